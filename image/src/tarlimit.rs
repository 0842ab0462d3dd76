//! A bound on the metadata entries of a tar stream, enforced as the stream passes.
//!
//! The `tar` crate reads some entries whole into memory before the entry they describe:
//! PAX extended headers (`x`) and GNU long names and long link targets (`L`, `K`). Their
//! size is whatever the archive's header says, so one header of a small (well
//! compressed) layer can make the reader allocate gigabytes. [`TarLimit`] sits between
//! the layer's bytes and the `tar` reader and follows the archive's 512-byte blocks as
//! they pass (a header, then its data rounded up to 512, GNU sparse extension blocks,
//! the size a PAX header gives the entry after it, as the `tar` crate reads them): a
//! metadata entry (`x`, `g`, `L`, `K`) larger than its limit fails the read that brings
//! its header, with [`Error::OverLimit`] inside the `io::Error`, before anything of it
//! is buffered. Nothing else of the stream is held: file data only passes through.
//!
//! It does not judge the archive otherwise (checksums, malformed sizes): where it cannot
//! follow the blocks it stops looking, and the `tar` reader reports the fault.

use std::io::{self, Read};

use crate::error::Error;

/// The largest metadata entry (PAX extended header, GNU long name or long link) a tar
/// stream may hold: 1 MiB. Real ones are a path or two and a few xattrs (Linux caps a
/// path at 4 KiB and an xattr value at 64 KiB).
pub const MAX_METADATA: u64 = 1 << 20;

/// Tar block size.
const BLOCK: usize = 512;

/// Where the stream is.
enum State {
    /// Collecting a header block (`filled` bytes of it so far).
    Header,
    /// Passing `n` bytes (an entry's data and padding).
    Skip(u64),
    /// Collecting a local PAX header's body (`left` bytes to come), then `pad` bytes.
    Pax { left: u64, pad: u64 },
    /// Collecting a GNU sparse extension block; `data` bytes follow the last one.
    SparseExt { data: u64 },
    /// Past the end of the archive, or where the blocks cannot be followed: bytes pass.
    Done,
}

/// A reader of a tar stream that refuses metadata entries over a limit (see the module
/// documentation).
pub struct TarLimit<R> {
    inner: R,
    limit: u64,
    state: State,
    block: [u8; BLOCK],
    filled: usize,
    /// The body of the local PAX header being read.
    pax: Vec<u8>,
    /// The size the last local PAX header gives the next entry.
    pax_size: Option<u64>,
    /// The refusal, repeated on every read after it.
    failed: Option<(String, u64)>,
}

impl<R: Read> TarLimit<R> {
    /// `inner`'s tar stream, its metadata entries bounded by [`MAX_METADATA`].
    pub fn new(inner: R) -> Self {
        Self::with_limit(inner, MAX_METADATA)
    }

    /// `inner`'s tar stream, its metadata entries bounded by `limit` bytes.
    pub fn with_limit(inner: R, limit: u64) -> Self {
        TarLimit {
            inner,
            limit,
            state: State::Header,
            block: [0; BLOCK],
            filled: 0,
            pax: Vec::new(),
            pax_size: None,
            failed: None,
        }
    }

    /// The reader it wraps.
    pub fn into_inner(self) -> R {
        self.inner
    }

    fn refusal(&self) -> Option<io::Error> {
        self.failed.as_ref().map(|(what, size)| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                Error::OverLimit {
                    what: what.clone(),
                    size: *size,
                    limit: self.limit,
                },
            )
        })
    }

    /// Follows `data`, the next bytes of the stream.
    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() && self.failed.is_none() {
            match &mut self.state {
                State::Done => return,
                State::Skip(n) => {
                    let k = (*n).min(data.len() as u64);
                    *n -= k;
                    data = &data[k as usize..];
                    if *n == 0 {
                        self.state = State::Header;
                    }
                }
                State::Pax { left, pad } => {
                    let k = (*left).min(data.len() as u64) as usize;
                    self.pax.extend_from_slice(&data[..k]);
                    *left -= k as u64;
                    data = &data[k..];
                    if *left == 0 {
                        let pad = *pad;
                        self.pax_size = pax_size(&self.pax);
                        self.pax = Vec::new();
                        self.state = if pad == 0 {
                            State::Header
                        } else {
                            State::Skip(pad)
                        };
                    }
                }
                State::Header | State::SparseExt { .. } => {
                    let k = (BLOCK - self.filled).min(data.len());
                    self.block[self.filled..self.filled + k].copy_from_slice(&data[..k]);
                    self.filled += k;
                    data = &data[k..];
                    if self.filled == BLOCK {
                        self.filled = 0;
                        self.block_done();
                    }
                }
            }
        }
    }

    /// A whole header or sparse extension block is in `self.block`.
    fn block_done(&mut self) {
        if let State::SparseExt { data } = self.state {
            // `isextended` of a GNU sparse extension block: another one follows.
            self.state = if self.block[504] != 0 {
                State::SparseExt { data }
            } else {
                skip(data)
            };
            return;
        }
        if self.block.iter().all(|&b| b == 0) {
            // The end of the archive (the `tar` reader stops at the first zero block).
            self.state = State::Done;
            return;
        }
        let h = tar::Header::from_byte_slice(&self.block);
        let kind = h.entry_type().as_byte();
        let Ok(size) = h.entry_size() else {
            self.state = State::Done;
            return;
        };
        let recognised = h.as_gnu().is_some() || h.as_ustar().is_some();
        let what = match kind {
            b'x' => Some("a PAX extended header"),
            b'g' => Some("a PAX global header"),
            b'L' => Some("a GNU long name"),
            b'K' => Some("a GNU long link name"),
            _ => None,
        };
        if let Some(what) = what {
            if size > self.limit {
                tracing::warn!(
                    what,
                    size,
                    limit = self.limit,
                    "tar metadata over its limit"
                );
                self.failed = Some((what.to_string(), size));
                return;
            }
        }
        // What the `tar` reader does with it: L, K and x (with a known magic) are
        // collected for the entry after them; anything else is an entry, which takes
        // the pending PAX size (metadata types keep their own size).
        let collected = recognised && matches!(kind, b'x' | b'L' | b'K');
        let size = if what.is_some() {
            if !collected {
                self.pax_size = None;
            }
            size
        } else {
            self.pax_size.take().unwrap_or(size)
        };
        let Some(padded) = size.checked_next_multiple_of(BLOCK as u64) else {
            self.state = State::Done;
            return;
        };
        self.state = if collected && kind == b'x' {
            State::Pax {
                left: size,
                pad: padded - size,
            }
        } else if kind == b'S' && h.as_gnu().is_some_and(|g| g.is_extended()) {
            State::SparseExt { data: padded }
        } else {
            skip(padded)
        };
        if let State::Pax { left: 0, .. } = self.state {
            self.pax_size = None;
            self.state = State::Header;
        }
    }
}

fn skip(n: u64) -> State {
    if n == 0 {
        State::Header
    } else {
        State::Skip(n)
    }
}

/// The `size` record of a PAX header's body, read as the `tar` crate reads it.
fn pax_size(body: &[u8]) -> Option<u64> {
    for ext in tar::PaxExtensions::new(body) {
        let ext = ext.ok()?;
        if ext.key() != Ok("size") {
            continue;
        }
        return ext.value().ok()?.parse().ok();
    }
    None
}

impl<R: Read> Read for TarLimit<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(e) = self.refusal() {
            return Err(e);
        }
        let n = self.inner.read(buf)?;
        self.feed(&buf[..n]);
        match self.refusal() {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header of `kind` and `size` (GNU magic when `gnu`, else ustar).
    fn header(path: &str, kind: u8, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_entry_type(tar::EntryType::new(kind));
        h.set_size(size);
        h.set_mode(0o644);
        h.set_cksum();
        h
    }

    /// Every entry of `data` through a [`TarLimit`] of `limit`: (path, bytes) each, or the
    /// error.
    fn read_all(data: &[u8], limit: u64) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        entries_of(tar::Archive::new(TarLimit::with_limit(data, limit)))
    }

    /// The same without the wrapper.
    fn read_plain(data: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        entries_of(tar::Archive::new(data))
    }

    fn entries_of<R: Read>(mut a: tar::Archive<R>) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut out = Vec::new();
        for e in a.entries()? {
            let mut e = e?;
            let mut body = Vec::new();
            // Capped: a mutated sparse entry can claim terabytes of zeros.
            (&mut e).take(4 << 20).read_to_end(&mut body)?;
            out.push((e.path_bytes().into_owned(), body));
        }
        Ok(out)
    }

    fn over_limit(e: &io::Error) -> Option<(&str, u64)> {
        match e.get_ref()?.downcast_ref::<Error>()? {
            Error::OverLimit { what, size, .. } => Some((what.as_str(), *size)),
            _ => None,
        }
    }

    /// A small archive with a long name, a long link, a PAX header (with xattrs and a
    /// `size` record) and plain files.
    fn archive_of_every_kind(seed: u64) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let long = format!("dir/{}", "n".repeat(300 + (seed % 50) as usize));
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o644);
        b.append_data(&mut h, &long, &b"abc"[..]).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "link", "t".repeat(200 + (seed % 7) as usize))
            .unwrap();
        let body = vec![7u8; (seed % 2000) as usize];
        b.append_pax_extensions([
            ("SCHILY.xattr.user.a", &b"value"[..]),
            ("path", &b"pax/named"[..]),
        ])
        .unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_size(body.len() as u64);
        h.set_mode(0o600);
        b.append_data(&mut h, "plain", &body[..]).unwrap();
        // A PAX size record overriding the header's (the header says 0).
        let real = vec![9u8; 1000 + (seed % 100) as usize];
        let size = real.len().to_string();
        b.append_pax_extensions([("size", size.as_bytes())])
            .unwrap();
        let mut h = header("sized", b'0', 0);
        h.set_cksum();
        b.append(&h, &real[..]).unwrap();
        b.into_inner().unwrap()
    }

    #[test]
    fn well_formed_archives_read_the_same_through_it() {
        for seed in 0..20 {
            let a = archive_of_every_kind(seed);
            let plain = read_plain(&a).unwrap();
            assert_eq!(read_all(&a, MAX_METADATA).unwrap(), plain);
            assert_eq!(plain.len(), 4);
        }
    }

    #[test]
    fn a_huge_pax_header_is_refused_before_it_is_read() {
        // The header claims 1.5 GiB; only its first block exists: the refusal comes
        // with the header, nothing of the body is needed.
        let mut a = header("././@PaxHeader", b'x', 3 << 29).as_bytes().to_vec();
        a.extend_from_slice(&[b'1'; 512]);
        let e = read_all(&a, MAX_METADATA).unwrap_err();
        assert_eq!(
            over_limit(&e),
            Some(("a PAX extended header", 3 << 29)),
            "{e}"
        );
        assert!(e.to_string().contains("more than the 1048576"), "{e}");
    }

    #[test]
    fn long_names_links_and_global_headers_are_bounded() {
        for (kind, what) in [
            (b'L', "a GNU long name"),
            (b'K', "a GNU long link name"),
            (b'g', "a PAX global header"),
        ] {
            let mut a = header("././@LongLink", kind, 2 << 20).as_bytes().to_vec();
            a.extend_from_slice(&vec![b'a'; 2 << 20]);
            let e = read_all(&a, MAX_METADATA).unwrap_err();
            assert_eq!(over_limit(&e), Some((what, 2 << 20)), "{e}");
        }
        // At the limit: read.
        let mut b = tar::Builder::new(Vec::new());
        let name = "x".repeat(1000);
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        b.append_data(&mut h, &name, &b"z"[..]).unwrap();
        let a = b.into_inner().unwrap();
        assert_eq!(read_all(&a, 1001).unwrap()[0].0, name.as_bytes());
        assert!(read_all(&a, 1000).is_err());
    }

    #[test]
    fn file_data_of_any_size_passes() {
        // A 3 MiB file (over the metadata limit) is data, not metadata.
        let mut b = tar::Builder::new(Vec::new());
        let data = vec![5u8; 3 << 20];
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        b.append_data(&mut h, "big", &data[..]).unwrap();
        let a = b.into_inner().unwrap();
        assert_eq!(read_all(&a, MAX_METADATA).unwrap()[0].1.len(), 3 << 20);
    }

    #[test]
    fn a_pax_size_record_is_followed() {
        // The PAX header says the next entry's data is 600 bytes (the header says 0):
        // the huge PAX header after that data is found where the tar reader finds it.
        let mut b = tar::Builder::new(Vec::new());
        b.append_pax_extensions([("size", &b"600"[..])]).unwrap();
        b.append(&header("f", b'0', 0), &vec![1u8; 600][..])
            .unwrap();
        let mut a = b.into_inner().unwrap();
        // Drop the end-of-archive blocks, add the hostile header.
        a.truncate(a.len() - 1024);
        a.extend_from_slice(header("h", b'x', 1 << 30).as_bytes());
        let e = read_all(&a, MAX_METADATA).unwrap_err();
        assert!(over_limit(&e).is_some(), "{e}");
    }

    #[test]
    fn gnu_sparse_extension_blocks_are_followed() {
        // A sparse entry with one extension block, then a hostile long name: found.
        let mut h = tar::Header::new_gnu();
        h.set_path("sparse").unwrap();
        h.set_entry_type(tar::EntryType::GNUSparse);
        h.set_size(512);
        {
            let g = h.as_gnu_mut().unwrap();
            g.isextended[0] = 1;
            g.sparse[0].offset = *b"00000000000\0";
            g.sparse[0].numbytes = *b"00000001000\0";
            g.realsize = *b"00000002000\0";
        }
        h.set_cksum();
        let mut a = h.as_bytes().to_vec();
        let mut ext = tar::GnuExtSparseHeader::new();
        ext.sparse[0].offset = *b"00000001000\0";
        ext.sparse[0].numbytes = *b"00000000000\0";
        a.extend_from_slice(ext.as_bytes());
        a.extend_from_slice(&[3u8; 512]);
        a.extend_from_slice(header("././@LongLink", b'L', 1 << 30).as_bytes());
        let mut r = TarLimit::new(&a[..]);
        let e = std::io::copy(&mut r, &mut std::io::sink()).unwrap_err();
        assert_eq!(over_limit(&e), Some(("a GNU long name", 1 << 30)), "{e}");
    }

    /// xorshift64*: a seeded generator (the same streams on every run).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    /// Random and mutated tar streams, read through the wrapper in reads of random
    /// sizes: no panic, no allocation beyond the limit, and a stream the plain reader
    /// reads without an over-limit entry reads the same through it.
    #[test]
    fn random_and_mutated_streams_never_panic() {
        let mut rng = Rng(0x5eed_1234_abcd_0001);
        let started = std::time::Instant::now();
        for round in 0..3000u64 {
            let mut a = archive_of_every_kind(rng.next());
            match round % 3 {
                // Flip bytes, in headers as much as in data.
                0 => {
                    for _ in 0..1 + rng.below(8) {
                        let i = rng.below(a.len() as u64) as usize;
                        a[i] = rng.next() as u8;
                    }
                }
                // A size field rewritten (octal, or GNU base-256).
                1 => {
                    let block = rng.below((a.len() / BLOCK) as u64) as usize * BLOCK;
                    let size = &mut a[block + 124..block + 136];
                    if rng.below(2) == 0 {
                        let s = format!("{:011o}\0", rng.next() >> rng.below(64));
                        size.copy_from_slice(&s.as_bytes()[s.len() - 12..]);
                    } else {
                        size[0] = 0x80;
                        for b in &mut size[1..] {
                            *b = rng.next() as u8;
                        }
                    }
                    let h = tar::Header::from_byte_slice(&a[block..block + BLOCK]).clone();
                    let mut h = h;
                    h.set_cksum();
                    a[block..block + BLOCK].copy_from_slice(h.as_bytes());
                }
                // Noise, with a header or two of random kinds in it.
                _ => {
                    a = (0..rng.below(8192)).map(|_| rng.next() as u8).collect();
                    let kinds = b"xgLKS05";
                    let k = kinds[rng.below(kinds.len() as u64) as usize];
                    let h = header("n", k, rng.next() >> rng.below(64));
                    let at = (rng.below((a.len() / BLOCK + 1) as u64) as usize) * BLOCK;
                    let at = at.min(a.len());
                    a.splice(at..at, h.as_bytes().iter().copied());
                }
            }
            // Reads of random sizes.
            let mut r = TarLimit::with_limit(&a[..], 4096);
            let mut seen = 0;
            let mut buf = vec![0u8; 1 + rng.below(2000) as usize];
            loop {
                match r.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => seen += n,
                }
            }
            assert!(seen <= a.len());
            // Through the tar reader: without a limit, exactly what it reads alone (the
            // wrapper follows, never changes, the stream); with one, no panic.
            let plain = read_plain(&a).map_err(|e| e.to_string());
            let unlimited = read_all(&a, u64::MAX).map_err(|e| e.to_string());
            assert_eq!(unlimited, plain, "round {round}");
            if let Err(e) = read_all(&a, 4096) {
                if plain.is_ok() {
                    assert!(over_limit(&e).is_some(), "round {round}: {e}");
                }
            }
        }
        assert!(started.elapsed().as_secs() < 60);
    }
}

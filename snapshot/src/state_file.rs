//! The snapshot state file: a fixed 128-byte header followed by a postcard-serialised
//! payload `T` (the VMM's vCPU, VM and device state).
//!
//! Header (all integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `CLADESNP` |
//! | 8 | 4 | format version (2; 1 is read too) |
//! | 12 | 4 | header length (128) |
//! | 16 | 4 | kind: 1 full, 2 diff |
//! | 20 | 4 | flags (0; reserved) |
//! | 24 | 16 | snapshot id |
//! | 40 | 16 | base id (zero for a full snapshot) |
//! | 56 | 12 | CPU vendor string |
//! | 68 | 2 | CPU family |
//! | 70 | 1 | CPU model |
//! | 71 | 1 | CPU stepping |
//! | 72 | 8 | guest memory size in bytes |
//! | 80 | 8 | payload length |
//! | 88 | 4 | CRC-32 (IEEE) of the payload |
//! | 92 | 32 | reserved, zero |
//! | 124 | 4 | CRC-32 of bytes 0..124 |
//!
//! [`write()`] writes a temporary file, fsyncs it and renames it over the target, so a
//! reader sees either the old file or the complete new one.
//!
//! Versions 1 and 2 have the same header; the version also tells the payload's layout,
//! which is the caller's: version 2 is the first with a payload layout differing from
//! version 1's. [`read_with`] hands the version to the caller's decoder, so that files
//! written with an older layout still load.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::bytes::{id_at, le_u16, le_u32, le_u64};
use crate::fsutil::AtomicFile;
use crate::{CpuCheck, CpuId, Error, FileType, Result, SnapshotId, SnapshotKind, PAGE_SIZE_U64};

/// Magic bytes at offset 0.
pub const MAGIC: [u8; 8] = *b"CLADESNP";
/// The format version this build writes.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest format version this build reads.
pub const OLDEST_READABLE_VERSION: u32 = 1;
/// Length of the fixed header.
pub const HEADER_LEN: usize = 128;
/// Default cap on the payload length ([`Expect::max_payload`]).
pub const DEFAULT_MAX_PAYLOAD: u64 = 64 << 20;

const FILE: FileType = FileType::State;

/// What a new snapshot is: written into the header by [`write()`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotMeta {
    /// This snapshot's id (also written into its memory file).
    pub id: SnapshotId,
    /// Full or diff.
    pub kind: SnapshotKind,
    /// The base a diff snapshot was taken on top of; `None` for a full snapshot.
    pub base: Option<SnapshotId>,
    /// Guest memory size in bytes (must match the memory file).
    pub mem_size: u64,
    /// CPU the snapshot is taken on; [`CpuId::host`] by default.
    pub cpu: CpuId,
}

impl SnapshotMeta {
    /// A full snapshot taken on this host.
    pub fn full(id: SnapshotId, mem_size: u64) -> SnapshotMeta {
        SnapshotMeta {
            id,
            kind: SnapshotKind::Full,
            base: None,
            mem_size,
            cpu: CpuId::host(),
        }
    }

    /// A diff snapshot on top of `base`, taken on this host.
    pub fn diff(id: SnapshotId, base: SnapshotId, mem_size: u64) -> SnapshotMeta {
        SnapshotMeta {
            id,
            kind: SnapshotKind::Diff,
            base: Some(base),
            mem_size,
            cpu: CpuId::host(),
        }
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.id.is_none() {
            return Err("snapshot id is zero".into());
        }
        match (self.kind, self.base) {
            (SnapshotKind::Full, None) => {}
            (SnapshotKind::Full, Some(_)) => return Err("full snapshot with a base id".into()),
            (SnapshotKind::Diff, None) => return Err("diff snapshot without a base id".into()),
            (SnapshotKind::Diff, Some(b)) if b.is_none() => {
                return Err("diff snapshot with a zero base id".into())
            }
            (SnapshotKind::Diff, Some(b)) if b == self.id => {
                return Err("diff snapshot is its own base".into())
            }
            (SnapshotKind::Diff, Some(_)) => {}
        }
        if !self.mem_size.is_multiple_of(PAGE_SIZE_U64) {
            return Err(format!(
                "memory size {:#x} is not a multiple of the page size",
                self.mem_size
            ));
        }
        Ok(())
    }
}

/// A parsed, checksum-verified header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Format version.
    pub version: u32,
    /// Identity, kind, base, CPU and memory size.
    pub meta: SnapshotMeta,
    /// Payload length in bytes.
    pub payload_len: u64,
    /// CRC-32 of the payload.
    pub payload_crc: u32,
}

/// What [`read`] and [`decode_from_bytes`] require of a state file.
#[derive(Debug, Clone, Copy)]
pub struct Expect {
    /// Required kind, if any.
    pub kind: Option<SnapshotKind>,
    /// How the snapshot's CPU must match `host_cpu`.
    pub cpu_check: CpuCheck,
    /// The CPU to compare against ([`CpuId::host`] by default).
    pub host_cpu: CpuId,
    /// Largest payload accepted, in bytes.
    pub max_payload: u64,
}

impl Default for Expect {
    fn default() -> Self {
        Expect {
            kind: None,
            cpu_check: CpuCheck::default(),
            host_cpu: CpuId::host(),
            max_payload: DEFAULT_MAX_PAYLOAD,
        }
    }
}

fn encode_header(meta: &SnapshotMeta, payload: &[u8]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    h[16..20].copy_from_slice(&meta.kind.to_raw().to_le_bytes());
    // 20..24 flags: 0
    h[24..40].copy_from_slice(&meta.id.0);
    h[40..56].copy_from_slice(&meta.base.unwrap_or(SnapshotId::NONE).0);
    h[56..68].copy_from_slice(&meta.cpu.vendor);
    h[68..70].copy_from_slice(&meta.cpu.family.to_le_bytes());
    h[70] = meta.cpu.model;
    h[71] = meta.cpu.stepping;
    h[72..80].copy_from_slice(&meta.mem_size.to_le_bytes());
    h[80..88].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[88..92].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
    // 92..124 reserved: 0
    let crc = crc32fast::hash(&h[..124]);
    h[124..128].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Parse and verify a header from the first bytes of a file (`bytes` may be the whole
/// file or just its start; a short slice gives [`Error::Truncated`]).
pub fn parse_header(bytes: &[u8]) -> Result<Header> {
    let truncated = || Error::Truncated {
        file: FILE,
        needed: HEADER_LEN as u64,
        found: bytes.len() as u64,
    };
    let n = bytes.len().min(MAGIC.len());
    if bytes[..n] != MAGIC[..n] {
        return Err(Error::NotASnapshot { file: FILE });
    }
    if bytes.len() < 12 {
        return Err(truncated());
    }
    let version = le_u32(bytes, 8);
    if !(OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(Error::UnsupportedVersion {
            file: FILE,
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if bytes.len() < HEADER_LEN {
        return Err(truncated());
    }
    let h = &bytes[..HEADER_LEN];
    let stored = le_u32(h, 124);
    let computed = crc32fast::hash(&h[..124]);
    if stored != computed {
        return Err(Error::ChecksumMismatch {
            file: FILE,
            section: "header",
            stored,
            computed,
        });
    }
    let header_len = le_u32(h, 12);
    if header_len as usize != HEADER_LEN {
        return Err(Error::corrupt(
            FILE,
            format!("header length {header_len}, expected {HEADER_LEN}"),
        ));
    }
    let raw_kind = le_u32(h, 16);
    let kind = SnapshotKind::from_raw(raw_kind)
        .ok_or_else(|| Error::corrupt(FILE, format!("unknown snapshot kind {raw_kind}")))?;
    let flags = le_u32(h, 20);
    if flags != 0 {
        return Err(Error::corrupt(FILE, format!("unknown flags {flags:#x}")));
    }
    if h[92..124].iter().any(|&b| b != 0) {
        return Err(Error::corrupt(FILE, "reserved header bytes are not zero"));
    }
    let base = id_at(h, 40);
    let mut vendor = [0u8; 12];
    vendor.copy_from_slice(&h[56..68]);
    let meta = SnapshotMeta {
        id: id_at(h, 24),
        kind,
        base: (!base.is_none()).then_some(base),
        mem_size: le_u64(h, 72),
        cpu: CpuId {
            vendor,
            family: le_u16(h, 68),
            model: h[70],
            stepping: h[71],
        },
    };
    meta.validate().map_err(|r| Error::corrupt(FILE, r))?;
    Ok(Header {
        version,
        meta,
        payload_len: le_u64(h, 80),
        payload_crc: le_u32(h, 88),
    })
}

fn check_payload_len(header: &Header, file_len: u64, expect: &Expect) -> Result<()> {
    if header.payload_len > expect.max_payload {
        return Err(Error::TooLarge {
            file: FILE,
            what: "payload length",
            found: header.payload_len,
            limit: expect.max_payload,
        });
    }
    let needed = (HEADER_LEN as u64).saturating_add(header.payload_len);
    if file_len < needed {
        return Err(Error::Truncated {
            file: FILE,
            needed,
            found: file_len,
        });
    }
    if file_len > needed {
        return Err(Error::corrupt(
            FILE,
            format!("{} bytes after the payload", file_len - needed),
        ));
    }
    Ok(())
}

fn check_and_decode<T: DeserializeOwned>(
    header: Header,
    payload: &[u8],
    expect: &Expect,
) -> Result<(Header, T)> {
    check_payload(&header, payload, expect)?;
    Ok((header, decode_payload(payload)?))
}

/// Checks the payload's checksum and the header against `expect`.
fn check_payload(header: &Header, payload: &[u8], expect: &Expect) -> Result<()> {
    let computed = crc32fast::hash(payload);
    if computed != header.payload_crc {
        return Err(Error::ChecksumMismatch {
            file: FILE,
            section: "payload",
            stored: header.payload_crc,
            computed,
        });
    }
    if let Some(kind) = expect.kind {
        if kind != header.meta.kind {
            return Err(Error::WrongKind {
                expected: kind,
                found: header.meta.kind,
            });
        }
    }
    if !expect.cpu_check.accepts(&header.meta.cpu, &expect.host_cpu) {
        return Err(Error::WrongHostCpu {
            snapshot: header.meta.cpu,
            host: expect.host_cpu,
        });
    }
    Ok(())
}

/// Decodes a whole payload as `T` (bytes left over are an error). For decoders given to
/// [`read_with`].
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T> {
    let (value, rest) = postcard::take_from_bytes::<T>(payload).map_err(Error::Decode)?;
    if !rest.is_empty() {
        return Err(Error::corrupt(
            FILE,
            format!("{} undecoded bytes at the end of the payload", rest.len()),
        ));
    }
    Ok(value)
}

/// Serialise a complete state file (header + payload) into memory.
pub fn encode<T: Serialize>(meta: &SnapshotMeta, value: &T) -> Result<Vec<u8>> {
    meta.validate().map_err(Error::InvalidInput)?;
    let payload = postcard::to_allocvec(value).map_err(Error::Encode)?;
    let header = encode_header(meta, &payload);
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Write a state file to `path` crash-safely (temporary file, fsync, rename, directory
/// fsync). An existing file at `path` is replaced only once the new one is complete.
pub fn write<T: Serialize>(path: &Path, meta: &SnapshotMeta, value: &T) -> Result<Header> {
    let bytes = encode(meta, value)?;
    let header = parse_header(&bytes)?;
    let out = AtomicFile::create(path)?;
    out.file()
        .write_all_at(&bytes, 0)
        .map_err(|e| Error::io("write", out.tmp_path(), e))?;
    out.commit()?;
    tracing::debug!(
        path = %path.display(),
        id = %meta.id,
        kind = %meta.kind,
        payload = header.payload_len,
        "wrote snapshot state file"
    );
    Ok(header)
}

/// Decode a complete state file held in memory. Every malformed input gives an error;
/// nothing is allocated from a length that has not been checked against `bytes`.
pub fn decode_from_bytes<T: DeserializeOwned>(
    bytes: &[u8],
    expect: &Expect,
) -> Result<(Header, T)> {
    let header = parse_header(bytes)?;
    check_payload_len(&header, bytes.len() as u64, expect)?;
    check_and_decode(header, &bytes[HEADER_LEN..], expect)
}

fn open(path: &Path) -> Result<(File, u64, Vec<u8>)> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    let mut head = Vec::with_capacity(HEADER_LEN);
    (&file)
        .take(HEADER_LEN as u64)
        .read_to_end(&mut head)
        .map_err(|e| Error::io("read header", path, e))?;
    Ok((file, len, head))
}

/// Read and verify only the header of the state file at `path` (for tooling and for
/// finding a diff's base; the payload is not checked).
pub fn read_header(path: &Path) -> Result<Header> {
    let (_, _, head) = open(path)?;
    parse_header(&head)
}

/// Read, verify and decode the state file at `path` (whatever its version: for payloads
/// whose layout never changed).
pub fn read<T: DeserializeOwned>(path: &Path, expect: &Expect) -> Result<(Header, T)> {
    read_with(path, expect, |_, payload| decode_payload(payload))
}

/// Read and verify the state file at `path`, then decode its payload with `decode`, which
/// gets the file's format version and the verified payload bytes (see
/// [`decode_payload`]).
pub fn read_with<T>(
    path: &Path,
    expect: &Expect,
    decode: impl FnOnce(u32, &[u8]) -> Result<T>,
) -> Result<(Header, T)> {
    let (file, len, head) = open(path)?;
    let header = parse_header(&head)?;
    check_payload_len(&header, len, expect)?;
    // Bounded: payload_len <= expect.max_payload and equals the file's remaining length.
    let mut payload = vec![0u8; header.payload_len as usize];
    file.read_exact_at(&mut payload, HEADER_LEN as u64)
        .map_err(|e| Error::io("read payload", path, e))?;
    check_payload(&header, &payload, expect)?;
    let value = decode(header.version, &payload)?;
    tracing::debug!(path = %path.display(), id = %header.meta.id, "read snapshot state file");
    Ok((header, value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use vmm_sys_util::tempdir::TempDir;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct State {
        regs: Vec<u64>,
        name: String,
        lapic: [u8; 32],
    }

    fn state() -> State {
        State {
            regs: (0..18).map(|i| i * 0x1111).collect(),
            name: "vcpu0".into(),
            lapic: [7; 32],
        }
    }

    fn any_cpu() -> Expect {
        Expect {
            cpu_check: CpuCheck::Ignore,
            ..Expect::default()
        }
    }

    #[test]
    fn roundtrip_in_memory_and_on_disk() {
        let id = SnapshotId::random();
        let meta = SnapshotMeta::full(id, 256 << 20);
        let bytes = encode(&meta, &state()).unwrap();
        let (h, s): (Header, State) = decode_from_bytes(&bytes, &Expect::default()).unwrap();
        assert_eq!(s, state());
        assert_eq!(h.meta, meta);
        assert_eq!(h.payload_len as usize, bytes.len() - HEADER_LEN);

        let dir = TempDir::new_with_prefix("/tmp/clade-snap-state").unwrap();
        let path = dir.as_path().join("vm.snap");
        let wh = write(&path, &meta, &state()).unwrap();
        assert_eq!(wh, h);
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let (rh, rs) = read::<State>(&path, &Expect::default()).unwrap();
        assert_eq!((rh, rs), (h, state()));
        assert_eq!(read_header(&path).unwrap(), h);
    }

    #[test]
    fn diff_meta_roundtrip_and_validation() {
        let base = SnapshotId::random();
        let id = SnapshotId::random();
        let meta = SnapshotMeta::diff(id, base, 1 << 20);
        let bytes = encode(&meta, &1u32).unwrap();
        let (h, v): (Header, u32) = decode_from_bytes(&bytes, &any_cpu()).unwrap();
        assert_eq!((h.meta.base, v), (Some(base), 1));

        let bad = SnapshotMeta::diff(id, id, 1 << 20);
        assert!(matches!(encode(&bad, &1u32), Err(Error::InvalidInput(_))));
        let bad = SnapshotMeta { base: None, ..meta };
        assert!(matches!(encode(&bad, &1u32), Err(Error::InvalidInput(_))));
        let bad = SnapshotMeta::full(id, 4097);
        assert!(matches!(encode(&bad, &1u32), Err(Error::InvalidInput(_))));
        let bad = SnapshotMeta::full(SnapshotId::NONE, 4096);
        assert!(matches!(encode(&bad, &1u32), Err(Error::InvalidInput(_))));
    }

    #[test]
    fn wrong_kind_and_wrong_cpu() {
        let meta = SnapshotMeta::full(SnapshotId::random(), 0);
        let bytes = encode(&meta, &state()).unwrap();
        let e = decode_from_bytes::<State>(
            &bytes,
            &Expect {
                kind: Some(SnapshotKind::Diff),
                ..Expect::default()
            },
        )
        .unwrap_err();
        assert!(matches!(
            e,
            Error::WrongKind {
                expected: SnapshotKind::Diff,
                found: SnapshotKind::Full
            }
        ));

        let other = CpuId::from_signature(*b"GenuineIntel", 0x0005_0654);
        let foreign = SnapshotMeta { cpu: other, ..meta };
        let bytes = encode(&foreign, &state()).unwrap();
        match decode_from_bytes::<State>(&bytes, &Expect::default()) {
            Err(Error::WrongHostCpu { snapshot, host }) => {
                assert_eq!(snapshot, other);
                assert_eq!(host, CpuId::host());
            }
            other => panic!("expected WrongHostCpu, got {other:?}"),
        }
        assert!(decode_from_bytes::<State>(&bytes, &any_cpu()).is_ok());
    }

    #[test]
    fn older_versions_load_and_their_decoder_knows_the_version() {
        let dir = TempDir::new_with_prefix("/tmp/clade-snap-state").unwrap();
        let path = dir.as_path().join("state.snap");
        let meta = SnapshotMeta::full(SnapshotId::random(), 1 << 20);
        let h = write(&path, &meta, &state()).unwrap();
        assert_eq!(h.version, FORMAT_VERSION);
        let with_version = |v: u32| {
            let mut b = std::fs::read(&path).unwrap();
            b[8..12].copy_from_slice(&v.to_le_bytes());
            let crc = crc32fast::hash(&b[..124]);
            b[124..128].copy_from_slice(&crc.to_le_bytes());
            let p = dir.as_path().join(format!("v{v}.snap"));
            std::fs::write(&p, b).unwrap();
            p
        };
        let v1 = with_version(1);
        let (h, (seen, s)) = read_with(&v1, &Expect::default(), |v, payload| {
            Ok((v, decode_payload::<State>(payload)?))
        })
        .unwrap();
        assert_eq!((h.version, seen, s), (1, 1, state()));
        // The decoder's own error comes through.
        let e = read_with(&v1, &Expect::default(), |_, _| -> Result<()> {
            Err(Error::corrupt(FILE, "layout"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("layout"), "{e}");
        for v in [0, FORMAT_VERSION + 1] {
            assert!(matches!(
                read::<State>(&with_version(v), &Expect::default()),
                Err(Error::UnsupportedVersion { found, .. }) if found == v
            ));
        }
    }

    #[test]
    fn distinct_errors_for_bad_input() {
        let meta = SnapshotMeta::full(SnapshotId::random(), 0);
        let good = encode(&meta, &state()).unwrap();
        let ex = Expect::default();

        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(
            decode_from_bytes::<State>(&bad, &ex),
            Err(Error::NotASnapshot { .. })
        ));
        assert!(matches!(
            decode_from_bytes::<State>(b"\x7fELF\x02\x01\x01", &ex),
            Err(Error::NotASnapshot { .. })
        ));

        let mut bad = good.clone();
        bad[8..12].copy_from_slice(&7u32.to_le_bytes());
        assert!(matches!(
            decode_from_bytes::<State>(&bad, &ex),
            Err(Error::UnsupportedVersion {
                found: 7,
                supported: FORMAT_VERSION,
                ..
            })
        ));

        for cut in [0, 5, 11, 100, HEADER_LEN, good.len() - 1] {
            assert!(
                matches!(
                    decode_from_bytes::<State>(&good[..cut], &ex),
                    Err(Error::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }

        let mut bad = good.clone();
        bad[30] ^= 1; // inside the id: header checksum
        assert!(matches!(
            decode_from_bytes::<State>(&bad, &ex),
            Err(Error::ChecksumMismatch {
                section: "header",
                ..
            })
        ));
        let mut bad = good.clone();
        *bad.last_mut().unwrap() ^= 0x40;
        assert!(matches!(
            decode_from_bytes::<State>(&bad, &ex),
            Err(Error::ChecksumMismatch {
                section: "payload",
                ..
            })
        ));

        let mut bad = good.clone();
        bad.push(0);
        assert!(matches!(
            decode_from_bytes::<State>(&bad, &ex),
            Err(Error::Corrupt { .. })
        ));

        let small = Expect {
            max_payload: 8,
            ..ex
        };
        assert!(matches!(
            decode_from_bytes::<State>(&good, &small),
            Err(Error::TooLarge { .. })
        ));

        // Well-formed file whose payload is another type.
        let other = encode(&meta, &(1u8, 2u8)).unwrap();
        assert!(matches!(
            decode_from_bytes::<State>(&other, &ex),
            Err(Error::Decode(_))
        ));
    }

    #[test]
    fn huge_length_field_is_rejected_before_allocation() {
        let meta = SnapshotMeta::full(SnapshotId::random(), 0);
        let mut bytes = encode(&meta, &state()).unwrap();
        bytes[80..88].copy_from_slice(&u64::MAX.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..124]);
        bytes[124..128].copy_from_slice(&crc.to_le_bytes());
        let dir = TempDir::new_with_prefix("/tmp/clade-snap-state").unwrap();
        let path = dir.as_path().join("huge.snap");
        std::fs::write(&path, &bytes).unwrap();
        let no_cap = Expect {
            max_payload: u64::MAX,
            ..Expect::default()
        };
        // Even without a cap, the length is checked against the file before allocating.
        assert!(matches!(
            read::<State>(&path, &no_cap),
            Err(Error::Truncated { .. })
        ));
        assert!(matches!(
            read::<State>(&path, &Expect::default()),
            Err(Error::TooLarge { .. })
        ));
    }

    #[test]
    fn failed_write_leaves_existing_file_untouched() {
        let dir = TempDir::new_with_prefix("/tmp/clade-snap-state").unwrap();
        let path = dir.as_path().join("vm.snap");
        let meta = SnapshotMeta::full(SnapshotId::random(), 0);
        write(&path, &meta, &state()).unwrap();
        let before = std::fs::read(&path).unwrap();
        let bad = SnapshotMeta::full(SnapshotId::NONE, 0);
        assert!(write(&path, &bad, &state()).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), before);
        assert_eq!(std::fs::read_dir(dir.as_path()).unwrap().count(), 1);
        assert!(matches!(
            read::<State>(&dir.as_path().join("missing"), &Expect::default()),
            Err(Error::Io { .. })
        ));
    }
}

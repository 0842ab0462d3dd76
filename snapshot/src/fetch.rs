//! Memory files whose bytes arrive lazily.
//!
//! A snapshot opened from an object store is restored before it has been downloaded: its
//! memory file exists locally as a sparse file with the real header and tables, and its
//! image bytes are filled in chunk by chunk by a fetcher (a process that may reach the
//! store; the VM process never opens a network socket). A [`MemoryFile`] opened with
//! [`MemoryFile::open_fetched`] asks its [`ChunkFetch`] to make a byte range present
//! before it reads it, so every reader — the page server's faults and prefetch, the eager
//! `copy` backend — gets the real bytes or an error naming what could not be fetched,
//! never the zeros of a hole that was not filled yet.
//!
//! Which pages hold data cannot be learned from the sparse file (a page not fetched yet is
//! a hole too), so the caller passes the data bitmap, which the snapshot's manifest
//! records.
//!
//! [`MemoryFile`]: crate::memory_file::MemoryFile
//! [`MemoryFile::open_fetched`]: crate::memory_file::MemoryFile::open_fetched

use std::sync::Arc;

/// Makes byte ranges of one lazily filled local file present.
pub trait ChunkFetch: Send + Sync {
    /// Returns once bytes `offset..offset + len` of the file are present, or why they
    /// cannot be (the message names the object that failed). Must not hang: an
    /// implementation bounds its wait.
    fn ensure(&self, offset: u64, len: u64) -> std::result::Result<(), String>;

    /// A hint that these `(offset, len)` ranges are needed soon: start fetching them
    /// (in parallel) without waiting. Errors surface in a later [`ChunkFetch::ensure`].
    fn prefetch(&self, ranges: &[(u64, u64)]);
}

/// A shared [`ChunkFetch`], printable.
#[derive(Clone)]
pub struct Fetcher(pub Arc<dyn ChunkFetch>);

impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fetcher")
    }
}

/// Merges `(offset, len)` ranges sorted by offset where they touch or overlap.
pub fn coalesce(ranges: &mut Vec<(u64, u64)>) {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(o, l) in ranges.iter() {
        match out.last_mut() {
            Some((po, pl)) if *po + *pl >= o => {
                let end = (*po + *pl).max(o + l);
                *pl = end - *po;
            }
            _ => out.push((o, l)),
        }
    }
    *ranges = out;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesce_merges_touching_ranges() {
        let mut r = vec![
            (8192, 4096),
            (0, 4096),
            (4096, 4096),
            (20000, 10),
            (20005, 10),
        ];
        coalesce(&mut r);
        assert_eq!(r, vec![(0, 12288), (20000, 15)]);
    }
}

//! The working-set file: the order in which a resumed guest first touched its pages,
//! recorded by the page server on the first resume and prefetched on later ones (REAP).
//!
//! Layout (little-endian): magic `CLADEWSF` (8), version u32 (1), entry count u32,
//! snapshot id (16), image page count u64, CRC-32 of the entries u32, CRC-32 of bytes
//! 0..44 u32, then `count` page indices as u32 (image page numbers, in fault order,
//! no duplicates).

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::bitmap::PageBitmap;
use crate::fsutil::AtomicFile;
use crate::{Error, FileType, Result, SnapshotId};

/// Magic bytes at offset 0.
pub const MAGIC: [u8; 8] = *b"CLADEWSF";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Header length.
pub const HEADER_LEN: usize = 48;

const FILE: FileType = FileType::WorkingSet;

/// Pages in first-touch order, for one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkingSet {
    /// The snapshot the pages belong to.
    pub id: SnapshotId,
    /// Pages in that snapshot's memory image.
    pub page_count: u64,
    /// Image page indices in first-touch order (each `< page_count`, no duplicates).
    pub pages: Vec<u64>,
}

impl WorkingSet {
    fn validate(&self) -> std::result::Result<(), String> {
        if self.page_count > u64::from(u32::MAX) + 1 {
            return Err(format!("{} pages do not fit u32 indices", self.page_count));
        }
        let mut seen = PageBitmap::new(self.page_count);
        for &p in &self.pages {
            if p >= self.page_count {
                return Err(format!(
                    "page {p} outside the {}-page image",
                    self.page_count
                ));
            }
            if seen.get(p) {
                return Err(format!("page {p} listed twice"));
            }
            seen.set(p);
        }
        Ok(())
    }

    /// Write to `path` crash-safely.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.validate().map_err(Error::InvalidInput)?;
        let mut entries = Vec::with_capacity(self.pages.len() * 4);
        for &p in &self.pages {
            entries.extend_from_slice(&(p as u32).to_le_bytes());
        }
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(self.pages.len() as u32).to_le_bytes());
        h[16..32].copy_from_slice(&self.id.0);
        h[32..40].copy_from_slice(&self.page_count.to_le_bytes());
        h[40..44].copy_from_slice(&crc32fast::hash(&entries).to_le_bytes());
        let crc = crc32fast::hash(&h[..44]);
        h[44..48].copy_from_slice(&crc.to_le_bytes());
        let out = AtomicFile::create(path)?;
        let tmp = out.tmp_path().to_path_buf();
        out.file()
            .write_all_at(&h, 0)
            .and_then(|_| out.file().write_all_at(&entries, HEADER_LEN as u64))
            .map_err(|e| Error::io("write", &tmp, e))?;
        out.commit()
    }

    /// Read and verify `path`, which must belong to snapshot `id` with `page_count` pages.
    pub fn load(path: &Path, id: SnapshotId, page_count: u64) -> Result<WorkingSet> {
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat", path, e))?
            .len();
        let mut h = Vec::with_capacity(HEADER_LEN);
        (&file)
            .take(HEADER_LEN as u64)
            .read_to_end(&mut h)
            .map_err(|e| Error::io("read header", path, e))?;
        let n = h.len().min(8);
        if h[..n] != MAGIC[..n] {
            return Err(Error::NotASnapshot { file: FILE });
        }
        if h.len() >= 12 {
            let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
            if version != FORMAT_VERSION {
                return Err(Error::UnsupportedVersion {
                    file: FILE,
                    found: version,
                    supported: FORMAT_VERSION,
                });
            }
        }
        if h.len() < HEADER_LEN {
            return Err(Error::Truncated {
                file: FILE,
                needed: HEADER_LEN as u64,
                found: h.len() as u64,
            });
        }
        let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let stored = u32_at(44);
        let computed = crc32fast::hash(&h[..44]);
        if stored != computed {
            return Err(Error::ChecksumMismatch {
                file: FILE,
                section: "header",
                stored,
                computed,
            });
        }
        let count = u64::from(u32_at(12));
        let mut idb = [0u8; 16];
        idb.copy_from_slice(&h[16..32]);
        let found_id = SnapshotId(idb);
        let mut pc = [0u8; 8];
        pc.copy_from_slice(&h[32..40]);
        let found_pages = u64::from_le_bytes(pc);
        if found_id != id {
            return Err(Error::IdMismatch {
                file: FILE,
                expected: id,
                found: found_id,
            });
        }
        if found_pages != page_count {
            return Err(Error::GeometryMismatch(format!(
                "working set is for a {found_pages}-page image, this one has {page_count}"
            )));
        }
        if count > page_count {
            return Err(Error::TooLarge {
                file: FILE,
                what: "entry count",
                found: count,
                limit: page_count,
            });
        }
        let needed = HEADER_LEN as u64 + 4 * count;
        if len < needed {
            return Err(Error::Truncated {
                file: FILE,
                needed,
                found: len,
            });
        }
        if len > needed {
            return Err(Error::corrupt(
                FILE,
                format!("{} trailing bytes", len - needed),
            ));
        }
        // Bounded: count <= page_count and the file really holds 4 * count bytes.
        let mut entries = vec![0u8; 4 * count as usize];
        file.read_exact_at(&mut entries, HEADER_LEN as u64)
            .map_err(|e| Error::io("read entries", path, e))?;
        let computed = crc32fast::hash(&entries);
        if computed != u32_at(40) {
            return Err(Error::ChecksumMismatch {
                file: FILE,
                section: "entries",
                stored: u32_at(40),
                computed,
            });
        }
        let ws = WorkingSet {
            id,
            page_count,
            pages: entries
                .chunks_exact(4)
                .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        };
        ws.validate().map_err(|r| Error::corrupt(FILE, r))?;
        Ok(ws)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::tempdir::TempDir;

    #[test]
    fn roundtrip_and_rejections() {
        let dir = TempDir::new_with_prefix("/tmp/clade-snap-ws").unwrap();
        let path = dir.as_path().join("ws");
        let id = SnapshotId::random();
        let ws = WorkingSet {
            id,
            page_count: 1000,
            pages: vec![5, 3, 999, 0, 4],
        };
        ws.save(&path).unwrap();
        assert_eq!(WorkingSet::load(&path, id, 1000).unwrap(), ws);
        assert!(matches!(
            WorkingSet::load(&path, SnapshotId::random(), 1000),
            Err(Error::IdMismatch { .. })
        ));
        assert!(matches!(
            WorkingSet::load(&path, id, 999),
            Err(Error::GeometryMismatch(_))
        ));

        let good = std::fs::read(&path).unwrap();
        for cut in [0, 7, 20, HEADER_LEN, good.len() - 1] {
            std::fs::write(&path, &good[..cut]).unwrap();
            assert!(
                matches!(
                    WorkingSet::load(&path, id, 1000),
                    Err(Error::Truncated { .. })
                ),
                "cut {cut}"
            );
        }
        let mut bad = good.clone();
        *bad.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert!(matches!(
            WorkingSet::load(&path, id, 1000),
            Err(Error::ChecksumMismatch { .. })
        ));
        std::fs::write(&path, b"garbage!garbage!").unwrap();
        assert!(matches!(
            WorkingSet::load(&path, id, 1000),
            Err(Error::NotASnapshot { .. })
        ));

        let dup = WorkingSet {
            pages: vec![1, 1],
            ..ws.clone()
        };
        assert!(matches!(dup.save(&path), Err(Error::InvalidInput(_))));
        let out = WorkingSet {
            pages: vec![1000],
            ..ws
        };
        assert!(matches!(out.save(&path), Err(Error::InvalidInput(_))));
    }
}

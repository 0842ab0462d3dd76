//! File helpers: crash-safe replacement of a file, and hole-aware extent listing.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use vmm_sys_util::seek_hole::SeekHole;

use crate::{Error, Result};

/// A file written under a temporary name next to its final path and renamed into place
/// only by [`AtomicFile::commit`] (after fsync), so a crash or an error never leaves a
/// half-written file under the final name, and never touches an existing one.
/// Dropped without commit, the temporary file is removed.
pub(crate) struct AtomicFile {
    file: File,
    tmp_path: PathBuf,
    final_path: PathBuf,
    committed: bool,
}

impl AtomicFile {
    pub(crate) fn create(path: &Path) -> Result<AtomicFile> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let name = path.file_name().ok_or_else(|| {
            Error::InvalidInput(format!("{} does not name a file", path.display()))
        })?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(
            ".tmp-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let tmp_path = path.with_file_name(tmp_name);
        let file = OpenOptions::new()
            .write(true)
            .read(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp_path)
            .map_err(|e| Error::io("create temporary file", &tmp_path, e))?;
        Ok(AtomicFile {
            file,
            tmp_path,
            final_path: path.to_path_buf(),
            committed: false,
        })
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    pub(crate) fn tmp_path(&self) -> &Path {
        &self.tmp_path
    }

    /// fsync the data, rename over the final path, fsync the directory.
    pub(crate) fn commit(mut self) -> Result<()> {
        self.file
            .sync_all()
            .map_err(|e| Error::io("fsync", &self.tmp_path, e))?;
        std::fs::rename(&self.tmp_path, &self.final_path)
            .map_err(|e| Error::io("rename into place", &self.final_path, e))?;
        self.committed = true;
        let dir = match self.final_path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        // The rename is done; a failing directory fsync only weakens durability.
        if let Err(e) = File::open(&dir).and_then(|d| d.sync_all()) {
            tracing::warn!(dir = %dir.display(), error = %e, "directory fsync failed");
        }
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}

/// The data (non-hole) byte ranges of `file` within `[start, end)`, sorted, as
/// `(offset, len)`. Filesystems without SEEK_DATA support report the whole range as data.
pub(crate) fn data_extents(file: &File, start: u64, end: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let mut f = file.try_clone()?;
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end {
        let data = match f.seek_data(pos) {
            Ok(Some(d)) => d,
            Ok(None) => break,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // No SEEK_DATA on this filesystem: treat everything as data.
                out.push((pos, end - pos));
                break;
            }
            Err(e) => return Err(e),
        };
        if data >= end {
            break;
        }
        let hole = f.seek_hole(data)?.unwrap_or(end).min(end);
        if hole <= data {
            // A filesystem must not do this; avoid looping forever if one does.
            out.push((data, end - data));
            break;
        }
        out.push((data, hole - data));
        pos = hole;
    }
    Ok(out)
}

/// Whether every byte of `buf` is zero (vectorisable: no early exit inside a chunk).
pub(crate) fn is_zero(buf: &[u8]) -> bool {
    let mut chunks = buf.chunks_exact(64);
    for chunk in &mut chunks {
        let mut acc = 0u64;
        for w in chunk.chunks_exact(8) {
            acc |= u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        }
        if acc != 0 {
            return false;
        }
    }
    chunks.remainder().iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    use vmm_sys_util::tempdir::TempDir;

    #[test]
    fn atomic_file_commit_and_abort() {
        let dir = TempDir::new_with_prefix("/tmp/clade-snap-fsutil").unwrap();
        let path = dir.as_path().join("out");
        std::fs::write(&path, b"old").unwrap();
        {
            let a = AtomicFile::create(&path).unwrap();
            a.file().write_all_at(b"new", 0).unwrap();
            // dropped without commit
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        let a = AtomicFile::create(&path).unwrap();
        let tmp = a.tmp_path().to_path_buf();
        a.file().write_all(b"new").unwrap();
        a.commit().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert!(!tmp.exists());
        assert_eq!(std::fs::read_dir(dir.as_path()).unwrap().count(), 1);
    }

    #[test]
    fn extents_skip_holes() {
        let dir = TempDir::new_with_prefix("/tmp/clade-snap-fsutil").unwrap();
        let path = dir.as_path().join("sparse");
        let f = File::create(&path).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 8 << 20).unwrap();
        f.write_all_at(&[2u8; 8192], 32 << 20).unwrap();
        let f = File::open(&path).unwrap();
        let ext = data_extents(&f, 0, 64 << 20).unwrap();
        let total: u64 = ext.iter().map(|e| e.1).sum();
        assert!(ext
            .iter()
            .any(|&(o, l)| o <= 8 << 20 && o + l >= (8 << 20) + 4096));
        assert!(ext
            .iter()
            .any(|&(o, l)| o <= 32 << 20 && o + l >= (32 << 20) + 8192));
        assert!(total < 8 << 20, "holes should be reported: {ext:?}");
    }

    #[test]
    fn zero_detection() {
        let mut page = vec![0u8; 4096];
        assert!(is_zero(&page));
        page[4095] = 1;
        assert!(!is_zero(&page));
        page[4095] = 0;
        page[3] = 1;
        assert!(!is_zero(&page));
        assert!(is_zero(&[0u8; 5]));
        assert!(!is_zero(&[0, 0, 0, 0, 9]));
    }
}

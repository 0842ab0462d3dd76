//! Writing a snapshot directory as one transaction ([`Staging`]).
//!
//! A snapshot is written into a staging directory next to its target
//! (`.<name>.staging-<pid>-<k>`), fsynced, and put in place by one atomic
//! `renameat2(RENAME_EXCHANGE)` with the old snapshot directory (or a plain rename when
//! there is none), so a kill at any instant leaves either the old snapshot or the new one at
//! the target, whole. Files in the old directory that are not the snapshot's own (the disk
//! overlays of VMs restored from it, anything an operator put there) are moved back into
//! the target, then the old snapshot files are removed. Staging directories of processes
//! that died are swept by the next snapshot into the same target (their foreign files moved
//! back first).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use super::{io_err, MEMORY_FILE, STATE_FILE, WORKING_SET_FILE};
use crate::error::{Error, Result};

/// A snapshot directory being written. Dropped without [`Staging::commit`], it is removed.
pub(crate) struct Staging {
    target: PathBuf,
    dir: PathBuf,
    done: bool,
}

/// The snapshot's own files; everything else in a snapshot directory is carried over.
fn is_own(name: &std::ffi::OsStr) -> bool {
    let n = name.to_string_lossy();
    n == STATE_FILE || n == MEMORY_FILE || n == WORKING_SET_FILE || n.starts_with('.')
}

fn staging_prefix(target: &Path) -> String {
    format!(
        ".{}.staging-",
        target.file_name().unwrap_or_default().to_string_lossy()
    )
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

impl Staging {
    /// Starts a snapshot that will become `target` (absolute; its parent exists). Refuses a
    /// target that exists and is not a directory.
    pub(crate) fn begin(target: &Path) -> Result<Staging> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        if let Ok(m) = std::fs::symlink_metadata(target) {
            if !m.is_dir() {
                return Err(Error::Snapshot(format!(
                    "{}: exists and is not a directory",
                    target.display()
                )));
            }
        }
        let parent = target.parent().unwrap_or(Path::new("/"));
        sweep(parent, target);
        let dir = parent.join(format!(
            "{}{}-{}",
            staging_prefix(target),
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).map_err(io_err("creating the snapshot's staging directory"))?;
        Ok(Staging {
            target: target.to_path_buf(),
            dir,
            done: false,
        })
    }

    /// Where the snapshot's files are written.
    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// Puts the snapshot in place (see the module documentation).
    pub(crate) fn commit(mut self) -> Result<()> {
        fsync_dir(&self.dir).map_err(io_err("syncing the snapshot directory"))?;
        let parent = self.target.parent().unwrap_or(Path::new("/")).to_path_buf();
        match exchange(&self.dir, &self.target) {
            Ok(()) => {
                crash_point("exchanged");
                // `self.dir` now holds the old snapshot.
                carry_over(&self.dir, &self.target);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                std::fs::rename(&self.dir, &self.target)
                    .map_err(io_err("putting the snapshot in place"))?;
            }
            Err(e) => {
                return Err(Error::Io {
                    context: "putting the snapshot in place (rename exchange)",
                    source: e,
                })
            }
        }
        self.done = true;
        if let Err(e) = fsync_dir(&parent) {
            tracing::warn!("syncing {}: {e}", parent.display());
        }
        // The old snapshot's files (its foreign files went back to the target).
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// `renameat2(from, to, RENAME_EXCHANGE)`: swaps the two paths atomically.
fn exchange(from: &Path, to: &Path) -> std::io::Result<()> {
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: both paths are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Moves the files of `old` that are not a snapshot's own into `target` (where it lacks
/// them).
fn carry_over(old: &Path, target: &Path) {
    let Ok(entries) = std::fs::read_dir(old) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if is_own(&name) {
            continue;
        }
        let to = target.join(&name);
        if std::fs::symlink_metadata(&to).is_ok() {
            tracing::warn!(
                "{} exists in the new snapshot: not carried over",
                to.display()
            );
            continue;
        }
        if let Err(err) = std::fs::rename(e.path(), &to) {
            tracing::warn!("carrying {} over: {err}", e.path().display());
        }
    }
}

/// Removes staging directories for `target` left by processes that died, carrying their
/// foreign files back first (a kill right after the exchange leaves them there).
fn sweep(parent: &Path, target: &Path) {
    let prefix = staging_prefix(target);
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<i32>().ok());
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let alive = pid.is_some_and(|p| unsafe { libc::kill(p, 0) } == 0);
        if alive {
            continue;
        }
        if target.is_dir() {
            carry_over(&e.path(), target);
        }
        tracing::info!(
            "removing {} (left by a snapshot that did not finish)",
            e.path().display()
        );
        let _ = std::fs::remove_dir_all(e.path());
    }
}

/// Test hook: `CLADE_SNAPSHOT_CRASH_AT=<point>` aborts the process there (a kill at the
/// worst moment, for the crash-safety tests).
pub(crate) fn crash_point(point: &str) {
    #[cfg(feature = "test-hooks")]
    if std::env::var("CLADE_SNAPSHOT_CRASH_AT").is_ok_and(|p| p == point) {
        tracing::error!("CLADE_SNAPSHOT_CRASH_AT={point}: aborting");
        std::process::abort();
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = point;
}

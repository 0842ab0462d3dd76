//! Private directories: where tenants' bytes live on the host (a service's state
//! directory, the store's chunk cache, a build's scratch tree).
//!
//! Guest memory, CPU state, disk layers and snapshots under such a directory are no
//! business of any other local user. Files inside may be readable by all (templates are
//! shared with every jailed VM process, whose user differs from the service's), so the
//! boundary is the top directory: `0700`, owned by the service's user. A jailed VM process
//! is not stopped by it: the jail bind-mounts each path it needs at the same absolute path
//! inside its own root, whose parents are the jail's, not the host's.
//!
//! [`private_dir`] creates such a directory that way, and tightens one that already exists
//! looser (a directory made by `mkdir -p`, or by an orchestrator's host-path volume, is
//! `0755`): an operator who made it must not leave every sandbox readable by accident.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

/// The mode of a private directory.
pub const PRIVATE_DIR_MODE: u32 = 0o700;

/// Makes `dir` a private directory (see the [module documentation](self)): created `0700`
/// (its missing parents with the usual mode), or, when it exists, given mode `0700` if any
/// group or other bit was set. Fails if `dir` is not a directory (a symbolic link to one
/// is followed: the operator's choice of where the state lives), or if it belongs to
/// another user while this process is not root (it could not be kept private from them).
pub fn private_dir(dir: &Path) -> io::Result<()> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::DirBuilder::new()
        .mode(PRIVATE_DIR_MODE)
        .create(dir)
    {
        Ok(()) => {
            // The umask may have taken bits away, never added any; set it exactly.
            return std::fs::set_permissions(
                dir,
                std::fs::Permissions::from_mode(PRIVATE_DIR_MODE),
            );
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let m = std::fs::metadata(dir)?;
    if !m.is_dir() {
        return Err(io::Error::other(format!(
            "{}: not a directory",
            dir.display()
        )));
    }
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me && me != 0 {
        return Err(io::Error::other(format!(
            "{}: owned by uid {}, not by this process's user (uid {me}): it cannot be kept private",
            dir.display(),
            m.uid()
        )));
    }
    if m.mode() & 0o077 != 0 {
        tracing::warn!(
            dir = %dir.display(),
            mode = format!("{:o}", m.mode() & 0o7777),
            "the directory was readable by other users: made 0700"
        );
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(PRIVATE_DIR_MODE))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn made_private_and_tightened_when_loose() {
        let top = std::env::temp_dir().join(format!("vmm-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&top);
        let d = top.join("a/state");
        private_dir(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        // As an orchestrator's host path or `mkdir -p` leaves it.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(d.join("f"), b"x").unwrap();
        private_dir(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        assert!(d.join("f").exists(), "contents kept");
        // Already private: left alone (sticky or not, no bit is added).
        private_dir(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        // Not a directory.
        let f = d.join("f");
        assert!(private_dir(&f).is_err());
        std::fs::remove_dir_all(&top).unwrap();
    }
}

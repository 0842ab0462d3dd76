//! Named network namespaces, made the way `ip netns add` makes them, and running code in one.
//!
//! A namespace is kept alive by a bind mount of a thread's `ns/net` file onto
//! `/run/netns/<name>` (so `ip netns exec` and the VMM's `--net netns=PATH` can enter it by
//! path). Entering one is per thread: every helper here runs on a thread of its own, which
//! ends afterwards, so no caller's thread is ever left in a sandbox's namespace.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};

use crate::range::NETNS_DIR;
use crate::{io_err, nix_err, Error, Result};

/// Makes `/run/netns` a shared mount point, as `ip netns add` does: bind mounts made on it
/// then propagate into mount namespaces made later (a jailed VMM still sees the sandbox's
/// namespace file).
fn ensure_netns_dir() -> Result<()> {
    // Once per process (two threads racing here would stack two bind mounts).
    static DONE: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let mut done = DONE.lock().unwrap_or_else(|p| p.into_inner());
    if *done {
        return Ok(());
    }
    make_netns_dir_shared()?;
    *done = true;
    Ok(())
}

fn make_netns_dir_shared() -> Result<()> {
    std::fs::create_dir_all(NETNS_DIR).map_err(io_err(format!("mkdir {NETNS_DIR}")))?;
    let shared = || {
        mount(
            None::<&str>,
            NETNS_DIR,
            Some("none"),
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    match shared() {
        Ok(()) => Ok(()),
        // Not a mount point yet: bind it onto itself, then make that shared.
        Err(nix::Error::EINVAL) => {
            mount(
                Some(NETNS_DIR),
                NETNS_DIR,
                Some("none"),
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(nix_err(format!("bind mount {NETNS_DIR}")))?;
            shared().map_err(nix_err(format!("make {NETNS_DIR} shared")))
        }
        Err(e) => Err(nix_err(format!("make {NETNS_DIR} shared"))(e)),
    }
}

/// Moves the CALLING thread into a new network namespace and pins it at `path`. The
/// caller must be a thread of this crate's that ends afterwards.
pub(crate) fn create_here(path: &Path) -> Result<()> {
    ensure_netns_dir()?;
    // The mount point: an empty file, which must not exist yet (O_EXCL).
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(path)
        .map_err(|e| match e.kind() {
            ErrorKind::AlreadyExists => Error::Exists(format!(
                "namespace {} already exists (sweep it, or pick another index)",
                path.display()
            )),
            _ => io_err(format!("create {}", path.display()))(e),
        })?;
    let pinned = unshare(CloneFlags::CLONE_NEWNET)
        .map_err(nix_err("unshare(CLONE_NEWNET)"))
        .and_then(|()| {
            mount(
                Some("/proc/thread-self/ns/net"),
                path,
                Some("none"),
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(nix_err(format!(
                "bind mount the namespace on {}",
                path.display()
            )))
        });
    if let Err(e) = pinned {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(())
}

/// Unpins a namespace: it goes away with its links (and a TAP in it) once no process is in
/// it. `Ok(false)` if there was none.
pub(crate) fn remove(path: &Path) -> Result<bool> {
    if !path.exists() {
        return Ok(false);
    }
    match umount2(path, MntFlags::MNT_DETACH) {
        // EINVAL: not a mount point (a file left by a crash between create and mount).
        Ok(()) | Err(nix::Error::EINVAL) => {}
        Err(e) => return Err(nix_err(format!("umount {}", path.display()))(e)),
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(format!("remove {}", path.display()))(e)),
    }
}

/// Creates an empty network namespace pinned at `path` (like `ip netns add`), e.g. a
/// process-based guest for [`crate::InnerLink::Veth`]. Remove it with [`remove_netns`].
pub fn add_netns(path: &Path) -> Result<()> {
    let path = path.to_path_buf();
    on_thread(move || create_here(&path))
}

/// Unpins a namespace made by [`add_netns`] (it goes once no process or socket is in it).
/// `Ok(false)` if there was none.
pub fn remove_netns(path: &Path) -> Result<bool> {
    remove(path)
}

/// Opens a namespace file (`/run/netns/<name>`, `/proc/<pid>/ns/net`).
pub(crate) fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(io_err(format!("open namespace {}", path.display())))
}

/// Moves the CALLING thread into the namespace `ns`.
pub(crate) fn enter(ns: &File) -> Result<()> {
    setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(nix_err("setns(CLONE_NEWNET)"))
}

/// Runs `f` on a new thread inside the namespace at `path`, and returns its result.
///
/// Sockets and file descriptors opened by `f` stay bound to that namespace after it
/// returns: this is how a listener or a TAP inside a sandbox's namespace is opened from a
/// process that stays outside it.
pub fn in_netns<T, F>(path: &Path, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let ns = open(path)?;
    on_thread(move || {
        enter(&ns)?;
        Ok(f())
    })
}

/// Runs `f` on a fresh thread, so whatever namespace it enters dies with it.
pub(crate) fn on_thread<T, F>(f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    std::thread::Builder::new()
        .name("hostnet".into())
        .spawn(f)
        .map_err(io_err("spawn a thread"))?
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
}

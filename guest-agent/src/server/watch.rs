//! Directory watches (`Watch` / `Unwatch`, events as `WatchEvent`): what the E2B data
//! plane's `WatchDir` and polling watchers are built on.
//!
//! One inotify instance per watch, read by a thread of its own that turns kernel events
//! into `WatchEvent` frames (names relative to the watched directory). A recursive watch
//! adds an inotify watch for every subdirectory, at the start and as new ones appear
//! (created or moved in; the contents of a new directory that were created before its
//! watch was in place are reported as `Create` too, so `mkdir -p a/b && touch a/b/f`
//! is not missed), and drops the watches of subdirectories that are moved out.
//!
//! libc directly rather than the `inotify` crate: the agent depends on libc alone (it is
//! the guest's static /init and stays small), and inotify is three system calls and one
//! packed record format, parsed here with bounds checks.
//!
//! Bounds: at most [`MAX_WATCHES_PER_CONN`] watches per connection and
//! [`MAX_DIRS_PER_WATCH`] directories per watch (beyond that a subdirectory is reported as
//! an `Overflow` event and not watched); events wait in the kernel's inotify queue, which
//! is bounded (`fs.inotify.max_queued_events`) and reports an overflow that becomes an
//! `Overflow` event. The thread holds one fixed read buffer and the directory table; a
//! host that reads slowly slows the thread (its frames block), nothing accumulates here.
//! A watch ends on `Unwatch` or when its connection closes (its stop pipe is closed either
//! way), or when the watched directory itself goes away (final `Error(NotFound)`).

use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::conn::Conn;
use crate::proto::{AgentMsg, ErrorKind, RemoteError, WatchKind};

/// Watches one connection may have running.
pub(crate) const MAX_WATCHES_PER_CONN: usize = 64;
/// Directories (inotify watches) one recursive watch may hold.
pub(crate) const MAX_DIRS_PER_WATCH: usize = 8192;
/// Bytes read from the inotify descriptor at once (room for hundreds of events).
const READ_BUF: usize = 64 * 1024;
/// Size of `struct inotify_event` without its name.
const EVENT_HEADER: usize = 16;

/// What every directory is watched for.
const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_ATTRIB
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF
    | libc::IN_ONLYDIR
    | libc::IN_EXCL_UNLINK;

/// The watches of one connection, owned by its reading thread. Dropping it (the
/// connection closed) stops them all.
#[derive(Default)]
pub(crate) struct Watches {
    map: HashMap<u32, Entry>,
}

struct Entry {
    /// Write end of the watch thread's stop pipe: dropping it stops the thread.
    _stop: OwnedFd,
    /// Set by the thread when the watch ended on its own.
    done: Arc<AtomicBool>,
}

impl Watches {
    /// Whether `id` names a running watch.
    pub(crate) fn contains(&self, id: u32) -> bool {
        self.map
            .get(&id)
            .is_some_and(|e| !e.done.load(Ordering::Relaxed))
    }

    /// Starts watching `path` on `id`: answers `Ok` once the watch is in place (or
    /// returns the error to answer), then streams events from a thread of its own.
    pub(crate) fn start(
        &mut self,
        conn: &Arc<Conn>,
        id: u32,
        path: &Path,
        recursive: bool,
    ) -> Result<(), RemoteError> {
        self.map.retain(|_, e| !e.done.load(Ordering::Relaxed));
        if self.map.len() >= MAX_WATCHES_PER_CONN {
            return Err(RemoteError {
                kind: ErrorKind::Io,
                errno: libc::EMFILE,
                message: format!(
                    "at most {MAX_WATCHES_PER_CONN} watches per connection; stop one first"
                ),
            });
        }
        let tree = Tree::new(path, recursive)?;
        let (stop_r, stop_w) =
            super::pipe().map_err(|e| RemoteError::from_io(&e, "watch stop pipe"))?;
        let done = Arc::new(AtomicBool::new(false));
        conn.send(id, &AgentMsg::Ok);
        let (c, d) = (conn.clone(), done.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("watch-{id}"))
            .stack_size(256 * 1024)
            .spawn(move || {
                let end = run(tree, &stop_r, &mut |name, kind| {
                    c.send(
                        id,
                        &AgentMsg::WatchEvent {
                            name: name.to_path_buf(),
                            kind,
                        },
                    )
                });
                d.store(true, Ordering::Relaxed);
                match end {
                    Ok(()) => c.send(id, &AgentMsg::Ok),
                    Err(e) => c.send_err(id, e),
                };
            });
        if let Err(e) = spawned {
            // `Ok` went out already: this error is the watch's final frame.
            conn.send_err(id, RemoteError::from_io(&e, "watch thread"));
            return Ok(());
        }
        self.map.insert(
            id,
            Entry {
                _stop: stop_w,
                done,
            },
        );
        Ok(())
    }

    /// Stops the watch `target` (it then sends its final `Ok`).
    pub(crate) fn stop(&mut self, target: u32) -> Result<(), RemoteError> {
        match self.map.remove(&target) {
            Some(e) if !e.done.load(Ordering::Relaxed) => Ok(()),
            _ => Err(RemoteError::new(
                ErrorKind::UnknownId,
                format!("no running watch with id {target} on this connection"),
            )),
        }
    }
}

/// One inotify instance and the directories it watches.
pub(crate) struct Tree {
    fd: OwnedFd,
    root: PathBuf,
    recursive: bool,
    /// Watch descriptor -> directory, relative to `root` ("" for the root).
    dirs: HashMap<i32, PathBuf>,
    root_wd: i32,
}

/// Why a directory could not be added.
enum AddError {
    /// The per-watch directory limit is reached.
    Limit,
    Os(io::Error),
}

impl Tree {
    /// Watches `root` (a directory; symlinks to one are followed) and, if `recursive`,
    /// every directory below it.
    pub(crate) fn new(root: &Path, recursive: bool) -> Result<Tree, RemoteError> {
        // SAFETY: plain inotify_init1 call; the result is checked.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            return Err(RemoteError::from_io(
                &io::Error::last_os_error(),
                "inotify_init1",
            ));
        }
        // SAFETY: fd is a new descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut t = Tree {
            fd,
            root: root.to_path_buf(),
            recursive,
            dirs: HashMap::new(),
            root_wd: -1,
        };
        t.root_wd = t.add_dir(Path::new(""), MASK).map_err(|e| match e {
            AddError::Os(e) => RemoteError::from_io(&e, format_args!("watch {}", root.display())),
            AddError::Limit => RemoteError::new(ErrorKind::Internal, "watch limit of 0"),
        })?;
        if recursive {
            let mut limit = false;
            t.add_subdirs(Path::new(""), &mut |_, _| true, false, &mut limit);
            if limit {
                return Err(RemoteError {
                    kind: ErrorKind::Io,
                    errno: libc::ENOSPC,
                    message: format!(
                        "watch {}: more than {MAX_DIRS_PER_WATCH} directories",
                        root.display()
                    ),
                });
            }
        }
        Ok(t)
    }

    /// Number of directories watched.
    #[cfg(test)]
    fn dirs(&self) -> usize {
        self.dirs.len()
    }

    fn add_dir(&mut self, rel: &Path, mask: u32) -> Result<i32, AddError> {
        if self.dirs.len() >= MAX_DIRS_PER_WATCH {
            return Err(AddError::Limit);
        }
        let full = if rel.as_os_str().is_empty() {
            self.root.clone()
        } else {
            self.root.join(rel)
        };
        let c = CString::new(full.as_os_str().as_bytes()).map_err(|_| {
            AddError::Os(io::Error::new(
                io::ErrorKind::InvalidInput,
                "NUL byte in the path",
            ))
        })?;
        // SAFETY: inotify_add_watch on our descriptor with a valid C string.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), mask) };
        if wd < 0 {
            return Err(AddError::Os(io::Error::last_os_error()));
        }
        // The same directory reached by a new name (moved) keeps its descriptor.
        self.dirs.insert(wd, rel.to_path_buf());
        Ok(wd)
    }

    /// Watches the directories below `rel` (already watched), depth first without
    /// recursion. With `report`, every entry found is passed to `emit` as `Create`
    /// (entries made before their directory was watched). Sets `limit` if the directory
    /// limit stopped it. Returns false once `emit` does.
    fn add_subdirs(
        &mut self,
        rel: &Path,
        emit: &mut dyn FnMut(&Path, WatchKind) -> bool,
        report: bool,
        limit: &mut bool,
    ) -> bool {
        let mut stack = vec![rel.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let Ok(rd) = fs::read_dir(self.root.join(&dir)) else {
                // Gone or unreadable meanwhile: nothing to watch there.
                continue;
            };
            for ent in rd.flatten() {
                let child = dir.join(ent.file_name());
                if report && !emit(&child, WatchKind::Create) {
                    return false;
                }
                if !ent.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                match self.add_dir(&child, MASK | libc::IN_DONT_FOLLOW) {
                    Ok(_) => stack.push(child),
                    Err(AddError::Limit) => {
                        *limit = true;
                        if !emit(&child, WatchKind::Overflow) {
                            return false;
                        }
                        return true;
                    }
                    // Removed or replaced meanwhile: its parent reports that.
                    Err(AddError::Os(e)) => {
                        tracing::debug!(dir = %child.display(), "watch subdirectory: {e}");
                    }
                }
            }
        }
        true
    }

    /// A new directory at `rel`: watch it and what is below it.
    fn add_new_dir(
        &mut self,
        rel: &Path,
        emit: &mut dyn FnMut(&Path, WatchKind) -> bool,
        report: bool,
    ) -> bool {
        match self.add_dir(rel, MASK | libc::IN_DONT_FOLLOW) {
            Ok(_) => {
                let mut limit = false;
                self.add_subdirs(rel, emit, report, &mut limit)
            }
            Err(AddError::Limit) => emit(rel, WatchKind::Overflow),
            Err(AddError::Os(e)) => {
                tracing::debug!(dir = %rel.display(), "watch new directory: {e}");
                true
            }
        }
    }

    /// The directory at `rel` left the tree: stop watching it and everything below.
    fn drop_subtree(&mut self, rel: &Path) {
        let gone: Vec<i32> = self
            .dirs
            .iter()
            .filter(|(_, p)| p.starts_with(rel))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.dirs.remove(&wd);
            // SAFETY: inotify_rm_watch on our descriptor; an already-gone wd is EINVAL.
            unsafe { libc::inotify_rm_watch(self.fd.as_raw_fd(), wd) };
        }
    }

    /// Handles one kernel event. `Err` ends the watch with that error; `Ok(false)` means
    /// `emit` asked to stop.
    fn handle(
        &mut self,
        wd: i32,
        mask: u32,
        name: &[u8],
        emit: &mut dyn FnMut(&Path, WatchKind) -> bool,
    ) -> Result<bool, RemoteError> {
        if mask & libc::IN_Q_OVERFLOW != 0 {
            return Ok(emit(Path::new(""), WatchKind::Overflow));
        }
        if mask & libc::IN_IGNORED != 0 {
            self.dirs.remove(&wd);
            if wd == self.root_wd {
                return Err(RemoteError::new(
                    ErrorKind::NotFound,
                    format!("the watched directory {} was removed", self.root.display()),
                ));
            }
            return Ok(true);
        }
        let Some(dir) = self.dirs.get(&wd).cloned() else {
            // A directory dropped from the tree; its last events are stale.
            return Ok(true);
        };
        if name.is_empty() {
            // Events on a watched directory itself are reported by its parent (or, for
            // the root, end the watch through IN_IGNORED).
            return Ok(true);
        }
        let rel = dir.join(std::ffi::OsStr::from_bytes(name));
        let is_dir = mask & libc::IN_ISDIR != 0;
        let mut go = true;
        if mask & libc::IN_CREATE != 0 {
            go = emit(&rel, WatchKind::Create);
            if go && is_dir && self.recursive {
                go = self.add_new_dir(&rel, emit, true);
            }
        }
        if mask & libc::IN_MOVED_TO != 0 {
            go = go && emit(&rel, WatchKind::Create);
            if go && is_dir && self.recursive {
                go = self.add_new_dir(&rel, emit, false);
            }
        }
        if mask & libc::IN_MOVED_FROM != 0 {
            go = go && emit(&rel, WatchKind::Rename);
            if is_dir && self.recursive {
                self.drop_subtree(&rel);
            }
        }
        if mask & libc::IN_MODIFY != 0 {
            go = go && emit(&rel, WatchKind::Write);
        }
        if mask & libc::IN_ATTRIB != 0 {
            go = go && emit(&rel, WatchKind::Chmod);
        }
        if mask & libc::IN_DELETE != 0 {
            go = go && emit(&rel, WatchKind::Remove);
        }
        Ok(go)
    }

    /// Handles every event in `buf` (what one read returned).
    fn handle_all(
        &mut self,
        buf: &[u8],
        emit: &mut dyn FnMut(&Path, WatchKind) -> bool,
    ) -> Result<bool, RemoteError> {
        for (wd, mask, name) in parse_events(buf) {
            if !self.handle(wd, mask, name, emit)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// The records of an inotify read: (wd, mask, name without its NUL padding). A record
/// that does not fit the buffer ends the parse (the kernel never writes one).
fn parse_events(buf: &[u8]) -> impl Iterator<Item = (i32, u32, &[u8])> {
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        let head = buf.get(pos..pos.checked_add(EVENT_HEADER)?)?;
        let word = |i: usize| [head[i], head[i + 1], head[i + 2], head[i + 3]];
        let wd = i32::from_ne_bytes(word(0));
        let mask = u32::from_ne_bytes(word(4));
        let len = u32::from_ne_bytes(word(12)) as usize;
        let start = pos + EVENT_HEADER;
        let raw = buf.get(start..start.checked_add(len)?)?;
        pos = start + len;
        let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        Some((wd, mask, &raw[..end]))
    })
}

/// The watch loop: waits for events or the stop pipe, hands events to `emit`. Returns
/// `Ok` when stopped (or `emit` refused: the connection is gone), `Err` when the watch
/// ended on its own.
pub(crate) fn run(
    mut tree: Tree,
    stop: &OwnedFd,
    emit: &mut dyn FnMut(&Path, WatchKind) -> bool,
) -> Result<(), RemoteError> {
    let mut buf = vec![0u8; READ_BUF];
    loop {
        let mut fds = [
            libc::pollfd {
                fd: tree.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfd.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(RemoteError::from_io(&e, "poll watch"));
        }
        if fds[1].revents != 0 {
            return Ok(());
        }
        if fds[0].revents == 0 {
            continue;
        }
        // SAFETY: reads into our buffer of the given length from our descriptor.
        let n = unsafe { libc::read(tree.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                _ => return Err(RemoteError::from_io(&e, "read inotify events")),
            }
        }
        if !tree.handle_all(&buf[..n as usize], emit)? {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory removed at the end.
    struct Scratch(PathBuf);
    impl Scratch {
        fn new(name: &str) -> Scratch {
            let p = std::env::temp_dir()
                .join(format!("clade-watch-unit-{}-{name}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            Scratch(p)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Reads what is queued now (the descriptor is non-blocking) into (name, kind)s.
    fn drain(t: &mut Tree) -> Result<Vec<(String, WatchKind)>, RemoteError> {
        let mut got = Vec::new();
        let mut buf = vec![0u8; READ_BUF];
        loop {
            // SAFETY: reads into our buffer from the tree's descriptor.
            let n = unsafe { libc::read(t.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return Ok(got);
            }
            t.handle_all(&buf[..n as usize], &mut |p, k| {
                got.push((p.to_string_lossy().into_owned(), k));
                true
            })?;
        }
    }

    fn has(ev: &[(String, WatchKind)], name: &str, kind: WatchKind) -> bool {
        ev.iter().any(|(n, k)| n == name && *k == kind)
    }

    #[test]
    fn create_write_chmod_rename_remove() {
        let s = Scratch::new("basic");
        let mut t = Tree::new(&s.0, false).unwrap();
        fs::write(s.0.join("a"), b"x").unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(s.0.join("a"), fs::Permissions::from_mode(0o600)).unwrap();
        fs::rename(s.0.join("a"), s.0.join("b")).unwrap();
        fs::remove_file(s.0.join("b")).unwrap();
        let ev = drain(&mut t).unwrap();
        assert_eq!(
            ev,
            vec![
                ("a".into(), WatchKind::Create),
                ("a".into(), WatchKind::Write),
                ("a".into(), WatchKind::Chmod),
                ("a".into(), WatchKind::Rename),
                ("b".into(), WatchKind::Create),
                ("b".into(), WatchKind::Remove),
            ]
        );
    }

    #[test]
    fn non_recursive_ignores_subdirectories() {
        let s = Scratch::new("flat");
        fs::create_dir(s.0.join("sub")).unwrap();
        let mut t = Tree::new(&s.0, false).unwrap();
        assert_eq!(t.dirs(), 1);
        fs::write(s.0.join("sub/f"), b"x").unwrap();
        fs::create_dir(s.0.join("d2")).unwrap();
        fs::write(s.0.join("d2/g"), b"x").unwrap();
        let ev = drain(&mut t).unwrap();
        assert_eq!(ev, vec![("d2".into(), WatchKind::Create)]);
    }

    #[test]
    fn recursive_follows_new_and_moved_directories() {
        let s = Scratch::new("rec");
        fs::create_dir_all(s.0.join("old/deep")).unwrap();
        let mut t = Tree::new(&s.0, true).unwrap();
        assert_eq!(t.dirs(), 3);
        fs::write(s.0.join("old/deep/f"), b"1").unwrap();
        // A new directory and a file in it right away: seen whichever comes first.
        fs::create_dir_all(s.0.join("new/inner")).unwrap();
        fs::write(s.0.join("new/inner/g"), b"2").unwrap();
        let ev = drain(&mut t).unwrap();
        assert!(has(&ev, "old/deep/f", WatchKind::Create), "{ev:?}");
        assert!(has(&ev, "old/deep/f", WatchKind::Write), "{ev:?}");
        assert!(has(&ev, "new", WatchKind::Create), "{ev:?}");
        assert!(has(&ev, "new/inner", WatchKind::Create), "{ev:?}");
        assert!(has(&ev, "new/inner/g", WatchKind::Create), "{ev:?}");
        assert_eq!(t.dirs(), 5);
        // Moved within the tree: watched under its new name.
        fs::rename(s.0.join("new"), s.0.join("renamed")).unwrap();
        let ev = drain(&mut t).unwrap();
        assert!(has(&ev, "new", WatchKind::Rename), "{ev:?}");
        assert!(has(&ev, "renamed", WatchKind::Create), "{ev:?}");
        fs::write(s.0.join("renamed/inner/h"), b"3").unwrap();
        let ev = drain(&mut t).unwrap();
        assert!(has(&ev, "renamed/inner/h", WatchKind::Create), "{ev:?}");
        // Moved out of the tree: no longer watched.
        let outside = Scratch::new("rec-outside");
        fs::rename(s.0.join("old"), outside.0.join("old")).unwrap();
        let ev = drain(&mut t).unwrap();
        assert!(has(&ev, "old", WatchKind::Rename), "{ev:?}");
        fs::write(outside.0.join("old/deep/x"), b"4").unwrap();
        let ev = drain(&mut t).unwrap();
        assert!(ev.is_empty(), "{ev:?}");
        assert_eq!(t.dirs(), 3);
    }

    #[test]
    fn missing_path_and_file_are_errors() {
        let s = Scratch::new("errors");
        let e = Tree::new(&s.0.join("nope"), false).err().unwrap();
        assert_eq!(e.kind, ErrorKind::NotFound);
        fs::write(s.0.join("file"), b"x").unwrap();
        let e = Tree::new(&s.0.join("file"), true).err().unwrap();
        assert_eq!(e.errno, libc::ENOTDIR, "{e:?}");
        let e = Tree::new(Path::new("/tmp/a\0b"), false).err().unwrap();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
    }

    #[test]
    fn removing_the_watched_directory_ends_the_watch() {
        let s = Scratch::new("gone");
        let root = s.0.join("w");
        fs::create_dir(&root).unwrap();
        let mut t = Tree::new(&root, true).unwrap();
        fs::write(root.join("f"), b"x").unwrap();
        fs::remove_file(root.join("f")).unwrap();
        fs::remove_dir(&root).unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; READ_BUF];
        // SAFETY: reads into our buffer from the tree's descriptor.
        let n = unsafe { libc::read(t.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        assert!(n > 0);
        let r = t.handle_all(&buf[..n as usize], &mut |p, k| {
            got.push((p.to_path_buf(), k));
            true
        });
        assert_eq!(r.unwrap_err().kind, ErrorKind::NotFound);
        assert!(got.contains(&(PathBuf::from("f"), WatchKind::Remove)));
    }

    #[test]
    fn directory_limit_is_reported_not_exceeded() {
        let s = Scratch::new("limit");
        let mut t = Tree::new(&s.0, true).unwrap();
        // Pretend the tree is full: the next new directory is not watched.
        for i in 0..(MAX_DIRS_PER_WATCH - 1) as i32 {
            t.dirs.insert(-2 - i, PathBuf::from(format!("fake{i}")));
        }
        fs::create_dir(s.0.join("one-too-many")).unwrap();
        let ev = drain(&mut t).unwrap();
        assert_eq!(
            ev,
            vec![
                ("one-too-many".into(), WatchKind::Create),
                ("one-too-many".into(), WatchKind::Overflow),
            ]
        );
        assert_eq!(t.dirs(), MAX_DIRS_PER_WATCH);
    }

    #[test]
    fn event_records_parse_safely() {
        let mut buf = Vec::new();
        for (wd, name) in [(1i32, &b"ab"[..]), (2, b"")] {
            buf.extend_from_slice(&wd.to_ne_bytes());
            buf.extend_from_slice(&libc::IN_CREATE.to_ne_bytes());
            buf.extend_from_slice(&0u32.to_ne_bytes());
            let padded = if name.is_empty() { 0 } else { 16 };
            buf.extend_from_slice(&(padded as u32).to_ne_bytes());
            let mut n = name.to_vec();
            n.resize(padded, 0);
            buf.extend_from_slice(&n);
        }
        let all: Vec<_> = parse_events(&buf).collect();
        assert_eq!(
            all,
            vec![
                (1, libc::IN_CREATE, &b"ab"[..]),
                (2, libc::IN_CREATE, &b""[..])
            ]
        );
        // Truncated anywhere: never a panic, never a record past the end.
        for cut in 0..buf.len() {
            assert!(parse_events(&buf[..cut]).count() <= 2);
        }
        let mut lying = buf[..16].to_vec();
        lying[12..16].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(parse_events(&lying).count(), 0);
    }
}

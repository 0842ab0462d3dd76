//! Fork child processes started ahead of time ([`PrestartedChildren`]).
//!
//! Starting a child process on the fork's path costs more than building the child VM in
//! it: fork and exec of the VMM, dynamic loading, then a VM shell (KVM VM, vCPUs, an
//! address-space reservation). A VM process with `fork_spares` set
//! ([`super::OwnerOptions::fork_spares`]) keeps that many `clade fork-child` processes
//! waiting, each with a shell of the VM's shape already built; a fork hands each child's
//! state to one of them instead of starting a process, and starts a new one for each
//! spent (one per idle turn of the owner loop, off the fork's path, and only
//! [`REFILL_AFTER`] after the last fork: starting a process and building its shell takes
//! a CPU for milliseconds, which the new children need for their first requests). A fork
//! asking for more children than are waiting starts the rest as before.
//!
//! A waiting process's standard input is one end of a Unix stream socket; the parent
//! keeps the other. What goes over it:
//! 1. at start: a little-endian `u32` length and the shell's shape ([`PrestartShape`],
//!    postcard) of that length; the process builds the shell, answers one byte (`w`) and
//!    waits (until that byte, it counts as starting, not waiting: a fork still takes it,
//!    after the ones that wait);
//! 2. at a fork: the `u32` length of the launch record, sent with the descriptors
//!    (`SCM_RIGHTS`): the child's log first, then the memory layers, base first; then the
//!    launch record and the hand-over bytes, as a child started at the fork reads them from
//!    its standard input ([`super::fork`]); then the parent shuts its side down.
//!
//! The process then logs to the log it was given and answers `ready` or `error …` on its
//! standard output, exactly like a child started at the fork.
//!
//! A waiting child's files are made ahead too, next to the parent's API socket, under
//! hidden names (`.<stem>-ahead-<tag>.{log,serial,api,vsock}`): the parent creates the log
//! and serial console files when it starts the process ([`AheadFiles`]), the process binds
//! its API and vsock sockets while it waits; the fork renames them to the child's names.
//! If the parent goes away first, the process reads the end of the stream and exits
//! without having run anything (removing what was made ahead for it).
//!
//! Written here (no crate hands a process its work over a socket this way); the
//! descriptor passing itself is `nix`'s `sendmsg`/`recvmsg`.

use std::fs::File;
use std::io::{IoSlice, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use nix::sys::socket::{recv, sendmsg, ControlMessage, MsgFlags};
use serde::{Deserialize, Serialize};

use super::options::ChildLauncher;
use crate::error::{Error, Result};
use crate::vm::Vm;
use crate::vstate::shell::ShellSpec;

/// After this many waiting processes ended by themselves, no more are started.
const MAX_DEATHS: usize = 3;

/// How long after a fork the waiting processes it used are replaced.
pub const REFILL_AFTER: Duration = Duration::from_millis(250);

/// Most memory layer descriptors one hand-over carries (the kernel passes at most 253
/// descriptors in one message; one of them is the log).
pub(super) const MAX_HANDED_LAYERS: usize = 250;

/// The shell a waiting child builds: [`ShellSpec`] as it goes over the socket.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct PrestartShape {
    pub(super) kvm_device: PathBuf,
    pub(super) mem_bytes: u64,
    pub(super) vcpus: u32,
    pub(super) dirty_log: bool,
    /// Where the process binds its API socket ahead (moved to the child's API socket at
    /// the fork: see [`AheadFiles`] for why), if anywhere.
    pub(super) api_ahead: Option<PathBuf>,
    /// The same for its vsock socket (when the VM has a vsock device).
    pub(super) vsock_ahead: Option<PathBuf>,
    /// Its log and serial files made ahead by the parent: the process removes them if it
    /// ends because the parent went away (a parent that ends it removes them itself).
    pub(super) files_ahead: Vec<PathBuf>,
}

impl PrestartShape {
    pub(super) fn spec(&self) -> ShellSpec {
        ShellSpec {
            kvm_device: self.kvm_device.clone(),
            mem_bytes: self.mem_bytes,
            vcpus: self.vcpus,
            dirty_log: self.dirty_log,
        }
    }
}

/// Idle fork child processes of one VM, at most `want` of them. Dropping it ends them.
pub struct PrestartedChildren {
    want: usize,
    idle: Vec<Prestarted>,
    /// When a fork last took one.
    last_taken: Option<Instant>,
    /// Waiting processes that ended by themselves.
    died: usize,
}

/// One waiting child process.
pub(super) struct Prestarted {
    pub(super) child: Child,
    sock: UnixStream,
    pub(super) stdout: ChildStdout,
    /// It said its shell is built.
    ready: bool,
    /// Its log and serial console files, made when it was started.
    files: Option<AheadFiles>,
    /// Where it binds its sockets ahead ([`PrestartShape`]): removed if it ends unused.
    sockets_ahead: Vec<PathBuf>,
}

/// A waiting child's log and serial console files, made (new and private, under names
/// nobody can guess) when the process is started, next to the parent's API socket where
/// a fork's children's files go by default; the fork renames them to the child's names
/// ([`AheadFiles::place`]). Creating a file allocates an inode, which on a filesystem
/// where many files were just deleted (ext4 skipping recently deleted inodes) was
/// measured here at 0.4-0.6 ms each, two per child in the fork's loop; a rename allocates
/// none. Removed when dropped unless placed.
pub(super) struct AheadFiles {
    log: PathBuf,
    /// Taken by [`AheadFiles::place`].
    log_file: Option<File>,
    serial: PathBuf,
}

/// Creates `path` for writing: it must not exist (not even as a symlink), mode 0600.
pub(super) fn new_private_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// The name of a waiting child's file made ahead next to `api_sock` (the parent's API
/// socket): `.<stem>-ahead-<tag>.<ext>`.
fn ahead_path(api_sock: &Path, tag: &str, ext: &str) -> PathBuf {
    let stem = api_sock
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    api_sock.with_file_name(format!(".{stem}-ahead-{tag}.{ext}"))
}

impl AheadFiles {
    /// Makes the two next to `api_sock`, named with `tag`; `None` (logged) if they cannot
    /// be made.
    fn make(api_sock: &Path, tag: &str) -> Option<AheadFiles> {
        let (log, serial) = (
            ahead_path(api_sock, tag, "log"),
            ahead_path(api_sock, tag, "serial"),
        );
        let log_file = match new_private_file(&log) {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!("no fork child files made ahead ({}: {e})", log.display());
                return None;
            }
        };
        if let Err(e) = new_private_file(&serial) {
            tracing::debug!("no fork child files made ahead ({}: {e})", serial.display());
            let _ = std::fs::remove_file(&log);
            return None;
        }
        Some(AheadFiles {
            log,
            log_file: Some(log_file),
            serial,
        })
    }

    /// Renames them to `log` and `serial`, neither of which may exist (as if made there):
    /// the log's open file, or `None` when they could not be placed (nothing of theirs is
    /// left at `log` or `serial`; the caller makes those).
    pub(super) fn place(mut self, log: &Path, serial: &Path) -> Option<File> {
        use nix::fcntl::{renameat2, RenameFlags};
        let rename = |from: &Path, to: &Path| {
            renameat2(None, from, None, to, RenameFlags::RENAME_NOREPLACE)
                .map_err(|e| tracing::debug!("a fork child file made ahead not used: {e}"))
        };
        rename(&self.log, log).ok()?;
        // Removed by `drop` from where it is now, should the rest fail.
        self.log = log.to_path_buf();
        rename(&self.serial, serial).ok()?;
        self.serial = serial.to_path_buf();
        let file = self.log_file.take()?;
        // Placed: nothing to remove any more.
        self.log = PathBuf::new();
        self.serial = PathBuf::new();
        Some(file)
    }
}

impl Drop for AheadFiles {
    fn drop(&mut self) {
        for p in [&self.log, &self.serial] {
            if !p.as_os_str().is_empty() {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

impl PrestartedChildren {
    /// A pool that keeps `want` processes waiting (0: none; forks start every child).
    pub fn new(want: usize) -> Self {
        PrestartedChildren {
            want,
            idle: Vec::with_capacity(want),
            last_taken: None,
            died: 0,
        }
    }

    /// How many wait now, their shells built.
    pub fn waiting(&mut self) -> usize {
        self.idle
            .iter_mut()
            .map(|p| p.is_ready())
            .filter(|r| *r)
            .count()
    }

    /// Starts one waiting process for children of `vm` if fewer than wanted wait. One per
    /// call: the owner loop calls it when it has nothing else to do. A failure is logged
    /// (forks then start their children as they go).
    pub(super) fn top_up(&mut self, vm: &Vm, api_sock: &Path, launcher: &dyn ChildLauncher) {
        if self.last_taken.is_some_and(|t| t.elapsed() < REFILL_AFTER) {
            return;
        }
        let before = self.idle.len();
        self.idle.retain_mut(|p| {
            let alive = matches!(p.child.try_wait(), Ok(None));
            if !alive {
                p.remove_sockets_ahead();
            }
            alive
        });
        self.died += before - self.idle.len();
        if self.died >= MAX_DEATHS && self.want > 0 {
            // Something ends them (see the VM process's log): not again and again.
            tracing::warn!(
                "{} waiting fork child processes ended by themselves: no more are started",
                self.died
            );
            self.want = 0;
        }
        if self.idle.len() >= self.want {
            return;
        }
        match Prestarted::start(vm, api_sock, launcher) {
            Ok(p) => self.idle.push(p),
            Err(e) => {
                tracing::warn!("could not start a waiting fork child process: {e}");
                // Not again and again: the next fork starts its children itself.
                self.want = self.idle.len();
            }
        }
    }

    /// A waiting process (one whose shell is built first), if one is still there. Only the
    /// one handed out is looked at, the first ready one (a readiness seen once is kept, so
    /// that costs no system call), and dropped if it has ended: a scan of every waiting
    /// process on each take made a fork into n of them n² system calls (a `wait4` for each
    /// waiting process, per child). One that ends after this is found at the hand-over, which then starts a
    /// new process; [`PrestartedChildren::top_up`] sweeps the ended ones.
    pub(super) fn take(&mut self) -> Option<Prestarted> {
        self.last_taken = Some(Instant::now());
        loop {
            let i = self
                .idle
                .iter_mut()
                .position(|p| p.is_ready())
                .or_else(|| self.idle.len().checked_sub(1))?;
            let mut p = self.idle.swap_remove(i);
            if matches!(p.child.try_wait(), Ok(None)) {
                return Some(p);
            }
            self.died += 1;
            p.end();
        }
    }
}

impl Drop for PrestartedChildren {
    fn drop(&mut self) {
        for p in self.idle.drain(..) {
            p.end();
        }
    }
}

impl Prestarted {
    fn start(vm: &Vm, api_sock: &Path, launcher: &dyn ChildLauncher) -> Result<Prestarted> {
        let spec = vm.child_shell_spec();
        // Names nobody can guess, for the files made ahead.
        let mut tag = crate::SnapshotId::random().to_string();
        tag.truncate(12);
        let mut shape = PrestartShape {
            kvm_device: spec.kvm_device,
            mem_bytes: spec.mem_bytes,
            vcpus: spec.vcpus,
            dirty_log: spec.dirty_log,
            api_ahead: Some(ahead_path(api_sock, &tag, "api")),
            vsock_ahead: vm
                .config()
                .vsock
                .as_ref()
                .map(|_| ahead_path(api_sock, &tag, "vsock")),
            files_ahead: Vec::new(),
        };
        let files = AheadFiles::make(api_sock, &tag);
        if let Some(f) = &files {
            shape.files_ahead = vec![f.log.clone(), f.serial.clone()];
        }
        let sockets_ahead: Vec<PathBuf> = shape
            .api_ahead
            .iter()
            .chain(&shape.vsock_ahead)
            .cloned()
            .collect();
        let record = postcard::to_allocvec(&shape)
            .map_err(|e| Error::Fork(format!("encoding a shell's shape: {e}")))?;
        let (mut ours, theirs) =
            UnixStream::pair().map_err(Error::io("a waiting child's socket"))?;
        let mut cmd = launcher.prestarted_command(api_sock);
        cmd.stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::piped())
            .process_group(0);
        // SAFETY: runs in the forked child before exec; only calls close_range
        // (async-signal safe) and allocates nothing.
        unsafe {
            cmd.pre_exec(|| {
                // Nothing of the parent's but its standard streams.
                const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
                libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(Error::io("starting a waiting fork child process"))?;
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Fork("a waiting child has no stdout pipe".into()));
        };
        let p = Prestarted {
            child,
            sock: ours
                .try_clone()
                .map_err(Error::io("a waiting child's socket"))?,
            stdout,
            ready: false,
            files,
            sockets_ahead,
        };
        if let Err(e) = ours
            .write_all(&(record.len() as u32).to_le_bytes())
            .and_then(|()| ours.write_all(&record))
        {
            p.end();
            return Err(Error::io("telling a waiting child its shell")(e));
        }
        Ok(p)
    }

    /// Hands the child its state: the launch record's length with `log` and the memory
    /// layers `fds`, then `record` and `handoff`; then ends the stream. On an error the
    /// caller ends the process.
    pub(super) fn hand_over(
        &mut self,
        log: RawFd,
        fds: &[RawFd],
        record: &[u8],
        handoff: &[u8],
    ) -> Result<()> {
        if fds.len() > MAX_HANDED_LAYERS {
            return Err(Error::Fork(format!(
                "{} memory layers: a waiting child takes at most {MAX_HANDED_LAYERS}",
                fds.len()
            )));
        }
        let mut all = Vec::with_capacity(fds.len() + 1);
        all.push(log);
        all.extend_from_slice(fds);
        let len = (record.len() as u32).to_le_bytes();
        let sent = sendmsg::<()>(
            self.sock.as_raw_fd(),
            &[IoSlice::new(&len)],
            &[ControlMessage::ScmRights(&all)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(|e| Error::Fork(format!("handing descriptors to a waiting child: {e}")))?;
        if sent != len.len() {
            return Err(Error::Fork("a short hand-over to a waiting child".into()));
        }
        self.sock
            .write_all(record)
            .and_then(|()| self.sock.write_all(handoff))
            .and_then(|()| self.sock.shutdown(std::net::Shutdown::Write))
            .map_err(Error::io("handing the state to a waiting child"))
    }

    /// Its log and serial files made ahead, for its fork to place.
    pub(super) fn take_files(&mut self) -> Option<AheadFiles> {
        self.files.take()
    }

    /// Whether it said its shell is built (looked at without waiting).
    fn is_ready(&mut self) -> bool {
        if !self.ready {
            let mut b = [0u8; 1];
            self.ready = matches!(
                recv(self.sock.as_raw_fd(), &mut b, MsgFlags::MSG_DONTWAIT),
                Ok(1)
            );
        }
        self.ready
    }

    /// Ends a process that is not used.
    pub(super) fn end(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.remove_sockets_ahead();
    }

    /// Removes the sockets it bound ahead, once it ended without a fork (killed, it
    /// removed nothing of its own).
    fn remove_sockets_ahead(&mut self) {
        for p in self.sockets_ahead.drain(..) {
            let _ = std::fs::remove_file(p);
        }
    }
}

//! Standby processes, and the one restore path of a `clade` process.
//!
//! Starting a VM process costs more than the restore in it: exec, dynamic loading, the
//! process's system-call filter, then a VM shell (KVM VM, slots, irqchip, vCPUs, spare
//! threads each confined to its kind) built in a process that has none ready. A standby
//! process pays all of that ahead of time: it confines itself, builds a shell of one shape
//! (vCPUs, memory), serves its control API and waits ([`standby`]). It serves that socket
//! on its main thread, a request per connection ([`ApiListener::next_request`]): the
//! restore request is read, run and answered without a hand-off between threads, and the
//! socket's server thread, started and confined ahead ([`ServerAhead`]), is handed the
//! socket once the process holds a VM. One `restore` request
//! ([`RestoreRequest`]) then restores a snapshot into that shell, and from then on the
//! process is an ordinary restored VM (its owner loop, [`super::own`], serves the rest of
//! its life). A second `restore` is refused, by the owner loop's dispatcher.
//!
//! [`restore_request`] is the restore itself, for `clade restore SNAPSHOT` (options from
//! its command line) and for a standby's request alike. A request's paths are checked
//! the way the control API checks snapshot and fork paths: absolute, no `..`, and the
//! files the VM creates (sockets, serial file, log, disk overlay) under the files root.
//!
//! A standby may be told which snapshot its request will most likely name (`--preload`,
//! a service's template; a `preload` request, a sandbox's snapshot just taken at its
//! pause): it opens and checks that snapshot and reads its working set while it waits
//! ([`Preloaded`]), and a request for it skips that part (~0.15 ms for one memory file,
//! ~0.05 ms more for each diff below it), as long as the snapshot's state file is still
//! the one it opened. It holds at most [`MAX_PRELOADED`] snapshots asked for by requests,
//! the oldest closed first, besides its `--preload` one.
//!
//! A standby started with a parent-death signal (`PR_SET_PDEATHSIG`, so that an unused
//! standby does not outlive the service that started it) clears it once it holds a VM:
//! from then on the VM is a sandbox of its own and outlives its starter, as one started
//! by `clade restore` does. A jailed one does it through [`super::jail::StarterLink`] (which
//! tells the process waiting for its jail to clear its own, in a jail with limits).

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::json;

use super::dispatch::{confine, status_fields, Confiner};
use super::options::OwnerOptions;
use crate::api::{ApiListener, ApiServer, Request, Response, RestoreRequest, ServerAhead};
use crate::config::{NetConfig, SerialOutput, Tap, TapSource};
use crate::device_manager::BoundAhead;
use crate::error::{Error, Result};
use crate::persist::restore::{PreparedSnapshot, RestoreOptions};
use crate::saved::MemoryBackend;
use crate::vm::Vm;
use crate::vstate::shell::{Shell, ShellSpec};
use crate::CpuCheck;
use devices::virtio::vsock::SocketFile;

/// How long the agent sync after a restore may take unless the request says otherwise.
pub const DEFAULT_AGENT_SYNC_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest agent sync a request may ask for.
pub const MAX_AGENT_SYNC_TIMEOUT: Duration = Duration::from_secs(600);

/// How a standby process's wait ended.
pub enum StandbyEnd {
    /// A `restore` request made this VM; the caller owns it from here ([`super::own`]),
    /// with its control API now served from a thread of its own.
    Restored(Box<Vm>, ApiServer),
    /// A `shutdown` request: the process ends without having run a VM.
    Shutdown,
    /// A stop signal (its number).
    Signal(i32),
}

impl std::fmt::Debug for StandbyEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StandbyEnd::Restored(..) => f.write_str("Restored"),
            StandbyEnd::Shutdown => f.write_str("Shutdown"),
            StandbyEnd::Signal(s) => write!(f, "Signal({s})"),
        }
    }
}

/// Snapshots a standby holds open ahead on request (`preload`), besides its `--preload`
/// one: a few paused sandboxes' latest snapshots, each a handful of open files.
pub const MAX_PRELOADED: usize = 2;

/// A snapshot opened ahead by a standby, with what its state file was then: a request
/// naming the same directory uses it while that file is unchanged (a template built
/// again under the same name is a new file, and is opened anew). Its memory files stay
/// open while the standby waits: a template removed meanwhile frees its disk space once
/// the standby is used or ends.
pub struct Preloaded {
    dir: PathBuf,
    snapshot: PreparedSnapshot,
    stamp: FileStamp,
}

/// What tells one file from another at a path: device, inode, size, modification time.
type FileStamp = (u64, u64, u64, i64, i64);

fn file_stamp(path: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

impl Preloaded {
    /// Opens and checks the snapshot in `dir` and reads its working set.
    pub fn open(dir: &Path) -> Result<Preloaded> {
        let stamp = file_stamp(&dir.join(crate::STATE_FILE))
            .ok_or_else(|| Error::Snapshot(format!("{}: no readable state file", dir.display())))?;
        let snapshot = PreparedSnapshot::open(dir, CpuCheck::default())?;
        snapshot.load_working_set();
        Ok(Preloaded {
            dir: dir.to_path_buf(),
            snapshot,
            stamp,
        })
    }

    /// Holds a snapshot the caller opened (e.g. from an object store, with
    /// [`PreparedSnapshot::open_with_layers`]) as the one in `dir`.
    pub fn from_prepared(dir: &Path, snapshot: PreparedSnapshot) -> Result<Preloaded> {
        let stamp = file_stamp(&dir.join(crate::STATE_FILE))
            .ok_or_else(|| Error::Snapshot(format!("{}: no readable state file", dir.display())))?;
        snapshot.load_working_set();
        Ok(Preloaded {
            dir: dir.to_path_buf(),
            snapshot,
            stamp,
        })
    }

    /// The snapshot, if `dir` names it and its state file is the one opened.
    fn for_dir(&self, dir: &Path) -> Option<&PreparedSnapshot> {
        (dir == self.dir && file_stamp(&dir.join(crate::STATE_FILE)) == Some(self.stamp))
            .then_some(&self.snapshot)
    }
}

/// Builds a shell for `spec`, opens `preload` (if given; a snapshot that cannot be
/// opened is logged and ignored), makes its files ahead ([`MadeAhead`]), and serves `api`
/// on this thread until a `restore` request succeeds, a `shutdown` request or a stop
/// signal ([`OwnerOptions::stop`]) comes. `status` answers
/// `{"state":"standby","vcpus","mem_mib","preloaded"}`; other requests are refused (there
/// is no VM yet). A request that fails its checks leaves the shell ready; a restore that
/// fails later (the shell is spent) builds a new one.
pub fn standby(
    api: ApiListener,
    spec: &ShellSpec,
    options: &OwnerOptions,
    preload: Option<&Path>,
    mut starter: Option<super::jail::StarterLink>,
) -> Result<StandbyEnd> {
    let mut shell = Some(Shell::create(spec)?);
    tracing::info!(
        "standby: {} vCPUs, {} MiB, shell built in {:?}",
        spec.vcpus,
        spec.mem_bytes >> 20,
        shell.as_ref().map(Shell::build_time).unwrap_or_default()
    );
    let initial = preload.and_then(|dir| match Preloaded::open(dir) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!("standby: not opening {} ahead: {e}", dir.display());
            None
        }
    });
    let mut ahead = Ahead {
        initial,
        asked: VecDeque::new(),
    };
    let mut made = MadeAhead::make(api.path());
    if let Some(p) = ahead.latest() {
        prefill(&mut shell, p, spec);
    }
    // The API's server thread, for after the restore (a failure leaves its start to then).
    let mut server = ServerAhead::start()
        .inspect_err(|e| tracing::debug!("standby: the API thread is not started ahead: {e}"))
        .ok();
    loop {
        if let Some(flag) = options.stop {
            let signal = flag.load(Ordering::SeqCst);
            if signal != 0 {
                tracing::info!("standby: stopped by signal {signal}");
                return Ok(StandbyEnd::Signal(signal));
            }
        }
        let Some(mut req) = api.next_request(Duration::from_millis(20)) else {
            continue;
        };
        match &req.request {
            Request::Status => req.respond(Response::ok(json!({
                "state": "standby",
                "vcpus": spec.vcpus,
                "mem_mib": spec.mem_bytes >> 20,
                "preloaded": ahead.dirs(),
            }))),
            Request::Preload { snapshot } => {
                let answer = ahead
                    .ask(snapshot)
                    .map(|()| json!({ "preloaded": ahead.dirs() }));
                let asked = answer.is_ok();
                req.respond(match answer {
                    Ok(fields) => Response::ok(fields),
                    Err(e) => Response::err(e),
                });
                // The snapshot asked for last is the one this standby's shell is
                // prepared for (its next restore is most likely that sandbox's wake).
                if let Some(p) = ahead.latest().filter(|_| asked) {
                    prefill(&mut shell, p, spec);
                }
            }
            Request::Shutdown => {
                req.respond(Response::ok(json!({ "state": "ended" })));
                return Ok(StandbyEnd::Shutdown);
            }
            Request::Restore(r) => {
                let r = r.clone();
                let passed = req.take_fds();
                match restore_request(
                    &r,
                    passed,
                    &spec.kvm_device,
                    &mut shell,
                    Some(options.files_root.as_deref()),
                    &ahead,
                    &mut made,
                ) {
                    Ok(mut restored) => {
                        clear_parent_death_signal();
                        req.respond(Response::ok(status_fields(&restored.vm)));
                        // Jailed, the process its starter knows is the one waiting for
                        // the jail: it clears its parent-death signal too. Told once the
                        // answer is out: woken before, it took the CPU the answer was to
                        // be sent from (a scheduler trace: ~0.05 ms at the median). It
                        // clears the signal asynchronously either way: the starter gone in
                        // between ends the VM, before the answer as after it.
                        if let Some(link) = starter.take() {
                            link.outlive_starter();
                        }
                        // The restored guest's first run (~0.3-0.6 ms of shadow page faults
                        // here) could take the CPU this thread was on until it halted, and
                        // the answer waited behind it (seen in a scheduler trace: ~0.45 ms);
                        // kept off it until now, the vCPUs may go anywhere again.
                        restored.vm.unpin_vcpus();
                        restored.log();
                        let vm = restored.vm;
                        // Handed over once the answer is out. Connections meanwhile wait
                        // in the backlog.
                        let api = match server.take() {
                            Some(ahead) => api.serve_on(ahead),
                            None => api.serve(),
                        };
                        let api = api.inspect_err(|e| {
                            tracing::error!("restored, but the control API cannot be served: {e}")
                        })?;
                        return Ok(StandbyEnd::Restored(Box::new(vm), api));
                    }
                    Err(e) => {
                        tracing::warn!("standby: restore of {}: {e}", r.snapshot.display());
                        req.respond(Response::err(e));
                        if shell.is_none() {
                            shell = Some(Shell::create(spec)?);
                            if let Some(p) = ahead.latest() {
                                prefill(&mut shell, p, spec);
                            }
                        }
                        made.make_missing(api.path());
                    }
                }
            }
            Request::Pause
            | Request::Unpause
            | Request::Snapshot { .. }
            | Request::FreezeDisk
            | Request::Fork { .. } => req.respond(Response::err(
                "no VM yet: this is a standby process (send a restore request first)",
            )),
        }
    }
}

/// Prepares the standby's shell for a restore of `snapshot`
/// ([`PreparedSnapshot::prefill_shell`]), after its answer is out. A failure is logged and
/// costs only the time saved: a shell lost in it is built again.
fn prefill(shell: &mut Option<Shell>, snapshot: &PreparedSnapshot, spec: &ShellSpec) {
    let Some(s) = shell.take() else {
        return;
    };
    let t = Instant::now();
    match snapshot.prefill_shell(s) {
        Ok(s) => {
            *shell = Some(s);
            tracing::debug!("standby: shell prefilled in {:?}", t.elapsed());
        }
        Err(e) => {
            tracing::warn!("standby: preparing its shell for a restore: {e}");
            *shell = Shell::create(spec)
                .inspect_err(|e| tracing::warn!("standby: building a shell: {e}"))
                .ok();
        }
    }
}

/// Files a standby makes while it waits, so that its restore need not create them: an
/// empty file renamed to the request's serial console file, another to its VM log (only
/// if there is none yet: a woken sandbox's log is appended to), and a listening socket
/// moved to the request's vsock socket path (`DeviceManager::finish_restore`), all next to
/// the standby's API socket (`<token>.serial`, `<token>.vmlog`, `<token>.vsock`; the same
/// filesystem as the sandboxes' files in a service's state directory). Creating a file (a
/// new inode) on a filesystem where files come and go was measured at 0.4-0.8 ms here
/// (ext4 skipping recently deleted inodes and reading inode tables, right after a pause
/// deleted a sandbox's older snapshot files), a rename at 0.02-0.05 ms. Best effort: what
/// cannot be made ahead, or moved, is created at the restore as before. Removed when
/// dropped unless used.
#[derive(Default)]
pub struct MadeAhead {
    serial: Option<PathBuf>,
    log: Option<PathBuf>,
    vsock: Option<BoundAhead>,
}

impl MadeAhead {
    /// Makes the three next to `api` (a standby's API socket path).
    fn make(api: &Path) -> MadeAhead {
        let mut m = MadeAhead::default();
        m.make_missing(api);
        m
    }

    /// Makes what is missing (after a restore that failed used them).
    fn make_missing(&mut self, api: &Path) {
        for (slot, ext) in [(&mut self.serial, "serial"), (&mut self.log, "vmlog")] {
            if slot.is_none() {
                let path = api.with_extension(ext);
                match std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                {
                    Ok(_) => *slot = Some(path),
                    Err(e) => tracing::debug!("standby: no {ext} file made ahead ({e})"),
                }
            }
        }
        if self.vsock.is_none() {
            match SocketFile::bind(&api.with_extension("vsock")) {
                Ok(b) => self.vsock = Some(b),
                Err(e) => tracing::debug!("standby: no vsock socket bound ahead ({e})"),
            }
        }
    }

    /// Puts the serial file made ahead at `to` (replacing what is there, as creating it
    /// with truncation would), if it can be renamed there.
    fn place_serial(&mut self, to: &Path) {
        if let Some(from) = self.serial.take() {
            if let Err(e) = std::fs::rename(&from, to) {
                tracing::debug!("standby: serial file made ahead not used ({e})");
                let _ = std::fs::remove_file(&from);
            }
        }
    }

    /// Puts the log file made ahead at `to` if nothing is there yet (a rename that
    /// replaces nothing); else it stays, removed with the rest later, off the request's
    /// path.
    fn place_log(&mut self, to: &Path) {
        use nix::fcntl::{renameat2, RenameFlags};
        if let Some(from) = self.log.take() {
            if let Err(e) = renameat2(None, &from, None, to, RenameFlags::RENAME_NOREPLACE) {
                tracing::debug!("standby: log file made ahead not used ({e})");
                self.log = Some(from);
            }
        }
    }
}

impl Drop for MadeAhead {
    fn drop(&mut self) {
        for p in [self.serial.take(), self.log.take()].into_iter().flatten() {
            let _ = std::fs::remove_file(p);
        }
        // The socket file goes with its `SocketFile`.
    }
}

/// The snapshots a standby holds open ahead: its `--preload` one, and up to
/// [`MAX_PRELOADED`] asked for by `preload` requests (oldest first).
#[derive(Default)]
pub struct Ahead {
    initial: Option<Preloaded>,
    asked: VecDeque<Preloaded>,
}

impl Ahead {
    /// Holds `snapshot`: a restore request for its directory uses it as opened.
    pub fn holding(snapshot: Preloaded) -> Ahead {
        Ahead {
            initial: Some(snapshot),
            asked: VecDeque::new(),
        }
    }

    /// The snapshot in `dir`, if one held is that one, unchanged.
    fn find(&self, dir: &Path) -> Option<&PreparedSnapshot> {
        self.initial
            .iter()
            .chain(&self.asked)
            .find_map(|p| p.for_dir(dir))
    }

    /// The snapshot a shell is best prepared for: the one asked for last, else the
    /// `--preload` one.
    fn latest(&self) -> Option<&PreparedSnapshot> {
        self.asked
            .back()
            .or(self.initial.as_ref())
            .map(|p| &p.snapshot)
    }

    /// The directories held.
    fn dirs(&self) -> Vec<&Path> {
        self.initial
            .iter()
            .chain(&self.asked)
            .map(|p| p.dir.as_path())
            .collect()
    }

    /// Opens `dir` ahead for a `preload` request, unless it is held already (and
    /// unchanged: it becomes the one asked for last); past [`MAX_PRELOADED`] the oldest
    /// asked for is closed.
    fn ask(&mut self, dir: &Path) -> Result<()> {
        let dir = confine(dir, None).map_err(Error::Config)?;
        if let Some(i) = self.asked.iter().position(|p| p.for_dir(&dir).is_some()) {
            if let Some(p) = self.asked.remove(i) {
                self.asked.push_back(p);
            }
            return Ok(());
        }
        if self.find(&dir).is_some() {
            return Ok(());
        }
        // One replaced since it was opened is opened anew.
        self.asked.retain(|p| p.dir != dir);
        let p = Preloaded::open(&dir)?;
        tracing::info!("standby: {} opened ahead", dir.display());
        if self.asked.len() >= MAX_PRELOADED {
            self.asked.pop_front();
        }
        self.asked.push_back(p);
        Ok(())
    }
}

/// Restores the VM `req` describes: `clade restore` and a standby's `restore` request
/// both come here. `shell` is taken once the request passed its checks and the snapshot
/// was read (it stays with the caller when either fails).
///
/// `confined`: `None` for a request from the process's own command line (trusted as
/// given); `Some(root)` for one through the control API: every path must be absolute
/// and without `..`, the files the VM creates must lie under `root` (when one is set)
/// and a snapshot with a disk needs an explicit overlay path then (the default one is
/// in the snapshot's directory). `passed`: the descriptors sent with an API request (its
/// TAP when `tap_passed`; a request that says none may carry none). `ahead`: snapshots
/// opened ahead, one used if the request names it. `made`: files made ahead, used for the
/// request's serial file and vsock socket.
pub fn restore_request(
    req: &RestoreRequest,
    passed: Vec<OwnedFd>,
    kvm_device: &Path,
    shell: &mut Option<Shell>,
    confined: Option<Option<&Path>>,
    ahead: &Ahead,
    made: &mut MadeAhead,
) -> Result<Restored> {
    let backend = match &req.backend {
        None => MemoryBackend::Uffd,
        Some(b) => b.parse::<MemoryBackend>().map_err(Error::Config)?,
    };
    let agent_sync = match req.agent_sync_timeout_ms.map(Duration::from_millis) {
        Some(t) if t.is_zero() || t > MAX_AGENT_SYNC_TIMEOUT => {
            return Err(Error::Config(format!(
                "agent_sync_timeout_ms must be 1..={}",
                MAX_AGENT_SYNC_TIMEOUT.as_millis()
            )))
        }
        t => req
            .agent_sync
            .then(|| t.unwrap_or(DEFAULT_AGENT_SYNC_TIMEOUT)),
    };
    let mut req = req.clone();
    if let Some(root) = confined {
        req.snapshot = confine(&req.snapshot, None).map_err(Error::Config)?;
        // The files a VM makes, in its one directory: resolved once for all of them.
        let mut confiner = Confiner::new(root);
        for p in [
            &mut req.vsock,
            &mut req.serial_file,
            &mut req.disk_overlay,
            &mut req.log,
            &mut req.working_set_to,
        ]
        .into_iter()
        .flatten()
        {
            *p = confiner.check(p).map_err(Error::Config)?;
        }
    }
    let net = match (req.tap_passed, passed.len(), &req.net) {
        (false, 0, spec) => spec.as_deref().map(NetConfig::parse).transpose()?,
        (true, 1, None) => {
            let tap = Tap::from_fd(passed[0].as_fd())?;
            Some(NetConfig {
                tap: TapSource::Open(std::sync::Arc::new(tap)),
                mac: None,
                netns: None,
            })
        }
        (true, _, Some(_)) => {
            return Err(Error::Config(
                "a request with tap_passed names no other TAP (net)".into(),
            ))
        }
        (true, n, None) => {
            return Err(Error::Config(format!(
                "tap_passed: the request must carry exactly one descriptor (the TAP), not {n}"
            )))
        }
        (false, n, _) => {
            return Err(Error::Config(format!(
                "{n} descriptors sent with a restore request that takes none (tap_passed)"
            )))
        }
    };
    let opened;
    let ahead = ahead.find(&req.snapshot);
    let prepared = match ahead {
        Some(p) => p,
        None => {
            opened = PreparedSnapshot::open(&req.snapshot, CpuCheck::default())?;
            &opened
        }
    };
    if confined.is_some()
        && prepared.disk().is_some_and(|d| !d.read_only)
        && req.disk_overlay.is_none()
    {
        return Err(Error::Config(
            "the snapshot has a disk: the request must name the VM's disk overlay".into(),
        ));
    }
    if let Some(log) = &req.log {
        made.place_log(log);
        redirect_stderr(log)?;
    }
    if let Some(serial) = &req.serial_file {
        made.place_serial(serial);
    }
    let options = RestoreOptions {
        serial: req
            .serial_file
            .clone()
            .map(SerialOutput::File)
            .unwrap_or(SerialOutput::Stdout),
        vsock_path: req.vsock.clone(),
        kvm_device: kvm_device.to_path_buf(),
        shell: shell.take(),
        agent_sync,
        working_set: req.working_set,
        working_set_to: req.working_set_to.clone(),
        disk_overlay: req.disk_overlay.clone(),
        net,
        vsock_bound_ahead: req.vsock.as_ref().and(made.vsock.take()),
        // A request through the control API has an answer to send once the VM runs:
        // until it is out (see `standby`), the vCPUs stay off the CPU this thread runs on.
        vcpu_cpus: if confined.is_some() {
            crate::vstate::vcpu::other_cpus_than_current()
        } else {
            Vec::new()
        },
        ..RestoreOptions::default()
    };
    let vm = prepared.restore(backend, options)?;
    let summary = vm.restore_report().map(|r| {
        format!(
            "restored {} ({} backend, shell {}, snapshot opened {}) in {:?}: {:?}",
            req.snapshot.display(),
            r.backend,
            if r.shell_reused { "pre-built" } else { "built" },
            if ahead.is_some() { "ahead" } else { "now" },
            r.total,
            r.steps
        )
    });
    Ok(Restored { vm, summary })
}

/// A VM [`restore_request`] made, and how its restore went.
pub struct Restored {
    /// The VM, running.
    pub vm: Vm,
    summary: Option<String>,
}

impl Restored {
    /// Logs how the restore went (one line with its steps). A standby does it once its
    /// answer is out: a log line appended to a file was measured at 0.05-0.5 ms here, on a
    /// filesystem busy with snapshots.
    pub fn log(&self) {
        if let Some(s) = &self.summary {
            tracing::info!("{s}");
        }
    }
}

/// Points this process's standard error (the VMM's log) at `path`, appended.
fn redirect_stderr(path: &PathBuf) -> Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::options()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|source| Error::Io {
            context: "opening the VM's log",
            source,
        })?;
    // SAFETY: dup2 onto descriptor 2 with a descriptor this function owns; both stay valid
    // for the call, and descriptor 2 is replaced atomically.
    if unsafe { libc::dup2(f.as_raw_fd(), libc::STDERR_FILENO) } < 0 {
        return Err(Error::Io {
            context: "redirecting standard error to the VM's log",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Clears a parent-death signal this process was started with: it holds a VM now, which
/// must outlive whoever started it.
fn clear_parent_death_signal() {
    // SAFETY: PR_SET_PDEATHSIG with 0 only changes this process's own attribute.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0) } != 0 {
        tracing::warn!(
            "clearing the parent-death signal: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checked before the snapshot is read: a request's passed descriptors must be what
    /// it says they are.
    #[test]
    fn a_passed_tap_must_be_exactly_the_one_descriptor_the_request_says() {
        let req = |tap_passed: bool, net: Option<&str>| RestoreRequest {
            tap_passed,
            net: net.map(String::from),
            ..RestoreRequest::new(PathBuf::from("/nonexistent/snapshot"))
        };
        let fd = || -> OwnedFd { std::fs::File::open("/dev/null").unwrap().into() };
        let kvm = Path::new("/dev/kvm");
        let err = |r: &RestoreRequest, fds: Vec<OwnedFd>| {
            restore_request(
                r,
                fds,
                kvm,
                &mut None,
                Some(None),
                &Ahead::default(),
                &mut MadeAhead::default(),
            )
            .err()
            .expect("refused")
            .to_string()
        };
        assert!(err(&req(true, None), vec![]).contains("exactly one"));
        assert!(err(&req(true, None), vec![fd(), fd()]).contains("exactly one"));
        assert!(err(&req(true, Some("tap=tap0")), vec![fd()]).contains("names no other TAP"));
        assert!(err(&req(false, None), vec![fd()]).contains("takes none"));
        // One descriptor as said, but not a TAP.
        assert!(err(&req(true, None), vec![fd()]).contains("TUNGETIFF"));
    }
}

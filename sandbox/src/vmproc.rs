//! VM processes: how the host starts, asks and stops the `clade` process behind a sandbox.
//!
//! Each sandbox is its own VM process (`clade restore SNAPSHOT --api-sock … --vsock …`), so
//! a VM that crashes, or is jailed, is one sandbox's business. The host talks to it through
//! its control API socket (`vmm::api`: snapshot, fork, shutdown) and never holds a VM in
//! its own address space. [`VmDriver`] is that boundary; [`ProcessDriver`] is the real one,
//! and the lifecycle's tests use their own.
//!
//! A VM process is identified by its pid *and* its API socket path (which is on its command
//! line): after a service restart the pid alone could name an unrelated process.
//!
//! With standby processes ([`standby`]), a start takes a process that was started ahead of
//! time and has its VM shell built, and sends it one `restore` request; only when none is
//! ready does it start `clade restore` itself.
//!
//! A sandbox whose memory was dropped (a filesystem-only pause, a reboot on resume) has no
//! snapshot to restore: its start boots the template's kernel from the sandbox's own disk
//! (`clade run`, [`StartSpec::boot`]) and is ready once its agent answers.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm::api::{ApiClient, Request, RestoreRequest};

use crate::error::{Error, Result};

pub mod confine;
pub mod jail;
pub mod limits;
pub mod standby;

pub use confine::BuildConfinement;
pub use jail::{JailConfig, Jails};
pub use limits::{LimitsConfig, VmCgroups};
pub use standby::{Shape, StandbyConfig, StandbyPool};

/// What a new VM process starts from and where its files go.
#[derive(Debug, Clone)]
pub struct StartSpec {
    /// The snapshot to restore: its directory, or with `fetcher`, a published snapshot's id.
    /// Unused when `boot` is given.
    pub snapshot: PathBuf,
    /// Boot this kernel instead of restoring a snapshot, with `disk_overlay` (which must
    /// exist) as the guest's disk, written in place.
    pub boot: Option<crate::template::BootFiles>,
    /// Attach the test device (a boot of the project's bare-metal test guest).
    pub test_device: bool,
    /// Restore a published snapshot through the host's fetcher at this socket.
    pub fetcher: Option<PathBuf>,
    /// A local snapshot whose disk stands on layers read lazily from the store: the
    /// host's fetcher at this socket fills them.
    pub layer_fetcher: Option<PathBuf>,
    /// Later starts will likely restore the same snapshot (a template's, or one that
    /// sandboxes are created from): standby processes may open it ahead.
    pub snapshot_reused: bool,
    /// Its control API socket.
    pub api_sock: PathBuf,
    /// The sandbox's own directory (its vsock, serial file, overlay and snapshots): handed
    /// over to the VM process's user when it is jailed.
    pub dir: PathBuf,
    /// Its vsock socket.
    pub vsock: PathBuf,
    /// Its serial console file.
    pub serial: PathBuf,
    /// Its stderr (the VMM's log; appended to).
    pub log: PathBuf,
    /// Snapshot and fork paths it accepts through its API must be under this directory.
    pub files_root: PathBuf,
    /// Its own disk overlay (snapshots with a disk).
    pub disk_overlay: Option<PathBuf>,
    /// Give the guest agent the time and fresh entropy after the restore.
    pub agent_sync: bool,
    /// The snapshot's vCPUs (which standby processes fit it).
    pub vcpus: u32,
    /// The snapshot's memory in MiB.
    pub mem_mib: u64,
    /// The TAP of a snapshot with a network device, as `--net` takes it.
    pub net: Option<String>,
    /// That TAP, opened ahead: the VM process gets a duplicate of its descriptor and
    /// does not open `net` itself.
    pub tap: Option<Arc<vmm::Tap>>,
}

/// A started VM process.
#[derive(Debug, Clone, PartialEq)]
pub struct Started {
    /// Its pid.
    pub pid: i32,
    /// Its control API socket: the spec's, or a standby process's own (which its command
    /// line names, see [`standby`]).
    pub api_sock: PathBuf,
}

/// A child of a fork, as the parent VM reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct ForkedChild {
    /// Its process.
    pub pid: i32,
    /// Its control API socket.
    pub api_sock: PathBuf,
    /// Its vsock socket.
    pub vsock: Option<PathBuf>,
    /// Its disk overlay.
    pub disk: Option<PathBuf>,
}

/// Starting, asking and stopping VM processes.
pub trait VmDriver: Send + Sync {
    /// Starts a VM process from a snapshot; returns once its API answers.
    fn start(&self, spec: &StartSpec) -> Result<Started>;
    /// Snapshots the VM into `dir`: a diff on the VM's last snapshot when `diff` (an error
    /// if it has none), else full. The VM keeps running.
    fn snapshot(&self, api_sock: &Path, dir: &Path, diff: bool) -> Result<()>;
    /// Memory files of the VM's last snapshot (itself and its bases; a diff on it adds
    /// one), if it has one and says so.
    fn snapshot_layers(&self, _api_sock: &Path) -> Option<usize> {
        None
    }
    /// A hint: a VM of this shape will likely be started from `snapshot` soon (a paused
    /// sandbox's), so a process kept ready may open it ahead. Best effort, no answer.
    fn open_ahead(&self, _vcpus: u32, _mem_mib: u64, _snapshot: &Path) {}
    /// Pauses (`running` false) or unpauses the VM's vCPUs.
    fn set_vcpus_running(&self, api_sock: &Path, running: bool) -> Result<()>;
    /// Stops the VM process (API shutdown, then SIGKILL if it does not end in time) and
    /// waits until it is gone.
    fn stop(&self, pid: i32, api_sock: &Path) -> Result<()>;
    /// Forks the VM into `count` children with their files under `prefix`; a VM with a
    /// network device gets one TAP per child in `nets` (`--net` specs).
    fn fork(
        &self,
        api_sock: &Path,
        count: usize,
        prefix: &Path,
        agent_sync: bool,
        nets: &[String],
    ) -> Result<Vec<ForkedChild>>;
    /// `None` while the VM process runs; why not otherwise (exit status, or "gone").
    fn exited(&self, pid: i32, api_sock: &Path) -> Option<String>;
    /// Whether the "guest" is this host itself (the test harness, `crate::hostagent`): its
    /// ports are then the host's loopback ports.
    fn guest_is_host(&self) -> bool {
        false
    }
    /// Whether VM processes are jailed, each as a user of its own ([`jail`]): a fork then
    /// goes through a snapshot, each child a VM process (and user) of its own.
    fn jailed(&self) -> bool {
        false
    }
    /// The process that holds the VM of the VM process `pid` this driver started (the one
    /// in its jail when jailed, `pid` itself otherwise): where the sandbox's CPU time and
    /// memory are read.
    fn vm_process(&self, pid: i32) -> i32 {
        pid
    }
    /// Before a jailed VM writes into `dir` (a fork's directory): hands it to the user of
    /// the VM whose sandbox directory is `owner_dir`.
    fn lend_dir(&self, _dir: &Path, _owner_dir: &Path) -> Result<()> {
        Ok(())
    }
    /// After a jailed VM wrote the snapshot `snapshot` that other sandboxes' VMs restore (a
    /// fork's base, a persistent snapshot): makes it, the snapshots its memory stands on
    /// and the frozen disk layers under it in `top` readable by them.
    fn share_snapshot(&self, _snapshot: &Path, _top: &Path) -> Result<()> {
        Ok(())
    }
    /// After the VM of the sandbox whose directory is `dir` ended (a kill, a pause): the
    /// working set it recorded for a snapshot it could not write into (a template, for a
    /// jailed VM) becomes that snapshot's, so that later restores of it prefetch their
    /// memory instead of faulting it in page by page. Best effort (logged).
    fn adopt_working_set(&self, _dir: &Path) {}
}

/// How long a new VM process may take until its API answers.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a booted VM's agent may take to answer (a Linux boot, nested under emulation
/// on the test machines).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a VM process may take to end after an API shutdown before it is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The real driver: VM processes are `clade restore` children of this process, started
/// on demand or ahead of time (standby processes).
pub struct ProcessDriver {
    clade: PathBuf,
    /// VM processes this process started (reaped here; others are watched through /proc).
    children: Mutex<HashMap<i32, Child>>,
    /// Standby processes, when enabled.
    standby: Mutex<Option<StandbyPool>>,
    /// A cgroup per VM process, unless limits are off.
    cgroups: Option<Arc<VmCgroups>>,
    /// A jail per VM process, unless jails are off.
    jails: Option<Arc<Jails>>,
    /// Jailed VMs recording a working set for a snapshot they may not write (a template):
    /// the snapshot, by the sandbox directory the recording goes to
    /// ([`VmDriver::adopt_working_set`]).
    recording: Mutex<HashMap<PathBuf, PathBuf>>,
}

impl ProcessDriver {
    /// A driver that starts VMs with the `clade` executable at `clade`, each when asked.
    pub fn new(clade: PathBuf) -> Self {
        Self {
            clade,
            children: Mutex::new(HashMap::new()),
            standby: Mutex::new(None),
            recording: Mutex::new(HashMap::new()),
            cgroups: None,
            jails: None,
        }
    }

    /// A driver that keeps standby processes ready as `cfg` says (see [`standby`]), each
    /// VM process in a cgroup of `cfg.cgroups` when it has them.
    pub fn with_standby(clade: PathBuf, cfg: StandbyConfig) -> Result<Self> {
        let cgroups = cfg.cgroups.clone();
        let jails = cfg.jails.clone();
        let pool = StandbyPool::new(clade.clone(), cfg)?;
        Ok(Self {
            clade,
            children: Mutex::new(HashMap::new()),
            standby: Mutex::new(Some(pool)),
            recording: Mutex::new(HashMap::new()),
            cgroups,
            jails,
        })
    }

    /// This driver, each VM process it starts jailed by `jails` (see [`jail`]).
    pub fn jailed_by(mut self, jails: Arc<Jails>) -> Self {
        self.jails = Some(jails);
        self
    }

    /// This driver, each VM process it starts in a cgroup of `cgroups` (see [`limits`]).
    pub fn limited(mut self, cgroups: Arc<VmCgroups>) -> Self {
        self.cgroups = Some(cgroups);
        self
    }

    /// Ends the ready standby processes and stops making new ones (sandboxes' VM processes
    /// are not touched). Called when the service stops; dropping the driver does it too.
    pub fn stop_standby(&self) {
        let pool = self
            .standby
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(pool);
    }

    /// The standby pool, if there is one.
    pub fn with_pool<T>(&self, f: impl FnOnce(&StandbyPool) -> T) -> Option<T> {
        self.standby
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(f)
    }

    /// Restores `spec` in a ready standby process of its shape. `Ok(None)`: there is none,
    /// or it did not answer (it is discarded): start one the usual way.
    fn start_standby(&self, spec: &StartSpec) -> Result<Option<Started>> {
        let shape = Shape {
            vcpus: spec.vcpus,
            mem_mib: spec.mem_mib,
        };
        let taken = self.with_pool(|pool| {
            (pool.files_root() == spec.files_root)
                .then(|| {
                    pool.take(
                        shape,
                        spec.snapshot_reused.then_some(spec.snapshot.as_path()),
                        &spec.snapshot,
                    )
                })
                .flatten()
        });
        let Some(sb) = taken.flatten() else {
            return Ok(None);
        };
        let t_hand = Instant::now();
        // A wake in the standby that opened its snapshot ahead: the sandbox's directory was
        // handed to this standby's user then (see `StandbyPool::open_ahead`), and nothing
        // was written into it since (the sandbox is paused).
        let handed_ahead = sb.asked.contains(&spec.snapshot) && sb.handed.contains(&spec.snapshot);
        if let (Some(lease), false) = (&sb.jail, handed_ahead) {
            if let Err(e) = self.hand_over(spec, lease.uid) {
                sb.discard();
                return Err(e);
            }
        }
        let hand_us = t_hand.elapsed().as_micros() as u64;
        // A TAP opened ahead goes with the request (its descriptor, SCM_RIGHTS).
        let req = Request::Restore(RestoreRequest {
            working_set_to: self.working_set_to(spec),
            vsock: Some(spec.vsock.clone()),
            serial_file: Some(spec.serial.clone()),
            disk_overlay: spec.disk_overlay.clone(),
            log: Some(spec.log.clone()),
            agent_sync: spec.agent_sync,
            net: if spec.tap.is_some() {
                None
            } else {
                spec.net.clone()
            },
            tap_passed: spec.tap.is_some(),
            ..RestoreRequest::new(spec.snapshot.clone())
        });
        let fds: Vec<_> = spec.tap.iter().map(|t| t.as_fd()).collect();
        let t = Instant::now();
        sb.run_at_normal_priority();
        let prio_us = t.elapsed().as_micros() as u64;
        let answer = ApiClient::connect(&sb.api_sock).and_then(|mut c| c.call_with_fds(&req, &fds));
        match answer {
            Ok(r) if r.ok => {
                tracing::info!(
                    pid = sb.child.id(),
                    restore_us = ?r.fields.get("restored").and_then(|x| x.get("us")),
                    call_us = t.elapsed().as_micros() as u64,
                    hand_us,
                    prio_us,
                    "restored in a standby VM process"
                );
                let mut sb = sb;
                let pid = sb.child.id() as i32;
                // Its start-up log: from the restore on it writes the sandbox's. Removed
                // by the pool's thread, off the request's path.
                let log = std::mem::take(&mut sb.log);
                self.with_pool(|pool| pool.remove_later(log));
                let api_sock = std::mem::take(&mut sb.api_sock);
                if let Some(j) = sb.cgroup.take() {
                    j.adopt(&api_sock);
                }
                self.children().insert(pid, sb.child);
                Ok(Some(Started { pid, api_sock }))
            }
            // The restore itself failed: `clade restore` would fail the same way.
            Ok(r) => {
                sb.discard();
                Err(Error::Vm(format!(
                    "restore {}: {}",
                    spec.snapshot.display(),
                    r.error.unwrap_or_else(|| "no reason given".into())
                )))
            }
            Err(e) => {
                tracing::warn!("standby process {} did not answer: {e}", sb.child.id());
                sb.discard();
                Ok(None)
            }
        }
    }

    /// Hands the sandbox directory of `spec` to the jailed VM process of user `uid` (and
    /// makes a template's snapshot readable, in case it was built since the service
    /// started: its files are written `0600`; likewise the kernel and initramfs of a boot).
    fn hand_over(&self, spec: &StartSpec, uid: u32) -> Result<()> {
        if let Some(j) = &self.jails {
            let shared = match &spec.boot {
                Some(b) => b.kernel.parent().unwrap_or(&b.kernel),
                None => &spec.snapshot,
            };
            if j.reads(shared) {
                jail::share_tree(shared)?;
            }
        }
        jail::hand_over(&spec.dir, uid)
    }

    /// Where the jailed VM restoring `spec` records its working set, when the snapshot has
    /// none yet and lies outside the sandbox's directory (a template, a persistent
    /// snapshot: read-only to it): its own directory, from which the working set is adopted
    /// once the VM ended ([`VmDriver::adopt_working_set`]). Unjailed, the VM writes it next
    /// to the snapshot itself.
    fn working_set_to(&self, spec: &StartSpec) -> Option<PathBuf> {
        if self.jails.is_none()
            || spec.boot.is_some()
            || spec.snapshot.starts_with(&spec.dir)
            || spec.snapshot.join(vmm::WORKING_SET_FILE).exists()
        {
            return None;
        }
        let to = spec.dir.join(vmm::WORKING_SET_FILE);
        self.recording
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(spec.dir.clone(), spec.snapshot.clone());
        Some(to)
    }

    fn children(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Child>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn api_call(api_sock: &Path, op: &'static str, req: &Request) -> Result<vmm::api::Response> {
    let mut c = ApiClient::connect(api_sock).map_err(|e| Error::VmApi {
        op,
        message: e.to_string(),
    })?;
    let r = c.call(req).map_err(|e| Error::VmApi {
        op,
        message: e.to_string(),
    })?;
    if !r.ok {
        return Err(Error::VmApi {
            op,
            message: r.error.unwrap_or_else(|| "no reason given".into()),
        });
    }
    Ok(r)
}

/// The last lines of a VM's log, for an error message.
pub(crate) fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// Whether `pid` is a live process whose command line names `api_sock`: one of its threads
/// has not ended. A process whose main thread ended shows as a zombie (with an empty command
/// line) while its other threads still run or are still ending, and its files (a VM's
/// TAP, which another process can open only once it is closed) are closed by the last of
/// them: so each thread is looked at, not only the main one (see [`thread_alive`]).
pub fn process_alive(pid: i32, api_sock: &Path) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let want = api_sock.as_os_str().as_encoded_bytes();
    tasks.flatten().any(|task| {
        let dir = task.path();
        let Ok(stat) = std::fs::read_to_string(dir.join("stat")) else {
            return false;
        };
        let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
        thread_alive(&stat, &cmdline, want)
    })
}

/// The kernel's `PF_EXITING` and `PF_KTHREAD` task flags (`include/linux/sched.h`).
const PF_EXITING: u64 = 0x4;
const PF_KTHREAD: u64 = 0x0020_0000;

/// One thread of [`process_alive`], from its `/proc/PID/task/TID/stat` and `cmdline`: not a
/// zombie, and either its command line names the API socket (`want`) or it is a user
/// thread on its way out (`PF_EXITING`). An exiting thread releases its memory before its
/// files, so for a while its command line reads empty although it still holds the VM's
/// TAP; a process that took the pid since would have to be exiting at that very moment to
/// be mistaken for the VM, and is then gone a moment later.
fn thread_alive(stat: &str, cmdline: &[u8], want: &[u8]) -> bool {
    // The fields after the command name, which may itself hold ')'.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next().unwrap_or("Z");
    if state.starts_with('Z') || state.starts_with('X') {
        return false;
    }
    // state, ppid, pgrp, session, tty_nr, tpgid, flags.
    let flags = fields
        .nth(5)
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0);
    cmdline.split(|b| *b == 0).any(|arg| arg == want)
        || (flags & PF_EXITING != 0 && flags & PF_KTHREAD == 0)
}

/// Puts the calling thread at idle priority (`SCHED_IDLE`: it runs on CPU time nothing else
/// wants), for the service's background work (starting standby processes, making
/// directories ahead). Processes it starts run at normal priority (`SCHED_RESET_ON_FORK`)
/// unless started with [`start_at_idle_priority`].
pub(crate) fn run_at_idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sets the calling thread's policy; `param` is a valid struct.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE | libc::SCHED_RESET_ON_FORK, &param) };
}

/// Makes the process `cmd` starts run at idle priority (`SCHED_IDLE`), and the threads it
/// starts too (those that reset their own policy aside): a standby process builds its VM
/// shell and opens snapshots on CPU time nothing else wants. Started at normal priority, a
/// replacement standby building its shell took the CPU the standby serving the next
/// request was woken on, and that request's restore began ~1 ms late (a scheduler trace
/// of `clade bench serve`). [`run_at_normal_priority`] lifts it when the process is taken.
pub(crate) fn start_at_idle_priority(cmd: &mut Command) {
    start_with_policy(cmd, libc::SCHED_IDLE);
}

/// Makes the process `cmd` starts run at normal priority (`SCHED_OTHER`) although started
/// by a thread at idle priority (`SCHED_IDLE` is inherited): a standby whose cgroup is
/// the idle one instead ([`standby`]).
pub(crate) fn start_at_normal_priority(cmd: &mut Command) {
    start_with_policy(cmd, libc::SCHED_OTHER);
}

fn start_with_policy(cmd: &mut Command, policy: libc::c_int) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and makes one
    // async-signal-safe call (sched_setscheduler on itself), allocating nothing.
    unsafe {
        cmd.pre_exec(move || {
            let param = libc::sched_param { sched_priority: 0 };
            if libc::sched_setscheduler(0, policy, &param) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
}

/// Puts the main thread of process `pid` (a child of this process, not yet reaped, or
/// the VM process in its jail) at normal priority (`SCHED_OTHER`): a standby taken for a
/// request. Best effort: a refusal is logged and the request goes on, slower under load.
pub(crate) fn run_at_normal_priority(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sets the policy of thread `pid` (this process's unreaped child, or a thread
    // of the jailed VM process below it; at worst a thread that just ended and whose ID
    // was reused gets normal priority, nothing more); `param` is a valid struct.
    if unsafe { libc::sched_setscheduler(pid, libc::SCHED_OTHER, &param) } != 0 {
        tracing::debug!(
            "standby {pid} stays at idle priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Makes the process `cmd` starts end (SIGKILL) when this one does, however it ends:
/// for processes that must not outlive their owner (a standby nobody can hand out, a VM
/// whose network its owner holds). A start after this process ended fails instead.
pub fn end_with_this_process(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec and only makes
    // async-signal-safe calls (prctl, getppid), allocating nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Its owner ended before the signal was set: nobody would send it.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("its owner has ended"));
            }
            Ok(())
        })
    };
}

/// Lets the process `cmd` starts inherit descriptor `fd` (open in this process, with
/// close-on-exec) under the same number: the flag is cleared in the child only, between
/// fork and exec, so no other process started meanwhile gets it.
pub fn inherit_descriptor(cmd: &mut Command, fd: std::os::fd::RawFd) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and makes one
    // async-signal-safe call (fcntl on the child's copy of `fd`), allocating nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
}

/// What a sandbox's VM process logs (a `CLADE_LOG` filter) when the service has none.
pub(crate) const VM_LOG_FILTER: &str = "info,virtio_queue=off";

impl VmDriver for ProcessDriver {
    fn start(&self, spec: &StartSpec) -> Result<Started> {
        if spec.fetcher.is_none() && spec.layer_fetcher.is_none() && spec.boot.is_none() {
            if let Some(started) = self.start_standby(spec)? {
                return Ok(started);
            }
        }
        // Appended: the log of a sandbox's earlier runs (before a pause) stays readable.
        let log = File::options()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&spec.log)
            .map_err(Error::io("creating", &spec.log))?;
        let mut cmd = Command::new(&self.clade);
        vmm::host::clean_child(&mut cmd);
        match &spec.boot {
            Some(b) => {
                cmd.arg("run")
                    .arg("--kernel")
                    .arg(&b.kernel)
                    .arg("--cmdline")
                    .arg(&b.cmdline)
                    .arg("--vcpus")
                    .arg(spec.vcpus.to_string())
                    .arg("--mem")
                    .arg(spec.mem_mib.to_string());
                if let Some(i) = &b.initrd {
                    cmd.arg("--initrd").arg(i);
                }
                if let Some(d) = &spec.disk_overlay {
                    cmd.arg("--disk").arg(d);
                }
                if spec.test_device {
                    cmd.arg("--test-device");
                }
            }
            None => {
                cmd.arg("restore").arg(&spec.snapshot);
                if let Some(d) = &spec.disk_overlay {
                    cmd.arg("--disk-overlay").arg(d);
                }
                if !spec.agent_sync {
                    cmd.arg("--no-agent-sync");
                }
                if let Some(w) = self.working_set_to(spec) {
                    cmd.arg("--working-set-to").arg(w);
                }
            }
        }
        cmd.arg("--api-sock")
            .arg(&spec.api_sock)
            .arg("--vsock")
            .arg(&spec.vsock)
            .arg("--serial-file")
            .arg(&spec.serial)
            .arg("--files-root")
            .arg(&spec.files_root);
        if let Some(f) = &spec.fetcher {
            cmd.arg("--fetcher").arg(f);
        }
        if let Some(f) = &spec.layer_fetcher {
            cmd.arg("--layer-fetcher").arg(f);
        }
        match (&spec.tap, &spec.net) {
            (Some(tap), _) => {
                let fd = tap.as_fd().as_raw_fd();
                cmd.arg("--net").arg(format!("fd={fd}"));
                inherit_descriptor(&mut cmd, fd);
            }
            (None, Some(n)) => {
                cmd.arg("--net").arg(n);
            }
            (None, None) => {}
        }
        // A VM restored through the store's fetcher is jailed too: it is connected to the
        // fetcher before the jail and sees only its snapshot's files in the cache.
        if let Some(j) = &self.jails {
            let lease = j.prepare(&mut cmd, &format!("vm-{}", crate::ids::random_string(16)))?;
            self.hand_over(spec, lease.uid)?;
        }
        // The VMM's info lines (restore steps and times) are the sandbox's log (the logs
        // endpoint), unless the service was started with its own CLADE_LOG.
        if std::env::var_os("CLADE_LOG").is_none() {
            cmd.env("CLADE_LOG", VM_LOG_FILTER);
        }
        // Its own process group: a Ctrl-C meant for the service does not stop sandboxes.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let shape = Shape {
            vcpus: spec.vcpus,
            mem_mib: spec.mem_mib,
        };
        let joining = self
            .cgroups
            .as_ref()
            .map(|cg| cg.join_new(&mut cmd, shape))
            .transpose()?;
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(Error::io("starting", &self.clade))?;
        // From here on its cgroup is released when it ends.
        if let Some(j) = joining {
            j.adopt(&spec.api_sock);
        }
        let pid = child.id() as i32;
        let t = Instant::now();
        let what = match &spec.boot {
            Some(b) => format!("clade run (a boot of {})", b.kernel.display()),
            None => format!("clade restore {}", spec.snapshot.display()),
        };
        // From a store: its chunks come through the fetcher (whose requests each have
        // their own limit), which may be slow on a loaded host. A boot is ready once its
        // agent answers, after the guest's whole boot.
        let limit = if spec.boot.is_some() {
            BOOT_TIMEOUT
        } else if spec.fetcher.is_some() {
            START_TIMEOUT * 4
        } else {
            START_TIMEOUT
        };
        let mut api_ready = false;
        let failed = |child: &mut Child, why: String| {
            let _ = child.kill();
            let _ = child.wait();
            if let Some(cg) = &self.cgroups {
                cg.release(&spec.api_sock);
            }
            Err(Error::Vm(format!("{what}: {why}: {}", log_tail(&spec.log))))
        };
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return failed(&mut child, format!("ended ({status})"));
            }
            if !api_ready && spec.api_sock.exists() {
                if let Ok(mut c) = ApiClient::connect(&spec.api_sock) {
                    api_ready = c.call(&Request::Status).is_ok_and(|r| r.ok);
                }
            }
            if api_ready {
                if spec.boot.is_none() {
                    break;
                }
                let probe = Duration::from_millis(200);
                if vmm::agent::probe(&spec.vsock, vmm::agent::Transport::Auto, probe).is_ok() {
                    tracing::info!(pid, elapsed = ?t.elapsed(), "booted: its agent answers");
                    break;
                }
            }
            if t.elapsed() > limit {
                let waited = if api_ready { "its agent" } else { "its API" };
                return failed(
                    &mut child,
                    format!("{waited} not answering after {limit:?}"),
                );
            }
            std::thread::sleep(Duration::from_micros(if api_ready { 20_000 } else { 100 }));
        }
        self.children().insert(pid, child);
        Ok(Started {
            pid,
            api_sock: spec.api_sock.clone(),
        })
    }

    fn snapshot(&self, api_sock: &Path, dir: &Path, diff: bool) -> Result<()> {
        api_call(
            api_sock,
            "snapshot",
            &Request::Snapshot {
                dir: dir.to_path_buf(),
                kind: if diff { "diff" } else { "full" }.into(),
            },
        )
        .map(|_| ())
    }

    fn snapshot_layers(&self, api_sock: &Path) -> Option<usize> {
        let r = api_call(api_sock, "status", &Request::Status).ok()?;
        r.fields
            .get("last_snapshot")?
            .get("layers")?
            .as_u64()
            .map(|n| n as usize)
    }

    fn open_ahead(&self, vcpus: u32, mem_mib: u64, snapshot: &Path) {
        self.with_pool(|pool| pool.open_ahead(Shape { vcpus, mem_mib }, snapshot));
    }

    fn set_vcpus_running(&self, api_sock: &Path, running: bool) -> Result<()> {
        if running {
            api_call(api_sock, "unpause", &Request::Unpause)
        } else {
            api_call(api_sock, "pause", &Request::Pause)
        }
        .map(|_| ())
    }

    fn stop(&self, pid: i32, api_sock: &Path) -> Result<()> {
        if self.exited(pid, api_sock).is_some() {
            return Ok(());
        }
        if let Err(e) = api_call(api_sock, "shutdown", &Request::Shutdown) {
            tracing::warn!("pid {pid}: {e}; killing it");
        }
        let t = Instant::now();
        while self.exited(pid, api_sock).is_none() {
            if t.elapsed() > STOP_TIMEOUT {
                tracing::warn!("pid {pid} did not end after shutdown; killing it");
                if let Some(mut child) = self.children().remove(&pid) {
                    let _ = child.kill();
                    let _ = child.wait();
                } else if process_alive(pid, api_sock) {
                    nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    )
                    .map_err(|e| Error::Vm(format!("killing pid {pid}: {e}")))?;
                }
                let t2 = Instant::now();
                while self.exited(pid, api_sock).is_none() {
                    if t2.elapsed() > STOP_TIMEOUT {
                        return Err(Error::Vm(format!("pid {pid} does not end")));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    fn fork(
        &self,
        api_sock: &Path,
        count: usize,
        prefix: &Path,
        agent_sync: bool,
        nets: &[String],
    ) -> Result<Vec<ForkedChild>> {
        let r = api_call(
            api_sock,
            "fork",
            &Request::Fork {
                count,
                prefix: Some(prefix.to_path_buf()),
                agent_sync,
                nets: nets.to_vec(),
            },
        )?;
        let bad = |what: &str| Error::VmApi {
            op: "fork",
            message: format!("answer without {what}"),
        };
        let children = r
            .fields
            .get("children")
            .and_then(|c| c.as_array())
            .ok_or_else(|| bad("children"))?;
        let path =
            |c: &serde_json::Value, k: &str| c.get(k).and_then(|v| v.as_str()).map(PathBuf::from);
        let children: Vec<ForkedChild> = children
            .iter()
            .map(|c| {
                Ok(ForkedChild {
                    pid: c
                        .get("pid")
                        .and_then(|p| p.as_i64())
                        .and_then(|p| i32::try_from(p).ok())
                        .ok_or_else(|| bad("a child's pid"))?,
                    api_sock: path(c, "api_sock").ok_or_else(|| bad("a child's api_sock"))?,
                    vsock: path(c, "vsock"),
                    disk: path(c, "disk"),
                })
            })
            .collect::<Result<_>>()?;
        if let Some(cg) = &self.cgroups {
            for c in &children {
                cg.adopt_child(api_sock, &c.api_sock, c.pid);
            }
        }
        Ok(children)
    }

    fn jailed(&self) -> bool {
        self.jails.is_some()
    }

    fn vm_process(&self, pid: i32) -> i32 {
        if self.jails.is_none() {
            return pid;
        }
        u32::try_from(pid)
            .ok()
            .and_then(jail::jailed_vm_process)
            .and_then(|p| i32::try_from(p).ok())
            .unwrap_or(pid)
    }

    fn lend_dir(&self, dir: &Path, owner_dir: &Path) -> Result<()> {
        if self.jails.is_none() {
            return Ok(());
        }
        use std::os::unix::fs::MetadataExt;
        let uid = std::fs::metadata(owner_dir)
            .map_err(Error::io("reading", owner_dir))?
            .uid();
        jail::hand_over(dir, uid)
    }

    fn share_snapshot(&self, snapshot: &Path, top: &Path) -> Result<()> {
        if self.jails.is_none() {
            return Ok(());
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(snapshot)
            .map_err(Error::io("reading", snapshot))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        let prepared = vmm::PreparedSnapshot::open(snapshot, vmm::CpuCheck::default())
            .map_err(|e| Error::Vm(format!("snapshot {}: {e}", snapshot.display())))?;
        // A diff's memory stands on the snapshots below it (a paused sandbox's earlier
        // pauses): readers need those files too.
        for dir in prepared.chain_dirs() {
            files.extend(
                std::fs::read_dir(dir)
                    .map_err(Error::io("reading", dir))?
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.is_file()),
            );
        }
        if let Some(d) = prepared.disk() {
            let layers = disk::ops::info(&d.layer)
                .map_err(|e| Error::Vm(format!("disk of {}: {e}", snapshot.display())))?;
            files.extend(layers.into_iter().map(|l| l.path));
        }
        jail::share_files(top, &files)
    }

    fn adopt_working_set(&self, dir: &Path) {
        let Some(snapshot) = self
            .recording
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(dir)
        else {
            return;
        };
        match jail::adopt_working_set(&dir.join(vmm::WORKING_SET_FILE), &snapshot) {
            Ok(Some(pages)) => tracing::info!(
                snapshot = %snapshot.display(),
                pages,
                "working set recorded by a jailed VM installed"
            ),
            Ok(None) => {}
            Err(e) => tracing::warn!("{e}"),
        }
    }

    fn exited(&self, pid: i32, api_sock: &Path) -> Option<String> {
        let mut why = self.process_exited(pid, api_sock);
        if let (Some(w), Some(cg)) = (&mut why, &self.cgroups) {
            if let Some(killed) = cg.killed_for(api_sock) {
                w.push_str(": ");
                w.push_str(&killed);
            }
            cg.release(api_sock);
        }
        why
    }
}

impl ProcessDriver {
    fn process_exited(&self, pid: i32, api_sock: &Path) -> Option<String> {
        let mut children = self.children();
        if let Some(child) = children.get_mut(&pid) {
            return match child.try_wait() {
                Ok(None) => None,
                Ok(Some(status)) => {
                    children.remove(&pid);
                    Some(format!("VM process {pid} {status}"))
                }
                Err(e) => Some(format!("VM process {pid}: {e}")),
            };
        }
        drop(children);
        (!process_alive(pid, api_sock)).then(|| format!("VM process {pid} is gone"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_needs_the_socket_on_the_command_line() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        // Until the exec, the child's command line is still this test's.
        let t = Instant::now();
        while !process_alive(pid, Path::new("30")) {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "sleep never showed up"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!process_alive(pid, Path::new("/some/other.api")));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!process_alive(pid, Path::new("30")));
        assert!(!process_alive(-1, Path::new("30")));
    }

    /// A thread on its way out, its memory (and so its command line) already released,
    /// is alive: it may still hold the VM's files. A zombie is not; nor is a kernel thread
    /// or a live thread of another program.
    #[test]
    fn an_exiting_thread_with_no_command_line_is_alive() {
        let want = b"/run/s/api.sock";
        let stat = |state: &str, flags: u64| {
            format!("4242 (vcpu 0) (x)) {state} 1 4242 4242 0 -1 {flags} 0 0 0 0 5 6 0 0 20 0 3")
        };
        let ours = b"clade\0run\0--api-sock\0/run/s/api.sock\0";
        assert!(thread_alive(&stat("S", 0x40), ours, want));
        assert!(thread_alive(&stat("R", 0x40 | PF_EXITING), b"", want));
        assert!(thread_alive(&stat("D", PF_EXITING), b"", want));
        assert!(!thread_alive(&stat("S", 0x40), b"", want));
        assert!(!thread_alive(&stat("S", 0x40), b"other\0program\0", want));
        assert!(!thread_alive(&stat("Z", PF_EXITING), ours, want));
        assert!(!thread_alive(&stat("X", 0), ours, want));
        assert!(!thread_alive(
            &stat("I", PF_KTHREAD | PF_EXITING),
            b"",
            want
        ));
        assert!(!thread_alive("", ours, want));
        assert!(!thread_alive("garbage", ours, want));
    }

    /// A process whose main thread ended while another runs on is alive (a zombie main
    /// thread, its command line empty), until that thread ends too.
    #[test]
    fn a_process_is_alive_while_any_of_its_threads_is() {
        let script = "import threading, time, ctypes\n\
                      threading.Thread(target=time.sleep, args=(1.0,)).start()\n\
                      ctypes.CDLL(None).pthread_exit(None)\n";
        let marker = Path::new("/clade-test/zombie-leader.api");
        let mut child = Command::new("python3")
            .args(["-c", script])
            .arg(marker)
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let leader_state = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.rsplit(')').next().unwrap_or("").trim_start().to_string())
                .unwrap_or_default()
        };
        let t = Instant::now();
        while !leader_state().starts_with('Z') {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the main thread never ended"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            process_alive(pid, marker),
            "main thread ended, the other runs: alive"
        );
        child.wait().unwrap();
        assert!(!process_alive(pid, marker));
    }

    #[test]
    fn a_vm_that_cannot_start_is_an_error_with_its_log() {
        let d = std::env::temp_dir().join(format!("sandbox-vmproc-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        // `false` ends at once: the driver reports it instead of waiting for a socket.
        let driver = ProcessDriver::new(PathBuf::from("false"));
        let spec = StartSpec {
            boot: None,
            test_device: false,
            snapshot: d.join("nosnap"),
            fetcher: None,
            layer_fetcher: None,
            snapshot_reused: false,
            api_sock: d.join("vm.api"),
            dir: d.clone(),
            vsock: d.join("vm.vsock"),
            serial: d.join("serial"),
            log: d.join("log"),
            files_root: d.clone(),
            disk_overlay: None,
            agent_sync: false,
            vcpus: 1,
            mem_mib: 64,
            net: None,
            tap: None,
        };
        let e = driver.start(&spec).unwrap_err();
        assert!(matches!(e, Error::Vm(_)), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}

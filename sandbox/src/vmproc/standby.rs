//! Standby VM processes: `clade restore --standby` processes started ahead of time, so that
//! a create or a resume finds a process that has already been exec'd, confined itself and
//! built its VM shell, and only has to restore into it (one control-API `restore` request).
//!
//! A [`StandbyPool`] keeps up to `per_shape` ready processes for each VM shape (vCPUs,
//! memory) it was told about or asked for. A background thread refills it after each take,
//! a little later ([`REFILL_DELAY`]) so that the new process does not compete for the CPU
//! with the request that just took one; a request never waits for a standby to start. A
//! standby runs at idle priority until a request takes it, so that one starting meanwhile
//! does not delay the requests that follow either: its cgroup is an idle one (`cpu.idle`)
//! where it has one, lifted by one write when taken; else each of its threads is
//! `SCHED_IDLE`, lifted one by one.
//!
//! Snapshots opened ahead: each standby of a shape opens the snapshot its creates restore
//! (a template; `--preload`) while it waits. When a sandbox pauses, one ready standby of
//! its shape is asked to open the new snapshot too ([`StandbyPool::open_ahead`]; a
//! `preload` request, a few at most per standby), and that sandbox's wake takes that
//! standby: the wake then skips reading the snapshot's state and memory files' layout
//! (~0.05 ms per file of its diff chain). Creates take standbys holding no such snapshot
//! first, so a pause's is kept for its wake.
//!
//! Identity: a standby's API socket is `<dir>/<token>.api` (a random token), named on its
//! command line, and stays its socket for the rest of its life, also once it is a sandbox's
//! VM: the registry records that path as the sandbox's API socket, so the liveness check
//! (`process_alive`: the pid's command line names the sandbox's API socket) holds as for
//! any VM process, and a reused pid is never mistaken for it.
//!
//! Lifetime: an unused standby ends with the service. Each one is started with a
//! parent-death signal (SIGKILL when the refill thread, and so the service, is gone), which
//! it clears once it holds a VM (a sandbox outlives the service). The pool shuts the ready
//! ones down when it is dropped, and a pool starting on `<dir>` ends whatever standbys an
//! earlier service left there (their sockets answer `status` with `"standby"`), keeping the
//! sockets of sandboxes.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm::api::{ApiClient, Request, Response};

use crate::error::{Error, Result};
use crate::ids;

/// Most standby processes per shape.
pub const MAX_PER_SHAPE: usize = 16;
/// How long the refill thread waits after a take before starting a process (while one
/// of the shape is still ready).
pub const REFILL_DELAY: Duration = Duration::from_millis(20);
/// Most standby processes the refill thread starts at once.
const MAX_STARTING: usize = 4;
/// How long a standby may take to answer, and a start that failed waits to be retried.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const RETRY_DELAY: Duration = Duration::from_secs(2);
/// How long the start-up sweep waits for an old socket's answer.
const SWEEP_TIMEOUT: Duration = Duration::from_secs(1);

/// A VM shape: what a standby's pre-built shell fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// vCPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub mem_mib: u64,
}

/// How a [`StandbyPool`] runs.
#[derive(Debug, Clone)]
pub struct StandbyConfig {
    /// Where the standbys' sockets and start-up logs go (`<state dir>/sandboxes/standby`:
    /// under `files_root`, so that what a jailed standby makes ahead there can be renamed
    /// into a sandbox's directory, on the same mount in its jail).
    pub dir: PathBuf,
    /// Ready processes kept per shape (1..=[`MAX_PER_SHAPE`]).
    pub per_shape: usize,
    /// The `--files-root` of every VM process (the sandboxes' directory).
    pub files_root: PathBuf,
    /// Shapes to fill at once (more are added when a start asks for them).
    pub shapes: Vec<Shape>,
    /// A cgroup per standby (and so per sandbox VM it becomes), unless limits are off.
    pub cgroups: Option<Arc<super::VmCgroups>>,
    /// A jail per standby (and so per sandbox VM it becomes), unless jails are off.
    pub jails: Option<Arc<super::Jails>>,
}

/// A ready standby process.
pub(crate) struct Standby {
    pub(crate) child: Child,
    pub(crate) api_sock: PathBuf,
    pub(crate) log: PathBuf,
    /// The snapshot it opened ahead at its start (`--preload`), with what its state file
    /// was then.
    pub(crate) preloaded: Option<(PathBuf, Option<FileId>)>,
    /// Snapshots it was asked to open ahead (`preload` requests), oldest first.
    pub(crate) asked: Vec<PathBuf>,
    /// Those of `asked` whose sandbox's directory was handed over to its jail's user at
    /// the ask (after the pause that wrote the snapshot): a wake restoring one of them in
    /// this standby has nothing left to hand over.
    pub(crate) handed: Vec<PathBuf>,
    /// Its cgroup, until a take hands it on with the process (removed with it otherwise).
    pub(crate) cgroup: Option<super::limits::Joining>,
    /// Idle by its cgroup (`cpu.idle`), its threads at normal priority; else its threads
    /// are at idle priority.
    pub(crate) idle_group: bool,
    /// Its jail, when jailed.
    pub(crate) jail: Option<super::jail::JailLease>,
    /// The process that holds the VM (`child` itself: a jail is one process).
    pub(crate) vm_pid: Option<u32>,
}

/// What tells one file at a path from the next one there: device and inode.
pub(crate) type FileId = (u64, u64);

/// The id of `snapshot`'s state file, if it has one.
fn state_file_id(snapshot: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(snapshot.join(vmm::STATE_FILE)).ok()?;
    Some((m.dev(), m.ino()))
}

impl Standby {
    /// Whether a snapshot it holds open was removed or replaced since it opened it (its
    /// template removed or built again, its paused sandbox killed or woken elsewhere): its
    /// open files then hold disk space that nothing else can use.
    fn holds_removed_files(&self) -> bool {
        self.preloaded
            .as_ref()
            .is_some_and(|(dir, id)| state_file_id(dir) != *id)
            || self.asked.iter().any(|d| state_file_id(d).is_none())
    }

    /// Puts the process that restores (the jailed VM process, or the standby itself) at
    /// normal priority: it was taken, or must end. A VM process puts each of its threads
    /// back at normal priority as it takes up work, but a jailed one may not (leaving
    /// `SCHED_IDLE` needs CAP_SYS_NICE, or an RLIMIT_NICE that only CAP_SYS_RESOURCE can
    /// raise): every thread of it is lifted here, before the request, so that the threads
    /// its restore starts begin at normal priority too.
    pub(crate) fn run_at_normal_priority(&self) {
        if self.idle_group {
            if let Some(cg) = &self.cgroup {
                if cg.set_idle(false) {
                    return;
                }
            }
        }
        super::run_at_normal_priority(self.child.id());
        if let Some(vm) = self.vm_pid {
            let tasks = std::fs::read_dir(format!("/proc/{vm}/task")).into_iter();
            for t in tasks.flatten().flatten() {
                if let Some(tid) = t.file_name().to_str().and_then(|n| n.parse().ok()) {
                    super::run_at_normal_priority(tid);
                }
            }
        }
    }

    /// Ends it (an API shutdown, then SIGKILL) and removes its files.
    pub(crate) fn discard(mut self) {
        // At idle priority it could take long to end on a busy host.
        self.run_at_normal_priority();
        let asked = ApiClient::connect(&self.api_sock)
            .and_then(|mut c| c.call(&Request::Shutdown))
            .is_ok_and(|r| r.ok);
        let t = Instant::now();
        while asked && t.elapsed() < Duration::from_secs(2) {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.api_sock);
        let _ = std::fs::remove_file(&self.log);
        if let Some(j) = &self.jail {
            let _ = std::fs::remove_dir(&j.root);
        }
        // Its cgroup goes with it (`Joining` removes the group when dropped).
    }
}

struct PoolState {
    ready: HashMap<Shape, Vec<Standby>>,
    /// Shapes kept filled, in the order they became known.
    shapes: Vec<Shape>,
    /// Shapes whose last start failed, and when.
    failed: HashMap<Shape, Instant>,
    /// Per shape, the snapshot its standbys open ahead: the last one taken for a
    /// restore that others are likely to repeat (a create from a template).
    preload: HashMap<Shape, PathBuf>,
    /// Files to remove, by the refill thread (off the paths of requests).
    trash: Vec<PathBuf>,
    last_take: Option<Instant>,
    stop: bool,
}

struct Inner {
    clade: PathBuf,
    cfg: StandbyConfig,
    state: Mutex<PoolState>,
    cv: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Ready standby processes per shape, refilled in the background (see the module docs).
pub struct StandbyPool {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl StandbyPool {
    /// Sweeps `cfg.dir` (standbys of an earlier service are ended) and starts the refill
    /// thread, which starts standbys of `clade` (the `clade` executable).
    pub fn new(clade: PathBuf, cfg: StandbyConfig) -> Result<StandbyPool> {
        if cfg.per_shape == 0 || cfg.per_shape > MAX_PER_SHAPE {
            return Err(Error::BadRequest(format!(
                "standby processes per shape: {} is not in 1..={MAX_PER_SHAPE}",
                cfg.per_shape
            )));
        }
        std::fs::create_dir_all(&cfg.dir).map_err(Error::io("creating", &cfg.dir))?;
        if cfg.jails.is_some() {
            // Jailed standbys, each its own user, make their sockets here: they may create
            // files, not list or remove others' (sticky).
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&cfg.dir, std::fs::Permissions::from_mode(0o1733))
                .map_err(Error::io("setting the mode of", &cfg.dir))?;
        }
        sweep(&cfg.dir)?;
        let mut shapes = Vec::new();
        for s in &cfg.shapes {
            if !shapes.contains(s) {
                shapes.push(*s);
            }
        }
        let inner = Arc::new(Inner {
            clade,
            cfg,
            state: Mutex::new(PoolState {
                ready: HashMap::new(),
                shapes,
                failed: HashMap::new(),
                preload: HashMap::new(),
                trash: Vec::new(),
                last_take: None,
                stop: false,
            }),
            cv: Condvar::new(),
        });
        let inner2 = Arc::clone(&inner);
        // The standbys' parent-death signal is this thread's: it lives as long as the pool.
        let thread = std::thread::Builder::new()
            .name("standby-refill".into())
            .spawn(move || refill(&inner2))
            .map_err(Error::io(
                "starting",
                Path::new("the standby refill thread"),
            ))?;
        Ok(StandbyPool {
            inner,
            thread: Some(thread),
        })
    }

    /// The files root its standbys were started with.
    pub fn files_root(&self) -> &Path {
        &self.inner.cfg.files_root
    }

    /// A ready standby of `shape`, if there is one; the shape is kept filled from now on.
    /// `again`: the snapshot this take restores, when later takes will likely restore it
    /// too: standbys of the shape started from now on open it ahead (`--preload`).
    /// `snapshot`: the one this take restores: a standby that opened it ahead is taken
    /// first; else one that holds no snapshot opened for a pause (see the module docs).
    pub(crate) fn take(
        &self,
        shape: Shape,
        again: Option<&Path>,
        snapshot: &Path,
    ) -> Option<Standby> {
        let mut st = self.inner.lock();
        if !st.shapes.contains(&shape) {
            st.shapes.push(shape);
        }
        if let Some(dir) = again {
            if st.preload.get(&shape).is_none_or(|d| d != dir) {
                st.preload.insert(shape, dir.to_path_buf());
            }
        }
        st.last_take = Some(Instant::now());
        let mut found = None;
        if let Some(list) = st.ready.get_mut(&shape) {
            // The preferred one goes to the end, where the search below starts.
            let best = list
                .iter()
                .position(|s| s.asked.iter().any(|d| d == snapshot))
                .or_else(|| list.iter().rposition(|s| s.asked.is_empty()));
            if let Some(i) = best {
                let s = list.remove(i);
                list.push(s);
            }
            while let Some(mut s) = list.pop() {
                // One that died meanwhile (killed from outside) is not handed out.
                match s.child.try_wait() {
                    Ok(None) => {
                        found = Some(s);
                        break;
                    }
                    _ => {
                        let _ = std::fs::remove_file(&s.api_sock);
                        let _ = std::fs::remove_file(&s.log);
                    }
                }
            }
        }
        drop(st);
        self.inner.cv.notify_all();
        found
    }

    /// Asks a ready standby of `shape` to open `snapshot` ahead (a paused sandbox's, for
    /// its wake; see the module docs): the one holding the fewest such snapshots, unless one
    /// holds it already. Best effort: a failure is logged, the wake then opens it itself.
    pub fn open_ahead(&self, shape: Shape, snapshot: &Path) {
        let mut st = self.inner.lock();
        let Some(list) = st.ready.get_mut(&shape) else {
            return;
        };
        if list.iter().any(|s| s.asked.iter().any(|d| d == snapshot)) {
            return;
        }
        let Some(i) = (0..list.len()).min_by_key(|&i| list[i].asked.len()) else {
            return;
        };
        // Out of the pool while it is asked (nobody takes it meanwhile), back after.
        let mut s = list.remove(i);
        drop(st);
        // Jailed, the sandbox's files are handed to this standby's user first: its wake
        // most likely takes this standby (any other one is handed them at its take).
        let sandbox_dir = snapshot
            .parent()
            .filter(|d| d.parent() == Some(self.inner.cfg.files_root.as_path()));
        let handed = match (&s.jail, sandbox_dir) {
            (Some(j), Some(dir)) => super::jail::hand_over(dir, j.uid)
                .inspect_err(|e| tracing::warn!("{e}"))
                .is_ok(),
            _ => false,
        };
        let asked = ApiClient::connect(&s.api_sock).and_then(|mut c| {
            c.call(&Request::Preload {
                snapshot: snapshot.to_path_buf(),
            })
        });
        match asked {
            Ok(r) if r.ok => {
                s.asked.retain(|d| d != snapshot);
                s.asked.push(snapshot.to_path_buf());
                // As many as the standby holds (it closes its oldest beyond that).
                while s.asked.len() > vmm::host::MAX_PRELOADED {
                    s.asked.remove(0);
                }
                // Only while it is one of `asked`: no other standby is asked for the same
                // snapshot (and handed its directory) meanwhile.
                s.handed.retain(|d| d != snapshot && s.asked.contains(d));
                if handed {
                    s.handed.push(snapshot.to_path_buf());
                }
            }
            Ok(r) => tracing::warn!(
                snapshot = %snapshot.display(),
                "a standby did not open the snapshot ahead: {}",
                r.error.unwrap_or_default()
            ),
            Err(e) => tracing::warn!(
                snapshot = %snapshot.display(),
                "asking a standby to open the snapshot ahead: {e}"
            ),
        }
        let mut st = self.inner.lock();
        if st.stop {
            drop(st);
            s.discard();
            return;
        }
        // At the front: a take without a preference starts from the end.
        st.ready.entry(shape).or_default().insert(0, s);
        drop(st);
        self.inner.cv.notify_all();
    }

    /// Removes `path` soon, from the pool's own thread (a taken standby's start-up log: an
    /// unlink on a busy filesystem is tens to hundreds of microseconds).
    pub(crate) fn remove_later(&self, path: PathBuf) {
        self.inner.lock().trash.push(path);
        self.inner.cv.notify_all();
    }

    /// How many standbys of `shape` are ready.
    pub fn ready(&self, shape: Shape) -> usize {
        self.inner.lock().ready.get(&shape).map_or(0, Vec::len)
    }

    /// The pids of the ready standbys of `shape`.
    pub fn ready_pids(&self, shape: Shape) -> Vec<i32> {
        self.inner
            .lock()
            .ready
            .get(&shape)
            .map(|l| l.iter().map(|s| s.child.id() as i32).collect())
            .unwrap_or_default()
    }

    /// Waits until every known shape has its standbys (or `timeout` passes); returns
    /// whether they all do.
    pub fn wait_full(&self, timeout: Duration) -> bool {
        let t = Instant::now();
        let mut st = self.inner.lock();
        loop {
            let full = st
                .shapes
                .iter()
                .all(|s| st.ready.get(s).map_or(0, Vec::len) >= self.inner.cfg.per_shape);
            if full {
                return true;
            }
            let Some(left) = timeout.checked_sub(t.elapsed()) else {
                return false;
            };
            st = self
                .inner
                .cv
                .wait_timeout(st, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Stops the refill thread and ends every ready standby.
    pub fn shutdown(&mut self) {
        self.inner.lock().stop = true;
        self.inner.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for p in std::mem::take(&mut self.inner.lock().trash) {
            let _ = std::fs::remove_file(p);
        }
        let ready: Vec<Standby> = self
            .inner
            .lock()
            .ready
            .drain()
            .flat_map(|(_, l)| l)
            .collect();
        for s in ready {
            s.discard();
        }
    }
}

impl Drop for StandbyPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The refill thread: starts one standby at a time for a shape that has fewer than it
/// should, never sooner than [`REFILL_DELAY`] after a take.
fn refill(inner: &Inner) {
    // Runs at idle priority: starting a standby must not slow the VMs that serve requests
    // (and the processes it starts run at idle priority until taken).
    super::run_at_idle_priority();
    let mut st = inner.lock();
    loop {
        if !st.trash.is_empty() {
            let trash = std::mem::take(&mut st.trash);
            drop(st);
            for p in trash {
                let _ = std::fs::remove_file(p);
            }
            st = inner.lock();
        }
        if st.stop {
            return;
        }
        // Standbys holding the files of a snapshot removed since go (the refill starts
        // new ones), and a removed template is not opened ahead any more.
        let stale: Vec<Standby> = st
            .ready
            .values_mut()
            .flat_map(|list| {
                let (gone, kept) = std::mem::take(list)
                    .into_iter()
                    .partition(Standby::holds_removed_files);
                *list = kept;
                gone
            })
            .collect();
        st.preload
            .retain(|_, dir| dir.join(vmm::STATE_FILE).exists());
        if !stale.is_empty() {
            drop(st);
            tracing::info!(
                count = stale.len(),
                "standbys holding removed snapshots' files retired"
            );
            for s in stale {
                s.discard();
            }
            st = inner.lock();
            continue;
        }
        let now = Instant::now();
        let wanted = st.shapes.iter().copied().find(|s| {
            st.ready.get(s).map_or(0, Vec::len) < inner.cfg.per_shape
                && st
                    .failed
                    .get(s)
                    .is_none_or(|at| now.duration_since(*at) >= RETRY_DELAY)
        });
        let since_take = st.last_take.map(|t| now.duration_since(t));
        let ready = wanted.map_or(0, |s| st.ready.get(&s).map_or(0, Vec::len));
        // After a take, a pause before starting more (not while the taken VM restores),
        // unless none is ready: then the next request would start its process itself.
        let wait = match (wanted, since_take) {
            (None, _) => Some(Duration::from_millis(500)),
            (Some(_), Some(d)) if d < REFILL_DELAY && ready > 0 => Some(REFILL_DELAY - d),
            _ => None,
        };
        if let Some(w) = wait {
            st = inner
                .cv
                .wait_timeout(st, w)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        }
        let Some(shape) = wanted else { continue };
        let preload = st.preload.get(&shape).cloned();
        // Every one missing at once (up to MAX_STARTING): one at a time, a burst of
        // requests drains the pool faster than it refills.
        let missing = (inner.cfg.per_shape - ready).min(MAX_STARTING);
        drop(st);
        let mut starting = Vec::new();
        let mut failure = None;
        for _ in 0..missing {
            match spawn_standby(&inner.clade, &inner.cfg, shape, preload.as_deref()) {
                Ok(s) => starting.push(s),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        // Each one joins the pool as soon as it is ready (not when the slowest of the
        // batch is): a create meanwhile takes it rather than starting a VM cold.
        while !starting.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
            let mut started = Vec::new();
            for s in std::mem::take(&mut starting) {
                match s.check() {
                    Checked::Ready(sb) => started.push(sb),
                    Checked::Waiting(s) => starting.push(s),
                    Checked::Failed(e) => failure = Some(e),
                }
            }
            if started.is_empty() {
                continue;
            }
            let mut st = inner.lock();
            if st.stop {
                drop(st);
                for s in started {
                    s.discard();
                }
                for s in starting {
                    s.standby.discard();
                }
                return;
            }
            for s in &started {
                tracing::debug!(pid = s.child.id(), ?shape, api = %s.api_sock.display(), "standby ready");
            }
            st.failed.remove(&shape);
            st.ready.entry(shape).or_default().extend(started);
            inner.cv.notify_all();
        }
        st = inner.lock();
        if st.stop {
            return;
        }
        if let Some(e) = failure {
            tracing::warn!(?shape, "starting a standby VM process: {e}");
            st.failed.insert(shape, Instant::now());
        }
    }
}

/// A standby process started, not yet answering.
struct Starting {
    standby: Standby,
    since: Instant,
}

/// What [`Starting::check`] found.
enum Checked {
    Ready(Standby),
    Waiting(Starting),
    Failed(Error),
}

/// Starts one standby of `shape` (opening `preload` ahead): [`Starting::check`] says when
/// its API answers as a standby. Started by the refill thread, whose end is the process's
/// parent-death signal.
fn spawn_standby(
    clade: &Path,
    cfg: &StandbyConfig,
    shape: Shape,
    preload: Option<&Path>,
) -> Result<Starting> {
    let token = format!("sb-{}", ids::random_string(16));
    let api_sock = cfg.dir.join(format!("{token}.api"));
    let log = cfg.dir.join(format!("{token}.log"));
    let log_file = File::options()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&log)
        .map_err(Error::io("creating", &log))?;
    let mut cmd = Command::new(clade);
    vmm::host::clean_child(&mut cmd)
        .args(["restore", "--standby"])
        .arg("--api-sock")
        .arg(&api_sock)
        .arg("--files-root")
        .arg(&cfg.files_root)
        .arg("--vcpus")
        .arg(shape.vcpus.to_string())
        .arg("--mem")
        .arg(shape.mem_mib.to_string())
        .args(
            preload
                .map(|d| [std::ffi::OsStr::new("--preload"), d.as_os_str()])
                .into_iter()
                .flatten(),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file)
        // As a spawned VM process: its info lines become the sandbox's log.
        .envs(
            std::env::var_os("CLADE_LOG")
                .is_none()
                .then_some(("CLADE_LOG", super::VM_LOG_FILTER)),
        )
        // Its own process group, as every VM process: a Ctrl-C meant for the service is
        // not its business (the parent-death signal is).
        .process_group(0);
    // Jailed too, the process started here is the VM process (its jail is one process):
    // it keeps the signal across its change of credentials and clears it once it holds a
    // sandbox's VM (`vmm::host::jail::StarterLink`).
    super::end_with_this_process(&mut cmd);
    let jail = cfg
        .jails
        .as_ref()
        .map(|j| j.prepare(&mut cmd, &token))
        .transpose()?;
    // In its cgroup while it waits: the request that takes it moves nothing.
    let cgroup = cfg
        .cgroups
        .as_ref()
        .map(|cg| cg.join_new(&mut cmd, shape))
        .transpose()?;
    // At idle priority until a request takes it ([`Standby::run_at_normal_priority`]): its
    // cgroup made idle where the kernel can (lifted then with one write), else each of
    // its threads.
    let idle_group = cgroup.as_ref().is_some_and(|j| j.set_idle(true));
    if idle_group {
        super::start_at_normal_priority(&mut cmd);
    } else {
        super::start_at_idle_priority(&mut cmd);
    }
    let child = cmd.spawn().map_err(Error::io("starting", clade))?;
    Ok(Starting {
        standby: Standby {
            child,
            api_sock,
            log,
            preloaded: preload.map(|d| (d.to_path_buf(), state_file_id(d))),
            asked: Vec::new(),
            handed: Vec::new(),
            cgroup,
            idle_group,
            jail,
            vm_pid: None,
        },
        since: Instant::now(),
    })
}

impl Starting {
    /// Whether it answers as a standby now (or ended, or took too long: then cleaned up).
    fn check(mut self) -> Checked {
        let sb = &mut self.standby;
        if let Ok(Some(status)) = sb.child.try_wait() {
            let _ = std::fs::remove_file(&sb.api_sock);
            if let Some(j) = &sb.jail {
                let _ = std::fs::remove_dir(&j.root);
            }
            let tail = super::log_tail(&sb.log);
            let _ = std::fs::remove_file(&sb.log);
            return Checked::Failed(Error::Vm(format!(
                "standby process ended ({status}): {tail}"
            )));
        }
        if let Ok(r) = ApiClient::connect(&sb.api_sock).and_then(|mut c| c.call(&Request::Status)) {
            if r.ok && r.fields.get("state").and_then(|s| s.as_str()) == Some("standby") {
                sb.vm_pid = sb
                    .jail
                    .as_ref()
                    .and_then(|_| super::jail::vm_process(sb.child.id()));
                return Checked::Ready(self.standby);
            }
        }
        if self.since.elapsed() > READY_TIMEOUT {
            self.standby.discard();
            return Checked::Failed(Error::Vm(format!(
                "standby process not ready after {READY_TIMEOUT:?}"
            )));
        }
        Checked::Waiting(self)
    }
}

/// Ends the standbys an earlier service left in `dir` and removes their files; sockets of
/// processes that became sandboxes' VMs are kept, and so are files still in use.
fn sweep(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(Error::io("reading", dir))?;
    // Stems of live processes' sockets, and the other files of standbys: their start-up
    // logs, and the files and socket each makes ahead (`<token>.serial`, `.vmlog`,
    // `.vsock`; see `vmm::host::MadeAhead`).
    let mut live = Vec::new();
    let mut others = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        match path.extension().and_then(|x| x.to_str()) {
            Some("api") => match ask(&path, &Request::Status) {
                Ok(r) if r.fields.get("state").and_then(|s| s.as_str()) == Some("standby") => {
                    tracing::info!(
                        "ending a standby left by an earlier service: {}",
                        path.display()
                    );
                    let _ = ask(&path, &Request::Shutdown);
                }
                // A sandbox's VM: its socket stays.
                Ok(_) => live.push(path.with_extension("")),
                // Not answering in time (a stopped process?): left alone.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    live.push(path.with_extension(""))
                }
                // Nobody listens, or the process is ending (it closed the connection
                // unanswered): a dead process's socket.
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                }
            },
            Some("log" | "serial" | "vmlog" | "vsock") => others.push(path),
            _ => {}
        }
    }
    for file in others {
        if !live.contains(&file.with_extension("")) {
            let _ = std::fs::remove_file(&file);
        }
    }
    Ok(())
}

/// One request with a time limit (an old socket's process may be stopped).
fn ask(sock: &Path, req: &Request) -> std::io::Result<Response> {
    let mut s = UnixStream::connect(sock)?;
    s.set_read_timeout(Some(SWEEP_TIMEOUT))?;
    s.set_write_timeout(Some(SWEEP_TIMEOUT))?;
    let mut line = serde_json::to_string(req).map_err(std::io::Error::other)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    serde_json::from_str(&answer).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sandbox-standby-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A socket that answers every request line with `state`, as a VM process would.
    fn fake_vm(path: &Path, state: &'static str) -> JoinHandle<Vec<String>> {
        let l = std::os::unix::net::UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            // The sweep makes at most two requests (status, then shutdown).
            for _ in 0..2 {
                let Ok((s, _)) = l.accept() else { break };
                let mut line = String::new();
                BufReader::new(s.try_clone().unwrap())
                    .read_line(&mut line)
                    .unwrap();
                seen.push(line.trim().to_string());
                let answer = format!("{{\"ok\":true,\"state\":\"{state}\"}}\n");
                (&s).write_all(answer.as_bytes()).unwrap();
                if state != "standby" {
                    break;
                }
            }
            seen
        })
    }

    #[test]
    fn the_sweep_ends_old_standbys_and_keeps_sandboxes() {
        let d = scratch("sweep");
        // A dead standby's files: a socket nobody listens on, its log.
        drop(std::os::unix::net::UnixListener::bind(d.join("sb-dead.api")).unwrap());
        std::fs::write(d.join("sb-dead.log"), "x").unwrap();
        // And what it made ahead for its restore.
        std::fs::write(d.join("sb-dead.serial"), "").unwrap();
        std::fs::write(d.join("sb-dead.vmlog"), "").unwrap();
        drop(std::os::unix::net::UnixListener::bind(d.join("sb-dead.vsock")).unwrap());
        std::fs::write(d.join("sb-orphan.log"), "x").unwrap();
        let old = fake_vm(&d.join("sb-old.api"), "standby");
        let vm = fake_vm(&d.join("sb-vm.api"), "running");
        std::fs::write(d.join("sb-vm.log"), "x").unwrap();
        sweep(&d).unwrap();
        for ext in ["api", "log", "serial", "vmlog", "vsock"] {
            assert!(!d.join("sb-dead").with_extension(ext).exists(), "{ext}");
        }
        assert!(!d.join("sb-orphan.log").exists());
        let asked = old.join().unwrap();
        assert_eq!(asked.len(), 2, "{asked:?}");
        assert!(asked[1].contains("shutdown"), "{asked:?}");
        assert_eq!(vm.join().unwrap().len(), 1, "a sandbox's VM is only asked");
        assert!(d.join("sb-vm.api").exists() && d.join("sb-vm.log").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn pool_sizes_are_checked() {
        let d = scratch("size");
        for n in [0, MAX_PER_SHAPE + 1] {
            let cfg = StandbyConfig {
                dir: d.clone(),
                per_shape: n,
                files_root: d.clone(),
                shapes: Vec::new(),
                cgroups: None,
                jails: None,
            };
            assert!(StandbyPool::new(PathBuf::from("false"), cfg).is_err());
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}

//! The lifecycle: where each sandbox's fate is decided. Create (restore a template),
//! timeouts (kill, or pause with auto-pause), pause (snapshot, diff when the VM has a base,
//! then stop the process: a paused sandbox holds no guest RAM), resume (restore the pause
//! snapshot, on the path of the request that needs it), fork (the VM's own live fork; each
//! child is a new sandbox), kill, and finding everything again after a service restart.
//!
//! Blocking by design (process starts, socket calls, file I/O): the HTTP layer runs these
//! calls on tokio's blocking pool. One lock per sandbox orders operations on it; the
//! registry lock is held only around database calls.
//!
//! Files: `<state dir>/sandboxes/<id>/` holds a sandbox's sockets (`vm.api`, `vm.vsock`),
//! serial console and VMM log, its pause snapshots (`pause-<k>/`) and disk overlays. Fork
//! children's sockets are where their parent VM put them (`sandboxes/forks/<batch>/`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::ids;
use crate::registry::{Query, Record, Registry, State};
use crate::template::{Template, TemplateStore};
use crate::vmproc::{StartSpec, VmDriver};

/// Limits and places.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// The state directory (registry, templates, sandboxes).
    pub state_dir: PathBuf,
    /// Longest timeout a client may ask for (seconds).
    pub max_timeout_s: u64,
    /// Most children one fork request may ask for.
    pub max_fork: usize,
    /// Most metadata or env var entries per sandbox.
    pub max_map_entries: usize,
}

impl HostConfig {
    /// Defaults for `state_dir`: timeouts up to 24 h (E2B's longest), forks up to 16.
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            state_dir,
            max_timeout_s: 24 * 3600,
            max_fork: 16,
            max_map_entries: 256,
        }
    }
}

/// What a create request asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    /// Template name.
    pub template: String,
    /// Seconds until it times out.
    pub timeout_s: u64,
    /// Pause instead of kill on timeout.
    pub auto_pause: bool,
    /// User metadata.
    pub metadata: BTreeMap<String, String>,
    /// Environment variables for its processes.
    pub env_vars: BTreeMap<String, String>,
}

/// Resource use of a running sandbox's VM process.
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    /// When sampled (ms).
    pub at_ms: i64,
    /// vCPUs.
    pub cpu_count: u32,
    /// CPU time of the VM process over its life, in percent of its vCPUs' wall time.
    pub cpu_used_pct: f64,
    /// Resident memory of the VM process (bytes).
    pub mem_used: u64,
    /// Guest memory size (bytes).
    pub mem_total: u64,
    /// Bytes allocated by the sandbox's own disk layers and snapshots.
    pub disk_used: u64,
    /// Apparent size of those files (bytes).
    pub disk_total: u64,
}

/// The sandbox host.
pub struct Host {
    cfg: HostConfig,
    templates: TemplateStore,
    registry: Mutex<Registry>,
    driver: Arc<dyn VmDriver>,
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl Host {
    /// Opens the host's state (creating the directories and registry as needed).
    pub fn open(cfg: HostConfig, driver: Arc<dyn VmDriver>) -> Result<Self> {
        let sandboxes = cfg.state_dir.join("sandboxes");
        std::fs::create_dir_all(&sandboxes).map_err(Error::io("creating", &sandboxes))?;
        let registry = Registry::open(&cfg.state_dir.join("registry.sqlite"))?;
        Ok(Self {
            templates: TemplateStore::new(&cfg.state_dir),
            cfg,
            registry: Mutex::new(registry),
            driver,
            locks: Mutex::new(HashMap::new()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &HostConfig {
        &self.cfg
    }

    fn reg(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_of(&self, id: &str) -> Arc<Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(id.to_string()).or_default().clone()
    }

    fn sandboxes_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("sandboxes")
    }

    fn check_timeout(&self, timeout_s: u64) -> Result<()> {
        if timeout_s == 0 || timeout_s > self.cfg.max_timeout_s {
            return Err(Error::BadRequest(format!(
                "timeout must be 1 to {} seconds, not {timeout_s}",
                self.cfg.max_timeout_s
            )));
        }
        Ok(())
    }

    fn check_map(&self, what: &str, m: &BTreeMap<String, String>) -> Result<()> {
        if m.len() > self.cfg.max_map_entries {
            return Err(Error::BadRequest(format!(
                "{what}: {} entries (at most {})",
                m.len(),
                self.cfg.max_map_entries
            )));
        }
        if m.iter()
            .any(|(k, v)| k.is_empty() || k.len() > 1024 || v.len() > 64 * 1024)
        {
            return Err(Error::BadRequest(format!(
                "{what}: keys must be 1 to 1024 bytes, values at most 64 KiB"
            )));
        }
        Ok(())
    }

    /// The sandbox's record; a running one whose process ended is marked crashed first.
    fn load(&self, id: &str) -> Result<Record> {
        if !ids::valid_sandbox_id(id) {
            return Err(Error::NotFound(id.to_string()));
        }
        let rec = self
            .reg()
            .get(id)?
            .ok_or_else(|| Error::NotFound(id.to_string()))?;
        self.check_alive(rec)
    }

    fn check_alive(&self, mut rec: Record) -> Result<Record> {
        if rec.state == State::Running {
            let (Some(pid), Some(api)) = (rec.pid, rec.api_sock.clone()) else {
                return Err(Error::Corrupt(format!(
                    "running sandbox {} has no process",
                    rec.id
                )));
            };
            if let Some(why) = self.driver.exited(pid, &api) {
                tracing::warn!(sandbox = %rec.id, "VM crashed: {why}");
                rec.state = State::Crashed;
                rec.crash = Some(why);
                rec.pid = None;
                self.reg().update(&rec)?;
            }
        }
        Ok(rec)
    }

    /// A sandbox that must be there and not crashed.
    fn load_usable(&self, id: &str) -> Result<Record> {
        let rec = self.load(id)?;
        if rec.state == State::Crashed {
            return Err(Error::Crashed {
                id: rec.id,
                why: rec.crash.unwrap_or_else(|| "unknown".into()),
            });
        }
        Ok(rec)
    }

    /// The template of a sandbox.
    pub fn template(&self, name: &str) -> Result<Template> {
        self.templates.get(name)
    }

    /// Creates a sandbox from a template: a restore of the template's snapshot.
    pub fn create(&self, req: CreateRequest) -> Result<Record> {
        self.check_timeout(req.timeout_s)?;
        self.check_map("metadata", &req.metadata)?;
        self.check_map("envVars", &req.env_vars)?;
        let template = match self.templates.get(&req.template) {
            Err(Error::TemplateNotFound(t)) => {
                return Err(Error::BadRequest(format!("template '{t}' not found")))
            }
            r => r?,
        };
        let id = ids::new_sandbox_id();
        let dir = self.sandboxes_dir().join(&id);
        std::fs::create_dir(&dir).map_err(Error::io("creating", &dir))?;
        let now = ids::now_ms();
        let mut rec = Record {
            id: id.clone(),
            template: template.name.clone(),
            state: State::Paused,
            pid: None,
            api_sock: None,
            vsock: None,
            dir: dir.clone(),
            snapshot: None,
            pauses: 0,
            started_ms: now,
            end_ms: now + (req.timeout_s as i64) * 1000,
            auto_pause: req.auto_pause,
            metadata: req.metadata,
            env_vars: req.env_vars,
            vcpus: template.vcpus,
            mem_mib: template.mem_mib,
            disk: None,
            crash: None,
            parent: None,
        };
        let snapshot = self.templates.snapshot_dir(&template.name)?;
        if let Err(e) = self.start_vm(&mut rec, &template, &snapshot) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        self.reg().insert(&rec)?;
        tracing::info!(sandbox = %id, template = %template.name, pid = ?rec.pid, "created");
        Ok(rec)
    }

    /// Starts the VM process of `rec` from `snapshot`; fills in its process fields.
    fn start_vm(&self, rec: &mut Record, template: &Template, snapshot: &Path) -> Result<()> {
        let api = rec.dir.join("vm.api");
        let vsock = rec.dir.join("vm.vsock");
        let disk = template
            .disk
            .then(|| rec.dir.join(format!("disk-r{}.cdsk", rec.pauses)));
        let spec = StartSpec {
            snapshot: snapshot.to_path_buf(),
            api_sock: api.clone(),
            vsock: vsock.clone(),
            serial: rec.dir.join("serial.log"),
            log: rec.dir.join("vm.log"),
            files_root: self.sandboxes_dir(),
            disk_overlay: disk.clone(),
            agent_sync: !template.test_guest,
        };
        let pid = self.driver.start(&spec)?;
        rec.state = State::Running;
        rec.pid = Some(pid);
        rec.api_sock = Some(api);
        rec.vsock = Some(vsock);
        rec.disk = disk;
        rec.crash = None;
        Ok(())
    }

    /// One sandbox (crashed ones too: the caller decides how to show them).
    pub fn get(&self, id: &str) -> Result<Record> {
        self.load(id)
    }

    /// Sandboxes matching `q` (running ones checked for life first), and whether there are
    /// more.
    pub fn list(&self, q: &Query) -> Result<(Vec<Record>, bool)> {
        self.reap()?;
        self.reg().list(q)
    }

    /// Kills a sandbox: its process stops and its files go. A crashed one is removed too.
    pub fn kill(&self, id: &str) -> Result<()> {
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.load(id)?;
        if let (State::Running, Some(pid), Some(api)) = (rec.state, rec.pid, &rec.api_sock) {
            self.driver.stop(pid, api)?;
        }
        self.reg().delete(id)?;
        if let Err(e) = std::fs::remove_dir_all(&rec.dir) {
            tracing::warn!(sandbox = %id, "removing {}: {e}", rec.dir.display());
        }
        // A fork child's sockets live in its fork batch's directory.
        for f in [&rec.api_sock, &rec.vsock].into_iter().flatten() {
            if !f.starts_with(&rec.dir) {
                let _ = std::fs::remove_file(f);
            }
        }
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        tracing::info!(sandbox = %id, "killed");
        Ok(())
    }

    /// Sets the time left to `timeout_s` from now.
    pub fn set_timeout(&self, id: &str, timeout_s: u64) -> Result<Record> {
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_usable(id)?;
        rec.end_ms = ids::now_ms() + (timeout_s as i64) * 1000;
        self.reg().update(&rec)?;
        Ok(rec)
    }

    /// Keeps the sandbox alive at least `duration_s` more (never shortens it).
    pub fn refresh(&self, id: &str, duration_s: u64) -> Result<Record> {
        self.check_timeout(duration_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_usable(id)?;
        rec.end_ms = rec.end_ms.max(ids::now_ms() + (duration_s as i64) * 1000);
        self.reg().update(&rec)?;
        Ok(rec)
    }

    /// Pauses a running sandbox: snapshot (a diff on the VM's last snapshot when it has
    /// one, else full) into its directory, then its process stops.
    pub fn pause(&self, id: &str) -> Result<Record> {
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.load_usable(id)?;
        self.pause_locked(rec)
    }

    fn pause_locked(&self, mut rec: Record) -> Result<Record> {
        if rec.state == State::Paused {
            return Err(Error::Conflict(format!(
                "sandbox {} is already paused",
                rec.id
            )));
        }
        let (Some(pid), Some(api)) = (rec.pid, rec.api_sock.clone()) else {
            return Err(Error::Corrupt(format!(
                "running sandbox {} has no process",
                rec.id
            )));
        };
        let dir = rec.dir.join(format!("pause-{}", rec.pauses + 1));
        let t = std::time::Instant::now();
        let kind = match self.driver.snapshot(&api, &dir, true) {
            Ok(()) => "diff",
            Err(e) => {
                tracing::debug!(sandbox = %rec.id, "diff snapshot refused ({e}); taking a full one");
                let _ = std::fs::remove_dir_all(&dir);
                self.driver.snapshot(&api, &dir, false)?;
                "full"
            }
        };
        self.driver.stop(pid, &api)?;
        rec.state = State::Paused;
        rec.pid = None;
        rec.api_sock = None;
        rec.vsock = None;
        rec.snapshot = Some(dir);
        rec.pauses += 1;
        self.reg().update(&rec)?;
        tracing::info!(sandbox = %rec.id, kind, elapsed = ?t.elapsed(), "paused");
        Ok(rec)
    }

    /// Resumes a paused sandbox (E2B `resume`): an error if it runs.
    pub fn resume(&self, id: &str, timeout_s: u64) -> Result<Record> {
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.load_usable(id)?;
        if rec.state == State::Running {
            return Err(Error::Conflict(format!("sandbox {id} is already running")));
        }
        self.resume_locked(rec, timeout_s)
    }

    /// E2B `connect`: a running sandbox gets at least `timeout_s` more, a paused one is
    /// resumed first. Returns the sandbox and whether it was resumed.
    pub fn connect(&self, id: &str, timeout_s: u64) -> Result<(Record, bool)> {
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_usable(id)?;
        if rec.state == State::Running {
            rec.end_ms = rec.end_ms.max(ids::now_ms() + (timeout_s as i64) * 1000);
            self.reg().update(&rec)?;
            return Ok((rec, false));
        }
        Ok((self.resume_locked(rec, timeout_s)?, true))
    }

    fn resume_locked(&self, mut rec: Record, timeout_s: u64) -> Result<Record> {
        let template = self.templates.get(&rec.template)?;
        let snapshot = rec
            .snapshot
            .clone()
            .ok_or_else(|| Error::Corrupt(format!("paused sandbox {} has no snapshot", rec.id)))?;
        let t = std::time::Instant::now();
        self.start_vm(&mut rec, &template, &snapshot)?;
        rec.end_ms = ids::now_ms() + (timeout_s as i64) * 1000;
        self.reg().update(&rec)?;
        tracing::info!(sandbox = %rec.id, elapsed = ?t.elapsed(), "resumed");
        Ok(rec)
    }

    /// Forks a running sandbox into `count` new sandboxes: the VM's live fork (memory
    /// shared copy-on-write, each child its own process) when its memory allows, else a
    /// snapshot of the running parent that each child restores (the parent runs on). Children inherit the template,
    /// metadata, env vars and auto-pause, and time out `timeout_s` from now.
    pub fn fork(&self, id: &str, count: usize, timeout_s: u64) -> Result<Vec<Record>> {
        self.check_timeout(timeout_s)?;
        if count == 0 || count > self.cfg.max_fork {
            return Err(Error::BadRequest(format!(
                "count must be 1 to {}, not {count}",
                self.cfg.max_fork
            )));
        }
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let parent = self.load_usable(id)?;
        let Some(api) = parent
            .api_sock
            .clone()
            .filter(|_| parent.state == State::Running)
        else {
            return Err(Error::Conflict(format!(
                "sandbox {id} is paused: connect to it before forking"
            )));
        };
        let template = self.templates.get(&parent.template)?;
        let prefix = self
            .sandboxes_dir()
            .join("forks")
            .join(format!("{id}-{}", ids::random_string(6)));
        std::fs::create_dir_all(&prefix).map_err(Error::io("creating", &prefix))?;
        let live = match self.driver.fork(&api, count, &prefix, !template.test_guest) {
            Ok(children) => Some(children),
            // A VM whose memory is served from a snapshot (the uffd and file backends, how
            // sandboxes start) cannot fork live: the children restore a snapshot instead.
            Err(Error::VmApi { message, .. }) if message.contains("can fork") => None,
            Err(e) => return Err(e),
        };
        let now = ids::now_ms();
        let new_child = |cid: String, dir: PathBuf| Record {
            id: cid,
            template: parent.template.clone(),
            state: State::Paused,
            pid: None,
            api_sock: None,
            vsock: None,
            dir,
            snapshot: None,
            pauses: 0,
            started_ms: now,
            end_ms: now + (timeout_s as i64) * 1000,
            auto_pause: parent.auto_pause,
            metadata: parent.metadata.clone(),
            env_vars: parent.env_vars.clone(),
            vcpus: parent.vcpus,
            mem_mib: parent.mem_mib,
            disk: None,
            crash: None,
            parent: Some(parent.id.clone()),
        };
        let mut out = Vec::new();
        match live {
            Some(children) => {
                for c in children {
                    let cid = ids::new_sandbox_id();
                    let dir = self.sandboxes_dir().join(&cid);
                    std::fs::create_dir(&dir).map_err(Error::io("creating", &dir))?;
                    let mut rec = new_child(cid, dir);
                    rec.state = State::Running;
                    rec.pid = Some(c.pid);
                    rec.api_sock = Some(c.api_sock);
                    rec.vsock = c.vsock;
                    rec.disk = c.disk;
                    self.reg().insert(&rec)?;
                    out.push(rec);
                }
            }
            None => {
                // The fork's base snapshot stays where it is while any child needs it (the
                // children's memory and their later diffs build on it), so it is not in the
                // parent's directory.
                let base = prefix.join("base");
                if self.driver.snapshot(&api, &base, true).is_err() {
                    let _ = std::fs::remove_dir_all(&base);
                    self.driver.snapshot(&api, &base, false)?;
                }
                for _ in 0..count {
                    let cid = ids::new_sandbox_id();
                    let dir = self.sandboxes_dir().join(&cid);
                    std::fs::create_dir(&dir).map_err(Error::io("creating", &dir))?;
                    let mut rec = new_child(cid, dir);
                    if let Err(e) = self.start_vm(&mut rec, &template, &base) {
                        let _ = std::fs::remove_dir_all(&rec.dir);
                        // The children started so far stay: each is a sandbox of its own.
                        tracing::warn!(sandbox = %id, "fork child {}: {e}", out.len() + 1);
                        if out.is_empty() {
                            return Err(e);
                        }
                        break;
                    }
                    self.reg().insert(&rec)?;
                    out.push(rec);
                }
            }
        }
        tracing::info!(sandbox = %id, children = out.len(), "forked");
        Ok(out)
    }

    /// Resource use of a running sandbox (empty for a paused one).
    pub fn metrics(&self, id: &str) -> Result<Vec<Metrics>> {
        let rec = self.load_usable(id)?;
        let Some(pid) = rec.pid.filter(|_| rec.state == State::Running) else {
            return Ok(Vec::new());
        };
        let (disk_used, disk_total) = dir_usage(&rec.dir);
        let (cpu, rss) = proc_usage(pid).unwrap_or_default();
        Ok(vec![Metrics {
            at_ms: ids::now_ms(),
            cpu_count: rec.vcpus,
            cpu_used_pct: cpu / rec.vcpus.max(1) as f64,
            mem_used: rss,
            mem_total: rec.mem_mib * 1024 * 1024,
            disk_used,
            disk_total,
        }])
    }

    /// Marks running sandboxes whose VM process ended as crashed.
    pub fn reap(&self) -> Result<()> {
        let running: Vec<Record> = self
            .reg()
            .all()?
            .into_iter()
            .filter(|r| r.state == State::Running)
            .collect();
        for rec in running {
            let lock = self.lock_of(&rec.id);
            // Busy: an operation on it is under way and will see for itself.
            let Ok(_g) = lock.try_lock() else { continue };
            // (The registry guard must be gone before check_alive writes.)
            let fresh = self.reg().get(&rec.id)?;
            if let Some(fresh) = fresh {
                self.check_alive(fresh)?;
            }
        }
        Ok(())
    }

    /// Applies timeouts due at `now_ms`: pause (auto-pause) or kill. Returns the ids acted on.
    pub fn expire(&self, now_ms: i64) -> Result<Vec<String>> {
        let due: Vec<Record> = self
            .reg()
            .all()?
            .into_iter()
            .filter(|r| r.state == State::Running && r.end_ms <= now_ms)
            .collect();
        let mut done = Vec::new();
        for rec in due {
            let id = rec.id.clone();
            let r = if rec.auto_pause {
                let lock = self.lock_of(&id);
                let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
                // Re-read under the lock: a request may have extended or paused it.
                match self.load(&id) {
                    Ok(r) if r.state == State::Running && r.end_ms <= now_ms => {
                        self.pause_locked(r).map(|_| ())
                    }
                    _ => continue,
                }
            } else {
                match self.load(&id) {
                    Ok(r) if r.state == State::Running && r.end_ms <= now_ms => self.kill(&id),
                    _ => continue,
                }
            };
            match r {
                Ok(()) => {
                    tracing::info!(sandbox = %id, "timed out ({})", if rec.auto_pause { "paused" } else { "killed" });
                    done.push(id);
                }
                Err(e) => tracing::warn!(sandbox = %id, "timeout: {e}"),
            }
        }
        Ok(done)
    }

    /// After a service restart: running sandboxes whose process is gone are marked crashed;
    /// the rest are the registry's. Returns (running, paused, crashed) counts.
    pub fn recover(&self) -> Result<(usize, usize, usize)> {
        self.reap()?;
        let all = self.reg().all()?;
        let count = |s: State| all.iter().filter(|r| r.state == s).count();
        Ok((
            count(State::Running),
            count(State::Paused),
            count(State::Crashed),
        ))
    }

    /// How many sandboxes use template `name`.
    pub fn template_users(&self, name: &str) -> Result<usize> {
        self.reg().count_template(name)
    }
}

/// (CPU percent over the process's life, resident bytes) of a process, from /proc.
fn proc_usage(pid: i32) -> Option<(f64, u64)> {
    // /proc reports times in USER_HZ, which is 100 on Linux.
    const HZ: f64 = 100.0;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    // After "(comm)": state is field 3 of stat(5), i.e. index 0 here.
    let num = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok());
    let cpu_s = (num(14)? + num(15)?) / HZ;
    let start_s = num(22)? / HZ;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let wall = (uptime - start_s).max(0.01);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Some(((cpu_s / wall * 100.0).min(100.0 * 1024.0), rss_kb * 1024))
}

/// (allocated bytes, apparent bytes) of the files under `dir`.
fn dir_usage(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut used = 0;
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                used += m.blocks() * 512;
                total += m.len();
            }
        }
    }
    (used, total)
}

#[cfg(test)]
pub(crate) mod tests;

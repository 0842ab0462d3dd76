//! The sandbox host: where each sandbox's fate is decided. [`Host`] owns the registry,
//! the per-sandbox locks and the drivers; the lifecycle is a state machine
//! ([`lifecycle`]: one phase per sandbox, one table of which operation moves which phase
//! where and what it checks first, drawn in `docs/lifecycle.md`), and each operation
//! lives in a room of its own that asks the table first:
//!
//! - `create`: a new sandbox (a restore of a template's or snapshot's snapshot), and the
//!   VM start that create, resume, boot and fork share;
//! - `pause` (with memory, or filesystem-only), `resume` (restore, or boot from its
//!   disk; `connect`), `fork`, `kill`, `expiry` (timeouts, the reaper), `snapshots`
//!   (persistent snapshots and garbage collection);
//! - beside the lifecycle, what it calls: `cluster` (the fence and admission),
//!   `durability` (publishing to the object store and adopting from it), `networks`,
//!   `templates`, `metrics` (and `usage`), `recovery` (after a restart), `lookup`
//!   (reads), `checkpoint`, `dirs`, `logs`.
//!
//! Blocking by design (process starts, socket calls, file I/O): the HTTP layer runs these
//! calls on tokio's blocking pool. One lock per sandbox orders operations on it; the
//! registry lock is held only around database calls.
//!
//! Persistent snapshots (E2B `createSnapshot`): a snapshot of a sandbox, running (a diff on
//! its VM's last snapshot where it can, the VM paused only while it is taken) or paused
//! (its pause snapshot, linked), becomes a template in `sandboxes/snapshots/<snap id>/`
//! that new sandboxes are created from like from any template. A snapshot builds on files
//! it does not own: its source's template, and the source sandbox's directory (the diff
//! chain of its earlier pauses, the disk layer frozen by the snapshot). So a killed
//! sandbox's directory stays while a snapshot of it exists, or while another sandbox's
//! disk chain stands on a layer in it (a fork freezes the parent's disk layer in place and
//! the children write overlays on it), and a deleted snapshot's files
//! stay while a sandbox, another snapshot, or its source (whose next pause is a diff on
//! it) still needs them; [`Host::collect_garbage`] removes what nothing needs any more.
//!
//! Files: `<state dir>/sandboxes/<id>/` holds a sandbox's sockets (`vm.api`, `vm.vsock`),
//! serial console of each run (`serial-r<k>.log`) and VMM log (`vm.log`, appended by each
//! run), its pause snapshots (`pause-<k>/`) and disk overlays. Fork children's sockets are
//! where their parent VM put them (`sandboxes/forks/<batch>/`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::durable::{Durable, SandboxObject};
use crate::error::{Error, Result};
use crate::ids;
use crate::net::Networks;
use crate::registry::{Query, Record, Registry, SnapshotQuery, SnapshotRecord, State};
use crate::template::{self, Template, TemplateStore, SNAPSHOT_DIR};
use crate::vmproc::{StartSpec, VmDriver};

pub use hostnet::EgressPolicy;

mod checkpoint;
mod cluster;
mod create;
mod dirs;
mod durability;
mod expiry;
mod fork;
mod kill;
pub mod lifecycle;
mod logs;
mod lookup;
mod metrics;
mod networks;
mod pause;
mod recovery;
mod resume;
mod snapshots;
mod templates;
mod usage;

use durability::{own_snapshots, sandbox_object, Upload};
use lifecycle::Op;

pub use logs::{LogLine, MAX_LOG_LINES};

/// Memory files a pause snapshot's chain may reach: a pause writes a diff on the sandbox's
/// last snapshot until its chain holds this many files, then a full snapshot. Each wake
/// opens every file of the chain and looks pages up through them: in `clade bench serve`
/// (one sandbox paused and woken 40 times) the wake's request took 4.2–4.9 ms at p50 with
/// chains growing to 40 diffs, 2.3–2.6 ms with a full snapshot every time. A full
/// snapshot writes all the memory the guest has (copy-on-write from the image the VM
/// runs on, the guest paused only to freeze it), so a pause in eight costs more disk.
pub const PAUSE_CHAIN_MAX: usize = 8;

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

/// A fork child's (envd, traffic) access tokens.
type ChildTokens = (Option<String>, Option<String>);

/// What a create request asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    /// Template name.
    pub template: String,
    /// Seconds until it times out.
    pub timeout_s: u64,
    /// Pause instead of kill on timeout.
    pub auto_pause: bool,
    /// Wake it for a request that comes while it is paused (needs `auto_pause`).
    /// A pause on timeout drops the memory (E2B's `autoPauseMemory: false`): a
    /// filesystem-only pause.
    pub pause_drops_memory: bool,
    pub auto_resume: bool,
    /// Give it an envd access token that every data-plane request must carry.
    pub secure: bool,
    /// Its exposed ports need its traffic access token (E2B `allowPublicTraffic: false`).
    pub private_traffic: bool,
    /// The Host header its exposed ports see (`${PORT}` replaced).
    pub mask_host: Option<String>,
    /// User metadata.
    pub metadata: BTreeMap<String, String>,
    /// Environment variables for its processes.
    pub env_vars: BTreeMap<String, String>,
    /// Its egress policy (for a template with a network).
    pub egress: EgressPolicy,
}

/// Resource use of a running sandbox's VM process (sources: [`usage`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    /// When sampled (ms).
    pub at_ms: i64,
    /// vCPUs.
    pub cpu_count: u32,
    /// CPU time the VM process used recently (since the previous metrics call, or over a
    /// short window), in percent of its vCPUs' wall time.
    pub cpu_used_pct: f64,
    /// Host memory the VM process costs: its proportional set size (bytes).
    pub mem_used: u64,
    /// Guest memory size (bytes).
    pub mem_total: u64,
    /// Bytes the sandbox's own files take on the host (disk overlays, pause snapshots,
    /// logs).
    pub disk_used: u64,
    /// The guest disk's size (bytes; 0 without a disk).
    pub disk_total: u64,
}

/// The tag every snapshot has (E2B names snapshots `name:tag`; this host keeps one build
/// per name, the newest, under this tag).
pub const DEFAULT_TAG: &str = "default";

/// Splits an E2B template or snapshot reference `name[:tag]`; only the default tag exists.
/// What a pause keeps and asks of the guest (E2B's pause body).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PauseOptions {
    /// Keep the memory (a full pause); false: a filesystem-only pause.
    pub keep_memory: bool,
    /// Refuse the pause when the guest agent does not answer (E2B's
    /// `requireHealthyGuest`); a filesystem-only pause always requires it.
    pub require_healthy_guest: bool,
}

impl PauseOptions {
    /// A full pause, whatever the guest agent's state (E2B's default).
    pub const FULL: Self = Self {
        keep_memory: true,
        require_healthy_guest: false,
    };
    /// A filesystem-only pause.
    pub const FILESYSTEM: Self = Self {
        keep_memory: false,
        require_healthy_guest: true,
    };
}

/// What a sandbox's VM process starts from.
enum Origin<'a> {
    /// A restore of this snapshot (`reused`: later starts will likely restore it too).
    Snapshot { dir: &'a Path, reused: bool },
    /// A boot of the template's kernel with this disk (a sandbox whose memory was dropped).
    Boot {
        files: template::BootFiles,
        disk: Option<PathBuf>,
    },
}

pub fn strip_tag(reference: &str) -> Result<&str> {
    match reference.split_once(':') {
        None => Ok(reference),
        Some((name, DEFAULT_TAG)) => Ok(name),
        Some((_, tag)) => Err(Error::BadRequest(format!(
            "tag '{tag}' of '{reference}' not found (this host keeps only '{DEFAULT_TAG}')"
        ))),
    }
}

/// The sandbox host.
pub struct Host {
    cfg: HostConfig,
    templates: TemplateStore,
    /// Persistent snapshots, templates of their own.
    snapshots: TemplateStore,
    registry: Mutex<Registry>,
    driver: Arc<dyn VmDriver>,
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Orders what makes, uses and removes snapshots' files (taken after a sandbox's lock,
    /// never before).
    snapshot_lock: Mutex<()>,
    /// The last CPU sample of each VM process (for a recent CPU figure).
    cpu_samples: Mutex<HashMap<i32, usage::CpuSample>>,
    /// Each sandbox's metrics over time (sampled by [`Host::sample_metrics`]).
    history: usage::History,
    /// The registry's write counter ([`Registry::changes`]), read without its lock.
    changes: Arc<std::sync::atomic::AtomicU64>,
    /// Sandbox networks, or why there are none (sandboxes of a template with a network
    /// device then cannot start).
    networks: std::result::Result<Arc<Networks>, String>,
    /// Empty sandbox directories made ahead (see `host::dirs`).
    dirs: dirs::DirsAhead,
    /// The object store sandboxes are kept durable in (`clade serve --store`).
    durable: Option<Arc<Durable>>,
    /// The uploader's queue.
    uploads: Mutex<Option<std::sync::mpsc::Sender<Upload>>>,
    /// The cluster's say on who may act on a sandbox (`clade serve --cluster`).
    ownership: Option<Arc<dyn crate::ownership::Ownership>>,
}

impl Host {
    /// Opens the host's state (creating the directories and registry as needed).
    pub fn open(cfg: HostConfig, driver: Arc<dyn VmDriver>) -> Result<Self> {
        // Every sandbox's memory, disk and snapshots are below it: no other local user's.
        vmm::host::private_dir(&cfg.state_dir).map_err(Error::io("creating", &cfg.state_dir))?;
        let sandboxes = cfg.state_dir.join("sandboxes");
        std::fs::create_dir_all(&sandboxes).map_err(Error::io("creating", &sandboxes))?;
        let registry = Registry::open(&cfg.state_dir.join("registry.sqlite"))?;
        Ok(Self {
            templates: TemplateStore::new(&cfg.state_dir),
            snapshots: TemplateStore::at(sandboxes.join("snapshots")),
            cfg,
            changes: registry.changes(),
            registry: Mutex::new(registry),
            driver,
            locks: Mutex::new(HashMap::new()),
            snapshot_lock: Mutex::new(()),
            cpu_samples: Mutex::new(HashMap::new()),
            history: usage::History::default(),
            networks: Err("networking is off (clade serve --no-net, or a library user)".into()),
            dirs: dirs::DirsAhead::start(&sandboxes),
            durable: None,
            uploads: Mutex::new(None),
            ownership: None,
        })
    }

    /// How many times a sandbox's registry row was written: unchanged means no sandbox was
    /// created, paused, resumed, killed or found crashed since (lock-free; for caches).
    pub fn changes(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::SeqCst)
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
                // Read without the sandbox's lock (a `get`), the row may be older than a
                // pause or kill that ended the process on purpose: marked only if it still
                // names that process, else what it says now.
                if !self.reg().mark_crashed(&rec.id, pid, &why)? {
                    return self
                        .reg()
                        .get(&rec.id)?
                        .ok_or_else(|| Error::NotFound(rec.id.clone()));
                }
                tracing::warn!(sandbox = %rec.id, "VM crashed: {why}");
                rec.state = State::Crashed;
                rec.crash = Some(why);
                rec.pid = None;
            }
        }
        Ok(rec)
    }

    /// A sandbox that must be there and not crashed.
    /// A usable sandbox this host may change (see [`Host::fence`]).
    fn load_owned(&self, id: &str) -> Result<Record> {
        let rec = self.load_usable(id)?;
        self.fence(&rec)?;
        Ok(rec)
    }

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

    fn snapshot_guard(&self) -> MutexGuard<'_, ()> {
        self.snapshot_lock.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether the sandbox in `dir` came from the store (taken over from another host, or of
/// a template it has from there): it keeps a copy of its template.
/// In a killed sandbox's directory kept for the disk layers other sandboxes stand on:
/// [`Host::collect_garbage`] removes it once none does.
const KILLED_MARK: &str = "killed";

fn mark_killed(dir: &Path) {
    let m = dir.join(KILLED_MARK);
    if let Err(e) = std::fs::write(&m, b"") {
        tracing::warn!("marking {}: {e}", m.display());
    }
}

fn from_store(dir: &Path) -> bool {
    dir.join(template::TEMPLATE_FILE).exists()
}

fn write_template_copy(dir: &Path, t: &Template) -> Result<()> {
    let copy = dir.join(template::TEMPLATE_FILE);
    let text = serde_json::to_string_pretty(t).map_err(|e| Error::Corrupt(e.to_string()))?;
    std::fs::write(&copy, text).map_err(Error::io("writing", &copy))
}

/// The registry's form of an egress policy (`None`: allow all, the default).
fn policy_json(p: &EgressPolicy) -> Result<Option<String>> {
    if *p == EgressPolicy::allow_all() {
        return Ok(None);
    }
    serde_json::to_string(p)
        .map(Some)
        .map_err(|e| Error::Corrupt(format!("egress policy: {e}")))
}

/// A sandbox's egress policy, as its record keeps it.
fn policy_of(rec: &Record) -> Result<EgressPolicy> {
    match &rec.egress {
        None => Ok(EgressPolicy::allow_all()),
        Some(j) => serde_json::from_str(j)
            .map_err(|e| Error::Corrupt(format!("egress policy of {}: {e}", rec.id))),
    }
}

/// Makes `to` a copy of snapshot directory `from`: hard links of its files (snapshot files
/// are not written after they are committed), copies where links fail. A page server's
/// working-set file is left out (it is rewritten by resumes; the copy records its own).
fn link_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir(to).map_err(Error::io("creating", to))?;
    let entries = std::fs::read_dir(from).map_err(Error::io("listing", from))?;
    for e in entries {
        let e = e.map_err(Error::io("listing", from))?;
        let ty = e.file_type().map_err(Error::io("reading", e.path()))?;
        let name = e.file_name();
        if !ty.is_file() || name.to_string_lossy().ends_with(".ws") {
            continue;
        }
        let dst = to.join(&name);
        if std::fs::hard_link(e.path(), &dst).is_err() {
            std::fs::copy(e.path(), &dst).map_err(Error::io("copying", e.path()))?;
        }
    }
    Ok(())
}

/// A sandbox's environment: its template's image `Env` (if it was built from an image),
/// overridden by the variables its create request sets.
fn with_image_env(t: &Template, mut env: BTreeMap<String, String>) -> BTreeMap<String, String> {
    if let Some(img) = &t.image {
        for (k, v) in &img.env {
            env.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    env
}

#[cfg(test)]
pub(crate) mod tests;

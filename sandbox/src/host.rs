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
mod dirs;
mod logs;
mod usage;

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

/// How long a filesystem-only pause waits for the guest to flush its writes.
const FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a pause that needs the guest agent waits for it to answer.
const AGENT_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether the guest agent of sandbox `id` (at `vsock`) answers a ping: an error saying
/// it does not, for a pause that requires a healthy guest.
fn check_guest(id: &str, vsock: &Path) -> Result<()> {
    vmm::agent::probe(vsock, vmm::agent::Transport::Auto, AGENT_ANSWER_TIMEOUT)
        .map(|_| ())
        .map_err(|e| Error::GuestUnresponsive {
            id: id.to_string(),
            why: format!("its guest agent does not answer ({e}), and the pause requires it"),
        })
}

/// How a sandbox's timeout pauses it (E2B's `autoPauseMemory`).
fn timeout_pause(rec: &Record) -> PauseOptions {
    PauseOptions {
        keep_memory: rec.pause_keeps_memory,
        require_healthy_guest: false,
    }
}

/// Has the guest of sandbox `id` (its agent at `vsock`) write everything to its disk
/// (`sync`). An agent that does not answer, or a flush that fails or does not end within
/// [`FLUSH_TIMEOUT`], is an error: the sandbox keeps running.
fn flush_guest(id: &str, vsock: &Path) -> Result<()> {
    let refused = |why: String| Error::GuestUnresponsive {
        id: id.to_string(),
        why: format!("a filesystem-only pause needs its guest agent to flush the disk, and {why}"),
    };
    let client = vmm::agent::Client::connect_timeout(
        vsock,
        vmm::agent::Transport::Auto,
        AGENT_ANSWER_TIMEOUT,
    )
    .map_err(|e| refused(format!("the agent does not answer ({e})")))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = client
            .spawn(&vmm::agent::Command::new("/bin/sync"))
            .and_then(|e| e.wait());
        let _ = tx.send(r);
    });
    match rx.recv_timeout(FLUSH_TIMEOUT) {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(refused(format!("sync ended with {status:?}"))),
        Ok(Err(e)) => Err(refused(format!("sync failed ({e})"))),
        Err(_) => Err(refused(format!("sync did not end in {FLUSH_TIMEOUT:?}"))),
    }
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

    /// Keeps paused sandboxes durable in `d`'s store (before [`Host::recover`]; start its
    /// uploader with [`Host::start_uploads`]).
    pub fn set_store(&mut self, d: Arc<Durable>) {
        self.durable = Some(d);
    }

    /// Makes the host a node of a cluster: `o` is asked before every change to a sandbox
    /// and told what the host holds (see [`crate::ownership`]). Before [`Host::recover`].
    pub fn set_ownership(&mut self, o: Arc<dyn crate::ownership::Ownership>) {
        self.ownership = Some(o);
    }

    /// Tells the cluster (if any) that this host holds `rec` as it is now. A failure is
    /// logged: the change was made, and the cluster learns the state at the next one.
    fn owned(&self, rec: &Record) {
        if let Some(o) = &self.ownership {
            if let Err(e) = o.record(rec) {
                tracing::warn!(sandbox = %rec.id, "recording it in the cluster: {e}");
            }
        }
    }

    /// Before a change to `rec` (its lock held): whether this host still owns it. One
    /// another host took over is forgotten here (its VM stopped, its local files
    /// removed; nothing of it in the store is touched).
    fn fence(&self, rec: &Record) -> Result<()> {
        let Some(o) = &self.ownership else {
            return Ok(());
        };
        self.forget_if_fenced(rec, o.check(&rec.id))
    }

    /// `r` is what the cluster or the store said of sandbox `rec` (its lock held): if it
    /// is [`Error::Fenced`], this host forgets its copy (without touching the store).
    fn forget_if_fenced(&self, rec: &Record, r: Result<()>) -> Result<()> {
        match r {
            Err(e @ Error::Fenced { .. }) => {
                tracing::warn!(sandbox = %rec.id, "{e}: forgetting this host's copy");
                if let Err(f) = self.teardown_locked(rec.clone()) {
                    tracing::warn!(sandbox = %rec.id, "forgetting it: {f}");
                }
                Err(e)
            }
            r => r,
        }
    }

    /// Every sandbox of this host another host owns now is forgotten (see
    /// [`Host::fence`]): after this node lost its cluster lease. Returns how many.
    pub fn forget_taken(&self) -> Result<usize> {
        let mut n = 0;
        // Read first: the registry's lock is taken again for each.
        let all = self.reg().all()?;
        for rec in all {
            let lock = self.lock_of(&rec.id);
            let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
            if let Ok(r) = self.load(&rec.id) {
                if matches!(self.fence(&r), Err(Error::Fenced { .. })) {
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// The object store, if the host has one.
    pub fn durable(&self) -> Option<&Arc<Durable>> {
        self.durable.as_ref()
    }

    /// Starts the uploader (with a store): the host's templates are published now (so
    /// that other hosts can create sandboxes of them), every pause after it returns, and
    /// the paused sandboxes whose pause is not published yet are queued now.
    pub fn start_uploads(self: &Arc<Self>) -> Result<()> {
        if self.durable.is_none() {
            return Ok(());
        }
        let (tx, rx) = std::sync::mpsc::channel::<Upload>();
        let host = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("clade-uploader".into())
            .spawn(move || uploader(host, rx))
            .map_err(Error::io("starting the uploader", &self.cfg.state_dir))?;
        for t in self.templates.list()? {
            let _ = tx.send(Upload::Template(t.name));
        }
        for r in self.reg().all()? {
            if r.state == State::Paused && r.remote.is_none() && !r.durable() {
                let _ = tx.send(Upload::Pause(r.id));
            }
        }
        *self.uploads.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        Ok(())
    }

    fn queue_upload(&self, id: &str) {
        if let Some(tx) = &*self.uploads.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = tx.send(Upload::Pause(id.to_string()));
        }
    }

    /// Publishes built template `name`: its snapshot (with its disk), then its template
    /// object.
    fn publish_template(&self, d: &Durable, name: &str) -> Result<()> {
        let template = match self.templates.get(name) {
            Ok(t) => t,
            // Removed since: nothing to publish.
            Err(Error::TemplateNotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        if let Some(o) = d.template_object(name)? {
            if o.template == template {
                return Ok(());
            }
        }
        publish_as_template(d, &self.templates.snapshot_dir(name)?, template)
    }

    /// Publishes persistent snapshot `reference` (its id, or a name) as a template other
    /// hosts create sandboxes of (a cluster's fork children beyond their parent's node).
    /// Returns its id (the template's name).
    pub fn publish_snapshot(&self, reference: &str) -> Result<String> {
        let Some(d) = &self.durable else {
            return Err(Error::BadRequest(
                "publishing a snapshot needs an object store (clade serve --store)".into(),
            ));
        };
        let name =
            strip_tag(reference).map_err(|_| Error::SnapshotNotFound(reference.to_string()))?;
        let snap = {
            let _snapshots = self.snapshot_guard();
            self.reg()
                .resolve_snapshot(name)?
                .ok_or_else(|| Error::SnapshotNotFound(reference.to_string()))?
        };
        let template = self.snapshots.get(&snap.id)?;
        if d.template_object(&snap.id)?.is_some() {
            return Ok(snap.id);
        }
        publish_as_template(d, &self.snapshots.snapshot_dir(&snap.id)?, template)?;
        Ok(snap.id)
    }

    /// Publishes the pause of sandbox `id` (if it is still paused at a pause not published
    /// yet): its snapshot chain, then its sandbox object, then its record says so.
    fn publish_pause(&self, d: &Durable, id: &str) -> Result<()> {
        let Some(rec) = self.reg().get(id)? else {
            return Ok(());
        };
        if rec.state != State::Paused || rec.remote.is_some() || rec.durable() {
            return Ok(());
        }
        let Some(dir) = rec.snapshot.clone() else {
            return Ok(());
        };
        let template = self.sandbox_template(&rec)?;
        let t = Instant::now();
        // Its template first (a sandbox of a built template), so that the host taking it
        // over can also create sandboxes of that template.
        if rec.remote.is_none() && !rec.dir.join(template::TEMPLATE_FILE).exists() {
            self.publish_template(d, &rec.template)?;
        }
        let files = store::publish::chain_files(&dir).map_err(crate::durable::store_err)?;
        let (manifest, report) = d.publish_chain(&files)?;
        // This sandbox's own snapshots: those in its directory (not its template's).
        let own = own_snapshots(d, id, &files, &[&rec.dir])?;
        let now = ids::now_ms();
        let object = sandbox_object(&rec, template, manifest.id.clone(), rec.pauses, own, d, now);
        // The object only while the sandbox is still paused at this pause (a resume of a
        // pause whose object exists claims it first; one that came before did not).
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let now_rec = self.reg().get(id)?;
        match now_rec {
            Some(mut r) if r.state == State::Paused && r.pauses == rec.pauses => {
                self.fence(&r)?;
                // Fenced by the store too: the check above and this write are not one.
                self.forget_if_fenced(&r, d.put_sandbox_object(&object))?;
                r.published_pause = Some(rec.pauses);
                r.published_ms = Some(now);
                self.reg().update(&r)?;
                self.owned(&r);
                tracing::info!(sandbox = %id, snapshot = %manifest.id, pause = rec.pauses,
                    uploaded = report.bytes_uploaded, elapsed = ?t.elapsed(), "durable");
            }
            Some(_) => {
                tracing::debug!(sandbox = %id, pause = rec.pauses, "resumed before its upload finished");
            }
            None => {
                // Killed meanwhile: what was just published is no one's.
                let sids: Vec<_> = report.published.iter().rev().copied().collect();
                if let Err(e) = d.block_on(store::publish::delete_all(d.store(), &sids)) {
                    tracing::warn!(sandbox = %id, "what its last upload published kept: {e}");
                }
            }
        }
        Ok(())
    }

    /// The template a sandbox runs: its template here, or the copy a sandbox taken over
    /// from another host brought along.
    fn sandbox_template(&self, rec: &Record) -> Result<Template> {
        let copy = rec.dir.join(template::TEMPLATE_FILE);
        if rec.remote.is_some() || copy.exists() {
            let text = std::fs::read_to_string(&copy).map_err(Error::io("reading", &copy))?;
            return serde_json::from_str(&text)
                .map_err(|e| Error::Corrupt(format!("{}: {e}", copy.display())));
        }
        self.template(&rec.template)
    }

    /// Takes over sandbox `id` from the object store (a host that paused it published
    /// it): claims its pause, then records it here as paused, to resume from the store.
    fn adopt(&self, id: &str) -> Result<Record> {
        let Some(d) = &self.durable else {
            return Err(Error::NotFound(id.to_string()));
        };
        if !ids::valid_sandbox_id(id) {
            return Err(Error::NotFound(id.to_string()));
        }
        let Some(mut o) = d.sandbox_object(id)? else {
            return Err(Error::NotFound(id.to_string()));
        };
        d.claim(id, o.pause)?;
        // Ours now: a kill on the host it came from no longer removes its objects.
        o.host = d.host_id().to_string();
        d.put_taken_over_object(&o)?;
        let dir = self.sandboxes_dir().join(id);
        self.dirs.make(&dir).map_err(Error::io("creating", &dir))?;
        write_template_copy(&dir, &o.template)?;
        if let Some(at) = o.checkpoint_ms {
            Self::mark_checkpoint(&dir, at)?;
        }
        let mut rec = self.record_of(o.clone());
        rec.end_ms = ids::now_ms();
        let policy = policy_of(&rec)?;
        rec.net = self.acquire_net(&o.template, &policy)?;
        if let Err(e) = self.reg().insert(&rec) {
            self.release_net(rec.net);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        tracing::info!(sandbox = %id, snapshot = ?rec.remote, pause = rec.pauses,
            from = %d.store().url(), "taken over from the store");
        Ok(rec)
    }

    /// A template another host published, if the host has a store and it has one.
    fn store_template(&self, name: &str) -> Result<Option<crate::durable::TemplateObject>> {
        match &self.durable {
            Some(d) if template::valid_dir_name(name) => d.template_object(name),
            _ => Ok(None),
        }
    }

    /// A paused sandbox as the store's object describes it (to resume from the store).
    fn record_of(&self, o: SandboxObject) -> Record {
        Record {
            dir: self.sandboxes_dir().join(&o.id),
            id: o.id,
            template: o.template.name.clone(),
            state: State::Paused,
            pid: None,
            api_sock: None,
            vsock: None,
            snapshot: None,
            pauses: o.pause,
            started_ms: o.started_ms,
            end_ms: o.published_ms,
            auto_pause: o.auto_pause,
            auto_resume: o.auto_resume,
            envd_token: o.envd_token,
            traffic_token: o.traffic_token,
            mask_host: o.mask_host,
            metadata: o.metadata,
            env_vars: o.env_vars,
            vcpus: o.template.vcpus,
            mem_mib: o.template.mem_mib,
            disk: None,
            crash: None,
            parent: o.parent,
            net: None,
            egress: o.egress,
            remote: Some(o.snapshot),
            published_pause: Some(o.pause),
            published_ms: Some(o.published_ms),
            pause_keeps_memory: true,
            memory_dropped: false,
        }
    }

    /// A sandbox to resume: this host's, or one taken over from the store.
    fn load_or_adopt(&self, id: &str) -> Result<Record> {
        match self.load_owned(id) {
            Err(Error::NotFound(_)) if self.durable.is_some() => self.adopt(id),
            r => r,
        }
    }

    /// Gives the host its sandbox networks (`Ok`), or says why it has none (`Err`: set-up
    /// failed, or turned off). Before [`Host::recover`].
    pub fn set_networks(&mut self, n: std::result::Result<Arc<Networks>, String>) {
        self.networks = n;
    }

    fn networks(&self) -> Result<&Arc<Networks>> {
        self.networks.as_ref().map_err(|why| {
            Error::Network(format!(
                "this template's VM has a network device, but the host has no sandbox \
                 networking: {why}"
            ))
        })
    }

    /// A network for a new VM of `template` (none for a template without a network device).
    fn acquire_net(&self, template: &Template, policy: &EgressPolicy) -> Result<Option<u32>> {
        if !template.net {
            return Ok(None);
        }
        self.networks()?.acquire(policy).map(Some)
    }

    /// Removes the ready networks of the pool (the service stops; sandboxes keep theirs).
    pub fn shutdown_networks(&self) {
        if let Ok(n) = &self.networks {
            n.shutdown();
        }
    }

    /// Gives a sandbox's network back (its sandbox is gone, or never started).
    fn release_net(&self, net: Option<u32>) {
        if let (Some(i), Ok(n)) = (net, &self.networks) {
            n.release(i);
        }
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

    /// Every built template (not snapshots), by name.
    pub fn list_templates(&self) -> Result<Vec<Template>> {
        self.templates.list()
    }

    /// The template of a sandbox (a built template, or a snapshot, deleted or not).
    pub fn template(&self, name: &str) -> Result<Template> {
        if self.reg().get_snapshot(name)?.is_some() {
            self.snapshots.get(name)
        } else {
            self.templates.get(name)
        }
    }

    /// What a create request's `templateID` means: a live snapshot (by id or name, with
    /// `:default` or no tag), else a build of a built template (`name`, `name:tag`,
    /// `name:<build id>`: [`crate::template::tags`]).
    fn resolve_template(&self, reference: &str) -> Result<(Template, PathBuf)> {
        if let Ok(name) = strip_tag(reference) {
            if let Some(s) = self.reg().resolve_snapshot(name)? {
                return Ok((
                    self.snapshots.get(&s.id)?,
                    self.snapshots.snapshot_dir(&s.id)?,
                ));
            }
        }
        let found = self.templates.resolve(reference).and_then(|build| {
            Ok((
                self.templates.get(&build)?,
                self.templates.snapshot_dir(&build)?,
            ))
        });
        match found {
            Err(Error::TemplateNotFound(_)) => Err(Error::BadRequest(format!(
                "template or snapshot '{reference}' not found"
            ))),
            r => r,
        }
    }

    /// The templates' tags ([`crate::template::tags`]).
    pub fn template_store(&self) -> &TemplateStore {
        &self.templates
    }

    /// Removes the builds of template `name` that no tag means and no sandbox or snapshot
    /// stands on (a build whose last tag moved elsewhere). Its template's own directory
    /// goes only when `default` means another build.
    pub fn sweep_builds(&self, name: &str) -> Result<()> {
        for b in self.templates.untagged_builds(name)? {
            let users = self.reg().count_template(&b)?;
            if users == 0 {
                tracing::info!(template = name, build = %b, "removing a build no tag means");
                self.templates.remove_build(&b)?;
            }
        }
        Ok(())
    }

    /// Creates a sandbox from a template or a snapshot: a restore of its snapshot.
    pub fn create(&self, req: CreateRequest) -> Result<Record> {
        // The room held for it goes once it is recorded.
        let (rec, _room) = self.create_vm(req)?;
        self.owned(&rec);
        Ok(rec)
    }

    /// Room for `count` VMs of `vcpus` and `mem_mib` each, when the cluster counts it
    /// ([`crate::ownership::Ownership::admit`]).
    fn admit(
        &self,
        vcpus: u32,
        mem_mib: u64,
        count: usize,
    ) -> Result<Option<crate::ownership::Reservation>> {
        match &self.ownership {
            Some(o) => o.admit(vcpus, mem_mib, u32::try_from(count).unwrap_or(u32::MAX)),
            None => Ok(None),
        }
    }

    fn create_vm(
        &self,
        req: CreateRequest,
    ) -> Result<(Record, Option<crate::ownership::Reservation>)> {
        let t0 = std::time::Instant::now();
        self.check_timeout(req.timeout_s)?;
        self.check_map("metadata", &req.metadata)?;
        self.check_map("envVars", &req.env_vars)?;
        if req.auto_resume && !req.auto_pause {
            return Err(Error::BadRequest(
                "auto-resume needs a timeout that pauses (auto-pause)".into(),
            ));
        }
        // From a snapshot: held until the new sandbox is in the registry, so that a
        // snapshot deleted meanwhile keeps its files for it.
        let from_snapshot = match strip_tag(&req.template) {
            Ok(name) => self.reg().resolve_snapshot(name)?.is_some(),
            Err(_) => false,
        };
        let _snapshots = from_snapshot.then(|| self.snapshot_guard());
        // Not here: a template another host published (restored from the store).
        let (template, snapshot, remote) = match self.resolve_template(&req.template) {
            Ok((t, s)) => (t, s, None),
            Err(e @ Error::BadRequest(_)) => {
                let published = match strip_tag(&req.template) {
                    Ok(name) => self.store_template(name)?,
                    Err(_) => None,
                };
                match published {
                    Some(o) => (o.template, PathBuf::from(&o.snapshot), Some(o.snapshot)),
                    None => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let room = self.admit(template.vcpus, template.mem_mib, 1)?;
        let token = |wanted: bool| {
            wanted
                .then(ids::new_token)
                .transpose()
                .map_err(Error::io("making an access token in", self.sandboxes_dir()))
        };
        let (envd_token, traffic_token) = (token(req.secure)?, token(req.private_traffic)?);
        let id = ids::new_sandbox_id();
        let dir = self.sandboxes_dir().join(&id);
        self.dirs.make(&dir).map_err(Error::io("creating", &dir))?;
        if remote.is_some() {
            if let Err(e) = write_template_copy(&dir, &template) {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        }
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
            auto_resume: req.auto_resume,
            envd_token,
            traffic_token,
            mask_host: req.mask_host.clone(),
            metadata: req.metadata,
            env_vars: with_image_env(&template, req.env_vars),
            vcpus: template.vcpus,
            mem_mib: template.mem_mib,
            disk: None,
            crash: None,
            parent: None,
            net: None,
            egress: None,
            remote,
            published_pause: None,
            published_ms: None,
            pause_keeps_memory: !req.pause_drops_memory,
            memory_dropped: false,
        };
        let t_start = std::time::Instant::now();
        let started = self.acquire_net(&template, &req.egress).and_then(|net| {
            rec.net = net;
            rec.egress = policy_json(&req.egress)?;
            // Other sandboxes will be created from the same snapshot.
            self.start_vm(
                &mut rec,
                &template,
                Origin::Snapshot {
                    dir: &snapshot,
                    reused: true,
                },
            )
        });
        if let Err(e) = started {
            self.release_net(rec.net);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let t_insert = std::time::Instant::now();
        self.reg().insert(&rec)?;
        tracing::info!(
            sandbox = %id,
            template = %template.name,
            pid = ?rec.pid,
            prepare_us = (t_start - t0).as_micros() as u64,
            start_us = (t_insert - t_start).as_micros() as u64,
            insert_us = t_insert.elapsed().as_micros() as u64,
            "created"
        );
        Ok((rec, room))
    }

    /// Starts the VM process of `rec` from `origin`; fills in its process fields.
    fn start_vm(&self, rec: &mut Record, template: &Template, origin: Origin<'_>) -> Result<()> {
        let api = rec.dir.join("vm.api");
        let vsock = rec.dir.join("vm.vsock");
        let (snapshot, reused, boot, disk) = match origin {
            Origin::Snapshot { dir, reused } => (
                dir.to_path_buf(),
                reused,
                None,
                template
                    .disk
                    .then(|| rec.dir.join(format!("disk-r{}.cdsk", rec.pauses))),
            ),
            Origin::Boot { files, disk } => (rec.dir.clone(), false, Some(files), disk),
        };
        let booting = boot.is_some();
        let spec = StartSpec {
            snapshot,
            boot,
            test_device: template.test_guest,
            fetcher: match (&rec.remote, &self.durable) {
                _ if booting => None,
                (Some(id), Some(d)) => {
                    d.prepare(id)?;
                    Some(d.fetcher_socket().to_path_buf())
                }
                (Some(id), None) => {
                    return Err(Error::Store(format!(
                        "sandbox {} resumes from published snapshot {id}, but this host has no \
                         store (clade serve --store)",
                        rec.id
                    )))
                }
                (None, _) => None,
            },
            // A sandbox taken over from the store (or of a template from it) stands on disk
            // layers the fetcher reads lazily, whatever snapshot of it is restored.
            layer_fetcher: match (&rec.remote, &self.durable) {
                _ if booting => None,
                (None, Some(d)) if from_store(&rec.dir) => Some(d.fetcher_socket().to_path_buf()),
                _ => None,
            },
            snapshot_reused: reused,
            api_sock: api.clone(),
            dir: rec.dir.clone(),
            vsock: vsock.clone(),
            serial: rec.dir.join(format!("serial-r{}.log", rec.pauses)),
            log: rec.dir.join("vm.log"),
            files_root: self.sandboxes_dir(),
            disk_overlay: disk.clone(),
            agent_sync: !template.test_guest,
            vcpus: template.vcpus,
            mem_mib: template.mem_mib,
            net: match (template.net, rec.net) {
                (false, _) => None,
                (true, Some(i)) => Some(self.networks()?.tap_spec(i)),
                (true, None) => {
                    return Err(Error::Network(format!(
                        "sandbox {} has no network, but its template's VM has a network device",
                        rec.id
                    )))
                }
            },
            tap: match (template.net, rec.net) {
                (true, Some(i)) => self.networks.as_ref().ok().and_then(|n| n.take_tap(i)),
                _ => None,
            },
        };
        let started = self.driver.start(&spec);
        // The VM process has its own descriptor of the TAP now (or failed): the service's
        // goes; after a failure it is opened ahead again for the next start.
        drop(spec);
        if let (Err(_), Some(i), Ok(n)) = (&started, rec.net, &self.networks) {
            n.reopen_tap(i);
        }
        let started = started?;
        rec.state = State::Running;
        rec.pid = Some(started.pid);
        // A standby process keeps its own socket (see `vmproc::standby`).
        rec.api_sock = Some(started.api_sock);
        rec.vsock = Some(vsock);
        rec.disk = disk;
        rec.crash = None;
        Ok(())
    }

    /// Where the guest of `rec` is reached from this host (its exposed ports): its network
    /// namespace's outer address; `None` for a sandbox without a network.
    pub fn guest_ip(&self, rec: &Record) -> Option<std::net::IpAddr> {
        if self.driver.guest_is_host() {
            return Some(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let n = self.networks.as_ref().ok()?;
        rec.net.map(|i| n.outer_ip(i).into())
    }

    /// Replaces a sandbox's egress policy (E2B `PUT /sandboxes/{id}/network`), running or
    /// paused; kept for its resumes and forks.
    pub fn set_egress(&self, id: &str, policy: &EgressPolicy) -> Result<Record> {
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_owned(id)?;
        let Some(i) = rec.net else {
            return Err(Error::BadRequest(format!(
                "sandbox {id} has no network (its template's VM has no network device)"
            )));
        };
        self.networks()?.set_policy(i, policy)?;
        rec.egress = policy_json(policy)?;
        self.reg().update(&rec)?;
        tracing::info!(sandbox = %id, ?policy, "egress policy replaced");
        Ok(rec)
    }

    /// One sandbox of this host's registry (crashed ones too), never asking the store:
    /// quick enough for an async handler. `NotFound` may still be in the store
    /// ([`Host::get`]).
    pub fn get_local(&self, id: &str) -> Result<Record> {
        self.load(id)
    }

    /// One sandbox (crashed ones too: the caller decides how to show them). With a
    /// store, a sandbox another host published is shown as it is there (paused), without
    /// taking it over.
    pub fn get(&self, id: &str) -> Result<Record> {
        match (self.load(id), &self.durable) {
            (Err(Error::NotFound(_)), Some(d)) if ids::valid_sandbox_id(id) => {
                let o = d
                    .sandbox_object(id)?
                    .ok_or_else(|| Error::NotFound(id.to_string()))?;
                Ok(self.record_of(o))
            }
            (r, _) => r,
        }
    }

    /// The hosts of the cluster this host is in (`None`: it is in none).
    pub fn cluster_nodes(&self) -> Result<Option<Vec<crate::ownership::NodeSummary>>> {
        match &self.ownership {
            Some(o) => o.nodes(),
            None => Ok(None),
        }
    }

    /// The sandboxes in this host's registry (not those only in the store), oldest first.
    pub fn local_sandboxes(&self) -> Result<Vec<Record>> {
        self.reap()?;
        self.reg().all()
    }

    /// Sandboxes matching `q` (running ones checked for life first), and whether there are
    /// more.
    ///
    /// With a store, sandboxes paused on other hosts (or on this one before its state was
    /// lost) that only the store has are listed too, as paused. A store that cannot be
    /// listed leaves them out (with a warning) rather than failing the list.
    pub fn list(&self, q: &Query) -> Result<(Vec<Record>, bool)> {
        self.reap()?;
        let Some(d) = &self.durable else {
            return self.reg().list(q);
        };
        let mut all = self.reg().all()?;
        match d.sandbox_objects() {
            Ok(objects) => {
                let here: std::collections::HashSet<String> =
                    all.iter().map(|r| r.id.clone()).collect();
                all.extend(
                    objects
                        .into_iter()
                        .filter(|o| !here.contains(&o.id) && ids::valid_sandbox_id(&o.id))
                        .map(|o| self.record_of(o)),
                );
                all.sort_by(|a, b| (a.started_ms, &a.id).cmp(&(b.started_ms, &b.id)));
            }
            Err(e) => tracing::warn!(error = %e, "sandboxes in the store not listed"),
        }
        Ok(q.select(all))
    }

    /// Kills a sandbox: its process stops and its files go. A crashed one is removed too.
    pub fn kill(&self, id: &str) -> Result<()> {
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = match (self.load(id), &self.durable) {
            // Only in the store (paused on a host that may be gone): claimed like a resume,
            // so that one running elsewhere is not deleted under it, then removed.
            (Err(Error::NotFound(_)), Some(d)) if ids::valid_sandbox_id(id) => {
                let o = d
                    .sandbox_object(id)?
                    .ok_or_else(|| Error::NotFound(id.to_string()))?;
                d.claim(id, o.pause)?;
                d.delete_sandbox(id)?;
                if let Some(o) = &self.ownership {
                    if let Err(e) = o.removed(id) {
                        tracing::warn!(sandbox = %id, "removing it from the cluster: {e}");
                    }
                }
                tracing::info!(sandbox = %id, "killed (in the store only)");
                return Ok(());
            }
            (r, _) => r?,
        };
        self.fence(&rec)?;
        self.teardown_locked(rec)?;
        tracing::info!(sandbox = %id, "killed");
        if let Some(o) = &self.ownership {
            if let Err(e) = o.removed(id) {
                tracing::warn!(sandbox = %id, "removing it from the cluster: {e}");
            }
        }
        if let Some(d) = &self.durable {
            self.delete_published(d, id);
        }
        self.collect_garbage_locked()
    }

    /// What a kill does on this host (its lock held): the sandbox leaves the registry, its
    /// VM stops, its network and local files go. The store is not touched.
    fn teardown_locked(&self, rec: Record) -> Result<()> {
        let id = rec.id.as_str();
        // Gone from the registry before its VM stops: a request that comes while the VM
        // ends (a client seeing its stream drop and probing) is answered "not found" at
        // once instead of waiting on an agent that will not answer.
        {
            let _snapshots = self.snapshot_guard();
            self.reg().delete(id)?;
        }
        if let (State::Running, Some(pid), Some(api)) = (rec.state, rec.pid, &rec.api_sock) {
            if let Err(e) = self.driver.stop(pid, api) {
                // Still there after all: it stays listed, and a kill may be tried again.
                if let Err(r) = self.reg().insert(&rec) {
                    tracing::error!(sandbox = %id, "restoring its row after a failed stop: {r}");
                }
                return Err(e);
            }
        }
        // Before its directory goes: what its VM recorded for the snapshot it came from.
        self.driver.adopt_working_set(&rec.dir);
        let _snapshots = self.snapshot_guard();
        self.history.forget(id);
        self.release_net(rec.net);
        // A snapshot of it may build on its files, fork children on its frozen disk
        // layers: then only its sockets go now.
        let held = self
            .reg()
            .all_snapshots()?
            .iter()
            .any(|s| s.source_dir == rec.dir);
        let stood_on = !held && self.disk_layers_used(&rec.dir)?;
        if stood_on {
            mark_killed(&rec.dir);
        } else if !held {
            if let Err(e) = std::fs::remove_dir_all(&rec.dir) {
                tracing::warn!(sandbox = %id, "removing {}: {e}", rec.dir.display());
            }
        }
        // A fork child's sockets live in its fork batch's directory.
        for f in [&rec.api_sock, &rec.vsock].into_iter().flatten() {
            let _ = std::fs::remove_file(f);
        }
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        tracing::info!(sandbox = %id, kept_for_snapshots = held, "stopped and removed from this host");
        Ok(())
    }

    /// Removes what the store holds of a killed sandbox, if this host owns it there (one
    /// taken over by another host is that host's now).
    fn delete_published(&self, d: &Durable, id: &str) {
        let r = d.sandbox_object(id).and_then(|o| match o {
            Some(o) if o.host != d.host_id() => {
                tracing::info!(sandbox = %id, owner = %o.host, "kept in the store: another host took it over");
                Ok(())
            }
            _ => d.delete_sandbox(id),
        });
        if let Err(e) = r {
            tracing::warn!(sandbox = %id, "removing its objects from the store: {e}");
        }
    }

    /// Takes a persistent snapshot of a sandbox, which runs on (or stays paused): a new
    /// template that sandboxes can be created from. `name` names it (a later snapshot of
    /// the same name replaces it for new sandboxes).
    pub fn snapshot(&self, id: &str, name: Option<&str>) -> Result<SnapshotRecord> {
        if let Some(n) = name {
            if !template::valid_name(n) {
                return Err(Error::BadRequest(format!(
                    "'{n}' is not a snapshot name (letters, digits, '-', '_', '.')"
                )));
            }
            if self.templates.get(n).is_ok() {
                return Err(Error::Conflict(format!(
                    "'{n}' is the name of a template: choose another snapshot name"
                )));
            }
        }
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.load_owned(id)?;
        let _snapshots = self.snapshot_guard();
        let template = self.sandbox_template(&rec)?;
        let sid = format!("snap-{}", ids::random_string(16));
        let dir = self.snapshots.prepare(&sid, false)?;
        let t = Instant::now();
        let made = (|| -> Result<&'static str> {
            let target = dir.join(SNAPSHOT_DIR);
            // Jailed, the VM writes it as its own user, and other sandboxes' users read it:
            // a full one, so that the sandbox's earlier snapshots stay its own.
            let jailed = self.driver.jailed();
            let kind = match (rec.state, &rec.api_sock, &rec.snapshot) {
                (State::Running, Some(api), _) => {
                    self.driver.lend_dir(&dir, &rec.dir)?;
                    match self.driver.snapshot(api, &target, !jailed) {
                        Ok(()) if jailed => "full",
                        Ok(()) => "diff",
                        Err(e) => {
                            tracing::debug!(sandbox = %rec.id, "diff snapshot refused ({e}); taking a full one");
                            let _ = std::fs::remove_dir_all(&target);
                            self.driver.snapshot(api, &target, false)?;
                            "full"
                        }
                    }
                }
                (State::Paused, _, _) if rec.memory_dropped => {
                    return Err(Error::Conflict(format!(
                        "sandbox {} was paused without its memory: connect to it (it boots \
                         from its disk) before taking a snapshot",
                        rec.id
                    )))
                }
                (State::Paused, _, Some(pause)) => {
                    link_dir(pause, &target)?;
                    "pause"
                }
                _ => {
                    return Err(Error::Corrupt(format!(
                        "sandbox {} has neither a process nor a snapshot",
                        rec.id
                    )))
                }
            };
            self.driver.share_snapshot(&target, &self.sandboxes_dir())?;
            self.snapshots.finish(&Template {
                name: sid.clone(),
                created_ms: ids::now_ms(),
                ..template.clone()
            })?;
            Ok(kind)
        })();
        let kind = match made {
            Ok(k) => k,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        // Times strictly increase, so that "newest first" is the order they were taken in.
        let latest = self.reg().all_snapshots()?.first().map(|s| s.created_ms);
        let snap = SnapshotRecord {
            id: sid,
            name: name.map(String::from),
            sandbox: rec.id.clone(),
            source_dir: rec.dir.clone(),
            template: rec.template.clone(),
            created_ms: ids::now_ms().max(latest.map_or(i64::MIN, |t| t + 1)),
            deleted: false,
        };
        let superseded: Vec<String> = match name {
            None => Vec::new(),
            Some(n) => self
                .reg()
                .all_snapshots()?
                .into_iter()
                .filter(|s| !s.deleted && s.name.as_deref() == Some(n))
                .map(|s| s.id)
                .collect(),
        };
        if let Err(e) = self.reg().insert_snapshot(&snap) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        for old in &superseded {
            self.reg().mark_snapshot_deleted(old)?;
            if let Some(o) = &self.ownership {
                if let Err(e) = o.snapshot_deleted(old) {
                    tracing::warn!(snapshot = %old, "removing it from the cluster: {e}");
                }
            }
        }
        tracing::info!(sandbox = %rec.id, snapshot = %snap.id, kind, elapsed = ?t.elapsed(), "snapshot taken");
        if let Some(o) = &self.ownership {
            if let Err(e) = o.snapshot_made(&snap) {
                tracing::warn!(snapshot = %snap.id, "recording it in the cluster: {e}");
            }
        }
        // A replaced snapshot goes once nothing needs it; a failure here is not the
        // snapshot's.
        if let Err(e) = self.collect_garbage_locked() {
            tracing::warn!("removing unused snapshots: {e}");
        }
        Ok(snap)
    }

    /// Live snapshots matching `q` (newest first), and whether there are more.
    pub fn list_snapshots(&self, q: &SnapshotQuery) -> Result<(Vec<SnapshotRecord>, bool)> {
        self.reg().list_snapshots(q)
    }

    /// Deletes the live snapshot `reference` (id or name, `:default` or no tag): it is no
    /// longer listed or usable; its files go once nothing needs them. A built template is
    /// not deleted here.
    pub fn delete_snapshot(&self, reference: &str) -> Result<SnapshotRecord> {
        let name =
            strip_tag(reference).map_err(|_| Error::SnapshotNotFound(reference.to_string()))?;
        let _snapshots = self.snapshot_guard();
        let Some(snap) = self.reg().resolve_snapshot(name)? else {
            if template::valid_name(name) && self.templates.get(name).is_ok() {
                return Err(Error::BadRequest(format!(
                    "'{name}' is a template, not a snapshot: templates are removed with \
                     `clade template rm`"
                )));
            }
            return Err(Error::SnapshotNotFound(reference.to_string()));
        };
        self.reg().mark_snapshot_deleted(&snap.id)?;
        tracing::info!(snapshot = %snap.id, "snapshot deleted");
        if let Some(o) = &self.ownership {
            if let Err(e) = o.snapshot_deleted(&snap.id) {
                tracing::warn!(snapshot = %snap.id, "removing it from the cluster: {e}");
            }
        }
        self.collect_garbage_locked()?;
        Ok(snap)
    }

    /// Removes deleted snapshots nothing needs any more, and the directories of killed
    /// sandboxes that only such snapshots held.
    pub fn collect_garbage(&self) -> Result<()> {
        let _snapshots = self.snapshot_guard();
        self.collect_garbage_locked()
    }

    fn collect_garbage_locked(&self) -> Result<()> {
        // One removal at a time, then look again: a removal can free others.
        'again: loop {
            let snaps = self.reg().all_snapshots()?;
            let sandboxes = self.reg().all()?;
            for s in snaps.iter().filter(|s| s.deleted) {
                let needed = sandboxes
                    .iter()
                    .any(|r| r.template == s.id || r.id == s.sandbox)
                    || snaps.iter().any(|o| o.template == s.id);
                if needed {
                    continue;
                }
                let dir = self.snapshots.dir(&s.id)?;
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(Error::io("removing", &dir)(e)),
                }
                self.reg().delete_snapshot(&s.id)?;
                let source_held = sandboxes.iter().any(|r| r.dir == s.source_dir)
                    || snaps
                        .iter()
                        .any(|o| o.id != s.id && o.source_dir == s.source_dir);
                if !source_held && s.source_dir.starts_with(self.sandboxes_dir()) {
                    if self.disk_layers_used(&s.source_dir)? {
                        mark_killed(&s.source_dir);
                    } else {
                        let _ = std::fs::remove_dir_all(&s.source_dir);
                    }
                }
                tracing::info!(snapshot = %s.id, "snapshot files removed");
                continue 'again;
            }
            break;
        }
        // Killed sandboxes' directories kept for the disk layers others stood on.
        let sandboxes = self.reg().all()?;
        let snaps = self.reg().all_snapshots()?;
        let Ok(entries) = std::fs::read_dir(self.sandboxes_dir()) else {
            return Ok(());
        };
        for dir in entries.flatten().map(|e| e.path()) {
            if !dir.join(KILLED_MARK).exists()
                || sandboxes.iter().any(|r| r.dir == dir)
                || snaps.iter().any(|s| s.source_dir == dir)
                || self.disk_layers_used(&dir)?
            {
                continue;
            }
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    tracing::info!(dir = %dir.display(), "a killed sandbox's disk layers removed: nothing stands on them")
                }
                Err(e) => tracing::warn!("removing {}: {e}", dir.display()),
            }
        }
        Ok(())
    }

    /// Whether a sandbox's disk chain has a layer in `dir`: fork children and the
    /// children of a fork's snapshot stand on the layer their parent froze, which stays
    /// in the parent's directory. A chain that cannot be read counts as standing on
    /// everything (kept until it can be, or its sandbox goes).
    fn disk_layers_used(&self, dir: &Path) -> Result<bool> {
        for r in self.reg().all()? {
            let Some(top) = r.disk.as_ref().filter(|_| r.dir != dir) else {
                continue;
            };
            if !top.exists() {
                continue;
            }
            match disk::ops::info(top) {
                Ok(chain) => {
                    if chain.iter().any(|l| l.path.starts_with(dir)) {
                        return Ok(true);
                    }
                }
                Err(e) => {
                    tracing::warn!(sandbox = %r.id, disk = %top.display(),
                        "disk chain not readable: keeping killed sandboxes' layers: {e}");
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// The log lines of a sandbox (any state): its VMM log and serial console, oldest
    /// first, at most [`MAX_LOG_LINES`] (the newest).
    pub fn logs(&self, id: &str) -> Result<Vec<LogLine>> {
        let rec = self.load(id)?;
        Ok(logs::read(&rec.dir))
    }

    /// Sets the time left to `timeout_s` from now. 0 times a running sandbox out now: it
    /// is paused (auto-pause) or killed before this returns, as E2B does; `None` then
    /// means it was killed.
    pub fn set_timeout(&self, id: &str, timeout_s: u64) -> Result<Option<Record>> {
        if timeout_s == 0 {
            return self.time_out_now(id);
        }
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_owned(id)?;
        rec.end_ms = ids::now_ms() + (timeout_s as i64) * 1000;
        self.reg().update(&rec)?;
        Ok(Some(rec))
    }

    /// The timeout's action, now ([`Host::set_timeout`] with 0). A paused sandbox has
    /// nothing left to time out: it stays as it is.
    fn time_out_now(&self, id: &str) -> Result<Option<Record>> {
        let lock = self.lock_of(id);
        let g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_owned(id)?;
        if rec.state != State::Running {
            return Ok(Some(rec));
        }
        if rec.auto_pause {
            rec.end_ms = ids::now_ms();
            tracing::info!(sandbox = %id, "timeout set to 0: pausing");
            let how = timeout_pause(&rec);
            return self.pause_locked(rec, how).map(Some);
        }
        drop(g);
        tracing::info!(sandbox = %id, "timeout set to 0: killing");
        self.kill(id).map(|()| None)
    }

    /// Keeps the sandbox alive at least `duration_s` more (never shortens it).
    pub fn refresh(&self, id: &str, duration_s: u64) -> Result<Record> {
        self.check_timeout(duration_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_owned(id)?;
        rec.end_ms = rec.end_ms.max(ids::now_ms() + (duration_s as i64) * 1000);
        self.reg().update(&rec)?;
        Ok(rec)
    }

    /// Pauses a running sandbox: snapshot (a diff on the VM's last snapshot when it has
    /// one, else full) into its directory, then its process stops. Without
    /// `how.keep_memory`, a filesystem-only pause ([`Host::drop_memory_locked`]).
    pub fn pause(&self, id: &str, how: PauseOptions) -> Result<Record> {
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.load_owned(id)?;
        self.pause_locked(rec, how)
    }

    fn pause_locked(&self, rec: Record, how: PauseOptions) -> Result<Record> {
        let r = self.pause_vm_locked(rec, how)?;
        self.owned(&r);
        Ok(r)
    }

    fn pause_vm_locked(&self, mut rec: Record, how: PauseOptions) -> Result<Record> {
        if rec.state == State::Paused {
            return Err(Error::Conflict(format!(
                "sandbox {} is already paused",
                rec.id
            )));
        }
        if !how.keep_memory {
            return self.drop_memory_locked(rec);
        }
        if let (true, Some(vsock)) = (how.require_healthy_guest, &rec.vsock) {
            check_guest(&rec.id, vsock)?;
        }
        let (Some(pid), Some(api)) = (rec.pid, rec.api_sock.clone()) else {
            return Err(Error::Corrupt(format!(
                "running sandbox {} has no process",
                rec.id
            )));
        };
        let dir = rec.dir.join(format!("pause-{}", rec.pauses + 1));
        let t = std::time::Instant::now();
        // The guest stops at the snapshot's instant and does nothing more (no packet sent,
        // no disk write) that a resume would not remember.
        self.driver.set_vcpus_running(&api, false)?;
        // A diff while the chain stays short (see PAUSE_CHAIN_MAX), else a full one.
        let diff = self
            .driver
            .snapshot_layers(&api)
            .is_none_or(|n| n < PAUSE_CHAIN_MAX);
        let snapshotted = match self.driver.snapshot(&api, &dir, diff) {
            Ok(()) => Ok(if diff { "diff" } else { "full" }),
            Err(e) if diff => {
                tracing::debug!(sandbox = %rec.id, "diff snapshot refused ({e}); taking a full one");
                let _ = std::fs::remove_dir_all(&dir);
                self.driver.snapshot(&api, &dir, false).map(|()| "full")
            }
            Err(e) => Err(e),
        };
        let kind = match snapshotted {
            Ok(k) => k,
            Err(e) => {
                // Not paused after all: it runs on as before.
                if let Err(u) = self.driver.set_vcpus_running(&api, true) {
                    tracing::warn!(sandbox = %rec.id, "unpausing after a failed pause: {u}");
                }
                return Err(e);
            }
        };
        self.driver.stop(pid, &api)?;
        self.driver.adopt_working_set(&rec.dir);
        rec.state = State::Paused;
        rec.pid = None;
        rec.api_sock = None;
        rec.vsock = None;
        rec.snapshot = Some(dir);
        rec.pauses += 1;
        // Its memory is local again (a sandbox taken over resumed from the store).
        rec.remote = None;
        self.reg().update(&rec)?;
        tracing::info!(sandbox = %rec.id, kind, elapsed = ?t.elapsed(), "paused");
        self.queue_upload(&rec.id);
        // Its wake will restore this snapshot: a ready VM process may open it now.
        if let Some(snapshot) = &rec.snapshot {
            self.driver.open_ahead(rec.vcpus, rec.mem_mib, snapshot);
        }
        // Its TAP, opened ahead again for the resume (off the resume's path).
        if let (Some(i), Ok(n)) = (rec.net, &self.networks) {
            n.reopen_tap(i);
        }
        Ok(rec)
    }

    /// A filesystem-only pause (E2B's `memory: false`): the guest flushes what it wrote to
    /// its disk, then its VM process ends. Its memory is gone, its disk stays, and its next
    /// wake boots the template's kernel from that disk. The guest's agent must answer (as
    /// E2B requires): one that does not leaves the sandbox running and the pause an error.
    fn drop_memory_locked(&self, mut rec: Record) -> Result<Record> {
        let template = self.sandbox_template(&rec)?;
        // Refused before anything stops: a sandbox that could not boot would be lost.
        self.boot_files(&rec, &template)?;
        let (Some(pid), Some(api), Some(vsock)) =
            (rec.pid, rec.api_sock.clone(), rec.vsock.clone())
        else {
            return Err(Error::Corrupt(format!(
                "running sandbox {} has no process",
                rec.id
            )));
        };
        let t = std::time::Instant::now();
        if !template.test_guest {
            flush_guest(&rec.id, &vsock)?;
        }
        self.driver.stop(pid, &api)?;
        self.driver.adopt_working_set(&rec.dir);
        rec.state = State::Paused;
        rec.pid = None;
        rec.api_sock = None;
        rec.vsock = None;
        // Nothing to restore: an earlier pause's snapshot is not this sandbox any more.
        rec.snapshot = None;
        rec.memory_dropped = true;
        rec.pauses += 1;
        self.reg().update(&rec)?;
        tracing::info!(sandbox = %rec.id, kind = "filesystem", elapsed = ?t.elapsed(), "paused");
        if let (Some(i), Ok(n)) = (rec.net, &self.networks) {
            n.reopen_tap(i);
        }
        Ok(rec)
    }

    /// What a sandbox whose memory is dropped boots: its template's kernel, with a clear
    /// error when it cannot (a template built before builds recorded their boot, a disk
    /// that stands on layers in the object store).
    fn boot_files(&self, rec: &Record, template: &Template) -> Result<template::BootFiles> {
        let Some(boot) = &template.boot else {
            return Err(Error::BadRequest(format!(
                "sandbox {}: its template '{}' records no boot (it was built before \
                 templates kept their kernel; rebuild it with clade template build), so its \
                 memory cannot be dropped: pause and resume with memory",
                rec.id, template.name
            )));
        };
        if rec.remote.is_some() || from_store(&rec.dir) {
            return Err(Error::BadRequest(format!(
                "sandbox {}: its disk stands on layers in the object store, which a boot \
                 cannot read yet: pause and resume with memory",
                rec.id
            )));
        }
        self.templates.boot_files(boot)
    }

    /// Boots a sandbox whose memory was dropped (or is to be, `on_resume="reboot"`) from
    /// its own disk: after a filesystem-only pause the disk it wrote, after a pause with
    /// memory a new overlay on the disk layer that pause froze.
    fn boot_locked(&self, rec: &mut Record, template: &Template) -> Result<()> {
        let files = self.boot_files(rec, template)?;
        let disk = match (template.disk, rec.memory_dropped, &rec.snapshot) {
            (false, _, _) => None,
            (true, true, _) => match &rec.disk {
                Some(d) if d.exists() => Some(d.clone()),
                _ => {
                    return Err(Error::Corrupt(format!(
                        "sandbox {} was paused without its memory, but its disk {} is gone",
                        rec.id,
                        rec.disk.as_deref().unwrap_or(Path::new("")).display()
                    )))
                }
            },
            (true, false, Some(snapshot)) => {
                let prepared = vmm::PreparedSnapshot::open(snapshot, vmm::CpuCheck::default())
                    .map_err(|e| Error::Vm(format!("snapshot {}: {e}", snapshot.display())))?;
                let Some(saved) = prepared.disk() else {
                    return Err(Error::Corrupt(format!(
                        "snapshot {} of sandbox {} has no disk",
                        snapshot.display(),
                        rec.id
                    )));
                };
                let overlay = rec.dir.join(format!("disk-r{}.cdsk", rec.pauses));
                let _ = std::fs::remove_file(&overlay);
                disk::ops::create(
                    &overlay,
                    &disk::ops::CreateOptions {
                        virtual_size: None,
                        block_size: None,
                        parent: Some(saved.layer.clone()),
                    },
                )
                .map_err(|e| Error::Vm(format!("a disk to boot sandbox {}: {e}", rec.id)))?;
                Some(overlay)
            }
            (true, false, None) => {
                return Err(Error::Corrupt(format!(
                    "paused sandbox {} has no snapshot",
                    rec.id
                )))
            }
        };
        self.start_vm(rec, template, Origin::Boot { files, disk })?;
        rec.memory_dropped = false;
        Ok(())
    }

    /// Resumes a paused sandbox (E2B `resume`): an error if it runs. With `reboot`, its
    /// memory is dropped and it boots from its disk (E2B's `memory: false`).
    pub fn resume(&self, id: &str, timeout_s: u64, reboot: bool) -> Result<Record> {
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.load_or_adopt(id)?;
        if rec.state == State::Running {
            return Err(Error::Conflict(format!("sandbox {id} is already running")));
        }
        self.resume_locked(rec, timeout_s, reboot)
    }

    /// E2B `connect`: a running sandbox gets at least `timeout_s` more, a paused one is
    /// resumed first (with `reboot`, booted from its disk). Returns the sandbox and whether
    /// it was resumed.
    pub fn connect(&self, id: &str, timeout_s: u64, reboot: bool) -> Result<(Record, bool)> {
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_or_adopt(id)?;
        if rec.state == State::Running {
            rec.end_ms = rec.end_ms.max(ids::now_ms() + (timeout_s as i64) * 1000);
            self.reg().update(&rec)?;
            return Ok((rec, false));
        }
        Ok((self.resume_locked(rec, timeout_s, reboot)?, true))
    }

    fn resume_locked(&self, rec: Record, timeout_s: u64, reboot: bool) -> Result<Record> {
        let _room = self.admit(rec.vcpus, rec.mem_mib, 1)?;
        let r = self.resume_vm_locked(rec, timeout_s, reboot)?;
        self.owned(&r);
        Ok(r)
    }

    fn resume_vm_locked(&self, mut rec: Record, timeout_s: u64, reboot: bool) -> Result<Record> {
        let template = self.sandbox_template(&rec)?;
        if reboot || rec.memory_dropped {
            let t = std::time::Instant::now();
            self.boot_locked(&mut rec, &template)?;
            rec.end_ms = ids::now_ms() + (timeout_s as i64) * 1000;
            self.reg().update(&rec)?;
            tracing::info!(sandbox = %rec.id, elapsed = ?t.elapsed(), "booted from its disk");
            return Ok(rec);
        }
        // A pause another host may take over is resumed by one host only.
        if let (true, Some(d)) = (rec.durable(), &self.durable) {
            d.claim(&rec.id, rec.pauses)?;
        }
        let snapshot = match (&rec.remote, &rec.snapshot) {
            (Some(id), _) => PathBuf::from(id),
            (None, Some(s)) => s.clone(),
            (None, None) => {
                return Err(Error::Corrupt(format!(
                    "paused sandbox {} has no snapshot",
                    rec.id
                )))
            }
        };
        let t = std::time::Instant::now();
        let origin = Origin::Snapshot {
            dir: &snapshot,
            reused: false,
        };
        self.start_vm(&mut rec, &template, origin)?;
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
        // In a cluster, room for the children (of the parent's shape), held until they are
        // recorded (alone, nothing is read for it). A sandbox this host does not have is
        // fork_vm's to refuse.
        let in_cluster = self.ownership.is_some() && (1..=self.cfg.max_fork).contains(&count);
        let _room = if in_cluster {
            match self.reg().get(id)? {
                Some(p) => self.admit(p.vcpus, p.mem_mib, count)?,
                None => None,
            }
        } else {
            None
        };
        let children = self.fork_vm(id, count, timeout_s)?;
        for c in &children {
            self.owned(c);
        }
        Ok(children)
    }

    fn fork_vm(&self, id: &str, count: usize, timeout_s: u64) -> Result<Vec<Record>> {
        self.check_timeout(timeout_s)?;
        if count == 0 || count > self.cfg.max_fork {
            return Err(Error::BadRequest(format!(
                "count must be 1 to {}, not {count}",
                self.cfg.max_fork
            )));
        }
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let parent = self.load_owned(id)?;
        // Children are secured as their parent, each with tokens of its own: made before
        // anything starts, so that a failing random source leaves nothing half-forked.
        let mut tokens = (0..count)
            .map(|_| -> Result<ChildTokens> {
                let token = |has: bool| {
                    has.then(ids::new_token).transpose().map_err(Error::io(
                        "making an access token for a child of",
                        &parent.dir,
                    ))
                };
                Ok((
                    token(parent.envd_token.is_some())?,
                    token(parent.traffic_token.is_some())?,
                ))
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter();
        let Some(api) = parent
            .api_sock
            .clone()
            .filter(|_| parent.state == State::Running)
        else {
            return Err(Error::Conflict(format!(
                "sandbox {id} is paused: connect to it before forking"
            )));
        };
        let template = self.sandbox_template(&parent)?;
        // Short: the children's Unix sockets are named inside it (at most 107 bytes).
        let prefix = self
            .sandboxes_dir()
            .join("forks")
            .join(ids::random_string(8));
        std::fs::create_dir_all(&prefix).map_err(Error::io("creating", &prefix))?;
        // Children get the parent's egress policy, each on a network of its own.
        let policy = policy_of(&parent)?;
        let mut nets: Vec<u32> = Vec::new();
        let release_all = |nets: &mut Vec<u32>| {
            for i in nets.drain(..) {
                self.release_net(Some(i));
            }
        };
        if template.net {
            for _ in 0..count {
                match self.acquire_net(&template, &policy) {
                    Ok(n) => nets.extend(n),
                    Err(e) => {
                        release_all(&mut nets);
                        return Err(e);
                    }
                }
            }
        }
        let specs: Vec<String> = match self.networks.as_ref() {
            Ok(n) => {
                // The children's VM processes open their TAPs by name (their parent starts
                // them): the service lets go of the ones it opened ahead. Jailed, each
                // child is started by the service and is handed its TAP.
                if !self.driver.jailed() {
                    for &i in &nets {
                        drop(n.take_tap(i));
                    }
                }
                nets.iter().map(|&i| n.tap_spec(i)).collect()
            }
            Err(_) => Vec::new(),
        };
        // Children open the parent's disk chain anew: layers read lazily from the store
        // are made whole first.
        if let (true, Some(d), Some(top)) = (from_store(&parent.dir), &self.durable, &parent.disk) {
            if let Err(e) = d.complete_disk(top) {
                release_all(&mut nets);
                return Err(e);
            }
        }
        // Jailed, each child is a VM process (and a user) of its own, restored from a
        // snapshot: live children would share their parent's jail and user.
        let forked = if self.driver.jailed() {
            Err(Error::VmApi {
                op: "fork",
                message: vmm::CANNOT_FORK_LIVE.to_string(),
            })
        } else {
            self.driver
                .fork(&api, count, &prefix, !template.test_guest, &specs)
        };
        let live = match forked {
            Ok(children) => Some(children),
            // A VM whose memory cannot be frozen now (e.g. it forked since its restore and
            // then wrote memory the record of which is gone) cannot fork live: the
            // children restore a snapshot instead.
            Err(Error::VmApi { message, .. }) if message.contains(vmm::CANNOT_FORK_LIVE) => None,
            Err(e) => {
                release_all(&mut nets);
                return Err(e);
            }
        };
        let mut nets = nets.into_iter();
        let now = ids::now_ms();
        let new_child =
            |cid: String, dir: PathBuf, (envd_token, traffic_token): ChildTokens| Record {
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
                auto_resume: parent.auto_resume,
                envd_token,
                traffic_token,
                mask_host: parent.mask_host.clone(),
                metadata: parent.metadata.clone(),
                env_vars: parent.env_vars.clone(),
                vcpus: parent.vcpus,
                mem_mib: parent.mem_mib,
                disk: None,
                crash: None,
                parent: Some(parent.id.clone()),
                net: None,
                egress: parent.egress.clone(),
                remote: None,
                published_pause: None,
                published_ms: None,
                pause_keeps_memory: parent.pause_keeps_memory,
                memory_dropped: false,
            };
        let mut out = Vec::new();
        match live {
            Some(children) => {
                for c in children {
                    let cid = ids::new_sandbox_id();
                    let dir = self.sandboxes_dir().join(&cid);
                    self.dirs.make(&dir).map_err(Error::io("creating", &dir))?;
                    if from_store(&parent.dir) {
                        write_template_copy(&dir, &template)?;
                    }
                    let mut rec = new_child(cid, dir, tokens.next().unwrap_or_default());
                    rec.net = nets.next();
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
                // Jailed, the children's users may read the base and what it stands on,
                // but not the parent's earlier snapshots: the base is a full one.
                let jailed = self.driver.jailed();
                let snapshotted = self
                    .driver
                    .lend_dir(&prefix, &parent.dir)
                    .and_then(|()| self.driver.snapshot(&api, &base, !jailed))
                    .or_else(|_| {
                        let _ = std::fs::remove_dir_all(&base);
                        self.driver.snapshot(&api, &base, false)
                    })
                    .and_then(|()| self.driver.share_snapshot(&base, &self.sandboxes_dir()));
                if let Err(e) = snapshotted {
                    nets.for_each(|i| self.release_net(Some(i)));
                    return Err(e);
                }
                for _ in 0..count {
                    let cid = ids::new_sandbox_id();
                    let dir = self.sandboxes_dir().join(&cid);
                    self.dirs.make(&dir).map_err(Error::io("creating", &dir))?;
                    if from_store(&parent.dir) {
                        write_template_copy(&dir, &template)?;
                    }
                    let mut rec = new_child(cid, dir, tokens.next().unwrap_or_default());
                    rec.net = nets.next();
                    let origin = Origin::Snapshot {
                        dir: &base,
                        reused: false,
                    };
                    if let Err(e) = self.start_vm(&mut rec, &template, origin) {
                        self.release_net(rec.net);
                        let _ = std::fs::remove_dir_all(&rec.dir);
                        // The children started so far stay: each is a sandbox of its own.
                        tracing::warn!(sandbox = %id, "fork child {}: {e}", out.len() + 1);
                        nets.by_ref().for_each(|i| self.release_net(Some(i)));
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

    /// A sandbox's metrics taken in `[from_ms, to_ms]`, oldest first: the samples taken
    /// every [`usage::SAMPLE_INTERVAL`] while it ran ([`Host::sample_metrics`]), and, when
    /// it runs and the range holds now, one taken now. That one's CPU figure covers the
    /// time since the previous sample of this VM (at least [`usage::MIN_INTERVAL`] ago),
    /// or else a short window measured now.
    pub fn metrics(&self, id: &str, from_ms: i64, to_ms: i64) -> Result<Vec<Metrics>> {
        if to_ms < from_ms {
            return Err(Error::BadRequest(format!(
                "the metrics range ends ({to_ms} ms) before it starts ({from_ms} ms)"
            )));
        }
        let rec = self.load_usable(id)?;
        let mut out = self.history.range(&rec.id, from_ms, to_ms);
        let now = ids::now_ms();
        if let (Some(pid), true) = (
            rec.pid.filter(|_| rec.state == State::Running),
            (from_ms..=to_ms).contains(&now),
        ) {
            let pid = self.driver.vm_process(pid);
            let cpu = usage::recent_cpu(&self.cpu_samples, pid).unwrap_or(0.0);
            out.push(self.measure(&rec, pid, cpu));
        }
        Ok(out)
    }

    /// The newest metrics of each of `ids` that exists (E2B's `GET /sandboxes/metrics`):
    /// its last sample, or one taken now for a running sandbox not sampled yet.
    pub fn latest_metrics(&self, ids: &[String]) -> Result<Vec<(String, Metrics)>> {
        let mut out = Vec::new();
        for id in ids {
            let rec = match self.load_usable(id) {
                Ok(r) => r,
                Err(Error::NotFound(_)) => continue,
                Err(e) => return Err(e),
            };
            let m = match (self.history.latest(&rec.id), rec.pid) {
                (Some(m), _) => Some(m),
                (None, Some(pid)) if rec.state == State::Running => {
                    let pid = self.driver.vm_process(pid);
                    let cpu = usage::recent_cpu(&self.cpu_samples, pid).unwrap_or(0.0);
                    Some(self.measure(&rec, pid, cpu))
                }
                _ => None,
            };
            if let Some(m) = m {
                out.push((rec.id, m));
            }
        }
        Ok(out)
    }

    /// Takes a sample of every running sandbox's metrics when one is due (every
    /// [`usage::SAMPLE_INTERVAL`]; the service's ticker calls this). A VM first seen now
    /// gets its CPU baseline and its first sample at the next round.
    pub fn sample_metrics(&self) -> Result<()> {
        if !self.history.due() {
            return Ok(());
        }
        let all = self.reg().all()?;
        let mut round = Vec::new();
        for rec in all.iter().filter(|r| r.state == State::Running) {
            let Some(pid) = rec.pid.map(|p| self.driver.vm_process(p)) else {
                continue;
            };
            if let Some(cpu) = usage::cpu_since(&self.cpu_samples, pid, false) {
                round.push((rec.id.clone(), self.measure(rec, pid, cpu)));
            }
        }
        let exists: std::collections::HashSet<&str> = all.iter().map(|r| r.id.as_str()).collect();
        self.history.record(round, |id| exists.contains(id));
        Ok(())
    }

    /// A metrics sample of a running sandbox now, `pid` the process that holds its VM
    /// ([`VmDriver::vm_process`]), with its CPU use (percent of one host CPU) measured by
    /// the caller.
    fn measure(&self, rec: &Record, pid: i32, cpu: f64) -> Metrics {
        let (disk_used, disk_total) = usage::disk(&rec.dir);
        Metrics {
            at_ms: ids::now_ms(),
            cpu_count: rec.vcpus,
            cpu_used_pct: (cpu / rec.vcpus.max(1) as f64).min(100.0),
            mem_used: usage::memory(pid).unwrap_or(0),
            mem_total: rec.mem_mib * 1024 * 1024,
            disk_used,
            disk_total,
        }
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
                        let how = timeout_pause(&r);
                        self.fence(&r)
                            .and_then(|()| self.pause_locked(r, how))
                            .map(|_| ())
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
        self.collect_garbage()?;
        let all = self.reg().all()?;
        // Networks no sandbox holds (a crash's leftovers) go; the rest are taken over.
        if let Ok(n) = &self.networks {
            let mut keep = Vec::new();
            for r in &all {
                if let Some(i) = r.net {
                    // Its rules stay in its namespace as they were; its DNS resolves
                    // nothing if the recorded policy cannot be read.
                    let policy = policy_of(r).unwrap_or_else(|e| {
                        tracing::error!("{e}: the sandbox's DNS answers nothing");
                        EgressPolicy::deny_all()
                    });
                    keep.push((i, policy));
                }
            }
            n.recover(&keep)?;
        }
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

/// What the uploader publishes.
#[derive(Debug)]
enum Upload {
    /// A sandbox's latest pause.
    Pause(String),
    /// A built template.
    Template(String),
}

/// The uploader: publishes what is queued, one job at a time; a job that fails is tried
/// again later with backoff (its sandbox's local copy stays meanwhile), while the others
/// go on. A pause job ends once its sandbox is no longer paused at that pause.
fn uploader(host: std::sync::Weak<Host>, rx: std::sync::mpsc::Receiver<Upload>) {
    use std::sync::mpsc::RecvTimeoutError;
    // (when due, failures so far, job)
    let mut pending: Vec<(Instant, u32, Upload)> = Vec::new();
    loop {
        let got = match pending.iter().map(|p| p.0).min() {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(due) => rx.recv_timeout(due.saturating_duration_since(Instant::now())),
        };
        match got {
            Ok(job) => pending.push((Instant::now(), 0, job)),
            Err(RecvTimeoutError::Timeout) => {}
            // The host is gone.
            Err(RecvTimeoutError::Disconnected) => return,
        }
        while let Ok(job) = rx.try_recv() {
            pending.push((Instant::now(), 0, job));
        }
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = pending.into_iter().partition(|p| p.0 <= now);
        pending = later;
        for (_, attempt, job) in due {
            let Some(h) = host.upgrade() else { return };
            let Some(d) = h.durable.clone() else { return };
            let (id, done) = match &job {
                Upload::Pause(id) => (id, h.publish_pause(&d, id)),
                Upload::Template(name) => (name, h.publish_template(&d, name)),
            };
            match done {
                Ok(()) => d.set_failure(id, None),
                Err(e) => {
                    let wait = crate::durable::backoff(attempt);
                    tracing::warn!(?job, attempt, retry_in = ?wait, "upload failed: {e}");
                    d.set_failure(id, Some(e.to_string()));
                    pending.push((Instant::now() + wait, attempt + 1, job));
                }
            }
        }
    }
}

/// Keeps a copy of `t` in sandbox directory `dir`: the template of a sandbox whose
/// template is not one of this host's ([`Host::sandbox_template`]).
/// Publishes the snapshot in `dir` (with its chain) and a template object naming it: other
/// hosts create sandboxes of `template` from the store.
fn publish_as_template(d: &Durable, dir: &Path, template: Template) -> Result<()> {
    let t = Instant::now();
    let files = store::publish::chain_files(dir).map_err(crate::durable::store_err)?;
    let (manifest, report) = d.publish_chain(&files)?;
    let name = template.name.clone();
    d.put_template_object(&crate::durable::TemplateObject {
        format: crate::durable::TEMPLATE_FORMAT.into(),
        version: crate::durable::SANDBOX_VERSION,
        snapshot: manifest.id.clone(),
        template,
        published_ms: ids::now_ms(),
        host: d.host_id().to_string(),
    })?;
    tracing::info!(template = %name, snapshot = %manifest.id,
        uploaded = report.bytes_uploaded, elapsed = ?t.elapsed(), "template published");
    Ok(())
}

/// The published snapshots that are sandbox `id`'s own: those its store object lists, and
/// those of `files` (a chain just published) under one of `dirs`.
fn own_snapshots(
    d: &Durable,
    id: &str,
    files: &[store::publish::SnapshotFiles],
    dirs: &[&Path],
) -> Result<Vec<String>> {
    let mut own: Vec<String> = d
        .sandbox_object(id)?
        .map(|o| o.own_snapshots)
        .unwrap_or_default();
    for f in files
        .iter()
        .filter(|f| dirs.iter().any(|d| f.state.starts_with(d)))
    {
        let sid = snapshot::state_file::read_header(&f.state)
            .map_err(|e| Error::Corrupt(format!("{}: {e}", f.state.display())))?
            .meta
            .id
            .to_string();
        if !own.contains(&sid) {
            own.push(sid);
        }
    }
    Ok(own)
}

/// What the store keeps of `rec` (see [`SandboxObject`]): resumable from `snapshot`, the
/// claim of `pause`.
fn sandbox_object(
    rec: &Record,
    template: Template,
    snapshot: String,
    pause: u32,
    own_snapshots: Vec<String>,
    d: &Durable,
    now: i64,
) -> SandboxObject {
    SandboxObject {
        format: crate::durable::SANDBOX_FORMAT.into(),
        version: crate::durable::SANDBOX_VERSION,
        id: rec.id.clone(),
        snapshot,
        pause,
        own_snapshots,
        template,
        started_ms: rec.started_ms,
        auto_pause: rec.auto_pause,
        auto_resume: rec.auto_resume,
        envd_token: rec.envd_token.clone(),
        traffic_token: rec.traffic_token.clone(),
        mask_host: rec.mask_host.clone(),
        metadata: rec.metadata.clone(),
        env_vars: rec.env_vars.clone(),
        egress: rec.egress.clone(),
        parent: rec.parent.clone(),
        published_ms: now,
        host: d.host_id().to_string(),
        checkpoint_ms: None,
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

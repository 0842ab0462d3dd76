//! Durable sandboxes: what `clade serve --store URL` keeps in an object store so that a
//! paused sandbox outlives the host it slept on (the lifecycle's use of it is in `host`).
//!
//! - Its **pause snapshot**, published (with the chain below it: earlier pauses, the
//!   template) by an uploader thread after the pause returned: a pause costs the client
//!   what it cost before, and the local copy stays.
//! - A **sandbox object** `sandboxes/<id>.json` ([`SandboxObject`]), written once its
//!   pause is published: what another host needs to take the sandbox over (the snapshot
//!   to resume, its template's shape, metadata, env vars, egress policy), and the pause
//!   snapshots that are the sandbox's own (deleted with it).
//! - **Claims** `claims/<id>/<pause>`: every resume of a pause a store has seen first
//!   writes this object if absent. Exactly one host's write succeeds, so one pause is
//!   resumed once, whichever hosts try.
//!
//! The sandbox object is the one object a publish replaces (snapshots' objects are only
//! added, under content-derived keys), so it is the one a host that lost the sandbox
//! must not write. Checking ownership first and writing after is not enough (a host
//! stalled between the two would overwrite the new owner's object), so the write itself
//! is fenced by a claim (see [`Durable::put_sandbox_object`]): conditional creates are
//! all it needs, which every store offers (S3's `If-None-Match`, `file://`, `memory://`).
//!
//! A host that takes a sandbox over restores its snapshot lazily through the host's
//! fetcher (the store crate's chunk cache, shared with the VM processes read-only; the VM
//! process itself opens no network socket).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use store::cache::ChunkCache;
use store::fetcher::FetcherThread;
use store::location::StoreOptions;
use store::Store;

use crate::error::{Error, Result};
use crate::template::Template;

/// Where the store is and how the host caches what it fetches.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// `s3://bucket/prefix`, `gs://…`, `az://…`, `file:///dir`, `memory://…`.
    pub url: String,
    /// Endpoint and time limits.
    pub options: StoreOptions,
    /// The chunk cache's directory.
    pub cache_dir: PathBuf,
    /// The chunk cache's size limit (bytes).
    pub cache_limit: u64,
}

/// The longest [`Durable::prepare`] may take (each store request in it is bounded by the
/// store's own timeout; a multi-GiB disk layer is many of them).
pub const PREPARE_TIMEOUT: Duration = Duration::from_secs(1800);

/// The sandbox object's format name.
pub const SANDBOX_FORMAT: &str = "clade-sandbox";
/// Its version.
pub const SANDBOX_VERSION: u32 = 1;

/// What the store keeps of a sandbox: `sandboxes/<id>.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxObject {
    /// [`SANDBOX_FORMAT`].
    pub format: String,
    /// [`SANDBOX_VERSION`].
    pub version: u32,
    /// The sandbox's id.
    pub id: String,
    /// The published snapshot it resumes from.
    pub snapshot: String,
    /// The pause that snapshot is (its claim is `claims/<id>/<pause>`).
    pub pause: u32,
    /// Published snapshots that are this sandbox's own pauses (deleted with it), oldest
    /// first.
    pub own_snapshots: Vec<String>,
    /// Its template's shape (the resuming host need not have the template).
    pub template: Template,
    /// When it was created (ms).
    pub started_ms: i64,
    /// Pause instead of kill on timeout.
    pub auto_pause: bool,
    /// Woken by a request while paused (objects published before it existed: no).
    #[serde(default)]
    pub auto_resume: bool,
    /// Its access tokens and Host mask (see [`crate::Record`]): the same on any host.
    #[serde(default)]
    pub envd_token: Option<String>,
    #[serde(default)]
    pub traffic_token: Option<String>,
    #[serde(default)]
    pub mask_host: Option<String>,
    /// User metadata.
    pub metadata: BTreeMap<String, String>,
    /// Environment variables.
    pub env_vars: BTreeMap<String, String>,
    /// Its egress policy (JSON), `None`: allow all.
    pub egress: Option<String>,
    /// The sandbox it was forked from.
    pub parent: Option<String>,
    /// When it was published (ms).
    pub published_ms: i64,
    /// The host that published it.
    pub host: String,
    /// Set when `snapshot` is a checkpoint of the sandbox while it ran (`clade serve
    /// --checkpoint-every`), not a pause: when it was taken (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_ms: Option<i64>,
}

impl SandboxObject {
    /// Parses and checks a sandbox object read from the store (untrusted).
    pub fn parse(id: &str, bytes: &[u8]) -> Result<SandboxObject> {
        let bad = |why: String| Error::Store(format!("{}: {why}", sandbox_key(id)));
        let o: SandboxObject =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("not a sandbox object: {e}")))?;
        if o.format != SANDBOX_FORMAT || o.version != SANDBOX_VERSION {
            return Err(bad(format!(
                "format {} version {} (this host reads {SANDBOX_FORMAT} {SANDBOX_VERSION})",
                o.format, o.version
            )));
        }
        if o.id != id {
            return Err(bad(format!("it names sandbox {}", o.id)));
        }
        for s in std::iter::once(&o.snapshot).chain(&o.own_snapshots) {
            store::manifest::parse_snapshot_id(s).map_err(|e| bad(e.to_string()))?;
        }
        if !crate::template::valid_name(&o.template.name)
            || o.template.vcpus == 0
            || o.template.mem_mib == 0
        {
            return Err(bad("its template is not a valid one".into()));
        }
        Ok(o)
    }
}

/// The template object's format name.
pub const TEMPLATE_FORMAT: &str = "clade-template";

/// What the store keeps of a built template: `templates/<name>.json`. Another host creates
/// sandboxes of it from the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateObject {
    /// [`TEMPLATE_FORMAT`].
    pub format: String,
    /// [`SANDBOX_VERSION`].
    pub version: u32,
    /// Its published snapshot.
    pub snapshot: String,
    /// The template.
    pub template: Template,
    /// When it was published (ms).
    pub published_ms: i64,
    /// The host that published it.
    pub host: String,
}

impl TemplateObject {
    /// Parses and checks a template object read from the store (untrusted).
    pub fn parse(name: &str, bytes: &[u8]) -> Result<TemplateObject> {
        let bad = |why: String| Error::Store(format!("{}: {why}", template_key(name)));
        let o: TemplateObject = serde_json::from_slice(bytes)
            .map_err(|e| bad(format!("not a template object: {e}")))?;
        if o.format != TEMPLATE_FORMAT || o.version != SANDBOX_VERSION {
            return Err(bad(format!("format {} version {}", o.format, o.version)));
        }
        if o.template.name != name || o.template.vcpus == 0 || o.template.mem_mib == 0 {
            return Err(bad(format!("it describes template '{}'", o.template.name)));
        }
        store::manifest::parse_snapshot_id(&o.snapshot).map_err(|e| bad(e.to_string()))?;
        Ok(o)
    }
}

/// The key of template `name`'s object.
pub fn template_key(name: &str) -> String {
    format!("templates/{name}.json")
}

/// The key of sandbox `id`'s object.
pub fn sandbox_key(id: &str) -> String {
    format!("sandboxes/{id}.json")
}

/// The key of the claim on pause `pause` of sandbox `id`.
pub fn claim_key(id: &str, pause: u32) -> String {
    format!("claims/{id}/{pause}")
}

/// The host's connection to its store: a runtime of its own for the store's calls (a
/// store's pooled connections belong to one runtime) and the fetcher its VM processes use.
pub struct Durable {
    rt: tokio::runtime::Runtime,
    store: Store,
    fetcher: FetcherThread,
    host_id: String,
    /// The last upload failure of each sandbox whose upload is being retried.
    failures: Mutex<BTreeMap<String, String>>,
    /// The sandbox objects last listed ([`Durable::sandbox_objects`]).
    listed: Mutex<Listed>,
}

/// The store's sandbox objects as last listed, by key.
#[derive(Default)]
struct Listed {
    at: Option<std::time::Instant>,
    objects: BTreeMap<String, SandboxObject>,
}

/// How long a listing of the store's sandbox objects is reused: a list of sandboxes costs
/// at most one store listing per this interval (plus one read per object not seen before).
pub const LIST_REFRESH: Duration = Duration::from_secs(2);

/// Sandbox objects read at once when listing.
const LIST_READS: usize = 8;

impl std::fmt::Debug for Durable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Durable")
            .field("store", &self.store)
            .field("host", &self.host_id)
            .finish()
    }
}

impl Durable {
    /// Opens the store, and starts the fetcher on `<state dir>/fetcher.sock`. The host's
    /// id (named in its claims) is kept in `<state dir>/host-id`.
    pub fn open(cfg: &StoreConfig, state_dir: &Path) -> Result<Durable> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("clade-store")
            .enable_all()
            .build()
            .map_err(Error::io("starting the store runtime", state_dir))?;
        let store = {
            let _g = rt.enter();
            Store::open(&cfg.url, &cfg.options).map_err(store_err)?
        };
        // The fetcher's runtime is its own: it gets its own store.
        let fetch_store = Store::open(&cfg.url, &cfg.options).map_err(store_err)?;
        let cache =
            ChunkCache::new(&cfg.cache_dir, fetch_store, cfg.cache_limit).map_err(store_err)?;
        let fetcher =
            FetcherThread::start(&state_dir.join("fetcher.sock"), cache).map_err(store_err)?;
        let host_id = host_id(state_dir)?;
        tracing::info!(store = %store.url(), host = %host_id, "object store open");
        Ok(Durable {
            rt,
            store,
            fetcher,
            host_id,
            failures: Mutex::default(),
            listed: Mutex::default(),
        })
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The fetcher's socket (VM processes restore published snapshots through it).
    pub fn fetcher_socket(&self) -> &Path {
        self.fetcher.socket()
    }

    /// Makes the disk layers read lazily from the store in the chain below `top` (a VM's
    /// overlay) whole, through the fetcher: a VM process forking starts children that
    /// open the chain anew, which only a fetcher's own connection could fill.
    pub fn complete_disk(&self, top: &Path) -> Result<()> {
        let derr = |e: String| Error::Store(format!("{}: {e}", top.display()));
        // The overlay is the VM's, locked for writing: its header only, read as it is.
        let mut head = vec![0u8; (disk::HEADER_SLOTS * disk::HEADER_SIZE) as usize];
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::File::open(top).map_err(|e| derr(e.to_string()))?;
            let n = f.read_at(&mut head, 0).map_err(|e| derr(e.to_string()))?;
            head.truncate(n);
        }
        let (h, _) = disk::decode_slots(top, &head).map_err(|e| derr(e.to_string()))?;
        let Some(parent) = h.parent else {
            return Ok(());
        };
        let ppath = match top.parent() {
            Some(d) if parent.path.is_relative() => d.join(&parent.path),
            _ => parent.path.clone(),
        };
        let chain = disk::ops::info(&ppath).map_err(|e| derr(e.to_string()))?;
        let lazy: Vec<String> = chain
            .iter()
            .filter(|l| disk::remote::is_filled_on_demand(&l.path))
            .map(|l| disk::id_hex(&l.header.layer_id))
            .collect();
        if lazy.is_empty() {
            return Ok(());
        }
        let client = store::fetcher::FetchClient::connect(self.fetcher.socket(), PREPARE_TIMEOUT)
            .map_err(store_err)?;
        for id in lazy {
            client.complete_layer(&id).map_err(store_err)?;
        }
        Ok(())
    }

    /// Brings published snapshot `id` into the host's cache (through the fetcher): its
    /// manifest, small objects, working-set chunks and disk layers, so that the VM process
    /// started on it next finds all it needs before its first fault. Whatever takes long
    /// (a big disk layer not cached yet) happens here, bounded by the store's limits,
    /// rather than in the VM process's start.
    ///
    /// The fetcher also checks that the store still has every object the snapshot may read
    /// from it later (its memory data, its disk layers): one missing is an error naming
    /// it now, before a VM is started that would die at its first read of it.
    pub fn prepare(&self, id: &str) -> Result<()> {
        let sid = store::manifest::parse_snapshot_id(id).map_err(store_err)?;
        let t = std::time::Instant::now();
        let client = store::fetcher::FetchClient::connect(self.fetcher.socket(), PREPARE_TIMEOUT)
            .map_err(store_err)?;
        client.open_checked(sid).map_err(store_err)?;
        tracing::info!(snapshot = %id, elapsed = ?t.elapsed(), "published snapshot prepared");
        Ok(())
    }

    /// This host's id.
    pub fn host_id(&self) -> &str {
        &self.host_id
    }

    /// Runs a store call on the store's runtime.
    pub fn block_on<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.rt.block_on(f)
    }

    /// Claims pause `pause` of sandbox `id` for this host: `Ok` if this host holds the
    /// claim (now or from before), [`Error::Conflict`] if another host does.
    pub fn claim(&self, id: &str, pause: u32) -> Result<()> {
        self.claim_fresh(id, pause).map(|_| ())
    }

    /// [`Durable::claim`], saying whether the claim was made now (`true`) or this host
    /// held it from before (`false`).
    pub fn claim_fresh(&self, id: &str, pause: u32) -> Result<bool> {
        let key = claim_key(id, pause);
        let me = Bytes::from(self.host_id.clone().into_bytes());
        if self
            .block_on(self.store.put_if_absent(&key, me))
            .map_err(store_err)?
        {
            tracing::info!(sandbox = %id, pause, "claimed");
            return Ok(true);
        }
        let holder = self.block_on(self.store.get(&key)).map_err(store_err)?;
        if holder.as_ref() == self.host_id.as_bytes() {
            return Ok(false);
        }
        Err(Error::Conflict(format!(
            "sandbox {id} was resumed by another host ({}; claim {})",
            String::from_utf8_lossy(&holder[..holder.len().min(64)]),
            self.store.key(&key)
        )))
    }

    /// Gives back this host's claim on pause `pause` of sandbox `id`, after a resume of it
    /// failed before its VM ran (none runs it, so any host may resume that pause again).
    /// A claim that is not this host's is left alone. Safe against a host claiming at
    /// the same time: while the claim is there no other host can write it, and once it
    /// is gone a claim is a conditional create again.
    pub fn release_claim(&self, id: &str, pause: u32) -> Result<()> {
        let key = claim_key(id, pause);
        match self.get_if_there(&key)? {
            Some(holder) if holder.as_ref() == self.host_id.as_bytes() => {
                self.block_on(self.store.delete(&key)).map_err(store_err)?;
                tracing::info!(sandbox = %id, pause, "claim given back");
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The store's object of sandbox `id` (`None`: there is none).
    pub fn sandbox_object(&self, id: &str) -> Result<Option<SandboxObject>> {
        self.get_if_there(&sandbox_key(id))?
            .map(|b| SandboxObject::parse(id, &b))
            .transpose()
    }

    /// Every sandbox object in the store (sandboxes paused on any host sharing it): listed
    /// again at most every [`LIST_REFRESH`], each object read once (what a list shows of
    /// it, its template, metadata and start, does not change with later pauses). An
    /// object that cannot be read or parsed is left out, with a warning.
    pub fn sandbox_objects(&self) -> Result<Vec<SandboxObject>> {
        use futures_util::StreamExt;
        let mut listed = self.listed.lock().unwrap_or_else(|p| p.into_inner());
        if listed.at.is_none_or(|t| t.elapsed() >= LIST_REFRESH) {
            let keys = self
                .block_on(self.store.list("sandboxes"))
                .map_err(store_err)?;
            let keys: std::collections::BTreeSet<String> =
                keys.into_iter().filter(|k| k.ends_with(".json")).collect();
            listed.objects.retain(|k, _| keys.contains(k));
            let new: Vec<&String> = keys
                .iter()
                .filter(|k| !listed.objects.contains_key(*k))
                .collect();
            let store = &self.store;
            let read = self.block_on(
                futures_util::stream::iter(new)
                    .map(|k| async move { (k.clone(), store.get(k).await) })
                    .buffer_unordered(LIST_READS)
                    .collect::<Vec<_>>(),
            );
            for (k, r) in read {
                let id = k
                    .strip_prefix("sandboxes/")
                    .and_then(|k| k.strip_suffix(".json"))
                    .unwrap_or_default();
                let parsed = match r {
                    // Deleted since it was listed.
                    Err(store::Error::Missing { .. }) => continue,
                    Err(e) => Err(store_err(e)),
                    Ok(b) => SandboxObject::parse(id, &b),
                };
                match parsed {
                    Ok(o) => {
                        listed.objects.insert(k, o);
                    }
                    Err(e) => {
                        tracing::warn!(key = %k, error = %e, "sandbox object left out of lists")
                    }
                }
            }
            listed.at = Some(std::time::Instant::now());
        }
        Ok(listed.objects.values().cloned().collect())
    }

    /// The store's object of template `name` (`None`: there is none).
    pub fn template_object(&self, name: &str) -> Result<Option<TemplateObject>> {
        self.get_if_there(&template_key(name))?
            .map(|b| TemplateObject::parse(name, &b))
            .transpose()
    }

    /// Object `key`'s bytes, or `None` if there is no such object.
    fn get_if_there(&self, key: &str) -> Result<Option<Bytes>> {
        if self
            .block_on(self.store.size(key))
            .map_err(store_err)?
            .is_none()
        {
            return Ok(None);
        }
        self.block_on(self.store.get(key))
            .map(Some)
            .map_err(store_err)
    }

    /// Publishes a snapshot and the chain below it (`chain`, base first: see
    /// [`store::publish::chain_files`]); what the store has already is skipped. Returns its
    /// manifest and what was uploaded.
    pub fn publish_chain(
        &self,
        chain: &[store::publish::SnapshotFiles],
    ) -> Result<(store::Manifest, store::publish::ChainReport)> {
        self.block_on(store::publish::publish_chain(
            &self.store,
            chain,
            &store::publish::PublishOptions::default(),
        ))
        .map_err(store_err)
    }

    /// Writes template object `o` (replacing the one before).
    pub fn put_template_object(&self, o: &TemplateObject) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(o).map_err(|e| Error::Corrupt(e.to_string()))?;
        self.block_on(
            self.store
                .put(&template_key(&o.template.name), Bytes::from(bytes)),
        )
        .map_err(store_err)
    }

    /// Writes sandbox `o`'s object (a pause or checkpoint this host published), replacing
    /// the one before only while this host still holds the sandbox in the store itself,
    /// whatever it was told before (see the module: the write carries its own fence).
    ///
    /// - No object yet: written only if still absent (a conditional create).
    /// - The object there is another host's: [`Error::Fenced`].
    /// - It is this host's: this host claims the pause it names before replacing it. A
    ///   host takes a sandbox over only by claiming the pause of the object it read, and
    ///   a claim is a conditional create, so exactly one of the two wins: this host (the
    ///   object it replaces can no longer be resumed elsewhere), or the host that took it
    ///   over ([`Error::Fenced`]: nothing is written, that host's object stays).
    pub fn put_sandbox_object(&self, o: &SandboxObject) -> Result<()> {
        let key = sandbox_key(&o.id);
        let bytes =
            Bytes::from(serde_json::to_vec_pretty(o).map_err(|e| Error::Corrupt(e.to_string()))?);
        let fenced = |why: String| Error::Fenced {
            id: o.id.clone(),
            why,
        };
        let Some(cur) = self.sandbox_object(&o.id)? else {
            if self
                .block_on(self.store.put_if_absent(&key, bytes))
                .map_err(store_err)?
            {
                return Ok(());
            }
            return Err(fenced(
                "another host published it meanwhile (its store object appeared)".into(),
            ));
        };
        if cur.host != self.host_id {
            return Err(fenced(format!(
                "host {} published it last (its store object is that host's)",
                cur.host
            )));
        }
        if cur.pause == o.pause {
            // The same pause again (a retried publish): not claimed, or nobody could
            // resume it; refused if another host resumed it.
            let claim = claim_key(&o.id, cur.pause);
            if let Some(holder) = self.get_if_there(&claim)? {
                if holder.as_ref() != self.host_id.as_bytes() {
                    return Err(fenced(format!(
                        "another host resumed pause {} ({})",
                        cur.pause,
                        self.store.key(&claim)
                    )));
                }
            }
        } else {
            match self.claim(&o.id, cur.pause) {
                Err(Error::Conflict(why)) => return Err(fenced(why)),
                r => r?,
            }
        }
        self.block_on(self.store.put(&key, bytes))
            .map_err(store_err)
    }

    /// Writes the object of sandbox `o`, which this host took over after claiming the
    /// pause of the object it read (see [`Durable::put_sandbox_object`]): from then on
    /// it is this host's.
    pub fn put_taken_over_object(&self, o: &SandboxObject) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(o).map_err(|e| Error::Corrupt(e.to_string()))?;
        self.block_on(self.store.put(&sandbox_key(&o.id), Bytes::from(bytes)))
            .map_err(store_err)
    }

    /// Removes what the store holds of sandbox `id`: its object, its own snapshots (those
    /// nothing else builds on) and its claims.
    pub fn delete_sandbox(&self, id: &str) -> Result<()> {
        let Some(o) = self.sandbox_object(id)? else {
            return self.delete_claims(id);
        };
        // The object first: from then on no host takes the sandbox over.
        self.block_on(self.store.delete(&sandbox_key(id)))
            .map_err(store_err)?;
        self.listed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .objects
            .remove(&sandbox_key(id));
        // Together: the store's manifests are read once for all of them.
        let sids = o
            .own_snapshots
            .iter()
            .rev()
            .map(|s| store::manifest::parse_snapshot_id(s).map_err(store_err))
            .collect::<Result<Vec<_>>>()?;
        match self.block_on(store::publish::delete_all(&self.store, &sids)) {
            Ok(r) => tracing::debug!(sandbox = %id, ?r, "published snapshots deleted"),
            Err(e) => tracing::warn!(sandbox = %id, "its snapshots kept in the store: {e}"),
        }
        self.delete_claims(id)
    }

    fn delete_claims(&self, id: &str) -> Result<()> {
        let keys = self
            .block_on(self.store.list(&format!("claims/{id}")))
            .map_err(store_err)?;
        for k in keys {
            self.block_on(self.store.delete(&k)).map_err(store_err)?;
        }
        Ok(())
    }

    /// Records that `id`'s upload failed with `why` (shown in its info until it succeeds).
    pub fn set_failure(&self, id: &str, why: Option<String>) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        match why {
            Some(w) => f.insert(id.to_string(), w),
            None => f.remove(id),
        };
    }

    /// The last upload failure of `id`, while it is retried.
    pub fn failure(&self, id: &str) -> Option<String> {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }
}

/// The store's errors, as the service's.
pub fn store_err(e: store::Error) -> Error {
    Error::Store(e.to_string())
}

/// This host's id: made once, kept in `<state dir>/host-id`.
fn host_id(state_dir: &Path) -> Result<String> {
    let p = state_dir.join("host-id");
    match std::fs::read_to_string(&p) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("reading", &p)(e)),
    }
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    let id = format!(
        "{}-{}",
        host.trim()
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .take(32)
            .collect::<String>(),
        crate::ids::random_string(12)
    );
    std::fs::write(&p, &id).map_err(Error::io("writing", &p))?;
    Ok(id)
}

/// How long the uploader waits before retry `n` (1 s doubling, at most a minute).
pub fn backoff(n: u32) -> Duration {
    Duration::from_secs(1u64 << n.min(6)).min(Duration::from_secs(60))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object() -> SandboxObject {
        SandboxObject {
            format: SANDBOX_FORMAT.into(),
            version: SANDBOX_VERSION,
            id: "iabc".into(),
            snapshot: "00112233445566778899aabbccddeeff".into(),
            pause: 2,
            own_snapshots: vec!["00112233445566778899aabbccddeeff".into()],
            template: Template {
                name: "base".into(),
                vcpus: 1,
                mem_mib: 64,
                disk: false,
                test_guest: true,
                created_ms: 1,
                setup: vec![],
                net: false,
                image: None,
                boot: None,
                build_id: None,
            },
            started_ms: 1,
            auto_pause: false,
            auto_resume: false,
            checkpoint_ms: None,
            envd_token: None,
            traffic_token: None,
            mask_host: None,
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            egress: None,
            parent: None,
            published_ms: 2,
            host: "h".into(),
        }
    }

    #[test]
    fn sandbox_objects_read_back_and_bad_ones_are_errors() {
        let o = object();
        let b = serde_json::to_vec(&o).unwrap();
        assert_eq!(SandboxObject::parse("iabc", &b).unwrap(), o);
        // Another sandbox's object under this id, garbage, a bad snapshot id, a template
        // name that could name a path: refused.
        assert!(SandboxObject::parse("iother", &b).is_err());
        assert!(SandboxObject::parse("iabc", b"{").is_err());
        let mut bad = o.clone();
        bad.snapshot = "../x".into();
        assert!(SandboxObject::parse("iabc", &serde_json::to_vec(&bad).unwrap()).is_err());
        let mut bad = o.clone();
        bad.template.name = "../../etc".into();
        assert!(SandboxObject::parse("iabc", &serde_json::to_vec(&bad).unwrap()).is_err());
        let mut bad = o;
        bad.version = 9;
        assert!(SandboxObject::parse("iabc", &serde_json::to_vec(&bad).unwrap()).is_err());
    }

    /// Two hosts (state directories `a` and `b`) on one `file://` store, under a directory
    /// of this test's own (returned, for the test to remove).
    fn two_hosts(test: &str) -> (std::path::PathBuf, Durable, Durable) {
        let dir = std::env::temp_dir().join(format!("sandbox-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = format!("file://{}", dir.join("store").display());
        std::fs::create_dir_all(dir.join("store")).unwrap();
        let open = |n: &str| {
            let state = dir.join(n);
            std::fs::create_dir_all(&state).unwrap();
            Durable::open(
                &StoreConfig {
                    url: url.clone(),
                    options: StoreOptions::default(),
                    cache_dir: state.join("cache"),
                    cache_limit: 1 << 30,
                },
                &state,
            )
            .unwrap()
        };
        let (a, b) = (open("a"), open("b"));
        (dir, a, b)
    }

    #[test]
    fn claims_let_exactly_one_host_resume_a_pause() {
        let (dir, a, b) = two_hosts("claims");
        assert_ne!(a.host_id(), b.host_id());
        a.claim("isb", 1).unwrap();
        // Again by the same host: still its claim.
        a.claim("isb", 1).unwrap();
        assert!(matches!(b.claim("isb", 1), Err(Error::Conflict(_))));
        // The next pause is a new claim.
        b.claim("isb", 2).unwrap();
        assert!(matches!(a.claim("isb", 2), Err(Error::Conflict(_))));
        a.put_sandbox_object(&SandboxObject {
            id: "isb".into(),
            ..object()
        })
        .unwrap();
        assert_eq!(b.sandbox_object("isb").unwrap().unwrap().id, "isb");
        b.delete_sandbox("isb").unwrap();
        assert!(a.sandbox_object("isb").unwrap().is_none());
        // Its claims went with it.
        a.claim("isb", 1).unwrap();
        drop((a, b));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A claim made now says so, one held from before does not; given back by its holder
    /// (a resume that failed before its VM ran), another host may claim the pause, while
    /// a host that does not hold it cannot give it back.
    #[test]
    fn a_claim_given_back_lets_another_host_resume_the_pause() {
        let (dir, a, b) = two_hosts("release");
        assert!(a.claim_fresh("isb", 1).unwrap());
        assert!(!a.claim_fresh("isb", 1).unwrap());
        // Not b's to give back: a keeps it.
        b.release_claim("isb", 1).unwrap();
        assert!(matches!(b.claim("isb", 1), Err(Error::Conflict(_))));
        a.release_claim("isb", 1).unwrap();
        // Nothing to give back any more: no error.
        a.release_claim("isb", 1).unwrap();
        assert!(b.claim_fresh("isb", 1).unwrap());
        assert!(matches!(a.claim("isb", 1), Err(Error::Conflict(_))));
        drop((a, b));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Two hosts on one store (`file://`), interleaved deliberately: host a owns the
    /// sandbox and publishes; it stalls after its ownership check, host b takes the
    /// sandbox over and publishes its own pause; a's late publish must fail and leave b's
    /// object as it is.
    #[test]
    fn a_stalled_hosts_late_publish_is_fenced_and_the_new_owners_object_stays() {
        let (dir, a, b) = two_hosts("fence");
        let by = |d: &Durable, pause: u32, snapshot: &str| SandboxObject {
            id: "isb".into(),
            pause,
            snapshot: snapshot.into(),
            host: d.host_id().to_string(),
            ..object()
        };
        let a1 = "a1000000000000000000000000000000";
        let a2 = "a2000000000000000000000000000000";
        let b2 = "b2000000000000000000000000000000";
        // a's first pause, then a resumes it and pauses again: its own object each time.
        a.put_sandbox_object(&by(&a, 1, a1)).unwrap();
        a.claim("isb", 1).unwrap();
        a.put_sandbox_object(&by(&a, 2, a2)).unwrap();
        // a's next publish (pause 3) passed its ownership check, then a stalled. Its lease
        // ended; b takes the sandbox over from pause 2, resumes and pauses it (pause 3).
        let read = b.sandbox_object("isb").unwrap().unwrap();
        assert_eq!(read.snapshot, a2);
        b.claim("isb", read.pause).unwrap();
        b.put_taken_over_object(&SandboxObject {
            host: b.host_id().to_string(),
            ..read
        })
        .unwrap();
        b.put_sandbox_object(&by(&b, 3, b2)).unwrap();
        // a continues: its late write is refused, whichever pause it names.
        for pause in [3, 4, 2] {
            let late = a.put_sandbox_object(&by(&a, pause, a2));
            assert!(matches!(late, Err(Error::Fenced { .. })), "{late:?}");
        }
        let now = a.sandbox_object("isb").unwrap().unwrap();
        assert_eq!((now.snapshot.as_str(), now.pause), (b2, 3));
        assert_eq!(now.host, b.host_id());
        // b goes on publishing.
        b.claim("isb", 3).unwrap();
        b.put_sandbox_object(&by(&b, 4, b2)).unwrap();

        // Stalled the other way round: a wins the race for its own pause before b
        // resumes it. b's takeover finds the pause claimed, and a's publish stands.
        a.delete_sandbox("isb").unwrap();
        a.put_sandbox_object(&by(&a, 1, a1)).unwrap();
        let read = b.sandbox_object("isb").unwrap().unwrap();
        a.put_sandbox_object(&by(&a, 2, a2)).unwrap();
        assert!(matches!(
            b.claim("isb", read.pause),
            Err(Error::Conflict(_))
        ));
        assert_eq!(b.sandbox_object("isb").unwrap().unwrap().snapshot, a2);
        // A first publish does not replace another host's first publish either.
        b.delete_sandbox("isb").unwrap();
        b.put_sandbox_object(&by(&b, 1, b2)).unwrap();
        assert!(matches!(
            a.put_sandbox_object(&by(&a, 1, a1)),
            Err(Error::Fenced { .. })
        ));
        assert_eq!(a.sandbox_object("isb").unwrap().unwrap().snapshot, b2);
        drop((a, b));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

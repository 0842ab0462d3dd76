//! This node of the cluster: its configuration, its lease, what it records of the
//! sandboxes it holds (the `sandbox::ownership::Ownership` the lifecycle asks), and its
//! drain.
//!
//! The lease is renewed every third of its length. A renewal that finds it already ended
//! (the process was stopped, the database unreachable for longer than a lease) means other
//! nodes may have taken this node's sandboxes: it joins again, then forgets every sandbox
//! whose row another node holds now, before anything else may act on them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use sandbox::ownership::Ownership;
use sandbox::registry::{Record, State};
use sandbox::Host;
use sha2::{Digest, Sha256};

use crate::db::{Db, Holding, NodeRow, TemplateShape};
use crate::error::{Error, Result};

/// How a node joins.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The registry: `postgres://user:password@host:port/db` (or `host=… user=…`).
    pub url: String,
    /// This node's name (unique in the cluster).
    pub name: String,
    /// Where other nodes reach this one (`https://host:port`; `http://` see
    /// [`crate::hop::check_address`]).
    pub address: String,
    /// The cluster CA (PEM): other nodes' certificates are verified to it.
    pub ca: Option<std::path::PathBuf>,
    /// `http://` node addresses off loopback allowed (the secret in clear text).
    pub plain_http: bool,
    /// The secret every hop between nodes carries.
    pub secret: String,
    /// The API key (a drain asks other nodes to resume what it moves).
    pub api_key: String,
    /// vCPUs this node may commit to running sandboxes.
    pub vcpus: u32,
    /// Memory (MiB) it may commit.
    pub mem_mib: u64,
    /// Runs sandboxes (false: a pure gateway).
    pub takes_sandboxes: bool,
    /// Its lease's length.
    pub lease: Duration,
}

impl NodeConfig {
    /// Checks what can be checked before anything starts.
    pub fn check(&self) -> Result<()> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 63
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !name_ok {
            return Err(Error::Config(format!(
                "node name {:?}: 1-63 letters, digits, '-', '_' or '.'",
                self.name
            )));
        }
        crate::hop::check_address(&self.address, self.ca.is_some(), self.plain_http)?;
        if self.secret.len() < 16 {
            return Err(Error::Config(
                "the cluster secret must be at least 16 characters".into(),
            ));
        }
        if self.lease < Duration::from_millis(500) || self.lease > Duration::from_secs(600) {
            return Err(Error::Config("the lease must be 0.5 to 600 seconds".into()));
        }
        Ok(())
    }
}

/// This node: the registry's connection and what it holds.
pub struct Node {
    cfg: NodeConfig,
    db: Db,
    /// The fencing token of each sandbox this node holds (as of its last record).
    tokens: Mutex<HashMap<String, i64>>,
    /// The host (set once it exists: the host is built with this node as its ownership).
    host: OnceLock<Weak<Host>>,
    /// The secret's digest (what hops are compared by).
    secret_digest: [u8; 32],
    /// The HTTP client of hops.
    pub(crate) hop: crate::hop::Hop,
    /// Routes of running sandboxes read a moment ago (the data plane's).
    pub(crate) routes: RouteCache,
    /// What this node has committed (see [`Room`]).
    room: Arc<Mutex<Room>>,
    /// The dashboard's key and sessions: a request of the dashboard is one with the key.
    dashboard: OnceLock<sandbox::dashboard::DashboardState>,
}

/// What a node has committed: its running sandboxes' shapes and the room held for VMs
/// about to start. Only this node starts VMs on itself, so this, not the registry's sums
/// (which gateways place by, and which lag behind), decides whether one more fits: two
/// creates placed here at the same moment cannot both take the last room.
#[derive(Default)]
struct Room {
    /// Running sandboxes: vCPUs and MiB.
    running: HashMap<String, (u32, u64)>,
    /// Held for VMs being started.
    held_vcpus: u64,
    held_mem_mib: u64,
}

impl Room {
    fn committed(&self) -> (u64, u64) {
        let (v, m) = self
            .running
            .values()
            .fold((0u64, 0u64), |(v, m), &(rv, rm)| {
                (v + u64::from(rv), m.saturating_add(rm))
            });
        (v + self.held_vcpus, m.saturating_add(self.held_mem_mib))
    }

    /// Holds room for `count` VMs of `shape` (vCPUs, MiB) within `capacity`, or says
    /// why there is none.
    fn hold(
        room: &Arc<Mutex<Room>>,
        capacity: (u32, u64),
        shape: (u32, u64),
        count: u32,
    ) -> std::result::Result<Held, String> {
        let v = u64::from(shape.0) * u64::from(count);
        let m = shape.1.saturating_mul(u64::from(count));
        let mut r = room.lock().unwrap_or_else(|p| p.into_inner());
        let (used_v, used_m) = r.committed();
        if used_v + v > u64::from(capacity.0) || used_m.saturating_add(m) > capacity.1 {
            return Err(format!(
                "has no room for {count} VM(s) of {} vCPUs and {} MiB: {used_v}/{} vCPUs and \
                 {used_m}/{} MiB committed",
                shape.0, shape.1, capacity.0, capacity.1
            ));
        }
        r.held_vcpus += v;
        r.held_mem_mib = r.held_mem_mib.saturating_add(m);
        Ok(Held {
            room: Arc::clone(room),
            vcpus: v,
            mem_mib: m,
        })
    }

    /// Notes `rec`'s state: running sandboxes count, others do not.
    fn note(&mut self, rec: &Record) {
        self.note_state(
            &rec.id,
            rec.state == State::Running,
            (rec.vcpus, rec.mem_mib),
        );
    }

    fn note_state(&mut self, id: &str, running: bool, shape: (u32, u64)) {
        if running {
            self.running.insert(id.to_string(), shape);
        } else {
            self.running.remove(id);
        }
    }
}

/// Room held in a [`Room`] until dropped.
struct Held {
    room: Arc<Mutex<Room>>,
    vcpus: u64,
    mem_mib: u64,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut r = self.room.lock().unwrap_or_else(|p| p.into_inner());
        r.held_vcpus = r.held_vcpus.saturating_sub(self.vcpus);
        r.held_mem_mib = r.held_mem_mib.saturating_sub(self.mem_mib);
    }
}

/// How long a route read from the registry is used for data-plane requests. A sandbox
/// that moved meanwhile is asked of its old node for at most this long (which answers
/// that it does not have it).
const ROUTE_TTL: Duration = Duration::from_secs(1);

/// Routes of running sandboxes with a live owner, as read from the registry.
#[derive(Default)]
pub(crate) struct RouteCache {
    map: Mutex<HashMap<String, (std::time::Instant, crate::db::OwnerRow)>>,
}

impl RouteCache {
    /// The route of `id` if it was read less than [`ROUTE_TTL`] ago.
    pub(crate) fn get(&self, id: &str) -> Option<crate::db::OwnerRow> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(id)
            .filter(|(at, _)| at.elapsed() < ROUTE_TTL)
            .map(|(_, r)| r.clone())
    }

    /// Keeps `r`, just read from the registry, if it is a route worth keeping (running,
    /// owner live), else forgets its sandbox.
    pub(crate) fn put(&self, r: &crate::db::OwnerRow) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if r.state == "running" && r.owner_live && !r.owner_draining {
            // Bounded: stale entries go when it grows.
            if map.len() >= 4096 {
                map.retain(|_, (at, _)| at.elapsed() < ROUTE_TTL);
            }
            map.insert(r.id.clone(), (std::time::Instant::now(), r.clone()));
        } else {
            map.remove(&r.id);
        }
    }
}

impl Node {
    /// Connects to the registry and creates its schema if missing. The node joins with
    /// [`Node::start`], once its host exists.
    pub fn connect(cfg: NodeConfig) -> Result<Arc<Self>> {
        cfg.check()?;
        let db = Db::connect(&cfg.url)?;
        let hop = crate::hop::Hop::new(cfg.ca.as_deref(), cfg.plain_http)?;
        Ok(Arc::new(Self {
            secret_digest: Sha256::digest(cfg.secret.as_bytes()).into(),
            cfg,
            db,
            tokens: Mutex::new(HashMap::new()),
            host: OnceLock::new(),
            hop,
            routes: RouteCache::default(),
            room: Arc::default(),
            dashboard: OnceLock::new(),
        }))
    }

    /// Its configuration.
    pub fn config(&self) -> &NodeConfig {
        &self.cfg
    }

    /// The registry.
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// Whether `v` is the cluster secret (compared in constant time, by digest).
    pub fn secret_ok(&self, v: &[u8]) -> bool {
        let d: [u8; 32] = Sha256::digest(v).into();
        sandbox::envd::access::same_digest(&d, &self.secret_digest)
    }

    /// The dashboard's sessions (set once, when the service is built).
    pub fn set_dashboard(&self, d: sandbox::dashboard::DashboardState) {
        let _ = self.dashboard.set(d);
    }

    /// Whether `headers` are those of the dashboard's page with a live session (see
    /// `sandbox::dashboard`): such a request is one with the API key, wherever it goes.
    pub(crate) fn dashboard_session(&self, headers: &axum::http::HeaderMap) -> bool {
        self.dashboard
            .get()
            .is_some_and(|d| sandbox::dashboard::dashboard_request(d, headers))
    }

    /// The host, while it exists.
    pub(crate) fn host(&self) -> Option<Arc<Host>> {
        self.host.get().and_then(Weak::upgrade)
    }

    fn row(&self, templates: Vec<String>) -> NodeRow {
        NodeRow {
            name: self.cfg.name.clone(),
            address: self.cfg.address.clone(),
            vcpus: self.cfg.vcpus.min(i32::MAX as u32) as i32,
            mem_mib: self.cfg.mem_mib.min(i64::MAX as u64) as i64,
            takes_sandboxes: self.cfg.takes_sandboxes,
            draining: false,
            drained: false,
            templates,
            live: true,
            lease_left_s: 0.0,
            used_vcpus: 0,
            used_mem_mib: 0,
            sandboxes: 0,
        }
    }

    /// Joins the cluster with `host` (registers, records the host's sandboxes and
    /// templates) and keeps the lease alive on the current runtime until the process ends.
    pub async fn start(self: &Arc<Self>, host: Arc<Host>) -> Result<()> {
        let _ = self.host.set(Arc::downgrade(&host));
        let (names, shapes) = templates_of(&host);
        self.db.put_templates(&shapes).await?;
        self.db
            .join(&self.row(names.clone()), self.cfg.lease, true)
            .await?;
        // What the host holds, as it is now (a restart finds its sandboxes again; those
        // another node took meanwhile are forgotten).
        let h = Arc::clone(&host);
        let forgotten = tokio::task::spawn_blocking(move || h.forget_taken())
            .await
            .map_err(|e| Error::Config(format!("worker: {e}")))?
            .map_err(|e| Error::Config(format!("checking this node's sandboxes: {e}")))?;
        let h = Arc::clone(&host);
        let all = tokio::task::spawn_blocking(move || h.local_sandboxes())
            .await
            .map_err(|e| Error::Config(format!("worker: {e}")))?
            .map_err(|e| Error::Config(format!("listing this node's sandboxes: {e}")))?;
        self.recount(&all);
        for r in &all {
            if let Err(e) = self.record_now(r) {
                tracing::warn!(sandbox = %r.id, "recording it in the cluster: {e}");
            }
        }
        tracing::info!(node = %self.cfg.name, address = %self.cfg.address,
            forgotten, "joined the cluster");
        let me = Arc::clone(self);
        tokio::spawn(async move { me.keep_lease(names).await });
        Ok(())
    }

    async fn keep_lease(self: Arc<Self>, mut names: Vec<String>) {
        let mut iv = tokio::time::interval(self.cfg.lease / 3);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut draining = false;
        loop {
            iv.tick().await;
            let Some(host) = self.host() else { return };
            let (now_names, shapes) = templates_of(&host);
            if now_names != names {
                if let Err(e) = self.db.put_templates(&shapes).await {
                    tracing::warn!("recording templates in the cluster: {e}");
                }
                names = now_names;
            }
            match self.db.renew(&self.cfg.name, self.cfg.lease, &names).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(node = %self.cfg.name,
                        "this node's lease had ended (stopped or cut off for longer than {:?}): \
                         rejoining; sandboxes other nodes took are forgotten", self.cfg.lease);
                    if let Err(e) = self.rejoin(&host, names.clone()).await {
                        tracing::error!("rejoining the cluster: {e}");
                    }
                }
                Err(e) => tracing::warn!("renewing this node's lease: {e}"),
            }
            if !draining {
                match self.db.draining(&self.cfg.name).await {
                    Ok(true) => {
                        draining = true;
                        let me = Arc::clone(&self);
                        tokio::spawn(async move {
                            if let Err(e) = me.drain().await {
                                tracing::error!("draining: {e}");
                            }
                        });
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!("reading this node's drain flag: {e}"),
                }
            }
        }
    }

    async fn rejoin(&self, host: &Arc<Host>, names: Vec<String>) -> Result<()> {
        self.db
            .join(&self.row(names), self.cfg.lease, false)
            .await?;
        let h = Arc::clone(host);
        let n = tokio::task::spawn_blocking(move || h.forget_taken())
            .await
            .map_err(|e| Error::Config(format!("worker: {e}")))?
            .map_err(|e| Error::Config(format!("checking this node's sandboxes: {e}")))?;
        tracing::warn!(node = %self.cfg.name, forgotten = n, "rejoined the cluster");
        let h = Arc::clone(host);
        match tokio::task::spawn_blocking(move || h.local_sandboxes()).await {
            Ok(Ok(all)) => self.recount(&all),
            Ok(Err(e)) => tracing::warn!("listing this node's sandboxes: {e}"),
            Err(e) => tracing::warn!("listing this node's sandboxes: {e}"),
        }
        Ok(())
    }

    /// Counts the running sandboxes among `all` (this host's, as they are now) as what
    /// this node has committed, forgetting any other.
    fn recount(&self, all: &[Record]) {
        let mut room = self.room.lock().unwrap_or_else(|p| p.into_inner());
        room.running.clear();
        for r in all {
            room.note(r);
        }
    }

    fn record_now(&self, rec: &Record) -> Result<()> {
        // What runs here counts whatever the registry answers.
        self.room
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .note(rec);
        let state = match rec.state {
            State::Running => "running",
            State::Paused => "paused",
            State::Crashed => "crashed",
        };
        let token = self.db.hold_blocking(
            &self.cfg.name,
            &Holding {
                id: &rec.id,
                state,
                durable: rec.durable(),
                template: &rec.template,
                vcpus: rec.vcpus,
                mem_mib: rec.mem_mib,
            },
        )?;
        let Some(token) = token else {
            // Killed through another node while this one held it: not brought back.
            self.room
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .running
                .remove(&rec.id);
            return Err(Error::Killed(rec.id.clone()));
        };
        self.tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rec.id.clone(), token);
        Ok(())
    }

    /// Drains this node: every running sandbox is paused, waits until its pause is in the
    /// store, and is resumed on another node with room; paused ones wait until they are
    /// durable and stay paused (a resume goes elsewhere). Then the node is marked drained.
    async fn drain(self: Arc<Self>) -> Result<()> {
        let Some(host) = self.host() else {
            return Ok(());
        };
        tracing::info!(node = %self.cfg.name, "draining");
        let h = Arc::clone(&host);
        let all = tokio::task::spawn_blocking(move || h.local_sandboxes())
            .await
            .map_err(|e| Error::Config(format!("worker: {e}")))?
            .map_err(|e| Error::Config(format!("listing this node's sandboxes: {e}")))?;
        let mut moved = 0;
        let mut failed = 0;
        for rec in all.into_iter().filter(|r| r.state != State::Crashed) {
            match self.move_off(&host, &rec).await {
                Ok(to) => {
                    moved += 1;
                    tracing::info!(sandbox = %rec.id, to = ?to, "drained");
                }
                Err(e) => {
                    failed += 1;
                    tracing::error!(sandbox = %rec.id, "draining it: {e}");
                }
            }
        }
        if failed == 0 {
            self.db.set_drained(&self.cfg.name).await?;
        }
        tracing::info!(node = %self.cfg.name, moved, failed, "drain finished");
        Ok(())
    }

    /// Moves one sandbox off this node (see [`Node::drain`]); the node it now runs on.
    async fn move_off(&self, host: &Arc<Host>, rec: &Record) -> Result<Option<String>> {
        let id = rec.id.clone();
        let running = rec.state == State::Running;
        if running {
            let h = Arc::clone(host);
            let i = id.clone();
            tokio::task::spawn_blocking(move || {
                h.pause(
                    &i,
                    sandbox::PauseOptions {
                        keep_memory: true,
                        require_healthy_guest: false,
                    },
                )
            })
            .await
            .map_err(|e| Error::Config(format!("worker: {e}")))?
            .map_err(|e| Error::Config(format!("pausing: {e}")))?;
        }
        // Durable: its pause in the store (uploaded in the background).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1800);
        loop {
            let h = Arc::clone(host);
            let i = id.clone();
            let now = tokio::task::spawn_blocking(move || h.get(&i))
                .await
                .map_err(|e| Error::Config(format!("worker: {e}")))?
                .map_err(|e| Error::Config(format!("reading it: {e}")))?;
            if now.durable() {
                break;
            }
            if now.state != State::Paused {
                return Err(Error::Config("it was resumed while draining".into()));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Config(
                    "its pause did not reach the object store in 30 minutes".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !running {
            return Ok(None);
        }
        let left_s = ((rec.end_ms - sandbox::ids::now_ms()) / 1000).max(60) as u64;
        let nodes = self.db.nodes().await?;
        let to = crate::placement::choose(&nodes, rec.vcpus, rec.mem_mib, &rec.template, None)
            .into_iter()
            .find(|n| n.name != self.cfg.name)
            .ok_or_else(|| Error::Config("no other node has room for it".into()))?;
        let body = serde_json::json!({ "timeout": left_s }).to_string();
        self.hop
            .call(
                &to,
                &self.cfg.secret,
                &self.cfg.api_key,
                "POST",
                &format!("/sandboxes/{id}/connect"),
                body,
            )
            .await?;
        Ok(Some(to.name))
    }
}

/// The host's templates: their names and shapes.
fn templates_of(host: &Host) -> (Vec<String>, Vec<TemplateShape>) {
    let list = host.list_templates().unwrap_or_default();
    let mut names: Vec<String> = list.iter().map(|t| t.name.clone()).collect();
    names.sort();
    let shapes = list
        .iter()
        .map(|t| TemplateShape {
            name: t.name.clone(),
            vcpus: t.vcpus,
            mem_mib: t.mem_mib,
        })
        .collect();
    (names, shapes)
}

fn cluster_err(e: Error) -> sandbox::Error {
    sandbox::Error::Cluster(e.to_string())
}

impl Ownership for Node {
    fn check(&self, id: &str) -> sandbox::Result<()> {
        let row = self.db.owner_blocking(id).map_err(cluster_err)?;
        let Some(row) = row else {
            // Not recorded yet (its record failed, or the registry was reset): this
            // node's, as long as the node is in the cluster. A killed sandbox is not
            // here: its row stays, as a tombstone (see `db`).
            return Ok(());
        };
        let me = self.cfg.name.as_str();
        if row.node.as_deref() != Some(me) {
            // The host forgets its copy: it no longer counts here.
            self.room
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .running
                .remove(id);
            return Err(sandbox::Error::Fenced {
                id: id.to_string(),
                why: match (&row.node, row.state.as_str()) {
                    (Some(n), _) => format!("node {n} holds it"),
                    (None, "killed") => "it was killed (through another node)".into(),
                    (None, "lost") => format!(
                        "it was marked lost ({})",
                        row.lost_why
                            .as_deref()
                            .unwrap_or("its node stopped answering")
                    ),
                    (None, _) => "no node holds it".into(),
                },
            });
        }
        let mine = self
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .copied();
        if mine.is_some_and(|t| t != row.token) {
            return Err(sandbox::Error::Fenced {
                id: id.to_string(),
                why: format!(
                    "its fencing token is {} now, this node holds {}: another node took it meanwhile",
                    row.token,
                    mine.unwrap_or_default()
                ),
            });
        }
        if !row.owner_live {
            return Err(sandbox::Error::Cluster(format!(
                "this node's lease has ended: it changes nothing of sandbox {id} until it has rejoined"
            )));
        }
        Ok(())
    }

    fn record(&self, rec: &Record) -> sandbox::Result<()> {
        self.record_now(rec).map_err(|e| match e {
            Error::Killed(id) => sandbox::Error::Fenced {
                id,
                why: "it was killed (through another node)".into(),
            },
            e => cluster_err(e),
        })
    }

    fn checkpointed(&self, id: &str) -> sandbox::Result<()> {
        self.db
            .checkpointed_blocking(id, &self.cfg.name)
            .map_err(cluster_err)
    }

    fn snapshot_made(&self, snap: &sandbox::registry::SnapshotRecord) -> sandbox::Result<()> {
        self.db
            .put_snapshot_blocking(
                &snap.id,
                snap.name.as_deref(),
                &snap.sandbox,
                &self.cfg.name,
                snap.created_ms,
            )
            .map_err(cluster_err)
    }

    fn snapshot_deleted(&self, id: &str) -> sandbox::Result<()> {
        self.db.delete_snapshot_blocking(id).map_err(cluster_err)
    }

    fn admit(
        &self,
        vcpus: u32,
        mem_mib: u64,
        count: u32,
    ) -> sandbox::Result<Option<sandbox::ownership::Reservation>> {
        let name = &self.cfg.name;
        if !self.cfg.takes_sandboxes {
            return Err(sandbox::Error::NoRoom(format!(
                "node {name} runs no sandboxes (--no-sandboxes)"
            )));
        }
        let held = Room::hold(
            &self.room,
            (self.cfg.vcpus, self.cfg.mem_mib),
            (vcpus, mem_mib),
            count,
        )
        .map_err(|why| sandbox::Error::NoRoom(format!("node {name} {why}")))?;
        Ok(Some(Box::new(held)))
    }

    fn nodes(&self) -> sandbox::Result<Option<Vec<sandbox::ownership::NodeSummary>>> {
        let rows = self.db.nodes_blocking().map_err(cluster_err)?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(Some(
            rows.into_iter()
                .map(|r| sandbox::ownership::NodeSummary {
                    name: r.name,
                    address: r.address,
                    live: r.live,
                    draining: r.draining,
                    drained: r.drained,
                    takes_sandboxes: r.takes_sandboxes,
                    vcpus: n(i64::from(r.vcpus)),
                    used_vcpus: n(r.used_vcpus),
                    mem_mib: n(r.mem_mib),
                    used_mem_mib: n(r.used_mem_mib),
                    sandboxes: n(r.sandboxes),
                    templates: r.templates,
                })
                .collect(),
        ))
    }

    fn removed(&self, id: &str) -> sandbox::Result<()> {
        self.room
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .running
            .remove(id);
        let token = self
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.db
            .remove_blocking(id, &self.cfg.name, token)
            .map_err(cluster_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_held_until_dropped_and_running_sandboxes_count() {
        let room = Arc::new(Mutex::new(Room::default()));
        let cap = (4, 1024);
        // Two at once for the last places: the second is refused while the first holds.
        let a = Room::hold(&room, cap, (2, 256), 1).expect("room for one");
        let b = Room::hold(&room, cap, (2, 256), 1).expect("room for two");
        let why = Room::hold(&room, cap, (1, 64), 1).err().expect("no third");
        assert!(why.contains("4/4 vCPUs"), "{why}");
        // The first is recorded running: its hold goes, its shape stays counted.
        room.lock().unwrap().note_state("a", true, (2, 256));
        drop(a);
        assert!(Room::hold(&room, cap, (1, 64), 1).is_err());
        // Paused or killed sandboxes commit nothing; dropped holds give their room back.
        room.lock().unwrap().note_state("a", false, (2, 256));
        drop(b);
        assert_eq!(room.lock().unwrap().committed(), (0, 0));
        // Memory decides as vCPUs do, and a fork's children count together.
        let why = Room::hold(&room, cap, (1, 300), 4)
            .err()
            .expect("1200 MiB > 1024");
        assert!(why.contains("0/1024 MiB"), "{why}");
        let c = Room::hold(&room, cap, (1, 256), 4).expect("exactly full");
        assert_eq!(room.lock().unwrap().committed(), (4, 1024));
        drop(c);
        assert_eq!(room.lock().unwrap().committed(), (0, 0));
    }
}

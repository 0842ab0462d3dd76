//! The cluster's registry in PostgreSQL: which nodes there are (each with a lease it keeps
//! alive), which node owns each sandbox (with a fencing token) and the templates' shapes.
//!
//! PostgreSQL is the only shared state. Every decision that two nodes could race on is one
//! conditional statement here (a takeover, marking a sandbox lost, renewing a lease), so
//! the database's row locks decide, and the database's clock (`now()`) is the only clock
//! leases are measured by: nodes' clocks may differ.
//!
//! The connection is driven on a thread of its own, so the client works from any thread:
//! the async gateway and the lifecycle's blocking calls ([`Db::blocking`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_postgres::{Client, Row};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{chain, Error, Result};
use crate::tls::{PgTarget, SslMode};

/// The schema, created if absent (statements that may run on every start, by every node).
const SCHEMA: &str = r#"
SET client_min_messages = warning;
CREATE TABLE IF NOT EXISTS clade_nodes (
    name text PRIMARY KEY,
    address text NOT NULL,
    vcpus integer NOT NULL,
    mem_mib bigint NOT NULL,
    takes_sandboxes boolean NOT NULL,
    draining boolean NOT NULL DEFAULT false,
    drained boolean NOT NULL DEFAULT false,
    templates text[] NOT NULL DEFAULT '{}',
    lease_until timestamptz NOT NULL,
    joined timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS clade_sandboxes (
    id text PRIMARY KEY,
    node text,
    token bigint NOT NULL,
    state text NOT NULL,
    durable boolean NOT NULL,
    checkpointed boolean NOT NULL DEFAULT false,
    template text NOT NULL,
    vcpus integer NOT NULL,
    mem_mib bigint NOT NULL,
    lost_why text,
    updated timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS clade_sandboxes_node ON clade_sandboxes (node);
CREATE TABLE IF NOT EXISTS clade_snapshots (
    id text PRIMARY KEY,
    name text,
    sandbox text NOT NULL,
    node text NOT NULL,
    created_ms bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS clade_templates (
    name text PRIMARY KEY,
    vcpus integer NOT NULL,
    mem_mib bigint NOT NULL
);
"#;

/// A lock that keeps two nodes from creating the schema at the same time.
const SCHEMA_LOCK: i64 = 0x636c_6164_6500;

/// One node, as the registry has it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRow {
    /// Its name.
    pub name: String,
    /// Where other nodes reach it (`http://host:port`).
    pub address: String,
    /// vCPUs it may commit to running sandboxes.
    pub vcpus: i32,
    /// Memory (MiB) it may commit.
    pub mem_mib: i64,
    /// Runs sandboxes (false: a pure gateway).
    pub takes_sandboxes: bool,
    /// Told to drain: no placements; its sandboxes are moved off.
    pub draining: bool,
    /// Its drain finished.
    pub drained: bool,
    /// Templates in its local cache.
    pub templates: Vec<String>,
    /// Its lease is alive (by the database's clock).
    pub live: bool,
    /// Seconds until its lease ends (negative: ended that long ago).
    pub lease_left_s: f64,
    /// vCPUs of its running sandboxes.
    pub used_vcpus: i64,
    /// Memory (MiB) of its running sandboxes.
    pub used_mem_mib: i64,
    /// Its sandboxes, running and paused.
    pub sandboxes: i64,
}

/// Where a sandbox is, as the registry has it.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnerRow {
    /// The sandbox.
    pub id: String,
    /// Its owner (`None`: lost, or released by a drain).
    pub node: Option<String>,
    /// Its fencing token: bumped at every change of owner.
    pub token: i64,
    /// `running`, `paused`, `lost`, or `killed` (a tombstone: see [`TOMBSTONE`]).
    pub state: String,
    /// Paused, and its pause is in the object store: any node may resume it.
    pub durable: bool,
    /// Running, with a checkpoint in the object store: if its node is lost, any node may
    /// resume it from there.
    pub checkpointed: bool,
    /// Why it was lost.
    pub lost_why: Option<String>,
    /// The owner's address, if it has one.
    pub owner_address: Option<String>,
    /// The owner's lease is alive.
    pub owner_live: bool,
    /// The owner drains.
    pub owner_draining: bool,
}

/// What a node records of a sandbox it holds.
#[derive(Debug, Clone)]
pub struct Holding<'a> {
    /// The sandbox.
    pub id: &'a str,
    /// `running` or `paused`.
    pub state: &'a str,
    /// Its pause is in the store.
    pub durable: bool,
    /// Its template.
    pub template: &'a str,
    /// Its shape.
    pub vcpus: u32,
    /// Its shape.
    pub mem_mib: u64,
}

/// A template's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateShape {
    /// Its name.
    pub name: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Memory (MiB).
    pub mem_mib: u64,
}

/// The connection to the cluster's registry.
pub struct Db {
    url: String,
    client: Mutex<Arc<Client>>,
    rt: tokio::runtime::Handle,
    _rt_thread: Arc<RtThread>,
}

/// The runtime the connections are driven on, stopped with the last [`Db`].
struct RtThread {
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl Drop for RtThread {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(());
        }
    }
}

impl Db {
    /// Connects to `url` (`postgres://user:password@host:port/db`, or `host=… user=…`)
    /// and creates the schema if it is missing. TLS as libpq's `sslmode` says (default
    /// `prefer`; `verify-full` with `sslrootcert=FILE` authenticates the server): see
    /// [`crate::tls`].
    pub fn connect(url: &str) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("clade-cluster-db".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let _ = tx.send(Ok(rt.handle().clone()));
                rt.block_on(async move {
                    let _ = stop_rx.await;
                });
            })
            .map_err(|e| Error::Config(format!("starting the registry's thread: {e}")))?;
        let rt = rx
            .recv()
            .map_err(|_| Error::Config("the registry's thread ended".into()))?
            .map_err(|e| Error::Config(format!("the registry's runtime: {e}")))?;
        let client = open(&rt, url)?;
        let db = Self {
            url: url.to_string(),
            client: Mutex::new(Arc::new(client)),
            rt,
            _rt_thread: Arc::new(RtThread {
                stop: Mutex::new(Some(stop_tx)),
            }),
        };
        db.blocking(|c| async move {
            // One node at a time creates the schema (CREATE … IF NOT EXISTS races).
            c.execute("SELECT pg_advisory_lock($1)", &[&SCHEMA_LOCK])
                .await?;
            let r = c.batch_execute(SCHEMA).await;
            c.execute("SELECT pg_advisory_unlock($1)", &[&SCHEMA_LOCK])
                .await?;
            r
        })?;
        Ok(db)
    }

    /// The client, reconnected if its connection ended (PostgreSQL restarted).
    fn client(&self) -> Result<Arc<Client>> {
        let mut c = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if c.is_closed() {
            tracing::warn!("cluster registry connection lost: reconnecting");
            *c = Arc::new(open(&self.rt, &self.url)?);
        }
        Ok(c.clone())
    }

    /// Runs `f` with the client from a thread that is not the async runtime's (the
    /// lifecycle's), waiting for it.
    pub fn blocking<T, F, Fut>(&self, f: F) -> Result<T>
    where
        F: FnOnce(Arc<Client>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
    {
        let c = self.client()?;
        Ok(futures::executor::block_on(f(c))?)
    }

    /// Runs `f` with the client from async code.
    pub async fn run<T, F, Fut>(&self, f: F) -> Result<T>
    where
        F: FnOnce(Arc<Client>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
    {
        let c = self.client()?;
        Ok(f(c).await?)
    }

    // ---- nodes ------------------------------------------------------------------------

    /// Registers node `n` (or re-registers it: its address, capacity and templates are
    /// updated, its drain flags cleared only if `fresh`) with a lease of `lease`.
    pub async fn join(&self, n: &NodeRow, lease: Duration, fresh: bool) -> Result<()> {
        let secs = lease.as_secs_f64();
        self.run(|c| async move {
            c.execute(
                "INSERT INTO clade_nodes (name, address, vcpus, mem_mib, takes_sandboxes, templates, lease_until)
                 VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))
                 ON CONFLICT (name) DO UPDATE SET address = $2, vcpus = $3, mem_mib = $4,
                   takes_sandboxes = $5, templates = $6,
                   lease_until = now() + make_interval(secs => $7),
                   draining = clade_nodes.draining AND NOT $8,
                   drained = clade_nodes.drained AND NOT $8",
                &[&n.name, &n.address, &n.vcpus, &n.mem_mib, &n.takes_sandboxes, &n.templates, &secs, &fresh],
            )
            .await
        })
        .await?;
        Ok(())
    }

    /// Renews `name`'s lease if it is still alive. `Ok(false)`: it had ended (the node
    /// must find out what it lost before it joins again).
    pub async fn renew(&self, name: &str, lease: Duration, templates: &[String]) -> Result<bool> {
        let secs = lease.as_secs_f64();
        let n = self
            .run(|c| async move {
                c.execute(
                    "UPDATE clade_nodes SET lease_until = now() + make_interval(secs => $2), templates = $3
                     WHERE name = $1 AND lease_until > now()",
                    &[&name, &secs, &templates],
                )
                .await
            })
            .await?;
        Ok(n == 1)
    }

    /// Every node, with what its running sandboxes commit.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>> {
        let rows = self
            .run(|c| async move { c.query(NODES_SQL, &[]).await })
            .await?;
        Ok(rows.iter().map(node_row).collect())
    }

    /// [`Db::nodes`] from blocking code.
    pub fn nodes_blocking(&self) -> Result<Vec<NodeRow>> {
        let rows = self.blocking(|c| async move { c.query(NODES_SQL, &[]).await })?;
        Ok(rows.iter().map(node_row).collect())
    }

    /// Tells node `name` to drain. Errors if there is no such node.
    pub async fn set_draining(&self, name: &str) -> Result<()> {
        let n = self
            .run(|c| async move {
                c.execute(
                    "UPDATE clade_nodes SET draining = true WHERE name = $1",
                    &[&name],
                )
                .await
            })
            .await?;
        if n == 0 {
            return Err(Error::NoSuchNode(name.to_string()));
        }
        Ok(())
    }

    /// Node `name`'s drain is over.
    pub async fn set_drained(&self, name: &str) -> Result<()> {
        self.run(|c| async move {
            c.execute(
                "UPDATE clade_nodes SET drained = true WHERE name = $1",
                &[&name],
            )
            .await
        })
        .await?;
        Ok(())
    }

    /// Whether node `name` was told to drain.
    pub async fn draining(&self, name: &str) -> Result<bool> {
        let r = self
            .run(|c| async move {
                c.query_opt("SELECT draining FROM clade_nodes WHERE name = $1", &[&name])
                    .await
            })
            .await?;
        Ok(r.is_some_and(|r| r.get(0)))
    }

    /// Records templates' shapes (for placing creates on nodes that lack them).
    pub async fn put_templates(&self, shapes: &[TemplateShape]) -> Result<()> {
        for t in shapes {
            let vcpus = t.vcpus as i32;
            let mem = t.mem_mib as i64;
            self.run(|c| async move {
                c.execute(
                    "INSERT INTO clade_templates (name, vcpus, mem_mib) VALUES ($1, $2, $3)
                     ON CONFLICT (name) DO UPDATE SET vcpus = $2, mem_mib = $3",
                    &[&t.name, &vcpus, &mem],
                )
                .await
            })
            .await?;
        }
        Ok(())
    }

    /// A template's shape, if some node recorded it.
    pub async fn template(&self, name: &str) -> Result<Option<TemplateShape>> {
        let r = self
            .run(|c| async move {
                c.query_opt(
                    "SELECT vcpus, mem_mib FROM clade_templates WHERE name = $1",
                    &[&name],
                )
                .await
            })
            .await?;
        Ok(r.map(|r| TemplateShape {
            name: name.to_string(),
            vcpus: r.get::<_, i32>(0).max(0) as u32,
            mem_mib: r.get::<_, i64>(1).max(0) as u64,
        }))
    }

    // ---- sandboxes --------------------------------------------------------------------

    /// Where sandbox `id` is; `None` if the registry has no row for it, or only its
    /// tombstone (it was killed: nothing is left of it to route to).
    pub async fn owner(&self, id: &str) -> Result<Option<OwnerRow>> {
        let r = self
            .run(|c| async move { c.query_opt(OWNER_SQL, &[&id]).await })
            .await?;
        Ok(r.as_ref().map(owner_row).filter(|r| r.state != "killed"))
    }

    /// Sandbox `id`'s row as it is, its tombstone included (state `killed`): what
    /// a node that holds a copy must know before it acts on it.
    pub fn owner_blocking(&self, id: &str) -> Result<Option<OwnerRow>> {
        let r = self.blocking(|c| async move { c.query_opt(OWNER_SQL, &[&id]).await })?;
        Ok(r.as_ref().map(owner_row))
    }

    /// Node `node` holds `h`: inserted, or updated (its token bumped if it had another
    /// owner: a takeover). Returns its token, or `None` if it was killed (its tombstone
    /// is left as it is: a node that held a copy does not bring it back).
    pub fn hold_blocking(&self, node: &str, h: &Holding<'_>) -> Result<Option<i64>> {
        let vcpus = h.vcpus as i32;
        let mem = h.mem_mib as i64;
        let r = self.blocking(|c| async move {
            c.query_opt(
                "INSERT INTO clade_sandboxes (id, node, token, state, durable, template, vcpus, mem_mib)
                 VALUES ($1, $2, 1, $3, $4, $5, $6, $7)
                 ON CONFLICT (id) DO UPDATE SET
                   token = CASE WHEN clade_sandboxes.node IS DISTINCT FROM $2
                           THEN clade_sandboxes.token + 1 ELSE clade_sandboxes.token END,
                   checkpointed = clade_sandboxes.checkpointed
                     AND clade_sandboxes.node IS NOT DISTINCT FROM $2 AND $3 = 'running',
                   node = $2, state = $3, durable = $4, template = $5, vcpus = $6,
                   mem_mib = $7, lost_why = NULL, updated = now()
                 WHERE clade_sandboxes.state <> 'killed'
                 RETURNING token",
                &[&h.id, &node, &h.state, &h.durable, &h.template, &vcpus, &mem],
            )
            .await
        })?;
        Ok(r.map(|r| r.get(0)))
    }

    /// Node `node` published a checkpoint of sandbox `id`.
    pub fn checkpointed_blocking(&self, id: &str, node: &str) -> Result<()> {
        self.blocking(|c| async move {
            c.execute(
                "UPDATE clade_sandboxes SET checkpointed = true WHERE id = $1 AND node = $2",
                &[&id, &node],
            )
            .await
        })?;
        Ok(())
    }

    /// Sandbox `id` was killed by `node`: if `node` owns it with `token`, or no live node
    /// owns it (it was killed from the store), its row becomes a tombstone (see
    /// [`TOMBSTONE`]). Returns whether it did.
    pub fn remove_blocking(&self, id: &str, node: &str, token: Option<i64>) -> Result<bool> {
        let n = self.blocking(|c| async move {
            let n = c
                .execute(
                    &format!(
                        "UPDATE clade_sandboxes s SET {TOMBSTONE}
                         WHERE s.id = $1 AND s.state <> 'killed' AND (
                           (s.node = $2 AND ($3::bigint IS NULL OR s.token = $3))
                           OR s.node IS NULL
                           OR NOT EXISTS (SELECT 1 FROM clade_nodes n
                                          WHERE n.name = s.node AND n.lease_until > now()))"
                    ),
                    &[&id, &node, &token],
                )
                .await?;
            c.execute(GC_TOMBSTONES, &[]).await?;
            Ok(n)
        })?;
        Ok(n == 1)
    }

    /// Sandbox `id`'s owner stopped renewing its lease while it ran: it is marked lost
    /// (no owner, its token bumped, so the old owner can no longer act on it). Only if
    /// that is still so when the statement runs; returns whether it marked it.
    pub async fn mark_lost(&self, id: &str, why: &str) -> Result<bool> {
        let n = self
            .run(|c| async move {
                c.execute(
                    "UPDATE clade_sandboxes s SET node = NULL, token = s.token + 1,
                       state = 'lost', lost_why = $2, updated = now()
                     FROM clade_nodes n
                     WHERE s.id = $1 AND n.name = s.node AND n.lease_until <= now()
                       AND s.state = 'running'",
                    &[&id, &why],
                )
                .await
            })
            .await?;
        Ok(n == 1)
    }

    /// A lost sandbox was killed: its row becomes a tombstone (see [`TOMBSTONE`]).
    pub async fn forget_lost(&self, id: &str) -> Result<bool> {
        let n = self
            .run(|c| async move {
                let n = c
                    .execute(
                        &format!(
                            "UPDATE clade_sandboxes s SET {TOMBSTONE}
                             WHERE s.id = $1 AND s.state = 'lost'"
                        ),
                        &[&id],
                    )
                    .await?;
                c.execute(GC_TOMBSTONES, &[]).await?;
                Ok(n)
            })
            .await?;
        Ok(n == 1)
    }

    /// Every sandbox row (for lists and the CLI).
    pub async fn sandboxes(&self) -> Result<Vec<OwnerRow>> {
        let rows = self
            .run(|c| async move {
                c.query(
                    "SELECT s.id, s.node, s.token, s.state, s.durable, s.lost_why, n.address, s.checkpointed,
                       COALESCE(n.lease_until > now(), false), COALESCE(n.draining, false)
                     FROM clade_sandboxes s LEFT JOIN clade_nodes n ON n.name = s.node
                     WHERE s.state <> 'killed'
                     ORDER BY s.id",
                    &[],
                )
                .await
            })
            .await?;
        Ok(rows.iter().map(owner_row).collect())
    }

    // ---- snapshots --------------------------------------------------------------------

    /// Node `node` holds persistent snapshot `id` (named `name`) of sandbox `sandbox`.
    pub fn put_snapshot_blocking(
        &self,
        id: &str,
        name: Option<&str>,
        sandbox: &str,
        node: &str,
        created_ms: i64,
    ) -> Result<()> {
        self.blocking(|c| async move {
            c.execute(
                "INSERT INTO clade_snapshots (id, name, sandbox, node, created_ms)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (id) DO UPDATE SET name = $2, sandbox = $3, node = $4, created_ms = $5",
                &[&id, &name, &sandbox, &node, &created_ms],
            )
            .await
        })?;
        Ok(())
    }

    /// Snapshot `id` is gone.
    pub fn delete_snapshot_blocking(&self, id: &str) -> Result<()> {
        self.blocking(|c| async move {
            c.execute("DELETE FROM clade_snapshots WHERE id = $1", &[&id])
                .await
        })?;
        Ok(())
    }

    /// The node holding the snapshot a reference means (its id, or a name: the newest of
    /// that name).
    pub async fn snapshot_node(&self, reference: &str) -> Result<Option<NodeRow>> {
        let r = self
            .run(|c| async move {
                c.query_opt(
                    "SELECT node FROM clade_snapshots WHERE id = $1 OR name = $1
                     ORDER BY id = $1 DESC, created_ms DESC LIMIT 1",
                    &[&reference],
                )
                .await
            })
            .await?;
        self.node_of(r.map(|r| r.get::<_, String>(0))).await
    }

    /// The node holding the newest snapshot of sandbox `sandbox`.
    pub async fn snapshots_node(&self, sandbox: &str) -> Result<Option<NodeRow>> {
        let r = self
            .run(|c| async move {
                c.query_opt(
                    "SELECT node FROM clade_snapshots WHERE sandbox = $1
                     ORDER BY created_ms DESC LIMIT 1",
                    &[&sandbox],
                )
                .await
            })
            .await?;
        self.node_of(r.map(|r| r.get::<_, String>(0))).await
    }

    async fn node_of(&self, name: Option<String>) -> Result<Option<NodeRow>> {
        let Some(name) = name else { return Ok(None) };
        Ok(self.nodes().await?.into_iter().find(|n| n.name == name))
    }
}

/// What a kill leaves of a sandbox's row: a tombstone (state `killed`, no owner, its
/// token bumped), so that a node that held a copy while it was away (stopped, cut off)
/// finds out it was killed when it comes back, instead of taking a missing row for a
/// sandbox not recorded yet, and neither resumes nor publishes it again. A sandbox id is
/// never reused, so a tombstone stands for nothing else.
const TOMBSTONE: &str = "node = NULL, token = s.token + 1, state = 'killed', durable = false,
     checkpointed = false, lost_why = NULL, updated = now()";

/// Tombstones are kept for a week, far longer than any lease, any
/// pause of a node's process or an operator's repair takes; then removed (by each kill,
/// in the same round trip). A node away for longer than that must not rejoin with its
/// old state directory.
const GC_TOMBSTONES: &str = "DELETE FROM clade_sandboxes
     WHERE state = 'killed' AND updated < now() - make_interval(days => 7)";

/// Every node with what its running sandboxes commit (see [`NodeRow`]).
const NODES_SQL: &str =
    "SELECT n.name, n.address, n.vcpus, n.mem_mib, n.takes_sandboxes, n.draining,
       n.drained, n.templates, n.lease_until > now() AS live,
       EXTRACT(EPOCH FROM (n.lease_until - now()))::float8 AS left_s,
       COALESCE(SUM(s.vcpus) FILTER (WHERE s.state = 'running'), 0)::bigint,
       COALESCE(SUM(s.mem_mib) FILTER (WHERE s.state = 'running'), 0)::bigint,
       COUNT(s.id)
     FROM clade_nodes n LEFT JOIN clade_sandboxes s ON s.node = n.name
     GROUP BY n.name ORDER BY n.name";

const OWNER_SQL: &str =
    "SELECT s.id, s.node, s.token, s.state, s.durable, s.lost_why, n.address, s.checkpointed,
       COALESCE(n.lease_until > now(), false), COALESCE(n.draining, false)
     FROM clade_sandboxes s LEFT JOIN clade_nodes n ON n.name = s.node
     WHERE s.id = $1";

fn owner_row(r: &Row) -> OwnerRow {
    OwnerRow {
        id: r.get(0),
        node: r.get(1),
        token: r.get(2),
        state: r.get(3),
        durable: r.get(4),
        lost_why: r.get(5),
        owner_address: r.get(6),
        checkpointed: r.get(7),
        owner_live: r.get(8),
        owner_draining: r.get(9),
    }
}

fn node_row(r: &Row) -> NodeRow {
    NodeRow {
        name: r.get(0),
        address: r.get(1),
        vcpus: r.get(2),
        mem_mib: r.get(3),
        takes_sandboxes: r.get(4),
        draining: r.get(5),
        drained: r.get(6),
        templates: r.get(7),
        live: r.get(8),
        lease_left_s: r.get::<_, Option<f64>>(9).unwrap_or(0.0),
        used_vcpus: r.get(10),
        used_mem_mib: r.get(11),
        sandboxes: r.get(12),
    }
}

/// Connects, its connection driven on `rt` (from any thread, async or not: nothing here
/// enters a runtime).
fn open(rt: &tokio::runtime::Handle, url: &str) -> Result<Client> {
    let target = PgTarget::parse(url)?;
    let mut config: tokio_postgres::Config = target
        .url
        .parse()
        // Not the URL in the message: it may hold a password.
        .map_err(|e| Error::Config(format!("the registry's URL: {}", chain(&e))))?;
    config.ssl_mode(target.mode.negotiation());
    let tls = MakeRustlsConnect::new(crate::tls::postgres(target.mode, target.root.as_deref())?);
    if matches!(
        target.mode,
        SslMode::Disable | SslMode::Prefer | SslMode::Require
    ) && target.root.is_none()
    {
        tracing::warn!(
            sslmode = %target.mode,
            "the registry's server is not authenticated: give ?sslmode=verify-full&sslrootcert=FILE"
        );
    }
    let mode = target.mode;
    let task = rt.spawn(async move {
        let (client, conn) = tokio::time::timeout(Duration::from_secs(10), config.connect(tls))
            .await
            .map_err(|_| Error::Config("connecting to PostgreSQL timed out after 10 s".into()))?
            .map_err(|e| {
                Error::Config(format!(
                    "connecting to PostgreSQL (sslmode={mode}): {}",
                    chain(&e)
                ))
            })?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::warn!("cluster registry connection: {}", chain(&e));
            }
        });
        Ok::<_, Error>(client)
    });
    futures::executor::block_on(task)
        .map_err(|e| Error::Config(format!("connecting to PostgreSQL: {e}")))?
}

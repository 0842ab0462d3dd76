//! The registry: every sandbox this host owns, in SQLite (`<state dir>/registry.sqlite`).
//!
//! It is the service's memory across restarts: for a running sandbox the VM process's pid
//! and its API and vsock sockets (so a restarted service finds the process again and checks
//! it is still the same one), for a paused one the snapshot it resumes from. One row per
//! sandbox; the lifecycle (`host`) is the only writer. Lists are filtered here, in Rust,
//! after one ordered read: a host holds hundreds of sandboxes, not millions.
//!
//! It also records persistent snapshots ([`SnapshotRecord`], table `snapshots`): each is a
//! template on disk, and the row says where it came from, which files of other sandboxes
//! and templates it needs, and whether it was deleted (a deleted snapshot's files stay
//! until nothing needs them; see `host`).
//!
//! Paging is by position, not by offset: a page token names the last row shown (its time
//! and id), so sandboxes created or killed between two pages neither repeat nor vanish.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::error::{Error, Result};

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Its VM process runs.
    Running,
    /// Snapshot on disk, no process.
    Paused,
    /// Its VM process ended without being asked to.
    Crashed,
}

impl State {
    /// The name stored and shown (`running`, `paused`, `crashed`).
    pub fn as_str(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Paused => "paused",
            State::Crashed => "crashed",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "running" => State::Running,
            "paused" => State::Paused,
            "crashed" => State::Crashed,
            other => return Err(Error::Corrupt(format!("unknown sandbox state '{other}'"))),
        })
    }
}

/// One sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Its id (E2B format).
    pub id: String,
    /// The template it was created from.
    pub template: String,
    /// Where it is in its life.
    pub state: State,
    /// The VM process (while running).
    pub pid: Option<i32>,
    /// The VM's control API socket (while running).
    pub api_sock: Option<PathBuf>,
    /// The VM's vsock socket (while running): how the agent is reached.
    pub vsock: Option<PathBuf>,
    /// The sandbox's own directory (pause snapshots, sockets of resumed VMs, logs).
    pub dir: PathBuf,
    /// The snapshot a paused sandbox resumes from (the latest pause).
    pub snapshot: Option<PathBuf>,
    /// Pauses so far (names the next snapshot directory and disk overlay).
    pub pauses: u32,
    /// When it was created (ms since the epoch).
    pub started_ms: i64,
    /// When it times out (ms since the epoch).
    pub end_ms: i64,
    /// Pause instead of kill on timeout.
    pub auto_pause: bool,
    /// A request for it while it is paused wakes it (E2B's `autoResume`); without, such
    /// a request gets the answer for a sandbox that is not running.
    pub auto_resume: bool,
    /// Its envd access token (E2B's `envdAccessToken`): every data-plane request for it
    /// must carry it (`X-Access-Token`) or a URL signed with it. `None`: not secured.
    pub envd_token: Option<String>,
    /// Its traffic access token (E2B's `trafficAccessToken`, with `allowPublicTraffic:
    /// false`): requests for its exposed ports must carry it. `None`: public.
    pub traffic_token: Option<String>,
    /// The Host header its exposed ports are sent (E2B's `maskRequestHost`, `${PORT}`
    /// replaced by the port). `None`: the request's own.
    pub mask_host: Option<String>,
    /// User metadata (E2B `metadata`).
    pub metadata: BTreeMap<String, String>,
    /// Environment variables asked for at creation (E2B `envVars`).
    pub env_vars: BTreeMap<String, String>,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory (MiB).
    pub mem_mib: u64,
    /// The disk overlay the running VM writes (None without a disk).
    pub disk: Option<PathBuf>,
    /// Why it is `Crashed`.
    pub crash: Option<String>,
    /// The sandbox it was forked from.
    pub parent: Option<String>,
    /// Its network's index (`crate::net`): its namespace, outer address and TAP, kept
    /// while it exists (paused too); `None` for a sandbox without a network.
    pub net: Option<u32>,
    /// Its egress policy (`hostnet::EgressPolicy`, as JSON; `None`: allow all).
    pub egress: Option<String>,
    /// A sandbox moved here from another host through the object store: the published
    /// snapshot (id) it resumes from, until its first pause here (see `host::durable`).
    pub remote: Option<String>,
    /// The latest of its pauses published to the object store (its number, `pauses` at
    /// that pause); `None`: none was. A paused sandbox is durable when this is `pauses`.
    pub published_pause: Option<u32>,
    /// When that pause was published (ms since the epoch).
    pub published_ms: Option<i64>,
    /// A pause on timeout keeps its memory (E2B's `autoPauseMemory`, true unless asked);
    /// false: a filesystem-only pause.
    pub pause_keeps_memory: bool,
    /// Paused filesystem-only: its memory was dropped and `disk` holds what it wrote; its
    /// next wake boots its template's kernel from that disk.
    pub memory_dropped: bool,
}

impl Record {
    /// Paused, and its pause is in the object store: another host may resume it.
    pub fn durable(&self) -> bool {
        self.state == State::Paused
            && (self.remote.is_some() || self.published_pause == Some(self.pauses))
    }
}

/// Filters and paging for [`Registry::list`].
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// Only these states (empty: all but `Crashed`).
    pub states: Vec<State>,
    /// Only sandboxes whose metadata has every one of these pairs.
    pub metadata: BTreeMap<String, String>,
    /// Only sandboxes of this template.
    pub template: Option<String>,
    /// Only sandboxes started at or after this time (ms).
    pub started_after: Option<i64>,
    /// Newest first.
    pub descending: bool,
    /// Only sandboxes after this one in the list's order (its start time and id: the
    /// previous page's last row).
    pub after: Option<(i64, String)>,
    /// At most this many (0: no limit).
    pub limit: usize,
}

impl Query {
    /// The sandboxes of `all` (oldest first) matching this query, in its order, and
    /// whether more match after them.
    pub fn select(&self, mut all: Vec<Record>) -> (Vec<Record>, bool) {
        let q = self;
        if q.descending {
            all.reverse();
        }
        let after = |r: &Record| match &q.after {
            None => true,
            Some((ms, id)) => {
                let here = (r.started_ms, r.id.as_str());
                let there = (*ms, id.as_str());
                if q.descending {
                    here < there
                } else {
                    here > there
                }
            }
        };
        let mut matching = all.into_iter().filter(|r| {
            (if q.states.is_empty() {
                r.state != State::Crashed
            } else {
                q.states.contains(&r.state)
            }) && q.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v))
                && q.template.as_ref().is_none_or(|t| &r.template == t)
                && q.started_after.is_none_or(|t| r.started_ms >= t)
                && after(r)
        });
        let mut page: Vec<Record> = matching.by_ref().collect();
        let more = q.limit > 0 && page.len() > q.limit;
        if q.limit > 0 {
            page.truncate(q.limit);
        }
        (page, more)
    }
}

/// The registry database.
pub struct Registry {
    db: Connection,
    /// Bumped by every write to the sandboxes table: readers that cache what they read
    /// (the data plane's routes) know from it, without a query, that nothing changed.
    changes: Arc<AtomicU64>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template TEXT NOT NULL,
    state TEXT NOT NULL,
    pid INTEGER,
    api_sock TEXT,
    vsock TEXT,
    dir TEXT NOT NULL,
    snapshot TEXT,
    pauses INTEGER NOT NULL,
    started_ms INTEGER NOT NULL,
    end_ms INTEGER NOT NULL,
    auto_pause INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    vcpus INTEGER NOT NULL,
    mem_mib INTEGER NOT NULL,
    disk TEXT,
    crash TEXT,
    parent TEXT,
    net INTEGER,
    egress TEXT,
    remote TEXT,
    published_pause INTEGER,
    published_ms INTEGER,
    auto_resume INTEGER,
    envd_token TEXT,
    traffic_token TEXT,
    mask_host TEXT,
    pause_keeps_memory INTEGER,
    memory_dropped INTEGER
);
";

/// Columns added since the first schema: (name, type), added to an older registry on open.
const ADDED_COLUMNS: &[(&str, &str)] = &[
    ("net", "INTEGER"),
    ("egress", "TEXT"),
    ("remote", "TEXT"),
    ("published_pause", "INTEGER"),
    ("published_ms", "INTEGER"),
    ("auto_resume", "INTEGER"),
    ("envd_token", "TEXT"),
    ("traffic_token", "TEXT"),
    ("mask_host", "TEXT"),
    ("pause_keeps_memory", "INTEGER"),
    ("memory_dropped", "INTEGER"),
];

const SNAPSHOT_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY,
    name TEXT,
    sandbox TEXT NOT NULL,
    source_dir TEXT NOT NULL,
    template TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    deleted INTEGER NOT NULL
);
";

/// A persistent snapshot of a sandbox: a template of its own (its id is the template's
/// name), plus where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRecord {
    /// Its id: the name of its template directory.
    pub id: String,
    /// The name it was given (E2B's snapshot name); the newest live snapshot of a name is
    /// the one the name means.
    pub name: Option<String>,
    /// The sandbox it is a snapshot of.
    pub sandbox: String,
    /// That sandbox's directory: its memory diff chain and frozen disk layer may lie there,
    /// so the directory stays (after a kill too) until this row is gone.
    pub source_dir: PathBuf,
    /// The template its source was created from (it builds on that template's files).
    pub template: String,
    /// When it was taken (ms since the epoch).
    pub created_ms: i64,
    /// Deleted through the API: no longer listed or usable; its files go once nothing
    /// needs them.
    pub deleted: bool,
}

/// Filters and paging for [`Registry::list_snapshots`] (newest first).
#[derive(Debug, Clone, Default)]
pub struct SnapshotQuery {
    /// Only snapshots of this sandbox.
    pub sandbox: Option<String>,
    /// Only snapshots with this id or name.
    pub name: Option<String>,
    /// Only snapshots after this one (its time and id: the previous page's last row).
    pub after: Option<(i64, String)>,
    /// At most this many (0: no limit).
    pub limit: usize,
}

const SNAPSHOT_COLUMNS: &str = "id, name, sandbox, source_dir, template, created_ms, deleted";

fn snapshot_row(row: &Row<'_>) -> rusqlite::Result<SnapshotRecord> {
    Ok(SnapshotRecord {
        id: row.get(0)?,
        name: row.get(1)?,
        sandbox: row.get(2)?,
        source_dir: PathBuf::from(row.get::<_, String>(3)?),
        template: row.get(4)?,
        created_ms: row.get(5)?,
        deleted: row.get::<_, i64>(6)? != 0,
    })
}

const COLUMNS: &str =
    "id, template, state, pid, api_sock, vsock, dir, snapshot, pauses, started_ms, \
    end_ms, auto_pause, metadata, env_vars, vcpus, mem_mib, disk, crash, parent, net, egress, \
    remote, published_pause, published_ms, auto_resume, envd_token, traffic_token, mask_host, pause_keeps_memory, \
    memory_dropped";

fn path_text(p: &Option<PathBuf>) -> Option<String> {
    p.as_ref().map(|p| p.to_string_lossy().into_owned())
}

fn map_json(m: &BTreeMap<String, String>) -> String {
    serde_json::to_string(m).unwrap_or_else(|_| "{}".into())
}

fn from_row(row: &Row<'_>) -> rusqlite::Result<(Record, String, String, String)> {
    let opt_path = |i: usize| -> rusqlite::Result<Option<PathBuf>> {
        Ok(row.get::<_, Option<String>>(i)?.map(PathBuf::from))
    };
    let r = Record {
        id: row.get(0)?,
        template: row.get(1)?,
        state: State::Running,
        pid: row.get(3)?,
        api_sock: opt_path(4)?,
        vsock: opt_path(5)?,
        dir: PathBuf::from(row.get::<_, String>(6)?),
        snapshot: opt_path(7)?,
        pauses: row.get(8)?,
        started_ms: row.get(9)?,
        end_ms: row.get(10)?,
        auto_pause: row.get::<_, i64>(11)? != 0,
        metadata: BTreeMap::new(),
        env_vars: BTreeMap::new(),
        vcpus: row.get(14)?,
        mem_mib: row.get::<_, i64>(15)? as u64,
        disk: opt_path(16)?,
        crash: row.get(17)?,
        parent: row.get(18)?,
        net: row.get(19)?,
        egress: row.get(20)?,
        remote: row.get(21)?,
        published_pause: row.get(22)?,
        published_ms: row.get(23)?,
        auto_resume: row.get::<_, Option<i64>>(24)?.unwrap_or(0) != 0,
        envd_token: row.get(25)?,
        traffic_token: row.get(26)?,
        mask_host: row.get(27)?,
        pause_keeps_memory: row.get::<_, Option<i64>>(28)?.unwrap_or(1) != 0,
        memory_dropped: row.get::<_, Option<i64>>(29)?.unwrap_or(0) != 0,
    };
    Ok((r, row.get(2)?, row.get(12)?, row.get(13)?))
}

fn finish_row((mut r, state, metadata, env): (Record, String, String, String)) -> Result<Record> {
    r.state = State::parse(&state)?;
    r.metadata = serde_json::from_str(&metadata)
        .map_err(|e| Error::Corrupt(format!("metadata of {}: {e}", r.id)))?;
    r.env_vars = serde_json::from_str(&env)
        .map_err(|e| Error::Corrupt(format!("env vars of {}: {e}", r.id)))?;
    Ok(r)
}

/// Brings a registry written by an older service up to [`SCHEMA`] (new columns are NULL in
/// old rows: no network, allow all).
fn add_missing_columns(db: &Connection) -> Result<()> {
    let mut have = Vec::new();
    {
        let mut stmt = db.prepare("PRAGMA table_info(sandboxes)")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            have.push(row.get::<_, String>(1)?);
        }
    }
    for (name, ty) in ADDED_COLUMNS {
        if !have.iter().any(|h| h == name) {
            db.execute_batch(&format!("ALTER TABLE sandboxes ADD COLUMN {name} {ty}"))?;
        }
    }
    Ok(())
}

impl Registry {
    /// Opens (creating if needed) the registry at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let db = Connection::open(path)?;
        // WAL: a crash of the service mid-write leaves the last committed state.
        db.pragma_update(None, "journal_mode", "WAL")?;
        db.pragma_update(None, "synchronous", "NORMAL")?;
        db.execute_batch(SCHEMA)?;
        db.execute_batch(SNAPSHOT_SCHEMA)?;
        add_missing_columns(&db)?;
        Ok(Self {
            db,
            changes: Arc::default(),
        })
    }

    /// A registry in memory (tests).
    pub fn in_memory() -> Result<Self> {
        let db = Connection::open_in_memory()?;
        db.execute_batch(SCHEMA)?;
        db.execute_batch(SNAPSHOT_SCHEMA)?;
        Ok(Self {
            db,
            changes: Arc::default(),
        })
    }

    /// The counter of writes to the sandboxes table (see the field).
    pub fn changes(&self) -> Arc<AtomicU64> {
        self.changes.clone()
    }

    /// Adds a new sandbox (its id must be new).
    pub fn insert(&self, r: &Record) -> Result<()> {
        self.write("INSERT", r)
    }

    /// Replaces a sandbox's row.
    pub fn update(&self, r: &Record) -> Result<()> {
        self.write("REPLACE", r)
    }

    fn write(&self, verb: &str, r: &Record) -> Result<()> {
        let sql = format!(
            "{verb} INTO sandboxes ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, \
             ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30)"
        );
        // Cached: a create or a wake writes its row on the request's path, and parsing
        // this statement each time was a measurable part of that write.
        let result = self.db.prepare_cached(&sql).and_then(|mut stmt| {
            stmt.execute(params![
                r.id,
                r.template,
                r.state.as_str(),
                r.pid,
                path_text(&r.api_sock),
                path_text(&r.vsock),
                r.dir.to_string_lossy(),
                path_text(&r.snapshot),
                r.pauses,
                r.started_ms,
                r.end_ms,
                r.auto_pause as i64,
                map_json(&r.metadata),
                map_json(&r.env_vars),
                r.vcpus,
                r.mem_mib as i64,
                path_text(&r.disk),
                r.crash,
                r.parent,
                r.net,
                r.egress,
                r.remote,
                r.published_pause,
                r.published_ms,
                r.auto_resume as i64,
                r.envd_token,
                r.traffic_token,
                r.mask_host,
                r.pause_keeps_memory as i64,
                r.memory_dropped as i64,
            ])
        });
        // After the write: whoever read the counter before reading a row sees it change.
        self.changes.fetch_add(1, Ordering::SeqCst);
        result?;
        Ok(())
    }

    /// The sandbox `id`.
    pub fn get(&self, id: &str) -> Result<Option<Record>> {
        // Cached: every data-plane request looks its sandbox up.
        let sql = format!("SELECT {COLUMNS} FROM sandboxes WHERE id = ?1");
        self.db
            .prepare_cached(&sql)?
            .query_row([id], from_row)
            .optional()?
            .map(finish_row)
            .transpose()
    }

    /// Marks sandbox `id` crashed (`why`), only if its row still says it runs in process
    /// `pid`. Whether it did: a caller that read the row without the sandbox's lock may
    /// have seen it before a pause or a kill ended that process on purpose, and a row
    /// written since (paused, say) must not be replaced by what it read.
    pub fn mark_crashed(&self, id: &str, pid: i32, why: &str) -> Result<bool> {
        let result = self.db.execute(
            "UPDATE sandboxes SET state = ?1, crash = ?2, pid = NULL \
             WHERE id = ?3 AND state = ?4 AND pid = ?5",
            params![
                State::Crashed.as_str(),
                why,
                id,
                State::Running.as_str(),
                pid
            ],
        );
        self.changes.fetch_add(1, Ordering::SeqCst);
        Ok(result? == 1)
    }

    /// Removes the sandbox `id` (no error if it is not there).
    pub fn delete(&self, id: &str) -> Result<()> {
        let result = self.db.execute("DELETE FROM sandboxes WHERE id = ?1", [id]);
        self.changes.fetch_add(1, Ordering::SeqCst);
        result?;
        Ok(())
    }

    /// Every sandbox, oldest first.
    pub fn all(&self) -> Result<Vec<Record>> {
        let sql = format!("SELECT {COLUMNS} FROM sandboxes ORDER BY started_ms, id");
        let mut stmt = self.db.prepare(&sql)?;
        let rows = stmt.query_map([], from_row)?;
        let mut out = Vec::new();
        for row in rows {
            out.push(finish_row(row?)?);
        }
        Ok(out)
    }

    /// The sandboxes matching `q`, and whether more match after them.
    pub fn list(&self, q: &Query) -> Result<(Vec<Record>, bool)> {
        Ok(q.select(self.all()?))
    }

    /// How many sandboxes and snapshots use template `name` (a snapshot builds on its
    /// source's template; a deleted one counts until its files are gone).
    pub fn count_template(&self, name: &str) -> Result<usize> {
        let n: i64 = self.db.query_row(
            "SELECT (SELECT COUNT(*) FROM sandboxes WHERE template = ?1) + \
             (SELECT COUNT(*) FROM snapshots WHERE template = ?1)",
            [name],
            |r| r.get(0),
        )?;
        Ok(n as usize)
    }

    /// Adds a new snapshot (its id must be new).
    pub fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<()> {
        self.db.execute(
            &format!(
                "INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
            ),
            params![
                s.id,
                s.name,
                s.sandbox,
                s.source_dir.to_string_lossy(),
                s.template,
                s.created_ms,
                s.deleted as i64,
            ],
        )?;
        Ok(())
    }

    /// The snapshot `id` (deleted ones too).
    pub fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRecord>> {
        let sql = format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = ?1");
        Ok(self
            .db
            .prepare_cached(&sql)?
            .query_row([id], snapshot_row)
            .optional()?)
    }

    /// Every snapshot (deleted ones too), newest first.
    pub fn all_snapshots(&self) -> Result<Vec<SnapshotRecord>> {
        let sql =
            format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots ORDER BY created_ms DESC, id DESC");
        let mut stmt = self.db.prepare(&sql)?;
        let rows = stmt.query_map([], snapshot_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The live snapshot `reference` means: the one with that id, else the newest with
    /// that name.
    pub fn resolve_snapshot(&self, reference: &str) -> Result<Option<SnapshotRecord>> {
        // One row looked up (by the primary key, or by name among live ones): every
        // create asks this, and reading every snapshot's row grew with their number.
        let sql = format!(
            "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE deleted = 0 AND (id = ?1 OR name = ?1) \
             ORDER BY id = ?1 DESC, created_ms DESC, id DESC LIMIT 1"
        );
        Ok(self
            .db
            .prepare_cached(&sql)?
            .query_row([reference], snapshot_row)
            .optional()?)
    }

    /// Live snapshots matching `q`, newest first, and whether more match after them.
    pub fn list_snapshots(&self, q: &SnapshotQuery) -> Result<(Vec<SnapshotRecord>, bool)> {
        let mut page: Vec<SnapshotRecord> = self
            .all_snapshots()?
            .into_iter()
            .filter(|s| {
                !s.deleted
                    && q.sandbox.as_ref().is_none_or(|x| &s.sandbox == x)
                    && q.name
                        .as_ref()
                        .is_none_or(|n| &s.id == n || s.name.as_ref() == Some(n))
                    && q.after
                        .as_ref()
                        .is_none_or(|(ms, id)| (s.created_ms, s.id.as_str()) < (*ms, id.as_str()))
            })
            .collect();
        let more = q.limit > 0 && page.len() > q.limit;
        if q.limit > 0 {
            page.truncate(q.limit);
        }
        Ok((page, more))
    }

    /// Marks snapshot `id` deleted.
    pub fn mark_snapshot_deleted(&self, id: &str) -> Result<()> {
        self.db
            .execute("UPDATE snapshots SET deleted = 1 WHERE id = ?1", [id])?;
        Ok(())
    }

    /// Removes snapshot `id`'s row (its files are gone).
    pub fn delete_snapshot(&self, id: &str) -> Result<()> {
        self.db
            .execute("DELETE FROM snapshots WHERE id = ?1", [id])?;
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn every_write_to_a_sandbox_row_is_counted_and_reads_are_not() {
        let reg = Registry::in_memory().unwrap();
        let changes = reg.changes();
        let n = || changes.load(Ordering::SeqCst);
        let mut r = record("aaaaaaaaaaaaaaaaaaaa", State::Running, 1);
        reg.insert(&r).unwrap();
        assert_eq!(n(), 1);
        reg.get(&r.id).unwrap();
        reg.all().unwrap();
        assert_eq!(n(), 1, "reads change nothing");
        r.state = State::Paused;
        reg.update(&r).unwrap();
        assert_eq!(n(), 2);
        // A failed write still counts (whatever a reader cached may be stale).
        assert!(reg.insert(&r).is_err());
        assert_eq!(n(), 3);
        reg.delete(&r.id).unwrap();
        assert_eq!(n(), 4);
    }

    #[test]
    fn a_crash_is_marked_only_on_the_row_of_the_process_that_ended() {
        let reg = Registry::in_memory().unwrap();
        let mut r = record("aaaaaaaaaaaaaaaaaaaa", State::Running, 1);
        reg.insert(&r).unwrap();
        // Another process's end (a row that moved on to a new VM) changes nothing.
        assert!(!reg.mark_crashed(&r.id, 43, "gone").unwrap());
        assert_eq!(reg.get(&r.id).unwrap().unwrap().state, State::Running);
        // Paused since it was read: the pause's row stays.
        r.state = State::Paused;
        r.pid = None;
        reg.update(&r).unwrap();
        assert!(!reg.mark_crashed(&r.id, 42, "gone").unwrap());
        assert_eq!(reg.get(&r.id).unwrap().unwrap(), r);
        // Still running in it: crashed, with the reason, and no process.
        r.state = State::Running;
        r.pid = Some(42);
        reg.update(&r).unwrap();
        assert!(reg.mark_crashed(&r.id, 42, "exit status 0").unwrap());
        let got = reg.get(&r.id).unwrap().unwrap();
        assert_eq!(
            (got.state, got.pid, got.crash.as_deref()),
            (State::Crashed, None, Some("exit status 0"))
        );
        assert!(!reg.mark_crashed("bbbbbbbbbbbbbbbbbbbb", 42, "x").unwrap());
    }

    pub(crate) fn record(id: &str, state: State, started_ms: i64) -> Record {
        Record {
            id: id.into(),
            template: "t".into(),
            state,
            pid: Some(42),
            api_sock: Some(PathBuf::from(format!("/s/{id}/vm.api"))),
            vsock: Some(PathBuf::from(format!("/s/{id}/vm.vsock"))),
            dir: PathBuf::from(format!("/s/{id}")),
            snapshot: None,
            pauses: 0,
            started_ms,
            end_ms: started_ms + 15_000,
            auto_pause: false,
            auto_resume: false,
            pause_keeps_memory: true,
            memory_dropped: false,
            envd_token: Some("t0k".into()),
            traffic_token: None,
            mask_host: Some("${PORT}-x.example.org".into()),
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            vcpus: 1,
            mem_mib: 64,
            disk: None,
            crash: None,
            parent: None,
            net: None,
            egress: None,
            remote: None,
            published_pause: None,
            published_ms: None,
        }
    }

    #[test]
    fn rows_round_trip_and_survive_reopening() {
        let path = std::env::temp_dir().join(format!("sandbox-reg-{}.sqlite", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut r = record("a1", State::Running, 10);
        r.metadata.insert("user".into(), "ann".into());
        r.env_vars.insert("K".into(), "v w".into());
        r.disk = Some("/s/a1/disk-0.cdsk".into());
        r.net = Some(7);
        r.egress = Some(r#"{"default":"deny","allow":[],"deny":[]}"#.into());
        {
            let reg = Registry::open(&path).unwrap();
            reg.insert(&r).unwrap();
            assert!(reg.insert(&r).is_err(), "ids are unique");
        }
        let reg = Registry::open(&path).unwrap();
        assert_eq!(reg.get("a1").unwrap().unwrap(), r);
        r.state = State::Paused;
        r.pid = None;
        r.snapshot = Some("/s/a1/p1".into());
        reg.update(&r).unwrap();
        assert_eq!(reg.get("a1").unwrap().unwrap(), r);
        reg.delete("a1").unwrap();
        assert_eq!(reg.get("a1").unwrap(), None);
        drop(reg);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_registry_of_an_older_service_gets_the_new_columns() {
        let path = std::env::temp_dir().join(format!("sandbox-old-{}.sqlite", std::process::id()));
        let _ = std::fs::remove_file(&path);
        {
            let db = Connection::open(&path).unwrap();
            // The first schema: without the columns added since.
            let mut old = SCHEMA.to_string();
            for (name, ty) in ADDED_COLUMNS {
                old = old.replace(&format!(",\n    {name} {ty}"), "");
            }
            assert!(!old.contains("egress"), "{old}");
            db.execute_batch(&old).unwrap();
        }
        let reg = Registry::open(&path).unwrap();
        let mut r = record("o1", State::Paused, 5);
        r.net = Some(3);
        reg.insert(&r).unwrap();
        assert_eq!(reg.get("o1").unwrap().unwrap(), r);
        drop(reg);
        Registry::open(&path).expect("opening again adds nothing twice");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn list_filters_and_pages() {
        let reg = Registry::in_memory().unwrap();
        for i in 0..5 {
            let mut r = record(&format!("s{i}"), State::Running, i);
            if i % 2 == 0 {
                r.metadata.insert("even".into(), "yes".into());
            }
            if i == 3 {
                r.state = State::Paused;
            }
            if i == 4 {
                r.state = State::Crashed;
            }
            reg.insert(&r).unwrap();
        }
        let ids = |q: &Query| -> Vec<String> {
            reg.list(q).unwrap().0.into_iter().map(|r| r.id).collect()
        };
        // Crashed ones only when asked for.
        assert_eq!(ids(&Query::default()), ["s0", "s1", "s2", "s3"]);
        let q = Query {
            states: vec![State::Paused],
            ..Query::default()
        };
        assert_eq!(ids(&q), ["s3"]);
        let mut q = Query::default();
        q.metadata.insert("even".into(), "yes".into());
        assert_eq!(ids(&q), ["s0", "s2"]);
        let q = Query {
            descending: true,
            limit: 2,
            ..Query::default()
        };
        let (page, more) = reg.list(&q).unwrap();
        assert_eq!(page.len(), 2);
        assert_eq!(page[0].id, "s3");
        assert!(more);
        // The next page starts after the last row shown, even when a row before it goes.
        let last = page.last().unwrap();
        let q = Query {
            descending: true,
            limit: 2,
            after: Some((last.started_ms, last.id.clone())),
            ..Query::default()
        };
        reg.delete("s3").unwrap();
        let (page, more) = reg.list(&q).unwrap();
        assert_eq!(
            page.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["s1", "s0"]
        );
        assert!(!more);
        // Ascending: a sandbox created meanwhile comes at the end, none repeats.
        let q = Query {
            limit: 2,
            ..Query::default()
        };
        let (page, _) = reg.list(&q).unwrap();
        assert_eq!(page[1].id, "s1");
        reg.insert(&record("s9", State::Running, 9)).unwrap();
        let q = Query {
            after: Some((page[1].started_ms, page[1].id.clone())),
            ..q
        };
        assert_eq!(ids(&q), ["s2", "s9"]);
        let q = Query {
            started_after: Some(2),
            ..Query::default()
        };
        assert_eq!(ids(&q), ["s2", "s9"]);
        assert_eq!(reg.count_template("t").unwrap(), 5);
        assert_eq!(reg.count_template("u").unwrap(), 0);
    }

    fn snap(id: &str, name: Option<&str>, sandbox: &str, ms: i64) -> SnapshotRecord {
        SnapshotRecord {
            id: id.into(),
            name: name.map(String::from),
            sandbox: sandbox.into(),
            source_dir: PathBuf::from(format!("/s/{sandbox}")),
            template: "t".into(),
            created_ms: ms,
            deleted: false,
        }
    }

    #[test]
    fn snapshots_resolve_list_page_and_survive_reopening() {
        let path =
            std::env::temp_dir().join(format!("sandbox-reg-snap-{}.sqlite", std::process::id()));
        let _ = std::fs::remove_file(&path);
        {
            let reg = Registry::open(&path).unwrap();
            reg.insert_snapshot(&snap("snap-a", Some("mine"), "x1", 1))
                .unwrap();
            reg.insert_snapshot(&snap("snap-b", None, "x2", 2)).unwrap();
            reg.insert_snapshot(&snap("snap-c", Some("mine"), "x1", 3))
                .unwrap();
            assert!(reg.insert_snapshot(&snap("snap-a", None, "x1", 4)).is_err());
        }
        let reg = Registry::open(&path).unwrap();
        assert_eq!(
            reg.get_snapshot("snap-a").unwrap().unwrap(),
            snap("snap-a", Some("mine"), "x1", 1)
        );
        // A name means its newest snapshot; an id means itself.
        assert_eq!(reg.resolve_snapshot("mine").unwrap().unwrap().id, "snap-c");
        assert_eq!(
            reg.resolve_snapshot("snap-a").unwrap().unwrap().id,
            "snap-a"
        );
        assert_eq!(reg.resolve_snapshot("nope").unwrap(), None);
        // An id wins over a newer snapshot named like it.
        reg.insert_snapshot(&snap("snap-d", Some("snap-b"), "x2", 5))
            .unwrap();
        assert_eq!(
            reg.resolve_snapshot("snap-b").unwrap().unwrap().id,
            "snap-b"
        );
        reg.delete_snapshot("snap-d").unwrap();
        let ids = |q: &SnapshotQuery| -> Vec<String> {
            reg.list_snapshots(q)
                .unwrap()
                .0
                .into_iter()
                .map(|s| s.id)
                .collect()
        };
        assert_eq!(
            ids(&SnapshotQuery::default()),
            ["snap-c", "snap-b", "snap-a"]
        );
        let q = SnapshotQuery {
            sandbox: Some("x1".into()),
            ..SnapshotQuery::default()
        };
        assert_eq!(ids(&q), ["snap-c", "snap-a"]);
        let q = SnapshotQuery {
            limit: 1,
            ..SnapshotQuery::default()
        };
        let (page, more) = reg.list_snapshots(&q).unwrap();
        assert!(more);
        let q = SnapshotQuery {
            after: Some((page[0].created_ms, page[0].id.clone())),
            limit: 1,
            ..q
        };
        assert_eq!(ids(&q), ["snap-b"]);
        // Deleted: not listed, not resolved; the name falls back to the older one.
        reg.mark_snapshot_deleted("snap-c").unwrap();
        assert_eq!(reg.resolve_snapshot("mine").unwrap().unwrap().id, "snap-a");
        assert_eq!(reg.resolve_snapshot("snap-c").unwrap(), None);
        assert!(reg.get_snapshot("snap-c").unwrap().unwrap().deleted);
        assert_eq!(ids(&SnapshotQuery::default()), ["snap-b", "snap-a"]);
        // Snapshots hold their source's template.
        assert_eq!(reg.count_template("t").unwrap(), 3);
        reg.delete_snapshot("snap-c").unwrap();
        assert_eq!(reg.get_snapshot("snap-c").unwrap(), None);
        drop(reg);
        let _ = std::fs::remove_file(&path);
    }
}

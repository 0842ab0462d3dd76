//! The registry: every sandbox this host owns, in SQLite (`<state dir>/registry.sqlite`).
//!
//! It is the service's memory across restarts: for a running sandbox the VM process's pid
//! and its API and vsock sockets (so a restarted service finds the process again and checks
//! it is still the same one), for a paused one the snapshot it resumes from. One row per
//! sandbox; the lifecycle (`host`) is the only writer. Lists are filtered here, in Rust,
//! after one ordered read: a host holds hundreds of sandboxes, not millions.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    /// Skip this many matches.
    pub offset: usize,
    /// At most this many (0: no limit).
    pub limit: usize,
}

/// The registry database.
pub struct Registry {
    db: Connection,
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
    parent TEXT
);
";

const COLUMNS: &str =
    "id, template, state, pid, api_sock, vsock, dir, snapshot, pauses, started_ms, \
    end_ms, auto_pause, metadata, env_vars, vcpus, mem_mib, disk, crash, parent";

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

impl Registry {
    /// Opens (creating if needed) the registry at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let db = Connection::open(path)?;
        // WAL: a crash of the service mid-write leaves the last committed state.
        db.pragma_update(None, "journal_mode", "WAL")?;
        db.pragma_update(None, "synchronous", "NORMAL")?;
        db.execute_batch(SCHEMA)?;
        Ok(Self { db })
    }

    /// A registry in memory (tests).
    pub fn in_memory() -> Result<Self> {
        let db = Connection::open_in_memory()?;
        db.execute_batch(SCHEMA)?;
        Ok(Self { db })
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
             ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)"
        );
        self.db.execute(
            &sql,
            params![
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
            ],
        )?;
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

    /// Removes the sandbox `id` (no error if it is not there).
    pub fn delete(&self, id: &str) -> Result<()> {
        self.db
            .execute("DELETE FROM sandboxes WHERE id = ?1", [id])?;
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
        let mut all = self.all()?;
        if q.descending {
            all.reverse();
        }
        let mut matching = all.into_iter().filter(|r| {
            (if q.states.is_empty() {
                r.state != State::Crashed
            } else {
                q.states.contains(&r.state)
            }) && q.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v))
                && q.template.as_ref().is_none_or(|t| &r.template == t)
                && q.started_after.is_none_or(|t| r.started_ms >= t)
        });
        let mut page: Vec<Record> = matching.by_ref().skip(q.offset).collect();
        let more = q.limit > 0 && page.len() > q.limit;
        if q.limit > 0 {
            page.truncate(q.limit);
        }
        Ok((page, more))
    }

    /// How many sandboxes use template `name`.
    pub fn count_template(&self, name: &str) -> Result<usize> {
        let n: i64 = self.db.query_row(
            "SELECT COUNT(*) FROM sandboxes WHERE template = ?1",
            [name],
            |r| r.get(0),
        )?;
        Ok(n as usize)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

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
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            vcpus: 1,
            mem_mib: 64,
            disk: None,
            crash: None,
            parent: None,
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
        let q = Query {
            descending: true,
            limit: 2,
            offset: 2,
            ..Query::default()
        };
        let (page, more) = reg.list(&q).unwrap();
        assert_eq!(
            page.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["s1", "s0"]
        );
        assert!(!more);
        let q = Query {
            started_after: Some(2),
            ..Query::default()
        };
        assert_eq!(ids(&q), ["s2", "s3"]);
        assert_eq!(reg.count_template("t").unwrap(), 5);
        assert_eq!(reg.count_template("u").unwrap(), 0);
    }
}

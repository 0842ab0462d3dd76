//! Kept processes: the agent-wide table of processes started with `Spawn`.
//!
//! Why the agent owns them: a plain `Exec` lives and dies with the connection that started
//! it, and every host connection is lost when the VM is paused (the VMM process exits; a
//! restored guest sees its vsock connections reset). A background server started through
//! the E2B data plane must survive that, and a restart of the host service too, so the
//! process, its stdin and its output readers belong to the agent, and connections only
//! *attach* to it (`Attach {pid}`) for as long as they care.
//!
//! Output produced while no connection is attached with `output` is read (so the process
//! never blocks on a full pipe or PTY) and dropped: an attachment receives output from the
//! moment it attached. Nothing is buffered, so memory does not grow with a chatty process
//! nobody watches.
//!
//! Bounds: at most [`MAX_KEPT`] kept processes run at once (Spawn beyond that is refused),
//! each with at most [`MAX_ATTACHMENTS`] live attachments; the last [`MAX_ENDED`] ended ones
//! are kept for [`ENDED_TTL`] so that a late Attach still gets the exit status.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use super::conn::{Conn, ExecEntry};
use crate::proto::{AgentMsg, ErrorKind, ExitStatus, ProcInfo, RemoteError};

/// Kept processes running at once.
pub const MAX_KEPT: usize = 256;
/// Live attachments per kept process.
pub const MAX_ATTACHMENTS: usize = 32;
/// Ended kept processes remembered (for a late Attach or ListProcs).
pub const MAX_ENDED: usize = 64;
/// How long an ended kept process is remembered.
pub const ENDED_TTL: Duration = Duration::from_secs(60);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain data behind these locks: a panic elsewhere leaves nothing half-updated.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A connection's interest in a kept process: frames for the process go to `id` there.
struct Sub {
    conn: Weak<Conn>,
    id: u32,
    output: bool,
}

impl Sub {
    fn live(&self) -> Option<Arc<Conn>> {
        self.conn.upgrade().filter(|c| !c.is_broken())
    }
}

#[derive(Default)]
struct KeptState {
    subs: Vec<Sub>,
    exit: Option<ExitStatus>,
}

/// One kept process.
pub(crate) struct Kept {
    /// What ListProcs reports (`exit` filled in from the state).
    info: ProcInfo,
    entry: Arc<ExecEntry>,
    state: Mutex<KeptState>,
}

impl Kept {
    pub(crate) fn new(info: ProcInfo, entry: Arc<ExecEntry>) -> Self {
        Kept {
            info,
            entry,
            state: Mutex::new(KeptState::default()),
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.info.pid
    }

    pub(crate) fn info(&self) -> ProcInfo {
        let mut i = self.info.clone();
        i.exit = lock(&self.state).exit;
        i
    }

    /// Attaches `conn`'s operation `id`: sends `Started` (and `Exited` at once if the
    /// process has ended); from then on `id` names the process on that connection.
    pub(crate) fn attach(
        &self,
        conn: &Arc<Conn>,
        id: u32,
        output: bool,
    ) -> Result<(), RemoteError> {
        let mut st = lock(&self.state);
        if let Some(x) = st.exit {
            conn.send(id, &AgentMsg::Started { pid: self.pid() });
            conn.send(id, &AgentMsg::Exited(x));
            return Ok(());
        }
        st.subs.retain(|s| s.live().is_some());
        if st.subs.len() >= MAX_ATTACHMENTS {
            return Err(RemoteError::new(
                ErrorKind::InvalidArgument,
                format!(
                    "process {} has {MAX_ATTACHMENTS} attachments already",
                    self.pid()
                ),
            ));
        }
        conn.execs().insert(id, self.entry.clone());
        // Under the state lock: output broadcast after this point follows Started.
        conn.send(id, &AgentMsg::Started { pid: self.pid() });
        st.subs.push(Sub {
            conn: Arc::downgrade(conn),
            id,
            output,
        });
        Ok(())
    }

    /// Output of the process to every attachment that wants it (none: dropped).
    pub(crate) fn broadcast(&self, msg: &AgentMsg) {
        let targets: Vec<(Arc<Conn>, u32)> = lock(&self.state)
            .subs
            .iter()
            .filter(|s| s.output)
            .filter_map(|s| s.live().map(|c| (c, s.id)))
            .collect();
        for (c, id) in targets {
            c.send(id, msg);
        }
    }

    /// The process ended (all its output already broadcast): every attachment gets the
    /// final frame and stops naming it.
    pub(crate) fn finish(&self, status: Option<ExitStatus>) {
        let subs = {
            let mut st = lock(&self.state);
            // A lost status (never expected: the reaper watches every child) is reported
            // as a kill, so later attachments still get a final frame.
            st.exit = Some(status.unwrap_or(ExitStatus::Signaled {
                signal: libc::SIGKILL,
                core_dumped: false,
            }));
            std::mem::take(&mut st.subs)
        };
        for s in subs {
            let Some(c) = s.conn.upgrade() else { continue };
            c.execs().remove(&s.id);
            match status {
                Some(st) => c.send(s.id, &AgentMsg::Exited(st)),
                None => c.send_err(
                    s.id,
                    RemoteError::new(ErrorKind::Internal, "lost the exit status"),
                ),
            };
        }
    }
}

#[derive(Default)]
struct Table {
    live: HashMap<u32, Arc<Kept>>,
    /// Slots promised to spawns in progress.
    reserved: usize,
    ended: VecDeque<(Instant, Arc<Kept>)>,
}

impl Table {
    fn prune(&mut self) {
        while self.ended.len() > MAX_ENDED
            || self
                .ended
                .front()
                .is_some_and(|(t, _)| t.elapsed() > ENDED_TTL)
        {
            self.ended.pop_front();
        }
    }
}

/// The agent's kept processes (one per server).
#[derive(Default)]
pub(crate) struct ProcTable {
    inner: Mutex<Table>,
}

/// A slot for a spawn in progress; given back when dropped unless used by [`ProcTable::insert`].
pub(crate) struct Reservation<'a> {
    table: &'a ProcTable,
    used: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.used {
            lock(&self.table.inner).reserved -= 1;
        }
    }
}

impl ProcTable {
    /// A slot for one more kept process, or an error at [`MAX_KEPT`].
    pub(crate) fn reserve(&self) -> Result<Reservation<'_>, RemoteError> {
        let mut t = lock(&self.inner);
        if t.live.len() + t.reserved >= MAX_KEPT {
            return Err(RemoteError {
                kind: ErrorKind::Io,
                errno: libc::EAGAIN,
                message: format!("{MAX_KEPT} kept processes are running already"),
            });
        }
        t.reserved += 1;
        Ok(Reservation {
            table: self,
            used: false,
        })
    }

    pub(crate) fn insert(&self, mut r: Reservation<'_>, k: Arc<Kept>) {
        let mut t = lock(&self.inner);
        t.reserved -= 1;
        r.used = true;
        let pid = k.pid();
        // The pid of an ended process may have been reused.
        t.ended.retain(|(_, e)| e.pid() != pid);
        t.live.insert(pid, k);
    }

    /// The process ended: from the live set to the recently ended ones.
    pub(crate) fn ended(&self, pid: u32) {
        let mut t = lock(&self.inner);
        if let Some(k) = t.live.remove(&pid) {
            t.ended.push_back((Instant::now(), k));
        }
        t.prune();
    }

    /// A live or recently ended kept process.
    pub(crate) fn get(&self, pid: u32) -> Option<Arc<Kept>> {
        let mut t = lock(&self.inner);
        t.prune();
        if let Some(k) = t.live.get(&pid) {
            return Some(k.clone());
        }
        t.ended
            .iter()
            .rev()
            .find(|(_, k)| k.pid() == pid)
            .map(|(_, k)| k.clone())
    }

    /// Every kept process: running ones by pid, then recently ended ones, oldest first.
    pub(crate) fn list(&self) -> Vec<ProcInfo> {
        let (mut live, ended): (Vec<Arc<Kept>>, Vec<Arc<Kept>>) = {
            let mut t = lock(&self.inner);
            t.prune();
            (
                t.live.values().cloned().collect(),
                t.ended.iter().map(|(_, k)| k.clone()).collect(),
            )
        };
        live.sort_by_key(|k| k.pid());
        live.iter().chain(ended.iter()).map(|k| k.info()).collect()
    }
}

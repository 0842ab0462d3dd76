//! The sending half of a connection ([`Conn`]), shared by every thread that replies on
//! it, and the processes its operation ids name ([`ExecEntry`]: an Exec's, or a kept
//! process attached to it). Reading and dispatching frames is [`super::session`]'s.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, Weak};

use super::Shared;
use crate::proto::{self, AgentMsg, ErrorKind, RemoteError, WinSize};
use crate::reaper::Reaper;

/// The sending half of a connection, shared by every thread that replies on it.
pub(crate) struct Conn {
    pub(crate) n: u64,
    out: Mutex<File>,
    broken: AtomicBool,
    pub(crate) shared: Arc<Shared>,
    /// Execs in flight, by request id.
    pub(crate) execs: Mutex<HashMap<u32, Arc<ExecEntry>>>,
}

impl Conn {
    /// Connection `n`, replying through `out`.
    pub(crate) fn new(n: u64, out: File, shared: Arc<Shared>) -> Self {
        Self {
            n,
            out: Mutex::new(out),
            broken: AtomicBool::new(false),
            shared,
            execs: Mutex::new(HashMap::new()),
        }
    }

    /// The connection has closed: nothing more is sent on it.
    pub(crate) fn mark_broken(&self) {
        self.broken.store(true, Ordering::Relaxed);
    }

    /// Sends one frame; false once the connection is broken (the caller may stop producing).
    pub(crate) fn send(&self, id: u32, msg: &AgentMsg) -> bool {
        if self.broken.load(Ordering::Relaxed) {
            return false;
        }
        let frame = match proto::encode_agent(id, msg) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(conn = self.n, id, "cannot encode reply: {e}");
                return true;
            }
        };
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = out.write_all(&frame) {
            tracing::debug!(conn = self.n, "send failed: {e}");
            self.broken.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The peer has gone (or a write failed): frames are no longer sent.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    pub(crate) fn send_err(&self, id: u32, err: RemoteError) -> bool {
        self.send(id, &AgentMsg::Error(err))
    }

    pub(crate) fn execs(&self) -> MutexGuard<'_, HashMap<u32, Arc<ExecEntry>>> {
        self.execs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running process: what a connection's operation id names (an Exec, or a Spawn/Attach
/// of a kept process).
pub(crate) struct ExecEntry {
    pid: libc::pid_t,
    stdin: Mutex<Option<mpsc::Sender<StdinCmd>>>,
    tty_master: Option<Arc<OwnedFd>>,
    /// Started by Spawn: owned by the agent, so a closing connection leaves it running.
    pub(crate) kept: bool,
}

pub(crate) enum StdinCmd {
    /// Bytes to write, and the operation to acknowledge them to.
    Data {
        data: Vec<u8>,
        ack: (Weak<Conn>, u32),
    },
    Close,
}

impl ExecEntry {
    /// A process `pid` as its connection (or the agent) names it: `stdin` feeds its stdin
    /// writer, `tty_master` its terminal; `kept` for a Spawn.
    pub(crate) fn new(
        pid: libc::pid_t,
        stdin: Option<mpsc::Sender<StdinCmd>>,
        tty_master: Option<Arc<OwnedFd>>,
        kept: bool,
    ) -> Self {
        Self {
            pid,
            stdin: Mutex::new(stdin),
            tty_master,
            kept,
        }
    }

    /// Queues stdin bytes; `StdinAck` goes to `conn`'s operation `id` once written.
    /// Without a stdin (none, or closed) the bytes are dropped and acknowledged at once, so
    /// the sender's window never waits for them.
    pub(crate) fn stdin_data(&self, data: Vec<u8>, conn: &Arc<Conn>, id: u32) {
        let n = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let queued = match self
            .stdin
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            Some(tx) => tx
                .send(StdinCmd::Data {
                    data,
                    ack: (Arc::downgrade(conn), id),
                })
                .is_ok(),
            None => false,
        };
        if !queued {
            conn.send(id, &AgentMsg::StdinAck(n));
        }
    }

    /// The process has ended: its stdin writer thread may stop.
    pub(crate) fn drop_stdin(&self) {
        self.stdin.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    pub(crate) fn stdin_close(&self) {
        if let Some(tx) = self.stdin.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(StdinCmd::Close);
        }
    }

    /// Sends `signal` to the process (or its process group: every exec is a session and
    /// group leader).
    pub(crate) fn signal(&self, signal: i32, group: bool) -> Result<(), RemoteError> {
        if !(0..=64).contains(&signal) {
            return Err(RemoteError::new(
                ErrorKind::InvalidArgument,
                format!("signal {signal} out of range"),
            ));
        }
        let target = if group { -self.pid } else { self.pid };
        // SAFETY: kill(2) with a pid the reaper guarantees is still ours (not reaped).
        let rc = Reaper::global().with_live(self.pid, || unsafe { libc::kill(target, signal) });
        match rc {
            None => Err(RemoteError::new(
                ErrorKind::UnknownId,
                "the process has already exited",
            )),
            Some(0) => Ok(()),
            Some(_) => Err(RemoteError::from_io(
                &io::Error::last_os_error(),
                format!("kill {target}"),
            )),
        }
    }

    pub(crate) fn resize(&self, size: WinSize) -> Result<(), RemoteError> {
        let master = self.tty_master.as_ref().ok_or_else(|| {
            RemoteError::new(ErrorKind::InvalidArgument, "the exec has no terminal")
        })?;
        super::set_winsize(master.as_raw_fd(), size)
            .map_err(|e| RemoteError::from_io(&e, "TIOCSWINSZ"))
    }

    /// SIGKILL to the process group.
    pub(crate) fn kill_group(&self) {
        // SAFETY: kill(2) on our own, not yet reaped, process group.
        Reaper::global().with_live(self.pid, || unsafe { libc::kill(-self.pid, libc::SIGKILL) });
    }
}

//! The sending half of a connection ([`Conn`]) and what the connection may do with a
//! running exec ([`RunningExec`]): what `exec` and `files` need of a connection, below the
//! module that reads and dispatches its frames (`conn`), so that neither imports it.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::Shared;
use crate::proto::{self, AgentMsg, RemoteError, WinSize};

/// A running exec, as the connection that started it drives it.
pub(crate) trait RunningExec: Send + Sync {
    /// Queues bytes for its stdin.
    fn stdin_data(&self, data: Vec<u8>);
    /// Closes its stdin once the queued bytes are written.
    fn stdin_close(&self);
    /// Sends `signal` to the process (or its process group).
    fn signal(&self, signal: i32, group: bool) -> Result<(), RemoteError>;
    /// Resizes its terminal.
    fn resize(&self, size: WinSize) -> Result<(), RemoteError>;
    /// The connection is gone: ends its process group.
    fn kill_on_disconnect(&self);
}

/// The sending half of a connection, shared by every thread that replies on it.
pub(crate) struct Conn {
    pub(crate) n: u64,
    out: Mutex<File>,
    broken: AtomicBool,
    pub(crate) shared: Arc<Shared>,
    /// Execs in flight, by request id.
    pub(crate) execs: Mutex<HashMap<u32, Arc<dyn RunningExec>>>,
}

impl Conn {
    /// Connection `n`, replying on `out`.
    pub(crate) fn new(n: u64, out: File, shared: Arc<Shared>) -> Conn {
        Conn {
            n,
            out: Mutex::new(out),
            broken: AtomicBool::new(false),
            shared,
            execs: Mutex::new(HashMap::new()),
        }
    }

    /// The peer is gone: every later send fails at once.
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

    pub(crate) fn send_err(&self, id: u32, err: RemoteError) -> bool {
        self.send(id, &AgentMsg::Error(err))
    }

    pub(crate) fn execs(&self) -> MutexGuard<'_, HashMap<u32, Arc<dyn RunningExec>>> {
        self.execs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

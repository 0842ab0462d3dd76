//! Host-side client of the in-guest agent (`clade-agent`, protocol in
//! `guest-agent/PROTOCOL.md`).
//!
//! A [`Client`] is one connection, reached through a VMM's vsock Unix socket (Firecracker's
//! host-initiated convention: `CONNECT 52\n`, `OK <port>\n`, then the protocol) or directly
//! through the Unix socket of `clade-agent --listen-unix` ([`Transport`]).
//!
//! **Blocking, with std threads.** Every call blocks the calling thread until its answer
//! arrives; one reader thread per connection routes incoming frames to the waiting calls by
//! request id, so any number of threads may share a `Client` (`&self` methods, `Send +
//! Sync`) and run operations concurrently over the one connection (e.g. 8 execs at once).
//! The VMM has no async runtime, the agent's operations are few and coarse, and a thread
//! per in-flight operation is cheap at that scale, so blocking calls keep this module and
//! its callers simple.
//!
//! Backpressure: each operation buffers at most 64 frames (4 MiB of output) that its caller
//! has not consumed yet; beyond that the reader thread waits, which stalls the whole
//! connection. Consume exec events promptly (or use one `Client` per long-lived exec).
//! Exec stdin is flow-controlled by the agent's acknowledgements (256 KiB window).
//!
//! Everything the guest sends is untrusted: frames are size-limited and decoded without
//! panics, unexpected frames fail the operation with [`Error::AgentProtocol`], and reads
//! into memory are capped ([`MAX_READ_FILE`]).

//!
//! Files: `handshake.rs` (connecting), `connection.rs` (the shared connection, request
//! routing and its reader thread), `files.rs` (file operations), `exec.rs` (processes),
//! `watch.rs` (directory watches), `transport.rs` (vsock or direct socket), `sync.rs` (the
//! post-restore sync).

mod connection;
mod exec;
mod files;
mod handshake;
mod sync;
mod transport;
mod watch;

use std::net::Shutdown;
use std::path::Path;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use guest_agent::proto::{AgentMsg, HostMsg};
pub use guest_agent::proto::{
    DirEntry, ErrorKind, ExitStatus, FileKind, FileStat, ProcInfo, RemoteError, WinSize,
    AGENT_VSOCK_PORT,
};

use connection::Inner;
pub use exec::{Command, Exec, ExecEvent, ExecHandle, Output, StdinWriter};
use handshake::pong_from;
pub use handshake::{connect_raw, probe};
pub(crate) use sync::sync_after_restore;
pub use transport::Transport;
pub use watch::{Watch, WatchEvent, WatchKind, WatchStopper};

use crate::error::{Error, Result};

/// Most output (stdout and stderr together) [`Client::output`] keeps in memory; a command
/// that writes more is killed (stream it with [`Exec::wait_with`] instead).
pub const MAX_OUTPUT: u64 = 1 << 30;
/// Largest file [`Client::read_file`] reads into memory (use [`Client::read_file_to`]).
pub const MAX_READ_FILE: u64 = 1 << 30;
/// Largest number of entries [`Client::list`] accepts.
pub const MAX_LIST_ENTRIES: usize = 1 << 20;

/// Health report from [`Client::ping`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pong {
    pub agent_version: String,
    pub protocol: u16,
    /// Guest uptime.
    pub uptime: Duration,
    /// Execs running in the guest (all connections).
    pub running_execs: u32,
    /// Round trip of this ping.
    pub rtt: Duration,
}

/// Next frame of an operation.
fn recv(rx: &Receiver<AgentMsg>) -> Result<AgentMsg> {
    rx.recv().map_err(|_| Error::AgentDisconnected)
}

/// An agent error reply becomes `Err`.
fn check(msg: AgentMsg) -> Result<AgentMsg> {
    match msg {
        AgentMsg::Error(e) => Err(Error::Agent(e)),
        m => Ok(m),
    }
}

fn unexpected(op: &str, msg: &AgentMsg) -> Error {
    Error::AgentProtocol(format!("unexpected reply to {op}: {msg:?}"))
}

/// A connection to the agent. See the [module documentation](self).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("agent_version", &self.inner.agent_version)
            .field("protocol", &self.inner.protocol)
            .finish()
    }
}

impl Client {
    /// The agent's version string (from the handshake).
    pub fn agent_version(&self) -> &str {
        &self.inner.agent_version
    }

    /// The negotiated protocol version.
    pub fn protocol(&self) -> u16 {
        self.inner.protocol
    }

    /// One request, one reply.
    fn call(&self, msg: &HostMsg) -> Result<AgentMsg> {
        let (_reg, rx) = self.inner.start(msg, None)?;
        check(recv(&rx)?)
    }

    fn call_ok(&self, op: &str, msg: &HostMsg) -> Result<()> {
        match self.call(msg)? {
            AgentMsg::Ok => Ok(()),
            m => Err(unexpected(op, &m)),
        }
    }

    /// Health check: agent version, guest uptime, running execs, round-trip time.
    pub fn ping(&self) -> Result<Pong> {
        let t0 = Instant::now();
        pong_from(self.call(&HostMsg::Ping)?, t0)
    }

    /// Starts a command. Its output arrives as [`ExecEvent`]s on the returned [`Exec`].
    pub fn spawn(&self, cmd: &Command) -> Result<Exec> {
        exec::spawn(&self.inner, cmd)
    }

    /// Starts a command that the agent keeps when this connection closes (protocol
    /// `Spawn`): it survives the connection, a VM pause, a restart of this process, and
    /// any connection can [`Client::attach`] to it by pid. `tag` and `meta` are stored
    /// with it and reported by [`Client::list_procs`]. Its stdin (if requested) stays open
    /// when the returned [`StdinWriter`] is dropped; close it with [`StdinWriter::close`].
    pub fn spawn_kept(&self, cmd: &Command, tag: Option<&str>, meta: &[u8]) -> Result<Exec> {
        exec::spawn_kept(&self.inner, cmd, tag, meta)
    }

    /// Follows a kept process (see [`Client::spawn_kept`]): with `output`, its output from
    /// now on; always its end, and a [`StdinWriter`] and an [`ExecHandle`] that act on it.
    /// An ended process (kept for a minute) yields its exit status at once.
    pub fn attach(&self, pid: u32, output: bool) -> Result<Exec> {
        exec::attach(&self.inner, pid, output)
    }

    /// The kept processes: running ones, then those that ended recently (`exit` set).
    pub fn list_procs(&self) -> Result<Vec<ProcInfo>> {
        let (_reg, rx) = self.inner.start(&HostMsg::ListProcs, None)?;
        let mut all = Vec::new();
        loop {
            match check(recv(&rx)?)? {
                AgentMsg::ProcList(mut p) => {
                    if all.len() + p.len() > MAX_LIST_ENTRIES {
                        return Err(Error::AgentProtocol("too many processes listed".into()));
                    }
                    all.append(&mut p);
                }
                AgentMsg::Ok => return Ok(all),
                m => return Err(unexpected("list_procs", &m)),
            }
        }
    }

    /// Closes the connection now (operations in flight fail; the agent kills the execs
    /// started on it, not kept processes). Dropping the last clone does the same.
    pub fn close(&self) {
        let _ = self.inner.sock.shutdown(Shutdown::Both);
    }

    /// Runs a command to completion, feeding it `stdin` (if `Some`), and collects its output.
    pub fn output(&self, cmd: &Command, stdin: Option<&[u8]>) -> Result<Output> {
        exec::output(&self.inner, cmd, stdin)
    }

    /// Sends `signal` to the process of the exec with request id `exec_id`.
    pub fn signal(&self, exec_id: u32, signal: i32, group: bool) -> Result<()> {
        self.call_ok(
            "signal",
            &HostMsg::Signal {
                target: exec_id,
                signal,
                group,
            },
        )
    }

    /// Watches the directory `path` (with `recursive`, its subdirectories too). Each
    /// watch should have a connection of its own when its events may be read slowly.
    pub fn watch(&self, path: impl AsRef<Path>, recursive: bool) -> Result<Watch> {
        watch::start(&self.inner, path.as_ref(), recursive)
    }

    /// Sets the guest's wall clock.
    pub fn set_clock(&self, t: SystemTime) -> Result<()> {
        let ns = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .ok()
            .and_then(|d| i64::try_from(d.as_nanos()).ok())
            .ok_or_else(|| Error::Io {
                context: "set_clock: time outside 1970..2262",
                source: std::io::ErrorKind::InvalidInput.into(),
            })?;
        self.call_ok("set_clock", &HostMsg::SetClock { unix_ns: ns })
    }

    /// Feeds `data` to the guest kernel's RNG, credited as entropy.
    pub fn add_entropy(&self, data: &[u8]) -> Result<()> {
        self.call_ok("add_entropy", &HostMsg::AddEntropy(data.to_vec()))
    }

    /// Flushes the guest's filesystems.
    pub fn sync(&self) -> Result<()> {
        self.call_ok("sync", &HostMsg::Sync)
    }

    /// Asks the guest to power off (it syncs first). The connection is closed afterwards;
    /// a connection dropped before the answer arrives also counts as success.
    pub fn power_off(&self) -> Result<()> {
        let r = match self.call(&HostMsg::PowerOff) {
            Ok(AgentMsg::Ok) | Err(Error::AgentDisconnected) => Ok(()),
            Ok(m) => Err(unexpected("power_off", &m)),
            Err(e) => Err(e),
        };
        let _ = self.inner.sock.shutdown(Shutdown::Both);
        r
    }
}

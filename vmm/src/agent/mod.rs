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

mod exec;
mod sync;
mod transport;
mod watch;

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use guest_agent::proto::{
    self, AgentMsg, HostMsg, Msg, CHUNK_LEN, MAX_FRAME_LEN, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
pub use guest_agent::proto::{
    DirEntry, ErrorKind, ExitStatus, FileKind, FileStat, ProcInfo, RemoteError, WinSize,
    AGENT_VSOCK_PORT,
};

pub use exec::{Command, Exec, ExecEvent, ExecHandle, Output, StdinWriter};
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
/// Frames buffered per operation before the reader thread waits for the caller.
const ROUTE_DEPTH: usize = 64;

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

/// Where incoming frames for one request id go.
pub(crate) struct Route {
    tx: SyncSender<AgentMsg>,
    /// Stdin window of an exec.
    window: Option<Arc<Window>>,
}

/// Exec stdin flow control: bytes sent but not yet acknowledged by the agent.
pub(crate) struct Window {
    state: Mutex<WindowState>,
    cond: Condvar,
}

#[derive(Default)]
struct WindowState {
    in_flight: u32,
    closed: bool,
}

impl Window {
    fn new() -> Self {
        Window {
            state: Mutex::new(WindowState::default()),
            cond: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, WindowState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn release(&self, n: u32) {
        let mut st = self.lock();
        st.in_flight = st.in_flight.saturating_sub(n);
        self.cond.notify_all();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.cond.notify_all();
    }

    /// Waits until every byte sent was acknowledged; false if the exec ended first.
    fn drained(&self) -> bool {
        let mut st = self.lock();
        loop {
            if st.in_flight == 0 {
                return true;
            }
            if st.closed {
                return false;
            }
            st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits for room and reserves up to `want` bytes; `None` once the exec has ended.
    fn reserve(&self, want: usize) -> Option<usize> {
        let max = proto::STDIN_WINDOW;
        let mut st = self.lock();
        loop {
            if st.closed {
                return None;
            }
            let room = max.saturating_sub(st.in_flight) as usize;
            if room > 0 {
                let n = want.min(room).min(CHUNK_LEN);
                st.in_flight += n as u32;
                return Some(n);
            }
            st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Routing table shared with the reader thread.
pub(crate) struct Routes {
    map: Mutex<HashMap<u32, Route>>,
    closed: AtomicBool,
}

impl Routes {
    fn lock(&self) -> MutexGuard<'_, HashMap<u32, Route>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Delivers one frame from the agent.
    fn deliver(&self, id: u32, msg: AgentMsg) {
        let (tx, window) = {
            let map = self.lock();
            match map.get(&id) {
                Some(r) => (r.tx.clone(), r.window.clone()),
                None => {
                    match &msg {
                        AgentMsg::Error(e) if id == 0 => {
                            tracing::warn!("agent: connection error: {e}")
                        }
                        _ => tracing::debug!(id, "agent frame for no pending request"),
                    }
                    return;
                }
            }
        };
        if let Some(w) = &window {
            match &msg {
                AgentMsg::StdinAck(n) => {
                    w.release(*n);
                    return;
                }
                AgentMsg::Exited(_) | AgentMsg::Error(_) => w.close(),
                _ => {}
            }
        }
        // Outside the lock: this may wait for the caller to consume.
        if tx.send(msg).is_err() {
            let route = self.lock().remove(&id);
            if let Some(w) = route.and_then(|r| r.window) {
                w.close();
            }
        }
    }

    /// The connection is gone: fail every pending request.
    fn close_all(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let routes: Vec<Route> = self.lock().drain().map(|(_, r)| r).collect();
        for r in routes {
            if let Some(w) = r.window {
                w.close();
            }
        }
    }
}

/// The connection; shared by the [`Client`] and its [`Exec`]s, closed when the last goes.
pub(crate) struct Inner {
    sock: UnixStream,
    writer: Mutex<UnixStream>,
    routes: Arc<Routes>,
    next_id: AtomicU32,
    agent_version: String,
    protocol: u16,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(Shutdown::Both);
    }
}

/// Unregisters a request id when the operation is over.
pub(crate) struct Registration {
    inner: Arc<Inner>,
    id: u32,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let route = self.inner.routes.lock().remove(&self.id);
        // A stdin writer outliving its exec must not wait for acknowledgements forever.
        if let Some(w) = route.and_then(|r| r.window) {
            w.close();
        }
    }
}

impl Inner {
    fn send(&self, id: u32, msg: &HostMsg) -> Result<()> {
        if self.routes.closed.load(Ordering::SeqCst) {
            return Err(Error::AgentDisconnected);
        }
        let frame = proto::encode_host(id, msg).map_err(|e| Error::AgentProtocol(e.to_string()))?;
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        w.write_all(&frame).map_err(|e| {
            tracing::debug!("agent send: {e}");
            Error::AgentDisconnected
        })
    }

    /// Registers a new id, then sends `msg` under it.
    fn start(
        self: &Arc<Self>,
        msg: &HostMsg,
        window: Option<Arc<Window>>,
    ) -> Result<(Registration, Receiver<AgentMsg>)> {
        let (reg, rx) = self.register(window)?;
        self.send(reg.id, msg)?;
        Ok((reg, rx))
    }

    fn register(
        self: &Arc<Self>,
        window: Option<Arc<Window>>,
    ) -> Result<(Registration, Receiver<AgentMsg>)> {
        let (tx, rx) = mpsc::sync_channel(ROUTE_DEPTH);
        let id = loop {
            // Id 0 is the connection's own (Hello, connection errors).
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                break id;
            }
        };
        self.routes.lock().insert(id, Route { tx, window });
        if self.routes.closed.load(Ordering::SeqCst) {
            self.routes.lock().remove(&id);
            return Err(Error::AgentDisconnected);
        }
        Ok((
            Registration {
                inner: self.clone(),
                id,
            },
            rx,
        ))
    }
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

/// A raw stream to the agent at `path`: the [`Transport`] is set up (the vsock `CONNECT`
/// handshake done) but the protocol has not started (no `Hello` sent), retrying for up to
/// `timeout` like [`Client::connect_timeout`]. Read and write timeouts are set to 10 s.
///
/// For protocol checks and debugging tools that write frames of their own, malformed ones
/// included (`clade ping --garbage-frame`); everything else uses a [`Client`].
pub fn connect_raw(
    path: impl AsRef<Path>,
    transport: Transport,
    timeout: Duration,
) -> Result<UnixStream> {
    let path = path.as_ref();
    transport::retry(timeout, || transport::open(path, transport, &[]))
}

/// Connects to the agent at `path`, has it answer a Hello and a Ping (sent together, as
/// [`Client::connect_and_ping`] does), and closes, retrying for up to `timeout` like it:
/// whether a guest is ready, without a [`Client`] and so without the connection's reader
/// thread (starting and ending a thread maps and unmaps its stack, which in a process that
/// holds many VMs interrupts each of them: a probe of 100 fork children at once is where
/// that shows).
pub fn probe(path: impl AsRef<Path>, transport: Transport, timeout: Duration) -> Result<Pong> {
    let path = path.as_ref();
    let first = opening(true)?;
    transport::retry(timeout, || {
        let t0 = Instant::now();
        let mut stream = transport::open(path, transport, &first)?;
        let (_, _, pong) = read_handshake_replies(&mut stream, Some(t0))?;
        pong.ok_or_else(|| Error::AgentProtocol("no answer to the ping".into()))
    })
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
    /// Connects to `path` ([`Transport::Auto`]: a VMM vsock socket, port 52, or a direct
    /// agent socket).
    pub fn connect(path: impl AsRef<Path>) -> Result<Self> {
        Self::connect_with(path, Transport::Auto)
    }

    /// Connects with an explicit transport.
    pub fn connect_with(path: impl AsRef<Path>, transport: Transport) -> Result<Self> {
        Self::connect_once(path.as_ref(), transport, &mut None, false).map(|(c, _)| c)
    }

    /// Like [`Client::connect_with`], retrying for up to `timeout` while the socket is
    /// missing or refuses, or nothing listens on the guest port yet (a VM still booting).
    pub fn connect_timeout(
        path: impl AsRef<Path>,
        transport: Transport,
        timeout: Duration,
    ) -> Result<Self> {
        let path = path.as_ref();
        // One reader thread waits through all the attempts.
        let mut reader = None;
        transport::retry(timeout, || {
            Self::connect_once(path, transport, &mut reader, false).map(|(c, _)| c)
        })
    }

    /// Like [`Client::connect_timeout`], and the agent answered a ping: what waiting for a
    /// sandbox to be ready is. The Ping goes out behind the Hello, in the opening's write
    /// (the agent answers a connection's requests in order, and one that arrives before
    /// the handshake is done is refused, so it cannot overtake the Hello): the guest
    /// answers both at one wake-up instead of a round trip each. The Pong's `rtt` counts
    /// from the opening.
    pub fn connect_and_ping(
        path: impl AsRef<Path>,
        transport: Transport,
        timeout: Duration,
    ) -> Result<(Self, Pong)> {
        let path = path.as_ref();
        let mut reader = None;
        transport::retry(timeout, || {
            let (c, pong) = Self::connect_once(path, transport, &mut reader, true)?;
            let pong = pong.ok_or_else(|| Error::AgentProtocol("no answer to the ping".into()))?;
            Ok((c, pong))
        })
    }

    /// One attempt to connect (and, with `ping`, to ping behind the Hello). The
    /// connection's reader thread is started first (or the one a failed attempt left in
    /// `reader` is used): starting a thread costs ~20-35 us here, which then overlaps the
    /// wait for the agent's answer instead of delaying the first call. It is taken from
    /// `reader` only when the connection is made.
    fn connect_once(
        path: &Path,
        transport: Transport,
        reader: &mut Option<PendingReader>,
        ping: bool,
    ) -> Result<(Self, Option<Pong>)> {
        if reader.is_none() {
            *reader = Some(PendingReader::start()?);
        }
        let first = opening(ping)?;
        let t0 = Instant::now();
        let stream = transport::open(path, transport, &first)?;
        Self::handshake(path, stream, reader, ping.then_some(t0))
    }

    /// Finishes a connection whose Hello ([`hello_frame`]) went out with the transport's
    /// opening (followed by a Ping with id [`FIRST_PING_ID`], sent at `ping_sent`): reads
    /// the agent's answers, then hands the stream to the reader thread taken from `reader`
    /// (left there if the handshake fails; one is started if there is none).
    fn handshake(
        path: &Path,
        mut stream: UnixStream,
        reader: &mut Option<PendingReader>,
        ping_sent: Option<Instant>,
    ) -> Result<(Self, Option<Pong>)> {
        let io_err = |e: std::io::Error| Error::AgentConnect {
            path: path.to_path_buf(),
            source: e,
        };
        let (version, agent_version, pong) = read_handshake_replies(&mut stream, ping_sent)?;
        stream.set_read_timeout(None).map_err(io_err)?;
        stream.set_write_timeout(None).map_err(io_err)?;
        let stream_reader = stream.try_clone().map_err(io_err)?;
        let writer = stream.try_clone().map_err(io_err)?;
        let routes = Arc::new(Routes {
            map: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        });
        let pending = match reader.take() {
            Some(p) => p,
            None => PendingReader::start()?,
        };
        pending.run(stream_reader, routes.clone())?;
        tracing::debug!(
            "{}: agent {agent_version}, protocol {version}",
            path.display()
        );
        let client = Client {
            inner: Arc::new(Inner {
                sock: stream,
                writer: Mutex::new(writer),
                routes,
                next_id: AtomicU32::new(FIRST_PING_ID + 1),
                agent_version,
                protocol: version,
            }),
        };
        Ok((client, pong))
    }

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

    /// Reads a whole file into memory (at most [`MAX_READ_FILE`] bytes).
    pub fn read_file(&self, path: impl AsRef<Path>) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.read_file_limited(path.as_ref(), &mut out, MAX_READ_FILE)?;
        Ok(out)
    }

    /// Streams a file into `w`; returns its size.
    pub fn read_file_to(&self, path: impl AsRef<Path>, w: &mut dyn Write) -> Result<u64> {
        self.read_file_limited(path.as_ref(), w, u64::MAX)
    }

    fn read_file_limited(&self, path: &Path, w: &mut dyn Write, limit: u64) -> Result<u64> {
        let (_reg, rx) = self.inner.start(
            &HostMsg::ReadFile {
                path: path.to_path_buf(),
            },
            None,
        )?;
        let mut total: u64 = 0;
        loop {
            match check(recv(&rx)?)? {
                AgentMsg::FileData(d) => {
                    total += d.len() as u64;
                    if total > limit {
                        return Err(Error::AgentProtocol(format!(
                            "{}: larger than {limit} bytes",
                            path.display()
                        )));
                    }
                    w.write_all(&d).map_err(|e| Error::Io {
                        context: "write downloaded file data",
                        source: e,
                    })?;
                }
                AgentMsg::FileDone { bytes } if bytes == total => return Ok(total),
                AgentMsg::FileDone { bytes } => {
                    return Err(Error::AgentProtocol(format!(
                        "{}: agent reports {bytes} bytes but sent {total}",
                        path.display()
                    )))
                }
                m => return Err(unexpected("read_file", &m)),
            }
        }
    }

    /// Creates or replaces `path` with `data`, permission bits `mode`.
    pub fn write_file(&self, path: impl AsRef<Path>, mode: u32, data: &[u8]) -> Result<u64> {
        let mut r = data;
        self.write_file_from(path, mode, &mut r)
    }

    /// Creates or replaces `path` with everything `r` yields (streamed in chunks).
    pub fn write_file_from(
        &self,
        path: impl AsRef<Path>,
        mode: u32,
        r: &mut dyn Read,
    ) -> Result<u64> {
        let (reg, rx) = self.inner.start(
            &HostMsg::WriteFile {
                path: path.as_ref().to_path_buf(),
                mode,
            },
            None,
        )?;
        match check(recv(&rx)?)? {
            AgentMsg::Ok => {}
            m => return Err(unexpected("write_file", &m)),
        }
        let mut buf = vec![0u8; CHUNK_LEN];
        let mut sent: u64 = 0;
        loop {
            // A write error in the guest arrives early: stop sending.
            if let Ok(m) = rx.try_recv() {
                let _ = self.inner.send(reg.id, &HostMsg::FileEnd);
                check(m)?;
                return Err(Error::AgentProtocol(
                    "unexpected reply during upload".into(),
                ));
            }
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Finish the upload so the agent frees it; report the local error.
                    let _ = self.inner.send(reg.id, &HostMsg::FileEnd);
                    return Err(Error::Io {
                        context: "read the data to upload",
                        source: e,
                    });
                }
            };
            self.inner
                .send(reg.id, &HostMsg::FileData(buf[..n].to_vec()))?;
            sent += n as u64;
        }
        self.inner.send(reg.id, &HostMsg::FileEnd)?;
        match check(recv(&rx)?)? {
            AgentMsg::FileDone { bytes } if bytes == sent => Ok(bytes),
            AgentMsg::FileDone { bytes } => Err(Error::AgentProtocol(format!(
                "agent wrote {bytes} bytes of {sent}"
            ))),
            m => Err(unexpected("write_file", &m)),
        }
    }

    /// Metadata of `path`, following symlinks.
    pub fn stat(&self, path: impl AsRef<Path>) -> Result<FileStat> {
        self.stat_impl(path.as_ref(), true)
    }

    /// Metadata of `path` itself (a symlink is reported as one).
    pub fn lstat(&self, path: impl AsRef<Path>) -> Result<FileStat> {
        self.stat_impl(path.as_ref(), false)
    }

    fn stat_impl(&self, path: &Path, follow_symlinks: bool) -> Result<FileStat> {
        match self.call(&HostMsg::Stat {
            path: path.to_path_buf(),
            follow_symlinks,
        })? {
            AgentMsg::Stat(s) => Ok(s),
            m => Err(unexpected("stat", &m)),
        }
    }

    /// Directory entries of `path`, sorted by name (symlinks not followed).
    pub fn list(&self, path: impl AsRef<Path>) -> Result<Vec<DirEntry>> {
        let (_reg, rx) = self.inner.start(
            &HostMsg::List {
                path: path.as_ref().to_path_buf(),
            },
            None,
        )?;
        let mut all = Vec::new();
        loop {
            match check(recv(&rx)?)? {
                AgentMsg::DirEntries(mut e) => {
                    if all.len() + e.len() > MAX_LIST_ENTRIES {
                        return Err(Error::AgentProtocol(format!(
                            "more than {MAX_LIST_ENTRIES} directory entries"
                        )));
                    }
                    all.append(&mut e);
                }
                AgentMsg::Ok => return Ok(all),
                m => return Err(unexpected("list", &m)),
            }
        }
    }

    /// Removes a file, symlink or empty directory; with `recursive`, a whole tree.
    pub fn remove(&self, path: impl AsRef<Path>, recursive: bool) -> Result<()> {
        self.call_ok(
            "remove",
            &HostMsg::Remove {
                path: path.as_ref().to_path_buf(),
                recursive,
            },
        )
    }

    /// Creates directory `path` with permission bits `mode`; with `parents`, its missing
    /// parents too, and an existing directory at `path` is not an error.
    pub fn make_dir(&self, path: impl AsRef<Path>, mode: u32, parents: bool) -> Result<()> {
        self.call_ok(
            "make_dir",
            &HostMsg::MakeDir {
                path: path.as_ref().to_path_buf(),
                mode,
                parents,
            },
        )
    }

    /// From now on, file operations on this connection run with `uid`'s filesystem
    /// credentials (`gid`, `groups`): the guest's kernel checks that user's permissions and
    /// what is created is theirs. The connection can then run no processes.
    pub fn as_user(&self, uid: u32, gid: u32, groups: &[u32]) -> Result<()> {
        self.call_ok(
            "as_user",
            &HostMsg::AsUser {
                uid,
                gid,
                groups: groups.to_vec(),
            },
        )
    }

    /// What the symbolic link `path` points to (readlink(2): as written in the link).
    pub fn read_link(&self, path: impl AsRef<Path>) -> Result<std::path::PathBuf> {
        match self.call(&HostMsg::ReadLink {
            path: path.as_ref().to_path_buf(),
        })? {
            AgentMsg::LinkTarget { target } => Ok(target),
            m => Err(unexpected("read_link", &m)),
        }
    }

    /// The extended attributes under `prefix` (a `user.` prefix) of each of `paths`, one
    /// list of (name, value) per path, in order (empty where none can be read). An agent
    /// older than the operation answers `Error(UnknownMessage)`.
    pub fn get_xattrs(
        &self,
        paths: &[std::path::PathBuf],
        prefix: &str,
    ) -> Result<Vec<guest_agent::proto::XattrList>> {
        match self.call(&HostMsg::GetXattrs {
            paths: paths.to_vec(),
            prefix: prefix.to_string(),
        })? {
            AgentMsg::Xattrs(lists) if lists.len() == paths.len() => Ok(lists),
            m => Err(unexpected("get_xattrs", &m)),
        }
    }

    /// Makes the extended attributes under `prefix` of `path` exactly `set` (full names).
    pub fn set_xattrs(
        &self,
        path: impl AsRef<Path>,
        prefix: &str,
        set: Vec<(String, Vec<u8>)>,
    ) -> Result<()> {
        self.call_ok(
            "set_xattrs",
            &HostMsg::SetXattrs {
                path: path.as_ref().to_path_buf(),
                prefix: prefix.to_string(),
                set,
            },
        )
    }

    /// Renames `from` to `to` (rename(2): same filesystem, replaces a file at `to`).
    pub fn rename(&self, from: impl AsRef<Path>, to: impl AsRef<Path>) -> Result<()> {
        self.call_ok(
            "rename",
            &HostMsg::Rename {
                from: from.as_ref().to_path_buf(),
                to: to.as_ref().to_path_buf(),
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

/// The id of the Ping [`Client::connect_and_ping`] sends behind the Hello (id 0); the
/// connection's own requests are numbered after it.
const FIRST_PING_ID: u32 = 1;

/// The answer to a Ping sent at `t0`.
fn pong_from(msg: AgentMsg, t0: Instant) -> Result<Pong> {
    match msg {
        AgentMsg::Pong {
            agent_version,
            protocol,
            uptime_ms,
            running_execs,
        } => Ok(Pong {
            agent_version,
            protocol,
            uptime: Duration::from_millis(uptime_ms),
            running_execs,
            rtt: t0.elapsed(),
        }),
        m => Err(unexpected("ping", &m)),
    }
}

/// Reads one answer during the handshake (to the `what` request). A connection reset
/// before it is a connection closed before it (the VMM closes a connection the guest
/// dropped, our Hello still unread: a resumed guest's transport reset drops connections
/// made just before it took effect); both are [`Error::AgentDisconnected`], which a
/// connect retries.
fn read_handshake_frame(stream: &mut UnixStream, what: &str) -> Result<Vec<u8>> {
    proto::read_frame(stream, MAX_FRAME_LEN)
        .map_err(|e| match e {
            guest_agent::Error::Io(io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ) =>
            {
                Error::AgentDisconnected
            }
            e => Error::AgentProtocol(format!("{what}: {e}")),
        })?
        .ok_or(Error::AgentDisconnected)
}

/// Reads the agent's answers to a Hello ([`hello_frame`]) and, when `ping_sent` is set, to
/// the Ping with id [`FIRST_PING_ID`] sent behind it: the protocol version, the agent's
/// version and the Pong.
fn read_handshake_replies(
    stream: &mut UnixStream,
    ping_sent: Option<Instant>,
) -> Result<(u16, String, Option<Pong>)> {
    let reply = read_handshake_frame(stream, "hello")?;
    let f = proto::decode_frame(&reply).map_err(|e| Error::AgentProtocol(format!("hello: {e}")))?;
    let (version, agent_version) = match f.msg {
        Msg::Agent(AgentMsg::HelloOk {
            version,
            agent_version,
            ..
        }) if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) => {
            (version, agent_version)
        }
        Msg::Agent(AgentMsg::Error(e)) => return Err(Error::Agent(e)),
        other => {
            return Err(Error::AgentProtocol(format!(
                "unexpected answer to Hello: {other:?}"
            )))
        }
    };
    let pong = match ping_sent {
        None => None,
        Some(t0) => {
            let reply = read_handshake_frame(stream, "ping")?;
            let f = proto::decode_frame(&reply)
                .map_err(|e| Error::AgentProtocol(format!("ping: {e}")))?;
            match f.msg {
                Msg::Agent(m) if f.id == FIRST_PING_ID => Some(pong_from(check(m)?, t0)?),
                other => {
                    return Err(Error::AgentProtocol(format!(
                        "unexpected answer to the first ping (id {}): {other:?}",
                        f.id
                    )))
                }
            }
        }
    };
    Ok((version, agent_version, pong))
}

/// What a connection opens with: the Hello ([`hello_frame`]), and with `ping` a Ping with
/// id [`FIRST_PING_ID`] behind it.
fn opening(ping: bool) -> Result<Vec<u8>> {
    let mut first = hello_frame()?;
    if ping {
        first.extend(
            proto::encode_host(FIRST_PING_ID, &HostMsg::Ping)
                .map_err(|e| Error::AgentProtocol(e.to_string()))?,
        );
    }
    Ok(first)
}

/// The protocol's first frame: Hello, with the versions this client speaks.
fn hello_frame() -> Result<Vec<u8>> {
    let hello = HostMsg::Hello {
        min_version: MIN_PROTOCOL_VERSION,
        max_version: PROTOCOL_VERSION,
        client: format!("clade {}", env!("CARGO_PKG_VERSION")),
    };
    proto::encode_host(0, &hello).map_err(|e| Error::AgentProtocol(e.to_string()))
}

/// A connection's reader thread, started before the connection is made; it runs
/// [`read_loop`] once handed the stream, and ends if dropped before that.
struct PendingReader(SyncSender<(UnixStream, Arc<Routes>)>);

impl PendingReader {
    fn start() -> Result<PendingReader> {
        let (tx, rx) = mpsc::sync_channel::<(UnixStream, Arc<Routes>)>(1);
        std::thread::Builder::new()
            .name("agent-reader".into())
            // No filter of its own: it inherits its creator's (the agent sync thread's, in a
            // VMM), and installing one costs more than a ping round trip.
            .spawn(move || {
                if let Ok((sock, routes)) = rx.recv() {
                    read_loop(sock, &routes);
                }
            })
            .map_err(|e| Error::Io {
                context: "start the agent reader thread",
                source: e,
            })?;
        Ok(PendingReader(tx))
    }

    /// Starts reading `sock`.
    fn run(self, sock: UnixStream, routes: Arc<Routes>) -> Result<()> {
        // The thread only ends before this if it panicked, which it cannot before `recv`.
        self.0
            .send((sock, routes))
            .map_err(|_| Error::AgentDisconnected)
    }
}

/// Reads frames until the connection ends, routing them by id.
fn read_loop(sock: UnixStream, routes: &Routes) {
    let mut input = BufReader::with_capacity(128 * 1024, sock);
    loop {
        let frame = match proto::read_frame(&mut input, MAX_FRAME_LEN) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!("agent connection: {e}");
                break;
            }
        };
        match proto::decode_frame(&frame) {
            Ok(f) => match f.msg {
                Msg::Agent(m) => routes.deliver(f.id, m),
                Msg::Host(m) => tracing::warn!("agent sent a host message: {m:?}"),
            },
            // Framing is intact (length-checked), so one bad frame need not end the
            // connection: the operation it belongs to fails.
            Err(e) => {
                let id = proto::body_id(&frame[4..]).unwrap_or(0);
                tracing::warn!(id, "undecodable frame from the agent: {e}");
                if id != 0 {
                    let err = RemoteError::new(
                        ErrorKind::BadFrame,
                        format!("undecodable frame from the agent: {e}"),
                    );
                    routes.deliver(id, AgentMsg::Error(err));
                }
            }
        }
    }
    routes.close_all();
}

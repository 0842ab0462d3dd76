//! The machinery under a [`Client`](super::Client): the shared connection ([`Inner`]), the
//! routing table that hands each frame from the agent to the operation waiting for its
//! request id ([`Routes`], [`Registration`]), exec stdin flow control ([`Window`]), and
//! the reader thread that does the routing ([`PendingReader`], [`read_loop`]). The
//! operations themselves (in `mod.rs`, `files.rs`, `exec.rs`, `watch.rs`) only start a
//! request and read its replies.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use guest_agent::proto::{self, AgentMsg, HostMsg, Msg, CHUNK_LEN, MAX_FRAME_LEN};

use super::{ErrorKind, RemoteError};
use crate::error::{Error, Result};

/// Frames buffered per operation before the reader thread waits for the caller.
const ROUTE_DEPTH: usize = 64;

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
    pub(super) fn new() -> Self {
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
    pub(super) fn drained(&self) -> bool {
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
    pub(super) fn reserve(&self, want: usize) -> Option<usize> {
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
    pub(super) map: Mutex<HashMap<u32, Route>>,
    pub(super) closed: AtomicBool,
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
///
/// [`Exec`]: super::Exec
/// [`Client`]: super::Client
pub(crate) struct Inner {
    pub(super) sock: UnixStream,
    pub(super) writer: Mutex<UnixStream>,
    pub(super) routes: Arc<Routes>,
    pub(super) next_id: AtomicU32,
    pub(super) agent_version: String,
    pub(super) protocol: u16,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(Shutdown::Both);
    }
}

/// Unregisters a request id when the operation is over.
pub(crate) struct Registration {
    inner: Arc<Inner>,
    pub(super) id: u32,
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
    pub(super) fn send(&self, id: u32, msg: &HostMsg) -> Result<()> {
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
    pub(super) fn start(
        self: &Arc<Self>,
        msg: &HostMsg,
        window: Option<Arc<Window>>,
    ) -> Result<(Registration, Receiver<AgentMsg>)> {
        let (reg, rx) = self.register(window)?;
        self.send(reg.id, msg)?;
        Ok((reg, rx))
    }

    pub(super) fn register(
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

/// A connection's reader thread, started before the connection is made; it runs
/// [`read_loop`] once handed the stream, and ends if dropped before that.
pub(super) struct PendingReader(SyncSender<(UnixStream, Arc<Routes>)>);

impl PendingReader {
    pub(super) fn start() -> Result<PendingReader> {
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
    pub(super) fn run(self, sock: UnixStream, routes: Arc<Routes>) -> Result<()> {
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

//! The API server thread ([`ApiServer`], [`ServerAhead`]): it accepts connections, serves
//! each from a connection thread of its own (a spare one started ahead, so a new
//! connection does not wait for a thread's start) and hands every request to the VM's
//! owner, which answers it.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::connection::{
    next_request, write_response, LineReader, NextRequest, PendingRequest, Reply,
};
use super::listener::{peer_allowed, wait_readable, BoundPath};
use super::{io_err, ApiListener, PeerCheck, Response, IDLE_TIMEOUT, MAX_CONNECTIONS};
use crate::error::Result;

/// An [`ApiServer`]'s thread started before its socket is handed to it
/// ([`ApiListener::serve_on`]): confined to its system-call filter, its first connection
/// thread started, waiting. A standby process starts one while it waits for its restore
/// request, so that the restore's answer is not followed by a thread start, its filter's
/// installation and a connection thread's start (~0.25 ms of CPU in a scheduler trace of a
/// create, competing with the restored guest's first run and with the service's answer on
/// a 2-CPU host). Dropped unused, the thread ends.
pub struct ServerAhead {
    pub(super) handoff: mpsc::SyncSender<(UnixListener, PeerCheck)>,
    pub(super) requests: Receiver<PendingRequest>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) thread: JoinHandle<()>,
}

impl ServerAhead {
    /// Starts the thread. It runs at normal priority whatever its starter's (a standby
    /// waits at idle priority; a server must not).
    pub fn start() -> Result<ServerAhead> {
        let (tx, requests) = mpsc::channel();
        let (handoff, socket) = mpsc::sync_channel::<(UnixListener, PeerCheck)>(1);
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                crate::vstate::spare::run_at_normal_priority();
                // Connection threads inherit this thread's filters.
                crate::seccomp::confine_current_thread(crate::seccomp::ThreadKind::Api);
                let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let spare = spare_connection_thread(&tx, &live);
                if let Ok((listener, peers)) = socket.recv() {
                    accept_loop(listener, tx, &stop2, peers, live, spare);
                }
            })
            .map_err(io_err("spawning the API thread"))?;
        Ok(ServerAhead {
            handoff,
            requests,
            stop,
            thread,
        })
    }
}

/// Listens on the API socket from a thread of its own and hands requests to the VM owner.
///
/// Bounded: at most [`MAX_CONNECTIONS`] connections at once, [`MAX_REQUEST`] bytes a line,
/// [`IDLE_TIMEOUT`] of silence. The socket is bound as by [`ApiListener::bind`] and removed
/// when the server is dropped only if the path still names the socket bound there.
///
/// [`MAX_REQUEST`]: super::MAX_REQUEST
pub struct ApiServer {
    // Dropped after the thread is joined (see `Drop`): the file goes last.
    pub(super) bound: BoundPath,
    pub(super) requests: Receiver<PendingRequest>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Binds `path` with [`PeerCheck::SameUser`] and serves it ([`ApiListener::bind`]).
    pub fn bind(path: &Path) -> Result<Self> {
        ApiListener::bind(path)?.serve()
    }

    /// Binds `path`, serving only peers that pass `peers`.
    pub fn bind_with(path: &Path, peers: PeerCheck) -> Result<Self> {
        ApiListener::bind_with(path, peers)?.serve()
    }

    /// The next request, if one arrives within `timeout`.
    pub fn next_request(&self, timeout: Duration) -> Option<PendingRequest> {
        self.requests.recv_timeout(timeout).ok()
    }

    /// Socket path.
    pub fn path(&self) -> &Path {
        &self.bound.path
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop from its wait at once (only through our own socket).
        if self.bound.still_ours() {
            let _ = UnixStream::connect(&self.bound.path);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Accepts connections until `stop`, each served by a connection thread of its own (at most
/// [`MAX_CONNECTIONS`] at once, counted in `live`). `spare`: a connection thread started
/// ahead, waiting for its connection, so that a new connection is served at once, not after
/// a thread's start (100-200 us here, on the path of every request of a service that
/// connects per request, such as a standby's restore).
fn accept_loop(
    listener: UnixListener,
    tx: Sender<PendingRequest>,
    stop: &AtomicBool,
    peers: PeerCheck,
    live: Arc<std::sync::atomic::AtomicUsize>,
    mut spare: Option<Sender<UnixStream>>,
) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((mut stream, _)) => {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                if !peer_allowed(&stream, peers) {
                    tracing::warn!("API connection refused: peer uid not allowed");
                    let _ = write_response(&mut stream, &Response::err("permission denied"));
                    continue;
                }
                if live.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
                    let _ = stream.set_nonblocking(false);
                    let _ = write_response(
                        &mut stream,
                        &Response::err(format!("too many connections (at most {MAX_CONNECTIONS})")),
                    );
                    continue;
                }
                live.fetch_add(1, Ordering::SeqCst);
                // The spare takes it (and counts it down when done); without one, or if it
                // is gone, one started now. With no thread at all the connection is dropped.
                let give = |to: Option<Sender<UnixStream>>, stream| match to {
                    Some(t) => t.send(stream).map_err(|mpsc::SendError(s)| s),
                    None => Err(stream),
                };
                let unserved = give(spare.take(), stream)
                    .or_else(|stream| give(spare_connection_thread(&tx, &live), stream));
                if unserved.is_err() {
                    live.fetch_sub(1, Ordering::SeqCst);
                }
                spare = spare_connection_thread(&tx, &live);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_readable(&listener, STOP_CHECK)
            }
            Err(e) => {
                tracing::warn!("API accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Starts a connection thread that waits for the connection sent to it, serves it and
/// counts it off `live` (the accept loop counted it on); it ends unused when the sender is
/// dropped. `None` if no thread could be started.
fn spare_connection_thread(
    tx: &Sender<PendingRequest>,
    live: &Arc<std::sync::atomic::AtomicUsize>,
) -> Option<Sender<UnixStream>> {
    let (give, take) = mpsc::channel::<UnixStream>();
    let tx = tx.clone();
    let live = Arc::clone(live);
    std::thread::Builder::new()
        .name("api-conn".into())
        .spawn(move || {
            if let Ok(stream) = take.recv() {
                serve_connection(stream, tx);
                live.fetch_sub(1, Ordering::SeqCst);
            }
        })
        .ok()
        .map(|_| give)
}

/// How often the accept loop looks at its stop flag while no connection comes.
const STOP_CHECK: Duration = Duration::from_millis(50);

fn serve_connection(stream: UnixStream, tx: Sender<PendingRequest>) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(IDLE_TIMEOUT));
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = LineReader::new(stream);
    loop {
        let response = match next_request(&mut reader) {
            NextRequest::End => return,
            NextRequest::Fatal(answer) => {
                let _ = write_response(&mut writer, &answer);
                return;
            }
            NextRequest::Bad(answer) => answer,
            NextRequest::Request(request, fds) => {
                let (reply, answer) = mpsc::channel();
                if tx
                    .send(PendingRequest {
                        request,
                        fds,
                        reply: Reply::Thread(reply),
                    })
                    .is_err()
                {
                    Response::err("the VM is gone")
                } else {
                    answer
                        .recv()
                        .unwrap_or_else(|_| Response::err("the VM is gone"))
                }
            }
        };
        if write_response(&mut writer, &response).is_err() {
            return;
        }
    }
}

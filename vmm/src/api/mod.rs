//! The control API of a running VM: newline-delimited JSON over a Unix socket.
//!
//! `clade run --api-sock PATH` and `clade restore DIR --api-sock PATH` serve it (through
//! the host layer's owner loop). The socket exists while the VM runs, with mode 0600; a
//! stale socket at the path is replaced, a live one or any other file is refused, and only
//! the socket this server bound is removed when the process ends. Peers must run as the
//! VMM's user or root (`SO_PEERCRED`, [`PeerCheck`]). Up to 32 connections at once (one more
//! gets an error line and is closed), each a sequence of one request line and one response
//! line, closed after 60 s of silence. Requests are executed one at a time, in arrival
//! order, by the process that owns the VM.
//! A standby process (`clade restore --standby`), before it holds a VM, serves its socket
//! on its own main thread ([`ApiListener::next_request`]): one request per connection, its
//! line read within 2 s.
//!
//! Every response is an object with `"ok"`: `true` plus result fields, or `false` plus
//! `"error"` (one line naming the problem). A line that is not a request gets
//! `{"ok":false,"error":"bad request: ..."}` and the connection stays usable; a line over
//! 64 KiB is answered with an error and the connection closed. A fork makes 1 to 128
//! children.
//!
//! | request | result fields |
//! |---|---|
//! | `{"op":"status"}` | `state` (`"running"`, `"paused"`), `vcpus`, `mem_mib`, `pvm_native`; `last_snapshot` `{id, dir}` once the VM took or was restored from one (the base of its next diff); `restored` `{backend, kind, us}` for a restored VM |
//! | `{"op":"pause"}` | `state`: the vCPUs stop (devices keep running) |
//! | `{"op":"unpause"}` | `state`: paused vCPUs run again (`"resume"` is accepted as an alias) |
//! | `{"op":"shutdown"}` | `state: "ended"`; then the VM stops and the process exits 0 |
//! | `{"op":"snapshot","dir":"/abs/dir","kind":"full"}` | `id`, `kind`, `dir` (absolute), `pause_us` (how long the vCPUs were stopped), `total_us`, `pages_written`, `pages_considered` |
//! | `{"op":"freeze_disk"}` | `layer` (absolute): the disk's top layer, frozen as it is at this instant (the vCPUs stopped for it, then run again if they ran); the VM continues on a new overlay on it, `top` |
//! | `{"op":"fork","count":3,"prefix":"/abs/dir","agent_sync":true,"nets":["tap=tap0,netns=/run/netns/a",...]}` (`nets`: one TAP per child, only for a VM with a network device) | `pause_us`, `children`: one `{pid, api_sock, vsock, cid, serial, log, disk}` per child (`vsock`, `cid`, `disk` null when the VM has none; `pid` as the VMM sees it: in a jail, the jail's PID namespace) |
//! | `{"op":"restore","snapshot":"/abs/snap","vsock":"/abs/vm.vsock",...}` | standby processes only (`clade restore --standby`): the fields of [`RestoreRequest`]; the answer is the `status` of the restored VM. A second restore, or one in a process that already runs a VM, is refused |
//! | `{"op":"preload","snapshot":"/abs/snap"}` | standby processes only: `preloaded`, the snapshots it holds open ahead (its `--preload` one and the last ones asked for) |
//!
//! `fork`: the VM pauses for a moment, its memory is frozen (shared copy-on-write) and each
//! child becomes its own `clade` process (its own API socket and vsock socket, named
//! `<prefix>/<api socket stem>-f<k>.{api,vsock}`, serial console and log next to them).
//! Children outlive the parent. If one child fails to start, the ones started are killed,
//! their files removed, and the parent runs on. A VM with a disk forks its disk too: its
//! overlay is frozen, it continues on a new one and each child gets its own.
//!
//! `snapshot`: `kind` is `"full"` (default) or `"diff"` (only pages written since the
//! VM's last snapshot, or since the snapshot it was restored from; that snapshot's directory
//! must stay where it is, and the diff must go to another directory). `dir` is created if
//! needed; it must be absolute, without `..`, and under the owner's files root when one is
//! configured (`--files-root`); so must a fork's `prefix`. A snapshot of a running VM leaves it running, of a
//! paused one paused. Errors: the VM is not running or paused, a diff without a base, I/O.
//!
//! ```text
//! -> {"op":"status"}
//! <- {"ok":true,"state":"running","vcpus":1,"mem_mib":256,"pvm_native":true,"fork_children_waiting":0,"spare_shell":true}
//! -> {"op":"snapshot","dir":"/var/lib/clade/s1"}
//! <- {"ok":true,"id":"6f0c...","kind":"full","dir":"/var/lib/clade/s1","pause_us":5210,...}
//! -> {"op":"pause"}
//! <- {"ok":true,"state":"paused"}
//! -> {"op":"pause"}
//! <- {"ok":false,"error":"VM is paused: cannot pause"}
//! ```
//!
//! The server only carries requests ([`ApiServer`]); the VM's owner (the host layer's owner
//! loop, in `clade run` / `clade restore`) executes them, so the VM itself is never shared
//! between threads. [`ApiClient`] is the client `clade snapshot` uses.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Size of `sun_path`: a Unix socket path is at most this many bytes minus one.
const MAX_SOCKET_PATH: usize = 108;
/// Longest request line accepted; longer lines are answered with an error and the
/// connection is closed.
pub const MAX_REQUEST: usize = 64 * 1024;
/// Most descriptors one request may carry (`SCM_RIGHTS`); a request with more is refused.
pub const MAX_REQUEST_FDS: usize = 4;
/// Most connections served at once; one more is answered with an error and closed.
pub const MAX_CONNECTIONS: usize = 32;
/// A connection that sends nothing for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long an [`ApiClient`] waits for the answer to a request that does no work that
/// grows with the VM (status, pause, unpause, shutdown).
pub const QUICK_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an [`ApiClient`] waits for the answer to a snapshot, fork, restore or preload:
/// work that grows with the VM's memory, its children and the disk's speed.
pub const WORK_ANSWER_TIMEOUT: Duration = Duration::from_secs(600);

/// A control request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The VM's state.
    Status,
    /// Pause all vCPUs.
    Pause,
    /// Let paused vCPUs run again (`"resume"` is accepted too, the op's earlier name).
    #[serde(alias = "resume")]
    Unpause,
    /// Stop the VM.
    Shutdown,
    /// Write a snapshot into `dir`.
    Snapshot {
        /// Target directory.
        dir: PathBuf,
        /// "full" or "diff".
        #[serde(default = "default_kind")]
        kind: String,
    },
    /// Freeze the disk's top layer as it is now and let the VM continue on a new overlay
    /// on it (a build's step made a layer; the guest should have synced first).
    FreezeDisk,
    /// Fork the VM into `count` child VM processes (see `clade fork`).
    Fork {
        /// Number of children.
        count: usize,
        /// Directory for the children's sockets and logs (default: the API socket's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prefix: Option<PathBuf>,
        /// Give each child's guest agent the time, entropy and a hostname suffix.
        #[serde(default = "default_true")]
        agent_sync: bool,
        /// Each child's TAP, as `--net` takes it (`tap=NAME[,netns=PATH]`): one per child,
        /// required when the VM has a network device.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        nets: Vec<String>,
    },
    /// Restore a snapshot into this process's pre-built VM shell (a standby process only,
    /// once; see [`crate::host::standby`]).
    Restore(RestoreRequest),
    /// Open a snapshot ahead, so that a later `restore` of it skips that part (a standby
    /// process only; see [`crate::host::standby`]).
    Preload {
        /// The snapshot directory (absolute, no `..`).
        snapshot: PathBuf,
    },
}

impl Request {
    /// How long a client waits for this request's answer: a VM process that has not
    /// answered by then is taken as wedged (its caller ends it) rather than waited on
    /// forever.
    pub fn answer_timeout(&self) -> Duration {
        match self {
            Request::Status
            | Request::Pause
            | Request::Unpause
            | Request::Shutdown
            | Request::FreezeDisk => QUICK_ANSWER_TIMEOUT,
            Request::Snapshot { .. }
            | Request::Fork { .. }
            | Request::Restore(_)
            | Request::Preload { .. } => WORK_ANSWER_TIMEOUT,
        }
    }
}

/// What a VM is restored from and where its files go: the options of `clade restore`, as
/// one value, so that the command line and a standby process's `restore` request restore
/// through the same code ([`crate::host::restore_request`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreRequest {
    /// The snapshot directory.
    pub snapshot: PathBuf,
    /// How guest memory is restored: "uffd" (default), "file" or "copy".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The vsock device's Unix socket (default: the snapshot's, which must be free).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<PathBuf>,
    /// Where the serial console goes (default: standard output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_file: Option<PathBuf>,
    /// A snapshot with a disk: the VM's own overlay on the snapshot's frozen layer (must
    /// not exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_overlay: Option<PathBuf>,
    /// The VMM's log (its standard error) from the restore on, appended (standby only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
    /// Give the guest agent the time and fresh entropy after the restore.
    #[serde(default = "default_true")]
    pub agent_sync: bool,
    /// How long the agent sync may take, in milliseconds (default 5000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_sync_timeout_ms: Option<u64>,
    /// `uffd`: record and prefetch a working set.
    #[serde(default = "default_true")]
    pub working_set: bool,
    /// `uffd`, when the snapshot has no working set yet: where the one recorded is written,
    /// instead of the snapshot's directory (which a jailed VM may not write); its service
    /// installs it there. Under the files root, like the other files the VM makes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_set_to: Option<PathBuf>,
    /// The virtio-net device's TAP, as `--net` takes it (`tap=NAME[,mac=MAC]` or
    /// `fd=N[,mac=MAC]`); required when the snapshot has a network device, unless
    /// `tap_passed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<String>,
    /// The TAP is the descriptor sent with this request (`SCM_RIGHTS`, API requests only;
    /// `net` then unset): a host service opens its networks' TAPs ahead, so a restore
    /// does not attach to one on its path.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tap_passed: bool,
}

impl RestoreRequest {
    /// A request for `snapshot` with every other option at its default.
    pub fn new(snapshot: PathBuf) -> Self {
        RestoreRequest {
            snapshot,
            backend: None,
            vsock: None,
            serial_file: None,
            disk_overlay: None,
            log: None,
            agent_sync: true,
            agent_sync_timeout_ms: None,
            working_set: true,
            working_set_to: None,
            net: None,
            tap_passed: false,
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_kind() -> String {
    "full".into()
}

/// A response: `ok` plus either result fields or an error message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// Whether the request succeeded.
    pub ok: bool,
    /// Error message when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Result fields when `ok` is true.
    #[serde(flatten)]
    pub fields: serde_json::Map<String, serde_json::Value>,
}

impl Response {
    /// A success with these fields.
    pub fn ok(fields: serde_json::Value) -> Self {
        Self {
            ok: true,
            error: None,
            fields: match fields {
                serde_json::Value::Object(m) => m,
                _ => serde_json::Map::new(),
            },
        }
    }

    /// A failure.
    pub fn err(msg: impl ToString) -> Self {
        Self {
            ok: false,
            error: Some(msg.to_string()),
            fields: serde_json::Map::new(),
        }
    }
}

/// A request waiting for the VM owner's answer.
pub struct PendingRequest {
    /// What was asked.
    pub request: Request,
    /// Descriptors that came with the request line (`SCM_RIGHTS`, at most
    /// [`MAX_REQUEST_FDS`]), e.g. a standby's TAP; closed with the request unless taken.
    fds: Vec<OwnedFd>,
    reply: Reply,
}

/// Where a request's answer goes.
enum Reply {
    /// To the connection thread that read it ([`ApiServer`]).
    Thread(Sender<Response>),
    /// Straight onto its connection, which closes then ([`ApiListener::next_request`]).
    Connection(UnixStream),
}

impl PendingRequest {
    /// Takes the descriptors that came with the request.
    pub fn take_fds(&mut self) -> Vec<OwnedFd> {
        std::mem::take(&mut self.fds)
    }

    /// Sends the answer back to the client.
    pub fn respond(self, response: Response) {
        match self.reply {
            Reply::Thread(tx) => {
                let _ = tx.send(response);
            }
            Reply::Connection(mut stream) => {
                let _ = write_response(&mut stream, &response);
            }
        }
    }
}

/// Who may use an API socket, besides its file mode (0600: the socket's owner).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerCheck {
    /// Peers whose uid (`SO_PEERCRED`) is this process's effective uid, or root.
    SameUser,
    /// Only peers with this uid (and root).
    Uid(u32),
    /// Anyone who can open the socket file.
    None,
}

/// The socket file an API socket was bound at, removed when this is dropped if the path
/// still names that socket (another VM may have bound the path since).
struct BoundPath {
    path: PathBuf,
    /// Device and inode of the socket file.
    identity: (u64, u64),
}

impl BoundPath {
    /// Whether the path still names the socket bound there.
    fn still_ours(&self) -> bool {
        file_identity(&self.path).is_ok_and(|id| id == self.identity)
    }
}

impl Drop for BoundPath {
    fn drop(&mut self) {
        if self.still_ours() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A bound API socket, served either on the caller's thread one request at a time
/// ([`ApiListener::next_request`]: a standby process, whose only work is to wait for its
/// restore) or by a server thread ([`ApiListener::serve`]).
///
/// The socket is created with mode 0600, never replaces anything but a stale socket, and is
/// removed when dropped only if the path still names the socket bound here.
pub struct ApiListener {
    bound: BoundPath,
    listener: UnixListener,
    peers: PeerCheck,
}

fn io_err(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

/// Device and inode of `path` itself (not what a symlink points at).
fn file_identity(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// How long [`ApiListener::next_request`] waits for the request line of a connection it
/// accepted (a client sends it as it connects).
pub const DIRECT_READ_TIMEOUT: Duration = Duration::from_secs(2);

impl ApiListener {
    /// Binds `path` with [`PeerCheck::SameUser`]. A stale socket file (nobody listening) is
    /// replaced; a live one, or any other kind of file, is an error.
    pub fn bind(path: &Path) -> Result<Self> {
        Self::bind_with(path, PeerCheck::SameUser)
    }

    /// Binds `path`, accepting only peers that pass `peers`.
    pub fn bind_with(path: &Path, peers: PeerCheck) -> Result<Self> {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                if UnixStream::connect(path).is_ok() {
                    return Err(Error::Config(format!(
                        "API socket {} is in use by another VM",
                        path.display()
                    )));
                }
                std::fs::remove_file(path).map_err(io_err("removing a stale API socket"))?;
            }
            Ok(_) => {
                return Err(Error::Config(format!(
                    "API socket {}: a file that is not a socket is there; not replacing it",
                    path.display()
                )))
            }
            Err(_) => {}
        }
        // Bound under a private name, made 0600, then renamed into place: the socket is
        // never reachable with the umask's mode.
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = PathBuf::from(tmp);
        if tmp.as_os_str().len() >= MAX_SOCKET_PATH {
            return Err(Error::Config(format!(
                "API socket {}: the path (with the {} bytes of its temporary name) is longer \
                 than a Unix socket path may be ({} bytes): choose a shorter one",
                path.display(),
                tmp.as_os_str().len() - path.as_os_str().len(),
                MAX_SOCKET_PATH - 1
            )));
        }
        let _ = std::fs::remove_file(&tmp);
        let listener = UnixListener::bind(&tmp).map_err(io_err("binding the API socket"))?;
        let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
            .and_then(|()| std::fs::rename(&tmp, path))
            .and_then(|()| file_identity(path));
        let identity = match placed {
            Ok(id) => id,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(Error::Io {
                    context: "placing the API socket",
                    source: e,
                });
            }
        };
        let bound = BoundPath {
            path: path.to_path_buf(),
            identity,
        };
        listener
            .set_nonblocking(true)
            .map_err(io_err("configuring the API socket"))?;
        Ok(Self {
            bound,
            listener,
            peers,
        })
    }

    /// Socket path.
    pub fn path(&self) -> &Path {
        &self.bound.path
    }

    /// Moves the socket file to `to` (a rename on the same filesystem: the socket keeps
    /// listening, reached at `to`), which must not exist. For a socket bound ahead of
    /// knowing its path (a fork child waiting for its fork): binding allocates an inode,
    /// a rename does not. On error the socket stays where it was.
    pub fn move_to(&mut self, to: &Path) -> Result<()> {
        use nix::fcntl::{renameat2, RenameFlags};
        if to.as_os_str().len() >= MAX_SOCKET_PATH {
            return Err(Error::Config(format!(
                "API socket {}: longer than a Unix socket path may be",
                to.display()
            )));
        }
        renameat2(
            None,
            &self.bound.path,
            None,
            to,
            RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(|e| Error::Io {
            context: "moving the API socket into place",
            source: e.into(),
        })?;
        self.bound.path = to.to_path_buf();
        Ok(())
    }

    /// The next request, if a connection with one arrives within `timeout`, served on
    /// this thread: accepted, its request line read (within [`DIRECT_READ_TIMEOUT`]) and
    /// parsed here, and [`PendingRequest::respond`] writes the answer on the connection
    /// and closes it: one request per connection. A connection that sends no valid
    /// request gets an error line (as from [`ApiServer`]) and counts as none.
    ///
    /// No hand-off between threads on the way in or out: for a standby process, whose
    /// restore request is on the path of a sandbox's create or wake, that is ~3 thread
    /// wake-ups (~100-200 us on a 2-CPU host) less than the server thread's path.
    pub fn next_request(&self, timeout: Duration) -> Option<PendingRequest> {
        let stream = match self.listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_readable(&self.listener, timeout);
                self.listener.accept().ok()?.0
            }
            Err(e) => {
                tracing::warn!("API accept failed: {e}");
                std::thread::sleep(timeout.min(Duration::from_millis(50)));
                return None;
            }
        };
        let mut writer = stream;
        if !peer_allowed(&writer, self.peers) {
            tracing::warn!("API connection refused: peer uid not allowed");
            let _ = write_response(&mut writer, &Response::err("permission denied"));
            return None;
        }
        let _ = writer.set_nonblocking(false);
        let _ = writer.set_read_timeout(Some(DIRECT_READ_TIMEOUT));
        let mut reader = LineReader::new(writer.try_clone().ok()?);
        match next_request(&mut reader) {
            NextRequest::Request(request, fds) => Some(PendingRequest {
                request,
                fds,
                reply: Reply::Connection(writer),
            }),
            NextRequest::End => None,
            NextRequest::Bad(answer) | NextRequest::Fatal(answer) => {
                let _ = write_response(&mut writer, &answer);
                None
            }
        }
    }

    /// Serves the socket from a thread of its own from now on (see [`ApiServer`]).
    pub fn serve(self) -> Result<ApiServer> {
        self.hand_to(ServerAhead::start()?)
            .map_err(|_| thread_ended())
    }

    /// Serves the socket from `ahead`'s thread, started earlier (see [`ServerAhead`]); from
    /// a thread started now if that one has ended.
    pub fn serve_on(self, ahead: ServerAhead) -> Result<ApiServer> {
        match self.hand_to(ahead) {
            Ok(server) => Ok(server),
            Err(me) => me.serve(),
        }
    }

    /// Gives the socket to `ahead`'s thread; back if that thread has ended (only a panic
    /// ends it early).
    fn hand_to(self, ahead: ServerAhead) -> std::result::Result<ApiServer, Self> {
        let Self {
            bound,
            listener,
            peers,
        } = self;
        let ServerAhead {
            handoff,
            requests,
            stop,
            thread,
        } = ahead;
        match handoff.send((listener, peers)) {
            Ok(()) => Ok(ApiServer {
                bound,
                requests,
                stop,
                thread: Some(thread),
            }),
            Err(mpsc::SendError((listener, peers))) => {
                let _ = thread.join();
                Err(Self {
                    bound,
                    listener,
                    peers,
                })
            }
        }
    }
}

fn thread_ended() -> Error {
    Error::Io {
        context: "handing the API socket to its thread",
        source: std::io::Error::other("the API thread has ended"),
    }
}

/// An [`ApiServer`]'s thread started before its socket is handed to it
/// ([`ApiListener::serve_on`]): confined to its system-call filter, its first connection
/// thread started, waiting. A standby process starts one while it waits for its restore
/// request, so that the restore's answer is not followed by a thread start, its filter's
/// installation and a connection thread's start (~0.25 ms of CPU in a scheduler trace of a
/// create, competing with the restored guest's first run and with the service's answer on
/// a 2-CPU host). Dropped unused, the thread ends.
pub struct ServerAhead {
    handoff: mpsc::SyncSender<(UnixListener, PeerCheck)>,
    requests: Receiver<PendingRequest>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
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
pub struct ApiServer {
    // Dropped after the thread is joined (see `Drop`): the file goes last.
    bound: BoundPath,
    requests: Receiver<PendingRequest>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
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

/// The peer's uid (`SO_PEERCRED`).
fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which lives for the call;
    // the descriptor is the stream's own.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

fn peer_allowed(stream: &UnixStream, peers: PeerCheck) -> bool {
    let want = match peers {
        PeerCheck::None => return true,
        // SAFETY: geteuid has no preconditions.
        PeerCheck::SameUser => unsafe { libc::geteuid() },
        PeerCheck::Uid(u) => u,
    };
    peer_uid(stream).is_ok_and(|uid| uid == want || uid == 0)
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

/// Waits until a connection is pending on `listener` or `timeout` passed: a new
/// connection is accepted at once (sleeping between accept attempts would add up to the
/// sleep to every request on a new connection, such as each request of `clade serve`).
fn wait_readable(listener: &UnixListener, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let mut fds = [libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    // SAFETY: `fds` is one valid pollfd for the duration of the call, with the listener's
    // own descriptor; poll writes only its `revents`.
    let rc = unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            1,
            timeout.as_millis().min(i32::MAX as u128) as libc::c_int,
        )
    };
    if rc < 0 {
        // EINTR or a transient failure: a short pause keeps this from spinning.
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn write_response(stream: &mut UnixStream, r: &Response) -> std::io::Result<()> {
    let mut line = serde_json::to_string(r).unwrap_or_else(|_| "{\"ok\":false}".into());
    line.push('\n');
    stream.write_all(line.as_bytes())
}

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

/// What the next line of a connection is.
enum NextRequest {
    Request(Request, Vec<OwnedFd>),
    /// Not a request: this answer, and the connection stays usable.
    Bad(Response),
    /// This answer, then the connection closes (the line was too long to find its end).
    Fatal(Response),
    /// The peer went away, or the socket failed or timed out.
    End,
}

fn next_request(reader: &mut LineReader) -> NextRequest {
    match reader.next_line() {
        Ok(Some((line, fds))) => match serde_json::from_slice::<Request>(&line) {
            Ok(request) => NextRequest::Request(request, fds),
            Err(e) => NextRequest::Bad(Response::err(format!("bad request: {e}"))),
        },
        Ok(None) | Err(LineError::Io) => NextRequest::End,
        Err(LineError::TooLong) => NextRequest::Fatal(Response::err("request too long")),
        Err(LineError::TooManyFds) => NextRequest::Bad(Response::err(format!(
            "bad request: more than {MAX_REQUEST_FDS} descriptors sent with it"
        ))),
    }
}

/// A request line (with its newline) and the descriptors that came with it.
type Line = (Vec<u8>, Vec<OwnedFd>);

enum LineError {
    /// The peer went away, or the socket failed or timed out.
    Io,
    /// A line longer than [`MAX_REQUEST`].
    TooLong,
    /// A line sent with more descriptors than [`MAX_REQUEST_FDS`].
    TooManyFds,
}

/// Reads request lines with `recvmsg`, so that descriptors sent with a line
/// (`SCM_RIGHTS`) come along with it: every descriptor received until a line ends belongs
/// to that line. A buffered reader would drop them (`read` discards control messages).
/// std and the rust-vmm crates have no line reader that keeps them; this one is ours.
struct LineReader {
    stream: UnixStream,
    buf: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// Descriptors of the current line were cut off (`MSG_CTRUNC`).
    truncated: bool,
}

impl LineReader {
    fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            buf: Vec::new(),
            fds: Vec::new(),
            truncated: false,
        }
    }

    /// The next line (with its newline) and its descriptors; `None` at the end.
    fn next_line(&mut self) -> std::result::Result<Option<Line>, LineError> {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        use std::os::fd::FromRawFd;
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                if end > MAX_REQUEST {
                    return Err(LineError::TooLong);
                }
                let rest = self.buf.split_off(end + 1);
                let line = std::mem::replace(&mut self.buf, rest);
                if std::mem::take(&mut self.truncated) || self.fds.len() > MAX_REQUEST_FDS {
                    self.fds.clear();
                    return Err(LineError::TooManyFds);
                }
                return Ok(Some((line, std::mem::take(&mut self.fds))));
            }
            if self.buf.len() > MAX_REQUEST {
                return Err(LineError::TooLong);
            }
            let mut chunk = [0u8; 4096];
            let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; MAX_REQUEST_FDS + 1]);
            let mut iov = [std::io::IoSliceMut::new(&mut chunk)];
            let msg = match recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(m) => m,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => return Err(LineError::Io),
            };
            let n = msg.bytes;
            for c in msg.cmsgs() {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    for fd in fds {
                        // SAFETY: the kernel installed `fd` in this process for this
                        // message; nothing else owns it.
                        self.fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
            // More descriptors than the buffer holds (the kernel closed the rest): the
            // line is refused for carrying too many.
            self.truncated |= msg.flags.contains(MsgFlags::MSG_CTRUNC);
            if n == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(LineError::Io)
                };
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// A client of a VM's API socket.
pub struct ApiClient {
    stream: BufReader<UnixStream>,
    /// Replaces [`Request::answer_timeout`] for every request (see
    /// [`ApiClient::set_answer_timeout`]).
    answer_timeout: Option<Duration>,
    /// The limit the socket has now (set again only when a request needs another: two
    /// system calls saved on each call of a standby's restore path).
    applied_timeout: Option<Duration>,
}

impl ApiClient {
    /// Connects to the socket at `path`.
    pub fn connect(path: &Path) -> Result<Self> {
        let stream = UnixStream::connect(path).map_err(|source| Error::Io {
            context: "connecting to the VM's API socket",
            source,
        })?;
        Ok(Self {
            stream: BufReader::new(stream),
            answer_timeout: None,
            applied_timeout: None,
        })
    }

    /// Waits at most `limit` for each answer from now on, whatever the request.
    pub fn set_answer_timeout(&mut self, limit: Duration) {
        self.answer_timeout = Some(limit);
    }

    /// Sends `request` and waits for the response.
    pub fn call(&mut self, request: &Request) -> Result<Response> {
        self.call_with_fds(request, &[])
    }

    /// Sends `request` with descriptors `fds` (`SCM_RIGHTS`, at most
    /// [`MAX_REQUEST_FDS`]; the server gets duplicates, these stay the caller's) and waits
    /// for the response, at most [`Request::answer_timeout`] (or the limit set with
    /// [`ApiClient::set_answer_timeout`]).
    pub fn call_with_fds(&mut self, request: &Request, fds: &[BorrowedFd<'_>]) -> Result<Response> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let limit = self
            .answer_timeout
            .unwrap_or_else(|| request.answer_timeout());
        if self.applied_timeout != Some(limit) {
            let sock = self.stream.get_ref();
            sock.set_read_timeout(Some(limit))
                .and_then(|()| sock.set_write_timeout(Some(limit)))
                .map_err(io_err("setting the API socket's timeouts"))?;
            self.applied_timeout = Some(limit);
        }
        let mut line = serde_json::to_string(request)
            .map_err(|e| Error::Config(format!("encoding request: {e}")))?;
        line.push('\n');
        let mut bytes = line.as_bytes();
        if !fds.is_empty() {
            // The descriptors go with the line's first bytes.
            let raw: Vec<std::os::fd::RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
            let sent = loop {
                match sendmsg::<()>(
                    self.stream.get_ref().as_raw_fd(),
                    &[std::io::IoSlice::new(bytes)],
                    &[ControlMessage::ScmRights(&raw)],
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                ) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    r => break r,
                }
            }
            .map_err(|e| Error::Io {
                context: "writing an API request with descriptors",
                source: std::io::Error::from_raw_os_error(e as i32),
            })?;
            bytes = &bytes[sent..];
        }
        self.stream
            .get_mut()
            .write_all(bytes)
            .map_err(io_err("writing an API request"))?;
        let mut answer = String::new();
        self.stream
            .read_line(&mut answer)
            .map_err(|source| Error::Io {
                context: if matches!(
                    source.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) {
                    "no API response in the request's time limit (the VM process is wedged?)"
                } else {
                    "reading an API response"
                },
                source,
            })?;
        serde_json::from_str(&answer).map_err(|e| Error::Config(format!("bad API response: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_lines_get_errors() {
        let path = std::env::temp_dir().join(format!("clade-api-{}.sock", std::process::id()));
        let server = ApiServer::bind(&path).unwrap();
        // A second server on a live socket is refused.
        assert!(ApiServer::bind(&path).is_err());
        let owner = std::thread::spawn({
            move || {
                for _ in 0..2 {
                    let p = server.next_request(Duration::from_secs(5)).unwrap();
                    let r = match &p.request {
                        Request::Status => Response::ok(serde_json::json!({"state": "running"})),
                        other => Response::err(format!("unsupported {other:?}")),
                    };
                    p.respond(r);
                }
                server
            }
        });
        let mut c = ApiClient::connect(&path).unwrap();
        let r = c.call(&Request::Status).unwrap();
        assert!(r.ok);
        assert_eq!(r.fields["state"], "running");
        // Garbage gets an error line and the connection stays usable.
        c.stream.get_mut().write_all(b"{not json\n").unwrap();
        let mut line = String::new();
        c.stream.read_line(&mut line).unwrap();
        let r: Response = serde_json::from_str(&line).unwrap();
        assert!(!r.ok && r.error.unwrap().contains("bad request"));
        let r = c.call(&Request::Pause).unwrap();
        assert!(!r.ok);
        let server = owner.join().unwrap();
        drop(server);
        assert!(!path.exists(), "socket removed on drop");
    }

    #[test]
    fn a_request_nobody_answers_fails_within_its_time_limit() {
        assert_eq!(Request::Pause.answer_timeout(), QUICK_ANSWER_TIMEOUT);
        assert_eq!(
            Request::Fork {
                count: 1,
                prefix: None,
                agent_sync: true,
                nets: vec![]
            }
            .answer_timeout(),
            WORK_ANSWER_TIMEOUT
        );
        let path = std::env::temp_dir().join(format!("clade-api-mute-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        // A wedged VM process: its socket takes connections and reads, but never answers.
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut c = ApiClient::connect(&path).unwrap();
        let (_held, _) = listener.accept().unwrap();
        c.set_answer_timeout(Duration::from_millis(100));
        let t = std::time::Instant::now();
        let e = c.call(&Request::Shutdown).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(e.to_string().contains("time limit"), "{e}");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn descriptors_sent_with_a_request_come_with_it() {
        use std::os::fd::AsFd;
        let path = std::env::temp_dir().join(format!("clade-api-fds-{}.sock", std::process::id()));
        let server = ApiServer::bind(&path).unwrap();
        let owner = std::thread::spawn(move || {
            let mut got = Vec::new();
            for _ in 0..3 {
                let mut p = server.next_request(Duration::from_secs(5)).unwrap();
                let fds = p.take_fds();
                // What the descriptor is: the contents of the file sent.
                let text = fds.first().map(|fd| {
                    let mut f = std::fs::File::from(fd.try_clone().unwrap());
                    std::io::Seek::rewind(&mut f).unwrap();
                    let mut s = String::new();
                    std::io::Read::read_to_string(&mut f, &mut s).unwrap();
                    s
                });
                got.push((fds.len(), text));
                p.respond(Response::ok(serde_json::json!({})));
            }
            got
        });
        let dir = scratch("fds");
        let file = dir.join("payload");
        std::fs::write(&file, "sent along").unwrap();
        let f = std::fs::File::open(&file).unwrap();
        let mut c = ApiClient::connect(&path).unwrap();
        assert!(c.call_with_fds(&Request::Status, &[f.as_fd()]).unwrap().ok);
        // More than the limit: refused, the connection stays usable.
        let many: Vec<_> = (0..MAX_REQUEST_FDS + 1).map(|_| f.as_fd()).collect();
        let r = c.call_with_fds(&Request::Status, &many).unwrap();
        assert!(!r.ok && r.error.unwrap().contains("descriptors"));
        assert!(c.call(&Request::Status).unwrap().ok);
        assert!(
            c.call_with_fds(&Request::Pause, &[f.as_fd(), f.as_fd()])
                .unwrap()
                .ok
        );
        let got = owner.join().unwrap();
        assert_eq!(
            got,
            vec![
                (1, Some("sent along".to_string())),
                (0, None),
                (2, Some("sent along".to_string()))
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_listener_serves_a_request_per_connection_on_its_thread_then_hands_over() {
        use std::io::Read;
        use std::os::fd::AsFd;
        let d = scratch("direct");
        let path = d.join("sb.api");
        let listener = ApiListener::bind(&path).unwrap();
        assert!(
            ApiListener::bind(&path).is_err(),
            "a live socket is not replaced"
        );
        // Nobody connects: nothing, after the timeout.
        assert!(listener.next_request(Duration::from_millis(20)).is_none());
        let client = std::thread::spawn({
            let path = path.clone();
            let payload = d.join("payload");
            move || {
                std::fs::write(&payload, "sent along").unwrap();
                let f = std::fs::File::open(&payload).unwrap();
                let mut c = ApiClient::connect(&path).unwrap();
                let r = c.call_with_fds(&Request::Status, &[f.as_fd()]).unwrap();
                // One request per connection: the next one finds it closed.
                let again = c.call(&Request::Status);
                // A line that is not a request gets its error, then the connection closes.
                let mut raw = UnixStream::connect(&path).unwrap();
                raw.write_all(b"{not json\n").unwrap();
                let mut answer = String::new();
                raw.read_to_string(&mut answer).unwrap();
                (r, again.is_err(), answer)
            }
        });
        let mut p = loop {
            if let Some(p) = listener.next_request(Duration::from_secs(5)) {
                break p;
            }
        };
        assert!(matches!(p.request, Request::Status));
        let fds = p.take_fds();
        let mut f = std::fs::File::from(fds.into_iter().next().expect("the descriptor"));
        let mut text = String::new();
        std::io::Seek::rewind(&mut f).unwrap();
        f.read_to_string(&mut text).unwrap();
        assert_eq!(text, "sent along");
        p.respond(Response::ok(serde_json::json!({"state": "standby"})));
        // The bad line: answered here, no request.
        assert!(listener.next_request(Duration::from_secs(5)).is_none());
        let (r, closed, answer) = client.join().unwrap();
        assert!(r.ok && r.fields["state"] == "standby", "{r:?}");
        assert!(closed, "a second request on the same connection fails");
        let bad: Response = serde_json::from_str(answer.trim()).unwrap();
        assert!(!bad.ok && bad.error.unwrap().contains("bad request"));
        // From here a server thread serves the same socket, with connections as usual.
        let server = listener.serve().unwrap();
        let owner = std::thread::spawn(move || {
            for _ in 0..2 {
                let p = server.next_request(Duration::from_secs(5)).unwrap();
                p.respond(Response::ok(serde_json::json!({"state": "running"})));
            }
            server
        });
        let mut c = ApiClient::connect(&path).unwrap();
        for _ in 0..2 {
            assert_eq!(c.call(&Request::Status).unwrap().fields["state"], "running");
        }
        drop(owner.join().unwrap());
        assert!(!path.exists(), "the socket goes with the server");
        // An unserved listener removes its socket too.
        drop(ApiListener::bind(&path).unwrap());
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_server_started_ahead_at_idle_priority_serves_at_normal_priority_once_handed_its_socket() {
        let d = scratch("ahead");
        let path = d.join("vm.api");
        // Started by a thread at idle priority, as a waiting standby's main thread is.
        let ahead = std::thread::spawn(|| {
            crate::vstate::spare::run_at_idle_priority("test");
            ServerAhead::start().unwrap()
        })
        .join()
        .unwrap();
        let listener = ApiListener::bind(&path).unwrap();
        // Not handed its socket yet: nobody accepts (the connection waits in the backlog).
        let mut early = ApiClient::connect(&path).unwrap();
        let server = listener.serve_on(ahead).unwrap();
        let owner = std::thread::spawn(move || {
            let p = server.next_request(Duration::from_secs(5)).unwrap();
            p.respond(Response::ok(serde_json::json!({"state": "running"})));
            server
        });
        assert_eq!(
            early.call(&Request::Status).unwrap().fields["state"],
            "running"
        );
        // It served a connection, so it ran past its start: no API thread of this process
        // (other tests' included) is left at idle priority.
        let idle: Vec<String> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "api")
            })
            .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
            // SAFETY: sched_getscheduler only reads the policy of the thread with this ID.
            .filter(|&tid| unsafe { libc::sched_getscheduler(tid) } == libc::SCHED_IDLE)
            .map(|tid| tid.to_string())
            .collect();
        assert!(idle.is_empty(), "API threads at idle priority: {idle:?}");
        drop(owner.join().unwrap());
        assert!(!path.exists(), "the socket goes with the server");
        // One dropped unused ends quietly.
        drop(ServerAhead::start().unwrap());
        let _ = std::fs::remove_dir_all(&d);
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("clade-api-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_socket_is_private_and_only_a_stale_socket_is_replaced() {
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("files");
        let path = d.join("vm.api");
        // A regular file (say, one a symlink attack aims at) is never removed.
        std::fs::write(&path, b"precious").unwrap();
        let e = ApiServer::bind(&path)
            .err()
            .expect("a file in the way is refused");
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"precious");
        std::fs::remove_file(&path).unwrap();

        let server = ApiServer::bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "socket mode {mode:o}");
        // Another VM took the path over (ours was removed under us): dropping ours must
        // leave theirs.
        std::fs::remove_file(&path).unwrap();
        let other = ApiServer::bind(&path).unwrap();
        drop(server);
        assert!(path.exists(), "the other VM's socket was removed");
        ApiClient::connect(&path).expect("the other VM's socket still answers");
        drop(other);
        assert!(!path.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn connections_beyond_the_limit_get_an_error() {
        let d = scratch("conns");
        let path = d.join("vm.api");
        let server = ApiServer::bind(&path).unwrap();
        let held: Vec<UnixStream> = (0..MAX_CONNECTIONS)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        // Let the accept loop take them all.
        let t = std::time::Instant::now();
        let refused = loop {
            let extra = UnixStream::connect(&path).unwrap();
            extra
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut line = String::new();
            if BufReader::new(&extra).read_line(&mut line).is_ok() && !line.is_empty() {
                break line;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no refusal");
        };
        assert!(refused.contains("too many connections"), "{refused}");
        drop(held);
        // Slots free up again once connections close.
        let t = std::time::Instant::now();
        loop {
            let p2 = path.clone();
            let client = std::thread::spawn(move || {
                ApiClient::connect(&p2).and_then(|mut c| c.call(&Request::Status))
            });
            if let Some(p) = server.next_request(Duration::from_secs(2)) {
                p.respond(Response::ok(serde_json::json!({})));
            }
            if client.join().unwrap().is_ok_and(|r| r.ok) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "slots never freed");
        }
        drop(server);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_huge_fork_count_is_a_request_not_a_crash() {
        let r: Request =
            serde_json::from_str(r#"{"op":"fork","count":18446744073709551615}"#).unwrap();
        assert_eq!(
            r,
            Request::Fork {
                count: usize::MAX,
                prefix: None,
                agent_sync: true,
                nets: Vec::new(),
            }
        );
        assert!(crate::fork::check_child_count(usize::MAX).is_err());
        assert!(crate::fork::check_child_count(0).is_err());
        assert!(crate::fork::check_child_count(crate::fork::MAX_FORK_CHILDREN).is_ok());
    }

    #[test]
    fn a_restore_request_has_the_restore_commands_defaults() {
        let r: Request = serde_json::from_str(r#"{"op":"restore","snapshot":"/s"}"#).unwrap();
        assert_eq!(r, Request::Restore(RestoreRequest::new("/s".into())));
        let Request::Restore(full) = serde_json::from_str::<Request>(
            r#"{"op":"restore","snapshot":"/s","vsock":"/r/v","serial_file":"/r/s",
                "disk_overlay":"/r/d","log":"/r/l","agent_sync":false,
                "agent_sync_timeout_ms":250,"backend":"file","working_set":false}"#,
        )
        .unwrap() else {
            panic!("not a restore")
        };
        assert_eq!(full.vsock.as_deref(), Some(Path::new("/r/v")));
        assert_eq!(full.agent_sync_timeout_ms, Some(250));
        assert!(!full.agent_sync && !full.working_set);
        // Round trip, and a request without its snapshot is a bad request.
        let again: Request =
            serde_json::from_str(&serde_json::to_string(&Request::Restore(full.clone())).unwrap())
                .unwrap();
        assert_eq!(again, Request::Restore(full));
        assert!(serde_json::from_str::<Request>(r#"{"op":"restore"}"#).is_err());
    }

    /// Mutated and random request lines through a live server: each gets one answer line
    /// (an error for what is not a request) and the server keeps serving.
    #[test]
    fn mutated_request_lines_get_answers_and_the_server_survives() {
        let d = scratch("fuzz");
        let path = d.join("vm.api");
        let server = ApiServer::bind(&path).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let owner = std::thread::spawn(move || {
            while !stop2.load(Ordering::SeqCst) {
                if let Some(p) = server.next_request(Duration::from_millis(20)) {
                    p.respond(Response::err("fuzzing"));
                }
            }
        });
        let seeds: [&[u8]; 4] = [
            br#"{"op":"status"}"#,
            br#"{"op":"snapshot","dir":"/tmp/x","kind":"diff"}"#,
            br#"{"op":"fork","count":3,"prefix":"/tmp/p","agent_sync":false}"#,
            br#"{"op":"unpause"}"#,
        ];
        let mut x: u64 = 0x0061_7069_6675_7a7a;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let conn = UnixStream::connect(&path).unwrap();
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let mut writer = conn;
        let (mut parsed, mut refused) = (0, 0);
        for i in 0..3000 {
            let mut line = seeds[i % seeds.len()].to_vec();
            for _ in 0..1 + next() % 4 {
                let v = next();
                let at = (v >> 8) as usize % (line.len() + 1);
                match v % 3 {
                    0 if at < line.len() => line[at] = (v >> 16) as u8,
                    1 => line.insert(at, (v >> 16) as u8),
                    _ => line.truncate(at.max(1)),
                }
            }
            line.retain(|&b| b != b'\n');
            if serde_json::from_slice::<Request>(&line).is_ok() {
                parsed += 1;
            } else {
                refused += 1;
            }
            line.push(b'\n');
            writer.write_all(&line).unwrap();
            let mut answer = String::new();
            reader.read_line(&mut answer).unwrap();
            let r: Response = serde_json::from_str(&answer).unwrap();
            assert!(!r.ok, "{answer}");
        }
        assert!(
            refused > 0 && parsed > 0,
            "{parsed} parsed, {refused} refused"
        );
        let mut c = ApiClient::connect(&path).unwrap();
        assert!(!c.call(&Request::Status).unwrap().ok, "still answering");
        stop.store(true, Ordering::SeqCst);
        owner.join().unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }
}

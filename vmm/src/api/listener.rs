//! The API socket itself: binding it safely ([`ApiListener`]: mode 0600, only a stale
//! socket replaced, removed only while the path still names it), checking who connects
//! ([`PeerCheck`]), and serving it on the caller's thread one request per connection
//! before handing it to a server thread.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use super::connection::{
    next_request, write_response, LineReader, NextRequest, PendingRequest, Reply,
};
use super::{io_err, ApiServer, Response, ServerAhead};
use crate::error::{Error, Result};

/// Size of `sun_path`: a Unix socket path is at most this many bytes minus one.
const MAX_SOCKET_PATH: usize = 108;

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
pub(super) struct BoundPath {
    pub(super) path: PathBuf,
    /// Device and inode of the socket file.
    identity: (u64, u64),
}

impl BoundPath {
    /// Whether the path still names the socket bound there.
    pub(super) fn still_ours(&self) -> bool {
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

pub(super) fn peer_allowed(stream: &UnixStream, peers: PeerCheck) -> bool {
    let want = match peers {
        PeerCheck::None => return true,
        // SAFETY: geteuid has no preconditions.
        PeerCheck::SameUser => unsafe { libc::geteuid() },
        PeerCheck::Uid(u) => u,
    };
    peer_uid(stream).is_ok_and(|uid| uid == want || uid == 0)
}

/// Waits until a connection is pending on `listener` or `timeout` passed: a new
/// connection is accepted at once (sleeping between accept attempts would add up to the
/// sleep to every request on a new connection, such as each request of `clade serve`).
pub(super) fn wait_readable(listener: &UnixListener, timeout: Duration) {
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

//! The agent server: accepts connections on a listener and serves the protocol on each,
//! one thread per connection (plus helper threads per exec, per file download and per
//! directory watch).
//!
//! The same code runs in the guest (AF_VSOCK, port 52) and on the host for tests (a Unix
//! socket, `clade-agent --listen-unix PATH`); [`SystemMode`] keeps the host-test mode from
//! touching the host's clock or power.

mod conn;
mod exec;
mod files;
mod procs;
mod session;
mod watch;

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::Error;

/// What the guest-wide operations really do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SystemMode {
    /// In the guest: SetClock sets the clock; PowerOff makes [`serve`] return
    /// [`ServeEnd::PowerOff`] so that the caller powers the machine off.
    Guest,
    /// On a host, for tests: SetClock is validated and logged but the clock is left alone;
    /// PowerOff makes [`serve`] return (the test server then exits). Entropy and sync are
    /// real (harmless on a host; entropy needs CAP_SYS_ADMIN).
    HostTest,
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub mode: SystemMode,
}

/// Why [`serve`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeEnd {
    /// A client asked for a power off (already answered with Ok).
    PowerOff,
}

/// A listening socket.
pub enum Listener {
    Unix(UnixListener),
    Vsock(OwnedFd),
}

impl Listener {
    /// Listens on a Unix socket at `path` (a stale socket file there is replaced).
    pub fn bind_unix(path: &Path) -> Result<Self, Error> {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if meta.file_type().is_socket() {
                let _ = std::fs::remove_file(path);
            }
        }
        UnixListener::bind(path)
            .map(Listener::Unix)
            .map_err(|e| Error::os(format!("listen on {}", path.display()), e))
    }

    /// Listens on AF_VSOCK `port`, any local CID.
    pub fn bind_vsock(port: u32) -> Result<Self, Error> {
        let ctx = |what: &str| format!("vsock port {port}: {what}");
        // SAFETY: plain socket(2) call; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(Error::os(ctx("socket"), io::Error::last_os_error()));
        }
        // SAFETY: fd is a fresh socket owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_vm is plain data; all-zero is valid before filling it in.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_port = port;
        addr.svm_cid = libc::VMADDR_CID_ANY;
        // SAFETY: addr is a valid sockaddr_vm of the given length.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_vm).cast(),
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(Error::os(ctx("bind"), io::Error::last_os_error()));
        }
        // SAFETY: listen on a bound socket we own.
        if unsafe { libc::listen(fd.as_raw_fd(), 64) } != 0 {
            return Err(Error::os(ctx("listen"), io::Error::last_os_error()));
        }
        Ok(Listener::Vsock(fd))
    }

    fn raw_fd(&self) -> libc::c_int {
        match self {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Vsock(fd) => fd.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<OwnedFd> {
        // SAFETY: accept4 on our listening socket; peer address not wanted (null pointers).
        let fd = unsafe {
            libc::accept4(
                self.raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: accept4 returned a new descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// State shared by all connections of one server.
pub(crate) struct Shared {
    pub(crate) opts: ServerOptions,
    pub(crate) running_execs: AtomicU32,
    /// Processes started by Spawn (they outlive connections).
    pub(crate) procs: procs::ProcTable,
    /// Write end of the stop pipe: a byte here ends the accept loop.
    stop: OwnedFd,
}

impl Shared {
    pub(crate) fn request_power_off(&self) {
        let b = [1u8];
        // SAFETY: writes one byte from a valid buffer to our pipe.
        let _ = unsafe { libc::write(self.stop.as_raw_fd(), b.as_ptr().cast(), 1) };
    }

    pub(crate) fn exec_started(&self) {
        self.running_execs.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn exec_ended(&self) {
        self.running_execs.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts connections until a client requests a power off; each connection is served on
/// its own thread. Returns only for a power off (the caller acts on it) or if the listener
/// breaks.
pub fn serve(listener: Listener, opts: ServerOptions) -> Result<ServeEnd, Error> {
    // Children's statuses must be collected by the reaper from the start.
    crate::reaper::Reaper::global();
    let (stop_r, stop_w) = pipe().map_err(|e| Error::os("stop pipe", e))?;
    let shared = Arc::new(Shared {
        opts,
        running_execs: AtomicU32::new(0),
        procs: procs::ProcTable::default(),
        stop: stop_w,
    });
    let mut next_conn: u64 = 0;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop_r.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfd.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::os("poll listener", err));
        }
        if fds[1].revents != 0 {
            tracing::info!("power off requested");
            return Ok(ServeEnd::PowerOff);
        }
        if fds[0].revents == 0 {
            continue;
        }
        match listener.accept() {
            Ok(fd) => {
                next_conn += 1;
                let shared = shared.clone();
                let n = next_conn;
                let spawned = std::thread::Builder::new()
                    .name(format!("conn-{n}"))
                    .spawn(move || session::serve_connection(n, fd, shared));
                if let Err(e) = spawned {
                    tracing::error!("connection {n}: cannot start a thread: {e}");
                }
            }
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::ECONNABORTED) | Some(libc::EAGAIN) => {}
                Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOMEM)
                | Some(libc::ENOBUFS) => {
                    tracing::warn!("accept: {e}; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                _ => return Err(Error::os("accept", e)),
            },
        }
    }
}

/// A pipe with both ends close-on-exec: (read, write).
pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the valid array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and owned by us from here on.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sets the terminal size of the PTY master `fd`.
pub(crate) fn set_winsize(fd: libc::c_int, size: crate::proto::WinSize) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads the valid winsize.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

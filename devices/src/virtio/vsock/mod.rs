//! virtio-vsock (device id 19) with the host side on Unix domain sockets, following
//! Firecracker's convention:
//!
//! - **host-initiated**: a host program connects to the VM's socket `<path>` and writes
//!   `CONNECT <port>\n`. The device sends the guest a connection request to `<port>`; when the
//!   guest accepts, the program reads `OK <host port>\n` and the stream is connected
//!   (`<host port>` is the ephemeral host-side port the guest sees as its peer). If the guest
//!   refuses (RST), or does not answer within [`CONNECT_TIMEOUT`], the Unix connection is
//!   closed. Connections made before the guest driver is up wait in the listen backlog.
//! - **guest-initiated**: a guest connection to host CID 2, port `P` becomes a Unix connection
//!   to `<path>_P`; if nothing listens there the guest gets a reset.
//!
//! Closing: a host program's EOF becomes a SHUTDOWN(SEND) to the guest, closing its socket
//! a SHUTDOWN(RCV|SEND); the guest's SHUTDOWN(SEND) becomes EOF for the host program once
//! everything before it was written, and a full guest shutdown or RST closes the Unix
//! connection. Flow control is the spec's credit scheme (see [`connection`]).
//!
//! All device work runs on the VMM's device event loop ([`crate::event_loop`]), never on
//! vCPU threads: the worker polls the rx/tx queue ioeventfds, the listening socket and every
//! connection socket.

mod connection;
mod worker;

#[cfg(test)]
mod tests;

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::GuestMemory;
use serde::{Deserialize, Serialize};
use socket2::{Domain, SockAddr, Socket, Type};

use super::worker::{take_queues, DeviceWorker, QueueWorker};
use super::{Interrupt, QueuePosition, VirtQueue, VirtioDevice, VirtioDeviceState};
use crate::event_loop::LoopHandle;
use crate::{Error, Result};

pub use worker::VsockWorker;

/// virtio device id of vsock.
pub const VSOCK_DEVICE_ID: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
/// The host's CID.
pub const HOST_CID: u64 = 2;
/// Lowest CID a guest may have (0, 1 and 2 are reserved).
pub const MIN_GUEST_CID: u64 = 3;
/// Size of each of the three queues (rx, tx, event).
pub const QUEUE_SIZE: u16 = 256;
/// Queue indexes.
pub const RX_QUEUE: usize = 0;
/// Guest-to-host packets.
pub const TX_QUEUE: usize = 1;
/// Transport events (unused by this device, but the driver sets it up).
pub const EVENT_QUEUE: usize = 2;

/// Receive buffer the device advertises per connection (`buf_alloc`): the most guest data a
/// connection ever holds for a slow host reader.
pub const CONN_BUF_SIZE: u32 = 256 * 1024;
/// Largest data payload accepted in or sent in one packet (Linux's
/// VIRTIO_VSOCK_MAX_PKT_BUF_SIZE).
pub const MAX_PKT_DATA: u32 = 64 * 1024;
/// Most connections at once; more are refused (host: closed, guest: RST).
pub const MAX_CONNECTIONS: usize = 1024;
/// Most accepted host connections that have not yet sent their `CONNECT` line.
pub const MAX_PENDING_ACCEPTS: usize = 64;
/// How long a guest has to answer a host-initiated connection request, and a host program
/// to send its `CONNECT` line.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a closing connection waits for the other side before it is reset.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
/// First host-side port given to host-initiated connections.
pub const LOCAL_PORT_BASE: u32 = 1 << 30;

/// Stream sockets.
pub const TYPE_STREAM: u16 = 1;
/// Packet operations.
pub const OP_REQUEST: u16 = 1;
/// Accept a connection.
pub const OP_RESPONSE: u16 = 2;
/// Refuse or abort a connection.
pub const OP_RST: u16 = 3;
/// Stop receiving and/or sending (flags).
pub const OP_SHUTDOWN: u16 = 4;
/// Data.
pub const OP_RW: u16 = 5;
/// Receive-buffer state, unsolicited or answering a request.
pub const OP_CREDIT_UPDATE: u16 = 6;
/// Ask the peer for its receive-buffer state.
pub const OP_CREDIT_REQUEST: u16 = 7;
/// SHUTDOWN flag: the sender will receive no more.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more.
pub const SHUTDOWN_SEND: u32 = 2;

/// `virtio_vsock_event` id telling the driver every connection was lost.
pub const EVENT_TRANSPORT_RESET: u32 = 0;

/// Size of `struct virtio_vsock_hdr`.
pub const HDR_SIZE: usize = virtio_vsock::packet::PKT_HEADER_SIZE;

/// A packet header, as we write it into guest rx buffers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hdr {
    /// Source CID.
    pub src_cid: u64,
    /// Destination CID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Data length.
    pub len: u32,
    /// Socket type.
    pub type_: u16,
    /// Operation.
    pub op: u16,
    /// Operation flags.
    pub flags: u32,
    /// Sender's receive buffer size.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer.
    pub fwd_cnt: u32,
}

impl Hdr {
    /// Little-endian wire format.
    pub fn to_bytes(&self) -> [u8; HDR_SIZE] {
        let mut b = [0u8; HDR_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// Parses the wire format.
    pub fn from_bytes(b: &[u8; HDR_SIZE]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or_default());
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }
}

/// The VM's Unix socket file; removed when this is dropped (if it is still ours).
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    /// Binds a listening socket at `path`. An existing socket file nobody listens on (left
    /// by a crashed VMM) is replaced; a live one, or any other kind of file, is an error.
    pub fn bind(path: &Path) -> Result<(UnixListener, SocketFile)> {
        let sock_err = |source| Error::Socket {
            path: path.to_path_buf(),
            source,
        };
        if stale_socket_at(path)? {
            tracing::info!("vsock: removing stale socket {}", path.display());
            std::fs::remove_file(path).map_err(sock_err)?;
        }
        let listener = bind_private(path).map_err(sock_err)?;
        listener.set_nonblocking(true).map_err(sock_err)?;
        let md = std::fs::symlink_metadata(path).map_err(sock_err)?;
        if md.permissions().mode() & 0o777 != 0o600 {
            // The umask took owner bits away: the owner could not connect.
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(sock_err)?;
        }
        Ok((
            listener,
            SocketFile {
                path: path.to_path_buf(),
                dev: md.dev(),
                ino: md.ino(),
            },
        ))
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves this socket file to `to` (a rename: the listener bound to it keeps listening,
    /// now reached at `to`), replacing a stale socket file there as [`SocketFile::bind`]
    /// does; a live socket or another kind of file at `to` is an error, and so is `to` on
    /// another filesystem. On error the socket stays where it was.
    ///
    /// Binding creates a new inode, which on a filesystem with files created and deleted
    /// around it (ext4 skipping recently deleted inodes, reading inode tables) was measured
    /// here at 0.4-0.6 ms; a socket bound ahead and moved into place costs a rename.
    pub fn move_to(&mut self, to: &Path) -> Result<()> {
        // A stale socket there is replaced by the rename.
        stale_socket_at(to)?;
        std::fs::rename(&self.path, to).map_err(|source| Error::Socket {
            path: to.to_path_buf(),
            source,
        })?;
        self.path = to.to_path_buf();
        Ok(())
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        // Another VMM may have replaced a file we lost; leave theirs alone.
        match std::fs::symlink_metadata(&self.path) {
            Ok(md) if md.dev() == self.dev && md.ino() == self.ino => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!("vsock: removing {}: {e}", self.path.display());
                }
            }
            _ => {}
        }
    }
}

/// A listening socket bound at `path` with mode 0600 from the start: only the VMM's user
/// (and root) may talk to the guest's agent. Linux gives the socket file the mode of the
/// socket itself, less the umask, so the socket is made 0600 before it is bound: one new
/// file and nothing else, where binding under a private name, `chmod` and a rename into
/// place changed the directory three more times (measured on this project's ext4: 104 ->
/// 88 us per socket, p50).
fn bind_private(path: &Path) -> std::io::Result<UnixListener> {
    let sock = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    // `fchmod` of the socket (through `File`, which is only a descriptor here).
    let sock = std::fs::File::from(std::os::fd::OwnedFd::from(sock));
    sock.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    let sock = Socket::from(std::os::fd::OwnedFd::from(sock));
    sock.bind(&SockAddr::unix(path)?)?;
    sock.listen(libc::SOMAXCONN)?;
    Ok(UnixListener::from(std::os::fd::OwnedFd::from(sock)))
}

/// Whether a stale socket file (nobody listens on it) is at `path`, where a VM's socket is
/// to go: `false` if nothing is there; an error for a live socket or another kind of file.
fn stale_socket_at(path: &Path) -> Result<bool> {
    let sock_err = |source| Error::Socket {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => {
            if socket_in_use(path) {
                return Err(Error::SocketInUse(path.to_path_buf()));
            }
            Ok(true)
        }
        Ok(_) => Err(sock_err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "exists and is not a socket",
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(sock_err(e)),
    }
}

/// True if something accepts connections at `path` (a full backlog counts as in use).
///
/// Nothing at the path, or no socket, is answered by one `stat` (which follows a link, as
/// a connect does): a connect that fails for a missing path was measured here at ~30-40 us
/// of a restore (the socket made and closed around the lookup), and most VMs' socket
/// paths are new.
pub fn socket_in_use(path: &Path) -> bool {
    if !std::fs::metadata(path).is_ok_and(|md| md.file_type().is_socket()) {
        return false;
    }
    let Ok(addr) = SockAddr::unix(path) else {
        return false;
    };
    let Ok(sock) = Socket::new(Domain::UNIX, Type::STREAM, None) else {
        return false;
    };
    if sock.set_nonblocking(true).is_err() {
        return false;
    }
    match sock.connect(&addr) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    }
}

/// Connects, without blocking, to the host listener for guest-initiated connections.
pub(crate) fn connect_host_port(
    base: &Path,
    port: u32,
) -> std::io::Result<std::os::unix::net::UnixStream> {
    let mut p = base.as_os_str().to_owned();
    p.push(format!("_{port}"));
    let addr = SockAddr::unix(PathBuf::from(p))?;
    let sock = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    sock.set_nonblocking(true)?;
    // A Unix connect completes at once, or fails (EAGAIN when the listener's backlog is
    // full): it never blocks the event loop.
    sock.connect(&addr)?;
    Ok(std::os::fd::OwnedFd::from(sock).into())
}

/// What a snapshot keeps of a vsock device. Connections are not kept: their host ends are
/// Unix sockets of the VMM process that took the snapshot. A restored device that had any
/// tells the guest with a transport-reset event; listening sockets in the guest survive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    /// The guest's CID (the guest driver read it once; it must not change).
    pub guest_cid: u64,
    /// Connections open when the snapshot was taken.
    pub connections: u32,
}

/// What the vsock worker publishes after each round besides its queue positions.
#[derive(Debug, Default)]
pub(crate) struct VsockProgress {
    /// Open connections after the worker's last round.
    pub connections: usize,
}

/// Where a restored device finds its listening socket once the VMM has bound it (see
/// [`VsockDevice::restore`]).
pub type ListenerSlot = Arc<Mutex<Option<UnixListener>>>;

enum Listener {
    Bound(UnixListener),
    Later(ListenerSlot),
}

/// The vsock device model: configuration space and activation. The data path is
/// [`VsockWorker`], which runs on the device event loop.
pub struct VsockDevice {
    guest_cid: u64,
    listener: Listener,
    uds_path: PathBuf,
    worker: DeviceWorker<VsockWorker>,
    /// Restored from a snapshot: tell the guest its connections are gone.
    reset_on_activate: bool,
    /// Guest-triggered warnings, across activations.
    log: crate::virtio::mmio::LogLimiter,
}

impl VsockDevice {
    /// A vsock device for guest `guest_cid`. `listener` is the VM's socket at `uds_path`
    /// (from [`SocketFile::bind`]; the caller keeps the [`SocketFile`], which removes the
    /// file when dropped). The worker will run on the event loop behind `event_loop`.
    pub fn new(
        guest_cid: u64,
        listener: UnixListener,
        uds_path: &Path,
        event_loop: LoopHandle,
    ) -> Result<Self> {
        listener.set_nonblocking(true)?;
        Self::with_listener(guest_cid, Listener::Bound(listener), uds_path, event_loop)
    }

    fn with_listener(
        guest_cid: u64,
        listener: Listener,
        uds_path: &Path,
        event_loop: LoopHandle,
    ) -> Result<Self> {
        if !(MIN_GUEST_CID..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(Error::Virtio(format!(
                "vsock guest CID {guest_cid} is reserved or too large (use 3..{})",
                u32::MAX
            )));
        }
        Ok(Self {
            guest_cid,
            listener,
            uds_path: uds_path.to_path_buf(),
            worker: DeviceWorker::new(event_loop),
            reset_on_activate: false,
            log: crate::virtio::mmio::LogLimiter::new(),
        })
    }

    /// A device restored from `state` (the guest CID comes from the snapshot; the other
    /// arguments as for [`VsockDevice::new`]). Its listening socket arrives later, in
    /// `listener` (the VMM binds it while the vCPUs already run), and must be there when
    /// the device is activated. The guest gets a transport-reset event as soon as the
    /// device runs: no connection survives a restore, and the guest may still hold one
    /// the host had already closed at the snapshot's instant (its end not yet processed)
    /// — a new host connection could then arrive from the same host port, be taken for
    /// that old one and be refused.
    ///
    /// `guest_cid` replaces the saved CID (a forked VM gets its own); the reset makes a
    /// driver read the CID again.
    pub fn restore(
        state: &VsockState,
        guest_cid: u64,
        listener: ListenerSlot,
        uds_path: &Path,
        event_loop: LoopHandle,
    ) -> Result<Self> {
        let mut dev =
            Self::with_listener(guest_cid, Listener::Later(listener), uds_path, event_loop)
                .map_err(|e| Error::Restore(format!("vsock: {e}")))?;
        dev.reset_on_activate = true;
        tracing::debug!(
            "vsock: restored (CID {} -> {guest_cid}, {} connections open at the snapshot): \
             the guest gets a transport reset",
            state.guest_cid,
            state.connections
        );
        Ok(dev)
    }

    /// The listening socket, taken from the slot the first time.
    fn listener(&mut self) -> Result<&UnixListener> {
        if let Listener::Later(slot) = &self.listener {
            let l = slot
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .ok_or_else(|| Error::Virtio("the vsock socket is not bound yet".into()))?;
            l.set_nonblocking(true)?;
            self.listener = Listener::Bound(l);
        }
        match &self.listener {
            Listener::Bound(l) => Ok(l),
            Listener::Later(_) => Err(Error::Virtio("the vsock socket is not bound".into())),
        }
    }

    /// The host socket path.
    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// The guest's CID.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }
}

impl VirtioDevice for VsockDevice {
    fn device_type(&self) -> u32 {
        VSOCK_DEVICE_ID
    }

    fn avail_features(&self) -> u64 {
        // Only VIRTIO_F_VERSION_1 (added by the transport): stream sockets, no SEQPACKET.
        0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 3]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_vsock_config { le64 guest_cid; }
        let cfg = self.guest_cid.to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| cfg.get(o as usize).copied())
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            "vsock: guest wrote {} bytes of read-only config at {offset:#x}, ignored",
            data.len()
        );
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<VirtQueue>,
        interrupt: Arc<Interrupt>,
        _features: u64,
    ) -> Result<()> {
        let queues = take_queues(
            VsockWorker::NAME,
            queues,
            &[(RX_QUEUE, "rx"), (TX_QUEUE, "tx")],
        )?;
        let listener = self.listener()?.try_clone()?;
        let worker = VsockWorker::new(
            mem,
            queues,
            interrupt,
            self.guest_cid,
            self.uds_path.clone(),
            listener,
        )?
        .with_transport_reset(std::mem::take(&mut self.reset_on_activate))
        .with_log(self.log.clone());
        self.worker.start(worker)?;
        // Debug: at a restore this is on the path to the VM's first answer, and a log line
        // to a file that is being appended to was measured at 0.05-0.5 ms here.
        tracing::debug!(
            "vsock: guest CID {} active, host socket {}",
            self.guest_cid,
            self.uds_path.display()
        );
        Ok(())
    }

    fn reset(&mut self) {
        self.worker.stop();
    }

    fn pause(&mut self) {
        self.worker.pause();
    }

    fn replace_memory(&mut self, mem: &GuestMemory) {
        self.worker.replace_memory(mem);
    }

    fn unpause(&mut self) {
        self.worker.unpause();
    }

    fn queue_positions(&self) -> Vec<QueuePosition> {
        self.worker.queue_positions()
    }

    fn save_state(&self) -> Option<VirtioDeviceState> {
        let connections = self.worker.progress(|p| p.connections).unwrap_or(0);
        Some(VirtioDeviceState::Vsock(VsockState {
            guest_cid: self.guest_cid,
            connections: u32::try_from(connections).unwrap_or(u32::MAX),
        }))
    }
}

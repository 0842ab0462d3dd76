//! The vsock data path: the worker that moves packets between the virtqueues and the host
//! Unix sockets (run on the event loop behind the pause gate, see `virtio::worker`).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::GuestMemory;
use event_manager::{EventOps, Events};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use virtio_vsock::packet::VsockPacket;
use vm_memory::Bytes;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::connection::{ConnKey, Connection};
use super::{
    connect_host_port, Hdr, CONNECT_TIMEOUT, EVENT_QUEUE, EVENT_TRANSPORT_RESET, HDR_SIZE,
    HOST_CID, LOCAL_PORT_BASE, MAX_CONNECTIONS, MAX_PENDING_ACCEPTS, MAX_PKT_DATA,
    OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE, OP_RST, OP_RW, OP_SHUTDOWN,
    RX_QUEUE, TX_QUEUE, TYPE_STREAM,
};
use crate::virtio::mmio::LogLimiter;
use crate::virtio::worker::{unregister_unknown, QueueWorker};
use crate::virtio::{Interrupt, VirtQueue};
use crate::{Error, Result};

/// Longest `CONNECT <port>\n` line accepted.
const MAX_CONNECT_LINE: usize = 32;
/// Resets waiting for rx buffers. Past half of it, guest tx processing pauses until the guest
/// takes them, so a guest sending junk without reading cannot grow this.
const RST_QUEUE_MAX: usize = 2048;
/// Connections accepted per listener wake-up.
const ACCEPT_BATCH: usize = 32;
/// Timer period while something has a deadline.
const TICK: Duration = Duration::from_millis(500);
/// Queue rounds per event, so one busy device cannot monopolize the event loop.
const MAX_ROUNDS: usize = 16;

/// A packet in guest memory (writes through it are recorded in the dirty bitmap).
type Packet<'a> = VsockPacket<'a, vm_memory::bitmap::BS<'a, vm_memory::bitmap::AtomicBitmap>>;

macro_rules! guest_warn {
    ($self:expr, $($arg:tt)*) => {
        if $self.log.allow() {
            tracing::warn!($($arg)*);
        }
    };
}

#[derive(Debug, Clone, Copy)]
enum Token {
    Conn(ConnKey),
    Pending,
}

/// An accepted host connection that has not finished its `CONNECT <port>` line.
struct PendingAccept {
    stream: UnixStream,
    line: Vec<u8>,
    deadline: Instant,
}

pub(super) fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(line).ok()?;
    let s = s.strip_suffix('\r').unwrap_or(s);
    s.strip_prefix("CONNECT ")?.trim().parse().ok()
}

/// The vsock device's work, owned by the event loop while the device is active.
pub struct VsockWorker {
    mem: GuestMemory,
    queues: [Queue; 3],
    evts: [EventFd; 3],
    interrupt: Arc<Interrupt>,
    /// Tell the guest all connections were lost, first thing (restored from a snapshot).
    reset_transport: bool,
    /// Set from the transport reset until the guest has taken it (see [`ResetSent`]):
    /// nothing goes into the rx queue meanwhile.
    reset_sent: Option<ResetSent>,
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    listener_paused: bool,
    timer: TimerFd,
    timer_armed: bool,
    conns: HashMap<ConnKey, Connection>,
    fds: HashMap<RawFd, Token>,
    pending: HashMap<RawFd, PendingAccept>,
    /// Connections with something for the guest, served round-robin.
    rx_order: VecDeque<ConnKey>,
    /// Resets for the guest not tied to a live connection.
    rst_queue: VecDeque<Hdr>,
    dirty: Vec<ConnKey>,
    next_local_port: u32,
    log: LogLimiter,
}

/// A transport reset the device sent and the guest may not have taken yet. A restored or
/// forked guest runs on from wherever it was paused, perhaps between its look at the event
/// queue and its look at the rx queue, and Linux's driver handles the rx queue's work
/// before the event queue's when one interrupt signals both: a connection request put in
/// the rx queue right after the reset could be accepted first and then dropped with the
/// connections the reset is about (the host's client then sees its new connection closed
/// after the agent's OK: ~0.2-0.7% of the embedding example's runs here). So the device
/// puts nothing in the rx queue until the guest has given an event buffer back (`avail`
/// moved on: Linux's driver and the test guest both handle an event before they post its
/// buffer again), or [`RESET_TAKEN_WAIT`] passed (a guest that never does).
struct ResetSent {
    /// The event queue's avail index when the reset was sent.
    avail: u16,
    at: Instant,
}

/// How long the rx queue waits for a guest to take a transport reset; checked at least
/// every [`TICK`]. Long enough for a slow machine: a Debian guest in the nested tier (QEMU
/// TCG) took longer than 100 ms, and the agent sync's connection, let through, was
/// answered from the guest's old CID (dropped) and then reset with the old connections.
const RESET_TAKEN_WAIT: Duration = Duration::from_secs(1);

/// Where a restored device starts counting its host ports: not at [`LOCAL_PORT_BASE`],
/// where every device starts and so where the ports of the connections its guest held at
/// the snapshot lie. Until the guest has taken the transport reset, it still holds those:
/// a connection request from one of their ports meets an established connection and is
/// answered with a reset (by Linux's driver and the test guest alike), and the host's
/// client must retry (its retry waits 100 ms). A random start among 2^29 ports keeps clear
/// of them.
fn restored_port_start() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    // Keys drawn from the OS's randomness once per thread, then stepped: no system call.
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    LOCAL_PORT_BASE + 1 + (r as u32 & ((1 << 29) - 1))
}

impl VsockWorker {
    /// A worker for an activated device.
    /// Logs guest-triggered warnings through `log` (the device's, shared by its workers).
    pub(crate) fn with_log(mut self, log: LogLimiter) -> Self {
        self.log = log;
        self
    }

    pub(crate) fn new(
        mem: GuestMemory,
        queues: [VirtQueue; 3],
        interrupt: Arc<Interrupt>,
        guest_cid: u64,
        uds_path: PathBuf,
        listener: UnixListener,
    ) -> Result<Self> {
        let [rx, tx, ev] = queues;
        Ok(Self {
            mem,
            queues: [rx.queue, tx.queue, ev.queue],
            evts: [rx.notify, tx.notify, ev.notify],
            interrupt,
            reset_transport: false,
            reset_sent: None,
            guest_cid,
            uds_path,
            listener,
            listener_paused: false,
            timer: TimerFd::new().map_err(|e| Error::Virtio(format!("vsock timer: {e}")))?,
            timer_armed: false,
            conns: HashMap::new(),
            fds: HashMap::new(),
            pending: HashMap::new(),
            rx_order: VecDeque::new(),
            rst_queue: VecDeque::new(),
            dirty: Vec::new(),
            next_local_port: LOCAL_PORT_BASE,
            log: LogLimiter::new(),
        })
    }

    /// Sends the guest a transport reset first thing (a device restored from a snapshot),
    /// and counts host ports from [`restored_port_start`] then.
    pub(crate) fn with_transport_reset(mut self, reset: bool) -> Self {
        self.reset_transport = reset;
        if reset {
            self.next_local_port = restored_port_start();
        }
        self
    }

    /// Puts a `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` in the event queue: the guest drops all
    /// its connections (their host ends are gone) and keeps its listening sockets.
    fn send_transport_reset(&mut self) {
        let mem = self.mem.clone();
        let Some(chain) = self.queues[EVENT_QUEUE].pop_descriptor_chain(&mem) else {
            tracing::warn!("vsock: no event buffer for the transport reset after restore");
            return;
        };
        let head = chain.head_index();
        let mut len = 0;
        for d in chain {
            if d.is_write_only() && d.len() >= 4 {
                match mem.write_obj(EVENT_TRANSPORT_RESET, d.addr()) {
                    Ok(()) => len = 4,
                    Err(e) => guest_warn!(self, "vsock: writing the reset event: {e}"),
                }
                break;
            }
        }
        if let Err(e) = self.queues[EVENT_QUEUE].add_used(&mem, head, len) {
            guest_warn!(self, "vsock: event used ring: {e}");
        }
        tracing::debug!("vsock: transport reset event sent to the guest");
        match self.queues[EVENT_QUEUE].avail_idx(&mem, Ordering::Acquire) {
            Ok(avail) => {
                self.reset_sent = Some(ResetSent {
                    avail: avail.0,
                    at: Instant::now(),
                });
                self.arm_timer();
            }
            Err(e) => guest_warn!(self, "vsock: event avail ring: {e}"),
        }
        self.interrupt.signal_used_queue();
    }

    /// Whether the guest may be given packets: not while a transport reset it has not
    /// taken is outstanding (see [`ResetSent`]).
    fn rx_open(&mut self) -> bool {
        let Some(r) = &self.reset_sent else {
            return true;
        };
        let taken = match self.queues[EVENT_QUEUE].avail_idx(&self.mem, Ordering::Acquire) {
            Ok(avail) => avail.0 != r.avail,
            Err(_) => true,
        };
        if !taken && r.at.elapsed() < RESET_TAKEN_WAIT {
            return false;
        }
        if !taken {
            tracing::debug!(
                "vsock: the guest gave no event buffer back within {RESET_TAKEN_WAIT:?} of \
                 the transport reset: serving it anyway"
            );
        }
        self.reset_sent = None;
        true
    }

    fn hdr_to_guest(&self, mut h: Hdr) -> Hdr {
        h.src_cid = HOST_CID;
        h.dst_cid = self.guest_cid;
        h.type_ = TYPE_STREAM;
        h
    }

    fn push_rst(&mut self, local_port: u32, peer_port: u32) {
        if self.rst_queue.len() >= RST_QUEUE_MAX {
            guest_warn!(
                self,
                "vsock: reset queue full (guest takes no rx buffers), reset dropped"
            );
            return;
        }
        let h = self.hdr_to_guest(Hdr {
            src_port: local_port,
            dst_port: peer_port,
            op: OP_RST,
            ..Hdr::default()
        });
        self.rst_queue.push_back(h);
    }

    // ---- connection bookkeeping -------------------------------------------------------

    fn queue_rx(&mut self, key: ConnKey) {
        if let Some(c) = self.conns.get_mut(&key) {
            if !c.queued && c.has_rx() {
                c.queued = true;
                self.rx_order.push_back(key);
            }
        }
    }

    fn mark_dirty(&mut self, key: ConnKey) {
        if let Some(c) = self.conns.get_mut(&key) {
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(key);
            }
        }
    }

    /// After any change to a connection: end it if it is over, else schedule its rx work
    /// and its epoll update.
    fn touch(&mut self, key: ConnKey, ops: &mut EventOps) {
        let Some(c) = self.conns.get(&key) else {
            return;
        };
        if let Some(why) = c.end_reason(Instant::now()) {
            self.kill(key, why, ops);
            return;
        }
        self.queue_rx(key);
        self.mark_dirty(key);
    }

    /// Ends a connection and tells the guest with an RST.
    fn kill(&mut self, key: ConnKey, why: &str, ops: &mut EventOps) {
        if self.conns.contains_key(&key) {
            tracing::debug!("vsock: reset {key}: {why}");
            self.push_rst(key.local_port, key.peer_port);
            self.forget(key, ops);
        }
    }

    /// Drops a connection (closing its Unix socket) without telling the guest.
    fn forget(&mut self, key: ConnKey, ops: &mut EventOps) {
        if let Some(c) = self.conns.remove(&key) {
            let fd = c.stream.as_raw_fd();
            if c.interest.is_some() {
                if let Err(e) = ops.remove(Events::empty(&c.stream)) {
                    tracing::warn!("vsock: unregistering {key}: {e}");
                }
            }
            self.fds.remove(&fd);
        }
    }

    fn sync_interest(&mut self, key: ConnKey, ops: &mut EventOps) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        c.dirty = false;
        let want = c.desired_interest();
        let res = match (c.interest, want) {
            (None, Some(set)) => ops.add(Events::new(&c.stream, set)),
            (Some(_), None) => ops.remove(Events::empty(&c.stream)),
            (Some(old), Some(new)) if old != new => ops.modify(Events::new(&c.stream, new)),
            _ => Ok(()),
        };
        match res {
            Ok(()) => c.interest = want,
            Err(e) => tracing::error!("vsock: epoll update for {key}: {e}"),
        }
        if c.deadline.is_some() {
            self.arm_timer();
        }
    }

    fn arm_timer(&mut self) {
        if !self.timer_armed {
            match self.timer.reset(TICK, Some(TICK)) {
                Ok(()) => self.timer_armed = true,
                Err(e) => tracing::error!("vsock: arming timer: {e}"),
            }
        }
    }

    fn alloc_local_port(&mut self, peer_port: u32) -> Option<u32> {
        for _ in 0..=MAX_CONNECTIONS {
            let p = self.next_local_port;
            self.next_local_port = if p >= u32::MAX - 1 {
                LOCAL_PORT_BASE
            } else {
                p + 1
            };
            let key = ConnKey {
                local_port: p,
                peer_port,
            };
            if !self.conns.contains_key(&key) {
                return Some(p);
            }
        }
        None
    }

    // ---- guest -> host ----------------------------------------------------------------

    /// Handles the guest's tx queue. Returns true if buffers were used.
    fn process_tx(&mut self, ops: &mut EventOps) -> bool {
        let mem = self.mem.clone();
        let mut used = false;
        while self.rst_queue.len() < RST_QUEUE_MAX / 2 {
            let Some(mut chain) = self.queues[TX_QUEUE].pop_descriptor_chain(&mem) else {
                break;
            };
            let head = chain.head_index();
            match VsockPacket::from_tx_virtq_chain(&mem, &mut chain, MAX_PKT_DATA) {
                Ok(pkt) => self.handle_guest_packet(&pkt, ops),
                Err(e) => guest_warn!(self, "vsock: malformed tx descriptor chain dropped: {e}"),
            }
            if let Err(e) = self.queues[TX_QUEUE].add_used(&mem, head, 0) {
                guest_warn!(self, "vsock: tx used ring: {e}");
            }
            used = true;
        }
        used
    }

    fn handle_guest_packet(&mut self, pkt: &Packet<'_>, ops: &mut EventOps) {
        if pkt.src_cid() != self.guest_cid {
            guest_warn!(
                self,
                "vsock: packet from CID {} (the guest is {}) dropped",
                pkt.src_cid(),
                self.guest_cid
            );
            return;
        }
        let key = ConnKey {
            local_port: pkt.dst_port(),
            peer_port: pkt.src_port(),
        };
        if pkt.dst_cid() != HOST_CID || pkt.type_() != TYPE_STREAM {
            tracing::debug!(
                "vsock: packet to CID {} type {} refused",
                pkt.dst_cid(),
                pkt.type_()
            );
            if pkt.op() != OP_RST {
                let mut h = self.hdr_to_guest(Hdr {
                    src_port: key.local_port,
                    dst_port: key.peer_port,
                    op: OP_RST,
                    ..Hdr::default()
                });
                // Answer from the address the guest tried to reach.
                h.src_cid = pkt.dst_cid();
                if self.rst_queue.len() < RST_QUEUE_MAX {
                    self.rst_queue.push_back(h);
                }
            }
            return;
        }
        let now = Instant::now();
        let Some(conn) = self.conns.get_mut(&key) else {
            match pkt.op() {
                OP_REQUEST => self.guest_connect(key, pkt, ops),
                OP_RST => {}
                _ => self.push_rst(key.local_port, key.peer_port),
            }
            return;
        };
        conn.update_peer_credit(pkt.buf_alloc(), pkt.fwd_cnt());
        let result = match pkt.op() {
            OP_RST => {
                tracing::debug!("vsock: {key} reset by the guest");
                self.forget(key, ops);
                return;
            }
            OP_RESPONSE => {
                tracing::trace!("vsock: {key}: RESPONSE from the guest");
                conn.on_response()
            }
            OP_RW => conn.on_rw(pkt.data_slice(), pkt.len()),
            OP_CREDIT_UPDATE => Ok(()),
            OP_CREDIT_REQUEST => {
                conn.on_credit_request();
                Ok(())
            }
            OP_SHUTDOWN => conn.on_shutdown(pkt.flags(), now),
            OP_REQUEST => Err("connection request for a connection that exists"),
            _ => Err("unknown operation"),
        };
        match result {
            Ok(()) => self.touch(key, ops),
            Err(why) => {
                guest_warn!(self, "vsock: {key}: {why}");
                self.kill(key, why, ops);
            }
        }
    }

    fn guest_connect(&mut self, key: ConnKey, pkt: &Packet<'_>, ops: &mut EventOps) {
        if self.conns.len() >= MAX_CONNECTIONS {
            guest_warn!(self, "vsock: {key}: too many connections, refused");
            self.push_rst(key.local_port, key.peer_port);
            return;
        }
        let stream = match connect_host_port(&self.uds_path, key.local_port) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(
                    "vsock: guest connection to host port {} refused: {}_{}: {e}",
                    key.local_port,
                    self.uds_path.display(),
                    key.local_port
                );
                self.push_rst(key.local_port, key.peer_port);
                return;
            }
        };
        let fd = stream.as_raw_fd();
        let conn = Connection::guest_initiated(stream, key, pkt.buf_alloc(), pkt.fwd_cnt());
        self.conns.insert(key, conn);
        self.fds.insert(fd, Token::Conn(key));
        tracing::debug!("vsock: {key} connected by the guest");
        self.touch(key, ops);
    }

    // ---- host -> guest ----------------------------------------------------------------

    /// Fills guest rx buffers while there is something to send. Returns true if any used.
    fn process_rx(&mut self, ops: &mut EventOps) -> bool {
        let mem = self.mem.clone();
        let mut used = false;
        while !self.rst_queue.is_empty() || !self.rx_order.is_empty() {
            let Some(mut chain) = self.queues[RX_QUEUE].pop_descriptor_chain(&mem) else {
                // Out of buffers: the rx queue notification brings us back.
                break;
            };
            let head = chain.head_index();
            let mut pkt = match VsockPacket::from_rx_virtq_chain(&mem, &mut chain, u32::MAX) {
                Ok(p) => p,
                Err(e) => {
                    guest_warn!(self, "vsock: malformed rx descriptor chain dropped: {e}");
                    if let Err(e) = self.queues[RX_QUEUE].add_used(&mem, head, 0) {
                        guest_warn!(self, "vsock: rx used ring: {e}");
                    }
                    used = true;
                    continue;
                }
            };
            match self.fill_rx(&mut pkt, ops) {
                Some(len) => {
                    tracing::trace!("vsock: rx packet of {len} bytes to the guest");
                    if let Err(e) = self.queues[RX_QUEUE].add_used(&mem, head, len) {
                        guest_warn!(self, "vsock: rx used ring: {e}");
                    }
                    used = true;
                }
                None => {
                    // Nothing to say after all: give the buffer back for later.
                    self.queues[RX_QUEUE].go_to_previous_position();
                    break;
                }
            }
        }
        used
    }

    /// Writes the next packet for the guest into `pkt`; returns the used length.
    fn fill_rx(&mut self, pkt: &mut Packet<'_>, ops: &mut EventOps) -> Option<u32> {
        let now = Instant::now();
        let mut tries = self.rx_order.len();
        loop {
            if let Some(h) = self.rst_queue.pop_front() {
                return self.write_hdr(pkt, &h).then_some(HDR_SIZE as u32);
            }
            if tries == 0 {
                return None;
            }
            tries -= 1;
            let key = self.rx_order.pop_front()?;
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            conn.queued = false;
            let out = conn.next_rx(pkt.data_slice(), now);
            match out {
                Ok(Some((h, len))) => {
                    let h = self.hdr_to_guest(h);
                    self.touch(key, ops);
                    return self.write_hdr(pkt, &h).then_some(HDR_SIZE as u32 + len);
                }
                Ok(None) => self.touch(key, ops),
                Err(why) => self.kill(key, why, ops),
            }
        }
    }

    fn write_hdr(&mut self, pkt: &mut Packet<'_>, h: &Hdr) -> bool {
        match pkt.set_header_from_raw(&h.to_bytes()) {
            Ok(()) => true,
            Err(e) => {
                guest_warn!(self, "vsock: writing an rx header: {e}");
                false
            }
        }
    }

    // ---- host sockets -----------------------------------------------------------------

    fn accept_host_connections(&mut self, ops: &mut EventOps) {
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.pending.len() >= MAX_PENDING_ACCEPTS
                        || self.conns.len() >= MAX_CONNECTIONS
                    {
                        tracing::warn!("vsock: too many host connections, one refused");
                        continue;
                    }
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!("vsock: host connection: {e}");
                        continue;
                    }
                    if let Err(e) = ops.add(Events::new(&stream, EventSet::IN)) {
                        tracing::error!("vsock: registering a host connection: {e}");
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    self.fds.insert(fd, Token::Pending);
                    self.pending.insert(
                        fd,
                        PendingAccept {
                            stream,
                            line: Vec::new(),
                            deadline: Instant::now() + CONNECT_TIMEOUT,
                        },
                    );
                    self.arm_timer();
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // E.g. out of file descriptors: stop polling the listener for a tick
                    // rather than spin on it.
                    tracing::warn!("vsock: accept on {}: {e}", self.uds_path.display());
                    if ops.remove(Events::empty(&self.listener)).is_ok() {
                        self.listener_paused = true;
                        self.arm_timer();
                    }
                    return;
                }
            }
        }
    }

    fn close_pending(&mut self, fd: RawFd, ops: &mut EventOps) {
        if let Some(p) = self.pending.remove(&fd) {
            let _ = ops.remove(Events::empty(&p.stream));
            self.fds.remove(&fd);
        }
    }

    /// Reads the `CONNECT <port>\n` line of an accepted host connection.
    fn on_pending_readable(&mut self, fd: RawFd, ops: &mut EventOps) {
        let Some(p) = self.pending.get_mut(&fd) else {
            return;
        };
        let mut buf = [0u8; MAX_CONNECT_LINE];
        let room = MAX_CONNECT_LINE - p.line.len();
        let n = loop {
            match p.stream.read(&mut buf[..room]) {
                Ok(n) => break n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => break 0,
            }
        };
        if n == 0 {
            tracing::debug!("vsock: host connection closed before its CONNECT line");
            self.close_pending(fd, ops);
            return;
        }
        p.line.extend_from_slice(&buf[..n]);
        let Some(nl) = p.line.iter().position(|&b| b == b'\n') else {
            if p.line.len() >= MAX_CONNECT_LINE {
                tracing::warn!("vsock: host connection sent no CONNECT line, closed");
                self.close_pending(fd, ops);
            }
            return;
        };
        let Some(port) = parse_connect_line(&p.line[..nl]) else {
            tracing::warn!(
                "vsock: host connection sent {:?}, expected \"CONNECT <port>\", closed",
                String::from_utf8_lossy(&p.line[..nl])
            );
            self.close_pending(fd, ops);
            return;
        };
        let Some(local_port) = self.alloc_local_port(port) else {
            tracing::warn!("vsock: no free host port for a connection to guest port {port}");
            self.close_pending(fd, ops);
            return;
        };
        let Some(p) = self.pending.remove(&fd) else {
            return;
        };
        let key = ConnKey {
            local_port,
            peer_port: port,
        };
        let prefix = p.line[nl + 1..].to_vec();
        let conn =
            Connection::host_initiated(p.stream, key, prefix, Some(EventSet::IN), Instant::now());
        self.conns.insert(key, conn);
        self.fds.insert(fd, Token::Conn(key));
        tracing::debug!("vsock: {key} requested by a host program");
        self.touch(key, ops);
    }

    fn on_conn_event(&mut self, key: ConnKey, set: EventSet, ops: &mut EventOps) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        if set.contains(EventSet::ERROR) {
            self.kill(key, "host socket error", ops);
            return;
        }
        if set.contains(EventSet::HANG_UP) {
            c.on_hup();
        }
        if set.contains(EventSet::IN) {
            c.on_readable();
        }
        if set.contains(EventSet::OUT) {
            if let Err(why) = c.flush() {
                self.kill(key, why, ops);
                return;
            }
        }
        self.touch(key, ops);
    }

    fn on_timer(&mut self, ops: &mut EventOps) {
        // Level-triggered: consume the expirations (readable, so this does not block).
        let _ = self.timer.wait();
        let now = Instant::now();
        let expired: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, c)| c.end_reason(now).is_some())
            .map(|(k, _)| *k)
            .collect();
        for key in expired {
            self.touch(key, ops);
        }
        let late: Vec<RawFd> = self
            .pending
            .iter()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in late {
            tracing::warn!("vsock: host connection sent no CONNECT line in time, closed");
            self.close_pending(fd, ops);
        }
        if self.listener_paused && ops.add(Events::new(&self.listener, EventSet::IN)).is_ok() {
            self.listener_paused = false;
        }
        let needed = self.listener_paused
            || self.reset_sent.is_some()
            || !self.pending.is_empty()
            || self.conns.values().any(|c| c.deadline.is_some());
        if !needed {
            match self.timer.reset(Duration::ZERO, None) {
                Ok(()) => self.timer_armed = false,
                Err(e) => tracing::error!("vsock: disarming timer: {e}"),
            }
        }
    }
}

impl QueueWorker for VsockWorker {
    const NAME: &'static str = "vsock";
    type Progress = super::VsockProgress;

    fn queues(&self) -> &[Queue] {
        &self.queues
    }

    fn notifiers(&self) -> &[EventFd] {
        &self.evts
    }

    fn init(&mut self, ops: &mut EventOps) {
        for (fd, what) in [
            (self.listener.as_raw_fd(), "listening socket"),
            (self.timer.as_raw_fd(), "timer"),
        ] {
            if let Err(e) = ops.add(Events::new_raw(fd, EventSet::IN)) {
                tracing::error!("vsock: registering the {what}: {e}");
            }
        }
    }

    fn first_round(&mut self, ops: &mut EventOps) {
        if std::mem::take(&mut self.reset_transport) {
            self.send_transport_reset();
        }
        self.run(ops);
    }

    fn notified(&mut self, q: usize) -> bool {
        // The event queue only returns buffers the device never uses, except the one
        // that says a transport reset was taken.
        q != EVENT_QUEUE || self.reset_sent.is_some()
    }

    fn on_event(&mut self, events: Events, ops: &mut EventOps) -> bool {
        let fd = events.fd();
        if fd == self.listener.as_raw_fd() {
            self.accept_host_connections(ops);
        } else if fd == self.timer.as_raw_fd() {
            self.on_timer(ops);
        } else {
            match self.fds.get(&fd).copied() {
                Some(Token::Conn(key)) => self.on_conn_event(key, events.event_set(), ops),
                Some(Token::Pending) => self.on_pending_readable(fd, ops),
                None => unregister_unknown(Self::NAME, fd, ops),
            }
        }
        true
    }

    fn publish(&self, progress: &mut super::VsockProgress) {
        progress.connections = self.conns.len();
    }

    /// Moves packets until neither queue makes progress, then updates epoll registrations
    /// and interrupts the guest if buffers were used.
    fn set_memory(&mut self, mem: GuestMemory) {
        self.mem = mem;
    }

    fn run(&mut self, ops: &mut EventOps) {
        let mut rx_used = false;
        let mut tx_used = false;
        let rx_open = self.rx_open();
        for _ in 0..MAX_ROUNDS {
            let t = self.process_tx(ops);
            let r = rx_open && self.process_rx(ops);
            tx_used |= t;
            rx_used |= r;
            if !t && !r {
                break;
            }
        }
        while let Some(key) = self.dirty.pop() {
            self.sync_interest(key, ops);
        }
        let mut notify = false;
        for (q, used) in [(RX_QUEUE, rx_used), (TX_QUEUE, tx_used)] {
            if used {
                // Without EVENT_IDX this is always true; an unreadable ring: notify anyway.
                notify |= self.queues[q].needs_notification(&self.mem).unwrap_or(true);
            }
        }
        if notify {
            self.interrupt.signal_used_queue();
        }
    }
}

//! A virtio-vsock driver and a responder for the Clade agent protocol on port 52: the
//! `vsock` step.
//!
//! The step serves connection after connection, up to [`MAX_CONNS`] at once, each an
//! independent agent session, until the host stops the VM (or, if the command line asks
//! for it, until a number of connections have ended). The host connects through the VMM's
//! Unix socket (`CONNECT 52\n`); the device sends us an OP_REQUEST, we answer OP_RESPONSE
//! (or RST when every slot is taken) and then serve `Hello` and `Ping` frames (see
//! [`crate::agent`]) until the host closes the connection, or until we have answered the
//! number of pings the step asked for, in which case we close it.
//!
//! Idle like a kernel: while there is work the driver polls the used rings (memory reads,
//! no exits) with device interrupts suppressed; once idle (after `poll_us=` without work,
//! [`POLL_WINDOW_US`] by default) it asks the device for interrupts on the rx and event
//! queues, checks the rings once more (a packet that arrived before the request would
//! raise no interrupt) and halts until the interrupt comes (see
//! [`crate::interrupts::wait_for_interrupt`] for the race between enabling interrupts and
//! `hlt`). By default it halts as soon as it is idle, as a Linux guest does (its
//! guest-side poll driver, cpuidle-haltpoll, is used only when the host hints at dedicated
//! CPUs): the short poll window before sleeping is the host's, KVM's halt-polling, which
//! keeps a halted vCPU's thread polling for a while (adapted per vCPU) and stops as soon as
//! another task wants its CPU. A guest-side window (`poll_us=N`) applies while a host
//! connection is open (the host's next request comes on it); with none open the driver
//! halts as soon as it is idle, so a restored or forked guest, whose connections the
//! transport reset ended, does not spin away the CPU its siblings are being built and
//! answering on.
//!
//! Packet header and flow control follow the virtio spec (5.10): every packet we send
//! carries our receive buffer size (`buf_alloc`) and how many bytes we have consumed of it
//! (`fwd_cnt`); the host may have at most `buf_alloc` bytes in flight. We only send as many
//! bytes as the host's advertised credit allows, and ask for more (CREDIT_REQUEST) when it
//! runs out.

use crate::agent::{self, Handled, Session};
use crate::steps::Reason;
use crate::virtio::{Dma, Ring, Transport, Virtqueue, F_VERSION_1, QSIZE};
use crate::{apic, clock, interrupts, serial};
use core::fmt::Write as _;
use core::ptr::{addr_of_mut, copy_nonoverlapping, read_volatile};
use core::sync::atomic::{AtomicU32, Ordering};

pub const DEVICE_ID: u32 = 19;
const HOST_CID: u64 = 2;

const RX_QUEUE: u32 = 0;
const TX_QUEUE: u32 = 1;
const EVENT_QUEUE: u32 = 2;

/// `struct virtio_vsock_hdr` (packed, little-endian).
const HDR_LEN: usize = 44;
const TYPE_STREAM: u16 = 1;
const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;
const SHUTDOWN_RCV: u32 = 1;
const SHUTDOWN_SEND: u32 = 2;
const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;
/// virtio_vsock_event id: the device lost all connections (e.g. after migration).
const EVENT_TRANSPORT_RESET: u32 = 0;

/// Receive buffers: header and data in one device-writable descriptor each.
const RX_BUF: usize = 4096;
/// Transmit buffers: header and data in one device-readable descriptor each.
const TX_BUF: usize = 1024;
const EVENT_BUF: usize = 8;
/// Refill the rx queue (and notify the device) once fewer buffers than this are posted.
const RX_REFILL_BELOW: usize = QSIZE / 2;

/// Our receive buffer per connection, advertised as `buf_alloc`: the most the host may send
/// that we have not consumed yet. Frames up to this size (length prefix included) are
/// answered; larger ones are skipped with an error reply.
const IN_CAP: usize = 8192;
/// Replies waiting for host credit or a tx buffer.
const OUT_CAP: usize = 4096;

/// How long the device may take to hand back a transmit buffer before we give up.
const TX_STALL_MS: u64 = 5000;

/// Connections served at once; a connection request beyond them is answered with RST.
pub const MAX_CONNS: usize = 8;

/// Default time without work before the driver halts while a host connection is open
/// (command line: `poll_us=`): none. Measured on a 2-CPU host, `clade bench fork --mem 1G
/// -n 10` (child first ping p50, 8 alternated runs each, us): halting at once 1401-2363
/// (median ~1700); a 30 us window 1851-2785; a 100 us window 1543-3932 (median ~2250):
/// ten children answering at once, each window is CPU time their own host threads (the
/// device worker, the pinger) wait for. What halting costs instead: an agent ping's round
/// trip on an open connection, 28 us polling, 47-56 us halting (the host's halt-polling
/// catches most wake-ups), and a restore's first ping ~45 us more.
pub const POLL_WINDOW_US: u64 = 0;

/// Interrupt vector of the device's IOAPIC pin (GSI 6 + slot).
const VEC_VSOCK: u8 = 0x32;
/// IOAPIC pin of virtio-mmio slot n is 6 + n (devices/src/virtio/mod.rs).
const FIRST_VIRTIO_GSI: u64 = 6;

/// Device interrupts taken (each ends a halt).
static WAKEUPS: AtomicU32 = AtomicU32::new(0);

/// The device's interrupt handler. It only counts: the work is found by polling the rings
/// after the halt ends. InterruptStatus is deliberately neither read nor acknowledged: the
/// pin is edge-triggered (an irqfd pulse per signal), so an unacknowledged status bit does
/// not hold the line, and each register access would be an exit to the VMM (~30 us here).
fn on_vsock_interrupt() {
    WAKEUPS.fetch_add(1, Ordering::Relaxed);
}

/// Rings and buffers the device uses, page-aligned in .bss (inside the guest image, which
/// the VMM keeps its own structures out of).
#[repr(C, align(4096))]
struct Mem {
    rings: [Ring; 3],
    rx: [[u8; RX_BUF]; QSIZE],
    tx: [[u8; TX_BUF]; QSIZE],
    event: [[u8; EVENT_BUF]; QSIZE],
}

static MEM: Dma<Mem> = Dma::new(Mem {
    rings: [Ring::ZERO; 3],
    rx: [[0; RX_BUF]; QSIZE],
    tx: [[0; TX_BUF]; QSIZE],
    event: [[0; EVENT_BUF]; QSIZE],
});

fn rx_buf(id: u16) -> *mut u8 {
    // SAFETY: address computation only.
    unsafe { addr_of_mut!((*MEM.get()).rx[id as usize]) as *mut u8 }
}

fn tx_buf(id: u16) -> *mut u8 {
    // SAFETY: address computation only.
    unsafe { addr_of_mut!((*MEM.get()).tx[id as usize]) as *mut u8 }
}

fn event_buf(id: u16) -> *mut u8 {
    // SAFETY: address computation only.
    unsafe { addr_of_mut!((*MEM.get()).event[id as usize]) as *mut u8 }
}

#[derive(Debug, Clone, Copy, Default)]
struct Hdr {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    type_: u16,
    op: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
}

impl Hdr {
    fn parse(b: &[u8; HDR_LEN]) -> Hdr {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap());
        Hdr {
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

    fn bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
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
}

/// A fixed-capacity byte queue.
struct ByteBuf<const N: usize> {
    b: [u8; N],
    len: usize,
}

impl<const N: usize> ByteBuf<N> {
    const fn new() -> Self {
        ByteBuf { b: [0; N], len: 0 }
    }

    fn data(&self) -> &[u8] {
        &self.b[..self.len]
    }

    fn room(&self) -> usize {
        N - self.len
    }

    /// Appends all of `d`; the caller checked `room()`.
    fn push(&mut self, d: &[u8]) {
        self.b[self.len..self.len + d.len()].copy_from_slice(d);
        self.len += d.len();
    }

    fn consume(&mut self, n: usize) {
        self.b.copy_within(n..self.len, 0);
        self.len -= n;
    }

    fn clear(&mut self) {
        self.len = 0;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// A free slot of the connection table.
    Free,
    Established,
    /// We sent SHUTDOWN(RCV|SEND); the device answers with RST once the host has it all.
    Closing,
    Closed,
}

/// One connection (a slot of the connection table).
struct Conn {
    state: State,
    /// The host-side port (the device allocates one per host connection).
    peer_port: u32,
    // host -> guest
    input: ByteBuf<IN_CAP>,
    /// Bytes received on this connection.
    rx_cnt: u32,
    /// Bytes consumed (taken out of `input` or skipped): our `fwd_cnt`.
    fwd_cnt: u32,
    /// `fwd_cnt` as last told to the host.
    fwd_cnt_sent: u32,
    /// Bytes of an oversized frame still to drop.
    skip: u32,
    // guest -> host
    output: ByteBuf<OUT_CAP>,
    tx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    credit_requested: bool,
    /// SHUTDOWN flags the host sent.
    peer_shutdown: u32,
    /// Close once the replies are out (ping limit reached, or an unframeable length).
    close_when_flushed: bool,
    session: Session,
    why_closed: &'static str,
    hellos: u32,
    pings: u32,
    refused: u32,
}

impl Conn {
    const fn new() -> Conn {
        Conn {
            state: State::Free,
            peer_port: 0,
            input: ByteBuf::new(),
            rx_cnt: 0,
            fwd_cnt: 0,
            fwd_cnt_sent: 0,
            skip: 0,
            output: ByteBuf::new(),
            tx_cnt: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            credit_requested: false,
            peer_shutdown: 0,
            close_when_flushed: false,
            session: Session::new(IN_CAP as u32 - 4),
            why_closed: "",
            hellos: 0,
            pings: 0,
            refused: 0,
        }
    }

    /// Makes the slot free and new, without rewriting the buffers' contents (only their
    /// lengths): a forked child copies each guest page it writes first.
    fn reset(&mut self) {
        self.input.clear();
        self.output.clear();
        self.state = State::Free;
        self.peer_port = 0;
        self.rx_cnt = 0;
        self.fwd_cnt = 0;
        self.fwd_cnt_sent = 0;
        self.skip = 0;
        self.tx_cnt = 0;
        self.peer_buf_alloc = 0;
        self.peer_fwd_cnt = 0;
        self.credit_requested = false;
        self.peer_shutdown = 0;
        self.close_when_flushed = false;
        self.session = Session::new(IN_CAP as u32 - 4);
        self.why_closed = "";
        self.hellos = 0;
        self.pings = 0;
        self.refused = 0;
    }

    fn in_use(&self) -> bool {
        matches!(self.state, State::Established | State::Closing)
    }

    /// What the host may still send us, as it knows it.
    fn peer_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn consumed(&mut self, n: usize) {
        self.fwd_cnt = self.fwd_cnt.wrapping_add(n as u32);
    }

    /// Answers every complete frame in `input` (while there is room for replies). Returns
    /// true if anything was consumed. Pings beyond `limit` are left unanswered.
    fn process(&mut self, limit: Option<u32>) -> bool {
        let mut worked = false;
        while self.state == State::Established
            && !self.close_when_flushed
            && self.skip == 0
            && self.input.len >= 4
            && self.output.room() >= agent::MAX_REPLY
        {
            let data = self.input.data();
            let len = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            if len > agent::MAX_FRAME_LEN {
                // As the real agent: the stream is no longer at a frame boundary.
                let mut e = agent::error(
                    0,
                    agent::E_FRAME_TOO_LARGE,
                    "frame length exceeds 1048576; closing the connection",
                );
                self.output.push(e.finish());
                self.refused += 1;
                self.close_when_flushed = true;
                self.why_closed = "guest closed it after a frame length above the limit";
                let n = self.input.len;
                self.input.clear();
                self.consumed(n);
                return true;
            }
            let total = 4 + len as usize;
            if total > IN_CAP {
                // Valid for the protocol but too big for this guest: answer, then drop it.
                if data.len() < 4 + agent::FRAME_HEADER_LEN {
                    break;
                }
                let id = u32::from_le_bytes([data[5], data[6], data[7], data[8]]);
                let mut e = agent::error(
                    id,
                    agent::E_UNSUPPORTED,
                    "frame larger than the native test guest's 8 KiB buffer",
                );
                self.output.push(e.finish());
                self.refused += 1;
                let n = self.input.len;
                self.input.clear();
                self.consumed(n);
                self.skip = (total - n) as u32;
                worked = true;
                continue;
            }
            if data.len() < total {
                break;
            }
            let (handled, mut reply) = self.session.handle(&data[..total], clock::uptime_ms);
            self.output.push(reply.finish());
            match handled {
                Handled::Hello => self.hellos += 1,
                Handled::Ping => self.pings += 1,
                Handled::Refused => self.refused += 1,
            }
            self.input.consume(total);
            self.consumed(total);
            worked = true;
            if handled == Handled::Ping && Some(self.pings) == limit {
                self.close_when_flushed = true;
                self.why_closed = "guest closed it after the requested number of pings";
            }
        }
        worked
    }
}

/// What the step should serve (command line: `vsock[:CONNS[:PINGS]]`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// End the step once this many connections have ended (None: serve until the VM is
    /// stopped).
    pub conns: Option<u32>,
    /// Close each connection after this many pongs.
    pub pings: Option<u32>,
    /// Command-line settings.
    pub tuning: Tuning,
}

/// The `vsock` step's command-line settings.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// Time without work before halting while a host connection is open, in microseconds
    /// (0: halt as soon as idle; `poll_us=`).
    pub poll_us: u64,
    /// A console line per connection that ends or is dropped by a transport reset
    /// (`conn_log=1`, the default; `conn_log=0`: only the step's totals at its end). Each
    /// byte on the console is an exit to the VMM (~27 us here), so a line keeps the vCPU
    /// in exits for ~2 ms after the connection it reports on; a VM paused meanwhile
    /// writes the rest of the line first thing when it is resumed. A Linux guest logs
    /// nothing per connection: benchmarks of what comes after a connection (a pause and
    /// a wake) run the guest with `conn_log=0`.
    pub conn_log: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            poll_us: POLL_WINDOW_US,
            conn_log: true,
        }
    }
}

/// The step's totals, for its report.
#[derive(Default)]
pub struct Report {
    /// Connections accepted.
    pub accepted: u32,
    /// Connections that ended (closed or reset, not dropped by a transport reset).
    pub conns: u32,
    /// Connection requests refused because every slot was taken (or the limit reached).
    pub refused_conns: u32,
    /// Connections dropped by transport resets.
    pub dropped: u32,
    /// Packets for our CID before a transport reset changed it, dropped.
    pub stale: u32,
    /// Times the guest halted, and device interrupts taken.
    pub halts: u64,
    pub wakeups: u32,
}

/// The connection table, in .bss: 8 connections with their buffers are ~100 KiB, more
/// than the boot stack.
struct Table(core::cell::UnsafeCell<[Conn; MAX_CONNS]>);

// SAFETY: one CPU; only `run` (not interrupt handlers) touches the table, through the one
// `&mut` it takes per step.
unsafe impl Sync for Table {}

static CONNS: Table = Table(core::cell::UnsafeCell::new(
    [const { Conn::new() }; MAX_CONNS],
));

struct Driver {
    t: Transport,
    cid: u64,
    rxq: Virtqueue,
    txq: Virtqueue,
    evq: Virtqueue,
    /// Bit i set: tx descriptor i is ours.
    tx_free: u32,
    /// Rx buffers taken from the used ring, not yet given back.
    rx_done: [u16; QSIZE],
    rx_done_len: usize,
    /// Rx buffers the device holds.
    rx_posted: usize,
    /// The step's console lines, written once the guest is idle (see
    /// [`serial::Deferred`]).
    log: serial::Deferred,
}

type Res<T> = Result<T, &'static str>;

impl Driver {
    /// Finds the device and brings it up (virtio spec 3.1.1 and 5.10.6).
    fn init() -> Res<Driver> {
        let t =
            Transport::find(DEVICE_ID).ok_or("no virtio-vsock device in any virtio-mmio slot")?;
        if let Err(e) = t.negotiate(F_VERSION_1) {
            t.fail();
            return Err(e);
        }
        // SAFETY: the rings are used by this driver and the device only.
        let rings = unsafe { addr_of_mut!((*MEM.get()).rings) as *mut Ring };
        // SAFETY: three distinct pages of MEM.
        let (rxq, txq, evq) = unsafe {
            (
                Virtqueue::new(rings),
                Virtqueue::new(rings.add(1)),
                Virtqueue::new(rings.add(2)),
            )
        };
        let mut d = Driver {
            t,
            cid: 0,
            rxq,
            txq,
            evq,
            tx_free: (1u32 << QSIZE) - 1,
            rx_done: [0; QSIZE],
            rx_done_len: 0,
            rx_posted: 0,
            log: serial::Deferred::new(),
        };
        for i in 0..QSIZE as u16 {
            d.rxq.set_desc(i, rx_buf(i) as u64, RX_BUF as u32, true);
            d.rxq.push(i);
            d.txq.set_desc(i, tx_buf(i) as u64, TX_BUF as u32, false);
            d.evq
                .set_desc(i, event_buf(i) as u64, EVENT_BUF as u32, true);
            d.evq.push(i);
        }
        d.rx_posted = QSIZE;
        let setup = [
            (RX_QUEUE, &d.rxq),
            (TX_QUEUE, &d.txq),
            (EVENT_QUEUE, &d.evq),
        ]
        .into_iter()
        .try_for_each(|(i, q)| d.t.setup_queue(i, q));
        if let Err(e) = setup {
            d.t.fail();
            return Err(e);
        }
        // struct virtio_vsock_config { le64 guest_cid; }
        d.cid = u64::from(d.t.config_read32(0)) | u64::from(d.t.config_read32(4)) << 32;
        if let Err(e) = d.t.driver_ok() {
            d.t.fail();
            return Err(e);
        }
        // Buffers were made available before DRIVER_OK; notifications only after it.
        d.t.notify(RX_QUEUE);
        d.t.notify(EVENT_QUEUE);
        Ok(d)
    }

    fn reclaim_tx(&mut self) -> bool {
        let mut any = false;
        while let Some((id, _)) = self.txq.pop_used() {
            self.tx_free |= 1 << (id as usize % QSIZE);
            any = true;
        }
        any
    }

    /// Sends one packet (header + `data`, at most TX_BUF - HDR_LEN bytes) to the host.
    fn send(&mut self, mut h: Hdr, data: &[u8]) -> Res<()> {
        let deadline = clock::deadline_ms(TX_STALL_MS);
        while self.tx_free == 0 {
            if !self.reclaim_tx() {
                if clock::passed(deadline) {
                    return Err("the device stopped taking transmit buffers");
                }
                core::hint::spin_loop();
            }
        }
        let id = self.tx_free.trailing_zeros() as u16;
        self.tx_free &= !(1 << id);
        h.src_cid = self.cid;
        h.dst_cid = HOST_CID;
        h.type_ = TYPE_STREAM;
        h.len = data.len() as u32;
        let buf = tx_buf(id);
        // SAFETY: the buffer is ours until the device uses it, and large enough.
        unsafe {
            copy_nonoverlapping(h.bytes().as_ptr(), buf, HDR_LEN);
            copy_nonoverlapping(data.as_ptr(), buf.add(HDR_LEN), data.len());
        }
        self.txq.set_len(id, (HDR_LEN + data.len()) as u32);
        self.txq.push(id);
        if self.txq.device_wants_notify() {
            self.t.notify(TX_QUEUE);
        }
        Ok(())
    }

    /// A reset for a packet that names no connection of ours.
    fn send_rst(&mut self, to: &Hdr) -> Res<()> {
        self.send(
            Hdr {
                src_port: to.dst_port,
                dst_port: to.src_port,
                op: OP_RST,
                ..Hdr::default()
            },
            &[],
        )
    }

    /// A packet on the connection; carries our receive-buffer state.
    fn send_conn(&mut self, c: &mut Conn, op: u16, flags: u32, data: &[u8]) -> Res<()> {
        c.fwd_cnt_sent = c.fwd_cnt;
        self.send(
            Hdr {
                src_port: agent::AGENT_PORT,
                dst_port: c.peer_port,
                op,
                flags,
                buf_alloc: IN_CAP as u32,
                fwd_cnt: c.fwd_cnt,
                ..Hdr::default()
            },
            data,
        )
    }

    /// Gives consumed rx buffers back when the device is running low.
    fn refill_rx(&mut self) {
        if self.rx_posted >= RX_REFILL_BELOW || self.rx_done_len == 0 {
            return;
        }
        for i in 0..self.rx_done_len {
            self.rxq.push(self.rx_done[i]);
        }
        self.rx_posted += self.rx_done_len;
        self.rx_done_len = 0;
        if self.rxq.device_wants_notify() {
            self.t.notify(RX_QUEUE);
        }
    }

    /// Handles one received packet.
    fn on_rx(
        &mut self,
        id: u16,
        used_len: u32,
        conns: &mut [Conn],
        limits: &Limits,
        report: &mut Report,
    ) -> Res<()> {
        let buf = rx_buf(id);
        if (used_len as usize) < HDR_LEN || used_len as usize > RX_BUF {
            return Err("device returned an rx buffer with a bad length");
        }
        // SAFETY: the device is done with the buffer (it is in the used ring).
        let h = Hdr::parse(&unsafe { read_volatile(buf as *const [u8; HDR_LEN]) });
        if h.len as usize > used_len as usize - HDR_LEN {
            return Err("rx packet longer than what the device wrote");
        }
        if h.src_cid != HOST_CID || h.type_ != TYPE_STREAM {
            return Err("rx packet with a wrong source or type");
        }
        if h.dst_cid != self.cid {
            // Sent to the CID we had before a transport reset gave us a new one (a fork):
            // its connection is gone. Linux drops these too.
            report.stale += 1;
            return Ok(());
        }
        let found = conns.iter().position(|c| {
            c.in_use() && h.dst_port == agent::AGENT_PORT && h.src_port == c.peer_port
        });
        if h.op == OP_REQUEST && found.is_none() {
            // With a limit, only that many connections are accepted in all: a connection
            // accepted only to be reset when the step ends could not be retried.
            let free = conns
                .iter()
                .position(|c| c.state == State::Free)
                .filter(|_| limits.conns.is_none_or(|n| report.accepted < n));
            return match free {
                Some(i) if h.dst_port == agent::AGENT_PORT => {
                    report.accepted += 1;
                    let c = &mut conns[i];
                    c.reset();
                    c.state = State::Established;
                    c.peer_port = h.src_port;
                    c.peer_buf_alloc = h.buf_alloc;
                    c.peer_fwd_cnt = h.fwd_cnt;
                    self.send_conn(c, OP_RESPONSE, 0, &[])
                }
                // Nothing listens there, or every slot is busy.
                _ => {
                    if h.dst_port == agent::AGENT_PORT {
                        report.refused_conns += 1;
                    }
                    self.send_rst(&h)
                }
            };
        }
        let Some(i) = found else {
            return if h.op == OP_RST {
                Ok(())
            } else {
                self.send_rst(&h)
            };
        };
        let c = &mut conns[i];
        c.peer_buf_alloc = h.buf_alloc;
        c.peer_fwd_cnt = h.fwd_cnt;
        c.credit_requested = false;
        match h.op {
            OP_RW => {
                if c.peer_shutdown & SHUTDOWN_SEND != 0 {
                    return self.abort(c, "host sent data after shutting down sending");
                }
                let mut n = h.len as usize;
                c.rx_cnt = c.rx_cnt.wrapping_add(n as u32);
                // SAFETY: n bytes of data follow the header inside the buffer (checked).
                let mut src = unsafe { buf.add(HDR_LEN) };
                let drop = n.min(c.skip as usize);
                c.skip -= drop as u32;
                c.consumed(drop);
                n -= drop;
                // SAFETY: within the same buffer.
                src = unsafe { src.add(drop) };
                if n > c.input.room() || c.state == State::Closing {
                    if c.state == State::Closing {
                        // We stopped reading; the host could not know yet.
                        c.consumed(n);
                        return Ok(());
                    }
                    return self.abort(c, "host sent more than its credit");
                }
                let dst = c.input.b[c.input.len..].as_mut_ptr();
                // SAFETY: room checked; the device is done with the source buffer.
                unsafe { copy_nonoverlapping(src, dst, n) };
                c.input.len += n;
                Ok(())
            }
            OP_CREDIT_UPDATE => Ok(()),
            OP_CREDIT_REQUEST => self.send_conn(c, OP_CREDIT_UPDATE, 0, &[]),
            OP_SHUTDOWN => {
                c.peer_shutdown |= h.flags & SHUTDOWN_BOTH;
                Ok(())
            }
            OP_RST => {
                if c.state == State::Established {
                    c.why_closed = "host reset it";
                }
                c.state = State::Closed;
                Ok(())
            }
            _ => self.abort(c, "unexpected packet on an established connection"),
        }
    }

    /// Ends the connection with a reset.
    fn abort(&mut self, c: &mut Conn, why: &'static str) -> Res<()> {
        c.why_closed = why;
        c.state = State::Closed;
        self.send_conn(c, OP_RST, 0, &[])
    }

    /// Sends queued replies as far as the host's credit allows.
    fn flush(&mut self, c: &mut Conn) -> Res<bool> {
        if c.peer_shutdown & SHUTDOWN_RCV != 0 {
            // The host reads nothing more.
            c.output.clear();
        }
        let mut sent = false;
        while c.state == State::Established && c.output.len > 0 {
            let credit = c.peer_credit() as usize;
            if credit == 0 {
                if !c.credit_requested {
                    c.credit_requested = true;
                    self.send_conn(c, OP_CREDIT_REQUEST, 0, &[])?;
                }
                break;
            }
            let n = c.output.len.min(credit).min(TX_BUF - HDR_LEN);
            let mut chunk = [0u8; TX_BUF - HDR_LEN];
            chunk[..n].copy_from_slice(&c.output.data()[..n]);
            self.send_conn(c, OP_RW, 0, &chunk[..n])?;
            c.tx_cnt = c.tx_cnt.wrapping_add(n as u32);
            c.output.consume(n);
            sent = true;
        }
        // Tell the host about consumed input it does not know of yet, before it runs dry.
        if c.state == State::Established
            && c.fwd_cnt.wrapping_sub(c.fwd_cnt_sent) as usize >= IN_CAP / 2
        {
            self.send_conn(c, OP_CREDIT_UPDATE, 0, &[])?;
            sent = true;
        }
        Ok(sent)
    }

    /// Decides whether the connection ends, after input and output were handled.
    fn close_if_done(&mut self, c: &mut Conn, worked: bool) -> Res<()> {
        if c.state != State::Established {
            if c.state == State::Closing && c.peer_shutdown == SHUTDOWN_BOTH {
                // The host is gone too; nothing more will come.
                c.state = State::Closed;
                return self.send_conn(c, OP_RST, 0, &[]);
            }
            return Ok(());
        }
        if c.peer_shutdown == SHUTDOWN_BOTH {
            c.why_closed = "host closed it";
            c.state = State::Closed;
            return self.send_conn(c, OP_RST, 0, &[]);
        }
        let flushed = c.output.len == 0;
        let host_done = c.peer_shutdown & SHUTDOWN_SEND != 0 && !worked;
        if flushed && (host_done || c.close_when_flushed) {
            if host_done {
                c.why_closed = "host shut down sending";
            }
            c.state = State::Closing;
            self.send_conn(c, OP_SHUTDOWN, SHUTDOWN_BOTH, &[])?;
        }
        Ok(())
    }

    /// Takes what the device returned and answers it: one round of the polling loop.
    /// Returns whether anything happened.
    fn poll(&mut self, conns: &mut [Conn], limits: &Limits, report: &mut Report) -> Res<bool> {
        let mut progress = self.reclaim_tx();
        while let Some((id, len)) = self.evq.pop_used() {
            // SAFETY: the device is done with the buffer.
            let ev = unsafe { read_volatile(event_buf(id) as *const [u8; 4]) };
            self.evq.push(id);
            self.t.notify(EVENT_QUEUE);
            progress = true;
            if len >= 4 && u32::from_le_bytes(ev) == EVENT_TRANSPORT_RESET {
                // Every connection is gone (the VM was resumed from a snapshot taken with
                // some open, or forked with a new CID); like Linux, read the CID again and
                // keep listening.
                self.cid =
                    u64::from(self.t.config_read32(0)) | u64::from(self.t.config_read32(4)) << 32;
                let mut n = 0;
                for c in conns.iter_mut().filter(|c| c.state != State::Free) {
                    c.reset();
                    n += 1;
                }
                report.dropped += n;
                // They never ended: they do not count against a limit.
                report.accepted = report.accepted.saturating_sub(n);
                // Every restore sends one: only worth a line when it dropped something.
                if n > 0 && limits.tuning.conn_log {
                    let _ = writeln!(
                        self.log,
                        "vsock: a transport reset dropped {} open connection(s)",
                        n
                    );
                }
            }
        }
        while let Some((id, len)) = self.rxq.pop_used() {
            self.rx_posted -= 1;
            let r = self.on_rx(id, len, conns, limits, report);
            self.rx_done[self.rx_done_len] = id;
            self.rx_done_len += 1;
            r?;
            progress = true;
        }
        self.refill_rx();
        for c in conns.iter_mut().filter(|c| c.state != State::Free) {
            let worked = c.process(limits.pings);
            progress |= worked;
            progress |= self.flush(c)?;
            self.close_if_done(c, worked)?;
            if c.state == State::Closed {
                report.conns += 1;
                if limits.tuning.conn_log {
                    let _ = writeln!(
                        self.log,
                        "vsock: host port {} done ({}): {} hello, {} pings, {} error replies",
                        c.peer_port, c.why_closed, c.hellos, c.pings, c.refused
                    );
                }
                c.state = State::Free;
                progress = true;
            }
        }
        Ok(progress)
    }

    /// True if the device has returned buffers we have not taken yet.
    fn pending(&self) -> bool {
        self.rxq.has_used() || self.evq.has_used()
    }

    /// Halts until the device signals new rx or event buffers, unless some arrived already.
    fn idle(&mut self, report: &mut Report) {
        // Ask for interrupts, then look again: a buffer used before the device saw the
        // request raised none.
        self.rxq.set_interrupts(true);
        self.evq.set_interrupts(true);
        if !self.pending() {
            interrupts::wait_for_interrupt();
            report.halts += 1;
        }
        self.rxq.set_interrupts(false);
        self.evq.set_interrupts(false);
    }

    /// Serves connections until the limit (if any) is reached.
    fn serve(&mut self, conns: &mut [Conn], limits: &Limits, report: &mut Report) -> Res<()> {
        let poll_window = clock::us_to_ticks(limits.tuning.poll_us);
        let mut window = 0;
        let mut last_work = clock::rdtsc();
        while limits.conns.is_none_or(|n| report.conns < n) {
            if self.poll(conns, limits, report)? {
                last_work = clock::rdtsc();
                window = if conns.iter().any(|c| c.state != State::Free) {
                    poll_window
                } else {
                    0
                };
            } else if clock::rdtsc().wrapping_sub(last_work) < window {
                core::hint::spin_loop();
            } else if !self.log.write_one() {
                // Idle past the poll window with the console drained: halt.
                self.idle(report);
                last_work = clock::rdtsc();
            }
            // Console output goes out only once the poll window has passed without work,
            // a byte per round with the rings checked in between: during an exchange with
            // the host (whose next request usually follows within the window) the console
            // neither delays an answer nor keeps the vCPU in exits.
        }
        Ok(())
    }
}

/// Routes the device's interrupt to [`on_vsock_interrupt`]; it only arrives while the
/// driver asks for it (see `Driver::idle`).
fn setup_interrupt(slot: u64) -> u8 {
    let pin = (FIRST_VIRTIO_GSI + slot) as u8;
    interrupts::set_handler(VEC_VSOCK, on_vsock_interrupt);
    apic::mask_pics();
    apic::lapic_enable(interrupts::VEC_SPURIOUS);
    apic::ioapic_route(pin, VEC_VSOCK, apic::lapic_id());
    pin
}

/// The `vsock` step: bring the device up, serve connections, reset the device.
pub fn run(limits: Limits) -> Result<Report, Reason> {
    match clock::calibrate() {
        Some(per_ms) => println!("vsock: TSC {} kHz", per_ms),
        None => println!("vsock: TSC not calibrated (no PIT?): uptime reads 0"),
    }
    let mut d = Driver::init().map_err(|e| Reason::new(format_args!("device setup: {}", e)))?;
    let pin = setup_interrupt(d.t.slot());
    println!(
        "vsock: device in slot {} at {:#x}, guest CID {}, rings at {:#x}, serving agent port {}",
        d.t.slot(),
        d.t.base(),
        d.cid,
        MEM.get() as u64,
        agent::AGENT_PORT
    );
    // SAFETY: the only reference to the table while the step runs (see `Table`).
    let conns = unsafe { &mut *CONNS.0.get() };
    conns.iter_mut().for_each(Conn::reset);
    let mut report = Report::default();
    WAKEUPS.store(0, Ordering::Relaxed);
    // With a limit, every accepted connection has ended when this returns Ok.
    let served = d.serve(conns, &limits, &mut report);
    d.log.flush();
    let device_broke = d.t.needs_reset();
    d.t.reset();
    apic::ioapic_mask(pin);
    interrupts::clear_handler(VEC_VSOCK);
    report.wakeups = WAKEUPS.load(Ordering::Relaxed);
    if let Err(e) = served {
        let pings: u32 = conns.iter().map(|c| c.pings).sum();
        return Err(Reason::new(format_args!(
            "{} (open connections had {} pings)",
            e, pings
        )));
    }
    if device_broke {
        return Err(Reason::new(format_args!("the device asked for a reset")));
    }
    Ok(report)
}

//! vsock device tests: a synthetic guest driver (rings built with virtio-queue's mock
//! helpers in real guest memory) drives the device through its virtio-mmio registers, and
//! real Unix sockets play the host programs. The device's event loop is pumped on the test
//! thread, so every test is deterministic.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_mmio as reg;
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::DescriptorTable;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::event_loop::Manager;
use crate::virtio::mmio::MmioTransport;
use crate::virtio::test_util::{pump, MmioDriver, TempDir};
use crate::BusDevice;

const MEM_SIZE: usize = 64 << 20;
const QSIZE: u16 = 256;
const GUEST_CID: u64 = 3;
/// The synthetic guest's receive buffer per connection.
const GUEST_BUF: u32 = 64 * 1024;
/// Data part of each rx buffer we post (Linux uses 4 KiB).
const RX_DATA: u32 = 4096;
const BUF_STRIDE: u64 = 0x11000;
const WAIT: Duration = Duration::from_secs(10);

fn test_mem() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// One queue as the guest driver sees it. Descriptors are written with virtio-queue's mock
/// descriptor table; the rings are laid out here (the mock's own layout lets the used ring
/// overlap the end of a large available ring).
struct DriverQueue<'a> {
    table: DescriptorTable<'a, GuestMemory>,
    mem: &'a GuestMemory,
    desc: u64,
    avail: u64,
    used: u64,
    bufs: u64,
    free: VecDeque<u16>,
    chains: HashMap<u16, Vec<u16>>,
    avail_idx: u16,
    used_seen: u16,
}

impl<'a> DriverQueue<'a> {
    fn new(mem: &'a GuestMemory, ring: u64, bufs: u64) -> Self {
        let avail = ring + 16 * u64::from(QSIZE);
        let used = (avail + 6 + 2 * u64::from(QSIZE) + 3) & !3;
        // Zeroed rings: flags 0, indexes 0.
        mem.write_slice(&[0u8; 0x4000], GuestAddress(ring)).unwrap();
        Self {
            table: DescriptorTable::new(mem, GuestAddress(ring), QSIZE),
            mem,
            desc: ring,
            avail,
            used,
            bufs,
            free: (0..QSIZE).collect(),
            chains: HashMap::new(),
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// Buffer address of descriptor `i` (each descriptor owns a fixed 68 KiB area).
    fn buf(&self, i: u16) -> u64 {
        self.bufs + u64::from(i) * BUF_STRIDE
    }

    /// Publishes a chain of raw descriptors (addr, len, device-writable) and returns its head.
    fn add_raw(&mut self, descs: &[(u64, u32, bool)]) -> u16 {
        let idx: Vec<u16> = (0..descs.len())
            .map(|_| self.free.pop_front().expect("descriptors exhausted"))
            .collect();
        for (n, &(addr, len, write)) in descs.iter().enumerate() {
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            let next = if n + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
                idx[n + 1]
            } else {
                0
            };
            let d = SplitDescriptor::new(addr, len, flags, next);
            self.table.store(idx[n], RawDescriptor::from(d)).unwrap();
        }
        let head = idx[0];
        self.publish(head);
        self.chains.insert(head, idx);
        head
    }

    fn publish(&mut self, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % QSIZE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    /// New used entries (head, len); their descriptors become free again.
    fn take_used(&mut self) -> Vec<(u16, u32)> {
        let mut out = Vec::new();
        let idx: u16 = self.mem.read_obj(GuestAddress(self.used + 2)).unwrap();
        while self.used_seen != idx {
            let e = self.used + 4 + 8 * u64::from(self.used_seen % QSIZE);
            let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(e + 4)).unwrap();
            self.used_seen = self.used_seen.wrapping_add(1);
            let head = id as u16;
            match self.chains.remove(&head) {
                Some(descs) => self.free.extend(descs),
                None => panic!("used id {id} is not an outstanding chain head (len {len})"),
            }
            out.push((head, len));
        }
        out
    }
}

#[derive(Debug, Clone)]
struct Pkt {
    hdr: Hdr,
    data: Vec<u8>,
}

/// Per-connection state of the synthetic guest.
#[derive(Default, Debug)]
struct GuestConn {
    /// Bytes received (all "read" by the guest application at once).
    rx: Vec<u8>,
    /// Host's credit as last seen.
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    tx_cnt: u32,
}

impl GuestConn {
    fn credit(&self) -> u32 {
        self.peer_buf_alloc
            .saturating_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }
}

struct Harness<'a> {
    mem: &'a GuestMemory,
    em: Manager,
    transport: MmioTransport,
    irq: EventFd,
    rx: DriverQueue<'a>,
    tx: DriverQueue<'a>,
    ev: DriverQueue<'a>,
    rx_posted: usize,
    rx_target: usize,
    dir: TempDir,
    path: PathBuf,
    _socket: SocketFile,
    /// Packets received and not yet looked at by the test.
    inbox: Vec<Pkt>,
}

impl MmioDriver for Harness<'_> {
    fn transport(&mut self) -> &mut MmioTransport {
        &mut self.transport
    }
}

impl<'a> Harness<'a> {
    fn new(mem: &'a GuestMemory) -> Self {
        Self::with_rx_buffers(mem, 64)
    }

    fn with_rx_buffers(mem: &'a GuestMemory, rx_target: usize) -> Self {
        let dir = TempDir::new("clade-vsock");
        let path = dir.0.join("v.sock");
        let em = Manager::new().unwrap();
        let (dev, socket) = device(&path, &em);
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let transport =
            MmioTransport::new(mem.clone(), Box::new(dev), irq.try_clone().unwrap()).unwrap();
        let mut h = Self {
            mem,
            em,
            transport,
            irq,
            rx: DriverQueue::new(mem, 0x10000, 0x10_0000),
            tx: DriverQueue::new(mem, 0x20000, 0x10_0000 + 0x120_0000),
            ev: DriverQueue::new(mem, 0x30000, 0x10_0000 + 0x240_0000),
            rx_posted: 0,
            rx_target,
            dir,
            path,
            _socket: socket,
            inbox: Vec::new(),
        };
        h.driver_init();
        h.post_rx();
        h.pump();
        h
    }

    /// What Linux's virtio_mmio + virtio_vsock do on probe.
    fn driver_init(&mut self) {
        // Only VIRTIO_F_VERSION_1 is offered.
        assert_eq!(self.negotiate(u64::MAX) >> 32, 1);
        let rings: Vec<(u64, u64, u64)> = [&self.rx, &self.tx, &self.ev]
            .iter()
            .map(|q| (q.desc, q.avail, q.used))
            .collect();
        for (i, r) in rings.into_iter().enumerate() {
            self.setup_queue(i as u32, QSIZE, QSIZE, r);
        }
        self.write(reg::VIRTIO_MMIO_STATUS, 0xf);
        assert_eq!(self.read(reg::VIRTIO_MMIO_STATUS), 0xf, "activation failed");
        assert!(self.transport.is_active());
    }

    fn notify(&mut self, q: u32) {
        self.write(reg::VIRTIO_MMIO_QUEUE_NOTIFY, q);
    }

    /// Runs the event loop until it has nothing more to do right now.
    fn pump(&mut self) {
        pump(&mut self.em, 1000);
        self.collect();
    }

    /// Pumps (waiting for events up to 10 ms at a time) until `cond` holds.
    fn pump_until(&mut self, what: &str, mut cond: impl FnMut(&mut Self) -> bool) {
        let t = Instant::now();
        loop {
            self.em.run_with_timeout(10).unwrap();
            self.collect();
            if cond(self) {
                return;
            }
            assert!(t.elapsed() < WAIT, "timed out waiting for {what}");
        }
    }

    /// Keeps `rx_target` rx buffers (44-byte header + 4 KiB data descriptors) posted.
    fn post_rx(&mut self) {
        let mut added = false;
        while self.rx_posted < self.rx_target {
            let h = self.rx.free[0];
            let a = self.rx.buf(h);
            self.rx
                .add_raw(&[(a, HDR_SIZE as u32, true), (a + 0x100, RX_DATA, true)]);
            self.rx_posted += 1;
            added = true;
        }
        if added {
            self.notify(RX_QUEUE as u32);
        }
    }

    /// Moves completed rx buffers into the inbox and reposts.
    fn collect(&mut self) {
        for (head, len) in self.rx.take_used() {
            self.rx_posted -= 1;
            let a = self.rx.buf(head);
            let mut b = [0u8; HDR_SIZE];
            self.mem.read_slice(&mut b, GuestAddress(a)).unwrap();
            let hdr = Hdr::from_bytes(&b);
            assert_eq!(
                len as usize,
                HDR_SIZE + hdr.len as usize,
                "used length of {hdr:?} head {head}"
            );
            let mut data = vec![0u8; hdr.len as usize];
            self.mem
                .read_slice(&mut data, GuestAddress(a + 0x100))
                .unwrap();
            self.inbox.push(Pkt { hdr, data });
        }
        self.tx.take_used();
        self.post_rx();
    }

    fn take(&mut self) -> Vec<Pkt> {
        std::mem::take(&mut self.inbox)
    }

    /// The guest sends one packet (header and data in separate descriptors, like Linux).
    fn send(&mut self, hdr: Hdr, data: &[u8]) {
        let h = self.tx.free[0];
        let a = self.tx.buf(h);
        self.mem
            .write_slice(&hdr.to_bytes(), GuestAddress(a))
            .unwrap();
        if data.is_empty() {
            self.tx.add_raw(&[(a, HDR_SIZE as u32, false)]);
        } else {
            self.mem.write_slice(data, GuestAddress(a + 0x100)).unwrap();
            self.tx.add_raw(&[
                (a, HDR_SIZE as u32, false),
                (a + 0x100, data.len() as u32, false),
            ]);
        }
        self.notify(TX_QUEUE as u32);
    }

    fn host_path(&self, port: u32) -> PathBuf {
        PathBuf::from(format!("{}_{port}", self.path.display()))
    }

    fn irq_count(&self) -> u64 {
        self.irq.read().unwrap_or(0)
    }
}

/// A device for `GUEST_CID` at `path`, working on `em`'s loop.
fn device(path: &Path, em: &Manager) -> (VsockDevice, SocketFile) {
    let (listener, socket) = SocketFile::bind(path).unwrap();
    let dev = VsockDevice::new(GUEST_CID, listener, path, em.remote_endpoint()).unwrap();
    (dev, socket)
}

/// A guest packet header: from the guest's `src` port to host port `dst`.
fn gh(op: u16, src: u32, dst: u32) -> Hdr {
    Hdr {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port: src,
        dst_port: dst,
        type_: TYPE_STREAM,
        op,
        buf_alloc: GUEST_BUF,
        ..Hdr::default()
    }
}

fn host_read_available(s: &mut UnixStream) -> (Vec<u8>, bool) {
    s.set_nonblocking(true).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (out, true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return (out, false),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return (out, true),
            Err(e) => panic!("host read: {e}"),
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn accept(l: &UnixListener) -> UnixStream {
    l.set_nonblocking(false).unwrap();
    let (s, _) = l.accept().unwrap();
    s
}

/// Guest connects from `gport` to host `hport`; returns the accepted host stream and the
/// guest's view of the connection.
fn guest_connect(
    h: &mut Harness<'_>,
    l: &UnixListener,
    gport: u32,
    hport: u32,
) -> (UnixStream, GuestConn) {
    h.send(gh(OP_REQUEST, gport, hport), &[]);
    h.pump();
    let s = accept(l);
    let pkts = h.take();
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    let r = &pkts[0].hdr;
    assert_eq!(r.op, OP_RESPONSE);
    assert_eq!(
        (r.src_cid, r.dst_cid, r.src_port, r.dst_port, r.type_),
        (HOST_CID, GUEST_CID, hport, gport, TYPE_STREAM)
    );
    assert_eq!(r.buf_alloc, CONN_BUF_SIZE);
    let gc = GuestConn {
        peer_buf_alloc: r.buf_alloc,
        peer_fwd_cnt: r.fwd_cnt,
        ..GuestConn::default()
    };
    (s, gc)
}

/// A host program connects to guest port `gport`; the guest accepts. Returns the host stream,
/// the host-side port from the `OK` line, and the guest's view.
fn host_connect(h: &mut Harness<'_>, gport: u32, extra: &[u8]) -> (UnixStream, u32, GuestConn) {
    let mut s = UnixStream::connect(&h.path).unwrap();
    let mut line = format!("CONNECT {gport}\n").into_bytes();
    line.extend_from_slice(extra);
    s.write_all(&line).unwrap();
    h.pump_until("the connection request", |h| !h.inbox.is_empty());
    let pkts = h.take();
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    let r = pkts[0].hdr;
    assert_eq!(r.op, OP_REQUEST);
    assert_eq!(
        (r.src_cid, r.dst_cid, r.dst_port),
        (HOST_CID, GUEST_CID, gport)
    );
    assert!(r.src_port >= LOCAL_PORT_BASE);
    let hport = r.src_port;
    let mut resp = gh(OP_RESPONSE, gport, hport);
    resp.buf_alloc = GUEST_BUF;
    h.send(resp, &[]);
    let mut got = Vec::new();
    h.pump_until("the OK line", |_| {
        got.extend(host_read_available(&mut s).0);
        got.contains(&b'\n')
    });
    let expect = format!("OK {hport}\n").into_bytes();
    assert_eq!(&got[..expect.len()], &expect[..]);
    // Anything after the line is guest data; the tests send none before this point.
    assert_eq!(got.len(), expect.len());
    let gc = GuestConn {
        peer_buf_alloc: r.buf_alloc,
        peer_fwd_cnt: r.fwd_cnt,
        ..GuestConn::default()
    };
    (s, hport, gc)
}

/// Applies received packets of connection (gport, hport) to `gc`; returns the others.
fn absorb(pkts: Vec<Pkt>, gport: u32, hport: u32, gc: &mut GuestConn) -> Vec<Pkt> {
    let mut rest = Vec::new();
    for p in pkts {
        if p.hdr.dst_port == gport && p.hdr.src_port == hport {
            gc.peer_buf_alloc = p.hdr.buf_alloc;
            gc.peer_fwd_cnt = p.hdr.fwd_cnt;
            if p.hdr.op == OP_RW {
                gc.rx.extend_from_slice(&p.data);
            } else {
                rest.push(p);
            }
        } else {
            rest.push(p);
        }
    }
    rest
}

#[test]
fn config_space_holds_the_guest_cid() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let mut b = [0u8; 8];
    h.transport.read(0x100, &mut b);
    assert_eq!(u64::from_le_bytes(b), GUEST_CID);
    // Linux reads a 64-bit field as two 32-bit halves.
    assert_eq!(h.read(0x100), GUEST_CID as u32);
    assert_eq!(h.read(0x104), 0);
    assert_eq!(h.read(reg::VIRTIO_MMIO_DEVICE_ID), VSOCK_DEVICE_ID);
    let mut one = [0xffu8; 1];
    h.transport.read(0x108, &mut one);
    assert_eq!(one, [0], "past the config reads as zero");
}

#[test]
fn guest_connects_to_a_host_listener_and_exchanges_data() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let l = UnixListener::bind(h.host_path(1234)).unwrap();
    let irqs_before = h.irq_count();
    let (mut s, mut gc) = guest_connect(&mut h, &l, 5000, 1234);
    assert!(h.irq_count() + irqs_before > 0, "the guest was interrupted");
    assert_ne!(h.read(reg::VIRTIO_MMIO_INTERRUPT_STATUS) & 1, 0);
    h.write(reg::VIRTIO_MMIO_INTERRUPT_ACK, 1);
    assert_eq!(h.read(reg::VIRTIO_MMIO_INTERRUPT_STATUS), 0);

    // guest -> host
    let mut p = gh(OP_RW, 5000, 1234);
    p.len = 5;
    h.send(p, b"hello");
    h.pump();
    let mut got = Vec::new();
    while got.len() < 5 {
        got.extend(host_read_available(&mut s).0);
    }
    assert_eq!(got, b"hello");

    // host -> guest
    s.write_all(b"world").unwrap();
    h.pump_until("data for the guest", |h| {
        let pkts = h.take();
        let rest = absorb(pkts, 5000, 1234, &mut gc);
        assert!(rest.is_empty(), "{rest:?}");
        gc.rx.len() >= 5
    });
    assert_eq!(gc.rx, b"world");
}

#[test]
fn guest_connection_to_a_missing_listener_is_reset() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    h.send(gh(OP_REQUEST, 5000, 9999), &[]);
    h.pump();
    let pkts = h.take();
    assert_eq!(pkts.len(), 1);
    assert_eq!(pkts[0].hdr.op, OP_RST);
    assert_eq!((pkts[0].hdr.src_port, pkts[0].hdr.dst_port), (9999, 5000));
}

#[test]
fn host_program_connects_and_gets_an_ok_line() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    // Bytes after the CONNECT line reach the guest once it accepted.
    let mut s = UnixStream::connect(&h.path).unwrap();
    s.write_all(b"CONNECT 52\r\nearly").unwrap();
    h.pump_until("the connection request", |h| !h.inbox.is_empty());
    let req = h.take()[0].hdr;
    assert_eq!((req.op, req.dst_port), (OP_REQUEST, 52));
    let hport = req.src_port;
    h.send(gh(OP_RESPONSE, 52, hport), &[]);
    let mut gc = GuestConn::default();
    let mut host_got = Vec::new();
    h.pump_until("OK line and early data", |h| {
        host_got.extend(host_read_available(&mut s).0);
        let rest = absorb(h.take(), 52, hport, &mut gc);
        assert!(rest.is_empty(), "{rest:?}");
        !gc.rx.is_empty() && host_got.ends_with(b"\n")
    });
    assert_eq!(host_got, format!("OK {hport}\n").into_bytes());
    assert_eq!(gc.rx, b"early");

    // Both directions after the handshake.
    s.write_all(b" and more").unwrap();
    h.pump_until("more data", |h| {
        absorb(h.take(), 52, hport, &mut gc);
        gc.rx.len() == 14
    });
    assert_eq!(gc.rx, b"early and more");
    let mut p = gh(OP_RW, 52, hport);
    p.len = 4;
    h.send(p, b"pong");
    h.pump();
    assert_eq!(host_read_available(&mut s).0, b"pong");

    // A second connection gets another host port.
    let (_s2, hport2, _) = host_connect(&mut h, 52, &[]);
    assert_ne!(hport, hport2);
}

#[test]
fn guest_refusal_closes_the_host_connection() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let mut s = UnixStream::connect(&h.path).unwrap();
    s.write_all(b"CONNECT 7\n").unwrap();
    h.pump_until("the connection request", |h| !h.inbox.is_empty());
    let req = h.take()[0].hdr;
    h.send(gh(OP_RST, 7, req.src_port), &[]);
    h.pump();
    let (data, eof) = host_read_available(&mut s);
    assert!(data.is_empty() && eof, "host sees the connection closed");
}

#[test]
fn bad_connect_lines_close_the_host_connection() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    for line in [
        &b"CONNECT\n"[..],
        b"HELLO 5\n",
        b"CONNECT 99999999999\n",
        &[b'x'; 40],
    ] {
        let mut s = UnixStream::connect(&h.path).unwrap();
        s.write_all(line).unwrap();
        let mut closed = false;
        h.pump_until("the host connection to close", |_| {
            closed |= host_read_available(&mut s).1;
            closed
        });
        assert!(
            h.take().is_empty(),
            "nothing reached the guest for {line:?}"
        );
    }
}

#[test]
fn slow_host_reader_loses_nothing_and_credit_flows_back() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let l = UnixListener::bind(h.host_path(80)).unwrap();
    let (mut s, mut gc) = guest_connect(&mut h, &l, 6000, 80);
    let total = 3 * CONN_BUF_SIZE as usize + 12345;
    let data = pattern(total, 7);
    let mut sent = 0usize;
    let mut host_got = Vec::new();
    let mut stalled = false;
    let t = Instant::now();
    while host_got.len() < total {
        assert!(t.elapsed() < WAIT, "stuck at {} of {total}", host_got.len());
        // The guest sends as much as its credit allows, in 64 KiB packets.
        while sent < total && gc.credit() > 0 {
            let n = (total - sent)
                .min(gc.credit() as usize)
                .min(MAX_PKT_DATA as usize);
            let mut p = gh(OP_RW, 6000, 80);
            p.len = n as u32;
            h.send(p, &data[sent..sent + n]);
            gc.tx_cnt = gc.tx_cnt.wrapping_add(n as u32);
            sent += n;
            h.pump();
        }
        let rest = absorb(h.take(), 6000, 80, &mut gc);
        for p in &rest {
            assert_eq!(p.hdr.op, OP_CREDIT_UPDATE, "{p:?}");
        }
        if sent < total && gc.credit() == 0 && !stalled {
            // The host has not read anything yet: the device holds at most its buffer, and
            // the guest is out of credit.
            stalled = true;
            assert!(host_got.is_empty());
            assert!(sent <= CONN_BUF_SIZE as usize + 512 * 1024, "sent {sent}");
        }
        if stalled {
            // Now the host reads, slowly.
            let mut buf = [0u8; 8192];
            s.set_nonblocking(true).unwrap();
            if let Ok(n) = s.read(&mut buf) {
                host_got.extend_from_slice(&buf[..n]);
            }
        }
        h.pump();
        std::thread::sleep(Duration::from_micros(100));
    }
    assert!(
        stalled,
        "the guest ran out of credit while the host did not read"
    );
    assert_eq!(host_got.len(), total);
    assert!(host_got == data, "bytes arrive intact and in order");
}

#[test]
fn guest_overrunning_its_credit_is_reset() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let l = UnixListener::bind(h.host_path(81)).unwrap();
    let (_s, _gc) = guest_connect(&mut h, &l, 6001, 81);
    // Nobody reads on the host: after the socket buffer and our 256 KiB, data is refused.
    let chunk = pattern(MAX_PKT_DATA as usize, 1);
    let mut reset = false;
    for _ in 0..200 {
        let mut p = gh(OP_RW, 6001, 81);
        p.len = chunk.len() as u32;
        h.send(p, &chunk);
        h.pump();
        if h.take().iter().any(|p| p.hdr.op == OP_RST) {
            reset = true;
            break;
        }
    }
    assert!(reset, "the device resets a guest that ignores flow control");
}

#[test]
fn host_data_never_exceeds_guest_credit() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let l = UnixListener::bind(h.host_path(82)).unwrap();
    let mut req = gh(OP_REQUEST, 6002, 82);
    req.buf_alloc = 4096;
    h.send(req, &[]);
    h.pump();
    let mut s = accept(&l);
    assert_eq!(h.take()[0].hdr.op, OP_RESPONSE);
    let data = pattern(10_000, 3);
    s.write_all(&data).unwrap();
    let mut got: Vec<u8> = Vec::new();
    let mut credit_requests = 0;
    h.pump_until("credit to run out", |h| {
        for p in h.take() {
            match p.hdr.op {
                OP_RW => got.extend(p.data),
                OP_CREDIT_REQUEST => credit_requests += 1,
                op => panic!("unexpected op {op}"),
            }
        }
        credit_requests > 0
    });
    assert_eq!(got.len(), 4096, "exactly the guest's buffer");
    // Make sure nothing more trickles in without credit.
    std::thread::sleep(Duration::from_millis(20));
    h.pump();
    assert!(h.take().is_empty());
    // The guest application reads 4096 bytes and says so.
    let mut upd = gh(OP_CREDIT_UPDATE, 6002, 82);
    upd.buf_alloc = 4096;
    upd.fwd_cnt = 4096;
    h.send(upd, &[]);
    let mut fwd = 4096u32;
    h.pump_until("the rest of the data", |h| {
        let mut fresh = 0;
        for p in h.take() {
            if p.hdr.op == OP_RW {
                fresh += p.data.len() as u32;
                got.extend(p.data);
            }
        }
        if fresh > 0 {
            fwd += fresh;
            let mut upd = gh(OP_CREDIT_UPDATE, 6002, 82);
            upd.buf_alloc = 4096;
            upd.fwd_cnt = fwd;
            h.send(upd, &[]);
        }
        got.len() == data.len()
    });
    assert!(got == data);
}

#[test]
fn a_stalled_stream_does_not_stall_the_others() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let l = UnixListener::bind(h.host_path(90)).unwrap();
    // Stream 0 is stuck both ways: its host program never reads (the guest runs out of
    // credit) and its guest application never reads (the host side runs out of credit).
    let (mut stuck_host, mut stuck) = guest_connect(&mut h, &l, 7000, 90);
    let big = pattern(MAX_PKT_DATA as usize, 9);
    while stuck.credit() > 0 {
        let n = (stuck.credit() as usize).min(big.len());
        let mut p = gh(OP_RW, 7000, 90);
        p.len = n as u32;
        h.send(p, &big[..n]);
        stuck.tx_cnt = stuck.tx_cnt.wrapping_add(n as u32);
        h.pump();
        absorb(h.take(), 7000, 90, &mut stuck);
    }
    stuck_host.write_all(&big).unwrap();
    stuck_host.write_all(&big).unwrap();
    let mut stuck_ctl = Vec::new();
    h.pump_until("the stuck stream's credit request", |h| {
        stuck_ctl.extend(absorb(h.take(), 7000, 90, &mut stuck));
        !stuck_ctl.is_empty()
    });
    assert_eq!(stuck_ctl[0].hdr.op, OP_CREDIT_REQUEST);
    assert_eq!(
        stuck.rx.len(),
        GUEST_BUF as usize,
        "exactly the guest's credit"
    );
    // Many other streams, both directions, host-initiated and guest-initiated.
    let mut streams = Vec::new();
    for i in 0..8u32 {
        let (s, gc) = guest_connect(&mut h, &l, 7100 + i, 90);
        streams.push((s, 7100 + i, 90, gc));
    }
    for i in 0..8u32 {
        let (s, hport, gc) = host_connect(&mut h, 8000 + i, &[]);
        streams.push((s, 8000 + i, hport, gc));
    }
    let payload = |i: usize| pattern(20_000 + (i % 100) * 1000, i as u8);
    for (i, (s, gport, hport, gc)) in streams.iter_mut().enumerate() {
        s.write_all(&payload(i)).unwrap();
        let mut p = gh(OP_RW, *gport, *hport);
        let d = payload(100 + i);
        p.len = d.len() as u32;
        h.send(p, &d);
        gc.tx_cnt = d.len() as u32;
    }
    let mut host_rx: Vec<Vec<u8>> = vec![Vec::new(); streams.len()];
    h.pump_until("every stream's data", |h| {
        let mut pkts = h.take();
        for (_, gport, hport, gc) in streams.iter_mut() {
            pkts = absorb(pkts, *gport, *hport, gc);
        }
        pkts = absorb(pkts, 7000, 90, &mut stuck);
        assert!(pkts.is_empty(), "unexpected packets {pkts:?}");
        for (i, (s, ..)) in streams.iter_mut().enumerate() {
            host_rx[i].extend(host_read_available(s).0);
        }
        streams
            .iter()
            .enumerate()
            .all(|(i, (.., gc))| gc.rx.len() == payload(i).len())
            && (0..streams.len()).all(|i| host_rx[i].len() == payload(100 + i).len())
    });
    assert_eq!(
        stuck.rx.len(),
        GUEST_BUF as usize,
        "the stuck stream got nothing more"
    );
    for (i, (.., gc)) in streams.iter().enumerate() {
        assert!(gc.rx == payload(i), "stream {i} host->guest intact");
        assert!(
            host_rx[i] == payload(100 + i),
            "stream {i} guest->host intact"
        );
    }
}

#[test]
fn guest_shutdown_reaches_the_host_and_the_host_close_reaches_the_guest() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let l = UnixListener::bind(h.host_path(83)).unwrap();
    let (mut s, mut gc) = guest_connect(&mut h, &l, 6003, 83);
    // The guest sends data then shuts down its sending side: the host reads data, then EOF.
    let mut p = gh(OP_RW, 6003, 83);
    p.len = 3;
    h.send(p, b"bye");
    let mut sd = gh(OP_SHUTDOWN, 6003, 83);
    sd.flags = SHUTDOWN_SEND;
    h.send(sd, &[]);
    h.pump();
    let mut got = Vec::new();
    let mut eof = false;
    h.pump_until("EOF on the host", |_| {
        let (d, e) = host_read_available(&mut s);
        got.extend(d);
        eof = e;
        eof
    });
    assert_eq!(got, b"bye");
    // The host still answers, then closes: the guest gets the data and a full shutdown.
    s.write_all(b"reply").unwrap();
    drop(s);
    let mut others = Vec::new();
    h.pump_until("the host's close", |h| {
        others.extend(absorb(h.take(), 6003, 83, &mut gc));
        !others.is_empty()
    });
    assert_eq!(gc.rx, b"reply");
    assert_eq!(others[0].hdr.op, OP_SHUTDOWN);
    assert_eq!(others[0].hdr.flags, SHUTDOWN_RCV | SHUTDOWN_SEND);
    // The guest answers with RST; the connection is gone: new packets for it get RST.
    h.send(gh(OP_RST, 6003, 83), &[]);
    h.pump();
    assert!(h.take().is_empty(), "no answer to an RST");
    let mut p = gh(OP_RW, 6003, 83);
    p.len = 1;
    h.send(p, b"x");
    h.pump();
    assert_eq!(h.take()[0].hdr.op, OP_RST);
}

#[test]
fn guest_close_flushes_then_resets() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let l = UnixListener::bind(h.host_path(84)).unwrap();
    let (mut s, _gc) = guest_connect(&mut h, &l, 6004, 84);
    let mut p = gh(OP_RW, 6004, 84);
    p.len = 4;
    h.send(p, b"last");
    let mut sd = gh(OP_SHUTDOWN, 6004, 84);
    sd.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    h.send(sd, &[]);
    h.pump();
    let pkts = h.take();
    assert_eq!(pkts.len(), 1);
    assert_eq!(
        pkts[0].hdr.op, OP_RST,
        "a full guest shutdown is answered with RST"
    );
    let (d, eof) = host_read_available(&mut s);
    assert_eq!(d, b"last");
    assert!(eof);
}

#[test]
fn host_half_close_is_a_send_shutdown() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let (mut s, hport, mut gc) = host_connect(&mut h, 60, &[]);
    s.write_all(b"request").unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut others = Vec::new();
    h.pump_until("the shutdown", |h| {
        others.extend(absorb(h.take(), 60, hport, &mut gc));
        !others.is_empty()
    });
    assert_eq!(gc.rx, b"request");
    assert_eq!(
        (others[0].hdr.op, others[0].hdr.flags),
        (OP_SHUTDOWN, SHUTDOWN_SEND)
    );
    // The guest can still answer.
    let mut p = gh(OP_RW, 60, hport);
    p.len = 8;
    h.send(p, b"response");
    h.pump();
    let mut got = Vec::new();
    h.pump_until("the response", |_| {
        got.extend(host_read_available(&mut s).0);
        got.len() == 8
    });
    assert_eq!(got, b"response");
}

#[test]
fn malformed_chains_are_dropped_and_the_device_keeps_working() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let base = h.tx.buf(200);
    h.mem
        .write_slice(&gh(OP_REQUEST, 1, 2).to_bytes(), GuestAddress(base))
        .unwrap();
    let mut rw = gh(OP_RW, 1, 2);
    rw.len = 100;
    h.mem
        .write_slice(&rw.to_bytes(), GuestAddress(base + 0x1000))
        .unwrap();
    let mut huge = gh(OP_RW, 1, 2);
    huge.len = 1 << 20;
    h.mem
        .write_slice(&huge.to_bytes(), GuestAddress(base + 0x2000))
        .unwrap();
    let bad: [&[(u64, u32, bool)]; 6] = [
        // Header descriptor too short.
        &[(base, 10, false)],
        // Header in a device-writable descriptor.
        &[(base, HDR_SIZE as u32, true)],
        // Header says 100 bytes of data, there is no data descriptor.
        &[(base + 0x1000, HDR_SIZE as u32, false)],
        // Data descriptor outside guest memory.
        &[
            (base + 0x1000, HDR_SIZE as u32, false),
            (MEM_SIZE as u64 + 0x1000, 100, false),
        ],
        // Header outside guest memory.
        &[(u64::MAX - 10, HDR_SIZE as u32, false)],
        // Payload larger than the 64 KiB maximum.
        &[
            (base + 0x2000, HDR_SIZE as u32, false),
            (base + 0x3000, 1 << 20, false),
        ],
    ];
    for chain in bad {
        h.tx.add_raw(chain);
    }
    // A data packet whose `next` points past the table.
    let head = h.tx.add_raw(&[(base + 0x1000, HDR_SIZE as u32, false)]);
    let d = SplitDescriptor::new(
        base + 0x1000,
        HDR_SIZE as u32,
        VRING_DESC_F_NEXT as u16,
        999,
    );
    h.tx.table.store(head, RawDescriptor::from(d)).unwrap();
    h.notify(TX_QUEUE as u32);
    h.pump();
    assert_eq!(h.tx.used_seen, h.tx.avail_idx, "every chain was returned");
    let sent = h.take();
    assert!(
        sent.is_empty(),
        "nothing was sent for malformed packets: {sent:?}"
    );

    // Malformed rx buffers are returned empty and skipped.
    h.rx.add_raw(&[(base, 8, true)]);
    h.rx.add_raw(&[(u64::MAX - 100, HDR_SIZE as u32, true)]);
    h.notify(RX_QUEUE as u32);

    // Still works.
    let l = UnixListener::bind(h.host_path(85)).unwrap();
    h.send(gh(OP_REQUEST, 6005, 85), &[]);
    h.pump();
    let _s = accept(&l);
    let ops: Vec<u16> = h.take().iter().map(|p| p.hdr.op).collect();
    assert_eq!(ops, vec![OP_RESPONSE]);
}

#[test]
fn packets_that_fit_no_connection_get_a_reset() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    // Data for a connection that does not exist.
    let mut p = gh(OP_RW, 1, 2);
    p.len = 1;
    h.send(p, b"x");
    // A RESPONSE nobody asked for.
    h.send(gh(OP_RESPONSE, 3, 4), &[]);
    // SEQPACKET is not offered.
    let mut sp = gh(OP_REQUEST, 5, 6);
    sp.type_ = 2;
    h.send(sp, &[]);
    // Another VM's CID: refused in that CID's name.
    let mut other = gh(OP_REQUEST, 7, 8);
    other.dst_cid = 42;
    h.send(other, &[]);
    // Spoofed source CID: dropped.
    let mut spoof = gh(OP_REQUEST, 9, 10);
    spoof.src_cid = 77;
    h.send(spoof, &[]);
    // An RST for nothing: ignored.
    h.send(gh(OP_RST, 11, 12), &[]);
    h.pump();
    let got: Vec<(u16, u64, u32, u32)> = h
        .take()
        .iter()
        .map(|p| (p.hdr.op, p.hdr.src_cid, p.hdr.src_port, p.hdr.dst_port))
        .collect();
    assert_eq!(
        got,
        vec![
            (OP_RST, HOST_CID, 2, 1),
            (OP_RST, HOST_CID, 4, 3),
            (OP_RST, HOST_CID, 6, 5),
            (OP_RST, 42, 8, 7),
        ]
    );
}

#[test]
fn rx_buffers_are_waited_for_not_lost() {
    let mem = test_mem();
    // The guest posts no rx buffers at first.
    let mut h = Harness::with_rx_buffers(&mem, 0);
    let l = UnixListener::bind(h.host_path(86)).unwrap();
    h.send(gh(OP_REQUEST, 6006, 86), &[]);
    h.pump();
    let mut s = accept(&l);
    s.write_all(b"queued").unwrap();
    h.pump();
    std::thread::sleep(Duration::from_millis(20));
    h.pump();
    assert!(h.take().is_empty());
    h.rx_target = 4;
    h.post_rx();
    let mut gc = GuestConn::default();
    let mut others = Vec::new();
    h.pump_until("the queued packets", |h| {
        others.extend(absorb(h.take(), 6006, 86, &mut gc));
        gc.rx.len() == 6
    });
    assert_eq!(others[0].hdr.op, OP_RESPONSE);
    assert_eq!(gc.rx, b"queued");
}

#[test]
fn device_reset_closes_connections_and_the_device_can_start_again() {
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let l = UnixListener::bind(h.host_path(87)).unwrap();
    let (mut s, _gc) = guest_connect(&mut h, &l, 6007, 87);
    h.write(reg::VIRTIO_MMIO_STATUS, 0);
    assert_eq!(h.read(reg::VIRTIO_MMIO_STATUS), 0);
    assert!(!h.transport.is_active());
    h.pump();
    let mut closed = false;
    h.pump_until("the host connection to close", |_| {
        closed |= host_read_available(&mut s).1;
        closed
    });
    // Fresh rings, as a driver would after reset.
    h.rx = DriverQueue::new(h.mem, 0x10000, 0x10_0000);
    h.tx = DriverQueue::new(h.mem, 0x20000, 0x10_0000 + 0x120_0000);
    h.ev = DriverQueue::new(h.mem, 0x30000, 0x10_0000 + 0x240_0000);
    h.rx_posted = 0;
    h.driver_init();
    h.post_rx();
    h.pump();
    let (_s2, _) = guest_connect(&mut h, &l, 6008, 87);
}

#[test]
fn many_host_connections_before_the_guest_driver_is_up_wait_for_it() {
    let mem = test_mem();
    let dir = TempDir::new("clade-vsock");
    let path = dir.0.join("v.sock");
    let mut em = Manager::new().unwrap();
    let (dev, socket) = device(&path, &em);
    // Connections made now sit in the listen backlog.
    let mut early = UnixStream::connect(&path).unwrap();
    early.write_all(b"CONNECT 52\n").unwrap();
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    let transport =
        MmioTransport::new(mem.clone(), Box::new(dev), irq.try_clone().unwrap()).unwrap();
    em.run_with_timeout(0).unwrap();
    let mut h = Harness {
        mem: &mem,
        em,
        transport,
        irq,
        rx: DriverQueue::new(&mem, 0x10000, 0x10_0000),
        tx: DriverQueue::new(&mem, 0x20000, 0x10_0000 + 0x120_0000),
        ev: DriverQueue::new(&mem, 0x30000, 0x10_0000 + 0x240_0000),
        rx_posted: 0,
        rx_target: 8,
        dir,
        path,
        _socket: socket,
        inbox: Vec::new(),
    };
    h.driver_init();
    h.post_rx();
    h.pump_until("the early request", |h| !h.inbox.is_empty());
    let req = h.take()[0].hdr;
    assert_eq!((req.op, req.dst_port), (OP_REQUEST, 52));
    let _ = h.dir.0.exists();
}

// ---- the socket file ------------------------------------------------------------------

#[test]
fn a_socket_in_use_is_refused_and_a_stale_one_replaced() {
    let dir = TempDir::new("clade-vsock");
    let path = dir.0.join("v.sock");
    let live = SocketFile::bind(&path).unwrap();
    let err = SocketFile::bind(&path).expect_err("second bind of a live socket");
    assert!(matches!(err, crate::Error::SocketInUse(_)), "{err}");
    drop(live);
    assert!(!path.exists(), "the socket file is removed with its guard");

    // A socket file nobody listens on (a crashed VMM's) is replaced.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let (listener, file) = SocketFile::bind(&path).unwrap();
    assert!(UnixStream::connect(&path).is_ok());
    assert_eq!(file.path(), path);
    drop(listener);
    drop(file);
    assert!(!path.exists());

    // A file that replaced ours is not ours to remove.
    let (_l, file) = SocketFile::bind(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"someone else's").unwrap();
    drop(file);
    assert!(path.exists());

    // Anything else at the path is left alone.
    assert!(SocketFile::bind(&path).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
}

#[test]
fn a_socket_bound_ahead_moves_into_place_and_keeps_listening() {
    let dir = TempDir::new("clade-vsock-move");
    let ahead = dir.0.join("ahead.sock");
    let path = dir.0.join("v.sock");
    let (listener, mut file) = SocketFile::bind(&ahead).unwrap();
    // A stale socket where it goes is replaced.
    drop(UnixListener::bind(&path).unwrap());
    file.move_to(&path).unwrap();
    assert_eq!(file.path(), path);
    assert!(!ahead.exists());
    let _c = UnixStream::connect(&path).unwrap();
    assert!(
        listener.accept().is_ok(),
        "the same listener, reached at the new path"
    );

    // A live socket or another file at the target: refused, and it stays where it was.
    let (_l2, mut other) = SocketFile::bind(&ahead).unwrap();
    let err = other.move_to(&path).expect_err("a live socket is there");
    assert!(matches!(err, crate::Error::SocketInUse(_)), "{err}");
    let plain = dir.0.join("plain");
    std::fs::write(&plain, b"x").unwrap();
    assert!(other.move_to(&plain).is_err());
    assert_eq!(other.path(), ahead);
    assert!(ahead.exists() && std::fs::read(&plain).unwrap() == b"x");
    // Each is removed with its guard, where it is.
    drop((other, file));
    assert!(!ahead.exists() && !path.exists());
}

#[test]
fn the_socket_is_created_with_mode_0600_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("clade-vsock");
    let path = dir.0.join("v.sock");
    // SAFETY: umask(2) only swaps the process's file-creation mask.
    let old = unsafe { libc::umask(0) };
    let bound = SocketFile::bind(&path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let (_listener, _file) = bound.unwrap();
    let mode = std::fs::symlink_metadata(&path)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
    assert!(UnixStream::connect(&path).is_ok());
}

#[test]
fn reserved_cids_are_refused() {
    let dir = TempDir::new("clade-vsock");
    let em = Manager::new().unwrap();
    let path = dir.0.join("v.sock");
    for cid in [0, 1, 2, u64::from(u32::MAX), 1 << 40] {
        let (l, _f) = SocketFile::bind(&path).unwrap();
        assert!(VsockDevice::new(cid, l, &path, em.remote_endpoint()).is_err());
    }
}

#[test]
fn connect_lines_parse() {
    use super::worker::parse_connect_line as parse;
    assert_eq!(parse(b"CONNECT 52"), Some(52));
    assert_eq!(parse(b"CONNECT 52\r"), Some(52));
    assert_eq!(parse(b"CONNECT  4294967295"), Some(u32::MAX));
    assert_eq!(parse(b"CONNECT 4294967296"), None);
    assert_eq!(parse(b"CONNECT -1"), None);
    assert_eq!(parse(b"connect 52"), None);
    assert_eq!(parse(b"CONNECT"), None);
    assert_eq!(parse(&[0xff, 0xfe]), None);
}

/// Random and mutated `CONNECT` lines: a port comes out only of a well-formed line.
#[test]
fn random_connect_lines_are_refused_or_parsed_exactly() {
    use super::worker::parse_connect_line as parse;
    let mut x: u64 = 0x0063_6f6e_6e65_6374;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..200_000u32 {
        let mut line = if i % 2 == 0 {
            format!("CONNECT {}", next() % (1 << 33)).into_bytes()
        } else {
            Vec::new()
        };
        for _ in 0..next() % 4 {
            let v = next();
            match v % 3 {
                0 if !line.is_empty() => {
                    let at = (v >> 8) as usize % line.len();
                    line[at] = (v >> 16) as u8;
                }
                1 => line.push((v >> 8) as u8),
                _ => line.truncate((v >> 8) as usize % (line.len() + 1)),
            }
        }
        if let Some(port) = parse(&line) {
            let text = std::str::from_utf8(&line).unwrap();
            assert!(text.starts_with("CONNECT "), "{line:?}");
            assert!(text.contains(&port.to_string()), "{line:?} -> {port}");
        }
    }
}

#[test]
fn header_round_trips() {
    let h = Hdr {
        src_cid: 1,
        dst_cid: 2,
        src_port: 3,
        dst_port: 4,
        len: 5,
        type_: 6,
        op: 7,
        flags: 8,
        buf_alloc: 9,
        fwd_cnt: 10,
    };
    assert_eq!(Hdr::from_bytes(&h.to_bytes()), h);
}

#[test]
fn snapshot_keeps_queue_positions_and_a_restored_device_resets_old_connections() {
    use crate::virtio::mmio::{MmioTransportArgs, MmioTransportState};
    use crate::virtio::VirtioDeviceState;
    use snapshot::Persist;
    use std::sync::{Arc, Mutex};

    let mem = test_mem();
    let mut h = Harness::new(&mem);
    // One event buffer, as Linux posts them.
    let eb = h.ev.buf(h.ev.free[0]);
    mem.write_obj(0xffff_ffffu32, GuestAddress(eb)).unwrap();
    h.ev.add_raw(&[(eb, 8, true)]);
    h.notify(EVENT_QUEUE as u32);
    let l = UnixListener::bind(h.host_path(87)).unwrap();
    let (mut s, _gc) = guest_connect(&mut h, &l, 6007, 87);
    let mut p = gh(OP_RW, 6007, 87);
    p.len = 3;
    h.send(p, b"abc");
    h.pump();
    let mut got = Vec::new();
    while got.len() < 3 {
        got.extend(host_read_available(&mut s).0);
    }

    h.transport.pause_device();
    let state = h.transport.save().unwrap();
    h.transport.unpause_device();
    assert!(state.active);
    assert_eq!(
        state.device,
        VirtioDeviceState::Vsock(VsockState {
            guest_cid: GUEST_CID,
            connections: 1
        })
    );
    let rx = state.queues[RX_QUEUE].position;
    let tx = state.queues[TX_QUEUE].position;
    assert_eq!(
        rx.next_used, h.rx.used_seen,
        "rx used entries the guest has seen"
    );
    assert_eq!(tx.next_avail, h.tx.avail_idx, "every tx packet was taken");
    assert_eq!(tx.next_used, h.tx.avail_idx, "and given back");
    assert!(rx.next_avail > 0);

    // Bad states are refused, whatever the device.
    let endpoint = h.em.remote_endpoint();
    let restore = |st: &MmioTransportState, path: &Path| {
        let VirtioDeviceState::Vsock(vs) = st.device else {
            panic!("not a vsock state: {:?}", st.device)
        };
        let slot = Arc::new(Mutex::new(None));
        let dev =
            VsockDevice::restore(&vs, vs.guest_cid, slot.clone(), path, endpoint.clone()).unwrap();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut t = MmioTransport::restore(
            MmioTransportArgs {
                mem: mem.clone(),
                device: Box::new(dev),
                irq: irq.into(),
            },
            st,
        )?;
        // Bound after the restore, as the VMM does while the vCPUs already run.
        let (listener, socket) = SocketFile::bind(path).unwrap();
        *slot.lock().unwrap() = Some(listener);
        t.finish_restore()?;
        Ok::<_, crate::Error>((t, socket))
    };
    let path2 = h.dir.0.join("v2.sock");
    let mut bad = state.clone();
    bad.device_type = 1;
    assert!(restore(&bad, &path2).is_err());
    let mut bad = state.clone();
    bad.status = 0x7;
    assert!(restore(&bad, &path2).is_err());
    let mut bad = state.clone();
    bad.queues[RX_QUEUE].desc = MEM_SIZE as u64 - 0x10;
    assert!(restore(&bad, &path2).is_err());
    let mut bad = state.clone();
    bad.queues.pop();
    assert!(restore(&bad, &path2).is_err());

    // The old device goes away (its VM is gone); the restored one continues in the same
    // guest memory from the saved positions.
    h.write(reg::VIRTIO_MMIO_STATUS, 0);
    h.pump();
    let (t, socket) = restore(&state, &path2).unwrap();
    h.transport = t;
    h._socket = socket;
    h.path = path2;
    let mut events = Vec::new();
    h.pump_until("the transport reset event", |h| {
        events.extend(h.ev.take_used());
        !events.is_empty()
    });
    assert_eq!(events[0].1, 4, "one le32 event id");
    let ev: u32 = mem.read_obj(GuestAddress(eb)).unwrap();
    assert_eq!(ev, EVENT_TRANSPORT_RESET);
    assert_ne!(h.read(reg::VIRTIO_MMIO_INTERRUPT_STATUS) & 1, 0);
    // Until the guest has taken the reset (given an event buffer back), a host program's
    // connection request waits: the guest could accept it and then drop it with the
    // connections the reset is about.
    let mut early = UnixStream::connect(&h.path).unwrap();
    early.write_all(b"CONNECT 52\n").unwrap();
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(50) {
        h.em.run_with_timeout(10).unwrap();
        h.collect();
    }
    assert!(
        h.take().is_empty(),
        "nothing for the guest before it took the reset"
    );
    h.ev.add_raw(&[(eb, 8, true)]);
    h.notify(EVENT_QUEUE as u32);
    h.pump_until("the request once the reset was taken", |h| {
        !h.inbox.is_empty()
    });
    let pkts = h.take();
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    assert_eq!((pkts[0].hdr.op, pkts[0].hdr.dst_port), (OP_REQUEST, 52));
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "the request followed the event buffer, not the time limit"
    );
    h.send(gh(OP_RST, 52, pkts[0].hdr.src_port), &[]);
    h.pump();
    // The guest's listening port still works through the restored device, from a host
    // port its guest cannot hold from before the snapshot (every device counts from the
    // base; the guest may not have taken the reset yet).
    let (_s2, hport, _gc2) = host_connect(&mut h, 52, b"");
    assert!(
        hport > LOCAL_PORT_BASE && hport <= LOCAL_PORT_BASE + (1 << 29),
        "restored device's first host port {hport}"
    );
}

/// Checks the device still serves a new guest connection: a listener on a fresh host port,
/// a REQUEST from a fresh guest port, and the RESPONSE (other packets are ignored).
fn still_connects(h: &mut Harness<'_>, n: u32, what: &str) {
    let hport = 60_000 + n;
    let gport = 70_000 + n;
    let l = UnixListener::bind(h.host_path(hport)).unwrap();
    l.set_nonblocking(true).unwrap();
    h.send(gh(OP_REQUEST, gport, hport), &[]);
    let mut ok = false;
    h.pump_until(what, |h| {
        ok |= h
            .take()
            .iter()
            .any(|p| p.hdr.op == OP_RESPONSE && (p.hdr.src_port, p.hdr.dst_port) == (hport, gport));
        ok
    });
    l.accept().expect("the host side of the connection");
    h.send(gh(OP_RST, gport, hport), &[]);
    h.pump();
    h.take();
}

/// Bounded fuzzing of the tx and rx paths with random descriptor chains: random tables
/// (flags, lengths, addresses inside, at the edge of and outside guest memory, loops, next
/// pointers past the table, indirect tables) in both queues, over buffers that hold valid
/// and random packet headers, random available rings, then notifications. No input may
/// panic the device or make it write guest memory outside the device-writable buffers and
/// the used rings. Each input starts from a reset (the rings are the driver's to rebuild);
/// every tenth one is followed by a real connection. `CLADE_FUZZ_ROUNDS` inputs (default
/// 600).
#[test]
fn fuzzed_descriptor_chains_never_break_the_device() {
    use crate::virtio::fuzz_util::{
        assert_writes_within, clear_dirty, rounds, writable_ranges, Rng,
    };
    const N: u64 = 32;
    const IND: u64 = 0x40000;
    const PKTS: u64 = 0x50000;
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let listener = UnixListener::bind(h.host_path(1)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut rng = Rng::new(0x7673_6f63_6b63_6831);
    let rounds = rounds(600);
    let (mut tx_used, mut rx_used, mut checked) = (0u64, 0u64, 0usize);
    for round in 0..rounds {
        let prior: Vec<(u64, u64)> =
            h.rx.chains
                .keys()
                .flat_map(|&head| {
                    let a = h.rx.buf(head);
                    [(a, HDR_SIZE as u64), (a + 0x100, u64::from(RX_DATA))]
                })
                .collect();
        // Packet headers the chains may point at: valid ones to a listening port and to
        // nowhere, data packets, and random bytes.
        for k in 0..8u64 {
            let mut p = gh(
                rng.pick(&[OP_REQUEST, OP_RW, OP_SHUTDOWN, OP_RST, OP_CREDIT_REQUEST]),
                1000 + rng.below(3) as u32,
                rng.pick(&[1, 2]),
            );
            p.len = rng.pick(&[0, 4, 100, 4096, 65536, 1 << 20, rng.next() as u32]);
            let mut b = p.to_bytes().to_vec();
            if k >= 6 {
                b.iter_mut().for_each(|x| *x = rng.next() as u8);
            }
            h.mem
                .write_slice(&b, GuestAddress(PKTS + 0x100 * k))
                .unwrap();
        }
        let desc = |rng: &mut Rng, table: u64| {
            let mut flags = rng.below(8) as u16;
            if rng.chance(3) {
                flags = rng.next() as u16;
            }
            let (addr, len) = if flags & VRING_DESC_F_INDIRECT as u16 != 0 {
                let a = rng.pick(&[
                    IND,
                    IND + rng.below(N * 16),
                    MEM_SIZE as u64 - 16,
                    u64::MAX - 8,
                ]);
                (a, 16 * rng.below(N + 2) as u32 + rng.pick(&[0, 0, 0, 8]))
            } else {
                let a = match rng.below(6) {
                    0 | 1 => PKTS + 0x100 * rng.below(8),
                    2 => 0x10_0000 + rng.below(1 << 20),
                    3 => MEM_SIZE as u64 - rng.below(1 << 16),
                    4 => rng.pick(&[MEM_SIZE as u64 + 0x1000, u64::MAX - rng.below(4096)]),
                    _ => rng.next(),
                };
                let l = rng.pick(&[
                    0,
                    1,
                    HDR_SIZE as u32 - 1,
                    HDR_SIZE as u32,
                    100,
                    4096,
                    65536,
                    0xffff_f000,
                    rng.next() as u32,
                ]);
                (a, l)
            };
            SplitDescriptor::new(addr, len, flags, rng.below(table + 4) as u16)
        };
        for (table, n) in [(h.rx.desc, N), (h.tx.desc, N), (IND, N)] {
            for i in 0..n {
                let d = desc(&mut rng, n);
                h.mem.write_obj(d, GuestAddress(table + 16 * i)).unwrap();
            }
        }
        let allowed = {
            // At most one packet (header + 64 KiB) goes into an rx buffer. The rx buffers
            // the driver posted before this input are the device's to fill, too.
            let mut a = writable_ranges(
                h.mem,
                &[(h.rx.desc, 16 * N), (h.tx.desc, 16 * N), (IND, 16 * N)],
                HDR_SIZE as u64 + 64 * 1024,
                false,
            );
            for q in [&h.rx, &h.tx] {
                a.push((q.used, 4 + 8 * u64::from(QSIZE) + 2));
            }
            a.extend(prior);
            a
        };
        for q in [RX_QUEUE, TX_QUEUE] {
            let dq = if q == RX_QUEUE { &h.rx } else { &h.tx };
            let (avail, used) = (dq.avail, dq.used);
            let n = 1 + rng.below(8) as u16;
            for k in 0..n {
                let head = rng.below(N + 4) as u16;
                h.mem
                    .write_obj(head, GuestAddress(avail + 4 + 2 * u64::from(k)))
                    .unwrap();
            }
            let idx = if rng.chance(3) { rng.next() as u16 } else { n };
            h.mem.write_obj(idx, GuestAddress(avail + 2)).unwrap();
            let _ = used;
        }
        clear_dirty(h.mem);
        h.notify(TX_QUEUE as u32);
        h.notify(RX_QUEUE as u32);
        for _ in 0..1000 {
            if h.em.run_with_timeout(0).unwrap() == 0 {
                break;
            }
        }
        // A connection may have been made to the listener: let the host end go.
        while listener.accept().is_ok() {}
        for _ in 0..100 {
            if h.em.run_with_timeout(0).unwrap() == 0 {
                break;
            }
        }
        checked += assert_writes_within(h.mem, &allowed, &format!("input {round}"));
        tx_used += u64::from(h.mem.read_obj::<u16>(GuestAddress(h.tx.used + 2)).unwrap());
        rx_used += u64::from(h.mem.read_obj::<u16>(GuestAddress(h.rx.used + 2)).unwrap());
        // The driver resets the device and rebuilds its rings.
        h.write(reg::VIRTIO_MMIO_STATUS, 0);
        h.rx = DriverQueue::new(h.mem, 0x10000, 0x10_0000);
        h.tx = DriverQueue::new(h.mem, 0x20000, 0x10_0000 + 0x120_0000);
        h.ev = DriverQueue::new(h.mem, 0x30000, 0x10_0000 + 0x240_0000);
        h.rx_posted = 0;
        h.inbox.clear();
        h.driver_init();
        h.post_rx();
        h.pump();
        if round % 10 == 0 {
            still_connects(
                &mut h,
                round as u32,
                &format!("a connection after input {round}"),
            );
        }
    }
    println!(
        "vsock chains: {rounds} inputs, {tx_used} tx and {rx_used} rx chains returned, \
         {checked} written pages checked, a connection worked after every tenth input"
    );
    assert!(tx_used > 0 && rx_used > 0);
}

/// Bounded fuzzing of packet headers on a live device (no resets): random op, type, cids,
/// ports (mostly ones with listeners or live connections), lengths (matching the data or
/// not), flags, buf_alloc and fwd_cnt, while host programs accept, write and hang up. The
/// device must never panic, every packet it sends must be well-formed (the harness checks
/// each used length against its header; data fits the guest's buffer; addressed to the
/// guest), and new connections must keep working. `CLADE_FUZZ_ROUNDS` packets (default 3000).
#[test]
fn fuzzed_packet_headers_never_break_the_device() {
    use crate::virtio::fuzz_util::{rounds, Rng};
    let mem = test_mem();
    let mut h = Harness::new(&mem);
    let listeners: Vec<UnixListener> = (1..=3)
        .map(|p| {
            let l = UnixListener::bind(h.host_path(p)).unwrap();
            l.set_nonblocking(true).unwrap();
            l
        })
        .collect();
    let mut hosts: Vec<UnixStream> = Vec::new();
    let rng = Rng::new(0x6864_7266_757a_7a31);
    let rounds = rounds(3000);
    let mut ops_seen = [0u64; 8];
    let mut checks = 0;
    for round in 0..rounds {
        let data_len = rng.pick(&[0, 0, 1, 100, 4096, rng.below(8192)]) as usize;
        let data: Vec<u8> = (0..data_len).map(|_| rng.next() as u8).collect();
        let hdr = Hdr {
            src_cid: rng.pick(&[GUEST_CID, GUEST_CID, GUEST_CID, HOST_CID, rng.next()]),
            dst_cid: rng.pick(&[HOST_CID, HOST_CID, HOST_CID, GUEST_CID, rng.next()]),
            src_port: rng.pick(&[1000, 1001, 1002, rng.next() as u32]),
            dst_port: rng.pick(&[1, 2, 3, 9999, LOCAL_PORT_BASE, rng.next() as u32]),
            len: rng.pick(&[
                data_len as u32,
                data_len as u32,
                0,
                data_len as u32 + 1,
                65536,
                u32::MAX,
                rng.next() as u32,
            ]),
            type_: rng.pick(&[TYPE_STREAM, TYPE_STREAM, TYPE_STREAM, 2, rng.next() as u16]),
            op: rng.pick(&[
                OP_REQUEST,
                OP_RESPONSE,
                OP_RST,
                OP_SHUTDOWN,
                OP_RW,
                OP_RW,
                OP_CREDIT_UPDATE,
                OP_CREDIT_REQUEST,
                0,
                rng.next() as u16,
            ]),
            flags: rng.pick(&[0, 1, 2, 3, rng.next() as u32]),
            buf_alloc: rng.pick(&[0, 4096, GUEST_BUF, u32::MAX, rng.next() as u32]),
            fwd_cnt: rng.pick(&[0, 100, u32::MAX, rng.next() as u32]),
        };
        h.send(hdr, &data);
        h.pump();
        for l in &listeners {
            while let Ok((s, _)) = l.accept() {
                s.set_nonblocking(true).unwrap();
                hosts.push(s);
            }
        }
        let mut i = 0;
        while i < hosts.len() {
            let (_, eof) = host_read_available(&mut hosts[i]);
            if eof || rng.chance(2) {
                hosts.swap_remove(i);
                continue;
            }
            if rng.chance(20) {
                let _ = hosts[i].write(&vec![b'x'; rng.below(20_000) as usize]);
            }
            i += 1;
        }
        h.pump();
        for p in h.take() {
            ops_seen[usize::from(p.hdr.op).min(7)] += 1;
            assert!(
                p.hdr.len as usize <= RX_DATA as usize && p.hdr.dst_cid == GUEST_CID,
                "{p:?}"
            );
        }
        if round % 200 == 199 {
            still_connects(
                &mut h,
                checks,
                &format!("a connection after packet {round}"),
            );
            checks += 1;
        }
    }
    println!(
        "vsock headers: {rounds} packets, device sent per op (0..=7): {ops_seen:?}, \
         {checks} connection checks"
    );
}

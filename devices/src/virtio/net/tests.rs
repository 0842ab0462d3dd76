//! virtio-net tests: a synthetic guest driver (descriptor tables and rings in real guest
//! memory) drives the device through its virtio-mmio registers; the backend is a Unix
//! datagram socket pair (one datagram, one frame), or a real TAP in a private network
//! namespace (root only). The event loop is pumped on the test thread.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::Mutex;

use virtio_bindings::virtio_mmio as reg;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_HOST_TSO4,
    VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_TCPV4,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::event_loop::Manager;
use crate::virtio::mmio::MmioTransport;
use crate::virtio::test_util::{pattern, pump, restored_transport, MmioDriver};
use crate::virtio::VIRTIO_F_VERSION_1;
use crate::BusDevice;

const MEM_SIZE: usize = 16 << 20;
const Q: u16 = 16;
/// Descriptor table, available and used ring of each queue (receive, transmit).
const RINGS: [(u64, u64, u64); 2] = [(0x1000, 0x2000, 0x3000), (0x4000, 0x5000, 0x6000)];
const INDIRECT: u64 = 0x8000;
const RXBUF: u64 = 0x10_0000;
const TXBUF: u64 = 0x80_0000;
const ALL_OFFLOADS: u32 = offload::CSUM | offload::TSO4 | offload::TSO6 | offload::UFO;
const MAC: [u8; 6] = [0x02, 0x11, 0x22, 0x33, 0x44, 0x55];

/// A backend over one end of a datagram socket pair; remembers the offloads it was given.
struct SocketBackend {
    sock: UnixDatagram,
    caps: u32,
    offloads: Mutex<Vec<u32>>,
    /// How often the device asked for the capability (a probe, on a real TAP).
    probes: std::sync::atomic::AtomicUsize,
}

impl NetBackend for SocketBackend {
    fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.sock.recv(buf)
    }
    fn send(&self, frame: &[u8]) -> std::io::Result<usize> {
        self.sock.send(frame)
    }
    fn raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
    fn offload_capability(&self) -> u32 {
        self.probes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.caps
    }
    fn set_offloads(&self, flags: u32) -> std::io::Result<()> {
        // As the kernel does: offloads beyond what it takes are refused.
        if flags & !self.caps != 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        self.offloads.lock().unwrap().push(flags);
        Ok(())
    }
}

fn socket_backend(caps: u32) -> (Arc<SocketBackend>, UnixDatagram) {
    let (a, b) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    // Room for full-size frames in the socket buffers.
    for s in [&a, &b] {
        let sz: libc::c_int = 1 << 20;
        // SAFETY: SO_SNDBUF/SO_RCVBUF read one int, which lives across the call.
        unsafe {
            for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&sz as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
    }
    (
        Arc::new(SocketBackend {
            sock: a,
            caps,
            offloads: Mutex::new(Vec::new()),
            probes: Default::default(),
        }),
        b,
    )
}

/// A frame as the backend carries it: vnet header, then `data`.
fn frame(hdr: VnetHeader, data: &[u8]) -> Vec<u8> {
    let mut f = hdr.to_bytes().to_vec();
    f.extend_from_slice(data);
    f
}

/// A descriptor as the test builds it: guest address, length, device-writable.
type D = (u64, u32, bool);

struct Harness {
    mem: GuestMemory,
    em: Manager,
    transport: MmioTransport,
    backend: Arc<SocketBackend>,
    peer: UnixDatagram,
    stats: Arc<NetStats>,
    /// Per queue: next free descriptor index, available index, used entries seen.
    next_desc: [u16; 2],
    avail_idx: [u16; 2],
    used_seen: [u16; 2],
}

impl MmioDriver for Harness {
    fn transport(&mut self) -> &mut MmioTransport {
        &mut self.transport
    }
}

impl Harness {
    fn new() -> Self {
        Self::with(ALL_OFFLOADS, u64::MAX)
    }

    /// A device over a backend with offloads `caps`, the driver accepting the offered
    /// features in `accept`.
    fn with(caps: u32, accept: u64) -> Self {
        let (backend, peer) = socket_backend(caps);
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let em = Manager::new().unwrap();
        let dev = NetDevice::new(backend.clone(), MAC, em.remote_endpoint()).unwrap();
        let stats = dev.stats();
        let transport = MmioTransport::new(
            mem.clone(),
            Box::new(dev),
            EventFd::new(EFD_NONBLOCK).unwrap(),
        )
        .unwrap();
        let mut h = Self {
            mem,
            em,
            transport,
            backend,
            peer,
            stats,
            next_desc: [0; 2],
            avail_idx: [0; 2],
            used_seen: [0; 2],
        };
        assert_eq!(h.driver_init(accept), 0xf, "activation failed");
        h
    }

    /// What Linux's virtio_mmio + virtio_net do on probe; accepts the offered features in
    /// `accept`. Returns the status read back.
    fn driver_init(&mut self, accept: u64) -> u32 {
        self.negotiate(accept);
        self.mem
            .write_slice(&[0u8; 0x6000], GuestAddress(0x1000))
            .unwrap();
        for (q, &rings) in RINGS.iter().enumerate() {
            self.setup_queue(q as u32, QUEUE_SIZE, Q, rings);
        }
        self.write(reg::VIRTIO_MMIO_STATUS, 0xf);
        self.next_desc = [0; 2];
        self.avail_idx = [0; 2];
        self.used_seen = [0; 2];
        self.pump();
        self.read(reg::VIRTIO_MMIO_STATUS)
    }

    fn pump(&mut self) {
        pump(&mut self.em, 100);
    }

    /// Publishes a chain of `descs` on queue `q` (without notifying); returns its head.
    fn add_chain(&mut self, q: usize, descs: &[D]) -> u16 {
        let head = self.next_desc[q];
        for (i, &(addr, len, write)) in descs.iter().enumerate() {
            let idx = (head + i as u16) % Q;
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let d = SplitDescriptor::new(addr, len, flags, (idx + 1) % Q);
            self.mem
                .write_obj(d, GuestAddress(RINGS[q].0 + 16 * u64::from(idx)))
                .unwrap();
        }
        self.next_desc[q] = (head + descs.len() as u16) % Q;
        self.publish(q, head);
        head
    }

    fn publish(&mut self, q: usize, head: u16) {
        let avail = RINGS[q].1;
        let slot = avail + 4 + 2 * u64::from(self.avail_idx[q] % Q);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx[q] = self.avail_idx[q].wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx[q], GuestAddress(avail + 2))
            .unwrap();
    }

    fn notify(&mut self, q: usize) {
        self.write(reg::VIRTIO_MMIO_QUEUE_NOTIFY, q as u32);
        self.pump();
    }

    /// New used entries of queue `q`: (head, length).
    fn take_used(&mut self, q: usize) -> Vec<(u16, u32)> {
        let used = RINGS[q].2;
        let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen[q] != idx {
            let e = used + 4 + 8 * u64::from(self.used_seen[q] % Q);
            let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(e + 4)).unwrap();
            out.push((id as u16, len));
            self.used_seen[q] = self.used_seen[q].wrapping_add(1);
        }
        out
    }

    /// Sends `bytes` (vnet header included) from the guest in descriptors of at most `seg`
    /// bytes; returns the used entries.
    fn transmit(&mut self, bytes: &[u8], seg: usize) -> Vec<(u16, u32)> {
        self.mem.write_slice(bytes, GuestAddress(TXBUF)).unwrap();
        let descs: Vec<D> = bytes
            .chunks(seg)
            .enumerate()
            .map(|(i, c)| (TXBUF + (i * seg) as u64, c.len() as u32, false))
            .collect();
        self.add_chain(TX_QUEUE, &descs);
        self.notify(TX_QUEUE);
        self.take_used(TX_QUEUE)
    }

    /// Posts `n` one-descriptor receive buffers of `size` bytes each (at RXBUF + i * size).
    fn post_rx(&mut self, n: usize, size: u32) {
        for i in 0..n {
            self.add_chain(
                RX_QUEUE,
                &[(RXBUF + i as u64 * u64::from(size), size, true)],
            );
        }
        self.notify(RX_QUEUE);
    }

    /// What the backend's peer got from the device, if anything.
    fn peer_recv(&self) -> Option<Vec<u8>> {
        let mut b = vec![0u8; MAX_FRAME_LEN + 100];
        match self.peer.recv(&mut b) {
            Ok(n) => Some(b[..n].to_vec()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            Err(e) => panic!("peer recv: {e}"),
        }
    }

    /// The backend's peer sends `f` to the device.
    fn peer_send(&mut self, f: &[u8]) {
        self.peer.send(f).unwrap();
        self.pump();
    }

    fn counters(&self) -> NetCounters {
        self.stats.get()
    }

    /// The bytes at `addr`.
    fn guest(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
        b
    }
}

#[test]
fn identification_features_and_config() {
    let mut h = Harness::new();
    assert_eq!(h.read(reg::VIRTIO_MMIO_DEVICE_ID), 1);
    let f = h.features();
    for b in [
        VIRTIO_F_VERSION_1,
        VIRTIO_NET_F_MAC,
        VIRTIO_NET_F_STATUS,
        VIRTIO_NET_F_MRG_RXBUF,
        VIRTIO_NET_F_CSUM,
        VIRTIO_NET_F_GUEST_CSUM,
        VIRTIO_NET_F_HOST_TSO4,
        VIRTIO_NET_F_GUEST_TSO4,
        VIRTIO_NET_F_HOST_UFO,
    ] {
        assert!(f & (1 << b) != 0, "feature bit {b} offered");
    }
    assert_eq!(
        f & (1 << virtio_bindings::virtio_net::VIRTIO_NET_F_CTRL_VQ),
        0
    );
    let mut cfg = [0u8; 8];
    for (i, b) in cfg.iter_mut().enumerate() {
        let mut one = [0u8; 1];
        h.transport.read(0x100 + i as u64, &mut one);
        *b = one[0];
    }
    assert_eq!(&cfg[..6], &MAC);
    assert_eq!(u16::from_le_bytes([cfg[6], cfg[7]]), 1, "link up");
    // Without offloads in the backend: only the base features.
    let mut h = Harness::with(0, u64::MAX);
    let f = h.features();
    assert_eq!(
        f,
        (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_NET_F_MAC)
            | (1 << VIRTIO_NET_F_STATUS)
            | (1 << VIRTIO_NET_F_MRG_RXBUF)
    );
    // Checksum and TSO but no UFO.
    let mut h = Harness::with(offload::CSUM | offload::TSO4 | offload::TSO6, u64::MAX);
    let f = h.features();
    assert!(f & (1 << VIRTIO_NET_F_GUEST_TSO4) != 0);
    assert_eq!(f & (1 << VIRTIO_NET_F_HOST_UFO), 0);
    // A multicast MAC is refused.
    let (b, _p) = socket_backend(0);
    let em = Manager::new().unwrap();
    assert!(NetDevice::new(b, [1, 0, 0, 0, 0, 1], em.remote_endpoint()).is_err());
}

#[test]
fn feature_negotiation_sets_the_backend_offloads_and_checks_dependencies() {
    let h = Harness::new();
    assert_eq!(
        h.backend.offloads.lock().unwrap().last().copied(),
        Some(ALL_OFFLOADS),
        "everything the guest accepted"
    );
    // A driver that takes checksums but no TSO: only CSUM.
    let h = Harness::with(
        ALL_OFFLOADS,
        !((1 << VIRTIO_NET_F_GUEST_TSO4) | (1 << 8) | (1 << 10)),
    );
    assert_eq!(
        h.backend.offloads.lock().unwrap().last().copied(),
        Some(offload::CSUM)
    );
    // A driver that takes nothing optional: no offloads.
    let h = Harness::with(ALL_OFFLOADS, 1 << VIRTIO_F_VERSION_1);
    assert_eq!(h.backend.offloads.lock().unwrap().last().copied(), Some(0));
    // GUEST_TSO4 without GUEST_CSUM: activation refused, the device needs a reset.
    let mut h = Harness::with(0, u64::MAX);
    let (b, p) = socket_backend(ALL_OFFLOADS);
    let dev = NetDevice::new(b, MAC, h.em.remote_endpoint()).unwrap();
    h.transport = MmioTransport::new(
        h.mem.clone(),
        Box::new(dev),
        EventFd::new(EFD_NONBLOCK).unwrap(),
    )
    .unwrap();
    h.peer = p;
    let status = h.driver_init(!(1u64 << VIRTIO_NET_F_GUEST_CSUM));
    assert_eq!(status & 0x40, 0x40, "NEEDS_RESET, status {status:#x}");
    assert!(!h.transport.is_active());
}

#[test]
fn a_transmit_chain_of_several_descriptors_reaches_the_backend() {
    let mut h = Harness::new();
    let data = pattern(1, 1500);
    let f = frame(VnetHeader::default(), &data);
    // Header and data split at odd places over 5 descriptors.
    assert_eq!(h.transmit(&f, 400), vec![(0, 0)]);
    assert_eq!(h.peer_recv().unwrap(), f);
    // Header alone in the first descriptor, as Linux sends it.
    h.mem.write_slice(&f, GuestAddress(TXBUF)).unwrap();
    h.add_chain(TX_QUEUE, &[(TXBUF, 12, false), (TXBUF + 12, 1500, false)]);
    h.notify(TX_QUEUE);
    assert_eq!(h.take_used(TX_QUEUE).len(), 1);
    assert_eq!(h.peer_recv().unwrap(), f);
    // A full-size GSO frame in one go.
    let big = frame(
        VnetHeader {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM as u8,
            gso_type: VIRTIO_NET_HDR_GSO_TCPV4 as u8,
            hdr_len: 54,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
            num_buffers: 0,
        },
        &pattern(2, MAX_FRAME_LEN - VNET_HDR_LEN),
    );
    assert_eq!(h.transmit(&big, 8192).len(), 1);
    assert_eq!(
        h.peer_recv().unwrap(),
        big,
        "the header goes through unchanged"
    );
    h.pump();
    assert_eq!(
        h.counters(),
        NetCounters {
            tx_frames: 3,
            ..Default::default()
        }
    );
}

#[test]
fn received_frames_merge_across_small_buffers_and_fit_in_large_ones() {
    let mut h = Harness::new();
    // 3000 bytes of data + 12 of header in 1024-byte buffers: three of them.
    h.post_rx(4, 1024);
    let data = pattern(3, 3000);
    let hdr = VnetHeader {
        flags: 2, // DATA_VALID
        ..Default::default()
    };
    h.peer_send(&frame(hdr, &data));
    let used = h.take_used(RX_QUEUE);
    assert_eq!(used, vec![(0, 1024), (1, 1024), (2, 964)]);
    let got = h.guest(RXBUF, 3012);
    let rx_hdr = VnetHeader::parse(&got).unwrap();
    assert_eq!(
        rx_hdr,
        VnetHeader {
            num_buffers: 3,
            ..hdr
        }
    );
    assert_eq!(&got[12..], &data[..]);
    // The fourth buffer takes the next small frame whole.
    h.peer_send(&frame(VnetHeader::default(), &[7; 60]));
    assert_eq!(h.take_used(RX_QUEUE), vec![(3, 72)]);
    assert_eq!(
        VnetHeader::parse(&h.guest(RXBUF + 3 * 1024, 12))
            .unwrap()
            .num_buffers,
        1
    );
    // One big buffer takes a full-size frame.
    h.post_rx(1, MAX_FRAME_LEN as u32);
    let big = pattern(4, MAX_FRAME_LEN - VNET_HDR_LEN);
    h.peer_send(&frame(VnetHeader::default(), &big));
    let used = h.take_used(RX_QUEUE);
    assert_eq!(used, vec![(4, MAX_FRAME_LEN as u32)]);
    assert_eq!(h.guest(RXBUF + 12, big.len()), big);
    // A chain of several descriptors is one buffer.
    h.add_chain(
        RX_QUEUE,
        &[
            (RXBUF, 10, true),
            (RXBUF + 100, 20, true),
            (RXBUF + 200, 500, true),
        ],
    );
    h.notify(RX_QUEUE);
    h.peer_send(&frame(VnetHeader::default(), &pattern(5, 100)));
    assert_eq!(h.take_used(RX_QUEUE), vec![(5, 112)]);
    let mut got = h.guest(RXBUF, 10);
    got.extend(h.guest(RXBUF + 100, 20));
    got.extend(h.guest(RXBUF + 200, 82));
    assert_eq!(&got[12..], &pattern(5, 100)[..]);
    assert_eq!(VnetHeader::parse(&got).unwrap().num_buffers, 1);
    assert_eq!(h.counters().rx_frames, 4);
}

#[test]
fn a_frame_waits_for_receive_buffers_and_then_arrives() {
    let mut h = Harness::new();
    let data = pattern(6, 2000);
    h.peer_send(&frame(VnetHeader::default(), &data));
    h.peer_send(&frame(VnetHeader::default(), &pattern(7, 100)));
    assert!(h.take_used(RX_QUEUE).is_empty(), "no buffers yet");
    // One buffer too small for the first frame: it still waits, nothing is taken.
    h.post_rx(1, 1024);
    assert!(h.take_used(RX_QUEUE).is_empty());
    h.add_chain(RX_QUEUE, &[(RXBUF + 0x1000, 4096, true)]);
    h.notify(RX_QUEUE);
    assert_eq!(h.take_used(RX_QUEUE), vec![(0, 1024), (1, 988)]);
    let mut got = h.guest(RXBUF, 1024);
    got.extend(h.guest(RXBUF + 0x1000, 988));
    assert_eq!(&got[12..], &data[..]);
    // The second frame came on after the first: both in order, none lost.
    h.post_rx(1, 1024);
    assert_eq!(h.take_used(RX_QUEUE), vec![(2, 112)]);
    assert_eq!(h.counters().rx_dropped, 0);
}

#[test]
fn without_mergeable_buffers_a_frame_needs_one_chain() {
    let mut h = Harness::with(ALL_OFFLOADS, !(1u64 << VIRTIO_NET_F_MRG_RXBUF));
    h.post_rx(2, 1024);
    // Too big for one buffer: dropped, the buffers stay available.
    h.peer_send(&frame(VnetHeader::default(), &pattern(8, 1500)));
    assert!(h.take_used(RX_QUEUE).is_empty());
    h.peer_send(&frame(VnetHeader::default(), &pattern(9, 500)));
    assert_eq!(h.take_used(RX_QUEUE), vec![(0, 512)]);
    assert_eq!(
        VnetHeader::parse(&h.guest(RXBUF, 12)).unwrap().num_buffers,
        1
    );
    assert_eq!(&h.guest(RXBUF + 12, 500), &pattern(9, 500)[..]);
    let c = h.counters();
    assert_eq!((c.rx_frames, c.rx_dropped), (1, 1));
}

#[test]
fn bad_transmit_chains_are_returned_and_dropped() {
    let mut h = Harness::new();
    let good = frame(VnetHeader::default(), &pattern(10, 200));
    h.mem.write_slice(&good, GuestAddress(TXBUF)).unwrap();
    let mem_end = MEM_SIZE as u64;
    let bad: Vec<Vec<D>> = vec![
        vec![(TXBUF, 0, false)],                            // zero-length
        vec![(TXBUF, 8, false)],                            // shorter than the header
        vec![(TXBUF, 12, false), (TXBUF + 12, 200, true)],  // writable in a tx chain
        vec![(mem_end - 100, 212, false)],                  // past guest memory
        vec![(u64::MAX - 50, 212, false)],                  // wrapping address
        vec![(TXBUF, (MAX_FRAME_LEN + 1) as u32, false)],   // too long
        vec![(TXBUF, 12, false), (TXBUF, u32::MAX, false)], // huge
    ];
    for (i, chain) in bad.iter().enumerate() {
        h.add_chain(TX_QUEUE, chain);
        h.notify(TX_QUEUE);
        let used = h.take_used(TX_QUEUE);
        assert_eq!(used.len(), 1, "chain {i}");
        assert_eq!(used[0].1, 0, "chain {i}");
        assert!(h.peer_recv().is_none(), "chain {i} reached the backend");
    }
    // Too many descriptors (an indirect table of 300 one-byte-ish descriptors).
    for i in 0..300u64 {
        let flags = if i < 299 { VRING_DESC_F_NEXT as u16 } else { 0 };
        let d = SplitDescriptor::new(TXBUF, 12, flags, i as u16 + 1);
        h.mem.write_obj(d, GuestAddress(INDIRECT + 16 * i)).unwrap();
    }
    let head = h.next_desc[TX_QUEUE];
    h.mem
        .write_obj(
            SplitDescriptor::new(INDIRECT, 16 * 300, VRING_DESC_F_INDIRECT as u16, 0),
            GuestAddress(RINGS[TX_QUEUE].0 + 16 * u64::from(head)),
        )
        .unwrap();
    h.next_desc[TX_QUEUE] = (head + 1) % Q;
    h.publish(TX_QUEUE, head);
    h.notify(TX_QUEUE);
    assert_eq!(h.take_used(TX_QUEUE).len(), 1);
    assert!(
        h.peer_recv().is_none(),
        "the long chain reached the backend"
    );
    // A header asking for an offload the driver did not accept.
    let mut h2 = Harness::with(
        ALL_OFFLOADS,
        !(1u64 << VIRTIO_NET_F_CSUM) & !(1 << VIRTIO_NET_F_HOST_TSO4) & !(1 << 12) & !(1 << 14),
    );
    let csum = frame(
        VnetHeader {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM as u8,
            csum_start: 34,
            csum_offset: 6,
            ..Default::default()
        },
        &pattern(11, 100),
    );
    assert_eq!(h2.transmit(&csum, 4096).len(), 1);
    assert!(h2.peer_recv().is_none(), "NEEDS_CSUM without CSUM was sent");
    // The device still works.
    assert_eq!(h.transmit(&good, 64), vec![(h.next_desc[TX_QUEUE] - 4, 0)]);
    assert_eq!(h.peer_recv().unwrap(), good);
    h.pump();
    let c = h.counters();
    assert_eq!((c.tx_frames, c.tx_dropped), (1, bad.len() as u64 + 1));
}

#[test]
fn bad_receive_chains_are_returned_empty_and_the_frame_dropped() {
    let mut h = Harness::new();
    let mem_end = MEM_SIZE as u64;
    let bad: Vec<Vec<D>> = vec![
        vec![(RXBUF, 0, true)],                             // zero-length
        vec![(RXBUF, 100, false)],                          // device-readable
        vec![(RXBUF, 8, true)],                             // no room for the header
        vec![(mem_end - 10, 1000, true)],                   // past guest memory
        vec![(RXBUF, 100, true), (RXBUF + 200, 50, false)], // readable after writable
    ];
    for (i, chain) in bad.iter().enumerate() {
        let head = h.add_chain(RX_QUEUE, chain);
        h.notify(RX_QUEUE);
        h.mem
            .write_slice(&[0xee; 16], GuestAddress(mem_end - 16))
            .unwrap();
        h.peer_send(&frame(VnetHeader::default(), &pattern(i as u64, 300)));
        assert_eq!(h.take_used(RX_QUEUE), vec![(head, 0)], "chain {i}");
        assert_eq!(h.guest(mem_end - 16, 16), vec![0xee; 16], "chain {i}");
    }
    // A good buffer then a bad one for a frame that needs both: both come back empty.
    let a = h.add_chain(RX_QUEUE, &[(RXBUF, 100, true)]);
    let b = h.add_chain(RX_QUEUE, &[(RXBUF + 200, 100, false)]);
    h.notify(RX_QUEUE);
    h.peer_send(&frame(VnetHeader::default(), &pattern(20, 150)));
    assert_eq!(h.take_used(RX_QUEUE), vec![(a, 0), (b, 0)]);
    // Afterwards a good buffer works.
    let c = h.add_chain(RX_QUEUE, &[(RXBUF, 2048, true)]);
    h.notify(RX_QUEUE);
    h.peer_send(&frame(VnetHeader::default(), &pattern(21, 300)));
    assert_eq!(h.take_used(RX_QUEUE), vec![(c, 312)]);
    assert_eq!(&h.guest(RXBUF + 12, 300), &pattern(21, 300)[..]);
    let c = h.counters();
    assert_eq!((c.rx_frames, c.rx_dropped), (1, bad.len() as u64 + 1));
    // A runt from the backend (shorter than a header) is dropped, nothing taken.
    h.post_rx(1, 2048);
    h.peer_send(&[1, 2, 3]);
    assert!(h.take_used(RX_QUEUE).is_empty());
}

#[test]
fn vnet_header_bytes_and_transmit_rules() {
    let h = VnetHeader {
        flags: 1,
        gso_type: 4,
        hdr_len: 0x1234,
        gso_size: 1448,
        csum_start: 54,
        csum_offset: 16,
        num_buffers: 3,
    };
    let b = h.to_bytes();
    assert_eq!(b, [1, 4, 0x34, 0x12, 0xa8, 0x05, 54, 0, 16, 0, 3, 0]);
    assert_eq!(VnetHeader::parse(&b), Some(h));
    assert_eq!(VnetHeader::parse(&b[..11]), None);

    let all = features_for(ALL_OFFLOADS) | (1 << VIRTIO_F_VERSION_1);
    let none = 1u64 << VIRTIO_F_VERSION_1;
    let plain = VnetHeader::default();
    assert!(plain.check_tx(none).is_ok());
    let csum = VnetHeader {
        flags: VIRTIO_NET_HDR_F_NEEDS_CSUM as u8,
        ..plain
    };
    assert!(csum.check_tx(all).is_ok());
    assert!(csum.check_tx(none).is_err());
    let tso = VnetHeader {
        gso_type: VIRTIO_NET_HDR_GSO_TCPV4 as u8,
        gso_size: 1448,
        ..csum
    };
    assert!(tso.check_tx(all).is_ok());
    assert!(tso.check_tx(all & !(1 << VIRTIO_NET_F_HOST_TSO4)).is_err());
    assert!(VnetHeader { gso_size: 0, ..tso }.check_tx(all).is_err());
    assert!(
        VnetHeader {
            gso_type: 0x81,
            ..tso
        }
        .check_tx(all)
        .is_err(),
        "ECN not offered"
    );
    assert!(VnetHeader {
        gso_type: 0x80,
        ..plain
    }
    .check_tx(all)
    .is_err());
    assert!(VnetHeader { gso_type: 9, ..tso }.check_tx(all).is_err());
    // Feature helpers.
    assert_eq!(offloads_for(all), ALL_OFFLOADS);
    assert_eq!(offloads_for(none), 0);
    assert!(check_feature_dependencies(all).is_ok());
    assert!(check_feature_dependencies(1 << VIRTIO_NET_F_GUEST_TSO4).is_err());
    assert!(check_feature_dependencies(1 << VIRTIO_NET_F_HOST_TSO4).is_err());
    assert_eq!(
        parse_mac("02:AA:bb:0c:0d:ff"),
        Some([2, 0xaa, 0xbb, 0xc, 0xd, 0xff])
    );
    for bad in [
        "02:aa:bb:0c:0d",
        "02:aa:bb:0c:0d:ff:00",
        "2:aa:bb:0c:0d:ff",
        "zz:aa:bb:0c:0d:ff",
    ] {
        assert_eq!(parse_mac(bad), None, "{bad}");
    }
    assert_eq!(format_mac(&DEFAULT_MAC), "06:00:ac:10:00:02");
}

#[test]
fn a_saved_device_restores_onto_a_new_backend_at_its_queue_positions() {
    use snapshot::Persist;

    let mut h = Harness::new();
    h.post_rx(2, 2048);
    h.peer_send(&frame(VnetHeader::default(), &pattern(30, 100)));
    assert_eq!(h.take_used(RX_QUEUE).len(), 1);
    let f = frame(VnetHeader::default(), &pattern(31, 100));
    assert_eq!(h.transmit(&f, 4096).len(), 1);
    assert!(h.peer_recv().is_some());
    h.transport.pause_device();
    let st = h.transport.save().unwrap();
    h.transport.unpause_device();
    assert_eq!(
        st.queues[RX_QUEUE].position,
        QueuePosition {
            next_avail: 1,
            next_used: 1
        }
    );
    assert_eq!(st.queues[TX_QUEUE].position.next_used, 1);
    let VirtioDeviceState::Net(ns) = &st.device else {
        panic!("not a net state: {:?}", st.device)
    };
    assert_eq!(ns.mac, MAC);
    assert_eq!(ns.features, features_for(ALL_OFFLOADS));
    // The state survives its encoding.
    let bytes = postcard_roundtrip(&st);
    assert_eq!(bytes, st);

    // A new VM: a new backend, the transport at the saved state.
    let em = Manager::new().unwrap();
    let (backend, peer) = socket_backend(ALL_OFFLOADS);
    let dev = NetDevice::restore(ns, backend.clone(), em.remote_endpoint()).unwrap();
    h.stats = dev.stats();
    h.transport = restored_transport(&h.mem, Box::new(dev), &st);
    h.em = em;
    h.backend = backend;
    h.peer = peer;
    h.pump();
    assert_eq!(
        h.backend.offloads.lock().unwrap().last().copied(),
        Some(ALL_OFFLOADS),
        "the restored worker gives the new TAP the guest's offloads"
    );
    assert_eq!(
        h.backend.probes.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "a restore sets the saved offloads, it does not probe the TAP"
    );
    // The second posted buffer is still there; the next frame lands in it.
    h.peer_send(&frame(VnetHeader::default(), &pattern(32, 100)));
    assert_eq!(h.take_used(RX_QUEUE), vec![(1, 112)]);
    assert_eq!(&h.guest(RXBUF + 2048 + 12, 100), &pattern(32, 100)[..]);
    assert_eq!(h.transmit(&f, 4096).len(), 1);
    assert_eq!(h.peer_recv().unwrap(), f);

    // A backend without the offloads the saved device offered is refused, and so is a
    // state with features no device offers.
    let (weak, _p) = socket_backend(0);
    let err = NetDevice::restore(ns, weak, h.em.remote_endpoint())
        .err()
        .expect("missing offloads refused");
    assert!(err.to_string().contains("offloads"), "{err}");
    let (b, _p) = socket_backend(ALL_OFFLOADS);
    let odd = NetState {
        features: ns.features | (1 << 17),
        ..ns.clone()
    };
    assert!(NetDevice::restore(&odd, b, h.em.remote_endpoint()).is_err());
    // A device saved without offloads restores onto a TAP with them, offering none.
    let (b, _p) = socket_backend(ALL_OFFLOADS);
    let plain = NetState {
        features: features_for(0),
        ..ns.clone()
    };
    let d = NetDevice::restore(&plain, b, h.em.remote_endpoint()).unwrap();
    assert_eq!(d.avail_features(), features_for(0));
}

fn postcard_roundtrip(
    st: &crate::virtio::mmio::MmioTransportState,
) -> crate::virtio::mmio::MmioTransportState {
    let json = format!("{st:?}");
    assert!(json.contains("Net("));
    // serde round trip through the encoding snapshots use.
    let bytes = postcard::to_allocvec(st).unwrap();
    postcard::from_bytes(&bytes).unwrap()
}

/// Bounded fuzzing of both queues: random descriptor tables (flags, lengths, addresses
/// inside, at the edge of and outside guest memory, next pointers with loops and past the
/// table, indirect tables), random available rings, random frames from the backend of any
/// length. No input may panic the device or make it write guest memory outside the
/// device-writable buffers and the used rings; afterwards a valid frame goes each way
/// (after a reset when the input broke the rings). `CLADE_FUZZ_ROUNDS` inputs (default
/// 1500).
#[test]
fn fuzzed_descriptor_chains_never_break_the_device() {
    use crate::virtio::fuzz_util::{
        assert_writes_within, clear_dirty, rounds, writable_ranges, Rng,
    };
    const IND_DESCS: u64 = 64;
    let mut h = Harness::new();
    let rng = Rng::new(0x6e65_7466_757a_7a31);
    let rounds = rounds(1500);
    let (mut checked, mut resets) = (0usize, 0u64);
    for round in 0..rounds {
        let mut ring_trouble = false;
        let addr = |rng: &Rng, indirect: bool, trouble: &mut bool| -> u64 {
            if indirect {
                return match rng.below(4) {
                    0 => INDIRECT,
                    1 => INDIRECT + rng.below(IND_DESCS * 16),
                    2 => MEM_SIZE as u64 - rng.below(64),
                    _ => rng.pick(&[MEM_SIZE as u64 + 4096, u64::MAX - 8, 1 << 40]),
                };
            }
            match rng.below(9) {
                0 => RXBUF + rng.below(1 << 20),
                1 => TXBUF + rng.below(1 << 20),
                2 => MEM_SIZE as u64 - rng.below(1 << 17),
                3 => MEM_SIZE as u64 + rng.below(1 << 20),
                4 => u64::MAX - rng.below(1 << 16),
                5 => rng.next(),
                6 if rng.chance(5) => {
                    *trouble = true;
                    RINGS[rng.below(2) as usize].1 + rng.below(2) * 0x1000
                }
                _ => RXBUF + 4096 * rng.below(256),
            }
        };
        let len = |rng: &Rng| -> u32 {
            let r = rng.next() as u32;
            rng.pick(&[
                0,
                1,
                11,
                12,
                13,
                60,
                1500,
                4096,
                65562,
                65563,
                u32::MAX,
                r,
                r % 3000,
            ])
        };
        for &(table, _, _) in &RINGS {
            for i in 0..u64::from(Q) {
                let mut flags = rng.below(8) as u16;
                if rng.chance(3) {
                    flags = rng.next() as u16;
                }
                let indirect = flags & VRING_DESC_F_INDIRECT as u16 != 0;
                let a = addr(&rng, indirect, &mut ring_trouble);
                let l = if indirect {
                    16 * rng.below(IND_DESCS + 2) as u32 + rng.pick(&[0, 0, 0, 8])
                } else {
                    len(&rng)
                };
                let d = SplitDescriptor::new(a, l, flags, rng.below(u64::from(Q) + 4) as u16);
                h.mem.write_obj(d, GuestAddress(table + 16 * i)).unwrap();
            }
        }
        for i in 0..IND_DESCS {
            let flags = rng.below(8) as u16 & !(VRING_DESC_F_INDIRECT as u16);
            let a = addr(&rng, false, &mut ring_trouble);
            let d = SplitDescriptor::new(a, len(&rng), flags, rng.below(IND_DESCS + 4) as u16);
            h.mem.write_obj(d, GuestAddress(INDIRECT + 16 * i)).unwrap();
        }
        let mut idx = [0u16; 2];
        for q in 0..2 {
            let n = rng.below(5) as u16;
            for k in 0..n {
                let slot = RINGS[q].1 + 4 + 2 * u64::from(h.avail_idx[q].wrapping_add(k) % Q);
                h.mem
                    .write_obj(rng.below(u64::from(Q) + 4) as u16, GuestAddress(slot))
                    .unwrap();
            }
            idx[q] = h.avail_idx[q].wrapping_add(n);
            if rng.chance(3) {
                idx[q] = rng.next() as u16;
                ring_trouble = true;
            }
            h.mem
                .write_obj(idx[q], GuestAddress(RINGS[q].1 + 2))
                .unwrap();
        }
        // Frames from the backend: header plus 0..65562 bytes, sometimes runts.
        let frames = rng.below(4);
        for _ in 0..frames {
            let l = rng.pick(&[0, 5, 12, 60, 1514, 9000, MAX_FRAME_LEN as u64]) as usize;
            let mut f = pattern(rng.next(), l);
            if l >= 12 {
                f[10] = 0;
                f[11] = 0;
            }
            let _ = h.peer.send(&f);
        }
        let allowed = {
            let mut a = writable_ranges(
                &h.mem,
                &[
                    (RINGS[0].0, 16 * u64::from(Q)),
                    (RINGS[1].0, 16 * u64::from(Q)),
                    (INDIRECT, 16 * IND_DESCS),
                ],
                MAX_FRAME_LEN as u64,
                false,
            );
            for r in RINGS {
                a.push((r.2, 4 + 8 * u64::from(Q) + 2));
            }
            a
        };
        clear_dirty(&h.mem);
        h.write(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        h.write(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 1);
        h.pump();
        checked += assert_writes_within(&h.mem, &allowed, &format!("input {round}"));
        // Start over: drain the backend's leftovers, reset, and check a frame each way.
        while h.peer_recv().is_some() {}
        h.write(reg::VIRTIO_MMIO_STATUS, 0);
        h.pump();
        // Frames the old worker left in the socket would land in the new buffers.
        let mut sink = vec![0u8; MAX_FRAME_LEN + 1];
        while h.backend.sock.recv(&mut sink).is_ok() {}
        assert_eq!(h.driver_init(u64::MAX), 0xf, "input {round}");
        resets += u64::from(ring_trouble);
        let data = pattern(round as u64, 1000);
        let f = frame(VnetHeader::default(), &data);
        assert_eq!(h.transmit(&f, 333).len(), 1, "input {round}");
        assert_eq!(h.peer_recv().as_deref(), Some(&f[..]), "input {round}");
        h.post_rx(1, 4096);
        h.peer_send(&f);
        assert_eq!(h.take_used(RX_QUEUE), vec![(0, 1012)], "input {round}");
        assert_eq!(h.guest(RXBUF + 12, 1000), data, "input {round}");
    }
    println!(
        "virtio-net chains: {rounds} inputs, {resets} with damaged rings, {checked} written \
         pages checked"
    );
    assert!(checked > 0, "the inputs made the device write");
}

/// A real TAP in a private network namespace (needs root; `cargo test -- --ignored`):
/// the host kernel's ARP request reaches the guest's receive buffer, and a UDP datagram the
/// guest sends reaches a socket of the namespace. Nothing leaves the namespace, which goes
/// away with the test's thread.
#[test]
#[ignore = "needs root (CAP_NET_ADMIN) for a network namespace and a TAP"]
fn a_tap_in_a_private_namespace_passes_frames_both_ways() {
    std::thread::spawn(|| {
        // SAFETY: unshare only changes this thread's network namespace (a new, empty one).
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            panic!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
        }
        let tap = tap::Tap::open("clade-t0").expect("creating a TAP");
        let ip = |args: &[&str]| {
            // A child started from this thread lives in its namespace.
            let st = std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap();
            assert!(st.success(), "ip {args:?}");
        };
        ip(&["link", "set", "dev", "clade-t0", "up"]);
        ip(&["addr", "add", "10.200.0.1/24", "dev", "clade-t0"]);
        assert_eq!(
            tap.offload_capability() & (offload::CSUM | offload::TSO4),
            offload::CSUM | offload::TSO4,
            "this kernel takes TSO on a TAP"
        );
        let backend: Arc<dyn NetBackend> = Arc::new(tap);
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let em = Manager::new().unwrap();
        let dev = NetDevice::new(backend, MAC, em.remote_endpoint()).unwrap();
        let stats = dev.stats();
        let transport = MmioTransport::new(
            mem.clone(),
            Box::new(dev),
            EventFd::new(EFD_NONBLOCK).unwrap(),
        )
        .unwrap();
        let (b, p) = socket_backend(0);
        let mut h = Harness {
            mem,
            em,
            transport,
            backend: b,
            peer: p,
            stats,
            next_desc: [0; 2],
            avail_idx: [0; 2],
            used_seen: [0; 2],
        };
        assert_eq!(h.driver_init(u64::MAX), 0xf);
        h.post_rx(8, 2048);
        // Host -> guest: sending to 10.200.0.2 makes the kernel ask who has it.
        let udp = std::net::UdpSocket::bind("10.200.0.1:4000").unwrap();
        udp.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let _ = udp.send_to(b"hello guest", "10.200.0.2:5000");
        let mut arp = None;
        for _ in 0..500 {
            h.pump();
            for (head, len) in h.take_used(RX_QUEUE) {
                let f = h.guest(RXBUF + u64::from(head) * 2048, len as usize);
                // Ethertype ARP, target protocol address 10.200.0.2.
                if f.len() >= 12 + 42
                    && f[24..26] == [0x08, 0x06]
                    && f[12 + 38..12 + 42] == [10, 200, 0, 2]
                {
                    arp = Some(f);
                }
            }
            if arp.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let arp = arp.expect("the kernel's ARP request reached the guest");
        let src_mac: [u8; 6] = arp[12 + 6..12 + 12].try_into().unwrap();
        // Guest -> host: a UDP datagram from 10.200.0.2:5000 to 10.200.0.1:4000.
        let payload = b"hello host";
        let mut ipv4 = vec![
            0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, 17, 0, 0, 10, 200, 0, 2, 10, 200, 0, 1,
        ];
        let total = (20 + 8 + payload.len()) as u16;
        ipv4[2..4].copy_from_slice(&total.to_be_bytes());
        let mut sum = 0u32;
        for c in ipv4.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        ipv4[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
        let mut eth = src_mac.to_vec();
        eth.extend_from_slice(&MAC);
        eth.extend_from_slice(&[0x08, 0x00]);
        eth.extend_from_slice(&ipv4);
        eth.extend_from_slice(&5000u16.to_be_bytes());
        eth.extend_from_slice(&4000u16.to_be_bytes());
        eth.extend_from_slice(&(8 + payload.len() as u16).to_be_bytes());
        eth.extend_from_slice(&[0, 0]); // no UDP checksum
        eth.extend_from_slice(payload);
        let f = frame(VnetHeader::default(), &eth);
        assert_eq!(h.transmit(&f, 4096).len(), 1);
        let mut buf = [0u8; 64];
        let (n, from) = udp
            .recv_from(&mut buf)
            .expect("the guest's datagram arrived");
        assert_eq!(&buf[..n], payload);
        assert_eq!(from.to_string(), "10.200.0.2:5000");
        let c = h.counters();
        assert!(c.rx_frames >= 1 && c.tx_frames == 1, "{c:?}");
    })
    .join()
    .unwrap();
}

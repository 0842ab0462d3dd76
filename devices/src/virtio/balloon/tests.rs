//! virtio-balloon tests: a synthetic guest driver (descriptor tables and rings in real
//! guest memory) drives the device through its virtio-mmio registers; discards are either
//! recorded (to check exactly what the device gives back) or real `madvise` calls whose
//! effect is read back from the host (`mincore`, the memfd's holes). The event loop is
//! pumped on the test thread.

use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use virtio_bindings::virtio_mmio as reg;
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::event_loop::Manager;
use crate::virtio::mmio::MmioTransport;
use crate::virtio::test_util::{pattern, pump, restored_transport, MmioDriver};
use crate::BusDevice;

const MEM_SIZE: usize = 16 << 20;
const Q: u16 = 16;
/// Queue `q`'s descriptor table; its avail ring is 0x1000 above, its used ring 0x2000.
const fn ring(q: usize) -> u64 {
    0x1000 + 0x3000 * q as u64
}
const INDIRECT: u64 = 0xa000;
const PFNS: u64 = 0xc000;
/// Guest RAM the tests fill and report.
const DATA: u64 = 0x40_0000;
const MIB: u64 = 1 << 20;

/// Records every discard instead of doing it.
#[derive(Default)]
struct Recorder(Mutex<Vec<(u64, u64)>>);

impl Discard for Recorder {
    fn discard(&self, _mem: &GuestMemory, addr: GuestAddress, len: u64) -> crate::Result<()> {
        self.0.lock().unwrap().push((addr.0, len));
        Ok(())
    }
}

impl Recorder {
    fn take(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

struct Harness {
    mem: GuestMemory,
    em: Manager,
    transport: MmioTransport,
    stats: Arc<BalloonStats>,
    avail_idx: [u16; 3],
    used_seen: [u16; 3],
}

/// A descriptor as the test builds it: guest address, length, device-writable.
type D = (u64, u32, bool);

impl MmioDriver for Harness {
    fn transport(&mut self) -> &mut MmioTransport {
        &mut self.transport
    }
}

impl Harness {
    fn new(mem: GuestMemory, discard: Arc<dyn Discard>) -> Self {
        let em = Manager::new().unwrap();
        let dev = BalloonDevice::new(0, discard, em.remote_endpoint());
        let stats = dev.stats();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let transport = MmioTransport::new(mem.clone(), Box::new(dev), irq).unwrap();
        let mut h = Self {
            mem,
            em,
            transport,
            stats,
            avail_idx: [0; 3],
            used_seen: [0; 3],
        };
        h.driver_init();
        h
    }

    fn anonymous(discard: Arc<dyn Discard>) -> Self {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        Self::new(mem, discard)
    }

    fn recording() -> (Self, Arc<Recorder>) {
        let r = Arc::new(Recorder::default());
        (Self::anonymous(r.clone()), r)
    }

    /// What Linux's virtio_balloon does on probe: accept what is offered, set up the
    /// inflate, deflate and reporting queues.
    fn driver_init(&mut self) {
        let f = self.negotiate(u64::MAX);
        assert_ne!(f & (1 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING), 0);
        self.mem
            .write_slice(&[0u8; 0x9000], GuestAddress(ring(0)))
            .unwrap();
        for q in 0..3 {
            let b = ring(q);
            self.setup_queue(q as u32, QUEUE_SIZE, Q, (b, b + 0x1000, b + 0x2000));
        }
        self.write(reg::VIRTIO_MMIO_STATUS, 0xf);
        assert_eq!(self.read(reg::VIRTIO_MMIO_STATUS), 0xf, "activation failed");
        self.avail_idx = [0; 3];
        self.used_seen = [0; 3];
        self.pump();
    }

    fn pump(&mut self) {
        pump(&mut self.em, 100);
    }

    /// Publishes one chain (descriptors 0.., linked in order) on queue `q`, notifies and
    /// returns the used length the device reported (asserts exactly one used entry).
    fn submit(&mut self, q: usize, descs: &[D]) -> u32 {
        for (i, &(addr, len, write)) in descs.iter().enumerate() {
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let d = SplitDescriptor::new(addr, len, flags, i as u16 + 1);
            self.mem
                .write_obj(d, GuestAddress(ring(q) + 16 * i as u64))
                .unwrap();
        }
        self.publish_head(q, 0);
        self.notify(q);
        self.take_used(q)
    }

    fn publish_head(&mut self, q: usize, head: u16) {
        let avail = ring(q) + 0x1000;
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

    fn take_used(&mut self, q: usize) -> u32 {
        let used = ring(q) + 0x2000;
        let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).unwrap();
        assert_eq!(
            idx,
            self.used_seen[q].wrapping_add(1),
            "one chain, one used entry"
        );
        let e = used + 4 + 8 * u64::from(self.used_seen[q] % Q);
        self.used_seen[q] = idx;
        let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
        assert_eq!(id, 0);
        self.mem.read_obj(GuestAddress(e + 4)).unwrap()
    }

    /// Reports the free ranges `ranges` in one chain (device-writable, as Linux posts them).
    fn report(&mut self, ranges: &[(u64, u32)]) -> u32 {
        let d: Vec<D> = ranges.iter().map(|&(a, l)| (a, l, true)).collect();
        self.submit(REPORTING_QUEUE, &d)
    }

    fn refused(&self) -> u64 {
        self.stats.snapshot().2
    }
}

/// Pages of `len` bytes at host address `addr` resident in this process.
fn resident_pages(addr: *mut u8, len: usize) -> usize {
    let mut v = vec![0u8; len.div_ceil(PAGE as usize)];
    // SAFETY: `addr..addr + len` is a live mapping (guest memory of the test); mincore only
    // writes `v`, which has one byte per page.
    let r = unsafe { libc::mincore(addr.cast(), len, v.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    v.iter().filter(|&&b| b & 1 != 0).count()
}

fn host(mem: &GuestMemory, addr: u64) -> *mut u8 {
    mem.get_host_address(GuestAddress(addr)).unwrap()
}

#[test]
fn identification_features_and_config() {
    let (mut h, _) = Harness::recording();
    assert_eq!(h.read(reg::VIRTIO_MMIO_DEVICE_ID), 5);
    assert_eq!(
        h.features(),
        (1 << 32) | (1 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING)
    );
    assert_eq!(h.read(0x100), 0, "num_pages: the host asks for nothing");
    assert_eq!(h.read(0x104), 0, "actual");
    // The driver writes `actual`, at any width; `num_pages` is read-only.
    h.write(0x104, 1234);
    h.write(0x100, 99);
    assert_eq!(h.read(0x104), 1234);
    assert_eq!(h.read(0x100), 0);
    h.transport.write(0x105, &[1]);
    assert_eq!(h.read(0x104), 1234 & !0xff00 | 0x100);
    assert_eq!(h.read(0x108), 0, "free_page_hint_cmd_id");
    assert_eq!(h.read(0x10c), 0, "poison_val");
    assert_eq!(h.read(0x100 + 0x200), 0, "past the config reads 0");
    let mut b = [0xffu8; 8];
    h.transport.read(0x100 + u64::MAX / 2, &mut b);
    assert_eq!(b, [0; 8]);
}

#[test]
fn reported_ranges_are_discarded_and_come_back_used() {
    let (mut h, rec) = Harness::recording();
    assert_eq!(h.report(&[(DATA, 2 << 20)]), 0);
    assert_eq!(rec.take(), vec![(DATA, 2 << 20)]);
    // Several ranges in one chain, the last at the very end of guest RAM.
    let end = MEM_SIZE as u64;
    assert_eq!(h.report(&[(DATA, 4096), (end - 8192, 8192)]), 0);
    assert_eq!(rec.take(), vec![(DATA, 4096), (end - 8192, 8192)]);
    // Device-readable descriptors count too (the spec does not say which way they go).
    assert_eq!(h.submit(REPORTING_QUEUE, &[(DATA, 4096, false)]), 0);
    assert_eq!(rec.take(), vec![(DATA, 4096)]);
    assert_eq!(h.stats.snapshot(), ((2 << 20) + 4 * 4096, 0, 0));
    // An indirect table of ranges.
    for i in 0..4u64 {
        let mut flags = VRING_DESC_F_WRITE as u16;
        if i < 3 {
            flags |= VRING_DESC_F_NEXT as u16;
        }
        let d = SplitDescriptor::new(DATA + 2 * i * 4096, 4096, flags, i as u16 + 1);
        h.mem.write_obj(d, GuestAddress(INDIRECT + 16 * i)).unwrap();
    }
    let head = SplitDescriptor::new(INDIRECT, 64, VRING_DESC_F_INDIRECT as u16, 0);
    h.mem
        .write_obj(head, GuestAddress(ring(REPORTING_QUEUE)))
        .unwrap();
    h.publish_head(REPORTING_QUEUE, 0);
    h.notify(REPORTING_QUEUE);
    assert_eq!(h.take_used(REPORTING_QUEUE), 0);
    assert_eq!(rec.take().len(), 4);
}

#[test]
fn bad_ranges_are_refused_and_the_device_keeps_working() {
    let (mut h, rec) = Harness::recording();
    let end = MEM_SIZE as u64;
    let bad: [(u64, u32); 7] = [
        (DATA + 1, 4096),        // unaligned address
        (DATA, 4095),            // unaligned length
        (DATA, 0),               // empty
        (end - 4096, 8192),      // runs past guest RAM
        (end, 4096),             // outside
        (u64::MAX - 4095, 4096), // the last page of the address space
        (!4095, 8192),           // wraps
    ];
    for (i, &r) in bad.iter().enumerate() {
        assert_eq!(h.report(&[r]), 0, "{r:x?}");
        assert_eq!(h.refused(), i as u64 + 1, "{r:x?}");
    }
    // A bad range does not stop the good ones of its chain.
    assert_eq!(h.report(&[(DATA + 1, 4096), (DATA, 4096)]), 0);
    assert_eq!(rec.take(), vec![(DATA, 4096)]);
    // A head past the table cannot be returned; the driver resets and starts over.
    h.publish_head(REPORTING_QUEUE, Q + 3);
    h.notify(REPORTING_QUEUE);
    h.write(reg::VIRTIO_MMIO_STATUS, 0);
    h.pump();
    h.driver_init();
    assert_eq!(h.report(&[(DATA, 8192)]), 0);
    assert_eq!(rec.take(), vec![(DATA, 8192)]);
}

#[test]
fn inflated_pages_are_discarded_in_runs_and_deflate_is_returned() {
    let (mut h, rec) = Harness::recording();
    let first = DATA / PAGE;
    let pfns: Vec<u32> = vec![
        first as u32,
        first as u32 + 1,
        first as u32 + 2,
        first as u32 + 10,
        (MEM_SIZE as u64 / PAGE) as u32, // outside: refused
        u32::MAX,                        // outside: refused
        first as u32 + 11,
    ];
    let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
    h.mem.write_slice(&bytes, GuestAddress(PFNS)).unwrap();
    // Split over two descriptors, the split inside a PFN.
    let used = h.submit(
        INFLATE_QUEUE,
        &[(PFNS, 6, false), (PFNS + 6, bytes.len() as u32 - 6, false)],
    );
    assert_eq!(used, 0);
    assert_eq!(
        rec.take(),
        vec![
            (DATA, 3 * PAGE),
            (DATA + 10 * PAGE, PAGE),
            ((first + 11) * PAGE, PAGE)
        ]
    );
    assert_eq!(h.refused(), 2);
    assert_eq!(h.stats.snapshot().1, 5 * PAGE);
    // A PFN buffer outside guest memory: refused, the chain is still returned.
    assert_eq!(h.submit(INFLATE_QUEUE, &[(MEM_SIZE as u64, 8, false)]), 0);
    // Deflate: nothing to do but return the chain.
    assert_eq!(h.submit(DEFLATE_QUEUE, &[(PFNS, 8, false)]), 0);
    assert!(rec.take().is_empty());
}

#[test]
fn madvise_gives_private_memory_back_and_it_reads_as_zero() {
    let log = Arc::new(DiscardLog::for_memory(
        &GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap(),
    ));
    let mut h = Harness::anonymous(Arc::new(MadviseDiscard::with_log(log.clone())));
    let data = pattern(7, 4 * MIB as usize);
    h.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    let base = host(&h.mem, DATA);
    assert_eq!(resident_pages(base, 4 * MIB as usize), 1024);
    assert_eq!(h.report(&[(DATA + MIB, 2 << 20)]), 0);
    assert_eq!(
        resident_pages(base, 4 * MIB as usize),
        512,
        "2 MiB given back"
    );
    let mut got = vec![0u8; 4 * MIB as usize];
    h.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(
        &got[..MIB as usize],
        &data[..MIB as usize],
        "before: intact"
    );
    assert!(got[MIB as usize..3 * MIB as usize].iter().all(|&b| b == 0));
    assert_eq!(
        &got[3 * MIB as usize..],
        &data[3 * MIB as usize..],
        "after: intact"
    );
    // The log has exactly those pages.
    assert_eq!(log.pages(), 512);
    let taken = log.take();
    let first = ((DATA + MIB) / PAGE) as usize;
    for p in 0..MEM_SIZE / PAGE as usize {
        let set = taken[0][p / 64] & (1 << (p % 64)) != 0;
        assert_eq!(set, (first..first + 512).contains(&p), "page {p}");
    }
    assert_eq!(log.pages(), 0, "taken");
}

#[test]
fn madvise_punches_holes_in_shared_memfd_memory() {
    let name = std::ffi::CString::new("clade-balloon-test").unwrap();
    // SAFETY: a valid NUL-terminated name; returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(MEM_SIZE as u64).unwrap();
    let mem = GuestMemory::from_ranges_with_files(&[(
        GuestAddress(0),
        MEM_SIZE,
        Some(FileOffset::new(file.try_clone().unwrap(), 0)),
    )])
    .unwrap();
    let mut h = Harness::new(mem, Arc::new(MadviseDiscard::new()));
    let data = pattern(8, 4 * MIB as usize);
    h.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    assert_eq!(h.report(&[(DATA, 2 << 20)]), 0);
    // The file itself lost those pages: a hole that reads as zero.
    let mut b = vec![0xeeu8; 2 * MIB as usize];
    file.read_exact_at(&mut b, DATA).unwrap();
    assert!(b.iter().all(|&x| x == 0));
    file.read_exact_at(&mut b, DATA + 2 * MIB).unwrap();
    assert_eq!(b, data[2 * MIB as usize..]);
    // SAFETY: lseek on an fd this test owns.
    let next_data = unsafe { libc::lseek(fd, DATA as i64, libc::SEEK_DATA) };
    assert_eq!(next_data as u64, DATA + 2 * MIB, "SEEK_DATA skips the hole");
}

#[test]
fn a_saved_balloon_restores_at_its_queue_positions() {
    use snapshot::Persist;
    let (mut h, _) = Harness::recording();
    h.write(0x104, 77);
    assert_eq!(h.report(&[(DATA, 4096)]), 0);
    assert_eq!(h.report(&[(DATA, 4096)]), 0);
    h.transport.pause_device();
    let st = h.transport.save().unwrap();
    assert_eq!(
        st.queues[REPORTING_QUEUE].position,
        QueuePosition {
            next_avail: 2,
            next_used: 2
        }
    );
    let VirtioDeviceState::Balloon(bs) = st.device else {
        panic!("not a balloon state: {:?}", st.device)
    };
    assert_eq!(
        bs,
        BalloonState {
            num_pages: 0,
            actual: 77
        }
    );
    let em = Manager::new().unwrap();
    let rec = Arc::new(Recorder::default());
    let dev = BalloonDevice::restore(&bs, rec.clone(), em.remote_endpoint());
    h.stats = dev.stats();
    h.transport = restored_transport(&h.mem, Box::new(dev), &st);
    h.em = em;
    assert_eq!(h.read(0x104), 77);
    // take_used checks the used index moves on from 2.
    assert_eq!(h.report(&[(DATA + 4096, 4096)]), 0);
    assert_eq!(rec.take(), vec![(DATA + 4096, 4096)]);
}

#[test]
fn the_discard_log_keeps_pages_per_region() {
    let log = DiscardLog::new(&[(0, 64 * PAGE), (1 << 32, 128 * PAGE)]);
    log.mark(PAGE, 2 * PAGE);
    log.mark(63 * PAGE, 4 * PAGE); // past the first region's end: clipped
    log.mark((1 << 32) + 64 * PAGE, PAGE);
    log.mark(u64::MAX - PAGE, 2 * PAGE); // nowhere
    assert_eq!(log.pages(), 4);
    assert_eq!(log.take(), vec![vec![0b110 | 1 << 63], vec![0, 1]]);
    assert_eq!(log.take(), vec![vec![0], vec![0, 0]]);
}

/// Random descriptor tables, indirect tables and avail rings thrown at the reporting and
/// inflate queues: the device never panics or hangs, never writes guest memory outside
/// the used rings (a balloon writes no buffer), only ever discards page-aligned ranges
/// inside guest RAM, and a valid report still works afterwards (after a reset when the
/// input broke the rings themselves, as a guest driver would have to).
/// `CLADE_FUZZ_ROUNDS` inputs (default 1500).
#[test]
fn fuzzed_descriptor_chains_never_break_the_device() {
    use crate::virtio::fuzz_util::{assert_writes_within, clear_dirty, rounds, Rng};
    const IND_DESCS: u64 = 64;
    let (mut h, rec) = Harness::recording();
    let rng = Rng::new(0x6261_6c6c_6f6f_6e31);
    let rounds = rounds(1500);
    let (mut discards, mut refused, mut resets, mut checked) = (0u64, 0u64, 0u64, 0usize);
    for round in 0..rounds {
        let q = rng.pick(&[
            REPORTING_QUEUE,
            REPORTING_QUEUE,
            INFLATE_QUEUE,
            DEFLATE_QUEUE,
        ]);
        let mut ring_trouble = false;
        let addr = |rng: &Rng, ring_trouble: &mut bool| -> u64 {
            match rng.below(10) {
                0 => DATA + PAGE * rng.below(1024),
                1 => DATA + rng.below(8 << 20),
                2 => MEM_SIZE as u64 - PAGE * rng.below(64),
                3 => MEM_SIZE as u64 + PAGE * rng.below(256),
                4 => u64::MAX - rng.below(1 << 16),
                5 => rng.next() & !(PAGE - 1),
                6 => rng.next(),
                7 => PFNS,
                8 if rng.chance(5) => {
                    *ring_trouble = true;
                    ring(q) + 0x1000 * (1 + rng.below(2))
                }
                _ => 0,
            }
        };
        let len = |rng: &Rng| -> u32 {
            let (r, pages) = (rng.next() as u32, (rng.below(1024) * PAGE) as u32);
            rng.pick(&[
                0,
                1,
                4,
                4095,
                4096,
                8192,
                2 << 20,
                0xffff_f000,
                u32::MAX,
                r,
                pages,
            ])
        };
        let desc = |rng: &Rng, ring_trouble: &mut bool, table: u64| {
            let mut flags = rng.below(8) as u16; // NEXT, WRITE, INDIRECT
            if rng.chance(3) {
                flags = rng.next() as u16;
            }
            let (a, l) = if flags & VRING_DESC_F_INDIRECT as u16 != 0 {
                let a = rng.pick(&[INDIRECT, INDIRECT + rng.below(IND_DESCS * 16), u64::MAX - 8]);
                (
                    a,
                    16 * rng.below(IND_DESCS + 2) as u32 + rng.pick(&[0, 0, 0, 8]),
                )
            } else {
                (addr(rng, ring_trouble), len(rng))
            };
            SplitDescriptor::new(a, l, flags, rng.below(table + 4) as u16)
        };
        for i in 0..u64::from(Q) {
            let d = desc(&rng, &mut ring_trouble, u64::from(Q));
            h.mem.write_obj(d, GuestAddress(ring(q) + 16 * i)).unwrap();
        }
        for i in 0..IND_DESCS {
            let d = desc(&rng, &mut ring_trouble, IND_DESCS);
            h.mem.write_obj(d, GuestAddress(INDIRECT + 16 * i)).unwrap();
        }
        for i in 0..256u64 {
            let pfn = rng.pick(&[
                (DATA / PAGE + rng.below(1024)) as u32,
                rng.next() as u32,
                (MEM_SIZE as u64 / PAGE) as u32,
            ]);
            h.mem.write_obj(pfn, GuestAddress(PFNS + 4 * i)).unwrap();
        }
        let n = 1 + rng.below(4) as u16;
        let mut returnable = n;
        let avail = ring(q) + 0x1000;
        for k in 0..n {
            let slot = avail + 4 + 2 * u64::from(h.avail_idx[q].wrapping_add(k) % Q);
            let head = rng.below(u64::from(Q) + 4) as u16;
            returnable -= u16::from(head >= Q);
            h.mem.write_obj(head, GuestAddress(slot)).unwrap();
        }
        let mut idx = h.avail_idx[q].wrapping_add(n);
        if rng.chance(3) {
            idx = rng.next() as u16;
            ring_trouble = true;
        }
        h.mem.write_obj(idx, GuestAddress(avail + 2)).unwrap();
        let used_ring = ring(q) + 0x2000;
        let before = h.refused();
        clear_dirty(&h.mem);
        h.notify(q);
        checked += assert_writes_within(
            &h.mem,
            &[(used_ring, 4 + 8 * u64::from(Q) + 2)],
            &format!("input {round}"),
        );
        for (a, l) in rec.take() {
            assert!(
                a % PAGE == 0 && l % PAGE == 0 && l > 0 && a + l <= MEM_SIZE as u64,
                "input {round}: discarded {l:#x} at {a:#x}"
            );
            discards += 1;
        }
        refused += h.refused() - before;
        let used: u16 = h.mem.read_obj(GuestAddress(used_ring + 2)).unwrap();
        if !ring_trouble {
            assert!(
                used.wrapping_sub(h.used_seen[q]) <= n,
                "input {round}: more used entries than chains"
            );
        }
        if ring_trouble || used.wrapping_sub(h.used_seen[q]) != returnable {
            h.write(reg::VIRTIO_MMIO_STATUS, 0);
            h.pump();
            h.driver_init();
            resets += 1;
        } else {
            h.avail_idx[q] = idx;
            h.used_seen[q] = used;
        }
        // A valid report still works.
        let at = DATA + PAGE * rng.below(512);
        assert_eq!(h.report(&[(at, 8192)]), 0, "input {round}");
        assert_eq!(rec.take(), vec![(at, 8192)], "input {round}");
    }
    println!(
        "virtio-balloon chains: {rounds} inputs, {discards} ranges discarded, {refused} \
         refused, {resets} resets, {checked} written pages checked"
    );
    assert!(
        discards > 0 && refused > 0,
        "the inputs reach both outcomes"
    );
}

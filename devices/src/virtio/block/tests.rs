//! virtio-blk tests: a synthetic guest driver (descriptor table and rings in real guest
//! memory) drives the device through its virtio-mmio registers; the disk is a real layered
//! image in a temporary directory. The event loop is pumped on the test thread.

use std::path::{Path, PathBuf};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_mmio as reg;
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::DescriptorTable;
use vm_memory::{Bytes, GuestAddress};

use crate::GuestMemory;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::event_loop::Manager;
use crate::virtio::mmio::MmioTransport;
use crate::virtio::test_util::{pattern, pump, restored_transport, MmioDriver, TempDir};
use crate::BusDevice;

const MEM_SIZE: usize = 16 << 20;
const Q: u16 = 16;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
const STATUS: u64 = 0x4000;
const HDR: u64 = 0x5000;
const DATA: u64 = 0x10_0000;
/// Where the tests put an indirect descriptor table (room for 4096 descriptors).
const INDIRECT: u64 = 0x8000;
const MIB: u64 = 1 << 20;
const BS: u64 = disk::DEFAULT_BLOCK_SIZE as u64;

/// A 4 MiB frozen base (first MiB pattern(1)) and an overlay on it; returns the overlay.
fn base_and_overlay(dir: &Path) -> PathBuf {
    let mut raw = pattern(1, MIB as usize);
    raw.resize(4 * MIB as usize, 0);
    std::fs::write(dir.join("base.raw"), &raw).unwrap();
    disk::ops::import_raw(&dir.join("base.raw"), &dir.join("base.cdsk"), None).unwrap();
    let top = dir.join("top.cdsk");
    disk::ops::create(
        &top,
        &disk::ops::CreateOptions {
            parent: Some(dir.join("base.cdsk")),
            ..Default::default()
        },
    )
    .unwrap();
    top
}

struct Harness {
    mem: GuestMemory,
    em: Manager,
    transport: MmioTransport,
    disk: Arc<Mutex<disk::Disk>>,
    avail_idx: u16,
    used_seen: u16,
    _dir: TempDir,
    top: PathBuf,
}

/// A descriptor as the test builds it: guest address, length, device-writable.
type D = (u64, u32, bool);

impl MmioDriver for Harness {
    fn transport(&mut self) -> &mut MmioTransport {
        &mut self.transport
    }
}

impl Harness {
    fn new() -> Self {
        Self::with(disk::OpenOptions::default(), None)
    }

    fn with(opts: disk::OpenOptions, limit: Option<u64>) -> Self {
        let dir = TempDir::new("clade-blk");
        let top = base_and_overlay(&dir.0);
        let mut d = disk::Disk::open(&top, opts).unwrap();
        d.set_size_limit(limit);
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let em = Manager::new().unwrap();
        let dev = BlockDevice::new(d, "clade-test-disk", em.remote_endpoint()).unwrap();
        let disk = dev.disk();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let transport = MmioTransport::new(mem.clone(), Box::new(dev), irq).unwrap();
        let mut h = Self {
            mem,
            em,
            transport,
            disk,
            avail_idx: 0,
            used_seen: 0,
            _dir: dir,
            top,
        };
        h.driver_init();
        h
    }

    /// What Linux's virtio_mmio + virtio_blk do on probe: accept what is offered.
    fn driver_init(&mut self) {
        self.negotiate(u64::MAX);
        self.mem
            .write_slice(&[0u8; 0x3000], GuestAddress(DESC))
            .unwrap();
        self.setup_queue(0, QUEUE_SIZE, Q, (DESC, AVAIL, USED));
        self.write(reg::VIRTIO_MMIO_STATUS, 0xf);
        assert_eq!(self.read(reg::VIRTIO_MMIO_STATUS), 0xf, "activation failed");
        self.avail_idx = 0;
        self.used_seen = 0;
        self.pump();
    }

    fn pump(&mut self) {
        pump(&mut self.em, 100);
    }

    /// Publishes a chain (descriptors 0.., linked in order, unless `link` overrides the
    /// next index of the last one) and returns the used length the device reported.
    fn submit_raw(&mut self, descs: &[D], last_next: Option<u16>) -> u32 {
        let table = DescriptorTable::new(&self.mem, GuestAddress(DESC), Q);
        for (i, &(addr, len, write)) in descs.iter().enumerate() {
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            let mut next = 0;
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
                next = i as u16 + 1;
            } else if let Some(n) = last_next {
                flags |= VRING_DESC_F_NEXT as u16;
                next = n;
            }
            table
                .store(
                    i as u16,
                    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next)),
                )
                .unwrap();
        }
        self.publish_head_and_notify();
        self.take_used()
    }

    /// Publishes a request whose descriptors are all in one indirect table: header, `data`,
    /// status byte. Returns (status, used length).
    fn request_indirect(&mut self, type_: u32, sector: u64, data: &[D]) -> (u32, u32) {
        self.set_header(type_, sector);
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let mut descs = vec![(HDR, 16, false)];
        descs.extend_from_slice(data);
        descs.push((STATUS, 1, true));
        assert!(descs.len() <= 4096);
        for (i, &(addr, len, write)) in descs.iter().enumerate() {
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let d = SplitDescriptor::new(addr, len, flags, i as u16 + 1);
            self.mem
                .write_obj(d, GuestAddress(INDIRECT + 16 * i as u64))
                .unwrap();
        }
        let table = DescriptorTable::new(&self.mem, GuestAddress(DESC), Q);
        let head = SplitDescriptor::new(
            INDIRECT,
            16 * descs.len() as u32,
            VRING_DESC_F_INDIRECT as u16,
            0,
        );
        table.store(0, RawDescriptor::from(head)).unwrap();
        self.publish_head_and_notify();
        (self.status(), self.take_used())
    }

    /// Makes descriptor 0 available, notifies and pumps.
    fn publish_head_and_notify(&mut self) {
        let slot = AVAIL + 4 + 2 * u64::from(self.avail_idx % Q);
        self.mem.write_obj(0u16, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(AVAIL + 2))
            .unwrap();
        self.write(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        self.pump();
    }

    /// The used length of the one new used entry (asserts there is exactly one).
    fn take_used(&mut self) -> u32 {
        let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        assert_eq!(
            idx,
            self.used_seen.wrapping_add(1),
            "one request, one used entry"
        );
        let e = USED + 4 + 8 * u64::from(self.used_seen % Q);
        self.used_seen = idx;
        let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
        assert_eq!(id, 0);
        self.mem.read_obj(GuestAddress(e + 4)).unwrap()
    }

    fn set_header(&self, type_: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&type_.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
    }

    fn status(&self) -> u32 {
        u32::from(self.mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
    }

    /// A request: header, then `data` descriptors, then the status byte. Returns (status,
    /// used length).
    fn request(&mut self, type_: u32, sector: u64, data: &[D]) -> (u32, u32) {
        self.set_header(type_, sector);
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let mut descs = vec![(HDR, 16, false)];
        descs.extend_from_slice(data);
        descs.push((STATUS, 1, true));
        let used = self.submit_raw(&descs, None);
        (self.status(), used)
    }

    /// Writes `bytes` at `sector` in segments of at most `seg` bytes.
    fn write_sectors(&mut self, sector: u64, bytes: &[u8], seg: usize) -> u32 {
        self.mem.write_slice(bytes, GuestAddress(DATA)).unwrap();
        let descs: Vec<D> = bytes
            .chunks(seg)
            .enumerate()
            .map(|(i, c)| (DATA + (i * seg) as u64, c.len() as u32, false))
            .collect();
        let (status, used) = self.request(VIRTIO_BLK_T_OUT, sector, &descs);
        assert_eq!(used, 1, "a write returns only the status byte");
        status
    }

    /// Reads `len` bytes at `sector` in segments of at most `seg` bytes.
    fn read_sectors(&mut self, sector: u64, len: usize, seg: usize) -> (u32, Vec<u8>) {
        let dst = DATA + 0x40_0000;
        self.mem
            .write_slice(&vec![0xee; len], GuestAddress(dst))
            .unwrap();
        let descs: Vec<D> = (0..len.div_ceil(seg))
            .map(|i| {
                let n = seg.min(len - i * seg);
                (dst + (i * seg) as u64, n as u32, true)
            })
            .collect();
        let (status, used) = self.request(VIRTIO_BLK_T_IN, sector, &descs);
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(dst)).unwrap();
        if status == VIRTIO_BLK_S_OK {
            assert_eq!(used as usize, len + 1);
        }
        (status, out)
    }
}

#[test]
fn identification_features_and_config() {
    let mut h = Harness::new();
    assert_eq!(h.read(reg::VIRTIO_MMIO_DEVICE_ID), 2);
    let f = h.features();
    assert_eq!(
        f,
        (1 << 32)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_SIZE_MAX)
    );
    // capacity (le64 sectors), size_max and seg_max, at any access width.
    let mut cap = [0u8; 8];
    h.transport.read(0x100, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), 4 * MIB / 512);
    assert_eq!(h.read(0x100 + 8), SIZE_MAX);
    assert_eq!(h.read(0x100 + 12), SEG_MAX);
    let mut one = [0u8; 1];
    h.transport.read(0x101, &mut one);
    assert_eq!(one[0], ((4 * MIB / 512) >> 8) as u8);
    assert_eq!(h.read(0x100 + 0x200), 0, "past the config reads 0");
    // A read-only disk says so.
    let mut h = Harness::with(disk::OpenOptions { read_only: true }, None);
    assert_ne!(h.features() & (1 << VIRTIO_BLK_F_RO), 0);
}

#[test]
fn reads_writes_get_id_and_flush() {
    let mut h = Harness::new();
    // The base shows through a fresh overlay.
    let (s, got) = h.read_sectors(0, 8192, 4096);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(got, pattern(1, 8192));
    // A multi-segment write at an unaligned (but whole-sector) offset, read back with a
    // different segmentation.
    let data = pattern(9, 3 * 4096 + 512);
    assert_eq!(h.write_sectors(129, &data, 4096), VIRTIO_BLK_S_OK);
    let (s, got) = h.read_sectors(129, data.len(), 1536);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(got, data);
    // The sector before is still the base's.
    let (_, got) = h.read_sectors(128, 512, 512);
    assert_eq!(got, pattern(1, MIB as usize)[128 * 512..129 * 512]);
    // A large write across blocks, in segments of size_max.
    let big = pattern(10, 300 * 1024);
    assert_eq!(
        h.write_sectors(4000, &big, SIZE_MAX as usize),
        VIRTIO_BLK_S_OK
    );
    let (_, got) = h.read_sectors(4000, big.len(), 64 * 1024);
    assert_eq!(got, big);

    // GET_ID: the serial, NUL-padded to 20 bytes.
    let (s, used) = h.request(VIRTIO_BLK_T_GET_ID, 0, &[(DATA, 20, true)]);
    assert_eq!((s, used), (VIRTIO_BLK_S_OK, 21));
    let mut id = [0u8; 20];
    h.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id, b"clade-test-disk\0\0\0\0\0");

    // FLUSH: afterwards the overlay file on the host holds the data and the table points
    // at it, without relying on the process (read with a plain open: the disk is locked).
    let (s, used) = h.request(VIRTIO_BLK_T_FLUSH, 0, &[]);
    assert_eq!((s, used), (VIRTIO_BLK_S_OK, 1));
    let file = std::fs::read(&h.top).unwrap();
    let entry = |idx: usize| {
        let o = disk::table_offset_for(disk::VERSION) as usize + idx * 8;
        u64::from_le_bytes(file[o..o + 8].try_into().unwrap()) as usize
    };
    // Sector 129 is 512 bytes into block 1.
    let off = entry(1);
    assert_ne!(off, 0, "block 1 committed");
    assert_eq!(&file[off + 512..off + 512 + data.len()], &data[..]);
    let b = (4000 * 512) / BS as usize;
    assert_ne!(entry(b), 0);
    let within = 4000 * 512 - b * BS as usize;
    assert_eq!(
        &file[entry(b) + within..entry(b) + BS as usize],
        &big[..BS as usize - within]
    );
}

#[test]
fn bad_requests_get_an_error_status_and_the_device_keeps_working() {
    let mut h = Harness::new();
    let sectors = 4 * MIB / 512;
    // Out of range, straddling the end, overflowing, partial sectors.
    for (sector, len) in [(sectors, 512), (sectors - 1, 1024), (u64::MAX / 256, 512)] {
        let (s, _) = h.read_sectors(sector, len, len);
        assert_eq!(s, VIRTIO_BLK_S_IOERR, "read {len} at {sector}");
        assert_eq!(
            h.write_sectors(sector, &vec![1; len], len),
            VIRTIO_BLK_S_IOERR
        );
    }
    let (s, _) = h.read_sectors(0, 100, 100);
    assert_eq!(s, VIRTIO_BLK_S_IOERR, "not whole sectors");
    assert_eq!(h.write_sectors(0, &[7; 700], 700), VIRTIO_BLK_S_IOERR);
    // Unknown request type.
    let (s, used) = h.request(42, 0, &[]);
    assert_eq!((s, used), (VIRTIO_BLK_S_UNSUPP, 1));
    // Header too short: answered with IOERR.
    h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    let used = h.submit_raw(&[(HDR, 8, false), (STATUS, 1, true)], None);
    assert_eq!((h.status(), used), (VIRTIO_BLK_S_IOERR, 1));
    // No status byte at all: cannot be answered, returned with used length 0.
    h.set_header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(h.submit_raw(&[(HDR, 16, false)], None), 0);
    // Readable after writable.
    h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    assert_eq!(
        h.submit_raw(
            &[
                (HDR, 16, false),
                (DATA, 512, true),
                (DATA, 512, false),
                (STATUS, 1, true)
            ],
            None
        ),
        0
    );
    assert_eq!(h.status(), 0xff, "nothing written for a malformed chain");
    // A loop, and a next index past the table.
    assert_eq!(
        h.submit_raw(&[(HDR, 16, false), (STATUS, 1, true)], Some(0)),
        0
    );
    assert_eq!(
        h.submit_raw(&[(HDR, 16, false), (STATUS, 1, true)], Some(Q + 3)),
        0
    );
    // Buffers outside guest memory.
    h.set_header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(
        h.submit_raw(
            &[
                (HDR, 16, false),
                (MEM_SIZE as u64 - 256, 512, true),
                (STATUS, 1, true)
            ],
            None
        ),
        0
    );
    h.set_header(VIRTIO_BLK_T_OUT, 0);
    assert_eq!(
        h.submit_raw(
            &[
                (HDR, 16, false),
                (u64::MAX - 100, 512, false),
                (STATUS, 1, true)
            ],
            None
        ),
        0
    );
    // The device still serves good requests, and nothing bad reached the disk.
    let (s, got) = h.read_sectors(0, 4096, 4096);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(got, pattern(1, 4096));
    assert_eq!(
        h.disk.lock().unwrap().layers()[0].allocated_blocks(),
        0,
        "no failed write touched the overlay"
    );
}

#[test]
fn writes_to_a_read_only_disk_fail() {
    let mut h = Harness::with(disk::OpenOptions { read_only: true }, None);
    assert_eq!(h.write_sectors(0, &[1; 512], 512), VIRTIO_BLK_S_IOERR);
    let (s, got) = h.read_sectors(0, 512, 512);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(got, pattern(1, 512));
    let (s, _) = h.request(VIRTIO_BLK_T_FLUSH, 0, &[]);
    assert_eq!(s, VIRTIO_BLK_S_OK);
}

#[test]
fn host_disk_full_is_an_io_error_and_the_image_stays_consistent() {
    // Room for exactly two new blocks in the overlay.
    let dir = TempDir::new("clade-blk");
    let top = base_and_overlay(&dir.0);
    let room = std::fs::metadata(&top).unwrap().len() + 2 * BS;
    drop(dir);
    let mut h = Harness::with(disk::OpenOptions::default(), Some(room));
    let a = pattern(20, 4096);
    assert_eq!(h.write_sectors(0, &a, 4096), VIRTIO_BLK_S_OK);
    assert_eq!(h.write_sectors(BS / 512, &a, 4096), VIRTIO_BLK_S_OK);
    // A third block does not fit: the guest gets IOERR.
    assert_eq!(
        h.write_sectors(2 * BS / 512, &pattern(21, 4096), 4096),
        VIRTIO_BLK_S_IOERR
    );
    // Rewrites of blocks already in the overlay still work; flush works.
    let b = pattern(22, 1024);
    assert_eq!(h.write_sectors(8, &b, 1024), VIRTIO_BLK_S_OK);
    let (s, _) = h.request(VIRTIO_BLK_T_FLUSH, 0, &[]);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    // The block that failed still reads as the base (zeros there), the others as written.
    let (_, got) = h.read_sectors(2 * BS / 512, 4096, 4096);
    assert_eq!(
        got,
        pattern(1, MIB as usize)[2 * BS as usize..2 * BS as usize + 4096]
    );
    let (_, got) = h.read_sectors(0, 8192, 8192);
    let mut want = a.clone();
    want.extend_from_slice(&pattern(1, 8192)[4096..]);
    want[8 * 512..8 * 512 + 1024].copy_from_slice(&b);
    assert_eq!(got, want);
    // After the VMM is gone, the image opens cleanly with the same content.
    let top = h.top.clone();
    let dir = std::mem::replace(&mut h._dir, TempDir(PathBuf::from("/nonexistent-clade")));
    drop(h);
    let d = disk::Disk::open(&top, disk::OpenOptions { read_only: true }).unwrap();
    let mut got = vec![0u8; 8192];
    d.read_at(0, &mut got).unwrap();
    assert_eq!(got, want);
    assert_eq!(d.layers()[0].allocated_blocks(), 2);
    drop(d);
    drop(dir);
}

#[test]
fn reset_stops_the_worker_and_a_new_driver_can_start_again() {
    let mut h = Harness::new();
    assert_eq!(h.write_sectors(0, &[5; 512], 512), VIRTIO_BLK_S_OK);
    h.write(reg::VIRTIO_MMIO_STATUS, 0);
    h.pump();
    assert!(!h.transport.is_active());
    h.driver_init();
    let (s, got) = h.read_sectors(0, 512, 512);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(got, vec![5; 512]);
}

#[test]
fn a_running_disk_can_be_frozen_for_a_fork() {
    let mut h = Harness::new();
    assert_eq!(h.write_sectors(0, &[1; 512], 512), VIRTIO_BLK_S_OK);
    // The fork: between two requests, freeze the current top; the VM continues on a new
    // overlay, a child gets its own overlay on the frozen layer.
    let dir = h.top.parent().unwrap().to_path_buf();
    let frozen = h
        .disk
        .lock()
        .unwrap()
        .snapshot(&dir.join("top.2.cdsk"))
        .unwrap();
    assert_eq!(frozen, h.top);
    let child = dir.join("child.cdsk");
    disk::ops::create(
        &child,
        &disk::ops::CreateOptions {
            parent: Some(frozen),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(h.write_sectors(0, &[2; 512], 512), VIRTIO_BLK_S_OK);
    let (_, got) = h.read_sectors(0, 512, 512);
    assert_eq!(got, vec![2; 512], "the VM sees its own later write");
    let c = disk::Disk::open(&child, disk::OpenOptions { read_only: true }).unwrap();
    let mut got = vec![0u8; 1024];
    c.read_at(0, &mut got).unwrap();
    assert_eq!(
        &got[..512],
        &[1; 512][..],
        "the child sees the state at the fork"
    );
    assert_eq!(
        &got[512..],
        &pattern(1, 1024)[512..],
        "and the base below it"
    );
}

#[test]
fn a_saved_device_restores_onto_a_fork_childs_overlay_at_its_queue_position() {
    use snapshot::Persist;

    let mut h = Harness::new();
    assert_eq!(h.write_sectors(0, &[1; 512], 512), VIRTIO_BLK_S_OK);
    assert_eq!(h.write_sectors(8, &[7; 512], 512), VIRTIO_BLK_S_OK);
    // Paused, the device reports where its queue stands and its identity.
    h.transport.pause_device();
    let st = h.transport.save().unwrap();
    assert_eq!(
        st.queues[0].position,
        QueuePosition {
            next_avail: 2,
            next_used: 2
        }
    );
    let VirtioDeviceState::Block(bs) = &st.device else {
        panic!("not a block state: {:?}", st.device)
    };
    assert_eq!(&bs.serial[..15], b"clade-test-disk");
    // The fork's disk half, while paused.
    let dir = h.top.parent().unwrap().to_path_buf();
    let frozen = h
        .disk
        .lock()
        .unwrap()
        .snapshot(&dir.join("top.2.cdsk"))
        .unwrap();
    h.transport.unpause_device();
    let child = dir.join("child.cdsk");
    disk::ops::create(
        &child,
        &disk::ops::CreateOptions {
            parent: Some(frozen),
            ..Default::default()
        },
    )
    .unwrap();
    let parent_disk = Arc::clone(&h.disk);

    // The child: a new device over its own overlay, the transport at the saved state.
    let em = Manager::new().unwrap();
    let c = disk::Disk::open(&child, disk::OpenOptions::default()).unwrap();
    let dev = BlockDevice::restore(bs, c, em.remote_endpoint()).unwrap();
    h.disk = dev.disk();
    h.transport = restored_transport(&h.mem, Box::new(dev), &st);
    h.em = em;
    // The next request continues at the saved ring positions (submit_raw checks the used
    // index moves from 2 to 3) and sees the disk as it was at the fork.
    let (s, got) = h.read_sectors(0, 512, 512);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(got, vec![1; 512]);
    assert_eq!(h.write_sectors(0, &[3; 512], 512), VIRTIO_BLK_S_OK);
    let (_, got) = h.read_sectors(0, 512, 512);
    assert_eq!(got, vec![3; 512], "the child sees its own write");
    let mut p = vec![0u8; 512];
    parent_disk.lock().unwrap().read_at(0, &mut p).unwrap();
    assert_eq!(p, vec![1; 512], "the parent does not see the child's write");

    // A disk of another size is refused.
    let mut other = bs.clone();
    other.size += 512;
    let base = dir.join("base.cdsk");
    let c2 = disk::Disk::open(&base, disk::OpenOptions { read_only: true }).unwrap();
    other.read_only = true;
    let err = BlockDevice::restore(&other, c2, h.em.remote_endpoint())
        .err()
        .expect("size mismatch refused");
    assert!(err.to_string().contains("bytes"), "{err}");
}

#[test]
fn requests_over_the_size_limits_get_an_error_status() {
    let mut h = Harness::new();
    let sectors_before = h.disk.lock().unwrap().layers()[0].allocated_blocks();
    // More data segments than seg_max (through an indirect table): IOERR, nothing written.
    let n = SEG_MAX as usize + 1;
    let segs: Vec<D> = (0..n)
        .map(|i| (DATA + 512 * i as u64, 512, false))
        .collect();
    h.mem
        .write_slice(&vec![0x5a; 512 * n], GuestAddress(DATA))
        .unwrap();
    assert_eq!(
        h.request_indirect(VIRTIO_BLK_T_OUT, 0, &segs),
        (VIRTIO_BLK_S_IOERR, 1)
    );
    let segs: Vec<D> = (0..n).map(|i| (DATA + 512 * i as u64, 512, true)).collect();
    assert_eq!(
        h.request_indirect(VIRTIO_BLK_T_IN, 0, &segs),
        (VIRTIO_BLK_S_IOERR, 1)
    );
    // One segment larger than size_max.
    let big = SIZE_MAX as usize + 4096;
    h.mem
        .write_slice(&vec![0x5a; big], GuestAddress(DATA))
        .unwrap();
    assert_eq!(
        h.request(VIRTIO_BLK_T_OUT, 0, &[(DATA, big as u32, false)]),
        (VIRTIO_BLK_S_IOERR, 1)
    );
    assert_eq!(
        h.request(VIRTIO_BLK_T_IN, 0, &[(DATA, big as u32, true)]),
        (VIRTIO_BLK_S_IOERR, 1)
    );
    // A guest-claimed ~4 GiB buffer: refused from the descriptor lengths alone (before, it
    // was mapped and would have been transferred in full had the memory been there).
    assert_eq!(
        h.request(VIRTIO_BLK_T_IN, 0, &[(0, 0xffff_f000, true)]),
        (VIRTIO_BLK_S_IOERR, 1)
    );
    assert_eq!(
        h.request(
            VIRTIO_BLK_T_OUT,
            0,
            &[(0, 0x8000_0000, false), (0, 0x7fff_0000, false)]
        ),
        (VIRTIO_BLK_S_IOERR, 1)
    );
    // Too long, and the status byte is outside guest memory: cannot be answered.
    h.set_header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(
        h.submit_raw(
            &[
                (HDR, 16, false),
                (DATA, big as u32, true),
                (MEM_SIZE as u64 + 4096, 1, true)
            ],
            None
        ),
        0
    );
    assert_eq!(
        h.disk.lock().unwrap().layers()[0].allocated_blocks(),
        sectors_before,
        "no refused write reached the disk"
    );

    // Legal requests at the limits work: seg_max segments (indirect), size_max segments.
    let n = SEG_MAX as usize;
    let data = pattern(30, 8192 * n);
    h.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    let segs: Vec<D> = (0..n)
        .map(|i| (DATA + 8192 * i as u64, 8192, false))
        .collect();
    assert_eq!(
        h.request_indirect(VIRTIO_BLK_T_OUT, 16, &segs),
        (VIRTIO_BLK_S_OK, 1)
    );
    let mut got = vec![0u8; data.len()];
    h.disk.lock().unwrap().read_at(16 * 512, &mut got).unwrap();
    assert_eq!(got, data);
    let dst = DATA + 0x40_0000;
    let segs: Vec<D> = (0..n)
        .map(|i| (dst + 8192 * i as u64, 8192, true))
        .collect();
    let (s, used) = h.request_indirect(VIRTIO_BLK_T_IN, 16, &segs);
    assert_eq!((s, used as usize), (VIRTIO_BLK_S_OK, data.len() + 1));
    let mut got = vec![0u8; data.len()];
    h.mem.read_slice(&mut got, GuestAddress(dst)).unwrap();
    assert_eq!(got, data);
    // Header and data in one descriptor (any layout): size_max of data still accepted.
    let one = pattern(31, SIZE_MAX as usize);
    h.set_header(VIRTIO_BLK_T_OUT, 0);
    let mut hdr = [0u8; 16];
    h.mem.read_slice(&mut hdr, GuestAddress(HDR)).unwrap();
    h.mem.write_slice(&hdr, GuestAddress(DATA)).unwrap();
    h.mem.write_slice(&one, GuestAddress(DATA + 16)).unwrap();
    h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    let used = h.submit_raw(&[(DATA, SIZE_MAX + 16, false), (STATUS, 1, true)], None);
    assert_eq!((h.status(), used), (VIRTIO_BLK_S_OK, 1));
    let (_, got) = h.read_sectors(0, one.len(), 8192);
    assert_eq!(got, one);
}

#[test]
fn a_full_queue_of_large_requests_is_served_in_bounded_rounds() {
    let mut h = Harness::new();
    // Six 4 MiB reads (64 segments of size_max each, in indirect tables): 24 MiB, more
    // than one round's budget.
    let per = 4 * MIB as usize;
    let segs = per / SIZE_MAX as usize;
    let table = DescriptorTable::new(&h.mem, GuestAddress(DESC), Q);
    let reqs = 6u16;
    h.set_header(VIRTIO_BLK_T_IN, 0);
    for r in 0..reqs {
        let base = INDIRECT + u64::from(r) * 16 * (segs as u64 + 2);
        let mut descs: Vec<D> = vec![(HDR, 16, false)];
        descs.extend((0..segs).map(|i| (DATA + (i as u64) * u64::from(SIZE_MAX), SIZE_MAX, true)));
        descs.push((STATUS + u64::from(r), 1, true));
        for (i, &(addr, len, write)) in descs.iter().enumerate() {
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let d = SplitDescriptor::new(addr, len, flags, i as u16 + 1);
            h.mem
                .write_obj(d, GuestAddress(base + 16 * i as u64))
                .unwrap();
        }
        let head = SplitDescriptor::new(
            base,
            16 * descs.len() as u32,
            VRING_DESC_F_INDIRECT as u16,
            0,
        );
        table.store(r, RawDescriptor::from(head)).unwrap();
        h.mem
            .write_obj(r, GuestAddress(AVAIL + 4 + 2 * u64::from(r)))
            .unwrap();
    }
    h.mem.write_obj(reqs, GuestAddress(AVAIL + 2)).unwrap();
    h.write(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 0);
    // One turn of the event loop serves one round's budget, not the whole queue.
    h.em.run_with_timeout(0).unwrap();
    let idx: u16 = h.mem.read_obj(GuestAddress(USED + 2)).unwrap();
    let per_round = (ROUND_BYTES as usize).div_ceil(per) as u16;
    assert_eq!(idx, per_round, "first round");
    // The worker rescheduled itself: the rest follows on the next turns.
    h.pump();
    let idx: u16 = h.mem.read_obj(GuestAddress(USED + 2)).unwrap();
    assert_eq!(idx, reqs);
    for r in 0..reqs {
        let s: u8 = h.mem.read_obj(GuestAddress(STATUS + u64::from(r))).unwrap();
        assert_eq!(u32::from(s), VIRTIO_BLK_S_OK, "request {r}");
    }
}

/// Bounded fuzzing of the request path: random descriptor tables (flags, lengths, addresses
/// inside, at the edge of and far outside guest memory, next pointers with loops and past
/// the table, indirect tables), random headers and random available rings, then a notify.
/// No input may panic the device or make it write guest memory outside the device-writable
/// buffers and the used ring, and after each one a valid write and read work (after a reset
/// when the input broke the rings themselves, as a guest driver would have to).
/// `CLADE_FUZZ_ROUNDS` inputs (default 1500).
#[test]
fn fuzzed_descriptor_chains_never_break_the_device() {
    use crate::virtio::fuzz_util::{
        assert_writes_within, clear_dirty, rounds, writable_ranges, Rng,
    };
    const IND_DESCS: u64 = 64;
    let mut h = Harness::new();
    let mut rng = Rng::new(0x626c_6b66_757a_7a31);
    let rounds = rounds(1500);
    let (mut completed, mut dropped, mut resets, mut checked) = (0u64, 0u64, 0u64, 0usize);
    let capacity = 4 * MIB / 512;
    for round in 0..rounds {
        let mut ring_trouble = false;
        let mut addr = |rng: &mut Rng, indirect: bool, ring_trouble: &mut bool| -> u64 {
            if indirect {
                return match rng.below(4) {
                    0 => INDIRECT,
                    1 => INDIRECT + rng.below(IND_DESCS * 16),
                    2 => MEM_SIZE as u64 - rng.below(64),
                    _ => rng.pick(&[MEM_SIZE as u64 + 4096, u64::MAX - 8, 1 << 40]),
                };
            }
            match rng.below(10) {
                0 => HDR,
                1 => STATUS,
                2 => DATA + 512 * rng.below(4096),
                3 => DATA + rng.below(8 << 20),
                4 => MEM_SIZE as u64 - rng.below(1 << 17),
                5 => MEM_SIZE as u64 + rng.below(1 << 20),
                6 => u64::MAX - rng.below(1 << 16),
                7 => rng.next(),
                8 if rng.chance(5) => {
                    // The avail or used ring: the guest lets the device scribble on them.
                    *ring_trouble = true;
                    rng.pick(&[AVAIL, USED])
                }
                _ if rng.chance(5) => 0,
                _ => DATA + rng.below(1 << 20),
            }
        };
        let len = |rng: &mut Rng| -> u32 {
            let (r, sectors) = (rng.next() as u32, (rng.below(256) * 512) as u32);
            rng.pick(&[
                0,
                1,
                8,
                16,
                17,
                512,
                4096,
                65536,
                SIZE_MAX + 16,
                SIZE_MAX + 17,
                0xffff_f000,
                u32::MAX,
                r,
                sectors,
            ])
        };
        let desc = |rng: &mut Rng,
                    addr: &mut dyn FnMut(&mut Rng, bool, &mut bool) -> u64,
                    ring_trouble: &mut bool,
                    table: u64| {
            let mut flags = (rng.below(8)) as u16; // NEXT, WRITE, INDIRECT
            if rng.chance(3) {
                flags = rng.next() as u16;
            }
            let indirect = flags & VRING_DESC_F_INDIRECT as u16 != 0;
            let a = addr(rng, indirect, ring_trouble);
            let l = if indirect {
                16 * rng.below(IND_DESCS + 2) as u32 + rng.pick(&[0, 0, 0, 8])
            } else {
                len(rng)
            };
            let next = rng.below(table + 4) as u16;
            SplitDescriptor::new(a, l, flags, next)
        };
        for i in 0..u64::from(Q) {
            let d = desc(&mut rng, &mut addr, &mut ring_trouble, u64::from(Q));
            h.mem.write_obj(d, GuestAddress(DESC + 16 * i)).unwrap();
        }
        for i in 0..IND_DESCS {
            let d = desc(&mut rng, &mut addr, &mut ring_trouble, IND_DESCS);
            h.mem.write_obj(d, GuestAddress(INDIRECT + 16 * i)).unwrap();
        }
        let r = rng.next() as u32;
        let type_ = rng.pick(&[
            VIRTIO_BLK_T_IN,
            VIRTIO_BLK_T_OUT,
            VIRTIO_BLK_T_FLUSH,
            VIRTIO_BLK_T_GET_ID,
            r,
        ]);
        let (inside, r) = (rng.below(capacity), rng.next());
        let sector = rng.pick(&[0, inside, capacity - 1, capacity, u64::MAX / 512, r]);
        h.set_header(type_, sector);
        let n = 1 + rng.below(4) as u16;
        // Heads past the table cannot be returned in the used ring.
        let mut returnable = n;
        for k in 0..n {
            let slot = AVAIL + 4 + 2 * u64::from(h.avail_idx.wrapping_add(k) % Q);
            let head = rng.below(u64::from(Q) + 4) as u16;
            returnable -= u16::from(head >= Q);
            h.mem.write_obj(head, GuestAddress(slot)).unwrap();
        }
        let mut idx = h.avail_idx.wrapping_add(n);
        if rng.chance(3) {
            idx = rng.next() as u16;
            ring_trouble = true;
        }
        h.mem.write_obj(idx, GuestAddress(AVAIL + 2)).unwrap();
        let allowed = {
            // The device writes at most size_max (+ header) into a buffer, and the status
            // byte: the last byte of the last descriptor.
            let mut a = writable_ranges(
                &h.mem,
                &[(DESC, 16 * u64::from(Q)), (INDIRECT, 16 * IND_DESCS)],
                u64::from(SIZE_MAX) + 16,
                true,
            );
            a.push((USED, 4 + 8 * u64::from(Q) + 2));
            a
        };
        clear_dirty(&h.mem);
        h.write(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        h.pump();
        checked += assert_writes_within(&h.mem, &allowed, &format!("input {round}"));
        // What came back.
        let used: u16 = h.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        if !ring_trouble {
            assert!(
                used.wrapping_sub(h.used_seen) <= n,
                "input {round}: more used entries than requests"
            );
            for k in 0..used.wrapping_sub(h.used_seen) {
                let e = USED + 4 + 8 * u64::from(h.used_seen.wrapping_add(k) % Q);
                let len: u32 = h.mem.read_obj(GuestAddress(e + 4)).unwrap();
                if len == 0 {
                    dropped += 1;
                } else {
                    completed += 1;
                }
            }
        }
        // A valid request still works.
        if ring_trouble || used.wrapping_sub(h.used_seen) != returnable {
            // Some chains are still in the ring (or the rings were damaged): the driver
            // resets the device and starts over.
            h.write(reg::VIRTIO_MMIO_STATUS, 0);
            h.pump();
            h.driver_init();
            resets += 1;
        } else {
            h.avail_idx = idx;
            h.used_seen = used;
        }
        let at = rng.below(capacity - 8);
        let data = pattern(round as u64, 4096);
        assert_eq!(
            h.write_sectors(at, &data, 4096),
            VIRTIO_BLK_S_OK,
            "input {round}"
        );
        let (s, got) = h.read_sectors(at, 4096, 1024);
        assert_eq!(s, VIRTIO_BLK_S_OK, "input {round}");
        assert_eq!(got, data, "input {round}");
    }
    println!(
        "virtio-blk chains: {rounds} inputs, {completed} chains answered, {dropped} returned \
         unanswered, {resets} resets (damaged rings or chains left in the ring), {checked} \
         written pages checked"
    );
    assert!(
        completed > 0 && dropped > 0,
        "the inputs reach both outcomes"
    );
}

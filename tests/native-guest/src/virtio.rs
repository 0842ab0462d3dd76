//! A minimal polling virtio driver core: the virtio-mmio (version 2, "modern") transport and
//! split virtqueues.
//!
//! The VMM's layout (devices/src/virtio/mod.rs): slot `n` at `0xd000_1000 + n * 0x1000`, up
//! to 18 slots, GSI `6 + n`. This driver polls the used rings in guest memory (no VM exit)
//! while it has work, with interrupts suppressed (`VIRTQ_AVAIL_F_NO_INTERRUPT`), and asks for
//! them only before it halts ([`Virtqueue::set_interrupts`]). It tells the device about new
//! buffers through QueueNotify (a KVM ioeventfd in the VMM: an exit to the kernel only, never
//! to the VMM's userspace).
//!
//! Guest-physical addresses equal virtual ones here (identity map), so ring and buffer
//! addresses are plain pointers.

use crate::io::{mmio_read32, mmio_write32};
use core::cell::UnsafeCell;
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

/// First virtio-mmio slot and slot stride (vmm/src/arch/layout.rs).
pub const MMIO_BASE: u64 = 0xd000_1000;
pub const SLOT_SIZE: u64 = 0x1000;
/// `VIRTIO_MMIO_MAX_SLOTS` in vmm/src/arch/layout.rs.
pub const MAX_SLOTS: u64 = 18;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;

// Register offsets (virtio 1.x spec, 4.2.2).
const REG_MAGIC: u64 = 0x000;
const REG_VERSION: u64 = 0x004;
const REG_DEVICE_ID: u64 = 0x008;
const REG_DEVICE_FEATURES: u64 = 0x010;
const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM_MAX: u64 = 0x034;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
const REG_QUEUE_NOTIFY: u64 = 0x050;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DESC_HIGH: u64 = 0x084;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const REG_CONFIG: u64 = 0x100;

// Device status bits.
const S_ACKNOWLEDGE: u32 = 1;
const S_DRIVER: u32 = 2;
const S_DRIVER_OK: u32 = 4;
const S_FEATURES_OK: u32 = 8;
const S_NEEDS_RESET: u32 = 0x40;
const S_FAILED: u32 = 0x80;

/// The one feature this driver accepts: modern device (bit 32).
pub const F_VERSION_1: u64 = 1 << 32;

/// Entries per virtqueue (a power of two, <= the device's QueueNumMax).
pub const QSIZE: usize = 16;

const DESC_F_WRITE: u16 = 2;
/// avail.flags: "don't interrupt me" (we poll). A hint the device may ignore (so a
/// stray interrupt is harmless); without it the device must interrupt after using buffers.
const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// used.flags: the device does not need QueueNotify for now.
const USED_F_NO_NOTIFY: u16 = 1;

/// Memory the device reads or writes (rings, buffers): a static the compiler must not
/// assume it owns exclusively. All accesses go through raw pointers.
pub struct Dma<T>(UnsafeCell<T>);

// SAFETY: one CPU runs the guest and nothing else touches these statics except the device,
// which is synchronised with through the ring protocol (volatile accesses and fences).
unsafe impl<T> Sync for Dma<T> {}

impl<T> Dma<T> {
    pub const fn new(v: T) -> Self {
        Dma(UnsafeCell::new(v))
    }

    pub fn get(&self) -> *mut T {
        self.0.get()
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UsedElem {
    id: u32,
    len: u32,
}

#[repr(C, align(4))]
struct Used {
    flags: u16,
    idx: u16,
    ring: [UsedElem; QSIZE],
    avail_event: u16,
}

/// One split virtqueue's rings in a page of their own: descriptor table (16-byte aligned,
/// at the page start), available ring (2-byte aligned), used ring (4-byte aligned).
#[repr(C, align(4096))]
pub struct Ring {
    desc: [Desc; QSIZE],
    avail_flags: u16,
    avail_idx: u16,
    avail_ring: [u16; QSIZE],
    used_event: u16,
    used: Used,
}

const _: () = assert!(core::mem::size_of::<Ring>() == 4096);

impl Ring {
    pub const ZERO: Ring = Ring {
        desc: [Desc {
            addr: 0,
            len: 0,
            flags: 0,
            next: 0,
        }; QSIZE],
        avail_flags: 0,
        avail_idx: 0,
        avail_ring: [0; QSIZE],
        used_event: 0,
        used: Used {
            flags: 0,
            idx: 0,
            ring: [UsedElem { id: 0, len: 0 }; QSIZE],
            avail_event: 0,
        },
    };
}

/// The driver's view of one virtqueue. Descriptors are used one per buffer (no chains).
pub struct Virtqueue {
    ring: *mut Ring,
    /// Next free slot in the available ring (the driver's copy of avail.idx).
    avail_idx: u16,
    /// used.idx up to which used buffers were taken.
    last_used: u16,
}

impl Virtqueue {
    /// Takes over `ring` and clears it.
    ///
    /// # Safety
    /// `ring` must stay valid and be used by nothing else while the queue and the device use it.
    pub unsafe fn new(ring: *mut Ring) -> Virtqueue {
        write_volatile(ring, Ring::ZERO);
        write_volatile(addr_of_mut!((*ring).avail_flags), AVAIL_F_NO_INTERRUPT);
        Virtqueue {
            ring,
            avail_idx: 0,
            last_used: 0,
        }
    }

    /// Guest-physical addresses of the descriptor table, available ring and used ring.
    pub fn addresses(&self) -> (u64, u64, u64) {
        let r = self.ring;
        // SAFETY: only addresses are taken.
        unsafe {
            (
                addr_of!((*r).desc) as u64,
                addr_of!((*r).avail_flags) as u64,
                addr_of!((*r).used) as u64,
            )
        }
    }

    /// Points descriptor `i` at a buffer; `device_writes` for buffers the device fills.
    pub fn set_desc(&mut self, i: u16, addr: u64, len: u32, device_writes: bool) {
        let flags = if device_writes { DESC_F_WRITE } else { 0 };
        // SAFETY: i < QSIZE (indexing panics otherwise); the ring is ours.
        unsafe {
            write_volatile(
                addr_of_mut!((*self.ring).desc[i as usize]),
                Desc {
                    addr,
                    len,
                    flags,
                    next: 0,
                },
            )
        }
    }

    /// Sets the length of descriptor `i` (a tx buffer about to be sent).
    pub fn set_len(&mut self, i: u16, len: u32) {
        // SAFETY: as in set_desc.
        unsafe { write_volatile(addr_of_mut!((*self.ring).desc[i as usize].len), len) }
    }

    /// Makes descriptor `head` available to the device (the caller notifies).
    pub fn push(&mut self, head: u16) {
        let slot = self.avail_idx as usize % QSIZE;
        // SAFETY: the ring is ours; the slot is in bounds.
        unsafe {
            write_volatile(addr_of_mut!((*self.ring).avail_ring[slot]), head);
            // The entry must be visible before the index that publishes it.
            fence(Ordering::SeqCst);
            self.avail_idx = self.avail_idx.wrapping_add(1);
            write_volatile(addr_of_mut!((*self.ring).avail_idx), self.avail_idx);
            // And the index before the notification that follows.
            fence(Ordering::SeqCst);
        }
    }

    /// The next buffer the device has finished with: (descriptor id, bytes written).
    pub fn pop_used(&mut self) -> Option<(u16, u32)> {
        // SAFETY: the ring is ours; the device writes used entries before used.idx.
        unsafe {
            let idx = read_volatile(addr_of!((*self.ring).used.idx));
            if idx == self.last_used {
                return None;
            }
            fence(Ordering::SeqCst);
            let slot = self.last_used as usize % QSIZE;
            let e = read_volatile(addr_of!((*self.ring).used.ring[slot]));
            self.last_used = self.last_used.wrapping_add(1);
            Some((e.id as u16, e.len))
        }
    }

    /// True if the device has used buffers not yet taken with `pop_used`.
    pub fn has_used(&self) -> bool {
        // SAFETY: the ring is ours.
        let idx = unsafe { read_volatile(addr_of!((*self.ring).used.idx)) };
        idx != self.last_used
    }

    /// Asks the device to interrupt (or not) after it uses buffers of this queue. After
    /// enabling, check `has_used` again before waiting: buffers used before the device saw
    /// the flag raised no interrupt.
    pub fn set_interrupts(&mut self, on: bool) {
        let flags = if on { 0 } else { AVAIL_F_NO_INTERRUPT };
        // SAFETY: the ring is ours.
        unsafe { write_volatile(addr_of_mut!((*self.ring).avail_flags), flags) };
        // The flag must be visible to the device before we read used.idx again (a store
        // followed by a load: only a full fence orders them).
        fence(Ordering::SeqCst);
    }

    /// False when the device said it does not need notifications right now.
    pub fn device_wants_notify(&self) -> bool {
        // SAFETY: the ring is ours.
        let flags = unsafe { read_volatile(addr_of!((*self.ring).used.flags)) };
        flags & USED_F_NO_NOTIFY == 0
    }
}

/// One virtio-mmio register window.
pub struct Transport {
    base: u64,
}

impl Transport {
    /// Probes the slots for a modern device of type `device_id`.
    pub fn find(device_id: u32) -> Option<Transport> {
        (0..MAX_SLOTS)
            .map(|n| Transport {
                base: MMIO_BASE + n * SLOT_SIZE,
            })
            .find(|t| {
                // Empty slots read as all ones.
                t.read(REG_MAGIC) == MAGIC
                    && t.read(REG_VERSION) == VERSION
                    && t.read(REG_DEVICE_ID) == device_id
            })
    }

    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn slot(&self) -> u64 {
        (self.base - MMIO_BASE) / SLOT_SIZE
    }

    fn read(&self, reg: u64) -> u32 {
        mmio_read32(self.base + reg)
    }

    fn write(&self, reg: u64, v: u32) {
        mmio_write32(self.base + reg, v)
    }

    /// Writing 0 to Status resets the device: it stops using every queue.
    pub fn reset(&self) {
        self.write(REG_STATUS, 0);
    }

    /// Tells the device we give up on it.
    pub fn fail(&self) {
        let s = self.read(REG_STATUS);
        self.write(REG_STATUS, s | S_FAILED);
    }

    /// Spec 3.1.1 steps 1-6: reset, ACKNOWLEDGE, DRIVER, negotiate `wanted` features (all
    /// must be offered, VERSION_1 among them), FEATURES_OK and check the device kept it.
    pub fn negotiate(&self, wanted: u64) -> Result<(), &'static str> {
        self.reset();
        if self.read(REG_STATUS) != 0 {
            return Err("device did not reset");
        }
        self.write(REG_STATUS, S_ACKNOWLEDGE);
        self.write(REG_STATUS, S_ACKNOWLEDGE | S_DRIVER);
        let mut offered = 0u64;
        for sel in 0..2u32 {
            self.write(REG_DEVICE_FEATURES_SEL, sel);
            offered |= u64::from(self.read(REG_DEVICE_FEATURES)) << (32 * sel);
        }
        if offered & F_VERSION_1 == 0 {
            return Err("device does not offer VIRTIO_F_VERSION_1");
        }
        if offered & wanted != wanted {
            return Err("device lacks a required feature");
        }
        for sel in 0..2u32 {
            self.write(REG_DRIVER_FEATURES_SEL, sel);
            self.write(REG_DRIVER_FEATURES, (wanted >> (32 * sel)) as u32);
        }
        self.write(REG_STATUS, S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK);
        if self.read(REG_STATUS) & S_FEATURES_OK == 0 {
            return Err("device refused FEATURES_OK");
        }
        Ok(())
    }

    /// Spec 4.2.3.2: configures queue `index` to use `q`'s rings and enables it.
    pub fn setup_queue(&self, index: u32, q: &Virtqueue) -> Result<(), &'static str> {
        self.write(REG_QUEUE_SEL, index);
        if self.read(REG_QUEUE_READY) != 0 {
            return Err("queue already in use");
        }
        let max = self.read(REG_QUEUE_NUM_MAX);
        if max == 0 {
            return Err("queue does not exist");
        }
        if (max as usize) < QSIZE {
            return Err("queue smaller than the driver's rings");
        }
        self.write(REG_QUEUE_NUM, QSIZE as u32);
        let (desc, avail, used) = q.addresses();
        for (lo, hi, addr) in [
            (REG_QUEUE_DESC_LOW, REG_QUEUE_DESC_HIGH, desc),
            (REG_QUEUE_DRIVER_LOW, REG_QUEUE_DRIVER_HIGH, avail),
            (REG_QUEUE_DEVICE_LOW, REG_QUEUE_DEVICE_HIGH, used),
        ] {
            self.write(lo, addr as u32);
            self.write(hi, (addr >> 32) as u32);
        }
        self.write(REG_QUEUE_READY, 1);
        if self.read(REG_QUEUE_READY) != 1 {
            return Err("device refused the queue configuration");
        }
        Ok(())
    }

    /// Spec 3.1.1 step 8: the driver is ready; the device starts using the queues.
    pub fn driver_ok(&self) -> Result<(), &'static str> {
        self.write(
            REG_STATUS,
            S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
        );
        let s = self.read(REG_STATUS);
        if s & S_NEEDS_RESET != 0 {
            return Err("device needs a reset after DRIVER_OK (activation failed)");
        }
        if s & S_DRIVER_OK == 0 {
            return Err("device refused DRIVER_OK");
        }
        Ok(())
    }

    /// True when the device reports it needs a reset (it stopped working).
    pub fn needs_reset(&self) -> bool {
        self.read(REG_STATUS) & S_NEEDS_RESET != 0
    }

    /// Tells the device queue `index` has new buffers.
    pub fn notify(&self, index: u32) {
        self.write(REG_QUEUE_NOTIFY, index);
    }

    /// A 32-bit read of device-specific configuration space.
    pub fn config_read32(&self, offset: u64) -> u32 {
        self.read(REG_CONFIG + offset)
    }
}

//! What the virtio device tests share (test builds only): a synthetic guest driver's
//! register access and bring-up steps on a virtio-mmio transport, the event loop pumped on
//! the test thread, a temporary directory and test data.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use virtio_bindings::virtio_mmio as reg;

use crate::event_loop::Manager;
use crate::virtio::mmio::{MmioTransport, MmioTransportArgs, MmioTransportState};
use crate::virtio::VirtioDevice;
use crate::{BusDevice, GuestMemory};
use snapshot::Persist;

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

/// A fresh directory under the system's temporary directory, removed when dropped.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    /// `<tmp>/<prefix>-<pid>-<n>`, empty.
    pub(crate) fn new(prefix: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `len` pseudo-random bytes, the same for the same `seed` (xorshift).
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Runs the event loop until it has nothing more to do right now (at most `turns` turns).
pub(crate) fn pump(em: &mut Manager, turns: usize) {
    for _ in 0..turns {
        if em.run_with_timeout(0).unwrap() == 0 {
            break;
        }
    }
}

/// A synthetic guest driver talking to a device through its virtio-mmio registers.
pub(crate) trait MmioDriver {
    /// The transport of the device under test.
    fn transport(&mut self) -> &mut MmioTransport;

    /// Reads the 32-bit register at `off`.
    fn read(&mut self, off: u32) -> u32 {
        let mut b = [0u8; 4];
        self.transport().read(u64::from(off), &mut b);
        u32::from_le_bytes(b)
    }

    /// Writes the 32-bit register at `off`.
    fn write(&mut self, off: u32, v: u32) {
        self.transport().write(u64::from(off), &v.to_le_bytes());
    }

    /// The device's feature bits, both words.
    fn features(&mut self) -> u64 {
        self.write(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
        let lo = self.read(reg::VIRTIO_MMIO_DEVICE_FEATURES);
        self.write(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        let hi = self.read(reg::VIRTIO_MMIO_DEVICE_FEATURES);
        (u64::from(hi) << 32) | u64::from(lo)
    }

    /// What Linux's virtio_mmio does on probe up to FEATURES_OK: reset, ACKNOWLEDGE, DRIVER,
    /// accept the offered features that are in `accept`, FEATURES_OK (asserted to stick).
    /// Returns the features accepted.
    fn negotiate(&mut self, accept: u64) -> u64 {
        self.write(reg::VIRTIO_MMIO_STATUS, 0);
        self.write(reg::VIRTIO_MMIO_STATUS, 1);
        self.write(reg::VIRTIO_MMIO_STATUS, 3);
        let f = self.features() & accept;
        self.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        self.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, (f >> 32) as u32);
        self.write(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        self.write(reg::VIRTIO_MMIO_DRIVER_FEATURES, f as u32);
        self.write(reg::VIRTIO_MMIO_STATUS, 0xb);
        assert_eq!(self.read(reg::VIRTIO_MMIO_STATUS), 0xb);
        f
    }

    /// Sets up queue `q` with `num` entries and its rings at `(desc, avail, used)`; asserts
    /// the device offers `num_max` entries and the queue goes from not ready to ready.
    fn setup_queue(
        &mut self,
        q: u32,
        num_max: u16,
        num: u16,
        (desc, avail, used): (u64, u64, u64),
    ) {
        self.write(reg::VIRTIO_MMIO_QUEUE_SEL, q);
        assert_eq!(self.read(reg::VIRTIO_MMIO_QUEUE_READY), 0);
        assert_eq!(
            self.read(reg::VIRTIO_MMIO_QUEUE_NUM_MAX),
            u32::from(num_max)
        );
        self.write(reg::VIRTIO_MMIO_QUEUE_NUM, u32::from(num));
        for (lo, a) in [
            (reg::VIRTIO_MMIO_QUEUE_DESC_LOW, desc),
            (reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW, avail),
            (reg::VIRTIO_MMIO_QUEUE_USED_LOW, used),
        ] {
            self.write(lo, a as u32);
            self.write(lo + 4, (a >> 32) as u32);
        }
        self.write(reg::VIRTIO_MMIO_QUEUE_READY, 1);
        assert_eq!(self.read(reg::VIRTIO_MMIO_QUEUE_READY), 1);
    }
}

/// A transport over `device` at the saved `state`, its restore finished: what the VMM does
/// for a restored (or forked) VM.
pub(crate) fn restored_transport(
    mem: &GuestMemory,
    device: Box<dyn VirtioDevice>,
    state: &MmioTransportState,
) -> MmioTransport {
    let mut t = MmioTransport::restore(
        MmioTransportArgs {
            mem: mem.clone(),
            device,
            irq: vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)
                .unwrap()
                .into(),
        },
        state,
    )
    .unwrap();
    t.finish_restore().unwrap();
    t
}

/// Polls `cond` every millisecond for up to 5 s; whether it became true.
pub(crate) fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_secs(5) {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    false
}

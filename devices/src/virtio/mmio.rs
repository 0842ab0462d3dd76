//! virtio-mmio transport (virtio 1.x, MMIO version 2).
//!
//! Everything here is driven by guest register accesses, so every value is checked: wrong
//! access widths, writes in the wrong device state, invalid queue sizes and ring addresses
//! are logged and ignored (a queue with a bad configuration simply does not become ready),
//! never a panic. Queue notifications normally never reach this code: the VMM registers each
//! queue's eventfd as a KVM ioeventfd on the QueueNotify register (datamatch = queue index).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_bindings::virtio_mmio as reg;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use crate::GuestMemory;
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};

use super::{
    Interrupt, QueuePosition, VirtQueue, VirtioDevice, VirtioDeviceState, VENDOR_ID,
    VIRTIO_F_VERSION_1,
};
use crate::{BusDevice, Error, IrqLine, Result};

/// Size of one virtio-mmio register window.
pub const MMIO_SLOT_SIZE: u64 = 0x1000;
/// "virt".
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// Modern virtio-mmio.
pub const MMIO_VERSION: u32 = 2;
/// Start of the device-specific configuration space.
const CONFIG_SPACE: u64 = reg::VIRTIO_MMIO_CONFIG as u64;

const S_ACK: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
const S_DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
const S_FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
const S_DRIVER_OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
const S_NEEDS_RESET: u32 = VIRTIO_CONFIG_S_NEEDS_RESET;
const S_FAILED: u32 = VIRTIO_CONFIG_S_FAILED;
/// The device status values a driver moves through, in order.
const STATUS_STEPS: [u32; 5] = [
    0,
    S_ACK,
    S_ACK | S_DRIVER,
    S_ACK | S_DRIVER | S_FEATURES_OK,
    S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
];

/// Guest-triggered warnings: at most this many per window, so a misbehaving guest cannot
/// flood the host log. Clones share the count: a device hands its limiter to the worker of
/// each activation, so resetting and reactivating the device does not start a new window.
#[derive(Clone)]
pub(crate) struct LogLimiter(Arc<Mutex<LimiterState>>);

struct LimiterState {
    window_start: Option<Instant>,
    count: u32,
}

impl LogLimiter {
    const PER_WINDOW: u32 = 20;
    const WINDOW: Duration = Duration::from_secs(10);

    pub(crate) fn new() -> Self {
        Self(Arc::new(Mutex::new(LimiterState {
            window_start: None,
            count: 0,
        })))
    }

    /// True if a message may be logged now.
    pub(crate) fn allow(&self) -> bool {
        let mut st = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match st.window_start {
            Some(t) if now.duration_since(t) < Self::WINDOW => {}
            _ => {
                st.window_start = Some(now);
                st.count = 0;
            }
        }
        st.count = st.count.saturating_add(1);
        if st.count == Self::PER_WINDOW + 1 {
            tracing::warn!("further guest-triggered warnings suppressed for a while");
        }
        st.count <= Self::PER_WINDOW
    }
}

/// What the driver wrote for one queue. The queue itself is only built, and its values
/// checked, when the driver sets QueueReady.
#[derive(Debug, Clone, Copy, Default)]
struct QueueRegs {
    size: u32,
    desc: u64,
    avail: u64,
    used: u64,
}

fn set_low(v: &mut u64, low: u32) {
    *v = (*v & !0xffff_ffff) | u64::from(low);
}

fn set_high(v: &mut u64, high: u32) {
    *v = (*v & 0xffff_ffff) | (u64::from(high) << 32);
}

/// One virtio device behind a virtio-mmio register window.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemory,
    interrupt: Arc<Interrupt>,
    max_sizes: Vec<u16>,
    regs: Vec<QueueRegs>,
    /// Set once the driver set QueueReady and the configuration was valid.
    ready: Vec<bool>,
    queue_evts: Vec<EventFd>,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    status: u32,
    config_generation: u32,
    active: bool,
    /// Restored active but not activated yet ([`MmioTransport::finish_restore`]): the
    /// queue positions to start from.
    pending_activation: Option<Vec<QueuePosition>>,
    log: LogLimiter,
}

macro_rules! guest_warn {
    ($self:expr, $($arg:tt)*) => {
        if $self.log.allow() {
            tracing::warn!($($arg)*);
        }
    };
}

impl MmioTransport {
    /// Wraps `device`; `irq` is the line the VMM registered as the slot's irqfd.
    pub fn new(
        mem: GuestMemory,
        device: Box<dyn VirtioDevice>,
        irq: impl Into<IrqLine>,
    ) -> Result<Self> {
        let max_sizes = device.queue_max_sizes().to_vec();
        for (i, &m) in max_sizes.iter().enumerate() {
            if Queue::new(m).is_err() {
                return Err(Error::Virtio(format!(
                    "device type {}: queue {i} maximum size {m} is not a power of two in 1..=32768",
                    device.device_type()
                )));
            }
        }
        let queue_evts = max_sizes
            .iter()
            .map(|_| EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Self {
            device,
            mem,
            interrupt: Arc::new(Interrupt::new(irq)),
            regs: vec![QueueRegs::default(); max_sizes.len()],
            ready: vec![false; max_sizes.len()],
            max_sizes,
            queue_evts,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            status: 0,
            config_generation: 0,
            active: false,
            pending_activation: None,
            log: LogLimiter::new(),
        })
    }

    /// From now on guest memory is `mem`, for the transport and its device (see
    /// [`VirtioDevice::replace_memory`]; call while the device is paused).
    pub fn replace_memory(&mut self, mem: &GuestMemory) {
        self.mem = mem.clone();
        self.device.replace_memory(mem);
    }

    /// One eventfd per queue, in queue order: the VMM registers each as an ioeventfd on
    /// `base + 0x50` with datamatch = the queue index.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The device's virtio type.
    pub fn device_type(&self) -> u32 {
        self.device.device_type()
    }

    /// The interrupt state shared with the device.
    pub fn interrupt(&self) -> &Arc<Interrupt> {
        &self.interrupt
    }

    /// True after DRIVER_OK until the next reset.
    pub fn is_active(&self) -> bool {
        self.active
    }

    fn device_features(&self) -> u64 {
        self.device.avail_features() | (1u64 << VIRTIO_F_VERSION_1)
    }

    /// Queue registers may only be written after feature negotiation and before DRIVER_OK.
    fn queue_config_allowed(&self) -> bool {
        self.status & (S_FEATURES_OK | S_DRIVER_OK | S_FAILED) == S_FEATURES_OK && !self.active
    }

    fn sel(&self) -> Option<usize> {
        let i = self.queue_sel as usize;
        (i < self.max_sizes.len()).then_some(i)
    }

    fn reset(&mut self) {
        if self.active {
            tracing::debug!("virtio-mmio: device type {} reset", self.device_type());
        }
        self.device.reset();
        self.active = false;
        self.pending_activation = None;
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.regs.iter_mut().for_each(|r| *r = QueueRegs::default());
        self.ready.iter_mut().for_each(|r| *r = false);
        self.interrupt.clear();
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        if value & S_FAILED != 0 {
            guest_warn!(
                self,
                "virtio-mmio: driver marked device type {} FAILED",
                self.device_type()
            );
            self.status |= S_FAILED;
            return;
        }
        // NEEDS_RESET is the device's bit; drivers write back what they read.
        let new = value & !S_NEEDS_RESET;
        let old = self.status & !S_NEEDS_RESET;
        if new & old != old || !STATUS_STEPS.contains(&new) || self.status & S_FAILED != 0 {
            guest_warn!(
                self,
                "virtio-mmio: invalid status transition {old:#x} -> {value:#x}, ignored"
            );
            return;
        }
        let added = new & !old;
        if added & S_FEATURES_OK != 0 {
            let offered = self.device_features();
            let unknown = self.driver_features & !offered;
            if unknown != 0 || self.driver_features & (1u64 << VIRTIO_F_VERSION_1) == 0 {
                guest_warn!(
                    self,
                    "virtio-mmio: driver features {:#x} not acceptable (offered {offered:#x}, \
                     VIRTIO_F_VERSION_1 required): FEATURES_OK refused",
                    self.driver_features
                );
                // Status unchanged: the driver reads it back and sees FEATURES_OK missing.
                return;
            }
        }
        self.status = new | (self.status & S_NEEDS_RESET);
        if added & S_DRIVER_OK != 0 {
            self.activate();
        }
    }

    /// The queues to hand to the device, rebuilt from the registers (which cannot have
    /// changed since QueueReady) and starting at `positions` (restore) or 0. An unused
    /// queue is handed over not ready; the device decides if it needs it.
    fn device_queues(
        &self,
        positions: &[QueuePosition],
    ) -> std::result::Result<Vec<VirtQueue>, String> {
        let mut queues = Vec::with_capacity(self.max_sizes.len());
        for (i, max) in self.max_sizes.iter().enumerate() {
            let mut queue = if self.ready[i] {
                self.build_queue(i)
            } else {
                Queue::new(*max).map_err(|e| e.to_string())
            }
            .map_err(|e| format!("queue {i}: {e}"))?;
            if let Some(p) = positions.get(i) {
                queue.set_next_avail(p.next_avail);
                queue.set_next_used(p.next_used);
            }
            let notify = self.queue_evts[i]
                .try_clone()
                .map_err(|e| format!("cloning queue {i} eventfd: {e}"))?;
            queues.push(VirtQueue { queue, notify });
        }
        Ok(queues)
    }

    fn activate(&mut self) {
        let queues = match self.device_queues(&[]) {
            Ok(q) => q,
            Err(e) => {
                self.fail(e);
                return;
            }
        };
        match self.device.activate(
            self.mem.clone(),
            queues,
            Arc::clone(&self.interrupt),
            self.driver_features,
        ) {
            Ok(()) => {
                self.active = true;
                tracing::debug!(
                    "virtio-mmio: device type {} activated (features {:#x})",
                    self.device_type(),
                    self.driver_features
                );
            }
            Err(e) => self.fail(format!("activation failed: {e}")),
        }
    }

    /// The device cannot work with what the driver set up: tell the driver it needs a reset.
    fn fail(&mut self, why: String) {
        // What the driver set up is the guest's: rate-limited like its other mistakes.
        if self.log.allow() {
            tracing::error!("virtio-mmio: device type {}: {why}", self.device_type());
        }
        self.status |= S_NEEDS_RESET;
        self.interrupt.signal_config_change();
    }

    fn set_queue_ready(&mut self, value: u32) {
        let Some(i) = self.sel() else {
            guest_warn!(
                self,
                "virtio-mmio: QueueReady for missing queue {}",
                self.queue_sel
            );
            return;
        };
        if value == 0 {
            if self.active {
                guest_warn!(
                    self,
                    "virtio-mmio: queue {i} disabled while the device runs, ignored"
                );
            } else {
                self.ready[i] = false;
            }
            return;
        }
        if !self.queue_config_allowed() {
            guest_warn!(
                self,
                "virtio-mmio: QueueReady in status {:#x}, ignored",
                self.status
            );
            return;
        }
        match self.build_queue(i) {
            Ok(_) => self.ready[i] = true,
            Err(why) => {
                guest_warn!(self, "virtio-mmio: queue {i} not made ready: {why}");
                self.ready[i] = false;
            }
        }
    }

    fn build_queue(&self, i: usize) -> std::result::Result<Queue, String> {
        let r = self.regs[i];
        let max = self.max_sizes[i];
        let mut q = Queue::new(max).map_err(|e| e.to_string())?;
        let size = u16::try_from(r.size)
            .map_err(|_| format!("size {} larger than the maximum {max}", r.size))?;
        q.try_set_size(size)
            .map_err(|_| format!("size {size} is not a power of two in 1..={max}"))?;
        q.try_set_desc_table_address(GuestAddress(r.desc))
            .map_err(|_| format!("descriptor table {:#x} not 16-byte aligned", r.desc))?;
        q.try_set_avail_ring_address(GuestAddress(r.avail))
            .map_err(|_| format!("available ring {:#x} not 2-byte aligned", r.avail))?;
        q.try_set_used_ring_address(GuestAddress(r.used))
            .map_err(|_| format!("used ring {:#x} not 4-byte aligned", r.used))?;
        q.set_ready(true);
        if !q.is_valid(&self.mem) {
            return Err(format!(
                "rings (desc {:#x}, avail {:#x}, used {:#x}, size {size}) are not inside guest memory",
                r.desc, r.avail, r.used
            ));
        }
        Ok(q)
    }

    fn write_queue_reg(&mut self, offset: u32, value: u32) {
        let Some(i) = self.sel() else {
            guest_warn!(
                self,
                "virtio-mmio: write to missing queue {}",
                self.queue_sel
            );
            return;
        };
        if !self.queue_config_allowed() || self.ready[i] {
            guest_warn!(
                self,
                "virtio-mmio: queue {i} register {offset:#x} written in status {:#x}{}, ignored",
                self.status,
                if self.ready[i] { " (queue ready)" } else { "" }
            );
            return;
        }
        let r = &mut self.regs[i];
        match offset {
            reg::VIRTIO_MMIO_QUEUE_NUM => r.size = value,
            reg::VIRTIO_MMIO_QUEUE_DESC_LOW => set_low(&mut r.desc, value),
            reg::VIRTIO_MMIO_QUEUE_DESC_HIGH => set_high(&mut r.desc, value),
            reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW => set_low(&mut r.avail, value),
            reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH => set_high(&mut r.avail, value),
            reg::VIRTIO_MMIO_QUEUE_USED_LOW => set_low(&mut r.used, value),
            reg::VIRTIO_MMIO_QUEUE_USED_HIGH => set_high(&mut r.used, value),
            _ => {}
        }
    }

    fn read_reg(&mut self, offset: u32) -> u32 {
        match offset {
            reg::VIRTIO_MMIO_MAGIC_VALUE => MMIO_MAGIC,
            reg::VIRTIO_MMIO_VERSION => MMIO_VERSION,
            reg::VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            reg::VIRTIO_MMIO_VENDOR_ID => VENDOR_ID,
            reg::VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device_features() as u32,
                1 => (self.device_features() >> 32) as u32,
                _ => 0,
            },
            reg::VIRTIO_MMIO_QUEUE_NUM_MAX => self.sel().map_or(0, |i| self.max_sizes[i].into()),
            reg::VIRTIO_MMIO_QUEUE_READY => self.sel().map_or(0, |i| u32::from(self.ready[i])),
            reg::VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt.status(),
            reg::VIRTIO_MMIO_STATUS => self.status,
            reg::VIRTIO_MMIO_CONFIG_GENERATION => self.config_generation,
            // No shared memory regions: length "-1" means absent.
            reg::VIRTIO_MMIO_SHM_LEN_LOW | reg::VIRTIO_MMIO_SHM_LEN_HIGH => u32::MAX,
            reg::VIRTIO_MMIO_SHM_BASE_LOW | reg::VIRTIO_MMIO_SHM_BASE_HIGH => u32::MAX,
            _ => {
                guest_warn!(self, "virtio-mmio: read of unknown register {offset:#x}");
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u32, value: u32) {
        match offset {
            reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = value,
            reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            reg::VIRTIO_MMIO_DRIVER_FEATURES => {
                if self.status & (S_DRIVER | S_FEATURES_OK | S_FAILED) != S_DRIVER {
                    guest_warn!(
                        self,
                        "virtio-mmio: DriverFeatures written in status {:#x}, ignored",
                        self.status
                    );
                    return;
                }
                match self.driver_features_sel {
                    0 => set_low(&mut self.driver_features, value),
                    1 => set_high(&mut self.driver_features, value),
                    s => {
                        if value != 0 {
                            guest_warn!(
                                self,
                                "virtio-mmio: driver features word {s} = {value:#x}, ignored"
                            );
                        }
                    }
                }
            }
            reg::VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = value,
            reg::VIRTIO_MMIO_QUEUE_READY => self.set_queue_ready(value),
            reg::VIRTIO_MMIO_QUEUE_NUM
            | reg::VIRTIO_MMIO_QUEUE_DESC_LOW
            | reg::VIRTIO_MMIO_QUEUE_DESC_HIGH
            | reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW
            | reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH
            | reg::VIRTIO_MMIO_QUEUE_USED_LOW
            | reg::VIRTIO_MMIO_QUEUE_USED_HIGH => self.write_queue_reg(offset, value),
            reg::VIRTIO_MMIO_QUEUE_NOTIFY => {
                // Only reaches here without an ioeventfd for this value (tests, or a value
                // that is not a queue index). Same effect as the ioeventfd: a notification
                // before DRIVER_OK waits in the eventfd until the device starts.
                match self.queue_evts.get(value as usize) {
                    Some(evt) => {
                        if let Err(e) = evt.write(1) {
                            tracing::error!("virtio-mmio: queue {value} notify failed: {e}");
                        }
                    }
                    None => guest_warn!(self, "virtio-mmio: notify of missing queue {value}"),
                }
            }
            reg::VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt.ack(value),
            reg::VIRTIO_MMIO_STATUS => self.write_status(value),
            reg::VIRTIO_MMIO_SHM_SEL => {}
            _ => guest_warn!(
                self,
                "virtio-mmio: write of {value:#x} to read-only or unknown register {offset:#x}"
            ),
        }
    }
}

/// One queue of a transport, as saved in a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioQueueState {
    /// QueueNum as written by the driver.
    pub size: u32,
    /// Descriptor table address.
    pub desc: u64,
    /// Available ring address.
    pub avail: u64,
    /// Used ring address.
    pub used: u64,
    /// QueueReady.
    pub ready: bool,
    /// Where the device stands in the rings (zero when not active).
    pub position: QueuePosition,
}

/// A virtio-mmio transport and its device, as saved in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioTransportState {
    /// virtio device type (must match the device it is restored into).
    pub device_type: u32,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// Features the driver accepted.
    pub driver_features: u64,
    /// QueueSel.
    pub queue_sel: u32,
    /// Device status.
    pub status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// InterruptStatus bits not yet acknowledged.
    pub interrupt_status: u32,
    /// The device was running (DRIVER_OK accepted).
    pub active: bool,
    /// Every queue, in queue order.
    pub queues: Vec<MmioQueueState>,
    /// The device's own state.
    pub device: VirtioDeviceState,
}

/// What [`MmioTransport`]'s `restore` needs besides the state.
pub struct MmioTransportArgs {
    /// Guest memory.
    pub mem: GuestMemory,
    /// The device, already restored from [`MmioTransportState::device`].
    pub device: Box<dyn VirtioDevice>,
    /// The slot's interrupt line (a KVM irqfd).
    pub irq: IrqLine,
}

impl MmioTransport {
    /// Stops the device's work for a snapshot (see [`VirtioDevice::pause`]).
    pub fn pause_device(&mut self) {
        self.device.pause();
    }

    /// Lets the device work again.
    pub fn unpause_device(&mut self) {
        self.device.unpause();
    }
}

fn restore_err(msg: impl std::fmt::Display) -> Error {
    Error::Restore(format!("virtio-mmio: {msg}"))
}

impl MmioTransport {
    /// Activates a device restored active (see `restore`), unless the guest reset it in
    /// the meantime. Idempotent.
    pub fn finish_restore(&mut self) -> Result<()> {
        let Some(positions) = self.pending_activation.take() else {
            return Ok(());
        };
        let queues = self.device_queues(&positions).map_err(restore_err)?;
        self.device
            .activate(
                self.mem.clone(),
                queues,
                Arc::clone(&self.interrupt),
                self.driver_features,
            )
            .map_err(|e| restore_err(format!("activating the restored device: {e}")))
    }
}

impl<'a> snapshot::Persist<'a> for MmioTransport {
    type State = MmioTransportState;
    type ConstructorArgs = MmioTransportArgs;
    type Error = Error;

    /// Call with the device paused ([`MmioTransport::pause_device`]).
    fn save(&self) -> Result<MmioTransportState> {
        let positions = match &self.pending_activation {
            Some(p) => p.clone(),
            None => self.device.queue_positions(),
        };
        let queues = self
            .regs
            .iter()
            .enumerate()
            .map(|(i, r)| MmioQueueState {
                size: r.size,
                desc: r.desc,
                avail: r.avail,
                used: r.used,
                ready: self.ready[i],
                position: positions.get(i).copied().unwrap_or_default(),
            })
            .collect();
        let device = self.device.save_state().ok_or_else(|| {
            Error::Restore(format!(
                "snapshots of VMs with a virtio device of type {} ({}) are not supported yet",
                self.device.device_type(),
                match self.device.device_type() {
                    2 => "block",
                    1 => "net",
                    _ => "unknown",
                }
            ))
        })?;
        Ok(MmioTransportState {
            device_type: self.device.device_type(),
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            queue_sel: self.queue_sel,
            status: self.status,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            active: self.active,
            queues,
            device,
        })
    }

    /// Rebuilds the transport; an active device is activated again with its queues at the
    /// saved positions, by [`MmioTransport::finish_restore`] (the guest may run before: its
    /// notifications wait in the queue eventfds). Everything is checked as if the driver had
    /// written it.
    fn restore(args: MmioTransportArgs, state: &MmioTransportState) -> Result<Self> {
        let mut t = MmioTransport::new(args.mem, args.device, args.irq)?;
        if state.device_type != t.device_type() {
            return Err(restore_err(format!(
                "saved device type {} restored into a device of type {}",
                state.device_type,
                t.device_type()
            )));
        }
        if state.queues.len() != t.max_sizes.len() {
            return Err(restore_err(format!(
                "{} saved queues for a device with {}",
                state.queues.len(),
                t.max_sizes.len()
            )));
        }
        let steps = state.status & !(S_NEEDS_RESET | S_FAILED);
        if !STATUS_STEPS.contains(&steps) {
            return Err(restore_err(format!(
                "invalid device status {:#x}",
                state.status
            )));
        }
        let offered = t.device_features();
        if steps & S_FEATURES_OK != 0
            && (state.driver_features & !offered != 0
                || state.driver_features & (1u64 << VIRTIO_F_VERSION_1) == 0)
        {
            return Err(restore_err(format!(
                "driver features {:#x} were never acceptable (offered {offered:#x})",
                state.driver_features
            )));
        }
        if state.interrupt_status & !3 != 0 {
            return Err(restore_err(format!(
                "interrupt status {:#x}",
                state.interrupt_status
            )));
        }
        t.device_features_sel = state.device_features_sel;
        t.driver_features_sel = state.driver_features_sel;
        t.driver_features = state.driver_features;
        t.queue_sel = state.queue_sel;
        t.status = state.status;
        t.config_generation = state.config_generation;
        for (i, q) in state.queues.iter().enumerate() {
            t.regs[i] = QueueRegs {
                size: q.size,
                desc: q.desc,
                avail: q.avail,
                used: q.used,
            };
            if q.ready {
                t.build_queue(i)
                    .map_err(|e| restore_err(format!("queue {i}: {e}")))?;
                t.ready[i] = true;
            }
        }
        if state.active {
            if steps & S_DRIVER_OK == 0 || state.status & (S_NEEDS_RESET | S_FAILED) != 0 {
                return Err(restore_err(format!(
                    "device marked active in status {:#x}",
                    state.status
                )));
            }
            let positions: Vec<QueuePosition> = state.queues.iter().map(|q| q.position).collect();
            // Checked now; used by finish_restore.
            t.device_queues(&positions).map_err(restore_err)?;
            t.pending_activation = Some(positions);
            t.active = true;
        }
        t.interrupt.restore_status(state.interrupt_status);
        Ok(t)
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE {
            data.fill(0);
            self.device.read_config(offset - CONFIG_SPACE, data);
            return;
        }
        if data.len() != 4 || offset & 3 != 0 {
            guest_warn!(
                self,
                "virtio-mmio: {}-byte read at register offset {offset:#x}: registers are 32-bit",
                data.len()
            );
            data.fill(0);
            return;
        }
        let v = self.read_reg(offset as u32);
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE {
            self.device.write_config(offset - CONFIG_SPACE, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            guest_warn!(
                self,
                "virtio-mmio: {}-byte write at register offset {offset:#x}: registers are 32-bit",
                data.len()
            );
            return;
        };
        if offset & 3 != 0 {
            guest_warn!(self, "virtio-mmio: unaligned register write at {offset:#x}");
            return;
        }
        self.write_reg(offset as u32, u32::from_le_bytes(bytes));
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn log_limiter_clones_share_one_window() {
        let a = LogLimiter::new();
        let b = a.clone();
        let allowed = (0..LogLimiter::PER_WINDOW * 2)
            .filter(|i| if i % 2 == 0 { a.allow() } else { b.allow() })
            .count();
        assert_eq!(allowed, LogLimiter::PER_WINDOW as usize);
        // A fresh clone (a new activation's worker) does not start a new window.
        assert!(!a.clone().allow());
    }
    use super::*;
    use crate::GuestMemory;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Calls {
        activations: Vec<(usize, u64, Vec<bool>)>,
        resets: usize,
        config_writes: Vec<(u64, Vec<u8>)>,
    }

    struct Dummy {
        calls: Arc<Mutex<Calls>>,
        fail_activate: bool,
    }

    impl VirtioDevice for Dummy {
        fn device_type(&self) -> u32 {
            42
        }
        fn avail_features(&self) -> u64 {
            1 << 3
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 8]
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = (offset as u8).wrapping_add(i as u8);
            }
        }
        fn write_config(&mut self, offset: u64, data: &[u8]) {
            self.calls
                .lock()
                .unwrap()
                .config_writes
                .push((offset, data.to_vec()));
        }
        fn replace_memory(&mut self, _mem: &GuestMemory) {}
        fn activate(
            &mut self,
            _mem: GuestMemory,
            queues: Vec<VirtQueue>,
            _interrupt: Arc<Interrupt>,
            features: u64,
        ) -> Result<()> {
            if self.fail_activate {
                return Err(Error::Virtio("no".into()));
            }
            let ready = queues.iter().map(|q| q.queue.ready()).collect();
            self.calls
                .lock()
                .unwrap()
                .activations
                .push((queues.len(), features, ready));
            Ok(())
        }
        fn reset(&mut self) {
            self.calls.lock().unwrap().resets += 1;
        }
        fn save_state(&self) -> Option<VirtioDeviceState> {
            None
        }
    }

    struct T {
        t: MmioTransport,
        calls: Arc<Mutex<Calls>>,
        irq: EventFd,
    }

    impl T {
        fn new(fail_activate: bool) -> Self {
            let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
            let calls = Arc::new(Mutex::new(Calls::default()));
            let irq = EventFd::new(EFD_NONBLOCK).unwrap();
            let dev = Dummy {
                calls: calls.clone(),
                fail_activate,
            };
            let t = MmioTransport::new(mem, Box::new(dev), irq.try_clone().unwrap()).unwrap();
            Self { t, calls, irq }
        }
        fn r(&mut self, off: u32) -> u32 {
            let mut b = [0u8; 4];
            self.t.read(u64::from(off), &mut b);
            u32::from_le_bytes(b)
        }
        fn w(&mut self, off: u32, v: u32) {
            self.t.write(u64::from(off), &v.to_le_bytes());
        }
        fn negotiate(&mut self, high: u32, low: u32) -> u32 {
            self.w(reg::VIRTIO_MMIO_STATUS, S_ACK);
            self.w(reg::VIRTIO_MMIO_STATUS, S_ACK | S_DRIVER);
            self.w(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
            self.w(reg::VIRTIO_MMIO_DRIVER_FEATURES, high);
            self.w(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
            self.w(reg::VIRTIO_MMIO_DRIVER_FEATURES, low);
            self.w(reg::VIRTIO_MMIO_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
            self.r(reg::VIRTIO_MMIO_STATUS)
        }
        /// Queue `q` with `size` entries and rings at `desc`, `desc + 0x100`, `desc + 0x200`.
        fn setup_queue(&mut self, q: u32, size: u32, desc: u64) -> u32 {
            self.w(reg::VIRTIO_MMIO_QUEUE_SEL, q);
            self.w(reg::VIRTIO_MMIO_QUEUE_NUM, size);
            for (lo, hi, a) in [
                (
                    reg::VIRTIO_MMIO_QUEUE_DESC_LOW,
                    reg::VIRTIO_MMIO_QUEUE_DESC_HIGH,
                    desc,
                ),
                (
                    reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW,
                    reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH,
                    desc.wrapping_add(0x100),
                ),
                (
                    reg::VIRTIO_MMIO_QUEUE_USED_LOW,
                    reg::VIRTIO_MMIO_QUEUE_USED_HIGH,
                    desc.wrapping_add(0x200),
                ),
            ] {
                self.w(lo, a as u32);
                self.w(hi, (a >> 32) as u32);
            }
            self.w(reg::VIRTIO_MMIO_QUEUE_READY, 1);
            self.r(reg::VIRTIO_MMIO_QUEUE_READY)
        }
    }

    #[test]
    fn identification_registers() {
        let mut t = T::new(false);
        assert_eq!(t.r(reg::VIRTIO_MMIO_MAGIC_VALUE), 0x7472_6976);
        assert_eq!(t.r(reg::VIRTIO_MMIO_VERSION), 2);
        assert_eq!(t.r(reg::VIRTIO_MMIO_DEVICE_ID), 42);
        assert_eq!(t.r(reg::VIRTIO_MMIO_VENDOR_ID), VENDOR_ID);
        t.w(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
        assert_eq!(t.r(reg::VIRTIO_MMIO_DEVICE_FEATURES), 1 << 3);
        t.w(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        assert_eq!(
            t.r(reg::VIRTIO_MMIO_DEVICE_FEATURES),
            1,
            "VIRTIO_F_VERSION_1"
        );
        t.w(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 2);
        assert_eq!(t.r(reg::VIRTIO_MMIO_DEVICE_FEATURES), 0);
        t.w(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
        assert_eq!(t.r(reg::VIRTIO_MMIO_QUEUE_NUM_MAX), 16);
        t.w(reg::VIRTIO_MMIO_QUEUE_SEL, 1);
        assert_eq!(t.r(reg::VIRTIO_MMIO_QUEUE_NUM_MAX), 8);
        t.w(reg::VIRTIO_MMIO_QUEUE_SEL, 2);
        assert_eq!(t.r(reg::VIRTIO_MMIO_QUEUE_NUM_MAX), 0, "no such queue");
        assert_eq!(t.r(reg::VIRTIO_MMIO_CONFIG_GENERATION), 0);
        // Config space passes through at any width.
        let mut b = [0u8; 3];
        t.t.read(0x105, &mut b);
        assert_eq!(b, [5, 6, 7]);
        t.t.write(0x101, &[9]);
        assert_eq!(t.calls.lock().unwrap().config_writes, vec![(1, vec![9])]);
    }

    #[test]
    fn odd_accesses_are_ignored() {
        let mut t = T::new(false);
        let mut b = [0xffu8; 2];
        t.t.read(0, &mut b);
        assert_eq!(b, [0, 0], "16-bit register read");
        let mut b = [0xffu8; 4];
        t.t.read(2, &mut b);
        assert_eq!(b, [0; 4], "unaligned register read");
        t.t.write(u64::from(reg::VIRTIO_MMIO_STATUS), &[1]);
        assert_eq!(t.r(reg::VIRTIO_MMIO_STATUS), 0, "8-bit register write");
        t.w(reg::VIRTIO_MMIO_MAGIC_VALUE, 5);
        assert_eq!(t.r(reg::VIRTIO_MMIO_MAGIC_VALUE), MMIO_MAGIC);
        assert_eq!(t.r(0x0f0), 0, "unknown register");
    }

    #[test]
    fn feature_negotiation_requires_version_1_and_offered_bits() {
        let mut t = T::new(false);
        assert_eq!(t.negotiate(0, 1 << 3) & S_FEATURES_OK, 0, "no VERSION_1");
        t.w(reg::VIRTIO_MMIO_STATUS, 0);
        assert_eq!(
            t.negotiate(1, 1 << 4) & S_FEATURES_OK,
            0,
            "bit 4 not offered"
        );
        t.w(reg::VIRTIO_MMIO_STATUS, 0);
        assert_eq!(
            t.negotiate(1 | 2, 0) & S_FEATURES_OK,
            0,
            "bit 33 not offered"
        );
        t.w(reg::VIRTIO_MMIO_STATUS, 0);
        assert_ne!(t.negotiate(1, 1 << 3) & S_FEATURES_OK, 0);
        // Features are frozen after FEATURES_OK.
        t.w(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        t.w(reg::VIRTIO_MMIO_DRIVER_FEATURES, 0);
        assert_eq!(t.setup_queue(0, 16, 0x1000), 1);
        t.w(reg::VIRTIO_MMIO_STATUS, 0xf);
        let calls = t.calls.lock().unwrap();
        assert_eq!(
            calls.activations,
            vec![(2, (1 << 32) | (1 << 3), vec![true, false])]
        );
    }

    #[test]
    fn status_only_moves_forward_in_order() {
        let mut t = T::new(false);
        t.w(
            reg::VIRTIO_MMIO_STATUS,
            S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
        );
        assert_eq!(t.r(reg::VIRTIO_MMIO_STATUS), 0, "cannot skip steps");
        t.w(reg::VIRTIO_MMIO_STATUS, S_ACK);
        t.w(reg::VIRTIO_MMIO_STATUS, S_ACK | S_DRIVER_OK);
        assert_eq!(t.r(reg::VIRTIO_MMIO_STATUS), S_ACK);
        t.w(reg::VIRTIO_MMIO_STATUS, S_ACK | S_DRIVER);
        t.w(reg::VIRTIO_MMIO_STATUS, S_DRIVER);
        assert_eq!(
            t.r(reg::VIRTIO_MMIO_STATUS),
            S_ACK | S_DRIVER,
            "no clearing bits"
        );
        // Queue registers before FEATURES_OK are ignored.
        assert_eq!(t.setup_queue(0, 16, 0x1000), 0);
        t.w(reg::VIRTIO_MMIO_STATUS, S_ACK | S_DRIVER | S_FAILED);
        assert_ne!(t.r(reg::VIRTIO_MMIO_STATUS) & S_FAILED, 0);
        assert!(t.calls.lock().unwrap().activations.is_empty());
    }

    #[test]
    fn bad_queue_configurations_never_become_ready() {
        let mut t = T::new(false);
        t.negotiate(1, 0);
        assert_eq!(t.setup_queue(0, 0, 0x1000), 0, "size 0");
        assert_eq!(t.setup_queue(0, 12, 0x1000), 0, "not a power of two");
        assert_eq!(t.setup_queue(0, 32, 0x1000), 0, "above the maximum");
        assert_eq!(t.setup_queue(0, 1 << 20, 0x1000), 0, "far above");
        assert_eq!(
            t.setup_queue(0, 16, 0x1008),
            0,
            "descriptor table misaligned"
        );
        assert_eq!(
            t.setup_queue(0, 16, 0xfff00),
            0,
            "rings past the end of memory"
        );
        assert_eq!(
            t.setup_queue(0, 16, 0xffff_ffff_ffff_f000),
            0,
            "address overflow"
        );
        assert_eq!(t.setup_queue(5, 16, 0x1000), 0, "no such queue");
        assert_eq!(t.setup_queue(0, 16, 0x1000), 1);
        // Once ready, the configuration is frozen.
        t.w(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
        t.w(reg::VIRTIO_MMIO_QUEUE_NUM, 4);
        t.w(reg::VIRTIO_MMIO_QUEUE_DESC_LOW, 0x8000);
        t.w(reg::VIRTIO_MMIO_STATUS, 0xf);
        let calls = t.calls.lock().unwrap();
        assert_eq!(calls.activations.len(), 1);
    }

    #[test]
    fn activation_failure_asks_for_a_reset() {
        let mut t = T::new(true);
        t.negotiate(1, 0);
        t.setup_queue(0, 16, 0x1000);
        t.w(reg::VIRTIO_MMIO_STATUS, 0xf);
        assert_ne!(t.r(reg::VIRTIO_MMIO_STATUS) & S_NEEDS_RESET, 0);
        assert!(!t.t.is_active());
        assert_eq!(
            t.r(reg::VIRTIO_MMIO_INTERRUPT_STATUS),
            2,
            "config change interrupt"
        );
        assert_eq!(t.irq.read().unwrap(), 1);
        t.w(reg::VIRTIO_MMIO_STATUS, 0);
        assert_eq!(t.r(reg::VIRTIO_MMIO_STATUS), 0);
        assert_eq!(t.r(reg::VIRTIO_MMIO_INTERRUPT_STATUS), 0);
    }

    #[test]
    fn interrupts_notify_and_reset() {
        let mut t = T::new(false);
        t.w(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!(
            t.t.queue_evts()[0].read().unwrap(),
            1,
            "kept for the device, like an ioeventfd"
        );
        t.negotiate(1, 0);
        t.setup_queue(0, 16, 0x1000);
        t.setup_queue(1, 8, 0x2000);
        t.w(reg::VIRTIO_MMIO_STATUS, 0xf);
        assert!(t.t.is_active());
        t.w(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 1);
        assert_eq!(t.t.queue_evts()[1].read().unwrap(), 1);
        t.w(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 7);
        assert!(t.t.queue_evts().iter().all(|e| e.read().is_err()));
        // Disabling a live queue is refused.
        t.w(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
        t.w(reg::VIRTIO_MMIO_QUEUE_READY, 0);
        assert_eq!(t.r(reg::VIRTIO_MMIO_QUEUE_READY), 1);

        let int = Arc::clone(t.t.interrupt());
        int.signal_used_queue();
        int.signal_config_change();
        assert_eq!(t.r(reg::VIRTIO_MMIO_INTERRUPT_STATUS), 3);
        assert_eq!(t.irq.read().unwrap(), 2);
        t.w(reg::VIRTIO_MMIO_INTERRUPT_ACK, 1);
        assert_eq!(t.r(reg::VIRTIO_MMIO_INTERRUPT_STATUS), 2);

        t.w(reg::VIRTIO_MMIO_STATUS, 0);
        assert_eq!(t.calls.lock().unwrap().resets, 1);
        assert!(!t.t.is_active());
        assert_eq!(t.r(reg::VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        assert_eq!(t.r(reg::VIRTIO_MMIO_QUEUE_READY), 0);
        // A full second round works.
        t.negotiate(1, 0);
        assert_eq!(t.setup_queue(0, 16, 0x1000), 1);
        t.w(reg::VIRTIO_MMIO_STATUS, 0xf);
        assert_eq!(t.calls.lock().unwrap().activations.len(), 2);
    }

    /// Bounded fuzzing of the register state machine: random sequences of reads and writes
    /// at register offsets (and anywhere else in the slot), of every width, with values
    /// biased to the interesting ones (status steps, queue selectors and sizes, ring
    /// addresses inside and outside memory, feature words, notifications, acks). No
    /// sequence may panic; the status only ever holds known bits; the device is never
    /// activated twice without a reset in between, and always gets all its queues (unused
    /// ones not ready: the device decides whether it needs them); and
    /// after every sequence a driver can reset the device and bring it up properly.
    /// `CLADE_FUZZ_ROUNDS` sequences (default 2000) of up to 64 accesses.
    #[test]
    fn fuzzed_register_sequences_keep_the_state_machine_sound() {
        use crate::virtio::fuzz_util::{rounds, Rng};
        let mut t = T::new(false);
        let rng = Rng::new(0x6d6d_696f_6675_7a7a);
        let regs = [
            reg::VIRTIO_MMIO_MAGIC_VALUE,
            reg::VIRTIO_MMIO_DEVICE_FEATURES,
            reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL,
            reg::VIRTIO_MMIO_DRIVER_FEATURES,
            reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL,
            reg::VIRTIO_MMIO_QUEUE_SEL,
            reg::VIRTIO_MMIO_QUEUE_NUM_MAX,
            reg::VIRTIO_MMIO_QUEUE_NUM,
            reg::VIRTIO_MMIO_QUEUE_READY,
            reg::VIRTIO_MMIO_QUEUE_NOTIFY,
            reg::VIRTIO_MMIO_INTERRUPT_STATUS,
            reg::VIRTIO_MMIO_INTERRUPT_ACK,
            reg::VIRTIO_MMIO_STATUS,
            reg::VIRTIO_MMIO_QUEUE_DESC_LOW,
            reg::VIRTIO_MMIO_QUEUE_DESC_HIGH,
            reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW,
            reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH,
            reg::VIRTIO_MMIO_QUEUE_USED_LOW,
            reg::VIRTIO_MMIO_QUEUE_USED_HIGH,
            reg::VIRTIO_MMIO_CONFIG_GENERATION,
            reg::VIRTIO_MMIO_CONFIG,
        ];
        let known = S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK | S_NEEDS_RESET | S_FAILED;
        let rounds = rounds(2000);
        let (mut accesses, mut max_status) = (0u64, 0u32);
        let mut random_activations = 0;
        for round in 0..rounds {
            // Start from a fresh device, or one part or all of the way through a driver's
            // bring-up, so the sequences reach every state.
            match rng.below(4) {
                0 => {}
                1 => {
                    t.negotiate(1, 1 << 3);
                }
                2 => {
                    t.negotiate(1, 1 << 3);
                    t.setup_queue(0, 16, 0x1000);
                    t.setup_queue(1, 8, 0x2000);
                }
                _ => {
                    t.negotiate(1, 1 << 3);
                    t.setup_queue(0, 16, 0x1000);
                    t.setup_queue(1, 8, 0x2000);
                    t.w(
                        reg::VIRTIO_MMIO_STATUS,
                        S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
                    );
                }
            }
            let start = t.calls.lock().unwrap().activations.len();
            for _ in 0..1 + rng.below(64) {
                let off = match rng.below(10) {
                    0..=6 => u64::from(rng.pick(&regs)),
                    7 => 0x100 + rng.below(0x40),
                    _ => rng.below(0x1100),
                };
                let size = rng.pick(&[4, 4, 4, 4, 1, 2, 8, 3]);
                let v = match off as u32 {
                    reg::VIRTIO_MMIO_STATUS => rng.pick(&[
                        0,
                        S_ACK,
                        S_ACK | S_DRIVER,
                        S_ACK | S_DRIVER | S_FEATURES_OK,
                        S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
                        S_FAILED,
                        S_NEEDS_RESET,
                        rng.next() as u32,
                    ]),
                    reg::VIRTIO_MMIO_QUEUE_SEL
                    | reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL
                    | reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL
                    | reg::VIRTIO_MMIO_QUEUE_NOTIFY => rng.pick(&[0, 1, 2, rng.next() as u32]),
                    reg::VIRTIO_MMIO_QUEUE_NUM => {
                        rng.pick(&[0, 1, 3, 8, 16, 32, rng.next() as u32])
                    }
                    reg::VIRTIO_MMIO_QUEUE_READY => rng.pick(&[0, 1, rng.next() as u32]),
                    reg::VIRTIO_MMIO_DRIVER_FEATURES => {
                        rng.pick(&[0, 1, 1 << 3, rng.next() as u32])
                    }
                    o if (reg::VIRTIO_MMIO_QUEUE_DESC_LOW..=reg::VIRTIO_MMIO_QUEUE_USED_HIGH)
                        .contains(&o) =>
                    {
                        rng.pick(&[0, 0x1000, 0x1008, 0x1001, (1 << 20) - 16, rng.next() as u32])
                    }
                    _ => rng.next() as u32,
                };
                let mut b = [0u8; 8];
                if rng.chance(50) {
                    b[..4].copy_from_slice(&v.to_le_bytes());
                    t.t.write(off, &b[..size]);
                } else {
                    t.t.read(off, &mut b[..size]);
                }
                accesses += 1;
                let status = t.r(reg::VIRTIO_MMIO_STATUS);
                assert_eq!(status & !known, 0, "round {round}: status {status:#x}");
                max_status = max_status.max(status);
                assert_eq!(t.r(reg::VIRTIO_MMIO_MAGIC_VALUE), 0x7472_6976);
                let c = t.calls.lock().unwrap();
                assert!(
                    c.activations.len() <= c.resets + 1,
                    "round {round}: activated {} times with {} resets",
                    c.activations.len(),
                    c.resets
                );
                assert!(
                    c.activations.iter().all(|(n, _, _)| *n == 2),
                    "round {round}: activated without every queue (unused ones not ready)"
                );
            }
            let activations = t.calls.lock().unwrap().activations.len();
            random_activations += activations - start;
            // A driver can always start over.
            t.w(reg::VIRTIO_MMIO_STATUS, 0);
            assert_eq!(t.r(reg::VIRTIO_MMIO_STATUS), 0);
            let before = t.calls.lock().unwrap().activations.len();
            assert_ne!(t.negotiate(1, 1 << 3) & S_FEATURES_OK, 0, "round {round}");
            assert_eq!(t.setup_queue(0, 16, 0x1000), 1, "round {round}");
            assert_eq!(t.setup_queue(1, 8, 0x2000), 1, "round {round}");
            t.w(
                reg::VIRTIO_MMIO_STATUS,
                S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
            );
            assert!(t.t.is_active(), "round {round}");
            assert_eq!(t.calls.lock().unwrap().activations.len(), before + 1);
            t.w(reg::VIRTIO_MMIO_STATUS, 0);
            let _ = t.irq.read();
        }
        println!(
            "virtio-mmio registers: {rounds} sequences, {accesses} accesses, \
             {random_activations} activations by the random accesses, highest status \
             {max_status:#x}"
        );
        assert!(random_activations > 0);
    }
}

//! Virtio devices on the virtio-mmio transport.
//!
//! # What the guest sees
//!
//! Each virtio device sits in one virtio-mmio "slot" (register layout: virtio 1.x, MMIO
//! version 2, "modern" only; legacy version-1 registers such as `QueuePFN` are not there).
//! The VMM places slots in the 32-bit MMIO gap (constants in `vmm/src/arch/layout.rs`):
//!
//! | slot | MMIO base                 | size   | GSI (IOAPIC pin) | device            |
//! |------|---------------------------|--------|------------------|-------------------|
//! | n    | `0xd000_1000 + n*0x1000`  | 0x1000 | `6 + n`          | in config order   |
//!
//! vsock comes first, so with `--vsock` it is slot 0: **base `0xd000_1000`, GSI 6**; a
//! `--disk` (virtio-blk, [`block`]) takes the next slot, a `--net` (virtio-net, [`net`])
//! the one after and a `--balloon` (virtio-balloon with free page reporting, [`balloon`])
//! the one after that. (The test device keeps
//! `0xd000_0000` / GSI 5.)
//!
//! Each slot is announced twice, for kernels with either discovery method:
//! - on the kernel command line: `virtio_mmio.device=4K@0xd0001000:6`;
//! - in the ACPI DSDT: `Device (_SB.Vnnn)` with `_HID "LNRO0005"`, `_UID n` and a `_CRS` of
//!   `Memory32Fixed (ReadWrite, base, 0x1000)` and `Interrupt (ResourceConsumer, Edge,
//!   ActiveHigh, Exclusive) { gsi }`.
//!
//! Registers (all 32-bit accesses; other widths are ignored and read as 0), offsets from base:
//!
//! | off   | reg                         | notes                                            |
//! |-------|-----------------------------|--------------------------------------------------|
//! | 0x000 | MagicValue                  | `0x74726976` ("virt")                            |
//! | 0x004 | Version                     | 2                                                |
//! | 0x008 | DeviceID                    | 19 = vsock, 2 = block, 1 = net, 5 = balloon      |
//! | 0x00c | VendorID                    | [`VENDOR_ID`] ("CLAD")                           |
//! | 0x010 | DeviceFeatures (+Sel 0x014) | vsock offers only `VIRTIO_F_VERSION_1` (bit 32)  |
//! | 0x020 | DriverFeatures (+Sel 0x024) | must include bit 32, or FEATURES_OK is refused   |
//! | 0x030 | QueueSel                    | vsock: 0 = rx, 1 = tx, 2 = event                 |
//! | 0x034 | QueueNumMax                 | 256 for each vsock queue; 0 past the last queue  |
//! | 0x038 | QueueNum                    | power of two, 1..=QueueNumMax                    |
//! | 0x044 | QueueReady                  | rejected (stays 0) if size/addresses are invalid |
//! | 0x050 | QueueNotify                 | write the queue index; a KVM ioeventfd, no exit  |
//! | 0x060 | InterruptStatus             | bit 0 used buffer, bit 1 config change           |
//! | 0x064 | InterruptACK                | write the bits handled                           |
//! | 0x070 | Status                      | 0 resets; ACK, DRIVER, FEATURES_OK, DRIVER_OK    |
//! | 0x080 | QueueDesc Low/High          | 16-byte aligned, inside guest RAM                |
//! | 0x090 | QueueDriver (avail) Lo/Hi   | 2-byte aligned                                   |
//! | 0x0a0 | QueueDevice (used) Lo/Hi    | 4-byte aligned                                   |
//! | 0x0fc | ConfigGeneration            | 0 (the vsock config never changes)               |
//! | 0x100 | config                      | vsock: `le64 guest_cid` (any access width)       |
//!
//! Queues and the rings are split virtqueues; no packed rings, no event index, no indirect
//! descriptor requirement (indirect chains are accepted). Interrupts are edge-triggered: the
//! device writes an irqfd after adding used buffers; the guest reads InterruptStatus, writes
//! the same bits to InterruptACK and then walks its used rings.
//!
//! vsock specifics (see [`vsock`]): the host is CID 2, the guest CID comes from the VM config
//! (>= 3, default 3). Stream sockets only (type 1; no SEQPACKET feature). For a guest driver,
//! e.g. a polling responder:
//! - rx (queue 0): post device-writable buffers, either one descriptor (44-byte header then
//!   data) or two (header, then data), and notify queue 0. The device returns each with used
//!   length `44 + hdr.len`; it never puts more than 64 KiB (or the buffer size) in one packet.
//! - tx (queue 1): device-readable header (+ data in the same or the next descriptor),
//!   notify queue 1. Every chain comes back with used length 0, malformed ones included
//!   (they are logged and dropped).
//! - event (queue 2): set up but never used by the device.
//! - host-initiated connections arrive as REQUEST from CID 2 and a host port >= 2^30 to the
//!   guest's listening port; answer RESPONSE (or RST). Guest-initiated: REQUEST to CID 2.
//! - flow control: put your `buf_alloc`/`fwd_cnt` in every header. The device advertises
//!   `buf_alloc` 256 KiB per connection, sends CREDIT_REQUEST when your credit is used up
//!   (answer CREDIT_UPDATE), and resets a connection that sends beyond its credit.
//! - close: SHUTDOWN with flags RCV|SEND is answered by RST once the data reached the host.
//!
//! With no interrupt handler, poll the used rings: the interrupt (GSI 6 for slot 0) is only
//! an edge on the IOAPIC pin; leave it masked.

pub mod balloon;
pub mod block;
#[cfg(test)]
pub(crate) mod fuzz_util;
pub mod mmio;
pub mod net;
#[cfg(test)]
pub(crate) mod test_util;
pub mod vsock;
mod worker;

use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};

use crate::{GuestMemory, IrqLine};
use virtio_bindings::virtio_mmio::{VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING};
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use crate::Result;

/// "CLAD" as the virtio-mmio vendor id.
pub const VENDOR_ID: u32 = u32::from_le_bytes(*b"CLAD");
/// Feature bit every modern device offers and every modern driver must accept.
pub const VIRTIO_F_VERSION_1: u32 = virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

/// A virtqueue handed to a device on activation: the queue as the driver configured it and
/// the eventfd that fires when the driver notifies it (a KVM ioeventfd in a running VM).
pub struct VirtQueue {
    /// Queue configuration and ring state.
    pub queue: Queue,
    /// Signalled on each driver notification of this queue.
    pub notify: EventFd,
}

/// The interrupt line of one virtio-mmio device: the InterruptStatus bits shared between the
/// device's worker and the transport, and the irqfd that raises the guest interrupt.
pub struct Interrupt {
    status: AtomicU32,
    irq: IrqLine,
}

impl Interrupt {
    /// `irq`: the line the VMM registered as a KVM irqfd.
    pub fn new(irq: impl Into<IrqLine>) -> Self {
        Self {
            status: AtomicU32::new(0),
            irq: irq.into(),
        }
    }

    fn signal(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
        if let Err(e) = self.irq.trigger() {
            tracing::error!("virtio: raising the interrupt failed: {e}");
        }
    }

    /// Tells the driver that used buffers were added to a queue.
    pub fn signal_used_queue(&self) {
        self.signal(VIRTIO_MMIO_INT_VRING);
    }

    /// Tells the driver the configuration space (or device status) changed.
    pub fn signal_config_change(&self) {
        self.signal(VIRTIO_MMIO_INT_CONFIG);
    }

    /// Current InterruptStatus bits.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    fn clear(&self) {
        self.status.store(0, Ordering::SeqCst);
    }

    fn restore_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }
}

/// How far a device got in one virtqueue: the positions a restored device continues from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuePosition {
    /// Next available-ring entry the device will take.
    pub next_avail: u16,
    /// Next used-ring entry the device will fill.
    pub next_used: u16,
}

/// A virtio device's own saved state (the transport saves the rest), by device type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum VirtioDeviceState {
    /// virtio-vsock.
    Vsock(vsock::VsockState),
    /// virtio-blk (its disk is the VMM's to reopen).
    Block(block::BlockState),
    /// virtio-net (its TAP is the VMM's to reopen).
    Net(net::NetState),
    /// virtio-balloon.
    Balloon(balloon::BalloonState),
}

/// A virtio device model, independent of the transport that exposes it.
pub trait VirtioDevice: Send {
    /// Virtio device id (19 for vsock).
    fn device_type(&self) -> u32;
    /// Feature bits the device offers, including transport bits it supports; the transport
    /// always adds `VIRTIO_F_VERSION_1`.
    fn avail_features(&self) -> u64;
    /// Maximum size of each queue; the number of entries is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// The driver reads `data.len()` bytes of configuration space at `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// The driver writes configuration space.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// The driver set DRIVER_OK: start processing `queues` (all of them, in queue order) in
    /// guest memory `mem`, signalling through `interrupt`. `features` are those the driver
    /// accepted.
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<VirtQueue>,
        interrupt: std::sync::Arc<Interrupt>,
        features: u64,
    ) -> Result<()>;
    /// The driver reset the device: stop all processing and forget the queues. When this
    /// returns the device no longer touches guest memory.
    fn reset(&mut self);

    /// Stops all processing until [`VirtioDevice::unpause`] (for a snapshot): when this
    /// returns, the device neither touches guest memory nor moves its queues, and
    /// [`VirtioDevice::queue_positions`] is current. Idempotent.
    fn pause(&mut self) {}

    /// Lets a paused device work again (anything that arrived meanwhile is handled then).
    fn unpause(&mut self) {}

    /// From now on guest memory is `mem`: the same guest memory, mapped at another host
    /// address (the VM moved to a new mapping of it while paused). Called while paused;
    /// an active device's worker uses `mem` from its next round on and never the old
    /// mapping again. Every device that keeps guest memory must implement it.
    fn replace_memory(&mut self, mem: &GuestMemory);

    /// Where each queue stands, in queue order, while the device is active and paused;
    /// empty when it is not active.
    fn queue_positions(&self) -> Vec<QueuePosition> {
        Vec::new()
    }

    /// The device's own state, for a snapshot (call while paused); `None` for a device
    /// that cannot be snapshotted (a snapshot of its VM then fails).
    fn save_state(&self) -> Option<VirtioDeviceState> {
        None
    }
}

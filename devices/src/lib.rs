//! Clade device models.
//!
//! Devices here know how to answer guest port I/O and MMIO accesses and how to signal
//! interrupts (through [`IrqLine`]s: eventfds the VMM wires to KVM irqfds). They know nothing of the KVM VM
//! lifecycle: when the guest asks to power off or reset, a device reports a [`GuestExit`] through
//! the [`ExitNotifier`] it was given, and the VMM decides what that means.

pub mod bus;
pub mod event_loop;
pub mod irq;
pub mod legacy;
pub mod test_device;
pub mod virtio;
pub mod vmgenid;

use std::path::PathBuf;
use std::sync::Arc;

pub use bus::{Bus, BusDevice};
pub use irq::IrqLine;

/// Guest memory as devices see it: every write through it (virtqueue rings, rx buffers) is
/// recorded in a per-region dirty bitmap, so a diff snapshot includes the pages the VMM
/// wrote, which KVM's dirty log does not see.
pub type GuestMemory = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;

/// Errors raised while wiring devices.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A device's address range overlaps one already on the bus.
    #[error("device range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap { base: u64, len: u64 },
    /// A device was given an empty range.
    #[error("device range at {0:#x} has zero length")]
    ZeroLength(u64),
    /// Creating an eventfd or thread for a device failed.
    #[error("device setup: {0}")]
    Setup(#[from] std::io::Error),
    /// A virtio device or its transport cannot be set up or activated.
    #[error("virtio: {0}")]
    Virtio(String),
    /// The vsock Unix socket path exists and another process is listening on it.
    #[error("vsock socket {0}: in use by another process")]
    SocketInUse(PathBuf),
    /// The vsock Unix socket cannot be created.
    #[error("vsock socket {path}: {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The device event loop cannot be started or reached.
    #[error("device event loop: {0}")]
    EventLoop(String),
    /// Saved device state cannot be restored (it does not fit this device, or it is invalid).
    #[error("device state: {0}")]
    Restore(String),
    /// A TAP device cannot be opened or set up for virtio-net.
    #[error("TAP {what}: {source}")]
    Tap {
        what: String,
        source: std::io::Error,
    },
    /// The VM generation ID cannot be made, placed or announced.
    #[error("VM generation ID: {0}")]
    VmGenId(String),
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Why the guest wants the machine to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestExit {
    /// ACPI S5 (power off).
    PowerOff,
    /// Reset requested through the i8042 controller or the ACPI reset register.
    Reset,
    /// The project's test guest reported a result code through the test device.
    TestExit(u32),
}

/// Callback a device uses to ask the VMM to stop the machine.
pub type ExitNotifier = Arc<dyn Fn(GuestExit) + Send + Sync>;

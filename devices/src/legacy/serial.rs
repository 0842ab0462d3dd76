//! 8250 UART (COM1) on top of vm-superio's model.

use std::io::Write;

use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::BusDevice;

/// Raises an interrupt by writing to an eventfd registered as a KVM irqfd.
pub struct EventFdTrigger(EventFd);

impl EventFdTrigger {
    /// Wraps `evt`; the VMM registers the same eventfd with KVM.
    pub fn new(evt: EventFd) -> Self {
        Self(evt)
    }
}

impl Trigger for EventFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// The guest's serial console; output goes to the writer the VMM chose (stdout, a file, ...).
pub struct SerialDevice {
    serial: Serial<EventFdTrigger, vm_superio::serial::NoEvents, Box<dyn Write + Send>>,
}

impl SerialDevice {
    /// A UART raising its interrupt through `irq` and writing transmitted bytes to `out`.
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> Self {
        Self {
            serial: Serial::new(EventFdTrigger::new(irq), out),
        }
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Ok(off), [b, ..]) = (u8::try_from(offset), data) {
            *b = self.serial.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), [b, ..]) = (u8::try_from(offset), data) {
            if let Err(e) = self.serial.write(off, *b) {
                // Losing console output must be visible, but must not stop the guest.
                tracing::warn!("serial write failed: {e:?}");
            }
        }
    }
}

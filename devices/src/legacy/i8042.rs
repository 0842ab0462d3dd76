//! i8042 keyboard controller, only for its CPU reset line (Linux `reboot=k`).

use std::sync::Arc;

use vm_superio::{I8042Device, Trigger};

use crate::{BusDevice, ExitNotifier, GuestExit};

struct ResetTrigger(ExitNotifier);

impl Trigger for ResetTrigger {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        (self.0)(GuestExit::Reset);
        Ok(())
    }
}

/// Ports 0x60..=0x64 of the PC keyboard controller.
pub struct I8042 {
    dev: I8042Device<ResetTrigger>,
}

impl I8042 {
    /// A controller that reports a reset through `exit`.
    pub fn new(exit: ExitNotifier) -> Self {
        Self {
            dev: I8042Device::new(ResetTrigger(Arc::clone(&exit))),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Ok(off), [b, ..]) = (u8::try_from(offset), data) {
            *b = self.dev.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), [b, ..]) = (u8::try_from(offset), data) {
            let _ = self.dev.write(off, *b);
        }
    }
}

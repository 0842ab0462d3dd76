//! The one I/O port behind the FADT's hardware-reduced sleep control register and reset
//! register. Writing `SLP_EN | S5 << 2` powers off; writing the reset value resets.

use crate::{BusDevice, ExitNotifier, GuestExit};

/// SLP_TYP the DSDT's `_S5_` package announces.
pub const ACPI_PM_S5_SLP_TYP: u8 = 5;
/// Value the FADT tells the guest to write to the reset register.
pub const ACPI_PM_RESET_VALUE: u8 = 1;
const SLP_EN: u8 = 1 << 5;

/// Sleep control + reset register device (1 byte wide).
pub struct AcpiPmDevice {
    exit: ExitNotifier,
}

impl AcpiPmDevice {
    /// A device that reports power off and reset through `exit`.
    pub fn new(exit: ExitNotifier) -> Self {
        Self { exit }
    }
}

impl BusDevice for AcpiPmDevice {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Sleep status register: never report a wake event.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (0, [v, ..]) = (offset, data) else { return };
        if *v == ACPI_PM_RESET_VALUE {
            (self.exit)(GuestExit::Reset);
        } else if v & SLP_EN != 0 && (v >> 2) & 0x7 == ACPI_PM_S5_SLP_TYP {
            (self.exit)(GuestExit::PowerOff);
        } else {
            tracing::debug!("ignoring ACPI sleep control write {v:#x}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn decodes_s5_and_reset() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let mut dev = AcpiPmDevice::new(Arc::new(move |e| s.lock().unwrap().push(e)));
        dev.write(0, &[SLP_EN | (ACPI_PM_S5_SLP_TYP << 2)]);
        dev.write(0, &[ACPI_PM_RESET_VALUE]);
        dev.write(0, &[SLP_EN | (3 << 2)]); // S3: not supported, ignored
        dev.write(0, &[]);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![GuestExit::PowerOff, GuestExit::Reset]
        );
    }
}

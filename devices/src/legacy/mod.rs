//! Legacy PC devices a Linux guest expects: the 8250 UART, the i8042 controller (reset line)
//! and the ACPI hardware-reduced sleep/reset registers (power off).

mod acpi_pm;
mod i8042;
mod serial;

pub use acpi_pm::{AcpiPmDevice, ACPI_PM_RESET_VALUE, ACPI_PM_S5_SLP_TYP};
pub use i8042::I8042;
pub use serial::{IrqTrigger, SerialDevice, SerialDeviceState};

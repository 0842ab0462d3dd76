//! 8250 UART (COM1) on top of vm-superio's model.

use std::io::Write;

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;
use vm_superio::{Serial, Trigger};

use crate::{BusDevice, Error, IrqLine};

/// Most bytes a saved receive FIFO may hold (vm-superio's FIFO is 64 bytes).
const MAX_SAVED_FIFO: usize = 64;

/// Raises an interrupt through a line registered as a KVM irqfd.
pub struct IrqTrigger(IrqLine);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.trigger()
    }
}

/// The guest's serial console; output goes to the writer the VMM chose (stdout, a file, ...).
pub struct SerialDevice {
    serial: Serial<IrqTrigger, vm_superio::serial::NoEvents, Box<dyn Write + Send>>,
}

impl SerialDevice {
    /// A UART raising its interrupt through `irq` and writing transmitted bytes to `out`.
    pub fn new(irq: impl Into<IrqLine>, out: Box<dyn Write + Send>) -> Self {
        Self {
            serial: Serial::new(IrqTrigger(irq.into()), out),
        }
    }
}

/// The UART's registers and receive FIFO, as saved in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialDeviceState {
    /// Divisor latch, low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch, high byte.
    pub baud_divisor_high: u8,
    /// Interrupt enable register.
    pub interrupt_enable: u8,
    /// Interrupt identification register.
    pub interrupt_identification: u8,
    /// Line control register.
    pub line_control: u8,
    /// Line status register.
    pub line_status: u8,
    /// Modem control register.
    pub modem_control: u8,
    /// Modem status register.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Bytes received and not yet read by the guest.
    pub in_buffer: Vec<u8>,
}

impl<'a> snapshot::Persist<'a> for SerialDevice {
    type State = SerialDeviceState;
    /// The interrupt eventfd (a KVM irqfd) and where transmitted bytes go.
    type ConstructorArgs = (IrqLine, Box<dyn Write + Send>);
    type Error = Error;

    fn save(&self) -> Result<SerialDeviceState, Error> {
        let s = self.serial.state();
        Ok(SerialDeviceState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        })
    }

    fn restore(
        (irq, out): (IrqLine, Box<dyn Write + Send>),
        state: &SerialDeviceState,
    ) -> Result<Self, Error> {
        if state.in_buffer.len() > MAX_SAVED_FIFO {
            return Err(Error::Restore(format!(
                "serial receive FIFO holds {} bytes, at most {MAX_SAVED_FIFO} fit",
                state.in_buffer.len()
            )));
        }
        let s = SerialState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        };
        let serial = Serial::from_state(&s, IrqTrigger(irq), vm_superio::serial::NoEvents, out)
            .map_err(|e| Error::Restore(format!("serial: {e:?}")))?;
        Ok(Self { serial })
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

#[cfg(test)]
mod tests {
    use super::*;
    use snapshot::Persist;
    use std::sync::{Arc, Mutex};
    use vmm_sys_util::eventfd::EventFd;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn registers_survive_save_and_restore() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(irq.try_clone().unwrap(), Box::new(Sink::default()));
        dev.write(3, &[0x80]); // DLAB
        dev.write(0, &[0x0c]); // divisor low
        dev.write(3, &[0x03]); // 8N1, DLAB off
        dev.write(7, &[0x5a]); // scratch
        dev.write(1, &[0x02]); // THR-empty interrupt enabled
        let state = dev.save().unwrap();
        assert_eq!(state.baud_divisor_low, 0x0c);
        assert_eq!(state.scratch, 0x5a);

        let sink = Sink::default();
        let mut back = SerialDevice::restore((irq.into(), Box::new(sink.clone())), &state).unwrap();
        assert_eq!(back.save().unwrap(), state);
        let mut b = [0u8];
        back.read(7, &mut b);
        assert_eq!(b[0], 0x5a);
        back.write(0, b"x");
        assert_eq!(
            &*sink.0.lock().unwrap(),
            b"x",
            "output goes to the new writer"
        );

        let bad = SerialDeviceState {
            in_buffer: vec![0; 1000],
            ..state
        };
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        assert!(SerialDevice::restore((irq.into(), Box::new(Sink::default())), &bad).is_err());
    }
}

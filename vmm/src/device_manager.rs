//! Creates the VM's devices, places them on the port I/O and MMIO buses and wires their
//! interrupts to KVM irqfds.

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use devices::legacy::{AcpiPmDevice, SerialDevice, I8042};
use devices::test_device::{TestMmio, TestPio, TEST_MMIO_LEN, TEST_PIO_BASE, TEST_PIO_LEN};
use devices::{Bus, ExitNotifier};
use kvm_ioctls::VmFd;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch::layout::{pio, TEST_MMIO_BASE};
use crate::config::SerialOutput;
use crate::error::{Error, Result};
use crate::vstate::vcpu::IoBuses;

/// Serial output shared with the [`crate::Vm`] handle: the in-memory buffer (if any) and the
/// time the guest wrote its first byte (boot-time measurements).
#[derive(Clone, Default)]
pub struct SerialTap {
    /// Bytes written, when the output is [`SerialOutput::Memory`].
    pub buffer: Option<Arc<Mutex<Vec<u8>>>>,
    /// When the first byte arrived.
    pub first_byte: Arc<OnceLock<Instant>>,
}

struct TappedWriter {
    inner: Box<dyn Write + Send>,
    tap: SerialTap,
}

impl Write for TappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !buf.is_empty() {
            self.tap.first_byte.get_or_init(Instant::now);
        }
        if let Some(b) = &self.tap.buffer {
            b.lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(buf);
        }
        self.inner.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn serial_writer(out: &SerialOutput) -> Result<(Box<dyn Write + Send>, SerialTap)> {
    let mut tap = SerialTap::default();
    let inner: Box<dyn Write + Send> = match out {
        SerialOutput::Stdout => Box::new(std::io::stdout()),
        SerialOutput::File(path) => {
            Box::new(File::create(path).map_err(|source| Error::SerialOutput {
                path: path.clone(),
                source,
            })?)
        }
        SerialOutput::Memory => {
            tap.buffer = Some(Arc::new(Mutex::new(Vec::new())));
            Box::new(std::io::sink())
        }
        SerialOutput::Discard => Box::new(std::io::sink()),
    };
    Ok((
        Box::new(TappedWriter {
            inner,
            tap: tap.clone(),
        }),
        tap,
    ))
}

fn irq_eventfd(vm: &VmFd, gsi: u32) -> Result<EventFd> {
    let evt = EventFd::new(EFD_NONBLOCK).map_err(|source| Error::Io {
        context: "creating an interrupt eventfd",
        source,
    })?;
    vm.register_irqfd(&evt, gsi)
        .map_err(Error::kvm("KVM_IRQFD"))?;
    Ok(evt)
}

/// The devices of one VM.
pub struct DeviceManager {
    buses: IoBuses,
    serial_tap: SerialTap,
}

impl DeviceManager {
    /// Creates the legacy devices (and the test device if asked) for `vm`.
    pub fn new(
        vm: &VmFd,
        serial: &SerialOutput,
        test_device: bool,
        exit: ExitNotifier,
    ) -> Result<Self> {
        let mut pio_bus = Bus::new();
        let mut mmio_bus = Bus::new();

        let (writer, serial_tap) = serial_writer(serial)?;
        let com1_irq = irq_eventfd(vm, pio::SERIAL_COM1_GSI)?;
        pio_bus.insert(
            Arc::new(Mutex::new(SerialDevice::new(com1_irq, writer))),
            u64::from(pio::SERIAL_COM1),
            8,
        )?;
        pio_bus.insert(
            Arc::new(Mutex::new(I8042::new(Arc::clone(&exit)))),
            u64::from(pio::I8042),
            5,
        )?;
        pio_bus.insert(
            Arc::new(Mutex::new(AcpiPmDevice::new(Arc::clone(&exit)))),
            u64::from(pio::ACPI_PM),
            1,
        )?;
        if test_device {
            pio_bus.insert(
                Arc::new(Mutex::new(TestPio::new(Arc::clone(&exit)))),
                TEST_PIO_BASE,
                TEST_PIO_LEN,
            )?;
            let irq = irq_eventfd(vm, pio::TEST_DEVICE_GSI)?;
            mmio_bus.insert(
                Arc::new(Mutex::new(TestMmio::new(irq))),
                TEST_MMIO_BASE,
                TEST_MMIO_LEN,
            )?;
        }
        Ok(Self {
            buses: IoBuses {
                pio: Arc::new(pio_bus),
                mmio: Arc::new(mmio_bus),
            },
            serial_tap,
        })
    }

    /// The buses vCPU threads dispatch to.
    pub fn buses(&self) -> IoBuses {
        self.buses.clone()
    }

    /// The serial output tap.
    pub fn serial_tap(&self) -> &SerialTap {
        &self.serial_tap
    }
}

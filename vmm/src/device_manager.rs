//! Creates the VM's devices, places them on the port I/O and MMIO buses and wires their
//! interrupts to KVM irqfds.
//!
//! virtio devices sit in virtio-mmio slots in the MMIO gap (see [`crate::arch::layout`]):
//! slot `n` at `VIRTIO_MMIO_BASE + n * 0x1000` with GSI `VIRTIO_MMIO_GSI_BASE + n`, queue
//! notifications as KVM ioeventfds (no exit to userspace) and the interrupt as an irqfd.
//! Their work runs on one device event-loop thread, never on vCPU threads. The builder
//! announces every slot on the kernel command line and in the ACPI DSDT.

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use devices::event_loop::EventLoop;
use devices::legacy::{AcpiPmDevice, SerialDevice, I8042};
use devices::test_device::{TestMmio, TestPio, TEST_MMIO_LEN, TEST_PIO_BASE, TEST_PIO_LEN};
use devices::virtio::block::BlockDevice;
use devices::virtio::mmio::MmioTransport;
use devices::virtio::vsock::{SocketFile, VsockDevice};
use devices::virtio::VirtioDevice;
use devices::{Bus, ExitNotifier};
use kvm_ioctls::{IoEventAddress, VmFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch::layout::{
    pio, TEST_MMIO_BASE, VIRTIO_MMIO_BASE, VIRTIO_MMIO_GSI_BASE, VIRTIO_MMIO_MAX_SLOTS,
    VIRTIO_MMIO_SLOT_SIZE,
};
use crate::config::{BlockConfig, SerialOutput, VsockConfig};
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

/// Offset of the QueueNotify register in a virtio-mmio window.
const VIRTIO_MMIO_QUEUE_NOTIFY: u64 = 0x50;

/// Where one virtio-mmio device sits, as the guest must be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioSlot {
    /// Base of the register window.
    pub base: u64,
    /// Size of the window.
    pub len: u64,
    /// IOAPIC pin (GSI) of its interrupt: edge-triggered, active high.
    pub gsi: u32,
    /// virtio device id.
    pub device_type: u32,
}

impl VirtioSlot {
    /// The kernel command-line entry for `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES` kernels.
    pub fn cmdline_entry(&self) -> String {
        format!(
            "virtio_mmio.device={}K@{:#x}:{}",
            self.len >> 10,
            self.base,
            self.gsi
        )
    }
}

/// Puts `device` in virtio-mmio slot `n`: irqfd on its GSI, one ioeventfd per queue on
/// QueueNotify (datamatch = queue index), the transport on the MMIO bus.
fn add_virtio_mmio(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    mmio_bus: &mut Bus,
    n: usize,
    device: Box<dyn VirtioDevice>,
) -> Result<VirtioSlot> {
    let n32 = u32::try_from(n).unwrap_or(u32::MAX);
    if n32 >= VIRTIO_MMIO_MAX_SLOTS {
        return Err(Error::Config(format!(
            "too many virtio devices (at most {VIRTIO_MMIO_MAX_SLOTS})"
        )));
    }
    let base = VIRTIO_MMIO_BASE + u64::from(n32) * VIRTIO_MMIO_SLOT_SIZE;
    let gsi = VIRTIO_MMIO_GSI_BASE + n32;
    let irq = irq_eventfd(vm, gsi)?;
    let transport = MmioTransport::new(mem.clone(), device, irq)?;
    let notify = IoEventAddress::Mmio(base + VIRTIO_MMIO_QUEUE_NOTIFY);
    for (q, evt) in transport.queue_evts().iter().enumerate() {
        vm.register_ioevent(evt, &notify, q as u32)
            .map_err(Error::kvm("KVM_IOEVENTFD"))?;
    }
    let slot = VirtioSlot {
        base,
        len: VIRTIO_MMIO_SLOT_SIZE,
        gsi,
        device_type: transport.device_type(),
    };
    mmio_bus.insert(Arc::new(Mutex::new(transport)), base, VIRTIO_MMIO_SLOT_SIZE)?;
    Ok(slot)
}

/// The devices of one VM.
pub struct DeviceManager {
    // Field order is drop order: the event loop (and every device worker on it) stops
    // first, then the vsock socket file is removed (whoever still holds the buses).
    _event_loop: Option<EventLoop>,
    _socket_files: Vec<SocketFile>,
    buses: IoBuses,
    serial_tap: SerialTap,
    virtio_slots: Vec<VirtioSlot>,
}

impl DeviceManager {
    /// Creates the legacy devices, the test device if asked, and the virtio devices the
    /// config names, for `vm` with guest memory `mem`.
    pub fn new(
        vm: &VmFd,
        mem: &GuestMemoryMmap,
        serial: &SerialOutput,
        test_device: bool,
        vsock: Option<&VsockConfig>,
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
        let mut virtio: Vec<Box<dyn VirtioDevice>> = Vec::new();
        let mut event_loop = None;
        let mut socket_files = Vec::new();
        if let Some(v) = vsock {
            let lp = EventLoop::start("clade-devices")?;
            // Refuses a path another VMM listens on; replaces a stale socket file.
            let (listener, file) = SocketFile::bind(&v.uds_path)?;
            socket_files.push(file);
            virtio.push(Box::new(VsockDevice::new(
                u64::from(v.guest_cid),
                listener,
                &v.uds_path,
                lp.handle(),
            )?));
            event_loop = Some(lp);
        }
        let mut virtio_slots = Vec::new();
        for (n, device) in virtio.into_iter().enumerate() {
            let slot = add_virtio_mmio(vm, mem, &mut mmio_bus, n, device)?;
            tracing::debug!(
                "virtio-mmio slot {n}: device type {} at {:#x}, GSI {}",
                slot.device_type,
                slot.base,
                slot.gsi
            );
            virtio_slots.push(slot);
        }
        Ok(Self {
            _event_loop: event_loop,
            _socket_files: socket_files,
            buses: IoBuses {
                pio: Arc::new(pio_bus),
                mmio: Arc::new(mmio_bus),
            },
            serial_tap,
            virtio_slots,
        })
    }

    /// Adds a virtio-blk disk in the next virtio-mmio slot (its layers are opened and
    /// checked here); requests run on the device event loop, started here if no other
    /// device needed it. Only before the vCPUs run and the boot tables are written (those
    /// announce every slot). Returns the disk, for freezing it when the VM forks.
    pub fn add_block_device(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemoryMmap,
        cfg: &BlockConfig,
    ) -> Result<Arc<Mutex<disk::Disk>>> {
        let image = disk::Disk::open(
            &cfg.path,
            disk::OpenOptions {
                read_only: cfg.read_only,
            },
        )?;
        let serial = cfg.serial.clone().unwrap_or_else(|| {
            let mut id = disk::id_hex(&image.layers()[0].header().layer_id);
            id.truncate(devices::virtio::block::ID_BYTES);
            id
        });
        let lp = match &self._event_loop {
            Some(lp) => lp,
            None => self._event_loop.insert(EventLoop::start("clade-devices")?),
        };
        let device = BlockDevice::new(image, &serial, lp.handle())?;
        let shared = device.disk();
        let mmio = Arc::get_mut(&mut self.buses.mmio)
            .ok_or_else(|| Error::Config("devices can only be added before the VM runs".into()))?;
        let n = self.virtio_slots.len();
        let slot = add_virtio_mmio(vm, mem, mmio, n, Box::new(device))?;
        tracing::debug!(
            "virtio-mmio slot {n}: block device {} at {:#x}, GSI {}",
            cfg.path.display(),
            slot.base,
            slot.gsi
        );
        self.virtio_slots.push(slot);
        Ok(shared)
    }

    /// The virtio-mmio slots in use, in slot order.
    pub fn virtio_slots(&self) -> &[VirtioSlot] {
        &self.virtio_slots
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::{kvm, memory};
    use std::path::Path;

    /// A KVM VM with 64 MiB of memory, or `None` where this host has no usable KVM.
    fn test_vm() -> Option<(kvm_ioctls::Kvm, VmFd, memory::GuestRam)> {
        let k = kvm::open(Path::new(kvm::KVM_PATH)).ok()?;
        let vm = kvm::create_vm(&k).ok()?;
        let ram = memory::create(64 << 20).ok()?;
        kvm::set_memory_slots(&vm, &ram.mem).ok()?;
        kvm::create_irqchip(&vm).ok()?;
        Some((k, vm, ram))
    }

    #[test]
    fn vsock_gets_a_slot_a_socket_and_kvm_wiring() {
        let Some((_k, vm, ram)) = test_vm() else {
            eprintln!("skipped: no usable /dev/kvm");
            return;
        };
        let dir = std::env::temp_dir().join(format!("clade-dm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("v.sock");
        let vsock = VsockConfig {
            uds_path: path.clone(),
            guest_cid: 7,
        };
        let exit: ExitNotifier = Arc::new(|_| {});
        let dm = DeviceManager::new(
            &vm,
            &ram.mem,
            &SerialOutput::Discard,
            false,
            Some(&vsock),
            exit.clone(),
        )
        .unwrap();
        assert_eq!(
            dm.virtio_slots(),
            &[VirtioSlot {
                base: 0xd000_1000,
                len: 0x1000,
                gsi: 6,
                device_type: 19,
            }]
        );
        assert!(path.exists(), "the socket is there before the guest runs");
        let mmio = dm.buses().mmio;
        let read = |addr: u64| {
            let mut b = [0u8; 4];
            assert!(mmio.read(addr, &mut b), "nothing at {addr:#x}");
            u32::from_le_bytes(b)
        };
        assert_eq!(read(0xd000_1000), 0x7472_6976, "virtio-mmio magic");
        assert_eq!(read(0xd000_1004), 2);
        assert_eq!(read(0xd000_1008), 19);
        assert_eq!(read(0xd000_1100), 7, "guest CID in the config space");

        // A second VM on the same socket is refused and leaves it alone.
        let (_k2, vm2, ram2) = test_vm().unwrap();
        let err = DeviceManager::new(
            &vm2,
            &ram2.mem,
            &SerialOutput::Discard,
            false,
            Some(&vsock),
            exit,
        )
        .err()
        .expect("socket in use");
        assert!(err.to_string().contains("in use"), "{err}");
        assert!(path.exists());

        drop(dm);
        assert!(
            !path.exists(),
            "the socket is removed with the devices, even while a bus is still referenced"
        );
        drop(mmio);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cmdline_entries_name_size_base_and_gsi() {
        let s = VirtioSlot {
            base: VIRTIO_MMIO_BASE,
            len: VIRTIO_MMIO_SLOT_SIZE,
            gsi: VIRTIO_MMIO_GSI_BASE,
            device_type: 19,
        };
        assert_eq!(s.cmdline_entry(), "virtio_mmio.device=4K@0xd0001000:6");
    }
}

//! Creates the VM's devices, places them on the port I/O and MMIO buses and wires their
//! interrupts to KVM irqfds.
//!
//! virtio devices sit in virtio-mmio slots in the MMIO gap (see [`crate::arch::layout`]):
//! slot `n` at `VIRTIO_MMIO_BASE + n * 0x1000` with GSI `VIRTIO_MMIO_GSI_BASE + n`, queue
//! notifications as KVM ioeventfds (no exit to userspace) and the interrupt as an irqfd.
//! Their work runs on one device event-loop thread, never on vCPU threads. The builder
//! announces every slot on the kernel command line and in the ACPI DSDT.
//!
//! Every booted VM has a VM generation ID ([`VmGenId`]) at [`VMGENID_ADDR`], announced in
//! the DSDT with its generic event device's interrupt on [`pio::GED_GSI`]; a VM built from
//! saved state has one exactly when the saved state does (older snapshots do not), and gets
//! a new ID before it runs ([`DeviceManager::new_vm_generation`]).

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use devices::event_loop::EventLoop;
use devices::legacy::{AcpiPmDevice, SerialDevice, SerialDeviceState, I8042};
use devices::test_device::{
    TestMmio, TestMmioState, TestPio, TEST_MMIO_LEN, TEST_PIO_BASE, TEST_PIO_LEN,
};
use devices::virtio::balloon::{BalloonDevice, DiscardLog};
use devices::virtio::block::BlockDevice;
use devices::virtio::mmio::{MmioTransport, MmioTransportArgs, MmioTransportState};
use devices::virtio::net::tap::Tap;
use devices::virtio::net::{NetBackend, NetDevice, DEFAULT_MAC};
use devices::virtio::vsock::{socket_in_use, ListenerSlot, SocketFile, VsockDevice};
use devices::virtio::{VirtioDevice, VirtioDeviceState};
use devices::vmgenid::{VmGenId, VmGenIdState};
use devices::{Bus, ExitNotifier, GuestMemory, IrqLine};
use kvm_ioctls::{IoEventAddress, VmFd};
use serde::{Deserialize, Serialize};
use snapshot::{Persist, ThreadRunner};
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};

use crate::arch::acpi::GenIdPlace;
use crate::arch::layout::{
    pio, VirtioSlot, TEST_MMIO_BASE, VIRTIO_MMIO_BASE, VIRTIO_MMIO_GSI_BASE, VIRTIO_MMIO_MAX_SLOTS,
    VIRTIO_MMIO_SLOT_SIZE, VMGENID_ADDR,
};
use crate::config::{BlockConfig, NetConfig, SerialOutput, TapSource, VsockConfig};
use crate::error::{Error, Result};
use crate::seccomp::ThreadKind;
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

fn open_serial_file(path: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

fn serial_writer(out: &SerialOutput) -> Result<(Box<dyn Write + Send>, SerialTap)> {
    let mut tap = SerialTap::default();
    let inner: Box<dyn Write + Send> = match out {
        SerialOutput::Stdout => Box::new(std::io::stdout()),
        SerialOutput::File(path) => {
            // Not through a symlink, and private: the guest writes this file.
            Box::new(
                open_serial_file(path).map_err(|source| Error::SerialOutput {
                    path: path.clone(),
                    source,
                })?,
            )
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

/// A listening Unix socket bound ahead of a restore, with its file (see
/// [`DeviceManager::finish_restore`]).
pub type BoundAhead = (std::os::unix::net::UnixListener, SocketFile);

/// Binds a VM's vsock socket ahead of its restore at `path`, a free name on the filesystem
/// of the socket path the restore will name ([`crate::RestoreOptions::vsock_bound_ahead`]):
/// the restore then moves it into place (a rename) instead of binding one (a new inode).
pub fn bind_vsock_ahead(path: &std::path::Path) -> Result<BoundAhead> {
    Ok(SocketFile::bind(path)?)
}

/// Opens the TAP `cfg` names (by name, or a duplicate of the descriptor given; an opened
/// one is shared), set up for virtio-net. Done before any KVM object exists on boot, so a
/// missing TAP fails early; a pool of networks calls it ahead of its restores
/// ([`TapSource::Open`]).
pub fn open_tap(cfg: &NetConfig) -> Result<Arc<Tap>> {
    Ok(Arc::new(match &cfg.tap {
        TapSource::Open(tap) => return Ok(Arc::clone(tap)),
        TapSource::Name(name) => match &cfg.netns {
            None => Tap::open(name)?,
            Some(ns) => open_tap_in_netns(name, ns)?,
        },
        TapSource::Fd(fd) => {
            // SAFETY: F_GETFD only reads the flags of descriptor `fd` (or fails if it is not
            // open), so `fd` is known to be open before it is borrowed below.
            if unsafe { libc::fcntl(*fd, libc::F_GETFD) } < 0 {
                return Err(devices::Error::Tap {
                    what: format!("descriptor {fd}"),
                    source: std::io::Error::last_os_error(),
                }
                .into());
            }
            // SAFETY: `fd` is open (checked above) and stays open for this call: the
            // process keeps it, and `from_fd` only duplicates it.
            let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(*fd) };
            let tap = Tap::from_fd(borrowed)?;
            // An inherited TAP was handed to this VMM for its VM, not to the processes it
            // starts (fork children): it does not pass on.
            if let Err(e) = nix::fcntl::fcntl(
                *fd,
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            ) {
                tracing::warn!("TAP descriptor {fd}: setting close-on-exec: {e}");
            }
            tap
        }
    }))
}

/// Opens the TAP `name` inside the network namespace `netns` (a namespace file such as
/// `/run/netns/NAME`): `/dev/net/tun` binds a TAP to the namespace of the thread that opens
/// it, so this thread enters the namespace, opens the TAP and goes back to its own at once
/// (the descriptor works from any namespace). No other thread is touched, and this one
/// makes no socket meanwhile. On a restore's path: entering and leaving costs a few
/// microseconds, where a thread of its own for it cost far more.
fn open_tap_in_netns(name: &str, netns: &std::path::Path) -> Result<Tap> {
    use nix::sched::{setns, CloneFlags};
    let tap_err = |what: String, source: std::io::Error| devices::Error::Tap { what, source };
    let own = File::open("/proc/thread-self/ns/net")
        .map_err(|e| tap_err(format!("'{name}': this thread's network namespace"), e))?;
    let ns = File::open(netns).map_err(|e| {
        tap_err(
            format!("'{name}': network namespace {}", netns.display()),
            e,
        )
    })?;
    setns(&ns, CloneFlags::CLONE_NEWNET).map_err(|e| {
        tap_err(
            format!(
                "'{name}': entering network namespace {} (not a namespace file?)",
                netns.display()
            ),
            std::io::Error::from_raw_os_error(e as i32),
        )
    })?;
    let tap = Tap::open(name);
    if let Err(e) = setns(&own, CloneFlags::CLONE_NEWNET) {
        // Not expected (the namespace was ours a moment ago); this thread must not go on
        // in the sandbox's namespace: the caller fails the VM build.
        return Err(tap_err(
            format!(
                "'{name}': returning from network namespace {}",
                netns.display()
            ),
            std::io::Error::from_raw_os_error(e as i32),
        )
        .into());
    }
    Ok(tap?)
}

/// One registration of a device's eventfd with KVM: what a VM that moves to another KVM
/// VM registers again there ([`DeviceManager::prewire`]).
enum Wire {
    /// An irqfd: raising `line` raises `gsi`.
    Irq { line: IrqLine, gsi: u32 },
    /// An ioeventfd: a guest write of `datamatch` at `addr` signals `evt`.
    IoEvent {
        evt: EventFd,
        addr: u64,
        datamatch: u32,
    },
}

/// The devices wired to another KVM VM ahead of a move onto it ([`DeviceManager::prewire`]):
/// the interrupt lines' eventfds there, in the order of the lines.
pub(crate) struct Prewired {
    irqs: Vec<EventFd>,
}

/// The KVM VM the devices are wired to, and the record of every registration made.
struct Wiring<'a> {
    vm: &'a VmFd,
    wires: Vec<Wire>,
}

impl<'a> Wiring<'a> {
    fn new(vm: &'a VmFd) -> Self {
        Wiring {
            vm,
            wires: Vec::new(),
        }
    }

    /// A new interrupt line, registered as the irqfd of `gsi`.
    fn irq(&mut self, gsi: u32) -> Result<IrqLine> {
        let line = IrqLine::new(irq_eventfd(self.vm, gsi)?);
        self.wires.push(Wire::Irq {
            line: line.clone(),
            gsi,
        });
        Ok(line)
    }

    /// Registers `evt` as the ioeventfd of a guest write of `datamatch` at MMIO `addr`.
    fn ioevent(&mut self, evt: &EventFd, addr: u64, datamatch: u32) -> Result<()> {
        self.vm
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), datamatch)
            .map_err(Error::kvm("KVM_IOEVENTFD"))?;
        self.wires.push(Wire::IoEvent {
            evt: dup_eventfd(evt)?,
            addr,
            datamatch,
        });
        Ok(())
    }
}

/// A new eventfd, registered with `vm` as the irqfd of `gsi`.
fn irq_eventfd(vm: &VmFd, gsi: u32) -> Result<EventFd> {
    let evt = EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC).map_err(|source| Error::Io {
        context: "creating an interrupt eventfd",
        source,
    })?;
    vm.register_irqfd(&evt, gsi)
        .map_err(Error::kvm("KVM_IRQFD"))?;
    Ok(evt)
}

fn dup_eventfd(evt: &EventFd) -> Result<EventFd> {
    evt.try_clone().map_err(|source| Error::Io {
        context: "duplicating an eventfd",
        source,
    })
}

/// Offset of the QueueNotify register in a virtio-mmio window.
const VIRTIO_MMIO_QUEUE_NOTIFY: u64 = 0x50;

/// Puts `device` in virtio-mmio slot `n`: irqfd on its GSI, one ioeventfd per queue on
/// QueueNotify (datamatch = queue index), the transport on the MMIO bus. With `state`, the
/// transport (and the device's queues) is restored from it.
fn add_virtio_mmio(
    wiring: &mut Wiring<'_>,
    mem: &GuestMemory,
    mmio_bus: &mut Bus,
    n: usize,
    device: Box<dyn VirtioDevice>,
    state: Option<&MmioTransportState>,
) -> Result<(VirtioSlot, Arc<Mutex<MmioTransport>>)> {
    let n32 = u32::try_from(n).unwrap_or(u32::MAX);
    if n32 >= VIRTIO_MMIO_MAX_SLOTS {
        return Err(Error::Config(format!(
            "too many virtio devices (at most {VIRTIO_MMIO_MAX_SLOTS})"
        )));
    }
    let base = VIRTIO_MMIO_BASE + u64::from(n32) * VIRTIO_MMIO_SLOT_SIZE;
    let gsi = VIRTIO_MMIO_GSI_BASE + n32;
    let irq = wiring.irq(gsi)?;
    let transport = match state {
        None => MmioTransport::new(mem.clone(), device, irq)?,
        Some(st) => MmioTransport::restore(
            MmioTransportArgs {
                mem: mem.clone(),
                device,
                irq,
            },
            st,
        )?,
    };
    for (q, evt) in transport.queue_evts().iter().enumerate() {
        wiring.ioevent(evt, base + VIRTIO_MMIO_QUEUE_NOTIFY, q as u32)?;
    }
    let slot = VirtioSlot {
        base,
        len: VIRTIO_MMIO_SLOT_SIZE,
        gsi,
        device_type: transport.device_type(),
    };
    let transport = Arc::new(Mutex::new(transport));
    mmio_bus.insert(transport.clone(), base, VIRTIO_MMIO_SLOT_SIZE)?;
    Ok((slot, transport))
}

/// Every device's state, as saved in a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DevicesState {
    /// COM1.
    pub serial: SerialDeviceState,
    /// The test device's MMIO half, when attached.
    pub test_device: Option<TestMmioState>,
    /// virtio-mmio slots, in slot order.
    pub virtio: Vec<MmioTransportState>,
    /// The VM generation ID device (absent in snapshots taken before VMs had one, whose
    /// guests do not know it).
    pub vmgenid: Option<VmGenIdState>,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The threads device work runs on, each given as a runner: a spare thread of its kind
/// when the VM's shell had one (see `vstate::spare`), else one that starts a thread.
pub struct DeviceThreads {
    /// The device event loop (virtio devices), if one is needed.
    pub event_loop: ThreadRunner,
    /// The test device's interrupt thread, if the VM has the test device (`None`: a new
    /// thread).
    pub test_irq: Option<ThreadRunner>,
}

impl DeviceThreads {
    /// Runners that start new threads, each confined to its kind.
    pub fn spawned() -> Self {
        Self {
            event_loop: crate::seccomp::confine(ThreadKind::DeviceLoop, snapshot::spawn_thread()),
            test_irq: None,
        }
    }
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
    serial: Arc<Mutex<SerialDevice>>,
    test_mmio: Option<Arc<Mutex<TestMmio>>>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    vmgenid: Option<VmGenId>,
    paused: bool,
    /// Restored vsock devices whose socket is not bound yet.
    unbound: Vec<(std::path::PathBuf, ListenerSlot)>,
    /// The virtio-blk device's disk, if any (frozen when the VM forks).
    disk: Option<Arc<Mutex<disk::Disk>>>,
    /// The balloon's record of the pages it discarded, if the VM has one.
    discard_log: Option<Arc<DiscardLog>>,
    /// Every eventfd registered with KVM (see [`Wire`]).
    wires: Vec<Wire>,
}

impl DeviceManager {
    /// Creates the legacy devices, the test device if asked, and the virtio devices the
    /// config names, for `vm` with guest memory `mem`.
    pub fn new(
        vm: &VmFd,
        mem: &GuestMemory,
        serial: &SerialOutput,
        test_device: bool,
        vsock: Option<&VsockConfig>,
        exit: ExitNotifier,
    ) -> Result<Self> {
        Self::build(
            vm,
            mem,
            serial,
            test_device,
            vsock,
            None,
            None,
            None,
            exit,
            DeviceThreads::spawned(),
        )
    }

    /// Recreates the devices of a snapshot from `state`: the same devices in the same
    /// places, with their saved registers and queues. The vsock device keeps its guest CID
    /// and listens on `vsock.uds_path`. The device event loop, if one is needed, and the
    /// test device's thread run on the threads `threads` provides. A saved virtio-blk
    /// device is restored over the disk chain whose top layer `disk` names; a saved
    /// virtio-net device over the TAP `net` names.
    #[allow(clippy::too_many_arguments)]
    pub fn restore(
        vm: &VmFd,
        mem: &GuestMemory,
        serial: &SerialOutput,
        vsock: Option<&VsockConfig>,
        disk: Option<&BlockConfig>,
        net: Option<&NetConfig>,
        state: &DevicesState,
        exit: ExitNotifier,
        threads: DeviceThreads,
    ) -> Result<Self> {
        Self::build(
            vm,
            mem,
            serial,
            state.test_device.is_some(),
            vsock,
            disk,
            net,
            Some(state),
            exit,
            threads,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        vm: &VmFd,
        mem: &GuestMemory,
        serial: &SerialOutput,
        test_device: bool,
        vsock: Option<&VsockConfig>,
        disk: Option<&BlockConfig>,
        net: Option<&NetConfig>,
        state: Option<&DevicesState>,
        exit: ExitNotifier,
        threads: DeviceThreads,
    ) -> Result<Self> {
        let DeviceThreads {
            event_loop: loop_runner,
            test_irq,
        } = threads;
        // At most one event loop: the runner (which confines its thread as a device loop)
        // is used once.
        let mut runner = Some(loop_runner);
        let mut start_loop = move || -> Result<EventLoop> {
            let r = runner.take().unwrap_or_else(|| {
                crate::seccomp::confine(ThreadKind::DeviceLoop, snapshot::spawn_thread())
            });
            Ok(EventLoop::start_on("clade-devices", r)?)
        };
        let mut wiring = Wiring::new(vm);
        let mut pio_bus = Bus::new();
        let mut mmio_bus = Bus::new();

        let (writer, serial_tap) = serial_writer(serial)?;
        let com1_irq = wiring.irq(pio::SERIAL_COM1_GSI)?;
        let serial_dev = match state {
            None => SerialDevice::new(com1_irq, writer),
            Some(st) => SerialDevice::restore((com1_irq, writer), &st.serial)?,
        };
        let serial_dev = Arc::new(Mutex::new(serial_dev));
        pio_bus.insert(serial_dev.clone(), u64::from(pio::SERIAL_COM1), 8)?;
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
        let vmgenid = match state {
            None => Some(VmGenId::new(
                mem,
                VMGENID_ADDR,
                pio::GED_GSI,
                wiring.irq(pio::GED_GSI)?,
            )?),
            Some(st) => match &st.vmgenid {
                None => None,
                Some(g) => {
                    // Its GSI must be a free IOAPIC pin below the virtio-mmio ones.
                    if g.gsi >= VIRTIO_MMIO_GSI_BASE
                        || [0, 2, pio::SERIAL_COM1_GSI, pio::TEST_DEVICE_GSI].contains(&g.gsi)
                    {
                        return Err(Error::Snapshot(format!(
                            "the saved VM generation ID device uses GSI {}, which is taken",
                            g.gsi
                        )));
                    }
                    Some(VmGenId::restore(g, wiring.irq(g.gsi)?)?)
                }
            },
        };
        let mut test_mmio = None;
        if test_device {
            pio_bus.insert(
                Arc::new(Mutex::new(TestPio::new(Arc::clone(&exit)))),
                TEST_PIO_BASE,
                TEST_PIO_LEN,
            )?;
            let irq = wiring.irq(pio::TEST_DEVICE_GSI)?;
            let test_irq = test_irq.unwrap_or_else(|| {
                crate::seccomp::confine(ThreadKind::Helper, snapshot::spawn_thread())
            });
            let dev = match state.and_then(|s| s.test_device.as_ref()) {
                None => TestMmio::new(irq, test_irq),
                Some(st) => TestMmio::restore((irq, test_irq), st)?,
            };
            let dev = Arc::new(Mutex::new(dev));
            mmio_bus.insert(dev.clone(), TEST_MMIO_BASE, TEST_MMIO_LEN)?;
            test_mmio = Some(dev);
        }
        let mut virtio: Vec<Box<dyn VirtioDevice>> = Vec::new();
        let mut event_loop = None;
        let mut socket_files = Vec::new();
        let mut unbound = Vec::new();
        let mut restored_disk = None;
        let mut vsock_seen = false;
        let mut net_seen = false;
        let mut discard_log = None;
        let saved_virtio = state.map(|s| &s.virtio[..]);
        match saved_virtio {
            None => {
                if let Some(v) = vsock {
                    let lp = start_loop()?;
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
            }
            Some(saved) => {
                for t in saved {
                    match &t.device {
                        VirtioDeviceState::Vsock(vs) => {
                            let Some(v) = vsock else {
                                return Err(Error::Snapshot(
                                    "the snapshot has a vsock device but no socket path was given"
                                        .into(),
                                ));
                            };
                            if vsock_seen {
                                return Err(Error::Snapshot(
                                    "the snapshot has more than one vsock device".into(),
                                ));
                            }
                            vsock_seen = true;
                            // Fail now rather than after the vCPUs started.
                            if socket_in_use(&v.uds_path) {
                                return Err(devices::Error::SocketInUse(v.uds_path.clone()).into());
                            }
                            let lp = event_loop.take().map_or_else(&mut start_loop, Ok)?;
                            // Bound by finish_restore, while the vCPUs already run.
                            let slot: ListenerSlot = Arc::new(Mutex::new(None));
                            virtio.push(Box::new(VsockDevice::restore(
                                vs,
                                u64::from(v.guest_cid),
                                slot.clone(),
                                &v.uds_path,
                                lp.handle(),
                            )?));
                            unbound.push((v.uds_path.clone(), slot));
                            event_loop = Some(lp);
                        }
                        VirtioDeviceState::Block(bs) => {
                            let Some(cfg) = disk else {
                                return Err(Error::Snapshot(
                                    "the saved VM has a virtio-blk disk but no disk was given"
                                        .into(),
                                ));
                            };
                            if restored_disk.is_some() {
                                return Err(Error::Snapshot(
                                    "the saved VM has more than one virtio-blk disk".into(),
                                ));
                            }
                            let image = open_disk(cfg)?;
                            let lp = event_loop.take().map_or_else(&mut start_loop, Ok)?;
                            let device = BlockDevice::restore(bs, image, lp.handle())?;
                            restored_disk = Some(device.disk());
                            virtio.push(Box::new(device));
                            event_loop = Some(lp);
                        }
                        VirtioDeviceState::Net(ns) => {
                            let Some(cfg) = net else {
                                return Err(Error::Snapshot(
                                    "the saved VM has a virtio-net device but no TAP was given"
                                        .into(),
                                ));
                            };
                            if std::mem::replace(&mut net_seen, true) {
                                return Err(Error::Snapshot(
                                    "the saved VM has more than one virtio-net device".into(),
                                ));
                            }
                            if let Some(mac) = cfg.mac.filter(|m| *m != ns.mac) {
                                return Err(Error::Config(format!(
                                    "MAC {} given, but the saved guest's is {}",
                                    devices::virtio::net::format_mac(&mac),
                                    devices::virtio::net::format_mac(&ns.mac)
                                )));
                            }
                            let tap: Arc<dyn NetBackend> = open_tap(cfg)?;
                            let lp = event_loop.take().map_or_else(&mut start_loop, Ok)?;
                            virtio.push(Box::new(NetDevice::restore(ns, tap, lp.handle())?));
                            event_loop = Some(lp);
                        }
                        VirtioDeviceState::Balloon(bs) => {
                            if discard_log.is_some() {
                                return Err(Error::Snapshot("more than one balloon".into()));
                            }
                            let lp = event_loop.take().map_or_else(&mut start_loop, Ok)?;
                            let (device, log) = BalloonDevice::logged(Some(bs), mem, lp.handle());
                            virtio.push(Box::new(device));
                            discard_log = Some(log);
                            event_loop = Some(lp);
                        }
                    }
                }
            }
        }
        let mut virtio_slots = Vec::new();
        let mut transports = Vec::new();
        for (n, device) in virtio.into_iter().enumerate() {
            let saved = saved_virtio.and_then(|s| s.get(n));
            let (slot, transport) =
                add_virtio_mmio(&mut wiring, mem, &mut mmio_bus, n, device, saved)?;
            transports.push(transport);
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
            serial: serial_dev,
            test_mmio,
            transports,
            vmgenid,
            paused: false,
            unbound,
            disk: restored_disk,
            discard_log,
            wires: wiring.wires,
        })
    }

    /// Completes a [`DeviceManager::restore`]: binds the vsock sockets and starts the
    /// virtio devices' work. Call it once the vCPUs run (their notifications wait in the
    /// queue eventfds until then), before handing the VM out. `bound_ahead`: a listening
    /// socket bound elsewhere on the same filesystem, moved to the vsock socket's path
    /// instead of binding one there ([`SocketFile::move_to`]); if it cannot be moved, it is
    /// closed and a socket bound as usual.
    pub fn finish_restore(&mut self, bound_ahead: Option<BoundAhead>) -> Result<()> {
        let mut bound_ahead = bound_ahead;
        for (path, slot) in self.unbound.drain(..) {
            let moved =
                bound_ahead
                    .take()
                    .and_then(|(listener, mut file)| match file.move_to(&path) {
                        Ok(()) => Some((listener, file)),
                        Err(e) => {
                            tracing::debug!("vsock: a socket bound ahead not used ({e})");
                            None
                        }
                    });
            let (listener, file) = match moved {
                Some(b) => b,
                None => SocketFile::bind(&path)?,
            };
            self._socket_files.push(file);
            *lock(&slot) = Some(listener);
        }
        for t in &self.transports {
            lock(t).finish_restore()?;
        }
        Ok(())
    }

    /// Stops device work that runs outside vCPU exits (virtio workers on the event loop),
    /// so that device state and guest memory hold still for a snapshot. Pause the vCPUs
    /// first.
    pub fn pause(&mut self) {
        if self.paused {
            return;
        }
        for t in &self.transports {
            lock(t).pause_device();
        }
        self.paused = true;
    }

    /// Whether [`DeviceManager::pause`] holds the devices still.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Lets paused devices work again.
    pub fn unpause(&mut self) {
        if !self.paused {
            return;
        }
        for t in &self.transports {
            lock(t).unpause_device();
        }
        self.paused = false;
    }

    /// The virtio-blk device's disk, if the VM has one.
    pub fn disk(&self) -> Option<Arc<Mutex<disk::Disk>>> {
        self.disk.clone()
    }

    /// Every device's state. Call between [`DeviceManager::pause`] and
    /// [`DeviceManager::unpause`], with the vCPUs paused.
    pub fn save(&self) -> Result<DevicesState> {
        if !self.paused {
            return Err(Error::Snapshot("devices must be paused to be saved".into()));
        }
        Ok(DevicesState {
            serial: lock(&self.serial).save()?,
            test_device: match &self.test_mmio {
                Some(t) => Some(lock(t).save()?),
                None => None,
            },
            virtio: self
                .transports
                .iter()
                .map(|t| lock(t).save())
                .collect::<devices::Result<Vec<_>>>()?,
            vmgenid: self.vmgenid.as_ref().map(VmGenId::save),
        })
    }

    /// Where the VM generation ID is and its interrupt, if the VM has the device.
    pub fn vmgenid(&self) -> Option<GenIdPlace> {
        self.vmgenid.as_ref().map(|g| GenIdPlace {
            addr: g.addr(),
            gsi: g.gsi(),
        })
    }

    /// The current VM generation ID, if the VM has the device.
    pub fn vm_generation_id(&self) -> Option<[u8; devices::vmgenid::VMGENID_LEN]> {
        self.vmgenid.as_ref().map(VmGenId::generation_id)
    }

    /// Gives the guest a new VM generation ID (written into `mem`) and raises the interrupt
    /// that tells it, if the VM has the device. For a VM built from saved state: after the
    /// in-kernel irqchip state is restored, before the vCPUs run. Returns whether it did.
    pub fn new_vm_generation(&mut self, mem: &GuestMemory) -> Result<bool> {
        match &mut self.vmgenid {
            Some(g) => {
                g.new_generation(mem)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The device event loop, started now if no device needed it yet.
    fn event_loop(&mut self) -> Result<devices::event_loop::LoopHandle> {
        let lp = match &self._event_loop {
            Some(lp) => lp,
            None => self._event_loop.insert(EventLoop::start_on(
                "clade-devices",
                crate::seccomp::confine(ThreadKind::DeviceLoop, snapshot::spawn_thread()),
            )?),
        };
        Ok(lp.handle())
    }

    /// Puts `device` in the next virtio-mmio slot (only before the VM runs); returns the
    /// slot's number and place.
    fn add_to_next_slot(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemory,
        device: Box<dyn VirtioDevice>,
    ) -> Result<(usize, VirtioSlot)> {
        let mmio = Arc::get_mut(&mut self.buses.mmio)
            .ok_or_else(|| Error::Config("devices can only be added before the VM runs".into()))?;
        let n = self.virtio_slots.len();
        let mut wiring = Wiring::new(vm);
        let added = add_virtio_mmio(&mut wiring, mem, mmio, n, device, None);
        self.wires.extend(wiring.wires);
        let (slot, transport) = added?;
        self.virtio_slots.push(slot);
        self.transports.push(transport);
        Ok((n, slot))
    }

    /// Adds a virtio-blk disk in the next virtio-mmio slot (its layers are opened and
    /// checked here); requests run on the device event loop, started here if no other
    /// device needed it. Only before the vCPUs run and the boot tables are written (those
    /// announce every slot). Returns the disk, for freezing it when the VM forks.
    pub fn add_block_device(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemory,
        cfg: &BlockConfig,
    ) -> Result<Arc<Mutex<disk::Disk>>> {
        let image = open_disk(cfg)?;
        let serial = cfg.serial.clone().unwrap_or_else(|| {
            let mut id = disk::id_hex(&image.layers()[0].header().layer_id);
            id.truncate(devices::virtio::block::ID_BYTES);
            id
        });
        let lp = self.event_loop()?;
        let device = BlockDevice::new(image, &serial, lp)?;
        let shared = device.disk();
        self.disk = Some(Arc::clone(&shared));
        let (n, slot) = self.add_to_next_slot(vm, mem, Box::new(device))?;
        tracing::debug!(
            "virtio-mmio slot {n}: block device {} at {:#x}, GSI {}",
            cfg.path.display(),
            slot.base,
            slot.gsi
        );
        Ok(shared)
    }

    /// Adds a virtio-net device over `tap` (see [`open_tap`]) with address `mac` (default
    /// [`DEFAULT_MAC`]) in the next virtio-mmio slot; frames move on the device event loop,
    /// started here if no other device needed it. Only before the vCPUs run and the boot
    /// tables are written (those announce every slot).
    pub fn add_net_device(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemory,
        tap: Arc<Tap>,
        mac: Option<[u8; 6]>,
    ) -> Result<()> {
        let lp = self.event_loop()?;
        let name = tap.name().to_string();
        let device = NetDevice::new(tap, mac.unwrap_or(DEFAULT_MAC), lp)?;
        let (n, slot) = self.add_to_next_slot(vm, mem, Box::new(device))?;
        tracing::debug!(
            "virtio-mmio slot {n}: net device on TAP {name} at {:#x}, GSI {}",
            slot.base,
            slot.gsi
        );
        Ok(())
    }

    /// Adds a virtio-balloon with free page reporting in the next virtio-mmio slot (only
    /// before the vCPUs run and the boot tables are written); what it discards is recorded
    /// in [`DeviceManager::discard_log`].
    pub fn add_balloon_device(&mut self, vm: &VmFd, mem: &GuestMemory) -> Result<()> {
        if self.discard_log.is_some() {
            return Err(Error::Config("the VM has a balloon already".into()));
        }
        let (device, log) = BalloonDevice::logged(None, mem, self.event_loop()?);
        let (n, slot) = self.add_to_next_slot(vm, mem, Box::new(device))?;
        tracing::debug!(
            "virtio-mmio slot {n}: balloon at {:#x}, GSI {}",
            slot.base,
            slot.gsi
        );
        self.discard_log = Some(log);
        Ok(())
    }

    /// The pages the balloon discarded since they were last taken (a VM with a balloon).
    pub fn discard_log(&self) -> Option<&Arc<DiscardLog>> {
        self.discard_log.as_ref()
    }

    /// Wires the devices to KVM VM `vm` too, ahead of a move onto it (a fork's parent, a
    /// copy-on-write snapshot: `Vm::move_onto`), changing nothing for the current VM: the
    /// ioeventfds are registered with `vm` as well (KVM lets an eventfd be the ioeventfd
    /// of several VMs), and each interrupt line gets a new eventfd registered with `vm` as
    /// its irqfd (an eventfd can be the irqfd of one VM only), for
    /// [`DeviceManager::switch_irqs`]. Done when a spare shell is given, this takes
    /// nothing from the move's pause. If it fails, what it registered with `vm` goes with
    /// `vm`.
    pub(crate) fn prewire(&self, vm: &VmFd) -> Result<Prewired> {
        let mut irqs = Vec::new();
        for w in &self.wires {
            match w {
                Wire::IoEvent {
                    evt,
                    addr,
                    datamatch,
                } => vm
                    .register_ioevent(evt, &IoEventAddress::Mmio(*addr), *datamatch)
                    .map_err(Error::kvm("KVM_IOEVENTFD"))?,
                Wire::Irq { gsi, .. } => irqs.push(irq_eventfd(vm, *gsi)?),
            }
        }
        Ok(Prewired { irqs })
    }

    /// Switches every interrupt line to the eventfd [`DeviceManager::prewire`] registered
    /// with the KVM VM the devices move to (call while paused). The former eventfds stay
    /// registered with the former KVM VM, which nothing raises any more, until that VM is
    /// torn down.
    pub(crate) fn switch_irqs(&mut self, prewired: Prewired) {
        let lines = self.wires.iter().filter_map(|w| match w {
            Wire::Irq { line, .. } => Some(line),
            Wire::IoEvent { .. } => None,
        });
        for (line, evt) in lines.zip(prewired.irqs) {
            drop(line.replace(evt));
        }
    }

    /// From now on guest memory is `mem` for every device (the same guest memory mapped
    /// elsewhere; call while paused: see [`devices::virtio::VirtioDevice::replace_memory`]).
    pub(crate) fn replace_memory(&mut self, mem: &GuestMemory) {
        for t in &self.transports {
            lock(t).replace_memory(mem);
        }
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

/// Opens a VM's disk chain, its layers filled on demand through `cfg.sources`: one
/// without a source is refused here, not found by the guest as an I/O error later.
fn open_disk(cfg: &BlockConfig) -> Result<disk::Disk> {
    let opts = disk::OpenOptions {
        read_only: cfg.read_only,
    };
    let sources = match &cfg.sources {
        Some(s) => s.clone(),
        None => disk::remote::Sources(std::sync::Arc::new(disk::remote::NoSources)),
    };
    Ok(disk::Disk::open_with_sources(
        &cfg.path,
        opts,
        Some(&sources),
    )?)
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
        kvm::set_memory_slots(&vm, ram.ranges(), false).ok()?;
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
    fn a_tap_descriptor_that_is_not_a_tap_or_not_open_is_refused() {
        use std::os::fd::AsRawFd;
        let f = File::open("/dev/null").unwrap();
        let cfg = NetConfig {
            tap: TapSource::Fd(f.as_raw_fd()),
            mac: None,
            netns: None,
        };
        let err = open_tap(&cfg).unwrap_err().to_string();
        assert!(err.contains("TUNGETIFF"), "{err}");
        let closed = NetConfig {
            tap: TapSource::Fd(100_000),
            mac: None,
            netns: None,
        };
        let err = open_tap(&closed).unwrap_err().to_string();
        assert!(err.contains("descriptor 100000"), "{err}");
    }

    /// Needs root: a TAP in a private network namespace (gone with the test's thread).
    #[test]
    #[ignore = "needs root (CAP_NET_ADMIN) for a network namespace and a TAP"]
    fn a_net_device_gets_the_next_slot_over_a_tap_by_name_or_descriptor() {
        std::thread::spawn(|| {
            // SAFETY: unshare only moves this thread into a new, empty network namespace.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            let Some((_k, vm, ram)) = test_vm() else {
                eprintln!("skipped: no usable /dev/kvm");
                return;
            };
            let by_name = open_tap(&NetConfig {
                tap: TapSource::Name("clade-dm0".into()),
                mac: None,
                netns: None,
            })
            .unwrap();
            // The same TAP through its descriptor, as a jailed VMM would get it.
            let by_fd = open_tap(&NetConfig {
                tap: TapSource::Fd(by_name.raw_fd()),
                mac: None,
                netns: None,
            })
            .unwrap();
            assert_eq!(by_fd.name(), "clade-dm0");
            drop(by_name);
            let exit: ExitNotifier = Arc::new(|_| {});
            let mut dm =
                DeviceManager::new(&vm, &ram.mem, &SerialOutput::Discard, false, None, exit)
                    .unwrap();
            let mac = [2, 0, 0, 0, 0, 9];
            dm.add_net_device(&vm, &ram.mem, by_fd, Some(mac)).unwrap();
            assert_eq!(
                dm.virtio_slots(),
                &[VirtioSlot {
                    base: 0xd000_1000,
                    len: 0x1000,
                    gsi: 6,
                    device_type: 1,
                }]
            );
            let mmio = dm.buses().mmio;
            let mut b = [0u8; 4];
            assert!(mmio.read(0xd000_1008, &mut b));
            assert_eq!(u32::from_le_bytes(b), 1, "virtio-net");
            let mut m = [0u8; 6];
            for (i, byte) in m.iter_mut().enumerate() {
                let mut one = [0u8; 1];
                assert!(mmio.read(0xd000_1100 + i as u64, &mut one));
                *byte = one[0];
            }
            assert_eq!(m, mac);
        })
        .join()
        .unwrap();
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

//! Forking a running VM ([`Vm::fork`]): N children that start from the parent's state at
//! one instant and share its memory copy-on-write.
//!
//! # How
//!
//! 1. The parent's vCPUs and device workers pause; vCPU, VM (irqchip, PIT, clock) and
//!    device state are read into memory (the snapshot code, no files).
//! 2. Its memory is *frozen* ([`GuestRam::freeze`]): a booted VM's memfd is mapped again,
//!    `MAP_PRIVATE`, at the same host address (KVM's memory slots stay valid; its MMU
//!    notifiers drop the old mappings), so nobody writes the memfd any more. A VM forked
//!    before copies the pages it wrote since (KVM dirty log + the VMM's writes) into a new
//!    memfd layer over the previous frozen image, and maps that layer back private.
//! 3. The parent runs again: the pause is steps 1 and 2 only.
//! 4. Each child is a VM shell with the frozen image's layers mapped `MAP_PRIVATE`, the
//!    state restored, and its own identity: vsock socket and guest CID (the guest gets a
//!    transport reset and reads the new CID), serial output, and with
//!    [`ForkOptions::agent_sync`] the current time, fresh entropy and a hostname suffix
//!    given to the guest agent right after it starts (best effort, in the background).
//!
//! A VM with a virtio-blk disk forks its disk in the same pause: the block worker is
//! paused between requests, its queue position saved with the transport, and
//! [`disk::Disk::snapshot`] freezes the top layer in place; the parent continues on a new
//! overlay next to it (`<name>-p<k>.cdsk`) and each child gets its own overlay on the frozen
//! layer ([`Frozen::child_overlay`]; `<frozen name>-c<k>.cdsk` for [`Vm::fork`]), so the
//! guest's disk and its page cache stay consistent. A read-only disk is shared as it is.
//!
//! Children in other processes (`clade fork`): [`Frozen::handoff`] encodes the state and
//! lists the memory layers' memfds; the other process rebuilds it with
//! [`Frozen::from_handoff`] and calls [`Vm::from_frozen`].
//!
//! Pages are shared (page cache of the memfds) until the parent or a child writes one;
//! the first write copies that page (~6.5 us here). A child is an ordinary [`Vm`]: it can
//! be snapshotted, forked again and stopped on its own; dropping the parent does not
//! affect it (the memfds live as long as any mapping of them).
//!
//! # Limits
//!
//! - VMs resumed with the `uffd` or `file` backend cannot fork (their memory is not a
//!   memfd).
//! - Each fork generation with writes in between adds a layer, and one mapping per run of
//!   written pages to every VM on it (at most
//!   [`MAX_FROZEN_LAYERS`](crate::vstate::memory::MAX_FROZEN_LAYERS) layers).
//! - A fork consumes the dirty log: the parent's next diff snapshot needs a full one first.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::config::{BlockConfig, SerialOutput, VmConfig, VsockConfig};
use crate::device_manager::{DeviceManager, DevicesState};
use crate::error::{Error, Result};
use crate::persist::{MachineState, Steps};
use crate::vm::{exit_notifier, RunState, Vm};
use crate::vstate::kvm;
use crate::vstate::memory::{Backing, FrozenImage, GuestRam};
use crate::vstate::shell::{Shell, ShellSpec};
use crate::vstate::spare;
use crate::vstate::state::{self as kvm_state, VcpuState, VmKvmState};

/// Options of [`Vm::fork`].
#[derive(Debug, Default)]
pub struct ForkOptions {
    /// Where each child's serial console goes (default: discarded).
    pub serial: SerialOutput,
    /// Child `i`'s vsock socket (when the parent has a vsock device); missing entries
    /// default to `<parent socket>.fork<k>` with `k` unique in this process.
    pub vsock_paths: Vec<PathBuf>,
    /// Child `i`'s guest CID; missing entries get a CID unique in this process (and
    /// different from the parent's).
    pub guest_cids: Vec<u32>,
    /// After a child starts, give its guest agent the current time, fresh entropy and the
    /// hostname suffix `-f<k>`, in a background thread that gives up after this long.
    pub agent_sync: Option<Duration>,
    /// Pre-built VM shells (e.g. from a [`crate::pool::ShellPool`]); children without one
    /// build their own.
    pub shells: Vec<Shell>,
    /// Start the children's vCPUs before returning (otherwise call [`Vm::start`]).
    pub start: bool,
    /// Pin the children's vCPUs (see [`Vm::pin_vcpus`]).
    pub vcpu_cpus: Vec<usize>,
    /// Test hook: fail after this many children were built (checks the cleanup).
    #[doc(hidden)]
    pub fail_after: Option<usize>,
}

/// A frozen instant of a VM: its memory image and its state. Children are made from it.
pub struct Frozen {
    /// The memory.
    pub image: Arc<FrozenImage>,
    /// The machine (vCPUs, memory size, vsock, ...).
    pub machine: MachineState,
    /// In-kernel irqchip, PIT and clock.
    pub vm: VmKvmState,
    /// Each vCPU.
    pub vcpus: Vec<VcpuState>,
    /// Devices.
    pub devices: DevicesState,
    /// The parent's configuration.
    pub config: VmConfig,
    /// The disk, when the VM has one.
    pub disk: Option<FrozenDisk>,
}

/// A forked VM's disk at the frozen instant.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FrozenDisk {
    /// The frozen layer each child gets its own overlay on ([`Frozen::child_overlay`]); for
    /// a read-only disk, the disk's own top layer, which children open read-only too.
    pub layer: PathBuf,
    /// The disk was read-only.
    pub read_only: bool,
    /// The configured serial.
    pub serial: Option<String>,
}

/// What a fork did.
#[derive(Debug, Clone)]
pub struct ForkReport {
    /// How long the parent's vCPUs were paused (0 when it was paused already).
    pub pause_time: Duration,
    /// Time steps of the pause, in order.
    pub pause_steps: Vec<(&'static str, Duration)>,
    /// Layers of the frozen image, and mappings a VM on it has.
    pub layers: usize,
    /// Mappings (runs of pages) each VM on the image has.
    pub mappings: usize,
    /// Building each child (from the end of the pause to it running).
    pub child_times: Vec<Duration>,
    /// Whole call.
    pub total: Duration,
}

static FORK_SEQ: AtomicU32 = AtomicU32::new(1);

/// A CID no other fork in this process handed out, and not `avoid`.
fn next_cid(avoid: u32) -> u32 {
    loop {
        let c = 1000 + FORK_SEQ.fetch_add(1, Ordering::Relaxed);
        if c != avoid {
            return c;
        }
    }
}

impl Vm {
    /// Forks this running (or paused) VM into `n` children (see the [module
    /// documentation](crate::fork)). The parent runs on afterwards (a paused one stays
    /// paused). If building a child fails, the children built so far are stopped and
    /// removed, the parent runs on, and the error is returned.
    pub fn fork(&mut self, n: usize, options: ForkOptions) -> Result<Vec<Vm>> {
        self.fork_with_report(n, options).map(|(c, _)| c)
    }

    /// [`Vm::fork`], with how it went.
    pub fn fork_with_report(
        &mut self,
        n: usize,
        mut options: ForkOptions,
    ) -> Result<(Vec<Vm>, ForkReport)> {
        let t0 = Instant::now();
        let (frozen, pause_time, pause_steps) = self.freeze_for_fork()?;
        let frozen = Arc::new(frozen);
        let mut children = Vec::with_capacity(n);
        let mut child_times = Vec::with_capacity(n);
        let mut shells = std::mem::take(&mut options.shells).into_iter();
        for i in 0..n {
            if options.fail_after == Some(i) {
                tracing::warn!("fork: injected failure after {i} children");
                // Dropping the children built so far stops them and removes their sockets.
                return Err(Error::Snapshot(format!(
                    "fork: injected failure after {i} children"
                )));
            }
            let t = Instant::now();
            let seq = FORK_SEQ.fetch_add(1, Ordering::Relaxed);
            let disk_path = match &frozen.disk {
                Some(d) if !d.read_only => {
                    let p = sibling_layer(&d.layer, "c");
                    frozen.child_overlay(&p)?;
                    Some(p)
                }
                _ => None,
            };
            let spec = ChildSpec {
                disk_path: disk_path.clone(),
                vsock_path: options.vsock_paths.get(i).cloned().or_else(|| {
                    frozen.machine.vsock.as_ref().map(|v| {
                        let mut p = v.uds_path.clone().into_os_string();
                        p.push(format!(".fork{}-{seq}", std::process::id()));
                        PathBuf::from(p)
                    })
                }),
                guest_cid: options.guest_cids.get(i).copied().unwrap_or_else(|| {
                    next_cid(frozen.machine.vsock.as_ref().map_or(0, |v| v.guest_cid))
                }),
                serial: options.serial.clone(),
                shell: shells.next(),
                agent_sync: options.agent_sync,
                hostname_suffix: format!("-f{seq}"),
                start: options.start,
                vcpu_cpus: options.vcpu_cpus.clone(),
            };
            let child = Vm::from_frozen(&frozen, spec).map_err(|e| {
                tracing::warn!("fork: child {i} failed ({e}); removing {i} children");
                if let Some(p) = &disk_path {
                    let _ = std::fs::remove_file(p);
                }
                e
            })?;
            children.push(child);
            child_times.push(t.elapsed());
        }
        let report = ForkReport {
            pause_time,
            pause_steps,
            layers: frozen.image.layers(),
            mappings: frozen.image.mappings(),
            child_times,
            total: t0.elapsed(),
        };
        tracing::info!(
            "forked {n} children: parent paused {:?}, {} layers, total {:?}",
            report.pause_time,
            report.layers,
            report.total
        );
        Ok((children, report))
    }

    /// Pauses the VM, saves its state and freezes its memory, lets it run again. The
    /// parent is left unchanged (still running) on an error.
    #[allow(clippy::type_complexity)]
    pub fn freeze_for_fork(&mut self) -> Result<(Frozen, Duration, Vec<(&'static str, Duration)>)> {
        self.poll_exit();
        if !matches!(self.state, RunState::Running | RunState::Paused) {
            return Err(Error::InvalidState {
                state: self.state_name(),
                op: "fork",
            });
        }
        if self.page_server.is_some() || !self.dirty_tracking {
            return Err(Error::Snapshot(
                "only VMs with their whole memory in place and dirty page tracking can fork \
                 (a uffd resume cannot)"
                    .into(),
            ));
        }
        let mut steps = Steps::new();
        let was_running = self.state == RunState::Running;
        let t_pause = Instant::now();
        if was_running {
            for v in &self.vcpus {
                v.pause();
            }
        }
        self.devices.pause();
        steps.done("pause");
        let captured = self.capture_for_fork(&mut steps);
        self.devices.unpause();
        if was_running {
            for v in &self.vcpus {
                v.resume();
            }
        }
        steps.done("unpause");
        let pause_time = if was_running {
            t_pause.elapsed()
        } else {
            Duration::ZERO
        };
        let (image, vcpus, vm, devices, disk) = captured?;
        // The dirty log was consumed: a diff snapshot would miss pages.
        self.lineage = None;
        let frozen = Frozen {
            image,
            machine: self.machine_state(),
            vm,
            vcpus,
            devices,
            config: self.config.clone(),
            disk,
        };
        Ok((frozen, pause_time, steps.steps))
    }

    #[allow(clippy::type_complexity)]
    fn capture_for_fork(
        &mut self,
        steps: &mut Steps,
    ) -> Result<(
        Arc<FrozenImage>,
        Vec<VcpuState>,
        VmKvmState,
        DevicesState,
        Option<FrozenDisk>,
    )> {
        let (vcpus, vm, devices) = self.save_machine(Some(steps))?;
        let disk = self.freeze_disk("p")?;
        if disk.is_some() {
            steps.done("freeze_disk");
        }
        // The pages written since this memory was last frozen (a booted VM: none needed,
        // but the log restarts here).
        self.take_dirty()?;
        let dirty = std::mem::take(&mut self.fork_carry);
        steps.done("dirty_log");
        let forked = matches!(self.ram.backing(), Backing::Forked(_));
        let image = match self.ram.freeze(forked.then_some(&dirty[..])) {
            Ok(i) => i,
            Err(e) => {
                self.fork_carry = dirty;
                return Err(e);
            }
        };
        steps.done("freeze_memory");
        Ok((image, vcpus, vm, devices, disk))
    }

    /// The disk's half of a fork or a snapshot (devices paused): its top layer is flushed
    /// and frozen and the VM continues on a new overlay next to it (`<name>-<tag><k>.cdsk`).
    /// A read-only disk stays as it is: children and resumes share it. The layer path
    /// returned is absolute when it can be resolved.
    pub(crate) fn freeze_disk(&mut self, tag: &str) -> Result<Option<FrozenDisk>> {
        let (Some(disk), Some(cfg)) = (self.devices.disk(), self.config.disk.clone()) else {
            return Ok(None);
        };
        if cfg.read_only {
            return Ok(Some(FrozenDisk {
                layer: absolute(cfg.path),
                read_only: true,
                serial: cfg.serial,
            }));
        }
        let mut d = disk.lock().unwrap_or_else(|e| e.into_inner());
        let new_top = sibling_layer(d.path(), tag);
        let frozen = absolute(d.snapshot(&new_top)?);
        drop(d);
        if let Some(c) = self.config.disk.as_mut() {
            c.path = new_top;
        }
        Ok(Some(FrozenDisk {
            layer: frozen,
            read_only: false,
            serial: cfg.serial,
        }))
    }

    /// A new VM from a frozen instant (a child of a fork), with its own identity.
    pub fn from_frozen(frozen: &Frozen, spec: ChildSpec) -> Result<Vm> {
        let t0 = Instant::now();
        let m = &frozen.machine;
        let shell_spec = ShellSpec {
            kvm_device: frozen.config.kvm_device.clone(),
            mem_bytes: m.mem_bytes,
            vcpus: m.vcpus,
            dirty_log: true,
        };
        let shell = match spec.shell {
            Some(s) if s.spec == shell_spec => s,
            _ => Shell::create(&shell_spec)?,
        };
        let Shell {
            vcpus: vcpu_fds,
            vm_fd,
            reservation,
            kvm: kvm_sys,
            cpuids,
            mut spares,
            ..
        } = shell;
        let ram = GuestRam::forked(reservation, Arc::clone(&frozen.image))?;
        ram.clear_vmm_dirty();
        let vsock = match (&m.vsock, &spec.vsock_path) {
            (Some(_), Some(p)) => Some(VsockConfig {
                uds_path: p.clone(),
                guest_cid: spec.guest_cid,
            }),
            (Some(_), None) => {
                return Err(Error::Config(
                    "the forked VM has a vsock device: its child needs a socket path".into(),
                ))
            }
            (None, _) => None,
        };
        let disk = match (&frozen.disk, &spec.disk_path) {
            (None, _) => None,
            (Some(d), _) if d.read_only => Some(BlockConfig {
                path: d.layer.clone(),
                read_only: true,
                serial: d.serial.clone(),
            }),
            (Some(d), Some(p)) => Some(BlockConfig {
                path: p.clone(),
                read_only: false,
                serial: d.serial.clone(),
            }),
            (Some(_), None) => {
                return Err(Error::Config(
                    "the forked VM has a disk: its child needs an overlay path".into(),
                ))
            }
        };
        let (events_tx, events) = mpsc::channel();
        let exit = exit_notifier(&events_tx);
        let devices = DeviceManager::restore(
            &vm_fd,
            &ram.mem,
            &spec.serial,
            vsock.as_ref(),
            disk.as_ref(),
            &frozen.devices,
            exit,
            spare::runner_from(&mut spares),
        )?;
        kvm_state::restore_vm(&vm_fd, &frozen.vm)?;
        for (i, (fd, s)) in vcpu_fds.iter().zip(&frozen.vcpus).enumerate() {
            let current = cpuids.get(i).map(|c| &c[..]);
            let refused = kvm_state::restore_vcpu(fd, s, current).map_err(|e| Error::Vcpu {
                index: i,
                reason: format!("restoring its state: {e}"),
            })?;
            if !refused.is_empty() {
                tracing::warn!("fork child vcpu{i}: KVM refused to restore MSRs {refused:#x?}");
            }
            if let Some(vif) = m.pvm_vif_base {
                if !kvm::register_pvm_vif(fd, vif + i as u64 * 0x1000)? {
                    return Err(Error::Snapshot(
                        "the PVM virtual-interrupt cell cannot be registered".into(),
                    ));
                }
            }
        }
        let config = VmConfig {
            serial: spec.serial.clone(),
            vsock,
            disk: disk.clone(),
            initrd: None,
            ..frozen.config.clone()
        };
        let mut vm = Vm {
            vcpus: Vec::new(),
            pending_vcpus: vcpu_fds,
            devices,
            events,
            events_tx,
            page_server: None,
            vm_fd,
            ram,
            _kvm: kvm_sys,
            config,
            pvm_native: m.pvm_vif_base.is_some(),
            created_at: t0,
            state: Vm::initial_state(),
            exit: None,
            lineage: None,
            resume_report: None,
            working_set_saved: true,
            dirty_tracking: true,
            agent_sync: None,
            vcpu_cpus: spec.vcpu_cpus,
            cpuids: frozen.vcpus.iter().map(|v| v.cpuid.clone()).collect(),
            spares,
            fork_carry: Vec::new(),
        };
        if spec.start {
            vm.start()?;
        }
        vm.devices.finish_restore()?;
        if let (Some(timeout), Some(v)) = (spec.agent_sync, &vm.config.vsock) {
            let path = v.uds_path.clone();
            let suffix = spec.hostname_suffix;
            let (tx, rx) = mpsc::sync_channel(1);
            std::thread::Builder::new()
                .name("fork-sync".into())
                .spawn(move || {
                    let _ = tx.send(fork_sync(&path, timeout, &suffix));
                })
                .map_err(|source| Error::Io {
                    context: "spawning the agent sync thread",
                    source,
                })?;
            vm.agent_sync = Some(rx);
        }
        tracing::debug!("fork child built in {:?}", t0.elapsed());
        Ok(vm)
    }

    /// Host memory this VM's guest RAM uses, as its proportional set size in KiB (pages
    /// shared with other VMs count in part), from `/proc/self/smaps`.
    pub fn memory_pss_kib(&self) -> Result<u64> {
        let start = self.ram.image_addr();
        let end = start + self.ram.mem_bytes() as usize;
        pss_kib(start, end)
    }
}

/// PSS in KiB of this process's mappings inside `start..end`.
pub fn pss_kib(start: usize, end: usize) -> Result<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").map_err(|source| Error::Io {
        context: "reading /proc/self/smaps",
        source,
    })?;
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a >= start && b <= end;
                continue;
            }
        }
        if inside {
            if let Some(v) = line.strip_prefix("Pss:") {
                total += v
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0);
            }
        }
    }
    Ok(total)
}

/// One child of a fork: its identity and how it starts.
#[derive(Debug)]
pub struct ChildSpec {
    /// Its vsock socket (needed when the parent has a vsock device).
    pub vsock_path: Option<PathBuf>,
    /// Its guest CID.
    pub guest_cid: u32,
    /// Its disk overlay (made with [`Frozen::child_overlay`]) when the parent has a
    /// writable disk.
    pub disk_path: Option<PathBuf>,
    /// Its serial output.
    pub serial: SerialOutput,
    /// A pre-built shell.
    pub shell: Option<Shell>,
    /// See [`ForkOptions::agent_sync`].
    pub agent_sync: Option<Duration>,
    /// Appended to the guest's hostname by the agent sync.
    pub hostname_suffix: String,
    /// Start the vCPUs.
    pub start: bool,
    /// vCPU pinning.
    pub vcpu_cpus: Vec<usize>,
}

/// The agent sync of a resume (clock, entropy), then the hostname suffix.
fn fork_sync(
    path: &std::path::Path,
    timeout: Duration,
    suffix: &str,
) -> std::result::Result<Duration, String> {
    let t = Instant::now();
    crate::persist::agent_sync(path, timeout)?;
    let r = (|| -> Result<()> {
        let client = crate::agent::Client::connect_timeout(
            path,
            crate::agent::Transport::Vsock {
                port: crate::agent::AGENT_VSOCK_PORT,
            },
            timeout,
        )?;
        // Through /proc: hostname(1) may refuse names it finds invalid, e.g. "(none)-f1".
        let script = format!(
            "h=$(cat /proc/sys/kernel/hostname); case \"$h\" in ''|'(none)') h=clade;; esac; \
             echo \"$h{suffix}\" > /proc/sys/kernel/hostname"
        );
        let cmd = crate::agent::Command::new("/bin/sh").args(["-c", &script]);
        client.output(&cmd, None)?;
        Ok(())
    })();
    match r {
        Ok(()) => Ok(t.elapsed()),
        Err(e) => {
            tracing::warn!("fork: setting the hostname suffix failed (best effort): {e}");
            Err(e.to_string())
        }
    }
}

/// The parts of a [`VmConfig`] a child process of a fork needs (the rest is its own).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct HandoffConfig {
    vcpus: u32,
    mem_mib: u64,
    kernel: PathBuf,
    cmdline: String,
    test_device: bool,
    kvm_device: PathBuf,
}

/// A [`Frozen`] instant as bytes, for a child in another process; the memory layers' files
/// travel separately (see [`Frozen::handoff`]).
#[derive(serde::Serialize, serde::Deserialize)]
struct Handoff {
    machine: MachineState,
    vm: VmKvmState,
    vcpus: Vec<VcpuState>,
    devices: DevicesState,
    config: HandoffConfig,
    /// Each memory layer's runs, base first, in the order of the files.
    layers: Vec<Vec<(u64, u64)>>,
    disk: Option<FrozenDisk>,
}

impl Frozen {
    /// This frozen instant for a child in another process: the state as bytes, and the
    /// memory layers' files (base first) the child must receive, in this order, to call
    /// [`Frozen::from_handoff`].
    pub fn handoff(&self) -> Result<(Vec<u8>, Vec<&std::fs::File>)> {
        let files: Vec<&std::fs::File> = self.image.parts().map(|(f, _)| f).collect();
        let layers: Vec<Vec<(u64, u64)>> =
            self.image.parts().map(|(_, runs)| runs.to_vec()).collect();
        let c = &self.config;
        let h = Handoff {
            machine: self.machine.clone(),
            vm: self.vm.clone(),
            vcpus: self.vcpus.iter().map(clone_vcpu).collect::<Result<_>>()?,
            devices: self.devices.clone(),
            config: HandoffConfig {
                vcpus: c.vcpus,
                mem_mib: c.mem_mib,
                kernel: c.kernel.clone(),
                cmdline: c.cmdline.clone(),
                test_device: c.test_device,
                kvm_device: c.kvm_device.clone(),
            },
            layers,
            disk: self.disk.clone(),
        };
        let bytes = postcard::to_allocvec(&h)
            .map_err(|e| Error::Snapshot(format!("encoding the fork handoff: {e}")))?;
        Ok((bytes, files))
    }

    /// The frozen instant another process handed over ([`Frozen::handoff`]): its bytes and
    /// the memory layers' files in the same order.
    pub fn from_handoff(bytes: &[u8], files: Vec<std::fs::File>) -> Result<Frozen> {
        let h: Handoff = postcard::from_bytes(bytes)
            .map_err(|e| Error::Snapshot(format!("decoding the fork handoff: {e}")))?;
        if h.layers.len() != files.len() {
            return Err(Error::Snapshot(format!(
                "fork handoff: {} memory layers but {} files",
                h.layers.len(),
                files.len()
            )));
        }
        let image = FrozenImage::from_parts(
            files.into_iter().zip(h.layers).collect(),
            h.machine.mem_bytes,
        )?;
        let c = h.config;
        let mut config = VmConfig::new(c.kernel);
        config.vcpus = c.vcpus;
        config.mem_mib = c.mem_mib;
        config.cmdline = c.cmdline;
        config.test_device = c.test_device;
        config.kvm_device = c.kvm_device;
        config.vsock = h.machine.vsock.as_ref().map(|v| VsockConfig {
            uds_path: v.uds_path.clone(),
            guest_cid: v.guest_cid,
        });
        Ok(Frozen {
            image: Arc::new(image),
            machine: h.machine,
            vm: h.vm,
            vcpus: h.vcpus,
            devices: h.devices,
            config,
            disk: h.disk,
        })
    }
}

impl Frozen {
    /// Makes a child's own overlay at `path` on the frozen disk layer (only for a writable
    /// disk; a read-only one is shared as it is).
    pub fn child_overlay(&self, path: &std::path::Path) -> Result<()> {
        let Some(d) = self.disk.as_ref().filter(|d| !d.read_only) else {
            return Ok(());
        };
        disk::ops::create(
            path,
            &disk::ops::CreateOptions {
                parent: Some(d.layer.clone()),
                ..Default::default()
            },
        )?;
        Ok(())
    }
}

/// `p` resolved to an absolute path (as it is when it cannot be).
fn absolute(p: PathBuf) -> PathBuf {
    p.canonicalize().unwrap_or(p)
}

/// A new layer's path next to `layer`: `<stem>-<tag><k>.cdsk`, a name not taken.
fn sibling_layer(layer: &std::path::Path, tag: &str) -> PathBuf {
    let stem = layer
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "disk".into());
    let dir = layer.parent().unwrap_or(std::path::Path::new("."));
    loop {
        let p = dir.join(format!(
            "{stem}-{tag}{}.cdsk",
            FORK_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        if !p.exists() {
            return p;
        }
    }
}

/// `VcpuState` is not `Clone` (KVM structs); a round trip through its encoding copies it.
fn clone_vcpu(v: &VcpuState) -> Result<VcpuState> {
    let b = postcard::to_allocvec(v)
        .map_err(|e| Error::Snapshot(format!("encoding vCPU state: {e}")))?;
    postcard::from_bytes(&b).map_err(|e| Error::Snapshot(format!("decoding vCPU state: {e}")))
}

/// A guest CID for a fork child: different between processes (from the pid) and between
/// the forks of one process, and never `avoid`.
pub fn process_unique_cid(avoid: u32) -> u32 {
    static CID_SEQ: AtomicU32 = AtomicU32::new(1);
    loop {
        let seq = u64::from(CID_SEQ.fetch_add(1, Ordering::Relaxed));
        let mixed =
            (u64::from(std::process::id()) << 10 | (seq & 0x3ff)) % u64::from(u32::MAX - 2000);
        let c = 1000 + mixed as u32;
        if c != avoid {
            return c;
        }
    }
}

/// The next fork sequence number of this process (names and hostname suffixes).
pub fn next_fork_seq() -> u32 {
    FORK_SEQ.fetch_add(1, Ordering::Relaxed)
}

//! [`Vm`]: one virtual machine, however it was made (booted, restored from a snapshot,
//! forked), and everything done to it while it exists: start, pause and unpause, wait,
//! shut down, save its state.
//!
//! A `Vm` is put together in one place, [`Vm::from_parts`], from the parts the builder
//! prepares for a boot, a restore or a fork child. Snapshot, restore and fork are modules
//! above this one: they call its methods ([`Vm::pause_guard`], [`Vm::save_machine`],
//! [`Vm::take_dirty`], ...) and never reach into it otherwise.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use snapshot::memory_file::MemoryChain;
use snapshot::page_server::{PageServer, PageServerStats};

use crate::config::VmConfig;
use crate::device_manager::{DeviceManager, Prewired};
use crate::error::{Error, Result};
use crate::exit::{VmEvent, VmExit};
use crate::saved::{
    Lineage, MachineState, RestoreReport, SavedDisk, SavedMachine, SavedVsock, Steps,
};
use crate::seccomp::ThreadKind;
use crate::vstate::kvm;
use crate::vstate::memory::{Backing, FrozenImage, GuestMemory, GuestRam, MAX_FROZEN_LAYERS};
use crate::vstate::shell::{Shell, ShellMemory};
use crate::vstate::spare::SpareThread;
use crate::vstate::state::{self as kvm_state, Capabilities};
use crate::vstate::vcpu::VcpuHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunState {
    Built,
    Running,
    Paused,
    Ended,
}

impl RunState {
    fn name(self) -> &'static str {
        match self {
            RunState::Built => "not started",
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Ended => "ended",
        }
    }
}

/// A virtual machine. Dropping it stops the vCPUs and frees everything.
pub struct Vm {
    // Field order is drop order: vCPU threads stop before devices and the VM fd go, and the VM
    // fd is closed before guest memory is unmapped.
    vcpus: Vec<VcpuHandle>,
    pending_vcpus: Vec<VcpuFd>,
    devices: DeviceManager,
    events: Receiver<VmEvent>,
    events_tx: Sender<VmEvent>,
    /// Serves guest memory on demand after a `uffd` restore (stops before memory goes).
    page_server: Option<PageServer>,
    vm_fd: VmFd,
    ram: GuestRam,
    kvm: Kvm,
    config: VmConfig,
    pvm_native: bool,
    created_at: Instant,
    state: RunState,
    exit: Option<VmExit>,
    /// The snapshot this VM's memory last matched (taken or restored from): the base of the
    /// next diff snapshot.
    lineage: Option<Lineage>,
    /// How the restore that made this VM went.
    restore_report: Option<RestoreReport>,
    /// False while a page server records a working set that was not yet written (or, in
    /// a run that prefetched one, still notes the pages it faults in beyond it).
    working_set_saved: bool,
    /// The memory slots log dirty pages (diff snapshots possible).
    dirty_tracking: bool,
    /// Threads started ahead of time (from a VM shell) for the vCPUs, the device loop, a
    /// page server, a helper. Those left unused stay parked here until the VM ends: a
    /// thread's end unmaps its stack, which interrupts every VM of the process (each
    /// one's KVM is told of the unmap, and the other CPUs flush their TLBs), so not while
    /// a fork's children start.
    spares: Vec<SpareThread>,
    /// The shell's userfaultfd when no page server took it; closed when the VM ends:
    /// closing one walks the process's whole address space under its lock, which in a
    /// process of many VMs (a fork's children) delays every vCPU's page faults.
    #[allow(dead_code)]
    unused_uffd: Option<snapshot::page_server::PreparedUffd>,
    /// The CPUID set on each vCPU (saved in snapshots).
    cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    /// Host CPUs the vCPU threads are pinned to (vCPU `i` on `vcpu_cpus[i % len]`).
    vcpu_cpus: Vec<usize>,
    /// The post-restore agent sync's outcome, once it arrives.
    agent_sync: Option<Receiver<std::result::Result<Duration, String>>>,
    /// Forked memory: the pages written since it was frozen that a snapshot already took
    /// out of the dirty log (the fork module's business).
    fork_carry: Vec<Vec<u64>>,
    /// A pre-built shell of this VM's shape that its next freeze moves it onto, made
    /// ready when it was given ([`Vm::give_shell`]).
    spare_shell: Option<SpareShell>,
    /// See [`Vm::image_ahead`].
    ahead_image: Option<Arc<FrozenImage>>,
    /// The KVM VM and memory mapping the last freeze moved away from, still to be torn
    /// down ([`Vm::unmap_retired_memory`]).
    retired_vm: Option<RetiredVm>,
}

/// A pre-built shell a VM moves onto at its next freeze, made ready when it was given
/// ([`Vm::give_shell`]), so that the freeze's pause does little more than switch over.
struct SpareShell {
    // Field order is drop order: vCPUs, then the VM, then the address space.
    vcpus: Vec<VcpuFd>,
    vm_fd: VmFd,
    memory: ShellMemory,
    cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    spares: Vec<SpareThread>,
    /// The devices wired to `vm_fd`.
    prewired: Prewired,
}

/// What a VM leaves behind when it moves onto a shell ([`Vm::move_onto`]): its former
/// KVM VM, vCPUs and memory mapping. Tearing them down costs in proportion to the memory
/// the guest touched (KVM drops its mappings of every page), so it happens in a thread of
/// its own, at idle priority, once the VM runs again.
struct RetiredVm {
    vcpu_fds: Vec<VcpuFd>,
    vm_fd: VmFd,
    ram: GuestRam,
    spares: Vec<SpareThread>,
}

impl RetiredVm {
    /// After [`crate::vstate::memory::TEARDOWN_GRACE`], closes the KVM VM (KVM drops its
    /// mappings then, not on a later unmap) and then unmaps the memory a few MiB at a
    /// time, in a short-lived thread (here, at once, if none can be started).
    fn tear_down_in_background(self) {
        let tear_down = move || {
            // Only on CPU time nothing else wants: right after a fork the children and the
            // parent need every CPU for their first requests.
            crate::vstate::spare::run_at_idle_priority("tearing down a former KVM VM");
            std::thread::sleep(crate::vstate::memory::TEARDOWN_GRACE);
            let t = Instant::now();
            let RetiredVm {
                vcpu_fds,
                vm_fd,
                ram,
                spares,
            } = self;
            drop(vcpu_fds);
            drop(vm_fd);
            let vm_closed = t.elapsed();
            ram.release_gradually();
            drop(spares);
            tracing::debug!(
                "former KVM VM closed in {vm_closed:?}, its memory mapping released in {:?}",
                t.elapsed() - vm_closed
            );
        };
        // Should no thread start, the closure is dropped with what it holds: torn down
        // here, at once.
        if let Err(e) = std::thread::Builder::new()
            .name("clade-retire".into())
            .spawn(tear_down)
        {
            tracing::warn!("no thread to tear down a former KVM VM ({e}): torn down here");
        }
    }
}

/// Everything a [`Vm`] is made of, prepared by the builder for a boot, a restore or
/// a fork child. Devices are created and the KVM state (boot registers, or saved state)
/// is set; the vCPUs have not run.
pub(crate) struct VmParts {
    pub(crate) vcpu_fds: Vec<VcpuFd>,
    pub(crate) devices: DeviceManager,
    pub(crate) events: (Sender<VmEvent>, Receiver<VmEvent>),
    pub(crate) page_server: Option<PageServer>,
    pub(crate) vm_fd: VmFd,
    pub(crate) ram: GuestRam,
    pub(crate) kvm: Kvm,
    pub(crate) config: VmConfig,
    pub(crate) pvm_native: bool,
    pub(crate) created_at: Instant,
    pub(crate) lineage: Option<Lineage>,
    pub(crate) dirty_tracking: bool,
    pub(crate) spares: Vec<SpareThread>,
    pub(crate) unused_uffd: Option<snapshot::page_server::PreparedUffd>,
    pub(crate) cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    pub(crate) vcpu_cpus: Vec<usize>,
}

/// Returned by [`Vm::pause_guard`]: the vCPUs and device workers stay paused while it
/// lives, and run again when it is dropped (or [`PauseGuard::release`]d), unless the VM was
/// paused before.
pub(crate) struct PauseGuard<'a> {
    vm: &'a mut Vm,
    was_running: bool,
    since: Instant,
    released: bool,
}

impl PauseGuard<'_> {
    /// The paused VM.
    pub(crate) fn vm(&mut self) -> &mut Vm {
        self.vm
    }

    /// Lets the VM run again (if it ran before); returns how long its vCPUs were paused
    /// (zero when it was paused already).
    pub(crate) fn release(mut self) -> Duration {
        self.unpause();
        if self.was_running {
            self.since.elapsed()
        } else {
            Duration::ZERO
        }
    }

    fn unpause(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        self.vm.devices.unpause();
        if self.was_running {
            for v in &self.vm.vcpus {
                v.unpause();
            }
        }
    }
}

impl Drop for PauseGuard<'_> {
    fn drop(&mut self) {
        self.unpause();
    }
}

/// The step a freeze records when the VM moved onto its spare shell ([`Vm::give_shell`]):
/// how a fork's or a snapshot's report says the VM moved.
pub const MOVED_STEP: &str = "move";

/// Whether a freeze's report `steps` (a fork's or a snapshot's) say the VM moved onto its
/// spare shell.
pub fn moved(steps: &[(&'static str, Duration)]) -> bool {
    steps.iter().any(|(s, _)| *s == MOVED_STEP)
}

/// How often a wait looks at the page server (a failed one sends no event).
const PAGE_SERVER_CHECK: Duration = Duration::from_millis(200);

/// How [`Vm::freeze_memory`] freezes this VM's memory ([`Vm::freeze_plan`]).
pub(crate) enum FreezePlan {
    /// Its own memory (a memfd, or a frozen image plus the pages written since).
    InPlace,
    /// On the snapshot it was restored from (or last took): its memory files.
    OnSnapshot(MemoryChain),
}

impl Vm {
    /// The one place a `Vm` is put together (boot, restore and fork all come here).
    pub(crate) fn from_parts(p: VmParts) -> Vm {
        let served = p.page_server.is_some();
        Vm {
            vcpus: Vec::new(),
            pending_vcpus: p.vcpu_fds,
            devices: p.devices,
            events_tx: p.events.0,
            events: p.events.1,
            page_server: p.page_server,
            vm_fd: p.vm_fd,
            ram: p.ram,
            kvm: p.kvm,
            config: p.config,
            pvm_native: p.pvm_native,
            created_at: p.created_at,
            state: RunState::Built,
            exit: None,
            lineage: p.lineage,
            restore_report: None,
            working_set_saved: !served,
            dirty_tracking: p.dirty_tracking,
            spares: p.spares,
            unused_uffd: p.unused_uffd,
            cpuids: p.cpuids,
            vcpu_cpus: p.vcpu_cpus,
            agent_sync: None,
            fork_carry: Vec::new(),
            spare_shell: None,
            ahead_image: None,
            retired_vm: None,
        }
    }

    fn invalid(&self, op: &'static str) -> Error {
        Error::InvalidState {
            state: self.state.name(),
            op,
        }
    }

    /// Starts one thread per vCPU.
    pub fn start(&mut self) -> Result<()> {
        if self.state != RunState::Built {
            return Err(self.invalid("start"));
        }
        let buses = self.devices.buses();
        for (index, fd) in self.pending_vcpus.drain(..).enumerate() {
            let cpu =
                (!self.vcpu_cpus.is_empty()).then(|| self.vcpu_cpus[index % self.vcpu_cpus.len()]);
            let runner =
                crate::vstate::spare::runner_for_on(&mut self.spares, ThreadKind::Vcpu, cpu);
            let handle = VcpuHandle::spawn(
                index,
                fd,
                buses.clone(),
                self.events_tx.clone(),
                cpu,
                runner,
            )?;
            self.vcpus.push(handle);
        }
        self.state = RunState::Running;
        Ok(())
    }

    /// Pins the vCPU threads to host CPUs (vCPU `i` on `cpus[i % cpus.len()]`; empty: no
    /// pinning). Only before [`Vm::start`]. Worth it when a guest busy-polls on a host
    /// with few CPUs: the VMM's threads then never wait behind a spinning vCPU.
    pub fn pin_vcpus(&mut self, cpus: Vec<usize>) -> Result<()> {
        if self.state != RunState::Built {
            return Err(self.invalid("pin vCPUs"));
        }
        self.vcpu_cpus = cpus;
        Ok(())
    }

    /// Lets every vCPU thread run on any CPU the calling thread may run on, lifting the
    /// pins [`Vm::pin_vcpus`] (or a restore's `vcpu_cpus`) gave them; later starts pin
    /// nothing. A pin that cannot be lifted is logged: the VM runs on, pinned.
    pub fn unpin_vcpus(&mut self) {
        self.vcpu_cpus.clear();
        let cpus = match crate::vstate::vcpu::current_thread_cpus() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("vCPU threads stay pinned: reading this thread's CPUs: {e}");
                return;
            }
        };
        for (i, v) in self.vcpus.iter().enumerate() {
            if let Err(e) = v.unpin(&cpus) {
                tracing::warn!("vcpu{i} stays pinned: {e}");
            }
        }
    }

    /// Stops all vCPUs from running guest code; guest memory and devices stay as they are.
    pub fn pause(&mut self) -> Result<()> {
        self.poll_exit();
        if self.state != RunState::Running {
            return Err(self.invalid("pause"));
        }
        for v in &self.vcpus {
            v.pause();
        }
        self.state = RunState::Paused;
        Ok(())
    }

    /// Lets paused vCPUs run again. (Not to be confused with restoring, which makes a new
    /// VM from a snapshot.)
    pub fn unpause(&mut self) -> Result<()> {
        if self.state != RunState::Paused {
            return Err(self.invalid("unpause"));
        }
        for v in &self.vcpus {
            v.unpause();
        }
        self.state = RunState::Running;
        Ok(())
    }

    fn finish(&mut self, status: VmExit) -> VmExit {
        self.stop_vcpus();
        self.state = RunState::Ended;
        tracing::info!("VM ended: {status}");
        self.finish_working_set();
        self.exit.get_or_insert(status).clone()
    }

    /// Stops the vCPU threads. One blocked on a page a failed page server never served
    /// would never stop: the server is detached first then (the kernel fills what was
    /// never served with zeros; the VM is ending, its memory is kept nowhere).
    fn stop_vcpus(&mut self) {
        if self.page_server_failure().is_some() {
            if let Some(ps) = self.page_server.take() {
                if let Err(e) = ps.stop(snapshot::page_server::StopMode::Detach) {
                    tracing::debug!("failed page server detached: {e}");
                }
                // Its working set is that of a failed run: not kept.
                self.working_set_saved = true;
            }
        }
        for v in &mut self.vcpus {
            v.stop();
        }
    }

    /// A page-server failure leaves a vCPU blocked on a page forever: end the VM.
    fn page_server_failure(&self) -> Option<VmExit> {
        let e = self.page_server.as_ref()?.error()?;
        Some(VmExit::Crashed(format!(
            "guest memory could not be served: {e}"
        )))
    }

    pub(crate) fn poll_exit(&mut self) {
        if self.state == RunState::Ended {
            return;
        }
        if let Ok(VmEvent::Exit(status)) = self.events.try_recv() {
            self.finish(status);
        } else if let Some(status) = self.page_server_failure() {
            self.finish(status);
        }
    }

    /// Blocks until the VM ends and returns how it ended.
    pub fn wait(&mut self) -> Result<VmExit> {
        loop {
            if let Some(status) = self.wait_timeout(Duration::from_secs(3600))? {
                return Ok(status);
            }
        }
    }

    /// Like [`Vm::wait`], but gives up after `timeout` (returns `None`, VM still running).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<VmExit>> {
        if let Some(s) = &self.exit {
            return Ok(Some(s.clone()));
        }
        if self.state == RunState::Built {
            return Err(self.invalid("wait"));
        }
        let deadline = Instant::now() + timeout;
        loop {
            // A page server that fails sends no event: looked at between slices.
            if let Some(status) = self.page_server_failure() {
                return Ok(Some(self.finish(status)));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left.min(PAGE_SERVER_CHECK)) {
                Ok(VmEvent::Exit(status)) => return Ok(Some(self.finish(status))),
                Err(RecvTimeoutError::Timeout) if left <= PAGE_SERVER_CHECK => return Ok(None),
                Err(RecvTimeoutError::Timeout) => {}
                // We hold a sender ourselves, so this cannot happen; treat it as a stop.
                Err(RecvTimeoutError::Disconnected) => {
                    return Ok(Some(self.finish(VmExit::Stopped)))
                }
            }
        }
    }

    /// Stops the VM now, whatever the guest is doing. Returns how it ended (a guest-requested
    /// exit that raced with this call wins).
    pub fn shutdown(&mut self) -> VmExit {
        if let Some(s) = &self.exit {
            return s.clone();
        }
        self.poll_exit();
        if let Some(s) = &self.exit {
            return s.clone();
        }
        self.finish(VmExit::Stopped)
    }

    /// The configuration this VM was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The virtio-blk device's disk (its current chain), if the VM has one.
    pub fn disk(&self) -> Option<std::sync::Arc<std::sync::Mutex<disk::Disk>>> {
        self.devices.disk()
    }

    /// Guest memory. (Clones of it must not outlive the VM, nor be kept across a fork or a
    /// snapshot of it: the memory is unmapped when the VM is dropped, and a VM that moves
    /// onto its spare shell at a freeze leaves this mapping behind, to be unmapped.)
    pub fn memory(&self) -> &GuestMemory {
        &self.ram.mem
    }

    /// Reads guest memory at guest-physical `addr` (the VM may run: for inspection).
    pub fn read_guest(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        use vm_memory::Bytes;
        self.ram
            .mem
            .read_slice(buf, vm_memory::GuestAddress(addr))
            .map_err(|e| Error::Memory(format!("reading guest memory at {addr:#x}: {e}")))
    }

    /// Writes guest memory at guest-physical `addr` (the VMM's own write: a mailbox for the
    /// guest, tests).
    pub fn write_guest(&self, addr: u64, data: &[u8]) -> Result<()> {
        use vm_memory::Bytes;
        self.ram
            .mem
            .write_slice(data, vm_memory::GuestAddress(addr))
            .map_err(|e| Error::Memory(format!("writing guest memory at {addr:#x}: {e}")))
    }

    /// The VM's state: "not started", "running", "paused" or "ended".
    pub fn state_name(&self) -> &'static str {
        self.state.name()
    }

    /// Whether it was started and has not ended (running or paused).
    pub(crate) fn is_live(&self) -> bool {
        matches!(self.state, RunState::Running | RunState::Paused)
    }

    /// Whether its vCPUs run (started, not paused, not ended).
    pub(crate) fn is_running(&self) -> bool {
        self.state == RunState::Running
    }

    /// The page server's counters, when the VM was restored with the `uffd` backend and the
    /// server still runs.
    pub fn page_server_stats(&self) -> Option<PageServerStats> {
        self.page_server.as_ref().map(|p| p.stats())
    }

    /// The snapshot this VM's memory last matched (the last one it took, or the one it
    /// was restored from): the base of its next diff snapshot.
    pub fn last_snapshot(&self) -> Option<&Lineage> {
        self.lineage.as_ref()
    }

    /// How the restore that made this VM went (None for a booted or forked VM).
    pub fn restore_report(&self) -> Option<&RestoreReport> {
        self.restore_report.as_ref()
    }

    /// Writes the working set the page server recorded since the restore (the pages the
    /// guest touched, in order) next to the snapshot, so that later restores prefetch it.
    /// Call it once the guest has served its first request; a VM that never calls it saves
    /// everything it touched when it ends. A VM restored with a working set writes none:
    /// the pages it faulted in beyond it until now go into its next snapshot's
    /// ([`PageServer::first_touches`]). Returns the pages written (None: not recording).
    pub fn save_working_set(&mut self) -> Result<Option<usize>> {
        let Some(ps) = &self.page_server else {
            return Ok(None);
        };
        if self.working_set_saved {
            return Ok(None);
        }
        let n = ps
            .save_working_set()
            .map_err(|e| Error::Snapshot(format!("saving the working set: {e}")))?;
        self.working_set_saved = true;
        if let Some(n) = n {
            tracing::info!("working set saved: {n} pages");
        }
        Ok(n)
    }

    /// The outcome of the agent sync a restore started ([`crate::RestoreOptions::agent_sync`]):
    /// `Some` once, when it has finished (with how long it took, or why it failed).
    pub fn agent_sync_done(&mut self) -> Option<std::result::Result<Duration, String>> {
        let r = self.agent_sync.as_ref()?.try_recv();
        match r {
            Ok(r) => {
                self.agent_sync = None;
                Some(r)
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => None,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                self.agent_sync = None;
                Some(Err("the agent sync thread ended without an answer".into()))
            }
        }
    }

    fn finish_working_set(&mut self) {
        if !self.working_set_saved {
            if let Err(e) = self.save_working_set() {
                tracing::warn!("{e}");
            }
        }
    }

    /// True when this host's PVM hypervisor runs the guest natively through the VIF cell.
    pub fn pvm_native(&self) -> bool {
        self.pvm_native
    }

    /// Serial output so far, when the config asked for [`crate::SerialOutput::Memory`].
    pub fn serial_output(&self) -> Option<Vec<u8>> {
        self.devices
            .serial_tap()
            .buffer
            .as_ref()
            .map(|b| b.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Time from the start of [`Vm::new`] to the guest's first serial byte.
    pub fn time_to_first_output(&self) -> Option<Duration> {
        self.devices
            .serial_tap()
            .first_byte
            .get()
            .map(|t| t.duration_since(self.created_at))
    }

    /// Fails unless the VM runs or is paused (`op` names the operation in the error).
    pub(crate) fn check_live(&mut self, op: &'static str) -> Result<()> {
        self.poll_exit();
        if matches!(self.state, RunState::Running | RunState::Paused) {
            Ok(())
        } else {
            Err(self.invalid(op))
        }
    }

    /// Pauses the vCPUs (if they run) and the device workers until the guard is dropped:
    /// guest memory and device state hold still meanwhile. A VM that ended cannot be
    /// paused (`op` names the operation in that error).
    pub(crate) fn pause_guard(&mut self, op: &'static str) -> Result<PauseGuard<'_>> {
        self.check_live(op)?;
        let was_running = self.state == RunState::Running;
        let since = Instant::now();
        if was_running {
            for v in &self.vcpus {
                v.pause();
            }
        }
        self.devices.pause();
        Ok(PauseGuard {
            vm: self,
            was_running,
            since,
            released: false,
        })
    }

    /// The shell a child of this VM's fork is built in (the shape [`Frozen::child`] asks
    /// for: this VM's memory and vCPUs, dirty pages logged), so one can be built ahead.
    ///
    /// [`Frozen::child`]: crate::fork::Frozen::child
    pub fn child_shell_spec(&self) -> crate::vstate::shell::ShellSpec {
        crate::vstate::shell::ShellSpec {
            kvm_device: self.config.kvm_device.clone(),
            mem_bytes: self.ram.mem_bytes(),
            vcpus: self.config.vcpus,
            dirty_log: true,
        }
    }

    /// The machine's shape, as VMs built from its saved state need it.
    fn machine_state(&self) -> MachineState {
        MachineState {
            vcpus: self.config.vcpus,
            mem_bytes: self.ram.mem_bytes(),
            pvm_vif_base: self.pvm_native.then_some(crate::arch::layout::PVM_VIF_BASE),
            vsock: self.config.vsock.as_ref().map(|v| SavedVsock {
                uds_path: v.uds_path.clone(),
                guest_cid: v.guest_cid,
            }),
            kernel: self.config.kernel.clone(),
            cmdline: self.config.cmdline.clone(),
        }
    }

    /// Everything but memory and disk, at this instant: vCPUs (each read on its own
    /// thread), VM, devices. The disk is the caller's to freeze ([`Vm::freeze_disk`]) once
    /// the memory is safe, so that a failed snapshot or fork does not grow the disk's
    /// layer chain. Call through a [`PauseGuard`].
    pub(crate) fn save_machine(&mut self, steps: &mut Steps) -> Result<SavedMachine> {
        if !self.devices.is_paused() {
            return Err(Error::Snapshot(
                "the VM must be paused for its state to be saved".into(),
            ));
        }
        let caps = Capabilities::probe(&self.kvm)?;
        let jobs = self
            .vcpus
            .iter()
            .zip(&self.cpuids)
            .map(|(v, cpuid)| {
                let caps = caps.clone();
                let cpuid = cpuid.clone();
                v.submit(move |fd| kvm_state::save_vcpu(fd, &caps, cpuid))
            })
            .collect::<Result<Vec<_>>>()?;
        let vcpus = jobs
            .into_iter()
            .zip(&self.vcpus)
            .map(|(rx, v)| v.wait_job(rx)?)
            .collect::<Result<Vec<_>>>()?;
        steps.done("save_vcpus");
        let vm = kvm_state::save_vm(&self.vm_fd)?;
        let devices = self.devices.save()?;
        steps.done("save_vm_devices");
        Ok(SavedMachine {
            machine: self.machine_state(),
            vm,
            vcpus,
            devices,
            disk: None,
        })
    }

    /// The disk's half of a saved machine (vCPUs and devices paused): the top layer is
    /// flushed and frozen, and the VM continues on a new overlay next to it
    /// (`<name>-<tag><k>.cdsk`); a read-only disk stays as it is.
    pub(crate) fn freeze_disk(
        &mut self,
        tag: &str,
        steps: &mut Steps,
    ) -> Result<Option<SavedDisk>> {
        let disk = self.freeze_disk_layer(tag)?;
        if let Some(d) = &disk {
            tracing::debug!("disk layer {} frozen", d.layer.display());
            steps.done("freeze_disk");
        }
        Ok(disk)
    }

    /// Freezes the disk's top layer as it is now (the vCPUs stopped meanwhile, then run
    /// again if they ran) and continues on a new overlay on it: what a build step made.
    /// Returns the frozen layer and the new top. Errors: no writable disk, a VM that is
    /// neither running nor paused, I/O.
    pub fn freeze_disk_now(&mut self) -> Result<(PathBuf, PathBuf)> {
        self.poll_exit();
        let running = match self.state {
            RunState::Running => true,
            RunState::Paused => false,
            _ => return Err(self.invalid("freeze its disk")),
        };
        if self.config.disk.as_ref().is_none_or(|d| d.read_only) {
            return Err(Error::Config(
                "freeze_disk: the VM has no writable disk".into(),
            ));
        }
        if running {
            self.pause()?;
        }
        let frozen = self.freeze_disk_layer("s");
        if running {
            self.unpause()?;
        }
        let d = frozen?.ok_or_else(|| Error::Config("freeze_disk: the VM has no disk".into()))?;
        let top = self
            .config
            .disk
            .as_ref()
            .map(|c| c.path.clone())
            .unwrap_or_default();
        Ok((d.layer, top))
    }

    fn freeze_disk_layer(&mut self, tag: &str) -> Result<Option<SavedDisk>> {
        let (Some(disk), Some(cfg)) = (self.devices.disk(), self.config.disk.clone()) else {
            return Ok(None);
        };
        if cfg.read_only {
            return Ok(Some(SavedDisk {
                layer: absolute(cfg.path),
                read_only: true,
                serial: cfg.serial,
                sources: cfg.sources,
            }));
        }
        let mut d = disk.lock().unwrap_or_else(|e| e.into_inner());
        let new_top = sibling_layer(d.path(), tag);
        let frozen = absolute(d.snapshot(&new_top)?);
        drop(d);
        if let Some(c) = self.config.disk.as_mut() {
            c.path = new_top;
        }
        Ok(Some(SavedDisk {
            layer: frozen,
            read_only: false,
            serial: cfg.serial,
            sources: cfg.sources,
        }))
    }

    /// Freezes guest memory (call paused, with the plan [`Vm::freeze_plan`] made, and its
    /// machine `saved` at this instant) and restarts the dirty log there: the instant a
    /// fork's children and a copy-on-write snapshot are made from. The VM runs on the
    /// returned image, copy-on-write; call [`Vm::unmap_retired_memory`] once it runs again.
    ///
    /// With a spare shell ([`Vm::give_shell`]) the VM moves onto it, mapped from the image
    /// ([`Vm::move_onto`]): the pause then costs the same whatever the guest touched.
    /// Without one (or should the move fail) its memory is mapped again in place
    /// ([`GuestRam::map_frozen`]), and KVM drops its mappings of every touched page in the
    /// pause.
    pub(crate) fn freeze_memory(
        &mut self,
        plan: FreezePlan,
        saved: &SavedMachine,
        steps: &mut Steps,
    ) -> Result<Arc<FrozenImage>> {
        if let FreezePlan::OnSnapshot(chain) = plan {
            return self.freeze_restored_memory(&chain, saved, steps);
        }
        let forked = matches!(self.ram.backing(), Backing::Forked(_));
        // Forked memory: the pages written since it was last frozen make the new layer.
        // A booted VM's memfd is frozen as it is: its dirty bits so far are in the frozen
        // base already, dropped below.
        let dirty = if forked {
            self.take_dirty()?;
            steps.done("dirty_log");
            Some(self.take_fork_carry())
        } else {
            None
        };
        let premapped = if forked {
            None
        } else {
            self.ahead_image.take()
        };
        let now = match premapped {
            Some(image) => Ok((image, true)),
            None => self.ram.image_now(dirty.as_deref()),
        };
        let (image, changed) = match now {
            Ok(i) => i,
            Err(e) => {
                if let Some(d) = dirty {
                    self.return_fork_carry(d);
                }
                return Err(e);
            }
        };
        if !changed {
            return Ok(image);
        }
        if forked {
            steps.done("copy_written");
        }
        if self.try_move(&image, saved, steps) {
            drop(self.take_fork_carry());
            return Ok(image);
        }
        if let Err(e) = self.ram.map_frozen(Arc::clone(&image)) {
            if let Some(d) = dirty {
                self.return_fork_carry(d);
            }
            return Err(e);
        }
        steps.done("freeze_memory");
        if !forked {
            // The dirty log restarts, cheaper after the freeze (KVM has no mapping of the
            // memory left to write-protect). Should reading it fail, the VM still runs on
            // the frozen image (same contents); only the caller's operation fails.
            self.take_dirty()?;
            drop(self.take_fork_carry());
            steps.done("dirty_log");
        }
        Ok(image)
    }

    /// Moves the VM onto its spare shell, if it has one, mapped from `image`; false if
    /// it has none or the move failed (the VM is then as it was; logged).
    fn try_move(
        &mut self,
        image: &Arc<FrozenImage>,
        saved: &SavedMachine,
        steps: &mut Steps,
    ) -> bool {
        let Some(shell) = self.spare_shell.take() else {
            return false;
        };
        match self.move_onto(shell, image, saved, steps) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("moving the VM onto its spare shell failed ({e}): its memory is frozen in place");
                false
            }
        }
    }

    /// The image a booted VM's next freeze takes, its memfd as it is: made once, when
    /// memory is first mapped ahead for it ([`Vm::map_ahead`]), so that every mapping
    /// made ahead (its spare shell's, children's shells') is of this very image, which
    /// the freeze then takes. `None` for memory of another kind.
    fn image_ahead(&mut self) -> Result<Option<Arc<FrozenImage>>> {
        if !matches!(self.ram.backing(), Backing::Memfd(_)) {
            return Ok(None);
        }
        if self.ahead_image.is_none() {
            self.ahead_image = Some(self.ram.image_now(None)?.0);
        }
        Ok(self.ahead_image.clone())
    }

    /// `memory` with this VM's next frozen image mapped over it where that image is known
    /// before the freeze (a booted VM's memfd; [`ShellMemory::Mapped`]); as it is for any
    /// other VM, whose image the freeze makes.
    fn map_ahead(&mut self, memory: ShellMemory) -> Result<ShellMemory> {
        let Some(image) = self.image_ahead()? else {
            return Ok(memory);
        };
        if memory
            .mapped_image()
            .is_some_and(|m| Arc::ptr_eq(m, &image))
        {
            return Ok(memory);
        }
        let ram = GuestRam::forked(memory.into_reservation()?, Arc::clone(&image))?;
        Ok(ShellMemory::Mapped(ram, image))
    }

    /// Makes `shell` (of this VM's shape, [`Vm::child_shell_spec`]) ready for a child of
    /// this VM's next fork: a booted VM's memory is mapped into it now, off the fork's
    /// path (~85 us per GiB of KVM walking the shell's memory slot, plus the mapping, that
    /// the child's build then skips); for any other VM it is returned as it is. A shell
    /// that a later fork's child gets, whose image is no longer the one mapped, has it
    /// replaced then.
    pub fn map_into_shell(&mut self, mut shell: Shell) -> Result<Shell> {
        let want = self.child_shell_spec();
        if *shell.spec() != want {
            return Err(Error::Config(format!(
                "a shell for {:?}, but a child of this VM needs {want:?}",
                shell.spec()
            )));
        }
        shell.memory = self.map_ahead(shell.memory)?;
        Ok(shell)
    }

    /// Moves this paused VM onto `shell`, a new KVM VM whose memory is `image` mapped
    /// private at a new address: the vCPUs' state (`saved`) and the in-kernel irqchip,
    /// PIT and clock are set there, the devices' interrupt lines switch to the eventfds
    /// registered there when the shell was given, the devices use the new mapping, and
    /// each vCPU thread runs the new VM's vCPU from now on. The
    /// devices themselves (with their host ends: sockets, connections, disk, TAP) and the
    /// threads stay, so the VM stays the same to whoever uses it.
    ///
    /// The former KVM VM and mapping are kept aside ([`RetiredVm`]), to be torn down
    /// once the VM runs again: nothing here costs in proportion to the memory the guest
    /// touched. Afterwards the guest faults in each page again on its first touch (a read
    /// maps the frozen page, a write copies it). On an error the VM is as it was: nothing
    /// changes it before the last, infallible step.
    fn move_onto(
        &mut self,
        shell: SpareShell,
        image: &Arc<FrozenImage>,
        saved: &SavedMachine,
        steps: &mut Steps,
    ) -> Result<()> {
        let SpareShell {
            vcpus: vcpu_fds,
            vm_fd,
            memory,
            cpuids,
            spares,
            prewired,
        } = shell;
        let ram = memory.forked(image)?;
        ram.clear_vmm_dirty();
        steps.done("map_memory");
        kvm_state::restore_vm(&vm_fd, &saved.vm)?;
        // The last step that can fail.
        kvm_state::restore_vcpus(&vcpu_fds, &saved.vcpus, &cpuids, saved.machine.pvm_vif_base)?;
        steps.done("vcpu_state");
        // From here on nothing fails: the VM becomes the new one.
        self.devices.switch_irqs(prewired);
        self.devices.replace_memory(&ram.mem);
        let old_vcpu_fds = if self.vcpus.is_empty() {
            std::mem::replace(&mut self.pending_vcpus, vcpu_fds)
        } else {
            self.swap_vcpu_fds(vcpu_fds)
        };
        let old_vm_fd = std::mem::replace(&mut self.vm_fd, vm_fd);
        let old_ram = std::mem::replace(&mut self.ram, ram);
        self.retired_vm = Some(RetiredVm {
            vcpu_fds: old_vcpu_fds,
            vm_fd: old_vm_fd,
            ram: old_ram,
            spares,
        });
        steps.done(MOVED_STEP);
        Ok(())
    }

    /// Each paused vCPU thread runs `fds[i]` from now on; returns the fds they ran.
    fn swap_vcpu_fds(&mut self, fds: Vec<VcpuFd>) -> Vec<VcpuFd> {
        let jobs: Vec<_> = self
            .vcpus
            .iter()
            .zip(fds)
            .map(|(h, fd)| h.submit(move |v: &mut VcpuFd| std::mem::replace(v, fd)))
            .collect();
        let mut old = Vec::with_capacity(jobs.len());
        for (h, job) in self.vcpus.iter().zip(jobs) {
            // A vCPU thread of a paused VM runs its jobs; one that ended has no vCPU
            // left to swap (its VM is ending anyway).
            match job.and_then(|rx| h.wait_job(rx)) {
                Ok(fd) => old.push(fd),
                Err(e) => tracing::error!("moving a vCPU to the new VM: {e}"),
            }
        }
        old
    }

    /// Gives this VM a pre-built shell of its shape ([`Vm::child_shell_spec`]) to move
    /// onto at its next freeze (a fork, a copy-on-write snapshot), so that the freeze does
    /// not pause the guest while KVM drops its mappings of the memory (see
    /// [`crate::fork`]). The devices are wired to the shell here, outside any pause, and
    /// a booted VM's memory is mapped there (`Vm::map_ahead`). A freeze uses the
    /// shell up: give another one after it ([`Vm::has_spare_shell`]). Refused for a shell
    /// of another shape, or one the devices cannot be wired to or the memory not mapped
    /// over.
    pub fn give_shell(&mut self, shell: Shell) -> Result<()> {
        let want = self.child_shell_spec();
        if *shell.spec() != want {
            return Err(Error::Config(format!(
                "a spare shell for {:?}, but this VM needs {want:?}",
                shell.spec()
            )));
        }
        let Shell {
            vcpus,
            vm_fd,
            memory,
            cpuids,
            spares,
            ..
        } = shell;
        let prewired = self.devices.prewire(&vm_fd)?;
        let memory = self.map_ahead(memory)?;
        self.spare_shell = Some(SpareShell {
            vcpus,
            vm_fd,
            memory,
            cpuids,
            spares,
            prewired,
        });
        Ok(())
    }

    /// Whether the VM holds a spare shell for its next freeze ([`Vm::give_shell`]).
    pub fn has_spare_shell(&self) -> bool {
        self.spare_shell.is_some()
    }

    /// Whether [`Vm::freeze_memory`] can freeze this VM's memory, and how (why not, as the
    /// error). Memory restored from a snapshot needs that snapshot's files: they are
    /// opened here, before any pause.
    pub(crate) fn freeze_plan(&self) -> Result<FreezePlan> {
        if !self.dirty_tracking {
            return Err(Error::Snapshot(
                "this VM runs without dirty page tracking: its memory cannot be frozen (fork, \
                 copy-on-write snapshot)"
                    .into(),
            ));
        }
        match self.ram.backing() {
            Backing::Memfd(_) => Ok(FreezePlan::InPlace),
            Backing::Forked(image) if image.layers() < MAX_FROZEN_LAYERS => Ok(FreezePlan::InPlace),
            Backing::Forked(_) => Err(Error::Snapshot(format!(
                "this VM's memory has {MAX_FROZEN_LAYERS} layers from earlier forks and \
                 snapshots: take a full snapshot and restore it with the copy backend to \
                 start a new line"
            ))),
            Backing::Anonymous | Backing::FilePrivate => {
                let Some(lineage) = &self.lineage else {
                    return Err(Error::Snapshot(
                        "this VM's memory comes from a snapshot that cannot be the base of a \
                         diff (fetched from a store, or which pages were written since is no \
                         longer known: a fork or a failed snapshot consumed the dirty log): \
                         take a full snapshot and restore it to fork"
                            .into(),
                    ));
                };
                if let Some(removed) = self
                    .page_server
                    .as_ref()
                    .map(|ps| ps.stats().pages_removed)
                    .filter(|&n| n > 0)
                {
                    return Err(Error::Snapshot(format!(
                        "{removed} pages of this VM's memory were discarded since its restore: \
                         its snapshot no longer describes them; take a full snapshot and \
                         restore it to fork"
                    )));
                }
                Ok(FreezePlan::OnSnapshot(lineage.memory_chain()?))
            }
        }
    }

    /// [`Vm::freeze_memory`] of memory restored from a snapshot (`uffd`, `file`): the
    /// snapshot it matched ([`Vm::last_snapshot`], its files `chain`) and the pages
    /// written since.
    fn freeze_restored_memory(
        &mut self,
        chain: &MemoryChain,
        saved: &SavedMachine,
        steps: &mut Steps,
    ) -> Result<Arc<FrozenImage>> {
        let dirty = self.take_dirty()?;
        steps.done("dirty_log");
        let layers = match self.ram.restored_layers(chain, &dirty) {
            Ok(l) => l,
            Err(e) => {
                // The dirty log was consumed: no diff on the old snapshot any more.
                self.lineage = None;
                return Err(e);
            }
        };
        steps.done("copy_written");
        // From here on the page server's pages come from the layers.
        if let Some(ps) = self.page_server.take() {
            match ps.stop(snapshot::page_server::StopMode::Detach) {
                Ok(_) => self.working_set_saved = true,
                Err(e) => tracing::warn!("page server stopped with an error ({e}) before a freeze"),
            }
            steps.done("stop_page_server");
        }
        let image = layers.into_image(self.ram.mem_bytes());
        if self.try_move(&image, saved, steps) {
            return Ok(image);
        }
        match self.ram.map_frozen(Arc::clone(&image)) {
            Ok(image) => {
                steps.done("freeze_memory");
                Ok(image)
            }
            Err(e) => {
                let why = format!("guest memory could not be mapped from its snapshot: {e}");
                tracing::error!("{why}: ending the VM");
                self.finish(VmExit::Crashed(why.clone()));
                Err(Error::Snapshot(why))
            }
        }
    }

    /// Unmaps, in the background, the mapping the last [`Vm::freeze_memory`] moved out of
    /// the guest's range, or tears down the KVM VM and mapping it moved away from (call
    /// once the VM runs again: see [`crate::vstate::memory::Retired`], [`RetiredVm`]).
    pub(crate) fn unmap_retired_memory(&mut self) {
        if let Some(retired) = self.ram.take_retired() {
            retired.unmap_in_background();
        }
        if let Some(old) = self.retired_vm.take() {
            old.tear_down_in_background();
        }
    }

    /// The pages written since the last call (KVM's dirty log and the VMM's own writes),
    /// one bitmap per range. A forked VM also keeps them for its next fork (the pages it
    /// wrote since its memory was frozen).
    pub(crate) fn take_dirty(&mut self) -> Result<Vec<Vec<u64>>> {
        let mut dirty = kvm::take_dirty_log(&self.vm_fd, self.ram.ranges())?;
        for (d, v) in dirty.iter_mut().zip(self.ram.take_vmm_dirty()) {
            for (a, b) in d.iter_mut().zip(v) {
                *a |= b;
            }
        }
        if matches!(self.ram.backing(), Backing::Forked(_)) {
            if self.fork_carry.is_empty() {
                self.fork_carry = dirty.clone();
            } else {
                for (d, v) in self.fork_carry.iter_mut().zip(&dirty) {
                    for (a, b) in d.iter_mut().zip(v) {
                        *a |= *b;
                    }
                }
            }
        }
        Ok(dirty)
    }

    /// The pages a forked VM wrote since its memory was last frozen (taken: the next fork
    /// starts a new count; give them back with [`Vm::return_fork_carry`] on failure).
    fn take_fork_carry(&mut self) -> Vec<Vec<u64>> {
        std::mem::take(&mut self.fork_carry)
    }

    /// Gives back what [`Vm::take_fork_carry`] took when a fork failed.
    fn return_fork_carry(&mut self, carry: Vec<Vec<u64>>) {
        self.fork_carry = carry;
    }

    /// Guest RAM (snapshot and fork read and freeze it).
    pub(crate) fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// Whether the memory slots log dirty pages.
    pub(crate) fn dirty_tracking(&self) -> bool {
        self.dirty_tracking
    }

    /// Whether a page server records the guest's working set (a first `uffd` restore).
    pub(crate) fn page_server_recording(&self) -> bool {
        self.page_server
            .as_ref()
            .is_some_and(PageServer::is_recording)
    }

    /// Whether the VM has a virtio-net device (a fork then needs a TAP per child).
    pub(crate) fn has_net_device(&self) -> bool {
        self.devices
            .virtio_slots()
            .iter()
            .any(|s| s.device_type == devices::virtio::net::NET_DEVICE_ID)
    }

    /// Whether guest memory is served on demand by a page server (a `uffd` restore).
    pub(crate) fn has_page_server(&self) -> bool {
        self.page_server.is_some()
    }

    /// The pages the guest needed first in this run, if its memory is served on demand
    /// (see `PageServer::first_touches`), with the page count of the image they index.
    pub(crate) fn first_touches(&self) -> Option<(u64, Vec<u64>)> {
        let ps = self.page_server.as_ref()?;
        Some((ps.page_count(), ps.first_touches()))
    }

    /// Stops the page server after installing every page it has not served yet, so the
    /// VM runs on plain memory (before a full snapshot reads all of it). If that fails,
    /// the pages not installed would read as zeros from now on: the VM is ended
    /// ([`VmExit::Crashed`]) rather than left running on memory it lost.
    pub(crate) fn fill_memory(&mut self) -> Result<Option<u64>> {
        let Some(ps) = self.page_server.take() else {
            return Ok(None);
        };
        match ps.stop(snapshot::page_server::StopMode::FillRemaining) {
            Ok(report) => {
                self.working_set_saved = true;
                Ok(Some(report.stats.pages_filled))
            }
            Err(e) => {
                let why = format!("guest memory could not be filled from the snapshot: {e}");
                tracing::error!("{why}: ending the VM");
                self.finish(VmExit::Crashed(why.clone()));
                Err(Error::Snapshot(why))
            }
        }
    }

    /// Sets the snapshot this VM's memory now matches (None: no diff possible until the
    /// next full snapshot).
    pub(crate) fn set_lineage(&mut self, lineage: Option<Lineage>) {
        self.lineage = lineage;
    }

    /// Records how the restore that made this VM went.
    pub(crate) fn set_restore_report(&mut self, report: RestoreReport) {
        self.restore_report = Some(report);
    }

    /// Finishes a VM built from saved state: starts the vCPUs if asked, then binds the
    /// vsock sockets (or moves `vsock_bound_ahead` into place) and starts the virtio
    /// workers (the vCPUs' first moments overlap with them), then with `agent_sync` gives
    /// the guest agent the time, fresh entropy and the hostname suffix in a background
    /// thread ([`Vm::agent_sync_done`] tells the outcome).
    pub(crate) fn finish_from_saved(
        &mut self,
        start: bool,
        agent_sync: Option<(Duration, Option<String>)>,
        vsock_bound_ahead: Option<crate::device_manager::BoundAhead>,
        steps: &mut Steps,
    ) -> Result<()> {
        // The shell's helper spare, if the devices left it.
        let sync_runner = (agent_sync.is_some() && self.config.vsock.is_some())
            .then(|| crate::vstate::spare::runner_for(&mut self.spares, ThreadKind::Helper));
        if start {
            self.start()?;
            steps.done("start");
        }
        self.devices.finish_restore(vsock_bound_ahead)?;
        steps.done("devices_finish");
        if let (Some((timeout, suffix)), Some(v), Some(runner)) =
            (agent_sync, &self.config.vsock, sync_runner)
        {
            let path = v.uds_path.clone();
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            runner(
                "agent-sync".into(),
                Box::new(move || {
                    let r = crate::agent::sync_after_restore(&path, timeout, suffix.as_deref());
                    let _ = tx.send(r);
                }),
            )
            .map_err(|source| Error::Io {
                context: "starting the agent sync thread",
                source,
            })?;
            self.agent_sync = Some(rx);
        }
        Ok(())
    }

    /// The guest's current VM generation ID (at [`crate::VMGENID_ADDR`]), if the VM has the
    /// device (VMs from snapshots taken before it existed do not).
    pub fn vm_generation_id(&self) -> Option<[u8; 16]> {
        self.devices.vm_generation_id()
    }

    /// Host memory this VM's guest RAM uses, as its proportional set size in KiB (pages
    /// shared with other VMs count in part), from `/proc/self/smaps`.
    pub fn memory_pss_kib(&self) -> Result<u64> {
        let start = self.ram.image_addr();
        let end = start + self.ram.mem_bytes() as usize;
        crate::vstate::memory::pss_kib(start, end)
    }
}

/// `p` resolved to an absolute path (as it is when it cannot be).
fn absolute(p: PathBuf) -> PathBuf {
    p.canonicalize().unwrap_or(p)
}

/// A new layer's path next to `layer`: `<stem>-<tag><k>.cdsk`, a name not taken.
fn sibling_layer(layer: &std::path::Path, tag: &str) -> PathBuf {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let stem = layer
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "disk".into());
    // `disk-s4` becomes `disk-s<k>`, not `disk-s4-s<k>`: a VM that freezes its disk many
    // times (a build's steps, a sandbox's pauses) keeps names of one length.
    let stem = match stem.rsplit_once(&format!("-{tag}")) {
        Some((base, n))
            if !base.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) =>
        {
            base.to_string()
        }
        _ => stem,
    };
    let dir = layer.parent().unwrap_or(std::path::Path::new("."));
    loop {
        let k = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = dir.join(format!("{stem}-{tag}{k}.cdsk"));
        if !p.exists() {
            return p;
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.stop_vcpus();
        self.finish_working_set();
    }
}

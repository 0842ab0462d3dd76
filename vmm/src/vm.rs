//! [`Vm`]: the handle to a built VM — start, pause, resume, wait, shut down.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devices::{ExitNotifier, GuestExit};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use snapshot::page_server::{PageServer, PageServerStats};

use crate::config::VmConfig;
use crate::device_manager::DeviceManager;
use crate::error::{Error, Result};
use crate::persist::{Lineage, ResumeReport};
use crate::vstate::memory::{GuestMemory, GuestRam};
use crate::vstate::vcpu::VcpuHandle;

/// How a VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitStatus {
    /// The guest powered off (ACPI S5).
    PowerOff,
    /// The guest reset the machine (reboot, or a panic with `panic=N`); Clade does not reboot.
    Reset,
    /// The project's test guest reported this result code.
    TestExit(u32),
    /// The guest or KVM failed: triple fault, entry failure, internal error.
    Crashed(String),
    /// The host stopped the VM ([`Vm::shutdown`]).
    Stopped,
}

impl ExitStatus {
    /// Process exit code for the `clade` binary: 0 for a power off, the guest's code for the
    /// test guest (255 if it does not fit), 2 for a reset, 1 for a crash, 0 when stopped.
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitStatus::PowerOff | ExitStatus::Stopped => 0,
            ExitStatus::TestExit(c) => (*c).min(255) as i32,
            ExitStatus::Reset => 2,
            ExitStatus::Crashed(_) => 1,
        }
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::PowerOff => write!(f, "guest powered off"),
            ExitStatus::Reset => write!(f, "guest reset the machine (reboot or panic)"),
            ExitStatus::TestExit(c) => write!(f, "test guest exited with code {c:#x}"),
            ExitStatus::Crashed(why) => write!(f, "guest crashed: {why}"),
            ExitStatus::Stopped => write!(f, "stopped by the host"),
        }
    }
}

/// Messages from vCPU threads and devices to the VM owner.
#[derive(Debug)]
pub enum VmEvent {
    /// The VM must end with this status.
    Exit(ExitStatus),
}

/// The callback devices use to end the VM: a [`VmEvent::Exit`] to the owner.
pub(crate) fn exit_notifier(events_tx: &Sender<VmEvent>) -> ExitNotifier {
    let exit_tx = Mutex::new(events_tx.clone());
    Arc::new(move |e: GuestExit| {
        let status = match e {
            GuestExit::PowerOff => ExitStatus::PowerOff,
            GuestExit::Reset => ExitStatus::Reset,
            GuestExit::TestExit(c) => ExitStatus::TestExit(c),
        };
        let tx = exit_tx.lock().unwrap_or_else(|p| p.into_inner());
        let _ = tx.send(VmEvent::Exit(status));
    })
}

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
    pub(crate) vcpus: Vec<VcpuHandle>,
    pub(crate) pending_vcpus: Vec<VcpuFd>,
    pub(crate) devices: DeviceManager,
    pub(crate) events: Receiver<VmEvent>,
    pub(crate) events_tx: Sender<VmEvent>,
    /// Serves guest memory on demand after a `uffd` resume (stops before memory goes).
    pub(crate) page_server: Option<PageServer>,
    pub(crate) vm_fd: VmFd,
    pub(crate) ram: GuestRam,
    pub(crate) _kvm: Kvm,
    pub(crate) config: VmConfig,
    pub(crate) pvm_native: bool,
    pub(crate) created_at: Instant,
    pub(crate) state: RunState,
    pub(crate) exit: Option<ExitStatus>,
    /// The snapshot this VM's memory last matched (taken or resumed from): the base of the
    /// next diff snapshot.
    pub(crate) lineage: Option<Lineage>,
    /// How the resume that made this VM went.
    pub(crate) resume_report: Option<ResumeReport>,
    /// False while a page server records a working set that was not yet written.
    pub(crate) working_set_saved: bool,
    /// The memory slots log dirty pages (diff snapshots possible).
    pub(crate) dirty_tracking: bool,
    /// Threads started ahead of time for the vCPUs (from a VM shell).
    pub(crate) spares: Vec<crate::vstate::spare::SpareThread>,
    /// The CPUID set on each vCPU (saved in snapshots).
    pub(crate) cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    /// Host CPUs the vCPU threads are pinned to (vCPU `i` on `vcpu_cpus[i % len]`).
    pub(crate) vcpu_cpus: Vec<usize>,
    /// The post-resume agent sync's outcome, once it arrives.
    pub(crate) agent_sync: Option<Receiver<std::result::Result<Duration, String>>>,
    /// Forked memory: the pages written since it was frozen that a snapshot already took
    /// out of the dirty log (see [`Vm::fork`]).
    pub(crate) fork_carry: Vec<Vec<u64>>,
}

impl Vm {
    /// Builds a VM from `config` (see [`crate::builder`]). It does not run until [`Vm::start`].
    pub fn new(config: VmConfig) -> Result<Self> {
        crate::builder::build(config)
    }

    pub(crate) fn initial_state() -> RunState {
        RunState::Built
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
            let runner = crate::vstate::spare::runner_from(&mut self.spares);
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
        self.spares.clear();
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

    /// Builds and starts, then waits for the VM to end.
    pub fn run(config: VmConfig) -> Result<ExitStatus> {
        let mut vm = Self::new(config)?;
        vm.start()?;
        vm.wait()
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

    /// Lets paused vCPUs run again. (Not to be confused with [`Vm::resume`], which
    /// makes a new VM from a snapshot.)
    pub fn unpause(&mut self) -> Result<()> {
        if self.state != RunState::Paused {
            return Err(self.invalid("unpause"));
        }
        for v in &self.vcpus {
            v.resume();
        }
        self.state = RunState::Running;
        Ok(())
    }

    fn finish(&mut self, status: ExitStatus) -> ExitStatus {
        for v in &mut self.vcpus {
            v.stop();
        }
        self.state = RunState::Ended;
        tracing::info!("VM ended: {status}");
        self.finish_working_set();
        self.exit.get_or_insert(status).clone()
    }

    /// A page-server failure leaves a vCPU blocked on a page forever: end the VM.
    fn page_server_failure(&self) -> Option<ExitStatus> {
        let e = self.page_server.as_ref()?.error()?;
        Some(ExitStatus::Crashed(format!(
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
    pub fn wait(&mut self) -> Result<ExitStatus> {
        loop {
            if let Some(status) = self.wait_timeout(Duration::from_millis(200))? {
                return Ok(status);
            }
        }
    }

    /// Like [`Vm::wait`], but gives up after `timeout` (returns `None`, VM still running).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        if let Some(s) = &self.exit {
            return Ok(Some(s.clone()));
        }
        if self.state == RunState::Built {
            return Err(self.invalid("wait"));
        }
        if let Some(status) = self.page_server_failure() {
            return Ok(Some(self.finish(status)));
        }
        match self.events.recv_timeout(timeout) {
            Ok(VmEvent::Exit(status)) => Ok(Some(self.finish(status))),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            // We hold a sender ourselves, so this cannot happen; treat it as a stop.
            Err(RecvTimeoutError::Disconnected) => Ok(Some(self.finish(ExitStatus::Stopped))),
        }
    }

    /// Stops the VM now, whatever the guest is doing. Returns how it ended (a guest-requested
    /// exit that raced with this call wins).
    pub fn shutdown(&mut self) -> ExitStatus {
        if let Some(s) = &self.exit {
            return s.clone();
        }
        self.poll_exit();
        if let Some(s) = &self.exit {
            return s.clone();
        }
        self.finish(ExitStatus::Stopped)
    }

    /// The configuration this VM was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The virtio-blk device's disk (its current chain), if the VM has one.
    pub fn disk(&self) -> Option<std::sync::Arc<std::sync::Mutex<disk::Disk>>> {
        self.devices.disk()
    }

    /// Guest memory. (Clones of it must not outlive the VM: the memory is unmapped when
    /// the VM is dropped.)
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

    /// The page server's counters, when the VM was resumed with the `uffd` backend and the
    /// server still runs.
    pub fn page_server_stats(&self) -> Option<PageServerStats> {
        self.page_server.as_ref().map(|p| p.stats())
    }

    /// The snapshot this VM's memory last matched (the last one it took, or the one it
    /// was resumed from): the base of its next diff snapshot.
    pub fn last_snapshot(&self) -> Option<&Lineage> {
        self.lineage.as_ref()
    }

    /// How the resume that created this VM went (None for a booted VM).
    pub fn resume_report(&self) -> Option<&ResumeReport> {
        self.resume_report.as_ref()
    }

    /// Writes the working set the page server recorded since the resume (the pages the
    /// guest touched, in order) next to the snapshot, so that later resumes prefetch it.
    /// Call it once the guest has served its first request; a VM that never calls it saves
    /// everything it touched when it ends. Returns the pages written (None: not recording).
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

    /// The outcome of the agent sync a resume started ([`crate::ResumeOptions::agent_sync`]):
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

    /// The raw KVM VM fd (for later subsystems: snapshot, dirty logging).
    pub fn vm_fd(&self) -> &VmFd {
        &self.vm_fd
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        for v in &mut self.vcpus {
            v.stop();
        }
        self.finish_working_set();
    }
}

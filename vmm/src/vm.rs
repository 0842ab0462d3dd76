//! [`Vm`]: the handle to a built VM — start, pause, resume, wait, shut down.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::GuestMemoryMmap;

use crate::config::VmConfig;
use crate::device_manager::DeviceManager;
use crate::error::{Error, Result};
use crate::vstate::memory::GuestRam;
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
    pub(crate) events_tx: std::sync::mpsc::Sender<VmEvent>,
    pub(crate) vm_fd: VmFd,
    pub(crate) ram: GuestRam,
    pub(crate) _kvm: Kvm,
    pub(crate) config: VmConfig,
    pub(crate) pvm_native: bool,
    pub(crate) created_at: Instant,
    pub(crate) state: RunState,
    pub(crate) exit: Option<ExitStatus>,
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
            let handle = VcpuHandle::spawn(index, fd, buses.clone(), self.events_tx.clone())?;
            self.vcpus.push(handle);
        }
        self.state = RunState::Running;
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

    /// Lets paused vCPUs run again.
    pub fn resume(&mut self) -> Result<()> {
        if self.state != RunState::Paused {
            return Err(self.invalid("resume"));
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
        self.exit.get_or_insert(status).clone()
    }

    fn poll_exit(&mut self) {
        if self.state == RunState::Ended {
            return;
        }
        if let Ok(VmEvent::Exit(status)) = self.events.try_recv() {
            self.finish(status);
        }
    }

    /// Blocks until the VM ends and returns how it ended.
    pub fn wait(&mut self) -> Result<ExitStatus> {
        loop {
            if let Some(status) = self.wait_timeout(Duration::from_secs(3600))? {
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

    /// Guest memory.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.ram.mem
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
    }
}

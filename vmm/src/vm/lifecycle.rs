//! Running a [`Vm`]: starting its vCPUs (and pinning them), pausing and unpausing, waiting
//! for its end or ending it, and the [`PauseGuard`] that holds it still while its state is
//! read. Apart from the rest so that every move between its run states is in one file.

use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use super::{RunState, Vm};
use crate::error::Result;
use crate::exit::{VmEvent, VmExit};
use crate::seccomp::ThreadKind;
use crate::vstate::vcpu::VcpuHandle;

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

/// How often a wait looks at the page server (a failed one sends no event).
const PAGE_SERVER_CHECK: Duration = Duration::from_millis(200);

impl Vm {
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

    pub(super) fn finish(&mut self, status: VmExit) -> VmExit {
        self.stop_vcpus();
        self.state = RunState::Ended;
        tracing::info!("VM ended: {status}");
        self.finish_working_set();
        self.exit.get_or_insert(status).clone()
    }

    /// Stops the vCPU threads. One blocked on a page a failed page server never served
    /// would never stop: the server is detached first then (the kernel fills what was
    /// never served with zeros; the VM is ending, its memory is kept nowhere).
    pub(super) fn stop_vcpus(&mut self) {
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
}

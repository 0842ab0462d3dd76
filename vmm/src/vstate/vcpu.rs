//! vCPUs: boot-time register setup and the per-vCPU thread that runs KVM_RUN and dispatches
//! port I/O and MMIO exits to the device buses.
//!
//! Control (pause, resume, stop) goes through a small state machine shared with the thread.
//! To get a thread out of KVM_RUN we send it a signal whose handler does nothing: KVM_RUN then
//! returns EINTR and the thread looks at its state before entering the guest again. A signal
//! that arrives just before KVM_RUN is lost, so the controller re-kicks until the thread
//! acknowledges.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use devices::Bus;
use kvm_bindings::{CpuId, Msrs};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::arch::{msrs, regs};
use crate::error::{Error, Result};
use crate::vm::{ExitStatus, VmEvent};

/// Applies the boot state to a vCPU: CPUID, MSRs, segment/control registers, general
/// registers, FPU and local APIC.
pub fn configure_for_boot(vcpu: &VcpuFd, cpuid: &CpuId, entry: u64) -> Result<()> {
    vcpu.set_cpuid2(cpuid)
        .map_err(Error::kvm("KVM_SET_CPUID2"))?;
    let boot = msrs::boot_msrs();
    let list =
        Msrs::from_entries(&boot).map_err(|e| Error::Boot(format!("building MSR list: {e:?}")))?;
    let written = vcpu.set_msrs(&list).map_err(Error::kvm("KVM_SET_MSRS"))?;
    if written != boot.len() {
        // KVM stops at the first MSR it refuses; the rest are optional niceties for Linux.
        tracing::warn!(
            "KVM accepted {written} of {} boot MSRs (first refused: {:#x})",
            boot.len(),
            boot[written].index
        );
    }
    let sregs = vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
    vcpu.set_sregs(&regs::long_mode_sregs(sregs))
        .map_err(Error::kvm("KVM_SET_SREGS"))?;
    vcpu.set_regs(&regs::boot_regs(entry))
        .map_err(Error::kvm("KVM_SET_REGS"))?;
    vcpu.set_fpu(&regs::boot_fpu())
        .map_err(Error::kvm("KVM_SET_FPU"))?;
    let lapic = vcpu.get_lapic().map_err(Error::kvm("KVM_GET_LAPIC"))?;
    vcpu.set_lapic(&regs::set_lint(lapic))
        .map_err(Error::kvm("KVM_SET_LAPIC"))?;
    Ok(())
}

/// What the controller wants a vCPU thread to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Request {
    Run,
    Pause,
    Stop,
}

#[derive(Debug)]
struct State {
    request: Request,
    /// The thread is parked (paused, stopped or exited) and not in KVM_RUN.
    parked: bool,
    exited: bool,
}

/// Shared between a vCPU thread and its controller.
struct Control {
    state: Mutex<State>,
    cv: Condvar,
}

impl Control {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The I/O buses a vCPU dispatches exits to.
#[derive(Clone)]
pub struct IoBuses {
    /// Port I/O.
    pub pio: Arc<Bus>,
    /// Memory-mapped I/O.
    pub mmio: Arc<Bus>,
}

fn kick_signal() -> i32 {
    SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn install_kick_handler() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = register_signal_handler(kick_signal(), on_kick).map_err(|e| Error::Vcpu {
            index: 0,
            reason: format!("installing the kick signal handler: {e}"),
        });
    });
    result
}

/// A running vCPU thread and its control handle.
pub struct VcpuHandle {
    index: usize,
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

impl VcpuHandle {
    /// Starts a thread running `vcpu`. Exits the guest requests, and errors, go to `events`.
    pub fn spawn(
        index: usize,
        vcpu: VcpuFd,
        buses: IoBuses,
        events: Sender<VmEvent>,
    ) -> Result<Self> {
        install_kick_handler()?;
        let control = Arc::new(Control {
            state: Mutex::new(State {
                request: Request::Run,
                parked: false,
                exited: false,
            }),
            cv: Condvar::new(),
        });
        let c = Arc::clone(&control);
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || run_loop(index, vcpu, buses, &c, &events))
            .map_err(|e| Error::Vcpu {
                index,
                reason: format!("spawning thread: {e}"),
            })?;
        Ok(Self {
            index,
            control,
            thread: Some(thread),
        })
    }

    fn set_request(&self, request: Request) {
        let mut st = self.control.lock();
        if st.request != Request::Stop {
            st.request = request;
        }
        self.control.cv.notify_all();
    }

    fn kick(&self) {
        if let Some(t) = &self.thread {
            // ESRCH means the thread already ended: nothing to interrupt.
            let _ = t.kill(kick_signal());
        }
    }

    /// Asks the thread to leave the guest and park; returns once it has.
    fn park(&self, request: Request) {
        self.set_request(request);
        let mut st = self.control.lock();
        while !st.parked && !st.exited {
            drop(st);
            self.kick();
            st = self.control.lock();
            st = self
                .control
                .cv
                .wait_timeout(st, Duration::from_millis(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stops running guest code until [`VcpuHandle::resume`].
    pub fn pause(&self) {
        self.park(Request::Pause);
    }

    /// Lets a paused vCPU run again.
    pub fn resume(&self) {
        self.set_request(Request::Run);
    }

    /// Stops the thread for good and joins it.
    pub fn stop(&mut self) {
        self.park(Request::Stop);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("vcpu{} thread panicked", self.index);
            }
        }
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits while paused; returns false when the thread must end.
fn wait_while_parked(control: &Control) -> bool {
    let mut st = control.lock();
    loop {
        match st.request {
            Request::Run => {
                st.parked = false;
                return true;
            }
            Request::Stop => {
                st.parked = true;
                control.cv.notify_all();
                return false;
            }
            Request::Pause => {
                if !st.parked {
                    st.parked = true;
                    control.cv.notify_all();
                }
                st = control.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
    }
}

fn run_loop(
    index: usize,
    mut vcpu: VcpuFd,
    buses: IoBuses,
    control: &Control,
    events: &Sender<VmEvent>,
) {
    let end = |status: ExitStatus| {
        let _ = events.send(VmEvent::Exit(status));
    };
    while wait_while_parked(control) {
        match vcpu.run() {
            Ok(exit) => match exit {
                VcpuExit::IoOut(port, data) => {
                    if !buses.pio.write(u64::from(port), data) {
                        tracing::trace!("vcpu{index}: unhandled out {port:#x}");
                    }
                }
                VcpuExit::IoIn(port, data) => {
                    if !buses.pio.read(u64::from(port), data) {
                        // Nothing there: an ISA bus floats high.
                        data.fill(0xff);
                    }
                }
                VcpuExit::MmioRead(addr, data) => {
                    if !buses.mmio.read(addr, data) {
                        tracing::trace!("vcpu{index}: unhandled MMIO read {addr:#x}");
                        data.fill(0xff);
                    }
                }
                VcpuExit::MmioWrite(addr, data) => {
                    if !buses.mmio.write(addr, data) {
                        tracing::trace!("vcpu{index}: unhandled MMIO write {addr:#x}");
                    }
                }
                // Only without an in-kernel LAPIC, or on the PVM hypervisor: just go back in.
                VcpuExit::Hlt => {}
                VcpuExit::Shutdown => {
                    end(ExitStatus::Crashed(format!(
                        "vcpu{index}: triple fault (KVM_EXIT_SHUTDOWN)"
                    )));
                    break;
                }
                VcpuExit::SystemEvent(kind, _) => {
                    let status = match kind {
                        kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => ExitStatus::PowerOff,
                        kvm_bindings::KVM_SYSTEM_EVENT_RESET => ExitStatus::Reset,
                        other => ExitStatus::Crashed(format!("vcpu{index}: system event {other}")),
                    };
                    end(status);
                    break;
                }
                VcpuExit::FailEntry(reason, cpu) => {
                    end(ExitStatus::Crashed(format!(
                        "vcpu{index}: KVM entry failed (hardware reason {reason:#x}, cpu {cpu})"
                    )));
                    break;
                }
                VcpuExit::InternalError => {
                    end(ExitStatus::Crashed(format!(
                        "vcpu{index}: KVM internal error"
                    )));
                    break;
                }
                other => {
                    end(ExitStatus::Crashed(format!(
                        "vcpu{index}: unexpected exit {other:?}"
                    )));
                    break;
                }
            },
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                // Kicked (or interrupted): re-check the requested state.
            }
            Err(e) => {
                end(ExitStatus::Crashed(format!("vcpu{index}: KVM_RUN: {e}")));
                break;
            }
        }
    }
    let mut st = control.lock();
    st.exited = true;
    st.parked = true;
    control.cv.notify_all();
}

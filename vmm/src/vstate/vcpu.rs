//! vCPUs: boot-time register setup and the per-vCPU thread that runs KVM_RUN and dispatches
//! port I/O and MMIO exits to the device buses.
//!
//! Control (pause, unpause, stop) goes through a small state machine shared with the thread.
//! To get a thread out of KVM_RUN we send it a signal whose handler does nothing: KVM_RUN then
//! returns EINTR and the thread looks at its state before entering the guest again. A signal
//! that arrives just before KVM_RUN is lost, so the controller re-kicks until the thread
//! acknowledges.

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, Once};
use std::time::Duration;

use devices::Bus;
use kvm_bindings::Msrs;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use crate::arch::{msrs, regs};
use crate::error::{Error, Result};
use crate::exit::{VmEvent, VmExit};

/// Applies the boot state to a vCPU whose CPUID is set (see `vstate::shell`): MSRs,
/// segment/control registers, general registers, FPU and local APIC.
pub fn configure_for_boot(vcpu: &VcpuFd, entry: u64) -> Result<()> {
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

/// Work run on a parked vCPU thread, with its vCPU.
type Job = Box<dyn FnOnce(&mut VcpuFd) + Send>;

struct State {
    request: Request,
    /// The thread running the vCPU, once it started (for kicks).
    thread: Option<libc::pthread_t>,
    /// Its kernel thread ID, once it started (to change its CPUs from another thread).
    tid: Option<libc::pid_t>,
    /// Its CPU pin was lifted ([`VcpuHandle::unpin`]) to these CPUs; a thread that starts
    /// after that does not pin itself, and takes these CPUs (its runner may have pinned it
    /// before it ran: `spare::runner_for_on`).
    unpinned: Option<libc::cpu_set_t>,
    /// The thread is parked (paused, stopped or exited) and not in KVM_RUN.
    parked: bool,
    exited: bool,
    /// Jobs to run while parked, in order.
    jobs: VecDeque<Job>,
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

/// Restricts the calling thread to host CPU `cpu`.
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    pin_thread(0, cpu)
}

/// The calling thread pinned to one host CPU until this is dropped (on that thread: it is
/// not `Send`), when it may again run on the CPUs it could before. What a benchmark holds
/// while it measures, so that the processes it starts afterwards (a service) are not
/// confined to that CPU too.
pub struct CpuPin {
    before: libc::cpu_set_t,
    _same_thread: std::marker::PhantomData<*const ()>,
}

impl std::fmt::Debug for CpuPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuPin").finish_non_exhaustive()
    }
}

impl CpuPin {
    /// Pins the calling thread to host CPU `cpu`.
    pub fn current_thread(cpu: usize) -> std::io::Result<CpuPin> {
        let before = current_thread_cpus()?;
        pin_thread(0, cpu)?;
        Ok(CpuPin {
            before,
            _same_thread: std::marker::PhantomData,
        })
    }
}

impl Drop for CpuPin {
    fn drop(&mut self) {
        if let Err(e) = set_thread_cpus(0, &self.before) {
            tracing::warn!("giving a thread its CPUs back: {e}");
        }
    }
}

/// Restricts thread `tid` (0: the calling thread) to host CPU `cpu`.
pub(crate) fn pin_thread(tid: libc::pid_t, cpu: usize) -> std::io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(std::io::ErrorKind::InvalidInput.into());
    }
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (checked), so CPU_SET stays inside `set`.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    set_thread_cpus(tid, &set)
}

/// Lets thread `tid` (0: the calling thread) run on the CPUs in `cpus`.
fn set_thread_cpus(tid: libc::pid_t, cpus: &libc::cpu_set_t) -> std::io::Result<()> {
    // SAFETY: `cpus` is a valid cpu_set_t of the size passed; the kernel checks `tid` (a
    // caller passing another thread's ID keeps that thread alive meanwhile).
    if unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(cpus), cpus) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The CPUs the calling thread may run on.
pub fn current_thread_cpus() -> std::io::Result<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a writable cpu_set_t of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(set)
}

/// The CPUs the calling thread may run on other than the one it runs on now, in order
/// (empty when there is no other, or the current one is unknown).
pub fn other_cpus_than_current() -> Vec<usize> {
    // SAFETY: sched_getcpu has no preconditions.
    let Ok(current) = usize::try_from(unsafe { libc::sched_getcpu() }) else {
        return Vec::new();
    };
    let Ok(set) = current_thread_cpus() else {
        return Vec::new();
    };
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: every index is below CPU_SETSIZE, inside `set`.
        .filter(|&c| c != current && unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// A running vCPU thread and its control handle.
pub struct VcpuHandle {
    index: usize,
    control: Arc<Control>,
    /// Closed when the thread's body has returned.
    done: Option<Receiver<()>>,
}

impl VcpuHandle {
    /// Runs `vcpu` on the thread `runner` provides (a new one with
    /// [`snapshot::spawn_thread`]), on host CPU `cpu` only if given. Exits the guest
    /// requests, and errors, go to `events`.
    pub fn spawn(
        index: usize,
        vcpu: VcpuFd,
        buses: IoBuses,
        events: Sender<VmEvent>,
        cpu: Option<usize>,
        runner: snapshot::ThreadRunner,
    ) -> Result<Self> {
        install_kick_handler()?;
        let control = Arc::new(Control {
            state: Mutex::new(State {
                thread: None,
                tid: None,
                unpinned: None,
                request: Request::Run,
                parked: false,
                exited: false,
                jobs: VecDeque::new(),
            }),
            cv: Condvar::new(),
        });
        let c = Arc::clone(&control);
        let (done_tx, done) = mpsc::sync_channel::<()>(0);
        runner(
            format!("vcpu{index}"),
            Box::new(move || {
                // Dropped when the body returns (or unwinds): the handle's cue.
                let _done = done_tx;
                {
                    let mut st = c.lock();
                    // SAFETY: pthread_self has no preconditions.
                    st.thread = Some(unsafe { libc::pthread_self() });
                    // SAFETY: gettid has no preconditions.
                    st.tid = Some(unsafe { libc::gettid() });
                    // Pinned with the state locked: an `unpin` either comes before (and
                    // is seen here) or after (and lifts this pin).
                    match (cpu, st.unpinned) {
                        (Some(cpu), None) => {
                            if let Err(e) = pin_current_thread(cpu) {
                                tracing::warn!("vcpu{index}: cannot pin to CPU {cpu}: {e}");
                            }
                        }
                        (Some(_), Some(cpus)) => {
                            if let Err(e) = set_thread_cpus(0, &cpus) {
                                tracing::warn!("vcpu{index}: cannot lift its CPU pin: {e}");
                            }
                        }
                        (None, _) => {}
                    }
                }
                run_loop(index, vcpu, buses, &c, &events)
            }),
        )
        .map_err(|e| Error::Vcpu {
            index,
            reason: format!("starting its thread: {e}"),
        })?;
        Ok(Self {
            index,
            control,
            done: Some(done),
        })
    }

    /// Lets the vCPU thread run on every CPU in `cpus` (its pin, if any, lifted).
    pub fn unpin(&self, cpus: &libc::cpu_set_t) -> std::io::Result<()> {
        let mut st = self.control.lock();
        st.unpinned = Some(*cpus);
        // The vCPU thread's ID, alive while it has not marked itself exited (which needs
        // the lock held here).
        match st.tid.filter(|_| !st.exited) {
            Some(tid) => set_thread_cpus(tid, cpus),
            None => Ok(()),
        }
    }

    fn set_request(&self, request: Request) {
        let mut st = self.control.lock();
        if st.request != Request::Stop {
            st.request = request;
        }
        self.control.cv.notify_all();
    }

    /// Interrupts KVM_RUN. Called with the state locked and the thread neither parked nor
    /// exited: it is alive until it has marked itself exited, which needs the lock.
    fn kick(st: &State) {
        if let Some(t) = st.thread {
            // SAFETY: `t` is a live thread (see above); the signal's handler does nothing.
            unsafe { libc::pthread_kill(t, kick_signal()) };
        }
    }

    /// Asks the thread to leave the guest and park; returns once it has.
    fn park(&self, request: Request) {
        self.set_request(request);
        let mut st = self.control.lock();
        while !st.parked && !st.exited {
            Self::kick(&st);
            st = self
                .control
                .cv
                .wait_timeout(st, Duration::from_millis(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stops running guest code until [`VcpuHandle::unpause`].
    pub fn pause(&self) {
        self.park(Request::Pause);
    }

    /// Lets a paused vCPU run again.
    pub fn unpause(&self) {
        self.set_request(Request::Run);
    }

    /// Queues `f` to run on the paused vCPU's thread with its vCPU fd, and returns where its
    /// result will arrive. The vCPU's pending I/O (an exit whose completion KVM performs on
    /// the next KVM_RUN) is completed first, so the state `f` reads is between instructions.
    /// Queue to every vCPU first and then wait, to work on all of them in parallel.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut VcpuFd) -> R + Send + 'static,
    ) -> Result<Receiver<R>> {
        let (tx, rx) = mpsc::sync_channel(1);
        let mut st = self.control.lock();
        if st.exited {
            return Err(Error::Vcpu {
                index: self.index,
                reason: "the vCPU thread has ended".into(),
            });
        }
        if st.request != Request::Pause || !st.parked {
            return Err(Error::Vcpu {
                index: self.index,
                reason: "the vCPU is not paused".into(),
            });
        }
        st.jobs.push_back(Box::new(move |v| {
            let _ = tx.send(f(v));
        }));
        self.control.cv.notify_all();
        Ok(rx)
    }

    /// Waits for the result of a job queued with [`VcpuHandle::submit`].
    pub fn wait_job<R>(&self, rx: Receiver<R>) -> Result<R> {
        rx.recv().map_err(|_| Error::Vcpu {
            index: self.index,
            reason: "the vCPU thread ended before running the job".into(),
        })
    }

    /// Stops the thread for good and waits until its body has returned.
    pub fn stop(&mut self) {
        self.park(Request::Stop);
        if let Some(done) = self.done.take() {
            // Only a disconnect arrives: the body returned (or panicked).
            let _ = done.recv();
            if !self.control.lock().exited {
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

/// The thread's side: runs the vCPU, handles exits, and parks on request.
struct VcpuThread<'a> {
    index: usize,
    vcpu: VcpuFd,
    buses: IoBuses,
    control: &'a Control,
    events: &'a Sender<VmEvent>,
    /// The last exit was an I/O exit whose completion KVM does on the next KVM_RUN.
    pending_io: bool,
}

impl VcpuThread<'_> {
    /// Waits while paused, running jobs; returns false when the thread must end.
    fn wait_while_parked(&mut self) -> bool {
        let control = self.control;
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
                    if let Some(job) = st.jobs.pop_front() {
                        drop(st);
                        if self.pending_io && !self.complete_pending_io() {
                            return false;
                        }
                        job(&mut self.vcpu);
                        st = control.lock();
                        continue;
                    }
                    st = control.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }

    /// Lets KVM finish the instruction behind the last I/O exit without entering the guest
    /// (KVM_RUN with `immediate_exit`). Returns false if the VM must end.
    fn complete_pending_io(&mut self) -> bool {
        self.vcpu.set_kvm_immediate_exit(1);
        let mut ok = true;
        // A string I/O instruction may exit again; a few rounds finish any of them.
        for _ in 0..64 {
            self.pending_io = false;
            match self.vcpu.run() {
                Ok(exit) => {
                    if let Some(status) = handle_exit(self.index, exit, &self.buses) {
                        let _ = self.events.send(VmEvent::Exit(status));
                        ok = false;
                        break;
                    }
                    self.pending_io = true;
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => break,
                Err(e) => {
                    let _ = self.events.send(VmEvent::Exit(VmExit::Crashed(format!(
                        "vcpu{}: KVM_RUN: {e}",
                        self.index
                    ))));
                    ok = false;
                    break;
                }
            }
        }
        self.vcpu.set_kvm_immediate_exit(0);
        ok
    }

    fn run(&mut self) {
        while self.wait_while_parked() {
            self.pending_io = false;
            match self.vcpu.run() {
                Ok(exit) => {
                    self.pending_io = matches!(
                        exit,
                        VcpuExit::IoIn(..)
                            | VcpuExit::IoOut(..)
                            | VcpuExit::MmioRead(..)
                            | VcpuExit::MmioWrite(..)
                    );
                    if let Some(status) = handle_exit(self.index, exit, &self.buses) {
                        let _ = self.events.send(VmEvent::Exit(status));
                        break;
                    }
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    // Kicked (or interrupted): re-check the requested state.
                }
                Err(e) => {
                    let _ = self.events.send(VmEvent::Exit(VmExit::Crashed(format!(
                        "vcpu{}: KVM_RUN: {e}",
                        self.index
                    ))));
                    break;
                }
            }
        }
        let mut st = self.control.lock();
        st.exited = true;
        st.parked = true;
        st.jobs.clear();
        self.control.cv.notify_all();
    }
}

/// Handles one exit; returns the VM's end status when the exit ends it.
fn handle_exit(index: usize, exit: VcpuExit<'_>, buses: &IoBuses) -> Option<VmExit> {
    match exit {
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
            return Some(VmExit::Crashed(format!(
                "vcpu{index}: triple fault (KVM_EXIT_SHUTDOWN)"
            )))
        }
        VcpuExit::SystemEvent(kind, _) => {
            return Some(match kind {
                kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => VmExit::PowerOff,
                kvm_bindings::KVM_SYSTEM_EVENT_RESET => VmExit::Reset,
                other => VmExit::Crashed(format!("vcpu{index}: system event {other}")),
            })
        }
        VcpuExit::FailEntry(reason, cpu) => {
            return Some(VmExit::Crashed(format!(
                "vcpu{index}: KVM entry failed (hardware reason {reason:#x}, cpu {cpu})"
            )))
        }
        VcpuExit::InternalError => {
            return Some(VmExit::Crashed(format!("vcpu{index}: KVM internal error")))
        }
        other => {
            return Some(VmExit::Crashed(format!(
                "vcpu{index}: unexpected exit {other:?}"
            )))
        }
    }
    None
}

fn run_loop(
    index: usize,
    vcpu: VcpuFd,
    buses: IoBuses,
    control: &Control,
    events: &Sender<VmEvent>,
) {
    VcpuThread {
        index,
        vcpu,
        buses,
        control,
        events,
        pending_io: false,
    }
    .run();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_other_cpus_are_the_allowed_ones_but_one() {
        let allowed = current_thread_cpus().unwrap();
        let is_set = |c: usize| {
            assert!(c < libc::CPU_SETSIZE as usize);
            // SAFETY: `c` is below CPU_SETSIZE (checked), inside `allowed`.
            unsafe { libc::CPU_ISSET(c, &allowed) }
        };
        let n = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| is_set(c))
            .count();
        let others = other_cpus_than_current();
        assert_eq!(others.len(), n - 1, "{others:?} of {n}");
        assert!(others.iter().all(|&c| is_set(c)));
    }
}

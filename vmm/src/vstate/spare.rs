//! Spare threads: started ahead of time (by a VM shell, in the background), each waiting to
//! run one body (a vCPU, the device event loop, the page server). Starting a thread costs
//! ~50-70 us on this project's hosts, and confining it to its kind's system-call filter
//! about as much again; a restore that finds them ready only hands bodies over.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::Arc;

use snapshot::ThreadRunner;

use crate::seccomp::{self, ThreadKind};

type Body = Box<dyn FnOnce() + Send>;

/// A thread waiting for its body. Dropped unused, the thread ends.
pub struct SpareThread {
    tx: SyncSender<(String, Body)>,
    kind: ThreadKind,
    /// Its kernel thread ID once it runs (0 before).
    tid: Arc<AtomicI32>,
}

impl std::fmt::Debug for SpareThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpareThread")
    }
}

/// Puts the calling thread at `SCHED_IDLE`: it runs only on CPU time nothing else wants
/// (building a shell ahead, tearing down what a VM left behind). `what` names the work in
/// the debug line when the kernel refuses.
pub(crate) fn run_at_idle_priority(what: &str) {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sets the calling thread's scheduling policy; `param` is a valid struct.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        tracing::debug!(
            "{what}: SCHED_IDLE refused: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Puts the calling thread back at `SCHED_OTHER`: a thread started by one at idle priority
/// (a pool's refill thread, a standby process waiting) inherits that, and its work (a
/// vCPU, the device loop, the API server) must not run so.
pub(crate) fn run_at_normal_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sets the calling thread's scheduling policy; `param` is a valid struct.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) };
}

impl SpareThread {
    /// Starts a thread that confines itself as a `kind` thread (if the process filter is
    /// on: [`seccomp::confine_current_thread`]) and waits for one body.
    pub fn start(kind: ThreadKind) -> std::io::Result<SpareThread> {
        let (tx, rx) = mpsc::sync_channel::<(String, Body)>(1);
        let tid = Arc::new(AtomicI32::new(0));
        let own_tid = Arc::clone(&tid);
        std::thread::Builder::new()
            .name("clade-spare".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                own_tid.store(unsafe { libc::gettid() }, Ordering::Release);
                run_at_normal_priority();
                seccomp::add_thread_filter(kind);
                if let Ok((name, body)) = rx.recv() {
                    set_thread_name(&name);
                    seccomp::probe(Some(kind));
                    body();
                }
            })?;
        Ok(SpareThread { tx, kind, tid })
    }

    /// Restricts the waiting thread to host CPU `cpu` before its body is handed over, so
    /// that the wake-up that hands it over puts it there at once. Unpinned, it would wake
    /// where it last ran, wait there behind the thread handing over (and whatever else
    /// runs there) and only then move: ~0.1 ms in a scheduler trace of a restore whose
    /// vCPU starts pinned to the other CPU of a 2-CPU host. Best effort: a thread not
    /// running yet, or a refusal, leaves the pin to the body.
    fn pin_ahead(&self, cpu: usize) {
        let tid = self.tid.load(Ordering::Acquire);
        if tid != 0 {
            if let Err(e) = crate::vstate::vcpu::pin_thread(tid, cpu) {
                tracing::debug!("a spare thread stays unpinned until it runs: {e}");
            }
        }
    }

    /// A runner that hands the body to this thread.
    pub fn runner(self) -> ThreadRunner {
        Box::new(move |name, body| {
            self.tx
                .send((name, body))
                .map_err(|_| std::io::Error::other("the spare thread has gone"))
        })
    }
}

/// Names the calling thread (at most 15 bytes are kept).
fn set_thread_name(name: &str) {
    let mut buf = [0u8; 16];
    let n = name.len().min(15);
    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes from `buf`,
    // which outlives the call.
    unsafe { libc::prctl(libc::PR_SET_NAME, buf.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

/// A runner for a `kind` thread: a spare of that kind if there is one left, else one that
/// starts a new thread and confines it.
pub fn runner_for(spares: &mut Vec<SpareThread>, kind: ThreadKind) -> ThreadRunner {
    runner_for_on(spares, kind, None)
}

/// [`runner_for`], for a body that pins itself to host CPU `cpu` (if given): a spare is
/// pinned there before the body goes to it ([`SpareThread::pin_ahead`]).
pub fn runner_for_on(
    spares: &mut Vec<SpareThread>,
    kind: ThreadKind,
    cpu: Option<usize>,
) -> ThreadRunner {
    match spares.iter().position(|s| s.kind == kind) {
        Some(i) => {
            let spare = spares.swap_remove(i);
            if let Some(cpu) = cpu {
                spare.pin_ahead(cpu);
            }
            spare.runner()
        }
        None => seccomp::confine(kind, snapshot::spawn_thread()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_runs_its_body_under_the_given_name() {
        let s = SpareThread::start(ThreadKind::Helper).unwrap();
        let (tx, rx) = mpsc::channel();
        s.runner()(
            "clade-test".into(),
            Box::new(move || {
                let name = std::fs::read_to_string("/proc/thread-self/comm").unwrap();
                tx.send(name).unwrap();
            }),
        )
        .unwrap();
        assert_eq!(rx.recv().unwrap().trim(), "clade-test");
        // An unused spare ends when dropped.
        drop(SpareThread::start(ThreadKind::Helper).unwrap());
    }

    /// The CPUs the calling thread may run on, as a list.
    fn my_cpus() -> Vec<usize> {
        let set = crate::vstate::vcpu::current_thread_cpus().unwrap();
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: every index is below CPU_SETSIZE, inside `set`.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect()
    }

    #[test]
    fn a_spare_given_a_cpu_is_on_it_before_its_body_runs() {
        let cpu = *my_cpus().last().unwrap();
        let mut spares = vec![SpareThread::start(ThreadKind::Helper).unwrap()];
        // Pinning ahead needs the thread's ID, which it publishes once it runs.
        let t = std::time::Instant::now();
        while spares[0].tid.load(Ordering::Acquire) == 0 {
            assert!(t.elapsed() < std::time::Duration::from_secs(10));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let runner = runner_for_on(&mut spares, ThreadKind::Helper, Some(cpu));
        assert!(spares.is_empty(), "the spare was used");
        let (tx, rx) = mpsc::channel();
        // The body does not pin itself: whatever pin it has came before it ran.
        runner(
            "clade-test".into(),
            Box::new(move || tx.send(my_cpus()).unwrap()),
        )
        .unwrap();
        assert_eq!(rx.recv().unwrap(), vec![cpu]);
        // Without a CPU, nothing is pinned.
        let mut spares = vec![SpareThread::start(ThreadKind::Helper).unwrap()];
        let (tx, rx) = mpsc::channel();
        runner_for_on(&mut spares, ThreadKind::Helper, None)(
            "clade-test".into(),
            Box::new(move || tx.send(my_cpus()).unwrap()),
        )
        .unwrap();
        assert_eq!(rx.recv().unwrap(), my_cpus());
    }
}

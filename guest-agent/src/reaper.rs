//! The child reaper: reaps every child of the agent process (its own exec children and, as
//! PID 1 or a subreaper, every orphan in the guest) and keeps the exit statuses of the pids
//! someone registered to wait for.
//!
//! One thread waits with `waitid(P_ALL, WEXITED | WNOWAIT)`, which reports a dead child
//! without reaping it; it then takes the lock and reaps that pid with `waitpid`. So a pid
//! is freed (and can be reused) only while the lock is held and its status recorded at the
//! same moment: [`Reaper::with_live`] can signal a watched pid under the lock without ever
//! hitting a recycled pid, and a child forked under the lock ([`Reaper::spawn_watched`])
//! is registered before it can be reaped. No SIGCHLD handler is involved: the default
//! disposition keeps zombies until they are waited for, which is what this needs.
//!
//! Nothing else in the process may call `wait*` on its children: statuses would be stolen.

use std::collections::HashMap;
use std::io;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// Registry of watched pids and their raw wait statuses once they end.
pub struct Reaper {
    state: Mutex<State>,
    cond: Condvar,
}

#[derive(Default)]
struct State {
    /// Watched pid -> raw wait status once reaped.
    watched: HashMap<libc::pid_t, Option<libc::c_int>>,
    /// Set when a child was forked, so the reaper thread rechecks after ECHILD.
    spawned: bool,
}

static GLOBAL: OnceLock<&'static Reaper> = OnceLock::new();

impl Reaper {
    /// The process's reaper; the first call starts its thread.
    pub fn global() -> &'static Reaper {
        GLOBAL.get_or_init(|| {
            let r: &'static Reaper = Box::leak(Box::new(Reaper {
                state: Mutex::new(State::default()),
                cond: Condvar::new(),
            }));
            if let Err(e) = std::thread::Builder::new()
                .name("reaper".into())
                .spawn(move || r.run())
            {
                // Without the thread children stay zombies and waits never end; nothing
                // sensible can continue.
                tracing::error!("cannot start the reaper thread: {e}");
                std::process::abort();
            }
            r
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock leaves only plain data behind: keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self) {
        loop {
            // SAFETY: siginfo_t is plain data; all-zero is a valid value for waitid to fill.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waitid writes only into `info`, which is valid and writable.
            let rc =
                unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if rc != 0 {
                let err = io::Error::last_os_error();
                match err.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::ECHILD) => {
                        // No children: sleep until a fork (or a second, for safety).
                        let mut st = self.lock();
                        if !st.spawned {
                            st = self
                                .cond
                                .wait_timeout(st, Duration::from_secs(1))
                                .unwrap_or_else(|p| p.into_inner())
                                .0;
                        }
                        st.spawned = false;
                        continue;
                    }
                    _ => {
                        tracing::error!("waitid: {err}");
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                }
            }
            // SAFETY: waitid succeeded with WEXITED, so the siginfo holds a child's pid.
            let pid = unsafe { info.si_pid() };
            let mut st = self.lock();
            let mut status: libc::c_int = 0;
            // SAFETY: waitpid writes only into `status`.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                match st.watched.get_mut(&pid) {
                    Some(slot) => {
                        *slot = Some(status);
                        self.cond.notify_all();
                    }
                    None => tracing::debug!(pid, status, "reaped orphan"),
                }
            }
        }
    }

    /// Runs `fork_fn` (which forks and returns the child's pid in the parent) with the
    /// lock held, and watches the new pid.
    pub fn spawn_watched<T>(
        &self,
        fork_fn: impl FnOnce() -> io::Result<(libc::pid_t, T)>,
    ) -> io::Result<(libc::pid_t, T)> {
        let mut st = self.lock();
        let (pid, extra) = fork_fn()?;
        st.watched.insert(pid, None);
        st.spawned = true;
        self.cond.notify_all();
        Ok((pid, extra))
    }

    /// Blocks until the watched `pid` has ended; returns its raw wait status and forgets it.
    /// `None` if `pid` is not watched.
    pub fn wait(&self, pid: libc::pid_t) -> Option<libc::c_int> {
        let mut st = self.lock();
        loop {
            match st.watched.get(&pid) {
                None => return None,
                Some(Some(status)) => {
                    let status = *status;
                    st.watched.remove(&pid);
                    return Some(status);
                }
                Some(None) => {
                    st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    /// Stops watching `pid` (its status, when it ends, is discarded).
    pub fn unwatch(&self, pid: libc::pid_t) {
        self.lock().watched.remove(&pid);
    }

    /// Runs `f` with the lock held if the watched `pid` has not been reaped yet (so the pid
    /// still names that process: safe to signal). `None` if it has ended or is not watched.
    pub fn with_live<R>(&self, pid: libc::pid_t, f: impl FnOnce() -> R) -> Option<R> {
        let st = self.lock();
        match st.watched.get(&pid) {
            Some(None) => Some(f()),
            _ => None,
        }
    }
}

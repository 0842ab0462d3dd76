//! A pool of pre-built VM shells ([`Shell`]) for one machine size, refilled by a background
//! thread, so that a restore finds its KVM VM, memory slots, irqchip and vCPUs ready.
//!
//! ```no_run
//! # fn main() -> vmm::Result<()> {
//! use vmm::{ShellPool, ShellSpec};
//! let pool = ShellPool::new(
//!     ShellSpec { kvm_device: "/dev/kvm".into(), mem_bytes: 256 << 20, vcpus: 1, dirty_log: true },
//!     4,
//! )?;
//! pool.wait_full(std::time::Duration::from_secs(5));
//! let shell = pool.take(); // Some(shell) while the pool has one
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::vstate::shell::{Shell, ShellSpec};

/// Largest pool accepted: each shell holds a KVM VM and its vCPU threads' fds.
pub const MAX_POOL_SIZE: usize = 64;

/// How long the refill thread waits after a shell was taken before building a new one:
/// building one is ~1-4 ms of mostly in-kernel work that would compete for the CPU with
/// the restore that just took a shell.
pub const REFILL_DELAY: Duration = Duration::from_millis(10);

struct PoolState {
    shells: VecDeque<Shell>,
    stop: bool,
    last_error: Option<String>,
    /// When a shell was last taken.
    last_take: Option<Instant>,
}

struct Inner {
    spec: ShellSpec,
    size: usize,
    state: Mutex<PoolState>,
    cv: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Keeps up to `size` shells of one [`ShellSpec`] ready. Dropping it stops the refill
/// thread and frees the shells.
pub struct ShellPool {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ShellPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShellPool")
            .field("spec", &self.inner.spec)
            .field("size", &self.inner.size)
            .field("ready", &self.ready())
            .finish()
    }
}

impl ShellPool {
    /// Starts a pool of `size` shells (1..=[`MAX_POOL_SIZE`]) and its refill thread. The
    /// first shell is built here, so a spec this host cannot build fails now.
    pub fn new(spec: ShellSpec, size: usize) -> Result<ShellPool> {
        if size == 0 || size > MAX_POOL_SIZE {
            return Err(Error::Config(format!(
                "pool size {size} out of range 1..={MAX_POOL_SIZE}"
            )));
        }
        let first = Shell::create(&spec)?;
        let inner = Arc::new(Inner {
            spec,
            size,
            state: Mutex::new(PoolState {
                shells: VecDeque::from([first]),
                stop: false,
                last_error: None,
                last_take: None,
            }),
            cv: Condvar::new(),
        });
        let i = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("clade-pool".into())
            .spawn(move || {
                crate::seccomp::confine_current_thread(crate::seccomp::ThreadKind::Helper);
                refill(&i)
            })
            .map_err(|source| Error::Io {
                context: "spawning the VM pool thread",
                source,
            })?;
        Ok(ShellPool {
            inner,
            thread: Some(thread),
        })
    }

    /// What the shells fit.
    pub fn spec(&self) -> &ShellSpec {
        &self.inner.spec
    }

    /// A ready shell, if there is one (the refill thread then builds a replacement).
    pub fn take(&self) -> Option<Shell> {
        let shell = {
            let mut st = self.inner.lock();
            st.last_take = Some(Instant::now());
            st.shells.pop_front()
        };
        self.inner.cv.notify_all();
        shell
    }

    /// Shells ready now.
    pub fn ready(&self) -> usize {
        self.inner.lock().shells.len()
    }

    /// The last error the refill thread met, if any.
    pub fn last_error(&self) -> Option<String> {
        self.inner.lock().last_error.clone()
    }

    /// Waits until the pool is full, at most `timeout`. Returns whether it is.
    pub fn wait_full(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.inner.lock();
        while st.shells.len() < self.inner.size {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .inner
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

fn refill(inner: &Inner) {
    // Building a shell is mostly kernel work (~4 ms here); it must not take CPU time from
    // the restore that just took a shell, or from running guests: only idle CPU time.
    crate::vstate::spare::run_at_idle_priority("VM pool");
    loop {
        {
            let mut st = inner.lock();
            loop {
                if st.stop {
                    return;
                }
                if st.shells.len() >= inner.size {
                    st = inner.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                    continue;
                }
                // Let a restore that just took a shell finish first.
                let quiet = st.last_take.map_or(REFILL_DELAY, |t| t.elapsed());
                if quiet >= REFILL_DELAY {
                    break;
                }
                st = inner
                    .cv
                    .wait_timeout(st, REFILL_DELAY - quiet)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        match Shell::create(&inner.spec) {
            Ok(shell) => {
                let mut st = inner.lock();
                st.shells.push_back(shell);
                st.last_error = None;
                inner.cv.notify_all();
            }
            Err(e) => {
                tracing::warn!("VM pool: building a shell failed: {e}");
                inner.lock().last_error = Some(e.to_string());
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

impl Drop for ShellPool {
    fn drop(&mut self) {
        self.inner.lock().stop = true;
        self.inner.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

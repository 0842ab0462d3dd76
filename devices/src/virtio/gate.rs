//! The pause gate between a virtio device and its worker on the event loop.
//!
//! The worker holds the gate's lock while it works, so whoever holds the lock knows the
//! worker is idle: that is how a snapshot or fork gets a consistent device (and guest memory
//! the device writes). Each device publishes its own progress `P` (queue positions, open
//! connections) under the same lock after every round of work.

use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard};

/// What the gate protects: whether the worker may run, plus the device's progress.
#[derive(Debug, Default)]
pub(crate) struct GateState<P> {
    /// False once the device was reset: the worker touches nothing any more.
    pub active: bool,
    /// True while the VM is being saved: the worker waits.
    pub paused: bool,
    /// Published by the worker after each round.
    pub progress: P,
}

// Field access on a guard reaches the device's progress directly (`g.position`).
impl<P> Deref for GateState<P> {
    type Target = P;
    fn deref(&self) -> &P {
        &self.progress
    }
}

impl<P> DerefMut for GateState<P> {
    fn deref_mut(&mut self) -> &mut P {
        &mut self.progress
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Gate<P> {
    state: Mutex<GateState<P>>,
    cv: Condvar,
}

impl<P: Default> Gate<P> {
    /// A gate the worker may pass.
    pub(crate) fn new_active() -> Self {
        Self {
            state: Mutex::new(GateState {
                active: true,
                paused: false,
                progress: P::default(),
            }),
            cv: Condvar::new(),
        }
    }
}

impl<P> Gate<P> {
    pub(crate) fn lock(&self) -> MutexGuard<'_, GateState<P>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For the worker: waits while paused; `None` once the device was reset.
    pub(crate) fn enter(&self) -> Option<MutexGuard<'_, GateState<P>>> {
        let mut g = self.lock();
        while g.active && g.paused {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.active.then_some(g)
    }

    /// Holds the worker (true) or lets it go on (false).
    pub(crate) fn set_paused(&self, paused: bool) {
        self.lock().paused = paused;
        self.cv.notify_all();
    }

    /// The device was reset: the worker must stop touching guest memory.
    pub(crate) fn deactivate(&self) {
        let mut g = self.lock();
        g.active = false;
        g.paused = false;
        self.cv.notify_all();
    }
}

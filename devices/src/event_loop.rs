//! The VMM's device event loop: one thread running an [`EventManager`] (epoll) over the file
//! descriptors of device back-ends (virtqueue ioeventfds, sockets, timers), so device work
//! never runs on vCPU threads.
//!
//! Devices add and remove their subscribers from any thread through a [`LoopHandle`]; the
//! requests run on the loop thread, in the order they were made.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;

use event_manager::{EventManager, MutEventSubscriber, RemoteEndpoint};

use crate::{Error, Result};

/// What the loop runs: any subscriber, owned by the loop.
pub type Subscriber = Box<dyn MutEventSubscriber + Send>;

/// The manager type of the loop (tests drive one directly with `run_with_timeout`).
pub type Manager = EventManager<Subscriber>;

/// Sends work to the loop thread from anywhere.
pub type LoopHandle = RemoteEndpoint<Subscriber>;

/// A running event loop thread. Dropping it stops the thread and drops every subscriber.
pub struct EventLoop {
    handle: LoopHandle,
    stop: Arc<AtomicBool>,
    /// Closed when the loop thread is done.
    done: Option<Receiver<()>>,
}

/// The lowest descriptor number free now (where the next open lands).
fn lowest_free_fd() -> Option<i32> {
    // SAFETY: F_DUPFD_CLOEXEC duplicates stdin's descriptor (or fails harmlessly) into the
    // lowest free number; it is closed again at once.
    let fd = unsafe { libc::fcntl(0, libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just created here and nothing else refers to it.
    unsafe { libc::close(fd) };
    Some(fd)
}

/// Runs `f` and makes the descriptors it opened close-on-exec. event-manager 0.4 opens its
/// wake-up eventfd without `EFD_CLOEXEC` and does not expose it; without this, every
/// process the VMM starts would inherit it. New descriptors take the lowest free numbers,
/// so only the few numbers from the lowest free one before `f` are looked at (this runs on
/// every restore: a scan of /proc/self/fd cost ~0.3 ms there). A descriptor another thread
/// opened there meanwhile is the VMM's too, and none of the VMM's is meant to be inherited
/// (fork children get their memory layers by clearing the flag after fork, in the child).
fn new_eventfds_cloexec<T>(f: impl FnOnce() -> T) -> T {
    let from = lowest_free_fd();
    let r = f();
    let Some(from) = from else {
        return r;
    };
    for fd in from..from + 8 {
        // SAFETY: F_GETFD only reads the descriptor's flags (fails on a closed number).
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
            // SAFETY: F_SETFD only sets the close-on-exec flag of that descriptor.
            unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) };
        }
    }
    r
}

impl EventLoop {
    /// Starts the loop thread.
    pub fn start(name: &str) -> Result<Self> {
        Self::start_on(name, snapshot::spawn_thread())
    }

    /// Starts the loop on the thread `runner` provides.
    pub fn start_on(name: &str, runner: snapshot::ThreadRunner) -> Result<Self> {
        let mut manager =
            new_eventfds_cloexec(Manager::new).map_err(|e| Error::EventLoop(e.to_string()))?;
        let handle = manager.remote_endpoint();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let (done_tx, done) = mpsc::sync_channel::<()>(0);
        runner(
            name.to_string(),
            Box::new(move || {
                // Dropped when the loop ends (or unwinds): the owner's cue.
                let _done = done_tx;
                while !flag.load(Ordering::SeqCst) {
                    // Returns 0 events on EINTR; other errors are epoll failures that would
                    // repeat, so give up rather than spin.
                    if let Err(e) = manager.run_with_timeout(-1) {
                        tracing::error!("device event loop failed: {e}");
                        break;
                    }
                }
                // Subscribers (and their sockets) are dropped here, on the loop thread.
                drop(manager);
            }),
        )
        .map_err(|e| Error::EventLoop(format!("spawning thread: {e}")))?;
        Ok(Self {
            handle,
            stop,
            done: Some(done),
        })
    }

    /// A handle to add or remove subscribers.
    pub fn handle(&self) -> LoopHandle {
        self.handle.clone()
    }
}

impl Drop for EventLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Err(e) = self.handle.kick() {
            tracing::error!("stopping the device event loop: {e}");
        }
        if let Some(done) = self.done.take() {
            // Only a disconnect arrives: the loop has ended, normally or by a panic.
            let _ = done.recv();
        }
    }
}

/// Adds `subscriber` on the loop thread; its id is stored in `slot` once added, so a later
/// [`remove_subscriber`] (which runs after this, in order) can find it.
pub fn add_subscriber(
    handle: &LoopHandle,
    subscriber: Subscriber,
    slot: Arc<std::sync::Mutex<Option<event_manager::SubscriberId>>>,
) -> Result<()> {
    handle
        .fire(move |ops| {
            let id = ops.add_subscriber(subscriber);
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
        })
        .map_err(|e| Error::EventLoop(format!("adding a subscriber: {e}")))
}

/// Removes (and drops, on the loop thread) the subscriber whose id is in `slot`.
pub fn remove_subscriber(
    handle: &LoopHandle,
    slot: Arc<std::sync::Mutex<Option<event_manager::SubscriberId>>>,
) -> Result<()> {
    handle
        .fire(move |ops| {
            if let Some(id) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                if let Err(e) = ops.remove_subscriber(id) {
                    tracing::warn!("removing a device subscriber: {e}");
                }
            }
        })
        .map_err(|e| Error::EventLoop(format!("removing a subscriber: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use event_manager::{EventOps, Events};
    use std::sync::Mutex;
    use std::time::Duration;
    use vmm_sys_util::epoll::EventSet;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    struct Counter {
        evt: EventFd,
        hits: Arc<Mutex<u64>>,
    }

    impl MutEventSubscriber for Counter {
        fn process(&mut self, _: Events, _: &mut EventOps) {
            if let Ok(n) = self.evt.read() {
                *self.hits.lock().unwrap() += n;
            }
        }
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.evt, EventSet::IN)).unwrap();
        }
    }

    use crate::virtio::test_util::wait_for;

    #[test]
    fn subscribers_run_on_the_loop_thread_and_are_removed_in_order() {
        let lp = EventLoop::start("test-loop").unwrap();
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let hits = Arc::new(Mutex::new(0));
        let slot = Arc::new(Mutex::new(None));
        let sub = Counter {
            evt: evt.try_clone().unwrap(),
            hits: hits.clone(),
        };
        add_subscriber(&lp.handle(), Box::new(sub), slot.clone()).unwrap();
        evt.write(3).unwrap();
        assert!(wait_for(|| *hits.lock().unwrap() == 3));
        remove_subscriber(&lp.handle(), slot.clone()).unwrap();
        assert!(wait_for(|| slot.lock().unwrap().is_none()));
        evt.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            *hits.lock().unwrap(),
            3,
            "a removed subscriber sees no events"
        );
        drop(lp); // joins the thread
    }
}

//! The lifecycle every virtio device's worker shares: activation, pause for a snapshot,
//! reset, and the queue positions a snapshot saves.
//!
//! A device's data path is a worker ([`QueueWorker`]) that the device hands to the VMM's
//! device event loop ([`crate::event_loop`]) when the driver activates it. The device keeps a
//! [`DeviceWorker`]: the subscriber's id on the loop and the pause gate between the two.
//!
//! The gate is a mutex the worker holds while it works, so whoever holds it knows the worker
//! is idle: that is how a snapshot or fork gets a consistent device (and the guest memory
//! the device writes). The worker publishes its queue positions (and the device's own
//! progress, such as vsock's open connections) under the same lock after every round, so a
//! paused device's positions are current. A reset deactivates the gate, so a worker still
//! on the loop touches nothing any more, and then removes it from the loop.
//!
//! Everything per event stays as cheap as before: one uncontended lock of the gate and the
//! worker's own code (monomorphized, no allocation, no extra lock).

use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use event_manager::{EventOps, Events, MutEventSubscriber, SubscriberId};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{QueuePosition, VirtQueue};
use crate::event_loop::{self, LoopHandle};
use crate::{Error, Result};

/// The device-specific part of a worker; [`DeviceWorker`] runs it on the event loop behind
/// the pause gate. The queue eventfds are registered, read and dispatched for it.
pub(crate) trait QueueWorker: Send + 'static {
    /// The device's name in log messages ("virtio-blk").
    const NAME: &'static str;
    /// What the worker publishes besides its queue positions.
    type Progress: Default + Send + 'static;

    /// The worker's queues, in queue order (their positions are published after each round).
    fn queues(&self) -> &[Queue];
    /// The queues' notification eventfds, in queue order.
    fn notifiers(&self) -> &[EventFd];
    /// Called once on the event loop, after the queue eventfds are registered and before
    /// the gate is entered: registers the worker's other descriptors.
    fn init(&mut self, _ops: &mut EventOps) {}
    /// The first round, on registration (work that arrived before it, unless the device was
    /// reset meanwhile).
    fn first_round(&mut self, ops: &mut EventOps) {
        self.run(ops);
    }
    /// Queue `q` was notified (its eventfd is already read); false if that needs no round.
    fn notified(&mut self, _q: usize) -> bool {
        true
    }
    /// An event on a descriptor that is not a queue eventfd; false if nothing is to be done
    /// now (an unknown descriptor: see [`unregister_unknown`]).
    fn on_event(&mut self, events: Events, ops: &mut EventOps) -> bool {
        unregister_unknown(Self::NAME, events.fd(), ops);
        false
    }
    /// One round of work on the queues.
    fn run(&mut self, ops: &mut EventOps);
    /// Publishes the device's own progress (called under the gate after every round).
    fn publish(&self, _progress: &mut Self::Progress) {}
    /// From now on guest memory is `mem` (the same guest memory, mapped elsewhere: see
    /// [`DeviceWorker::replace_memory`]). Called under the gate, between rounds.
    fn set_memory(&mut self, mem: crate::GuestMemory);
}

/// For an event on a descriptor the worker does not know: unregisters it (it would fire
/// again and again).
pub(crate) fn unregister_unknown(device: &str, fd: i32, ops: &mut EventOps) {
    tracing::warn!("{device}: event for unknown fd {fd}, unregistered");
    let _ = ops.remove(Events::empty_raw(fd));
}

/// Checks the queues the transport handed a device on activation: `N` of them, and those in
/// `required` (index, name) set up by the driver.
pub(crate) fn take_queues<const N: usize>(
    device: &str,
    queues: Vec<VirtQueue>,
    required: &[(usize, &str)],
) -> Result<[VirtQueue; N]> {
    let queues: [VirtQueue; N] = queues.try_into().map_err(|q: Vec<_>| {
        let s = if N == 1 { "" } else { "s" };
        Error::Virtio(format!("{device} needs {N} queue{s}, got {}", q.len()))
    })?;
    for &(i, name) in required {
        if !queues.get(i).is_some_and(|q| q.queue.ready()) {
            return Err(Error::Virtio(format!(
                "{device} {name} queue was not set up"
            )));
        }
    }
    Ok(queues)
}

/// What the gate protects.
#[derive(Debug)]
struct GateState<P> {
    /// False once the device was reset: the worker touches nothing any more.
    active: bool,
    /// True while the VM is being saved: the worker waits.
    paused: bool,
    /// Queue positions after the worker's last round (sized once, on activation).
    positions: Vec<QueuePosition>,
    /// The device's own progress after the worker's last round.
    progress: P,
    /// Guest memory the worker uses from its next round on (see
    /// [`DeviceWorker::replace_memory`]).
    memory: Option<crate::GuestMemory>,
}

/// The pause gate (see the module documentation).
#[derive(Debug)]
struct Gate<P> {
    state: Mutex<GateState<P>>,
    cv: Condvar,
}

impl<P: Default> Gate<P> {
    /// A gate the worker may pass, for a device with `queues` queues.
    fn new_active(queues: usize) -> Self {
        Self {
            state: Mutex::new(GateState {
                active: true,
                paused: false,
                positions: vec![QueuePosition::default(); queues],
                progress: P::default(),
                memory: None,
            }),
            cv: Condvar::new(),
        }
    }
}

impl<P> Gate<P> {
    fn lock(&self) -> MutexGuard<'_, GateState<P>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For the worker: waits while paused; `None` once the device was reset.
    fn enter(&self) -> Option<MutexGuard<'_, GateState<P>>> {
        let mut g = self.lock();
        while g.active && g.paused {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.active.then_some(g)
    }

    /// Holds the worker (true) or lets it go on (false). Taking the lock waits for a round
    /// of work in progress to end.
    fn set_paused(&self, paused: bool) {
        self.lock().paused = paused;
        self.cv.notify_all();
    }

    /// The device was reset: the worker must stop touching guest memory.
    fn deactivate(&self) {
        let mut g = self.lock();
        g.active = false;
        g.paused = false;
        self.cv.notify_all();
    }
}

/// The subscriber the event loop runs: a worker behind its gate.
struct Gated<W: QueueWorker> {
    gate: Arc<Gate<W::Progress>>,
    worker: W,
}

impl<W: QueueWorker> Gated<W> {
    fn publish(worker: &W, g: &mut GateState<W::Progress>) {
        for (p, q) in g.positions.iter_mut().zip(worker.queues()) {
            *p = QueuePosition {
                next_avail: q.next_avail(),
                next_used: q.next_used(),
            };
        }
        worker.publish(&mut g.progress);
    }
}

impl<W: QueueWorker> MutEventSubscriber for Gated<W> {
    fn init(&mut self, ops: &mut EventOps) {
        for (q, evt) in self.worker.notifiers().iter().enumerate() {
            if let Err(e) = ops.add(Events::new(evt, EventSet::IN)) {
                tracing::error!("{}: registering the queue {q} eventfd: {e}", W::NAME);
            }
        }
        self.worker.init(ops);
        let Some(mut g) = self.gate.enter() else {
            return;
        };
        if let Some(mem) = g.memory.take() {
            self.worker.set_memory(mem);
        }
        self.worker.first_round(ops);
        Self::publish(&self.worker, &mut g);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let Some(mut g) = self.gate.enter() else {
            return;
        };
        if let Some(mem) = g.memory.take() {
            self.worker.set_memory(mem);
        }
        let fd = events.fd();
        let queue = self
            .worker
            .notifiers()
            .iter()
            .position(|e| e.as_raw_fd() == fd);
        let run = match queue {
            Some(q) => {
                // Clear the notification; the queue itself says what is new.
                let _ = self.worker.notifiers()[q].read();
                self.worker.notified(q)
            }
            None => self.worker.on_event(events, ops),
        };
        if run {
            self.worker.run(ops);
        }
        Self::publish(&self.worker, &mut g);
    }
}

/// What a device keeps of its running worker.
struct Running<P> {
    gate: Arc<Gate<P>>,
    id: Arc<Mutex<Option<SubscriberId>>>,
}

/// A device's worker on the event loop: none until the driver activates the device, then
/// the running one until a reset. Dropping it lets a paused worker go (so it cannot block
/// the event loop's shutdown); the loop drops the worker itself.
pub(crate) struct DeviceWorker<W: QueueWorker> {
    event_loop: LoopHandle,
    running: Option<Running<W::Progress>>,
}

impl<W: QueueWorker> DeviceWorker<W> {
    /// No worker yet; workers will run on `event_loop`.
    pub(crate) fn new(event_loop: LoopHandle) -> Self {
        Self {
            event_loop,
            running: None,
        }
    }

    /// Fails if a worker runs (activated twice without a reset).
    fn ensure_stopped(&self) -> Result<()> {
        match self.running {
            Some(_) => Err(Error::Virtio(format!(
                "{} activated twice without a reset",
                W::NAME
            ))),
            None => Ok(()),
        }
    }

    /// Hands `worker` to the event loop (its first round runs there).
    pub(crate) fn start(&mut self, worker: W) -> Result<()> {
        self.ensure_stopped()?;
        let gate = Arc::new(Gate::new_active(worker.queues().len()));
        let subscriber = Gated {
            gate: Arc::clone(&gate),
            worker,
        };
        let id = Arc::new(Mutex::new(None));
        event_loop::add_subscriber(&self.event_loop, Box::new(subscriber), Arc::clone(&id))?;
        self.running = Some(Running { gate, id });
        Ok(())
    }

    /// Stops the worker (the device was reset): waits for a round in progress to end;
    /// afterwards the worker touches nothing, and it is removed from the loop. Returns
    /// whether a worker was running.
    pub(crate) fn stop(&mut self) -> bool {
        let Some(r) = self.running.take() else {
            return false;
        };
        r.gate.deactivate();
        if let Err(e) = event_loop::remove_subscriber(&self.event_loop, r.id) {
            tracing::error!("{} reset: {e}", W::NAME);
        }
        true
    }

    /// Holds the worker between two rounds (see [`super::VirtioDevice::pause`]).
    pub(crate) fn pause(&self) {
        if let Some(r) = &self.running {
            r.gate.set_paused(true);
        }
    }

    /// Hands a paused worker the guest memory it uses from its next round on: the same
    /// guest memory at another host address (its VM moved to a new mapping of it). The
    /// worker touches guest memory only between entering the gate and leaving it, and
    /// takes the new memory as it enters, so it never uses the old mapping afterwards.
    pub(crate) fn replace_memory(&self, mem: &crate::GuestMemory) {
        if let Some(r) = &self.running {
            r.gate.lock().memory = Some(mem.clone());
        }
    }

    /// Lets a paused worker go on.
    pub(crate) fn unpause(&self) {
        if let Some(r) = &self.running {
            r.gate.set_paused(false);
        }
    }

    /// The queue positions the worker published last; empty when none runs.
    pub(crate) fn queue_positions(&self) -> Vec<QueuePosition> {
        match &self.running {
            Some(r) => r.gate.lock().positions.clone(),
            None => Vec::new(),
        }
    }

    /// `f` of the progress the worker published last; `None` when none runs.
    pub(crate) fn progress<T>(&self, f: impl FnOnce(&W::Progress) -> T) -> Option<T> {
        self.running.as_ref().map(|r| f(&r.gate.lock().progress))
    }
}

impl<W: QueueWorker> Drop for DeviceWorker<W> {
    fn drop(&mut self) {
        self.unpause();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_loop::EventLoop;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    /// Counts its rounds (and publishes the count); no queues, one notifier.
    struct Counter {
        evt: [EventFd; 1],
        rounds: Arc<AtomicUsize>,
    }

    impl QueueWorker for Counter {
        const NAME: &'static str = "counter";
        type Progress = usize;
        fn queues(&self) -> &[Queue] {
            &[]
        }
        fn notifiers(&self) -> &[EventFd] {
            &self.evt
        }
        fn run(&mut self, _ops: &mut EventOps) {
            self.rounds.fetch_add(1, Ordering::SeqCst);
        }
        fn publish(&self, progress: &mut usize) {
            *progress = self.rounds.load(Ordering::SeqCst);
        }
        fn set_memory(&mut self, _mem: crate::GuestMemory) {}
    }

    use crate::virtio::test_util::wait_for;

    #[test]
    fn a_worker_runs_pauses_resumes_and_stops() {
        let lp = EventLoop::start("worker-test").unwrap();
        let mut dw = DeviceWorker::<Counter>::new(lp.handle());
        assert!(dw.queue_positions().is_empty());
        assert_eq!(dw.progress(|p| *p), None);
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let rounds = Arc::new(AtomicUsize::new(0));
        let counter = || Counter {
            evt: [evt.try_clone().unwrap()],
            rounds: Arc::clone(&rounds),
        };
        dw.start(counter()).unwrap();
        assert!(dw.start(counter()).is_err(), "started twice");
        // The first round runs on registration and is published.
        assert!(wait_for(|| dw.progress(|p| *p) == Some(1)));

        evt.write(1).unwrap();
        assert!(wait_for(|| dw.progress(|p| *p) == Some(2)));

        // Paused: a notification waits; the published progress is current.
        dw.pause();
        evt.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(rounds.load(Ordering::SeqCst), 2);
        assert_eq!(dw.progress(|p| *p), Some(2));
        dw.unpause();
        assert!(wait_for(|| dw.progress(|p| *p) == Some(3)));

        // Stopped: nothing runs any more, and a new worker can start.
        assert!(dw.stop());
        assert!(!dw.stop());
        evt.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(rounds.load(Ordering::SeqCst), 3);
        assert_eq!(dw.progress(|p| *p), None);
        // Its first round, then the notification left unread by the stopped one.
        dw.start(counter()).unwrap();
        assert!(wait_for(|| dw.progress(|p| *p) == Some(5)));

        // Dropped while paused with work pending: the loop still shuts down.
        dw.pause();
        evt.write(1).unwrap();
        drop(dw);
        drop(lp);
    }
}

//! The interrupt line a device raises: an eventfd that the VMM registered as a KVM irqfd.
//!
//! The VMM can put another eventfd behind a line while the device keeps it
//! ([`IrqLine::replace`]): a VM that moves onto another KVM VM (a fork's parent, a
//! copy-on-write snapshot) has new eventfds registered there ahead, and switching the lines
//! is all its pause does for interrupts. KVM accepts an eventfd as the irqfd of one VM only,
//! and taking an irqfd off a VM waits for KVM's cleanup work (tens of microseconds each
//! here), so moving the registrations themselves in the pause cost 60-250 us.

use std::sync::{Arc, RwLock};

use vmm_sys_util::eventfd::EventFd;

/// One interrupt line, shared by the device that raises it and the VMM that wires it.
/// Cloning shares the line.
#[derive(Debug, Clone)]
pub struct IrqLine(Arc<RwLock<EventFd>>);

impl IrqLine {
    /// A line raised through `evt`.
    pub fn new(evt: EventFd) -> Self {
        IrqLine(Arc::new(RwLock::new(evt)))
    }

    /// Raises the interrupt (one irqfd signal: an edge).
    pub fn trigger(&self) -> std::io::Result<()> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).write(1)
    }

    /// Runs `f` with the eventfd behind the line (to register or unregister it with KVM).
    pub fn with<R>(&self, f: impl FnOnce(&EventFd) -> R) -> R {
        f(&self.0.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// From now on the line is raised through `evt`; returns the eventfd it had.
    pub fn replace(&self, evt: EventFd) -> EventFd {
        std::mem::replace(&mut self.0.write().unwrap_or_else(|e| e.into_inner()), evt)
    }
}

impl From<EventFd> for IrqLine {
    fn from(evt: EventFd) -> Self {
        IrqLine::new(evt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    #[test]
    fn a_replaced_line_raises_the_new_eventfd_only() {
        let first = EventFd::new(EFD_NONBLOCK).unwrap();
        let line = IrqLine::new(first.try_clone().unwrap());
        let device_side = line.clone();
        device_side.trigger().unwrap();
        assert_eq!(first.read().unwrap(), 1);

        let second = EventFd::new(EFD_NONBLOCK).unwrap();
        let old = line.replace(second.try_clone().unwrap());
        device_side.trigger().unwrap();
        assert_eq!(second.read().unwrap(), 1);
        assert!(first.read().is_err(), "the old eventfd was raised again");
        // The old eventfd comes back: the same file as `first`.
        old.write(1).unwrap();
        assert_eq!(first.read().unwrap(), 1);
    }
}

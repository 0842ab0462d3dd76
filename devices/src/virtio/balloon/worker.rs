//! The virtio-balloon data path: the worker that takes reported free ranges and inflated
//! pages off the queues, checks them against guest RAM and discards them (run on the event
//! loop behind the pause gate, see `virtio::worker`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use event_manager::EventOps;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use super::{
    BalloonStats, Discard, DEFLATE_QUEUE, INFLATE_QUEUE, MAX_PFN_BYTES, PAGE, REPORTING_QUEUE,
};
use crate::virtio::mmio::LogLimiter;
use crate::virtio::worker::QueueWorker;
use crate::virtio::{Interrupt, VirtQueue};
use crate::GuestMemory;

/// Most chains completed per queue in one turn on the event loop before the others run.
const ROUND_CHAINS: usize = 64;

macro_rules! guest_warn {
    ($self:expr, $($arg:tt)*) => {
        if $self.log.allow() {
            tracing::warn!($($arg)*);
        }
    };
}

type Chain<'a> = DescriptorChain<&'a GuestMemory>;

/// Why a guest range cannot be discarded.
pub(crate) fn check_range(mem: &GuestMemory, addr: u64, len: u64) -> Result<(), String> {
    if len == 0 {
        return Err(format!("empty range at {addr:#x}"));
    }
    if !addr.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) {
        return Err(format!("{len:#x} bytes at {addr:#x}: not page-aligned"));
    }
    let end = addr
        .checked_add(len)
        .ok_or_else(|| format!("{len:#x} bytes at {addr:#x} wrap"))?;
    // Every byte in some region (regions may abut): walk them.
    let mut at = addr;
    while at < end {
        let Some(r) = mem.find_region(GuestAddress(at)) else {
            return Err(format!(
                "{len:#x} bytes at {addr:#x}: {at:#x} is not guest RAM"
            ));
        };
        let rend = r.start_addr().0.saturating_add(r.len());
        at = rend.min(end);
    }
    Ok(())
}

/// The device's work, owned by the event loop while the device is active.
pub struct BalloonWorker {
    mem: GuestMemory,
    queues: [Queue; 3],
    evts: [EventFd; 3],
    interrupt: Arc<Interrupt>,
    discard: Arc<dyn Discard>,
    stats: Arc<BalloonStats>,
    log: LogLimiter,
    /// Page frame numbers read from an inflate chain (reused).
    pfns: Vec<u8>,
}

impl BalloonWorker {
    pub(crate) fn new(
        mem: GuestMemory,
        queues: [VirtQueue; 3],
        interrupt: Arc<Interrupt>,
        discard: Arc<dyn Discard>,
        stats: Arc<BalloonStats>,
        log: LogLimiter,
    ) -> Self {
        let [a, b, c] = queues;
        Self {
            mem,
            queues: [a.queue, b.queue, c.queue],
            evts: [a.notify, b.notify, c.notify],
            interrupt,
            discard,
            stats,
            log,
            pfns: Vec::new(),
        }
    }

    /// Discards `len` bytes at `addr` if they are free guest RAM; false if refused.
    fn discard(&self, mem: &GuestMemory, addr: u64, len: u64, what: &str) -> bool {
        let r = check_range(mem, addr, len).and_then(|()| {
            self.discard
                .discard(mem, GuestAddress(addr), len)
                .map_err(|e| e.to_string())
        });
        match r {
            Ok(()) => true,
            Err(why) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                guest_warn!(self, "virtio-balloon: {what} refused: {why}");
                false
            }
        }
    }

    /// A reporting chain: each descriptor is a free range.
    fn report(&self, mem: &GuestMemory, chain: Chain<'_>) {
        for d in chain {
            let (addr, len) = (d.addr().0, u64::from(d.len()));
            if self.discard(mem, addr, len, "reported range") {
                self.stats.reported_bytes.fetch_add(len, Ordering::Relaxed);
            }
        }
    }

    /// An inflate chain: device-readable arrays of `le32` page frame numbers.
    fn inflate(&mut self, mem: &GuestMemory, chain: Chain<'_>) {
        let mut pfns = std::mem::take(&mut self.pfns);
        pfns.clear();
        for d in chain {
            if d.is_write_only() {
                continue;
            }
            let room = MAX_PFN_BYTES - pfns.len();
            let n = (d.len() as usize).min(room);
            if n < d.len() as usize {
                guest_warn!(
                    self,
                    "virtio-balloon: inflate chain over {MAX_PFN_BYTES} bytes, the rest ignored"
                );
            }
            let at = pfns.len();
            pfns.resize(at + n, 0);
            if let Err(e) = mem.read_slice(&mut pfns[at..], d.addr()) {
                guest_warn!(self, "virtio-balloon: inflate buffer: {e}");
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                pfns.truncate(at);
            }
            if pfns.len() == MAX_PFN_BYTES {
                break;
            }
        }
        // Runs of consecutive pages, one discard each.
        let mut run: Option<(u64, u64)> = None;
        let words = pfns
            .chunks_exact(4)
            .map(|b| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        for pfn in words.map(Some).chain(std::iter::once(None)) {
            match (run, pfn) {
                (Some((start, n)), Some(p)) if p == start + n => run = Some((start, n + 1)),
                (r, p) => {
                    if let Some((start, n)) = r {
                        if self.discard(mem, start * PAGE, n * PAGE, "inflated page") {
                            self.stats
                                .inflated_bytes
                                .fetch_add(n * PAGE, Ordering::Relaxed);
                        }
                    }
                    run = p.map(|p| (p, 1));
                }
            }
        }
        self.pfns = pfns;
    }

    /// Completes up to [`ROUND_CHAINS`] chains of queue `q`; true if any was completed.
    fn process(&mut self, q: usize) -> bool {
        let mem = self.mem.clone();
        let mut used = false;
        for _ in 0..ROUND_CHAINS {
            let Some(chain) = self.queues[q].pop_descriptor_chain(&mem) else {
                return used;
            };
            let head = chain.head_index();
            match q {
                REPORTING_QUEUE => self.report(&mem, chain),
                INFLATE_QUEUE => self.inflate(&mem, chain),
                _ => {}
            }
            if let Err(e) = self.queues[q].add_used(&mem, head, 0) {
                guest_warn!(self, "virtio-balloon: used ring of queue {q}: {e}");
            }
            used = true;
        }
        // Budget used up: the rest on the next turn (a spurious wake-up if nothing is left).
        if let Err(e) = self.evts[q].write(1) {
            tracing::error!("virtio-balloon: rescheduling queue {q}: {e}");
        }
        used
    }
}

impl QueueWorker for BalloonWorker {
    const NAME: &'static str = "virtio-balloon";
    type Progress = ();

    fn queues(&self) -> &[Queue] {
        &self.queues
    }

    fn notifiers(&self) -> &[EventFd] {
        &self.evts
    }

    fn set_memory(&mut self, mem: GuestMemory) {
        self.mem = mem;
    }

    fn run(&mut self, _ops: &mut EventOps) {
        let mut used = false;
        for q in [REPORTING_QUEUE, INFLATE_QUEUE, DEFLATE_QUEUE] {
            if self.queues[q].ready() {
                used |= self.process(q);
            }
        }
        let mem = &self.mem;
        // Without EVENT_IDX this is always true; an unreadable ring: notify anyway.
        if used
            && self
                .queues
                .iter_mut()
                .any(|q| q.ready() && q.needs_notification(mem).unwrap_or(true))
        {
            self.interrupt.signal_used_queue();
        }
    }
}

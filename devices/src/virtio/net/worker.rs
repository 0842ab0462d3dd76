//! The virtio-net data path: the worker that moves frames between the backend and the
//! guest's receive and transmit queues (run on the event loop, see `virtio::worker`).

use std::io::{ErrorKind, Write};
use std::sync::Arc;

use event_manager::{EventOps, Events};
use virtio_bindings::virtio_net::VIRTIO_NET_F_MRG_RXBUF;
use virtio_queue::{DescriptorChain, Queue, QueueT, Reader, Writer};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{
    offloads_for, NetBackend, NetStats, VnetHeader, MAX_FRAME_LEN, QUEUE_SIZE, ROUND_FRAMES,
    RX_QUEUE, TX_QUEUE, VNET_HDR_LEN,
};
use crate::virtio::mmio::LogLimiter;
use crate::virtio::worker::{unregister_unknown, QueueWorker};
use crate::virtio::{Interrupt, VirtQueue};
use crate::GuestMemory;

macro_rules! guest_warn {
    ($self:expr, $($arg:tt)*) => {
        if $self.log.allow() {
            tracing::warn!($($arg)*);
        }
    };
}

type Chain<'a> = DescriptorChain<&'a GuestMemory>;
/// Slices of guest memory (writes through them are recorded in the dirty bitmap).
type Bs<'a> = vm_memory::bitmap::BS<'a, vm_memory::bitmap::AtomicBitmap>;

/// Most descriptors in one chain (a longer one is refused before any buffer is mapped).
const MAX_CHAIN_DESCRIPTORS: u32 = QUEUE_SIZE as u32;

/// What became of a frame offered to the receive queue.
#[derive(Debug, PartialEq, Eq)]
enum Delivery {
    /// In guest memory, its chains in the used ring.
    Done,
    /// Dropped; `used` says whether chains went to the used ring (returned with length 0).
    Dropped { used: bool },
    /// Not enough buffers posted: nothing was taken; try again when the driver adds some.
    NoBuffers,
}

/// The device's work, owned by the event loop while the device is active.
pub struct NetWorker {
    mem: GuestMemory,
    queues: [Queue; 2],
    evts: [EventFd; 2],
    interrupt: Arc<Interrupt>,
    backend: Arc<dyn NetBackend>,
    features: u64,
    /// A frame read from the backend, waiting for receive buffers.
    rx_frame: Vec<u8>,
    rx_pending: Option<usize>,
    tx_frame: Vec<u8>,
    /// The backend's descriptor is registered with the event loop (not while a frame waits
    /// for receive buffers: it would poll readable again and again).
    backend_polled: bool,
    /// Chains taken for the frame being received: (head, used length).
    heads: Vec<(u16, u32)>,
    stats: Arc<NetStats>,
    log: LogLimiter,
}

impl NetWorker {
    /// Logs guest-triggered warnings through `log` (the device's, shared by its workers).
    pub(crate) fn with_log(mut self, log: LogLimiter) -> Self {
        self.log = log;
        self
    }

    pub(crate) fn new(
        mem: GuestMemory,
        queues: [VirtQueue; 2],
        interrupt: Arc<Interrupt>,
        backend: Arc<dyn NetBackend>,
        features: u64,
        stats: Arc<NetStats>,
    ) -> Self {
        let [rx, tx] = queues;
        Self {
            mem,
            queues: [rx.queue, tx.queue],
            evts: [rx.notify, tx.notify],
            interrupt,
            backend,
            features,
            rx_frame: vec![0; MAX_FRAME_LEN],
            rx_pending: None,
            tx_frame: vec![0; MAX_FRAME_LEN],
            backend_polled: false,
            heads: Vec::with_capacity(usize::from(QUEUE_SIZE)),
            stats,
            log: LogLimiter::new(),
        }
    }

    fn mergeable(&self) -> bool {
        self.features & (1u64 << VIRTIO_NET_F_MRG_RXBUF) != 0
    }

    fn set_backend_polled(&mut self, on: bool, ops: &mut EventOps) {
        if self.backend_polled == on {
            return;
        }
        let fd = self.backend.raw_fd();
        let r = if on {
            ops.add(Events::new_raw(fd, EventSet::IN))
        } else {
            ops.remove(Events::empty_raw(fd))
        };
        match r {
            Ok(()) => self.backend_polled = on,
            Err(e) => tracing::error!("virtio-net: epoll update for the backend: {e}"),
        }
    }

    /// Sends the available transmit chains to the backend, at most [`ROUND_FRAMES`]; when
    /// the budget is used up the worker notifies itself for the rest. Returns whether
    /// chains were used.
    fn process_tx(&mut self) -> bool {
        let mem = self.mem.clone();
        let mut used = false;
        for _ in 0..ROUND_FRAMES {
            let Some(chain) = self.queues[TX_QUEUE].pop_descriptor_chain(&mem) else {
                return used;
            };
            let head = chain.head_index();
            match self.transmit(&mem, chain) {
                Ok(()) => NetStats::count(&self.stats.tx_frames),
                Err(why) => {
                    guest_warn!(self, "virtio-net: transmitted frame dropped: {why}");
                    NetStats::count(&self.stats.tx_dropped);
                }
            }
            if let Err(e) = self.queues[TX_QUEUE].add_used(&mem, head, 0) {
                guest_warn!(self, "virtio-net: transmit used ring: {e}");
            }
            used = true;
        }
        // The rest on the next turn (a spurious wake-up if nothing is left).
        if let Err(e) = self.evts[TX_QUEUE].write(1) {
            tracing::error!("virtio-net: rescheduling the transmit queue: {e}");
        }
        used
    }

    /// Checks one transmit chain, copies its frame out and sends it.
    fn transmit(&mut self, mem: &GuestMemory, chain: Chain<'_>) -> Result<(), String> {
        let len = check_tx_chain(&chain)?;
        let mut reader: Reader<'_, Bs<'_>> =
            Reader::new(mem, chain).map_err(|e| format!("buffers: {e}"))?;
        let frame = &mut self.tx_frame[..len];
        std::io::Read::read_exact(&mut reader, frame).map_err(|e| format!("reading: {e}"))?;
        let hdr = VnetHeader::parse(frame).ok_or("no vnet header")?;
        hdr.check_tx(self.features)?;
        match self.backend.send(frame) {
            Ok(_) => Ok(()),
            // The host side cannot take it now: dropped, as a NIC would.
            Err(e) if e.kind() == ErrorKind::WouldBlock => Err("backend busy".into()),
            Err(e) => {
                // The host kernel refusing a frame (a bad GSO header, the TAP down) is the
                // guest's business; other errors are logged by the same limiter.
                Err(format!("backend: {e}"))
            }
        }
    }

    /// Moves frames from the backend into receive buffers, at most [`ROUND_FRAMES`] per
    /// turn (the backend polls readable again for the rest). Returns whether chains were
    /// used.
    fn process_rx(&mut self, ops: &mut EventOps) -> bool {
        let mut used = false;
        for _ in 0..ROUND_FRAMES {
            let len = match self.rx_pending.take() {
                Some(len) => len,
                None => match self.backend.recv(&mut self.rx_frame) {
                    Ok(len) => len,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        if self.log.allow() {
                            tracing::error!("virtio-net: reading the backend: {e}");
                        }
                        break;
                    }
                },
            };
            if len < VNET_HDR_LEN {
                tracing::debug!("virtio-net: {len}-byte frame from the backend, dropped");
                NetStats::count(&self.stats.rx_dropped);
                continue;
            }
            match self.deliver(len) {
                Delivery::Done => {
                    NetStats::count(&self.stats.rx_frames);
                    used = true;
                }
                Delivery::Dropped { used: u } => {
                    NetStats::count(&self.stats.rx_dropped);
                    used |= u;
                }
                Delivery::NoBuffers => {
                    self.rx_pending = Some(len);
                    self.set_backend_polled(false, ops);
                    return used;
                }
            }
        }
        self.set_backend_polled(true, ops);
        used
    }

    /// Puts the `len`-byte frame in `rx_frame` (vnet header first) into receive chains.
    fn deliver(&mut self, len: usize) -> Delivery {
        let mem = self.mem.clone();
        let mergeable = self.mergeable();
        let queue_size = usize::from(self.queues[RX_QUEUE].size());
        let start = self.queues[RX_QUEUE].next_avail();
        self.heads.clear();
        let mut hdr_writer: Option<Writer<'_, Bs<'_>>> = None;
        let mut off = VNET_HDR_LEN;
        while hdr_writer.is_none() || off < len {
            if self.heads.len() >= queue_size {
                guest_warn!(
                    self,
                    "virtio-net: a {len}-byte frame does not fit in the whole receive ring: \
                     dropped"
                );
                self.queues[RX_QUEUE].set_next_avail(start);
                return Delivery::Dropped { used: false };
            }
            let Some(chain) = self.queues[RX_QUEUE].pop_descriptor_chain(&mem) else {
                self.queues[RX_QUEUE].set_next_avail(start);
                return Delivery::NoBuffers;
            };
            let head = chain.head_index();
            let first = hdr_writer.is_none();
            let writer = check_rx_chain(&chain)
                .and_then(|()| Writer::new(&mem, chain).map_err(|e| format!("buffers: {e}")));
            let mut w: Writer<'_, Bs<'_>> = match writer {
                Ok(w) if !first || w.available_bytes() >= VNET_HDR_LEN => w,
                Ok(w) => {
                    return self.drop_rx(
                        &mem,
                        head,
                        format!(
                            "{}-byte first buffer, shorter than the header",
                            w.available_bytes()
                        ),
                    )
                }
                Err(why) => return self.drop_rx(&mem, head, why),
            };
            let mut taken = 0;
            if first {
                match w.split_at(VNET_HDR_LEN) {
                    Ok(data) => {
                        hdr_writer = Some(w);
                        w = data;
                        taken = VNET_HDR_LEN;
                    }
                    Err(e) => return self.drop_rx(&mem, head, format!("header: {e}")),
                }
            }
            let n = w.available_bytes().min(len - off);
            if let Err(e) = w.write_all(&self.rx_frame[off..off + n]) {
                return self.drop_rx(&mem, head, format!("writing: {e}"));
            }
            off += n;
            taken += n;
            self.heads
                .push((head, u32::try_from(taken).unwrap_or(u32::MAX)));
            if !mergeable && off < len {
                guest_warn!(
                    self,
                    "virtio-net: a {len}-byte frame does not fit in a {taken}-byte receive \
                     buffer (no mergeable buffers): dropped"
                );
                self.queues[RX_QUEUE].set_next_avail(start);
                return Delivery::Dropped { used: false };
            }
        }
        let mut hdr = VnetHeader::parse(&self.rx_frame[..len]).unwrap_or_default();
        hdr.num_buffers = u16::try_from(self.heads.len()).unwrap_or(u16::MAX);
        if let Some(mut w) = hdr_writer {
            if let Err(e) = w.write_all(&hdr.to_bytes()) {
                // Cannot happen: the header's 12 bytes were checked to be there.
                tracing::error!("virtio-net: writing the receive header: {e}");
            }
        }
        for &(head, n) in &self.heads {
            if let Err(e) = self.queues[RX_QUEUE].add_used(&mem, head, n) {
                guest_warn!(self, "virtio-net: receive used ring: {e}");
            }
        }
        Delivery::Done
    }

    /// A bad receive chain (`head`): it and the chains already taken for the frame go back
    /// with length 0, and the frame is dropped.
    fn drop_rx(&mut self, mem: &GuestMemory, head: u16, why: String) -> Delivery {
        guest_warn!(
            self,
            "virtio-net: receive chain {head} refused, frame dropped: {why}"
        );
        self.heads.push((head, 0));
        for &(h, _) in &self.heads {
            if let Err(e) = self.queues[RX_QUEUE].add_used(mem, h, 0) {
                guest_warn!(self, "virtio-net: receive used ring: {e}");
            }
        }
        Delivery::Dropped { used: true }
    }
}

/// A transmit chain's shape: device-readable descriptors only, at most
/// [`MAX_CHAIN_DESCRIPTORS`], a vnet header and at most [`MAX_FRAME_LEN`] bytes, and a chain
/// that ends. Returns its length. Reads only the descriptors.
fn check_tx_chain(chain: &Chain<'_>) -> Result<usize, String> {
    let (count, bytes, last_has_next) = walk(chain, false)?;
    if count == 0 {
        return Err("empty or unreadable descriptor chain".into());
    }
    if last_has_next {
        return Err(format!("descriptor chain broken after {count} descriptors"));
    }
    if bytes < VNET_HDR_LEN as u64 {
        return Err(format!("{bytes} bytes, shorter than the vnet header"));
    }
    if bytes > MAX_FRAME_LEN as u64 {
        return Err(format!("{bytes} bytes, longer than {MAX_FRAME_LEN}"));
    }
    Ok(bytes as usize)
}

/// A receive chain's shape: device-writable descriptors only, at most
/// [`MAX_CHAIN_DESCRIPTORS`], at least one byte, and a chain that ends.
fn check_rx_chain(chain: &Chain<'_>) -> Result<(), String> {
    let (count, bytes, last_has_next) = walk(chain, true)?;
    if count == 0 {
        return Err("empty or unreadable descriptor chain".into());
    }
    if last_has_next {
        return Err(format!("descriptor chain broken after {count} descriptors"));
    }
    if bytes == 0 {
        return Err("zero-length buffer".into());
    }
    Ok(())
}

/// Walks the chain (bounded by the iterator: at most the queue size, or one indirect
/// table); returns (descriptors, bytes, whether the last one still had NEXT). Each
/// descriptor must be device-writable exactly when `writable`.
fn walk(chain: &Chain<'_>, writable: bool) -> Result<(u32, u64, bool), String> {
    let (mut count, mut bytes, mut last_has_next) = (0u32, 0u64, false);
    for d in chain.clone() {
        if d.is_write_only() != writable {
            return Err(format!(
                "a device-{} descriptor in a {} chain",
                if writable { "readable" } else { "writable" },
                if writable { "receive" } else { "transmit" }
            ));
        }
        count += 1;
        if count > MAX_CHAIN_DESCRIPTORS {
            return Err(format!("more than {MAX_CHAIN_DESCRIPTORS} descriptors"));
        }
        bytes += u64::from(d.len());
        last_has_next = d.has_next();
    }
    Ok((count, bytes, last_has_next))
}

impl QueueWorker for NetWorker {
    const NAME: &'static str = "virtio-net";
    type Progress = ();

    fn queues(&self) -> &[Queue] {
        &self.queues
    }

    fn notifiers(&self) -> &[EventFd] {
        &self.evts
    }

    fn init(&mut self, _ops: &mut EventOps) {
        // On the event loop thread (not the vCPU that activated the device): the offloads
        // the guest accepted (within the ones offered, which the backend takes: the
        // transport refuses features it did not offer).
        let offloads = offloads_for(self.features);
        if let Err(e) = self.backend.set_offloads(offloads) {
            tracing::error!("virtio-net: setting the backend's offloads {offloads:#x}: {e}");
        }
    }

    fn first_round(&mut self, ops: &mut EventOps) {
        self.set_backend_polled(true, ops);
        self.run(ops);
    }

    fn on_event(&mut self, events: Events, ops: &mut EventOps) -> bool {
        if events.fd() == self.backend.raw_fd() {
            return true;
        }
        unregister_unknown(Self::NAME, events.fd(), ops);
        false
    }

    /// Both directions until neither moves, then one interrupt if buffers were used.
    fn set_memory(&mut self, mem: GuestMemory) {
        self.mem = mem;
    }

    fn run(&mut self, ops: &mut EventOps) {
        let tx = self.process_tx();
        let rx = self.process_rx(ops);
        let mem = &self.mem;
        let mut notify = false;
        for (q, used) in [(RX_QUEUE, rx), (TX_QUEUE, tx)] {
            if used {
                // Without EVENT_IDX this is always true; an unreadable ring: notify anyway.
                notify |= self.queues[q].needs_notification(mem).unwrap_or(true);
            }
        }
        if notify {
            self.interrupt.signal_used_queue();
        }
    }
}

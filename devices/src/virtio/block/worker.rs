//! The virtio-blk data path: the worker that takes requests off the queue, checks them,
//! and does the disk I/O (run on the event loop behind the pause gate, see `virtio::worker`).

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};

use crate::GuestMemory;
use event_manager::EventOps;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_queue::{DescriptorChain, Queue, QueueT, Reader, Writer};
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::{HDR_BYTES, ID_BYTES, MAX_REQUEST_BYTES, ROUND_BYTES, SECTOR_SIZE, SEG_MAX, SIZE_MAX};
use crate::virtio::mmio::LogLimiter;
use crate::virtio::worker::QueueWorker;
use crate::virtio::{Interrupt, VirtQueue};

/// Size of the request header (`struct virtio_blk_outhdr`: type, reserved, sector).
const HDR_SIZE: usize = HDR_BYTES as usize;
/// Most requests completed in one turn on the event loop (see [`ROUND_BYTES`]).
const ROUND_REQUESTS: usize = 64;
/// Largest bounce buffer between the disk and guest memory.
const MAX_CHUNK: usize = 256 * 1024;

macro_rules! guest_warn {
    ($self:expr, $($arg:tt)*) => {
        if $self.log.allow() {
            tracing::warn!($($arg)*);
        }
    };
}

/// A request that cannot even be answered (no status byte to write).
#[derive(Debug)]
struct Unanswerable(String);

/// The device's work, owned by the event loop while the device is active.
pub struct BlockWorker {
    mem: GuestMemory,
    queue: Queue,
    evt: EventFd,
    interrupt: Arc<Interrupt>,
    disk: Arc<Mutex<disk::Disk>>,
    serial: [u8; ID_BYTES],
    buf: Vec<u8>,
    log: LogLimiter,
}

type Chain<'a> = DescriptorChain<&'a GuestMemory>;
/// Slices of guest memory (writes through them are recorded in the dirty bitmap).
type Bs<'a> = vm_memory::bitmap::BS<'a, vm_memory::bitmap::AtomicBitmap>;

impl BlockWorker {
    /// Logs guest-triggered warnings through `log` (the device's, shared by its workers).
    pub(crate) fn with_log(mut self, log: LogLimiter) -> Self {
        self.log = log;
        self
    }

    pub(crate) fn new(
        mem: GuestMemory,
        queue: VirtQueue,
        interrupt: Arc<Interrupt>,
        disk: Arc<Mutex<disk::Disk>>,
        serial: [u8; ID_BYTES],
    ) -> Self {
        Self {
            mem,
            queue: queue.queue,
            evt: queue.notify,
            interrupt,
            disk,
            serial,
            buf: Vec::new(),
            log: LogLimiter::new(),
        }
    }

    /// Completes the available requests, at most [`ROUND_BYTES`] of data or
    /// [`ROUND_REQUESTS`] requests per call; interrupts the guest if any was completed. When
    /// the round's budget is used up the worker notifies itself and returns, so the event
    /// loop serves the other devices before the rest of the queue.
    fn process_queue(&mut self) {
        let mem = self.mem.clone();
        let mut used = false;
        let (mut bytes, mut requests) = (0u64, 0usize);
        while let Some(chain) = self.queue.pop_descriptor_chain(&mem) {
            let head = chain.head_index();
            let (len, cost) = match self.handle(&mem, chain) {
                Ok(done) => done,
                Err(Unanswerable(why)) => {
                    guest_warn!(self, "virtio-blk: request dropped: {why}");
                    (0, 0)
                }
            };
            if let Err(e) = self.queue.add_used(&mem, head, len) {
                guest_warn!(self, "virtio-blk: used ring: {e}");
            }
            used = true;
            bytes = bytes.saturating_add(cost);
            requests += 1;
            if bytes >= ROUND_BYTES || requests >= ROUND_REQUESTS {
                // The rest on the next turn (a spurious wake-up if nothing is left).
                if let Err(e) = self.evt.write(1) {
                    tracing::error!("virtio-blk: rescheduling the queue: {e}");
                }
                break;
            }
        }
        // Without EVENT_IDX this is always true; an unreadable ring: notify anyway.
        if used && self.queue.needs_notification(&mem).unwrap_or(true) {
            self.interrupt.signal_used_queue();
        }
    }

    /// Handles one request; returns the used length (bytes written to the guest, status
    /// byte included) and the request's data size (for the round's budget).
    fn handle(&mut self, mem: &GuestMemory, chain: Chain<'_>) -> Result<(u32, u64), Unanswerable> {
        // One walk over the descriptors, before any buffer is mapped or allocated for.
        let shape = check_shape(&chain).map_err(Unanswerable)?;
        if let Err(why) = shape.check_limits() {
            guest_warn!(self, "virtio-blk: request refused: {why}");
            // The status byte is the last byte of the last (device-writable) descriptor.
            let status = shape
                .status
                .ok_or_else(|| Unanswerable(format!("{why}, and no status byte")))?;
            mem.write_obj(VIRTIO_BLK_S_IOERR as u8, status)
                .map_err(|e| Unanswerable(format!("{why}; writing the status byte: {e}")))?;
            return Ok((1, 0));
        }
        let mut reader: Reader<'_, Bs<'_>> = Reader::new(mem, chain.clone())
            .map_err(|e| Unanswerable(format!("device-readable buffers: {e}")))?;
        let mut writer: Writer<'_, Bs<'_>> = Writer::new(mem, chain)
            .map_err(|e| Unanswerable(format!("device-writable buffers: {e}")))?;
        let writable = writer.available_bytes();
        if writable == 0 {
            return Err(Unanswerable("no device-writable status byte".into()));
        }
        let mut status_w = writer
            .split_at(writable - 1)
            .map_err(|e| Unanswerable(format!("status byte: {e}")))?;
        let mut hdr = [0u8; HDR_SIZE];
        let (status, written) = if reader.read_exact(&mut hdr).is_err() {
            guest_warn!(
                self,
                "virtio-blk: request header is {} bytes, not {HDR_SIZE}",
                reader.bytes_read()
            );
            (VIRTIO_BLK_S_IOERR, 0)
        } else {
            let type_ = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
            let mut s = [0u8; 8];
            s.copy_from_slice(&hdr[8..16]);
            let sector = u64::from_le_bytes(s);
            self.dispatch(type_, sector, &mut reader, &mut writer)
        };
        status_w
            .write_all(&[status as u8])
            .map_err(|e| Unanswerable(format!("writing the status byte: {e}")))?;
        let used = u32::try_from(written).unwrap_or(u32::MAX).saturating_add(1);
        Ok((used, shape.bytes))
    }

    /// Runs a request with a valid header; returns (status, data bytes written to the guest).
    fn dispatch(
        &mut self,
        type_: u32,
        sector: u64,
        reader: &mut Reader<'_, Bs<'_>>,
        writer: &mut Writer<'_, Bs<'_>>,
    ) -> (u32, usize) {
        match type_ {
            VIRTIO_BLK_T_IN => self.read(sector, writer),
            VIRTIO_BLK_T_OUT => (self.write(sector, reader), 0),
            VIRTIO_BLK_T_FLUSH => {
                let r = self.lock_disk().flush();
                match r {
                    Ok(()) => (VIRTIO_BLK_S_OK, 0),
                    Err(e) => {
                        tracing::error!("virtio-blk: flush failed: {e}");
                        (VIRTIO_BLK_S_IOERR, 0)
                    }
                }
            }
            VIRTIO_BLK_T_GET_ID => {
                let n = writer.available_bytes().min(ID_BYTES);
                match writer.write_all(&self.serial[..n]) {
                    Ok(()) => (VIRTIO_BLK_S_OK, n),
                    Err(e) => {
                        guest_warn!(self, "virtio-blk: GET_ID buffer: {e}");
                        (VIRTIO_BLK_S_IOERR, 0)
                    }
                }
            }
            t => {
                guest_warn!(self, "virtio-blk: unsupported request type {t}");
                (VIRTIO_BLK_S_UNSUPP, 0)
            }
        }
    }

    fn lock_disk(&self) -> std::sync::MutexGuard<'_, disk::Disk> {
        self.disk.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The byte range of a `len`-byte transfer at `sector`, if it is whole sectors inside
    /// the disk.
    fn range(&mut self, what: &str, sector: u64, len: usize) -> Option<u64> {
        let size = self.lock_disk().virtual_size();
        let start = sector.checked_mul(SECTOR_SIZE);
        let ok = (len as u64).is_multiple_of(SECTOR_SIZE)
            && start
                .and_then(|s| s.checked_add(len as u64))
                .is_some_and(|end| end <= size);
        if !ok {
            guest_warn!(
                self,
                "virtio-blk: {what} of {len} bytes at sector {sector} is not whole sectors \
                 inside the {size}-byte disk"
            );
            return None;
        }
        start
    }

    fn read(&mut self, sector: u64, writer: &mut Writer<'_, Bs<'_>>) -> (u32, usize) {
        let len = writer.available_bytes();
        let Some(mut pos) = self.range("read", sector, len) else {
            return (VIRTIO_BLK_S_IOERR, 0);
        };
        let mut buf = std::mem::take(&mut self.buf);
        buf.resize(len.min(MAX_CHUNK), 0);
        let mut done = 0;
        let status = loop {
            if done == len {
                break VIRTIO_BLK_S_OK;
            }
            let n = (len - done).min(MAX_CHUNK);
            if let Err(e) = self.lock_disk().read_at(pos, &mut buf[..n]) {
                tracing::error!("virtio-blk: read at {pos}: {e}");
                break VIRTIO_BLK_S_IOERR;
            }
            if let Err(e) = writer.write_all(&buf[..n]) {
                guest_warn!(self, "virtio-blk: read buffer: {e}");
                break VIRTIO_BLK_S_IOERR;
            }
            done += n;
            pos += n as u64;
        };
        self.buf = buf;
        (status, done)
    }

    fn write(&mut self, sector: u64, reader: &mut Reader<'_, Bs<'_>>) -> u32 {
        let len = reader.available_bytes();
        if self.lock_disk().read_only() {
            guest_warn!(self, "virtio-blk: write to a read-only disk");
            return VIRTIO_BLK_S_IOERR;
        }
        let Some(mut pos) = self.range("write", sector, len) else {
            return VIRTIO_BLK_S_IOERR;
        };
        let mut buf = std::mem::take(&mut self.buf);
        buf.resize(len.min(MAX_CHUNK), 0);
        let mut done = 0;
        let status = loop {
            if done == len {
                break VIRTIO_BLK_S_OK;
            }
            let n = (len - done).min(MAX_CHUNK);
            if let Err(e) = reader.read_exact(&mut buf[..n]) {
                guest_warn!(self, "virtio-blk: write buffer: {e}");
                break VIRTIO_BLK_S_IOERR;
            }
            let r = self.lock_disk().write_at(pos, &buf[..n]);
            if let Err(e) = r {
                if e.is_no_space() {
                    guest_warn!(self, "virtio-blk: write at {pos}: host disk full: {e}");
                } else {
                    tracing::error!("virtio-blk: write at {pos}: {e}");
                }
                break VIRTIO_BLK_S_IOERR;
            }
            done += n;
            pos += n as u64;
        };
        self.buf = buf;
        status
    }
}

/// What one walk over a chain found (nothing mapped, nothing allocated).
#[derive(Debug)]
struct Shape {
    /// Descriptors in the chain (indirect ones counted, the indirect table's own not).
    descriptors: u64,
    /// Sum of the descriptors' lengths.
    bytes: u64,
    /// Length of the longest descriptor.
    longest: u32,
    /// Where the status byte goes: the last byte of the last descriptor, if device-writable.
    status: Option<GuestAddress>,
}

impl Shape {
    /// Most descriptors a request may have: its data segments, the header and the status.
    const MAX_DESCRIPTORS: u64 = SEG_MAX as u64 + 2;
    /// Longest descriptor: a data segment, or one sharing its buffer with the header.
    const MAX_DESCRIPTOR: u32 = SIZE_MAX + HDR_BYTES;
    /// Most bytes in all descriptors: the data, the header and the status byte.
    const MAX_BYTES: u64 = MAX_REQUEST_BYTES + HDR_BYTES as u64 + 1;

    /// The request size limits (see the module documentation).
    fn check_limits(&self) -> Result<(), String> {
        if self.descriptors > Self::MAX_DESCRIPTORS {
            return Err(format!(
                "{} descriptors (at most {SEG_MAX} data segments, header and status)",
                self.descriptors
            ));
        }
        if self.longest > Self::MAX_DESCRIPTOR {
            return Err(format!(
                "a {}-byte segment (size_max is {SIZE_MAX})",
                self.longest
            ));
        }
        if self.bytes > Self::MAX_BYTES {
            return Err(format!(
                "{} bytes of buffers (at most {MAX_REQUEST_BYTES} bytes of data)",
                self.bytes
            ));
        }
        Ok(())
    }
}

/// The spec's chain shape: device-readable descriptors, then device-writable ones, and a
/// chain that ends (the iterator stops early on a loop, an index past the table or an
/// unreadable descriptor, which leaves the last one with NEXT set). The walk is bounded by
/// the iterator (at most the queue size plus one indirect table of 65535 descriptors) and
/// reads only the descriptors.
fn check_shape(chain: &Chain<'_>) -> Result<Shape, String> {
    let mut seen_writable = false;
    let mut last_has_next = false;
    let mut shape = Shape {
        descriptors: 0,
        bytes: 0,
        longest: 0,
        status: None,
    };
    for d in chain.clone() {
        if d.is_write_only() {
            seen_writable = true;
        } else if seen_writable {
            return Err("device-readable descriptor after a device-writable one".into());
        }
        last_has_next = d.has_next();
        shape.descriptors += 1;
        shape.bytes += u64::from(d.len());
        shape.longest = shape.longest.max(d.len());
        shape.status = (d.is_write_only() && d.len() > 0)
            .then(|| d.addr().checked_add(u64::from(d.len()) - 1))
            .flatten();
    }
    if shape.descriptors == 0 {
        return Err("empty or unreadable descriptor chain".into());
    }
    if last_has_next {
        return Err(format!(
            "descriptor chain broken after {} descriptors (loop, bad next index or \
             unreadable descriptor)",
            shape.descriptors
        ));
    }
    Ok(shape)
}

impl QueueWorker for BlockWorker {
    const NAME: &'static str = "virtio-blk";
    type Progress = ();

    fn queues(&self) -> &[Queue] {
        std::slice::from_ref(&self.queue)
    }

    fn notifiers(&self) -> &[EventFd] {
        std::slice::from_ref(&self.evt)
    }

    fn set_memory(&mut self, mem: GuestMemory) {
        self.mem = mem;
    }

    fn run(&mut self, _ops: &mut EventOps) {
        self.process_queue();
    }
}

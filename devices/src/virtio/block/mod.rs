//! virtio-blk (device id 2) over a layered Clade disk ([`disk::Disk`]).
//!
//! What the guest sees:
//! - one request queue (index 0) of up to [`QUEUE_SIZE`] entries;
//! - features: `VIRTIO_BLK_F_FLUSH` (a volatile write cache: data the guest was told is
//!   written is on the host's disk once a FLUSH completes: the overlay is `fdatasync`ed and
//!   its allocation table committed), `VIRTIO_BLK_F_SEG_MAX` ([`SEG_MAX`] = `QUEUE_SIZE - 2`
//!   data segments per request), `VIRTIO_BLK_F_SIZE_MAX` ([`SIZE_MAX`] = 64 KiB per data
//!   segment), and `VIRTIO_BLK_F_RO` when the disk is read-only;
//! - config space (`struct virtio_blk_config`, read-only): `le64 capacity` in 512-byte
//!   sectors at 0, `le32 size_max` at 8, `le32 seg_max` at 12; every other field reads as 0;
//! - requests: IN (read), OUT (write), FLUSH, GET_ID (the serial, at most 20 bytes, padded
//!   with NULs when shorter); anything else gets `VIRTIO_BLK_S_UNSUPP`.
//!
//! # Request size
//!
//! Requests run synchronously on the event loop that vsock shares, so their size is
//! bounded: a request may have at most [`SEG_MAX`] data descriptors (plus header and status)
//! of at most [`SIZE_MAX`] bytes each, so at most [`MAX_REQUEST_BYTES`] (about 16 MiB) of
//! data. Linux derives its queue limits (`max_segments`, `max_segment_size`) from exactly
//! these two fields, so it never builds a larger request; a chain over the limits (possible
//! with indirect descriptors, or a guest that ignores them) is answered with
//! `VIRTIO_BLK_S_IOERR` after one walk over its descriptors, before any buffer is mapped or
//! any memory is allocated for it. A descriptor may carry [`HDR_BYTES`] more than
//! `SIZE_MAX` (header and data in one buffer are allowed by the spec's any-layout rule). The
//! worker moves data through a bounce buffer of at most 256 KiB whatever the request size,
//! and yields the event loop after [`ROUND_BYTES`] of requests, so one busy disk delays vsock
//! by one bounded round, not by a whole queue of requests.
//!
//! Every request is checked before it touches the disk: the chain must be device-readable
//! descriptors (16-byte header, then OUT data) followed by device-writable ones (IN data or
//! GET_ID buffer, then the 1-byte status), every buffer inside guest memory, the data a
//! whole number of sectors and inside the disk. A request that fails a check, or whose I/O
//! fails (out of space on the host included), completes with `VIRTIO_BLK_S_IOERR`; a chain
//! without a writable status byte cannot be answered and is returned with used length 0.
//! Both are logged (rate-limited); the VMM carries on.
//!
//! The data path runs on the device event loop ([`crate::event_loop`]) like vsock's, doing
//! synchronous file I/O there. The disk sits behind an `Arc<Mutex<_>>` ([`BlockDevice::disk`])
//! so that a fork can freeze it ([`disk::Disk::snapshot`]) between two requests.

mod worker;

#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::GuestMemory;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
};

use super::worker::{take_queues, DeviceWorker, QueueWorker};
use super::{Interrupt, QueuePosition, VirtQueue, VirtioDevice, VirtioDeviceState};
use crate::event_loop::LoopHandle;
use crate::{Error, Result};

pub use worker::BlockWorker;

/// virtio device id of a block device.
pub const BLOCK_DEVICE_ID: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most data segments in one request (the header and status take two descriptors).
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Largest data segment (one descriptor) of a request, advertised as `size_max`.
pub const SIZE_MAX: u32 = 64 * 1024;
/// Most data bytes in one request: what `SEG_MAX` segments of `SIZE_MAX` bytes hold.
pub const MAX_REQUEST_BYTES: u64 = SEG_MAX as u64 * SIZE_MAX as u64;
/// Size of the request header (`struct virtio_blk_outhdr`: type, reserved, sector).
pub const HDR_BYTES: u32 = 16;
/// Data the worker handles in one turn on the event loop before it lets other devices run.
pub const ROUND_BYTES: u64 = MAX_REQUEST_BYTES;
/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Length of the GET_ID answer.
pub const ID_BYTES: usize = virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES as usize;
/// Size of `struct virtio_blk_config` up to and including the fields we fill.
const CONFIG_SIZE: usize = 60;

/// What a virtio-blk device saves besides its transport (queue positions are the
/// transport's): the identity the guest saw. The disk itself is the VMM's to reopen (a
/// forked VM gets its own overlay on the frozen layer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// The GET_ID answer.
    pub serial: Vec<u8>,
    /// The disk was read-only.
    pub read_only: bool,
    /// Its size in bytes (the restored disk must have the same).
    pub size: u64,
}

/// The virtio-blk device model: features, configuration space and activation. The data
/// path is [`BlockWorker`] on the device event loop.
pub struct BlockDevice {
    /// Guest-triggered warnings, across activations.
    log: crate::virtio::mmio::LogLimiter,
    disk: Arc<Mutex<disk::Disk>>,
    serial: [u8; ID_BYTES],
    config: [u8; CONFIG_SIZE],
    read_only: bool,
    worker: DeviceWorker<BlockWorker>,
}

impl BlockDevice {
    /// A block device over `disk`. `serial` is what GET_ID returns (at most 20 bytes;
    /// Linux shows it as `/sys/block/vdX/serial`); the worker will run on `event_loop`.
    pub fn new(disk: disk::Disk, serial: &str, event_loop: LoopHandle) -> Result<Self> {
        if serial.len() > ID_BYTES {
            return Err(Error::Virtio(format!(
                "block device serial '{serial}' is longer than {ID_BYTES} bytes"
            )));
        }
        let size = disk.virtual_size();
        if !size.is_multiple_of(SECTOR_SIZE) {
            return Err(Error::Virtio(format!(
                "disk size {size} is not a whole number of {SECTOR_SIZE}-byte sectors"
            )));
        }
        let mut id = [0u8; ID_BYTES];
        id[..serial.len()].copy_from_slice(serial.as_bytes());
        let mut config = [0u8; CONFIG_SIZE];
        config[0..8].copy_from_slice(&(size / SECTOR_SIZE).to_le_bytes());
        config[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        Ok(Self {
            log: crate::virtio::mmio::LogLimiter::new(),
            read_only: disk.read_only(),
            disk: Arc::new(Mutex::new(disk)),
            serial: id,
            config,
            worker: DeviceWorker::new(event_loop),
        })
    }

    /// A device restored from `state` over `disk` (reopened by the VMM: the same chain, or
    /// a fork child's own overlay on the frozen layer). The transport restores the queue.
    pub fn restore(state: &BlockState, disk: disk::Disk, event_loop: LoopHandle) -> Result<Self> {
        if disk.virtual_size() != state.size {
            return Err(Error::Restore(format!(
                "virtio-blk: the disk has {} bytes, the saved device had {}",
                disk.virtual_size(),
                state.size
            )));
        }
        if disk.read_only() != state.read_only {
            return Err(Error::Restore(
                "virtio-blk: the disk's read-only mode differs from the saved device's".into(),
            ));
        }
        let end = state
            .serial
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(state.serial.len());
        let serial = std::str::from_utf8(&state.serial[..end])
            .map_err(|_| Error::Restore("virtio-blk: saved serial is not UTF-8".into()))?;
        Self::new(disk, serial, event_loop)
    }

    /// The disk, shared with the worker: lock it to freeze or inspect it between requests.
    pub fn disk(&self) -> Arc<Mutex<disk::Disk>> {
        Arc::clone(&self.disk)
    }
}

impl VirtioDevice for BlockDevice {
    fn device_type(&self) -> u32 {
        BLOCK_DEVICE_ID
    }

    fn avail_features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_BLK_F_FLUSH)
            | (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_BLK_F_SIZE_MAX);
        if self.read_only {
            f |= 1u64 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| self.config.get(usize::try_from(o).ok()?).copied())
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `writeback` is writable, and only with CONFIG_WCE, which is not offered.
        tracing::debug!(
            "virtio-blk: guest wrote {} bytes of read-only config at {offset:#x}, ignored",
            data.len()
        );
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<VirtQueue>,
        interrupt: Arc<Interrupt>,
        _features: u64,
    ) -> Result<()> {
        let [queue] = take_queues(BlockWorker::NAME, queues, &[(0, "request")])?;
        let worker = BlockWorker::new(mem, queue, interrupt, Arc::clone(&self.disk), self.serial)
            .with_log(self.log.clone());
        self.worker.start(worker)?;
        tracing::debug!("virtio-blk: active");
        Ok(())
    }

    fn reset(&mut self) {
        if !self.worker.stop() {
            return;
        }
        // What the guest wrote before the reset is kept like after a flush.
        if let Err(e) = self.disk.lock().unwrap_or_else(|e| e.into_inner()).flush() {
            tracing::error!("virtio-blk reset: flushing the disk: {e}");
        }
    }

    fn pause(&mut self) {
        self.worker.pause();
    }

    fn replace_memory(&mut self, mem: &GuestMemory) {
        self.worker.replace_memory(mem);
    }

    fn unpause(&mut self) {
        self.worker.unpause();
    }

    fn queue_positions(&self) -> Vec<QueuePosition> {
        self.worker.queue_positions()
    }

    fn save_state(&self) -> Option<VirtioDeviceState> {
        Some(VirtioDeviceState::Block(BlockState {
            serial: self.serial.to_vec(),
            read_only: self.read_only,
            size: u64::from_le_bytes(self.config[0..8].try_into().ok()?) * SECTOR_SIZE,
        }))
    }
}

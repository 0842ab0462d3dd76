//! virtio-balloon (device id 5) with free page reporting: an idle guest gives the memory it
//! freed back to the host, so that a host runs more guests than their combined RAM and a
//! snapshot or fork of a guest does not copy its free memory.
//!
//! What the guest sees:
//! - features: `VIRTIO_F_VERSION_1` and `VIRTIO_BALLOON_F_FREE_PAGE_REPORTING` (bit 5) only
//!   (no stats queue, no deflate-on-OOM, no free page hinting, no page poison: a Linux guest
//!   with page poisoning or `init_on_free` then turns reporting off itself);
//! - queues: 0 inflate, 1 deflate, 2 reporting (the queue after inflate/deflate when stats
//!   are not offered), [`QUEUE_SIZE`] entries each;
//! - config space (`struct virtio_balloon_config`): `le32 num_pages` (the host's target, in
//!   4 KiB pages; [`BalloonDevice::new`]'s, 0 by default) at 0, `le32 actual` (what the
//!   guest says it gave) at 4, writable by the driver; `free_page_hint_cmd_id` and
//!   `poison_val` read as 0.
//!
//! Requests:
//! - reporting: every descriptor of a chain (Linux posts device-writable ones, one per free
//!   block of at least a pageblock) is a guest-physical range of free pages. Each one that
//!   is page-aligned, non-empty and inside guest RAM is discarded through the device's
//!   [`Discard`]; any other is refused (logged, rate-limited, counted). The chain always
//!   comes back with used length 0;
//! - inflate: device-readable arrays of `le32` page frame numbers; each page inside guest
//!   RAM is discarded like a reported range (runs of consecutive pages in one call), others
//!   are refused. At most [`MAX_PFN_BYTES`] per chain are read; used length 0;
//! - deflate: returned with used length 0 (a deflated page is simply faulted in again).
//!
//! Every guest-written value is checked before use; a bad one never stops the device. The
//! data path is [`BalloonWorker`] on the device event loop, behind the pause gate like the
//! other devices' (see `virtio::worker`).

mod discard;
mod worker;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::worker::{take_queues, DeviceWorker, QueueWorker};
use super::{Interrupt, QueuePosition, VirtQueue, VirtioDevice, VirtioDeviceState};
use crate::event_loop::LoopHandle;
use crate::{GuestMemory, Result};

pub use discard::{Discard, DiscardLog, MadviseDiscard, PAGE};
pub use worker::BalloonWorker;

/// virtio device id of a memory balloon.
pub const BALLOON_DEVICE_ID: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;
/// Feature bit: the driver reports free pages on the reporting queue.
pub const VIRTIO_BALLOON_F_FREE_PAGE_REPORTING: u32 = 5;
/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the inflate queue.
pub const INFLATE_QUEUE: usize = 0;
/// Index of the deflate queue.
pub const DEFLATE_QUEUE: usize = 1;
/// Index of the free page reporting queue.
pub const REPORTING_QUEUE: usize = 2;
/// Most bytes of page frame numbers read from one inflate chain (Linux sends 256 PFNs).
pub const MAX_PFN_BYTES: usize = 64 * 1024;
/// Size of `struct virtio_balloon_config`.
const CONFIG_SIZE: usize = 16;

/// What a balloon saves besides its transport: the target and what the guest reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonState {
    /// `num_pages`: the host's target, in 4 KiB pages.
    pub num_pages: u32,
    /// `actual`: what the driver last wrote.
    pub actual: u32,
}

/// What the device did, since it was made (shared with its workers; for tests and metrics).
#[derive(Debug, Default)]
pub struct BalloonStats {
    /// Bytes of reported free pages discarded.
    pub reported_bytes: AtomicU64,
    /// Bytes of inflated pages discarded.
    pub inflated_bytes: AtomicU64,
    /// Ranges or page numbers refused (outside guest RAM, unaligned, empty) or whose
    /// discard failed.
    pub refused: AtomicU64,
}

impl BalloonStats {
    /// (reported bytes, inflated bytes, refused) now.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.reported_bytes.load(Ordering::Relaxed),
            self.inflated_bytes.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

/// The virtio-balloon device model: features, configuration space and activation. The
/// data path is [`BalloonWorker`].
pub struct BalloonDevice {
    log: crate::virtio::mmio::LogLimiter,
    state: BalloonState,
    discard: Arc<dyn Discard>,
    stats: Arc<BalloonStats>,
    worker: DeviceWorker<BalloonWorker>,
}

impl BalloonDevice {
    /// A balloon whose target is `num_pages` 4 KiB pages (0: the host asks for nothing
    /// back; reported free pages are given back whatever the target), discarding through
    /// `discard`, its worker on `event_loop`.
    pub fn new(num_pages: u32, discard: Arc<dyn Discard>, event_loop: LoopHandle) -> Self {
        Self {
            log: crate::virtio::mmio::LogLimiter::new(),
            state: BalloonState {
                num_pages,
                actual: 0,
            },
            discard,
            stats: Arc::new(BalloonStats::default()),
            worker: DeviceWorker::new(event_loop),
        }
    }

    /// A balloon restored from `state` (the transport restores the queues).
    pub fn restore(
        state: &BalloonState,
        discard: Arc<dyn Discard>,
        event_loop: LoopHandle,
    ) -> Self {
        let mut d = Self::new(state.num_pages, discard, event_loop);
        d.state.actual = state.actual;
        d
    }

    /// A balloon (restored from `state`, or new with a target of 0) over guest memory `mem`
    /// that discards with `madvise` and records what it discarded in the log returned
    /// alongside (what a VMM gives a snapshot or fork, so it skips those pages).
    pub fn logged(
        state: Option<&BalloonState>,
        mem: &GuestMemory,
        event_loop: LoopHandle,
    ) -> (Self, Arc<DiscardLog>) {
        let log = Arc::new(DiscardLog::for_memory(mem));
        let discard = Arc::new(MadviseDiscard::with_log(Arc::clone(&log)));
        let state = state.copied().unwrap_or_default();
        (Self::restore(&state, discard, event_loop), log)
    }

    /// What the device did so far.
    pub fn stats(&self) -> Arc<BalloonStats> {
        Arc::clone(&self.stats)
    }

    fn config_bytes(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        c[0..4].copy_from_slice(&self.state.num_pages.to_le_bytes());
        c[4..8].copy_from_slice(&self.state.actual.to_le_bytes());
        c
    }
}

impl VirtioDevice for BalloonDevice {
    fn device_type(&self) -> u32 {
        BALLOON_DEVICE_ID
    }

    fn avail_features(&self) -> u64 {
        1u64 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 3]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = self.config_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| c.get(usize::try_from(o).ok()?).copied())
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` (bytes 4..8) is the driver's to write.
        let mut c = self.config_bytes();
        let mut changed = false;
        for (i, &b) in data.iter().enumerate() {
            match offset.checked_add(i as u64) {
                Some(o @ 4..=7) => {
                    c[o as usize] = b;
                    changed = true;
                }
                _ => {
                    if self.log.allow() {
                        tracing::debug!(
                            "virtio-balloon: guest wrote read-only config at {offset:#x}, ignored"
                        );
                    }
                }
            }
        }
        if changed {
            self.state.actual = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        }
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<VirtQueue>,
        interrupt: Arc<Interrupt>,
        features: u64,
    ) -> Result<()> {
        let queues = take_queues(
            BalloonWorker::NAME,
            queues,
            &[(INFLATE_QUEUE, "inflate"), (DEFLATE_QUEUE, "deflate")],
        )?;
        let reporting = features & (1u64 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING) != 0;
        let worker = BalloonWorker::new(
            mem,
            queues,
            interrupt,
            Arc::clone(&self.discard),
            Arc::clone(&self.stats),
            self.log.clone(),
        );
        self.worker.start(worker)?;
        tracing::debug!(reporting, "virtio-balloon: active");
        Ok(())
    }

    fn reset(&mut self) {
        self.worker.stop();
    }

    fn pause(&mut self) {
        self.worker.pause();
    }

    fn unpause(&mut self) {
        self.worker.unpause();
    }

    fn replace_memory(&mut self, mem: &GuestMemory) {
        self.worker.replace_memory(mem);
    }

    fn queue_positions(&self) -> Vec<QueuePosition> {
        self.worker.queue_positions()
    }

    fn save_state(&self) -> Option<VirtioDeviceState> {
        Some(VirtioDeviceState::Balloon(self.state))
    }
}

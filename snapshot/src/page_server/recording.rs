//! What a page server remembers of its run: the order the guest first touched its pages,
//! written as the snapshot's working set ([`PageServer::save_working_set`]) on a first
//! resume, and handed to the next snapshot of this VM ([`PageServer::first_touches`]) so
//! that its restores prefetch what this run needed.

use std::sync::atomic::Ordering;

use super::{PageServer, CARRIED_MAX};
use crate::bitmap::PageBitmap;
use crate::working_set::WorkingSet;
use crate::{Error, Result};

impl PageServer {
    /// Whether this run records a working set (no valid working-set file was found).
    pub fn is_recording(&self) -> bool {
        self.record_to.is_some()
    }

    /// The pages this run's guest needed first: the working set it prefetched followed by
    /// the pages it faulted in beyond it early on (at most [`CARRIED_EXTRA_MAX`]), or, when
    /// recording, the fault order so far (first touches). A snapshot of this VM writes
    /// them as its own working set (see `vmm`'s snapshot), so that waking a sandbox from
    /// its pause snapshot prefetches what it needed last time instead of faulting page by
    /// page while recording again. Image page indices of this server's image
    /// ([`Self::page_count`] pages).
    ///
    /// A recording run keeps recording after it saved its working set: what it touched
    /// later is not what a restore needs first, so only the saved part counts, or, before
    /// it saved one, the first [`CARRIED_MAX`] pages.
    ///
    /// [`CARRIED_EXTRA_MAX`]: super::CARRIED_EXTRA_MAX
    pub fn first_touches(&self) -> Vec<u64> {
        let saved = self.saved_len.load(Ordering::Relaxed);
        let mut touched = self.recorded_first_touches().unwrap_or_default();
        if self.record_to.is_some() {
            touched.truncate(if saved == usize::MAX {
                CARRIED_MAX
            } else {
                saved
            });
            return touched;
        }
        // The working set prefetched, then the pages this run still had to fault in
        // early on (a woken sandbox's guest does not need exactly what its template's
        // did: without them each wake would fault them again), up to the point the VM
        // said its first requests were served.
        let mut pages = self
            .loaded
            .as_ref()
            .map(|ws| ws.pages.clone())
            .unwrap_or_default();
        let mut known = PageBitmap::new(self.pages);
        for &p in &pages {
            if p < self.pages {
                known.set(p);
            }
        }
        touched.truncate(saved);
        pages.extend(touched.into_iter().filter(|&p| !known.get(p)));
        pages.truncate(CARRIED_MAX);
        pages
    }

    /// The recorded fault order, each page once (a page discarded by the guest and
    /// touched again faults twice: the first counts).
    fn recorded_first_touches(&self) -> Result<Vec<u64>> {
        let recorded = self
            .shared
            .recorded
            .lock()
            .map(|r| r.clone())
            .map_err(|_| Error::PageServer("recorder lock poisoned".into()))?;
        let mut seen = PageBitmap::new(self.pages);
        let mut pages = Vec::with_capacity(recorded.len());
        for p in recorded {
            if p < self.pages && !seen.get(p) {
                seen.set(p);
                pages.push(p);
            }
        }
        Ok(pages)
    }

    /// Pages in the image this server serves.
    pub fn page_count(&self) -> u64 {
        self.pages
    }

    /// Write the fault order recorded so far to the working-set file (e.g. when the
    /// sandbox has served its first request). Returns the number of pages written, or
    /// `None` when this run is not recording: it prefetched a working set, and its faults
    /// beyond it from now on are not added to the next snapshot's ([`Self::first_touches`]).
    pub fn save_working_set(&self) -> Result<Option<usize>> {
        let Some(path) = &self.record_to else {
            // A run with a working set: its first faults beyond it end here.
            let n = self.shared.recorded.lock().map(|r| r.len()).unwrap_or(0);
            self.saved_len.store(n, Ordering::Relaxed);
            return Ok(None);
        };
        let pages = self.recorded_first_touches()?;
        let n = pages.len();
        WorkingSet {
            id: self.id,
            page_count: self.pages,
            pages,
        }
        .save(path)?;
        self.saved_len.store(n, Ordering::Relaxed);
        tracing::debug!(path = %path.display(), pages = n, "saved working set");
        Ok(Some(n))
    }
}

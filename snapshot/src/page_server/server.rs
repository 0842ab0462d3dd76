//! The page server's thread ([`Server`]): it waits on the userfaultfd, serves each fault
//! from the memory chain (or with the zero page), follows pages the guest discards, and
//! between faults installs the working set or, when stopping with
//! [`StopMode::FillRemaining`](super::StopMode::FillRemaining), every page still missing.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use userfaultfd::{Event, EventBuffer, Uffd};
use vmm_sys_util::eventfd::EventFd;

use super::{add, uffd_err, GuestMapping, Shared, CARRIED_EXTRA_MAX, FILL, STOP};
use crate::bitmap::PageBitmap;
use crate::memory_file::{MemoryChain, PageLocation};
use crate::{Error, Result, PAGE_SIZE, PAGE_SIZE_U64};

/// Pages per prefetch/fill batch (one read and one `UFFDIO_COPY` per contiguous run).
const BATCH_PAGES: u64 = 64;

/// The server thread's state.
pub(super) struct Server {
    pub(super) uffd: Arc<Uffd>,
    pub(super) chain: Arc<MemoryChain>,
    /// Sorted by host address.
    pub(super) maps: Vec<GuestMapping>,
    pub(super) populated: PageBitmap,
    pub(super) removed: PageBitmap,
    pub(super) recording: bool,
    pub(super) shared: Arc<Shared>,
    pub(super) buf: Vec<u8>,
    pub(super) zeropage: bool,
    pub(super) prefetch: Vec<u64>,
    pub(super) prefetch_pos: usize,
    pub(super) fill_pos: Option<u64>,
}

/// Times a fault the kernel refused with EAGAIN is retried (20 us apart) before it counts
/// as an error.
const MAX_AGAIN_RETRIES: u32 = 50_000;

/// The kernel refused to fill a page for now (the memory is being changed: EAGAIN).
fn is_again(e: &Error) -> bool {
    matches!(
        e,
        Error::Uffd {
            source: userfaultfd::Error::CopyFailed(x) | userfaultfd::Error::ZeropageFailed(x),
            ..
        } if *x as i32 == libc::EAGAIN
    )
}

/// Outcome of installing a run of pages.
enum Installed {
    Done,
    /// Some page was already present (EEXIST): retry page by page.
    Exists,
}

impl Server {
    pub(super) fn run(mut self, stop_evt: &EventFd) -> Result<()> {
        let mut events = EventBuffer::new(64);
        loop {
            let control = self.shared.control.load(Ordering::SeqCst);
            if control == STOP {
                return Ok(());
            }
            if control == FILL && self.fill_pos.is_none() {
                // A lazily filled chain fetches what is still missing in parallel now.
                self.chain.prefetch_all();
                self.fill_pos = Some(0);
            }
            let background = self.prefetch_pos < self.prefetch.len() || self.fill_pos.is_some();
            let mut fds = [
                libc::pollfd {
                    fd: self.uffd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: stop_evt.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let timeout = if background { 0 } else { -1 };
            // SAFETY: `fds` is a valid array of two pollfd structs for the duration of the
            // call, and its length is passed alongside.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::PageServer(format!("poll: {e}")));
            }
            if fds[1].revents != 0 {
                let _ = stop_evt.read();
            }
            if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                return Err(Error::PageServer(format!(
                    "userfaultfd poll revents {:#x}",
                    fds[0].revents
                )));
            }
            if fds[0].revents & libc::POLLIN != 0 {
                self.drain_events(&mut events)?;
            }
            if self.prefetch_pos < self.prefetch.len() {
                let t = Instant::now();
                self.prefetch_batch();
                add(
                    &self.shared.counters.prefetch_ns,
                    t.elapsed().as_nanos() as u64,
                );
            } else if let Some(pos) = self.fill_pos {
                match self.fill_batch(pos) {
                    Some(next) => self.fill_pos = Some(next),
                    None => return Ok(()),
                }
            }
        }
    }

    fn drain_events(&mut self, buf: &mut EventBuffer) -> Result<()> {
        // Faults the kernel refused to fill for now (EAGAIN: a discard, e.g. a balloon's
        // MADV_DONTNEED, is changing the memory; its REMOVE event comes next). Served
        // again once the events so far are read, or the faulting thread would wait forever.
        let mut deferred: Vec<usize> = Vec::new();
        let mut retries = 0u32;
        loop {
            let mut pending = Vec::new();
            let uffd = self.uffd.clone();
            for ev in uffd.read_events(buf).map_err(uffd_err("read events"))? {
                pending.push(ev.map_err(uffd_err("decode event"))?);
            }
            if pending.is_empty() {
                if deferred.is_empty() {
                    return Ok(());
                }
                // The discarding thread ends its change just after its event was read.
                std::thread::sleep(std::time::Duration::from_micros(20));
                retries += 1;
                let last = retries >= MAX_AGAIN_RETRIES;
                for addr in std::mem::take(&mut deferred) {
                    if self.serve_fault(addr, last) {
                        deferred.push(addr);
                    }
                }
                continue;
            }
            for ev in pending {
                match ev {
                    Event::Pagefault { addr, .. } => {
                        if self.serve_fault(addr as usize, false) {
                            deferred.push(addr as usize);
                        }
                    }
                    Event::Remove { start, end } => {
                        self.removed_range(start as usize, end as usize)
                    }
                    other => tracing::debug!(event = ?other, "ignoring userfaultfd event"),
                }
            }
        }
    }

    fn mapping_of_addr(&self, addr: usize) -> Option<&GuestMapping> {
        let i = self.maps.partition_point(|m| m.host_addr <= addr);
        let m = self.maps.get(i.checked_sub(1)?)?;
        (addr < m.host_addr + m.len).then_some(m)
    }

    /// Host address of image page `page`, and pages left in its mapping from there.
    fn host_of_page(&self, page: u64) -> Option<(usize, u64)> {
        let off = page * PAGE_SIZE_U64;
        self.maps
            .iter()
            .find(|m| off >= m.image_offset && off < m.image_offset + m.len as u64)
            .map(|m| {
                let rel = off - m.image_offset;
                (
                    m.host_addr + rel as usize,
                    (m.len as u64 - rel) / PAGE_SIZE_U64,
                )
            })
    }

    fn record_error(&self, msg: String) {
        tracing::error!(error = %msg, "page server could not serve a page");
        add(&self.shared.counters.errors, 1);
        super::maybe_end_process(&msg);
        if let Ok(mut e) = self.shared.error.lock() {
            e.get_or_insert(msg);
        }
    }

    /// Serves the fault at `addr`; true if the kernel said to try again later (EAGAIN)
    /// and `last` is false (the caller retries), else the fault is done with.
    fn serve_fault(&mut self, addr: usize, last: bool) -> bool {
        let t = Instant::now();
        let Some(m) = self.mapping_of_addr(addr).copied() else {
            self.record_error(format!("fault at {addr:#x} outside every mapping"));
            return false;
        };
        let host = addr & !(PAGE_SIZE - 1);
        let page = (m.image_offset + (host - m.host_addr) as u64) / PAGE_SIZE_U64;
        let c = &self.shared.counters;
        if self.populated.get(page) {
            add(&c.duplicate_faults, 1);
            if let Err(e) = self.uffd.wake(host as *mut libc::c_void, PAGE_SIZE) {
                self.record_error(format!("wake {host:#x}: {e}"));
            }
            return false;
        }
        add(&c.faults, 1);
        // Recorded while recording (the working set), and in a run with a working set
        // its first faults beyond it (see `PageServer::first_touches`).
        if let Ok(mut r) = self.shared.recorded.lock() {
            if self.recording || r.len() < CARRIED_EXTRA_MAX {
                r.push(page);
            }
        }
        let zero = self.removed.get(page) || self.chain.locate(page) == PageLocation::Zero;
        let result = if zero && self.zeropage {
            add(&self.shared.counters.zero_faults, 1);
            self.install_zero(host, 1)
        } else {
            self.install(page, host, 1)
        };
        let again = match result {
            Ok(_) => {
                self.populated.set(page);
                false
            }
            Err(e) if !last && is_again(&e) => true,
            Err(e) => {
                self.record_error(e.to_string());
                false
            }
        };
        add(
            &self.shared.counters.fault_service_ns,
            t.elapsed().as_nanos() as u64,
        );
        again
    }

    fn removed_range(&mut self, start: usize, end: usize) {
        let mut addr = start & !(PAGE_SIZE - 1);
        let mut n = 0;
        while addr < end {
            if let Some(m) = self.mapping_of_addr(addr) {
                let page = (m.image_offset + (addr - m.host_addr) as u64) / PAGE_SIZE_U64;
                self.populated.clear(page);
                self.removed.set(page);
                n += 1;
            }
            addr += PAGE_SIZE;
        }
        add(&self.shared.counters.pages_removed, n);
    }

    /// Map zero pages at `host` (`n` pages).
    fn install_zero(&self, host: usize, n: u64) -> Result<Installed> {
        let len = n as usize * PAGE_SIZE;
        // SAFETY: `host..host + len` lies inside a mapping registered with this uffd
        // (callers derive it from `self.maps`); the kernel only fills pages that are
        // missing there, and this crate holds no reference into that memory.
        match unsafe { self.uffd.zeropage(host as *mut libc::c_void, len, true) } {
            Ok(_) => Ok(Installed::Done),
            Err(userfaultfd::Error::ZeropageFailed(e)) if e as i32 == libc::EEXIST => {
                self.wake(host, len);
                Ok(Installed::Exists)
            }
            Err(e) => Err(Error::Uffd {
                op: "UFFDIO_ZEROPAGE",
                source: e,
            }),
        }
    }

    fn wake(&self, host: usize, len: usize) {
        if let Err(e) = self.uffd.wake(host as *mut libc::c_void, len) {
            self.record_error(format!("wake {host:#x}: {e}"));
        }
    }

    /// Read `n` pages from `page` and install them at `host` with one `UFFDIO_COPY`.
    fn install(&mut self, page: u64, host: usize, n: u64) -> Result<Installed> {
        let len = n as usize * PAGE_SIZE;
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        let buf = &mut self.buf[..len];
        self.chain.read_pages(page, buf)?;
        add(&self.shared.counters.bytes_read, len as u64);
        // Pages the guest discarded must read as zero, not as the file's contents.
        for i in 0..n {
            if self.removed.get(page + i) {
                buf[i as usize * PAGE_SIZE..(i as usize + 1) * PAGE_SIZE].fill(0);
            }
        }
        // SAFETY: `buf` holds `len` initialised bytes and outlives the call; the
        // destination `host..host + len` lies inside a mapping registered with this uffd
        // (derived from `self.maps`), where the kernel only fills missing pages; this
        // crate holds no reference into that memory.
        let r = unsafe {
            self.uffd.copy(
                buf.as_ptr() as *const libc::c_void,
                host as *mut libc::c_void,
                len,
                true,
            )
        };
        match r {
            Ok(_) => Ok(Installed::Done),
            Err(userfaultfd::Error::CopyFailed(e)) if e as i32 == libc::EEXIST => {
                self.wake(host, len);
                Ok(Installed::Exists)
            }
            Err(userfaultfd::Error::PartiallyCopied(_)) => Ok(Installed::Exists),
            Err(e) => Err(Error::Uffd {
                op: "UFFDIO_COPY",
                source: e,
            }),
        }
    }

    /// Install a run of pages not yet present (prefetch or fill), falling back to page by
    /// page if some page turned out to be present already.
    fn install_run(&mut self, page: u64, host: usize, n: u64) -> Result<u64> {
        let all_zero = self.zeropage
            && (page..page + n)
                .all(|p| self.removed.get(p) || self.chain.locate(p) == PageLocation::Zero);
        let installed = if all_zero {
            self.install_zero(host, n)?
        } else {
            self.install(page, host, n)?
        };
        match installed {
            Installed::Done => {
                self.populated.set_range(page, n);
                Ok(n)
            }
            Installed::Exists => {
                let mut done = 0;
                for i in 0..n {
                    if self.populated.get(page + i) {
                        continue;
                    }
                    if let Installed::Done =
                        self.install(page + i, host + i as usize * PAGE_SIZE, 1)?
                    {
                        done += 1;
                    }
                    self.populated.set(page + i);
                }
                Ok(done)
            }
        }
    }

    /// Install the next batch of the working set: consecutive entries that are
    /// consecutive pages become one read and one `UFFDIO_COPY`.
    pub(super) fn prefetch_batch(&mut self) {
        let end = (self.prefetch_pos + BATCH_PAGES as usize).min(self.prefetch.len());
        let mut i = self.prefetch_pos;
        while i < end {
            let page = self.prefetch[i];
            i += 1;
            if self.populated.get(page) || self.removed.get(page) {
                continue;
            }
            let Some((host, room)) = self.host_of_page(page) else {
                continue;
            };
            let mut n = 1;
            while i < end
                && n < room
                && self.prefetch[i] == page + n
                && !self.populated.get(page + n)
                && !self.removed.get(page + n)
            {
                n += 1;
                i += 1;
            }
            match self.install_run(page, host, n) {
                Ok(done) => add(&self.shared.counters.pages_prefetched, done),
                Err(e) => self.record_error(e.to_string()),
            }
        }
        self.prefetch_pos = end;
    }

    /// Install up to a batch of not-yet-present pages from `pos`; returns the position to
    /// continue from, or `None` when every page is present.
    fn fill_batch(&mut self, pos: u64) -> Option<u64> {
        let mut installed = 0;
        let mut p = pos;
        while installed < BATCH_PAGES {
            let page = self.populated.next_clear(p)?;
            if self.removed.get(page) {
                p = page + 1;
                continue;
            }
            let Some((host, room)) = self.host_of_page(page) else {
                p = page + 1;
                continue;
            };
            let mut n = 1;
            while n < room
                && n < BATCH_PAGES
                && !self.populated.get(page + n)
                && !self.removed.get(page + n)
            {
                n += 1;
            }
            match self.install_run(page, host, n) {
                Ok(done) => add(&self.shared.counters.pages_filled, done),
                Err(e) => {
                    self.record_error(e.to_string());
                    self.populated.set_range(page, n);
                }
            }
            installed += n;
            p = page + n;
        }
        Some(p)
    }
}

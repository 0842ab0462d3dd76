//! A userfaultfd page server for the `uffd` resume backend.
//!
//! The VMM maps guest memory without content (anonymous memory, or an empty memfd mapped
//! `MAP_SHARED` or `MAP_PRIVATE`; userfaultfd MISSING mode does not work on `MAP_PRIVATE`
//! of a regular file) and starts a [`PageServer`] over those mappings and a
//! [`MemoryChain`]. With a `MAP_SHARED` memfd the installed pages land in the memfd, so the
//! next snapshot can read guest memory through the fd
//! ([`crate::memory_file::RegionData::Fd`]); with a `MAP_PRIVATE` mapping they do not, and
//! the next snapshot must read the mapping ([`crate::memory_file::RegionData::Slice`]).
//! The server registers the mappings with a new userfaultfd (MISSING mode, kernel faults
//! included, so KVM's own accesses are served too) and runs one thread that:
//!
//! * on a fault, reads the page from the memory file that owns it and installs it with
//!   `UFFDIO_COPY`, or maps the zero page with `UFFDIO_ZEROPAGE` for a hole;
//! * on the first resume (no working-set file yet), records the order of faulted pages
//!   and writes it as the working-set file when stopped (or on
//!   [`PageServer::save_working_set`]);
//! * on later resumes, installs the working set in order, in multi-page `UFFDIO_COPY`
//!   batches, before the guest starts ([`Prefetch::BeforeStart`]) or interleaved with
//!   serving faults ([`Prefetch::Background`]), so a warm resume takes few or no faults;
//! * handles `UFFD_EVENT_REMOVE` (the guest's memory was discarded with
//!   `MADV_DONTNEED`/`MADV_REMOVE`, e.g. by a balloon): those pages are served as zero
//!   afterwards, never again from the file.
//!
//! [`PageServer::stop`] stops the thread and unregisters the mappings; with
//! [`StopMode::FillRemaining`] it first installs every page not yet present, so the guest
//! can keep running on plain memory.
//!
//! This file has the types a caller uses and the running server's handle
//! ([`PageServer`]: counters, errors, stopping); `start.rs` registers the memory and
//! starts the server, `server.rs` is the server thread, `recording.rs` the working set a
//! run records and hands on.
//!
//! [`MemoryChain`]: crate::memory_file::MemoryChain

mod recording;
mod server;
mod start;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use userfaultfd::{FeatureFlags, Uffd, UffdBuilder};
use vmm_sys_util::eventfd::EventFd;

pub use start::Prefilled;

use crate::working_set::WorkingSet;
use crate::{Error, Result};

/// One host mapping of (part of) the guest memory image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestMapping {
    /// Host virtual address of the mapping (page-aligned).
    pub host_addr: usize,
    /// Length in bytes (page-aligned).
    pub len: usize,
    /// Offset of the mapping's first byte in the memory image (see
    /// [`crate::memory_file::RegionInfo::offset`]).
    pub image_offset: u64,
}

/// What to do with a working set loaded from the working-set file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefetch {
    /// Install the whole working set inside [`PageServer::start`], before it returns
    /// (and so before the VMM runs the vCPUs).
    #[default]
    BeforeStart,
    /// Install it from the server thread, in batches between fault services.
    Background,
    /// Do not prefetch.
    Off,
}

/// Page server settings.
#[derive(Debug, Clone, Default)]
pub struct PageServerOptions {
    /// The working-set file: prefetched if it exists and is valid for this snapshot,
    /// otherwise recorded on this run and written on stop.
    pub working_set: Option<PathBuf>,
    /// The working set, already read from that file (by a caller resuming one snapshot
    /// many times): used instead of reading the file if it belongs to this snapshot.
    pub working_set_loaded: Option<Arc<WorkingSet>>,
    /// Where a working set recorded on this run is written, instead of `working_set`:
    /// for a process that may read the snapshot's directory but not write it (a jailed
    /// VM restoring a template shared by every sandbox). Its owner checks the file and
    /// installs it as the snapshot's own (see [`WorkingSet::load`]).
    pub record_to: Option<PathBuf>,
    /// How to prefetch a loaded working set.
    pub prefetch: Prefetch,
}

/// A userfaultfd created ahead of time (see [`PageServer::start_with`]): creating one is
/// a few tens of microseconds a resume need not spend.
pub struct PreparedUffd(Uffd);

impl std::fmt::Debug for PreparedUffd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PreparedUffd")
    }
}

impl PreparedUffd {
    /// Creates a userfaultfd as the page server needs it (non-blocking, kernel faults
    /// included, EVENT_REMOVE).
    pub fn create() -> Result<PreparedUffd> {
        UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .require_features(FeatureFlags::EVENT_REMOVE)
            .create()
            .map(PreparedUffd)
            .map_err(uffd_err(
                "create (needs CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1)",
            ))
    }
}

/// How [`PageServer::stop`] leaves the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Just stop and unregister. Pages never touched are then zero-filled by the kernel
    /// on access: only for a guest that is not going to run again.
    Detach,
    /// Install every page not yet present, then stop and unregister: the guest keeps
    /// running on complete, ordinary memory.
    FillRemaining,
}

/// Counters of a page server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageServerStats {
    /// Page faults served (each a guest or VMM thread that waited).
    pub faults: u64,
    /// ... of which were served with the zero page (holes).
    pub zero_faults: u64,
    /// Fault messages for pages already installed (two threads faulting the same page).
    pub duplicate_faults: u64,
    /// Pages installed from the working set.
    pub pages_prefetched: u64,
    /// Pages installed by [`StopMode::FillRemaining`].
    pub pages_filled: u64,
    /// Bytes read from memory files.
    pub bytes_read: u64,
    /// Pages discarded by the guest (`UFFD_EVENT_REMOVE`) and served as zero afterwards.
    pub pages_removed: u64,
    /// Entries in the loaded working set (0 when recording).
    pub working_set_len: u64,
    /// Time spent prefetching, in nanoseconds.
    pub prefetch_ns: u64,
    /// Time spent in the server thread serving faults (read, ioctl), in nanoseconds.
    pub fault_service_ns: u64,
    /// Pages that could not be served (I/O error): see [`PageServer::error`].
    pub errors: u64,
}

#[derive(Default)]
struct Counters {
    faults: AtomicU64,
    zero_faults: AtomicU64,
    duplicate_faults: AtomicU64,
    pages_prefetched: AtomicU64,
    pages_filled: AtomicU64,
    bytes_read: AtomicU64,
    pages_removed: AtomicU64,
    working_set_len: AtomicU64,
    prefetch_ns: AtomicU64,
    fault_service_ns: AtomicU64,
    errors: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> PageServerStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PageServerStats {
            faults: g(&self.faults),
            zero_faults: g(&self.zero_faults),
            duplicate_faults: g(&self.duplicate_faults),
            pages_prefetched: g(&self.pages_prefetched),
            pages_filled: g(&self.pages_filled),
            bytes_read: g(&self.bytes_read),
            pages_removed: g(&self.pages_removed),
            working_set_len: g(&self.working_set_len),
            prefetch_ns: g(&self.prefetch_ns),
            fault_service_ns: g(&self.fault_service_ns),
            errors: g(&self.errors),
        }
    }
}

fn add(a: &AtomicU64, v: u64) {
    a.fetch_add(v, Ordering::Relaxed);
}

struct Shared {
    counters: Counters,
    /// Fault order, when recording.
    recorded: Mutex<Vec<u64>>,
    /// First page-service error.
    error: Mutex<Option<String>>,
    /// 0 run, 1 stop, 2 fill then stop.
    control: AtomicU8,
}

const RUN: u8 = 0;
const STOP: u8 = 1;
const FILL: u8 = 2;

/// The most pages [`PageServer::first_touches`] gives from a recording run that has not
/// saved its working set yet (a guest whose agent is never synced records all its life):
/// its first 16 MiB of touches, not everything it touched since.
pub const CARRIED_MAX: usize = 4096;

/// The most pages a run with a working set adds to it for the next snapshot's (the
/// first pages it faulted in beyond it, until the VM says its first requests are served:
/// [`PageServer::save_working_set`]).
pub const CARRIED_EXTRA_MAX: usize = 256;

/// What [`PageServer::stop`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageServerReport {
    /// Final counters.
    pub stats: PageServerStats,
    /// Entries written to the working-set file, if this run recorded one.
    pub working_set_saved: Option<usize>,
}

/// A running page server; see the [module documentation](self).
pub struct PageServer {
    uffd: Arc<Uffd>,
    mappings: Vec<GuestMapping>,
    shared: Arc<Shared>,
    stop_evt: EventFd,
    /// The server thread's result, when it ends.
    thread: Option<Receiver<Result<()>>>,
    /// Where to write the recorded working set (None: not recording).
    record_to: Option<PathBuf>,
    /// The working set this run prefetched (loaded from its file), in its order.
    loaded: Option<Arc<WorkingSet>>,
    /// Pages written by [`Self::save_working_set`] (`usize::MAX`: not saved yet).
    saved_len: AtomicUsize,
    id: crate::SnapshotId,
    pages: u64,
}

impl std::fmt::Debug for PageServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageServer")
            .field("mappings", &self.mappings)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Whether a page server's failure ends this process ([`end_process_on_failure`]).
static END_PROCESS_ON_FAILURE: AtomicBool = AtomicBool::new(false);

/// The exit code of a process ended by a page server's failure.
pub const EXIT_MEMORY_UNSERVED: i32 = 75;

/// Makes the first page a page server of this process cannot serve end the process (exit
/// code [`EXIT_MEMORY_UNSERVED`], after an error line naming what failed): for a process
/// that holds one VM and nothing else (a VM process). The thread that faulted on the page
/// stays blocked until the page is served, and that may be the VMM's own thread while it
/// restores, which then never answers; serving anything else would run the guest on
/// memory that is not its own. Without it, [`PageServer::error`] says so and the VMM ends
/// the VM when it next looks.
pub fn end_process_on_failure() {
    END_PROCESS_ON_FAILURE.store(true, Ordering::SeqCst);
}

/// Ends the process if [`end_process_on_failure`] was asked for.
fn maybe_end_process(msg: &str) {
    if END_PROCESS_ON_FAILURE.load(Ordering::SeqCst) {
        tracing::error!(
            error = %msg,
            "guest memory could not be served: the VM process ends (exit code {EXIT_MEMORY_UNSERVED})"
        );
        std::process::exit(EXIT_MEMORY_UNSERVED);
    }
}

fn uffd_err(op: &'static str) -> impl FnOnce(userfaultfd::Error) -> Error {
    move |source| Error::Uffd { op, source }
}

impl PageServer {
    /// Current counters.
    pub fn stats(&self) -> PageServerStats {
        self.shared.counters.snapshot()
    }

    /// The first error met while serving a page, if any. A faulting thread whose page
    /// could not be served stays blocked: the VMM should treat this as fatal for the VM.
    pub fn error(&self) -> Option<String> {
        self.shared.error.lock().map(|e| e.clone()).unwrap_or(None)
    }

    /// Stop the server thread and unregister the mappings (see [`StopMode`]). A
    /// recording run writes its working-set file.
    pub fn stop(mut self, mode: StopMode) -> Result<PageServerReport> {
        let thread_result = self.shutdown(mode);
        // The working set only speeds later restores up: one that cannot be written (the
        // snapshot's directory is read-only to this process, as a store cache's is to a
        // jailed VM) is a warning, never a failed stop (which would end the VM).
        let saved = if thread_result.is_ok() {
            self.save_working_set().unwrap_or_else(|e| {
                tracing::warn!("working set not saved: {e}");
                None
            })
        } else {
            None
        };
        thread_result?;
        if let Some(e) = self.error() {
            return Err(Error::PageServer(e));
        }
        Ok(PageServerReport {
            stats: self.stats(),
            working_set_saved: saved,
        })
    }

    fn shutdown(&mut self, mode: StopMode) -> Result<()> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        let control = match mode {
            StopMode::Detach => STOP,
            StopMode::FillRemaining => FILL,
        };
        self.shared.control.store(control, Ordering::SeqCst);
        let _ = self.stop_evt.write(1);
        // The sender is dropped without a message only if the thread panicked.
        let result = thread
            .recv()
            .unwrap_or_else(|_| Err(Error::PageServer("server thread panicked".into())));
        for m in &self.mappings {
            if let Err(e) = self
                .uffd
                .unregister(m.host_addr as *mut libc::c_void, m.len)
            {
                tracing::warn!(mapping = ?m, error = %e, "userfaultfd unregister failed");
            }
        }
        result
    }
}

impl Drop for PageServer {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown(StopMode::Detach) {
            tracing::warn!(error = %e, "page server stopped with an error");
        }
    }
}

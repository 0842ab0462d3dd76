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

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use userfaultfd::{Event, EventBuffer, FeatureFlags, IoctlFlags, Uffd, UffdBuilder};
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};

use crate::bitmap::PageBitmap;
use crate::memory_file::{MemoryChain, PageLocation};
use crate::working_set::WorkingSet;
use crate::{spawn_thread, Error, Result, ThreadRunner, PAGE_SIZE, PAGE_SIZE_U64};

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

/// Pages per prefetch/fill batch (one read and one `UFFDIO_COPY` per contiguous run).
const BATCH_PAGES: u64 = 64;

/// What [`PageServer::stop`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageServerReport {
    /// Final counters.
    pub stats: PageServerStats,
    /// Entries written to the working-set file, if this run recorded one.
    pub working_set_saved: Option<usize>,
}

/// Memory registered for a page server and its working set installed, before the server
/// runs ([`PageServer::prefill`], [`PageServer::start_prefilled`]).
pub struct Prefilled {
    server: Server,
    shared: Arc<Shared>,
    stop_evt: EventFd,
    thread_evt: EventFd,
    record_to: Option<PathBuf>,
    loaded: Option<Arc<WorkingSet>>,
    maps: Vec<GuestMapping>,
    id: crate::SnapshotId,
    pages: u64,
    /// What it was prefilled with (a restore with other options does not use it).
    options: PageServerOptions,
}

impl std::fmt::Debug for Prefilled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefilled")
            .field("id", &self.id)
            .field("mappings", &self.maps)
            .field(
                "prefetched",
                &self
                    .shared
                    .counters
                    .pages_prefetched
                    .load(Ordering::Relaxed),
            )
            .finish()
    }
}

impl Prefilled {
    /// Whether it was prefilled from `chain` (the very same loaded chain).
    pub fn is_of(&self, chain: &Arc<MemoryChain>) -> bool {
        Arc::ptr_eq(&self.server.chain, chain)
    }

    /// Whether it is of `chain` (the very same loaded chain), with `options`' working set
    /// and prefetch, over `mappings`: then [`PageServer::start_prefilled`] with it serves
    /// what [`PageServer::start_with`] with these arguments would.
    pub fn matches(
        &self,
        chain: &Arc<MemoryChain>,
        mappings: &[GuestMapping],
        options: &PageServerOptions,
    ) -> bool {
        let mut want = mappings.to_vec();
        want.sort_by_key(|m| m.host_addr);
        Arc::ptr_eq(&self.server.chain, chain)
            && want == self.maps
            && options.working_set == self.options.working_set
            && options.prefetch == self.options.prefetch
    }

    /// Its userfaultfd, to register other memory with: call once the mappings it was
    /// registered on are gone or replaced (a replaced mapping is not registered).
    pub fn into_uffd(self) -> Option<PreparedUffd> {
        Arc::try_unwrap(self.server.uffd).ok().map(PreparedUffd)
    }
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

fn uffd_err(op: &'static str) -> impl FnOnce(userfaultfd::Error) -> Error {
    move |source| Error::Uffd { op, source }
}

fn validate_mappings(maps: &[GuestMapping], image_len: u64) -> Result<Vec<GuestMapping>> {
    if maps.is_empty() {
        return Err(Error::InvalidInput("no guest mappings given".into()));
    }
    let mut sorted = maps.to_vec();
    sorted.sort_by_key(|m| m.host_addr);
    for (i, m) in sorted.iter().enumerate() {
        if m.len == 0
            || !m.host_addr.is_multiple_of(PAGE_SIZE)
            || !m.len.is_multiple_of(PAGE_SIZE)
            || !m.image_offset.is_multiple_of(PAGE_SIZE_U64)
        {
            return Err(Error::InvalidInput(format!(
                "mapping {m:?} is empty or not page-aligned"
            )));
        }
        if m.host_addr.checked_add(m.len).is_none()
            || m.image_offset
                .checked_add(m.len as u64)
                .is_none_or(|e| e > image_len)
        {
            return Err(Error::InvalidInput(format!(
                "mapping {m:?} extends past the {image_len:#x}-byte image"
            )));
        }
        if i > 0 && sorted[i - 1].host_addr + sorted[i - 1].len > m.host_addr {
            return Err(Error::InvalidInput(format!(
                "mappings {:?} and {m:?} overlap",
                sorted[i - 1]
            )));
        }
    }
    let mut by_image = sorted.clone();
    by_image.sort_by_key(|m| m.image_offset);
    for w in by_image.windows(2) {
        if w[0].image_offset + w[0].len as u64 > w[1].image_offset {
            return Err(Error::InvalidInput(format!(
                "mappings {:?} and {:?} cover the same image pages",
                w[0], w[1]
            )));
        }
    }
    Ok(sorted)
}

impl PageServer {
    /// Register `mappings` with a new userfaultfd and start serving them from `chain`.
    ///
    /// The mappings must be anonymous or memfd (`MAP_SHARED` or `MAP_PRIVATE`) mappings
    /// with no page present yet, and must stay mapped until [`PageServer::stop`] returns. Until then,
    /// any access to a page not yet installed blocks until the server installs it.
    /// Serving kernel-mode faults (KVM) needs CAP_SYS_PTRACE, root, or
    /// `vm.unprivileged_userfaultfd = 1`.
    pub fn start(
        chain: Arc<MemoryChain>,
        mappings: &[GuestMapping],
        options: PageServerOptions,
    ) -> Result<PageServer> {
        Self::start_on(chain, mappings, options, spawn_thread())
    }

    /// [`PageServer::start`], running the server on the thread `runner` provides.
    pub fn start_on(
        chain: Arc<MemoryChain>,
        mappings: &[GuestMapping],
        options: PageServerOptions,
        runner: ThreadRunner,
    ) -> Result<PageServer> {
        Self::start_with(chain, mappings, options, runner, None)
    }

    /// [`PageServer::start_on`] with a userfaultfd created earlier (a new one if `None`).
    pub fn start_with(
        chain: Arc<MemoryChain>,
        mappings: &[GuestMapping],
        options: PageServerOptions,
        runner: ThreadRunner,
        uffd: Option<PreparedUffd>,
    ) -> Result<PageServer> {
        Self::start_prefilled(Self::prefill(chain, mappings, options, uffd)?, runner)
    }

    /// The first half of [`PageServer::start_with`], which can be done before the memory
    /// is needed (a standby VM process does it while it waits for a request to restore
    /// the snapshot it opened ahead): registers `mappings` and, with
    /// [`Prefetch::BeforeStart`], installs the working set. Nothing serves faults on the
    /// mappings until [`PageServer::start_prefilled`]; dropping the result unregisters
    /// them (the pages installed stay mapped).
    pub fn prefill(
        chain: Arc<MemoryChain>,
        mappings: &[GuestMapping],
        options: PageServerOptions,
        uffd: Option<PreparedUffd>,
    ) -> Result<Prefilled> {
        let for_options = options.clone();
        let maps = validate_mappings(mappings, chain.mem_size())?;
        let uffd = match uffd {
            Some(PreparedUffd(u)) => u,
            None => PreparedUffd::create()?.0,
        };
        let mut zeropage = true;
        for (i, m) in maps.iter().enumerate() {
            let ioctls = match uffd.register(m.host_addr as *mut libc::c_void, m.len) {
                Ok(i) => i,
                Err(e) => {
                    for prev in &maps[..i] {
                        let _ = uffd.unregister(prev.host_addr as *mut libc::c_void, prev.len);
                    }
                    return Err(Error::Uffd {
                        op: "register (anonymous or memfd memory needed)",
                        source: e,
                    });
                }
            };
            if !ioctls.contains(IoctlFlags::COPY) {
                return Err(Error::PageServer(format!(
                    "UFFDIO_COPY is not available on mapping {m:?}"
                )));
            }
            zeropage &= ioctls.contains(IoctlFlags::ZEROPAGE);
        }
        let uffd = Arc::new(uffd);
        let id = chain.top().header().id;
        let pages = chain.pages();

        let mut record_to = None;
        // Kept whole (shared, not copied) for `first_touches`; the server's prefetch list
        // below is the one copy, as it always was.
        let mut loaded: Option<Arc<WorkingSet>> = None;
        let preloaded = options
            .working_set_loaded
            .as_ref()
            .filter(|ws| ws.id == id && ws.page_count == pages);
        if let (Some(ws), Some(_)) = (preloaded, &options.working_set) {
            loaded = Some(Arc::clone(ws));
        } else if let Some(path) = &options.working_set {
            match WorkingSet::load(path, id, pages) {
                Ok(ws) => loaded = Some(Arc::new(ws)),
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    record_to = Some(options.record_to.clone().unwrap_or_else(|| path.clone()));
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e,
                        "ignoring unusable working-set file; recording a new one");
                    record_to = Some(options.record_to.clone().unwrap_or_else(|| path.clone()));
                }
            }
        }
        if options.prefetch == Prefetch::Off {
            loaded = None;
        }
        let working_set = loaded
            .as_ref()
            .map(|ws| ws.pages.clone())
            .unwrap_or_default();

        let shared = Arc::new(Shared {
            counters: Counters::default(),
            recorded: Mutex::new(Vec::new()),
            error: Mutex::new(None),
            control: AtomicU8::new(RUN),
        });
        add(&shared.counters.working_set_len, working_set.len() as u64);
        let stop_evt = EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC)
            .map_err(|e| Error::PageServer(format!("eventfd: {e}")))?;
        let thread_evt = stop_evt
            .try_clone()
            .map_err(|e| Error::PageServer(format!("eventfd: {e}")))?;

        let mut server = Server {
            uffd: uffd.clone(),
            chain,
            maps: maps.clone(),
            populated: PageBitmap::new(pages),
            removed: PageBitmap::new(pages),
            recording: record_to.is_some(),
            shared: shared.clone(),
            // Grown by `install` to the longest run it reads: a prefetch before the start
            // reads short runs, and zeroing a whole batch's buffer here was ~18 us of it.
            buf: Vec::new(),
            zeropage,
            prefetch: working_set,
            prefetch_pos: 0,
            fill_pos: None,
        };
        // A lazily filled chain fetches the whole working set in parallel now.
        server.chain.prefetch_pages(&server.prefetch);
        if options.prefetch == Prefetch::BeforeStart {
            // Nothing runs yet, so the order does not matter: ascending order lets
            // adjacent pages share one read and one UFFDIO_COPY.
            server.prefetch.sort_unstable();
            let t = Instant::now();
            while server.prefetch_pos < server.prefetch.len() {
                server.prefetch_batch();
            }
            add(&shared.counters.prefetch_ns, t.elapsed().as_nanos() as u64);
        }
        Ok(Prefilled {
            server,
            shared,
            stop_evt,
            thread_evt,
            record_to,
            loaded,
            maps,
            id,
            pages,
            options: for_options,
        })
    }

    /// Starts serving faults on memory [`PageServer::prefill`] prepared, on the thread
    /// `runner` provides.
    pub fn start_prefilled(prefilled: Prefilled, runner: ThreadRunner) -> Result<PageServer> {
        let Prefilled {
            server,
            shared,
            stop_evt,
            thread_evt,
            record_to,
            loaded,
            maps,
            id,
            pages,
            options: _,
        } = prefilled;
        let uffd = Arc::clone(&server.uffd);
        let (done_tx, thread) = mpsc::sync_channel(1);
        let thread_shared = Arc::clone(&shared);
        runner(
            "clade-uffd".into(),
            Box::new(move || {
                // A server that fails or panics leaves faulting threads blocked: say so
                // through `error()`, which the VMM watches, not only to `stop()`.
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    server.run(&thread_evt)
                }))
                .unwrap_or_else(|_| Err(Error::PageServer("server thread panicked".into())));
                if let Err(e) = &r {
                    if let Ok(mut slot) = thread_shared.error.lock() {
                        slot.get_or_insert_with(|| e.to_string());
                    }
                }
                let _ = done_tx.send(r);
            }),
        )
        .map_err(|e| Error::PageServer(format!("spawn thread: {e}")))?;
        tracing::debug!(
            id = %id,
            mappings = maps.len(),
            recording = record_to.is_some(),
            "page server started"
        );
        Ok(PageServer {
            uffd,
            mappings: maps,
            shared,
            stop_evt,
            thread: Some(thread),
            record_to,
            loaded,
            saved_len: AtomicUsize::new(usize::MAX),
            id,
            pages,
        })
    }

    /// Current counters.
    pub fn stats(&self) -> PageServerStats {
        self.shared.counters.snapshot()
    }

    /// The first error met while serving a page, if any. A faulting thread whose page
    /// could not be served stays blocked: the VMM should treat this as fatal for the VM.
    pub fn error(&self) -> Option<String> {
        self.shared.error.lock().map(|e| e.clone()).unwrap_or(None)
    }

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

/// The server thread's state.
struct Server {
    uffd: Arc<Uffd>,
    chain: Arc<MemoryChain>,
    /// Sorted by host address.
    maps: Vec<GuestMapping>,
    populated: PageBitmap,
    removed: PageBitmap,
    recording: bool,
    shared: Arc<Shared>,
    buf: Vec<u8>,
    zeropage: bool,
    prefetch: Vec<u64>,
    prefetch_pos: usize,
    fill_pos: Option<u64>,
}

/// Outcome of installing a run of pages.
enum Installed {
    Done,
    /// Some page was already present (EEXIST): retry page by page.
    Exists,
}

impl Server {
    fn run(mut self, stop_evt: &EventFd) -> Result<()> {
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
        loop {
            let mut pending = Vec::new();
            let uffd = self.uffd.clone();
            for ev in uffd.read_events(buf).map_err(uffd_err("read events"))? {
                pending.push(ev.map_err(uffd_err("decode event"))?);
            }
            if pending.is_empty() {
                return Ok(());
            }
            for ev in pending {
                match ev {
                    Event::Pagefault { addr, .. } => self.serve_fault(addr as usize),
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
        if let Ok(mut e) = self.shared.error.lock() {
            e.get_or_insert(msg);
        }
    }

    fn serve_fault(&mut self, addr: usize) {
        let t = Instant::now();
        let Some(m) = self.mapping_of_addr(addr).copied() else {
            self.record_error(format!("fault at {addr:#x} outside every mapping"));
            return;
        };
        let host = addr & !(PAGE_SIZE - 1);
        let page = (m.image_offset + (host - m.host_addr) as u64) / PAGE_SIZE_U64;
        let c = &self.shared.counters;
        if self.populated.get(page) {
            add(&c.duplicate_faults, 1);
            if let Err(e) = self.uffd.wake(host as *mut libc::c_void, PAGE_SIZE) {
                self.record_error(format!("wake {host:#x}: {e}"));
            }
            return;
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
        match result {
            Ok(_) => {
                self.populated.set(page);
            }
            Err(e) => self.record_error(e.to_string()),
        }
        add(
            &self.shared.counters.fault_service_ns,
            t.elapsed().as_nanos() as u64,
        );
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
    fn prefetch_batch(&mut self) {
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

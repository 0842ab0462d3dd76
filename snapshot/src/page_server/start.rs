//! Starting a [`PageServer`]: the mappings checked and registered with a userfaultfd, the
//! working set loaded (or recording set up) and, with [`Prefetch::BeforeStart`],
//! installed; then the server thread started. The first half can be done ahead
//! ([`PageServer::prefill`], [`Prefilled`]), before the memory is needed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use userfaultfd::IoctlFlags;
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};

use super::server::Server;
use super::{
    add, Counters, GuestMapping, PageServer, PageServerOptions, Prefetch, PreparedUffd, Shared, RUN,
};
use crate::bitmap::PageBitmap;
use crate::memory_file::MemoryChain;
use crate::working_set::WorkingSet;
use crate::{spawn_thread, Error, Result, ThreadRunner, PAGE_SIZE, PAGE_SIZE_U64};

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
}

//! The userfaultfd page server, without KVM: mappings stand in for guest memory and
//! threads stand in for vCPUs.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{make_image, Mapping, Rng, Watchdog, PAGE};
use snapshot::memory_file::{self, GuestRegion, MemoryChain, RegionData};
use snapshot::page_server::{GuestMapping, PageServer, PageServerOptions, Prefetch, StopMode};
use snapshot::working_set::WorkingSet;
use snapshot::{Error, SnapshotId};
use vmm_sys_util::tempdir::TempDir;

const PAGES: usize = 2048; // 8 MiB

struct Fixture {
    _dir: TempDir,
    img: Vec<u8>,
    mem_path: PathBuf,
    ws_path: PathBuf,
    chain: Arc<MemoryChain>,
}

fn fixture(seed: u64) -> Fixture {
    let dir = TempDir::new_with_prefix("/tmp/clade-snap-uffd").unwrap();
    let img = make_image(PAGES, seed);
    let mem_path = dir.as_path().join("vm.mem");
    memory_file::write_full(
        &mem_path,
        SnapshotId::random(),
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&img),
        }],
    )
    .unwrap();
    let chain = Arc::new(MemoryChain::open(&[&mem_path]).unwrap());
    let ws_path = dir.as_path().join("vm.ws");
    Fixture {
        _dir: dir,
        img,
        mem_path,
        ws_path,
        chain,
    }
}

fn whole(m: &Mapping) -> [GuestMapping; 1] {
    [GuestMapping {
        host_addr: m.addr(),
        len: m.len(),
        image_offset: 0,
    }]
}

fn opts(ws: &Path, prefetch: Prefetch) -> PageServerOptions {
    PageServerOptions {
        working_set: Some(ws.to_path_buf()),
        prefetch,
        ..Default::default()
    }
}

/// The pages a "workload" touches: thread 0 a strided scan, thread 1 random pages, both
/// some of the same pages.
fn workload() -> [Vec<usize>; 2] {
    let scan: Vec<usize> = (0..PAGES).step_by(5).take(200).collect();
    let mut rng = Rng::new(42);
    let mut random: Vec<usize> = (0..300).map(|_| rng.below(PAGES as u64) as usize).collect();
    random.extend_from_slice(&scan[..20]);
    [scan, random]
}

fn distinct(w: &[Vec<usize>; 2]) -> usize {
    let mut all: Vec<usize> = w.iter().flatten().copied().collect();
    all.sort_unstable();
    all.dedup();
    all.len()
}

/// Run the workload on two threads, checking every touched page against the image.
fn run_workload(m: &Mapping, img: &[u8], w: &[Vec<usize>; 2]) {
    std::thread::scope(|s| {
        for pages in w {
            s.spawn(move || {
                for &p in pages {
                    assert!(
                        m.read_page(p) == img[p * PAGE..(p + 1) * PAGE],
                        "page {p} differs from the memory file"
                    );
                }
            });
        }
    });
}

#[test]
fn cold_run_records_and_warm_run_prefetches() {
    let _w = Watchdog::new("cold_run_records_and_warm_run_prefetches", 60);
    let f = fixture(1);
    let w = workload();
    let n = distinct(&w);

    // Cold: no working set yet, every first touch is a fault.
    let m = Mapping::anon(PAGES * PAGE);
    let server = PageServer::start(
        f.chain.clone(),
        &whole(&m),
        opts(&f.ws_path, Prefetch::BeforeStart),
    )
    .unwrap();
    assert!(server.is_recording());
    run_workload(&m, &f.img, &w);
    let cold = server.stop(StopMode::Detach).unwrap();
    eprintln!("cold: {:?}", cold.stats);
    assert_eq!(cold.stats.faults, n as u64);
    assert_eq!(cold.stats.pages_prefetched, 0);
    assert_eq!(cold.working_set_saved, Some(n));
    assert!(cold.stats.zero_faults > 0 && cold.stats.zero_faults < n as u64);
    let ws = WorkingSet::load(&f.ws_path, f.chain.top().header().id, PAGES as u64).unwrap();
    assert_eq!(ws.pages.len(), n);
    drop(m);

    // Warm: the working set is installed before the "guest" runs: no faults.
    let m = Mapping::anon(PAGES * PAGE);
    let server = PageServer::start(
        f.chain.clone(),
        &whole(&m),
        opts(&f.ws_path, Prefetch::BeforeStart),
    )
    .unwrap();
    assert!(!server.is_recording());
    assert_eq!(
        server.first_touches(),
        ws.pages,
        "a prefetching run carries what it loaded"
    );
    let after_prefetch = server.stats();
    assert_eq!(after_prefetch.pages_prefetched, n as u64);
    assert_eq!(after_prefetch.working_set_len, n as u64);
    run_workload(&m, &f.img, &w);
    let warm = server.stats();
    eprintln!("warm: {warm:?}");
    assert_eq!(warm.faults, 0, "warm run faulted");
    // A page outside the working set still faults, and is served; it joins what the run
    // carries to a snapshot of it (after the working set), until the VM says its first
    // requests were served (`save_working_set`, which writes nothing here).
    let mut outside = (0..PAGES).filter(|p| !ws.pages.contains(&(*p as u64)));
    let (early, late) = (outside.next().unwrap(), outside.next().unwrap());
    assert!(m.read_page(early) == f.img[early * PAGE..(early + 1) * PAGE]);
    let mut carried = ws.pages.clone();
    carried.push(early as u64);
    assert_eq!(server.first_touches(), carried);
    assert_eq!(server.save_working_set().unwrap(), None);
    assert!(m.read_page(late) == f.img[late * PAGE..(late + 1) * PAGE]);
    assert_eq!(
        server.first_touches(),
        carried,
        "a later fault is not carried"
    );
    let report = server.stop(StopMode::Detach).unwrap();
    assert_eq!(report.stats.faults, 2);
    assert_eq!(report.working_set_saved, None);
    // The working-set file was not rewritten by the warm run.
    assert_eq!(
        WorkingSet::load(&f.ws_path, f.chain.top().header().id, PAGES as u64).unwrap(),
        ws
    );
}

#[test]
fn a_prefilled_mapping_serves_as_a_started_one_and_its_uffd_can_be_reused() {
    let _w = Watchdog::new("a_prefilled_mapping_serves_as_a_started_one", 60);
    let f = fixture(7);
    let w = workload();
    let n = distinct(&w) as u64;
    // Record the working set.
    let m = Mapping::anon(PAGES * PAGE);
    let server = PageServer::start(
        f.chain.clone(),
        &whole(&m),
        opts(&f.ws_path, Prefetch::BeforeStart),
    )
    .unwrap();
    run_workload(&m, &f.img, &w);
    server.stop(StopMode::Detach).unwrap();
    drop(m);

    // Prefilled ahead: the working set is in place before any server runs.
    let m = Mapping::anon(PAGES * PAGE);
    let options = opts(&f.ws_path, Prefetch::BeforeStart);
    let prefilled =
        PageServer::prefill(f.chain.clone(), &whole(&m), options.clone(), None).unwrap();
    assert!(prefilled.is_of(&f.chain));
    assert!(prefilled.matches(&f.chain, &whole(&m), &options));
    let other_chain = Arc::new(MemoryChain::open(&[&f.mem_path]).unwrap());
    assert!(!prefilled.matches(&other_chain, &whole(&m), &options));
    assert!(!prefilled.matches(&f.chain, &whole(&m), &opts(&f.ws_path, Prefetch::Off)));
    let server = PageServer::start_prefilled(prefilled, snapshot::spawn_thread()).unwrap();
    assert_eq!(server.stats().pages_prefetched, n);
    run_workload(&m, &f.img, &w);
    assert_eq!(
        server.stats().faults,
        0,
        "a prefilled run faulted in its working set"
    );
    // A page outside it is still served.
    let p = (0..PAGES)
        .find(|p| !w.iter().flatten().any(|q| q == p))
        .unwrap();
    assert!(m.read_page(p) == f.img[p * PAGE..(p + 1) * PAGE]);
    assert_eq!(server.stop(StopMode::Detach).unwrap().stats.faults, 1);
    drop(m);

    // Not used: its userfaultfd serves another mapping once the first one is gone.
    let m = Mapping::anon(PAGES * PAGE);
    let prefilled =
        PageServer::prefill(f.chain.clone(), &whole(&m), options.clone(), None).unwrap();
    drop(m);
    let uffd = prefilled.into_uffd().expect("its userfaultfd");
    let m = Mapping::anon(PAGES * PAGE);
    let server = PageServer::start_with(
        f.chain.clone(),
        &whole(&m),
        options,
        snapshot::spawn_thread(),
        Some(uffd),
    )
    .unwrap();
    run_workload(&m, &f.img, &w);
    assert_eq!(server.stats().faults, 0);
    server.stop(StopMode::Detach).unwrap();
}

#[test]
fn background_prefetch_and_private_memfd() {
    let _w = Watchdog::new("background_prefetch_and_private_memfd", 60);
    let f = fixture(2);
    let w = workload();
    let n = distinct(&w) as u64;
    // Record with a MAP_PRIVATE memfd mapping (the VMM's other choice).
    let m = Mapping::memfd(PAGES * PAGE, libc::MAP_PRIVATE);
    let server = PageServer::start(
        f.chain.clone(),
        &whole(&m),
        opts(&f.ws_path, Prefetch::Background),
    )
    .unwrap();
    run_workload(&m, &f.img, &w);
    let cold = server.stop(StopMode::Detach).unwrap();
    assert_eq!(cold.stats.faults, n);
    drop(m);

    let m = Mapping::memfd(PAGES * PAGE, libc::MAP_PRIVATE);
    let server = PageServer::start(
        f.chain.clone(),
        &whole(&m),
        opts(&f.ws_path, Prefetch::Background),
    )
    .unwrap();
    run_workload(&m, &f.img, &w);
    let warm = server.stop(StopMode::Detach).unwrap();
    eprintln!("background warm: {:?}", warm.stats);
    // Whatever the race between prefetch and the threads, every page is served once.
    assert_eq!(warm.stats.faults + warm.stats.pages_prefetched, n);
    assert!(
        warm.stats.faults < n,
        "prefetch did nothing: {:?}",
        warm.stats
    );
}

#[test]
fn diff_chain_is_served_lazily() {
    let _w = Watchdog::new("diff_chain_is_served_lazily", 60);
    let f = fixture(3);
    let mut next = f.img.clone();
    let mut rng = Rng::new(3);
    let mut words = vec![0u64; PAGES / 64];
    for p in (0..PAGES).step_by(7) {
        let page = &mut next[p * PAGE..(p + 1) * PAGE];
        if p % 3 == 0 {
            page.fill(0);
        } else {
            rng.fill(page);
        }
        words[p / 64] |= 1 << (p % 64);
    }
    let diff_path = f.mem_path.with_extension("diff");
    memory_file::write_diff(
        &diff_path,
        SnapshotId::random(),
        f.chain.top().header().id,
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&next),
        }],
        &[&words],
    )
    .unwrap();
    let chain = Arc::new(MemoryChain::open(&[&f.mem_path, &diff_path]).unwrap());
    let m = Mapping::anon(PAGES * PAGE);
    let server = PageServer::start(chain, &whole(&m), PageServerOptions::default()).unwrap();
    let all: Vec<usize> = (0..PAGES).collect();
    run_workload(
        &m,
        &next,
        &[all[..PAGES / 2].to_vec(), all[PAGES / 2..].to_vec()],
    );
    let r = server.stop(StopMode::Detach).unwrap();
    assert_eq!(r.stats.faults, PAGES as u64);
    assert_eq!(r.working_set_saved, None);
}

#[test]
fn discarded_pages_read_as_zero_and_fill_completes_memory() {
    let _w = Watchdog::new("discarded_pages_read_as_zero_and_fill_completes_memory", 60);
    let f = fixture(4);
    let m = Mapping::anon(PAGES * PAGE);
    // Two mappings of the one region, as a VMM with a split memslot would register.
    let half = PAGES * PAGE / 2;
    let maps = [
        GuestMapping {
            host_addr: m.addr() + half,
            len: half,
            image_offset: half as u64,
        },
        GuestMapping {
            host_addr: m.addr(),
            len: half,
            image_offset: 0,
        },
    ];
    let server = PageServer::start(
        f.chain.clone(),
        &maps,
        opts(&f.ws_path, Prefetch::BeforeStart),
    )
    .unwrap();
    let data_page = (0..PAGES)
        .find(|&p| {
            f.img[p * PAGE..(p + 1) * PAGE]
                .iter()
                .filter(|&&b| b != 0)
                .count()
                > 100
        })
        .unwrap();
    assert!(m.read_page(data_page) == f.img[data_page * PAGE..(data_page + 1) * PAGE]);
    // The guest discards the page (balloon): it must read as zero, not the file.
    m.discard(data_page * PAGE, PAGE);
    assert!(m.read_page(data_page).iter().all(|&b| b == 0));
    m.write_byte(data_page * PAGE, 9);
    assert_eq!(m.read_page(data_page)[0], 9);

    let r = server.stop(StopMode::FillRemaining).unwrap();
    eprintln!("fill: {:?}", r.stats);
    assert_eq!(r.stats.pages_removed, 1);
    // The page faulted twice but is recorded once.
    assert_eq!(r.working_set_saved, Some(1));
    // Unregistered and complete: every page readable without a server.
    for p in 0..PAGES {
        let page = m.read_page(p);
        if p == data_page {
            assert_eq!(page[0], 9);
        } else {
            assert!(page == f.img[p * PAGE..(p + 1) * PAGE], "page {p}");
        }
    }
    // Every page installed once, plus the discarded page's second fault.
    assert_eq!(
        r.stats.faults + r.stats.pages_filled,
        PAGES as u64 + 1,
        "{:?}",
        r.stats
    );
}

#[test]
fn unusable_working_set_is_replaced_by_a_new_recording() {
    let _w = Watchdog::new("unusable_working_set_is_replaced_by_a_new_recording", 60);
    let f = fixture(5);
    // A working set of another snapshot.
    WorkingSet {
        id: SnapshotId::random(),
        page_count: PAGES as u64,
        pages: vec![1, 2, 3],
    }
    .save(&f.ws_path)
    .unwrap();
    let m = Mapping::anon(PAGES * PAGE);
    let server = PageServer::start(
        f.chain.clone(),
        &whole(&m),
        opts(&f.ws_path, Prefetch::BeforeStart),
    )
    .unwrap();
    assert!(server.is_recording());
    assert_eq!(server.stats().pages_prefetched, 0);
    for p in [10, 5, 700] {
        m.read_page(p);
    }
    // What a snapshot of this run would carry: the touches so far, in order...
    assert_eq!(server.first_touches(), vec![10, 5, 700]);
    assert_eq!(server.save_working_set().unwrap(), Some(3));
    // ...and once saved, the saved part only (later touches are not the first ones).
    m.read_page(42);
    assert_eq!(server.first_touches(), vec![10, 5, 700]);
    // Stopping writes the file again, with everything recorded.
    let r = server.stop(StopMode::Detach).unwrap();
    assert_eq!(r.working_set_saved, Some(4));
    let ws = WorkingSet::load(&f.ws_path, f.chain.top().header().id, PAGES as u64).unwrap();
    assert_eq!(ws.pages, vec![10, 5, 700, 42]);
}

#[test]
fn a_recording_goes_where_record_to_says_and_a_later_run_prefetches_it() {
    let _w = Watchdog::new(
        "a_recording_goes_where_record_to_says_and_a_later_run_prefetches_it",
        60,
    );
    let f = fixture(7);
    // The snapshot's own directory is not written: the recording goes elsewhere.
    let elsewhere = f.ws_path.with_file_name("recorded.ws");
    let m = Mapping::anon(PAGES * PAGE);
    let start = |m: &Mapping| {
        PageServer::start(
            f.chain.clone(),
            &whole(m),
            PageServerOptions {
                record_to: Some(elsewhere.clone()),
                ..opts(&f.ws_path, Prefetch::BeforeStart)
            },
        )
        .unwrap()
    };
    let server = start(&m);
    assert!(server.is_recording());
    for p in [3, 9, 1] {
        m.read_page(p);
    }
    let r = server.stop(StopMode::Detach).unwrap();
    assert_eq!(r.working_set_saved, Some(3));
    assert!(
        !f.ws_path.exists(),
        "nothing written at the snapshot's path"
    );
    let id = f.chain.top().header().id;
    let ws = WorkingSet::load(&elsewhere, id, PAGES as u64).unwrap();
    assert_eq!(ws.pages, vec![3, 9, 1]);
    // Installed as the snapshot's own, a later run prefetches it and records nothing,
    // wherever `record_to` points.
    ws.save(&f.ws_path).unwrap();
    std::fs::remove_file(&elsewhere).unwrap();
    let m = Mapping::anon(PAGES * PAGE);
    let server = start(&m);
    assert!(!server.is_recording());
    assert_eq!(server.stats().pages_prefetched, 3);
    server.stop(StopMode::Detach).unwrap();
    assert!(!elsewhere.exists());
}

#[test]
fn bad_mappings_are_refused_cleanly() {
    let f = fixture(6);
    let m = Mapping::anon(PAGES * PAGE);
    let too_long = [GuestMapping {
        host_addr: m.addr(),
        len: m.len() + PAGE,
        image_offset: 0,
    }];
    assert!(matches!(
        PageServer::start(f.chain.clone(), &too_long, PageServerOptions::default()),
        Err(Error::InvalidInput(_))
    ));
    let unaligned = [GuestMapping {
        host_addr: m.addr() + 8,
        len: PAGE,
        image_offset: 0,
    }];
    assert!(matches!(
        PageServer::start(f.chain.clone(), &unaligned, PageServerOptions::default()),
        Err(Error::InvalidInput(_))
    ));
    // MAP_PRIVATE of a regular file cannot be registered (MISSING mode): a clear error.
    let file = std::fs::File::open(&f.mem_path).unwrap();
    let len = PAGES * PAGE;
    // SAFETY: a fresh read-only private mapping of our own file.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            f.chain.top().header().data_offset as libc::off_t,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    let maps = [GuestMapping {
        host_addr: ptr as usize,
        len,
        image_offset: 0,
    }];
    let r = PageServer::start(f.chain.clone(), &maps, PageServerOptions::default());
    // SAFETY: unmapping the mapping made above.
    unsafe { libc::munmap(ptr, len) };
    match r {
        Err(Error::Uffd { op, .. }) => assert!(op.starts_with("register")),
        other => panic!("expected a register error, got {other:?}"),
    }
    // The memory is still usable without a server.
    assert!(m.read_page(3).iter().all(|&b| b == 0));
}

#[test]
fn shared_memfd_is_served_and_visible_through_the_fd() {
    use std::os::unix::fs::FileExt;
    let _w = Watchdog::new("shared_memfd_is_served_and_visible_through_the_fd", 60);
    let f = fixture(7);
    // MAP_SHARED memfd: installed pages land in the memfd's page cache, so the VMM can
    // keep sharing the memfd and take the next snapshot from it (RegionData::Fd).
    let m = Mapping::memfd(PAGES * PAGE, libc::MAP_SHARED);
    let server =
        PageServer::start(f.chain.clone(), &whole(&m), PageServerOptions::default()).unwrap();
    let all: Vec<usize> = (0..PAGES).collect();
    run_workload(
        &m,
        &f.img,
        &[all[..PAGES / 2].to_vec(), all[PAGES / 2..].to_vec()],
    );
    let r = server.stop(StopMode::Detach).unwrap();
    assert_eq!(r.stats.faults, PAGES as u64);
    assert!(r.stats.zero_faults > 0);
    let memfd = std::fs::File::from(m.memfd_fd().unwrap().try_clone().unwrap());
    let mut via_fd = vec![0u8; PAGES * PAGE];
    memfd.read_exact_at(&mut via_fd, 0).unwrap();
    assert!(via_fd == f.img);
}

//! Measures the page server on this machine:
//!
//! * fault round trip with the MISSING-mode page server (anonymous memory), against a
//!   plain anonymous page fault and a first touch of a `MAP_PRIVATE` file mapping;
//! * a cold run (every page faults) against a warm run (working set prefetched);
//! * a MINOR-mode alternative: a `MAP_SHARED` memfd whose page cache already holds the
//!   image, faults resolved with `UFFDIO_CONTINUE`;
//! * the `copy` backend (eager read of the whole image).
//!
//! Run: `cargo run --release -p snapshot --example uffd_bench [pages] [touches]`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use snapshot::memory_file::{self, GuestRegion, HoleFill, MemoryChain, RegionData};
use snapshot::page_server::{GuestMapping, PageServer, PageServerOptions, Prefetch, StopMode};
use snapshot::{SnapshotId, PAGE_SIZE};
use userfaultfd::{Event, RegisterMode, UffdBuilder};

struct Map {
    ptr: *mut u8,
    len: usize,
}

impl Map {
    fn new(len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> Map {
        // SAFETY: a fresh mapping; no existing memory is affected.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, off) };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Map {
            ptr: ptr.cast(),
            len,
        }
    }
    fn anon(len: usize) -> Map {
        Map::new(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    }
    /// Touch page `p` (read one byte) and return how long it took.
    fn touch(&self, p: usize) -> Duration {
        let t = Instant::now();
        // SAFETY: inside the mapping.
        let v = unsafe { std::ptr::read_volatile(self.ptr.add(p * PAGE_SIZE + 7)) };
        let d = t.elapsed();
        std::hint::black_box(v);
        d
    }
    fn addr(&self) -> usize {
        self.ptr as usize
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn summary(name: &str, mut v: Vec<Duration>) {
    v.sort_unstable();
    let n = v.len();
    let mean = v.iter().sum::<Duration>() / n as u32;
    println!(
        "{name:<46} n={n:<6} mean {:>7.1} us  p50 {:>7.1} us  p99 {:>7.1} us",
        mean.as_secs_f64() * 1e6,
        v[n / 2].as_secs_f64() * 1e6,
        v[n * 99 / 100].as_secs_f64() * 1e6
    );
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let pages = args.first().copied().unwrap_or(65536); // 256 MiB
    let touches = args.get(1).copied().unwrap_or(4096);
    let len = pages * PAGE_SIZE;
    let dir = std::env::temp_dir().join(format!("clade-uffd-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // An image whose pages are all non-zero (worst case for the server: every fault is a
    // read + UFFDIO_COPY).
    let mut img = vec![0u8; len];
    let mut s = 0x1234_5678u64;
    for w in img.chunks_mut(8) {
        w.copy_from_slice(&xorshift(&mut s).to_le_bytes());
    }
    let mem_path = dir.join("vm.mem");
    let id = SnapshotId::random();
    memory_file::write_full(
        &mem_path,
        id,
        &[GuestRegion {
            guest_addr: 0,
            data: RegionData::Slice(&img),
        }],
    )
    .unwrap();
    let chain = Arc::new(MemoryChain::open(&[&mem_path]).unwrap());
    let order: Vec<usize> = (0..touches)
        .map(|_| xorshift(&mut s) as usize % pages)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut shuffled = order.clone();
    for i in (1..shuffled.len()).rev() {
        shuffled.swap(i, xorshift(&mut s) as usize % (i + 1));
    }
    println!(
        "image {} MiB, {} distinct pages touched in random order",
        len >> 20,
        shuffled.len()
    );

    // Baselines.
    let m = Map::anon(len);
    summary(
        "anonymous first touch (no uffd)",
        shuffled.iter().map(|&p| m.touch(p)).collect(),
    );
    drop(m);
    let file = std::fs::File::open(&mem_path).unwrap();
    let m = Map::new(
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE,
        file.as_raw_fd(),
        chain.top().header().data_offset as i64,
    );
    summary(
        "`file` backend: MAP_PRIVATE first touch",
        shuffled.iter().map(|&p| m.touch(p)).collect(),
    );
    drop(m);

    // `copy` backend.
    let mut dst = Map::anon(len);
    let t = Instant::now();
    // SAFETY: our own mapping of `len` bytes, only accessed through this slice here.
    let slice = unsafe { std::slice::from_raw_parts_mut(dst.ptr, dst.len) };
    chain
        .top()
        .read_into(slice, HoleFill::AssumeZeroed)
        .unwrap();
    println!(
        "`copy` backend: eager read of {} MiB: {:.1} ms",
        len >> 20,
        t.elapsed().as_secs_f64() * 1e3
    );
    dst.len = len;
    drop(dst);

    // MISSING-mode page server, cold then warm: random pages, then a contiguous range
    // (where the prefetch coalesces adjacent pages into multi-page UFFDIO_COPYs).
    let contiguous: Vec<usize> = (0..shuffled.len()).collect();
    for (run, ws_name, order) in [
        ("cold random", "random.ws", &shuffled),
        ("warm random", "random.ws", &shuffled),
        ("cold contiguous", "contig.ws", &contiguous),
        ("warm contiguous", "contig.ws", &contiguous),
    ] {
        let ws = dir.join(ws_name);
        let m = Map::anon(len);
        let maps = [GuestMapping {
            host_addr: m.addr(),
            len,
            image_offset: 0,
        }];
        let t = Instant::now();
        let server = PageServer::start(
            chain.clone(),
            &maps,
            PageServerOptions {
                working_set: Some(ws.clone()),
                prefetch: Prefetch::BeforeStart,
                ..Default::default()
            },
        )
        .unwrap();
        let start = t.elapsed();
        let t = Instant::now();
        let lat: Vec<Duration> = order.iter().map(|&p| m.touch(p)).collect();
        let workload = t.elapsed();
        let r = server.stop(StopMode::Detach).unwrap();
        summary(&format!("uffd MISSING {run}: touch latency"), lat);
        println!(
            "    start (incl. prefetch) {:.2} ms, workload {:.2} ms, faults {}, prefetched {}, server time/fault {:.1} us",
            start.as_secs_f64() * 1e3,
            workload.as_secs_f64() * 1e3,
            r.stats.faults,
            r.stats.pages_prefetched,
            r.stats.fault_service_ns as f64 / r.stats.faults.max(1) as f64 / 1e3
        );
    }

    // MINOR mode: MAP_SHARED memfd with the image already in its page cache.
    // SAFETY: memfd_create with a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"clade-minor".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the fd was just created and is owned only here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let memfd = std::fs::File::from(fd);
    let t = Instant::now();
    std::os::unix::fs::FileExt::write_all_at(&memfd, &img, 0).unwrap();
    println!(
        "MINOR setup: populate memfd page cache with {} MiB: {:.1} ms",
        len >> 20,
        t.elapsed().as_secs_f64() * 1e3
    );
    let m = Map::new(
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED,
        memfd.as_raw_fd(),
        0,
    );
    let uffd = Arc::new(
        UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .create()
            .unwrap(),
    );
    uffd.register_with_mode(m.ptr.cast(), len, RegisterMode::MINOR)
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (u, st) = (uffd.clone(), stop.clone());
    let handler = std::thread::spawn(move || {
        let mut served = 0u64;
        while !st.load(Ordering::Relaxed) {
            let mut pfd = libc::pollfd {
                fd: u.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut pfd, 1, 20) } <= 0 {
                continue;
            }
            while let Ok(Some(Event::Pagefault { addr, .. })) = u.read_event() {
                let page = (addr as usize) & !(PAGE_SIZE - 1);
                u.r#continue(page as *mut libc::c_void, PAGE_SIZE, true)
                    .unwrap();
                served += 1;
            }
        }
        served
    });
    let lat: Vec<Duration> = shuffled.iter().map(|&p| m.touch(p)).collect();
    stop.store(true, Ordering::Relaxed);
    let served = handler.join().unwrap();
    summary("uffd MINOR (UFFDIO_CONTINUE): touch latency", lat);
    println!("    minor faults served {served}");
    let _ = uffd.unregister(m.ptr.cast(), len);
    drop(m);
    let _ = std::fs::remove_dir_all(&dir);
}

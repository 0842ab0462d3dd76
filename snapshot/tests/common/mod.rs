//! Helpers shared by the integration tests: deterministic data, and raw mappings to
//! stand in for guest memory (test-only `unsafe`, each with its SAFETY note).
#![allow(dead_code)]

use std::os::fd::{FromRawFd, OwnedFd};

pub const PAGE: usize = snapshot::PAGE_SIZE;

/// xorshift64*: deterministic pseudo-random numbers.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// A guest-memory-like image: random pages, zero pages, and pages with one non-zero byte.
pub fn make_image(pages: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut img = vec![0u8; pages * PAGE];
    for p in 0..pages {
        let page = &mut img[p * PAGE..(p + 1) * PAGE];
        match rng.below(10) {
            0..=5 => rng.fill(page),
            6..=8 => {}
            _ => page[PAGE - 1] = 0xa5,
        }
    }
    img
}

/// An mmap'ed region standing in for guest memory.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    _memfd: Option<OwnedFd>,
}

// SAFETY: the mapping is plain memory owned by this struct; tests access it through raw
// pointers only.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Anonymous private memory.
    pub fn anon(len: usize) -> Mapping {
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapping {
            ptr: ptr.cast(),
            len,
            _memfd: None,
        }
    }

    /// An empty memfd of `len` bytes, mapped with `flags` (MAP_PRIVATE or MAP_SHARED).
    pub fn memfd(len: usize, flags: libc::c_int) -> Mapping {
        // SAFETY: memfd_create with a valid NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"clade-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: fd was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let file = std::fs::File::from(fd.try_clone().unwrap());
        file.set_len(len as u64).unwrap();
        // SAFETY: a fresh mapping of our own memfd; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                0,
            )
        };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapping {
            ptr: ptr.cast(),
            len,
            _memfd: Some(fd),
        }
    }

    pub fn memfd_fd(&self) -> Option<&OwnedFd> {
        self._memfd.as_ref()
    }

    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Read page `i` (faults it in if absent).
    pub fn read_page(&self, i: usize) -> Vec<u8> {
        assert!((i + 1) * PAGE <= self.len);
        let mut out = vec![0u8; PAGE];
        // SAFETY: the page lies inside our mapping; the source is not referenced as a
        // Rust object elsewhere (only through raw pointers). The volatile read touches the
        // page even where the caller drops the copy (which an optimised build elides, and
        // with it the fault a test counts on).
        unsafe {
            std::ptr::read_volatile(self.ptr.add(i * PAGE));
            std::ptr::copy_nonoverlapping(self.ptr.add(i * PAGE), out.as_mut_ptr(), PAGE);
        }
        out
    }

    /// Write one byte (faults the page in if absent).
    pub fn write_byte(&self, offset: usize, v: u8) {
        assert!(offset < self.len);
        // SAFETY: inside our mapping.
        unsafe { std::ptr::write_volatile(self.ptr.add(offset), v) }
    }

    /// The whole mapping as a slice (only once no other thread writes it).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is valid for `len` bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The whole mapping as a mutable slice.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is valid for `len` bytes and `&mut self` makes this the only
        // access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Discard pages (MADV_DONTNEED).
    pub fn discard(&self, offset: usize, len: usize) {
        // SAFETY: the range lies inside our mapping.
        let r = unsafe { libc::madvise(self.ptr.add(offset).cast(), len, libc::MADV_DONTNEED) };
        assert_eq!(r, 0, "madvise: {}", std::io::Error::last_os_error());
    }

    /// Resident pages (mincore).
    pub fn resident_pages(&self) -> usize {
        let mut vec = vec![0u8; self.len.div_ceil(PAGE)];
        // SAFETY: `vec` has one byte per page of the mapping.
        let r = unsafe { libc::mincore(self.ptr.cast(), self.len, vec.as_mut_ptr()) };
        assert_eq!(r, 0);
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping the region this struct mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Bytes the file really occupies on disk.
pub fn allocated_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Aborts the process if not dropped within `secs` (a broken page server would leave a
/// faulting thread blocked forever; better a loud failure than a hung CI run).
pub struct Watchdog(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Watchdog {
    pub fn new(name: &'static str, secs: u64) -> Watchdog {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = done.clone();
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            while start.elapsed().as_secs() < secs {
                if d.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            eprintln!("watchdog: test {name} still running after {secs} s, aborting");
            std::process::abort();
        });
        Watchdog(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

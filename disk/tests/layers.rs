//! Layered disk behaviour on real files: copy-on-write isolation, read-through, flush
//! durability, snapshot (fork) semantics, flatten, corrupt and mismatched layers, disk full.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use disk::ops::{self, CreateOptions, FlattenFormat};
use disk::{Disk, Error, OpenOptions};

const MIB: u64 = 1 << 20;
const BS: u64 = disk::DEFAULT_BLOCK_SIZE as u64;

static NEXT: AtomicUsize = AtomicUsize::new(0);

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let p = std::env::temp_dir().join(format!(
            "clade-disk-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    fn p(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic non-zero-ish bytes.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn rw() -> OpenOptions {
    OpenOptions::default()
}

fn ro() -> OpenOptions {
    OpenOptions { read_only: true }
}

fn read(d: &Disk, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    d.read_at(off, &mut b).unwrap();
    b
}

/// A frozen 4 MiB base whose first 1 MiB is pattern(1) and the rest zeros, imported from a
/// raw file; returns (base path, raw content).
fn make_base(t: &TempDir) -> (PathBuf, Vec<u8>) {
    let mut raw = pattern(1, MIB as usize);
    raw.resize(4 * MIB as usize, 0);
    std::fs::write(t.p("base.raw"), &raw).unwrap();
    let stats = ops::import_raw(&t.p("base.raw"), &t.p("base.cdsk"), None).unwrap();
    assert_eq!(stats.virtual_size, 4 * MIB);
    assert_eq!(stats.blocks, 64);
    assert_eq!(stats.stored, 16, "zero blocks are not stored");
    (t.p("base.cdsk"), raw)
}

fn overlay(t: &TempDir, parent: &Path, name: &str) -> PathBuf {
    let p = t.p(name);
    ops::create(
        &p,
        &CreateOptions {
            parent: Some(parent.to_path_buf()),
            ..Default::default()
        },
    )
    .unwrap();
    p
}

#[test]
fn overlays_on_one_base_are_isolated_and_read_through() {
    let t = TempDir::new();
    let (base, raw) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    let b = overlay(&t, &base, "b.cdsk");
    let mut da = Disk::open(&a, rw()).unwrap();
    let mut db = Disk::open(&b, rw()).unwrap();
    assert_eq!(da.layers().len(), 2);
    // Read-through: a fresh overlay reads exactly the base.
    assert_eq!(read(&da, 0, raw.len()), raw);
    // Partial-block writes at unaligned offsets copy the rest of the block up.
    da.write_at(1000, b"written by A").unwrap();
    db.write_at(1000, b"written by B, longer").unwrap();
    da.write_at(3 * MIB + 5, &pattern(7, 200_000)).unwrap();
    let mut want_a = raw.clone();
    want_a[1000..1012].copy_from_slice(b"written by A");
    want_a[3 * MIB as usize + 5..3 * MIB as usize + 200_005].copy_from_slice(&pattern(7, 200_000));
    let mut want_b = raw.clone();
    want_b[1000..1020].copy_from_slice(b"written by B, longer");
    assert_eq!(read(&da, 0, raw.len()), want_a);
    assert_eq!(read(&db, 0, raw.len()), want_b);
    // The base is untouched, and readable on its own.
    let dbase = Disk::open(&base, ro()).unwrap();
    assert_eq!(read(&dbase, 0, raw.len()), raw);
    // Only the touched blocks are in each overlay: block 0 in both; 4 blocks (3 MiB + 5 ..
    // + 200_005 spans blocks 48..=51) more in A.
    assert_eq!(da.layers()[0].allocated_blocks(), 5);
    assert_eq!(db.layers()[0].allocated_blocks(), 1);
    // Zeros written over never-written space store nothing.
    db.write_at(2 * MIB, &vec![0u8; 2 * BS as usize]).unwrap();
    assert_eq!(db.layers()[0].allocated_blocks(), 1);
    // Whole-disk and boundary checks.
    assert!(matches!(
        da.write_at(4 * MIB - 1, b"ab"),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        da.read_at(u64::MAX - 1, &mut [0u8; 4]),
        Err(Error::OutOfRange { .. })
    ));
    drop((da, db));
    // Reopened, both keep their own view.
    let da = Disk::open(&a, ro()).unwrap();
    let db = Disk::open(&b, ro()).unwrap();
    assert_eq!(read(&da, 0, raw.len()), want_a);
    assert_eq!(read(&db, 0, raw.len()), want_b);
}

const CRASH_CHILD_ENV: &str = "CLADE_DISK_TEST_CRASH_CHILD";

/// Runs in a child process: a flushed write, an unflushed one, then the process ends
/// without dropping the disk (no final commit), like a crash.
fn crash_child(path: &Path) -> ! {
    let mut d = Disk::open(path, rw()).unwrap();
    d.write_at(2 * MIB, b"flushed").unwrap();
    d.flush().unwrap();
    d.write_at(2 * MIB + BS, b"never flushed").unwrap();
    std::process::exit(0);
}

/// Runs this test binary's test `name` in a child process with `env` set.
fn run_child(name: &str, env: (&str, String)) {
    // Output captured: the child's own "test result" line is not one of ours.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env.0, env.1)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn flush_is_the_durability_point() {
    if let Ok(p) = std::env::var(CRASH_CHILD_ENV) {
        crash_child(Path::new(&p));
    }
    let t = TempDir::new();
    let (base, raw) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    run_child(
        "flush_is_the_durability_point",
        (CRASH_CHILD_ENV, a.display().to_string()),
    );
    let len_after_crash = std::fs::metadata(&a).unwrap().len();
    let d = Disk::open(&a, rw()).unwrap();
    assert_eq!(read(&d, 2 * MIB, 7), b"flushed");
    assert_eq!(
        read(&d, 2 * MIB + BS, 13),
        vec![0u8; 13],
        "unflushed new block is lost"
    );
    assert_eq!(read(&d, 0, MIB as usize), raw[..MIB as usize]);
    assert!(
        std::fs::metadata(&a).unwrap().len() < len_after_crash,
        "the uncommitted block is trimmed on a writable open"
    );
    drop(d);
    // A clean close commits without an explicit flush.
    let mut d = Disk::open(&a, rw()).unwrap();
    d.write_at(3 * MIB, b"closed").unwrap();
    drop(d);
    let d = Disk::open(&a, ro()).unwrap();
    assert_eq!(read(&d, 3 * MIB, 6), b"closed");
}

#[test]
fn snapshot_freezes_the_parent_view_for_children() {
    let t = TempDir::new();
    let (base, _) = make_base(&t);
    let vm = overlay(&t, &base, "vm.cdsk");
    let mut d = Disk::open(&vm, rw()).unwrap();
    d.write_at(0, b"before fork").unwrap();
    let frozen = d.snapshot(&t.p("vm.2.cdsk")).unwrap();
    assert_eq!(frozen, vm);
    assert_eq!(d.layers().len(), 3);
    // The parent keeps writing, on its new overlay.
    d.write_at(0, b"parent after").unwrap();
    let child = overlay(&t, &frozen, "child.cdsk");
    let mut c = Disk::open(&child, rw()).unwrap();
    assert_eq!(
        read(&c, 0, 11),
        b"before fork",
        "the child sees the frozen view"
    );
    c.write_at(0, b"child after").unwrap();
    assert_eq!(read(&d, 0, 12), b"parent after");
    assert_eq!(read(&c, 0, 11), b"child after");
    // The frozen layer can no longer be written, not even by opening it directly.
    drop(d);
    assert!(matches!(Disk::open(&vm, rw()), Err(Error::Frozen(_))));
    let d = Disk::open(&t.p("vm.2.cdsk"), ro()).unwrap();
    assert_eq!(read(&d, 0, 12), b"parent after");
}

#[test]
fn flatten_equals_the_logical_content() {
    let t = TempDir::new();
    let (base, raw) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    let mut d = Disk::open(&a, rw()).unwrap();
    d.write_at(12345, &pattern(3, 300_000)).unwrap();
    d.snapshot(&t.p("a2.cdsk")).unwrap();
    d.write_at(4 * MIB - 512, &pattern(4, 512)).unwrap();
    d.write_at(0, &vec![0u8; BS as usize]).unwrap(); // zeros over base data
    drop(d);
    let top = t.p("a2.cdsk");
    let logical = read(&Disk::open(&top, ro()).unwrap(), 0, raw.len());
    assert_eq!(&logical[..BS as usize], &vec![0u8; BS as usize][..]);
    assert_eq!(&logical[4 * MIB as usize - 512..], &pattern(4, 512)[..]);

    let stats = ops::flatten(&top, &t.p("flat.cdsk"), FlattenFormat::Layer).unwrap();
    let flat = Disk::open(&t.p("flat.cdsk"), ro()).unwrap();
    assert_eq!(flat.layers().len(), 1, "standalone");
    assert!(flat.layers()[0].header().frozen());
    assert_eq!(read(&flat, 0, raw.len()), logical);
    assert_eq!(stats.stored, flat.layers()[0].allocated_blocks());

    ops::flatten(&top, &t.p("flat.raw"), FlattenFormat::Raw).unwrap();
    assert_eq!(std::fs::read(t.p("flat.raw")).unwrap(), logical);
    // Outputs are never overwritten.
    assert!(ops::flatten(&top, &t.p("flat.raw"), FlattenFormat::Raw).is_err());
    // And a flattened image can be a base.
    let o = overlay(&t, &t.p("flat.cdsk"), "o.cdsk");
    assert_eq!(read(&Disk::open(&o, ro()).unwrap(), 0, raw.len()), logical);
}

#[test]
fn info_and_blank_disks() {
    let t = TempDir::new();
    let p = t.p("blank.cdsk");
    ops::create(
        &p,
        &CreateOptions {
            virtual_size: Some(10 * MIB),
            ..Default::default()
        },
    )
    .unwrap();
    let mut d = Disk::open(&p, rw()).unwrap();
    assert_eq!(read(&d, 5 * MIB, 100), vec![0u8; 100]);
    d.write_at(5 * MIB, b"x").unwrap();
    drop(d);
    ops::freeze(&p).unwrap();
    let info = ops::info(&p).unwrap();
    assert_eq!(info.len(), 1);
    assert!(info[0].header.frozen());
    assert_eq!(info[0].allocated_blocks, 1);
    assert_eq!(info[0].header.virtual_size, 10 * MIB);
    // Bad geometries are refused up front.
    for (size, bs) in [(1000, None), (0, None), (MIB, Some(1000)), (1 << 60, None)] {
        assert!(ops::create(
            &t.p("bad.cdsk"),
            &CreateOptions {
                virtual_size: Some(size),
                block_size: bs,
                parent: None
            }
        )
        .is_err());
        assert!(!t.p("bad.cdsk").exists());
    }
    // Overlays only on frozen layers.
    let w = t.p("w.cdsk");
    ops::create(
        &w,
        &CreateOptions {
            virtual_size: Some(MIB),
            ..Default::default()
        },
    )
    .unwrap();
    let e = ops::create(
        &t.p("o.cdsk"),
        &CreateOptions {
            parent: Some(w),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("frozen"), "{e}");
}

#[test]
fn a_layer_has_one_writer() {
    let t = TempDir::new();
    let (base, _) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    let _d = Disk::open(&a, rw()).unwrap();
    assert!(matches!(Disk::open(&a, rw()), Err(Error::InUse(_))));
    assert!(matches!(Disk::open(&a, ro()), Err(Error::InUse(_))));
    // Readers of the base share it.
    let _b1 = Disk::open(&base, ro()).unwrap();
    let _o = Disk::open(&overlay(&t, &base, "b.cdsk"), rw()).unwrap();
}

// ---- untrusted files ------------------------------------------------------------------

fn open_err(p: &Path) -> String {
    Disk::open(p, ro()).unwrap_err().to_string()
}

#[test]
fn corrupt_layers_are_refused_with_a_clear_error() {
    let t = TempDir::new();
    let (base, _) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    {
        let mut d = Disk::open(&a, rw()).unwrap();
        d.write_at(0, b"data").unwrap();
        d.write_at(MIB, b"more").unwrap();
    }
    let good = std::fs::read(&a).unwrap();
    let bad = t.p("bad.cdsk");
    let with = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        std::fs::write(&bad, &b).unwrap();
        open_err(&bad)
    };

    let e = with(&|b| b[0] = b'X');
    assert!(e.contains("not a Clade disk layer"), "{e}");
    let e = with(&|b| b.truncate(3));
    assert!(e.contains("not a Clade disk layer"), "{e}");
    let e = with(&|b| b.truncate(2000));
    assert!(e.contains("truncated header"), "{e}");
    let e = with(&|b| b[8] = 9);
    assert!(e.contains("version"), "{e}");
    let e = with(&|b| b[50] ^= 0x40);
    assert!(e.contains("checksum"), "{e}");
    // Version 2: two 4096-byte header slots, then the table at 8192: a 4 MiB disk in
    // 64 KiB blocks has 64 entries (512 bytes).
    const T: usize = 8192;
    let e = with(&|b| b.truncate(T + 100));
    assert!(e.contains("truncated allocation table"), "{e}");
    let e = with(&|b| b[T..T + 8].copy_from_slice(&(1u64 << 40).to_le_bytes()));
    assert!(e.contains("outside the data area"), "{e}");
    let e = with(&|b| b[T..T + 8].copy_from_slice(&65537u64.to_le_bytes()));
    assert!(e.contains("outside the data area"), "{e}");
    let e = with(&|b| {
        let second = b[T + 16 * 8..T + 17 * 8].to_vec();
        b[T..T + 8].copy_from_slice(&second);
    });
    assert!(e.contains("share"), "{e}");
    // Data blocks cut off at the end of the file.
    let e = with(&|b| b.truncate(b.len() - 10));
    assert!(e.contains("outside the data area"), "{e}");
    // An empty file, a directory.
    std::fs::write(&bad, b"").unwrap();
    assert!(open_err(&bad).contains("not a Clade disk layer"));
    assert!(Disk::open(&t.0, ro()).is_err());
    // A frozen layer whose table changed after freezing.
    let mut b = std::fs::read(&base).unwrap();
    let first = b[T..T + 8].to_vec();
    b[T + 63 * 8..T + 64 * 8].copy_from_slice(&first);
    b[T..T + 8].fill(0);
    std::fs::write(&bad, &b).unwrap();
    let e = open_err(&bad);
    assert!(e.contains("table checksum"), "{e}");
    // The good file still opens.
    std::fs::write(&bad, &good).unwrap();
    Disk::open(&bad, ro()).unwrap();
}

#[test]
fn mismatched_parents_are_refused() {
    let t = TempDir::new();
    let (base, raw) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    // Another base in the parent's place: same size, different identity.
    std::fs::rename(&base, t.p("orig.cdsk")).unwrap();
    ops::import_raw(&t.p("base.raw"), &base, None).unwrap();
    let e = open_err(&a);
    assert!(
        e.contains("does not match") && e.contains("created on layer"),
        "{e}"
    );
    // A parent of another size.
    std::fs::remove_file(&base).unwrap();
    std::fs::write(t.p("small.raw"), &raw[..MIB as usize]).unwrap();
    ops::import_raw(&t.p("small.raw"), &base, None).unwrap();
    assert!(open_err(&a).contains("does not match"));
    // Missing parent.
    std::fs::remove_file(&base).unwrap();
    let e = open_err(&a);
    assert!(e.contains("does not exist"), "{e}");
    // The original back: fine again.
    std::fs::rename(t.p("orig.cdsk"), &base).unwrap();
    Disk::open(&a, ro()).unwrap();
    // Same id, but the recorded size/table checksum in the child disagree.
    let good = std::fs::read(&a).unwrap();
    let patch = |o: usize, v: &[u8]| {
        let mut b = good.clone();
        b[o..o + v.len()].copy_from_slice(v);
        b[12..16].fill(0);
        let crc = crc32(&b[..4096]);
        b[12..16].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&a, &b).unwrap();
        open_err(&a)
    };
    let e = patch(88, &(8 * MIB).to_le_bytes());
    assert!(e.contains("virtual size"), "{e}");
    let e = patch(96, &0x1234u32.to_le_bytes());
    assert!(e.contains("table checksum"), "{e}");
    // A parent that is not frozen.
    std::fs::write(&a, &good).unwrap();
    let mut b = std::fs::read(&base).unwrap();
    b[16] = 0;
    b[12..16].fill(0);
    let crc = crc32(&b[..4096]);
    b[12..16].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&base, &b).unwrap();
    let e = open_err(&a);
    assert!(e.contains("not frozen"), "{e}");
}

fn crc32(b: &[u8]) -> u32 {
    crc32fast::hash(b)
}

#[test]
fn chains_cannot_loop() {
    let t = TempDir::new();
    let (base, _) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    ops::freeze(&a).unwrap();
    // Point the base at `a` (its own child): the chain would never end.
    let mut b = std::fs::read(&base).unwrap();
    let a_id = std::fs::read(&a).unwrap()[56..72].to_vec();
    b[72..88].copy_from_slice(&a_id);
    b[88..96].copy_from_slice(&(4 * MIB).to_le_bytes());
    // `a` was frozen into its second header slot (at 4096): its table_crc is there.
    b[96..100].copy_from_slice(&std::fs::read(&a).unwrap()[4096 + 100..4096 + 104]);
    b[104..106].copy_from_slice(&6u16.to_le_bytes());
    b[106..112].copy_from_slice(b"a.cdsk");
    b[12..16].fill(0);
    let crc = crc32(&b[..4096]);
    b[12..16].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&base, &b).unwrap();
    let e = open_err(&a);
    assert!(e.contains("deeper than") || e.contains("in use"), "{e}");
}

// ---- out of space -----------------------------------------------------------------------

#[test]
fn quota_exhaustion_is_an_error_and_leaves_the_disk_consistent() {
    let t = TempDir::new();
    let (base, raw) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    let mut d = Disk::open(&a, rw()).unwrap();
    let data_off = d.layers()[0].header().data_offset;
    d.set_size_limit(Some(data_off + 3 * BS));
    d.write_at(0, &pattern(5, 3 * BS as usize)).unwrap();
    let e = d.write_at(3 * BS + 10, b"no room").unwrap_err();
    assert!(e.is_no_space(), "{e}");
    // In-place writes to blocks already here still work; reads are intact.
    d.write_at(100, b"in place").unwrap();
    let mut want = pattern(5, 3 * BS as usize);
    want[100..108].copy_from_slice(b"in place");
    want.extend_from_slice(&raw[3 * BS as usize..]);
    assert_eq!(read(&d, 0, raw.len()), want);
    d.flush().unwrap();
    drop(d);
    let d = Disk::open(&a, ro()).unwrap();
    assert_eq!(read(&d, 0, raw.len()), want);
}

const FSIZE_CHILD_ENV: &str = "CLADE_DISK_TEST_FSIZE_CHILD";

/// Runs in a child process (see `real_enospc_...`): RLIMIT_FSIZE makes the kernel refuse
/// to grow the overlay file (EFBIG), as a full filesystem would (ENOSPC).
fn fsize_child(path: &Path, limit: u64) {
    // SAFETY: setting SIGXFSZ to ignored (so the limit gives EFBIG instead of killing the
    // process) and lowering our own file size limit; both only affect this process.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    let mut d = Disk::open(path, rw()).unwrap();
    let mut written = 0u64;
    let err = loop {
        match d.write_at(written, &pattern(written, 8192)) {
            Ok(()) => written += BS,
            Err(e) => break e,
        }
        assert!(written < 4 * MIB, "the limit never hit");
    };
    assert!(err.is_no_space(), "{err}");
    d.flush().unwrap();
    std::fs::write(path.with_extension("written"), written.to_string()).unwrap();
}

#[test]
fn real_enospc_from_the_filesystem_keeps_the_image_consistent() {
    if let Ok(spec) = std::env::var(FSIZE_CHILD_ENV) {
        let (path, limit) = spec.split_once(':').unwrap();
        fsize_child(Path::new(path), limit.parse().unwrap());
        return;
    }
    let t = TempDir::new();
    let (base, raw) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    let limit = std::fs::metadata(&a).unwrap().len() + 5 * BS + 100;
    run_child(
        "real_enospc_from_the_filesystem_keeps_the_image_consistent",
        (FSIZE_CHILD_ENV, format!("{}:{limit}", a.display())),
    );
    let written: u64 = std::fs::read_to_string(a.with_extension("written"))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(written, 5 * BS, "five whole blocks fit under the limit");
    let d = Disk::open(&a, rw()).unwrap();
    for i in 0..8u64 {
        let got = read(&d, i * BS, 8192);
        if i < 5 {
            assert_eq!(got, pattern(i * BS, 8192), "block {i}");
        } else {
            assert_eq!(
                got,
                raw[(i * BS) as usize..(i * BS) as usize + 8192],
                "block {i}"
            );
        }
    }
}

// ---- crash-safe header rewrite ----------------------------------------------------------

/// xorshift64*: deterministic pseudo-random numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn a_torn_freeze_leaves_the_layer_in_its_old_or_its_new_state() {
    let t = TempDir::new();
    let (base, raw) = make_base(&t);
    let a = overlay(&t, &base, "a.cdsk");
    let data = pattern(40, 100_000);
    {
        let mut d = Disk::open(&a, rw()).unwrap();
        d.write_at(3 * BS + 7 * 512, &data).unwrap();
        d.flush().unwrap();
    }
    let mut want = raw.clone();
    let at = (3 * BS + 7 * 512) as usize;
    want[at..at + data.len()].copy_from_slice(&data);
    let before = std::fs::read(&a).unwrap();
    let old_header = Disk::open(&a, ro()).unwrap().layers()[0].header().clone();
    ops::freeze(&a).unwrap();
    let after = std::fs::read(&a).unwrap();
    let new_header = Disk::open(&a, ro()).unwrap().layers()[0].header().clone();
    assert!(new_header.frozen() && !old_header.frozen());
    assert_eq!(new_header.sequence, old_header.sequence + 1);
    // The freeze wrote only the second header slot (the first stays as it was).
    const SLOT: std::ops::Range<usize> = 4096..8192;
    assert_eq!(before.len(), after.len());
    assert_eq!(
        before[..SLOT.start],
        after[..SLOT.start],
        "slot 0 untouched"
    );
    assert_eq!(
        before[SLOT.end..],
        after[SLOT.end..],
        "table and data untouched"
    );
    assert_ne!(before[SLOT], after[SLOT]);

    // Every way the slot write can be torn by a crash: a prefix or a suffix of the new
    // bytes reached the disk, any mix of its eight 512-byte sectors, or garbage.
    let mut rng = Rng(0x746f_726e_6672_7a65);
    let mut slots: Vec<Vec<u8>> = Vec::new();
    for cut in (0..=4096).step_by(16) {
        let mut s = after[SLOT].to_vec();
        s[cut..].copy_from_slice(&before[SLOT][cut..]);
        slots.push(s);
        let mut s = before[SLOT].to_vec();
        s[cut..].copy_from_slice(&after[SLOT][cut..]);
        slots.push(s);
    }
    for mask in 0..256u32 {
        let mut s = before[SLOT].to_vec();
        for sector in 0..8 {
            if mask & (1 << sector) != 0 {
                let r = sector * 512..(sector + 1) * 512;
                s[r.clone()].copy_from_slice(&after[SLOT][r]);
            }
        }
        slots.push(s);
    }
    for _ in 0..100 {
        let mut s = after[SLOT].to_vec();
        let from = (rng.next() % 4096) as usize;
        let to = from + (rng.next() % (4096 - from as u64 + 1)) as usize;
        for b in &mut s[from..to] {
            *b = rng.next() as u8;
        }
        slots.push(s);
    }
    let torn = t.p("torn.cdsk");
    let (mut old, mut new) = (0, 0);
    for (i, s) in slots.iter().enumerate() {
        let mut b = before.clone();
        b[SLOT].copy_from_slice(s);
        std::fs::write(&torn, &b).unwrap();
        let d = Disk::open(&torn, ro())
            .unwrap_or_else(|e| panic!("torn write {i} left the layer unopenable: {e}"));
        let h = d.layers()[0].header().clone();
        if h.frozen() {
            assert_eq!(h, new_header, "case {i}");
            new += 1;
        } else {
            assert_eq!(h, old_header, "case {i}");
            old += 1;
        }
        assert_eq!(read(&d, 0, want.len()), want, "case {i}: content");
        drop(d);
        // The old state is the layer before the freeze: it can be frozen again.
        if !h.frozen() && i % 50 == 0 {
            ops::freeze(&torn).unwrap();
            let d = Disk::open(&torn, ro()).unwrap();
            assert!(d.layers()[0].header().frozen());
            assert_eq!(read(&d, 0, want.len()), want);
        }
    }
    println!(
        "torn freeze: {} cases, {old} old state, {new} new",
        slots.len()
    );
    assert!(old > 0 && new > 0, "{old} old, {new} new");
}

#[test]
fn version_1_layers_still_open_write_freeze_and_parent() {
    let t = TempDir::new();
    let p = t.p("v1.cdsk");
    // What older builds wrote: one header slot, the table at 4096, data at 64 KiB.
    let mut h = disk::Header::new(4 * MIB, disk::DEFAULT_BLOCK_SIZE, [3; 16], None).unwrap();
    h.version = disk::VERSION_1;
    h.sequence = 0;
    h.table_offset = disk::HEADER_SIZE;
    h.data_offset = BS;
    let mut b = h.encode();
    b.resize(BS as usize, 0);
    std::fs::write(&p, &b).unwrap();
    let data = pattern(41, 70_000);
    {
        let mut d = Disk::open(&p, rw()).unwrap();
        assert_eq!(d.layers()[0].header(), &h);
        d.write_at(MIB, &data).unwrap();
        d.flush().unwrap();
    }
    let file = std::fs::read(&p).unwrap();
    let entry =
        |f: &[u8], i: usize| u64::from_le_bytes(f[4096 + 8 * i..4104 + 8 * i].try_into().unwrap());
    assert_ne!(entry(&file, 16), 0, "the table is at 4096");
    ops::freeze(&p).unwrap();
    let d = Disk::open(&p, ro()).unwrap();
    let fh = d.layers()[0].header().clone();
    assert!(fh.frozen());
    assert_eq!((fh.version, fh.table_offset), (disk::VERSION_1, 4096));
    assert_eq!(read(&d, MIB, data.len()), data);
    drop(d);
    // An overlay (version 2) on the version-1 base.
    let c = overlay(&t, &p, "child.cdsk");
    let mut d = Disk::open(&c, rw()).unwrap();
    assert_eq!(d.layers()[0].header().version, disk::VERSION);
    assert_eq!(read(&d, MIB, data.len()), data);
    d.write_at(MIB, b"child").unwrap();
    assert_eq!(read(&d, MIB, 5), b"child");
}

/// A frozen chain base ← mid ← top in `t` with distinct content per layer; returns the
/// three paths (top first) and the chain's content.
fn frozen_chain(t: &TempDir) -> ([PathBuf; 3], Vec<u8>) {
    let (base, _) = make_base(t);
    let mid = overlay(t, &base, "mid.cdsk");
    {
        let mut d = Disk::open(&mid, rw()).unwrap();
        d.write_at(5 * BS + 100, &pattern(50, 70_000)).unwrap();
    }
    ops::freeze(&mid).unwrap();
    let top = overlay(t, &mid, "top.cdsk");
    {
        let mut d = Disk::open(&top, rw()).unwrap();
        d.write_at(200, &pattern(51, 3000)).unwrap();
        d.write_at(40 * BS, &pattern(52, 2 * BS as usize)).unwrap();
    }
    ops::freeze(&top).unwrap();
    let d = Disk::open(&top, ro()).unwrap();
    let content = read(&d, 0, d.virtual_size() as usize);
    ([top, mid, base], content)
}

#[test]
fn a_moved_chain_opens_again_once_each_child_names_its_parent_anew() {
    let t = TempDir::new();
    let ([top, mid, base], content) = frozen_chain(&t);
    let other = TempDir::new();
    let (top2, mid2, base2) = (other.p("t.cdsk"), other.p("m.cdsk"), other.p("b.cdsk"));
    for (from, to) in [(&top, &top2), (&mid, &mid2), (&base, &base2)] {
        std::fs::copy(from, to).unwrap();
    }
    // Under the new names the recorded parents (`mid.cdsk`, `base.cdsk`) are not there.
    assert!(matches!(
        Disk::open(&top2, ro()),
        Err(Error::ParentMismatch { .. })
    ));
    let before = Disk::open(&top, ro()).unwrap().layers()[0].header().clone();
    // Bottom up: a child is checked against its parent's whole chain.
    assert!(matches!(
        ops::set_parent_path(&top2, &mid2),
        Err(Error::ParentMismatch { .. })
    ));
    ops::set_parent_path(&mid2, &base2).unwrap();
    ops::set_parent_path(&top2, &mid2).unwrap();
    let d = Disk::open(&top2, ro()).unwrap();
    assert_eq!(read(&d, 0, content.len()), content);
    let after = d.layers()[0].header().clone();
    assert!(after.frozen());
    assert_eq!(after.layer_id, before.layer_id);
    assert_eq!(after.table_crc, before.table_crc);
    assert_eq!(after.sequence, before.sequence + 1);
    let (pb, pa) = (before.parent.unwrap(), after.parent.unwrap());
    assert_eq!(
        (pa.id, pa.virtual_size, pa.table_crc),
        (pb.id, pb.virtual_size, pb.table_crc)
    );
    assert_eq!(
        pa.path,
        PathBuf::from("m.cdsk"),
        "same directory: by file name"
    );
    drop(d);
    // Overlays still go on the moved layer, and the original chain is untouched.
    let c = overlay(&other, &top2, "c.cdsk");
    assert_eq!(
        read(&Disk::open(&c, ro()).unwrap(), 0, content.len()),
        content
    );
    assert_eq!(
        read(&Disk::open(&top, ro()).unwrap(), 0, content.len()),
        content
    );
    // A parent in another directory is recorded by absolute path.
    ops::set_parent_path(&top2, &mid).unwrap();
    let d = Disk::open(&top2, ro()).unwrap();
    assert_eq!(
        d.layers()[0].header().parent.as_ref().unwrap().path,
        mid.canonicalize().unwrap()
    );
    assert_eq!(read(&d, 0, content.len()), content);
}

#[test]
fn a_parent_path_is_only_set_to_the_parent_recorded() {
    let t = TempDir::new();
    let ([top, mid, base], content) = frozen_chain(&t);
    let bytes = std::fs::read(&top).unwrap();
    let err = |r: disk::Result<()>| r.unwrap_err().to_string();
    // Another layer (the grandparent): refused, naming the mismatch; nothing written.
    let e = err(ops::set_parent_path(&top, &base));
    assert!(e.contains("does not match"), "{e}");
    let e = err(ops::set_parent_path(&top, &t.p("missing.cdsk")));
    assert!(e.contains("missing.cdsk"), "{e}");
    // A copy of the parent with a changed table: same id, other content.
    let forged = t.p("forged.cdsk");
    let mut f = std::fs::read(&mid).unwrap();
    let last = f.len() - 1;
    f[last] ^= 1;
    std::fs::write(&forged, &f).unwrap();
    // (the data changed, not the table: the header and table still match, as they should
    // for a byte-identical layer; a forged table is refused)
    ops::set_parent_path(&top, &forged).unwrap();
    ops::set_parent_path(&top, &mid).unwrap();
    let mut f = std::fs::read(&mid).unwrap();
    let table = disk::table_offset_for(disk::VERSION) as usize;
    f[table] ^= 0x40;
    std::fs::write(&forged, &f).unwrap();
    assert!(ops::set_parent_path(&top, &forged).is_err());
    // A base has no parent to move.
    let e = err(ops::set_parent_path(&base, &mid));
    assert!(e.contains("no parent"), "{e}");
    // A layer in use is not rewritten.
    let d = Disk::open(&top, ro()).unwrap();
    assert!(matches!(
        ops::set_parent_path(&top, &mid),
        Err(Error::InUse(_))
    ));
    drop(d);
    let now = std::fs::read(&top).unwrap();
    // Only the header slots changed (two successful rewrites), never table or data.
    assert_eq!(bytes[8192..], now[8192..]);
    assert_eq!(
        read(&Disk::open(&top, ro()).unwrap(), 0, content.len()),
        content
    );
}

#[test]
fn a_parent_path_rewrite_writes_only_the_header_slot_not_in_use() {
    let t = TempDir::new();
    let ([top, mid, _], _) = frozen_chain(&t);
    let before = std::fs::read(&top).unwrap();
    let seq = |p: &Path| Disk::open(p, ro()).unwrap().layers()[0].header().sequence;
    let s0 = seq(&top);
    ops::set_parent_path(&top, &mid).unwrap();
    let after = std::fs::read(&top).unwrap();
    assert_eq!(seq(&top), s0 + 1);
    // The freeze wrote slot 1; this rewrite goes to slot 0, and slot 1 stays valid.
    assert_ne!(before[..4096], after[..4096]);
    assert_eq!(before[4096..], after[4096..]);
    // A torn write of slot 0 (garbage in it) leaves the layer as it was.
    let mut torn = after.clone();
    torn[100..300].fill(0xa5);
    let p = t.p("torn.cdsk");
    std::fs::write(&p, &torn).unwrap();
    let d = Disk::open(&p, ro()).unwrap();
    assert_eq!(d.layers()[0].header().sequence, s0);
}

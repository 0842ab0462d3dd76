//! Native KVM tier: the virtio balloon's free page reporting in a real VM. The bare-metal
//! guest has no balloon driver, so the test plays the driver from the host: it sets the
//! device up through its MMIO registers (the way a vCPU's accesses reach them), writes
//! reporting-queue descriptors into guest memory and notifies. It checks the host memory
//! behind guest RAM drops by what was reported, that the pages read back as zero (memfd
//! memory) or as the snapshot file under them (a `file` restore), that a diff snapshot
//! leaves out pages discarded since they were written (but not pages written again after
//! their discard), also where the discarded pages read as non-zero file contents, and
//! that the balloon comes back from a snapshot where it was (and, ignored for now, that a
//! page server filling a restored VM's memory serves reported pages as zero).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clade_tests::guest_config;
use vmm::{MemoryBackend, RestoreOptions, SerialOutput, SnapshotKind, Vm};

const MIB: u64 = 1 << 20;
/// The first virtio-mmio slot (the balloon is the VM's only virtio device).
const BASE: u64 = 0xd000_1000;
/// Where the test driver keeps its rings: queue `q` at `RINGS + q * 0x3000` (descriptor
/// table), its avail ring 0x1000 above, its used ring 0x2000 above.
const RINGS: u64 = 200 * MIB;
const QSIZE: u16 = 16;
const REPORTING: u32 = 2;
/// The guest's `memfill` area: 64 MiB from 64 MiB.
const FILL: u64 = 64 * MIB;

struct TmpDir(PathBuf);

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn serial(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned()
}

fn reg_write(vm: &Vm, off: u64, v: u32) {
    assert!(vm.mmio_access(BASE + off, &mut v.to_le_bytes(), true));
}

fn reg_read(vm: &Vm, off: u64) -> u32 {
    let mut b = [0u8; 4];
    assert!(vm.mmio_access(BASE + off, &mut b, false));
    u32::from_le_bytes(b)
}

fn ring(q: u32) -> u64 {
    RINGS + 0x3000 * u64::from(q)
}

fn read_u16(vm: &Vm, addr: u64) -> u16 {
    let mut b = [0u8; 2];
    vm.read_guest(addr, &mut b).unwrap();
    u16::from_le_bytes(b)
}

/// What Linux's virtio_balloon does on probe, with free page reporting.
fn driver_init(vm: &Vm) {
    assert_eq!(reg_read(vm, 0x008), 5, "a balloon in slot 0");
    reg_write(vm, 0x070, 0);
    reg_write(vm, 0x070, 1);
    reg_write(vm, 0x070, 3);
    reg_write(vm, 0x014, 0);
    let lo = reg_read(vm, 0x010);
    reg_write(vm, 0x014, 1);
    let hi = reg_read(vm, 0x010);
    assert_eq!((hi, lo), (1, 1 << 5), "VERSION_1 and FREE_PAGE_REPORTING");
    reg_write(vm, 0x024, 1);
    reg_write(vm, 0x020, 1);
    reg_write(vm, 0x024, 0);
    reg_write(vm, 0x020, 1 << 5);
    reg_write(vm, 0x070, 0xb);
    assert_eq!(reg_read(vm, 0x070), 0xb);
    vm.write_guest(RINGS, &vec![0u8; 0x9000]).unwrap();
    for q in 0..3 {
        reg_write(vm, 0x030, q);
        assert_eq!(reg_read(vm, 0x034), 256);
        reg_write(vm, 0x038, u32::from(QSIZE));
        for (off, a) in [
            (0x080, ring(q)),
            (0x090, ring(q) + 0x1000),
            (0x0a0, ring(q) + 0x2000),
        ] {
            reg_write(vm, off, a as u32);
            reg_write(vm, off + 4, (a >> 32) as u32);
        }
        reg_write(vm, 0x044, 1);
        assert_eq!(reg_read(vm, 0x044), 1);
    }
    reg_write(vm, 0x070, 0xf);
    assert_eq!(reg_read(vm, 0x070), 0xf, "activated");
}

/// Reports `ranges` (guest address, length) free in one chain and waits for the device to
/// return it; `n` is the number of chains reported before on this queue.
fn report(vm: &Vm, n: u16, ranges: &[(u64, u32)]) {
    let q = REPORTING;
    for (i, &(addr, len)) in ranges.iter().enumerate() {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        let more = i + 1 < ranges.len();
        let flags: u16 = 2 | u16::from(more); // WRITE, NEXT
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&(i as u16 + 1).to_le_bytes());
        vm.write_guest(ring(q) + 16 * i as u64, &d).unwrap();
    }
    let avail = ring(q) + 0x1000;
    vm.write_guest(avail + 4 + 2 * u64::from(n % QSIZE), &0u16.to_le_bytes())
        .unwrap();
    vm.write_guest(avail + 2, &(n + 1).to_le_bytes()).unwrap();
    reg_write(vm, 0x050, q);
    let t = Instant::now();
    while read_u16(vm, ring(q) + 0x2002) != n + 1 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the report never came back"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn pss_mib(vm: &Vm) -> f64 {
    vm.memory_pss_kib().unwrap() as f64 / 1024.0
}

fn zero(vm: &Vm, addr: u64, len: usize) -> bool {
    let mut b = vec![0xeeu8; len];
    vm.read_guest(addr, &mut b).unwrap();
    b.iter().all(|&x| x == 0)
}

#[test]
fn reported_free_pages_go_back_to_the_host_and_stay_out_of_snapshots() {
    let dir = TmpDir(std::env::temp_dir().join(format!("clade-balloon-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    std::fs::create_dir_all(&dir.0).unwrap();
    let mut c = guest_config("memfill:7:64,memsum,loop:37");
    c.mem_mib = 256;
    c.balloon = true;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    let t = Instant::now();
    while !serial(&vm).contains("step memsum ok") {
        assert!(t.elapsed() < Duration::from_secs(30), "{}", serial(&vm));
        std::thread::sleep(Duration::from_millis(2));
    }
    driver_init(&vm);

    // 1. The guest frees 32 MiB of what it filled: the host gets it back.
    let before = pss_mib(&vm);
    report(&vm, 0, &[(FILL, 32 << 20)]);
    let after = pss_mib(&vm);
    println!("guest RAM PSS: {before:.1} MiB before reporting 32 MiB free, {after:.1} MiB after");
    assert!(before - after >= 32.0 * 0.95, "{before} -> {after} MiB");
    // The discarded memfd pages read as zero; the rest of the fill is intact.
    assert!(zero(&vm, FILL, 4096) && zero(&vm, FILL + 32 * MIB - 4096, 4096));
    assert!(!zero(&vm, FILL + 32 * MIB, 4096));

    // 2. A full snapshot skips the hole (the memfd's), so it holds about the 32 MiB left.
    vm.pause().unwrap();
    let full = dir.0.join("full");
    let info = vmm::snapshot(&mut vm, &full, SnapshotKind::Full).unwrap();
    println!(
        "full snapshot: {} pages written ({:.1} MiB)",
        info.pages_written,
        info.pages_written as f64 / 256.0
    );
    assert!(info.pages_written * 4096 < 40 * MIB, "{info:?}");

    // 3. A diff: 4 MiB written, 2 MiB of it then freed, 1 MiB of the rest freed and written
    // again. The freed pages are not copied; the ones written again are.
    let w = FILL + 36 * MIB;
    vm.write_guest(w, &vec![0x5a; 4 << 20]).unwrap();
    report(&vm, 1, &[(w, 2 << 20)]);
    report(&vm, 2, &[(w + 2 * MIB, 1 << 20)]);
    vm.write_guest(w + 2 * MIB, &vec![0xa5; 1 << 20]).unwrap();
    let diff = dir.0.join("diff");
    let info = vmm::snapshot(&mut vm, &diff, SnapshotKind::Diff).unwrap();
    println!(
        "diff snapshot: {} dirty pages considered, {} written (4 MiB = 1024 pages written by \
         the host, 512 of them discarded since)",
        info.pages_considered, info.pages_written
    );
    assert!(
        (512..=540).contains(&info.pages_considered),
        "the 512 discarded pages left out, the rest kept: {info:?}"
    );
    vm.shutdown();
    drop(vm);

    // 4. Restored (`file` backend: private copy-on-write of the snapshot), the balloon is
    // back where it was and gives private pages back.
    let mut vm = vmm::restore(
        &diff,
        MemoryBackend::File,
        RestoreOptions {
            serial: SerialOutput::Memory,
            dirty_tracking: true,
            start: true,
            ..RestoreOptions::default()
        },
    )
    .unwrap();
    assert!(vm.config().balloon, "the restored VM has its balloon");
    let mut snap = vec![0u8; 8 << 20];
    let at = FILL + 48 * MIB;
    vm.read_guest(at, &mut snap).unwrap();
    vm.write_guest(at, &vec![0x77; 8 << 20]).unwrap();
    let before = pss_mib(&vm);
    report(&vm, 3, &[(at, 8 << 20)]);
    let after = pss_mib(&vm);
    println!(
        "restored (file backend): guest RAM PSS {before:.1} MiB before reporting 8 MiB of \
         private pages free, {after:.1} MiB after"
    );
    assert!(before - after >= 8.0 * 0.95, "{before} -> {after} MiB");
    let mut back = vec![0u8; 8 << 20];
    vm.read_guest(at, &mut back).unwrap();
    assert!(
        back == snap,
        "the pages read as the snapshot file under them again"
    );

    // 5. Its next diff leaves those 8 MiB out: written since the restore, but discarded
    // since, they read as the file under them (non-zero: without the discard log they
    // would be copied).
    vm.pause().unwrap();
    let info = vmm::snapshot(&mut vm, &dir.0.join("diff2"), SnapshotKind::Diff).unwrap();
    println!(
        "diff of the restored VM: {} dirty pages considered, {} written (2048 written by the \
         host, then discarded)",
        info.pages_considered, info.pages_written
    );
    assert!(
        info.pages_considered < 64 && info.pages_written < 64,
        "{info:?}"
    );
    vm.shutdown();
    vm.shutdown();
}

/// A fork freezes the parent's memfd as the children's base and maps it private in the
/// parent (in place: the parent's guest memory regions still say `MAP_SHARED`). What the
/// parent reports free afterwards must never punch the frozen memfd: the kernel refuses
/// `MADV_REMOVE` on the private mapping and the balloon drops the parent's pages with
/// `MADV_DONTNEED` instead, so a child still reads what was there at the fork.
#[test]
fn a_parents_report_after_a_fork_leaves_its_childrens_memory_alone() {
    let mut c = guest_config("memfill:7:64,memsum,loop:37");
    c.mem_mib = 256;
    c.balloon = true;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    let t = Instant::now();
    while !serial(&vm).contains("step memsum ok") {
        assert!(t.elapsed() < Duration::from_secs(30), "{}", serial(&vm));
        std::thread::sleep(Duration::from_millis(2));
    }
    driver_init(&vm);
    let mut at_fork = vec![0u8; 32 << 20];
    vm.read_guest(FILL, &mut at_fork).unwrap();
    assert!(at_fork.iter().any(|&b| b != 0));
    let mut children = vmm::fork(
        &mut vm,
        1,
        vmm::ForkOptions {
            serial: SerialOutput::Memory,
            ..vmm::ForkOptions::default()
        },
    )
    .unwrap();
    let child = children.pop().unwrap();
    // The parent maps the frozen pages again (its range starts empty after the fork).
    let mut got = vec![0u8; 32 << 20];
    vm.read_guest(FILL, &mut got).unwrap();
    let before = pss_mib(&vm);
    report(&vm, 0, &[(FILL, 32 << 20)]);
    let after = pss_mib(&vm);
    println!("forked parent: guest RAM PSS {before:.1} -> {after:.1} MiB after reporting 32 MiB");
    // (The frozen pages count in part: the parent's old mapping may still hold them.)
    assert!(before >= 15.0 && after < 1.0, "{before} -> {after} MiB");
    child.read_guest(FILL, &mut got).unwrap();
    assert!(
        got == at_fork,
        "the child's memory is as it was at the fork"
    );
    vm.read_guest(FILL, &mut got).unwrap();
    assert!(got == at_fork, "the parent reads the frozen pages again");
    drop(child);
    vm.shutdown();
}

/// A VM restored on demand (`uffd`: a page server fills guest memory) whose balloon
/// discards: the reported pages reach the page server as removed (UFFD_EVENT_REMOVE) and
/// read as zero from then on. Ignored: it hangs about one run in five (the test thread
/// waits on a futex while the page server thread runs; not yet understood), so it is a
/// reproducer, run with `--ignored`.
#[test]
#[ignore = "intermittent hang of a balloon discard under a uffd page server"]
fn a_page_server_serves_reported_pages_as_zero() {
    let dir =
        TmpDir(std::env::temp_dir().join(format!("clade-balloon-uffd-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    std::fs::create_dir_all(&dir.0).unwrap();
    let mut c = guest_config("memfill:7:64,memsum,loop:37");
    c.mem_mib = 256;
    c.balloon = true;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    let t = Instant::now();
    while !serial(&vm).contains("step memsum ok") {
        assert!(t.elapsed() < Duration::from_secs(30), "{}", serial(&vm));
        std::thread::sleep(Duration::from_millis(2));
    }
    driver_init(&vm);
    report(&vm, 0, &[(FILL, 4 << 20)]);
    let full = dir.0.join("full");
    vmm::snapshot(&mut vm, &full, SnapshotKind::Full).unwrap();
    vm.shutdown();
    drop(vm);
    // 6. Restored on demand (`uffd`: a page server fills guest memory): reported pages
    // reach the page server as removed (UFFD_EVENT_REMOVE) and read as zero from then on,
    // also those it had served before.
    let mut vm = vmm::restore(
        &full,
        MemoryBackend::Uffd,
        RestoreOptions {
            serial: SerialOutput::Memory,
            start: true,
            ..RestoreOptions::default()
        },
    )
    .unwrap();
    let at = FILL + 40 * MIB;
    assert!(!zero(&vm, at, 4096), "served from the snapshot");
    report(&vm, 1, &[(at, 4 << 20)]);
    // The counter moves once the server has handled the event it already read.
    let t = Instant::now();
    let mut stats = vm.page_server_stats().expect("a page server runs");
    while stats.pages_removed < 1024 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
        stats = vm.page_server_stats().expect("a page server runs");
    }
    println!(
        "uffd restore: {} pages removed after reporting 4 MiB",
        stats.pages_removed
    );
    assert!(stats.pages_removed >= 1024, "{stats:?}");
    assert!(zero(&vm, at, 4 << 20), "reported pages read as zero");
    assert!(
        !zero(&vm, at + (4 << 20), 4096),
        "the next page is still served"
    );
    vm.shutdown();
}

//! Native KVM tier: snapshot a running native test guest and resume it with every memory
//! backend. The resumed guest must continue exactly where it was: same memory (checked by
//! the host over all of guest memory, and by the guest's own `memsum` step), same CPU state
//! (a counting loop finishes, later steps run), working interrupts (the `hlt` step) and
//! devices (vsock pings).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clade_tests::guest_config;
use vmm::agent::{Client, Transport, AGENT_VSOCK_PORT};
use vmm::VsockConfig;
use vmm::{MemoryBackend, RestoreOptions, MEMORY_FILE, STATE_FILE};
use vmm::{SerialOutput, SnapshotKind, Vm, VmExit};

const T: Duration = Duration::from_secs(30);
const BACKENDS: [MemoryBackend; 3] = [
    MemoryBackend::Uffd,
    MemoryBackend::File,
    MemoryBackend::Copy,
];
const AGENT: Transport = Transport::Vsock {
    port: AGENT_VSOCK_PORT,
};

struct TmpDir(PathBuf);

impl TmpDir {
    fn new(name: &str) -> TmpDir {
        let d = std::env::temp_dir().join(format!("clade-snaptest-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TmpDir(d)
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn serial(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned()
}

fn options() -> RestoreOptions {
    RestoreOptions {
        serial: SerialOutput::Memory,
        ..RestoreOptions::default()
    }
}

/// Hash of all guest memory, read by the host, but the VM generation ID (which every
/// restore changes on purpose; `tests/tests/vmgenid.rs` checks it).
fn checksum(vm: &Vm) -> u64 {
    let mem_bytes = vm.config().mem_mib << 20;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut buf = vec![0u8; 1 << 20];
    let mut addr = 0u64;
    while addr < mem_bytes {
        vm.read_guest(addr, &mut buf).expect("reading guest memory");
        if (addr..addr + buf.len() as u64).contains(&vmm::VMGENID_ADDR) {
            let at = (vmm::VMGENID_ADDR - addr) as usize;
            buf[at..at + 16].fill(0);
        }
        for chunk in buf.chunks_exact(8) {
            h ^= u64::from_le_bytes(chunk.try_into().unwrap());
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        addr += buf.len() as u64;
    }
    h
}

/// The `memsum` lines the guest printed, in order.
fn memsums(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("memsum "))
        .map(str::to_string)
        .collect()
}

/// Waits until the guest's serial output contains `what` `count` times (use a whole line's
/// text: a snapshot may have been taken in the middle of a line).
fn wait_for_output(vm: &Vm, what: &str, count: usize) {
    let t = Instant::now();
    while serial(vm).matches(what).count() < count {
        assert!(
            t.elapsed() < T,
            "no {count}x '{what}' in the output:\n{}",
            serial(vm)
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn finish(vm: &mut Vm, what: &str) -> String {
    let status = vm.wait_timeout(T).unwrap();
    let out = serial(vm);
    assert_eq!(status, Some(VmExit::TestExit(0)), "{what}:\n{out}");
    out
}

/// Every file under `dir` with its contents, to prove a failed resume changed nothing.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.insert(p.clone(), std::fs::read(&p).unwrap());
        }
    }
    out
}

/// Boots "memfill:7:32,memsum,loop:30,memsum,mmio,hlt" and takes a full snapshot in the
/// middle of the loop. Returns the host checksum at the snapshot and the first memsum line.
fn snapshot_mid_loop(dir: &Path) -> (u64, String) {
    let mut c = guest_config("memfill:7:32,memsum,loop:30,memsum,mmio,hlt");
    c.mem_mib = 128;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "step memsum ok", 1);
    vm.pause().unwrap();
    let info = vmm::snapshot(&mut vm, dir, SnapshotKind::Full).unwrap();
    let sum = checksum(&vm);
    println!(
        "full snapshot: {} pages written, paused (already) {:?}, total {:?}, steps {:?}",
        info.pages_written, info.pause_time, info.total_time, info.steps
    );
    let before = serial(&vm);
    assert!(
        !before.contains("loop 2^30 done"),
        "snapshot taken mid-loop: {before}"
    );
    // The original goes on too.
    vm.unpause().unwrap();
    let out = finish(&mut vm, "original");
    let sums = memsums(&out);
    assert_eq!(sums.len(), 2, "{out}");
    assert_eq!(sums[0], sums[1], "{out}");
    (sum, sums[0].clone())
}

#[test]
fn resumed_guest_continues_exactly_with_every_backend_twice() {
    let dir = TmpDir::new("continue");
    let (sum, memsum) = snapshot_mid_loop(&dir.0);
    for backend in BACKENDS {
        for round in 0..2 {
            let mut vm = vmm::restore(
                &dir.0,
                backend,
                RestoreOptions {
                    start: false,
                    ..options()
                },
            )
            .unwrap_or_else(|e| panic!("{backend} resume {round}: {e}"));
            let report = vm.restore_report().unwrap().clone();
            assert_eq!(
                checksum(&vm),
                sum,
                "{backend} round {round}: memory differs from the snapshot"
            );
            vm.start().unwrap();
            let out = finish(&mut vm, &format!("{backend} round {round}"));
            assert!(
                !out.contains("clade-native-guest: start"),
                "{backend}: the guest restarted instead of continuing: {out}"
            );
            assert!(out.contains("loop 2^30 done"), "{backend}: {out}");
            assert_eq!(memsums(&out), vec![memsum.clone()], "{backend}: {out}");
            assert!(out.contains("step mmio ok"), "{backend}: {out}");
            assert!(out.contains("step hlt ok"), "{backend}: {out}");
            println!(
                "{backend} round {round}: resumed in {:?} ({:?})",
                report.total, report.steps
            );
        }
    }
}

/// Boots a guest serving the agent protocol on vsock and snapshots it while it waits for
/// a connection.
fn listening_snapshot(dir: &Path, sock: &Path) {
    // Each VM's step ends after one connection: the tests below wait for that.
    let mut c = guest_config("vsock:1");
    c.vsock = Some(VsockConfig {
        uds_path: sock.to_path_buf(),
        guest_cid: 3,
    });
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "serving agent port", 1);
    vmm::snapshot(&mut vm, dir, SnapshotKind::Full).unwrap();
    assert_eq!(
        vm.state_name(),
        "running",
        "the VM runs on after a snapshot"
    );
    // The original still answers.
    let c = Client::connect_timeout(sock, AGENT, Duration::from_secs(10)).unwrap();
    c.ping().unwrap();
}

#[test]
fn two_resumes_of_one_snapshot_side_by_side_answer_independently() {
    let dir = TmpDir::new("sidebyside");
    listening_snapshot(&dir.0, &dir.0.join("orig.sock"));
    let socks = [dir.0.join("a.sock"), dir.0.join("b.sock")];
    let mut vms: Vec<Vm> = socks
        .iter()
        .zip([MemoryBackend::Uffd, MemoryBackend::File])
        .map(|(s, backend)| {
            vmm::restore(
                &dir.0,
                backend,
                RestoreOptions {
                    vsock_path: Some(s.clone()),
                    ..options()
                },
            )
            .unwrap()
        })
        .collect();
    let mut clients: Vec<Client> = socks
        .iter()
        .map(|s| Client::connect_timeout(s, AGENT, Duration::from_secs(10)).unwrap())
        .collect();
    for _ in 0..20 {
        for c in &clients {
            c.ping().unwrap();
        }
    }
    // The first one ends (closing the connection ends its guest's step, and the guest);
    // the second still answers.
    drop(clients.remove(0));
    let out = finish(&mut vms[0], "first resume");
    assert!(out.contains(" 20 pings"), "{out}");
    drop(vms.remove(0));
    assert!(
        !socks[0].exists(),
        "the first VM's socket went away with it"
    );
    for _ in 0..5 {
        clients[0].ping().unwrap();
    }
    drop(clients);
    let out = finish(&mut vms[0], "second resume");
    assert!(out.contains(" 25 pings"), "{out}");
}

#[test]
fn diff_snapshots_restore_on_top_of_their_base() {
    let dirs = TmpDir::new("diff");
    let base = dirs.0.join("base");
    let diff = dirs.0.join("diff");
    let diff2 = dirs.0.join("diff2");
    let mut c = guest_config(
        "memfill:1:32,memsum,loop:30,memfill:2:1,memsum,loop:30,memfill:3:1,memsum,loop:30,memsum",
    );
    c.mem_mib = 128;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "step memsum ok", 1);
    let full = vmm::snapshot(&mut vm, &base, SnapshotKind::Full).unwrap();
    // A diff before the base exists elsewhere is refused in the base's own directory.
    wait_for_output(&vm, "step memsum ok", 2);
    assert!(vmm::snapshot(&mut vm, &base, SnapshotKind::Diff).is_err());
    let d1 = vmm::snapshot(&mut vm, &diff, SnapshotKind::Diff).unwrap();
    wait_for_output(&vm, "step memsum ok", 3);
    let d2 = vmm::snapshot(&mut vm, &diff2, SnapshotKind::Diff).unwrap();
    println!(
        "full: {} pages written (paused {:?}); diff: {} dirty, {} written (paused {:?}); \
         diff2: {} dirty, {} written (paused {:?})",
        full.pages_written,
        full.pause_time,
        d1.pages_considered,
        d1.pages_written,
        d1.pause_time,
        d2.pages_considered,
        d2.pages_written,
        d2.pause_time
    );
    // memfill:2:1 dirtied 256 pages; the diff holds those and little else.
    assert!(
        (256..2000).contains(&d1.pages_considered),
        "{} dirty pages",
        d1.pages_considered
    );
    assert!(d1.pages_written < full.pages_written);
    let out = finish(&mut vm, "original");
    let sums = memsums(&out);
    assert_eq!(sums.len(), 4, "{out}");
    for backend in BACKENDS {
        // The second diff: a chain of three.
        let mut r = vmm::restore(&diff2, backend, options()).unwrap();
        assert_eq!(r.restore_report().unwrap().layers, 3);
        let o = finish(&mut r, &format!("{backend} diff2"));
        assert_eq!(memsums(&o), vec![sums[3].clone()], "{backend}: {o}");
        // The first diff: its guest still has memfill:3 to do.
        let mut r = vmm::restore(&diff, backend, options()).unwrap();
        let o = finish(&mut r, &format!("{backend} diff"));
        assert_eq!(memsums(&o), sums[2..].to_vec(), "{backend}: {o}");
    }
}

/// Boots a guest that sums its memory three times (writing 2 MiB between the first two),
/// takes a full snapshot into `base` after the first sum, and lets the guest finish: its
/// three sums.
fn full_snapshot_between_memsums(base: &Path) -> Vec<String> {
    let mut c = guest_config("memfill:1:32,memsum,loop:29,memfill:9:2,memsum,loop:30,memsum");
    c.mem_mib = 128;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "step memsum ok", 1);
    vmm::snapshot(&mut vm, base, SnapshotKind::Full).unwrap();
    memsums(&finish(&mut vm, "original"))
}

#[test]
fn a_resumed_vm_takes_diffs_on_top_of_the_snapshot_it_came_from() {
    let dirs = TmpDir::new("resumed-diff");
    let base = dirs.0.join("base");
    let diff = dirs.0.join("diff");
    let sums = full_snapshot_between_memsums(&base);
    for backend in BACKENDS {
        let mut r = vmm::restore(&base, backend, options()).unwrap();
        wait_for_output(&r, "step memsum ok", 1);
        let d = vmm::snapshot(&mut r, &diff, SnapshotKind::Diff).unwrap();
        assert!(d.pages_considered >= 512, "memfill:9:2 dirtied 2 MiB");
        let o = finish(&mut r, &format!("{backend} resumed"));
        assert_eq!(memsums(&o), sums[1..].to_vec(), "{backend}: {o}");
        drop(r);
        let mut r2 = vmm::restore(&diff, MemoryBackend::Uffd, options()).unwrap();
        let o = finish(&mut r2, &format!("{backend} diff of a resumed VM"));
        assert_eq!(memsums(&o), vec![sums[2].clone()], "{backend}: {o}");
    }
}

/// A snapshot of a VM whose memory is served on demand carries the pages that VM's guest
/// needed first (recorded by a first restore, or prefetched by a later one): restoring the
/// new snapshot prefetches them instead of recording from nothing. That is every wake of a
/// paused sandbox (a restore of its newest pause snapshot).
#[test]
fn snapshots_of_a_vm_restored_on_demand_carry_its_working_set() {
    let dirs = TmpDir::new("ws-carry");
    let base = dirs.0.join("base");
    let (d1, d2) = (dirs.0.join("d1"), dirs.0.join("d2"));
    let sums = full_snapshot_between_memsums(&base);
    let working_set = |vm: &Vm| {
        let r = vm.restore_report().unwrap();
        let ws = r.page_server.as_ref().unwrap().working_set_len;
        (r.recording_working_set, ws)
    };

    // The first restore of the base records; its diff gets what it recorded so far.
    let mut r1 = vmm::restore(&base, MemoryBackend::Uffd, options()).unwrap();
    assert_eq!(working_set(&r1), (true, 0));
    wait_for_output(&r1, "step memsum ok", 1);
    vmm::snapshot(&mut r1, &d1, SnapshotKind::Diff).unwrap();
    assert!(d1.join(vmm::WORKING_SET_FILE).is_file());
    drop(r1);

    // Restoring that diff prefetches it; its own diff carries the same pages on.
    let mut r2 = vmm::restore(&d1, MemoryBackend::Uffd, options()).unwrap();
    let (recording, carried) = working_set(&r2);
    assert!(!recording && carried > 0, "{:?}", working_set(&r2));
    vmm::snapshot(&mut r2, &d2, SnapshotKind::Diff).unwrap();
    drop(r2);
    let mut r3 = vmm::restore(&d2, MemoryBackend::Uffd, options()).unwrap();
    assert_eq!(working_set(&r3), (false, carried));
    // A full snapshot carries them too (taken before the snapshot stops the page server).
    let full = dirs.0.join("full");
    vmm::snapshot(&mut r3, &full, SnapshotKind::Full).unwrap();
    let r4 = vmm::restore(&full, MemoryBackend::Uffd, options()).unwrap();
    assert_eq!(working_set(&r4), (false, carried));
    drop(r4);
    // The pages are a hint only: the guest runs on exactly its memory.
    let out = finish(&mut r3, "restore of a diff of a diff");
    assert_eq!(memsums(&out), vec![sums[2].clone()], "{out}");
}

#[test]
fn snapshot_requests_that_cannot_work_are_refused() {
    let dir = TmpDir::new("refused");
    let mut vm = vmm::boot(guest_config("loop:33")).unwrap();
    let e = vmm::snapshot(&mut vm, &dir.0, SnapshotKind::Full).unwrap_err();
    assert!(e.to_string().contains("not started"), "{e}");
    vm.start().unwrap();
    let e = vmm::snapshot(&mut vm, &dir.0, SnapshotKind::Diff).unwrap_err();
    assert!(e.to_string().contains("full snapshot"), "{e}");
    assert!(!dir.0.join(STATE_FILE).exists());
    vm.shutdown();
    let e = vmm::snapshot(&mut vm, &dir.0, SnapshotKind::Full).unwrap_err();
    assert!(e.to_string().contains("ended"), "{e}");
}

/// One resume that must fail with `expect` in its message, leaving every file as it was
/// and no VM behind.
fn resume_fails(dir: &Path, all: &Path, expect: &str) {
    let before = files(all);
    let sock = dir.with_extension("sock");
    for backend in BACKENDS {
        let e = vmm::restore(
            dir,
            backend,
            RestoreOptions {
                vsock_path: Some(sock.clone()),
                ..options()
            },
        )
        .err()
        .unwrap_or_else(|| panic!("{backend}: resume of a bad snapshot succeeded ({expect})"));
        let msg = e.to_string();
        assert!(
            msg.to_lowercase().contains(&expect.to_lowercase()),
            "{backend}: '{msg}' should mention '{expect}'"
        );
        assert!(!msg.contains('\n'), "one line: {msg}");
        assert!(!sock.exists(), "{backend}: nothing restored half-way");
    }
    assert!(files(all) == before, "a failed resume changed files");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

fn rewrite(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b);
    std::fs::write(path, b).unwrap();
}

/// Recomputes the state file's header CRC after an edit of its fields.
fn fix_header_crc(b: &mut [u8]) {
    let crc = crc32(&b[..124]);
    b[124..128].copy_from_slice(&crc.to_le_bytes());
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn bad_snapshots_fail_cleanly_and_change_nothing() {
    let root = TmpDir::new("bad");
    let good = root.0.join("good");
    let mut c = guest_config("vsock");
    c.mem_mib = 64;
    c.vsock = Some(VsockConfig {
        uds_path: root.0.join("orig.sock"),
        guest_cid: 3,
    });
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "serving agent port", 1);
    vmm::snapshot(&mut vm, &good, SnapshotKind::Full).unwrap();
    let diff = root.0.join("diff");
    vmm::snapshot(&mut vm, &diff, SnapshotKind::Diff).unwrap();
    // A snapshot of another size, for its memory file.
    let mut c2 = guest_config("loop:33");
    c2.mem_mib = 128;
    let mut vm2 = vmm::boot(c2).unwrap();
    vm2.start().unwrap();
    let other = root.0.join("other");
    vmm::snapshot(&mut vm2, &other, SnapshotKind::Full).unwrap();
    drop(vm2);
    drop(vm);
    let case = |name: &str| {
        let d = root.0.join(name);
        copy_dir(&good, &d);
        d
    };

    let d = case("truncated-state");
    rewrite(&d.join(STATE_FILE), |b| b.truncate(b.len() / 2));
    resume_fails(&d, &root.0, "truncated");

    let d = case("truncated-header");
    rewrite(&d.join(STATE_FILE), |b| b.truncate(60));
    resume_fails(&d, &root.0, "truncated");

    let d = case("corrupted-state");
    rewrite(&d.join(STATE_FILE), |b| {
        let n = b.len() - 100;
        b[n] ^= 0x55;
    });
    resume_fails(&d, &root.0, "checksum");

    let d = case("corrupted-header");
    rewrite(&d.join(STATE_FILE), |b| b[30] ^= 1);
    resume_fails(&d, &root.0, "checksum");

    let d = case("wrong-version");
    rewrite(&d.join(STATE_FILE), |b| {
        b[8..12].copy_from_slice(&3u32.to_le_bytes())
    });
    resume_fails(&d, &root.0, "version 3");

    let d = case("not-a-snapshot");
    std::fs::write(d.join(STATE_FILE), b"#!/bin/sh\necho hello\n").unwrap();
    resume_fails(&d, &root.0, "bad magic");

    let d = case("wrong-cpu");
    rewrite(&d.join(STATE_FILE), |b| {
        b[56..68].copy_from_slice(b"GenuineIntel");
        b[70] ^= 0x3f;
        fix_header_crc(b);
    });
    resume_fails(&d, &root.0, "snapshot was taken on CPU GenuineIntel");

    let d = case("missing-state");
    std::fs::remove_file(d.join(STATE_FILE)).unwrap();
    resume_fails(&d, &root.0, "No such file");

    let d = case("truncated-memory");
    rewrite(&d.join(MEMORY_FILE), |b| b.truncate(b.len() - 4096));
    resume_fails(&d, &root.0, "truncated");

    let d = case("corrupted-memory-header");
    rewrite(&d.join(MEMORY_FILE), |b| b[50] ^= 1);
    resume_fails(&d, &root.0, "checksum");

    let d = case("memory-of-another-snapshot");
    std::fs::copy(other.join(MEMORY_FILE), d.join(MEMORY_FILE)).unwrap();
    resume_fails(&d, &root.0, "belongs to snapshot");

    let d = case("memory-of-the-wrong-size");
    rewrite(&d.join(MEMORY_FILE), |b| {
        // Same id, 64 MiB more memory: header field, length, tables.
        let size = u64::from_le_bytes(b[48..56].try_into().unwrap()) + (64 << 20);
        b[48..56].copy_from_slice(&size.to_le_bytes());
        let region_size = size.to_le_bytes();
        b[136..144].copy_from_slice(&region_size);
        let tables_crc = crc32(&b[128..152]);
        b[120..124].copy_from_slice(&tables_crc.to_le_bytes());
        fix_header_crc(b);
        b.resize(b.len() + (64 << 20), 0);
    });
    resume_fails(&d, &root.0, "geometry mismatch");

    // A diff whose base is gone, or was replaced by another snapshot.
    std::fs::rename(&good, root.0.join("good-moved")).unwrap();
    resume_fails(&diff, &root.0, "needs its base snapshot");
    copy_dir(&other, &good);
    resume_fails(&diff, &root.0, "based on");
    std::fs::remove_dir_all(&good).unwrap();
    std::fs::rename(root.0.join("good-moved"), &good).unwrap();
    // Put back, the chain resumes.
    let mut r = vmm::restore(
        &diff,
        MemoryBackend::Uffd,
        RestoreOptions {
            vsock_path: Some(root.0.join("ok.sock")),
            ..options()
        },
    )
    .unwrap();
    let c =
        Client::connect_timeout(root.0.join("ok.sock"), AGENT, Duration::from_secs(10)).unwrap();
    c.ping().unwrap();
    r.shutdown();
}

#[test]
fn connections_are_reset_on_resume_and_the_listener_survives() {
    let dir = TmpDir::new("reset");
    let sock = dir.0.join("orig.sock");
    let mut c = guest_config("vsock:1");
    c.vsock = Some(VsockConfig {
        uds_path: sock.clone(),
        guest_cid: 3,
    });
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "serving agent port", 1);
    // A connection is open when the snapshot is taken.
    let client = Client::connect_timeout(&sock, AGENT, Duration::from_secs(10)).unwrap();
    client.ping().unwrap();
    vmm::snapshot(&mut vm, &dir.0.join("snap"), SnapshotKind::Full).unwrap();
    drop(client);
    drop(vm);
    for backend in BACKENDS {
        let rsock = dir.0.join(format!("{backend}.sock"));
        let mut r = vmm::restore(
            &dir.0.join("snap"),
            backend,
            RestoreOptions {
                vsock_path: Some(rsock.clone()),
                ..options()
            },
        )
        .unwrap();
        // The guest dropped the old connection and listens again.
        let c = Client::connect_timeout(&rsock, AGENT, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{backend}: {e}; serial:\n{}", serial(&r)));
        c.ping().unwrap();
        drop(c);
        let out = finish(&mut r, &format!("{backend}"));
        assert!(
            out.contains("a transport reset dropped 1 open connection"),
            "{backend}: {out}"
        );
        assert!(out.contains("1 pings"), "{backend}: {out}");
    }
}

#[test]
fn a_pool_hands_out_prebuilt_shells_and_refills() {
    use vmm::PreparedSnapshot;
    use vmm::ShellPool;

    let dir = TmpDir::new("pool");
    let mut c = guest_config("memfill:3:8,memsum,loop:30,memsum");
    c.mem_mib = 96;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "step memsum ok", 1);
    vmm::snapshot(&mut vm, &dir.0, SnapshotKind::Full).unwrap();
    let sums = memsums(&finish(&mut vm, "original"));
    drop(vm);

    let snap = PreparedSnapshot::open(&dir.0, Default::default()).unwrap();
    assert_eq!(snap.machine().mem_bytes, 96 << 20);
    let pool = ShellPool::new(snap.shell_spec(Path::new("/dev/kvm"), true), 2).unwrap();
    assert!(
        pool.wait_full(Duration::from_secs(10)),
        "{:?}",
        pool.last_error()
    );
    for round in 0..3 {
        let shell = pool.take().expect("a ready shell");
        let mut r = snap
            .restore(
                MemoryBackend::Uffd,
                RestoreOptions {
                    shell: Some(shell),
                    ..options()
                },
            )
            .unwrap();
        assert!(r.restore_report().unwrap().shell_reused, "round {round}");
        let out = finish(&mut r, &format!("pool round {round}"));
        assert_eq!(memsums(&out), vec![sums[1].clone()], "round {round}");
        assert!(pool.wait_full(Duration::from_secs(10)), "refilled");
    }
    // A shell of the wrong size is not used.
    let other = ShellPool::new(
        vmm::ShellSpec {
            kvm_device: "/dev/kvm".into(),
            mem_bytes: 64 << 20,
            vcpus: 1,
            dirty_log: true,
        },
        1,
    )
    .unwrap();
    let mut r = snap
        .restore(
            MemoryBackend::File,
            RestoreOptions {
                shell: other.take(),
                ..options()
            },
        )
        .unwrap();
    assert!(!r.restore_report().unwrap().shell_reused);
    finish(&mut r, "unfit shell");
}

/// A full snapshot (96 MiB) of a guest that filled its memory with `seed` and is in its
/// loop; the memsum the restored guest prints.
fn filled_snapshot(dir: &Path, seed: u32) -> String {
    let mut c = guest_config(&format!("memfill:{seed}:8,memsum,loop:30,memsum"));
    c.mem_mib = 96;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "step memsum ok", 1);
    vmm::snapshot(&mut vm, dir, SnapshotKind::Full).unwrap();
    memsums(&finish(&mut vm, "original"))[1].clone()
}

#[test]
fn a_prefilled_shell_restores_its_snapshot_and_any_other_exactly() {
    use vmm::{PreparedSnapshot, Shell};

    let (a_dir, b_dir) = (TmpDir::new("prefill-a"), TmpDir::new("prefill-b"));
    let a_sum = filled_snapshot(&a_dir.0, 3);
    let b_sum = filled_snapshot(&b_dir.0, 5);
    assert_ne!(a_sum, b_sum);
    let a = PreparedSnapshot::open(&a_dir.0, Default::default()).unwrap();
    let b = PreparedSnapshot::open(&b_dir.0, Default::default()).unwrap();
    let spec = a.shell_spec(Path::new("/dev/kvm"), true);
    let restore = |snap: &PreparedSnapshot, shell: Shell, o: RestoreOptions, what: &str| {
        let mut vm = snap
            .restore(
                MemoryBackend::Uffd,
                RestoreOptions {
                    shell: Some(shell),
                    ..o
                },
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(vm.restore_report().unwrap().shell_reused, "{what}");
        let stats = vm.page_server_stats().unwrap();
        (memsums(&finish(&mut vm, what)), stats)
    };
    // No working set yet: nothing to prefill, the first restore records it.
    let shell = a.prefill_shell(Shell::create(&spec).unwrap()).unwrap();
    let (sums, stats) = restore(&a, shell, options(), "a, recording");
    assert_eq!(sums, vec![a_sum.clone()]);
    assert_eq!(stats.pages_prefetched, 0);
    assert!(
        a.load_working_set(),
        "the first restore wrote its working set"
    );

    // Prefilled for a, restoring a: the working set was installed ahead, and it is a's.
    let shell = a.prefill_shell(Shell::create(&spec).unwrap()).unwrap();
    let (sums, stats) = restore(&a, shell, options(), "a, prefilled");
    assert_eq!(sums, vec![a_sum.clone()]);
    assert!(stats.pages_prefetched > 0, "{stats:?}");
    assert_eq!(stats.pages_prefetched, stats.working_set_len);

    // Prefilled for a, restoring b: fresh memory, none of a's pages.
    let shell = a.prefill_shell(Shell::create(&spec).unwrap()).unwrap();
    let (sums, _) = restore(&b, shell, options(), "b on a shell prefilled for a");
    assert_eq!(sums, vec![b_sum]);

    // Prefilled for a, restoring a without a working set: fresh memory too.
    let shell = a.prefill_shell(Shell::create(&spec).unwrap()).unwrap();
    let o = RestoreOptions {
        working_set: false,
        ..options()
    };
    let (sums, stats) = restore(&a, shell, o, "a without its working set");
    assert_eq!(sums, vec![a_sum]);
    assert_eq!(stats.pages_prefetched, 0);
}

/// `len` bytes of the disk chain of `vm` at offset 0.
fn disk_bytes(vm: &Vm, len: usize) -> Vec<u8> {
    let d = vm.disk().expect("the VM has a disk");
    let mut buf = vec![0u8; len];
    d.lock().unwrap().read_at(0, &mut buf).unwrap();
    buf
}

fn disk_write(vm: &Vm, data: &[u8]) {
    let d = vm.disk().expect("the VM has a disk");
    d.lock().unwrap().write_at(0, data).unwrap();
}

fn disk_top(vm: &Vm) -> PathBuf {
    let d = vm.disk().expect("the VM has a disk");
    let p = d.lock().unwrap().path().to_path_buf();
    p
}

fn disk_layers(vm: &Vm) -> Vec<PathBuf> {
    let d = vm.disk().expect("the VM has a disk");
    let l = d.lock().unwrap();
    l.layers().iter().map(|l| l.path().to_path_buf()).collect()
}

/// A VM with a writable disk: the snapshot freezes its top layer (the VM runs on from a
/// new overlay), each resume gets its own overlay on the frozen layer and sees the disk as
/// it was at the snapshot, isolated from the original and from the other resume. (Host
/// level: the native guest has no virtio-blk driver.)
#[test]
fn a_vm_with_a_disk_resumes_on_its_own_overlay_of_the_frozen_disk() {
    let dir = TmpDir::new("disk");
    let top = dir.0.join("vm.cdsk");
    disk::ops::create(
        &top,
        &disk::ops::CreateOptions {
            virtual_size: Some(16 << 20),
            ..Default::default()
        },
    )
    .unwrap();
    let mut c = guest_config("loop:33");
    c.disk = Some(vmm::BlockConfig {
        sources: None,
        path: top.clone(),
        read_only: false,
        serial: None,
    });
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    const BEFORE: &[u8] = b"written before the snapshot";
    const AFTER: &[u8] = b"the original, after the snap";
    const MINE: &[u8] = b"resume one's own write here";
    disk_write(&vm, BEFORE);

    let snap = dir.0.join("snap");
    vmm::snapshot(&mut vm, &snap, SnapshotKind::Full).unwrap();
    // The original runs on from a new overlay on the frozen layer.
    let frozen = top.canonicalize().unwrap();
    assert_ne!(disk_top(&vm), top);
    assert_eq!(disk_layers(&vm)[1].canonicalize().unwrap(), frozen);
    assert_eq!(vm.config().disk.as_ref().unwrap().path, disk_top(&vm));
    disk_write(&vm, AFTER);

    // Resume twice side by side: the default overlay in the snapshot directory, and one
    // at a given path.
    let mut r1 = vmm::restore(&snap, MemoryBackend::Copy, options()).unwrap();
    let own = dir.0.join("r2.cdsk");
    let mut r2 = vmm::restore(
        &snap,
        MemoryBackend::File,
        RestoreOptions {
            disk_overlay: Some(own.clone()),
            ..options()
        },
    )
    .unwrap();
    let t1 = disk_top(&r1);
    assert_eq!(t1.parent().unwrap(), snap.canonicalize().unwrap());
    let name = t1.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("restore-") && name.ends_with(".cdsk"),
        "{name}"
    );
    assert_eq!(disk_top(&r2), own);
    for r in [&r1, &r2] {
        let layers = disk_layers(r);
        assert_eq!(layers.len(), 2, "{layers:?}");
        assert_eq!(layers[1].canonicalize().unwrap(), frozen);
        assert_eq!(
            disk_bytes(r, BEFORE.len()),
            BEFORE,
            "the disk at the snapshot"
        );
    }
    // Writes stay where they were made.
    disk_write(&r1, MINE);
    assert_eq!(disk_bytes(&r1, MINE.len()), MINE);
    assert_eq!(disk_bytes(&r2, BEFORE.len()), BEFORE);
    assert_eq!(disk_bytes(&vm, AFTER.len()), AFTER);

    // An overlay path that exists already: refused, the file left alone, no VM.
    let Err(e) = vmm::restore(
        &snap,
        MemoryBackend::Copy,
        RestoreOptions {
            disk_overlay: Some(own.clone()),
            ..options()
        },
    ) else {
        panic!("a resume onto an existing overlay worked");
    };
    assert!(e.to_string().contains("exists"), "{e}");
    assert_eq!(disk_bytes(&r2, BEFORE.len()), BEFORE);
    // (The snapshot's own files; resume overlays live next to them.)
    let snap_files = |d: &Path| {
        let mut f = files(d);
        f.retain(|p, _| p.ends_with(STATE_FILE) || p.ends_with(MEMORY_FILE));
        f
    };
    let before = snap_files(&snap);
    // The resumes are VMs that work: they snapshot (freezing their own overlay) too.
    let snap2 = dir.0.join("snap2");
    vmm::snapshot(&mut r1, &snap2, SnapshotKind::Full).unwrap();
    let mut r3 = vmm::restore(&snap2, MemoryBackend::Copy, options()).unwrap();
    assert_eq!(disk_layers(&r3).len(), 3);
    assert_eq!(disk_bytes(&r3, MINE.len()), MINE);
    // A diff snapshot of the original freezes its current overlay: the chain grows.
    let diff = dir.0.join("diff");
    vmm::snapshot(&mut vm, &diff, SnapshotKind::Diff).unwrap();
    let mut r4 = vmm::restore(&diff, MemoryBackend::Uffd, options()).unwrap();
    assert_eq!(disk_layers(&r4).len(), 3);
    assert_eq!(disk_bytes(&r4, AFTER.len()), AFTER);
    assert_eq!(snap_files(&snap), before, "the first snapshot is unchanged");

    for v in [&mut vm, &mut r1, &mut r2, &mut r3, &mut r4] {
        assert_eq!(v.state_name(), "running");
        v.shutdown();
    }
}

/// A VM with a writable disk, snapshotted (full, then a diff), published with its disk
/// layers, and every file of the host that took it deleted (snapshots and disk): on
/// "another host" (a fresh cache and fetcher) each restores with its disk exactly as it was
/// at its snapshot, on the restored VM's own overlay of the downloaded layers. (Host level:
/// the native guest has no virtio-blk driver.)
#[test]
fn a_published_snapshot_with_a_disk_restores_its_disk_after_the_host_files_are_gone() {
    use store::cache::ChunkCache;
    use store::fetcher::{FetchClient, FetcherThread};
    use store::publish::{publish, PublishOptions, SnapshotDisk, SnapshotFiles};

    let dir = TmpDir::new("published-disk");
    let host_a = dir.0.join("host-a");
    std::fs::create_dir_all(&host_a).unwrap();
    let top = host_a.join("vm.cdsk");
    disk::ops::create(
        &top,
        &disk::ops::CreateOptions {
            virtual_size: Some(16 << 20),
            ..Default::default()
        },
    )
    .unwrap();
    let mut c = guest_config("loop:33");
    c.disk = Some(vmm::BlockConfig {
        sources: None,
        path: top.clone(),
        read_only: false,
        serial: None,
    });
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    const BEFORE: &[u8] = b"written before the full snapshot";
    const AFTER: &[u8] = b"written before the diff snapshot";
    disk_write(&vm, BEFORE);
    let (snap, diff) = (host_a.join("snap"), host_a.join("diff"));
    vmm::snapshot(&mut vm, &snap, SnapshotKind::Full).unwrap();
    disk_write(&vm, AFTER);
    vmm::snapshot(&mut vm, &diff, SnapshotKind::Diff).unwrap();
    vm.shutdown();
    drop(vm);

    let store = store::Store::open(
        &format!("file://{}/store", dir.0.display()),
        &store::location::StoreOptions::default(),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut ids = Vec::new();
    for d in [&snap, &diff] {
        let saved = vmm::PreparedSnapshot::open(d, vmm::CpuCheck::default())
            .unwrap()
            .disk()
            .cloned()
            .expect("the snapshot has a disk");
        let files = SnapshotFiles {
            state: d.join(STATE_FILE),
            memory: d.join(MEMORY_FILE),
            working_set: None,
            disk: Some(SnapshotDisk {
                layer: saved.layer,
                read_only: saved.read_only,
            }),
        };
        let (m, r) = rt
            .block_on(publish(&store, &files, &PublishOptions::default()))
            .unwrap();
        println!(
            "published {}: {} disk layers, {} bytes uploaded, {} reused",
            m.id,
            m.disk.as_ref().unwrap().layers.len(),
            r.bytes_uploaded,
            r.objects_reused
        );
        ids.push(m.snapshot_id());
    }
    // The host that took them is gone: snapshots and disk layers.
    std::fs::remove_dir_all(&host_a).unwrap();

    let cache = ChunkCache::new(&dir.0.join("host-b"), store, 1 << 30).unwrap();
    let fetcher = FetcherThread::start(&dir.0.join("fetch.sock"), cache).unwrap();
    let client = FetchClient::connect(fetcher.socket(), T).unwrap();
    let open = |id| {
        let remote = client.open(id).unwrap();
        let p = vmm::PreparedSnapshot::open_with_layers(
            remote.dir(),
            vmm::CpuCheck::default(),
            remote.memory_layers().unwrap(),
        )
        .unwrap();
        (p, remote.disk.expect("the fetcher gives the disk"))
    };
    // Without relocating, the saved disk path is the gone host's.
    let (p, _) = open(ids[1]);
    assert!(p.restore(MemoryBackend::Copy, options()).is_err());
    let mut vms = Vec::new();
    for (id, want, layers) in [(ids[0], BEFORE, 2), (ids[1], AFTER, 3)] {
        let (mut p, remote_disk) = open(id);
        p.relocate_disk(
            remote_disk.layer.clone(),
            Some(store::fetcher::FetcherLayers::sources(client.clone())),
        )
        .unwrap();
        let own = dir.0.join(format!("own-{id}.cdsk"));
        let r = p
            .restore(
                MemoryBackend::Uffd,
                RestoreOptions {
                    disk_overlay: Some(own.clone()),
                    ..options()
                },
            )
            .unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!(disk_top(&r), own);
        let chain = disk_layers(&r);
        assert_eq!(chain.len(), layers, "{chain:?}");
        assert_eq!(chain[1], remote_disk.layer);
        assert_eq!(disk_bytes(&r, want.len()), want, "{id}: the disk differs");
        // The restored VM writes to its own overlay only.
        disk_write(&r, b"mine");
        assert_eq!(disk_bytes(&r, 4), b"mine");
        assert_eq!(r.state_name(), "running");
        vms.push(r);
    }
    for mut v in vms {
        v.shutdown();
    }
    // The cached layers are read lazily: only through a fetcher; through one, a disk
    // reads them as the snapshots saved them.
    let (_, remote_disk) = open(ids[1]);
    assert!(disk::remote::is_filled_on_demand(&remote_disk.layer));
    let mut buf = vec![0u8; AFTER.len()];
    let d = disk::Disk::open(&remote_disk.layer, disk::OpenOptions { read_only: true }).unwrap();
    let e = d.read_at(0, &mut buf).unwrap_err();
    assert!(matches!(e, disk::Error::Unfilled { .. }), "{e}");
    let d = disk::Disk::open_with_sources(
        &remote_disk.layer,
        disk::OpenOptions { read_only: true },
        Some(&store::fetcher::FetcherLayers::sources(client.clone())),
    )
    .unwrap();
    d.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, AFTER);
}

/// Resuming a snapshot without a writable disk with a disk overlay is refused.
#[test]
fn a_disk_overlay_for_a_snapshot_without_a_disk_is_refused() {
    let dir = TmpDir::new("nodisk");
    let mut vm = vmm::boot(guest_config("loop:33")).unwrap();
    vm.start().unwrap();
    vmm::snapshot(&mut vm, &dir.0, SnapshotKind::Full).unwrap();
    vm.shutdown();
    let overlay = dir.0.join("o.cdsk");
    let Err(e) = vmm::restore(
        &dir.0,
        MemoryBackend::Copy,
        RestoreOptions {
            disk_overlay: Some(overlay.clone()),
            ..options()
        },
    ) else {
        panic!("a disk overlay was accepted for a snapshot without a disk");
    };
    assert!(e.to_string().contains("no writable disk"), "{e}");
    assert!(!overlay.exists());
}

/// A `uffd` restore (started, then `then`) of a snapshot taken mid-loop in `dir`, whose
/// memory file then loses its pages under the page server.
fn restore_then_break_its_memory_file(dir: &TmpDir, then: impl FnOnce(&mut Vm)) -> Vm {
    let snap = dir.0.join("s");
    snapshot_mid_loop(&snap);
    let mut vm = vmm::restore(
        &snap,
        MemoryBackend::Uffd,
        RestoreOptions {
            working_set: false,
            ..options()
        },
    )
    .unwrap();
    then(&mut vm);
    std::fs::OpenOptions::new()
        .write(true)
        .open(snap.join(MEMORY_FILE))
        .unwrap()
        .set_len(4096)
        .unwrap();
    vm
}

/// A full snapshot of a `uffd`-restored VM first installs every page not served yet. If
/// that fails, those pages would read as zeros: the VM must end, not run on (and not be
/// snapshotted with its memory gone).
#[test]
fn a_failed_fill_ends_the_vm_instead_of_losing_its_memory() {
    let dir = TmpDir::new("fill-fails");
    let mut vm = restore_then_break_its_memory_file(&dir, |vm| vm.pause().unwrap());
    let e = vmm::snapshot(&mut vm, &dir.0.join("s2"), SnapshotKind::Full).unwrap_err();
    assert!(e.to_string().contains("could not be filled"), "{e}");
    assert_eq!(vm.state_name(), "ended");
    let status = vm.wait().unwrap();
    assert!(
        matches!(&status, VmExit::Crashed(why) if why.contains("could not be filled")),
        "{status:?}"
    );
    assert!(!dir.0.join("s2").join(STATE_FILE).exists());
}

/// A running `uffd`-restored VM whose memory file breaks under its page server ends as
/// crashed, without hanging on its vCPU blocked on a page that is never served.
#[test]
fn a_broken_memory_file_under_a_running_vm_ends_it_without_hanging() {
    let dir = TmpDir::new("broken-running");
    let mut vm = restore_then_break_its_memory_file(&dir, |_| {});
    // The guest's `memsum` after its loop reads pages that cannot be served now: its
    // vCPU blocks on the first one.
    let t = Instant::now();
    let status = vm.wait_timeout(T).unwrap();
    assert!(
        matches!(&status, Some(VmExit::Crashed(why)) if why.contains("could not be served")),
        "{status:?}"
    );
    drop(vm);
    assert!(t.elapsed() < T, "ending took {:?}", t.elapsed());
}

/// A full snapshot of memory that can be frozen is copy-on-write: the pause only freezes
/// the memory and the file is written while the guest runs on. Taken of a running guest,
/// or of one whose memory is in layers already (written since an earlier freeze), it
/// restores exactly the memory of its instant, and nothing written after it.
#[test]
fn copy_on_write_full_snapshots_hold_exactly_their_instant() {
    let dir = TmpDir::new("cow");
    // The loop must outlast two snapshots, writes and pauses: 2^30 iterations (~0.3 s
    // here) once did not, when the snapshots' file writes drew memory slow on first touch.
    let mut c = guest_config("memfill:7:32,memsum,loop:32,memsum,mmio,hlt");
    c.mem_mib = 128;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "step memsum ok", 1);
    // Running: memory written after the vCPUs run again.
    let a = dir.0.join("a");
    let info = vmm::snapshot(&mut vm, &a, SnapshotKind::Full).unwrap();
    let names: Vec<&str> = info.steps.iter().map(|(n, _)| *n).collect();
    let at = |n: &str| names.iter().position(|x| *x == n).unwrap();
    assert!(at("write_memory") > at("unpause"), "{names:?}");
    assert!(at("freeze_memory") < at("unpause"), "{names:?}");

    // Written since that freeze (the VMM's writes count as the guest's do): the next
    // full snapshot's memory is a layer over the first one's.
    vm.pause().unwrap();
    let above_fill = (64 + 32 + 4) << 20;
    vm.write_guest(above_fill, &[0xa5; 3 * 4096 + 17]).unwrap();
    vm.unpause().unwrap();
    let b = dir.0.join("b");
    let info = vmm::snapshot(&mut vm, &b, SnapshotKind::Full).unwrap();
    assert!(info.steps.iter().any(|(n, _)| *n == "freeze_memory"));
    // Written after it: not in it.
    vm.pause().unwrap();
    vm.write_guest(above_fill, &[0x3c; 4096]).unwrap();
    // A paused VM's full snapshot is written while paused (no freeze): exact at once.
    let c_dir = dir.0.join("c");
    let info = vmm::snapshot(&mut vm, &c_dir, SnapshotKind::Full).unwrap();
    assert!(!info.steps.iter().any(|(n, _)| *n == "freeze_memory"));
    let sum_c = checksum(&vm);
    vm.unpause().unwrap();
    let out = finish(&mut vm, "original");
    let sums = memsums(&out);
    assert_eq!(sums.len(), 2, "{out}");

    for (snap, sum, page_byte) in [(&c_dir, Some(sum_c), 0x3c), (&b, None, 0xa5), (&a, None, 0)] {
        let mut vm = vmm::restore(
            snap,
            MemoryBackend::Copy,
            RestoreOptions {
                start: false,
                ..options()
            },
        )
        .unwrap();
        if let Some(sum) = sum {
            assert_eq!(checksum(&vm), sum, "{}", snap.display());
        }
        let mut page = [0u8; 4];
        vm.read_guest(above_fill, &mut page).unwrap();
        assert_eq!(page, [page_byte; 4], "{}", snap.display());
        vm.start().unwrap();
        let out = finish(&mut vm, &snap.display().to_string());
        assert!(out.contains("loop 2^32 done"), "{out}");
        assert_eq!(memsums(&out), vec![sums[1].clone()], "{out}");
    }
}

/// A snapshot published to a real S3 server (s3s-fs on loopback), its host files deleted,
/// then restored on "another host" (a fresh chunk cache and fetcher) with its memory
/// fetched lazily: the memory is exactly the snapshot's and the guest continues; the file
/// backend (a mapping of a file still being filled) is refused; a restore after the
/// server is gone fails with an error naming the object instead of running on zeros.
#[test]
fn published_snapshot_restores_exactly_from_s3_after_the_host_files_are_gone() {
    use store::cache::ChunkCache;
    use store::fetcher::{FetchClient, FetcherThread};
    use store::publish::{publish, PublishOptions, SnapshotFiles};
    use store::s3server::S3Server;

    let dir = TmpDir::new("published");
    let snap = dir.0.join("snap");
    let (sum, memsum) = snapshot_mid_loop(&snap);
    let mut server = S3Server::start(&dir.0.join("s3"), "clade").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (manifest, report) = rt
        .block_on(async {
            let s = server.store("clade", "host-a", T).unwrap();
            let files = SnapshotFiles {
                state: snap.join(STATE_FILE),
                memory: snap.join(MEMORY_FILE),
                working_set: None,
                disk: None,
            };
            publish(&s, &files, &PublishOptions::default()).await
        })
        .unwrap();
    let id = manifest.snapshot_id();
    println!(
        "published {id}: {} bytes uploaded, {} bytes of memory data",
        report.bytes_uploaded, report.data_bytes
    );
    // The host that took it is gone.
    std::fs::remove_dir_all(&snap).unwrap();

    let cache = ChunkCache::new(
        &dir.0.join("host-b-cache"),
        server.store("clade", "host-a", T).unwrap(),
        1 << 30,
    )
    .unwrap();
    let fetcher = FetcherThread::start(&dir.0.join("fetch.sock"), cache).unwrap();
    let open = || {
        let client = FetchClient::connect(fetcher.socket(), T).unwrap();
        let remote = client.open(id).unwrap();
        let layers = remote.memory_layers().unwrap();
        vmm::PreparedSnapshot::open_with_layers(remote.dir(), vmm::CpuCheck::default(), layers)
            .unwrap()
    };
    let err = match open().restore(MemoryBackend::File, options()) {
        Ok(_) => panic!("the file backend restored a lazily fetched snapshot"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("fetched lazily"), "{err}");
    for backend in [MemoryBackend::Uffd, MemoryBackend::Copy] {
        let mut vm = open()
            .restore(
                backend,
                RestoreOptions {
                    start: false,
                    ..options()
                },
            )
            .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        assert_eq!(checksum(&vm), sum, "{backend:?}: memory differs");
        vm.start().unwrap();
        let out = finish(&mut vm, &format!("{backend:?} from S3"));
        assert_eq!(memsums(&out), vec![memsum.clone()], "{backend:?}: {out}");
    }
    let stats = fetcher.cache().stats();
    println!("fetched: {stats:?}");
    assert!(
        stats.bytes_fetched >= manifest.memory.data.size,
        "{stats:?}"
    );
    assert!(
        stats.bytes_fetched < manifest.memory.data.size + (4 << 20),
        "every chunk once: {stats:?}"
    );

    // A third host, after the store is gone: the restore fails, naming the object.
    server.kill();
    let cache = ChunkCache::new(
        &dir.0.join("host-c-cache"),
        server
            .store("clade", "host-a", Duration::from_secs(2))
            .unwrap(),
        1 << 30,
    )
    .unwrap();
    let fetcher = FetcherThread::start(&dir.0.join("fetch-c.sock"), cache).unwrap();
    let client = FetchClient::connect(fetcher.socket(), T).unwrap();
    let err = client.open(id).unwrap_err().to_string();
    assert!(err.contains("host-a/snapshots/"), "{err}");
}

//! Native KVM tier: fork a running native test guest. Memory is copy-on-write between the
//! parent and every child both ways (the guest's own `memsum` checksums after each VM
//! writes its own pattern), forks of forks and repeated forks of one parent see the right
//! memory, VMs restored on demand (`uffd`) or from the memory file fork from their
//! snapshot, and a fork failing part-way leaves the parent running and no child behind.
//! The memory tests run twice: the parent frozen in place, and the parent moving onto a
//! spare shell (`Vm::give_shell`), which must be the same to the guest and to its users.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clade_tests::guest_config;
use vmm::agent::{Client, Transport, AGENT_VSOCK_PORT};
use vmm::VsockConfig;
use vmm::{ForkOptions, ForkReport, SerialOutput, Shell, Vm, VmExit};

const T: Duration = Duration::from_secs(60);
/// The guest's mailbox (tests/native-guest: 64 MiB - 4096).
const MBOX: u64 = (64 << 20) - 4096;
const FILL_BASE: u64 = 64 << 20;
const MIB: u64 = 16;

fn serial(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned()
}

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

fn mbox(vm: &Vm, slot: u64, value: u64) {
    vm.write_guest(MBOX + 8 * slot, &value.to_le_bytes())
        .unwrap();
}

/// The guest's `memsum` of `MIB` MiB filled with `seed` (same formulas as the guest).
fn expected_sum(seed: u64) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut a = FILL_BASE;
    while a < FILL_BASE + (MIB << 20) {
        let w = (a ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= w;
        h = h.wrapping_mul(0x100_0000_01b3);
        h ^= h >> 32;
        a += 8;
    }
    format!("memsum {MIB} MiB: {h:#018x}")
}

fn memsums(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("memsum "))
        .map(str::to_string)
        .collect()
}

fn finish(vm: &mut Vm, what: &str) -> String {
    let status = vm.wait_timeout(T).unwrap();
    let out = serial(vm);
    assert_eq!(status, Some(VmExit::TestExit(0)), "{what}:\n{out}");
    out
}

fn fork_opts() -> ForkOptions {
    ForkOptions {
        serial: SerialOutput::Memory,
        start: true,
        ..ForkOptions::default()
    }
}

/// How the forking VM freezes its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Freeze {
    /// Remapped in place (no spare shell).
    InPlace,
    /// The VM moves onto a spare shell.
    Moving,
}

/// Gives `vm` a spare shell when it is to move at its next fork.
fn prepare(vm: &mut Vm, how: Freeze) {
    if how == Freeze::Moving {
        vm.give_shell(Shell::create(&vm.child_shell_spec()).unwrap())
            .unwrap();
        assert!(vm.has_spare_shell());
    }
}

/// The fork froze the parent the way asked for (a failed move would fall back in place).
fn check_freeze(report: &ForkReport, how: Freeze) {
    let moved = vmm::moved(&report.pause_steps);
    assert_eq!(
        moved,
        how == Freeze::Moving,
        "{how:?}: {:?}",
        report.pause_steps
    );
}

fn memory_parent(steps: &str) -> Vm {
    let mut c = guest_config(steps);
    c.mem_mib = 128;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    vm
}

#[test]
fn ten_children_and_the_parent_see_only_their_own_writes() {
    ten_children(Freeze::InPlace);
}

#[test]
fn ten_children_and_a_parent_that_moved_see_only_their_own_writes() {
    ten_children(Freeze::Moving);
}

fn ten_children(how: Freeze) {
    let steps = format!("memfill:1:{MIB},memsum,mbox:0,memsum,memfill:mbox:{MIB},mbox:1,memsum");
    let mut parent = memory_parent(&steps);
    wait_for_output(&parent, "step memsum ok", 1);
    prepare(&mut parent, how);
    let (children, report) = vmm::fork_with_report(&mut parent, 10, fork_opts()).unwrap();
    check_freeze(&report, how);
    assert!(!parent.has_spare_shell(), "the move used the shell up");
    println!(
        "fork of 10: parent paused {:?} ({:?}); children built in {:?}",
        report.pause_time, report.pause_steps, report.child_times
    );
    let mut vms: Vec<Vm> = std::iter::once(parent).chain(children).collect();
    for (i, vm) in vms.iter().enumerate() {
        mbox(vm, 0, 100 + i as u64);
    }
    for vm in &vms {
        wait_for_output(vm, &format!("step memfill:mbox:{MIB} ok"), 1);
    }
    // Everyone has written its own pattern over the same pages; now each checks.
    for vm in &vms {
        mbox(vm, 1, 1);
    }
    let before = expected_sum(1);
    for (i, vm) in vms.iter_mut().enumerate() {
        let out = finish(vm, &format!("VM {i}"));
        let sums = memsums(&out);
        let own = expected_sum(100 + i as u64);
        if i == 0 {
            assert_eq!(
                sums,
                vec![before.clone(), before.clone(), own],
                "parent:\n{out}"
            );
        } else {
            assert_eq!(
                sums,
                vec![before.clone(), own],
                "child {i} sees the pre-fork memory, then only its own writes:\n{out}"
            );
            assert!(
                !out.contains("clade-native-guest: start"),
                "child {i} restarted:\n{out}"
            );
        }
    }
}

#[test]
fn fork_of_a_fork_and_a_second_fork_of_the_parent_see_the_latest_writes() {
    fork_of_a_fork(Freeze::InPlace);
}

#[test]
fn fork_of_a_fork_and_a_second_fork_of_a_parent_that_moved_see_the_latest_writes() {
    fork_of_a_fork(Freeze::Moving);
}

fn fork_of_a_fork(how: Freeze) {
    let steps = format!("memfill:1:{MIB},memsum,mbox:0,memfill:mbox:{MIB},memsum,mbox:1,memsum");
    let mut parent = memory_parent(&steps);
    wait_for_output(&parent, "step memsum ok", 1);
    prepare(&mut parent, how);
    let (mut first, r0) = vmm::fork_with_report(&mut parent, 1, fork_opts()).unwrap();
    check_freeze(&r0, how);
    let mut child = first.pop().unwrap();
    mbox(&parent, 0, 5);
    mbox(&child, 0, 6);
    wait_for_output(&parent, "step memsum ok", 2);
    wait_for_output(&child, "step memsum ok", 1);

    // Both wrote since their memory was frozen: the second generation needs a layer.
    prepare(&mut child, how);
    prepare(&mut parent, how);
    let (mut grand, r1) = vmm::fork_with_report(&mut child, 1, fork_opts()).unwrap();
    let (mut second, r2) = vmm::fork_with_report(&mut parent, 2, fork_opts()).unwrap();
    check_freeze(&r1, how);
    check_freeze(&r2, how);
    assert_eq!((r1.layers, r2.layers), (2, 2));
    println!(
        "second-generation forks: paused {:?} / {:?} ({} / {} mappings)",
        r1.pause_time, r2.pause_time, r1.mappings, r2.mappings
    );
    let mut all: Vec<(Vm, u64)> = vec![(parent, 5), (child, 6)];
    all.extend(grand.drain(..).map(|v| (v, 6)));
    all.extend(second.drain(..).map(|v| (v, 5)));
    for (vm, _) in &all {
        mbox(vm, 1, 1);
    }
    for (i, (vm, seed)) in all.iter_mut().enumerate() {
        let out = finish(vm, &format!("VM {i}"));
        assert_eq!(
            memsums(&out).last(),
            Some(&expected_sum(*seed)),
            "VM {i}:\n{out}"
        );
    }
}

struct TmpDir(PathBuf);

impl TmpDir {
    fn new(name: &str) -> TmpDir {
        let d = std::env::temp_dir().join(format!("clade-fork-{}-{name}", std::process::id()));
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

/// An agent connection to the guest behind `sock`.
fn connect(sock: &Path) -> Client {
    Client::connect_timeout(
        sock,
        Transport::Vsock {
            port: AGENT_VSOCK_PORT,
        },
        Duration::from_secs(10),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", sock.display()))
}

fn ping(sock: &Path) {
    connect(sock).ping().unwrap();
}

/// A running guest serving its agent on `p.sock` in `dir` (guest CID 3), its steps
/// `steps` (a `vsock` one first).
fn agent_parent(dir: &TmpDir, steps: &str) -> (Vm, PathBuf) {
    let psock = dir.0.join("p.sock");
    let mut c = guest_config(steps);
    c.vsock = Some(VsockConfig {
        uds_path: psock.clone(),
        guest_cid: 3,
    });
    let mut parent = vmm::boot(c).unwrap();
    parent.start().unwrap();
    wait_for_output(&parent, "serving agent port", 1);
    (parent, psock)
}

#[test]
fn a_failed_fork_removes_its_children_and_the_parent_runs_on() {
    let dir = TmpDir::new("fail");
    let (mut parent, psock) = agent_parent(&dir, "vsock");
    let paths: Vec<PathBuf> = (0..3).map(|i| dir.0.join(format!("c{i}.sock"))).collect();
    let err = vmm::fork(
        &mut parent,
        3,
        ForkOptions {
            vsock_paths: paths.clone(),
            fail_after: Some(2),
            ..fork_opts()
        },
    )
    .err()
    .expect("injected failure");
    assert!(err.to_string().contains("injected"), "{err}");
    for p in &paths {
        assert!(!p.exists(), "{} left behind", p.display());
    }
    assert_eq!(parent.state_name(), "running");
    ping(&psock);

    // A real fork afterwards: children with their own sockets and CIDs answer, and so
    // does the parent.
    let mut kids = vmm::fork(
        &mut parent,
        2,
        ForkOptions {
            vsock_paths: paths[..2].to_vec(),
            guest_cids: vec![40, 41],
            ..fork_opts()
        },
    )
    .unwrap();
    for (p, k) in paths.iter().zip(&kids) {
        ping(p);
        assert_eq!(
            k.config().vsock.as_ref().unwrap().guest_cid,
            if p == &paths[0] { 40 } else { 41 }
        );
    }
    ping(&psock);
    // Killing the parent leaves the children running.
    parent.shutdown();
    drop(parent);
    for p in &paths[..2] {
        ping(p);
    }
    for k in &mut kids {
        k.shutdown();
    }
}

/// Children's vsock sockets bound ahead are moved into place (a child without one binds
/// its own), and a failed fork leaves none of them behind.
#[test]
fn sockets_bound_ahead_become_the_childrens_and_a_failed_fork_leaves_none() {
    let dir = TmpDir::new("ahead");
    let (mut parent, psock) = agent_parent(&dir, "vsock");
    let paths: Vec<PathBuf> = (0..3).map(|i| dir.0.join(format!("c{i}.sock"))).collect();
    let ahead_path = |i: usize| dir.0.join(format!("c{i}.ahead"));
    let ahead = |n: usize| -> Vec<vmm::BoundAhead> {
        (0..n)
            .map(|i| vmm::bind_vsock_ahead(&ahead_path(i)).unwrap())
            .collect()
    };
    let err = vmm::fork(
        &mut parent,
        3,
        ForkOptions {
            vsock_paths: paths.clone(),
            vsock_bound_ahead: ahead(3),
            fail_after: Some(2),
            ..fork_opts()
        },
    )
    .err()
    .expect("injected failure");
    assert!(err.to_string().contains("injected"), "{err}");
    for (i, p) in paths.iter().enumerate() {
        assert!(!p.exists(), "{} left behind", p.display());
        assert!(
            !ahead_path(i).exists(),
            "socket {i} bound ahead left behind"
        );
    }
    let mut kids = vmm::fork(
        &mut parent,
        2,
        ForkOptions {
            vsock_paths: paths[..2].to_vec(),
            vsock_bound_ahead: ahead(1),
            ..fork_opts()
        },
    )
    .unwrap();
    assert!(!ahead_path(0).exists(), "the socket bound ahead was moved");
    for p in &paths[..2] {
        ping(p);
    }
    ping(&psock);
    for k in &mut kids {
        k.shutdown();
    }
    drop(kids);
    for p in &paths[..2] {
        assert!(!p.exists(), "{} left behind", p.display());
    }
}

/// A VM restored with the `uffd` or `file` backend forks live from the snapshot it came
/// from (or last took, a diff on it): the children see the memory at the fork — the
/// snapshot's pages, the ones written since — and from then on only their own writes.
#[test]
fn vms_restored_on_demand_or_from_the_file_fork_from_their_snapshot() {
    restored_parents(Freeze::InPlace);
}

#[test]
fn vms_restored_on_demand_or_from_the_file_move_and_fork_from_their_snapshot() {
    restored_parents(Freeze::Moving);
}

fn restored_parents(how: Freeze) {
    let dir = TmpDir::new(&format!("restored-{how:?}"));
    let full = dir.0.join("full");
    let steps = format!(
        "memfill:1:{MIB},memsum,mbox:0,memfill:mbox:{MIB},memsum,mbox:1,memsum,\
         memfill:mbox:{MIB},mbox:2,memsum"
    );
    let mut original = memory_parent(&steps);
    wait_for_output(&original, "step memsum ok", 1);
    original.pause().unwrap();
    vmm::snapshot(&mut original, &full, vmm::SnapshotKind::Full).unwrap();
    drop(original);

    for backend in [vmm::MemoryBackend::Uffd, vmm::MemoryBackend::File] {
        let mut parent = vmm::restore(
            &full,
            backend,
            vmm::RestoreOptions {
                serial: SerialOutput::Memory,
                ..vmm::RestoreOptions::default()
            },
        )
        .unwrap();
        // Written since the restore: the layer over the snapshot.
        mbox(&parent, 0, 7);
        wait_for_output(&parent, "step memsum ok", 1);
        let mut layers = 2;
        if backend == vmm::MemoryBackend::Uffd {
            // A diff since: the fork builds on the chain (full, diff).
            parent.pause().unwrap();
            let diff = dir.0.join("diff");
            vmm::snapshot(&mut parent, &diff, vmm::SnapshotKind::Diff).unwrap();
            parent.write_guest(MBOX + 8 * 3, &[1; 8]).unwrap();
            parent.unpause().unwrap();
            layers = 3;
        }
        prepare(&mut parent, how);
        let (mut children, report) = vmm::fork_with_report(&mut parent, 2, fork_opts())
            .unwrap_or_else(|e| {
                panic!("{backend}: {e}");
            });
        check_freeze(&report, how);
        assert_eq!(report.layers, layers, "{backend}: {:?}", report.pause_steps);
        println!(
            "{backend}: fork paused {:?} ({:?})",
            report.pause_time, report.pause_steps
        );
        let mut all: Vec<(Vm, u64)> = vec![(parent, 8)];
        all.extend(children.drain(..).zip([9, 10]));
        // Each its own seed; slot 2 lets each sum up after its own fill.
        for (vm, seed) in &all {
            mbox(vm, 1, *seed);
            mbox(vm, 2, 1);
        }
        for (i, (vm, seed)) in all.iter_mut().enumerate() {
            let out = finish(vm, &format!("{backend} VM {i}"));
            let sums = memsums(&out);
            assert_eq!(
                &sums[sums.len() - 2..],
                &[expected_sum(7), expected_sum(*seed)],
                "{backend} VM {i}: the memory at the fork, then its own writes:\n{out}"
            );
        }
    }
}

/// A VM that moves onto a spare shell at each freeze stays the same VM to its users: an
/// agent connection opened before carries on through every move, its socket and CID stay,
/// it forks again and again (moving each time), and a copy-on-write snapshot moves it too
/// and restores into a VM that answers.
#[test]
fn a_vm_that_moves_keeps_its_connection_forks_again_and_snapshots() {
    let dir = TmpDir::new("moves");
    let (mut parent, psock) = agent_parent(&dir, "vsock");
    let conn = connect(&psock);
    conn.ping().unwrap();
    for round in 0..3 {
        prepare(&mut parent, Freeze::Moving);
        let kid = dir.0.join(format!("c{round}.sock"));
        let (mut kids, report) = vmm::fork_with_report(
            &mut parent,
            1,
            ForkOptions {
                vsock_paths: vec![kid.clone()],
                ..fork_opts()
            },
        )
        .unwrap();
        check_freeze(&report, Freeze::Moving);
        conn.ping().unwrap();
        ping(&psock);
        ping(&kid);
        assert_eq!(parent.config().vsock.as_ref().unwrap().guest_cid, 3);
        kids[0].shutdown();
    }
    // A full snapshot of the running VM is copy-on-write: the freeze moves it.
    prepare(&mut parent, Freeze::Moving);
    let snap = dir.0.join("snap");
    let info = vmm::snapshot(&mut parent, &snap, vmm::SnapshotKind::Full).unwrap();
    assert!(vmm::moved(&info.steps), "{:?}", info.steps);
    conn.ping().unwrap();
    let rsock = dir.0.join("r.sock");
    let mut restored = vmm::restore(
        &snap,
        vmm::MemoryBackend::Uffd,
        vmm::RestoreOptions {
            vsock_path: Some(rsock.clone()),
            ..vmm::RestoreOptions::default()
        },
    )
    .unwrap();
    ping(&rsock);
    conn.ping().unwrap();
    restored.shutdown();
    parent.shutdown();
}

/// Every interrupt line follows a VM that moves onto its spare shell (the lines switch to
/// eventfds wired to the new KVM VM when the shell is given): after two moves, its vsock
/// device still wakes it for a request on a connection opened before them, and then its
/// `hlt` step, which waits for the test device's interrupt, ends well.
#[test]
fn the_interrupts_of_a_vm_that_moved_reach_it() {
    let dir = TmpDir::new("moved-irqs");
    let (mut parent, psock) = agent_parent(&dir, "vsock:1,hlt");
    let conn = connect(&psock);
    for round in 0..2 {
        prepare(&mut parent, Freeze::Moving);
        let (kids, report) = vmm::fork_with_report(
            &mut parent,
            1,
            ForkOptions {
                vsock_paths: vec![dir.0.join(format!("c{round}.sock"))],
                ..fork_opts()
            },
        )
        .unwrap();
        check_freeze(&report, Freeze::Moving);
        drop(kids);
        // Long enough for the guest to halt: the ping's packet must wake it.
        std::thread::sleep(Duration::from_millis(20));
        let (tx, rx) = std::sync::mpsc::channel();
        let c = conn.clone();
        std::thread::spawn(move || tx.send(c.ping().map(|_| ())));
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(r) => r.unwrap(),
            Err(_) => panic!("move {round}: no answer in 10 s (its interrupt went elsewhere)"),
        }
    }
    // The one connection the `vsock:1` step serves ends; `hlt` runs.
    drop(conn);
    let out = finish(&mut parent, "the moved parent");
    assert!(out.contains("step hlt ok"), "{out}");
}

/// A booted VM's spare shell has its memory mapped when it is given (its memfd, which the
/// fork freezes as it is): what the guest writes after that and before the fork is in the
/// parent that moved onto the shell and in every child.
#[test]
fn writes_after_the_spare_shell_was_given_are_in_the_fork() {
    writes_after_shells_were_mapped(false);
}

/// Shells a booted VM mapped its memory into ahead of the fork (`Vm::map_into_shell`: its
/// memfd, which the fork freezes as it is): the children built on them see what the guest
/// wrote after that and before the fork, like the parent that moved.
#[test]
fn children_on_shells_mapped_ahead_see_the_writes_made_before_the_fork() {
    writes_after_shells_were_mapped(true);
}

/// The parent gets a spare shell (and, with `children_mapped`, two shells for its children
/// with its memory mapped ahead), then fills its memory and forks into two children; the
/// parent and both children must see that memory.
fn writes_after_shells_were_mapped(children_mapped: bool) {
    let steps = format!("mbox:0,memfill:mbox:{MIB},memsum,mbox:1,memsum");
    let mut parent = memory_parent(&steps);
    prepare(&mut parent, Freeze::Moving);
    let spec = parent.child_shell_spec();
    let shells: Vec<Shell> = if children_mapped {
        (0..2)
            .map(|_| {
                parent
                    .map_into_shell(Shell::create(&spec).unwrap())
                    .unwrap()
            })
            .collect()
    } else {
        Vec::new()
    };
    // Only now does the guest fill its memory (seed 7).
    mbox(&parent, 0, 7);
    wait_for_output(&parent, "step memsum ok", 1);
    let opts = ForkOptions {
        shells,
        ..fork_opts()
    };
    let (children, report) = vmm::fork_with_report(&mut parent, 2, opts).unwrap();
    check_freeze(&report, Freeze::Moving);
    let mut vms: Vec<Vm> = std::iter::once(parent).chain(children).collect();
    for vm in &vms {
        mbox(vm, 1, 1);
    }
    let filled = expected_sum(7);
    for (i, vm) in vms.iter_mut().enumerate() {
        let out = finish(vm, &format!("VM {i}"));
        let want = if i == 0 { 2 } else { 1 };
        assert_eq!(
            memsums(&out),
            vec![filled.clone(); want],
            "VM {i}:
{out}"
        );
    }
}

/// A shell mapped ahead for one fork and given to a child of a later one, whose frozen
/// image is another (the parent wrote in between): the child gets the later fork's memory.
#[test]
fn a_shell_mapped_ahead_for_an_earlier_fork_gets_the_later_forks_memory() {
    let steps =
        format!("mbox:0,memfill:mbox:{MIB},memsum,mbox:1,memfill:mbox:{MIB},memsum,mbox:2,memsum");
    let mut parent = memory_parent(&steps);
    let stale = parent
        .map_into_shell(Shell::create(&parent.child_shell_spec()).unwrap())
        .unwrap();
    mbox(&parent, 0, 7);
    wait_for_output(&parent, "step memsum ok", 1);
    let mut first = vmm::fork(&mut parent, 1, fork_opts()).unwrap();
    // The parent fills its memory again (seed 9) and forks again, with the old shell.
    mbox(&parent, 1, 9);
    wait_for_output(&parent, "step memsum ok", 2);
    let opts = ForkOptions {
        shells: vec![stale],
        ..fork_opts()
    };
    let mut second = vmm::fork(&mut parent, 1, opts).unwrap();
    // The first child fills with seed 5; the second only sums what it was forked with.
    mbox(&first[0], 1, 5);
    for vm in [&parent, &first[0], &second[0]] {
        mbox(vm, 2, 1);
    }
    let parent_out = finish(&mut parent, "parent");
    assert_eq!(
        memsums(&parent_out),
        vec![expected_sum(7), expected_sum(9), expected_sum(9)],
        "{parent_out}"
    );
    let out = finish(&mut first[0], "first child");
    assert_eq!(memsums(&out), vec![expected_sum(5); 2], "{out}");
    let out = finish(&mut second[0], "second child");
    assert_eq!(memsums(&out), vec![expected_sum(9)], "{out}");
}

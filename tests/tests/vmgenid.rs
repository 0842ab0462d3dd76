//! Native KVM tier: the VM generation ID. A booted VM has a random one in guest memory at
//! `vmm::VMGENID_ADDR`; every restore of a snapshot and every fork child gets a new one
//! (read by the host from guest memory before and after the vCPUs run), the guest goes on
//! undisturbed, and a snapshot in the format from before the device (state file version
//! 1) still restores, without the device and without its memory being touched.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clade_tests::guest_config;
use vmm::{ForkOptions, MemoryBackend, RestoreOptions, SerialOutput, SnapshotKind, Vm, VmExit};

const T: Duration = Duration::from_secs(60);
/// The guest's mailbox (tests/native-guest: 64 MiB - 4096).
const MBOX: u64 = (64 << 20) - 4096;

struct TmpDir(PathBuf);

impl TmpDir {
    fn new(name: &str) -> TmpDir {
        let d = std::env::temp_dir().join(format!("clade-vmgenid-{}-{name}", std::process::id()));
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

fn wait_for_output(vm: &Vm, what: &str) {
    let t = Instant::now();
    while !serial(vm).contains(what) {
        assert!(
            t.elapsed() < T,
            "no '{what}' in the output:\n{}",
            serial(vm)
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The 16 bytes at the generation ID's address, read from guest memory.
fn id_in_memory(vm: &Vm) -> [u8; 16] {
    let mut b = [0u8; 16];
    vm.read_guest(vmm::VMGENID_ADDR, &mut b).unwrap();
    b
}

/// Checks the VM's ID is in its memory and returns it.
fn current_id(vm: &Vm, what: &str) -> [u8; 16] {
    let id = vm
        .vm_generation_id()
        .unwrap_or_else(|| panic!("{what}: no VM generation ID device"));
    assert_eq!(id_in_memory(vm), id, "{what}: the ID in guest memory");
    id
}

/// Lets the guest past its `mbox:0` step and expects it to finish cleanly.
fn release_and_finish(vm: &mut Vm, what: &str) {
    vm.write_guest(MBOX, &1u64.to_le_bytes()).unwrap();
    let status = vm.wait_timeout(T).unwrap();
    let out = serial(vm);
    assert_eq!(status, Some(VmExit::TestExit(0)), "{what}:\n{out}");
    assert!(out.contains("step memsum ok"), "{what}:\n{out}");
}

fn waiting_guest() -> Vm {
    let mut c = guest_config("hello,mbox:0,memsum");
    c.mem_mib = 128;
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    wait_for_output(&vm, "step hello ok");
    vm
}

fn options() -> RestoreOptions {
    RestoreOptions {
        serial: SerialOutput::Memory,
        start: false,
        ..RestoreOptions::default()
    }
}

#[test]
fn restores_and_fork_children_get_new_ids_old_snapshots_none() {
    let dir = TmpDir::new("snap");
    let mut vm = waiting_guest();
    let booted = current_id(&vm, "booted VM");
    assert_ne!(booted, [0; 16]);
    vm.pause().unwrap();
    vmm::snapshot(&mut vm, &dir.0, SnapshotKind::Full).unwrap();
    vm.unpause().unwrap();
    assert_eq!(
        current_id(&vm, "snapshotted VM"),
        booted,
        "the original keeps its ID"
    );

    // Every restore, with every memory backend, has an ID of its own before it runs.
    let mut seen = vec![booted];
    for backend in [
        MemoryBackend::Uffd,
        MemoryBackend::Uffd,
        MemoryBackend::File,
        MemoryBackend::Copy,
    ] {
        let mut r = vmm::restore(&dir.0, backend, options()).unwrap();
        let id = current_id(&r, &format!("{backend} restore"));
        assert!(!seen.contains(&id), "{backend}: ID {id:02x?} seen before");
        seen.push(id);
        let steps: Vec<&str> = r
            .restore_report()
            .unwrap()
            .steps
            .iter()
            .map(|s| s.0)
            .collect();
        assert!(steps.contains(&"vmgenid"), "{steps:?}");
        r.start().unwrap();
        release_and_finish(&mut r, &format!("{backend} restore"));
        assert_eq!(
            id_in_memory(&r),
            id,
            "{backend}: the guest left its ID alone"
        );
    }

    // Fork children too; the parent keeps its own.
    let opts = ForkOptions {
        serial: SerialOutput::Memory,
        start: true,
        ..ForkOptions::default()
    };
    let mut children = vmm::fork(&mut vm, 3, opts).unwrap();
    assert_eq!(current_id(&vm, "fork parent"), booted);
    for (i, c) in children.iter().enumerate() {
        let id = current_id(c, &format!("child {i}"));
        assert!(!seen.contains(&id), "child {i}: ID {id:02x?} seen before");
        seen.push(id);
    }
    for (i, c) in children.iter_mut().enumerate() {
        release_and_finish(c, &format!("child {i}"));
    }
    release_and_finish(&mut vm, "fork parent");

    // The same snapshot as written before the device existed: it restores without one,
    // and the guest's memory there is what the snapshot holds.
    vmm::downgrade_state_file_to_v1(&dir.0).unwrap();
    let mut old = vmm::restore(&dir.0, MemoryBackend::Copy, options()).unwrap();
    assert_eq!(old.vm_generation_id(), None);
    assert_eq!(
        id_in_memory(&old),
        booted,
        "nothing written at the ID's address"
    );
    let steps: Vec<&str> = old
        .restore_report()
        .unwrap()
        .steps
        .iter()
        .map(|s| s.0)
        .collect();
    assert!(!steps.contains(&"vmgenid"), "{steps:?}");
    old.start().unwrap();
    release_and_finish(&mut old, "version-1 snapshot");
}

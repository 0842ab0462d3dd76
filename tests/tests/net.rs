//! Native KVM tier, root only (skipped otherwise: `cargo test -p clade-tests --test net`): a VM
//! with a virtio-net device over a TAP in a private network namespace is snapshotted and
//! restored onto another TAP; a restore without a TAP, or with another MAC, is refused
//! before the VM runs. (The native test guest does not drive the device: the data path is
//! tested in `devices`, with a TAP too.) Nothing leaves the namespace, which goes away with
//! the test's thread.

use std::path::PathBuf;
use std::time::Duration;

use clade_tests::guest_config;
use vmm::{
    MemoryBackend, NetConfig, RestoreOptions, SerialOutput, SnapshotKind, TapSource, VmExit,
};

fn net(name: &str, mac: Option<[u8; 6]>) -> NetConfig {
    NetConfig {
        tap: TapSource::Name(name.into()),
        mac,
        netns: None,
    }
}

#[test]
fn a_vm_with_a_tap_is_snapshotted_and_restored_onto_another_tap() {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (CAP_NET_ADMIN) for a network namespace and TAPs");
        return;
    }
    std::thread::spawn(|| {
        // SAFETY: unshare only moves this thread (and the VM threads it starts) into a
        // new, empty network namespace.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        let dir = std::env::temp_dir().join(format!("clade-nettest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mac = [2, 0, 0, 0, 0, 7];
        let mut c = guest_config("loop:26,hlt");
        c.net = Some(net("clade-n0", Some(mac)));
        let mut vm = vmm::boot(c).unwrap();
        vm.start().unwrap();
        vm.pause().unwrap();
        vmm::snapshot(&mut vm, &dir, SnapshotKind::Full).unwrap();
        vm.shutdown();
        drop(vm);

        let options = |n: Option<NetConfig>| RestoreOptions {
            serial: SerialOutput::Memory,
            net: n,
            ..RestoreOptions::default()
        };
        let err = vmm::restore(&dir, MemoryBackend::Copy, options(None))
            .err()
            .expect("a restore without a TAP is refused");
        assert!(err.to_string().contains("needs a TAP"), "{err}");
        let err = vmm::restore(
            &dir,
            MemoryBackend::Copy,
            options(Some(net("clade-n1", Some([2, 0, 0, 0, 0, 8])))),
        )
        .err()
        .expect("another MAC is refused");
        assert!(err.to_string().contains("saved guest's"), "{err}");
        let mut vm = vmm::restore(
            &dir,
            MemoryBackend::Copy,
            options(Some(net("clade-n1", None))),
        )
        .unwrap();
        let status = vm.wait_timeout(Duration::from_secs(60)).unwrap();
        let out = String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned();
        assert_eq!(status, Some(VmExit::TestExit(0)), "{out}");
        assert!(out.contains("step hlt ok"), "{out}");
        let _ = std::fs::remove_dir_all(PathBuf::from(&dir));
    })
    .join()
    .unwrap();
}

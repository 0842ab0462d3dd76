//! Native KVM tier: every descriptor a running VM holds (KVM, eventfds, memfds, epoll,
//! sockets) is close-on-exec, so processes the VMM starts (fork children, helpers) inherit
//! none of them. Alone in its test binary: it looks at all of this process's descriptors.

use std::time::{Duration, Instant};

use clade_tests::guest_config;
use vmm::VsockConfig;

/// This process's descriptors that are not close-on-exec, with what they are.
fn inheritable() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap() {
        let e = e.unwrap();
        let Ok(fd) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        // Only what the VMM makes: the test harness's own pipes and stdio are not ours.
        if !(target.starts_with("anon_inode:")
            || target.starts_with("/memfd:")
            || target.starts_with("socket:")
            || target.starts_with("/dev/kvm"))
        {
            continue;
        }
        // SAFETY: F_GETFD on a descriptor number only reads its flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
            out.push(format!("{fd} -> {target}"));
        }
    }
    out
}

#[test]
fn a_running_vm_holds_no_inheritable_descriptor() {
    let sock = std::env::temp_dir().join(format!("clade-fds-{}.sock", std::process::id()));
    let mut c = guest_config("vsock");
    c.vsock = Some(VsockConfig {
        uds_path: sock,
        guest_cid: 3,
    });
    let mut vm = vmm::boot(c).unwrap();
    vm.start().unwrap();
    let t = Instant::now();
    while !String::from_utf8_lossy(&vm.serial_output().unwrap_or_default())
        .contains("serving agent port")
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the guest never served"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let left = inheritable();
    vm.shutdown();
    assert!(left.is_empty(), "inheritable descriptors: {left:#?}");
}

//! The VMM's system-call filter: every thread of a running `clade run` is filtered, a call
//! outside the allow-list ends the process with a line naming it, and `--no-seccomp` turns
//! the filter off.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Dir, Proc};
use native_guest::native_guest;

fn run(d: &Dir, extra: &[&str], probe: bool) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_clade"));
    cmd.arg("run")
        .arg("--kernel")
        .arg(native_guest())
        .args(["--test-device", "--cmdline", "steps=vsock"])
        .arg("--vsock")
        .arg(d.p("vm.vsock"))
        .arg("--api-sock")
        .arg(d.p("vm.api"))
        .arg("--serial-file")
        .arg(d.p("vm.serial"))
        .args(extra);
    if probe {
        cmd.env("CLADE_SECCOMP_PROBE", "1");
    }
    cmd
}

/// The `Seccomp:` mode of each thread of `pid`.
fn thread_modes(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .unwrap_or("")
                .trim()
                .to_string()
        };
        out.push((field("Name:"), field("Seccomp:")));
    }
    out
}

fn wait_serving(d: &Dir) {
    let t = Instant::now();
    while !std::fs::read_to_string(d.p("vm.serial"))
        .unwrap_or_default()
        .contains("serving agent port")
    {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the guest never served"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The owner installs the filter as its loop starts.
    std::thread::sleep(Duration::from_millis(200));
}

#[test]
fn every_thread_of_a_running_vmm_is_filtered() {
    let d = Dir::new("seccomp-threads");
    let p = Proc(run(&d, &[], false).stderr(Stdio::null()).spawn().unwrap());
    wait_serving(&d);
    let modes = thread_modes(p.0.id());
    assert!(modes.len() >= 3, "{modes:?}");
    assert!(modes.iter().all(|(_, m)| m == "2"), "{modes:?}");

    let d2 = Dir::new("seccomp-off");
    let p2 = Proc(
        run(&d2, &["--no-seccomp"], false)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_serving(&d2);
    let modes = thread_modes(p2.0.id());
    assert!(modes.iter().all(|(_, m)| m == "0"), "{modes:?}");
    drop((p, p2));
}

#[test]
fn a_call_outside_the_filter_ends_the_vmm_with_a_line_naming_it() {
    let d = Dir::new("seccomp-probe");
    let o = run(&d, &[], true).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(128 + libc::SIGSYS), "{err}");
    let line = format!("system call #{}", libc::SYS_personality);
    assert!(
        err.contains("clade: seccomp:") && err.contains(&line),
        "{err}"
    );
    // Without the filter the same call is harmless and the VM runs on.
    let d2 = Dir::new("seccomp-probe-off");
    let mut p = Proc(
        run(&d2, &["--no-seccomp"], true)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_serving(&d2);
    assert!(p.0.try_wait().unwrap().is_none(), "the VMM ended");
}

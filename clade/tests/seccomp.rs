//! The VMM's system-call filters: every thread of a running `clade run` is filtered, each
//! VM thread with its kind's filter on top of the process filter; a call outside a filter
//! ends the process with a line naming it and the thread; `--no-seccomp` turns them off.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Dir, Proc};
use native_guest::native_guest;

fn run(d: &Dir, extra: &[&str], probe: bool) -> Command {
    run_probing(d, extra, probe.then_some("1"))
}

fn run_probing(d: &Dir, extra: &[&str], probe: Option<&str>) -> Command {
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
    if let Some(p) = probe {
        cmd.env("CLADE_SECCOMP_PROBE", p);
    }
    cmd
}

/// The `Seccomp:` mode of each thread of `pid`.
fn thread_modes(pid: u32) -> Vec<(String, String)> {
    thread_fields(pid, "Seccomp:")
}

/// Each thread's name and the value of its status field `key`.
fn thread_fields(pid: u32, key: &str) -> Vec<(String, String)> {
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
        out.push((field("Name:"), field(key)));
    }
    out
}

/// Each thread's name and number of filters.
fn thread_filters(pid: u32) -> Vec<(String, u32)> {
    thread_fields(pid, "Seccomp_filters:")
        .into_iter()
        .map(|(n, f)| (n, f.parse().unwrap_or(0)))
        .collect()
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

#[test]
fn each_vm_thread_adds_its_kinds_filter() {
    let d = Dir::new("seccomp-kinds");
    let p = Proc(run(&d, &[], false).stderr(Stdio::null()).spawn().unwrap());
    wait_serving(&d);
    let filters = thread_filters(p.0.id());
    let of = |name: &str| {
        filters
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, f)| *f)
            .unwrap_or_else(|| panic!("no thread {name}: {filters:?}"))
    };
    // The owner keeps the process filter only; the others add theirs.
    assert_eq!(of("clade"), 1, "{filters:?}");
    assert!(of("vcpu0") >= 2, "{filters:?}");
    assert!(of("clade-devices") >= 2, "{filters:?}");
    assert!(of("api") >= 2, "{filters:?}");
    drop(p);
}

/// A VM whose thread of kind `kind` (named `thread`) tries `execve` right after confining
/// itself: allowed by the process filter (the owner starts fork children with it), not by
/// the kind's. The VMM ends with the line naming the call and the thread; unfiltered, the
/// same call fails harmlessly and the VM runs on.
fn probe_kind(kind: &str, thread: &str) {
    let d = Dir::new(&format!("seccomp-probe-{kind}"));
    let o = run_probing(&d, &[], Some(kind)).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(128 + libc::SIGSYS), "{kind}: {err}");
    let line = format!(
        "system call #{} is not allowed in thread {thread}",
        libc::SYS_execve
    );
    assert!(err.contains(&line), "{kind}: {err}");
    let d2 = Dir::new(&format!("seccomp-probe-{kind}-off"));
    let mut p = Proc(
        run_probing(&d2, &["--no-seccomp"], Some(kind))
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_serving(&d2);
    assert!(p.0.try_wait().unwrap().is_none(), "{kind}: the VMM ended");
}

#[test]
fn a_vcpu_thread_cannot_start_programs() {
    probe_kind("vcpu", "vcpu0");
}

#[test]
fn the_device_loop_cannot_start_programs() {
    probe_kind("devices", "clade-devices");
}

#[test]
fn the_api_thread_cannot_start_programs() {
    probe_kind("api", "api");
}

#[test]
fn the_page_server_cannot_start_programs() {
    let d = Dir::new("seccomp-probe-uffd");
    let mut p = Proc(run(&d, &[], false).stderr(Stdio::null()).spawn().unwrap());
    wait_serving(&d);
    let clade = || Command::new(env!("CARGO_BIN_EXE_clade"));
    let o = clade()
        .arg("snapshot")
        .arg(d.p("vm.api"))
        .arg(d.p("snap"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let _ = p.0.kill();
    let _ = p.0.wait();
    let o = clade()
        .arg("restore")
        .arg(d.p("snap"))
        .args(["--backend", "uffd", "--no-agent-sync"])
        .arg("--serial-file")
        .arg(d.p("r.serial"))
        .env("CLADE_SECCOMP_PROBE", "page-server")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(128 + libc::SIGSYS), "{err}");
    let line = format!(
        "system call #{} is not allowed in thread clade-uffd",
        libc::SYS_execve
    );
    assert!(err.contains(&line), "{err}");
}

#[test]
fn the_test_devices_interrupt_works_under_the_filters() {
    // The test device's irq thread once started at the guest's first arm, from the vCPU
    // thread, whose filter forbids making threads: the VMM died of SIGSYS.
    let out = Command::new(env!("CARGO_BIN_EXE_clade"))
        .arg("run")
        .arg("--kernel")
        .arg(native_guest())
        .args(["--test-device", "--cmdline", "steps=hlt"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{:?}: {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("step hlt ok"), "{text}");
}

//! `clade run/restore --jail`: a jailed VM on the native test guest runs as the given
//! user with the system-call filter on every thread, seeing only its own user's processes
//! (one process; with cgroup limits, in a PID namespace of its own) and a root holding
//! only what it needs; it snapshots (only under --files-root), forks (children
//! jailed alike, outliving a killed parent) and restores jailed. Needs root (CI runs as
//! root); as another user these tests say so and pass without running.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::os::unix::fs::chown;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Dir, Proc};
use native_guest::native_guest;
use vmm::api::{ApiClient, Request};

const NOBODY: u32 = 65534;

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) takes no arguments and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("not root: the jail tests need root to create namespaces; skipped");
    }
    root
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A directory the jailed user owns.
fn owned_dir(path: PathBuf) -> PathBuf {
    std::fs::create_dir_all(&path).unwrap();
    chown(&path, Some(NOBODY), Some(NOBODY)).unwrap();
    path
}

/// Pids whose command line contains `needle` and whose real uid is `uid`.
fn pids_of(needle: &str, uid: u32) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let real_uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next().map(str::to_owned));
        if cmd.contains(needle) && real_uid.as_deref() == Some(&uid.to_string()) {
            pids.push(pid);
        }
    }
    pids
}

/// As [`pids_of`] for nobody, the processes that hold a VM (not the jail's keeper, which
/// runs as the VM's user too once the jail is built).
fn vm_pids_of(needle: &str) -> Vec<i32> {
    let mut pids = pids_of(needle, NOBODY);
    pids.retain(|p| common::holds_kvm(*p));
    pids
}

/// Every thread of `pid` runs as nobody with no capabilities under the filter.
fn assert_confined(pid: i32) {
    let tasks: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .collect();
    assert!(!tasks.is_empty());
    for t in tasks {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap();
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
                .unwrap_or_default()
        };
        let n = NOBODY;
        assert_eq!(field("Uid:"), format!("{n} {n} {n} {n}"), "{status}");
        assert_eq!(field("Gid:"), format!("{n} {n} {n} {n}"), "{status}");
        assert_eq!(field("Seccomp:"), "2", "{status}");
        assert_eq!(field("CapEff:"), "0000000000000000", "{status}");
        assert_eq!(field("CapPrm:"), "0000000000000000", "{status}");
        assert_eq!(field("NoNewPrivs:"), "1", "{status}");
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let nspid = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .unwrap()
        .split_whitespace()
        .count();
    if nspid == 1 {
        // A jail with no cgroup of its own is one process: the VM process itself, in the
        // host's PID namespace, whose /proc shows it only its own user's processes.
        common::assert_sees_only_its_own_processes(pid, NOBODY, NOBODY);
        assert_own_network(pid);
        assert_own_root(pid);
        return;
    }
    // Else two PID namespaces, the host's and the jail's, and its parent (the jail's
    // keeper, or the VM process of a fork child) holds no privilege either.
    assert_eq!(nspid, 2, "{status}");
    let ppid = status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .map(str::trim)
        .unwrap()
        .to_string();
    let parent = std::fs::read_to_string(format!("/proc/{ppid}/status")).unwrap();
    let pfield = |k: &str| {
        parent
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    let n = NOBODY;
    assert_eq!(
        pfield("Uid:"),
        format!("{n} {n} {n} {n}"),
        "keeper {ppid}: {parent}"
    );
    assert_eq!(
        pfield("CapEff:"),
        "0000000000000000",
        "keeper {ppid}: {parent}"
    );
    assert_eq!(
        pfield("CapPrm:"),
        "0000000000000000",
        "keeper {ppid}: {parent}"
    );
    assert_own_network(pid);
    assert_own_root(pid);
}

/// A network namespace of its own: nothing of the host's network (its abstract Unix
/// sockets included) is reachable from it.
fn assert_own_network(pid: i32) {
    let net = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/net")).unwrap();
    assert_ne!(
        net(&pid.to_string()),
        net("self"),
        "pid {pid}: the host's network"
    );
}

/// Its root holds only what it needs.
fn assert_own_root(pid: i32) {
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    assert!(root.join("dev/kvm").exists());
    assert!(
        !root.join("etc").exists(),
        "the host's /etc is visible in the jail"
    );
    assert!(!root.join("root").exists());
    let mut top: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    for name in &top {
        assert!(
            ["dev", "proc", "tmp", "work", "usr", "lib", "lib64", "home", "root"]
                .contains(&name.as_str())
                || Path::new(env!("CARGO_MANIFEST_DIR")).starts_with(format!("/{name}")),
            "unexpected /{name} in the jail: {top:?}"
        );
    }
}

/// The process is in a cgroup of the jail's own (v2, or each v1 controller's), with the
/// limits the test gave.
fn assert_limited(pid: i32) {
    let v1 = !Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let read = |ctl: &str, file: &str| common::cgroup_file(pid, ctl, file).1;
    let (path, _) = common::cgroup_file(pid, "memory", "cgroup.procs");
    assert!(path.contains("clade/jail-"), "{path}");
    if v1 {
        assert_eq!(read("memory", "memory.limit_in_bytes"), "1073741824");
        assert_eq!(read("pids", "pids.max"), "512");
        assert_eq!(read("cpu", "cpu.cfs_quota_us"), "150000");
    } else {
        assert_eq!(read("memory", "memory.max"), "1073741824");
        assert_eq!(read("pids", "pids.max"), "512");
        assert_eq!(read("cpu", "cpu.max"), "150000 100000");
    }
}

fn ping(sock: &Path) {
    // --wait: a restored VM's vsock socket appears after its API socket.
    let o = clade()
        .args(["ping", "--wait", "20"])
        .arg(sock)
        .output()
        .unwrap();
    assert!(o.status.success(), "ping {}: {}", sock.display(), text(&o));
}

fn wait_exit(p: &mut Proc, within: Duration) -> Option<i32> {
    let t = Instant::now();
    loop {
        if let Some(s) = p.0.try_wait().unwrap() {
            return s.code();
        }
        assert!(t.elapsed() < within, "the jailed VM process did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_jailed_vm_runs_snapshots_forks_and_restores_confined() {
    if !is_root() {
        return;
    }
    let d = Dir::new("jail");
    let vm = owned_dir(d.p("vm"));
    let api = vm.join("api.sock");
    let vsock = vm.join("v.sock");
    let serial = vm.join("serial");
    let mut parent = Proc(
        clade()
            .arg("run")
            .arg("--kernel")
            .arg(native_guest())
            .args(["--test-device", "--cmdline", "steps=vsock"])
            .arg("--vsock")
            .arg(&vsock)
            .arg("--api-sock")
            .arg(&api)
            .arg("--serial-file")
            .arg(&serial)
            .arg("--files-root")
            .arg(&vm)
            .arg("--jail")
            .arg(d.p("root"))
            .args(["--uid", "65534", "--gid", "65534"])
            .args(["--jail-memory-max", "1G", "--jail-pids-max", "512"])
            .args(["--jail-cpus", "1.5"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_until("the API socket", || api.exists());
    wait_until("the agent", || {
        std::fs::read_to_string(&serial)
            .unwrap_or_default()
            .contains("serving agent port")
    });
    let vm_pids = vm_pids_of(&api.display().to_string());
    assert_eq!(
        vm_pids.len(),
        1,
        "one VM process runs as nobody: {vm_pids:?}"
    );
    let vm_pid = vm_pids[0];
    assert_confined(vm_pid);
    assert_limited(vm_pid);
    ping(&vsock);

    // Snapshots go under --files-root only.
    let o = clade()
        .arg("snapshot")
        .arg(&api)
        .arg(vm.join("snap"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let mut c = ApiClient::connect(&api).unwrap();
    let r = c
        .call(&Request::Snapshot {
            dir: d.p("outside"),
            kind: "full".into(),
        })
        .unwrap();
    assert!(!r.ok && !d.p("outside").exists(), "{r:?}");
    drop(c);

    // Fork: the children are jailed alike and outlive the parent's SIGKILL.
    let o = clade()
        .arg("fork")
        .arg(&api)
        .args(["-n", "2", "--no-agent-sync", "--json", "--prefix"])
        .arg(vm.join("kids"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let kids = j["children"].as_array().unwrap().clone();
    assert_eq!(kids.len(), 2, "{j}");
    for k in &kids {
        // `pid` is the jail's; the host sees the child by its command line.
        let api = k["api_sock"].as_str().unwrap();
        let pids = pids_of(&format!("fork-child --api-sock {api}"), NOBODY);
        assert_eq!(pids.len(), 1, "{pids:?}");
        assert_confined(pids[0]);
    }
    // SAFETY: kill(2) of the VM process this test started (through the jail).
    unsafe { libc::kill(vm_pid, libc::SIGKILL) };
    for k in &kids {
        ping(Path::new(k["vsock"].as_str().unwrap()));
    }
    // The jail lives on while its children do...
    std::thread::sleep(Duration::from_millis(200));
    assert!(parent.0.try_wait().unwrap().is_none());
    for k in &kids {
        let mut c = ApiClient::connect(Path::new(k["api_sock"].as_str().unwrap())).unwrap();
        assert!(c.call(&Request::Shutdown).unwrap().ok);
    }
    // ...and ends with them, with the parent VM's status (128 + SIGKILL).
    assert_eq!(wait_exit(&mut parent, Duration::from_secs(20)), Some(137));

    // Restore, jailed.
    let r1 = owned_dir(d.p("r1"));
    let mut restored = Proc(
        clade()
            .arg("restore")
            .arg(vm.join("snap"))
            .arg("--vsock")
            .arg(r1.join("v.sock"))
            .arg("--api-sock")
            .arg(r1.join("api.sock"))
            .arg("--files-root")
            .arg(&r1)
            .arg("--serial-file")
            .arg(r1.join("serial"))
            .arg("--no-agent-sync")
            .arg("--jail")
            .arg(d.p("root"))
            .args(["--uid", "65534", "--gid", "65534"])
            .spawn()
            .unwrap(),
    );
    wait_until("the restored VM's API socket", || {
        r1.join("api.sock").exists()
    });
    // The socket is bound before the restore opens /dev/kvm: the VM process is the one
    // that holds it, once it does.
    let needle = r1.join("api.sock").display().to_string();
    wait_until("the restored VM's process", || {
        !vm_pids_of(&needle).is_empty()
    });
    let pids = vm_pids_of(&needle);
    assert_eq!(pids.len(), 1, "{pids:?}");
    assert_confined(pids[0]);
    ping(&r1.join("v.sock"));
    // SIGTERM to the supervisor reaches the VM: it stops (128 + SIGTERM).
    // SAFETY: kill(2) of the process this test started.
    unsafe { libc::kill(restored.0.id() as i32, libc::SIGTERM) };
    assert_eq!(wait_exit(&mut restored, Duration::from_secs(20)), Some(143));
    wait_until("the jail's processes to end", || {
        pids_of(&d.0.display().to_string(), NOBODY).is_empty()
    });
}

#[test]
fn jail_errors_are_clear() {
    if !is_root() {
        return;
    }
    let d = Dir::new("jailerr");
    let vm = owned_dir(d.p("vm"));
    let run = |extra: &[&str], root: &Path| {
        clade()
            .arg("run")
            .arg("--kernel")
            .arg(native_guest())
            .args(["--test-device", "--cmdline", "steps=vsock"])
            .arg("--jail")
            .arg(root)
            .args(extra)
            .output()
            .unwrap()
    };
    let o = run(&["--uid", "0", "--gid", "0"], &d.p("r0"));
    assert!(
        !o.status.success() && text(&o).contains("must not be 0"),
        "{}",
        text(&o)
    );
    let o = run(&["--uid", "65534"], &d.p("r0"));
    assert!(
        !o.status.success() && text(&o).contains("--gid"),
        "{}",
        text(&o)
    );
    std::fs::create_dir_all(d.p("full/x")).unwrap();
    let o = run(&["--uid", "65534", "--gid", "65534"], &d.p("full"));
    assert!(
        !o.status.success() && text(&o).contains("not empty"),
        "{}",
        text(&o)
    );
    let api = vm.join("api.sock").display().to_string();
    let o = run(
        &["--uid", "65534", "--gid", "65534", "--api-sock", &api],
        &d.p("r1"),
    );
    assert!(
        !o.status.success() && text(&o).contains("--files-root"),
        "{}",
        text(&o)
    );
    let o = run(
        &["--uid", "65534", "--gid", "65534", "--jail-cpus", "0"],
        &d.p("r2"),
    );
    assert!(
        !o.status.success() && text(&o).contains("positive number of CPUs"),
        "{}",
        text(&o)
    );
    // None of these started a VM.
    assert!(pids_of(&d.0.display().to_string(), NOBODY).is_empty());
}

/// `clade restore --standby --jail`: the standby is confined while it waits (a uid of its
/// own, no capabilities, its own namespaces) and restores a snapshot it is shown read-only
/// (`--jail-read`) when asked; one it is not shown does not exist for it.
#[test]
fn a_jailed_standby_restores_a_snapshot_it_is_shown() {
    if !is_root() {
        return;
    }
    let d = Dir::new("jail-standby");
    // A snapshot of the guest serving agent connections, made unjailed.
    let shown = d.p("shown");
    std::fs::create_dir(&shown).unwrap();
    let snap = shown.join("snap");
    common::guest_snapshot(&native_guest(), &d.0, &snap);
    // Snapshot files are the writer's only (0600): a snapshot shared by VMs of other users
    // (a template's) is made readable to them.
    for f in std::fs::read_dir(&snap).unwrap().flatten() {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    // The hidden one: a copy of the snapshot outside what the jail shows.
    let hidden = d.p("hidden");
    std::fs::create_dir(&hidden).unwrap();
    for f in std::fs::read_dir(&snap).unwrap().flatten() {
        std::fs::copy(f.path(), hidden.join(f.file_name())).unwrap();
    }

    let home = owned_dir(d.p("home"));
    let sock = home.join("sb.api");
    let mut sb = Proc(
        clade()
            .args(["restore", "--standby", "--vcpus", "1", "--mem", "64"])
            .arg("--api-sock")
            .arg(&sock)
            .arg("--files-root")
            .arg(&home)
            .arg("--jail")
            .arg(d.p("root"))
            .args(["--uid", "65534", "--gid", "65534"])
            .arg("--jail-read")
            .arg(&shown)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("the standby", || {
        ApiClient::connect(&sock)
            .and_then(|mut c| c.call(&Request::Status))
            .is_ok_and(|r| r.ok && r.fields["state"] == "standby")
    });
    let pids = vm_pids_of(&sock.display().to_string());
    assert_eq!(pids.len(), 1, "one standby process as nobody: {pids:?}");
    assert_confined(pids[0]);

    let restore = |dir: &Path| {
        let req = Request::Restore(vmm::api::RestoreRequest {
            vsock: Some(home.join("vm.vsock")),
            serial_file: Some(home.join("serial.log")),
            agent_sync: false,
            ..vmm::api::RestoreRequest::new(dir.to_path_buf())
        });
        ApiClient::connect(&sock).unwrap().call(&req).unwrap()
    };
    let r = restore(&hidden);
    assert!(
        !r.ok && r.error.as_deref().unwrap_or("").contains("No such file"),
        "a snapshot the jail does not show: {r:?}"
    );
    let r = restore(&snap);
    assert!(r.ok, "{r:?}");
    ping(&home.join("vm.vsock"));
    assert_confined(pids[0]);
    let r = ApiClient::connect(&sock)
        .unwrap()
        .call(&Request::Shutdown)
        .unwrap();
    assert!(r.ok, "{r:?}");
    assert_eq!(wait_exit(&mut sb, Duration::from_secs(20)), Some(0));
}

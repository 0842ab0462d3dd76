//! `clade restore --standby`: a process with a pre-built VM shell restores a snapshot of
//! the native test guest on request, and from then on is an ordinary restored VM.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Dir, Proc};
use native_guest::native_guest;
use vmm::api::{ApiClient, Request, Response, RestoreRequest};

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

fn api(sock: &Path, req: &Request) -> Response {
    ApiClient::connect(sock).unwrap().call(req).unwrap()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wait_exit(p: &mut Proc) -> i32 {
    let mut code = None;
    wait_until("the process did not end", || {
        code = p.0.try_wait().unwrap().map(|s| s.code().unwrap_or(-1));
        code.is_some()
    });
    code.unwrap()
}

/// A full snapshot of the native test guest serving agent connections (one after another).
fn guest_snapshot(d: &Dir) -> PathBuf {
    let snap = d.p("snap");
    common::guest_snapshot(&native_guest(), &d.0, &snap);
    snap
}

/// The `Cpus_allowed_list` line of a /proc status file.
fn cpus_allowed(status: &Path) -> String {
    std::fs::read_to_string(status)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list")
        .trim()
        .to_string()
}

fn start_standby(d: &Dir, name: &str, root: &Path) -> (Proc, PathBuf) {
    start_standby_with(d, name, root, &[])
}

fn start_standby_with(d: &Dir, name: &str, root: &Path, args: &[&Path]) -> (Proc, PathBuf) {
    let sock = d.p(&format!("{name}.api"));
    let p = Proc(
        clade()
            .args(["restore", "--standby", "--vcpus", "1", "--mem", "256"])
            .args(args)
            .arg("--api-sock")
            .arg(&sock)
            .arg("--files-root")
            .arg(root)
            .env("CLADE_LOG", "info")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("the standby never answered", || {
        ApiClient::connect(&sock)
            .and_then(|mut c| c.call(&Request::Status))
            .is_ok_and(|r| r.ok && r.fields["state"] == "standby")
    });
    (p, sock)
}

#[test]
fn a_standby_restores_on_request_and_then_is_an_ordinary_vm() {
    let d = Dir::new("standby");
    let snap = guest_snapshot(&d);
    let root = d.p("sandboxes");
    std::fs::create_dir(&root).unwrap();
    let (mut sb, sock) = start_standby(&d, "sb", &root);

    let r = api(&sock, &Request::Status);
    assert_eq!(r.fields["vcpus"], 1);
    assert_eq!(r.fields["mem_mib"], 256);
    // There is no VM yet.
    let r = api(&sock, &Request::Pause);
    assert!(
        !r.ok && r.error.as_deref().unwrap().contains("standby"),
        "{r:?}"
    );

    // Bad requests are refused and leave the standby ready.
    let good = RestoreRequest {
        vsock: Some(root.join("vm.vsock")),
        serial_file: Some(root.join("serial.log")),
        log: Some(root.join("vm.log")),
        agent_sync: false,
        ..RestoreRequest::new(snap.clone())
    };
    let bad = [
        (
            RestoreRequest {
                snapshot: "relative/snap".into(),
                ..good.clone()
            },
            "absolute",
        ),
        (
            RestoreRequest {
                vsock: Some(d.p("outside.vsock")),
                ..good.clone()
            },
            "outside",
        ),
        (
            RestoreRequest {
                serial_file: Some(root.join("../escape.log")),
                ..good.clone()
            },
            "..",
        ),
        (
            RestoreRequest {
                snapshot: d.p("no-such-snapshot"),
                ..good.clone()
            },
            "no-such-snapshot",
        ),
        (
            RestoreRequest {
                backend: Some("tape".into()),
                ..good.clone()
            },
            "tape",
        ),
        (
            RestoreRequest {
                agent_sync_timeout_ms: Some(0),
                ..good.clone()
            },
            "agent_sync_timeout_ms",
        ),
    ];
    for (req, why) in bad {
        let r = api(&sock, &Request::Restore(req.clone()));
        assert!(
            !r.ok && r.error.as_deref().unwrap().contains(why),
            "{req:?}: {r:?}"
        );
        let r = api(&sock, &Request::Status);
        assert_eq!(r.fields["state"], "standby", "after {req:?}");
    }
    assert!(!root.join("vm.vsock").exists());
    // A stale socket where the VM's goes (left by a VM process that ended): replaced.
    // Bound but never listening: a copy of it that a process spawned meanwhile by another
    // test's thread holds until its exec accepts nothing either, as a dropped listener's
    // copy would (the restore then took the socket for a live one).
    {
        use socket2::{Domain, SockAddr, Socket, Type};
        let s = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        s.bind(&SockAddr::unix(root.join("vm.vsock")).unwrap())
            .unwrap();
    }
    // The standby made its serial file and vsock socket ahead, next to its API socket:
    // the restore moves them into place (same files), it does not create them.
    let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let made = (
        ino(&d.p("sb.serial")),
        ino(&d.p("sb.vmlog")),
        ino(&d.p("sb.vsock")),
    );

    // The restore: the answer is the restored VM's status; its agent answers.
    let r = api(&sock, &Request::Restore(good.clone()));
    assert!(r.ok, "{r:?}");
    assert_eq!(
        (
            ino(&root.join("serial.log")),
            ino(&root.join("vm.log")),
            ino(&root.join("vm.vsock"))
        ),
        made
    );
    for ext in ["serial", "vmlog", "vsock"] {
        assert!(!d.p("sb").with_extension(ext).exists(), "{ext}");
    }
    assert_eq!(r.fields["state"], "running");
    assert_eq!(r.fields["restored"]["kind"], "full");
    let o = clade()
        .arg("ping")
        .arg(root.join("vm.vsock"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The vCPU, kept off the CPU the standby answered on until the answer was out, may
    // run on every CPU the process may.
    let pid = sb.0.id();
    wait_until("the vCPU thread stayed pinned", || {
        let vcpu = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|t| t.ok())
            .find(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "vcpu0")
            })
            .expect("a vcpu0 thread");
        cpus_allowed(&vcpu.path().join("status"))
            == cpus_allowed(Path::new(&format!("/proc/{pid}/status")))
    });
    // Its log went where the request said, and the restore used the pre-built shell (a
    // line written once the standby answered).
    wait_until("no line about the restore in the VM's log", || {
        std::fs::read_to_string(root.join("vm.log")).is_ok_and(|l| l.contains("restored "))
    });
    let log = std::fs::read_to_string(root.join("vm.log")).unwrap();
    assert!(log.contains("shell pre-built"), "{log}");

    // A second restore is refused; the VM runs on and serves its API as any VM does.
    let r = api(&sock, &Request::Restore(good));
    assert!(
        !r.ok && r.error.as_deref().unwrap().contains("already runs a VM"),
        "{r:?}"
    );
    let r = api(&sock, &Request::Pause);
    assert_eq!(r.fields["state"], "paused", "{r:?}");
    let r = api(&sock, &Request::Unpause);
    assert_eq!(r.fields["state"], "running", "{r:?}");
    let o = clade()
        .arg("ping")
        .arg(root.join("vm.vsock"))
        .output()
        .unwrap();
    assert!(o.status.success(), "a second connection is served too");
    assert!(api(&sock, &Request::Shutdown).ok);
    assert_eq!(wait_exit(&mut sb), 0);
    assert!(!sock.exists() && !root.join("vm.vsock").exists());
}

/// `--preload`: the standby opens the snapshot it is told its request will most likely
/// name while it waits, and a request for it uses it; once that snapshot's files were
/// replaced (a template built again under the same name), the request opens the new one.
#[test]
fn a_standby_opens_its_likely_snapshot_ahead_and_sees_when_it_was_replaced() {
    let d = Dir::new("standby-preload");
    let snap = guest_snapshot(&d);
    let root = d.p("sandboxes");
    std::fs::create_dir(&root).unwrap();
    let request = |name: &str| RestoreRequest {
        vsock: Some(root.join(format!("{name}.vsock"))),
        serial_file: Some(root.join(format!("{name}.serial"))),
        log: Some(root.join(format!("{name}.log"))),
        agent_sync: false,
        ..RestoreRequest::new(snap.clone())
    };
    let restore = |sock: &Path, name: &str| {
        let r = api(sock, &Request::Restore(request(name)));
        assert!(r.ok, "{r:?}");
        let o = clade()
            .arg("ping")
            .arg(root.join(format!("{name}.vsock")))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let log_file = root.join(format!("{name}.log"));
        wait_until("no line about the restore in the VM's log", || {
            std::fs::read_to_string(&log_file).is_ok_and(|l| l.contains("restored "))
        });
        let log = std::fs::read_to_string(&log_file).unwrap();
        assert!(api(sock, &Request::Shutdown).ok);
        (r.fields["last_snapshot"]["id"].clone(), log)
    };
    let preload = [Path::new("--preload"), snap.as_path()];

    let (mut a, sock_a) = start_standby_with(&d, "a", &root, &preload);
    let r = api(&sock_a, &Request::Status);
    assert_eq!(r.fields["preloaded"], serde_json::json!([snap]), "{r:?}");
    let (first_id, log) = restore(&sock_a, "a");
    assert!(log.contains("snapshot opened ahead"), "{log}");
    assert_eq!(wait_exit(&mut a), 0);

    // Opened ahead, then replaced by another snapshot at the same path.
    let (mut b, sock_b) = start_standby_with(&d, "b", &root, &preload);
    let other = Dir::new("standby-preload-other");
    let replacement = guest_snapshot(&other);
    std::fs::rename(&snap, d.p("snap-old")).unwrap();
    std::fs::rename(&replacement, &snap).unwrap();
    let (second_id, log) = restore(&sock_b, "b");
    assert!(log.contains("snapshot opened now"), "{log}");
    assert_ne!(first_id, second_id, "the replacement was restored");
    assert_eq!(wait_exit(&mut b), 0);

    // A snapshot that cannot be opened ahead is no reason not to stand by.
    let missing = d.p("no-such-snapshot");
    let (mut c, sock_c) = start_standby_with(&d, "c", &root, &[Path::new("--preload"), &missing]);
    assert_eq!(
        api(&sock_c, &Request::Status).fields["preloaded"],
        serde_json::json!([])
    );
    // Nor is a `preload` request for it (answered with why), nor one with a relative path.
    let r = api(
        &sock_c,
        &Request::Preload {
            snapshot: missing.clone(),
        },
    );
    assert!(!r.ok && r.error.unwrap().contains("no-such-snapshot"));
    let r = api(
        &sock_c,
        &Request::Preload {
            snapshot: "snap".into(),
        },
    );
    assert!(!r.ok && r.error.unwrap().contains("absolute"));
    // A snapshot asked for (a paused sandbox's, by the service) is opened ahead too; past
    // MAX_PRELOADED asked for, the oldest is closed; the restore of one uses it.
    let mut copies = Vec::new();
    for i in 0..=vmm::host::MAX_PRELOADED {
        let copy = d.p(&format!("copy{i}"));
        copy_dir(&snap, &copy);
        let r = api(
            &sock_c,
            &Request::Preload {
                snapshot: copy.clone(),
            },
        );
        assert!(r.ok, "{r:?}");
        copies.push(copy);
    }
    let held = api(&sock_c, &Request::Status).fields["preloaded"].clone();
    assert_eq!(held, serde_json::json!(copies[1..]), "the oldest went");
    // Asked again: held already, nothing changes.
    let r = api(
        &sock_c,
        &Request::Preload {
            snapshot: copies[2].clone(),
        },
    );
    assert_eq!(r.fields["preloaded"], held);
    let mut req = request("c");
    req.snapshot = copies[2].clone();
    let r = api(&sock_c, &Request::Restore(req));
    assert!(r.ok, "{r:?}");
    // The standby logs how the restore went once it has answered.
    wait_until("no line about the restore in the VM's log", || {
        std::fs::read_to_string(root.join("c.log")).is_ok_and(|l| l.contains("restored "))
    });
    let log = std::fs::read_to_string(root.join("c.log")).unwrap();
    assert!(log.contains("snapshot opened ahead"), "{log}");
    // A VM refuses it.
    let r = api(
        &sock_c,
        &Request::Preload {
            snapshot: copies[1].clone(),
        },
    );
    assert!(
        !r.ok && r.error.as_deref().unwrap_or("").contains("standby"),
        "{r:?}"
    );
    assert!(api(&sock_c, &Request::Shutdown).ok);
    assert_eq!(wait_exit(&mut c), 0);
}

/// Copies the files of snapshot directory `from` to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_standby_ends_on_shutdown_and_on_a_signal() {
    let d = Dir::new("standby-end");
    let (mut sb, sock) = start_standby(&d, "a", &d.0);
    for ext in ["serial", "vmlog", "vsock"] {
        assert!(sock.with_extension(ext).exists(), "{ext} made ahead");
    }
    assert!(api(&sock, &Request::Shutdown).ok);
    assert_eq!(wait_exit(&mut sb), 0);
    // Its files go with it, the ones it made ahead too.
    for ext in ["api", "serial", "vmlog", "vsock"] {
        assert!(!sock.with_extension(ext).exists(), "{ext}");
    }

    let (mut sb, sock) = start_standby(&d, "b", &d.0);
    let o = Command::new("kill")
        .arg("-TERM")
        .arg(sb.0.id().to_string())
        .output()
        .unwrap();
    assert!(o.status.success());
    assert_eq!(wait_exit(&mut sb), 128 + 15);
    for ext in ["api", "serial", "vmlog", "vsock"] {
        assert!(!sock.with_extension(ext).exists(), "{ext}");
    }

    // --standby takes no snapshot and needs an API socket.
    let o = clade()
        .args(["restore", "--standby"])
        .arg(d.p("snap"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let o = clade().args(["restore", "--standby"]).output().unwrap();
    assert!(!o.status.success());
}

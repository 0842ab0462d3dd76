//! `clade run|restore --net auto` on the native test guest (root only): each VM gets a
//! network namespace of its own with its TAP attached, two at once get two, a third finds
//! none free in a two-network range, a network a SIGKILLed owner left behind is removed
//! by the next taker, a restore gets a new one and its guest answers, a jailed VM takes
//! its TAP as a descriptor, and every network is gone once its VM ended.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Dir, Proc};
use native_guest::native_guest;

const NOBODY: u32 = 65534;

/// Two /30 blocks: networks 0 and 1.
const RANGE: &str = "10.231.0.0/29";

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

fn netns(i: u32) -> PathBuf {
    PathBuf::from(format!("/run/netns/cladevm-{i}"))
}

fn holder(i: u32) -> String {
    std::fs::read_to_string(format!("/run/clade/own-net/cladevm-{i}.lock"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "never: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `ip -n NS link show tap0`: the TAP exists in the namespace and has a carrier (a VMM
/// holds it open).
fn tap_attached(i: u32) -> bool {
    let o = Command::new("ip")
        .args(["-n", &format!("cladevm-{i}"), "link", "show", "tap0"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).contains("LOWER_UP")
}

/// `clade run --net auto` of the native guest serving the agent, its files `dir/name.*`.
fn run_vm(dir: &Path, name: &str) -> Command {
    let f = |ext: &str| dir.join(format!("{name}.{ext}"));
    let mut c = clade();
    c.args([
        "run",
        "--test-device",
        "--net",
        "auto",
        "--own-net-range",
        RANGE,
    ])
    .arg("--kernel")
    .arg(native_guest())
    .args(["--cmdline", "steps=vsock"])
    .arg("--api-sock")
    .arg(f("api"))
    .arg("--vsock")
    .arg(f("vsock"))
    .arg("--serial-file")
    .arg(f("serial"))
    .stderr(std::fs::File::create(f("log")).unwrap());
    c
}

/// The jail's VM process: the one running as nobody whose command line names `dir`.
fn jailed_vm_pid(dir: &Path) -> i32 {
    let needle = dir.to_string_lossy().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains(&needle)
                && status.contains(&format!("Uid:\t{NOBODY}"))
        })
        .expect("a VM process running as nobody")
}

fn ping(sock: &Path) -> Output {
    clade().arg("ping").arg(sock).output().unwrap()
}

/// The command line of the VM process (the child) that serves `api`.
fn vm_cmdline(api: &Path) -> String {
    let needle = api.to_string_lossy().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .find(|c| c.contains(&needle) && c.contains("--net fd="))
        .unwrap_or_default()
}

#[test]
fn vms_get_networks_of_their_own_that_end_with_them() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: networks of their own need root");
        return;
    }
    assert!(!netns(0).exists() && !netns(1).exists(), "leftovers");
    let d = Dir::new("own-net");

    // The first takes the range's top network, with its TAP attached and the guest's
    // addresses on its command line; the second the next one down.
    let mut a = Proc(run_vm(&d.0, "a").spawn().unwrap());
    wait_until("a's network", || tap_attached(1));
    assert_eq!(holder(1), a.0.id().to_string());
    // The VMM took its TAP as an inherited descriptor. (The TAP is attached once the
    // parent opened it, which can be before its VM process exists.)
    wait_until("a's VM process", || !vm_cmdline(&d.p("a.api")).is_empty());
    let cmdline = vm_cmdline(&d.p("a.api"));
    assert!(
        cmdline.contains("--net fd=") && cmdline.contains("clade.net="),
        "{cmdline}"
    );
    let mut b = Proc(run_vm(&d.0, "b").spawn().unwrap());
    wait_until("b's network", || tap_attached(0));
    wait_until("b's agent", || ping(&d.p("b.vsock")).status.success());

    // None left: a clear refusal, nothing made.
    let o = run_vm(&d.0, "x").stderr(Stdio::piped()).output().unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no free index"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // Its owner SIGKILLed: the VM goes with it, the network stays, recorded as its.
    a.0.kill().unwrap();
    a.0.wait().unwrap();
    wait_until("a's VM gone", || vm_cmdline(&d.p("a.api")).is_empty());
    assert!(netns(1).exists());
    assert!(!holder(1).is_empty());
    // The next one removes it and makes its own there.
    let mut c = Proc(run_vm(&d.0, "c").spawn().unwrap());
    wait_until("c's network", || {
        tap_attached(1) && holder(1) == c.0.id().to_string()
    });
    let log = std::fs::read_to_string(d.p("c.log")).unwrap();
    assert!(log.contains("left behind"), "{log}");
    wait_until("c's agent", || ping(&d.p("c.vsock")).status.success());

    // A snapshot of it restored with a network of its own: the guest answers there.
    let o = clade()
        .arg("snapshot")
        .arg(d.p("c.api"))
        .arg(d.p("snap"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // SAFETY: kill(2) of a process this test started.
    unsafe { libc::kill(b.0.id() as i32, libc::SIGTERM) };
    let status = b.0.wait().unwrap();
    assert_eq!(status.code(), Some(143), "stopped by SIGTERM: {status:?}");
    assert!(!netns(0).exists(), "b's network is removed with it");
    assert!(holder(0).is_empty());
    let mut r = Proc(
        clade()
            .arg("restore")
            .arg(d.p("snap"))
            .args(["--net", "auto", "--own-net-range", RANGE])
            .arg("--api-sock")
            .arg(d.p("r.api"))
            .arg("--vsock")
            .arg(d.p("r.vsock"))
            .arg("--serial-file")
            .arg(d.p("r.serial"))
            .stderr(std::fs::File::create(d.p("r.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_until("the restore's network", || tap_attached(0));
    wait_until("the restored agent", || {
        ping(&d.p("r.vsock")).status.success()
    });

    // Jailed (as nobody, its own root): the same, the TAP handed in as a descriptor.
    // SAFETY: kill(2) of a process this test started.
    unsafe { libc::kill(r.0.id() as i32, libc::SIGTERM) };
    r.0.wait().unwrap();
    assert!(!netns(0).exists());
    let jd = d.p("j");
    std::fs::create_dir_all(&jd).unwrap();
    std::os::unix::fs::chown(&jd, Some(NOBODY), Some(NOBODY)).unwrap();
    let mut j = Proc(
        run_vm(&jd, "j")
            .arg("--files-root")
            .arg(&jd)
            .arg("--jail")
            .arg(d.p("root"))
            .args(["--uid", "65534", "--gid", "65534"])
            .spawn()
            .unwrap(),
    );
    wait_until("the jailed VM's network", || tap_attached(0));
    wait_until("the jailed agent", || {
        ping(&jd.join("j.vsock")).status.success()
    });
    let status = std::fs::read_to_string(format!("/proc/{}/status", jailed_vm_pid(&jd))).unwrap();
    assert!(status.contains(&format!("Uid:\t{NOBODY}")), "{status}");

    for p in [&mut c, &mut j] {
        // SAFETY: kill(2) of a process this test started.
        unsafe { libc::kill(p.0.id() as i32, libc::SIGTERM) };
        p.0.wait().unwrap();
    }
    assert!(!netns(0).exists() && !netns(1).exists());
    assert!(holder(0).is_empty() && holder(1).is_empty());
}

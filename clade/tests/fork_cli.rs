//! `clade fork` on the native test guest: children are separate `clade` processes that
//! answer on their own vsock sockets, outlive a SIGKILLed parent, are stopped through their
//! own API sockets, and a fork failing part-way leaves no child behind.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{Dir, Proc};
use native_guest::native_guest;
use vmm::api::{ApiClient, Request};

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

/// Kills a child VM process (not ours to wait for) if the test fails before it ended.
struct Pid(i32);

impl Drop for Pid {
    fn drop(&mut self) {
        if pid_alive(self.0) {
            // SAFETY: plain kill(2) on a process this test started (through the parent).
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

fn pid_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            // State field after "(comm)": Z (zombie) or X (dead) is not alive.
            let st = s.rsplit(')').next().unwrap_or("").trim_start();
            !st.starts_with('Z') && !st.starts_with('X')
        })
        .unwrap_or(false)
}

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wait_for_text(path: &Path, text: &str) {
    let t = Instant::now();
    while !std::fs::read_to_string(path)
        .unwrap_or_default()
        .contains(text)
    {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no '{text}' in {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn text(o: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ping(sock: &Path) {
    let o = clade().arg("ping").arg(sock).output().unwrap();
    assert!(o.status.success(), "ping {}: {}", sock.display(), text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("clade-native-guest"));
}

fn start_parent(d: &Dir, steps: &str, env: Option<(&str, &str)>) -> Proc {
    start_parent_with(d, steps, env, &[])
}

fn start_parent_with(d: &Dir, steps: &str, env: Option<(&str, &str)>, extra: &[&str]) -> Proc {
    let mut cmd = clade();
    cmd.arg("run")
        .arg("--kernel")
        .arg(native_guest())
        .args(["--test-device", "--cmdline", &format!("steps={steps}")])
        .arg("--vsock")
        .arg(d.p("p.vsock"))
        .arg("--api-sock")
        .arg(d.p("p.api"))
        .arg("--serial-file")
        .arg(d.p("p.serial"))
        .args(extra);
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    let p = Proc(cmd.spawn().unwrap());
    wait_for(&d.p("p.api"));
    wait_for_text(&d.p("p.serial"), "serving agent port");
    p
}

/// `clade fork API -n 3 --no-agent-sync --json` with the children's files in `kids/`: its
/// answer, the children and their processes.
fn fork_three(d: &Dir, api: &Path) -> (serde_json::Value, Vec<serde_json::Value>, Vec<Pid>) {
    let o = clade()
        .arg("fork")
        .arg(api)
        .args(["-n", "3", "--no-agent-sync", "--json"])
        .arg("--prefix")
        .arg(d.p("kids"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let kids = j["children"].as_array().unwrap().clone();
    assert_eq!(kids.len(), 3, "{j}");
    let pids: Vec<Pid> = kids
        .iter()
        .map(|k| Pid(k["pid"].as_i64().unwrap() as i32))
        .collect();
    (j, kids, pids)
}

#[test]
fn fork_children_are_processes_that_outlive_a_killed_parent() {
    let d = Dir::new("three");
    let mut parent = start_parent(&d, "vsock", None);
    let (j, kids, pids) = fork_three(&d, &d.p("p.api"));
    let parent_pid = parent.0.id() as i32;
    let mut cids = Vec::new();
    for (k, pid) in kids.iter().zip(&pids) {
        assert_ne!(pid.0, parent_pid, "a child is its own process");
        assert!(pid_alive(pid.0));
        let vsock = PathBuf::from(k["vsock"].as_str().unwrap());
        assert!(vsock.starts_with(d.p("kids")), "{k}");
        cids.push(k["cid"].as_u64().unwrap());
        ping(&vsock);
    }
    cids.sort();
    cids.dedup();
    assert_eq!(cids.len(), 3, "distinct CIDs: {j}");
    ping(&d.p("p.vsock"));

    // A child is an ordinary VM process: it can be snapshotted.
    let o = clade()
        .arg("snapshot")
        .arg(kids[0]["api_sock"].as_str().unwrap())
        .arg(d.p("child-snap"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(d.p("child-snap/memory.mem").exists());

    // SIGKILL the parent: the children run on, on their own memory.
    parent.0.kill().unwrap();
    parent.0.wait().unwrap();
    for k in &kids {
        ping(Path::new(k["vsock"].as_str().unwrap()));
        let r = ApiClient::connect(Path::new(k["api_sock"].as_str().unwrap()))
            .unwrap()
            .call(&Request::Status)
            .unwrap();
        assert_eq!(r.fields["state"], "running", "{r:?}");
    }
    // Stopped through their own API sockets; they remove their sockets.
    for (k, pid) in kids.iter().zip(&pids) {
        let api = PathBuf::from(k["api_sock"].as_str().unwrap());
        let r = ApiClient::connect(&api)
            .unwrap()
            .call(&Request::Shutdown)
            .unwrap();
        assert!(r.ok, "{r:?}");
        let t = Instant::now();
        while pid_alive(pid.0) {
            assert!(t.elapsed() < Duration::from_secs(20), "child did not end");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!api.exists());
        assert!(!Path::new(k["vsock"].as_str().unwrap()).exists());
    }
}

/// The `clade fork-child` processes waiting for a fork of the VM behind `api`.
fn waiting_children(api: &Path) -> Vec<i32> {
    let needle = format!("--prestarted-for\0{}\0", api.display());
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                .unwrap_or(false)
                && pid_alive(*pid)
        })
        .collect();
    pids.sort();
    pids
}

fn status(api: &Path) -> serde_json::Value {
    let r = ApiClient::connect(api)
        .unwrap()
        .call(&Request::Status)
        .unwrap();
    assert!(r.ok, "{r:?}");
    serde_json::Value::Object(r.fields)
}

/// Waits until the VM behind `api` reports `field` as `want` in its status.
fn wait_status(api: &Path, field: &str, want: serde_json::Value) {
    let t = Instant::now();
    while status(api)[field] != want {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{field} never {want}: {}",
            status(api)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the parent behind `api` says `n` fork children wait.
fn wait_waiting(api: &Path, n: u64) {
    wait_status(api, "fork_children_waiting", n.into());
}

/// Waits until the VM behind `api` says whether it holds a spare shell as `want`.
fn wait_spare_shell(api: &Path, want: bool) {
    wait_status(api, "spare_shell", want.into());
}

#[test]
fn children_started_ahead_take_the_fork_are_replaced_and_end_with_the_parent() {
    let d = Dir::new("spares");
    let mut parent = start_parent_with(&d, "vsock", None, &["--fork-spares", "2"]);
    let api = d.p("p.api");
    wait_waiting(&api, 2);
    let waiting = waiting_children(&api);
    assert_eq!(waiting.len(), 2, "two waiting processes: {waiting:?}");

    // Three children: the two waiting processes become two of them, the third is started.
    let (j, kids, pids) = fork_three(&d, &api);
    let from_waiting = pids.iter().filter(|p| waiting.contains(&p.0)).count();
    assert_eq!(from_waiting, 2, "children {j} vs waiting {waiting:?}");
    for k in &kids {
        ping(Path::new(k["vsock"].as_str().unwrap()));
        // Each logs to its own log (the waiting ones took theirs over the socket).
        let log = PathBuf::from(k["log"].as_str().unwrap());
        assert!(log.exists(), "{k}");
        assert!(
            !std::fs::read_to_string(&log)
                .unwrap()
                .contains("does not fit"),
            "a waiting child's shell fits its VM: {k}"
        );
    }
    // A child is an ordinary VM: its memory is the parent's at the fork.
    let r = ApiClient::connect(Path::new(kids[0]["api_sock"].as_str().unwrap()))
        .unwrap()
        .call(&Request::Status)
        .unwrap();
    assert_eq!(r.fields["state"], "running", "{r:?}");

    // The parent starts two new ones while idle.
    wait_waiting(&api, 2);
    // (A child that was started ahead keeps that command line.)
    let again: Vec<i32> = waiting_children(&api)
        .into_iter()
        .filter(|p| !pids.iter().any(|c| c.0 == *p))
        .collect();
    assert_eq!(again.len(), 2, "{again:?}");
    assert!(again.iter().all(|p| !waiting.contains(p)), "new processes");

    // Each waiting process has its files made ahead (log, serial console, API and vsock
    // sockets); the ones the fork used were moved to the children's names.
    let t = Instant::now();
    while made_ahead(&d.0).len() < 8 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "files made ahead: {:?}",
            made_ahead(&d.0)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(made_ahead(&d.0).len(), 8, "{:?}", made_ahead(&d.0));

    // The parent killed outright: the waiting processes see their socket close and end,
    // removing what was made ahead for them; the children run on.
    parent.0.kill().unwrap();
    parent.0.wait().unwrap();
    let t = Instant::now();
    while again.iter().any(|p| pid_alive(*p)) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "waiting processes outlived their parent"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(made_ahead(&d.0), Vec::<String>::new());
    for k in &kids {
        ping(Path::new(k["vsock"].as_str().unwrap()));
    }
}

/// The files made ahead for waiting fork children in `dir` (hidden, `-ahead-` in the name).
fn made_ahead(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n.contains("-ahead-"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_failed_fork_leaves_no_child_and_a_fork_of_a_child_works() {
    let d = Dir::new("fail");
    let mut parent = start_parent(&d, "vsock", Some(("CLADE_FORK_FAIL_AFTER", "2")));
    let o = clade()
        .arg("fork")
        .arg(d.p("p.api"))
        .args(["-n", "3", "--no-agent-sync"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("injected failure"), "{err}");
    let mut left: Vec<_> = std::fs::read_dir(&d.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".api") || n.ends_with(".vsock"))
        .collect();
    left.sort();
    assert_eq!(left, ["p.api", "p.vsock"], "only the parent's sockets");
    let stale = Command::new("pgrep")
        .args(["-f", &format!("fork-child --api-sock {}", d.0.display())])
        .output()
        .unwrap();
    assert!(stale.stdout.is_empty(), "children left running");
    ping(&d.p("p.vsock"));

    // A fork that works (fewer children than the injected failure), then a fork of the
    // child: a child is an ordinary VM process.
    let o = clade()
        .arg("fork")
        .arg(d.p("p.api"))
        .args(["-n", "1", "--no-agent-sync"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let line = String::from_utf8_lossy(&o.stdout).into_owned();
    let mut it = line.split_whitespace();
    let (api, vsock) = (
        PathBuf::from(it.next().unwrap()),
        PathBuf::from(it.next().unwrap()),
    );
    let status = ApiClient::connect(&api)
        .unwrap()
        .call(&Request::Status)
        .unwrap();
    assert_eq!(status.fields["state"], "running");
    // The stale-children check above looks for this command line: a live child has it.
    let live = Command::new("pgrep")
        .args(["-f", &format!("fork-child --api-sock {}", api.display())])
        .output()
        .unwrap();
    assert!(
        !live.stdout.is_empty(),
        "no process with the child's command line"
    );
    let o = clade()
        .arg("fork")
        .arg(&api)
        .args(["-n", "1", "--no-agent-sync", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let grand = &j["children"][0];
    let _g = Pid(grand["pid"].as_i64().unwrap() as i32);
    ping(Path::new(grand["vsock"].as_str().unwrap()));
    ping(&vsock);
    for a in [api, PathBuf::from(grand["api_sock"].as_str().unwrap())] {
        let r = ApiClient::connect(&a).unwrap().call(&Request::Shutdown);
        assert!(r.unwrap().ok);
    }
    parent.0.kill().unwrap();
    parent.0.wait().unwrap();
}

/// `clade run` of the native guest with its sockets `p.*` in `d` (and `disk`), once its
/// agent port is served.
fn start_native(d: &Dir, disk: Option<&Path>) -> Proc {
    let mut cmd = clade();
    cmd.arg("run")
        .arg("--kernel")
        .arg(native_guest())
        .args(["--test-device", "--cmdline", "steps=vsock"])
        .arg("--vsock")
        .arg(d.p("p.vsock"))
        .arg("--api-sock")
        .arg(d.p("p.api"))
        .arg("--serial-file")
        .arg(d.p("p.serial"));
    if let Some(disk) = disk {
        cmd.arg("--disk").arg(disk);
    }
    let vm = Proc(cmd.spawn().unwrap());
    wait_for(&d.p("p.api"));
    wait_for_text(&d.p("p.serial"), "serving agent port");
    vm
}

/// `clade disk info --json`: one object per layer, top first.
fn disk_info(layer: &Path) -> Vec<serde_json::Value> {
    let o = clade()
        .args(["disk", "info", "--json"])
        .arg(layer)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect()
}

#[test]
fn a_vm_with_a_disk_forks_its_disk_each_child_on_its_own_overlay() {
    let d = Dir::new("disk");
    let top = d.p("vm.cdsk");
    let o = clade()
        .args(["disk", "create", "--size", "16M"])
        .arg(&top)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let mut parent = start_native(&d, Some(&top));
    // Both forks move the parent (its disk's worker follows it onto the new mapping).
    wait_spare_shell(&d.p("p.api"), true);
    let o = clade()
        .arg("fork")
        .arg(d.p("p.api"))
        .args(["-n", "2", "--no-agent-sync", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["moved"], true, "{j}");
    let kids = j["children"].as_array().unwrap().clone();
    let pids: Vec<Pid> = kids
        .iter()
        .map(|k| Pid(k["pid"].as_i64().unwrap() as i32))
        .collect();
    let mut overlays = Vec::new();
    for k in &kids {
        overlays.push(PathBuf::from(k["disk"].as_str().expect("a child disk")));
        ping(Path::new(k["vsock"].as_str().unwrap()));
    }
    assert_ne!(overlays[0], overlays[1]);
    ping(&d.p("p.vsock"));
    // A fork of the parent again freezes the overlay it continued on.
    wait_spare_shell(&d.p("p.api"), true);
    let o = clade()
        .arg("fork")
        .arg(d.p("p.api"))
        .args(["-n", "1", "--no-agent-sync", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let second = j["children"][0].clone();
    let p2 = Pid(second["pid"].as_i64().unwrap() as i32);
    // Stop everyone (layers in use cannot be inspected), then look at the chains.
    for k in kids.iter().chain(std::iter::once(&second)) {
        let api = PathBuf::from(k["api_sock"].as_str().unwrap());
        let r = ApiClient::connect(&api).unwrap().call(&Request::Shutdown);
        assert!(r.unwrap().ok);
    }
    parent.0.kill().unwrap();
    parent.0.wait().unwrap();
    for p in pids.iter().chain(std::iter::once(&p2)) {
        let t = Instant::now();
        while pid_alive(p.0) {
            assert!(t.elapsed() < Duration::from_secs(20), "child did not end");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // The parent's first layer is frozen; each first child has its own overlay on it.
    let info = disk_info(&top);
    assert_eq!(info[0]["frozen"], true, "{info:?}");
    for o in &overlays {
        let layers = disk_info(o);
        assert_eq!(layers.len(), 2, "{layers:?}");
        assert_eq!(layers[0]["frozen"], false, "{layers:?}");
        assert_eq!(
            layers[1]["id"], info[0]["id"],
            "on the frozen layer: {layers:?}"
        );
    }
    // The parent went on on `vm-p<k>.cdsk`, frozen by the second fork, and then on another.
    let mut parent_tops: Vec<_> = std::fs::read_dir(&d.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with("vm-p") && n.ends_with(".cdsk")
        })
        .collect();
    parent_tops.sort_by_key(|p| disk_info(p).len());
    assert_eq!(parent_tops.len(), 2, "{parent_tops:?}");
    let last = disk_info(&parent_tops[1]);
    assert_eq!(last.len(), 3, "{last:?}");
    assert_eq!(last[0]["frozen"], false, "{last:?}");
    assert_eq!(last[1]["frozen"], true, "{last:?}");
    assert_eq!(last[2]["id"], info[0]["id"], "{last:?}");
    let layers = disk_info(Path::new(second["disk"].as_str().unwrap()));
    assert_eq!(layers.len(), 3, "{layers:?}");
    assert_eq!(layers[1]["id"], last[1]["id"], "{layers:?}");
}

#[test]
fn bad_fork_and_snapshot_requests_get_errors_and_touch_nothing() {
    let d = Dir::new("bad-requests");
    let root = d.p("root");
    std::fs::create_dir_all(&root).unwrap();
    let root_arg = root.to_string_lossy().into_owned();
    let _parent = start_parent_with(&d, "vsock", None, &["--files-root", &root_arg]);
    let call = |r: &Request| ApiClient::connect(&d.p("p.api")).unwrap().call(r).unwrap();
    // A count no host could serve: an error answer, not a dead VM.
    let r = call(&Request::Fork {
        count: usize::MAX,
        prefix: None,
        agent_sync: false,
        nets: Vec::new(),
    });
    assert!(
        !r.ok && r.error.as_deref().unwrap_or("").contains("children"),
        "{r:?}"
    );
    // Paths must be absolute.
    let r = call(&Request::Snapshot {
        dir: PathBuf::from("relative/snap"),
        kind: "full".into(),
    });
    assert!(
        !r.ok && r.error.as_deref().unwrap_or("").contains("absolute"),
        "{r:?}"
    );
    assert!(!Path::new("relative").exists());
    // Outside the files root: refused; inside: works.
    let r = call(&Request::Snapshot {
        dir: d.p("outside"),
        kind: "full".into(),
    });
    assert!(
        !r.ok && r.error.as_deref().unwrap_or("").contains("outside"),
        "{r:?}"
    );
    assert!(!d.p("outside").exists());
    let r = call(&Request::Snapshot {
        dir: root.join("s1"),
        kind: "full".into(),
    });
    assert!(r.ok, "{r:?}");
    // A symlink planted where the first child's log will go: the fork fails and the file
    // it points at is untouched.
    let victim = d.p("victim");
    std::fs::write(&victim, b"keep me").unwrap();
    std::os::unix::fs::symlink(&victim, d.p("p-f1.log")).unwrap();
    let o = clade()
        .arg("fork")
        .arg(d.p("p.api"))
        .args(["-n", "1", "--no-agent-sync"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("p-f1.log"),
        "{}",
        text(&o)
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    let r = call(&Request::Status);
    assert_eq!(r.fields["state"], "running", "{r:?}");
    ping(&d.p("p.vsock"));
    // A child keeps the parent's files root.
    let o = clade()
        .arg("fork")
        .arg(d.p("p.api"))
        .args([
            "-n",
            "1",
            "--no-agent-sync",
            "--json",
            "--prefix",
            &root_arg,
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let child = &j["children"][0];
    let _c = Pid(child["pid"].as_i64().unwrap() as i32);
    let child_api = PathBuf::from(child["api_sock"].as_str().unwrap());
    let mut c = ApiClient::connect(&child_api).unwrap();
    let r = c
        .call(&Request::Snapshot {
            dir: d.p("outside-child"),
            kind: "full".into(),
        })
        .unwrap();
    assert!(
        !r.ok && r.error.as_deref().unwrap_or("").contains("outside"),
        "{r:?}"
    );
    let r = c.call(&Request::Shutdown).unwrap();
    assert!(r.ok, "{r:?}");
}

/// A network namespace made for one test (`ip netns`: test code only), removed on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("cladet-{}-{tag}", std::process::id());
        let o = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .unwrap();
        assert!(o.status.success(), "ip netns add {name}: {}", text(&o));
        Netns(name)
    }

    fn path(&self) -> String {
        format!("/run/netns/{}", self.0)
    }

    /// Whether `tap0` exists in this namespace (a TAP the VMM made by name exists while
    /// its descriptor is open: it is the VM's).
    fn has_tap0(&self) -> bool {
        Command::new("ip")
            .args(["-n", &self.0, "link", "show", "tap0"])
            .output()
            .unwrap()
            .status
            .success()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn a_vm_with_a_nic_forks_only_with_a_tap_per_child_each_in_its_own_namespace() {
    if !is_root() {
        eprintln!("skipped: needs root for network namespaces and TAPs");
        return;
    }
    let (p_ns, a_ns, b_ns) = (Netns::new("p"), Netns::new("a"), Netns::new("b"));
    let d = Dir::new("netns");
    let net = |ns: &Netns| format!("tap=tap0,netns={}", ns.path());
    let mut parent = start_parent_with(&d, "vsock", None, &["--net", &net(&p_ns)]);
    assert!(p_ns.has_tap0(), "the parent's TAP is in its namespace");
    let fork = |extra: &[&str]| {
        clade()
            .arg("fork")
            .arg(d.p("p.api"))
            .args(["-n", "2", "--no-agent-sync", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    // Refused before the VM pauses: no TAPs, too few, a TAP by descriptor, a namespace
    // path that is no namespace.
    for (extra, why) in [
        (vec![], "needs its own TAP (0 given)"),
        (vec!["--net".to_string(), net(&a_ns)], "(1 given)"),
        (
            vec!["--net".into(), "fd=3".into(), "--net".into(), "fd=4".into()],
            "needs a TAP by name",
        ),
        (
            vec![
                "--net".into(),
                "tap=tap0,netns=/proc/self/status".into(),
                "--net".into(),
                net(&b_ns),
            ],
            "not a namespace file",
        ),
    ] {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let o = fork(&extra);
        assert!(!o.status.success(), "{extra:?}: {}", text(&o));
        assert!(text(&o).contains(why), "{extra:?}: {}", text(&o));
    }
    assert!(!a_ns.has_tap0() && !b_ns.has_tap0());
    ping(&d.p("p.vsock"));

    let o = fork(&["--net", &net(&a_ns), "--net", &net(&b_ns)]);
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let kids: Vec<serde_json::Value> = j["children"].as_array().unwrap().clone();
    let pids: Vec<Pid> = kids
        .iter()
        .map(|k| Pid(k["pid"].as_i64().unwrap() as i32))
        .collect();
    for k in &kids {
        ping(Path::new(k["vsock"].as_str().unwrap()));
    }
    assert!(a_ns.has_tap0() && b_ns.has_tap0(), "each child holds a TAP");
    assert!(p_ns.has_tap0(), "the parent keeps its own");
    // A child's TAP goes with its process.
    // SAFETY: plain kill(2) on a process this test started (through the parent).
    unsafe { libc::kill(pids[0].0, libc::SIGKILL) };
    let t = Instant::now();
    while a_ns.has_tap0() {
        assert!(t.elapsed() < Duration::from_secs(10), "child a's TAP stays");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(b_ns.has_tap0());
    ping(&d.p("p.vsock"));
    parent.0.kill().unwrap();
    parent.0.wait().unwrap();
}

/// A VM process keeps a spare shell and moves onto it at a fork and at a full snapshot
/// of the running VM (each answer says `moved`), builds another one afterwards, and stays
/// the same VM to its users: an agent connection opened before answers after each move.
#[test]
fn a_vm_process_moves_onto_its_spare_shell_at_a_fork_and_a_snapshot() {
    let d = Dir::new("move");
    let mut parent = start_parent(&d, "vsock", None);
    let api = d.p("p.api");
    wait_spare_shell(&api, true);
    let conn = vmm::agent::Client::connect_timeout(
        d.p("p.vsock"),
        vmm::agent::Transport::Vsock {
            port: vmm::agent::AGENT_VSOCK_PORT,
        },
        Duration::from_secs(10),
    )
    .unwrap();
    conn.ping().unwrap();
    let (j, kids, pids) = fork_three(&d, &api);
    assert_eq!(j["moved"], true, "{j}");
    conn.ping().unwrap();
    for k in &kids {
        ping(Path::new(k["vsock"].as_str().unwrap()));
    }
    wait_spare_shell(&api, true);
    let r = ApiClient::connect(&api)
        .unwrap()
        .call(&Request::Snapshot {
            dir: d.p("snap"),
            kind: "full".into(),
        })
        .unwrap();
    assert!(r.ok, "{r:?}");
    assert_eq!(r.fields["moved"], true, "{r:?}");
    conn.ping().unwrap();
    ping(&d.p("p.vsock"));
    drop(pids);
    parent.0.kill().unwrap();
}

#[test]
fn freeze_disk_freezes_the_top_layer_and_the_vm_goes_on_on_a_new_one() {
    let d = Dir::new("freeze");
    let top = d.p("vm.cdsk");
    let o = clade()
        .args(["disk", "create", "--size", "16M"])
        .arg(&top)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let mut vm = start_native(&d, Some(&top));
    let call = |r: &Request| ApiClient::connect(&d.p("p.api")).unwrap().call(r).unwrap();
    let mut frozen = Vec::new();
    let mut tops = Vec::new();
    for _ in 0..3 {
        let r = call(&Request::FreezeDisk);
        assert!(r.ok, "{r:?}");
        frozen.push(PathBuf::from(r.fields["layer"].as_str().unwrap()));
        tops.push(PathBuf::from(r.fields["top"].as_str().unwrap()));
        ping(&d.p("p.vsock"));
    }
    assert_eq!(frozen[0], top);
    assert_eq!(frozen[1], tops[0]);
    assert_eq!(frozen[2], tops[1]);
    // Names keep one length however many times the disk is frozen: vm-s<k>.cdsk.
    for t in &tops {
        let n = t.file_name().unwrap().to_string_lossy().into_owned();
        assert!(n.starts_with("vm-s") && n.matches("-s").count() == 1, "{n}");
    }
    // A paused VM stays paused.
    assert!(call(&Request::Pause).ok);
    let r = call(&Request::FreezeDisk);
    assert!(r.ok, "{r:?}");
    assert_eq!(call(&Request::Status).fields["state"], "paused");
    assert!(call(&Request::Unpause).ok);
    ping(&d.p("p.vsock"));
    let last = PathBuf::from(r.fields["top"].as_str().unwrap());
    assert!(call(&Request::Shutdown).ok);
    vm.0.wait().unwrap();
    // The chain: the last top on each frozen layer in turn.
    let layers = disk_info(&last);
    assert_eq!(layers.len(), 5, "{layers:?}");
    assert_eq!(layers[0]["frozen"], false, "{layers:?}");
    assert!(
        layers[1..].iter().all(|l| l["frozen"] == true),
        "{layers:?}"
    );
    assert_eq!(layers[4]["id"], disk_info(&top)[0]["id"]);
}

#[test]
fn freeze_disk_without_a_disk_is_an_error() {
    let d = Dir::new("freeze-nodisk");
    let mut vm = start_native(&d, None);
    let r = ApiClient::connect(&d.p("p.api"))
        .unwrap()
        .call(&Request::FreezeDisk)
        .unwrap();
    assert!(!r.ok);
    assert!(r.error.unwrap().contains("no writable disk"));
    ping(&d.p("p.vsock"));
    vm.0.kill().unwrap();
    vm.0.wait().unwrap();
}

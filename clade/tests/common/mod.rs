//! Helpers shared by the CLI integration tests.

use std::path::PathBuf;
use std::process::Child;

pub mod serve;

/// A scratch directory, removed when dropped.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("clade-clitest-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    pub fn p(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        kill_processes_naming(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// SIGKILLs every process whose command line names a path under `dir`: the VM processes
/// a test started (directly, through `clade serve`, or as fork children) are their own
/// process groups and outlive a test that failed half-way; left running, they would
/// spin on this host's CPUs for the rest of the run.
fn kill_processes_naming(dir: &std::path::Path) {
    // With the separator: another test's directory may start with this one's name.
    let needle = format!("{}/", dir.to_string_lossy());
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in procs.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if pid as u32 == me {
            continue;
        }
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            // SAFETY: kill(2) of a process this test started (it names the test's own
            // scratch directory).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Kills the process if the test fails before it ended.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value of cgroup file `file` of controller `ctl` (a v1 controller's name; on
/// cgroup v2 the one hierarchy) for the cgroup of process `pid`, and that cgroup's path.
#[allow(dead_code)]
pub fn cgroup_file(pid: i32, ctl: &str, file: &str) -> (String, String) {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let v1 = !std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let path = cgroups
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, names, path) = (f.next()?, f.next()?, f.next()?);
            let hit = if v1 {
                names.split(',').any(|n| n == ctl)
            } else {
                names.is_empty()
            };
            hit.then(|| path.to_string())
        })
        .unwrap_or_else(|| panic!("pid {pid}: no {ctl} cgroup: {cgroups}"));
    let base = if v1 {
        format!("/sys/fs/cgroup/{ctl}")
    } else {
        "/sys/fs/cgroup".into()
    };
    let value = std::fs::read_to_string(format!("{base}{path}/{file}"))
        .unwrap_or_else(|e| panic!("pid {pid}: {base}{path}/{file}: {e}"))
        .trim()
        .to_string();
    (path, value)
}

/// A full snapshot at `snap` of the native test guest `kernel` serving agent connections
/// (one after another), made by an unjailed `clade run` whose sockets go in `work`.
#[allow(dead_code)]
pub fn guest_snapshot(kernel: &std::path::Path, work: &std::path::Path, snap: &std::path::Path) {
    use std::time::{Duration, Instant};
    use vmm::api::{ApiClient, Request};
    let (api, serial) = (work.join("template.api"), work.join("template.serial"));
    let mut vm = Proc(
        std::process::Command::new(env!("CARGO_BIN_EXE_clade"))
            .arg("run")
            .arg("--kernel")
            .arg(kernel)
            .args(["--test-device", "--cmdline", "steps=vsock"])
            .arg("--vsock")
            .arg(work.join("template.vsock"))
            .arg("--api-sock")
            .arg(&api)
            .arg("--serial-file")
            .arg(&serial)
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while !std::fs::read_to_string(&serial)
        .unwrap_or_default()
        .contains("serving agent port")
    {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the template VM never served its agent port"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut c = ApiClient::connect(&api).unwrap();
    let r = c
        .call(&Request::Snapshot {
            dir: snap.to_path_buf(),
            kind: "full".into(),
        })
        .unwrap();
    assert!(r.ok, "{r:?}");
    assert!(c.call(&Request::Shutdown).unwrap().ok);
    let status = vm.0.wait().unwrap();
    assert!(status.success(), "the template VM ended with {status}");
}

/// Runs the shell command line `cmd` with its stdio on a pseudo-terminal (util-linux
/// `script`) and returns what the terminal showed; panics if the command fails.
#[allow(dead_code)]
pub fn on_a_terminal(cmd: &str) -> String {
    let o = std::process::Command::new("script")
        .args(["-qefc", cmd, "/dev/null"])
        .output()
        .expect("run script(1)");
    let shown = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{cmd}: {shown}");
    shown
}

/// Whether process `pid` holds a KVM device or VM descriptor.
#[allow(dead_code)]
pub fn holds_kvm(pid: i32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .any(|l| {
            let l = l.to_string_lossy();
            l == "/dev/kvm" || l.starts_with("anon_inode:kvm")
        })
}

/// The processes a jailed VM process `vm` sees in its jail's `/proc`, as its own user
/// `uid`:`gid` would list them: a process of that user (`ls`) lists the jail's `/proc`
/// mount through a descriptor this (root) process opened on it. None when the jail has a
/// PID namespace of its own (its `/proc` numbers are not the host's).
#[allow(dead_code)]
pub fn pids_seen_in_jail(vm: i32, uid: u32, gid: u32) -> Option<Vec<i32>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let status = std::fs::read_to_string(format!("/proc/{vm}/status")).ok()?;
    let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    if nspid.split_whitespace().count() != 1 {
        return None;
    }
    let dir = std::fs::File::open(format!("/proc/{vm}/root/proc")).expect("the jail's /proc");
    let fd = dir.as_raw_fd();
    let mut cmd = std::process::Command::new("ls");
    cmd.arg(format!("/proc/self/fd/{fd}/")).uid(uid).gid(gid);
    // SAFETY: runs between fork and exec; one fcntl on a descriptor the child holds.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    let out = cmd.output().expect("running ls as the VM's user");
    assert!(
        out.status.success(),
        "listing the jail's /proc as {uid}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect(),
    )
}

/// The real uid of process `pid`.
#[allow(dead_code)]
pub fn uid_of_pid(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Checks what a jailed VM process `vm` of user `uid`:`gid` sees of the host's processes
/// in a jail with no PID namespace of its own: only its own user's (and of those, the
/// ones it may trace: here the lister), never the process that started it.
#[allow(dead_code)]
pub fn assert_sees_only_its_own_processes(vm: i32, uid: u32, gid: u32) {
    let Some(seen) = pids_seen_in_jail(vm, uid, gid) else {
        return;
    };
    // The lister sees itself (a VM process, which is not dumpable, only its own entry);
    // without `hidepid` it would see every process of the host.
    assert!(!seen.is_empty(), "the lister sees not even itself");
    assert!(!seen.contains(&1), "the host's init is visible: {seen:?}");
    let me = std::process::id() as i32;
    assert!(!seen.contains(&me), "the test process is visible: {seen:?}");
    for p in seen {
        // (A process of another user that ended since is not there to read.)
        if let Some(u) = uid_of_pid(p) {
            assert_eq!(u, uid, "process {p} of user {u} is visible to {vm}");
        }
    }
}

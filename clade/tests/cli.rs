//! The `clade` binary: exit statuses, one-line errors, signals.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use native_guest::native_guest;

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

fn run_guest(steps: &str, extra: &[&str]) -> Output {
    clade()
        .arg("run")
        .arg("--kernel")
        .arg(native_guest())
        .args(["--test-device", "--cmdline", &format!("steps={steps}")])
        .args(extra)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// The error is one line on stderr and the exit status is non-zero.
fn assert_one_line_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line expected: {err}"
    );
    assert!(err.contains(needle), "expected '{needle}' in: {err}");
}

#[test]
fn help_documents_run_options() {
    let o = clade().args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&o.stdout);
    for opt in [
        "--kernel",
        "--initrd",
        "--cmdline",
        "--vcpus",
        "--mem",
        "--serial-file",
    ] {
        assert!(help.contains(opt), "{opt} missing from:\n{help}");
    }
}

#[test]
fn guest_exit_statuses_map_to_process_exit_codes() {
    let o = run_guest("hello,poweroff", &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("step hello ok"));
    for reset in ["reset:kbd", "reset:acpi"] {
        let o = run_guest(reset, &[]);
        assert_eq!(o.status.code(), Some(2), "{reset}: {}", stderr(&o));
        assert!(stderr(&o).contains("reset"), "{}", stderr(&o));
    }
    let o = run_guest("bogus", &[]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn serial_output_to_a_file() {
    let path = std::env::temp_dir().join(format!("clade-serial-{}.log", std::process::id()));
    let o = run_guest("hello,poweroff", &["--serial-file", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0));
    let log = std::fs::read_to_string(&path).unwrap();
    assert!(log.contains("step hello ok"), "{log}");
    assert!(o.stdout.is_empty());
    std::fs::remove_file(path).unwrap();
}

#[test]
fn bad_input_gives_one_line_errors() {
    let o = clade()
        .args(["run", "--kernel", "/nonexistent/vmlinuz"])
        .output()
        .unwrap();
    assert_one_line_error(&o, "/nonexistent/vmlinuz");
    assert_eq!(
        stderr(&o).matches("No such file").count(),
        1,
        "cause repeated: {}",
        stderr(&o)
    );
    let o = run_guest("hello", &["--mem", "0"]);
    assert_one_line_error(&o, "memory size must be greater than 0");
    let o = run_guest("hello", &["--mem", "100000G"]);
    assert_one_line_error(&o, "memory");
    let o = run_guest("hello", &["--vcpus", "5000"]);
    assert_one_line_error(&o, "vCPUs");
    let o = run_guest("hello", &["--kvm-device", "/nonexistent/kvm"]);
    assert_one_line_error(&o, "no KVM");
}

#[test]
fn kvm_permission_denied_is_explained() {
    // Root bypasses file permissions, so drop to an unprivileged user with a private copy of
    // the KVM device node that only root may open.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to create the device node and switch user");
        return;
    }
    let dir = std::env::temp_dir().join(format!("clade-perm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let node = dir.join("kvm");
    let _ = std::fs::remove_file(&node);
    assert!(Command::new("mknod")
        .args(["-m", "0600"])
        .arg(&node)
        .args(["c", "10", "232"])
        .status()
        .unwrap()
        .success());
    // The unprivileged user must be able to reach the binary and guest.
    let o = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_clade"))
        .args(["run", "--kernel", "/proc/self/exe", "--kvm-device"])
        .arg(&node)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_one_line_error(&o, "permission denied");
}

#[test]
fn sigterm_stops_the_vm_promptly() {
    let mut child = clade()
        .arg("run")
        .arg("--kernel")
        .arg(native_guest())
        .args(["--test-device", "--cmdline", "steps=loop:50"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill with a valid pid and signal number.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let t = Instant::now();
    let status = child.wait().unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
}

/// The cluster registry's URL holds the database's password: `clade node` and `clade
/// serve` take it from a file (or CLADE_CLUSTER), so it need not be on a command line
/// every local user can read. The file's URL is the one used (here a port where nothing
/// listens), and a registry given twice is refused.
#[test]
fn the_cluster_registry_is_read_from_a_file() {
    let dir = std::env::temp_dir().join(format!("clade-cli-registry-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("registry");
    std::fs::write(&file, "postgres://clade:pw-in-a-file@127.0.0.1:1/clade\n").unwrap();
    let o = clade()
        .args(["node", "ls", "--cluster-file"])
        .arg(&file)
        .env_remove("CLADE_CLUSTER")
        .output()
        .unwrap();
    // The URL was read (an unauthenticated sslmode is warned of first), its password
    // never shown.
    let err = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(last.contains("connecting to PostgreSQL"), "{err}");
    assert!(!err.contains("pw-in-a-file"), "{err}");
    let o = clade()
        .args(["node", "ls", "--cluster-file"])
        .arg(&file)
        .env("CLADE_CLUSTER", "postgres://elsewhere/clade")
        .output()
        .unwrap();
    assert_one_line_error(&o, "the registry is given twice");
    // `clade serve` accepts it too (and refuses a cluster without its secret).
    let o = clade()
        .args(["serve", "--state-dir"])
        .arg(dir.join("state"))
        .args(["--standby", "0", "--no-jail", "--no-limits", "--net", "off"])
        .arg("--cluster-file")
        .arg(&file)
        .env("CLADE_API_KEY", "k")
        .env_remove("CLADE_CLUSTER")
        .env_remove("CLADE_CLUSTER_SECRET")
        .output()
        .unwrap();
    assert!(
        stderr(&o).contains("--cluster needs --cluster-secret"),
        "{}",
        stderr(&o)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

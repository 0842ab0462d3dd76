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

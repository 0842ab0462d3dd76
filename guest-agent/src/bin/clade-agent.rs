//! `clade-agent`: the nested guest's `/init` (PID 1).
//!
//! For now it only brings up the minimal filesystem set, reports readiness on the console
//! (ttyS0) with a fixed marker line, and powers the VM off. Later issues turn it into a
//! long-running agent; keep `main` a sequence of small steps.
//!
//! Marker format (parsed by tests/nested/run.sh):
//! `CLADE-GUEST-READY kernel=<uname release> uptime=<seconds from /proc/uptime>`

use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// Readiness marker written to the console.
const READY_MARKER: &str = "CLADE-GUEST-READY";

/// How long to wait for the console to transmit queued output before powering off.
const CONSOLE_DRAIN_TIMEOUT: Duration = Duration::from_secs(3);

/// One filesystem to mount at boot.
struct MountSpec {
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: libc::c_ulong,
    data: &'static str,
}

const MOUNTS: &[MountSpec] = &[
    MountSpec {
        source: "proc",
        target: "/proc",
        fstype: "proc",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: "",
    },
    MountSpec {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: "",
    },
    MountSpec {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: libc::MS_NOSUID,
        data: "mode=0755",
    },
    MountSpec {
        source: "tmpfs",
        target: "/tmp",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
    },
];

#[derive(Debug, thiserror::Error)]
enum InitError {
    #[error("create mount point {path}: {source}")]
    MountPoint {
        path: &'static str,
        source: io::Error,
    },
    #[error("mount {fstype} on {target}: {source}")]
    Mount {
        fstype: &'static str,
        target: &'static str,
        source: io::Error,
    },
    #[error("string contains NUL byte: {0:?}")]
    Nul(&'static str),
    #[error("uname: {0}")]
    Uname(io::Error),
    #[error("read /proc/uptime: {0}")]
    Uptime(io::Error),
    #[error("write to console: {0}")]
    Console(io::Error),
    #[error("console did not drain: {0} bytes still queued after {1:?} (serial interrupts not delivered?)")]
    ConsoleStalled(libc::c_int, Duration),
}

fn main() {
    if let Err(e) = mount_all() {
        log_error(&e);
    }
    if let Err(e) = report_ready() {
        log_error(&e);
    }
    power_off();
}

/// Print an error line on the console (stdout and stderr both go to ttyS0 for PID 1); if
/// the console itself fails, through the kernel log instead.
fn log_error(e: &InitError) {
    let mut out = io::stdout().lock();
    let written = writeln!(out, "clade-agent: error: {e}").and_then(|()| out.flush());
    if written.is_err() {
        log_error_kmsg(e);
    }
}

/// Print an error line through the kernel log, which the kernel writes to the console by
/// polling: for when the tty's own (interrupt-driven) output path is what failed. Logged
/// at KERN_ERR so that it shows even with `quiet`.
fn log_error_kmsg(e: &InitError) {
    if let Ok(mut kmsg) = OpenOptions::new().write(true).open("/dev/kmsg") {
        // One write(2) per record: /dev/kmsg turns every write into a separate line.
        let _ = kmsg.write_all(format!("<3>clade-agent: error: {e}\n").as_bytes());
    }
}

/// Mount every entry of [`MOUNTS`], creating mount points as needed. Keeps going after a
/// failure so that as much as possible is available; returns the first error.
fn mount_all() -> Result<(), InitError> {
    let mut first_err = None;
    for spec in MOUNTS {
        if let Err(e) = mount_one(spec) {
            log_error(&e);
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

fn mount_one(spec: &MountSpec) -> Result<(), InitError> {
    if !Path::new(spec.target).is_dir() {
        fs::create_dir_all(spec.target).map_err(|source| InitError::MountPoint {
            path: spec.target,
            source,
        })?;
    }
    let source = CString::new(spec.source).map_err(|_| InitError::Nul(spec.source))?;
    let target = CString::new(spec.target).map_err(|_| InitError::Nul(spec.target))?;
    let fstype = CString::new(spec.fstype).map_err(|_| InitError::Nul(spec.fstype))?;
    let data = CString::new(spec.data).map_err(|_| InitError::Nul(spec.data))?;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            spec.flags,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        // The kernel may already have mounted devtmpfs (CONFIG_DEVTMPFS_MOUNT); that is fine.
        if err.raw_os_error() == Some(libc::EBUSY) {
            return Ok(());
        }
        return Err(InitError::Mount {
            fstype: spec.fstype,
            target: spec.target,
            source: err,
        });
    }
    Ok(())
}

/// Write the readiness marker line to the console and flush it to the device.
fn report_ready() -> Result<(), InitError> {
    let release = kernel_release().unwrap_or_else(|e| {
        log_error(&e);
        "unknown".to_string()
    });
    let uptime = uptime_secs().unwrap_or_else(|e| {
        log_error(&e);
        "unknown".to_string()
    });
    let mut out = io::stdout().lock();
    writeln!(out, "{READY_MARKER} kernel={release} uptime={uptime}")
        .and_then(|()| out.flush())
        .map_err(InitError::Console)
}

/// `uname -r`.
fn kernel_release() -> Result<String, InitError> {
    // SAFETY: utsname is plain old data; all-zero is a valid value.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uts is a valid, writable utsname.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return Err(InitError::Uname(io::Error::last_os_error()));
    }
    let bytes: Vec<u8> = uts
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// First field of /proc/uptime (seconds since boot, as the kernel prints it).
fn uptime_secs() -> Result<String, InitError> {
    let text = fs::read_to_string("/proc/uptime").map_err(InitError::Uptime)?;
    Ok(text
        .split_whitespace()
        .next()
        .unwrap_or("unknown")
        .to_string())
}

/// Wait (bounded) until the tty behind stdout has transmitted everything queued, so that
/// powering off does not cut the last lines. Not a tty (e.g. under a test harness): no wait.
fn drain_console(timeout: Duration) -> Result<(), InitError> {
    let start = Instant::now();
    loop {
        let mut queued: libc::c_int = 0;
        // SAFETY: TIOCOUTQ writes one c_int through the valid pointer.
        if unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCOUTQ, &mut queued) } != 0 {
            return Ok(());
        }
        if queued <= 0 {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(InitError::ConsoleStalled(queued, timeout));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Flush filesystems and power the VM off. PID 1 must never return, so if reboot(2)
/// fails this reports it and parks forever.
fn power_off() -> ! {
    let _ = io::stdout().flush();
    if let Err(e) = drain_console(CONSOLE_DRAIN_TIMEOUT) {
        log_error_kmsg(&e);
    }
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    // SAFETY: reboot with a valid command; on success it does not return.
    let rc = unsafe { libc::reboot(libc::LINUX_REBOOT_CMD_POWER_OFF) };
    let err = io::Error::last_os_error();
    let _ = writeln!(
        io::stdout(),
        "clade-agent: error: reboot(POWER_OFF) returned {rc}: {err}"
    );
    let _ = io::stdout().flush();
    loop {
        // SAFETY: pause has no preconditions.
        unsafe { libc::pause() };
    }
}

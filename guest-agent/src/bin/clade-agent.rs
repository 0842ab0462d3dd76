//! `clade-agent`: the guest's `/init` (PID 1) and the in-guest agent server.
//!
//! As PID 1 (arguments ignored: the kernel may pass stray words from its command line):
//! 1. mount proc, sys, dev, dev/pts, tmp;
//! 2. load the kernel modules listed in `/lib/modules/<release>/load-order` and print
//!    `CLADE-AGENT-MODULES loaded=N already=N failed=N`;
//! 3. with `clade.root=<device>` on the kernel command line (e.g. `clade.root=/dev/vda`, the
//!    first virtio-blk disk): mount that device (`clade.rootfstype=`, default ext4) and make
//!    it the root filesystem, staying PID 1 (`system::switch_root`: the initramfs's /dev,
//!    /proc, /sys, /tmp move along, then chroot); prints `CLADE-AGENT-ROOT <device>
//!    <fstype>`, or an error line and carries on from the initramfs. On power off the root
//!    is remounted read-only after a sync, so the disk is left clean;
//! 4. by the kernel command line's `clade.agent=` value:
//!    - `ready-poweroff`: print the readiness marker and power off (the nested tier's
//!      boot check);
//!    - `serve` (default): listen on AF_VSOCK port 52 (`clade.agent.port=` overrides),
//!      print the readiness marker and `CLADE-AGENT-LISTENING vsock port=<port>`, serve
//!      until a client asks for a power off, then power off.
//!
//!    `clade.agent.log=<level>` sets the log level (default warn); logs go to the console.
//!    `clade.net=ADDR/PREFIX[,GATEWAY]` gives `eth0` (virtio-net) that address, before 4;
//!    `clade.dns=IP` makes IP the guest's resolver (`/etc/resolv.conf`).
//!
//! Not PID 1, for host-side tests and development:
//! `clade-agent --listen-unix PATH` (or `--listen-vsock PORT`) serves the same protocol
//! without touching mounts, modules, the clock or power: PowerOff makes it exit 0. It is a
//! child subreaper so orphans of its commands are reaped as in the guest. Log level:
//! `CLADE_AGENT_LOG` (default warn).
//!
//! Marker format (parsed by tests/nested/run.sh):
//! `CLADE-GUEST-READY kernel=<uname release> uptime=<seconds from /proc/uptime>`

use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use guest_agent::server::{self, Listener, ServeEnd, ServerOptions, SystemMode};
use guest_agent::{system, AGENT_VSOCK_PORT};

/// Readiness marker written to the console.
const READY_MARKER: &str = "CLADE-GUEST-READY";
/// Written once the agent listens.
const LISTENING_MARKER: &str = "CLADE-AGENT-LISTENING";
/// Written after loading the initramfs's kernel modules.
const MODULES_MARKER: &str = "CLADE-AGENT-MODULES";
/// Written after switching to a disk root.
const ROOT_MARKER: &str = "CLADE-AGENT-ROOT";

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
    // PTYs for exec --tty (/dev/ptmx works only with devpts mounted next to it).
    MountSpec {
        source: "devpts",
        target: "/dev/pts",
        fstype: "devpts",
        flags: libc::MS_NOSUID | libc::MS_NOEXEC,
        data: "mode=0620,ptmxmode=0666",
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
    #[error("{0}")]
    Agent(#[from] guest_agent::Error),
    #[error("usage: {0}")]
    Usage(String),
}

const USAGE: &str = "clade-agent [--listen-unix PATH | --listen-vsock PORT]  \
                     (as PID 1: no arguments; see the kernel command line options)";

fn main() {
    // SAFETY: getpid has no preconditions.
    if unsafe { libc::getpid() } == 1 {
        init_main();
    }
    match host_main() {
        Ok(()) => {}
        Err(e) => {
            eprintln!("clade-agent: {e}");
            std::process::exit(2);
        }
    }
}

// ------------------------------------------------------------------------------ PID 1

fn init_main() -> ! {
    if let Err(e) = mount_all() {
        log_error(&e);
    }
    let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
    init_logging(system::cmdline_value(&cmdline, "clade.agent.log").unwrap_or("warn"));
    load_modules();
    let disk_root = mount_disk_root(&cmdline);
    configure_net(&cmdline);
    configure_dns(&cmdline);
    match system::cmdline_value(&cmdline, "clade.agent").unwrap_or("serve") {
        "ready-poweroff" => {
            if let Err(e) = report_ready() {
                log_error(&e);
            }
        }
        mode => {
            if mode != "serve" {
                log_error(&InitError::Usage(format!(
                    "clade.agent={mode} is not a mode (ready-poweroff, serve); serving"
                )));
            }
            let port = system::cmdline_value(&cmdline, "clade.agent.port")
                .and_then(|p| p.parse().ok())
                .unwrap_or(AGENT_VSOCK_PORT);
            serve_vsock(port);
        }
    }
    power_off(disk_root);
}

/// `clade.root=`: switch to the disk's filesystem as root. True if it is the root now.
fn mount_disk_root(cmdline: &str) -> bool {
    let Some(device) = system::cmdline_value(cmdline, "clade.root") else {
        return false;
    };
    let fstype = system::cmdline_value(cmdline, "clade.rootfstype").unwrap_or("ext4");
    match system::switch_root(Path::new(device), fstype, false) {
        Ok(()) => {
            let _ = writeln!(io::stdout(), "{ROOT_MARKER} {device} {fstype}");
            true
        }
        Err(e) => {
            log_error(&e.into());
            false
        }
    }
}

/// `clade.net=ADDR/PREFIX[,GATEWAY]`: the first virtio-net interface (`eth0`) gets that
/// address (and `lo` comes up); prints `CLADE-AGENT-NET eth0 <spec>` or an error line. A
/// restored or forked VM keeps it: each has its own TAP with the same inner addressing.
fn configure_net(cmdline: &str) {
    let Some(v) = system::cmdline_value(cmdline, "clade.net") else {
        return;
    };
    let Some(spec) = system::NetSpec::parse(v) else {
        return log_error(&InitError::Usage(format!(
            "clade.net={v}: want ADDR/PREFIX[,GATEWAY] (IPv4)"
        )));
    };
    // The device may still be probing right after the module loaded.
    let ok = system::wait_for_path(Path::new("/sys/class/net/eth0"), Duration::from_secs(5));
    match system::configure_interface("eth0", &spec) {
        Ok(()) => {
            let _ = writeln!(io::stdout(), "CLADE-AGENT-NET eth0 {v}");
        }
        Err(e) => log_error(&InitError::Usage(format!(
            "clade.net: configuring eth0{}: {e}",
            if ok { "" } else { " (no such interface)" }
        ))),
    }
}

/// `clade.dns=IP`: `/etc/resolv.conf` names IP as the only resolver (the host's forwarder on
/// the sandbox's gateway); prints `CLADE-AGENT-DNS <ip>` or an error line. A symlink there
/// (e.g. to a resolver daemon's file) is replaced by the file.
fn configure_dns(cmdline: &str) {
    let Some(v) = system::cmdline_value(cmdline, "clade.dns") else {
        return;
    };
    let Ok(ip) = v.parse::<std::net::IpAddr>() else {
        return log_error(&InitError::Usage(format!(
            "clade.dns={v}: want an IP address"
        )));
    };
    let path = Path::new("/etc/resolv.conf");
    let _ = fs::remove_file(path);
    match fs::write(path, format!("nameserver {ip}\n")) {
        Ok(()) => {
            let _ = writeln!(io::stdout(), "CLADE-AGENT-DNS {ip}");
        }
        Err(e) => log_error(&InitError::Usage(format!(
            "clade.dns: writing {}: {e}",
            path.display()
        ))),
    }
}

fn load_modules() {
    let release = match system::kernel_release() {
        Ok(r) => r,
        Err(e) => return log_error(&InitError::Uname(e)),
    };
    let dir = PathBuf::from("/lib/modules").join(release);
    match system::load_modules(&dir) {
        Ok(results) if results.is_empty() => {}
        Ok(results) => {
            let (mut loaded, mut already, mut failed) = (0, 0, 0);
            for (name, r) in &results {
                match r {
                    system::ModuleLoad::Loaded => loaded += 1,
                    system::ModuleLoad::AlreadyLoaded => already += 1,
                    system::ModuleLoad::Failed(e) => {
                        failed += 1;
                        let _ = writeln!(
                            io::stdout(),
                            "clade-agent: error: module {}: {e}",
                            name.display()
                        );
                    }
                }
            }
            let _ = writeln!(
                io::stdout(),
                "{MODULES_MARKER} loaded={loaded} already={already} failed={failed}"
            );
        }
        Err(e) => log_error(&e.into()),
    }
}

/// Serves on vsock until a power off is requested. Retries the listener (the transport may
/// be missing, e.g. a VMM without a vsock device) rather than leaving PID 1.
fn serve_vsock(port: u32) {
    let mut announced = false;
    loop {
        match Listener::bind_vsock(port) {
            Ok(listener) => {
                if let Err(e) = report_ready() {
                    log_error(&e);
                }
                let _ = writeln!(io::stdout(), "{LISTENING_MARKER} vsock port={port}");
                let _ = io::stdout().flush();
                match server::serve(
                    listener,
                    ServerOptions {
                        mode: SystemMode::Guest,
                    },
                ) {
                    Ok(ServeEnd::PowerOff) => {
                        // Give the Ok reply a moment to leave through the vsock device.
                        std::thread::sleep(Duration::from_millis(100));
                        return;
                    }
                    Err(e) => log_error(&e.into()),
                }
            }
            Err(e) => {
                if !announced {
                    log_error(&e.into());
                    let _ = writeln!(io::stdout(), "clade-agent: retrying every 2 s");
                    announced = true;
                }
            }
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

// ------------------------------------------------------------------------------ host mode

fn host_main() -> Result<(), InitError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let listener = match args.as_slice() {
        [flag, path] if flag == "--listen-unix" => Listener::bind_unix(Path::new(path))?,
        [flag, port] if flag == "--listen-vsock" => {
            let port = port
                .parse()
                .map_err(|_| InitError::Usage(format!("bad port {port:?}")))?;
            Listener::bind_vsock(port)?
        }
        [flag] if flag == "--help" || flag == "-h" => {
            println!("{USAGE}");
            return Ok(());
        }
        _ => return Err(InitError::Usage(USAGE.to_string())),
    };
    init_logging(&std::env::var("CLADE_AGENT_LOG").unwrap_or_else(|_| "warn".into()));
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) affects only this process.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) } != 0 {
        tracing::warn!("PR_SET_CHILD_SUBREAPER: {}", io::Error::last_os_error());
    }
    println!("{LISTENING_MARKER} {}", args.join(" "));
    let _ = io::stdout().flush();
    match server::serve(
        listener,
        ServerOptions {
            mode: SystemMode::HostTest,
        },
    )? {
        ServeEnd::PowerOff => {
            // Let the Ok reply leave before the process (the "machine") goes away.
            std::thread::sleep(Duration::from_millis(50));
            Ok(())
        }
    }
}

fn init_logging(level: &str) {
    let level = level
        .parse::<tracing::Level>()
        .unwrap_or(tracing::Level::WARN);
    let _ = tracing_subscriber::fmt()
        .with_writer(io::stderr)
        .with_max_level(level)
        .with_ansi(false)
        .without_time()
        .with_target(false)
        .try_init();
}

// ------------------------------------------------------------------------------ console

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
    let release = system::kernel_release().unwrap_or_else(|e| {
        log_error(&InitError::Uname(e));
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

/// Flush filesystems and power the VM off (a disk root is remounted read-only first, so
/// its filesystem is clean). PID 1 must never return, so if reboot(2) fails this reports
/// it and parks forever.
fn power_off(disk_root: bool) -> ! {
    let _ = io::stdout().flush();
    if let Err(e) = drain_console(CONSOLE_DRAIN_TIMEOUT) {
        log_error_kmsg(&e);
    }
    system::sync();
    if disk_root {
        if let Err(e) = system::remount_root_read_only() {
            // Still consistent: everything was synced; the journal covers the rest.
            log_error_kmsg(&InitError::Agent(guest_agent::Error::os(
                "remount / read-only",
                e,
            )));
        }
        system::sync();
    }
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

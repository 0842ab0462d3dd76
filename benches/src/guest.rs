//! The native test guest (tests/native-guest) and the machine it runs on: where its ELF
//! comes from, booting it until it is ready, and small helpers every scenario shares.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm::agent::{Client, Transport, AGENT_VSOCK_PORT};
use vmm::{SerialOutput, ShellSpec, Vm, VmConfig, VsockConfig};

use crate::error::{Context, Error, Result};

/// The machine a benchmark boots the guest on.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// KVM device node.
    pub kvm_device: PathBuf,
}

impl Machine {
    /// A pre-built VM shell of this machine's shape.
    pub(crate) fn shell_spec(&self) -> ShellSpec {
        ShellSpec {
            kvm_device: self.kvm_device.clone(),
            mem_bytes: self.mem_mib << 20,
            vcpus: self.vcpus,
            dirty_log: true,
        }
    }
}

/// The native test guest ELF a benchmark boots: a file, or an image held in memory (the one
/// the `clade` binary embeds), exposed as `/proc/self/fd/<fd>` of a memory file that lives
/// as long as this value.
#[derive(Debug)]
pub struct Guest {
    path: PathBuf,
    _image: Option<File>,
}

impl Guest {
    /// The guest ELF at `path`; fails when there is no such file.
    pub fn from_path(path: impl Into<PathBuf>) -> Result<Guest> {
        let path = path.into();
        if !path.exists() {
            return Err(Error::GuestNotFound { path });
        }
        Ok(Guest { path, _image: None })
    }

    /// The guest ELF `image`, written to an anonymous memory file (memfd, closed on exec).
    pub fn from_image(image: &[u8]) -> Result<Guest> {
        let name = c"clade-native-guest";
        // SAFETY: `name` is a NUL-terminated string that outlives the call, and
        // memfd_create reads nothing else. A non-negative result is a new descriptor that
        // nothing else in this process owns or closes, so OwnedFd may take it over.
        let fd = unsafe {
            let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC);
            (fd >= 0).then(|| OwnedFd::from_raw_fd(fd))
        };
        let fd = fd.ok_or_else(|| Error::GuestImage(std::io::Error::last_os_error()))?;
        let mut file = File::from(fd);
        file.write_all(image).map_err(Error::GuestImage)?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        tracing::debug!(bytes = image.len(), path = %path.display(), "native test guest in a memory file");
        Ok(Guest {
            path,
            _image: Some(file),
        })
    }

    /// The path to give the VMM as the kernel.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The guest ELF as a path another process can open (the built-in one is this
    /// process's memory file: `/proc/self/…` would be that process's own).
    pub(crate) fn path_for_other_processes(&self) -> PathBuf {
        match self.path.strip_prefix("/proc/self") {
            Ok(rest) => Path::new("/proc")
                .join(std::process::id().to_string())
                .join(rest),
            Err(_) => self.path.clone(),
        }
    }
}

/// The native guest's setting for no console line per connection (see its
/// `vsock::Tuning`): a benchmark of what follows a connection (a fork of a VM with one
/// open: each child's transport reset drops it) must not find the guest writing that
/// line, an exit to the VMM per byte, ~1.5 ms of vCPU time per line here. A Linux guest
/// logs nothing per connection.
pub(crate) const NO_CONN_LOG: &str = "conn_log=0";

/// The configuration booting `guest` on `machine` with the guest's `steps` (the value of
/// `steps=`, optionally followed by the guest's other settings, e.g. [`NO_CONN_LOG`];
/// serial output kept in memory, test device on, and a vsock device with CID 3 behind
/// `vsock`).
pub(crate) fn config(
    guest: &Guest,
    machine: &Machine,
    steps: &str,
    vsock: Option<&Path>,
) -> VmConfig {
    VmConfig {
        vcpus: machine.vcpus,
        mem_mib: machine.mem_mib,
        kernel: guest.path().to_path_buf(),
        initrd: None,
        cmdline: format!("steps={steps}"),
        serial: SerialOutput::Memory,
        test_device: true,
        kvm_device: machine.kvm_device.clone(),
        vsock: vsock.map(|p| VsockConfig {
            uds_path: p.to_path_buf(),
            guest_cid: 3,
        }),
        disk: None,
        net: None,
        balloon: false,
    }
}

/// The guest's serial output so far.
pub(crate) fn serial(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned()
}

/// The guest's last line of serial output, quoted, for one-line error messages.
pub(crate) fn last_serial_line(vm: &Vm) -> String {
    let text = serial(vm);
    format!("{:?}", text.trim_end().lines().last().unwrap_or(""))
}

/// Boots the native guest with `steps` and waits for `ready` in its output.
pub(crate) fn boot_until(
    guest: &Guest,
    machine: &Machine,
    steps: &str,
    vsock: Option<&Path>,
    ready: &str,
) -> Result<Vm> {
    boot_until_with(guest, machine, steps, vsock, ready, None)
}

/// [`boot_until`], with a network device over `net` when given.
pub(crate) fn boot_until_with(
    guest: &Guest,
    machine: &Machine,
    steps: &str,
    vsock: Option<&Path>,
    ready: &str,
    net: Option<vmm::NetConfig>,
) -> Result<Vm> {
    tracing::debug!(steps, ready, "booting the native guest");
    let mut cfg = config(guest, machine, steps, vsock);
    cfg.net = net;
    let mut vm = vmm::boot(cfg)?;
    vm.start()?;
    let t = Instant::now();
    while !serial(&vm).contains(ready) {
        if let Some(status) = vm.wait_timeout(Duration::from_millis(5))? {
            return Err(Error::Guest(format!(
                "the guest ended ({status}) before '{ready}':\n{}",
                serial(&vm)
            )));
        }
        if t.elapsed() > Duration::from_secs(120) {
            return Err(Error::Guest(format!(
                "no '{ready}' from the guest in 120 s:\n{}",
                serial(&vm)
            )));
        }
    }
    tracing::debug!(elapsed = ?t.elapsed(), "the native guest is ready");
    Ok(vm)
}

/// Connects to the agent port of the guest behind the vsock socket `sock`.
pub(crate) fn connect(sock: &Path, timeout: Duration) -> vmm::Result<Client> {
    Client::connect_timeout(
        sock,
        Transport::Vsock {
            port: AGENT_VSOCK_PORT,
        },
        timeout,
    )
}

/// Connects to the agent port of the guest behind `sock` and waits for one answered ping,
/// sent with the connection's Hello (as a client waiting for a sandbox to be ready sends
/// it: [`Client::connect_and_ping`]).
pub(crate) fn connect_and_ping(sock: &Path, timeout: Duration) -> vmm::Result<Client> {
    Client::connect_and_ping(
        sock,
        Transport::Vsock {
            port: AGENT_VSOCK_PORT,
        },
        timeout,
    )
    .map(|(c, _)| c)
}

/// Connects to the guest behind `sock` and waits for one answered ping.
pub(crate) fn ping_once(sock: &Path) -> Result<()> {
    connect_and_ping(sock, Duration::from_secs(20))
        .context_with(|| format!("connecting to {} and pinging", sock.display()))?;
    Ok(())
}

/// Connects to the guest behind `sock`, waits for its answer to a ping, and closes, with
/// no client kept (so no reader thread: [`vmm::agent::probe`]).
pub(crate) fn probe(sock: &Path) -> Result<()> {
    vmm::agent::probe(
        sock,
        Transport::Vsock {
            port: AGENT_VSOCK_PORT,
        },
        Duration::from_secs(20),
    )
    .context_with(|| format!("probing the agent behind {}", sock.display()))?;
    Ok(())
}

/// A scratch directory, removed when dropped.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    /// `clade-bench-<what>-<pid>-<n>` in the temporary directory, emptied: `n` counts the
    /// scratch directories of this process, so that two at once (the two services of
    /// `bench serve`'s confinement case) never share one.
    pub(crate) fn new(what: &str) -> Result<Scratch> {
        static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("clade-bench-{what}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).context_with(|| format!("creating {}", d.display()))?;
        Ok(Scratch(d))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_directories_of_one_process_are_its_own() {
        let a = Scratch::new("same").unwrap();
        let b = Scratch::new("same").unwrap();
        assert_ne!(a.0, b.0);
        std::fs::write(a.0.join("f"), b"a").unwrap();
        drop(b);
        assert_eq!(std::fs::read(a.0.join("f")).unwrap(), b"a");
    }

    #[test]
    fn an_image_is_readable_through_its_path() {
        let g = Guest::from_image(b"\x7fELF test").unwrap();
        assert!(g.path().starts_with("/proc/self/fd"));
        assert_eq!(std::fs::read(g.path()).unwrap(), b"\x7fELF test");
    }

    #[test]
    fn a_missing_file_is_an_error() {
        let e = Guest::from_path("/nonexistent/native-guest").unwrap_err();
        assert!(matches!(e, Error::GuestNotFound { .. }), "{e}");
    }
}

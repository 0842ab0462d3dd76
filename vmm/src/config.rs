//! What a VM should look like: the only input of [`crate::Vm::new`].

use std::path::PathBuf;
use std::sync::Arc;

pub use devices::virtio::net::tap::Tap;

use crate::error::{Error, Result};

/// Where the guest's serial console (ttyS0) goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SerialOutput {
    /// The VMM process's standard output.
    #[default]
    Stdout,
    /// A file, created or truncated.
    File(PathBuf),
    /// An in-memory buffer, read back with [`crate::Vm::serial_output`] (tests, benchmarks).
    Memory,
    /// Discarded.
    Discard,
}

/// A virtio-vsock device whose host side is Unix sockets (Firecracker's convention): host
/// programs connect to `uds_path` and send `CONNECT <port>\n`; guest connections to host
/// port P reach a listener at `<uds_path>_P`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// The VM's socket; created at build time, removed when the VM is dropped.
    pub uds_path: PathBuf,
    /// The guest's context id, 3..u32::MAX.
    pub guest_cid: u32,
}

/// A virtio-blk disk: the top layer of a layered Clade image (`clade disk create`; format in
/// `disk/FORMAT.md`). Writes go to that layer; its parents are opened read-only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockConfig {
    /// The top layer (an overlay, or a standalone image).
    pub path: PathBuf,
    /// Open the top layer read-only too; the guest sees a read-only disk.
    pub read_only: bool,
    /// The disk's serial (virtio-blk GET_ID, at most 20 bytes); default: from the layer id.
    pub serial: Option<String>,
    /// What fills the layers of its chain that are filled on demand (`disk::remote`: a
    /// published layer restored through a fetcher); a chain with such a layer and no
    /// source for it is refused when the VM is built.
    pub sources: Option<disk::remote::Sources>,
}

/// Where a virtio-net device's TAP comes from.
#[derive(Debug, Clone)]
pub enum TapSource {
    /// The TAP interface of this name, opened (or created, with CAP_NET_ADMIN) through
    /// `/dev/net/tun` when the VM is built.
    Name(String),
    /// A TAP descriptor this process inherited, opened with `IFF_TAP | IFF_NO_PI |
    /// IFF_VNET_HDR` (a jailed VMM gets its TAP this way); the VM uses a duplicate, and
    /// the descriptor is made close-on-exec (processes this one starts do not get it).
    Fd(i32),
    /// A TAP this process opened ahead ([`crate::open_tap`]), e.g. by a pool of sandbox
    /// networks, so that a restore's path does not attach to one: the VM shares it (one VM
    /// at a time; a VM built over it while another runs on it would share its frames).
    Open(Arc<Tap>),
}

/// Equal when they name the same TAP the same way (an opened one: the same object).
impl PartialEq for TapSource {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (TapSource::Name(a), TapSource::Name(b)) => a == b,
            (TapSource::Fd(a), TapSource::Fd(b)) => a == b,
            (TapSource::Open(a), TapSource::Open(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for TapSource {}

/// A virtio-net device over a TAP (see `devices::virtio::net`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// The TAP.
    pub tap: TapSource,
    /// The guest's MAC address; default [`devices::virtio::net::DEFAULT_MAC`] for a new VM,
    /// the saved one for a restored VM (a different one given then is refused).
    pub mac: Option<[u8; 6]>,
    /// The network namespace the TAP lives in (a file such as `/run/netns/NAME`): the TAP
    /// is opened from a thread that enters it for that moment only, so the VMM itself stays
    /// where it is (a sandbox's own namespace, issue 12). Default: the VMM's namespace.
    pub netns: Option<PathBuf>,
}

impl NetConfig {
    /// Parses `tap=NAME[,mac=MAC][,netns=PATH]` or `fd=N[,mac=MAC]` (what `--net` takes).
    pub fn parse(spec: &str) -> Result<Self> {
        let err = |why: String| Error::Config(format!("--net '{spec}': {why}"));
        let (mut tap, mut mac, mut netns) = (None, None, None);
        for part in spec.split(',') {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| err(format!("'{part}' is not KEY=VALUE")))?;
            let dup = match key {
                "tap" => tap.replace(TapSource::Name(value.to_string())).is_some(),
                "fd" => {
                    let fd = value
                        .parse()
                        .map_err(|_| err(format!("fd '{value}' is not a number")))?;
                    tap.replace(TapSource::Fd(fd)).is_some()
                }
                "mac" => mac
                    .replace(
                        devices::virtio::net::parse_mac(value)
                            .ok_or_else(|| err(format!("'{value}' is not a MAC address")))?,
                    )
                    .is_some(),
                "netns" => netns.replace(PathBuf::from(value)).is_some(),
                _ => return Err(err(format!("unknown key '{key}' (tap, fd, mac, netns)"))),
            };
            if dup {
                return Err(err(format!("'{key}' given twice, or both tap and fd")));
            }
        }
        let tap = tap.ok_or_else(|| err("needs tap=NAME or fd=N".into()))?;
        let c = Self { tap, mac, netns };
        c.validate()?;
        Ok(c)
    }

    /// Checks what can be checked without touching the host.
    pub fn validate(&self) -> Result<()> {
        match &self.tap {
            TapSource::Name(n) if !devices::virtio::net::tap::valid_name(n) => {
                return Err(Error::Config(format!(
                    "TAP name '{n}' is not a valid interface name (1..={} bytes, no '/', ':' \
                     or spaces)",
                    devices::virtio::net::tap::MAX_NAME_LEN
                )))
            }
            TapSource::Fd(fd) if *fd < 0 => {
                return Err(Error::Config(format!("TAP descriptor {fd} is negative")))
            }
            _ => {}
        }
        if let Some(ns) = &self.netns {
            if !matches!(self.tap, TapSource::Name(_)) {
                return Err(Error::Config(
                    "netns= goes with tap=NAME (an open TAP is in its namespace already)".into(),
                ));
            }
            if !ns.is_absolute()
                || ns
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
                || ns.as_os_str().to_string_lossy().contains(',')
            {
                return Err(Error::Config(format!(
                    "netns '{}' must be an absolute path without '..' or ','",
                    ns.display()
                )));
            }
        }
        if let Some(mac) = &self.mac {
            if mac[0] & 1 != 0 {
                return Err(Error::Config(format!(
                    "MAC {} is a multicast address",
                    devices::virtio::net::format_mac(mac)
                )));
            }
        }
        Ok(())
    }
}

/// The spec [`NetConfig::parse`] reads back (a fork child gets its TAP this way).
impl std::fmt::Display for NetConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.tap {
            TapSource::Name(n) => write!(f, "tap={n}")?,
            TapSource::Fd(fd) => write!(f, "fd={fd}")?,
            TapSource::Open(t) => write!(f, "open={}", t.name())?,
        }
        if let Some(mac) = &self.mac {
            write!(f, ",mac={}", devices::virtio::net::format_mac(mac))?;
        }
        if let Some(ns) = &self.netns {
            write!(f, ",netns={}", ns.display())?;
        }
        Ok(())
    }
}

/// Longest Unix socket path (`sun_path` holds 108 bytes including the NUL).
pub const MAX_UDS_PATH: usize = 107;

/// Smallest guest memory accepted: below this Linux and our boot layout do not fit.
pub const MIN_MEM_MIB: u64 = 16;

/// Configuration of one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    /// Number of vCPUs, 1..=KVM's limit.
    pub vcpus: u32,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// Kernel: an x86_64 bzImage or ELF (vmlinux, or the project's test guest).
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Serial console destination.
    pub serial: SerialOutput,
    /// Attach the test device used by the project's bare-metal test guest.
    pub test_device: bool,
    /// KVM device node (default `/dev/kvm`).
    pub kvm_device: PathBuf,
    /// A virtio-vsock device, if any.
    pub vsock: Option<VsockConfig>,
    /// A virtio-blk disk, if any (the guest's /dev/vda).
    pub disk: Option<BlockConfig>,
    /// A virtio-net device, if any (the guest's eth0).
    pub net: Option<NetConfig>,
    /// A virtio-balloon with free page reporting: memory the guest frees goes back to the
    /// host, and snapshots and forks skip it (see `devices::virtio::balloon`).
    pub balloon: bool,
}

impl VmConfig {
    /// A config with one vCPU, 256 MiB and serial to stdout.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            vcpus: 1,
            mem_mib: 256,
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::new(),
            serial: SerialOutput::Stdout,
            test_device: false,
            kvm_device: PathBuf::from(crate::vstate::kvm::KVM_PATH),
            vsock: None,
            disk: None,
            net: None,
            balloon: false,
        }
    }

    /// Checks what can be checked without touching KVM or the host.
    pub fn validate(&self) -> Result<()> {
        if self.vcpus == 0 {
            return Err(Error::Config("vcpus must be at least 1".into()));
        }
        if self.mem_mib == 0 {
            return Err(Error::Config("memory size must be greater than 0".into()));
        }
        if self.mem_mib < MIN_MEM_MIB {
            return Err(Error::Config(format!(
                "memory size {} MiB is below the minimum of {MIN_MEM_MIB} MiB",
                self.mem_mib
            )));
        }
        if self.mem_mib > (1 << 30) {
            return Err(Error::Config(format!(
                "memory size {} MiB is beyond any host",
                self.mem_mib
            )));
        }
        if self.cmdline.contains('\0') {
            return Err(Error::Cmdline("contains a NUL byte".into()));
        }
        if let Some(v) = &self.vsock {
            if v.guest_cid < 3 || v.guest_cid == u32::MAX {
                return Err(Error::Config(format!(
                    "vsock guest CID {} is reserved (use 3..{})",
                    v.guest_cid,
                    u32::MAX
                )));
            }
            let len = v.uds_path.as_os_str().len();
            if len == 0 || len > MAX_UDS_PATH {
                return Err(Error::Config(format!(
                    "vsock socket path must be 1..={MAX_UDS_PATH} bytes, '{}' is {len}",
                    v.uds_path.display()
                )));
            }
        }
        if let Some(d) = &self.disk {
            if d.path.as_os_str().is_empty() {
                return Err(Error::Config("disk path is empty".into()));
            }
            if let Some(s) = d.serial.as_ref().filter(|s| s.len() > 20) {
                return Err(Error::Config(format!(
                    "disk serial '{s}' is longer than 20 bytes"
                )));
            }
        }
        if let Some(n) = &self.net {
            n.validate()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_zero_and_tiny_memory_and_zero_vcpus() {
        let mut c = VmConfig::new("/k");
        assert!(c.validate().is_ok());
        c.mem_mib = 0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("greater than 0"));
        c.mem_mib = 4;
        assert!(c.validate().unwrap_err().to_string().contains("minimum"));
        c.mem_mib = 256;
        c.vcpus = 0;
        assert!(c.validate().unwrap_err().to_string().contains("vcpus"));
    }

    #[test]
    fn vsock_needs_a_guest_cid_and_a_usable_path() {
        let mut c = VmConfig::new("/k");
        let mut v = VsockConfig {
            uds_path: "/tmp/v.sock".into(),
            guest_cid: 3,
        };
        c.vsock = Some(v.clone());
        assert!(c.validate().is_ok());
        for cid in [0, 1, 2, u32::MAX] {
            v.guest_cid = cid;
            c.vsock = Some(v.clone());
            assert!(c.validate().unwrap_err().to_string().contains("CID"));
        }
        v.guest_cid = 3;
        v.uds_path = format!("/tmp/{}", "x".repeat(200)).into();
        c.vsock = Some(v.clone());
        assert!(c.validate().unwrap_err().to_string().contains("path"));
        v.uds_path = "".into();
        c.vsock = Some(v);
        assert!(c.validate().is_err());
    }

    #[test]
    fn net_specs_parse_and_bad_ones_are_refused_before_any_host_work() {
        assert_eq!(
            NetConfig::parse("tap=tap0").unwrap(),
            NetConfig {
                tap: TapSource::Name("tap0".into()),
                mac: None,
                netns: None,
            }
        );
        assert_eq!(
            NetConfig::parse("fd=5,mac=02:00:00:00:00:01").unwrap(),
            NetConfig {
                tap: TapSource::Fd(5),
                mac: Some([2, 0, 0, 0, 0, 1]),
                netns: None,
            }
        );
        let in_ns =
            NetConfig::parse("tap=tap0,mac=02:00:00:00:00:01,netns=/run/netns/c-1").unwrap();
        assert_eq!(
            in_ns.netns.as_deref(),
            Some(std::path::Path::new("/run/netns/c-1"))
        );
        assert_eq!(NetConfig::parse(&in_ns.to_string()).unwrap(), in_ns);
        for (bad, why) in [
            ("", "KEY=VALUE"),
            ("mac=02:00:00:00:00:01", "needs tap"),
            ("tap=a,fd=3", "twice"),
            ("tap=a,tap=b", "twice"),
            ("tap=a/b", "interface name"),
            ("tap=0123456789abcdef", "interface name"),
            ("fd=x", "number"),
            ("fd=-1", "negative"),
            ("tap=a,mac=01:00:00:00:00:01", "multicast"),
            ("tap=a,mac=zz", "MAC"),
            ("tap=a,mtu=9000", "unknown key"),
            ("fd=3,netns=/run/netns/x", "goes with tap"),
            ("tap=a,netns=run/netns/x", "absolute"),
            ("tap=a,netns=/run/../x", "absolute"),
        ] {
            let err = NetConfig::parse(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
        let mut c = VmConfig::new("/k");
        c.net = Some(NetConfig {
            tap: TapSource::Name(String::new()),
            mac: None,
            netns: None,
        });
        assert!(c.validate().unwrap_err().to_string().contains("TAP name"));
    }
}

//! Guest-wide facilities: kernel modules, clock, entropy, uptime, kernel command line.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::Error;

/// Name of the module load-order file inside `/lib/modules/<release>/`, written by the
/// initramfs builder (tests/nested/build-guest-initramfs.sh): one `.ko` file name per line,
/// relative to that directory, dependencies first; `#` starts a comment.
pub const MODULE_LOAD_ORDER: &str = "load-order";

/// `RNDADDENTROPY` = `_IOW('R', 0x03, int[2])` (linux/random.h; not in the libc crate).
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG` = `_IO('R', 0x07)`: reseed the kernel's CRNG from the input pool now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Outcome of loading one module.
#[derive(Debug)]
pub enum ModuleLoad {
    Loaded,
    /// EEXIST: already loaded (or built in).
    AlreadyLoaded,
    Failed(io::Error),
}

/// Parses a load-order file: the module file names in order.
pub fn parse_load_order(text: &str) -> Vec<PathBuf> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// Loads the modules listed in `dir`/[`MODULE_LOAD_ORDER`] in order with `finit_module`.
/// A missing list means nothing to load. Keeps going after a failure (a later module may
/// not need the failed one); returns each module with its outcome.
pub fn load_modules(dir: &Path) -> Result<Vec<(PathBuf, ModuleLoad)>, Error> {
    let list = dir.join(MODULE_LOAD_ORDER);
    let text = match std::fs::read_to_string(&list) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::os(format!("read {}", list.display()), e)),
    };
    let mut out = Vec::new();
    for name in parse_load_order(&text) {
        let path = dir.join(&name);
        let result = match File::open(&path) {
            Ok(f) => finit_module(&f),
            Err(e) => ModuleLoad::Failed(e),
        };
        match &result {
            ModuleLoad::Loaded => tracing::debug!("loaded module {}", path.display()),
            ModuleLoad::AlreadyLoaded => {
                tracing::debug!("module {} already loaded", path.display())
            }
            ModuleLoad::Failed(e) => tracing::error!("load module {}: {e}", path.display()),
        }
        out.push((name, result));
    }
    Ok(out)
}

fn finit_module(f: &File) -> ModuleLoad {
    let params = c"";
    // SAFETY: finit_module(fd, param_values, flags) reads the open module file and a valid
    // NUL-terminated (empty) parameter string.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            f.as_raw_fd(),
            params.as_ptr(),
            0 as libc::c_int,
        )
    };
    if rc == 0 {
        return ModuleLoad::Loaded;
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EEXIST) {
        ModuleLoad::AlreadyLoaded
    } else {
        ModuleLoad::Failed(err)
    }
}

/// Sets CLOCK_REALTIME.
pub fn set_clock(unix_ns: i64) -> io::Result<()> {
    if unix_ns < 0 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let ts = libc::timespec {
        tv_sec: unix_ns / 1_000_000_000,
        tv_nsec: unix_ns % 1_000_000_000,
    };
    // SAFETY: clock_settime reads the valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Mixes `data` into the kernel's entropy pool and credits 8 bits per byte (RNDADDENTROPY
/// on /dev/urandom; needs CAP_SYS_ADMIN), then makes the CRNG reseed from it at once
/// (RNDRESEEDCRNG): adding entropy alone does not, and clones of one snapshot or fork
/// would go on producing the same random bytes until the kernel's next scheduled reseed.
pub fn add_entropy(data: &[u8]) -> io::Result<()> {
    let len = libc::c_int::try_from(data.len())
        .ok()
        .filter(|n| n.checked_mul(8).is_some())
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + data.len());
    info.extend_from_slice(&(len * 8).to_ne_bytes());
    info.extend_from_slice(&len.to_ne_bytes());
    info.extend_from_slice(data);
    let dev = OpenOptions::new().write(true).open("/dev/urandom")?;
    // SAFETY: the buffer holds a rand_pool_info header followed by buf_size bytes; the
    // kernel only reads it.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG) } != 0 {
        let e = io::Error::last_os_error();
        // ENODATA: the CRNG is not seeded yet; it seeds itself from the pool when it is.
        if e.raw_os_error() != Some(libc::ENODATA) {
            return Err(e);
        }
    }
    Ok(())
}

/// Flushes all filesystems.
/// Gives the calling thread (only it: raw system calls, not libc's process-wide setxid
/// broadcast) the filesystem credentials of a user: supplementary groups, fsgid, fsuid.
/// Checked afterwards (setfsuid/setfsgid report failure only by not changing anything).
pub fn thread_fs_credentials(uid: u32, gid: u32, groups: &[u32]) -> io::Result<()> {
    // SAFETY: setgroups reads `groups.len()` gid_t values from a valid slice; it changes
    // only this thread's credentials.
    if unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: setfsgid/setfsuid take plain integers and change only this thread's
    // filesystem ids; each returns the previous id, so a second call reads the result.
    let (fsgid, fsuid) = unsafe {
        libc::syscall(libc::SYS_setfsgid, gid);
        let fsgid = libc::syscall(libc::SYS_setfsgid, gid) as u32;
        libc::syscall(libc::SYS_setfsuid, uid);
        (fsgid, libc::syscall(libc::SYS_setfsuid, uid) as u32)
    };
    if fsgid != gid || fsuid != uid {
        return Err(io::Error::from_raw_os_error(libc::EPERM));
    }
    Ok(())
}

pub fn sync() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
}

/// Milliseconds since boot (CLOCK_BOOTTIME, which counts suspend).
pub fn uptime_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the valid timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64) * 1000 + (ts.tv_nsec as u64) / 1_000_000
}

/// `uname -r`.
pub fn kernel_release() -> io::Result<String> {
    // SAFETY: utsname is plain old data; all-zero is a valid value.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uts is a valid, writable utsname.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let bytes: Vec<u8> = uts
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The value of `key=value` on a kernel command line (last one wins, as for the kernel).
pub fn cmdline_value<'a>(cmdline: &'a str, key: &str) -> Option<&'a str> {
    cmdline
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v)
        .next_back()
}

/// Where [`switch_root`] mounts the new root before moving it to `/`.
pub const NEW_ROOT: &str = "/mnt/root";
/// Mounts moved from the initramfs into the new root, in this order.
pub const MOVED_MOUNTS: [&str; 4] = ["/dev", "/proc", "/sys", "/tmp"];

fn mount_raw(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
) -> io::Result<()> {
    let source = source.map(path_cstring).transpose()?;
    let target = path_cstring(target)?;
    let fstype = fstype
        .map(|f| CString::new(f).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL)))
        .transpose()?;
    // SAFETY: every pointer is either null or a valid NUL-terminated string that outlives
    // the call; no mount data is passed.
    let rc = unsafe {
        libc::mount(
            source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            target.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Waits (bounded) for a device node to appear; devtmpfs creates it when the driver
/// probes the device.
pub fn wait_for_path(path: &Path, timeout: std::time::Duration) -> bool {
    let start = std::time::Instant::now();
    loop {
        if path.exists() {
            return true;
        }
        if start.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Makes the filesystem on `device` the root, keeping this process (PID 1) running: mount
/// it at [`NEW_ROOT`], move /dev, /proc, /sys and /tmp into it, move it onto `/` and
/// chroot there (what `switch_root` does, without exec'ing another init and without
/// deleting the initramfs, whose files are simply no longer reachable). Afterwards every
/// command the agent runs sees the disk's filesystem as `/`.
///
/// On an error before the final move, mounts already moved are moved back and the
/// initramfs stays the root.
pub fn switch_root(device: &Path, fstype: &str, read_only: bool) -> Result<(), Error> {
    let new_root = Path::new(NEW_ROOT);
    if !wait_for_path(device, std::time::Duration::from_secs(10)) {
        return Err(Error::os(
            format!("root device {}", device.display()),
            io::Error::from_raw_os_error(libc::ENOENT),
        ));
    }
    std::fs::create_dir_all(new_root).map_err(|e| Error::os(format!("create {NEW_ROOT}"), e))?;
    let flags = if read_only { libc::MS_RDONLY } else { 0 };
    mount_raw(Some(device), new_root, Some(fstype), flags).map_err(|e| {
        Error::os(
            format!("mount {} ({fstype}) on {NEW_ROOT}", device.display()),
            e,
        )
    })?;
    let mut moved: Vec<&str> = Vec::new();
    let result = (|| {
        for m in MOVED_MOUNTS {
            let dest = new_root.join(m.trim_start_matches('/'));
            if !dest.is_dir() {
                std::fs::create_dir_all(&dest)
                    .map_err(|e| Error::os(format!("create {}", dest.display()), e))?;
            }
            mount_raw(Some(Path::new(m)), &dest, None, libc::MS_MOVE)
                .map_err(|e| Error::os(format!("move {m} to {}", dest.display()), e))?;
            moved.push(m);
        }
        std::env::set_current_dir(new_root)
            .map_err(|e| Error::os(format!("chdir {NEW_ROOT}"), e))?;
        mount_raw(Some(Path::new(".")), Path::new("/"), None, libc::MS_MOVE)
            .map_err(|e| Error::os(format!("move {NEW_ROOT} to /"), e))
    })();
    if let Err(e) = result {
        for m in moved.iter().rev() {
            let from = new_root.join(m.trim_start_matches('/'));
            if let Err(e2) = mount_raw(Some(&from), Path::new(m), None, libc::MS_MOVE) {
                tracing::error!("moving {} back to {m}: {e2}", from.display());
            }
        }
        let _ = std::env::set_current_dir("/");
        if let Ok(t) = path_cstring(new_root) {
            // SAFETY: umount2 of a NUL-terminated path that outlives the call.
            unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
        }
        return Err(e);
    }
    // SAFETY: chroot(".") with a static NUL-terminated string.
    if unsafe { libc::chroot(c".".as_ptr()) } != 0 {
        return Err(Error::os("chroot", io::Error::last_os_error()));
    }
    std::env::set_current_dir("/").map_err(|e| Error::os("chdir /", e))?;
    Ok(())
}

/// Remounts `/` read-only (before power off, so a disk root is left clean); errors are
/// returned, e.g. EBUSY while files are open for writing.
pub fn remount_root_read_only() -> io::Result<()> {
    mount_raw(
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT | libc::MS_RDONLY,
    )
}

/// A path as a C string (fails on interior NUL bytes).
pub fn path_cstring(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// What `clade.net=ADDR/PREFIX[,GATEWAY]` on the kernel command line asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetSpec {
    pub addr: std::net::Ipv4Addr,
    pub prefix: u8,
    pub gateway: Option<std::net::Ipv4Addr>,
}

impl NetSpec {
    /// Parses `ADDR/PREFIX[,GATEWAY]` (IPv4; prefix 1..=32).
    pub fn parse(s: &str) -> Option<NetSpec> {
        let (cidr, gw) = match s.split_once(',') {
            Some((c, g)) => (c, Some(g.parse().ok()?)),
            None => (s, None),
        };
        let (addr, prefix) = cidr.split_once('/')?;
        let prefix: u8 = prefix.parse().ok()?;
        if !(1..=32).contains(&prefix) {
            return None;
        }
        Some(NetSpec {
            addr: addr.parse().ok()?,
            prefix,
            gateway: gw,
        })
    }

    fn netmask(&self) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::from(u32::MAX << (32 - u32::from(self.prefix)))
    }
}

fn sockaddr_in(a: std::net::Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(a).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) and sockaddr is
    // plain bytes: reinterpreting one as the other is how the socket API is used.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
    let b = name.as_bytes();
    if b.is_empty() || b.len() >= r.ifr_name.len() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    for (d, s) in r.ifr_name.iter_mut().zip(b) {
        *d = *s as libc::c_char;
    }
    Ok(r)
}

/// Brings the interface `name` up (and `lo`) with the address of `spec`, and a default
/// route through its gateway: the ioctls `ip addr`/`ip link`/`ip route` make, so the
/// agent needs no tool from the root filesystem.
pub fn configure_interface(name: &str, spec: &NetSpec) -> io::Result<()> {
    // SAFETY: socket has no memory preconditions; the descriptor is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor nothing else owns.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let ioctl = |req: libc::Ioctl, r: &mut libc::ifreq| -> io::Result<()> {
        // SAFETY: r is a valid ifreq for the request, which reads or fills only it.
        if unsafe { libc::ioctl(sock.as_raw_fd(), req, r as *mut libc::ifreq) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    let up = |ifname: &str| -> io::Result<()> {
        let mut r = ifreq(ifname)?;
        ioctl(libc::SIOCGIFFLAGS, &mut r)?;
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        unsafe { r.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
        ioctl(libc::SIOCSIFFLAGS, &mut r)
    };
    up("lo")?;
    let mut r = ifreq(name)?;
    r.ifr_ifru.ifru_addr = sockaddr_in(spec.addr);
    ioctl(libc::SIOCSIFADDR, &mut r)?;
    let mut r = ifreq(name)?;
    r.ifr_ifru.ifru_netmask = sockaddr_in(spec.netmask());
    ioctl(libc::SIOCSIFNETMASK, &mut r)?;
    up(name)?;
    if let Some(gw) = spec.gateway {
        // SAFETY: rtentry is plain data; all zeroes is a valid value.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr_in(std::net::Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr_in(std::net::Ipv4Addr::UNSPECIFIED);
        rt.rt_gateway = sockaddr_in(gw);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        // SAFETY: rt is a valid rtentry, read by SIOCADDRT only.
        if unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCADDRT,
                &mut rt as *mut libc::rtentry,
            )
        } != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_order_parsing_skips_blanks_and_comments() {
        let t = "# deps first\nvirtio_ring.ko\n\n  virtio.ko  # core\nvsock.ko\n";
        assert_eq!(
            parse_load_order(t),
            vec![
                PathBuf::from("virtio_ring.ko"),
                PathBuf::from("virtio.ko"),
                PathBuf::from("vsock.ko")
            ]
        );
    }

    #[test]
    fn missing_load_order_loads_nothing() {
        let dir = std::env::temp_dir().join(format!("clade-agent-nomods-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(load_modules(&dir).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn net_specs() {
        let s = NetSpec::parse("10.10.0.2/24,10.10.0.1").unwrap();
        assert_eq!(s.addr, std::net::Ipv4Addr::new(10, 10, 0, 2));
        assert_eq!(s.netmask(), std::net::Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(s.gateway, Some(std::net::Ipv4Addr::new(10, 10, 0, 1)));
        assert_eq!(
            NetSpec::parse("192.168.1.9/32").unwrap().netmask(),
            std::net::Ipv4Addr::BROADCAST
        );
        for bad in [
            "",
            "10.0.0.1",
            "10.0.0.1/0",
            "10.0.0.1/33",
            "10.0.0/24",
            "10.0.0.1/24,x",
            "a/b",
        ] {
            assert_eq!(NetSpec::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn cmdline_values() {
        let c = "console=ttyS0 clade.agent=ready-poweroff quiet clade.agent=serve panic=-1\n";
        assert_eq!(cmdline_value(c, "clade.agent"), Some("serve"));
        assert_eq!(cmdline_value(c, "panic"), Some("-1"));
        assert_eq!(cmdline_value(c, "quiet"), None);
        assert_eq!(cmdline_value(c, "clade"), None);
    }

    #[test]
    fn negative_clock_is_rejected_before_the_syscall() {
        assert_eq!(
            set_clock(-1).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
    }
}

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
/// on /dev/urandom; needs CAP_SYS_ADMIN).
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
    Ok(())
}

/// Flushes all filesystems.
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

/// A path as a C string (fails on interior NUL bytes).
pub fn path_cstring(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
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

//! A TAP device as a [`NetBackend`]: `/dev/net/tun` opened with
//! `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR` by interface name, or a TAP descriptor opened by
//! someone else (a jailed VMM is handed one before it drops its privileges).
//!
//! The TAP is set up for virtio 1.x frames: a 12-byte vnet header (`TUNSETVNETHDRSZ`) in
//! front of every frame both ways, non-blocking. Which offloads the host kernel takes is
//! probed when a new device first asks (`TUNSETOFFLOAD` with checksum + TSO, and UFO), then
//! switched off until the guest accepts them; a restored device does not ask (it sets the
//! offloads its saved guest was offered, which checks them in one call), so a restore's
//! path has no probe. The ioctls are the only `unsafe` code of the device; there is no
//! maintained crate for TAP setup that fits (the ones that exist bring their own async
//! runtimes or do not take a descriptor opened elsewhere), so this is our own.

use std::ffi::CStr;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use super::{offload, NetBackend, VNET_HDR_LEN};
use crate::{Error, Result};

/// The TUN/TAP clone device.
pub const TUN_PATH: &str = "/dev/net/tun";
/// Longest interface name (`IFNAMSIZ` with its NUL).
pub const MAX_NAME_LEN: usize = libc::IFNAMSIZ - 1;

/// The flags a TAP for virtio-net must have.
const TAP_FLAGS: libc::c_int = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;

/// An open TAP interface set up for virtio-net.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
    /// The offloads the kernel takes on it, probed on first use.
    caps: std::sync::OnceLock<u32>,
}

fn tap_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Tap { what, source }
}

/// Whether `name` is a name the kernel accepts for an interface (`dev_valid_name`).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace())
}

fn ifreq_with_name(name: &str) -> libc::ifreq {
    // SAFETY: `ifreq` is plain old data (a name array and a union of integers and
    // addresses); all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req
}

impl Tap {
    /// Opens (or creates, with CAP_NET_ADMIN) the TAP interface `name`.
    pub fn open(name: &str) -> Result<Self> {
        if !valid_name(name) {
            return Err(Error::Tap {
                what: format!("'{name}'"),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("not a valid interface name (1..={MAX_NAME_LEN} bytes, no '/', ':' or spaces)"),
                ),
            });
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(TUN_PATH)
            .map_err(tap_err(format!("'{name}': opening {TUN_PATH}")))?;
        let mut req = ifreq_with_name(name);
        req.ifr_ifru.ifru_flags = TAP_FLAGS as libc::c_short;
        // SAFETY: TUNSETIFF reads (and writes back) one `ifreq`, which lives across the call;
        // the descriptor is the tun device just opened.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        if r < 0 {
            return Err(tap_err(format!("'{name}': TUNSETIFF"))(
                std::io::Error::last_os_error(),
            ));
        }
        Self::setup(file, name.to_string())
    }

    /// Uses a TAP descriptor opened elsewhere (it is duplicated; the caller keeps its own).
    /// It must be a TAP with `IFF_NO_PI | IFF_VNET_HDR`.
    pub fn from_fd(fd: BorrowedFd<'_>) -> Result<Self> {
        let raw = fd.as_raw_fd();
        let owned: OwnedFd = fd
            .try_clone_to_owned()
            .map_err(tap_err(format!("descriptor {raw}")))?;
        let file = File::from(owned);
        let mut req = ifreq_with_name("");
        // SAFETY: TUNGETIFF writes one `ifreq`, which lives across the call; on anything but
        // a tun descriptor it fails without writing.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNGETIFF, &mut req) };
        if r < 0 {
            return Err(
                tap_err(format!("descriptor {raw}: TUNGETIFF (not a TAP?)"))(
                    std::io::Error::last_os_error(),
                ),
            );
        }
        // SAFETY: TUNGETIFF filled `ifr_flags` of the union.
        let flags = libc::c_int::from(unsafe { req.ifr_ifru.ifru_flags }) & 0xffff;
        if flags & TAP_FLAGS != TAP_FLAGS {
            return Err(Error::Tap {
                what: format!("descriptor {raw}"),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "flags {flags:#x}: needs IFF_TAP | IFF_NO_PI | IFF_VNET_HDR ({TAP_FLAGS:#x})"
                    ),
                ),
            });
        }
        // SAFETY: the kernel NUL-terminates the name within IFNAMSIZ; `ifr_name` is zeroed
        // beforehand, so its last byte stays NUL.
        let name = unsafe { CStr::from_ptr(req.ifr_name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: F_GETFL/F_SETFL only read and set the descriptor's status flags.
        let r = unsafe {
            let fl = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
            if fl < 0 {
                fl
            } else {
                libc::fcntl(file.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK)
            }
        };
        if r < 0 {
            return Err(tap_err(format!("'{name}': making it non-blocking"))(
                std::io::Error::last_os_error(),
            ));
        }
        Self::setup(file, name)
    }

    /// The 12-byte vnet header.
    fn setup(file: File, name: String) -> Result<Self> {
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int, which lives across the call.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr_len) };
        if r < 0 {
            return Err(tap_err(format!("'{name}': TUNSETVNETHDRSZ"))(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Self {
            file,
            name,
            caps: std::sync::OnceLock::new(),
        })
    }

    /// Which offloads the kernel takes on this TAP (checksum + TSO, and UFO), leaving them
    /// all off. A probe that cannot switch them off again reports none (the device then
    /// offers none, and the kernel hands it no offloaded frames it could not take back).
    fn probe_offloads(&self) -> u32 {
        let tso = offload::CSUM | offload::TSO4 | offload::TSO6;
        let caps = [tso | offload::UFO, tso]
            .into_iter()
            .find(|&caps| self.set_offloads(caps).is_ok())
            .unwrap_or(0);
        if let Err(e) = self.set_offloads(0) {
            tracing::error!("TAP {}: switching offloads off: {e}", self.name);
            return 0;
        }
        tracing::debug!("TAP {}: offloads {caps:#x} available", self.name);
        caps
    }

    /// The interface's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The TAP's descriptor (to hand it to another process, e.g. a jailed VMM).
impl AsFd for Tap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl NetBackend for Tap {
    fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&self.file).read(buf)
    }

    fn send(&self, frame: &[u8]) -> std::io::Result<usize> {
        (&self.file).write(frame)
    }

    fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn offload_capability(&self) -> u32 {
        *self.caps.get_or_init(|| self.probe_offloads())
    }

    fn set_offloads(&self, flags: u32) -> std::io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its flags by value (an unsigned long argument).
        let r = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(flags),
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_are_checked_like_the_kernel_does() {
        for ok in ["tap0", "clade-net-1", "a", "x".repeat(15).as_str()] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a:b", "a b", "x".repeat(16).as_str()] {
            assert!(!valid_name(bad), "{bad:?}");
        }
        let err = Tap::open("bad/name").unwrap_err();
        assert!(err.to_string().contains("interface name"), "{err}");
    }

    #[test]
    fn a_descriptor_that_is_not_a_tap_is_refused() {
        let f = File::open("/dev/null").unwrap();
        let err = Tap::from_fd(f.as_fd()).unwrap_err();
        assert!(err.to_string().contains("TUNGETIFF"), "{err}");
    }

    use std::os::fd::AsFd;
}

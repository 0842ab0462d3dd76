//! Creating the persistent TAP a sandbox's VMM attaches to.
//!
//! The TAP is made with the very flags the VMM opens it with (`IFF_TAP | IFF_NO_PI |
//! IFF_VNET_HDR`, devices/src/virtio/net/tap.rs) and marked persistent, so it outlives this
//! descriptor and the VMM later attaches to it by name from inside the namespace. No crate
//! wraps these two ioctls in a way that fits (the tun crates open and own the device), so
//! they are made here directly.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use crate::{io_err, Result};

/// The flags the VMM's virtio-net backend requires.
pub(crate) const TAP_FLAGS: libc::c_int = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;

/// Creates the persistent TAP `name` in the CALLING thread's network namespace.
pub(crate) fn create_persistent(name: &str) -> Result<()> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(io_err("open /dev/net/tun"))?;
    // SAFETY: an all-zero ifreq is a valid value of this plain C struct.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().take(15)) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = TAP_FLAGS as libc::c_short;
    // SAFETY: TUNSETIFF reads (and writes back) one ifreq, which lives across the call; the
    // descriptor is the tun device opened above.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        return Err(io_err(format!("TUNSETIFF {name}"))(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: TUNSETPERSIST takes an int by value; the descriptor is attached to the TAP.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        return Err(io_err(format!("TUNSETPERSIST {name}"))(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

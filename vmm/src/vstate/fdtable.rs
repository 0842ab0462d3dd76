//! The process's file descriptor table, grown ahead of need.
//!
//! Linux grows a process's descriptor table by doubling it when a new descriptor does not
//! fit, and in a process with more than one thread it then waits for an RCU grace period
//! before it frees the old table (`expand_fdtable`). That wait was measured at 12-13 ms on
//! this project's hosts. A VM holds ~25 descriptors (its KVM VM and vCPUs, eventfds,
//! sockets, memory files), so a process that builds VMs crosses 256, 512, 1024, ... and
//! the VM being built when it does waits: with 10 children of a fork, the ninth child took
//! 5-15 ms to build instead of ~0.5 ms. Growing the table where time is not counted (a
//! single-threaded process at its start waits for nothing; a VM shell is built ahead of
//! the VM that takes it) keeps the wait off the paths that build VMs.

use std::os::fd::{AsRawFd, RawFd};

use nix::fcntl::{fcntl, FcntlArg};

/// Room a shell reserves beyond twice the descriptors in use: a VM made from it, and as
/// many more as the process already holds.
const SPARE: usize = 256;

/// A duplicate of `fd` at the lowest free number at or above `min`, closed again.
fn dup_closed(fd: RawFd, min: RawFd) -> nix::Result<RawFd> {
    let d = fcntl(fd, FcntlArg::F_DUPFD_CLOEXEC(min))?;
    // Ours: opened just above, closed only here.
    let _ = nix::unistd::close(d);
    Ok(d)
}

/// Grows the table so that descriptors below `count` fit (nothing to do if they do).
/// `fd`: any open descriptor (it is duplicated, and the duplicate closed). Best effort:
/// a limit below `count` (`RLIMIT_NOFILE`) leaves the table as it is, logged at debug
/// level.
pub fn reserve_fd_table(fd: &impl AsRawFd, count: usize) {
    let Ok(last) = RawFd::try_from(count.saturating_sub(1)) else {
        return;
    };
    if let Err(e) = dup_closed(fd.as_raw_fd(), last) {
        tracing::debug!("descriptor table not grown to {count}: {e}");
    }
}

/// Grows the table to twice the descriptors in use plus [`SPARE`], where "in use" is the
/// lowest free descriptor number (descriptors are handed out lowest first). Called where a
/// VM shell is built, ahead of the VM that will take it.
pub(crate) fn reserve_for_another_vm(fd: &impl AsRawFd) {
    match dup_closed(fd.as_raw_fd(), 0) {
        Ok(lowest_free) => {
            let in_use = usize::try_from(lowest_free).unwrap_or(0);
            reserve_fd_table(fd, 2 * in_use + SPARE);
        }
        Err(e) => tracing::debug!("descriptor table not grown: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of this process's descriptor table (`FDSize` in /proc/self/status).
    fn table_size() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("FDSize:")).unwrap();
        line["FDSize:".len()..].trim().parse().unwrap()
    }

    #[test]
    fn the_table_is_grown_to_the_count_asked_for() {
        let f = std::fs::File::open("/dev/null").unwrap();
        reserve_fd_table(&f, 600);
        let size = table_size();
        assert!(size >= 600, "FDSize {size}");
        // Beyond any limit: refused, nothing else happens.
        reserve_fd_table(&f, usize::MAX);
        assert!(table_size() >= size);
    }

    #[test]
    fn a_shell_reserves_room_for_twice_the_descriptors_in_use() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let lowest_free = usize::try_from(dup_closed(f.as_raw_fd(), 0).unwrap()).unwrap();
        reserve_for_another_vm(&f);
        assert!(table_size() >= 2 * lowest_free + SPARE);
    }
}

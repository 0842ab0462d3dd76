//! Guest memory backed by one memfd, so later snapshots and forks can share or copy it by file
//! descriptor rather than by address.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

use crate::arch::layout::ram_ranges;
use crate::error::{Error, Result};

/// Guest RAM and the memfd behind it.
pub struct GuestRam {
    /// The mapped guest memory (MAP_SHARED of `file`).
    pub mem: GuestMemoryMmap,
    /// The memfd holding every region back to back, in guest address order.
    pub file: File,
}

/// Total RAM of the host, in MiB, from /proc/meminfo.
pub fn host_mem_mib() -> Result<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").map_err(|source| Error::Io {
        context: "reading /proc/meminfo",
        source,
    })?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib / 1024)
        .ok_or_else(|| Error::Memory("no MemTotal in /proc/meminfo".into()))
}

fn memfd(name: &str, size: u64) -> Result<File> {
    let cname = CString::new(name).map_err(|e| Error::Memory(e.to_string()))?;
    // SAFETY: memfd_create takes a valid NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Memory(format!(
            "memfd_create: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|e| Error::Memory(format!("sizing memfd to {size} bytes: {e}")))?;
    Ok(file)
}

/// Creates `mem_bytes` of guest RAM laid out around the MMIO gap. Pages are allocated lazily
/// by the host on first touch.
pub fn create(mem_bytes: u64) -> Result<GuestRam> {
    let file = memfd("clade-guest-ram", mem_bytes)?;
    let mut offset = 0u64;
    let mut regions = Vec::new();
    for (start, size) in ram_ranges(mem_bytes) {
        let fo = FileOffset::new(
            file.try_clone().map_err(|e| Error::Memory(e.to_string()))?,
            offset,
        );
        let region = GuestRegionMmap::from_range(GuestAddress(start), size as usize, Some(fo))
            .map_err(|e| Error::Memory(format!("mapping {size} bytes: {e}")))?;
        regions.push(region);
        offset += size;
    }
    let mem = GuestMemoryMmap::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))?;
    Ok(GuestRam { mem, file })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn memory_is_shared_with_the_memfd() {
        use std::os::unix::fs::FileExt;
        let ram = create(64 << 20).unwrap();
        ram.mem
            .write_obj(0x1234_5678u32, GuestAddress(0x1000))
            .unwrap();
        let mut b = [0u8; 4];
        ram.file.read_exact_at(&mut b, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0x1234_5678);
        assert_eq!(ram.mem.num_regions(), 1);
    }

    #[test]
    fn host_memory_is_known() {
        assert!(host_mem_mib().unwrap() > 0);
    }
}

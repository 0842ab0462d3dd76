//! Linux x86 boot protocol: load the kernel (bzImage or ELF) and initrd, write the command
//! line and boot_params (with the e820 map). The same path boots the project's test guest,
//! which is an ELF.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{load_cmdline, BzImage, Cmdline, Elf, KernelLoader};
use vm_memory::{Address, Bytes, GuestAddress};

use devices::GuestMemory;

use super::layout::*;
use crate::error::{Error, Result};

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;
const XLF_KERNEL_64: u16 = 1;
/// 64-bit entry point offset from the start of a bzImage's protected-mode code.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// Boot protocol 2.12 introduced xloadflags (and with it the 64-bit entry).
const MIN_BOOT_PROTOCOL: u16 = 0x020c;
const ELF_MAGIC: [u8; 4] = *b"\x7fELF";

/// What the vCPU needs to start the loaded kernel.
#[derive(Debug, Clone, Copy)]
pub struct BootInfo {
    /// 64-bit entry point.
    pub entry: u64,
}

/// Inputs of [`load`].
pub struct BootSpec<'a> {
    /// Kernel image path.
    pub kernel: &'a Path,
    /// Optional initrd path.
    pub initrd: Option<&'a Path>,
    /// Full command line (the VMM's own additions included).
    pub cmdline: &'a str,
    /// Guest memory size in bytes.
    pub mem_bytes: u64,
    /// Reserve the PVM VIF cells for this many vCPUs in the e820 map (0 = none).
    pub vif_cells: u64,
}

fn kernel_invalid(path: &Path, reason: impl ToString) -> Error {
    Error::KernelInvalid {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// True when `kernel` is an ELF image (vmlinux or the project's test guest), false for a
/// bzImage or anything else.
pub fn is_elf(kernel: &Path) -> Result<bool> {
    let mut magic = [0u8; 4];
    let mut f = File::open(kernel).map_err(|source| Error::KernelOpen {
        path: kernel.to_path_buf(),
        source,
    })?;
    Ok(f.read_exact(&mut magic).is_ok() && magic == ELF_MAGIC)
}

/// Loads everything needed to boot into `mem` and returns the entry point.
pub fn load(mem: &GuestMemory, spec: &BootSpec) -> Result<BootInfo> {
    let kernel_err = |source| Error::KernelOpen {
        path: spec.kernel.to_path_buf(),
        source,
    };
    let mut kernel = File::open(spec.kernel).map_err(kernel_err)?;
    let mut magic = [0u8; 4];
    kernel.read_exact(&mut magic).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            kernel_invalid(spec.kernel, "file is too short")
        } else {
            kernel_err(e)
        }
    })?;

    let mut params = boot_params::default();
    let (entry, kernel_end) = if magic == ELF_MAGIC {
        let r = Elf::load(mem, None, &mut kernel, Some(GuestAddress(HIMEM_START)))
            .map_err(|e| kernel_invalid(spec.kernel, e))?;
        params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
        params.hdr.header = KERNEL_HDR_MAGIC;
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
        (r.kernel_load.raw_value(), r.kernel_end)
    } else {
        let r = BzImage::load(mem, None, &mut kernel, Some(GuestAddress(HIMEM_START)))
            .map_err(|e| kernel_invalid(spec.kernel, e))?;
        let hdr = r
            .setup_header
            .ok_or_else(|| kernel_invalid(spec.kernel, "bzImage without a setup header"))?;
        if hdr.version < MIN_BOOT_PROTOCOL || hdr.xloadflags & XLF_KERNEL_64 == 0 {
            return Err(kernel_invalid(
                spec.kernel,
                "kernel has no 64-bit entry point (boot protocol >= 2.12 with XLF_KERNEL_64)",
            ));
        }
        params.hdr = hdr;
        (
            r.kernel_load.raw_value() + BZIMAGE_64BIT_ENTRY_OFFSET,
            r.kernel_end,
        )
    };
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;

    if let Some(initrd) = spec.initrd {
        let (addr, size) = load_initrd(mem, initrd, kernel_end, initrd_limit(&params, spec))?;
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }

    let mut cmdline = Cmdline::new(CMDLINE_MAX).map_err(|e| Error::Cmdline(e.to_string()))?;
    cmdline
        .insert_str(spec.cmdline)
        .map_err(|e| Error::Cmdline(e.to_string()))?;
    load_cmdline(mem, GuestAddress(CMDLINE_ADDR), &cmdline)
        .map_err(|e| Error::Cmdline(e.to_string()))?;
    params.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    params.hdr.cmdline_size = spec.cmdline.len() as u32 + 1;

    let e820 = e820_map(spec.mem_bytes, spec.vif_cells);
    if e820.len() > params.e820_table.len() {
        return Err(Error::Boot("too many e820 entries".into()));
    }
    for (slot, entry) in params.e820_table.iter_mut().zip(&e820) {
        *slot = *entry;
    }
    params.e820_entries = e820.len() as u8;
    params.acpi_rsdp_addr = ACPI_START;

    LinuxBootConfigurator::write_bootparams::<GuestMemory>(
        &BootParams::new(&params, GuestAddress(ZERO_PAGE_ADDR)),
        mem,
    )
    .map_err(|e| Error::Boot(format!("writing boot_params: {e}")))?;
    Ok(BootInfo { entry })
}

/// Highest address (exclusive) the initrd may end at.
fn initrd_limit(params: &boot_params, spec: &BootSpec) -> u64 {
    let low_ram_end = spec.mem_bytes.min(MMIO_GAP_START);
    let max = match params.hdr.initrd_addr_max {
        0 => 0x3fff_ffff, // protocol default before 2.03
        m => u64::from(m),
    };
    low_ram_end.min(max + 1)
}

/// Places the initrd page-aligned at the top of usable low memory, above the kernel.
fn load_initrd(mem: &GuestMemory, path: &Path, kernel_end: u64, limit: u64) -> Result<(u64, u64)> {
    let open_err = |source| Error::InitrdOpen {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(open_err)?;
    let size = file.seek(SeekFrom::End(0)).map_err(open_err)?;
    file.rewind().map_err(open_err)?;
    let available = limit.saturating_sub(kernel_end);
    if size == 0 || size > available || size > u64::from(u32::MAX) {
        if size == 0 {
            return Err(Error::InitrdOpen {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, "file is empty"),
            });
        }
        return Err(Error::InitrdTooLarge {
            path: path.to_path_buf(),
            size,
            available,
        });
    }
    let addr = (limit - size) & !0xfff;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)
        .map_err(|e| Error::Boot(format!("reading initrd {}: {e}", path.display())))?;
    Ok((addr, size))
}

/// The guest's e820 map: low RAM (minus the PVM VIF cells), the legacy hole (with the ACPI
/// tables) reserved, and RAM above 1 MiB split around the MMIO gap.
pub fn e820_map(mem_bytes: u64, vif_cells: u64) -> Vec<boot_e820_entry> {
    let e = |addr, size, r#type| boot_e820_entry { addr, size, r#type };
    let mut map = Vec::new();
    if vif_cells > 0 {
        let vif_end = PVM_VIF_BASE + vif_cells * 0x1000;
        map.push(e(0, PVM_VIF_BASE, E820_RAM));
        map.push(e(PVM_VIF_BASE, vif_cells * 0x1000, E820_RESERVED));
        if vif_end < EBDA_START {
            map.push(e(vif_end, EBDA_START - vif_end, E820_RAM));
        }
    } else {
        map.push(e(0, EBDA_START, E820_RAM));
    }
    map.push(e(EBDA_START, HIMEM_START - EBDA_START, E820_RESERVED));
    for (start, size) in ram_ranges(mem_bytes) {
        let start_hi = start.max(HIMEM_START);
        if start + size > start_hi {
            map.push(e(start_hi, start + size - start_hi, E820_RAM));
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e820_covers_low_ram_and_reserves_vif_cells() {
        let m = e820_map(256 << 20, 0);
        assert_eq!(
            (m[0].addr, m[0].size, m[0].r#type),
            (0, EBDA_START, E820_RAM)
        );
        assert_eq!(m.last().unwrap().addr + m.last().unwrap().size, 256 << 20);
        let m = e820_map(8 << 30, 2);
        let (a1, t1, a2) = (m[1].addr, m[1].r#type, m[2].addr);
        assert_eq!((a1, t1), (PVM_VIF_BASE, E820_RESERVED));
        assert_eq!(a2, PVM_VIF_BASE + 0x2000);
        // The VM generation ID page is reserved, never RAM.
        for map in [e820_map(256 << 20, 0), e820_map(256 << 20, 4)] {
            let covers = |e: &boot_e820_entry| {
                let (addr, size, t) = (e.addr, e.size, e.r#type);
                (addr <= VMGENID_ADDR && VMGENID_ADDR + 0x1000 <= addr + size).then_some(t)
            };
            let types: Vec<u32> = map.iter().filter_map(covers).collect();
            assert_eq!(types, vec![E820_RESERVED]);
            let overlaps_ram = map.iter().any(|e| {
                let (addr, size, t) = (e.addr, e.size, e.r#type);
                t == E820_RAM && addr < VMGENID_ADDR + 0x1000 && VMGENID_ADDR < addr + size
            });
            assert!(!overlaps_ram);
        }
        let high = m.last().unwrap();
        assert_eq!(
            (high.addr, high.size),
            (MMIO_GAP_END, (8 << 30) - MMIO_GAP_START)
        );
    }

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap()
    }

    fn spec<'a>(kernel: &'a Path, initrd: Option<&'a Path>) -> BootSpec<'a> {
        BootSpec {
            kernel,
            initrd,
            cmdline: "console=ttyS0",
            mem_bytes: 64 << 20,
            vif_cells: 0,
        }
    }

    #[test]
    fn garbage_kernels_are_rejected_with_a_reason() {
        let dir = std::env::temp_dir().join(format!("clade-boot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty");
        std::fs::write(&empty, b"").unwrap();
        let e = load(&mem(), &spec(&empty, None)).unwrap_err().to_string();
        assert!(e.contains("too short"), "{e}");
        let junk = dir.join("junk");
        std::fs::write(&junk, vec![0x5a; 8192]).unwrap();
        let e = load(&mem(), &spec(&junk, None)).unwrap_err().to_string();
        assert!(e.contains("not a usable x86_64 kernel"), "{e}");
        let bad_elf = dir.join("bad.elf");
        let mut b = b"\x7fELF".to_vec();
        b.resize(100, 0xff);
        std::fs::write(&bad_elf, b).unwrap();
        let e = load(&mem(), &spec(&bad_elf, None)).unwrap_err().to_string();
        assert!(e.contains("not a usable x86_64 kernel"), "{e}");
        let missing = dir.join("missing");
        let e = load(&mem(), &spec(&missing, None)).unwrap_err().to_string();
        assert!(e.contains("No such file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn initrd_larger_than_memory_is_rejected() {
        let dir = std::env::temp_dir().join(format!("clade-initrd-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let big = dir.join("big");
        let f = File::create(&big).unwrap();
        f.set_len(128 << 20).unwrap(); // sparse, larger than the 64 MiB guest
        let e = load_initrd(&mem(), &big, 2 << 20, 64 << 20).unwrap_err();
        assert!(matches!(e, Error::InitrdTooLarge { .. }), "{e}");
        let small = dir.join("small");
        std::fs::write(&small, vec![7u8; 10000]).unwrap();
        let (addr, size) = load_initrd(&mem(), &small, 2 << 20, 64 << 20).unwrap();
        assert_eq!(size, 10000);
        assert_eq!(addr % 4096, 0);
        assert!(addr + size <= 64 << 20);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

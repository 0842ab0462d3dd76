//! Guest-physical memory layout.
//!
//! ```text
//! 0x0000_0500  GDT              0x0000_0520  IDT (empty)
//! 0x0000_7000  boot_params      0x0000_8ff0  initial stack
//! 0x0001_0000  PML4, PDPT, 4 PDs (identity map of 4 GiB; CR3 bit 12 clear, see PVM notes)
//! 0x0002_0000  kernel command line
//! 0x0008_0000  PVM virtual-interrupt-flag cells, one page per vCPU (reserved in e820)
//! 0x0009_fc00  EBDA .. 1 MiB    reserved; ACPI tables from 0xe_0000, the VM generation ID
//!              page at 0xf_f000
//! 0x0010_0000  high memory: kernel, initrd (at the top of low RAM)
//! 0xc000_0000  MMIO gap up to 4 GiB: devices, IOAPIC, LAPIC
//!              0xd000_0000 test device, 0xd000_1000.. virtio-mmio slots (4 KiB each)
//! 0x1_0000_0000 RAM above 3 GiB continues here
//! ```

/// Global descriptor table.
pub const GDT_ADDR: u64 = 0x500;
/// Interrupt descriptor table (left empty: the guest installs its own).
pub const IDT_ADDR: u64 = 0x520;
/// Linux "zero page" (struct boot_params).
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial stack pointer.
pub const BOOT_STACK: u64 = 0x8ff0;
/// Boot page tables. PML4 must not have bit 12 set on the PVM hypervisor.
pub const PML4_ADDR: u64 = 0x10000;
/// Page-directory-pointer table.
pub const PDPT_ADDR: u64 = 0x11000;
/// First of four page directories (2 MiB pages, 4 GiB).
pub const PD_ADDR: u64 = 0x12000;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x20000;
/// Longest command line accepted (Linux's COMMAND_LINE_SIZE on x86 is 2048).
pub const CMDLINE_MAX: usize = 2048;
/// PVM virtual interrupt flag cells: vCPU `i` uses `PVM_VIF_BASE + i * 0x1000`.
pub const PVM_VIF_BASE: u64 = 0x80000;
/// How many VIF cells fit below the EBDA.
pub const PVM_VIF_MAX: u64 = (EBDA_START - PVM_VIF_BASE) / 0x1000;
/// Start of the extended BIOS data area; usable low RAM ends here.
pub const EBDA_START: u64 = 0x9fc00;
/// ACPI tables (RSDP first; Linux also scans here).
pub const ACPI_START: u64 = 0xe0000;
/// End of the ACPI table area (the VM generation ID page follows).
pub const ACPI_END: u64 = VMGENID_ADDR;
/// The VM generation ID (16 bytes at the start of the last page below 1 MiB, in the
/// reserved legacy area: the guest kernel never uses it as RAM).
pub const VMGENID_ADDR: u64 = 0xff000;
/// Where the kernel may be loaded and where high memory starts.
pub const HIMEM_START: u64 = 0x100000;
/// Start of the 32-bit MMIO hole; RAM above it is moved beyond 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the 32-bit MMIO hole.
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Test device MMIO window (project test guest only).
pub const TEST_MMIO_BASE: u64 = 0xd000_0000;
/// First virtio-mmio slot: slot `n` is at `VIRTIO_MMIO_BASE + n * VIRTIO_MMIO_SLOT_SIZE`.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_1000;
/// Size of one virtio-mmio register window.
pub const VIRTIO_MMIO_SLOT_SIZE: u64 = 0x1000;
/// IOAPIC pin of virtio-mmio slot 0; slot `n` uses `VIRTIO_MMIO_GSI_BASE + n` (edge, high).
pub const VIRTIO_MMIO_GSI_BASE: u32 = 6;
/// Most virtio-mmio slots: GSIs 6..=23 are the IOAPIC's remaining pins.
pub const VIRTIO_MMIO_MAX_SLOTS: u32 = 18;
/// IOAPIC registers.
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
/// Local APIC registers.
pub const LAPIC_ADDR: u64 = 0xfee0_0000;

/// Legacy I/O ports and interrupt lines.
pub mod pio {
    /// COM1.
    pub const SERIAL_COM1: u16 = 0x3f8;
    /// COM1's ISA IRQ.
    pub const SERIAL_COM1_GSI: u32 = 4;
    /// i8042 controller (0x60..=0x64).
    pub const I8042: u16 = 0x60;
    /// ACPI sleep control / reset register (hardware-reduced ACPI).
    pub const ACPI_PM: u16 = 0x3c0;
    /// Test device interrupt line.
    pub const TEST_DEVICE_GSI: u32 = 5;
    /// The ACPI generic event device's interrupt (VM generation ID changes): COM2's ISA
    /// line, unused here (GSIs 4 and 5 are COM1 and the test device, 6..=23 virtio-mmio).
    pub const GED_GSI: u32 = 3;
}

/// The guest RAM ranges (guest address, size) for `mem_bytes` of memory.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(u64, u64)> {
    if mem_bytes <= MMIO_GAP_START {
        vec![(0, mem_bytes)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_bytes - MMIO_GAP_START),
        ]
    }
}

/// Where one virtio-mmio device sits, as the guest must be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioSlot {
    /// Base of the register window.
    pub base: u64,
    /// Size of the window.
    pub len: u64,
    /// IOAPIC pin (GSI) of its interrupt: edge-triggered, active high.
    pub gsi: u32,
    /// virtio device id.
    pub device_type: u32,
}

impl VirtioSlot {
    /// The kernel command-line entry for `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES` kernels.
    pub fn cmdline_entry(&self) -> String {
        format!(
            "virtio_mmio.device={}K@{:#x}:{}",
            self.len >> 10,
            self.base,
            self.gsi
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_splits_around_the_mmio_gap() {
        assert_eq!(ram_ranges(256 << 20), vec![(0, 256 << 20)]);
        assert_eq!(ram_ranges(MMIO_GAP_START), vec![(0, MMIO_GAP_START)]);
        assert_eq!(
            ram_ranges(16 << 30),
            vec![
                (0, MMIO_GAP_START),
                (MMIO_GAP_END, (16 << 30) - MMIO_GAP_START)
            ]
        );
        const { assert!(PML4_ADDR & 0x1000 == 0) };
        // virtio-mmio slots stay clear of the test device, its GSI and the IOAPIC's 24 pins.
        const { assert!(VIRTIO_MMIO_BASE >= TEST_MMIO_BASE + 0x1000) };
        const { assert!(VIRTIO_MMIO_GSI_BASE > pio::TEST_DEVICE_GSI) };
        const { assert!(VIRTIO_MMIO_GSI_BASE + VIRTIO_MMIO_MAX_SLOTS <= 24) };
        const {
            assert!(
                VIRTIO_MMIO_BASE + VIRTIO_MMIO_MAX_SLOTS as u64 * VIRTIO_MMIO_SLOT_SIZE
                    <= IOAPIC_ADDR
            )
        };
        const { assert!(PVM_VIF_MAX >= 16) };
        // The generation ID page is in the reserved legacy area, after the ACPI tables.
        const { assert!(VMGENID_ADDR >= ACPI_START && VMGENID_ADDR + 0x1000 <= HIMEM_START) };
        const { assert!(VMGENID_ADDR >= EBDA_START && VMGENID_ADDR.is_multiple_of(0x1000)) };
        const { assert!(pio::GED_GSI != pio::SERIAL_COM1_GSI && pio::GED_GSI < pio::TEST_DEVICE_GSI) };
    }
}

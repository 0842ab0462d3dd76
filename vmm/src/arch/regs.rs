//! Initial vCPU state for a 64-bit entry: GDT, identity-mapped page tables, control
//! registers, general registers, FPU and local APIC LINT pins.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress};

use devices::GuestMemory;

use super::layout::*;
use crate::error::{Error, Result};

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_AM: u64 = 1 << 18;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
// Rust guests use SSE, which faults without OSFXSR/OSXMMEXCPT.
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// Selectors: the GDT is null, code64 (0x8), data (0x10), TSS (0x18).
pub const CODE_SELECTOR: u16 = 0x8;
/// Data segment selector.
pub const DATA_SELECTOR: u16 = 0x10;
/// Task state segment selector.
pub const TSS_SELECTOR: u16 = 0x18;

/// A GDT descriptor from flags (type/S/DPL/P in bits 0..8, AVL/L/DB/G in 12..16), base, limit.
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0xffff)
        | ((limit as u64 & 0xf_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
}

const GDT: [u64; 4] = [
    gdt_entry(0, 0, 0),
    gdt_entry(0xa09b, 0, 0xfffff), // code: present, exec/read, L=1, G=1
    gdt_entry(0xc093, 0, 0xfffff), // data: present, read/write, DB=1, G=1
    gdt_entry(0x808b, 0, 0xfffff), // busy 64-bit TSS
];

/// The `kvm_segment` KVM wants for a GDT entry (the hidden part of a segment register).
fn segment_from_gdt(entry: u64, selector: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000);
    let limit = (entry & 0xffff) | ((entry >> 32) & 0xf_0000);
    let g = ((entry >> 55) & 1) as u8;
    kvm_segment {
        base,
        // With 4 KiB granularity the effective limit covers whole pages.
        limit: if g == 1 {
            ((limit << 12) | 0xfff) as u32
        } else {
            limit as u32
        },
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

fn write_mem<T: vm_memory::ByteValued>(mem: &GuestMemory, addr: u64, val: T) -> Result<()> {
    mem.write_obj(val, GuestAddress(addr))
        .map_err(|e| Error::Boot(format!("writing at {addr:#x}: {e}")))
}

/// present | writable | user. The user bit matters on the PVM hypervisor, which runs the
/// guest kernel deprivileged: without it the guest cannot use its own boot mappings.
const PTE_FLAGS: u64 = 0x7;
/// 2 MiB page.
const PTE_HUGE: u64 = 0x80;

/// Writes the GDT, an empty IDT and page tables identity-mapping 4 GiB with 2 MiB pages
/// (enough for the kernel, boot structures, and MMIO devices the test guest touches).
pub fn write_boot_tables(mem: &GuestMemory) -> Result<()> {
    for (i, entry) in GDT.iter().enumerate() {
        write_mem(mem, GDT_ADDR + 8 * i as u64, *entry)?;
    }
    write_mem(mem, IDT_ADDR, 0u64)?;
    write_mem(mem, PML4_ADDR, PDPT_ADDR | PTE_FLAGS)?;
    for g in 0..4u64 {
        let pd = PD_ADDR + g * 0x1000;
        write_mem(mem, PDPT_ADDR + g * 8, pd | PTE_FLAGS)?;
        let table: Vec<u8> = (0..512u64)
            .flat_map(|i| ((g << 30) | (i << 21) | PTE_FLAGS | PTE_HUGE).to_le_bytes())
            .collect();
        mem.write_slice(&table, GuestAddress(pd))
            .map_err(|e| Error::Boot(format!("writing page directory: {e}")))?;
    }
    Ok(())
}

/// Special registers for 64-bit long mode entry, starting from KVM's defaults in `sregs`.
pub fn long_mode_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    let code = segment_from_gdt(GDT[1], CODE_SELECTOR);
    let data = segment_from_gdt(GDT[2], DATA_SELECTOR);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment_from_gdt(GDT[3], TSS_SELECTOR);
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (std::mem::size_of_val(&GDT) - 1) as u16;
    sregs.idt.base = IDT_ADDR;
    sregs.idt.limit = 7;
    sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_AM | CR0_PG;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT;
    sregs.efer = EFER_LME | EFER_LMA;
    sregs
}

/// General registers: Linux's 64-bit boot protocol wants boot_params in RSI.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK,
        rbp: BOOT_STACK,
        rsi: ZERO_PAGE_ADDR,
        ..Default::default()
    }
}

/// x87/SSE state after FNINIT with SSE exceptions masked.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(state: &kvm_lapic_state, off: usize) -> u32 {
    let b = &state.regs[off..off + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(state: &mut kvm_lapic_state, off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        state.regs[off + i] = *b as _;
    }
}

/// LINT0 as ExtINT (the PIC's output) and LINT1 as NMI, as PC firmware leaves them.
pub fn set_lint(mut state: kvm_lapic_state) -> kvm_lapic_state {
    let set_mode = |v: u32, mode: u32| (v & !0x700) | (mode << 8);
    let lvt0 = lapic_reg(&state, APIC_LVT0);
    set_lapic_reg(&mut state, APIC_LVT0, set_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = lapic_reg(&state, APIC_LVT1);
    set_lapic_reg(&mut state, APIC_LVT1, set_mode(lvt1, APIC_MODE_NMI));
    state
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_segments_decode_to_long_mode_code_and_flat_data() {
        let cs = segment_from_gdt(GDT[1], CODE_SELECTOR);
        assert_eq!((cs.l, cs.db, cs.present, cs.type_, cs.s), (1, 0, 1, 0xb, 1));
        assert_eq!(cs.limit, 0xffff_ffff);
        let ds = segment_from_gdt(GDT[2], DATA_SELECTOR);
        assert_eq!((ds.l, ds.db, ds.type_), (0, 1, 3));
        // The reference encodings for these descriptors.
        assert_eq!(GDT[1], 0x00af_9b00_0000_ffff);
        assert_eq!(GDT[2], 0x00cf_9300_0000_ffff);
    }

    #[test]
    fn page_tables_identity_map_4g() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_boot_tables(&mem).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_ADDR)).unwrap();
        assert_eq!(pml4 & !0xfff, PDPT_ADDR);
        let pdpt3: u64 = mem.read_obj(GuestAddress(PDPT_ADDR + 24)).unwrap();
        let pd3_last: u64 = mem
            .read_obj(GuestAddress((pdpt3 & !0xfff) + 511 * 8))
            .unwrap();
        assert_eq!(pd3_last & !0xfff, 0xffe0_0000);
    }

    #[test]
    fn lint_pins_get_extint_and_nmi() {
        let s = set_lint(kvm_lapic_state::default());
        assert_eq!((lapic_reg(&s, APIC_LVT0) >> 8) & 7, APIC_MODE_EXTINT);
        assert_eq!((lapic_reg(&s, APIC_LVT1) >> 8) & 7, APIC_MODE_NMI);
    }
}

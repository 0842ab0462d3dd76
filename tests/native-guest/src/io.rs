//! Port I/O, MMIO and CPU primitives.
//!
//! MMIO helpers take 64-bit physical addresses (identity-mapped): a 32-bit
//! absolute address such as 0xd000_0000 in an instruction's displacement would
//! be sign-extended to 0xffff_ffff_d000_0000.

use core::arch::asm;
use core::ptr::{read_volatile, write_volatile};

pub fn outb(port: u16, val: u8) {
    // SAFETY: port I/O has no memory effects visible to Rust.
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") val, options(nomem, nostack, preserves_flags))
    }
}

pub fn inb(port: u16) -> u8 {
    let val: u8;
    // SAFETY: as above.
    unsafe {
        asm!("in al, dx", in("dx") port, out("al") val, options(nomem, nostack, preserves_flags))
    }
    val
}

pub fn outl(port: u16, val: u32) {
    // SAFETY: as above.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") val, options(nomem, nostack, preserves_flags))
    }
}

pub fn inl(port: u16) -> u32 {
    let val: u32;
    // SAFETY: as above.
    unsafe {
        asm!("in eax, dx", in("dx") port, out("eax") val, options(nomem, nostack, preserves_flags))
    }
    val
}

pub fn mmio_read32(addr: u64) -> u32 {
    // SAFETY: callers pass device register addresses inside the identity map.
    unsafe { read_volatile(addr as *const u32) }
}

pub fn mmio_write32(addr: u64, val: u32) {
    // SAFETY: as above.
    unsafe { write_volatile(addr as *mut u32, val) }
}

pub fn mmio_read64(addr: u64) -> u64 {
    // SAFETY: as above.
    unsafe { read_volatile(addr as *const u64) }
}

pub fn mmio_write64(addr: u64, val: u64) {
    // SAFETY: as above.
    unsafe { write_volatile(addr as *mut u64, val) }
}

/// Halt until the next interrupt. Not `nomem`: it doubles as a compiler
/// barrier so flags set by interrupt handlers are re-read after it.
pub fn hlt() {
    // SAFETY: hlt only waits.
    unsafe { asm!("hlt", options(nostack, preserves_flags)) }
}

//! The VMM's test device: an exit port, a magic port and a small MMIO window
//! that can raise a repeating edge interrupt on GSI 5.

use crate::io::{hlt, inl, mmio_read32, mmio_read64, mmio_write32, mmio_write64, outl};

pub const MAGIC: u32 = 0x434C_4144; // "CLAD"
pub const GSI: u8 = 5;

const EXIT_PORT: u16 = 0xf4;
const MAGIC_PORT: u16 = 0xf8;

const MMIO_BASE: u64 = 0xD000_0000;
const REG_MAGIC: u64 = MMIO_BASE; // u32, read-only
const REG_SCRATCH: u64 = MMIO_BASE + 0x8; // u64, read/write
const REG_ARM: u64 = MMIO_BASE + 0x10; // write: raise GSI 5 every ~1 ms
const REG_ACK: u64 = MMIO_BASE + 0x18; // write: stop raising

/// Ends the VM with `code` as the guest's result.
pub fn exit(code: u32) -> ! {
    outl(EXIT_PORT, code);
    // Only reached if the VMM resumes us anyway.
    loop {
        hlt();
    }
}

pub fn pio_magic() -> u32 {
    inl(MAGIC_PORT)
}

pub fn mmio_magic() -> u32 {
    mmio_read32(REG_MAGIC)
}

pub fn write_scratch(v: u64) {
    mmio_write64(REG_SCRATCH, v)
}

pub fn read_scratch() -> u64 {
    mmio_read64(REG_SCRATCH)
}

pub fn arm() {
    mmio_write32(REG_ARM, 1)
}

pub fn ack() {
    mmio_write32(REG_ACK, 1)
}

//! Interrupt controllers: legacy 8259 PICs (masked), local APIC and IOAPIC,
//! all at their standard xAPIC addresses.

use crate::io::{mmio_read32, mmio_write32, outb};

const LAPIC: u64 = 0xFEE0_0000;
const LAPIC_ID: u64 = 0x20;
const LAPIC_EOI: u64 = 0xB0;
const LAPIC_SVR: u64 = 0xF0;
const LAPIC_LVT_TIMER: u64 = 0x320;
const LAPIC_TIMER_INIT: u64 = 0x380;
const LAPIC_TIMER_DIV: u64 = 0x3E0;

const IOAPIC_SEL: u64 = 0xFEC0_0000;
const IOAPIC_WIN: u64 = 0xFEC0_0010;
const IOAPIC_REDIR: u32 = 0x10;

const MASKED: u32 = 1 << 16;

/// Mask both PICs so nothing arrives through LINT0 (ExtINT) behind our back.
pub fn mask_pics() {
    outb(0x21, 0xff);
    outb(0xa1, 0xff);
}

fn lapic_read(reg: u64) -> u32 {
    mmio_read32(LAPIC + reg)
}

fn lapic_write(reg: u64, val: u32) {
    mmio_write32(LAPIC + reg, val)
}

/// Software-enable the local APIC with the given spurious vector.
pub fn lapic_enable(spurious_vector: u8) {
    let svr = lapic_read(LAPIC_SVR) & !0xff;
    lapic_write(LAPIC_SVR, svr | 1 << 8 | spurious_vector as u32);
}

pub fn lapic_id() -> u8 {
    (lapic_read(LAPIC_ID) >> 24) as u8
}

pub fn eoi() {
    lapic_write(LAPIC_EOI, 0)
}

/// One-shot local APIC timer, divide-by-1. Under KVM the timer counts at
/// 1 GHz, so `count` is roughly nanoseconds (elsewhere: bus clock ticks).
/// One-shot rather than periodic: KVM only honours the periodic mode bit
/// once the VMM has set CPUID, and re-arming from the handler is trivial.
pub fn timer_oneshot(vector: u8, count: u32) {
    lapic_write(LAPIC_TIMER_DIV, 0b1011);
    lapic_write(LAPIC_LVT_TIMER, vector as u32);
    lapic_write(LAPIC_TIMER_INIT, count);
}

pub fn timer_stop() {
    lapic_write(LAPIC_LVT_TIMER, MASKED);
    lapic_write(LAPIC_TIMER_INIT, 0);
}

fn ioapic_write(reg: u32, val: u32) {
    mmio_write32(IOAPIC_SEL, reg);
    mmio_write32(IOAPIC_WIN, val);
}

/// Route IOAPIC `pin` to `vector` on APIC `dest`: fixed delivery, physical
/// destination, edge-triggered, active high, unmasked.
pub fn ioapic_route(pin: u8, vector: u8, dest: u8) {
    let reg = IOAPIC_REDIR + 2 * pin as u32;
    ioapic_write(reg + 1, (dest as u32) << 24);
    ioapic_write(reg, vector as u32); // low half last: this unmasks
}

pub fn ioapic_mask(pin: u8) {
    ioapic_write(IOAPIC_REDIR + 2 * pin as u32, MASKED);
}

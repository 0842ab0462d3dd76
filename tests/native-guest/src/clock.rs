//! Time since the guest started: the TSC, calibrated once against PIT channel 2 (a fixed
//! 1.193182 MHz clock; KVM's in-kernel PIT emulates it from host time).

use crate::io::{inb, outb};
use core::sync::atomic::{AtomicU64, Ordering};

const PIT_HZ: u64 = 1_193_182;
const PIT_CH2: u16 = 0x42;
const PIT_MODE: u16 = 0x43;
/// Port B: bit 0 gates channel 2, bit 1 drives the speaker, bit 5 reads channel 2's output.
const PORT_B: u16 = 0x61;
const CALIBRATION_MS: u64 = 10;
const CALIBRATION_RUNS: u32 = 3;

static START_TSC: AtomicU64 = AtomicU64::new(0);
/// TSC ticks per millisecond; 0 until calibrated.
static TSC_PER_MS: AtomicU64 = AtomicU64::new(0);

pub fn rdtsc() -> u64 {
    // SAFETY: rdtsc only reads the time-stamp counter.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// Remembers the TSC at guest start (call first thing).
pub fn init() {
    START_TSC.store(rdtsc(), Ordering::Relaxed);
}

/// Measures the TSC rate against PIT channel 2: the fastest of a few 10 ms runs, since the
/// vCPU being descheduled can only make a run look longer. Returns ticks per millisecond, or
/// None if the PIT's output never rose.
pub fn calibrate() -> Option<u64> {
    if let v @ 1.. = TSC_PER_MS.load(Ordering::Relaxed) {
        return Some(v);
    }
    let per_ms = (0..CALIBRATION_RUNS).map(|_| pit_run()).min()??;
    if per_ms == 0 {
        return None;
    }
    TSC_PER_MS.store(per_ms, Ordering::Relaxed);
    Some(per_ms)
}

/// TSC ticks per millisecond over one 10 ms period of PIT channel 2 in mode 0 (its output
/// goes high at terminal count), as Linux's `pit_calibrate_tsc` does.
fn pit_run() -> Option<u64> {
    let latch = (PIT_HZ * CALIBRATION_MS / 1000) as u16;
    outb(PORT_B, (inb(PORT_B) & !0x02) | 0x01); // gate high, speaker off
    outb(PIT_MODE, 0b1011_0000); // channel 2, lobyte/hibyte, mode 0, binary
    outb(PIT_CH2, latch as u8);
    outb(PIT_CH2, (latch >> 8) as u8);
    let t0 = rdtsc();
    // Bounded: each `in` is an exit, far slower than 10 ms / 10^6.
    let mut polls = 0u32;
    while inb(PORT_B) & 0x20 == 0 {
        polls += 1;
        if polls > 1_000_000 {
            return None;
        }
    }
    Some((rdtsc() - t0) / CALIBRATION_MS)
}

/// A TSC value `ms` milliseconds from now; if the TSC is not calibrated, assume 1 GHz
/// (only used to bound waits, never to report time).
pub fn deadline_ms(ms: u64) -> u64 {
    let per_ms = match TSC_PER_MS.load(Ordering::Relaxed) {
        0 => 1_000_000,
        v => v,
    };
    rdtsc().saturating_add(ms.saturating_mul(per_ms))
}

/// TSC ticks in `us` microseconds (1 GHz assumed if not calibrated).
pub fn us_to_ticks(us: u64) -> u64 {
    let per_ms = match TSC_PER_MS.load(Ordering::Relaxed) {
        0 => 1_000_000,
        v => v,
    };
    us.saturating_mul(per_ms) / 1000
}

/// True once the TSC has passed `deadline`.
pub fn passed(deadline: u64) -> bool {
    rdtsc() >= deadline
}

/// Milliseconds since `init`; 0 if the TSC was never calibrated.
pub fn uptime_ms() -> u64 {
    match TSC_PER_MS.load(Ordering::Relaxed) {
        0 => 0,
        per_ms => rdtsc().wrapping_sub(START_TSC.load(Ordering::Relaxed)) / per_ms,
    }
}

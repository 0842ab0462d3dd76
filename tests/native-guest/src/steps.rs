//! The test steps named by `steps=` on the command line.
//!
//! Each step returns Ok or a one-line failure reason; `run` prints
//! "step <name> ok" / "step <name> FAIL <reason>" and computes the exit code.

use crate::{apic, interrupts, io, memtest, testdev, vsock};
use core::arch::asm;
use core::fmt::{self, Write};
use core::sync::atomic::{AtomicU32, Ordering};

enum Step {
    Hello,
    Pio,
    Mmio,
    Hlt,
    /// 2^n iterations of a tight loop.
    Loop(u32),
    /// ACPI S5 through the FADT's sleep control register (ends the VM).
    PowerOff,
    /// CPU reset through the i8042 controller (ends the VM).
    ResetKbd,
    /// Reset through the FADT's reset register (ends the VM).
    ResetAcpi,
    /// Serve agent-protocol connections on virtio-vsock port 52 (several at once) until the
    /// host stops the VM, or until `conns` connections ended; each connection is closed by
    /// the guest after `pings` pongs if that is given.
    Vsock {
        conns: Option<u32>,
        pings: Option<u32>,
    },
    /// Fill MiB of memory from 64 MiB with a pattern from SEED.
    MemFill(u64, u64),
    /// Checksum the memory filled so far: printed and put in the test device's scratch
    /// register.
    MemSum,
    /// Keep rewriting MiB of memory from 64 MiB, forever (the host stops the VM).
    MemChurn(u64),
    /// Wait until the host puts a non-zero word in mailbox slot N (fork tests: each VM
    /// gets its own value); it becomes the seed of `memfill:mbox:MIB`.
    Mbox(u64),
    /// `memfill` with the seed the last `mbox` step read.
    MemFillMbox(u64),
}

fn parse_num(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

impl Step {
    fn parse(name: &str) -> Option<Step> {
        Some(match name {
            "hello" => Step::Hello,
            "pio" => Step::Pio,
            "mmio" => Step::Mmio,
            "hlt" => Step::Hlt,
            "poweroff" => Step::PowerOff,
            "reset:kbd" => Step::ResetKbd,
            "reset:acpi" => Step::ResetAcpi,
            "vsock" => Step::Vsock {
                conns: None,
                pings: None,
            },
            "memsum" => Step::MemSum,
            _ if name.starts_with("mbox:") => Step::Mbox(parse_num(&name["mbox:".len()..])?),
            _ if name.starts_with("memfill:mbox:") => {
                Step::MemFillMbox(parse_num(&name["memfill:mbox:".len()..])?)
            }
            _ if name.starts_with("memfill:") => {
                let (seed, mib) = name["memfill:".len()..].split_once(':')?;
                Step::MemFill(parse_num(seed)?, parse_num(mib)?)
            }
            _ if name.starts_with("memchurn:") => {
                Step::MemChurn(parse_num(&name["memchurn:".len()..])?)
            }
            _ if name.starts_with("vsock:") => {
                let rest = &name["vsock:".len()..];
                let (conns, pings) = match rest.split_once(':') {
                    Some((c, p)) => (c, Some(p)),
                    None => (rest, None),
                };
                let positive = |s: &str| match parse_num(s) {
                    Some(n @ 1..=0xffff_ffff) => Some(n as u32),
                    _ => None,
                };
                Step::Vsock {
                    conns: Some(positive(conns)?),
                    pings: match pings {
                        Some(p) => Some(positive(p)?),
                        None => None,
                    },
                }
            }
            _ => match name.strip_prefix("loop:")?.parse() {
                Ok(n) if n < 64 => Step::Loop(n),
                _ => return None,
            },
        })
    }

    fn run(&self, tuning: vsock::Tuning) -> Result<(), Reason> {
        match *self {
            Step::Hello => Ok(()),
            Step::Pio => pio(),
            Step::Mmio => mmio(),
            Step::Hlt => hlt(),
            Step::Loop(n) => spin(n),
            Step::PowerOff => machine_exit(ACPI_PM_PORT, ACPI_SLP_EN | (ACPI_S5 << 2)),
            Step::ResetKbd => machine_exit(I8042_COMMAND_PORT, I8042_PULSE_RESET),
            Step::ResetAcpi => machine_exit(ACPI_PM_PORT, ACPI_RESET_VALUE),
            Step::Vsock { conns, pings } => serve_vsock(vsock::Limits {
                conns,
                pings,
                tuning,
            }),
            Step::MemFill(seed, mib) => {
                memtest::fill(seed, mib).map_err(|e| Reason::new(format_args!("{}", e)))
            }
            Step::MemSum => {
                let (mib, h) = memtest::sum();
                testdev::write_scratch(h);
                println!("memsum {} MiB: {:#018x}", mib, h);
                Ok(())
            }
            Step::MemChurn(mib) => {
                memtest::churn(mib).map_err(|e| Reason::new(format_args!("{}", e)))
            }
            Step::Mbox(n) => {
                let v = memtest::mbox_wait(n).map_err(|e| Reason::new(format_args!("{}", e)))?;
                println!("mbox {}: {:#x}", n, v);
                Ok(())
            }
            Step::MemFillMbox(mib) => memtest::fill(memtest::mbox_seed(), mib)
                .map_err(|e| Reason::new(format_args!("{}", e))),
        }
    }
}

// The VMM's hardware-reduced ACPI registers (see its FADT) and the i8042 reset command.
const ACPI_PM_PORT: u16 = 0x3c0;
const ACPI_SLP_EN: u8 = 1 << 5;
const ACPI_S5: u8 = 5;
const ACPI_RESET_VALUE: u8 = 1;
const I8042_COMMAND_PORT: u16 = 0x64;
const I8042_PULSE_RESET: u8 = 0xfe;

/// Writes `value` to `port`, which should end the VM; if the guest is still running after
/// that, the step fails.
fn machine_exit(port: u16, value: u8) -> Result<(), Reason> {
    io::outb(port, value);
    Err(Reason::new(format_args!(
        "still running after writing {:#x} to port {:#x}",
        value, port
    )))
}

/// Runs the comma-separated `steps`; returns the exit code (0 all ok, 1 a
/// step failed, 2 unknown step name). All names are checked before anything
/// runs, so a typo never produces a partial run. `tuning`: the `vsock` step's settings
/// from the command line.
pub fn run(steps: &str, tuning: vsock::Tuning) -> u32 {
    let names = || steps.split(',').filter(|s| !s.is_empty());
    if let Some(bad) = names().find(|n| Step::parse(n).is_none()) {
        println!("clade-native-guest: unknown step '{}'", bad);
        return 2;
    }
    let mut code = 0;
    for name in names() {
        match Step::parse(name).unwrap().run(tuning) {
            Ok(()) => println!("step {} ok", name),
            Err(reason) => {
                println!("step {} FAIL {}", name, reason.as_str());
                code = 1;
            }
        }
    }
    code
}

/// A failure message formatted into a fixed buffer (no allocator here).
pub struct Reason {
    buf: [u8; 96],
    len: usize,
}

impl Reason {
    pub fn new(args: fmt::Arguments) -> Reason {
        let mut r = Reason {
            buf: [0; 96],
            len: 0,
        };
        let _ = r.write_fmt(args);
        r
    }

    fn as_str(&self) -> &str {
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("?")
    }
}

impl Write for Reason {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // Truncate on a char boundary rather than fail.
        let mut n = s.len().min(self.buf.len() - self.len);
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

macro_rules! fail {
    ($($arg:tt)*) => { return Err(Reason::new(format_args!($($arg)*))) };
}

fn pio() -> Result<(), Reason> {
    let v = testdev::pio_magic();
    if v != testdev::MAGIC {
        fail!("port 0xf8 read {:#x}, want {:#x}", v, testdev::MAGIC);
    }
    Ok(())
}

fn mmio() -> Result<(), Reason> {
    let v = testdev::mmio_magic();
    if v != testdev::MAGIC {
        fail!("magic read {:#x}, want {:#x}", v, testdev::MAGIC);
    }
    for pattern in [0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210, 0, u64::MAX] {
        testdev::write_scratch(pattern);
        let got = testdev::read_scratch();
        if got != pattern {
            fail!("scratch wrote {:#x}, read {:#x}", pattern, got);
        }
    }
    Ok(())
}

const VEC_TESTDEV: u8 = 0x30;
const VEC_TIMER: u8 = 0x31;
/// Guard timer period (~10 ms under KVM) and how many ticks to wait for the
/// device interrupt before giving up, so a lost interrupt fails the step
/// instead of hanging the VM in hlt.
const TIMER_COUNT: u32 = 10_000_000;
const TIMEOUT_TICKS: u32 = 100;

static DEVICE_IRQS: AtomicU32 = AtomicU32::new(0);
static TIMER_TICKS: AtomicU32 = AtomicU32::new(0);

fn on_testdev() {
    testdev::ack();
    DEVICE_IRQS.fetch_add(1, Ordering::Relaxed);
}

fn on_timer() {
    TIMER_TICKS.fetch_add(1, Ordering::Relaxed);
    apic::timer_oneshot(VEC_TIMER, TIMER_COUNT);
}

/// Route the test device's GSI through the IOAPIC, arm it, and hlt until its
/// handler has run.
fn hlt() -> Result<(), Reason> {
    DEVICE_IRQS.store(0, Ordering::Relaxed);
    TIMER_TICKS.store(0, Ordering::Relaxed);
    interrupts::set_handler(VEC_TESTDEV, on_testdev);
    interrupts::set_handler(VEC_TIMER, on_timer);

    apic::mask_pics();
    apic::lapic_enable(interrupts::VEC_SPURIOUS);
    apic::ioapic_route(testdev::GSI, VEC_TESTDEV, apic::lapic_id());
    apic::timer_oneshot(VEC_TIMER, TIMER_COUNT);
    testdev::arm();

    // Loop on the flag rather than trusting one hlt: the first hlt after the
    // VMM sets vCPU state may return at once, and the guard timer wakes us
    // too. Re-enable every time round: with the VIF cell there is no
    // sti;hlt shadow, and enabling again is harmless.
    let mut halts = 0u64;
    while DEVICE_IRQS.load(Ordering::Relaxed) == 0
        && TIMER_TICKS.load(Ordering::Relaxed) < TIMEOUT_TICKS
    {
        interrupts::enable();
        io::hlt();
        halts += 1;
    }
    apic::timer_stop();
    apic::ioapic_mask(testdev::GSI);
    interrupts::disable();
    interrupts::clear_handler(VEC_TESTDEV);
    interrupts::clear_handler(VEC_TIMER);

    let ticks = TIMER_TICKS.load(Ordering::Relaxed);
    if DEVICE_IRQS.load(Ordering::Relaxed) == 0 {
        testdev::ack(); // stop the device raising the line
        fail!(
            "no interrupt after {} hlt iterations ({} timer ticks)",
            halts,
            ticks
        );
    }
    println!(
        "hlt woke after {} hlt iterations ({} timer ticks)",
        halts, ticks
    );
    Ok(())
}

/// 2^n iterations of `dec; jnz`, in asm so the compiler cannot fold it: a
/// pure CPU-bound workload to tell native from emulated execution.
fn spin(n: u32) -> Result<(), Reason> {
    // SAFETY: register-only loop.
    unsafe {
        asm!("2:", "dec rcx", "jnz 2b", inout("rcx") 1u64 << n => _, options(nomem, nostack));
    }
    println!("loop 2^{} done", n);
    Ok(())
}

fn serve_vsock(limits: vsock::Limits) -> Result<(), Reason> {
    let r = vsock::run(limits)?;
    println!(
        "vsock: served {} connections ({} refused, {} dropped by transport resets, \
         {} stale packets); halted {} times, {} device interrupts",
        r.conns, r.refused_conns, r.dropped, r.stale, r.halts, r.wakeups
    );
    Ok(())
}

//! Output on the 8250 UART at COM1 (transmit only, no initialisation needed:
//! the VMM's emulated UART ignores baud rate and line settings).

use crate::io::{inb, outb};
use core::fmt;
use core::sync::atomic::{AtomicU32, Ordering};

const COM1: u16 = 0x3f8;
const LSR: u16 = COM1 + 5;
const LSR_THR_EMPTY: u8 = 1 << 5;

/// Bytes the transmit FIFO of a 16550A takes once LSR says the transmitter is empty.
const FIFO_LEN: u32 = 16;

/// Bytes that may still be written before LSR must be read again.
static FIFO_ROOM: AtomicU32 = AtomicU32::new(0);

/// Writes one byte. LSR is read once per FIFO's worth of bytes, as Linux's 8250 driver
/// fills the FIFO per "transmitter empty": every register access is an exit to the VMM,
/// and reading LSR before every byte doubled the cost of a line.
pub fn write_byte(b: u8) {
    if FIFO_ROOM.load(Ordering::Relaxed) == 0 {
        // Bounded wait: a missing or stuck UART must not hang the test.
        for _ in 0..10_000 {
            if inb(LSR) & LSR_THR_EMPTY != 0 {
                break;
            }
        }
        FIFO_ROOM.store(FIFO_LEN, Ordering::Relaxed);
    }
    FIFO_ROOM.fetch_sub(1, Ordering::Relaxed);
    outb(COM1, b);
}

pub fn write_str(s: &str) {
    s.bytes().for_each(write_byte);
}

pub struct Serial;

/// Bytes of console output [`Deferred`] holds back.
const DEFERRED_LEN: usize = 1024;

/// Console output held back while the guest has work, and written a byte at a time once it
/// has been idle for its poll window ([`Deferred::write_one`]), as a kernel's log buffer is
/// drained by its console.
///
/// Each byte on this UART costs two exits to the VMM (the LSR read and the THR write;
/// ~30 us each under the PVM hypervisor), so an 80-byte line written at once held the guest
/// for 4-5 ms: a connection request that arrived meanwhile waited for all of it. That
/// includes the first request after a restore or a fork whenever the snapshot caught the
/// guest in the middle of a line (a snapshot taken right after a host program hung up).
/// A Linux guest logs nothing per connection; this keeps the test guest's log from
/// standing in front of the work it reports on. Full: the oldest byte is written out at
/// once, so nothing is lost; callers flush before their own direct output, so the order
/// on the console is the order of writing.
pub struct Deferred {
    buf: [u8; DEFERRED_LEN],
    start: usize,
    len: usize,
}

impl Deferred {
    pub const fn new() -> Self {
        Deferred {
            buf: [0; DEFERRED_LEN],
            start: 0,
            len: 0,
        }
    }

    fn push(&mut self, b: u8) {
        if self.len == DEFERRED_LEN {
            self.write_one();
        }
        self.buf[(self.start + self.len) % DEFERRED_LEN] = b;
        self.len += 1;
    }

    /// Writes the oldest held byte; false if there was none.
    pub fn write_one(&mut self) -> bool {
        if self.len == 0 {
            return false;
        }
        write_byte(self.buf[self.start]);
        self.start = (self.start + 1) % DEFERRED_LEN;
        self.len -= 1;
        true
    }

    /// Writes everything held.
    pub fn flush(&mut self) {
        while self.write_one() {}
    }
}

impl fmt::Write for Deferred {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        s.bytes().for_each(|b| self.push(b));
        Ok(())
    }
}

impl fmt::Write for Serial {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        write_str(s);
        Ok(())
    }
}

macro_rules! print {
    ($($arg:tt)*) => {{
        let _ = core::fmt::Write::write_fmt(&mut $crate::serial::Serial, format_args!($($arg)*));
    }};
}

macro_rules! println {
    ($($arg:tt)*) => {{
        print!($($arg)*);
        $crate::serial::write_byte(b'\n');
    }};
}

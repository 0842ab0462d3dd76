//! Output on the 8250 UART at COM1 (transmit only, no initialisation needed:
//! the VMM's emulated UART ignores baud rate and line settings).

use crate::io::{inb, outb};
use core::fmt;

const COM1: u16 = 0x3f8;
const LSR: u16 = COM1 + 5;
const LSR_THR_EMPTY: u8 = 1 << 5;

pub fn write_byte(b: u8) {
    // Bounded wait: a missing or stuck UART must not hang the test.
    for _ in 0..10_000 {
        if inb(LSR) & LSR_THR_EMPTY != 0 {
            break;
        }
    }
    outb(COM1, b);
}

pub fn write_str(s: &str) {
    s.bytes().for_each(write_byte);
}

pub struct Serial;

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

//! Address-range dispatch of guest port I/O and MMIO accesses to devices.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::{Error, Result};

/// A device reachable through a [`Bus`]. `offset` is relative to the range the device was
/// inserted at, so the same model works at any address.
pub trait BusDevice: Send {
    /// The guest reads `data.len()` bytes at `offset`. Unwritten bytes read as zero.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// The guest writes `data` at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

type SharedDevice = Arc<Mutex<dyn BusDevice>>;

/// Maps non-overlapping address ranges to devices; one bus for port I/O, one for MMIO.
#[derive(Default, Clone)]
pub struct Bus {
    /// base -> (length, device)
    ranges: BTreeMap<u64, (u64, SharedDevice)>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Places `device` at `[base, base + len)`.
    pub fn insert(&mut self, device: SharedDevice, base: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Err(Error::ZeroLength(base));
        }
        let end = base.checked_add(len).ok_or(Error::Overlap { base, len })?;
        // The only candidates for overlap are the last range starting below `end`.
        if let Some((&b, &(l, _))) = self.ranges.range(..end).next_back() {
            if b + l > base {
                return Err(Error::Overlap { base, len });
            }
        }
        self.ranges.insert(base, (len, device));
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &SharedDevice)> {
        let (&base, (len, dev)) = self.ranges.range(..=addr).next_back()?;
        let offset = addr - base;
        // The whole access must fall inside the device's range.
        if offset.checked_add(size as u64)? <= *len {
            Some((offset, dev))
        } else {
            None
        }
    }

    /// Dispatches a read; returns false (and leaves `data` untouched) if no device is there.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((offset, dev)) => {
                lock(dev).read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write; returns false if no device is there.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((offset, dev)) => {
                lock(dev).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// A device's mutex is only poisoned if a device model panicked; keep serving rather than
/// propagating the panic into every vCPU thread.
fn lock(dev: &SharedDevice) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    dev.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(Vec<u8>);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = self.0.get(offset as usize + i).copied().unwrap_or(0);
            }
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            let o = offset as usize;
            self.0[o..o + data.len()].copy_from_slice(data);
        }
    }

    #[test]
    fn dispatches_by_range_with_relative_offsets() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Echo(vec![0; 8]))), 0x100, 8)
            .unwrap();
        assert!(bus.write(0x104, &[1, 2]));
        let mut buf = [0u8; 2];
        assert!(bus.read(0x104, &mut buf));
        assert_eq!(buf, [1, 2]);
        // Straddling the end or outside: not dispatched.
        assert!(!bus.read(0x107, &mut buf));
        assert!(!bus.read(0xff, &mut [0u8; 1]));
        assert!(!bus.read(0x108, &mut [0u8; 1]));
    }

    #[test]
    fn rejects_overlaps_and_empty_ranges() {
        let mut bus = Bus::new();
        let dev = || Arc::new(Mutex::new(Echo(vec![0; 16]))) as SharedDevice;
        bus.insert(dev(), 0x100, 0x10).unwrap();
        assert!(bus.insert(dev(), 0x10f, 1).is_err());
        assert!(bus.insert(dev(), 0xf0, 0x11).is_err());
        assert!(bus.insert(dev(), 0x50, 0).is_err());
        assert!(bus.insert(dev(), u64::MAX, 2).is_err());
        bus.insert(dev(), 0xf0, 0x10).unwrap();
        bus.insert(dev(), 0x110, 0x10).unwrap();
    }
}

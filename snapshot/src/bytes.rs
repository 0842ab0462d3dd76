//! Little-endian field readers for the fixed-layout headers. Callers check lengths first.

use crate::SnapshotId;

pub(crate) fn le_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

pub(crate) fn le_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

pub(crate) fn le_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

pub(crate) fn id_at(b: &[u8], off: usize) -> SnapshotId {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[off..off + 16]);
    SnapshotId(a)
}

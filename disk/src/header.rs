//! The layer header: encoding, decoding and every check that needs only the header bytes.
//! The byte layout is documented in `FORMAT.md`.
//!
//! Version 2 keeps two copies ("slots") of the header, at offsets 0 and [`HEADER_SIZE`],
//! each with its own checksum and a sequence number; the valid slot with the highest
//! sequence is the header ([`decode_slots`]). A header is rewritten (to freeze the layer)
//! into the *other* slot, so a write torn by a crash leaves the previous header intact and
//! the layer opens in its old or its new state, never not at all. Version 1 (one slot, the
//! table right after it) is what older builds wrote; such files still open and are still
//! rewritten in place.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// First 8 bytes of every layer file.
pub const MAGIC: [u8; 8] = *b"CLADEDSK";
/// The format version this code writes (it also reads [`VERSION_1`]).
pub const VERSION: u32 = 2;
/// The single-slot format of older builds: still read, and frozen in place.
pub const VERSION_1: u32 = 1;
/// Size of one header slot; in version 1 the allocation table starts here.
pub const HEADER_SIZE: u64 = 4096;
/// Header slots in version 2 (at 0 and [`HEADER_SIZE`]); the allocation table follows them.
pub const HEADER_SLOTS: u64 = 2;
/// Sector size of the virtual disk: sizes are multiples of it.
pub const SECTOR_SIZE: u64 = 512;
/// Block size of new layers: the unit of allocation and copy-on-write.
pub const DEFAULT_BLOCK_SIZE: u32 = 64 * 1024;
/// Smallest block size accepted.
pub const MIN_BLOCK_SIZE: u32 = 4096;
/// Largest block size accepted.
pub const MAX_BLOCK_SIZE: u32 = 2 * 1024 * 1024;
/// Most allocation-table entries (the table is held in memory: 8 bytes per entry, so at
/// most 128 MiB; with 64 KiB blocks a 1 TiB disk).
pub const MAX_TABLE_ENTRIES: u64 = 1 << 24;
/// Longest parent path stored in a header.
pub const MAX_PARENT_PATH: usize = 2048;

/// Header flag: the layer is frozen (immutable). Only frozen layers can be parents.
pub const FLAG_FROZEN: u32 = 1;
/// Every flag this version knows; a header with any other bit set is refused.
pub const KNOWN_FLAGS: u32 = FLAG_FROZEN;

// Field offsets (see FORMAT.md).
const OFF_VERSION: usize = 8;
const OFF_CRC: usize = 12;
const OFF_FLAGS: usize = 16;
const OFF_BLOCK_SIZE: usize = 20;
const OFF_VIRTUAL_SIZE: usize = 24;
const OFF_TABLE_OFFSET: usize = 32;
const OFF_TABLE_ENTRIES: usize = 40;
const OFF_DATA_OFFSET: usize = 48;
const OFF_LAYER_ID: usize = 56;
const OFF_PARENT_ID: usize = 72;
const OFF_PARENT_SIZE: usize = 88;
const OFF_PARENT_TABLE_CRC: usize = 96;
const OFF_TABLE_CRC: usize = 100;
const OFF_PARENT_PATH_LEN: usize = 104;
const OFF_PARENT_PATH: usize = 106;
/// Version 2: the slot's sequence number (after the longest parent path; zero in version 1).
const OFF_SEQUENCE: usize = 2160;

/// A 128-bit random layer identity.
pub type LayerId = [u8; 16];

/// What a child records about its parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentRef {
    /// The parent's layer id.
    pub id: LayerId,
    /// The parent's virtual size in bytes (must equal the child's).
    pub virtual_size: u64,
    /// CRC-32 of the parent's allocation table as it was frozen.
    pub table_crc: u32,
    /// Where the parent is: relative paths are relative to the child's directory.
    pub path: PathBuf,
}

/// A decoded, validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Format version: [`VERSION`] for layers this build creates, [`VERSION_1`] for older ones.
    pub version: u32,
    /// Version 2: which write of the header this is (1 at creation, +1 on each rewrite); the
    /// valid slot with the highest one wins. 0 in version 1.
    pub sequence: u64,
    /// [`FLAG_FROZEN`] or 0.
    pub flags: u32,
    /// Bytes per block, a power of two in `MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE`.
    pub block_size: u32,
    /// Size of the virtual disk in bytes, a multiple of [`SECTOR_SIZE`].
    pub virtual_size: u64,
    /// File offset of the allocation table: after the header slots ([`table_offset_for`]).
    pub table_offset: u64,
    /// Number of table entries: `ceil(virtual_size / block_size)`.
    pub table_entries: u64,
    /// File offset of the first data block (block-aligned, after the table).
    pub data_offset: u64,
    /// This layer's identity.
    pub layer_id: LayerId,
    /// The parent, if any.
    pub parent: Option<ParentRef>,
    /// CRC-32 of the allocation table; meaningful only when frozen (0 otherwise).
    pub table_crc: u32,
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[o..o + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

fn id_at(b: &[u8], o: usize) -> LayerId {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[o..o + 16]);
    a
}

/// Formats a layer id as 32 hex digits.
pub fn id_hex(id: &LayerId) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Table entries needed for `virtual_size` bytes in `block_size` blocks.
pub fn entries_for(virtual_size: u64, block_size: u32) -> u64 {
    virtual_size.div_ceil(u64::from(block_size))
}

/// Where a layer of format `version` keeps its allocation table (after its header slots).
pub fn table_offset_for(version: u32) -> u64 {
    if version == VERSION_1 {
        HEADER_SIZE
    } else {
        HEADER_SLOTS * HEADER_SIZE
    }
}

/// Rounds `v` up to a multiple of `align` (a power of two), or `None` on overflow.
pub(crate) fn align_up(v: u64, align: u64) -> Option<u64> {
    Some(v.checked_add(align - 1)? & !(align - 1))
}

/// Checks a block size and a virtual size against the limits; returns the table size.
pub fn check_geometry(virtual_size: u64, block_size: u32) -> std::result::Result<u64, String> {
    if !block_size.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size) {
        return Err(format!(
            "block size {block_size} is not a power of two in {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}"
        ));
    }
    if virtual_size == 0 || !virtual_size.is_multiple_of(SECTOR_SIZE) {
        return Err(format!(
            "virtual size {virtual_size} is not a positive multiple of {SECTOR_SIZE}"
        ));
    }
    let entries = entries_for(virtual_size, block_size);
    if entries > MAX_TABLE_ENTRIES {
        return Err(format!(
            "virtual size {virtual_size} needs {entries} blocks of {block_size} bytes; at most \
             {MAX_TABLE_ENTRIES} are supported (use a larger block size)"
        ));
    }
    Ok(entries)
}

impl Header {
    /// A header for a new layer (table right after the header, data after the table).
    pub fn new(
        virtual_size: u64,
        block_size: u32,
        layer_id: LayerId,
        parent: Option<ParentRef>,
    ) -> std::result::Result<Self, String> {
        let table_entries = check_geometry(virtual_size, block_size)?;
        let table_offset = table_offset_for(VERSION);
        let data_offset = align_up(table_offset + table_entries * 8, u64::from(block_size))
            .ok_or("table too large")?;
        if let Some(p) = &parent {
            if p.path.as_os_str().len() > MAX_PARENT_PATH {
                return Err(format!(
                    "parent path {} is longer than {MAX_PARENT_PATH} bytes",
                    p.path.display()
                ));
            }
        }
        Ok(Self {
            version: VERSION,
            sequence: 1,
            flags: 0,
            block_size,
            virtual_size,
            table_offset,
            table_entries,
            data_offset,
            layer_id,
            parent,
            table_crc: 0,
        })
    }

    /// True if the layer is frozen.
    pub fn frozen(&self) -> bool {
        self.flags & FLAG_FROZEN != 0
    }

    /// Bytes of the allocation table.
    pub fn table_bytes(&self) -> u64 {
        self.table_entries * 8
    }

    /// The 4096-byte encoding of one slot, CRC included (version 1: byte for byte what
    /// older builds wrote).
    pub fn encode(&self) -> Vec<u8> {
        use std::os::unix::ffi::OsStrExt;
        let mut b = vec![0u8; HEADER_SIZE as usize];
        b[0..8].copy_from_slice(&MAGIC);
        b[OFF_VERSION..OFF_VERSION + 4].copy_from_slice(&self.version.to_le_bytes());
        if self.version != VERSION_1 {
            b[OFF_SEQUENCE..OFF_SEQUENCE + 8].copy_from_slice(&self.sequence.to_le_bytes());
        }
        b[OFF_FLAGS..OFF_FLAGS + 4].copy_from_slice(&self.flags.to_le_bytes());
        b[OFF_BLOCK_SIZE..OFF_BLOCK_SIZE + 4].copy_from_slice(&self.block_size.to_le_bytes());
        b[OFF_VIRTUAL_SIZE..OFF_VIRTUAL_SIZE + 8].copy_from_slice(&self.virtual_size.to_le_bytes());
        b[OFF_TABLE_OFFSET..OFF_TABLE_OFFSET + 8].copy_from_slice(&self.table_offset.to_le_bytes());
        b[OFF_TABLE_ENTRIES..OFF_TABLE_ENTRIES + 8]
            .copy_from_slice(&self.table_entries.to_le_bytes());
        b[OFF_DATA_OFFSET..OFF_DATA_OFFSET + 8].copy_from_slice(&self.data_offset.to_le_bytes());
        b[OFF_LAYER_ID..OFF_LAYER_ID + 16].copy_from_slice(&self.layer_id);
        b[OFF_TABLE_CRC..OFF_TABLE_CRC + 4].copy_from_slice(&self.table_crc.to_le_bytes());
        if let Some(p) = &self.parent {
            b[OFF_PARENT_ID..OFF_PARENT_ID + 16].copy_from_slice(&p.id);
            b[OFF_PARENT_SIZE..OFF_PARENT_SIZE + 8].copy_from_slice(&p.virtual_size.to_le_bytes());
            b[OFF_PARENT_TABLE_CRC..OFF_PARENT_TABLE_CRC + 4]
                .copy_from_slice(&p.table_crc.to_le_bytes());
            let path = p.path.as_os_str().as_bytes();
            // Length checked in `new`; truncation here would only make the parent unfindable.
            let n = path.len().min(MAX_PARENT_PATH);
            b[OFF_PARENT_PATH_LEN..OFF_PARENT_PATH_LEN + 2]
                .copy_from_slice(&(n as u16).to_le_bytes());
            b[OFF_PARENT_PATH..OFF_PARENT_PATH + n].copy_from_slice(&path[..n]);
        }
        let crc = crc32fast::hash(&b);
        b[OFF_CRC..OFF_CRC + 4].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks one header slot read from `path`. `b` is what the file holds at
    /// the slot's offset (possibly less than [`HEADER_SIZE`] bytes for a short file).
    pub fn decode(path: &Path, b: &[u8]) -> Result<Self> {
        use std::os::unix::ffi::OsStrExt;
        let corrupt = |what: String| Error::Corrupt {
            path: path.to_path_buf(),
            what,
        };
        if b.len() < MAGIC.len() || b[..MAGIC.len()] != MAGIC {
            return Err(Error::BadMagic(path.to_path_buf()));
        }
        if b.len() < HEADER_SIZE as usize {
            return Err(corrupt(format!(
                "truncated header: the file has {} bytes, the header needs {HEADER_SIZE}",
                b.len()
            )));
        }
        let b = &b[..HEADER_SIZE as usize];
        let version = u32_at(b, OFF_VERSION);
        if version != VERSION && version != VERSION_1 {
            return Err(Error::UnsupportedVersion {
                path: path.to_path_buf(),
                version,
            });
        }
        let stored_crc = u32_at(b, OFF_CRC);
        let mut copy = b.to_vec();
        copy[OFF_CRC..OFF_CRC + 4].fill(0);
        let crc = crc32fast::hash(&copy);
        if crc != stored_crc {
            return Err(corrupt(format!(
                "header checksum mismatch (stored {stored_crc:#010x}, computed {crc:#010x})"
            )));
        }
        let flags = u32_at(b, OFF_FLAGS);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(corrupt(format!(
                "unknown header flags {:#x}",
                flags & !KNOWN_FLAGS
            )));
        }
        let block_size = u32_at(b, OFF_BLOCK_SIZE);
        let virtual_size = u64_at(b, OFF_VIRTUAL_SIZE);
        let entries = check_geometry(virtual_size, block_size).map_err(corrupt)?;
        let table_offset = u64_at(b, OFF_TABLE_OFFSET);
        let want_table = table_offset_for(version);
        if table_offset != want_table {
            return Err(corrupt(format!(
                "table offset {table_offset} (version {version} puts the table at {want_table})"
            )));
        }
        let table_entries = u64_at(b, OFF_TABLE_ENTRIES);
        if table_entries != entries {
            return Err(corrupt(format!(
                "{table_entries} table entries for a {virtual_size}-byte disk in \
                 {block_size}-byte blocks (expected {entries})"
            )));
        }
        let data_offset = u64_at(b, OFF_DATA_OFFSET);
        let min_data = align_up(table_offset + entries * 8, u64::from(block_size))
            .ok_or_else(|| corrupt("table too large".into()))?;
        if data_offset < min_data || !data_offset.is_multiple_of(u64::from(block_size)) {
            return Err(corrupt(format!(
                "data offset {data_offset} overlaps the table or is not block-aligned \
                 (at least {min_data})"
            )));
        }
        let parent_id = id_at(b, OFF_PARENT_ID);
        let path_len = usize::from(u16::from_le_bytes([
            b[OFF_PARENT_PATH_LEN],
            b[OFF_PARENT_PATH_LEN + 1],
        ]));
        let parent = if parent_id == [0; 16] {
            if path_len != 0 {
                return Err(corrupt("a parent path but no parent id".into()));
            }
            None
        } else {
            if path_len == 0 || path_len > MAX_PARENT_PATH {
                return Err(corrupt(format!(
                    "parent path length {path_len} (1..={MAX_PARENT_PATH})"
                )));
            }
            let raw = &b[OFF_PARENT_PATH..OFF_PARENT_PATH + path_len];
            if raw.contains(&0) {
                return Err(corrupt("parent path contains a NUL byte".into()));
            }
            Some(ParentRef {
                id: parent_id,
                virtual_size: u64_at(b, OFF_PARENT_SIZE),
                table_crc: u32_at(b, OFF_PARENT_TABLE_CRC),
                path: PathBuf::from(std::ffi::OsStr::from_bytes(raw)),
            })
        };
        Ok(Self {
            version,
            sequence: if version == VERSION_1 {
                0
            } else {
                u64_at(b, OFF_SEQUENCE)
            },
            flags,
            block_size,
            virtual_size,
            table_offset,
            table_entries,
            data_offset,
            layer_id: id_at(b, OFF_LAYER_ID),
            parent,
            table_crc: u32_at(b, OFF_TABLE_CRC),
        })
    }
}

/// The header of a layer file whose first bytes are `b` (up to [`HEADER_SLOTS`] slots; less
/// for a short file), and the slot it came from. A version-1 file has one slot. Otherwise
/// the valid version-2 slot with the highest sequence wins: a torn rewrite of one slot
/// leaves the other. With no valid slot, slot 0's error (bad magic, checksum, …) is
/// returned.
pub fn decode_slots(path: &Path, b: &[u8]) -> Result<(Header, usize)> {
    let slot = |i: u64| {
        let start = (i * HEADER_SIZE).min(b.len() as u64) as usize;
        let end = ((i + 1) * HEADER_SIZE).min(b.len() as u64) as usize;
        &b[start..end]
    };
    let first = Header::decode(path, slot(0));
    if let Ok(h) = &first {
        if h.version == VERSION_1 {
            return Ok((h.clone(), 0));
        }
    }
    let mut best: Option<(Header, usize)> = first.as_ref().ok().map(|h| (h.clone(), 0));
    for i in 1..HEADER_SLOTS {
        // A version-1 file has its table here; only a valid version-2 slot counts.
        if let Ok(h) = Header::decode(path, slot(i)) {
            if h.version != VERSION_1 && best.as_ref().is_none_or(|(b, _)| h.sequence > b.sequence)
            {
                best = Some((h, i as usize));
            }
        }
    }
    // (A valid slot 0 is always among the candidates: with none, `first` is its error.)
    best.map_or_else(|| first.map(|h| (h, 0)), Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(parent: bool) -> Header {
        Header::new(
            10 << 20,
            DEFAULT_BLOCK_SIZE,
            [7; 16],
            parent.then(|| ParentRef {
                id: [9; 16],
                virtual_size: 10 << 20,
                table_crc: 0xdead_beef,
                path: "base.cdsk".into(),
            }),
        )
        .unwrap()
    }

    #[test]
    fn round_trip() {
        for parent in [false, true] {
            let h = sample(parent);
            let b = h.encode();
            assert_eq!(b.len(), HEADER_SIZE as usize);
            assert_eq!(Header::decode(Path::new("x"), &b).unwrap(), h);
        }
        let h = sample(false);
        assert_eq!(h.table_entries, 160);
        assert_eq!(
            h.data_offset,
            64 * 1024,
            "two header slots and the table (1280 B) fit in the first block"
        );
        assert_eq!((h.version, h.sequence, h.table_offset), (VERSION, 1, 8192));
        // Version 1 encodes as older builds did: no sequence, table at 4096.
        let mut v1 = sample(true);
        v1.version = VERSION_1;
        v1.sequence = 0;
        v1.table_offset = HEADER_SIZE;
        let b = v1.encode();
        assert!(b[OFF_SEQUENCE..].iter().all(|&x| x == 0));
        assert_eq!(Header::decode(Path::new("x"), &b).unwrap(), v1);
    }

    #[test]
    fn the_valid_slot_with_the_highest_sequence_wins() {
        let p = Path::new("x");
        let old = sample(true);
        let mut new = old.clone();
        new.sequence = 2;
        new.flags |= FLAG_FROZEN;
        new.table_crc = 0x1234;
        let mut both = old.encode();
        both.extend(new.encode());
        assert_eq!(decode_slots(p, &both).unwrap(), (new.clone(), 1));
        // Slot 1 torn anywhere: slot 0.
        for cut in [0, 1, 12, 16, 100, 511, 512, 2160, 4095] {
            let mut b = old.encode();
            let mut n = new.encode();
            n[cut..].copy_from_slice(&old.encode()[cut..]);
            b.extend(n);
            let want = if cut == 4095 && old.encode()[4095] == new.encode()[4095] {
                1
            } else {
                0
            };
            assert_eq!(decode_slots(p, &b).unwrap().1, want, "cut at {cut}");
        }
        // Slot 0 torn, slot 1 valid: slot 1 (and the reverse order of sequences too).
        let mut b = new.encode();
        b[..100].fill(0xaa);
        let mut n = old.clone();
        n.sequence = 3;
        b.extend(n.encode());
        assert_eq!(decode_slots(p, &b).unwrap(), (n, 1));
        // Neither valid: slot 0's error.
        let b = vec![0u8; 8192];
        assert!(matches!(decode_slots(p, &b), Err(Error::BadMagic(_))));
        // A version-1 header in slot 0 ignores what follows (its table).
        let mut v1 = old.clone();
        v1.version = VERSION_1;
        v1.sequence = 0;
        v1.table_offset = HEADER_SIZE;
        let mut b = v1.encode();
        b.extend(new.encode());
        assert_eq!(decode_slots(p, &b).unwrap(), (v1, 0));
    }

    #[test]
    fn every_header_defect_is_named() {
        let p = Path::new("l.cdsk");
        let good = sample(true).encode();
        let err = |b: &[u8]| Header::decode(p, b).unwrap_err().to_string();
        assert!(err(b"QCOWxxxx").contains("not a Clade disk layer"));
        assert!(err(&good[..100]).contains("truncated header"));
        let mut b = good.clone();
        b[OFF_VERSION] = 9;
        assert!(err(&b).contains("version 9"), "{}", err(&b));
        let mut b = good.clone();
        b[200] ^= 1;
        assert!(err(&b).contains("checksum"));
        // Field defects, with a recomputed checksum so the field check itself is exercised.
        let patch = |o: usize, v: &[u8]| {
            let mut b = good.clone();
            b[o..o + v.len()].copy_from_slice(v);
            b[OFF_CRC..OFF_CRC + 4].fill(0);
            let crc = crc32fast::hash(&b);
            b[OFF_CRC..OFF_CRC + 4].copy_from_slice(&crc.to_le_bytes());
            b
        };
        assert!(err(&patch(OFF_FLAGS, &4u32.to_le_bytes())).contains("unknown header flags"));
        assert!(err(&patch(OFF_BLOCK_SIZE, &3000u32.to_le_bytes())).contains("block size"));
        assert!(err(&patch(OFF_VIRTUAL_SIZE, &1000u64.to_le_bytes())).contains("virtual size"));
        assert!(err(&patch(OFF_VIRTUAL_SIZE, &u64::MAX.to_le_bytes())).contains("virtual size"));
        assert!(err(&patch(OFF_TABLE_ENTRIES, &5u64.to_le_bytes())).contains("table entries"));
        assert!(err(&patch(OFF_TABLE_OFFSET, &0u64.to_le_bytes())).contains("table offset"));
        assert!(err(&patch(OFF_DATA_OFFSET, &4096u64.to_le_bytes())).contains("data offset"));
        assert!(err(&patch(OFF_PARENT_PATH_LEN, &0u16.to_le_bytes())).contains("parent path"));
        assert!(err(&patch(OFF_PARENT_PATH_LEN, &5000u16.to_le_bytes())).contains("parent path"));
        assert!(err(&patch(OFF_PARENT_PATH, &[0])).contains("NUL"));
    }
}

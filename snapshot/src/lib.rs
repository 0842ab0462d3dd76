//! Clade snapshot formats and resume machinery, independent of KVM.
//!
//! * [`Persist`]: the small save/restore trait every device implements.
//! * [`state_file`]: the versioned, checksummed snapshot state file (vCPU, VM and device
//!   state serialised as one generic `T`).
//! * [`memory_file`]: the sparse, page-aligned guest memory file (full or diff), diff
//!   chains, and eager reading for the `copy` backend.
//! * [`page_server`]: a userfaultfd (MISSING mode) page server for the `uffd` backend that
//!   records the fault order on the first resume and prefetches that working set later.
//! * [`working_set`]: the working-set file the page server records and replays.
//! * [`fetch`]: memory files whose bytes arrive lazily (a snapshot opened from an object
//!   store), filled by a fetcher before they are read.
//!
//! Every file this crate reads is treated as untrusted: bad input gives an [`Error`],
//! never a panic and never an allocation sized by an unchecked length.
//! The on-disk layouts are described in `snapshot/FORMAT.md`.

use std::fmt;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

pub mod bitmap;
pub mod cpu;
pub mod fetch;
pub mod memory_file;
pub mod page_server;
pub mod state_file;
pub mod working_set;

mod bytes;
mod fsutil;
mod persist;

pub use cpu::{CpuCheck, CpuId};
pub use persist::Persist;

/// Runs a thread's body (the first argument is the thread's name). [`spawn_thread`] starts
/// a new thread; a VMM may instead hand the body to a thread it started earlier, to keep
/// thread creation (tens of microseconds on some hosts) off a resume's critical path.
pub type ThreadRunner =
    Box<dyn FnOnce(String, Box<dyn FnOnce() + Send>) -> std::io::Result<()> + Send>;

/// A [`ThreadRunner`] that starts a new thread.
pub fn spawn_thread() -> ThreadRunner {
    Box::new(|name, body| {
        std::thread::Builder::new()
            .name(name)
            .spawn(body)
            .map(|_| ())
    })
}

/// Guest page size used by every format in this crate (x86-64 base pages).
pub const PAGE_SIZE: usize = 4096;
/// [`PAGE_SIZE`] as `u64`.
pub const PAGE_SIZE_U64: u64 = PAGE_SIZE as u64;

/// Which kind of file an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    /// The snapshot state file.
    State,
    /// The guest memory file.
    Memory,
    /// The page server's working-set file.
    WorkingSet,
}

impl fmt::Display for FileType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileType::State => "snapshot state",
            FileType::Memory => "snapshot memory",
            FileType::WorkingSet => "working-set",
        })
    }
}

/// Full snapshot, or diff on top of a base snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SnapshotKind {
    /// Complete state and complete guest memory.
    Full,
    /// Complete state; guest memory holds only the pages dirtied since the base.
    Diff,
}

impl SnapshotKind {
    pub(crate) fn to_raw(self) -> u32 {
        match self {
            SnapshotKind::Full => 1,
            SnapshotKind::Diff => 2,
        }
    }

    pub(crate) fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(SnapshotKind::Full),
            2 => Some(SnapshotKind::Diff),
            _ => None,
        }
    }
}

impl fmt::Display for SnapshotKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SnapshotKind::Full => "full",
            SnapshotKind::Diff => "diff",
        })
    }
}

/// 128-bit identity of one snapshot. The state file, its memory file and its working-set
/// file carry the same id; a diff names the id of its base.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct SnapshotId(pub [u8; 16]);

impl SnapshotId {
    /// The all-zero id, never produced by [`SnapshotId::random`]; stands for "no id".
    pub const NONE: SnapshotId = SnapshotId([0; 16]);

    /// A fresh random id (from `/dev/urandom`, falling back to time, pid and a counter).
    pub fn random() -> SnapshotId {
        let mut bytes = [0u8; 16];
        let from_urandom = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .is_ok();
        if !from_urandom {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            let count = COUNTER.fetch_add(1, Ordering::Relaxed);
            let hi = nanos ^ (u64::from(std::process::id()) << 32);
            let lo = count.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ nanos.rotate_left(17);
            bytes[..8].copy_from_slice(&hi.to_le_bytes());
            bytes[8..].copy_from_slice(&lo.to_le_bytes());
        }
        if bytes == [0; 16] {
            bytes[0] = 1;
        }
        SnapshotId(bytes)
    }

    /// Whether this is [`SnapshotId::NONE`].
    pub fn is_none(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SnapshotId({self})")
    }
}

/// The one error type of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O operation on a file failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the expected magic bytes.
    #[error("not a Clade {file} file (bad magic)")]
    NotASnapshot {
        /// Which file.
        file: FileType,
    },
    /// The file's format version is not one this build reads.
    #[error(
        "unsupported {file} file format version {found} (this build reads version {supported})"
    )]
    UnsupportedVersion {
        /// Which file.
        file: FileType,
        /// Version found in the file.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// The file ends before its header says it should.
    #[error("{file} file is truncated: {needed} bytes expected, {found} present")]
    Truncated {
        /// Which file.
        file: FileType,
        /// Bytes the header promises.
        needed: u64,
        /// Bytes present.
        found: u64,
    },
    /// A stored checksum does not match the data.
    #[error("{file} file is corrupted: {section} checksum is {stored:#010x}, data gives {computed:#010x}")]
    ChecksumMismatch {
        /// Which file.
        file: FileType,
        /// Which checksummed section.
        section: &'static str,
        /// Checksum stored in the file.
        stored: u32,
        /// Checksum computed over the data read.
        computed: u32,
    },
    /// The file is structurally invalid although its checksums match.
    #[error("{file} file is invalid: {reason}")]
    Corrupt {
        /// Which file.
        file: FileType,
        /// What is wrong.
        reason: String,
    },
    /// The state payload does not decode as the expected type.
    #[error("snapshot state payload does not decode: {0}")]
    Decode(#[source] postcard::Error),
    /// The state value could not be serialised.
    #[error("cannot serialise snapshot state: {0}")]
    Encode(#[source] postcard::Error),
    /// The snapshot was taken on a different CPU than this host's.
    #[error("snapshot was taken on CPU {snapshot}, this host is {host}")]
    WrongHostCpu {
        /// CPU recorded in the snapshot.
        snapshot: CpuId,
        /// This host's CPU.
        host: CpuId,
    },
    /// A length in the file exceeds this build's limit.
    #[error("{file} file: {what} of {found} exceeds the limit of {limit}")]
    TooLarge {
        /// Which file.
        file: FileType,
        /// Which quantity.
        what: &'static str,
        /// Value found.
        found: u64,
        /// Limit.
        limit: u64,
    },
    /// The snapshot is not of the kind the caller asked for.
    #[error("expected a {expected} snapshot, found a {found} snapshot")]
    WrongKind {
        /// Kind asked for.
        expected: SnapshotKind,
        /// Kind found.
        found: SnapshotKind,
    },
    /// Memory size or layout differs from what the state file (or the base) says.
    #[error("memory geometry mismatch: {0}")]
    GeometryMismatch(String),
    /// A file belongs to another snapshot than expected.
    #[error("{file} file belongs to snapshot {found}, expected {expected}")]
    IdMismatch {
        /// Which file.
        file: FileType,
        /// Id expected.
        expected: SnapshotId,
        /// Id found.
        found: SnapshotId,
    },
    /// A diff snapshot was given without the base it was taken on top of.
    #[error("diff snapshot needs its base snapshot {base}, which was not given")]
    MissingBase {
        /// The base the diff names.
        base: SnapshotId,
    },
    /// A diff's base is not the snapshot given before it in the chain.
    #[error("diff snapshot {diff} is based on {expected}, but the previous snapshot in the chain is {found}")]
    BaseMismatch {
        /// The diff.
        diff: SnapshotId,
        /// Base named by the diff.
        expected: SnapshotId,
        /// Snapshot given before it.
        found: SnapshotId,
    },
    /// A caller-supplied argument is invalid.
    #[error("invalid argument: {0}")]
    InvalidInput(String),
    /// A userfaultfd operation failed.
    #[error("userfaultfd {op}: {source}")]
    Uffd {
        /// Which operation.
        op: &'static str,
        /// Error from the `userfaultfd` crate.
        #[source]
        source: userfaultfd::Error,
    },
    /// The page server failed while serving pages.
    #[error("page server: {0}")]
    PageServer(String),
    /// Bytes of a lazily filled memory file could not be fetched.
    #[error("{path}: bytes {offset}..{end} could not be fetched: {reason}")]
    Fetch {
        /// The local file.
        path: PathBuf,
        /// First byte.
        offset: u64,
        /// End of the range.
        end: u64,
        /// Why (names the remote object).
        reason: String,
    },
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(file: FileType, reason: impl Into<String>) -> Self {
        Error::Corrupt {
            file,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ids_differ_and_are_not_none() {
        let a = SnapshotId::random();
        let b = SnapshotId::random();
        assert_ne!(a, b);
        assert!(!a.is_none());
        assert!(SnapshotId::NONE.is_none());
        assert_eq!(a.to_string().len(), 32);
    }

    #[test]
    fn kind_raw_roundtrip() {
        for k in [SnapshotKind::Full, SnapshotKind::Diff] {
            assert_eq!(SnapshotKind::from_raw(k.to_raw()), Some(k));
        }
        assert_eq!(SnapshotKind::from_raw(0), None);
        assert_eq!(SnapshotKind::from_raw(3), None);
    }
}

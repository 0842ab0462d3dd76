//! Clade disk images: a read-only **base** layer shared by every VM, plus a private
//! copy-on-write **overlay** per VM, in 64 KiB blocks (the byte layout is `FORMAT.md`).
//!
//! - [`Layer`]: one layer file (header, allocation table, data blocks), validated on open.
//! - [`Disk`]: a chain of layers as one virtual disk: writes go to the top layer, reads fall
//!   through top → parent → … → zeros; [`Disk::flush`] is the durability point.
//! - [`ops`]: offline operations: [`ops::create`] (empty disk or overlay), [`ops::import_raw`]
//!   (a raw image becomes a frozen base), [`ops::flatten`] (a chain becomes one standalone
//!   image), [`ops::freeze`], [`ops::info`].
//!
//! # Freeze and fork
//!
//! Only **frozen** layers can be parents, and a frozen layer is never opened for writing, so
//! a child's view of its parents cannot change under it (each child also records its parent's
//! id, size and table checksum, and is refused if they do not match). Forking a running VM's
//! disk is [`Disk::snapshot`]: the VM's current top is flushed and frozen in place, and the VM
//! continues on a new empty overlay on top of it; each child gets its own new overlay on the
//! same frozen layer ([`ops::create`] with `parent`). Parent and children then write to their
//! own overlays and never see each other's writes. Chains are at most [`MAX_CHAIN_DEPTH`]
//! layers deep: flatten long chains into a new base.
//!
//! A header rewrite (freezing) is crash-safe: version-2 layers keep two header slots and
//! write the one not in use (see `header`), so a torn write cannot make a layer unopenable.
//!
//! Every file opened here is untrusted: a bad magic, unknown version, checksum mismatch,
//! truncated table, table entry outside the file, or a parent that is not the one recorded is
//! a clear [`Error`], never a panic.

mod chain;
mod header;
mod layer;
pub mod ops;
pub mod remote;

use std::path::PathBuf;

pub use chain::{Disk, OpenOptions};
pub use header::{
    decode_slots, id_hex, table_offset_for, Header, LayerId, ParentRef, DEFAULT_BLOCK_SIZE,
    FLAG_FROZEN, HEADER_SIZE, HEADER_SLOTS, MAGIC, MAX_BLOCK_SIZE, MAX_PARENT_PATH,
    MAX_TABLE_ENTRIES, MIN_BLOCK_SIZE, SECTOR_SIZE, VERSION, VERSION_1,
};
pub use layer::Layer;

/// Most layers in one chain (top included).
pub const MAX_CHAIN_DEPTH: usize = 64;

/// Errors of disk images. Each message names the file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O operation on a layer file failed.
    #[error("{}: {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    /// The file does not start with the layer magic.
    #[error("{}: not a Clade disk layer (bad magic); import raw images with `clade disk create --from RAW`", .0.display())]
    BadMagic(PathBuf),
    /// A format version this code does not know.
    #[error("{}: unsupported layer format version {version} (this build reads versions {VERSION_1} and {VERSION})", path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },
    /// The layer's header or allocation table is inconsistent.
    #[error("{}: corrupt layer: {what}", path.display())]
    Corrupt { path: PathBuf, what: String },
    /// A parent layer is not the one the child was created on.
    #[error("{}: parent {} does not match: {what}", child.display(), parent.display())]
    ParentMismatch {
        child: PathBuf,
        parent: PathBuf,
        what: String,
    },
    /// A frozen layer was opened for writing.
    #[error("{}: layer is frozen (read-only, possibly the parent of other layers); create an overlay on it", .0.display())]
    Frozen(PathBuf),
    /// Another process has the layer open for writing (or reading, for a write open).
    #[error("{}: in use by another process", .0.display())]
    InUse(PathBuf),
    /// The chain is deeper than [`MAX_CHAIN_DEPTH`] (or loops).
    #[error("{}: layer chain deeper than {MAX_CHAIN_DEPTH} layers (or a loop); flatten it", .0.display())]
    ChainTooDeep(PathBuf),
    /// A read or write outside the virtual disk.
    #[error("access at {offset}+{len} is outside the {size}-byte disk")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    /// A write to a disk opened read-only.
    #[error("{}: disk is read-only", .0.display())]
    ReadOnly(PathBuf),
    /// The top layer reached its size limit ([`Disk::set_size_limit`]).
    #[error("{}: no space: the layer would grow past its limit of {limit} bytes", path.display())]
    NoSpace { path: PathBuf, limit: u64 },
    /// An argument to an operation is invalid.
    #[error("{0}")]
    Invalid(String),
    /// A layer filled on demand could not be filled, or was opened without its source.
    #[error("{}: {what}", path.display())]
    Unfilled { path: PathBuf, what: String },
}

impl Error {
    pub(crate) fn io(
        path: &std::path::Path,
        op: &'static str,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| Error::Io { path, op, source }
    }

    /// True for "out of space" conditions (the quota, ENOSPC, EFBIG, EDQUOT).
    pub fn is_no_space(&self) -> bool {
        match self {
            Error::NoSpace { .. } => true,
            Error::Io { source, .. } => matches!(
                source.raw_os_error(),
                Some(libc::ENOSPC) | Some(libc::EFBIG) | Some(libc::EDQUOT)
            ),
            _ => false,
        }
    }
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

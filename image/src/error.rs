//! The image crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong reading or unpacking an image. Messages name the file,
/// blob or layer path concerned.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A host I/O operation failed.
    #[error("{what} {}: {source}", .path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The input is not an image Clade reads (no layout, no manifest, bad JSON).
    #[error("{0}")]
    NotAnImage(String),
    /// A blob is missing, or its content does not match its digest (corrupt, truncated).
    #[error("{0}")]
    BadBlob(String),
    /// A layer tries something it may not: a path out of the tree, through a symlink, a
    /// hard link to outside, an entry type not supported.
    #[error("layer {layer}: {path}: {reason}")]
    BadEntry {
        /// The layer's digest.
        layer: String,
        /// The entry's path in the layer.
        path: String,
        /// Why it was refused.
        reason: String,
    },
    /// A size the input controls is over its limit: a tar metadata entry (PAX header,
    /// GNU long name), a registry blob or manifest.
    #[error("{what} of {size} bytes: more than the {limit} bytes allowed")]
    OverLimit {
        /// What it is.
        what: String,
        /// Its size (as far as it was read, or as declared).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The unpacked tree would exceed the size allowed.
    #[error(
        "the image is larger than the {limit} bytes allowed (at least {needed} bytes unpacked)"
    )]
    TooLarge {
        /// The limit.
        limit: u64,
        /// Bytes unpacked when the limit was passed.
        needed: u64,
    },
}

impl Error {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

//! Layers whose data blocks are filled on demand (a published layer restored on another
//! host: its header and allocation table are in the file from the start, each data chunk
//! is fetched the first time it is read).
//!
//! Such a layer file has a marker beside it, `<file name>.present` (written by whoever
//! fills it; one byte per chunk, 1 = in the file). A layer with a marker has its data read only
//! through a [`BlockSource`] for it ([`Disk::open_with_sources`](crate::Disk::open_with_sources),
//! which asks a [`LayerSources`]); every read of its data asks the source first to make
//! the bytes present. Opened any other way (`clade disk flatten`, a process without the
//! fetcher), it opens (its header and table are real) but reading its data is an error,
//! never the zeros of a hole not filled yet.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::LayerId;

/// What fills one layer file on demand.
pub trait BlockSource: Send + Sync + std::fmt::Debug {
    /// Makes bytes `offset..offset + len` of the layer file present, blocking until they
    /// are; `Err` says why they cannot be (naming what failed).
    fn ensure(&self, offset: u64, len: u64) -> std::result::Result<(), String>;
}

/// Finds the [`BlockSource`] of each layer filled on demand.
pub trait LayerSources: Send + Sync {
    /// The source of layer `id` at `path`, if this knows it.
    fn source(&self, path: &Path, id: &LayerId) -> Option<Arc<dyn BlockSource>>;
}

/// A shared [`LayerSources`], comparable by identity (for configurations that derive
/// `PartialEq`).
#[derive(Clone)]
pub struct Sources(pub Arc<dyn LayerSources>);

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sources(..)")
    }
}

impl PartialEq for Sources {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Sources {}

/// The marker of a layer file filled on demand: `<layer file name>.present` beside it.
pub fn present_path(layer: &Path) -> PathBuf {
    let mut name = layer.file_name().unwrap_or_default().to_os_string();
    name.push(".present");
    layer.with_file_name(name)
}

/// Whether the layer file at `layer` is filled on demand (has a marker).
pub fn is_filled_on_demand(layer: &Path) -> bool {
    present_path(layer).exists()
}

/// Knows no source: a chain opened with it refuses any layer filled on demand.
#[derive(Debug)]
pub struct NoSources;

impl LayerSources for NoSources {
    fn source(&self, _: &Path, _: &LayerId) -> Option<Arc<dyn BlockSource>> {
        None
    }
}

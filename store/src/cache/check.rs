//! The existence check of a restore: before a VM is started on a snapshot opened from the
//! store, every object it may still read from there (the memory data of each snapshot of
//! its chain not wholly cached, the disk layers not wholly cached) must be in the store,
//! as large as its manifest says. An open brings only the working set's chunks (from the
//! lead object, a copy), so without this a deleted data object would be found only when
//! the running VM first read past its working set, and the VM would die there. One
//! concurrent `HEAD` per object: one round trip, on the resume path. Separate because it
//! is the one part of an open that asks the store about objects it does not read.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use snapshot::SnapshotId;

use super::{layer_file, lock, CachedLayer, ChunkCache, OpenedSnapshot, LAYERS_DIR};
use crate::manifest::Manifest;
use crate::{Error, Result};

/// An object a snapshot may still read from the store: its key (relative to the store's
/// prefix) and the size its manifest gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Needed {
    pub(super) key: String,
    pub(super) size: u64,
}

impl ChunkCache {
    /// Checks that the store has every object `opened` (a snapshot opened in this cache)
    /// may still read from it: [`Error::Incomplete`] naming each one missing or of
    /// another size than its manifest gives, a store error if the store could not say.
    pub async fn check_store(&self, opened: &OpenedSnapshot) -> Result<()> {
        let Some(top) = opened.layers.last() else {
            return Ok(());
        };
        let needed = self.needed_objects(&opened.layers, &top.manifest);
        self.check_objects(top.id, needed).await
    }

    /// What the snapshot of `layers` (its chain, in any order) with top manifest `top`
    /// may still read from the store: the memory data of each layer with a chunk not
    /// present, and each layer of its disk not wholly in `layers/`.
    pub(super) fn needed_objects(
        &self,
        layers: &[Arc<CachedLayer>],
        top: &Manifest,
    ) -> Vec<Needed> {
        let mut needed = Vec::new();
        {
            let inner = lock(&self.inner);
            for l in layers {
                let data = &l.manifest.memory.data;
                let whole = inner
                    .ticks
                    .get(&l.id)
                    .is_some_and(|t| t.iter().all(|&t| t != 0));
                if data.inline.is_none() && data.size > 0 && !whole {
                    needed.push(Needed {
                        key: data.key(),
                        size: data.size,
                    });
                }
            }
        }
        let dir = self.root.join(LAYERS_DIR);
        for l in top.disk.iter().flat_map(|d| &d.layers) {
            if !layer_is_whole(&dir.join(layer_file(&l.id))) {
                needed.push(Needed {
                    key: l.object.key(),
                    size: l.object.size,
                });
            }
        }
        needed.dedup();
        needed
    }

    /// Asks the store about every object of `needed` at once (snapshot `id`'s).
    pub(super) async fn check_objects(&self, id: SnapshotId, needed: Vec<Needed>) -> Result<()> {
        if needed.is_empty() {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let sizes = futures::future::join_all(needed.iter().map(|n| self.store.size(&n.key))).await;
        self.requests
            .fetch_add(needed.len() as u64, Ordering::Relaxed);
        let mut missing = Vec::new();
        for (n, size) in needed.iter().zip(sizes) {
            let key = self.store.key(&n.key);
            match size? {
                None => missing.push(format!("object {key} does not exist")),
                Some(s) if s != n.size => missing.push(format!(
                    "object {key} is {s} bytes, its manifest says {}",
                    n.size
                )),
                Some(_) => {}
            }
        }
        tracing::debug!(snapshot = %id, objects = needed.len(), missing = missing.len(),
            us = t0.elapsed().as_micros() as u64, "store checked for what the snapshot needs");
        if missing.is_empty() {
            return Ok(());
        }
        tracing::warn!(snapshot = %id, ?missing, "the store lacks what the snapshot needs");
        Err(Error::Incomplete {
            snapshot: id.to_string(),
            missing,
        })
    }
}

/// Whether the disk layer file `path` of the cache is there whole: under its final name,
/// and not read lazily (no presence map beside it).
fn layer_is_whole(path: &Path) -> bool {
    path.exists() && !disk::remote::present_path(path).exists()
}

//! Deleting published snapshots without taking what another snapshot needs.
//!
//! Objects are shared: `objects/<sha256>` is named by every snapshot with the same bytes
//! (fork siblings name the same frozen disk layers, snapshots of one template the same
//! state), and a diff needs its base's manifest. A publish that finds an object in the
//! store does not upload it again and writes its manifest last, so a delete that decides
//! from the manifests alone can remove an object a publish under way has just decided to
//! reuse: the new snapshot would name a missing object.
//!
//! Mark and sweep with a grace period, not reference counts: S3 has neither atomic
//! counters nor conditional deletes, and a count kept in an object is a read-modify-write
//! that races the same way. So:
//! - [`delete`] writes a tombstone `deleted/<id>.json` listing the snapshot's objects, then
//!   sweeps. The tombstone comes first, so no object is ever forgotten.
//! - A sweep removes a tombstoned snapshot's manifest (unless a diff builds on it), then
//!   each of its objects that no manifest names, that was written more than the grace
//!   period ago and that no publish touched within it. Ages are by the store's own clock (a
//!   clock object the sweep writes gives "now"), so hosts' clocks do not matter; what cannot
//!   be deleted yet stays in the tombstone for a later sweep (every delete sweeps them all,
//!   reading the manifests once for the batch).
//! - A publish that reuses an object touches it (writes an empty `touched/<key>`, the cheap
//!   S3 way to "touch": objects cannot be copied onto themselves), and right before writing
//!   its manifest checks that every object it names still exists, publishing again if one
//!   vanished (see `publish::publish`).
//!
//! What stays possible is a sweep that checks an object and then stalls for longer than a
//! whole publish before its delete arrives; a sweep that took more than [`SWEEP_STALL`]
//! between its check and its delete keeps the object instead.
//!
//! A manifest that cannot be read must neither block other deletes nor lose what it names.
//! One whose bytes do not parse keeps every tombstoned object whose name or SHA-256 occurs
//! in its bytes, and any snapshot whose id occurs in them (it may be its base). One the
//! store does not serve at all could name anything: that sweep deletes nothing, and the
//! tombstones wait until it is readable or removed. Both are logged.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use snapshot::SnapshotId;

use crate::manifest::{self, Manifest};
use crate::{Error, Result, Store};

/// How long an object written or touched by a publish is kept from a sweep: longer than
/// any publish takes from its first check of an object to writing its manifest.
pub const DELETE_GRACE: Duration = Duration::from_secs(30 * 60);

/// The longest a sweep may take between checking an object and deleting it.
pub const SWEEP_STALL: Duration = Duration::from_secs(5);

/// Where the tombstones of deleted snapshots are.
const TOMBSTONES: &str = "deleted";

/// The tombstone of snapshot `id`.
pub fn tombstone_key(id: SnapshotId) -> String {
    format!("{TOMBSTONES}/{id}.json")
}

/// The marker a publish writes when it reuses object `key`.
pub fn touch_key(key: &str) -> String {
    format!("touched/{key}")
}

/// Marks object `key` as reused by a publish under way: a sweep keeps it for the grace
/// period.
pub(crate) async fn touch(store: &Store, key: &str) -> Result<()> {
    store.put(&touch_key(key), Bytes::new()).await
}

/// Whether every object manifest `m` names is in the store with its size (and its base's
/// manifest, not tombstoned): checked right before the manifest is written.
pub(crate) async fn still_whole(store: &Store, m: &Manifest) -> Result<bool> {
    let objects: Vec<_> = m
        .objects()
        .into_iter()
        .filter(|o| o.inline.is_none())
        .collect();
    let sizes = futures::future::try_join_all(objects.iter().map(|o| async move {
        let k = o.key();
        store.size(&k).await
    }))
    .await?;
    if let Some((o, _)) = objects
        .iter()
        .zip(&sizes)
        .find(|(o, size)| **size != Some(o.size))
    {
        tracing::warn!(snapshot = %m.id, object = %store.key(&o.key()),
            "an object this publish reuses was deleted meanwhile: publishing it again");
        return Ok(false);
    }
    if let Some(base) = m.base_id() {
        if store.size(&manifest::manifest_key(base)).await?.is_none()
            || store.size(&tombstone_key(base)).await?.is_some()
        {
            return Err(Error::InvalidInput(format!(
                "snapshot {}: its base {base} was deleted while it was published",
                m.id
            )));
        }
    }
    Ok(true)
}

/// What [`delete`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteReport {
    /// Objects deleted (manifests included).
    pub objects_deleted: u64,
    /// Objects kept because another snapshot names them too.
    pub objects_kept: u64,
    /// Objects left for a later sweep: young, touched by a publish, or possibly named by a
    /// manifest that could not be read.
    pub objects_deferred: u64,
}

/// A tombstone: a deleted snapshot and its objects not yet removed.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Tombstone {
    id: String,
    objects: Vec<String>,
}

/// What the manifests in the store name.
#[derive(Default)]
struct References {
    /// Per readable manifest (by snapshot id): its base and its objects' keys.
    readable: HashMap<String, (Option<String>, HashSet<String>)>,
    /// Bytes of manifests that do not parse, by key.
    garbled: Vec<(String, Bytes)>,
    /// Manifests the store did not serve.
    unserved: Vec<String>,
}

impl References {
    async fn load(store: &Store) -> Result<References> {
        let mut r = References::default();
        for k in store.list("snapshots").await? {
            if !k.ends_with(".json") {
                continue;
            }
            let b = match store.get_max(&k, manifest::MAX_MANIFEST_BYTES as u64).await {
                Ok(b) => b,
                // Deleted meanwhile.
                Err(Error::Missing { .. }) => continue,
                Err(e) => {
                    tracing::warn!(manifest = %store.key(&k), error = %e,
                        "manifest not readable: no object is deleted until it is");
                    r.unserved.push(k);
                    continue;
                }
            };
            match Manifest::parse(&store.key(&k), &b) {
                Ok(m) => {
                    let keys = m
                        .objects()
                        .iter()
                        .filter(|o| o.inline.is_none())
                        .map(|o| o.key())
                        .collect();
                    r.readable.insert(m.id.clone(), (m.base.clone(), keys));
                }
                Err(e) => {
                    tracing::warn!(manifest = %store.key(&k), error = %e,
                        "unreadable manifest: keeping every object it may name");
                    r.garbled.push((k, b));
                }
            }
        }
        Ok(r)
    }

    /// A snapshot that builds on `id`, if any (a garbled manifest naming `id` may).
    fn child_of(&self, id: &str) -> Option<String> {
        if let Some((child, _)) = self
            .readable
            .iter()
            .find(|(_, (base, _))| base.as_deref() == Some(id))
        {
            return Some(child.clone());
        }
        self.garbled
            .iter()
            .find(|(_, b)| contains(b, id))
            .map(|(k, _)| k.clone())
    }

    /// Whether a manifest other than `except`'s names object `key`.
    fn named_by_other(&self, key: &str, except: &str) -> bool {
        self.readable
            .iter()
            .any(|(id, (_, keys))| id != except && keys.contains(key))
    }

    /// Whether a garbled manifest may name object `key`.
    fn maybe_named(&self, key: &str) -> bool {
        let token = key.strip_prefix("objects/").unwrap_or(key);
        self.garbled.iter().any(|(_, b)| contains(b, token))
    }
}

fn contains(hay: &[u8], needle: &str) -> bool {
    let n = needle.as_bytes();
    !n.is_empty() && hay.windows(n.len()).any(|w| w == n)
}

/// Deletes published snapshot `id` (see the module docs): its manifest now, its objects
/// once nothing needs them. Refused while a diff is published on top of it. Readers that
/// opened it before get an error naming the missing object on their next fetch, never
/// other bytes.
pub async fn delete(store: &Store, id: SnapshotId) -> Result<DeleteReport> {
    delete_with(store, id, DELETE_GRACE).await
}

/// [`delete`] with grace period `grace`.
pub async fn delete_with(store: &Store, id: SnapshotId, grace: Duration) -> Result<DeleteReport> {
    let mut refs = References::load(store).await?;
    tombstone(store, &mut refs, id, &[]).await?;
    let report = sweep_with(store, refs, grace).await?;
    tracing::info!(snapshot = %id, deleted = report.objects_deleted, kept = report.objects_kept,
        deferred = report.objects_deferred, "published snapshot deleted");
    Ok(report)
}

/// Deletes the published snapshots `ids` together (a killed sandbox's, a diff chain in
/// any order), reading the manifests once. One that cannot be deleted (another snapshot
/// builds on it, its manifest does not parse) is logged and left; the others go.
pub async fn delete_all(store: &Store, ids: &[SnapshotId]) -> Result<DeleteReport> {
    let mut refs = References::load(store).await?;
    for &id in ids {
        match tombstone(store, &mut refs, id, ids).await {
            Ok(()) => {}
            Err(
                e @ (Error::InvalidInput(_) | Error::BadManifest { .. } | Error::Missing { .. }),
            ) => {
                tracing::warn!(snapshot = %id, "kept in the store: {e}")
            }
            Err(e) => return Err(e),
        }
    }
    let report = sweep_with(store, refs, DELETE_GRACE).await?;
    tracing::info!(
        snapshots = ids.len(),
        deleted = report.objects_deleted,
        kept = report.objects_kept,
        deferred = report.objects_deferred,
        "published snapshots deleted"
    );
    Ok(report)
}

/// Writes snapshot `id`'s tombstone, unless a snapshot outside `batch` builds on it.
async fn tombstone(
    store: &Store,
    refs: &mut References,
    id: SnapshotId,
    batch: &[SnapshotId],
) -> Result<()> {
    let key = manifest::manifest_key(id);
    match store
        .get_max(&key, manifest::MAX_MANIFEST_BYTES as u64)
        .await
    {
        Ok(bytes) => {
            let target = Manifest::parse(&store.key(&key), &bytes)?;
            let in_batch = |c: &str| batch.iter().any(|b| b.to_string() == c);
            if let Some(child) = refs.child_of(&target.id).filter(|c| !in_batch(c)) {
                return Err(Error::InvalidInput(format!(
                    "snapshot {id} is the base of snapshot {child}: delete that first"
                )));
            }
            let t = Tombstone {
                id: target.id.clone(),
                objects: target
                    .objects()
                    .iter()
                    .filter(|o| o.inline.is_none())
                    .map(|o| o.key())
                    .collect(),
            };
            let b = serde_json::to_vec(&t).map_err(|e| Error::InvalidInput(e.to_string()))?;
            store.put(&tombstone_key(id), Bytes::from(b)).await
        }
        // Deleted before, its objects not all gone yet: swept again.
        Err(Error::Missing { .. }) if store.size(&tombstone_key(id)).await?.is_some() => Ok(()),
        Err(e) => Err(e),
    }
}

/// Removes what the tombstones of deleted snapshots list and nothing needs any more.
pub async fn sweep(store: &Store, grace: Duration) -> Result<DeleteReport> {
    let refs = References::load(store).await?;
    sweep_with(store, refs, grace).await
}

/// "Now" by the store's clock, in milliseconds since the epoch.
async fn store_now(store: &Store) -> Result<i64> {
    let k = format!("{TOMBSTONES}/clock-{}", SnapshotId::random());
    store.put(&k, Bytes::new()).await?;
    let now = store.modified(&k).await?;
    store.delete(&k).await?;
    now.ok_or_else(|| Error::Missing { key: store.key(&k) })
}

async fn sweep_with(store: &Store, mut refs: References, grace: Duration) -> Result<DeleteReport> {
    let mut report = DeleteReport::default();
    let mut stones: Vec<String> = store
        .list(TOMBSTONES)
        .await?
        .into_iter()
        .filter(|k| k.ends_with(".json"))
        .collect();
    if stones.is_empty() {
        return Ok(report);
    }
    if let Some(k) = refs.unserved.first() {
        tracing::warn!(manifest = %store.key(k), tombstones = stones.len(),
            "deleted snapshots kept whole until this manifest can be read");
        report.objects_deferred += stones.len() as u64;
        return Ok(report);
    }
    let now = store_now(store).await?;
    // Diffs before their bases: a base waits while a deleted diff's manifest is there.
    loop {
        let before = stones.len();
        let mut waiting = Vec::new();
        for sk in stones {
            if !sweep_one(store, &mut refs, &sk, now, grace, &mut report).await? {
                waiting.push(sk);
            }
        }
        if waiting.is_empty() || waiting.len() == before {
            for sk in &waiting {
                tracing::warn!(tombstone = %store.key(sk), "deleted snapshot kept: a snapshot builds on it");
            }
            return Ok(report);
        }
        stones = waiting;
    }
}

/// Sweeps tombstone `sk`; `false` if a snapshot builds on it (nothing done).
async fn sweep_one(
    store: &Store,
    refs: &mut References,
    sk: &str,
    now: i64,
    grace: Duration,
    report: &mut DeleteReport,
) -> Result<bool> {
    let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
    let old = |t: Option<i64>| t.is_none_or(|t| t.saturating_add(grace_ms) <= now);
    let b = match store.get(sk).await {
        Ok(b) => b,
        Err(Error::Missing { .. }) => return Ok(true),
        Err(e) => return Err(e),
    };
    let mut t: Tombstone = match serde_json::from_slice(&b) {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(tombstone = %store.key(sk), error = %e, "unreadable tombstone kept");
            return Ok(true);
        }
    };
    let Ok(id) = manifest::parse_snapshot_id(&t.id) else {
        tracing::warn!(tombstone = %store.key(sk), "tombstone of no snapshot id kept");
        return Ok(true);
    };
    let mkey = manifest::manifest_key(id);
    if refs.readable.contains_key(&t.id) || store.size(&mkey).await?.is_some() {
        if refs.child_of(&t.id).is_some() {
            return Ok(false);
        }
        store.delete(&mkey).await?;
        report.objects_deleted += 1;
    }
    refs.readable.remove(&t.id);
    let mut left = Vec::new();
    for k in std::mem::take(&mut t.objects) {
        if refs.named_by_other(&k, &t.id) {
            report.objects_kept += 1;
            continue;
        }
        if refs.maybe_named(&k) {
            report.objects_deferred += 1;
            left.push(k);
            continue;
        }
        let checked = Instant::now();
        let written = store.modified(&k).await?;
        if written.is_none() {
            store.delete(&touch_key(&k)).await?;
            continue;
        }
        let touched = store.modified(&touch_key(&k)).await?;
        if !old(written) || !old(touched) || checked.elapsed() > SWEEP_STALL {
            report.objects_deferred += 1;
            left.push(k);
            continue;
        }
        store.delete(&k).await?;
        store.delete(&touch_key(&k)).await?;
        report.objects_deleted += 1;
    }
    if left.is_empty() {
        store.delete(sk).await?;
    } else {
        t.objects = left;
        let b = serde_json::to_vec(&t).map_err(|e| Error::InvalidInput(e.to_string()))?;
        store.put(sk, Bytes::from(b)).await?;
    }
    Ok(true)
}

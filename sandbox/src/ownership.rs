//! Who may act on a sandbox when several hosts share sandboxes (a cluster, the `cluster`
//! crate). A host alone owns every sandbox in its registry and needs none of this; in a
//! cluster, a sandbox that another host took over (its pause resumed there after this host
//! stopped answering) must not be touched here again: not paused, not killed, not
//! published. The host asks [`Ownership::check`] before every change it makes to a
//! sandbox, and tells [`Ownership::record`] what it now holds, so that the cluster's
//! registry (not this crate) decides and remembers ownership.
//!
//! The trait is defined here, below the cluster, so that the lifecycle depends on nothing
//! above it; the cluster implements it.

use crate::error::Result;
use crate::registry::{Record, SnapshotRecord};

/// One host of the cluster as an operator sees it (the dashboard's nodes view,
/// `GET /nodes`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSummary {
    /// Its name.
    pub name: String,
    /// Where other nodes reach it.
    pub address: String,
    /// Its lease is alive.
    pub live: bool,
    /// Told to drain (no placements).
    pub draining: bool,
    /// Its drain is over.
    pub drained: bool,
    /// Runs sandboxes (false: a pure gateway).
    pub takes_sandboxes: bool,
    /// vCPUs it may commit, and those its running sandboxes have.
    pub vcpus: u64,
    /// See `vcpus`.
    pub used_vcpus: u64,
    /// Memory (MiB) it may commit, and that of its running sandboxes.
    pub mem_mib: u64,
    /// See `mem_mib`.
    pub used_mem_mib: u64,
    /// Its sandboxes, running and paused.
    pub sandboxes: u64,
    /// Templates in its local cache.
    pub templates: Vec<String>,
}

/// Room held for VMs about to start (see [`Ownership::admit`]): given back when dropped,
/// which the host does once the sandboxes it was for are recorded.
pub type Reservation = Box<dyn Send>;

/// The cluster's say on this host's sandboxes.
pub trait Ownership: Send + Sync {
    /// Before a change to sandbox `id`, which this host's registry holds: `Ok` if this
    /// host still owns it; [`crate::Error::Fenced`] if another host owns it now (the host
    /// then forgets its copy, without touching the store); any other error when ownership
    /// cannot be known (nothing is changed then).
    fn check(&self, id: &str) -> Result<()>;
    /// After this host created, resumed, took over, paused or published `rec`: it is this
    /// host's, in this state.
    fn record(&self, rec: &Record) -> Result<()>;
    /// Before this host starts `count` VMs of `vcpus` vCPUs and `mem_mib` MiB each (a
    /// create, a resume, a fork's children): room for them, held until the reservation is
    /// dropped, or [`crate::Error::NoRoom`] when they would pass what this host may
    /// commit. Two starts at once cannot both take the last room.
    fn admit(&self, _vcpus: u32, _mem_mib: u64, _count: u32) -> Result<Option<Reservation>> {
        Ok(None)
    }
    /// The cluster's hosts (`None`: not known here).
    fn nodes(&self) -> Result<Option<Vec<NodeSummary>>> {
        Ok(None)
    }
    /// After this host killed sandbox `id`.
    fn removed(&self, id: &str) -> Result<()>;
    /// After this host published a checkpoint of running sandbox `id` (see
    /// `host::checkpoint`): were this host lost, the sandbox resumes from it elsewhere.
    fn checkpointed(&self, _id: &str) -> Result<()> {
        Ok(())
    }
    /// After this host took a persistent snapshot (sandboxes created from it start here).
    fn snapshot_made(&self, _snap: &SnapshotRecord) -> Result<()> {
        Ok(())
    }
    /// After this host deleted snapshot `id`.
    fn snapshot_deleted(&self, _id: &str) -> Result<()> {
        Ok(())
    }
}

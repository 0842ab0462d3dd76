//! The `clade bench` scenarios, run on the native test guest (tests/native-guest), and their
//! statistics and reports.
//!
//! Benchmarks measure; they do not assert. Each scenario ([`boot()`], [`ping()`],
//! [`restore()`], [`snapshot()`], [`fork()`], [`fork_processes()`], [`serve()`]) boots the guest described by a [`Guest`] on a
//! [`Machine`] and returns a report: a [`Summary`] or a scenario's own report type, each
//! with `to_json()` (one JSON object) and a text rendering (`Display`). Printing is the
//! caller's job.

mod boot;
mod cluster;
mod error;
mod fork;
mod fork_processes;
mod guest;
mod net;
mod noise;
mod ping;
pub mod report;
mod restore;
mod serve;
mod snapshot;
mod stats;
mod store;

pub use boot::boot;
pub use cluster::{cluster, ClusterParams, ClusterReport};
pub use error::{Error, Result};
pub use fork::{fork, ForkParams, ForkReport};
pub use fork_processes::{
    fork_processes, ForkProcessesParams, ForkProcessesReport, ForkProcessesRun,
};
pub use guest::{Guest, Machine};
pub use noise::HostNoise;
pub use ping::ping;
pub use restore::{restore, BackendRun, RestoreParams, RestoreReport};
pub use serve::{serve, Census, RunningRun, ServeParams, ServeReport, ServeRun, SustainRun};
pub use snapshot::{snapshot, SnapshotParams, SnapshotReport, SnapshotRuns};
pub use stats::{pct_u64, Samples, StepTimes, Summary};
pub use store::{
    pause_store, restore_store, StorePauseParams, StorePauseReport, StoreRestoreParams,
    StoreRestoreReport, StoreTarget,
};

/// Guest memory below this is the image, boot structures and the VMM's tables; the
/// native guest's memfill/memchurn steps work above it.
pub const FILL_BASE_MIB: u64 = 64;

//! Snapshots on disk: taking one of a running VM ([`take::snapshot`]) and making new VMs
//! from one ([`restore::restore`], [`restore::PreparedSnapshot`]).
//!
//! # A snapshot directory
//!
//! | file | what |
//! |---|---|
//! | `state.snap` | the [`SavedMachine`] (vCPUs, in-kernel irqchip/PIT/clock, devices, disk, machine shape) and the directories of the snapshots below a diff, in the versioned, checksummed state file of the `snapshot` crate |
//! | `memory.mem` | guest memory, sparse and page-aligned: every page (full) or the pages written since the base (diff) |
//! | `working_set.ws` | written by the first `uffd` restore: the pages the guest touched first, prefetched by later restores |
//!
//! A snapshot is written whole into a staging directory next to its target and put in
//! place by one atomic rename (see `staging`): replacing a snapshot never leaves a broken
//! one, whenever the VMM dies, and files others keep in the directory stay.
//!
//! A diff snapshot's state file names the directories of the snapshots below it (base
//! first, absolute paths); restoring it needs all of them in place. A snapshot of a VM
//! with a writable disk references the disk layer frozen at the snapshot (it must stay
//! where it is, like a diff's base); each restore puts its own overlay on it.

pub(crate) mod restore;
mod staging;
pub(crate) mod take;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::device_manager::DevicesState;
use crate::error::Error;
use crate::saved::{MachineState, SavedDisk, SavedMachine};
use crate::vstate::state::{VcpuState, VmKvmState};

/// The state file in a snapshot directory.
pub const STATE_FILE: &str = "state.snap";
/// The memory file in a snapshot directory.
pub const MEMORY_FILE: &str = "memory.mem";
/// The working-set file a `uffd` restore records in a snapshot directory.
pub const WORKING_SET_FILE: &str = "working_set.ws";

/// Longest chain of snapshots a diff may sit on (base and diffs, this one included).
pub const MAX_DIFF_CHAIN: usize = snapshot::memory_file::MAX_CHAIN_LEN;

/// The payload of a snapshot's state file: the saved machine, and the directories of the
/// snapshots below it (a diff; base first, empty for a full snapshot).
///
/// Encoded as the fields in the order machine, chain, vm, vcpus, devices, disk (the
/// layout state files have had since format version 1).
pub(crate) struct StatePayload {
    pub(crate) saved: SavedMachine,
    pub(crate) chain: Vec<PathBuf>,
}

impl Serialize for StatePayload {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let m = &self.saved;
        (
            &m.machine,
            &self.chain,
            &m.vm,
            &m.vcpus,
            &m.devices,
            &m.disk,
        )
            .serialize(s)
    }
}

impl<'de> Deserialize<'de> for StatePayload {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[allow(clippy::type_complexity)]
        let (machine, chain, vm, vcpus, devices, disk): (
            MachineState,
            Vec<PathBuf>,
            VmKvmState,
            Vec<VcpuState>,
            DevicesState,
            Option<SavedDisk>,
        ) = Deserialize::deserialize(d)?;
        Ok(StatePayload {
            saved: SavedMachine {
                machine,
                vm,
                vcpus,
                devices,
                disk,
            },
            chain,
        })
    }
}

pub(crate) fn file_err(dir: &Path) -> impl FnOnce(snapshot::Error) -> Error + '_ {
    move |source| Error::SnapshotFile {
        dir: dir.to_path_buf(),
        source,
    }
}

pub(crate) fn io_err(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

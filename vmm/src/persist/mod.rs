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

use devices::legacy::SerialDeviceState;
use devices::test_device::TestMmioState;
use devices::virtio::mmio::MmioTransportState;
use snapshot::state_file;

use crate::device_manager::DevicesState;
use crate::error::Error;
use crate::saved::{MachineState, SavedDisk, SavedMachine};
use crate::vstate::state::{VcpuState, VmKvmState};

/// The state file in a snapshot directory.
pub const STATE_FILE: &str = "state.snap";
pub use crate::saved::MEMORY_FILE;
/// The working-set file a `uffd` restore records in a snapshot directory.
pub const WORKING_SET_FILE: &str = "working_set.ws";

/// Longest chain of snapshots a diff may sit on (base and diffs, this one included).
pub const MAX_DIFF_CHAIN: usize = snapshot::memory_file::MAX_CHAIN_LEN;

/// The payload of a snapshot's state file: the saved machine, and the directories of the
/// snapshots below it (a diff; base first, empty for a full snapshot).
///
/// Encoded as the fields in the order machine, chain, vm, vcpus, devices, disk (the
/// layout state files have had since format version 1). Format version 2 added the VM
/// generation ID device to the devices; version-1 files are read with
/// [`StatePayload::decode`] (their VMs have no such device).
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

/// The devices of a version-1 state file: those of [`DevicesState`] but the VM generation
/// ID.
#[derive(Serialize, Deserialize)]
struct DevicesStateV1 {
    serial: SerialDeviceState,
    test_device: Option<TestMmioState>,
    virtio: Vec<MmioTransportState>,
}

impl StatePayload {
    /// Decodes a state file's payload written with format `version`.
    pub(crate) fn decode(version: u32, payload: &[u8]) -> snapshot::Result<StatePayload> {
        if version >= 2 {
            return state_file::decode_payload(payload);
        }
        #[allow(clippy::type_complexity)]
        let (machine, chain, vm, vcpus, devices, disk): (
            MachineState,
            Vec<PathBuf>,
            VmKvmState,
            Vec<VcpuState>,
            DevicesStateV1,
            Option<SavedDisk>,
        ) = state_file::decode_payload(payload)?;
        Ok(StatePayload {
            saved: SavedMachine {
                machine,
                vm,
                vcpus,
                devices: DevicesState {
                    serial: devices.serial,
                    test_device: devices.test_device,
                    virtio: devices.virtio,
                    vmgenid: None,
                },
                disk,
            },
            chain,
        })
    }
}

/// Rewrites the snapshot in `dir` as a build before the VM generation ID would have written
/// it (format version 1, devices without it): the old-snapshot compatibility tests.
#[cfg(feature = "test-hooks")]
pub fn downgrade_state_file_to_v1(dir: &Path) -> crate::Result<()> {
    let path = dir.join(STATE_FILE);
    let expect = state_file::Expect {
        cpu_check: snapshot::CpuCheck::Ignore,
        ..Default::default()
    };
    let (header, state) =
        state_file::read_with(&path, &expect, StatePayload::decode).map_err(file_err(dir))?;
    let m = state.saved;
    let d = m.devices;
    let v1 = (
        &m.machine,
        &state.chain,
        &m.vm,
        &m.vcpus,
        DevicesStateV1 {
            serial: d.serial,
            test_device: d.test_device,
            virtio: d.virtio,
        },
        &m.disk,
    );
    let mut bytes = state_file::encode(&header.meta, &v1).map_err(file_err(dir))?;
    // The header's version field, and its checksum (the last 4 of its 128 bytes).
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..124]);
    bytes[124..128].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&path, bytes).map_err(io_err("writing a version-1 state file"))
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

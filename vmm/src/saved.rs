//! What a VM is saved as ([`SavedMachine`]), and where a VM came from ([`Lineage`],
//! [`RestoreReport`]).
//!
//! One saved-machine type serves all three places a VM's state goes: snapshot files
//! (snapshot files), the in-memory instant children of a fork are made from
//! ([`crate::Frozen`]) and the hand-over of that instant to a child process
//! ([`crate::Frozen::handoff`]). The VM's `save_machine` makes one and the builder's
//! `from_saved` builds a VM from one.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use snapshot::memory_file::MemoryChain;
use snapshot::page_server::PageServerStats;
use snapshot::{SnapshotId, SnapshotKind};

use crate::config::BlockConfig;
use crate::device_manager::DevicesState;
use crate::error::{Error, Result};
use crate::vstate::state::{VcpuState, VmKvmState};

/// The memory file in a snapshot directory.
pub const MEMORY_FILE: &str = "memory.mem";

/// The vsock device of a saved machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedVsock {
    /// The Unix socket the VM listened on (a restore may choose another).
    pub uds_path: PathBuf,
    /// The guest's CID.
    pub guest_cid: u32,
}

/// The shape of the machine a saved state restores into.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineState {
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM in bytes.
    pub mem_bytes: u64,
    /// The PVM hypervisor's VIF cells (vCPU `i` at `base + i * 4096`), when the state was
    /// saved on such a host.
    pub pvm_vif_base: Option<u64>,
    /// The vsock device, if any.
    pub vsock: Option<SavedVsock>,
    /// The kernel the VM booted (informational).
    pub kernel: PathBuf,
    /// Its command line (informational).
    pub cmdline: String,
}

/// A VM's disk at the instant it was saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedDisk {
    /// The layer frozen at that instant (absolute path; it must stay where it is), which
    /// each VM built from the saved state gets its own overlay on; for a read-only disk,
    /// the disk's own top layer, which they open read-only too.
    pub layer: PathBuf,
    /// The disk was read-only.
    pub read_only: bool,
    /// The configured serial.
    pub serial: Option<String>,
    /// What fills the chain's layers that are filled on demand (`disk::remote`), for the
    /// VMs built from it here; never saved (a restore gives its own).
    #[serde(skip)]
    pub sources: Option<disk::remote::Sources>,
}

impl SavedDisk {
    /// Creates a VM's own overlay at `path` on the saved layer (nothing for a read-only
    /// disk: VMs share it as it is).
    pub(crate) fn create_overlay(&self, path: &Path) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        disk::ops::create(
            path,
            &disk::ops::CreateOptions {
                parent: Some(self.layer.clone()),
                ..Default::default()
            },
        )?;
        Ok(())
    }

    /// The disk of a VM built from the saved state: its overlay at `overlay` (made with
    /// [`SavedDisk::create_overlay`]; needed for a writable disk), or the saved read-only
    /// layer itself.
    pub(crate) fn block_config(&self, overlay: Option<&Path>) -> Result<BlockConfig> {
        let path =
            match (self.read_only, overlay) {
                (true, _) => self.layer.clone(),
                (false, Some(p)) => p.to_path_buf(),
                (false, None) => return Err(Error::Config(
                    "the saved VM has a writable disk: the new VM needs an overlay on its layer"
                        .into(),
                )),
            };
        Ok(BlockConfig {
            path,
            read_only: self.read_only,
            serial: self.serial.clone(),
            sources: self.sources.clone(),
        })
    }
}

/// Everything about a VM at one instant but its memory: machine shape, in-kernel state,
/// vCPUs, devices and disk.
#[derive(Debug, Serialize, Deserialize)]
pub struct SavedMachine {
    /// Machine shape.
    pub machine: MachineState,
    /// In-kernel irqchip, PIT and clock.
    pub vm: VmKvmState,
    /// Each vCPU, in index order.
    pub vcpus: Vec<VcpuState>,
    /// Devices.
    pub devices: DevicesState,
    /// The virtio-blk disk, if any.
    pub disk: Option<SavedDisk>,
}

/// The snapshot a VM's memory last matched: the base of its next diff snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    /// Its id.
    pub id: SnapshotId,
    /// Its directory (absolute).
    pub dir: PathBuf,
    /// The directories below it, base first (empty for a full snapshot).
    pub chain: Vec<PathBuf>,
}

impl Lineage {
    /// The snapshot's memory files, base first, checked to be this snapshot's (a snapshot
    /// written over its directory since is refused).
    pub(crate) fn memory_chain(&self) -> Result<MemoryChain> {
        let paths: Vec<PathBuf> = self
            .chain
            .iter()
            .chain(std::iter::once(&self.dir))
            .map(|d| d.join(MEMORY_FILE))
            .collect();
        let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
        let chain = MemoryChain::open(&refs).map_err(|e| {
            Error::Snapshot(format!(
                "opening the memory of snapshot {}: {e}",
                self.dir.display()
            ))
        })?;
        let top = chain.top().header().id;
        if top != self.id {
            return Err(Error::Snapshot(format!(
                "{} holds snapshot {top} now, not {} that this VM's memory came from",
                self.dir.display(),
                self.id
            )));
        }
        Ok(chain)
    }
}

/// How a restored VM gets its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryBackend {
    /// Anonymous memory filled on demand by a userfaultfd page server; the first restore
    /// records the pages the guest touches, later ones prefetch them before the vCPUs run.
    #[default]
    Uffd,
    /// A private (copy-on-write) mapping of the memory file; diff layers are copied over it.
    File,
    /// Everything read into fresh memory before the vCPUs run (the baseline).
    Copy,
}

impl MemoryBackend {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            MemoryBackend::Uffd => "uffd",
            MemoryBackend::File => "file",
            MemoryBackend::Copy => "copy",
        }
    }
}

impl std::fmt::Display for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for MemoryBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "uffd" => Ok(MemoryBackend::Uffd),
            "file" => Ok(MemoryBackend::File),
            "copy" => Ok(MemoryBackend::Copy),
            _ => Err(format!("unknown memory backend '{s}' (uffd, file or copy)")),
        }
    }
}

/// How the restore that made a VM went.
#[derive(Debug, Clone)]
pub struct RestoreReport {
    /// The snapshot's id.
    pub id: SnapshotId,
    /// Full or diff (with `layers` memory files).
    pub kind: SnapshotKind,
    /// Memory files in the chain (1 for a full snapshot).
    pub layers: usize,
    /// The memory backend used.
    pub backend: MemoryBackend,
    /// The VM shell came from the caller (a pool) rather than being built.
    pub shell_reused: bool,
    /// From the call to the vCPUs running (or ready to, without `start`).
    pub total: Duration,
    /// Time steps, in order.
    pub steps: Vec<(&'static str, Duration)>,
    /// Bytes read from memory files before the vCPUs ran (`copy`, `file` diff layers,
    /// `uffd` prefetch).
    pub bytes_read: u64,
    /// `uffd`: the page server's counters when the vCPUs started.
    pub page_server: Option<PageServerStats>,
    /// `uffd`: whether this restore records a working set (none was there yet).
    pub recording_working_set: bool,
    /// MSRs KVM refused to restore (logged).
    pub refused_msrs: Vec<u32>,
}

/// Named time steps of an operation (snapshot, restore, fork), for its report.
#[derive(Debug)]
pub(crate) struct Steps {
    last: std::time::Instant,
    pub(crate) steps: Vec<(&'static str, Duration)>,
}

impl Steps {
    pub(crate) fn new() -> Steps {
        Steps {
            last: std::time::Instant::now(),
            steps: Vec::new(),
        }
    }

    /// Ends the step `name` now.
    pub(crate) fn done(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.steps.push((name, now - self.last));
        self.last = now;
    }
}

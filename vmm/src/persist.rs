//! Snapshots of running VMs ([`Vm::snapshot`]) and new VMs resumed from them
//! ([`Vm::resume`]).
//!
//! # A snapshot directory
//!
//! | file | what |
//! |---|---|
//! | `state.snap` | vCPUs, in-kernel irqchip/PIT/clock, devices, machine shape ([`VmSnapshotState`]) in the versioned, checksummed state file of the `snapshot` crate |
//! | `memory.mem` | guest memory, sparse and page-aligned: every page (full) or the pages written since the base (diff) |
//! | `working_set.ws` | written by the first `uffd` resume: the pages the guest touched first, prefetched by later resumes |
//!
//! A diff snapshot's state file names the directories of the snapshots below it (base
//! first, absolute paths); resuming it needs all of them in place.
//!
//! # Taking one
//!
//! The vCPUs are paused (kicked out of KVM_RUN, pending I/O completed), devices stop their
//! background work, each vCPU's state is read on its own thread, then the VM's, the
//! devices' and the memory: for a diff, the pages KVM's dirty log and the VMM's own writes
//! (virtqueues, rx buffers: tracked by `vm-memory`'s bitmap) marked since the last snapshot.
//! The memory file is written while paused but made durable (fsync, rename) after the vCPUs
//! run again; the state file is written last and commits the snapshot.
//!
//! # Resuming
//!
//! Everything is read and checked first (state file, memory files of the whole chain,
//! geometry, CPU): a bad snapshot fails before any KVM object exists and no file is
//! written. Then a VM shell (from a pool, or built now) gets memory mapped over its reserved
//! address space by one of three [`MemoryBackend`]s, devices are recreated from their
//! state, the VM's and vCPUs' KVM state is set, and the vCPUs run. vsock connections do not
//! survive (their host ends belonged to another process): the guest gets a transport reset
//! when it had any, its listening sockets stay. With [`ResumeOptions::agent_sync`] a
//! background thread then gives the guest agent the current time and fresh entropy.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use snapshot::memory_file::{
    self, GuestRegion, HoleFill, MemoryChain, MemoryFile, PendingMemoryFile, RegionData,
};
use snapshot::page_server::{
    GuestMapping, PageServer, PageServerOptions, PageServerStats, Prefetch, StopMode,
};
use snapshot::state_file::{self, Expect, SnapshotMeta};
use snapshot::working_set::WorkingSet;
use snapshot::{CpuCheck, SnapshotId};

pub use snapshot::SnapshotKind;

use crate::arch::layout::ram_ranges;
use crate::config::{BlockConfig, SerialOutput, VmConfig, VsockConfig};
use crate::device_manager::{DeviceManager, DevicesState};
use crate::error::{Error, Result};
use crate::fork::FrozenDisk;
use crate::vm::{exit_notifier, RunState, Vm};
use crate::vstate::kvm;
use crate::vstate::memory::{Backing, GuestRam};
use crate::vstate::shell::{Shell, ShellSpec};
use crate::vstate::spare;
use crate::vstate::state::{self as kvm_state, Capabilities, VcpuState, VmKvmState};

/// The state file in a snapshot directory.
pub const STATE_FILE: &str = "state.snap";
/// The memory file in a snapshot directory.
pub const MEMORY_FILE: &str = "memory.mem";
/// The working-set file a `uffd` resume records in a snapshot directory.
pub const WORKING_SET_FILE: &str = "working_set.ws";

/// Longest chain of snapshots a diff may sit on (base and diffs, this one included).
pub const MAX_DIFF_CHAIN: usize = memory_file::MAX_CHAIN_LEN;

/// How a resumed VM gets its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryBackend {
    /// Anonymous memory filled on demand by a userfaultfd page server; the first resume
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

/// The vsock device of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedVsock {
    /// The Unix socket the VM listened on (a resume may choose another).
    pub uds_path: PathBuf,
    /// The guest's CID.
    pub guest_cid: u32,
}

/// The shape of the machine a snapshot restores into.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineState {
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM in bytes.
    pub mem_bytes: u64,
    /// The PVM hypervisor's VIF cells (vCPU `i` at `base + i * 4096`), when the snapshot
    /// was taken on such a host.
    pub pvm_vif_base: Option<u64>,
    /// The vsock device, if any.
    pub vsock: Option<SavedVsock>,
    /// The kernel the VM booted (informational).
    pub kernel: PathBuf,
    /// Its command line (informational).
    pub cmdline: String,
}

/// The payload of a snapshot's state file.
#[derive(Serialize, Deserialize)]
pub struct VmSnapshotState {
    /// Machine shape.
    pub machine: MachineState,
    /// Directories of the snapshots below this one (a diff), base first; empty for full.
    pub chain: Vec<PathBuf>,
    /// In-kernel irqchip, PIT and clock.
    pub vm: VmKvmState,
    /// Each vCPU, in index order.
    pub vcpus: Vec<VcpuState>,
    /// Devices.
    pub devices: DevicesState,
    /// The virtio-blk disk, if any: the layer frozen at the snapshot (absolute path; it
    /// must stay where it is), which each resume puts a private overlay on.
    pub disk: Option<FrozenDisk>,
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

/// What [`Vm::snapshot`] did.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    /// The new snapshot's id.
    pub id: SnapshotId,
    /// Full or diff.
    pub kind: SnapshotKind,
    /// Its directory (absolute).
    pub dir: PathBuf,
    /// How long the vCPUs were paused (0 when the VM was paused already).
    pub pause_time: Duration,
    /// Whole call.
    pub total_time: Duration,
    /// Pages in the dirty bitmap (diff) or in guest memory (full).
    pub pages_considered: u64,
    /// Non-zero pages written to the memory file.
    pub pages_written: u64,
    /// Time steps, in order.
    pub steps: Vec<(&'static str, Duration)>,
}

/// Options of [`Vm::resume`].
#[derive(Debug)]
pub struct ResumeOptions {
    /// Where the serial console goes.
    pub serial: SerialOutput,
    /// The vsock device's Unix socket; default: the one in the snapshot.
    pub vsock_path: Option<PathBuf>,
    /// KVM device node.
    pub kvm_device: PathBuf,
    /// How closely the snapshot's CPU must match this host's.
    pub cpu_check: CpuCheck,
    /// A pre-built VM shell (e.g. from [`crate::pool::ShellPool::take`]); one that does not
    /// fit the snapshot is dropped and a new one built.
    pub shell: Option<Shell>,
    /// After the vCPUs run, give the guest agent the current time and fresh entropy, in a
    /// background thread that gives up after this long (best effort, logged).
    pub agent_sync: Option<Duration>,
    /// `uffd`: record the working set on the first resume and prefetch it on later ones.
    pub working_set: bool,
    /// `uffd`: how a recorded working set is prefetched.
    pub prefetch: Prefetch,
    /// Log dirty pages in the resumed VM (needed for its diff snapshots).
    pub dirty_tracking: bool,
    /// Start the vCPUs before returning (otherwise call [`Vm::start`]).
    pub start: bool,
    /// Pin vCPU `i` to host CPU `vcpu_cpus[i % len]` (empty: no pinning; see
    /// [`Vm::pin_vcpus`]).
    pub vcpu_cpus: Vec<usize>,
    /// A snapshot with a writable disk: where the resumed VM's own overlay on the
    /// snapshot's frozen disk layer is created (it must not exist; default:
    /// `<snapshot dir>/resume-<random>.cdsk`). The overlay stays after the VM ends.
    pub disk_overlay: Option<PathBuf>,
}

impl Default for ResumeOptions {
    fn default() -> Self {
        ResumeOptions {
            serial: SerialOutput::Stdout,
            vsock_path: None,
            kvm_device: PathBuf::from(kvm::KVM_PATH),
            cpu_check: CpuCheck::default(),
            shell: None,
            agent_sync: None,
            working_set: true,
            prefetch: Prefetch::BeforeStart,
            dirty_tracking: true,
            start: true,
            vcpu_cpus: Vec::new(),
            disk_overlay: None,
        }
    }
}

/// How a resume went.
#[derive(Debug, Clone)]
pub struct ResumeReport {
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
    /// `uffd`: whether this resume records a working set (none was there yet).
    pub recording_working_set: bool,
    /// MSRs KVM refused to restore (logged).
    pub refused_msrs: Vec<u32>,
}

pub(crate) struct Steps {
    last: Instant,
    pub(crate) steps: Vec<(&'static str, Duration)>,
}

impl Steps {
    pub(crate) fn new() -> Steps {
        Steps {
            last: Instant::now(),
            steps: Vec::new(),
        }
    }

    pub(crate) fn done(&mut self, name: &'static str) {
        let now = Instant::now();
        self.steps.push((name, now - self.last));
        self.last = now;
    }
}

fn file_err(dir: &Path) -> impl FnOnce(snapshot::Error) -> Error + '_ {
    move |source| Error::SnapshotFile {
        dir: dir.to_path_buf(),
        source,
    }
}

fn io_err(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

impl Vm {
    /// The machine description a snapshot or a fork hands to the VMs built from it.
    pub(crate) fn machine_state(&self) -> MachineState {
        MachineState {
            vcpus: self.config.vcpus,
            mem_bytes: self.ram.mem_bytes(),
            pvm_vif_base: self.pvm_native.then_some(crate::arch::layout::PVM_VIF_BASE),
            vsock: self.config.vsock.as_ref().map(|v| SavedVsock {
                uds_path: v.uds_path.clone(),
                guest_cid: v.guest_cid,
            }),
            kernel: self.config.kernel.clone(),
            cmdline: self.config.cmdline.clone(),
        }
    }

    /// Takes a snapshot of this running (or paused) VM into `dir` (created if needed; a
    /// snapshot already there is replaced once the new one is complete). `Diff` writes only
    /// the pages written since the last snapshot this VM took or was resumed from, and
    /// needs that snapshot's directory to stay where it is. The VM keeps running
    /// afterwards (a paused VM stays paused).
    pub fn snapshot(&mut self, dir: &Path, kind: SnapshotKind) -> Result<SnapshotInfo> {
        let t0 = Instant::now();
        let mut steps = Steps::new();
        self.poll_exit();
        if !matches!(self.state, RunState::Running | RunState::Paused) {
            return Err(Error::InvalidState {
                state: self.state_name(),
                op: "snapshot",
            });
        }
        let base = match kind {
            SnapshotKind::Full => None,
            SnapshotKind::Diff => {
                if !self.dirty_tracking {
                    return Err(Error::Snapshot(
                        "a diff snapshot needs dirty page tracking, which this VM runs without"
                            .into(),
                    ));
                }
                Some(self.lineage.clone().ok_or_else(|| {
                    Error::Snapshot(
                        "a diff snapshot needs a base: take a full snapshot of this VM first"
                            .into(),
                    )
                })?)
            }
        };
        std::fs::create_dir_all(dir).map_err(io_err("creating the snapshot directory"))?;
        let dir = dir
            .canonicalize()
            .map_err(io_err("resolving the snapshot directory"))?;
        if let Some(l) = &base {
            if l.chain.len() + 2 > MAX_DIFF_CHAIN {
                return Err(Error::Snapshot(format!(
                    "a diff would make a chain of {} snapshots (at most {MAX_DIFF_CHAIN}): \
                     take a full snapshot",
                    l.chain.len() + 2
                )));
            }
            if l.dir == dir || l.chain.contains(&dir) {
                return Err(Error::Snapshot(format!(
                    "{} holds this diff's base snapshot: write the diff elsewhere",
                    dir.display()
                )));
            }
        }
        if kind == SnapshotKind::Full {
            // A full snapshot reads all of memory: install what the page server has not
            // served yet, while the guest still runs, then run on plain memory.
            if let Some(ps) = self.page_server.take() {
                let report = ps.stop(StopMode::FillRemaining).map_err(|e| {
                    Error::Snapshot(format!("filling guest memory from the snapshot: {e}"))
                })?;
                self.working_set_saved = true;
                tracing::debug!(
                    "page server stopped before a full snapshot: {} pages filled",
                    report.stats.pages_filled
                );
                steps.done("fill_memory");
            }
        }
        let id = SnapshotId::random();
        let was_running = self.state == RunState::Running;
        let t_pause = Instant::now();
        if was_running {
            for v in &self.vcpus {
                v.pause();
            }
        }
        self.devices.pause();
        steps.done("pause");
        let captured = self.capture(&dir, kind, id, base.as_ref(), &mut steps);
        self.devices.unpause();
        if was_running {
            for v in &self.vcpus {
                v.resume();
            }
        }
        let pause_time = if was_running {
            t_pause.elapsed()
        } else {
            Duration::ZERO
        };
        steps.done("unpause");
        let (pending, state, pages_considered) = match captured {
            Ok(c) => c,
            Err(e) => {
                // The dirty log may have been consumed: only a full snapshot is safe now.
                self.lineage = None;
                return Err(e);
            }
        };
        let committed = (|| -> Result<(u64, SnapshotMeta)> {
            let (header, stats) = pending.commit().map_err(file_err(&dir))?;
            steps.done("commit_memory");
            let meta = match &base {
                None => SnapshotMeta::full(id, header.mem_size),
                Some(b) => SnapshotMeta::diff(id, b.id, header.mem_size),
            };
            state_file::write(&dir.join(STATE_FILE), &meta, &state).map_err(file_err(&dir))?;
            steps.done("write_state");
            Ok((stats.pages_written, meta))
        })();
        let (pages_written, _meta) = match committed {
            Ok(c) => c,
            Err(e) => {
                self.lineage = None;
                return Err(e);
            }
        };
        // A working set recorded for the snapshot this one replaced is useless now.
        match std::fs::remove_file(dir.join(WORKING_SET_FILE)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!("removing a stale working set in {}: {e}", dir.display()),
        }
        self.lineage = Some(Lineage {
            id,
            dir: dir.clone(),
            chain: state.chain,
        });
        let info = SnapshotInfo {
            id,
            kind,
            dir,
            pause_time,
            total_time: t0.elapsed(),
            pages_considered,
            pages_written,
            steps: steps.steps,
        };
        tracing::info!(
            "{kind} snapshot {id} in {}: {} pages written, paused {:?}, total {:?}",
            info.dir.display(),
            info.pages_written,
            info.pause_time,
            info.total_time
        );
        Ok(info)
    }

    /// The pages written since the last call (KVM's dirty log and the VMM's own writes),
    /// one bitmap per range. A forked VM also keeps them for its next fork (the pages it
    /// wrote since its memory was frozen).
    pub(crate) fn take_dirty(&mut self) -> Result<Vec<Vec<u64>>> {
        let mut dirty = kvm::take_dirty_log(&self.vm_fd, self.ram.ranges())?;
        for (d, v) in dirty.iter_mut().zip(self.ram.take_vmm_dirty()) {
            for (a, b) in d.iter_mut().zip(v) {
                *a |= b;
            }
        }
        if matches!(self.ram.backing(), Backing::Forked(_)) {
            if self.fork_carry.is_empty() {
                self.fork_carry = dirty.clone();
            } else {
                for (d, v) in self.fork_carry.iter_mut().zip(&dirty) {
                    for (a, b) in d.iter_mut().zip(v) {
                        *a |= *b;
                    }
                }
            }
        }
        Ok(dirty)
    }

    /// The vCPUs', the VM's and the devices' state, in memory. vCPUs and devices paused.
    pub(crate) fn save_machine(
        &self,
        mut steps: Option<&mut Steps>,
    ) -> Result<(Vec<VcpuState>, VmKvmState, DevicesState)> {
        let caps = Capabilities::probe(&self._kvm)?;
        let jobs = self
            .vcpus
            .iter()
            .zip(&self.cpuids)
            .map(|(v, cpuid)| {
                let caps = caps.clone();
                let cpuid = cpuid.clone();
                v.submit(move |fd| kvm_state::save_vcpu(fd, &caps, cpuid))
            })
            .collect::<Result<Vec<_>>>()?;
        let vcpus = jobs
            .into_iter()
            .zip(&self.vcpus)
            .map(|(rx, v)| v.wait_job(rx)?)
            .collect::<Result<Vec<_>>>()?;
        if let Some(s) = steps.as_deref_mut() {
            s.done("save_vcpus");
        }
        let vm = kvm_state::save_vm(&self.vm_fd)?;
        let devices = self.devices.save()?;
        if let Some(s) = steps {
            s.done("save_vm_devices");
        }
        Ok((vcpus, vm, devices))
    }

    /// Everything that needs the vCPUs and devices paused.
    fn capture(
        &mut self,
        dir: &Path,
        kind: SnapshotKind,
        id: SnapshotId,
        base: Option<&Lineage>,
        steps: &mut Steps,
    ) -> Result<(PendingMemoryFile, VmSnapshotState, u64)> {
        let (vcpus, vm, devices) = self.save_machine(Some(steps))?;
        // The disk's current top layer becomes the snapshot's (frozen, flushed); the VM
        // runs on from a new overlay on it.
        let disk = self.freeze_disk("s")?;
        if let Some(d) = &disk {
            tracing::debug!("snapshot disk layer {}", d.layer.display());
            steps.done("freeze_disk");
        }

        let ranges = self.ram.ranges().to_vec();
        let mem_path = dir.join(MEMORY_FILE);
        let (pending, considered) = match (kind, base) {
            (SnapshotKind::Full, _) => {
                if self.dirty_tracking {
                    // Start a new interval: the next diff covers what changes after this.
                    self.take_dirty()?;
                }
                steps.done("dirty_log");
                let regions: Vec<GuestRegion<'_>> = match self.ram.backing() {
                    Backing::Memfd(f) => ranges
                        .iter()
                        .map(|r| GuestRegion {
                            guest_addr: r.guest_addr,
                            data: RegionData::Fd {
                                fd: f.as_fd(),
                                offset: r.image_offset,
                                len: r.len as u64,
                            },
                        })
                        .collect(),
                    _ => (0..ranges.len())
                        .map(|i| GuestRegion {
                            guest_addr: ranges[i].guest_addr,
                            // SAFETY: vCPUs and devices are paused: nothing writes guest
                            // memory while the slices live (until this function returns).
                            data: RegionData::Slice(unsafe { self.ram.range_slice(i) }),
                        })
                        .collect(),
                };
                let p = memory_file::write_full_pending(&mem_path, id, &regions)
                    .map_err(file_err(dir))?;
                let pages = self.ram.mem_bytes() / snapshot::PAGE_SIZE_U64;
                (p, pages)
            }
            (SnapshotKind::Diff, Some(base)) => {
                let dirty = self.take_dirty()?;
                steps.done("dirty_log");
                let considered = dirty
                    .iter()
                    .flatten()
                    .map(|w| u64::from(w.count_ones()))
                    .sum();
                let regions: Vec<GuestRegion<'_>> = (0..ranges.len())
                    .map(|i| GuestRegion {
                        guest_addr: ranges[i].guest_addr,
                        // SAFETY: as above: nothing writes guest memory while paused.
                        data: RegionData::Slice(unsafe { self.ram.range_slice(i) }),
                    })
                    .collect();
                let dirty_refs: Vec<&[u64]> = dirty.iter().map(|d| &d[..]).collect();
                let p =
                    memory_file::write_diff_pending(&mem_path, id, base.id, &regions, &dirty_refs)
                        .map_err(file_err(dir))?;
                (p, considered)
            }
            (SnapshotKind::Diff, None) => {
                return Err(Error::Snapshot("a diff snapshot needs a base".into()))
            }
        };
        steps.done("write_memory");
        let chain = match base {
            None => Vec::new(),
            Some(b) => {
                let mut c = b.chain.clone();
                c.push(b.dir.clone());
                c
            }
        };
        let state = VmSnapshotState {
            machine: self.machine_state(),
            chain,
            vm,
            vcpus,
            devices,
            disk,
        };
        Ok((pending, state, considered))
    }

    /// Makes a new VM from the snapshot in `dir` (see the [module documentation](self)):
    /// [`PreparedSnapshot::open`] then [`PreparedSnapshot::resume`]. The snapshot's files are
    /// only read (a `uffd` resume may add `working_set.ws`). Any error leaves nothing behind:
    /// no VM, no changed file.
    pub fn resume(dir: &Path, backend: MemoryBackend, options: ResumeOptions) -> Result<Vm> {
        let t0 = Instant::now();
        let prepared = PreparedSnapshot::open(dir, options.cpu_check)?;
        let read = t0.elapsed();
        let mut vm = prepared.resume(backend, options)?;
        if let Some(r) = vm.resume_report.as_mut() {
            r.steps.insert(0, ("read_check", read));
            r.total += read;
        }
        Ok(vm)
    }
}

/// A snapshot whose files were read and checked (state file, every memory file of its
/// chain, geometry, CPU), ready to be resumed any number of times without reading them
/// again. It keeps the memory files open.
pub struct PreparedSnapshot {
    dir: PathBuf,
    header: state_file::Header,
    state: VmSnapshotState,
    chain: Arc<MemoryChain>,
    vsock: Option<SavedVsock>,
    /// The working set, once a resume found it (it does not change once written).
    working_set: Mutex<Option<Arc<WorkingSet>>>,
}

impl std::fmt::Debug for PreparedSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedSnapshot")
            .field("dir", &self.dir)
            .field("id", &self.header.meta.id)
            .field("kind", &self.header.meta.kind)
            .field("machine", &self.state.machine)
            .finish()
    }
}

impl PreparedSnapshot {
    /// Reads and checks the snapshot in `dir`; nothing is created or written.
    pub fn open(dir: &Path, cpu_check: CpuCheck) -> Result<PreparedSnapshot> {
        // 1. Read and check everything before touching KVM.
        let expect = Expect {
            cpu_check,
            ..Expect::default()
        };
        let (header, state): (_, VmSnapshotState) =
            state_file::read(&dir.join(STATE_FILE), &expect).map_err(file_err(dir))?;
        let meta = header.meta;
        let m = &state.machine;
        if m.vcpus == 0 || state.vcpus.len() != m.vcpus as usize {
            return Err(Error::Snapshot(format!(
                "{}: state for {} vCPUs in a {}-vCPU machine",
                dir.display(),
                state.vcpus.len(),
                m.vcpus
            )));
        }
        if m.mem_bytes != meta.mem_size {
            return Err(Error::Snapshot(format!(
                "{}: machine of {} bytes in a snapshot of {} bytes",
                dir.display(),
                m.mem_bytes,
                meta.mem_size
            )));
        }
        match (meta.kind, state.chain.is_empty()) {
            (SnapshotKind::Full, false) => {
                return Err(Error::Snapshot(format!(
                    "{}: a full snapshot that lists base snapshots",
                    dir.display()
                )))
            }
            (SnapshotKind::Diff, true) => {
                return Err(Error::Snapshot(format!(
                    "{}: a diff snapshot that lists no base snapshot",
                    dir.display()
                )))
            }
            _ => {}
        }
        if state.chain.len() >= memory_file::MAX_CHAIN_LEN {
            return Err(Error::Snapshot(format!(
                "{}: diff chain of {} snapshots",
                dir.display(),
                state.chain.len() + 1
            )));
        }
        let mut layers = Vec::with_capacity(state.chain.len() + 1);
        for (i, base_dir) in state.chain.iter().enumerate() {
            let path = base_dir.join(MEMORY_FILE);
            let f = MemoryFile::open(&path).map_err(|e| match e {
                snapshot::Error::Io { source, .. }
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    Error::Snapshot(format!(
                        "{}: this diff snapshot needs its base snapshot {} at {}, which is missing",
                        dir.display(),
                        if i + 1 == state.chain.len() {
                            meta.base.map(|b| b.to_string()).unwrap_or_default()
                        } else {
                            "(an earlier one in its chain)".into()
                        },
                        base_dir.display()
                    ))
                }
                other => Error::SnapshotFile {
                    dir: base_dir.clone(),
                    source: other,
                },
            })?;
            layers.push(f);
        }
        layers.push(MemoryFile::open(&dir.join(MEMORY_FILE)).map_err(file_err(dir))?);
        let chain = MemoryChain::new(layers).map_err(file_err(dir))?;
        chain.check_state(&header).map_err(file_err(dir))?;
        if let (Some(base), Some(below)) = (meta.base, chain.layers().iter().rev().nth(1)) {
            if below.header().id != base {
                return Err(Error::SnapshotFile {
                    dir: dir.to_path_buf(),
                    source: snapshot::Error::BaseMismatch {
                        diff: meta.id,
                        expected: base,
                        found: below.header().id,
                    },
                });
            }
        }
        let layout: Vec<(u64, u64)> = ram_ranges(m.mem_bytes);
        let geometry: Vec<(u64, u64)> = chain
            .regions()
            .iter()
            .map(|r| (r.guest_addr, r.size))
            .collect();
        if layout != geometry {
            return Err(Error::SnapshotFile {
                dir: dir.to_path_buf(),
                source: snapshot::Error::GeometryMismatch(format!(
                    "memory regions {geometry:#x?}, a {}-byte machine has {layout:#x?}",
                    m.mem_bytes
                )),
            });
        }
        let dir = dir
            .canonicalize()
            .map_err(io_err("resolving the snapshot directory"))?;
        let vsock = state.machine.vsock.clone();
        Ok(PreparedSnapshot {
            dir,
            header,
            state,
            chain: Arc::new(chain),
            vsock,
            working_set: Mutex::new(None),
        })
    }

    /// The snapshot's id.
    pub fn id(&self) -> SnapshotId {
        self.header.meta.id
    }

    /// Full or diff.
    pub fn kind(&self) -> SnapshotKind {
        self.header.meta.kind
    }

    /// The machine it restores.
    pub fn machine(&self) -> &MachineState {
        &self.state.machine
    }

    /// The VM shell it fits (for a [`crate::pool::ShellPool`]).
    pub fn shell_spec(&self, kvm_device: &Path, dirty_log: bool) -> ShellSpec {
        ShellSpec {
            kvm_device: kvm_device.to_path_buf(),
            mem_bytes: self.state.machine.mem_bytes,
            vcpus: self.state.machine.vcpus,
            dirty_log,
        }
    }

    /// The working set at `path`, read once and kept (None while there is none yet).
    fn cached_working_set(&self, path: &Path) -> Option<Arc<WorkingSet>> {
        let mut cache = self.working_set.lock().unwrap_or_else(|e| e.into_inner());
        if cache.is_none() {
            if let Ok(ws) = WorkingSet::load(path, self.header.meta.id, self.chain.pages()) {
                *cache = Some(Arc::new(ws));
            }
        }
        cache.clone()
    }

    /// Makes a new VM from this snapshot (see [`Vm::resume`]).
    pub fn resume(&self, backend: MemoryBackend, mut options: ResumeOptions) -> Result<Vm> {
        let t0 = Instant::now();
        let mut steps = Steps::new();
        let dir = &self.dir;
        let state = &self.state;
        let m = &state.machine;
        let meta = self.header.meta;
        let vsock = match (&self.vsock, &options.vsock_path) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(Error::Config(
                    "a vsock socket was given, but the snapshot has no vsock device".into(),
                ))
            }
            (Some(v), path) => Some(VsockConfig {
                uds_path: path.clone().unwrap_or_else(|| v.uds_path.clone()),
                guest_cid: v.guest_cid,
            }),
        };

        if state.disk.as_ref().is_none_or(|d| d.read_only) && options.disk_overlay.is_some() {
            return Err(Error::Config(
                "a disk overlay was given, but the snapshot has no writable disk".into(),
            ));
        }

        // 2. A VM shell.
        let spec = ShellSpec {
            kvm_device: options.kvm_device.clone(),
            mem_bytes: m.mem_bytes,
            vcpus: m.vcpus,
            dirty_log: options.dirty_tracking,
        };
        let (shell, shell_reused) = match options.shell.take() {
            Some(s) if s.spec == spec => (s, true),
            other => {
                if let Some(s) = other {
                    tracing::warn!(
                        "the VM shell given does not fit the snapshot ({:?} vs {spec:?})",
                        s.spec
                    );
                }
                (Shell::create(&spec)?, false)
            }
        };
        let Shell {
            vcpus: vcpu_fds,
            vm_fd,
            reservation,
            kvm: kvm_sys,
            cpuids,
            mut spares,
            uffd,
            ..
        } = shell;
        steps.done("shell");

        // 3. Memory.
        let mut page_server = None;
        let (ram, bytes_read) = match backend {
            MemoryBackend::Copy => {
                let ram = GuestRam::memfd(reservation)?;
                // SAFETY: nothing runs yet: no vCPU, no device; this is the only slice.
                let image = unsafe { ram.image_mut() };
                let n = self
                    .chain
                    .restore_into(image, HoleFill::AssumeZeroed)
                    .map_err(file_err(dir))?;
                (ram, n)
            }
            MemoryBackend::File => {
                let base = &self.chain.layers()[0];
                let ram =
                    GuestRam::file_private(reservation, base.file(), base.header().data_offset)?;
                // SAFETY: as above.
                let image = unsafe { ram.image_mut() };
                let n = self
                    .chain
                    .overlay_diffs_into(image)
                    .map_err(file_err(dir))?;
                (ram, n)
            }
            MemoryBackend::Uffd => {
                let ram = GuestRam::anonymous(reservation)?;
                let ws = options.working_set.then(|| dir.join(WORKING_SET_FILE));
                let loaded = ws.as_deref().and_then(|p| self.cached_working_set(p));
                let ps = PageServer::start_with(
                    Arc::clone(&self.chain),
                    &[GuestMapping {
                        host_addr: ram.image_addr(),
                        len: m.mem_bytes as usize,
                        image_offset: 0,
                    }],
                    PageServerOptions {
                        working_set: ws,
                        working_set_loaded: loaded,
                        prefetch: options.prefetch,
                    },
                    spare::runner_from(&mut spares),
                    uffd,
                )
                .map_err(file_err(dir))?;
                let n = ps.stats().bytes_read;
                page_server = Some(ps);
                (ram, n)
            }
        };
        ram.clear_vmm_dirty();
        steps.done("memory");

        // 4. The disk (its own overlay), devices, then KVM state.
        let mut overlay = OverlayGuard(None);
        let disk = match &state.disk {
            None => None,
            Some(d) if d.read_only => Some(BlockConfig {
                path: d.layer.clone(),
                read_only: true,
                serial: d.serial.clone(),
            }),
            Some(d) => {
                let path = options.disk_overlay.clone().unwrap_or_else(|| {
                    let mut name = SnapshotId::random().to_string();
                    name.truncate(12);
                    dir.join(format!("resume-{name}.cdsk"))
                });
                disk::ops::create(
                    &path,
                    &disk::ops::CreateOptions {
                        parent: Some(d.layer.clone()),
                        ..Default::default()
                    },
                )?;
                overlay.0 = Some(path.clone());
                tracing::info!(
                    "disk overlay {} on the snapshot's layer {}",
                    path.display(),
                    d.layer.display()
                );
                Some(BlockConfig {
                    path,
                    read_only: false,
                    serial: d.serial.clone(),
                })
            }
        };
        steps.done("disk");
        let (events_tx, events) = mpsc::channel();
        let exit = exit_notifier(&events_tx);
        let devices = DeviceManager::restore(
            &vm_fd,
            &ram.mem,
            &options.serial,
            vsock.as_ref(),
            disk.as_ref(),
            &state.devices,
            exit,
            spare::runner_from(&mut spares),
        )?;
        steps.done("devices");
        kvm_state::restore_vm(&vm_fd, &state.vm)?;
        steps.done("vm_state");
        let mut refused_msrs = Vec::new();
        for (i, (fd, s)) in vcpu_fds.iter().zip(&state.vcpus).enumerate() {
            let current = cpuids.get(i).map(|c| &c[..]);
            let refused = kvm_state::restore_vcpu(fd, s, current).map_err(|e| Error::Vcpu {
                index: i,
                reason: format!("restoring its state: {e}"),
            })?;
            if !refused.is_empty() {
                tracing::warn!("vcpu{i}: KVM refused to restore MSRs {refused:#x?}");
                refused_msrs.extend(refused);
            }
            steps.done("vcpu_state");
            if let Some(vif) = m.pvm_vif_base {
                // After SREGS, which resets the hypervisor's view of the cell.
                if !kvm::register_pvm_vif(fd, vif + i as u64 * 0x1000)? {
                    return Err(Error::Snapshot(
                        "the snapshot was taken under the PVM hypervisor and its guest needs \
                         the PVM virtual-interrupt cell, which this host's KVM lacks"
                            .into(),
                    ));
                }
            }
        }
        steps.done("kvm_state");

        let pvm_native = m.pvm_vif_base.is_some();
        let recording = page_server.as_ref().is_some_and(PageServer::is_recording);
        let config = VmConfig {
            vcpus: m.vcpus,
            mem_mib: m.mem_bytes >> 20,
            kernel: m.kernel.clone(),
            initrd: None,
            cmdline: m.cmdline.clone(),
            serial: options.serial.clone(),
            test_device: state.devices.test_device.is_some(),
            kvm_device: options.kvm_device.clone(),
            vsock,
            disk,
        };
        let mut vm = Vm {
            vcpus: Vec::new(),
            pending_vcpus: vcpu_fds,
            devices,
            events,
            events_tx,
            page_server,
            vm_fd,
            ram,
            _kvm: kvm_sys,
            config,
            pvm_native,
            created_at: t0,
            state: Vm::initial_state(),
            exit: None,
            lineage: Some(Lineage {
                id: meta.id,
                dir: dir.clone(),
                chain: state.chain.clone(),
            }),
            resume_report: None,
            working_set_saved: !recording,
            dirty_tracking: options.dirty_tracking,
            agent_sync: None,
            fork_carry: Vec::new(),
            vcpu_cpus: options.vcpu_cpus.clone(),
            cpuids: state.vcpus.iter().map(|v| v.cpuid.clone()).collect(),
            spares,
        };
        if options.start {
            vm.start()?;
            steps.done("start");
        }
        // The vsock socket and the virtio workers last: the vCPUs' first moments (KVM
        // builds its mappings of the guest's pages) overlap with them.
        vm.devices.finish_restore()?;
        steps.done("devices_finish");
        // The VM owns its overlay from here on.
        overlay.0 = None;
        let report = ResumeReport {
            id: meta.id,
            kind: meta.kind,
            layers: 1 + vm.lineage.as_ref().map_or(0, |l| l.chain.len()),
            backend,
            shell_reused,
            total: t0.elapsed(),
            steps: steps.steps,
            bytes_read,
            page_server: vm.page_server_stats(),
            recording_working_set: recording,
            refused_msrs,
        };
        tracing::info!(
            "resumed snapshot {} ({}, {} backend) in {:?}",
            report.id,
            report.kind,
            backend,
            report.total
        );
        vm.resume_report = Some(report);
        if let (Some(timeout), Some(v)) = (options.agent_sync, &vm.config.vsock) {
            let path = v.uds_path.clone();
            let (tx, rx) = mpsc::sync_channel(1);
            std::thread::Builder::new()
                .name("agent-sync".into())
                .spawn(move || {
                    let _ = tx.send(agent_sync(&path, timeout));
                })
                .map_err(io_err("spawning the agent sync thread"))?;
            vm.agent_sync = Some(rx);
        }
        Ok(vm)
    }
}

/// Removes a disk overlay a failed resume created.
struct OverlayGuard(Option<PathBuf>);

impl Drop for OverlayGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            if let Err(e) = std::fs::remove_file(&p) {
                tracing::warn!("removing the disk overlay {}: {e}", p.display());
            }
        }
    }
}

/// Gives a resumed guest's agent the current time and fresh entropy (best effort, logged).
pub(crate) fn agent_sync(path: &Path, timeout: Duration) -> std::result::Result<Duration, String> {
    let t = Instant::now();
    let result = (|| -> Result<()> {
        let client = crate::agent::Client::connect_timeout(
            path,
            crate::agent::Transport::Vsock {
                port: crate::agent::AGENT_VSOCK_PORT,
            },
            timeout,
        )?;
        client.set_clock(SystemTime::now())?;
        let mut seed = [0u8; 64];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed))
            .map_err(io_err("reading /dev/urandom"))?;
        client.add_entropy(&seed)?;
        Ok(())
    })();
    match result {
        Ok(()) => {
            tracing::info!(
                "agent sync after resume: clock set and entropy added in {:?}",
                t.elapsed()
            );
            Ok(t.elapsed())
        }
        Err(e) => {
            tracing::warn!("agent sync after resume failed (best effort): {e}");
            Err(e.to_string())
        }
    }
}

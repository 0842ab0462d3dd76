//! Restoring a snapshot: a new VM from a snapshot directory ([`restore`], or
//! [`PreparedSnapshot::open`] once and [`PreparedSnapshot::restore`] any number of times).
//!
//! Everything is read and checked first (state file, memory files of the whole chain,
//! geometry, CPU): a bad snapshot fails before any KVM object exists and no file is
//! written. Then a VM shell (from a pool, or built now) gets memory mapped over its reserved
//! address space by one of three [`MemoryBackend`]s and the VM is built from the saved
//! machine ([`crate::builder::from_saved`]). vsock connections do not survive (their host
//! ends belonged to another process): the guest gets a transport reset when it had any,
//! its listening sockets stay. With [`RestoreOptions::agent_sync`] a background thread then
//! gives the guest agent the current time and fresh entropy.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use snapshot::memory_file::{self, HoleFill, MemoryChain, MemoryFile};
use snapshot::page_server::{GuestMapping, PageServer, PageServerOptions, Prefetch};
use snapshot::state_file::{self, Expect};
use snapshot::working_set::WorkingSet;
use snapshot::{CpuCheck, SnapshotId, SnapshotKind};

use super::{file_err, io_err, StatePayload, MEMORY_FILE, STATE_FILE, WORKING_SET_FILE};
use crate::arch::layout::ram_ranges;
use crate::builder::{self, Identity, MemorySlot};
use crate::config::{NetConfig, SerialOutput, VsockConfig};
use crate::error::{Error, Result};
use crate::saved::{
    Lineage, MachineState, MemoryBackend, RestoreReport, SavedDisk, SavedMachine, Steps,
};
use crate::seccomp::ThreadKind;
use crate::vm::Vm;
use crate::vstate::kvm;
use crate::vstate::memory::GuestRam;
use crate::vstate::shell::{Shell, ShellMemory, ShellSpec};
use crate::vstate::spare;

/// Options of [`restore`].
#[derive(Debug)]
pub struct RestoreOptions {
    /// Where the serial console goes.
    pub serial: SerialOutput,
    /// The vsock device's Unix socket; default: the one in the snapshot.
    pub vsock_path: Option<PathBuf>,
    /// KVM device node.
    pub kvm_device: PathBuf,
    /// How closely the snapshot's CPU must match this host's.
    pub cpu_check: CpuCheck,
    /// A pre-built VM shell (e.g. from [`crate::ShellPool::take`]); one that does not
    /// fit the snapshot is dropped and a new one built.
    pub shell: Option<Shell>,
    /// After the vCPUs run, give the guest agent the current time and fresh entropy, in a
    /// background thread that gives up after this long (best effort, logged).
    pub agent_sync: Option<Duration>,
    /// `uffd`: record the working set on the first restore and prefetch it on later ones.
    pub working_set: bool,
    /// `uffd`: how a recorded working set is prefetched.
    pub prefetch: Prefetch,
    /// `uffd`, recording (the snapshot has no working set yet): where the recording is
    /// written instead of the snapshot's directory, which this process may not write (a
    /// jailed VM restoring a template every sandbox reads). Whoever may write there
    /// installs it ([`PreparedSnapshot::adopt_working_set`]).
    pub working_set_to: Option<PathBuf>,
    /// Log dirty pages in the restored VM (needed for its diff snapshots).
    pub dirty_tracking: bool,
    /// Start the vCPUs before returning (otherwise call [`Vm::start`]).
    pub start: bool,
    /// Pin vCPU `i` to host CPU `vcpu_cpus[i % len]` (empty: no pinning; see
    /// [`Vm::pin_vcpus`]).
    pub vcpu_cpus: Vec<usize>,
    /// A snapshot with a writable disk: where the restored VM's own overlay on the
    /// snapshot's frozen disk layer is created (it must not exist; default:
    /// `<snapshot dir>/restore-<random>.cdsk`). The overlay stays after the VM ends.
    pub disk_overlay: Option<PathBuf>,
    /// A snapshot with a network device: the restored VM's TAP (and, optionally, the MAC,
    /// which must be the saved one).
    pub net: Option<NetConfig>,
    /// A listening socket bound ahead elsewhere on the vsock socket's filesystem (by a
    /// standby process): moved to the vsock socket's path instead of binding one there,
    /// if it can be (see `DeviceManager::finish_restore`).
    pub vsock_bound_ahead: Option<crate::device_manager::BoundAhead>,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            serial: SerialOutput::Stdout,
            vsock_path: None,
            kvm_device: PathBuf::from(kvm::KVM_PATH),
            cpu_check: CpuCheck::default(),
            shell: None,
            agent_sync: None,
            working_set: true,
            prefetch: Prefetch::BeforeStart,
            working_set_to: None,
            dirty_tracking: true,
            start: true,
            vcpu_cpus: Vec::new(),
            disk_overlay: None,
            net: None,
            vsock_bound_ahead: None,
        }
    }
}

/// Makes a new VM from the snapshot in `dir` (see the [module documentation](self)):
/// [`PreparedSnapshot::open`] then [`PreparedSnapshot::restore`]. The snapshot's files are
/// only read (a `uffd` restore may add `working_set.ws`). Any error leaves nothing behind:
/// no VM, no changed file.
pub fn restore(dir: &Path, backend: MemoryBackend, options: RestoreOptions) -> Result<Vm> {
    let t0 = Instant::now();
    let prepared = PreparedSnapshot::open(dir, options.cpu_check)?;
    let read = t0.elapsed();
    let vm = prepared.restore_with(backend, options, Some(read))?;
    Ok(vm)
}

/// A snapshot whose files were read and checked (state file, every memory file of its
/// chain, geometry, CPU), ready to be restored any number of times without reading them
/// again. It keeps the memory files open.
pub struct PreparedSnapshot {
    dir: PathBuf,
    header: state_file::Header,
    state: StatePayload,
    chain: Arc<MemoryChain>,
    /// The working set, once a restore found it (it does not change once written).
    working_set: Mutex<Option<Arc<WorkingSet>>>,
}

impl std::fmt::Debug for PreparedSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedSnapshot")
            .field("dir", &self.dir)
            .field("id", &self.header.meta.id)
            .field("kind", &self.header.meta.kind)
            .field("machine", &self.state.saved.machine)
            .finish()
    }
}

impl PreparedSnapshot {
    /// Reads and checks the snapshot in `dir`; nothing is created or written.
    pub fn open(dir: &Path, cpu_check: CpuCheck) -> Result<PreparedSnapshot> {
        let (header, state) = Self::read_state(dir, cpu_check)?;
        let meta = header.meta;
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
        Self::assemble(dir, header, state, layers)
    }

    /// Reads and checks a snapshot whose memory files were opened by the caller: `dir`
    /// holds its state file (and working set), `layers` are its memory files with the
    /// directory of each, base first, the snapshot's own last. For a snapshot opened from
    /// an object store, whose memory is filled lazily ([`snapshot::fetch`]) and whose
    /// bases live elsewhere than the directories its state file names: the restored VM's
    /// lineage (for its diff snapshots) is these directories.
    pub fn open_with_layers(
        dir: &Path,
        cpu_check: CpuCheck,
        layers: Vec<(PathBuf, MemoryFile)>,
    ) -> Result<PreparedSnapshot> {
        let (header, mut state) = Self::read_state(dir, cpu_check)?;
        if layers.len() != state.chain.len() + 1 {
            return Err(Error::Snapshot(format!(
                "{}: a chain of {} snapshots, {} memory files given",
                dir.display(),
                state.chain.len() + 1,
                layers.len()
            )));
        }
        let (dirs, files): (Vec<PathBuf>, Vec<MemoryFile>) = layers.into_iter().unzip();
        state.chain = dirs[..dirs.len() - 1].to_vec();
        Self::assemble(dir, header, state, files)
    }

    /// Reads and checks the state file in `dir` and what it says of the machine.
    fn read_state(dir: &Path, cpu_check: CpuCheck) -> Result<(state_file::Header, StatePayload)> {
        // 1. Read and check everything before touching KVM.
        let expect = Expect {
            cpu_check,
            ..Expect::default()
        };
        let (header, state) =
            state_file::read_with(&dir.join(STATE_FILE), &expect, StatePayload::decode)
                .map_err(file_err(dir))?;
        let meta = header.meta;
        let m = &state.saved.machine;
        if m.vcpus == 0 || state.saved.vcpus.len() != m.vcpus as usize {
            return Err(Error::Snapshot(format!(
                "{}: state for {} vCPUs in a {}-vCPU machine",
                dir.display(),
                state.saved.vcpus.len(),
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
        Ok((header, state))
    }

    /// Checks the memory files against the state and each other.
    fn assemble(
        dir: &Path,
        header: state_file::Header,
        state: StatePayload,
        layers: Vec<MemoryFile>,
    ) -> Result<PreparedSnapshot> {
        let meta = header.meta;
        let m = &state.saved.machine;
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
        Ok(PreparedSnapshot {
            dir,
            header,
            state,
            chain: Arc::new(chain),
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
        &self.state.saved.machine
    }

    /// The disk it restores (its frozen layer; each restored VM gets an overlay on it).
    pub fn disk(&self) -> Option<&SavedDisk> {
        self.state.saved.disk.as_ref()
    }

    /// Points the snapshot's disk at `layer` instead of the path its saved state records:
    /// the same layer chain, found elsewhere (a published snapshot restored on another
    /// host has its layers in the fetcher's cache). The chain at `layer` must open whole,
    /// and its top must be frozen (each restored VM stacks its overlay on it) unless the
    /// disk was read-only. Nothing on disk changes; the state file keeps its path.
    ///
    /// `sources` fills the chain's layers that are filled on demand (`disk::remote`); the
    /// VMs restored from this snapshot read them through it.
    pub fn relocate_disk(
        &mut self,
        layer: PathBuf,
        sources: Option<disk::remote::Sources>,
    ) -> Result<()> {
        let Some(saved) = self.state.saved.disk.as_mut() else {
            return Err(Error::Config(format!(
                "{}: the snapshot has no disk to relocate",
                self.dir.display()
            )));
        };
        let layer = std::path::absolute(&layer).unwrap_or(layer);
        let d = disk::Disk::open_with_sources(
            &layer,
            disk::OpenOptions { read_only: true },
            sources.as_ref(),
        )?;
        saved.sources = sources;
        let frozen = d.layers().first().is_some_and(|l| l.header().frozen());
        drop(d);
        if !saved.read_only && !frozen {
            return Err(Error::Config(format!(
                "{}: not a frozen layer, so it cannot be the snapshot's disk",
                layer.display()
            )));
        }
        tracing::debug!(
            "snapshot disk relocated from {} to {}",
            saved.layer.display(),
            layer.display()
        );
        saved.layer = layer;
        Ok(())
    }

    /// Gives the snapshot's disk chain what fills its layers that are filled on demand
    /// (`disk::remote`: a layer restored from a store through a fetcher, which a snapshot
    /// made later on this host still stands on). Without, such a chain is refused when
    /// the VM is built.
    pub fn set_disk_sources(&mut self, sources: disk::remote::Sources) {
        if let Some(saved) = self.state.saved.disk.as_mut() {
            saved.sources = Some(sources);
        }
    }

    /// The directories of the snapshots below this diff snapshot, base first (empty for a
    /// full snapshot): their memory files are read too.
    pub fn chain_dirs(&self) -> &[PathBuf] {
        &self.state.chain
    }

    /// The VM shell it fits (for a [`crate::ShellPool`]).
    pub fn shell_spec(&self, kvm_device: &Path, dirty_log: bool) -> ShellSpec {
        ShellSpec {
            kvm_device: kvm_device.to_path_buf(),
            mem_bytes: self.state.saved.machine.mem_bytes,
            vcpus: self.state.saved.machine.vcpus,
            dirty_log,
        }
    }

    /// Reads the snapshot's working set ahead (if it has one yet), so that a restore finds
    /// it read. Returns whether it has one.
    pub fn load_working_set(&self) -> bool {
        self.cached_working_set(&self.dir.join(WORKING_SET_FILE))
            .is_some()
    }

    /// Prepares `shell` for a `uffd` restore of this snapshot with its working set
    /// prefetched ([`RestoreOptions::working_set`] and [`RestoreOptions::prefetch`] as by
    /// default): anonymous memory mapped over the shell's address range, registered with
    /// its userfaultfd, the working set installed. That restore then only starts its page
    /// server (~0.15-0.2 ms less on its path here); a restore of another snapshot or with
    /// other options maps fresh memory over it. For a caller that knows which snapshot its
    /// shell will most likely restore and has time before (a standby VM process waiting
    /// with the snapshot opened ahead). Nothing is done without a working set yet (the
    /// first restore records it), for a working set over [`MAX_PREFILL_PAGES`] (held by
    /// a shell nobody may use) or for a shell of another size. On an error the shell is
    /// gone (its memory in an unknown state): build another.
    pub fn prefill_shell(&self, shell: Shell) -> Result<Shell> {
        let m = &self.state.saved.machine;
        let done = matches!(&shell.memory, ShellMemory::Prefilled(_, p) if p.is_of(&self.chain));
        let ws = self.dir.join(WORKING_SET_FILE);
        let loaded = self.cached_working_set(&ws);
        let fits = loaded
            .as_ref()
            .is_some_and(|w| w.pages.len() <= MAX_PREFILL_PAGES);
        if done || shell.spec.mem_bytes != m.mem_bytes || !fits {
            return Ok(shell);
        }
        let Shell {
            vcpus,
            vm_fd,
            memory,
            kvm,
            spec,
            spares,
            uffd,
            cpuids,
            build_time,
        } = shell;
        let options = PageServerOptions {
            working_set_loaded: loaded,
            working_set: Some(ws),
            prefetch: RestoreOptions::default().prefetch,
            record_to: None,
        };
        let (reservation, freed) = memory.into_reservation_and_uffd()?;
        let ram = GuestRam::anonymous(reservation)?;
        let mapping = uffd_mapping(&ram, m.mem_bytes);
        let prefilled =
            PageServer::prefill(Arc::clone(&self.chain), &[mapping], options, uffd.or(freed))
                .map_err(file_err(&self.dir))?;
        Ok(Shell {
            vcpus,
            vm_fd,
            memory: ShellMemory::Prefilled(ram, Box::new(prefilled)),
            kvm,
            spec,
            spares,
            uffd: None,
            cpuids,
            build_time,
        })
    }

    /// Installs the working set a restore of this snapshot recorded elsewhere
    /// ([`RestoreOptions::working_set_to`]) as this snapshot's own, so that later restores
    /// prefetch it: read from `recorded`, checked against this snapshot (its id, its page
    /// count, every page in range and listed once), written anew into the snapshot's
    /// directory. Only a valid working set is written, whatever `recorded` held. Returns the
    /// number of pages; nothing is done (`Ok(None)`) when the snapshot has one already.
    pub fn adopt_working_set(&self, recorded: &Path) -> Result<Option<usize>> {
        let path = self.dir.join(WORKING_SET_FILE);
        if path.exists() {
            return Ok(None);
        }
        let ws = WorkingSet::load(recorded, self.header.meta.id, self.chain.pages())
            .map_err(file_err(&self.dir))?;
        ws.save(&path).map_err(file_err(&self.dir))?;
        Ok(Some(ws.pages.len()))
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

    /// Makes a new VM from this snapshot (see [`restore`]).
    pub fn restore(&self, backend: MemoryBackend, options: RestoreOptions) -> Result<Vm> {
        self.restore_with(backend, options, None)
    }

    /// [`PreparedSnapshot::restore`]; `read` is how long opening the snapshot took, when
    /// that was part of the same call (it is reported as the first step).
    pub(crate) fn restore_with(
        &self,
        backend: MemoryBackend,
        mut options: RestoreOptions,
        read: Option<Duration>,
    ) -> Result<Vm> {
        if backend == MemoryBackend::File && self.chain.layers().iter().any(|l| l.is_fetched()) {
            // A private mapping of a file still being filled would read its holes as zero.
            return Err(Error::Snapshot(format!(
                "{}: the file backend maps the memory file, which is fetched lazily here: use uffd or copy",
                self.dir.display()
            )));
        }
        let t0 = Instant::now();
        let mut steps = Steps::new();
        let dir = &self.dir;
        let saved: &SavedMachine = &self.state.saved;
        let m = &saved.machine;
        let meta = self.header.meta;
        let vsock = match (&m.vsock, &options.vsock_path) {
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
        if saved.disk.as_ref().is_none_or(|d| d.read_only) && options.disk_overlay.is_some() {
            return Err(Error::Config(
                "a disk overlay was given, but the snapshot has no writable disk".into(),
            ));
        }

        // The disk: the snapshot's read-only layer, or an overlay of the VM's own on the
        // frozen layer (removed again if the restore fails).
        let mut overlay = OverlayGuard(None);
        let disk = match &saved.disk {
            None => None,
            Some(d) if d.read_only => Some(d.block_config(None)?),
            Some(d) => {
                let path = options.disk_overlay.clone().unwrap_or_else(|| {
                    let mut name = SnapshotId::random().to_string();
                    name.truncate(12);
                    dir.join(format!("restore-{name}.cdsk"))
                });
                d.create_overlay(&path)?;
                overlay.0 = Some(path.clone());
                tracing::info!(
                    "disk overlay {} on the snapshot's layer {}",
                    path.display(),
                    d.layer.display()
                );
                Some(d.block_config(Some(&path))?)
            }
        };
        steps.done("disk");

        let shell = options.shell.take();
        let mut bytes_read = 0;
        let memory = |slot: MemorySlot<'_>| -> Result<(GuestRam, Option<PageServer>)> {
            match backend {
                MemoryBackend::Copy => {
                    let ram = GuestRam::memfd(slot.memory.into_reservation()?)?;
                    // SAFETY: nothing runs yet: no vCPU, no device; this is the only slice.
                    let image = unsafe { ram.image_mut() };
                    bytes_read = self
                        .chain
                        .restore_into(image, HoleFill::AssumeZeroed)
                        .map_err(file_err(dir))?;
                    Ok((ram, None))
                }
                MemoryBackend::File => {
                    let base = &self.chain.layers()[0];
                    let ram = GuestRam::file_private(
                        slot.memory.into_reservation()?,
                        base.file(),
                        base.header().data_offset,
                    )?;
                    // SAFETY: as above.
                    let image = unsafe { ram.image_mut() };
                    bytes_read = self
                        .chain
                        .overlay_diffs_into(image)
                        .map_err(file_err(dir))?;
                    Ok((ram, None))
                }
                MemoryBackend::Uffd => {
                    let ws = options.working_set.then(|| dir.join(WORKING_SET_FILE));
                    let ps_options = PageServerOptions {
                        working_set_loaded: ws.as_deref().and_then(|p| self.cached_working_set(p)),
                        working_set: ws,
                        prefetch: options.prefetch,
                        record_to: options.working_set_to.clone(),
                    };
                    let runner = spare::runner_for(slot.spares, ThreadKind::PageServer);
                    let (ram, ps) = match slot.memory {
                        // Prefilled for this very restore (a standby's shell): its page
                        // server only starts.
                        ShellMemory::Prefilled(ram, p)
                            if p.matches(
                                &self.chain,
                                &[uffd_mapping(&ram, m.mem_bytes)],
                                &ps_options,
                            ) =>
                        {
                            let ps =
                                PageServer::start_prefilled(*p, runner).map_err(file_err(dir))?;
                            (ram, ps)
                        }
                        other => {
                            let (reservation, freed) = other.into_reservation_and_uffd()?;
                            let ram = GuestRam::anonymous(reservation)?;
                            let ps = PageServer::start_with(
                                Arc::clone(&self.chain),
                                &[uffd_mapping(&ram, m.mem_bytes)],
                                ps_options,
                                runner,
                                slot.uffd.take().or(freed),
                            )
                            .map_err(file_err(dir))?;
                            (ram, ps)
                        }
                    };
                    bytes_read = ps.stats().bytes_read;
                    Ok((ram, Some(ps)))
                }
            }
        };
        let identity = Identity {
            serial: options.serial.clone(),
            vsock,
            disk,
            net: options.net.clone(),
            kvm_device: options.kvm_device.clone(),
            dirty_tracking: options.dirty_tracking,
            vcpu_cpus: options.vcpu_cpus.clone(),
            // A chain fetched from a store lives in a cache that fills lazily and may be
            // evicted: no later diff may name it as its base (its pages would be read
            // back from a sparse file as zeros). Such a VM's next snapshot is a full one.
            lineage: (!self.chain.layers().iter().any(|l| l.is_fetched())).then(|| Lineage {
                id: meta.id,
                dir: dir.clone(),
                chain: self.state.chain.clone(),
            }),
        };
        let builder::Built {
            mut vm,
            refused_msrs,
            shell_reused,
        } = builder::from_saved(saved, shell, memory, identity, &mut steps)?;
        let agent_sync = options.agent_sync.map(|t| (t, None));
        let recording = vm.page_server_recording();
        vm.finish_from_saved(
            options.start,
            agent_sync,
            options.vsock_bound_ahead.take(),
            &mut steps,
        )?;
        // The VM owns its overlay from here on.
        overlay.0 = None;
        let mut report = RestoreReport {
            id: meta.id,
            kind: meta.kind,
            layers: 1 + self.state.chain.len(),
            backend,
            shell_reused,
            total: t0.elapsed(),
            steps: steps.steps,
            bytes_read,
            page_server: vm.page_server_stats(),
            recording_working_set: recording,
            refused_msrs,
        };
        if let Some(read) = read {
            report.steps.insert(0, ("read_check", read));
            report.total += read;
        }
        // Debug: the caller says it (after answering whoever waits for the VM: see
        // `host::restore_request`), with the steps, from `Vm::restore_report`.
        tracing::debug!(
            "restored snapshot {} ({}, {} backend) in {:?}",
            report.id,
            report.kind,
            backend,
            report.total
        );
        vm.set_restore_report(report);
        Ok(vm)
    }
}

/// Removes a disk overlay a failed restore created.
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

/// The largest working set [`PreparedSnapshot::prefill_shell`] installs ahead (64 MiB):
/// memory a waiting shell holds before any sandbox uses it.
pub const MAX_PREFILL_PAGES: usize = 16384;

/// The one userfaultfd mapping of a `uffd` restore: the whole guest image at `ram`.
fn uffd_mapping(ram: &GuestRam, mem_bytes: u64) -> GuestMapping {
    GuestMapping {
        host_addr: ram.image_addr(),
        len: mem_bytes as usize,
        image_offset: 0,
    }
}

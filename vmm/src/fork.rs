//! Forking a running VM ([`fork`]): N children that start from the parent's state at one
//! instant and share its memory copy-on-write.
//!
//! # How
//!
//! 1. The parent's vCPUs and device workers pause ([`Vm::pause_guard`]); its machine is
//!    saved in memory ([`Vm::save_machine`], the same state a snapshot writes).
//! 2. Its memory is *frozen*: a booted VM's memfd becomes the frozen image as it is; a VM
//!    forked before copies the pages it wrote since (KVM dirty log + the VMM's writes) into
//!    a new memfd layer over the previous frozen image. Then, with a spare shell
//!    ([`Vm::give_shell`]; a VM process keeps one), the parent *moves*: it continues in that
//!    pre-built KVM VM, on a new private mapping of the image, with its own devices, vCPU
//!    threads, sockets and connections (`Vm::move_onto`); its former KVM VM and mapping
//!    are torn down in a thread after it runs again. Nothing in this pause grows with the
//!    memory the guest touched. Without a shell the image is mapped `MAP_PRIVATE` over the
//!    same host addresses instead ([`GuestRam::map_frozen`]; KVM's memory slots stay valid,
//!    its MMU notifiers drop the old mappings: ~10 us per touched MiB here, in the pause;
//!    the old mapping's page tables are moved aside and dropped after the pause). Either
//!    way the parent then faults each page in again on its first touch (a read maps the
//!    frozen page, a write copies it).
//! 3. The parent runs again: the pause is steps 1 and 2 only.
//! 4. Each child is a VM shell with the frozen image's layers mapped `MAP_PRIVATE`, built
//!    from the saved machine ([`crate::builder::from_saved`]) with its own identity: vsock
//!    socket and guest CID (the guest gets a transport reset and reads the new CID), serial
//!    output, disk overlay, and with [`ForkOptions::agent_sync`] the current time, fresh
//!    entropy and a hostname suffix given to the guest agent right after it starts (best
//!    effort, in the background).
//!
//! A VM with a virtio-blk disk forks its disk in the same pause: the block worker is
//! paused between requests, its queue position saved with the transport, and the top layer
//! is frozen in place; the parent continues on a new overlay next to it
//! (`<name>-p<k>.cdsk`) and each child gets its own overlay on the frozen layer
//! ([`Frozen::child_overlay`]). A read-only disk is shared as it is.
//!
//! Every file a child gets is named by one scheme, [`child_path`]: `<stem>-f<k>.<ext>`
//! next to the parent's (vsock socket, disk overlay) or in a chosen directory (the process
//! fork of the host layer: API socket, vsock socket, serial console, log, disk overlay),
//! with `k` the fork sequence number that is also the guest's hostname suffix `-f<k>`.
//!
//! Children in other processes: [`Frozen::handoff`] encodes the saved machine and lists
//! the memory layers' memfds; the other process rebuilds it with [`Frozen::from_handoff`]
//! and calls [`Frozen::child`].
//!
//! Pages are shared (page cache of the memfds) until the parent or a child writes one;
//! the first write copies that page (~6.5 us here). A child is an ordinary [`Vm`]: it can
//! be snapshotted, forked again and stopped on its own; dropping the parent does not
//! affect it (the memfds live as long as any mapping of them).
//!
//! # Limits
//!
//! - A VM restored with the `uffd` or `file` backend forks from the snapshot it came from
//!   (or last took): its frozen image is that snapshot's memory files with the pages
//!   written since in a layer over them (the page server stops; pages it never installed
//!   come from the files). The snapshot's directory must stay in place meanwhile (a
//!   snapshot written over it since is refused), and the VM must not have forked or
//!   failed a snapshot since (the record of the pages written is gone then).
//! - A VM with a network device forks only with a TAP for each child
//!   ([`ForkOptions::nets`]): the same TAP name in each child's own network namespace keeps
//!   the guest's addresses valid in every child.
//! - Each fork generation with writes in between adds a layer, and one mapping per run of
//!   written pages to every VM on it (at most 64 layers).
//! - A fork consumes the dirty log: the parent's next diff snapshot needs a full one first.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::builder::{self, Identity, MemorySlot};
use crate::config::{NetConfig, SerialOutput, VsockConfig};
use crate::error::{Error, Result};
use crate::saved::{SavedMachine, Steps};
use crate::vm::{FreezePlan, Vm};
use crate::vstate::memory::FrozenImage;
use crate::vstate::shell::Shell;

/// Options of [`fork`].
#[derive(Debug)]
pub struct ForkOptions {
    /// Where each child's serial console goes (default: discarded).
    pub serial: SerialOutput,
    /// Child `i`'s vsock socket (when the parent has a vsock device); missing entries
    /// default to [`child_path`] of the parent's socket.
    pub vsock_paths: Vec<PathBuf>,
    /// Child `i`'s guest CID; missing entries get a CID unique in this process (and
    /// different from the parent's).
    pub guest_cids: Vec<u32>,
    /// After a child starts, give its guest agent the current time, fresh entropy and the
    /// hostname suffix `-f<k>`, in a background thread that gives up after this long
    /// (default: none).
    pub agent_sync: Option<Duration>,
    /// Pre-built VM shells (e.g. from a [`crate::ShellPool`]); children without one build
    /// their own (default: none).
    pub shells: Vec<Shell>,
    /// Child `i`'s vsock socket bound ahead ([`crate::bind_vsock_ahead`], on the filesystem
    /// of its `vsock_paths` entry): moved into place instead of binding one at the fork;
    /// children without one bind theirs (default: none).
    pub vsock_bound_ahead: Vec<crate::BoundAhead>,
    /// Start the children's vCPUs before returning (default: false; call [`Vm::start`]).
    pub start: bool,
    /// Pin the children's vCPUs (see [`Vm::pin_vcpus`]; default: no pinning).
    pub vcpu_cpus: Vec<usize>,
    /// Child `i`'s TAP (required for each child when the parent has a network device: a
    /// TAP carries one VM; usually the same TAP name in the child's own network namespace,
    /// so the guest's addressing stays valid).
    pub nets: Vec<NetConfig>,
    /// Test hook: fail after this many children were built (checks the cleanup).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fail_after: Option<usize>,
}

impl Default for ForkOptions {
    fn default() -> Self {
        ForkOptions {
            serial: SerialOutput::Discard,
            vsock_paths: Vec::new(),
            guest_cids: Vec::new(),
            agent_sync: None,
            shells: Vec::new(),
            vsock_bound_ahead: Vec::new(),
            start: false,
            vcpu_cpus: Vec::new(),
            nets: Vec::new(),
            #[cfg(any(test, feature = "test-hooks"))]
            fail_after: None,
        }
    }
}

/// A frozen instant of a VM: its memory image and its saved machine. Children are made
/// from it ([`Frozen::child`]), in this process or, handed over, in another.
pub struct Frozen {
    /// The memory.
    image: Arc<FrozenImage>,
    /// Everything else.
    saved: SavedMachine,
    /// The KVM device node the parent used (children use the same).
    kvm_device: PathBuf,
}

/// What a fork did.
#[derive(Debug, Clone)]
pub struct ForkReport {
    /// How long the parent's vCPUs were paused (0 when it was paused already).
    pub pause_time: Duration,
    /// Time steps of the pause, in order.
    pub pause_steps: Vec<(&'static str, Duration)>,
    /// Layers of the frozen image.
    pub layers: usize,
    /// Mappings (runs of pages) each VM on the image has.
    pub mappings: usize,
    /// Building each child (from the end of the pause to it running).
    pub child_times: Vec<Duration>,
    /// Whole call.
    pub total: Duration,
}

/// How freezing the parent went ([`freeze`]).
#[derive(Debug, Clone)]
pub struct FreezeReport {
    /// How long the parent's vCPUs were paused (0 when it was paused already).
    pub pause_time: Duration,
    /// Time steps of the pause, in order.
    pub steps: Vec<(&'static str, Duration)>,
}

/// One child of a fork: its identity and how it starts.
#[derive(Debug)]
pub struct ChildSpec {
    /// Its vsock socket (needed when the parent has a vsock device).
    pub vsock_path: Option<PathBuf>,
    /// Its guest CID.
    pub guest_cid: u32,
    /// Its disk overlay (made with [`Frozen::child_overlay`]) when the parent has a
    /// writable disk.
    pub disk_path: Option<PathBuf>,
    /// Its serial output.
    pub serial: SerialOutput,
    /// A pre-built shell.
    pub shell: Option<Shell>,
    /// See [`ForkOptions::agent_sync`].
    pub agent_sync: Option<Duration>,
    /// Appended to the guest's hostname by the agent sync.
    pub hostname_suffix: String,
    /// Start the vCPUs.
    pub start: bool,
    /// vCPU pinning.
    pub vcpu_cpus: Vec<usize>,
    /// Its TAP (needed when the parent has a network device).
    pub net: Option<NetConfig>,
    /// A listening socket bound ahead on the same filesystem, moved to `vsock_path`
    /// instead of binding one there (its listener and socket file; a child
    /// process waiting for its fork binds one).
    pub vsock_bound_ahead: Option<crate::device_manager::BoundAhead>,
}

/// In the error of a fork refused because the VM's memory cannot be frozen now (a caller
/// can fall back to a snapshot and restores).
pub const CANNOT_FORK_LIVE: &str = "cannot fork live";

/// Most children one fork makes.
pub const MAX_FORK_CHILDREN: usize = 128;

/// `n` must be 1..=[`MAX_FORK_CHILDREN`].
pub(crate) fn check_child_count(n: usize) -> Result<()> {
    if n == 0 || n > MAX_FORK_CHILDREN {
        return Err(Error::Fork(format!(
            "{n} children asked for: a fork makes 1 to {MAX_FORK_CHILDREN}"
        )));
    }
    Ok(())
}

static FORK_SEQ: AtomicU32 = AtomicU32::new(1);

/// The next fork sequence number of this process: the `k` of a child's file names and
/// hostname suffix ([`child_path`]).
pub fn next_fork_seq() -> u32 {
    FORK_SEQ.fetch_add(1, Ordering::Relaxed)
}

/// A child's file: `<dir>/<stem>-f<seq>.<ext>` — the one naming scheme of fork children's
/// files. `dir` and `stem` default to those of `like` (`dir` given: the child's files go
/// there instead).
pub fn child_path(like: &Path, dir: Option<&Path>, seq: u32, ext: &str) -> PathBuf {
    let stem = like
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "vm".into());
    let dir = dir
        .map(Path::to_path_buf)
        .or_else(|| like.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    dir.join(format!("{stem}-f{seq}.{ext}"))
}

/// A guest CID for a fork child: different between processes (from the pid) and between
/// the forks of one process, and never `avoid`.
pub fn process_unique_cid(avoid: u32) -> u32 {
    static CID_SEQ: AtomicU32 = AtomicU32::new(1);
    loop {
        let seq = u64::from(CID_SEQ.fetch_add(1, Ordering::Relaxed));
        let mixed =
            (u64::from(std::process::id()) << 10 | (seq & 0x3ff)) % u64::from(u32::MAX - 2000);
        let c = 1000 + mixed as u32;
        if c != avoid {
            return c;
        }
    }
}

/// Forks `vm`, running or paused, into `n` children (see the [module documentation](self)).
/// The parent runs on afterwards (a paused one stays paused). If building a child fails,
/// the children built so far are stopped and removed, the parent runs on, and the error is
/// returned.
pub fn fork(vm: &mut Vm, n: usize, options: ForkOptions) -> Result<Vec<Vm>> {
    fork_with_report(vm, n, options).map(|(c, _)| c)
}

/// [`fork`], with how it went.
pub fn fork_with_report(
    vm: &mut Vm,
    n: usize,
    mut options: ForkOptions,
) -> Result<(Vec<Vm>, ForkReport)> {
    let t0 = Instant::now();
    check_child_count(n)?;
    let (frozen, freeze_report) = freeze(vm)?;
    let mut children = Vec::with_capacity(n);
    let mut child_times = Vec::with_capacity(n);
    let mut shells = std::mem::take(&mut options.shells).into_iter();
    let mut bound_ahead = std::mem::take(&mut options.vsock_bound_ahead).into_iter();
    let parent_vsock = frozen.saved.machine.vsock.clone();
    for i in 0..n {
        #[cfg(any(test, feature = "test-hooks"))]
        if options.fail_after == Some(i) {
            tracing::warn!("fork: injected failure after {i} children");
            // Dropping the children built so far stops them and removes their sockets.
            return Err(Error::Snapshot(format!(
                "fork: injected failure after {i} children"
            )));
        }
        let t = Instant::now();
        let seq = next_fork_seq();
        let disk_path = match &frozen.saved.disk {
            Some(d) if !d.read_only => {
                let p = unused(|k| child_path(&d.layer, None, k, "cdsk"), seq);
                frozen.child_overlay(&p)?;
                Some(p)
            }
            _ => None,
        };
        let spec = ChildSpec {
            disk_path: disk_path.clone(),
            vsock_path: options.vsock_paths.get(i).cloned().or_else(|| {
                parent_vsock.as_ref().map(|v| {
                    let ext = v
                        .uds_path
                        .extension()
                        .map(|e| e.to_string_lossy().into_owned())
                        .unwrap_or_else(|| "vsock".into());
                    unused(|k| child_path(&v.uds_path, None, k, &ext), seq)
                })
            }),
            guest_cid: options.guest_cids.get(i).copied().unwrap_or_else(|| {
                process_unique_cid(parent_vsock.as_ref().map_or(0, |v| v.guest_cid))
            }),
            serial: options.serial.clone(),
            shell: shells.next(),
            agent_sync: options.agent_sync,
            hostname_suffix: format!("-f{seq}"),
            start: options.start,
            vcpu_cpus: options.vcpu_cpus.clone(),
            net: options.nets.get(i).cloned(),
            vsock_bound_ahead: bound_ahead.next(),
        };
        let child = frozen.child(spec).map_err(|e| {
            tracing::warn!("fork: child {i} failed ({e}); removing {i} children");
            if let Some(p) = &disk_path {
                let _ = std::fs::remove_file(p);
            }
            e
        })?;
        children.push(child);
        child_times.push(t.elapsed());
    }
    let report = ForkReport {
        pause_time: freeze_report.pause_time,
        pause_steps: freeze_report.steps,
        layers: frozen.image.layers(),
        mappings: frozen.image.mappings(),
        child_times,
        total: t0.elapsed(),
    };
    tracing::info!(
        "forked {n} children: parent paused {:?}, {} layers, total {:?}",
        report.pause_time,
        report.layers,
        report.total
    );
    Ok((children, report))
}

/// `name(seq)`, or `name(k)` for the first later `k` whose path is free.
fn unused(name: impl Fn(u32) -> PathBuf, seq: u32) -> PathBuf {
    let p = name(seq);
    if !p.exists() {
        return p;
    }
    loop {
        let p = name(next_fork_seq());
        if !p.exists() {
            return p;
        }
    }
}

/// Pauses `vm`, saves its machine and freezes its memory, lets it run again: the instant
/// children are made from. The parent is left unchanged (still running) on an error.
pub fn freeze(vm: &mut Vm) -> Result<(Frozen, FreezeReport)> {
    vm.check_live("fork")?;
    let plan = vm
        .freeze_plan()
        .map_err(|e| Error::Fork(format!("this VM {CANNOT_FORK_LIVE}: {e}")))?;
    let mut steps = Steps::new();
    let mut paused = vm.pause_guard("fork")?;
    steps.done("pause");
    let captured = capture(paused.vm(), plan, &mut steps);
    let pause_time = paused.release();
    steps.done("unpause");
    // The old mapping's teardown, now that the parent runs again.
    vm.unmap_retired_memory();
    let (image, saved) = captured?;
    // The dirty log was consumed: a diff snapshot would miss pages.
    vm.set_lineage(None);
    let frozen = Frozen {
        image,
        saved,
        kvm_device: vm.config().kvm_device.clone(),
    };
    Ok((
        frozen,
        FreezeReport {
            pause_time,
            steps: steps.steps,
        },
    ))
}

/// Everything that needs the parent paused: its machine, its memory frozen.
fn capture(
    vm: &mut Vm,
    plan: FreezePlan,
    steps: &mut Steps,
) -> Result<(Arc<FrozenImage>, SavedMachine)> {
    let mut saved = vm.save_machine(steps)?;
    let image = vm.freeze_memory(plan, &saved, steps)?;
    saved.disk = vm.freeze_disk("p", steps)?;
    Ok((image, saved))
}

/// The first bytes of a hand-over: what travels besides the saved machine.
#[derive(Serialize, Deserialize)]
struct HandoffHeader {
    /// Each memory layer, base first, in the order of the files: where the image starts
    /// in its file, and its runs.
    layers: Vec<(u64, Vec<(u64, u64)>)>,
    kvm_device: PathBuf,
}

impl Frozen {
    /// The saved machine (shape, devices, disk).
    pub fn saved(&self) -> &SavedMachine {
        &self.saved
    }

    /// Layers of the frozen memory image.
    pub fn layers(&self) -> usize {
        self.image.layers()
    }

    /// The same instant with a private full copy of its memory instead of the shared
    /// copy-on-write image (a fork by copy: the baseline of `clade bench fork`).
    pub fn with_copied_memory(self) -> Result<Frozen> {
        Ok(Frozen {
            image: Arc::new(self.image.deep_copy()?),
            ..self
        })
    }

    /// A new VM from this instant (a child of the fork), with its own identity.
    pub fn child(&self, spec: ChildSpec) -> Result<Vm> {
        let t0 = Instant::now();
        let saved = &self.saved;
        // A missing socket or overlay is refused by the builder, before any KVM object.
        let vsock = saved
            .machine
            .vsock
            .as_ref()
            .and(spec.vsock_path)
            .map(|p| VsockConfig {
                uds_path: p,
                guest_cid: spec.guest_cid,
            });
        let disk = saved
            .disk
            .as_ref()
            .map(|d| d.block_config(spec.disk_path.as_deref()))
            .transpose()?;
        let identity = Identity {
            serial: spec.serial,
            vsock,
            disk,
            // Missing for a parent with a network device: refused by the builder.
            net: spec.net,
            kvm_device: self.kvm_device.clone(),
            dirty_tracking: true,
            vcpu_cpus: spec.vcpu_cpus,
            lineage: None,
        };
        let image = Arc::clone(&self.image);
        let memory = move |slot: MemorySlot<'_>| Ok((slot.memory.forked(&image)?, None));
        let mut steps = Steps::new();
        let mut vm = builder::from_saved(saved, spec.shell, memory, identity, &mut steps)?.vm;
        let agent_sync = spec.agent_sync.map(|t| (t, Some(spec.hostname_suffix)));
        vm.finish_from_saved(spec.start, agent_sync, spec.vsock_bound_ahead, &mut steps)?;
        tracing::debug!("fork child built in {:?}: {:?}", t0.elapsed(), steps.steps);
        Ok(vm)
    }

    /// Makes a child's own overlay at `path` on the frozen disk layer (only for a writable
    /// disk; a read-only one is shared as it is).
    pub fn child_overlay(&self, path: &Path) -> Result<()> {
        match &self.saved.disk {
            Some(d) => d.create_overlay(path),
            None => Ok(()),
        }
    }

    /// This frozen instant for a child in another process: the state as bytes, and the
    /// memory layers' files (base first) the child must receive, in this order, to call
    /// [`Frozen::from_handoff`].
    pub fn handoff(&self) -> Result<(Vec<u8>, Vec<&std::fs::File>)> {
        let files: Vec<&std::fs::File> = self.image.parts().map(|(f, _, _)| f).collect();
        let header = HandoffHeader {
            layers: self
                .image
                .parts()
                .map(|(_, at, runs)| (at, runs.to_vec()))
                .collect(),
            kvm_device: self.kvm_device.clone(),
        };
        let encode =
            |e: postcard::Error| Error::Snapshot(format!("encoding the fork handoff: {e}"));
        let mut bytes = postcard::to_allocvec(&header).map_err(encode)?;
        bytes.extend(postcard::to_allocvec(&self.saved).map_err(encode)?);
        Ok((bytes, files))
    }

    /// The frozen instant another process handed over ([`Frozen::handoff`]): its bytes and
    /// the memory layers' files in the same order.
    pub fn from_handoff(bytes: &[u8], files: Vec<std::fs::File>) -> Result<Frozen> {
        let decode =
            |e: postcard::Error| Error::Snapshot(format!("decoding the fork handoff: {e}"));
        let (header, rest): (HandoffHeader, _) =
            postcard::take_from_bytes(bytes).map_err(decode)?;
        let (saved, rest): (SavedMachine, _) = postcard::take_from_bytes(rest).map_err(decode)?;
        if !rest.is_empty() {
            return Err(Error::Snapshot(format!(
                "fork handoff: {} bytes after the state",
                rest.len()
            )));
        }
        if header.layers.len() != files.len() {
            return Err(Error::Snapshot(format!(
                "fork handoff: {} memory layers but {} files",
                header.layers.len(),
                files.len()
            )));
        }
        if saved.machine.vcpus == 0 || saved.vcpus.len() != saved.machine.vcpus as usize {
            return Err(Error::Snapshot(format!(
                "fork handoff: state for {} vCPUs in a {}-vCPU machine",
                saved.vcpus.len(),
                saved.machine.vcpus
            )));
        }
        let image = FrozenImage::from_parts(
            files
                .into_iter()
                .zip(header.layers)
                .map(|(f, (at, runs))| (f, at, runs))
                .collect(),
            saved.machine.mem_bytes,
        )?;
        Ok(Frozen {
            image: Arc::new(image),
            saved,
            kvm_device: header.kvm_device,
        })
    }
}

//! A cgroup per VM process: what one sandbox may take of the host's CPU, memory and
//! process table, so that a busy or leaking guest does not take its neighbours' share.
//!
//! Each VM process joins a cgroup of its own before it executes (`cgroup.procs` written
//! between fork and exec), so nothing it does runs outside its limits. A standby process
//! gets its cgroup when it starts, while it waits, with the limits of its shape: a create
//! or a wake that takes it moves nothing. A fork child is moved into a cgroup of its own
//! with its parent's limits as soon as the parent reports it (on cgroup v1 the little
//! memory it charged before stays with the parent's).
//!
//! Limits of a VM of `vcpus` vCPUs and `mem_mib` MiB ([`LimitsConfig::for_shape`]): CPU
//! time of `vcpus × cpu_share` CPUs (a hard quota; `cpu_share` below 1 oversubscribes the
//! host) and a CPU weight of 100 per vCPU; memory of the guest's RAM plus a bounded VMM
//! overhead (a guest that fills its memory and more is killed by the kernel, inside its
//! cgroup: the host's other processes are untouched); a number of processes and threads;
//! an I/O weight where the block scheduler has weights.
//!
//! The cgroups of one service are under `clade/s-<hash of its state directory>`: each
//! service sweeps only its own. Those of VM processes that ended are removed when the
//! driver sees them end, or by a later sweep (a cgroup that still holds processes — a fork
//! child started inside its parent's — cannot be removed and is kept).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use vmm::host::cgroup::{Cgroup, CgroupLimits, Hierarchy};

use crate::error::{Error, Result};
use crate::ids;

use super::Shape;

/// How a VM's limits follow from its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitsConfig {
    /// CPUs' worth of time per vCPU (1.0: a VM may use all its vCPUs fully; 0.5: half).
    pub cpu_share: f64,
    /// Memory allowed beyond the guest's RAM for the VMM itself (MiB).
    pub vmm_overhead_mib: u64,
    /// Processes and threads per VM process (and the fork children started inside it).
    pub pids_max: u64,
    /// I/O weight (1..=10000), applied where the host's block scheduler has weights.
    pub io_weight: Option<u32>,
    /// TEST HARNESS ONLY: this memory limit (MiB) whatever the shape, so that a test
    /// guest can go over it.
    pub test_memory_mib: Option<u64>,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            cpu_share: 1.0,
            vmm_overhead_mib: 192,
            pids_max: 1024,
            io_weight: Some(100),
            test_memory_mib: None,
        }
    }
}

impl LimitsConfig {
    /// The limits of a VM of `shape`.
    pub fn for_shape(&self, shape: Shape) -> CgroupLimits {
        let vcpus = shape.vcpus.max(1);
        CgroupLimits {
            memory_max: Some(
                self.test_memory_mib
                    .unwrap_or(shape.mem_mib.saturating_add(self.vmm_overhead_mib))
                    << 20,
            ),
            pids_max: Some(self.pids_max),
            cpus: Some(f64::from(vcpus) * self.cpu_share),
            cpu_weight: Some((100 * vcpus).min(10_000)),
            io_weight: self.io_weight,
        }
    }

    fn check(&self) -> Result<()> {
        if !(self.cpu_share.is_finite() && self.cpu_share > 0.0 && self.cpu_share <= 64.0) {
            return Err(Error::BadRequest(format!(
                "CPU share per vCPU {}: must be above 0 and at most 64",
                self.cpu_share
            )));
        }
        if self.pids_max < 16 {
            return Err(Error::BadRequest(format!(
                "process limit {}: a VM process needs at least 16",
                self.pids_max
            )));
        }
        Ok(())
    }
}

/// The cgroups of one service's VM processes.
#[derive(Debug)]
pub struct VmCgroups {
    hierarchy: Hierarchy,
    parent: String,
    cfg: LimitsConfig,
    /// The cgroup (and its limits) of each VM process, by its API socket.
    live: Mutex<HashMap<PathBuf, (Cgroup, CgroupLimits)>>,
}

impl VmCgroups {
    /// The cgroups of the service whose state is in `state_dir`: finds the host's
    /// hierarchy (an error naming what is missing if the limits cannot be applied) and
    /// sweeps what an earlier run left.
    pub fn new(state_dir: &Path, cfg: LimitsConfig) -> Result<VmCgroups> {
        cfg.check()?;
        let probe = cfg.for_shape(Shape {
            vcpus: 1,
            mem_mib: 64,
        });
        let hierarchy = Hierarchy::detect(&probe).map_err(|e| Error::Vm(e.to_string()))?;
        // Short and stable: one name per state directory.
        let hash = state_dir
            .as_os_str()
            .as_encoded_bytes()
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
            });
        let parent = format!("clade/s-{:012x}", hash & 0xffff_ffff_ffff);
        let mut cfg = cfg;
        if cfg.io_weight.is_some() && !hierarchy.io_weight_supported(&parent) {
            tracing::warn!(
                "no I/O weight for sandboxes: no block device of this host uses BFQ (the \
                 scheduler with weights); CPU, memory and process limits apply"
            );
            cfg.io_weight = None;
        }
        let cgroups = VmCgroups {
            hierarchy,
            parent,
            cfg,
            live: Mutex::new(HashMap::new()),
        };
        cgroups.sweep();
        tracing::info!(hierarchy = ?cgroups.hierarchy, parent = %cgroups.parent, "sandbox cgroups");
        Ok(cgroups)
    }

    /// The limits a VM of `shape` gets.
    pub fn limits(&self, shape: Shape) -> CgroupLimits {
        self.cfg.for_shape(shape)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, (Cgroup, CgroupLimits)>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new cgroup with `limits`.
    fn create(&self, limits: &CgroupLimits) -> Result<Cgroup> {
        let name = format!("{}/vm-{}", self.parent, ids::random_string(12));
        Cgroup::create(&self.hierarchy, &name, limits).map_err(|e| Error::Vm(e.to_string()))
    }

    /// Makes the process `cmd` starts join a new cgroup of `shape`'s limits before it
    /// executes. The group is removed when the [`Joining`] is dropped, unless
    /// [`Joining::adopt`] records it as a VM process's first.
    pub(crate) fn join_new(self: &Arc<Self>, cmd: &mut Command, shape: Shape) -> Result<Joining> {
        let limits = self.limits(shape);
        let cgroup = self.create(&limits)?;
        let files: Vec<OwnedFd> = match cgroup
            .procs_files()
            .iter()
            .map(|f| File::options().write(true).open(f).map(OwnedFd::from))
            .collect::<std::io::Result<_>>()
        {
            Ok(f) => f,
            Err(e) => {
                let _ = cgroup.remove();
                return Err(Error::Vm(format!(
                    "opening the cgroup of a VM process: {e}"
                )));
            }
        };
        let raw: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the child between fork and exec and makes only
        // async-signal-safe calls (write on descriptors opened before the fork), touching
        // no memory but the vector captured before the fork.
        unsafe {
            cmd.pre_exec(move || {
                for fd in &raw {
                    if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            })
        };
        Ok(Joining {
            owner: Arc::clone(self),
            group: Some((cgroup, limits)),
            _files: files,
        })
    }

    /// The VM process behind `api_sock` ended: its cgroup goes (kept while fork children
    /// started inside it run; a later sweep removes it).
    pub(crate) fn release(&self, api_sock: &Path) {
        let Some((cg, _)) = self.lock().remove(api_sock) else {
            // A VM started by an earlier run of the service (sandboxes outlive it): its
            // group is not known here; the empty ones of this service go, except those
            // just made (a process may be about to join one).
            self.sweep_own(SETTLED_AGE);
            return;
        };
        if cg.pids().is_empty() {
            if let Err(e) = cg.remove() {
                tracing::debug!("{e}; the next sweep removes it");
            }
        }
    }

    /// Moves the fork child `pid` (its VM behind `child_sock`) into a cgroup of its own
    /// with the limits of its parent's (behind `parent_sock`).
    pub(crate) fn adopt_child(&self, parent_sock: &Path, child_sock: &Path, pid: i32) {
        let Some(limits) = self.lock().get(parent_sock).map(|(_, l)| l.clone()) else {
            tracing::warn!(
                pid,
                "fork child stays in its parent's cgroup: the parent's is not known here"
            );
            return;
        };
        let moved = self.create(&limits).and_then(|cg| match cg.add(pid) {
            Ok(()) => Ok(cg),
            Err(e) => {
                let _ = cg.remove();
                Err(Error::Vm(e.to_string()))
            }
        });
        match moved {
            Ok(cg) => {
                self.lock().insert(child_sock.to_path_buf(), (cg, limits));
            }
            Err(e) => tracing::warn!(pid, "fork child stays in its parent's cgroup: {e}"),
        }
    }

    /// Why the VM process behind `api_sock`, which ended, was killed, if its cgroup
    /// knows: the kernel killed a process of it for going over its memory limit.
    pub fn killed_for(&self, api_sock: &Path) -> Option<String> {
        let st = self.lock();
        let (cg, limits) = st.get(api_sock)?;
        (cg.oom_kills()? > 0).then(|| {
            format!(
                "killed by the kernel: over its memory limit of {} MiB (guest RAM + VMM)",
                limits.memory_max.unwrap_or(0) >> 20
            )
        })
    }

    /// Removes this service's cgroups that hold no process and belong to no VM process
    /// it knows, and the empty ones of services that were killed (those older than
    /// [`FOREIGN_AGE`]: another live service may have just made one).
    pub fn sweep(&self) {
        for other in self.hierarchy.children("clade") {
            let parent = format!("clade/{other}");
            if parent == self.parent || !other.starts_with("s-") {
                continue;
            }
            for name in self.hierarchy.children(&parent) {
                let Ok(cg) = self.hierarchy.cgroup(&format!("{parent}/{name}")) else {
                    continue;
                };
                if older_than(&cg, FOREIGN_AGE) && cg.pids().is_empty() {
                    let _ = cg.remove();
                }
            }
            if self.hierarchy.children(&parent).is_empty() {
                if let Ok(cg) = self.hierarchy.cgroup(&parent) {
                    let _ = cg.remove();
                }
            }
        }
        self.sweep_own(std::time::Duration::ZERO);
    }

    /// Removes this service's empty groups that no VM process it knows has and that are
    /// at least `min_age` old.
    fn sweep_own(&self, min_age: std::time::Duration) {
        let known: Vec<PathBuf> = self
            .lock()
            .values()
            .map(|(c, _)| c.path().to_path_buf())
            .collect();
        for name in self.hierarchy.children(&self.parent) {
            let Ok(cg) = self.hierarchy.cgroup(&format!("{}/{name}", self.parent)) else {
                continue;
            };
            if known.contains(&cg.path().to_path_buf()) || !cg.pids().is_empty() {
                continue;
            }
            if !min_age.is_zero() && !older_than(&cg, min_age) {
                continue;
            }
            if let Err(e) = cg.remove() {
                tracing::debug!("sweep: {e}");
            }
        }
    }
}

/// Whether the group's directory was made (last changed) more than `age` ago.
fn older_than(cg: &Cgroup, age: std::time::Duration) -> bool {
    std::fs::metadata(cg.path())
        .and_then(|m| m.modified())
        .is_ok_and(|t| t.elapsed().is_ok_and(|a| a > age))
}

/// How old an empty group of this service must be before a sweep during its run removes
/// it: one is empty only between its creation and its process's start (milliseconds).
const SETTLED_AGE: std::time::Duration = std::time::Duration::from_secs(2);

/// How old an empty cgroup of another service must be before a sweep removes it.
const FOREIGN_AGE: std::time::Duration = std::time::Duration::from_secs(120);

impl Drop for VmCgroups {
    /// The service ends: its empty cgroups go (those of sandboxes' VMs, which outlive it,
    /// stay).
    fn drop(&mut self) {
        self.lock().clear();
        self.sweep_own(std::time::Duration::ZERO);
        if self.hierarchy.children(&self.parent).is_empty() {
            if let Ok(cg) = self.hierarchy.cgroup(&self.parent) {
                let _ = cg.remove();
            }
        }
    }
}

/// A new VM process's cgroup, between its creation and the time the process is known to
/// run (a standby: until it is taken). Dropped, it removes the group.
#[derive(Debug)]
pub(crate) struct Joining {
    owner: Arc<VmCgroups>,
    group: Option<(Cgroup, CgroupLimits)>,
    /// Its `cgroup.procs` files, open for the child to write to before it executes.
    _files: Vec<OwnedFd>,
}

impl Joining {
    /// Makes its group idle or normal ([`Cgroup::set_idle`]); false where it cannot be.
    pub(crate) fn set_idle(&self, idle: bool) -> bool {
        match &self.group {
            Some((cg, limits)) => match cg.set_idle(idle, limits.cpu_weight) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!("{e}");
                    false
                }
            },
            None => false,
        }
    }

    /// Records the group as that of the VM process behind `api_sock` (released when the
    /// driver sees it end).
    pub(crate) fn adopt(mut self, api_sock: &Path) {
        if let Some(g) = self.group.take() {
            self.owner.lock().insert(api_sock.to_path_buf(), g);
        }
    }
}

impl Drop for Joining {
    fn drop(&mut self) {
        if let Some((cg, _)) = self.group.take() {
            if let Err(e) = cg.remove() {
                tracing::debug!("{e}; the next sweep removes it");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_shape() {
        let cfg = LimitsConfig {
            cpu_share: 0.5,
            vmm_overhead_mib: 100,
            pids_max: 500,
            io_weight: None,
            test_memory_mib: None,
        };
        let l = cfg.for_shape(Shape {
            vcpus: 2,
            mem_mib: 512,
        });
        assert_eq!(l.memory_max, Some(612 << 20));
        assert_eq!(l.cpus, Some(1.0));
        assert_eq!(l.cpu_weight, Some(200));
        assert_eq!(l.pids_max, Some(500));
        assert!(LimitsConfig {
            cpu_share: 0.0,
            ..LimitsConfig::default()
        }
        .check()
        .is_err());
        assert!(LimitsConfig {
            pids_max: 3,
            ..LimitsConfig::default()
        }
        .check()
        .is_err());
    }
}

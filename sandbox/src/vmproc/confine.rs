//! The jail and cgroup of a template build's VM process: the service builds templates
//! from what tenants send (E2B's build API: their images, files and commands), so a build
//! VM is confined as a sandbox's is — a uid of its own from the jail's range, its own
//! namespaces and a root with only its files, a cgroup with its shape's limits.
//!
//! A build VM writes in one directory at a time (a build's run directory in the build
//! cache, then the new template's directory): it is handed over to the VM's uid while the
//! VM runs and taken back once the process has ended — owned by the service again, and
//! readable by every jailed VM, since what a build leaves (frozen layers, the template's
//! snapshot) is what sandboxes and later build VMs read.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use clade_builder::vm::Confine;

use super::jail::{self, Jails};
use super::limits::{Joining, VmCgroups};
use super::Shape;

/// Confines the service's build VMs: with its jails, its cgroups, or both.
#[derive(Debug)]
pub struct BuildConfinement {
    jails: Option<Arc<Jails>>,
    cgroups: Option<Arc<VmCgroups>>,
}

impl BuildConfinement {
    /// Build VMs jailed by `jails` and limited by `cgroups` (None when both are: nothing
    /// to confine with, said where the service was told `--no-jail --no-limits`).
    pub fn new(jails: Option<Arc<Jails>>, cgroups: Option<Arc<VmCgroups>>) -> Option<Self> {
        (jails.is_some() || cgroups.is_some()).then_some(Self { jails, cgroups })
    }
}

/// A build VM's confinement while its process lives.
struct Lease {
    /// The directory handed over (taken back on drop).
    dir: Option<PathBuf>,
    /// Its jail's root (an empty directory, removed on drop).
    root: Option<PathBuf>,
    /// Its cgroup (removed on drop).
    _cgroup: Option<Joining>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            if let Err(e) = jail::take_back(dir) {
                tracing::warn!(dir = %dir.display(), "a build VM's directory: {e}");
            }
        }
        if let Some(root) = &self.root {
            let _ = std::fs::remove_dir(root);
        }
    }
}

impl Confine for BuildConfinement {
    fn confine(
        &self,
        cmd: &mut Command,
        dir: &Path,
        vcpus: u32,
        mem_mib: u64,
    ) -> Result<Box<dyn Send>, String> {
        let mut lease = Lease {
            dir: None,
            root: None,
            _cgroup: None,
        };
        if let Some(j) = &self.jails {
            let token = format!("build-{}", crate::ids::random_string(12));
            let l = j.prepare_alone(cmd, &token).map_err(|e| e.to_string())?;
            lease.root = Some(l.root);
            jail::hand_over(dir, l.uid).map_err(|e| e.to_string())?;
            lease.dir = Some(dir.to_path_buf());
            tracing::info!(uid = l.uid, dir = %dir.display(), "build VM jailed");
        }
        if let Some(cg) = &self.cgroups {
            lease._cgroup = Some(
                cg.join_new(cmd, Shape { vcpus, mem_mib })
                    .map_err(|e| e.to_string())?,
            );
        }
        Ok(Box::new(lease))
    }
}

//! Saving a [`Vm`]'s state for a snapshot or a fork: its machine (vCPUs, VM, devices, at
//! one instant) and its disk (the top layer frozen, the VM continuing on a new overlay).
//! Guest memory is frozen elsewhere (`freeze.rs`): the two are separate steps of a
//! snapshot, ordered by its caller.

use std::path::PathBuf;

use super::{RunState, Vm};
use crate::error::{Error, Result};
use crate::saved::{MachineState, SavedDisk, SavedMachine, SavedVsock, Steps};
use crate::vstate::state::{self as kvm_state, Capabilities};

impl Vm {
    /// The machine's shape, as VMs built from its saved state need it.
    fn machine_state(&self) -> MachineState {
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

    /// Everything but memory and disk, at this instant: vCPUs (each read on its own
    /// thread), VM, devices. The disk is the caller's to freeze ([`Vm::freeze_disk`]) once
    /// the memory is safe, so that a failed snapshot or fork does not grow the disk's
    /// layer chain. Call through a [`PauseGuard`](super::lifecycle::PauseGuard).
    pub(crate) fn save_machine(&mut self, steps: &mut Steps) -> Result<SavedMachine> {
        if !self.devices.is_paused() {
            return Err(Error::Snapshot(
                "the VM must be paused for its state to be saved".into(),
            ));
        }
        let caps = Capabilities::probe(&self.kvm)?;
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
        steps.done("save_vcpus");
        let vm = kvm_state::save_vm(&self.vm_fd)?;
        let devices = self.devices.save()?;
        steps.done("save_vm_devices");
        Ok(SavedMachine {
            machine: self.machine_state(),
            vm,
            vcpus,
            devices,
            disk: None,
        })
    }

    /// The disk's half of a saved machine (vCPUs and devices paused): the top layer is
    /// flushed and frozen, and the VM continues on a new overlay next to it
    /// (`<name>-<tag><k>.cdsk`); a read-only disk stays as it is.
    pub(crate) fn freeze_disk(
        &mut self,
        tag: &str,
        steps: &mut Steps,
    ) -> Result<Option<SavedDisk>> {
        let disk = self.freeze_disk_layer(tag)?;
        if let Some(d) = &disk {
            tracing::debug!("disk layer {} frozen", d.layer.display());
            steps.done("freeze_disk");
        }
        Ok(disk)
    }

    /// Freezes the disk's top layer as it is now (the vCPUs stopped meanwhile, then run
    /// again if they ran) and continues on a new overlay on it: what a build step made.
    /// Returns the frozen layer and the new top. Errors: no writable disk, a VM that is
    /// neither running nor paused, I/O.
    pub fn freeze_disk_now(&mut self) -> Result<(PathBuf, PathBuf)> {
        self.poll_exit();
        let running = match self.state {
            RunState::Running => true,
            RunState::Paused => false,
            _ => return Err(self.invalid("freeze its disk")),
        };
        if self.config.disk.as_ref().is_none_or(|d| d.read_only) {
            return Err(Error::Config(
                "freeze_disk: the VM has no writable disk".into(),
            ));
        }
        if running {
            self.pause()?;
        }
        let frozen = self.freeze_disk_layer("s");
        if running {
            self.unpause()?;
        }
        let d = frozen?.ok_or_else(|| Error::Config("freeze_disk: the VM has no disk".into()))?;
        let top = self
            .config
            .disk
            .as_ref()
            .map(|c| c.path.clone())
            .unwrap_or_default();
        Ok((d.layer, top))
    }

    fn freeze_disk_layer(&mut self, tag: &str) -> Result<Option<SavedDisk>> {
        let (Some(disk), Some(cfg)) = (self.devices.disk(), self.config.disk.clone()) else {
            return Ok(None);
        };
        if cfg.read_only {
            return Ok(Some(SavedDisk {
                layer: absolute(cfg.path),
                read_only: true,
                serial: cfg.serial,
                sources: cfg.sources,
            }));
        }
        let mut d = disk.lock().unwrap_or_else(|e| e.into_inner());
        let new_top = sibling_layer(d.path(), tag);
        let frozen = absolute(d.snapshot(&new_top)?);
        drop(d);
        if let Some(c) = self.config.disk.as_mut() {
            c.path = new_top;
        }
        Ok(Some(SavedDisk {
            layer: frozen,
            read_only: false,
            serial: cfg.serial,
            sources: cfg.sources,
        }))
    }
}

/// `p` resolved to an absolute path (as it is when it cannot be).
fn absolute(p: PathBuf) -> PathBuf {
    p.canonicalize().unwrap_or(p)
}

/// A new layer's path next to `layer`: `<stem>-<tag><k>.cdsk`, a name not taken.
fn sibling_layer(layer: &std::path::Path, tag: &str) -> PathBuf {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let stem = layer
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "disk".into());
    // `disk-s4` becomes `disk-s<k>`, not `disk-s4-s<k>`: a VM that freezes its disk many
    // times (a build's steps, a sandbox's pauses) keeps names of one length.
    let stem = match stem.rsplit_once(&format!("-{tag}")) {
        Some((base, n))
            if !base.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) =>
        {
            base.to_string()
        }
        _ => stem,
    };
    let dir = layer.parent().unwrap_or(std::path::Path::new("."));
    loop {
        let k = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = dir.join(format!("{stem}-{tag}{k}.cdsk"));
        if !p.exists() {
            return p;
        }
    }
}

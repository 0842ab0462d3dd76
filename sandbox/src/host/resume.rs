//! Resume and connect: a paused sandbox runs again, restoring its pause snapshot (claimed
//! in the store first when it is durable, so one host only resumes it), or booting its
//! template's kernel from its own disk when its memory was dropped (or `reboot` asks).

use super::*;

impl Host {
    /// What a sandbox whose memory is dropped boots: its template's kernel, with a clear
    /// error when it cannot (a template built before builds recorded their boot, a disk
    /// that stands on layers in the object store).
    pub(super) fn boot_files(
        &self,
        rec: &Record,
        template: &Template,
    ) -> Result<template::BootFiles> {
        let Some(boot) = &template.boot else {
            return Err(Error::BadRequest(format!(
                "sandbox {}: its template '{}' records no boot (it was built before \
                 templates kept their kernel; rebuild it with clade template build), so its \
                 memory cannot be dropped: pause and resume with memory",
                rec.id, template.name
            )));
        };
        if rec.remote.is_some() || from_store(&rec.dir) {
            return Err(Error::BadRequest(format!(
                "sandbox {}: its disk stands on layers in the object store, which a boot \
                 cannot read yet: pause and resume with memory",
                rec.id
            )));
        }
        self.templates.boot_files(boot)
    }

    /// Boots a sandbox whose memory was dropped (or is to be, `on_resume="reboot"`) from
    /// its own disk: after a filesystem-only pause the disk it wrote, after a pause with
    /// memory a new overlay on the disk layer that pause froze.
    pub(super) fn boot_locked(&self, rec: &mut Record, template: &Template) -> Result<()> {
        let files = self.boot_files(rec, template)?;
        let disk = match (template.disk, rec.memory_dropped, &rec.snapshot) {
            (false, _, _) => None,
            (true, true, _) => match &rec.disk {
                Some(d) if d.exists() => Some(d.clone()),
                _ => {
                    return Err(Error::Corrupt(format!(
                        "sandbox {} was paused without its memory, but its disk {} is gone",
                        rec.id,
                        rec.disk.as_deref().unwrap_or(Path::new("")).display()
                    )))
                }
            },
            (true, false, Some(snapshot)) => {
                let prepared = vmm::PreparedSnapshot::open(snapshot, vmm::CpuCheck::default())
                    .map_err(|e| Error::Vm(format!("snapshot {}: {e}", snapshot.display())))?;
                let Some(saved) = prepared.disk() else {
                    return Err(Error::Corrupt(format!(
                        "snapshot {} of sandbox {} has no disk",
                        snapshot.display(),
                        rec.id
                    )));
                };
                let overlay = rec.dir.join(format!("disk-r{}.cdsk", rec.pauses));
                let _ = std::fs::remove_file(&overlay);
                disk::ops::create(
                    &overlay,
                    &disk::ops::CreateOptions {
                        virtual_size: None,
                        block_size: None,
                        parent: Some(saved.layer.clone()),
                    },
                )
                .map_err(|e| Error::Vm(format!("a disk to boot sandbox {}: {e}", rec.id)))?;
                Some(overlay)
            }
            (true, false, None) => {
                return Err(Error::Corrupt(format!(
                    "paused sandbox {} has no snapshot",
                    rec.id
                )))
            }
        };
        self.start_vm(rec, template, Origin::Boot { files, disk })?;
        rec.memory_dropped = false;
        Ok(())
    }

    /// Resumes a paused sandbox (E2B `resume`): an error if it runs. With `reboot`, its
    /// memory is dropped and it boots from its disk (E2B's `memory: false`).
    pub fn resume(&self, id: &str, timeout_s: u64, reboot: bool) -> Result<Record> {
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let (rec, adopted) = self.load_or_adopt(id)?;
        let r = lifecycle::permit(if reboot { Op::Reboot } else { Op::Resume }, &rec)
            .and_then(|_| self.resume_locked(rec, timeout_s, reboot));
        self.keep_adopted(id, r, adopted)
    }

    /// E2B `connect`: a running sandbox gets at least `timeout_s` more, a paused one is
    /// resumed first (with `reboot`, booted from its disk). Returns the sandbox and whether
    /// it was resumed.
    pub fn connect(&self, id: &str, timeout_s: u64, reboot: bool) -> Result<(Record, bool)> {
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let (mut rec, adopted) = self.load_or_adopt(id)?;
        let r = lifecycle::permit(Op::Connect, &rec).and_then(|_| {
            if rec.state == State::Running {
                rec.end_ms = rec.end_ms.max(ids::now_ms() + (timeout_s as i64) * 1000);
                self.reg().update(&rec)?;
                return Ok((rec, false));
            }
            Ok((self.resume_locked(rec, timeout_s, reboot)?, true))
        });
        self.keep_adopted(id, r, adopted)
    }

    pub(super) fn resume_locked(
        &self,
        rec: Record,
        timeout_s: u64,
        reboot: bool,
    ) -> Result<Record> {
        let _room = self.admit(rec.vcpus, rec.mem_mib, 1)?;
        let r = self.resume_vm_locked(rec, timeout_s, reboot)?;
        self.owned(&r);
        Ok(r)
    }

    pub(super) fn resume_vm_locked(
        &self,
        mut rec: Record,
        timeout_s: u64,
        reboot: bool,
    ) -> Result<Record> {
        let template = self.sandbox_template(&rec)?;
        if reboot || rec.memory_dropped {
            let t = std::time::Instant::now();
            self.boot_locked(&mut rec, &template)?;
            rec.end_ms = ids::now_ms() + (timeout_s as i64) * 1000;
            self.reg().update(&rec)?;
            tracing::info!(sandbox = %rec.id, elapsed = ?t.elapsed(), "booted from its disk");
            return Ok(rec);
        }
        // A pause another host may take over is resumed by one host only. A claim made
        // now is given back if the VM does not start (none runs that pause then): a store
        // fault in the start leaves the sandbox resumable, here or on another host.
        let claimed = match (rec.durable(), &self.durable) {
            (true, Some(d)) => d.claim_fresh(&rec.id, rec.pauses)?.then_some(d),
            _ => None,
        };
        let snapshot = match (&rec.remote, &rec.snapshot) {
            (Some(id), _) => PathBuf::from(id),
            (None, Some(s)) => s.clone(),
            (None, None) => {
                return Err(Error::Corrupt(format!(
                    "paused sandbox {} has no snapshot",
                    rec.id
                )))
            }
        };
        let t = std::time::Instant::now();
        let origin = Origin::Snapshot {
            dir: &snapshot,
            reused: false,
        };
        let give_back = |rec: &Record| {
            if let Some(d) = claimed {
                if let Err(f) = d.release_claim(&rec.id, rec.pauses) {
                    tracing::warn!(sandbox = %rec.id, "giving back its claim: {f}");
                }
            }
        };
        if let Err(e) = self.start_vm(&mut rec, &template, origin) {
            give_back(&rec);
            return Err(e);
        }
        rec.end_ms = ids::now_ms() + (timeout_s as i64) * 1000;
        if let Err(e) = self.reg().update(&rec) {
            // Its VM runs, but no record says so: stopped, so that the failed resume
            // leaves none running (and then the pause to any host).
            if let (Some(pid), Some(api)) = (rec.pid, &rec.api_sock) {
                match self.driver.stop(pid, api) {
                    Ok(()) => give_back(&rec),
                    Err(f) => tracing::error!(sandbox = %rec.id, "stopping its VM: {f}"),
                }
            }
            return Err(e);
        }
        tracing::info!(sandbox = %rec.id, elapsed = ?t.elapsed(), "resumed");
        Ok(rec)
    }
}

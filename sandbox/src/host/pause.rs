//! Pause: with memory (a snapshot, a diff on the VM's last one while the chain is short,
//! then the process stops: a paused sandbox holds no guest RAM), or filesystem-only (the
//! guest flushes its disk, the process ends, the next wake boots from that disk).

use super::*;

impl Host {
    /// Pauses a running sandbox: snapshot (a diff on the VM's last snapshot when it has
    /// one, else full) into its directory, then its process stops. Without
    /// `how.keep_memory`, a filesystem-only pause ([`Host::drop_memory_locked`]).
    pub fn pause(&self, id: &str, how: PauseOptions) -> Result<Record> {
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.load_owned(id)?;
        self.pause_locked(rec, how)
    }

    pub(super) fn pause_locked(&self, rec: Record, how: PauseOptions) -> Result<Record> {
        let r = self.pause_vm_locked(rec, how)?;
        self.owned(&r);
        Ok(r)
    }

    pub(super) fn pause_vm_locked(&self, mut rec: Record, how: PauseOptions) -> Result<Record> {
        let op = if how.keep_memory {
            Op::Pause
        } else {
            Op::PauseDiskOnly
        };
        lifecycle::permit(op, &rec)?;
        if !how.keep_memory {
            return self.drop_memory_locked(rec);
        }
        if let (true, Some(vsock)) = (how.require_healthy_guest, &rec.vsock) {
            check_guest(&rec.id, vsock)?;
        }
        let (Some(pid), Some(api)) = (rec.pid, rec.api_sock.clone()) else {
            return Err(Error::Corrupt(format!(
                "running sandbox {} has no process",
                rec.id
            )));
        };
        let dir = rec.dir.join(format!("pause-{}", rec.pauses + 1));
        let t = std::time::Instant::now();
        // The guest stops at the snapshot's instant and does nothing more (no packet sent,
        // no disk write) that a resume would not remember.
        self.driver.set_vcpus_running(&api, false)?;
        // A diff while the chain stays short (see PAUSE_CHAIN_MAX), else a full one.
        let diff = self
            .driver
            .snapshot_layers(&api)
            .is_none_or(|n| n < PAUSE_CHAIN_MAX);
        let snapshotted = match self.driver.snapshot(&api, &dir, diff) {
            Ok(()) => Ok(if diff { "diff" } else { "full" }),
            Err(e) if diff => {
                tracing::debug!(sandbox = %rec.id, "diff snapshot refused ({e}); taking a full one");
                let _ = std::fs::remove_dir_all(&dir);
                self.driver.snapshot(&api, &dir, false).map(|()| "full")
            }
            Err(e) => Err(e),
        };
        let kind = match snapshotted {
            Ok(k) => k,
            Err(e) => {
                // Not paused after all: it runs on as before.
                if let Err(u) = self.driver.set_vcpus_running(&api, true) {
                    tracing::warn!(sandbox = %rec.id, "unpausing after a failed pause: {u}");
                }
                return Err(e);
            }
        };
        self.driver.stop(pid, &api)?;
        self.driver.adopt_working_set(&rec.dir);
        rec.state = State::Paused;
        rec.pid = None;
        rec.api_sock = None;
        rec.vsock = None;
        rec.snapshot = Some(dir);
        rec.pauses += 1;
        // Its memory is local again (a sandbox taken over resumed from the store).
        rec.remote = None;
        self.reg().update(&rec)?;
        tracing::info!(sandbox = %rec.id, kind, elapsed = ?t.elapsed(), "paused");
        self.queue_upload(&rec.id);
        // Its wake will restore this snapshot: a ready VM process may open it now.
        if let Some(snapshot) = &rec.snapshot {
            self.driver.open_ahead(rec.vcpus, rec.mem_mib, snapshot);
        }
        // Its TAP, opened ahead again for the resume (off the resume's path).
        if let (Some(i), Ok(n)) = (rec.net, &self.networks) {
            n.reopen_tap(i);
        }
        Ok(rec)
    }

    /// A filesystem-only pause (E2B's `memory: false`): the guest flushes what it wrote to
    /// its disk, then its VM process ends. Its memory is gone, its disk stays, and its next
    /// wake boots the template's kernel from that disk. The guest's agent must answer (as
    /// E2B requires): one that does not leaves the sandbox running and the pause an error.
    pub(super) fn drop_memory_locked(&self, mut rec: Record) -> Result<Record> {
        let template = self.sandbox_template(&rec)?;
        // Refused before anything stops: a sandbox that could not boot would be lost.
        self.boot_files(&rec, &template)?;
        let (Some(pid), Some(api), Some(vsock)) =
            (rec.pid, rec.api_sock.clone(), rec.vsock.clone())
        else {
            return Err(Error::Corrupt(format!(
                "running sandbox {} has no process",
                rec.id
            )));
        };
        let t = std::time::Instant::now();
        if !template.test_guest {
            flush_guest(&rec.id, &vsock)?;
        }
        self.driver.stop(pid, &api)?;
        self.driver.adopt_working_set(&rec.dir);
        rec.state = State::Paused;
        rec.pid = None;
        rec.api_sock = None;
        rec.vsock = None;
        // Nothing to restore: an earlier pause's snapshot is not this sandbox any more.
        rec.snapshot = None;
        rec.memory_dropped = true;
        rec.pauses += 1;
        self.reg().update(&rec)?;
        tracing::info!(sandbox = %rec.id, kind = "filesystem", elapsed = ?t.elapsed(), "paused");
        if let (Some(i), Ok(n)) = (rec.net, &self.networks) {
            n.reopen_tap(i);
        }
        Ok(rec)
    }
}

/// How long a filesystem-only pause waits for the guest to flush its writes.
pub(super) const FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a pause that needs the guest agent waits for it to answer.
pub(super) const AGENT_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether the guest agent of sandbox `id` (at `vsock`) answers a ping: an error saying
/// it does not, for a pause that requires a healthy guest.
pub(super) fn check_guest(id: &str, vsock: &Path) -> Result<()> {
    vmm::agent::probe(vsock, vmm::agent::Transport::Auto, AGENT_ANSWER_TIMEOUT)
        .map(|_| ())
        .map_err(|e| Error::GuestUnresponsive {
            id: id.to_string(),
            why: format!("its guest agent does not answer ({e}), and the pause requires it"),
        })
}

/// Has the guest of sandbox `id` (its agent at `vsock`) write everything to its disk
/// (`sync`). An agent that does not answer, or a flush that fails or does not end within
/// [`FLUSH_TIMEOUT`], is an error: the sandbox keeps running.
pub(super) fn flush_guest(id: &str, vsock: &Path) -> Result<()> {
    let refused = |why: String| Error::GuestUnresponsive {
        id: id.to_string(),
        why: format!("a filesystem-only pause needs its guest agent to flush the disk, and {why}"),
    };
    let client = vmm::agent::Client::connect_timeout(
        vsock,
        vmm::agent::Transport::Auto,
        AGENT_ANSWER_TIMEOUT,
    )
    .map_err(|e| refused(format!("the agent does not answer ({e})")))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = client
            .spawn(&vmm::agent::Command::new("/bin/sync"))
            .and_then(|e| e.wait());
        let _ = tx.send(r);
    });
    match rx.recv_timeout(FLUSH_TIMEOUT) {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(refused(format!("sync ended with {status:?}"))),
        Ok(Err(e)) => Err(refused(format!("sync failed ({e})"))),
        Err(_) => Err(refused(format!("sync did not end in {FLUSH_TIMEOUT:?}"))),
    }
}

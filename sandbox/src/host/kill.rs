//! Kill: a sandbox's VM stops, it leaves the registry and its network and files go (those a
//! snapshot or a fork child still stands on stay until garbage collection frees them);
//! with a store, what the store holds of it too.

use super::*;

impl Host {
    /// Kills a sandbox: its process stops and its files go. A crashed one is removed too.
    pub fn kill(&self, id: &str) -> Result<()> {
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = match (self.load(id), &self.durable) {
            // Only in the store (paused on a host that may be gone): claimed like a resume,
            // so that one running elsewhere is not deleted under it, then removed.
            (Err(Error::NotFound(_)), Some(d)) if ids::valid_sandbox_id(id) => {
                let o = d
                    .sandbox_object(id)?
                    .ok_or_else(|| Error::NotFound(id.to_string()))?;
                d.claim(id, o.pause)?;
                d.delete_sandbox(id)?;
                if let Some(o) = &self.ownership {
                    if let Err(e) = o.removed(id) {
                        tracing::warn!(sandbox = %id, "removing it from the cluster: {e}");
                    }
                }
                tracing::info!(sandbox = %id, "killed (in the store only)");
                return Ok(());
            }
            (r, _) => r?,
        };
        lifecycle::permit(Op::Kill, &rec)?;
        self.fence(&rec)?;
        self.teardown_locked(rec)?;
        tracing::info!(sandbox = %id, "killed");
        if let Some(o) = &self.ownership {
            if let Err(e) = o.removed(id) {
                tracing::warn!(sandbox = %id, "removing it from the cluster: {e}");
            }
        }
        if let Some(d) = &self.durable {
            self.delete_published(d, id);
        }
        self.collect_garbage_locked()
    }

    /// What a kill does on this host (its lock held): the sandbox leaves the registry, its
    /// VM stops, its network and local files go. The store is not touched.
    pub(super) fn teardown_locked(&self, rec: Record) -> Result<()> {
        let id = rec.id.as_str();
        // Gone from the registry before its VM stops: a request that comes while the VM
        // ends (a client seeing its stream drop and probing) is answered "not found" at
        // once instead of waiting on an agent that will not answer.
        {
            let _snapshots = self.snapshot_guard();
            self.reg().delete(id)?;
        }
        if let (State::Running, Some(pid), Some(api)) = (rec.state, rec.pid, &rec.api_sock) {
            if let Err(e) = self.driver.stop(pid, api) {
                // Still there after all: it stays listed, and a kill may be tried again.
                if let Err(r) = self.reg().insert(&rec) {
                    tracing::error!(sandbox = %id, "restoring its row after a failed stop: {r}");
                }
                return Err(e);
            }
        }
        // Before its directory goes: what its VM recorded for the snapshot it came from.
        self.driver.adopt_working_set(&rec.dir);
        let _snapshots = self.snapshot_guard();
        self.history.forget(id);
        self.release_net(rec.net);
        // A snapshot of it may build on its files, fork children on its frozen disk
        // layers: then only its sockets go now.
        let held = self
            .reg()
            .all_snapshots()?
            .iter()
            .any(|s| s.source_dir == rec.dir);
        let stood_on = !held && self.disk_layers_used(&rec.dir)?;
        if stood_on {
            mark_killed(&rec.dir);
        } else if !held {
            if let Err(e) = std::fs::remove_dir_all(&rec.dir) {
                tracing::warn!(sandbox = %id, "removing {}: {e}", rec.dir.display());
            }
        }
        // A fork child's sockets live in its fork batch's directory.
        for f in [&rec.api_sock, &rec.vsock].into_iter().flatten() {
            let _ = std::fs::remove_file(f);
        }
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        tracing::info!(sandbox = %id, kept_for_snapshots = held, "stopped and removed from this host");
        Ok(())
    }
}

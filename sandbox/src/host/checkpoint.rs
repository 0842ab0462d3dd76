//! Checkpoints: a running sandbox's state published to the object store every so often
//! (`clade serve --checkpoint-every`), so that when its host is lost it comes back on
//! another host from its last checkpoint instead of being lost.
//!
//! A checkpoint is a persistent snapshot of the running VM (the sandbox runs on; it is
//! listed among the sandbox's snapshots as `checkpoint-<id>`, each one replacing the
//! last), published like a pause, and a sandbox object that names it and says when it was
//! taken. The object's claim number is one no pause of the sandbox uses (see
//! [`checkpoint_claim`]), so that exactly one host resumes a given checkpoint. A sandbox
//! resumed from one says so in its info (`restoredFromCheckpoint`).

use std::time::Instant;

use super::*;

/// The file in a sandbox's directory that says it was resumed from a checkpoint (its time,
/// ms).
const CHECKPOINT_MARK: &str = "restored-from-checkpoint";

/// The claim number of a checkpoint taken now of a sandbox with `pauses` pauses: seconds
/// since the epoch, above any pause number it has (pauses after a resume from it count on
/// from it, and the next checkpoint is later).
fn checkpoint_claim(pauses: u32, now_ms: i64) -> u32 {
    let secs = u32::try_from(now_ms.div_euclid(1000)).unwrap_or(u32::MAX - 1);
    secs.max(pauses.saturating_add(1))
}

impl Host {
    /// Checkpoints every running sandbox of this host (see the module). Returns how many
    /// were checkpointed; one that fails is logged and the others still are.
    pub fn checkpoint_running(&self) -> Result<usize> {
        let running: Vec<String> = self
            .local_sandboxes()?
            .into_iter()
            .filter(|r| r.state == State::Running)
            .map(|r| r.id)
            .collect();
        let mut n = 0;
        for id in running {
            match self.checkpoint(&id) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => tracing::warn!(sandbox = %id, "checkpoint: {e}"),
            }
        }
        Ok(n)
    }

    /// Checkpoints running sandbox `id`: `Ok(false)` if it was no longer running when its
    /// checkpoint was published (its pause is what the store keeps then).
    pub fn checkpoint(&self, id: &str) -> Result<bool> {
        let Some(d) = self.durable.clone() else {
            return Err(Error::BadRequest(
                "checkpoints need an object store (clade serve --store)".into(),
            ));
        };
        let t = Instant::now();
        let snap = self.snapshot(id, Some(&format!("checkpoint-{id}")))?;
        // Uploaded without the sandbox's lock: its requests go on meanwhile.
        let dir = self.snapshots.snapshot_dir(&snap.id)?;
        let files = store::publish::chain_files(&dir).map_err(crate::durable::store_err)?;
        let (manifest, report) = d.publish_chain(&files)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = match self.load_owned(id) {
            Ok(r) if r.state == State::Running => r,
            _ => return Ok(false),
        };
        let snap_dir = self.snapshots.dir(&snap.id)?;
        let own = own_snapshots(&d, id, &files, &[&rec.dir, &snap_dir])?;
        let now = ids::now_ms();
        let mut object = sandbox_object(
            &rec,
            self.sandbox_template(&rec)?,
            manifest.id.clone(),
            checkpoint_claim(rec.pauses, now),
            own,
            &d,
            now,
        );
        object.checkpoint_ms = Some(snap.created_ms);
        // Fenced by the store itself (see `Durable::put_sandbox_object`).
        self.forget_if_fenced(&rec, d.put_sandbox_object(&object))?;
        if let Some(o) = &self.ownership {
            if let Err(e) = o.checkpointed(id) {
                tracing::warn!(sandbox = %id, "recording its checkpoint in the cluster: {e}");
            }
        }
        tracing::info!(sandbox = %id, snapshot = %manifest.id, uploaded = report.bytes_uploaded,
            elapsed = ?t.elapsed(), "checkpoint published");
        Ok(true)
    }

    /// When the checkpoint sandbox `rec` was resumed from was taken (ms), if it was.
    pub fn restored_checkpoint(&self, rec: &Record) -> Option<i64> {
        std::fs::read_to_string(rec.dir.join(CHECKPOINT_MARK))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Marks a sandbox taken over from a checkpoint (see [`Host::restored_checkpoint`]).
    pub(super) fn mark_checkpoint(dir: &Path, at_ms: i64) -> Result<()> {
        let f = dir.join(CHECKPOINT_MARK);
        std::fs::write(&f, at_ms.to_string()).map_err(Error::io("writing", &f))
    }
}

#[cfg(test)]
mod tests {
    use super::checkpoint_claim;

    #[test]
    fn checkpoint_claims_are_above_every_pause_and_grow() {
        let now = 1_800_000_000_000;
        assert_eq!(checkpoint_claim(3, now), 1_800_000_000);
        assert!(checkpoint_claim(3, now + 60_000) > checkpoint_claim(3, now));
        // A sandbox resumed from a checkpoint counts its pauses on from its claim.
        assert_eq!(checkpoint_claim(1_800_000_005, now), 1_800_000_006);
        assert_eq!(checkpoint_claim(u32::MAX, i64::MAX), u32::MAX);
    }
}

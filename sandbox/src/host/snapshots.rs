//! Persistent snapshots (E2B `createSnapshot`): a sandbox, running or paused, becomes a
//! template of its own under `sandboxes/snapshots/`; listing and deleting them; and the
//! garbage collection of files that no sandbox, snapshot or disk chain needs any more.

use super::*;

impl Host {
    /// Takes a persistent snapshot of a sandbox, which runs on (or stays paused): a new
    /// template that sandboxes can be created from. `name` names it (a later snapshot of
    /// the same name replaces it for new sandboxes).
    pub fn snapshot(&self, id: &str, name: Option<&str>) -> Result<SnapshotRecord> {
        if let Some(n) = name {
            if !template::valid_name(n) {
                return Err(Error::BadRequest(format!(
                    "'{n}' is not a snapshot name (letters, digits, '-', '_', '.')"
                )));
            }
            if self.templates.get(n).is_ok() {
                return Err(Error::Conflict(format!(
                    "'{n}' is the name of a template: choose another snapshot name"
                )));
            }
        }
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.load_owned(id)?;
        lifecycle::permit(Op::Snapshot, &rec)?;
        let _snapshots = self.snapshot_guard();
        let template = self.sandbox_template(&rec)?;
        let sid = format!("snap-{}", ids::random_string(16));
        let dir = self.snapshots.prepare(&sid, false)?;
        let t = Instant::now();
        let made = (|| -> Result<&'static str> {
            let target = dir.join(SNAPSHOT_DIR);
            // Jailed, the VM writes it as its own user, and other sandboxes' users read it:
            // a full one, so that the sandbox's earlier snapshots stay its own.
            let jailed = self.driver.jailed();
            let kind = match (rec.state, &rec.api_sock, &rec.snapshot) {
                (State::Running, Some(api), _) => {
                    self.driver.lend_dir(&dir, &rec.dir)?;
                    match self.driver.snapshot(api, &target, !jailed) {
                        Ok(()) if jailed => "full",
                        Ok(()) => "diff",
                        Err(e) => {
                            tracing::debug!(sandbox = %rec.id, "diff snapshot refused ({e}); taking a full one");
                            let _ = std::fs::remove_dir_all(&target);
                            self.driver.snapshot(api, &target, false)?;
                            "full"
                        }
                    }
                }
                (State::Paused, _, _) if rec.memory_dropped => {
                    return Err(Error::Conflict(format!(
                        "sandbox {} was paused without its memory: connect to it (it boots \
                         from its disk) before taking a snapshot",
                        rec.id
                    )))
                }
                (State::Paused, _, Some(pause)) => {
                    link_dir(pause, &target)?;
                    "pause"
                }
                _ => {
                    return Err(Error::Corrupt(format!(
                        "sandbox {} has neither a process nor a snapshot",
                        rec.id
                    )))
                }
            };
            self.driver.share_snapshot(&target, &self.sandboxes_dir())?;
            self.snapshots.finish(&Template {
                name: sid.clone(),
                created_ms: ids::now_ms(),
                ..template.clone()
            })?;
            Ok(kind)
        })();
        let kind = match made {
            Ok(k) => k,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        // Times strictly increase, so that "newest first" is the order they were taken in.
        let latest = self.reg().all_snapshots()?.first().map(|s| s.created_ms);
        let snap = SnapshotRecord {
            id: sid,
            name: name.map(String::from),
            sandbox: rec.id.clone(),
            source_dir: rec.dir.clone(),
            template: rec.template.clone(),
            created_ms: ids::now_ms().max(latest.map_or(i64::MIN, |t| t + 1)),
            deleted: false,
        };
        let superseded: Vec<String> = match name {
            None => Vec::new(),
            Some(n) => self
                .reg()
                .all_snapshots()?
                .into_iter()
                .filter(|s| !s.deleted && s.name.as_deref() == Some(n))
                .map(|s| s.id)
                .collect(),
        };
        if let Err(e) = self.reg().insert_snapshot(&snap) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        for old in &superseded {
            self.reg().mark_snapshot_deleted(old)?;
            if let Some(o) = &self.ownership {
                if let Err(e) = o.snapshot_deleted(old) {
                    tracing::warn!(snapshot = %old, "removing it from the cluster: {e}");
                }
            }
        }
        tracing::info!(sandbox = %rec.id, snapshot = %snap.id, kind, elapsed = ?t.elapsed(), "snapshot taken");
        if let Some(o) = &self.ownership {
            if let Err(e) = o.snapshot_made(&snap) {
                tracing::warn!(snapshot = %snap.id, "recording it in the cluster: {e}");
            }
        }
        // A replaced snapshot goes once nothing needs it; a failure here is not the
        // snapshot's.
        if let Err(e) = self.collect_garbage_locked() {
            tracing::warn!("removing unused snapshots: {e}");
        }
        Ok(snap)
    }

    /// Live snapshots matching `q` (newest first), and whether there are more.
    pub fn list_snapshots(&self, q: &SnapshotQuery) -> Result<(Vec<SnapshotRecord>, bool)> {
        self.reg().list_snapshots(q)
    }

    /// Deletes the live snapshot `reference` (id or name, `:default` or no tag): it is no
    /// longer listed or usable; its files go once nothing needs them. A built template is
    /// not deleted here.
    pub fn delete_snapshot(&self, reference: &str) -> Result<SnapshotRecord> {
        let name =
            strip_tag(reference).map_err(|_| Error::SnapshotNotFound(reference.to_string()))?;
        let _snapshots = self.snapshot_guard();
        let Some(snap) = self.reg().resolve_snapshot(name)? else {
            if template::valid_name(name) && self.templates.get(name).is_ok() {
                return Err(Error::BadRequest(format!(
                    "'{name}' is a template, not a snapshot: templates are removed with \
                     `clade template rm`"
                )));
            }
            return Err(Error::SnapshotNotFound(reference.to_string()));
        };
        self.reg().mark_snapshot_deleted(&snap.id)?;
        tracing::info!(snapshot = %snap.id, "snapshot deleted");
        if let Some(o) = &self.ownership {
            if let Err(e) = o.snapshot_deleted(&snap.id) {
                tracing::warn!(snapshot = %snap.id, "removing it from the cluster: {e}");
            }
        }
        self.collect_garbage_locked()?;
        Ok(snap)
    }

    /// Removes deleted snapshots nothing needs any more, and the directories of killed
    /// sandboxes that only such snapshots held.
    pub fn collect_garbage(&self) -> Result<()> {
        let _snapshots = self.snapshot_guard();
        self.collect_garbage_locked()
    }

    pub(super) fn collect_garbage_locked(&self) -> Result<()> {
        // One removal at a time, then look again: a removal can free others.
        'again: loop {
            let snaps = self.reg().all_snapshots()?;
            let sandboxes = self.reg().all()?;
            for s in snaps.iter().filter(|s| s.deleted) {
                let needed = sandboxes
                    .iter()
                    .any(|r| r.template == s.id || r.id == s.sandbox)
                    || snaps.iter().any(|o| o.template == s.id);
                if needed {
                    continue;
                }
                let dir = self.snapshots.dir(&s.id)?;
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(Error::io("removing", &dir)(e)),
                }
                self.reg().delete_snapshot(&s.id)?;
                let source_held = sandboxes.iter().any(|r| r.dir == s.source_dir)
                    || snaps
                        .iter()
                        .any(|o| o.id != s.id && o.source_dir == s.source_dir);
                if !source_held && s.source_dir.starts_with(self.sandboxes_dir()) {
                    if self.disk_layers_used(&s.source_dir)? {
                        mark_killed(&s.source_dir);
                    } else {
                        let _ = std::fs::remove_dir_all(&s.source_dir);
                    }
                }
                tracing::info!(snapshot = %s.id, "snapshot files removed");
                continue 'again;
            }
            break;
        }
        // Killed sandboxes' directories kept for the disk layers others stood on.
        let sandboxes = self.reg().all()?;
        let snaps = self.reg().all_snapshots()?;
        let Ok(entries) = std::fs::read_dir(self.sandboxes_dir()) else {
            return Ok(());
        };
        for dir in entries.flatten().map(|e| e.path()) {
            if !dir.join(KILLED_MARK).exists()
                || sandboxes.iter().any(|r| r.dir == dir)
                || snaps.iter().any(|s| s.source_dir == dir)
                || self.disk_layers_used(&dir)?
            {
                continue;
            }
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    tracing::info!(dir = %dir.display(), "a killed sandbox's disk layers removed: nothing stands on them")
                }
                Err(e) => tracing::warn!("removing {}: {e}", dir.display()),
            }
        }
        Ok(())
    }

    /// Whether a sandbox's disk chain has a layer in `dir`: fork children and the
    /// children of a fork's snapshot stand on the layer their parent froze, which stays
    /// in the parent's directory. A chain that cannot be read counts as standing on
    /// everything (kept until it can be, or its sandbox goes).
    pub(super) fn disk_layers_used(&self, dir: &Path) -> Result<bool> {
        for r in self.reg().all()? {
            let Some(top) = r.disk.as_ref().filter(|_| r.dir != dir) else {
                continue;
            };
            if !top.exists() {
                continue;
            }
            match disk::ops::info(top) {
                Ok(chain) => {
                    if chain.iter().any(|l| l.path.starts_with(dir)) {
                        return Ok(true);
                    }
                }
                Err(e) => {
                    tracing::warn!(sandbox = %r.id, disk = %top.display(),
                        "disk chain not readable: keeping killed sandboxes' layers: {e}");
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }
}

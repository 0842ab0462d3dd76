//! Durability: paused sandboxes, templates and persistent snapshots published to the
//! object store (`clade serve --store`) by a background uploader, and sandboxes adopted
//! from it (one paused on a host that is gone resumes here). The store is what survives a
//! lost host; this module is the only one that writes it for the lifecycle.

use super::*;

impl Host {
    /// Keeps paused sandboxes durable in `d`'s store (before [`Host::recover`]; start its
    /// uploader with [`Host::start_uploads`]).
    pub fn set_store(&mut self, d: Arc<Durable>) {
        self.durable = Some(d);
    }

    /// The object store, if the host has one.
    pub fn durable(&self) -> Option<&Arc<Durable>> {
        self.durable.as_ref()
    }

    /// Starts the uploader (with a store): the host's templates are published now (so
    /// that other hosts can create sandboxes of them), every pause after it returns, and
    /// the paused sandboxes whose pause is not published yet are queued now.
    pub fn start_uploads(self: &Arc<Self>) -> Result<()> {
        if self.durable.is_none() {
            return Ok(());
        }
        let (tx, rx) = std::sync::mpsc::channel::<Upload>();
        let host = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("clade-uploader".into())
            .spawn(move || uploader(host, rx))
            .map_err(Error::io("starting the uploader", &self.cfg.state_dir))?;
        for t in self.templates.list()? {
            let _ = tx.send(Upload::Template(t.name));
        }
        for r in self.reg().all()? {
            if r.state == State::Paused && r.remote.is_none() && !r.durable() {
                let _ = tx.send(Upload::Pause(r.id));
            }
        }
        *self.uploads.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        Ok(())
    }

    pub(super) fn queue_upload(&self, id: &str) {
        if let Some(tx) = &*self.uploads.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = tx.send(Upload::Pause(id.to_string()));
        }
    }

    /// Publishes built template `name`: its snapshot (with its disk), then its template
    /// object.
    pub(super) fn publish_template(&self, d: &Durable, name: &str) -> Result<()> {
        let template = match self.templates.get(name) {
            Ok(t) => t,
            // Removed since: nothing to publish.
            Err(Error::TemplateNotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        if let Some(o) = d.template_object(name)? {
            if o.template == template {
                return Ok(());
            }
        }
        publish_as_template(d, &self.templates.snapshot_dir(name)?, template)
    }

    /// Publishes persistent snapshot `reference` (its id, or a name) as a template other
    /// hosts create sandboxes of (a cluster's fork children beyond their parent's node).
    /// Returns its id (the template's name).
    pub fn publish_snapshot(&self, reference: &str) -> Result<String> {
        let Some(d) = &self.durable else {
            return Err(Error::BadRequest(
                "publishing a snapshot needs an object store (clade serve --store)".into(),
            ));
        };
        let name =
            strip_tag(reference).map_err(|_| Error::SnapshotNotFound(reference.to_string()))?;
        let snap = {
            let _snapshots = self.snapshot_guard();
            self.reg()
                .resolve_snapshot(name)?
                .ok_or_else(|| Error::SnapshotNotFound(reference.to_string()))?
        };
        let template = self.snapshots.get(&snap.id)?;
        if d.template_object(&snap.id)?.is_some() {
            return Ok(snap.id);
        }
        publish_as_template(d, &self.snapshots.snapshot_dir(&snap.id)?, template)?;
        Ok(snap.id)
    }

    /// Publishes the pause of sandbox `id` (if it is still paused at a pause not published
    /// yet): its snapshot chain, then its sandbox object, then its record says so.
    pub(super) fn publish_pause(&self, d: &Durable, id: &str) -> Result<()> {
        let Some(rec) = self.reg().get(id)? else {
            return Ok(());
        };
        if rec.state != State::Paused || rec.remote.is_some() || rec.durable() {
            return Ok(());
        }
        let Some(dir) = rec.snapshot.clone() else {
            return Ok(());
        };
        let template = self.sandbox_template(&rec)?;
        let t = Instant::now();
        // Its template first (a sandbox of a built template), so that the host taking it
        // over can also create sandboxes of that template.
        if rec.remote.is_none() && !rec.dir.join(template::TEMPLATE_FILE).exists() {
            self.publish_template(d, &rec.template)?;
        }
        let files = store::publish::chain_files(&dir).map_err(crate::durable::store_err)?;
        let (manifest, report) = d.publish_chain(&files)?;
        // This sandbox's own snapshots: those in its directory (not its template's).
        let own = own_snapshots(d, id, &files, &[&rec.dir])?;
        let now = ids::now_ms();
        let object = sandbox_object(&rec, template, manifest.id.clone(), rec.pauses, own, d, now);
        // The object only while the sandbox is still paused at this pause (a resume of a
        // pause whose object exists claims it first; one that came before did not).
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let now_rec = self.reg().get(id)?;
        match now_rec {
            Some(mut r) if r.state == State::Paused && r.pauses == rec.pauses => {
                self.fence(&r)?;
                // Fenced by the store too: the check above and this write are not one.
                self.forget_if_fenced(&r, d.put_sandbox_object(&object))?;
                r.published_pause = Some(rec.pauses);
                r.published_ms = Some(now);
                self.reg().update(&r)?;
                self.owned(&r);
                tracing::info!(sandbox = %id, snapshot = %manifest.id, pause = rec.pauses,
                    uploaded = report.bytes_uploaded, elapsed = ?t.elapsed(), "durable");
            }
            Some(_) => {
                tracing::debug!(sandbox = %id, pause = rec.pauses, "resumed before its upload finished");
            }
            None => {
                // Killed meanwhile: what was just published is no one's.
                let sids: Vec<_> = report.published.iter().rev().copied().collect();
                if let Err(e) = d.block_on(store::publish::delete_all(d.store(), &sids)) {
                    tracing::warn!(sandbox = %id, "what its last upload published kept: {e}");
                }
            }
        }
        Ok(())
    }

    /// Takes over sandbox `id` from the object store (a host that paused it published
    /// it): claims its pause, then records it here as paused, to resume from the store.
    /// Returns it with what the store said of it before, for [`Host::keep_adopted`] to
    /// put back if its resume fails. A failure after the claim gives it back.
    pub(super) fn adopt(&self, id: &str) -> Result<(Record, Adopted)> {
        let Some(d) = &self.durable else {
            return Err(Error::NotFound(id.to_string()));
        };
        if !ids::valid_sandbox_id(id) {
            return Err(Error::NotFound(id.to_string()));
        }
        let Some(o) = d.sandbox_object(id)? else {
            return Err(Error::NotFound(id.to_string()));
        };
        d.claim(id, o.pause)?;
        let adopted = Adopted { object: o.clone() };
        match self.adopt_claimed(d, o) {
            Ok(rec) => Ok((rec, adopted)),
            Err(e) => {
                self.give_back(d, &adopted);
                Err(e)
            }
        }
    }

    /// The part of [`Host::adopt`] after its claim: the store's object becomes this
    /// host's, and the sandbox is recorded here.
    fn adopt_claimed(&self, d: &Durable, mut o: SandboxObject) -> Result<Record> {
        let id = o.id.clone();
        // Ours now: a kill on the host it came from no longer removes its objects.
        o.host = d.host_id().to_string();
        d.put_taken_over_object(&o)?;
        let dir = self.sandboxes_dir().join(&id);
        self.dirs.make(&dir).map_err(Error::io("creating", &dir))?;
        let recorded = (|| {
            write_template_copy(&dir, &o.template)?;
            if let Some(at) = o.checkpoint_ms {
                Self::mark_checkpoint(&dir, at)?;
            }
            let mut rec = self.record_of(o.clone());
            rec.end_ms = ids::now_ms();
            let policy = policy_of(&rec)?;
            rec.net = self.acquire_net(&o.template, &policy)?;
            if let Err(e) = self.reg().insert(&rec) {
                self.release_net(rec.net);
                return Err(e);
            }
            Ok(rec)
        })();
        let rec = match recorded {
            Ok(rec) => rec,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        tracing::info!(sandbox = %id, snapshot = ?rec.remote, pause = rec.pauses,
            from = %d.store().url(), "taken over from the store");
        Ok(rec)
    }

    /// `r` is how the resume of sandbox `id` went (its lock held); `adopted`, set when
    /// that request took it over from the store ([`Host::adopt`]). A resume that failed
    /// leaves nothing of the takeover: the sandbox leaves this host (its record and
    /// files; a VM of it is stopped), the store's object is the one it was again and the
    /// claim is given back. So a store fault in a resume loses nothing: once the store is
    /// whole, the sandbox resumes here or on any host, as if the failed try had not been.
    pub(super) fn keep_adopted<T>(
        &self,
        id: &str,
        r: Result<T>,
        adopted: Option<Adopted>,
    ) -> Result<T> {
        let (Err(e), Some(adopted), Some(d)) = (&r, adopted, &self.durable) else {
            return r;
        };
        tracing::warn!(sandbox = %id, "its resume failed ({e}): left in the store as it was");
        // (The registry's guard ends with this statement: a teardown takes it again.)
        let now = self.reg().get(id);
        match now {
            Ok(Some(rec)) => {
                if let Err(f) = self.teardown_locked(rec) {
                    // Still here (its VM would not stop): the claim stays this host's.
                    tracing::warn!(sandbox = %id, "removing what its takeover made: {f}");
                    return r;
                }
            }
            Ok(None) => {}
            Err(f) => {
                tracing::warn!(sandbox = %id, "reading its record after a failed resume: {f}");
                return r;
            }
        }
        self.give_back(d, &adopted);
        r
    }

    /// Undoes a takeover's changes to the store (see [`Host::keep_adopted`]): its object as
    /// it was before (unless another host's write replaced this host's since), then the
    /// claim. The claim stays if the object could not be put back: given back with the
    /// object naming this host, the host it came from would have its next publish fenced
    /// and lose the sandbox (a takeover from here tries again, holding the claim).
    fn give_back(&self, d: &Durable, adopted: &Adopted) {
        let o = &adopted.object;
        let restored = match d.sandbox_object(&o.id) {
            Ok(Some(cur)) if cur.host == d.host_id() && cur.pause == o.pause => {
                if o.host == d.host_id() {
                    Ok(())
                } else {
                    d.put_taken_over_object(o)
                }
            }
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        let r = restored.and_then(|()| d.release_claim(&o.id, o.pause));
        if let Err(e) = r {
            tracing::warn!(sandbox = %o.id, pause = o.pause,
                "giving back a failed takeover (its claim stays this host's): {e}");
        }
    }

    /// A template another host published, if the host has a store and it has one.
    pub(super) fn store_template(
        &self,
        name: &str,
    ) -> Result<Option<crate::durable::TemplateObject>> {
        match &self.durable {
            Some(d) if template::valid_dir_name(name) => d.template_object(name),
            _ => Ok(None),
        }
    }

    /// A paused sandbox as the store's object describes it (to resume from the store).
    pub(super) fn record_of(&self, o: SandboxObject) -> Record {
        Record {
            dir: self.sandboxes_dir().join(&o.id),
            id: o.id,
            template: o.template.name.clone(),
            state: State::Paused,
            pid: None,
            api_sock: None,
            vsock: None,
            snapshot: None,
            pauses: o.pause,
            started_ms: o.started_ms,
            end_ms: o.published_ms,
            auto_pause: o.auto_pause,
            auto_resume: o.auto_resume,
            envd_token: o.envd_token,
            traffic_token: o.traffic_token,
            mask_host: o.mask_host,
            metadata: o.metadata,
            env_vars: o.env_vars,
            vcpus: o.template.vcpus,
            mem_mib: o.template.mem_mib,
            disk: None,
            crash: None,
            parent: o.parent,
            net: None,
            egress: o.egress,
            remote: Some(o.snapshot),
            published_pause: Some(o.pause),
            published_ms: Some(o.published_ms),
            pause_keeps_memory: true,
            memory_dropped: false,
        }
    }

    /// A sandbox to resume: this host's, or one taken over from the store now (then with
    /// what [`Host::keep_adopted`] needs to undo that if the resume fails).
    pub(super) fn load_or_adopt(&self, id: &str) -> Result<(Record, Option<Adopted>)> {
        match self.load_owned(id) {
            Err(Error::NotFound(_)) if self.durable.is_some() => {
                self.adopt(id).map(|(rec, a)| (rec, Some(a)))
            }
            r => r.map(|rec| (rec, None)),
        }
    }

    /// Removes what the store holds of a killed sandbox, if this host owns it there (one
    /// taken over by another host is that host's now).
    pub(super) fn delete_published(&self, d: &Durable, id: &str) {
        let r = d.sandbox_object(id).and_then(|o| match o {
            Some(o) if o.host != d.host_id() => {
                tracing::info!(sandbox = %id, owner = %o.host, "kept in the store: another host took it over");
                Ok(())
            }
            _ => d.delete_sandbox(id),
        });
        if let Err(e) = r {
            tracing::warn!(sandbox = %id, "removing its objects from the store: {e}");
        }
    }
}

/// A sandbox taken over from the store by the request being served ([`Host::adopt`]).
#[derive(Debug)]
pub(super) struct Adopted {
    /// Its store object as read before the takeover.
    object: SandboxObject,
}

/// What the uploader publishes.
#[derive(Debug)]
pub(super) enum Upload {
    /// A sandbox's latest pause.
    Pause(String),
    /// A built template.
    Template(String),
}

/// The uploader: publishes what is queued, one job at a time; a job that fails is tried
/// again later with backoff (its sandbox's local copy stays meanwhile), while the others
/// go on. A pause job ends once its sandbox is no longer paused at that pause.
pub(super) fn uploader(host: std::sync::Weak<Host>, rx: std::sync::mpsc::Receiver<Upload>) {
    use std::sync::mpsc::RecvTimeoutError;
    // (when due, failures so far, job)
    let mut pending: Vec<(Instant, u32, Upload)> = Vec::new();
    loop {
        let got = match pending.iter().map(|p| p.0).min() {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(due) => rx.recv_timeout(due.saturating_duration_since(Instant::now())),
        };
        match got {
            Ok(job) => pending.push((Instant::now(), 0, job)),
            Err(RecvTimeoutError::Timeout) => {}
            // The host is gone.
            Err(RecvTimeoutError::Disconnected) => return,
        }
        while let Ok(job) = rx.try_recv() {
            pending.push((Instant::now(), 0, job));
        }
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = pending.into_iter().partition(|p| p.0 <= now);
        pending = later;
        for (_, attempt, job) in due {
            let Some(h) = host.upgrade() else { return };
            let Some(d) = h.durable.clone() else { return };
            let (id, done) = match &job {
                Upload::Pause(id) => (id, h.publish_pause(&d, id)),
                Upload::Template(name) => (name, h.publish_template(&d, name)),
            };
            match done {
                Ok(()) => d.set_failure(id, None),
                Err(e) => {
                    let wait = crate::durable::backoff(attempt);
                    tracing::warn!(?job, attempt, retry_in = ?wait, "upload failed: {e}");
                    d.set_failure(id, Some(e.to_string()));
                    pending.push((Instant::now() + wait, attempt + 1, job));
                }
            }
        }
    }
}

/// Keeps a copy of `t` in sandbox directory `dir`: the template of a sandbox whose
/// template is not one of this host's ([`Host::sandbox_template`]).
/// Publishes the snapshot in `dir` (with its chain) and a template object naming it: other
/// hosts create sandboxes of `template` from the store.
pub(super) fn publish_as_template(d: &Durable, dir: &Path, template: Template) -> Result<()> {
    let t = Instant::now();
    let files = store::publish::chain_files(dir).map_err(crate::durable::store_err)?;
    let (manifest, report) = d.publish_chain(&files)?;
    let name = template.name.clone();
    d.put_template_object(&crate::durable::TemplateObject {
        format: crate::durable::TEMPLATE_FORMAT.into(),
        version: crate::durable::SANDBOX_VERSION,
        snapshot: manifest.id.clone(),
        template,
        published_ms: ids::now_ms(),
        host: d.host_id().to_string(),
    })?;
    tracing::info!(template = %name, snapshot = %manifest.id,
        uploaded = report.bytes_uploaded, elapsed = ?t.elapsed(), "template published");
    Ok(())
}

/// The published snapshots that are sandbox `id`'s own: those its store object lists, and
/// those of `files` (a chain just published) under one of `dirs`.
pub(super) fn own_snapshots(
    d: &Durable,
    id: &str,
    files: &[store::publish::SnapshotFiles],
    dirs: &[&Path],
) -> Result<Vec<String>> {
    let mut own: Vec<String> = d
        .sandbox_object(id)?
        .map(|o| o.own_snapshots)
        .unwrap_or_default();
    for f in files
        .iter()
        .filter(|f| dirs.iter().any(|d| f.state.starts_with(d)))
    {
        let sid = snapshot::state_file::read_header(&f.state)
            .map_err(|e| Error::Corrupt(format!("{}: {e}", f.state.display())))?
            .meta
            .id
            .to_string();
        if !own.contains(&sid) {
            own.push(sid);
        }
    }
    Ok(own)
}

/// What the store keeps of `rec` (see [`SandboxObject`]): resumable from `snapshot`, the
/// claim of `pause`.
pub(super) fn sandbox_object(
    rec: &Record,
    template: Template,
    snapshot: String,
    pause: u32,
    own_snapshots: Vec<String>,
    d: &Durable,
    now: i64,
) -> SandboxObject {
    SandboxObject {
        format: crate::durable::SANDBOX_FORMAT.into(),
        version: crate::durable::SANDBOX_VERSION,
        id: rec.id.clone(),
        snapshot,
        pause,
        own_snapshots,
        template,
        started_ms: rec.started_ms,
        auto_pause: rec.auto_pause,
        auto_resume: rec.auto_resume,
        envd_token: rec.envd_token.clone(),
        traffic_token: rec.traffic_token.clone(),
        mask_host: rec.mask_host.clone(),
        metadata: rec.metadata.clone(),
        env_vars: rec.env_vars.clone(),
        egress: rec.egress.clone(),
        parent: rec.parent.clone(),
        published_ms: now,
        host: d.host_id().to_string(),
        checkpoint_ms: None,
    }
}

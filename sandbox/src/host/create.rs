//! Create: a new sandbox from a template or a persistent snapshot (a restore of its
//! snapshot), and starting a sandbox's VM process, which create, resume, boot and fork
//! share ([`Host::start_vm`]).

use super::*;

impl Host {
    /// Creates a sandbox from a template or a snapshot: a restore of its snapshot.
    pub fn create(&self, req: CreateRequest) -> Result<Record> {
        // The room held for it goes once it is recorded.
        let (rec, _room) = self.create_vm(req)?;
        self.owned(&rec);
        Ok(rec)
    }

    pub(super) fn create_vm(
        &self,
        req: CreateRequest,
    ) -> Result<(Record, Option<crate::ownership::Reservation>)> {
        let t0 = std::time::Instant::now();
        self.check_timeout(req.timeout_s)?;
        self.check_map("metadata", &req.metadata)?;
        self.check_map("envVars", &req.env_vars)?;
        if req.auto_resume && !req.auto_pause {
            return Err(Error::BadRequest(
                "auto-resume needs a timeout that pauses (auto-pause)".into(),
            ));
        }
        // From a snapshot: held until the new sandbox is in the registry, so that a
        // snapshot deleted meanwhile keeps its files for it.
        let from_snapshot = match strip_tag(&req.template) {
            Ok(name) => self.reg().resolve_snapshot(name)?.is_some(),
            Err(_) => false,
        };
        let _snapshots = from_snapshot.then(|| self.snapshot_guard());
        // Not here: a template another host published (restored from the store).
        let (template, snapshot, remote) = match self.resolve_template(&req.template) {
            Ok((t, s)) => (t, s, None),
            Err(e @ Error::BadRequest(_)) => {
                let published = match strip_tag(&req.template) {
                    Ok(name) => self.store_template(name)?,
                    Err(_) => None,
                };
                match published {
                    Some(o) => (o.template, PathBuf::from(&o.snapshot), Some(o.snapshot)),
                    None => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let room = self.admit(template.vcpus, template.mem_mib, 1)?;
        let token = |wanted: bool| {
            wanted
                .then(ids::new_token)
                .transpose()
                .map_err(Error::io("making an access token in", self.sandboxes_dir()))
        };
        let (envd_token, traffic_token) = (token(req.secure)?, token(req.private_traffic)?);
        let id = ids::new_sandbox_id();
        let dir = self.sandboxes_dir().join(&id);
        self.dirs.make(&dir).map_err(Error::io("creating", &dir))?;
        if remote.is_some() {
            if let Err(e) = write_template_copy(&dir, &template) {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        }
        let now = ids::now_ms();
        let mut rec = Record {
            id: id.clone(),
            template: template.name.clone(),
            state: State::Paused,
            pid: None,
            api_sock: None,
            vsock: None,
            dir: dir.clone(),
            snapshot: None,
            pauses: 0,
            started_ms: now,
            end_ms: now + (req.timeout_s as i64) * 1000,
            auto_pause: req.auto_pause,
            auto_resume: req.auto_resume,
            envd_token,
            traffic_token,
            mask_host: req.mask_host.clone(),
            metadata: req.metadata,
            env_vars: with_image_env(&template, req.env_vars),
            vcpus: template.vcpus,
            mem_mib: template.mem_mib,
            disk: None,
            crash: None,
            parent: None,
            net: None,
            egress: None,
            remote,
            published_pause: None,
            published_ms: None,
            pause_keeps_memory: !req.pause_drops_memory,
            memory_dropped: false,
        };
        let t_start = std::time::Instant::now();
        let started = self.acquire_net(&template, &req.egress).and_then(|net| {
            rec.net = net;
            rec.egress = policy_json(&req.egress)?;
            // Other sandboxes will be created from the same snapshot.
            self.start_vm(
                &mut rec,
                &template,
                Origin::Snapshot {
                    dir: &snapshot,
                    reused: true,
                },
            )
        });
        if let Err(e) = started {
            self.release_net(rec.net);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let t_insert = std::time::Instant::now();
        self.reg().insert(&rec)?;
        tracing::info!(
            sandbox = %id,
            template = %template.name,
            pid = ?rec.pid,
            prepare_us = (t_start - t0).as_micros() as u64,
            start_us = (t_insert - t_start).as_micros() as u64,
            insert_us = t_insert.elapsed().as_micros() as u64,
            "created"
        );
        Ok((rec, room))
    }

    /// Starts the VM process of `rec` from `origin`; fills in its process fields.
    pub(super) fn start_vm(
        &self,
        rec: &mut Record,
        template: &Template,
        origin: Origin<'_>,
    ) -> Result<()> {
        let api = rec.dir.join("vm.api");
        let vsock = rec.dir.join("vm.vsock");
        let (snapshot, reused, boot, disk) = match origin {
            Origin::Snapshot { dir, reused } => (
                dir.to_path_buf(),
                reused,
                None,
                template
                    .disk
                    .then(|| rec.dir.join(format!("disk-r{}.cdsk", rec.pauses))),
            ),
            Origin::Boot { files, disk } => (rec.dir.clone(), false, Some(files), disk),
        };
        let booting = boot.is_some();
        let spec = StartSpec {
            snapshot,
            boot,
            test_device: template.test_guest,
            fetcher: match (&rec.remote, &self.durable) {
                _ if booting => None,
                (Some(id), Some(d)) => {
                    d.prepare(id)?;
                    Some(d.fetcher_socket().to_path_buf())
                }
                (Some(id), None) => {
                    return Err(Error::Store(format!(
                        "sandbox {} resumes from published snapshot {id}, but this host has no \
                         store (clade serve --store)",
                        rec.id
                    )))
                }
                (None, _) => None,
            },
            // A sandbox taken over from the store (or of a template from it) stands on disk
            // layers the fetcher reads lazily, whatever snapshot of it is restored.
            layer_fetcher: match (&rec.remote, &self.durable) {
                _ if booting => None,
                (None, Some(d)) if from_store(&rec.dir) => Some(d.fetcher_socket().to_path_buf()),
                _ => None,
            },
            snapshot_reused: reused,
            api_sock: api.clone(),
            dir: rec.dir.clone(),
            vsock: vsock.clone(),
            serial: rec.dir.join(format!("serial-r{}.log", rec.pauses)),
            log: rec.dir.join("vm.log"),
            files_root: self.sandboxes_dir(),
            disk_overlay: disk.clone(),
            agent_sync: !template.test_guest,
            vcpus: template.vcpus,
            mem_mib: template.mem_mib,
            net: match (template.net, rec.net) {
                (false, _) => None,
                (true, Some(i)) => Some(self.networks()?.tap_spec(i)),
                (true, None) => {
                    return Err(Error::Network(format!(
                        "sandbox {} has no network, but its template's VM has a network device",
                        rec.id
                    )))
                }
            },
            tap: match (template.net, rec.net) {
                (true, Some(i)) => self.networks.as_ref().ok().and_then(|n| n.take_tap(i)),
                _ => None,
            },
        };
        let started = self.driver.start(&spec);
        // The VM process has its own descriptor of the TAP now (or failed): the service's
        // goes; after a failure it is opened ahead again for the next start.
        drop(spec);
        if let (Err(_), Some(i), Ok(n)) = (&started, rec.net, &self.networks) {
            n.reopen_tap(i);
        }
        let started = started?;
        rec.state = State::Running;
        rec.pid = Some(started.pid);
        // A standby process keeps its own socket (see `vmproc::standby`).
        rec.api_sock = Some(started.api_sock);
        rec.vsock = Some(vsock);
        rec.disk = disk;
        rec.crash = None;
        Ok(())
    }
}

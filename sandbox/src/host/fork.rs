//! Fork: a running sandbox becomes `count` new ones, by the VM's live fork (memory shared
//! copy-on-write, each child its own process) or, where that cannot be, a snapshot of the
//! running parent that each child restores. Each child has its own network, tokens and
//! disk overlay on the parent's frozen layer.

use super::*;

impl Host {
    /// Forks a running sandbox into `count` new sandboxes: the VM's live fork (memory
    /// shared copy-on-write, each child its own process) when its memory allows, else a
    /// snapshot of the running parent that each child restores (the parent runs on). Children inherit the template,
    /// metadata, env vars and auto-pause, and time out `timeout_s` from now.
    pub fn fork(&self, id: &str, count: usize, timeout_s: u64) -> Result<Vec<Record>> {
        // In a cluster, room for the children (of the parent's shape), held until they are
        // recorded (alone, nothing is read for it). A sandbox this host does not have is
        // fork_vm's to refuse.
        let in_cluster = self.ownership.is_some() && (1..=self.cfg.max_fork).contains(&count);
        let _room = if in_cluster {
            match self.reg().get(id)? {
                Some(p) => self.admit(p.vcpus, p.mem_mib, count)?,
                None => None,
            }
        } else {
            None
        };
        let children = self.fork_vm(id, count, timeout_s)?;
        for c in &children {
            self.owned(c);
        }
        Ok(children)
    }

    pub(super) fn fork_vm(&self, id: &str, count: usize, timeout_s: u64) -> Result<Vec<Record>> {
        self.check_timeout(timeout_s)?;
        if count == 0 || count > self.cfg.max_fork {
            return Err(Error::BadRequest(format!(
                "count must be 1 to {}, not {count}",
                self.cfg.max_fork
            )));
        }
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let parent = self.load_owned(id)?;
        lifecycle::permit(Op::Fork, &parent)?;
        // Children are secured as their parent, each with tokens of its own: made before
        // anything starts, so that a failing random source leaves nothing half-forked.
        let mut tokens = (0..count)
            .map(|_| -> Result<ChildTokens> {
                let token = |has: bool| {
                    has.then(ids::new_token).transpose().map_err(Error::io(
                        "making an access token for a child of",
                        &parent.dir,
                    ))
                };
                Ok((
                    token(parent.envd_token.is_some())?,
                    token(parent.traffic_token.is_some())?,
                ))
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter();
        let Some(api) = parent
            .api_sock
            .clone()
            .filter(|_| parent.state == State::Running)
        else {
            return Err(Error::Conflict(format!(
                "sandbox {id} is paused: connect to it before forking"
            )));
        };
        let template = self.sandbox_template(&parent)?;
        // Short: the children's Unix sockets are named inside it (at most 107 bytes).
        let prefix = self
            .sandboxes_dir()
            .join("forks")
            .join(ids::random_string(8));
        std::fs::create_dir_all(&prefix).map_err(Error::io("creating", &prefix))?;
        // Children get the parent's egress policy, each on a network of its own.
        let policy = policy_of(&parent)?;
        let mut nets: Vec<u32> = Vec::new();
        let release_all = |nets: &mut Vec<u32>| {
            for i in nets.drain(..) {
                self.release_net(Some(i));
            }
        };
        if template.net {
            for _ in 0..count {
                match self.acquire_net(&template, &policy) {
                    Ok(n) => nets.extend(n),
                    Err(e) => {
                        release_all(&mut nets);
                        return Err(e);
                    }
                }
            }
        }
        let specs: Vec<String> = match self.networks.as_ref() {
            Ok(n) => {
                // The children's VM processes open their TAPs by name (their parent starts
                // them): the service lets go of the ones it opened ahead. Jailed, each
                // child is started by the service and is handed its TAP.
                if !self.driver.jailed() {
                    for &i in &nets {
                        drop(n.take_tap(i));
                    }
                }
                nets.iter().map(|&i| n.tap_spec(i)).collect()
            }
            Err(_) => Vec::new(),
        };
        // Children open the parent's disk chain anew: layers read lazily from the store
        // are made whole first.
        if let (true, Some(d), Some(top)) = (from_store(&parent.dir), &self.durable, &parent.disk) {
            if let Err(e) = d.complete_disk(top) {
                release_all(&mut nets);
                return Err(e);
            }
        }
        // Jailed, each child is a VM process (and a user) of its own, restored from a
        // snapshot: live children would share their parent's jail and user.
        let forked = if self.driver.jailed() {
            Err(Error::VmApi {
                op: "fork",
                message: vmm::CANNOT_FORK_LIVE.to_string(),
            })
        } else {
            self.driver
                .fork(&api, count, &prefix, !template.test_guest, &specs)
        };
        let live = match forked {
            Ok(children) => Some(children),
            // A VM whose memory cannot be frozen now (e.g. it forked since its restore and
            // then wrote memory the record of which is gone) cannot fork live: the
            // children restore a snapshot instead.
            Err(Error::VmApi { message, .. }) if message.contains(vmm::CANNOT_FORK_LIVE) => None,
            Err(e) => {
                release_all(&mut nets);
                return Err(e);
            }
        };
        let mut nets = nets.into_iter();
        let now = ids::now_ms();
        let new_child =
            |cid: String, dir: PathBuf, (envd_token, traffic_token): ChildTokens| Record {
                id: cid,
                template: parent.template.clone(),
                state: State::Paused,
                pid: None,
                api_sock: None,
                vsock: None,
                dir,
                snapshot: None,
                pauses: 0,
                started_ms: now,
                end_ms: now + (timeout_s as i64) * 1000,
                auto_pause: parent.auto_pause,
                auto_resume: parent.auto_resume,
                envd_token,
                traffic_token,
                mask_host: parent.mask_host.clone(),
                metadata: parent.metadata.clone(),
                env_vars: parent.env_vars.clone(),
                vcpus: parent.vcpus,
                mem_mib: parent.mem_mib,
                disk: None,
                crash: None,
                parent: Some(parent.id.clone()),
                net: None,
                egress: parent.egress.clone(),
                remote: None,
                published_pause: None,
                published_ms: None,
                pause_keeps_memory: parent.pause_keeps_memory,
                memory_dropped: false,
            };
        let mut out = Vec::new();
        match live {
            Some(children) => {
                for c in children {
                    let cid = ids::new_sandbox_id();
                    let dir = self.sandboxes_dir().join(&cid);
                    self.dirs.make(&dir).map_err(Error::io("creating", &dir))?;
                    if from_store(&parent.dir) {
                        write_template_copy(&dir, &template)?;
                    }
                    let mut rec = new_child(cid, dir, tokens.next().unwrap_or_default());
                    rec.net = nets.next();
                    rec.state = State::Running;
                    rec.pid = Some(c.pid);
                    rec.api_sock = Some(c.api_sock);
                    rec.vsock = c.vsock;
                    rec.disk = c.disk;
                    self.reg().insert(&rec)?;
                    out.push(rec);
                }
            }
            None => {
                // The fork's base snapshot stays where it is while any child needs it (the
                // children's memory and their later diffs build on it), so it is not in the
                // parent's directory.
                let base = prefix.join("base");
                // Jailed, the children's users may read the base and what it stands on,
                // but not the parent's earlier snapshots: the base is a full one.
                let jailed = self.driver.jailed();
                let snapshotted = self
                    .driver
                    .lend_dir(&prefix, &parent.dir)
                    .and_then(|()| self.driver.snapshot(&api, &base, !jailed))
                    .or_else(|_| {
                        let _ = std::fs::remove_dir_all(&base);
                        self.driver.snapshot(&api, &base, false)
                    })
                    .and_then(|()| self.driver.share_snapshot(&base, &self.sandboxes_dir()));
                if let Err(e) = snapshotted {
                    nets.for_each(|i| self.release_net(Some(i)));
                    return Err(e);
                }
                for _ in 0..count {
                    let cid = ids::new_sandbox_id();
                    let dir = self.sandboxes_dir().join(&cid);
                    self.dirs.make(&dir).map_err(Error::io("creating", &dir))?;
                    if from_store(&parent.dir) {
                        write_template_copy(&dir, &template)?;
                    }
                    let mut rec = new_child(cid, dir, tokens.next().unwrap_or_default());
                    rec.net = nets.next();
                    let origin = Origin::Snapshot {
                        dir: &base,
                        reused: false,
                    };
                    if let Err(e) = self.start_vm(&mut rec, &template, origin) {
                        self.release_net(rec.net);
                        let _ = std::fs::remove_dir_all(&rec.dir);
                        // The children started so far stay: each is a sandbox of its own.
                        tracing::warn!(sandbox = %id, "fork child {}: {e}", out.len() + 1);
                        nets.by_ref().for_each(|i| self.release_net(Some(i)));
                        if out.is_empty() {
                            return Err(e);
                        }
                        break;
                    }
                    self.reg().insert(&rec)?;
                    out.push(rec);
                }
            }
        }
        tracing::info!(sandbox = %id, children = out.len(), "forked");
        Ok(out)
    }
}

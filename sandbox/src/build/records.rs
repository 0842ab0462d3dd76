//! The builds kept: a build requested ([`Builds::request`]: its name, tags and size
//! checked), looked up ([`Builds::get`]), and its record in `<state dir>/builds/<id>.json`
//! written ([`Builds::save`]) and read back at a restart ([`Builds::load`]: a build the
//! service was running then is an error, its work removed). At most `MAX_BUILDS` are kept:
//! finished ones are forgotten to make room.

use super::*;

impl Builds {
    fn records_dir(&self) -> PathBuf {
        self.state_dir.join("builds")
    }

    /// Writes build `id`'s record (a failure is logged: the build goes on in memory).
    pub(super) fn save(&self, id: &str, b: &Build) {
        let dir = self.records_dir();
        let tmp = dir.join(format!(".{id}.json"));
        let r = std::fs::create_dir_all(&dir)
            .and_then(|_| {
                let body = serde_json::to_vec(b).map_err(std::io::Error::other)?;
                std::fs::write(&tmp, body)
            })
            .and_then(|_| std::fs::rename(&tmp, dir.join(format!("{id}.json"))));
        if let Err(e) = r {
            tracing::warn!(build = %id, "keeping the build's record: {e}");
        }
    }

    /// The builds of earlier runs of the service; those it was running when it stopped
    /// ended then. Work directories of such builds are removed.
    pub(super) fn load(&self) {
        let Ok(rd) = std::fs::read_dir(self.records_dir()) else {
            return;
        };
        let mut found: Vec<(i64, String, Build)> = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".json") else {
                continue;
            };
            // Ids are UUIDs ([`Builds::request`]; 20 hex digits before tags existed);
            // anything else is not ours.
            let old_form = id.len() == 20 && id.bytes().all(|b| b.is_ascii_hexdigit());
            if !old_form && !crate::template::is_build_id(id) {
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            let b = std::fs::read(e.path())
                .ok()
                .and_then(|t| serde_json::from_slice::<Build>(&t).ok());
            let Some(mut b) = b else {
                tracing::warn!(path = %e.path().display(), "an unreadable build record: removed");
                let _ = std::fs::remove_file(e.path());
                continue;
            };
            if matches!(b.status, BuildStatus::Waiting | BuildStatus::Building) {
                let why =
                    "the service stopped during this build: nothing of it was kept; build again";
                b.status = BuildStatus::Error;
                b.reason = Some(why.into());
                b.logs.push(LogLine {
                    ms: crate::ids::now_ms(),
                    level: "error".into(),
                    message: why.into(),
                });
                self.save(id, &b);
                let _ = std::fs::remove_dir_all(self.state_dir.join("build-jobs").join(id));
            }
            let at = b.logs.last().map_or(0, |l| l.ms);
            found.push((at, id.to_string(), b));
        }
        // The newest MAX_BUILDS are kept.
        found.sort_by_key(|(at, _, _)| std::cmp::Reverse(*at));
        let mut g = lock(&self.builds);
        for (i, (_, id, b)) in found.into_iter().enumerate() {
            if i < MAX_BUILDS {
                g.insert(id, Arc::new(Mutex::new(b)));
            } else {
                let _ = std::fs::remove_file(self.records_dir().join(format!("{id}.json")));
            }
        }
    }

    /// Requests a build of template `name` (`[team/]name[:tag]`) to be tagged with `tags`
    /// as well as the tag in `name` (`default` when neither gives one); returns the
    /// template's id (its name) and the build's id.
    pub fn request(
        &self,
        name: &str,
        tags: &[String],
        vcpus: Option<u32>,
        mem_mib: Option<u64>,
    ) -> Result<(String, String, Vec<String>)> {
        if self.config.is_none() {
            return Err(Error::BadRequest(
                "this service builds no templates: start clade serve with --build-kernel (and --build-initrd)".into(),
            ));
        }
        let (name, tag) = crate::template::tags::parse_reference(name).map_err(|_| {
            Error::BadRequest(format!(
                "'{name}' is not a template name (letters, digits, '-', '_', '.'; optionally team/ before it and :tag after it)"
            ))
        })?;
        let mut all: Vec<String> = tag.into_iter().map(String::from).collect();
        for t in tags {
            crate::template::tags::check_tag(t)?;
            if !all.contains(t) {
                all.push(t.clone());
            }
        }
        if all.is_empty() {
            all.push(crate::template::tags::DEFAULT_TAG.to_string());
        }
        if all.len() > crate::template::tags::MAX_TAGS {
            return Err(Error::BadRequest(format!(
                "more than {} tags",
                crate::template::tags::MAX_TAGS
            )));
        }
        let vcpus = vcpus.unwrap_or(1);
        let mem_mib = mem_mib.unwrap_or(512);
        if vcpus == 0 || vcpus > 32 || !(128..=65536).contains(&mem_mib) {
            return Err(Error::BadRequest(format!(
                "cpuCount {vcpus} / memoryMB {mem_mib}: 1-32 vCPUs and 128-65536 MiB"
            )));
        }
        let build_id = crate::template::new_build_id()?;
        let mut g = lock(&self.builds);
        if g.len() >= MAX_BUILDS {
            let done: Vec<String> = g
                .iter()
                .filter(|(_, b)| matches!(lock(b).status, BuildStatus::Ready | BuildStatus::Error))
                .map(|(k, _)| k.clone())
                .take(g.len() + 1 - MAX_BUILDS)
                .collect();
            for k in done {
                g.remove(&k);
                let _ = std::fs::remove_file(self.records_dir().join(format!("{k}.json")));
            }
        }
        let b = Build {
            template: name.to_string(),
            vcpus,
            mem_mib,
            status: BuildStatus::Waiting,
            logs: Vec::new(),
            reason: None,
            tags: all.clone(),
            dir: String::new(),
            log_bytes: 0,
        };
        self.save(&build_id, &b);
        g.insert(build_id.clone(), Arc::new(Mutex::new(b)));
        Ok((name.to_string(), build_id, all))
    }

    /// The build `build_id` of `template`.
    pub fn get(&self, template: &str, build_id: &str) -> Result<Arc<Mutex<Build>>> {
        let g = lock(&self.builds);
        match g.get(build_id) {
            Some(b) if lock(b).template == template => Ok(b.clone()),
            _ => Err(Error::NotFound(format!(
                "build {build_id} of template {template}"
            ))),
        }
    }
}

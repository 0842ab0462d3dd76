//! Starting a build ([`Builds::start`]): what its request is checked for before anything
//! runs (one build of a template at a time, no sandbox on a directory it replaces, one
//! base, known step types, every COPY's files uploaded), where its template goes (in place
//! or beside the template's other builds), and the thread it runs on.

use super::uploads::check_hash;
use super::*;

impl Builds {
    /// Starts build `build_id` of `template` in the background; `users` counts the
    /// sandboxes of the template's own directory (a build that replaces it needs none),
    /// `done` is called when it ends, whatever the result.
    pub fn start(
        self: &Arc<Self>,
        template: &str,
        build_id: &str,
        req: StartRequest,
        users: usize,
        done: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        let b = self.get(template, build_id)?;
        // An untagged build replaces the template's own directory while `default` means
        // it; any other is kept beside it, as `template@<build id>`.
        let in_place = {
            let tags = &lock(&b).tags;
            let default = crate::template::tags::DEFAULT_TAG;
            // Nothing but `default` may mean the directory it replaces.
            tags.len() == 1
                && tags[0] == default
                && self
                    .templates()
                    .tags(template)?
                    .tags
                    .iter()
                    .all(|(tag, t)| (tag == default) == (t.build == template))
        };
        // One build of a template at a time.
        let other = lock(&self.builds).iter().any(|(id, o)| {
            id != build_id && {
                let o = lock(o);
                o.template == template && o.status == BuildStatus::Building
            }
        });
        if other {
            return Err(Error::Conflict(format!(
                "template {template} is being built already"
            )));
        }
        {
            let mut g = lock(&b);
            if g.status != BuildStatus::Waiting {
                return Err(Error::Conflict(format!(
                    "build {build_id} was started already"
                )));
            }
            if in_place && users > 0 {
                return Err(Error::Conflict(format!(
                    "template {template} is used by {users} sandbox(es): kill them before building it again (or build it with a tag: it is then kept beside the one in use)"
                )));
            }
            if req.from_image_registry.is_some() {
                return Err(Error::BadRequest(
                    "registry credentials in a build request are not supported: give them to the \
                     service's user in ~/.docker/config.json"
                        .into(),
                ));
            }
            if in_place
                && req.from_template.as_deref().map(|t| {
                    crate::template::tags::parse_reference(t).is_ok_and(|(n, tag)| {
                        n == template && tag.is_none_or(|t| t == crate::template::tags::DEFAULT_TAG)
                    })
                }) == Some(true)
            {
                return Err(Error::BadRequest(format!(
                    "template {template} cannot be built on itself (its build replaces it)"
                )));
            }
            match (&req.from_image, &req.from_template) {
                (Some(_), Some(_)) => {
                    return Err(Error::BadRequest(
                        "fromImage and fromTemplate together".into(),
                    ))
                }
                (None, None) => {
                    return Err(Error::BadRequest(
                        "neither fromImage nor fromTemplate".into(),
                    ))
                }
                _ => {}
            }
            for (i, s) in req.steps.iter().enumerate() {
                if !["COPY", "RUN", "ENV", "WORKDIR", "USER"].contains(&s.kind.as_str()) {
                    return Err(Error::BadRequest(format!(
                        "step {}: type '{}' is not supported",
                        i + 1,
                        s.kind
                    )));
                }
                if let Some(h) = &s.files_hash {
                    check_hash(h)?;
                    if !self.files_present(h)? {
                        return Err(Error::BadRequest(format!(
                            "step {}: its files ({h}) were not uploaded",
                            i + 1
                        )));
                    }
                }
            }
            g.status = BuildStatus::Building;
            g.dir = if in_place {
                template.to_string()
            } else {
                crate::template::tags::build_dir_name(template, build_id)
            };
            self.save(build_id, &g);
        }
        let me = self.clone();
        let id = build_id.to_string();
        std::thread::Builder::new()
            .name(format!("build-{id}"))
            .spawn(move || {
                me.run(&b, &id, &req);
                done();
            })
            .map_err(|e| Error::Vm(format!("starting the build: {e}")))?;
        Ok(())
    }
}

//! The templates a sandbox is made from, as the lifecycle sees them: built templates
//! (resolved by name, tag or build id), persistent snapshots, and which template a
//! sandbox's record stands on. Building templates is `crate::build`.

use super::*;

impl Host {
    /// The template a sandbox runs: its template here, or the copy a sandbox taken over
    /// from another host brought along.
    pub(super) fn sandbox_template(&self, rec: &Record) -> Result<Template> {
        let copy = rec.dir.join(template::TEMPLATE_FILE);
        if rec.remote.is_some() || copy.exists() {
            let text = std::fs::read_to_string(&copy).map_err(Error::io("reading", &copy))?;
            return serde_json::from_str(&text)
                .map_err(|e| Error::Corrupt(format!("{}: {e}", copy.display())));
        }
        self.template(&rec.template)
    }

    /// Every built template (not snapshots), by name.
    pub fn list_templates(&self) -> Result<Vec<Template>> {
        self.templates.list()
    }

    /// The template of a sandbox (a built template, or a snapshot, deleted or not).
    pub fn template(&self, name: &str) -> Result<Template> {
        if self.reg().get_snapshot(name)?.is_some() {
            self.snapshots.get(name)
        } else {
            self.templates.get(name)
        }
    }

    /// What a create request's `templateID` means: a live snapshot (by id or name, with
    /// `:default` or no tag), else a build of a built template (`name`, `name:tag`,
    /// `name:<build id>`: [`crate::template::tags`]).
    pub(super) fn resolve_template(&self, reference: &str) -> Result<(Template, PathBuf)> {
        if let Ok(name) = strip_tag(reference) {
            if let Some(s) = self.reg().resolve_snapshot(name)? {
                return Ok((
                    self.snapshots.get(&s.id)?,
                    self.snapshots.snapshot_dir(&s.id)?,
                ));
            }
        }
        let found = self.templates.resolve(reference).and_then(|build| {
            Ok((
                self.templates.get(&build)?,
                self.templates.snapshot_dir(&build)?,
            ))
        });
        match found {
            Err(Error::TemplateNotFound(_)) => Err(Error::BadRequest(format!(
                "template or snapshot '{reference}' not found"
            ))),
            r => r,
        }
    }

    /// The templates' tags ([`crate::template::tags`]).
    pub fn template_store(&self) -> &TemplateStore {
        &self.templates
    }

    /// Removes the builds of template `name` that no tag means and no sandbox or snapshot
    /// stands on (a build whose last tag moved elsewhere). Its template's own directory
    /// goes only when `default` means another build.
    pub fn sweep_builds(&self, name: &str) -> Result<()> {
        for b in self.templates.untagged_builds(name)? {
            let users = self.reg().count_template(&b)?;
            if users == 0 {
                tracing::info!(template = name, build = %b, "removing a build no tag means");
                self.templates.remove_build(&b)?;
            }
        }
        Ok(())
    }

    /// How many sandboxes use template `name`.
    pub fn template_users(&self, name: &str) -> Result<usize> {
        self.reg().count_template(name)
    }
}

//! Reading sandboxes without changing them: one (`get`, `get_local`), all of this host's,
//! a filtered page (`list`, with those only the store has), and a sandbox's logs.

use super::*;

impl Host {
    /// One sandbox of this host's registry (crashed ones too), never asking the store:
    /// quick enough for an async handler. `NotFound` may still be in the store
    /// ([`Host::get`]).
    pub fn get_local(&self, id: &str) -> Result<Record> {
        self.load(id)
    }

    /// One sandbox (crashed ones too: the caller decides how to show them). With a
    /// store, a sandbox another host published is shown as it is there (paused), without
    /// taking it over.
    pub fn get(&self, id: &str) -> Result<Record> {
        match (self.load(id), &self.durable) {
            (Err(Error::NotFound(_)), Some(d)) if ids::valid_sandbox_id(id) => {
                let o = d
                    .sandbox_object(id)?
                    .ok_or_else(|| Error::NotFound(id.to_string()))?;
                Ok(self.record_of(o))
            }
            (r, _) => r,
        }
    }

    /// The sandboxes in this host's registry (not those only in the store), oldest first.
    pub fn local_sandboxes(&self) -> Result<Vec<Record>> {
        self.reap()?;
        self.reg().all()
    }

    /// Sandboxes matching `q` (running ones checked for life first), and whether there are
    /// more.
    ///
    /// With a store, sandboxes paused on other hosts (or on this one before its state was
    /// lost) that only the store has are listed too, as paused. A store that cannot be
    /// listed leaves them out (with a warning) rather than failing the list.
    pub fn list(&self, q: &Query) -> Result<(Vec<Record>, bool)> {
        self.reap()?;
        let Some(d) = &self.durable else {
            return self.reg().list(q);
        };
        let mut all = self.reg().all()?;
        match d.sandbox_objects() {
            Ok(objects) => {
                let here: std::collections::HashSet<String> =
                    all.iter().map(|r| r.id.clone()).collect();
                all.extend(
                    objects
                        .into_iter()
                        .filter(|o| !here.contains(&o.id) && ids::valid_sandbox_id(&o.id))
                        .map(|o| self.record_of(o)),
                );
                all.sort_by(|a, b| (a.started_ms, &a.id).cmp(&(b.started_ms, &b.id)));
            }
            Err(e) => tracing::warn!(error = %e, "sandboxes in the store not listed"),
        }
        Ok(q.select(all))
    }

    /// The log lines of a sandbox (any state): its VMM log and serial console, oldest
    /// first, at most [`MAX_LOG_LINES`] (the newest).
    pub fn logs(&self, id: &str) -> Result<Vec<LogLine>> {
        let rec = self.load(id)?;
        Ok(logs::read(&rec.dir))
    }
}

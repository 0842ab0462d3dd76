//! Recovery after a service restart: running sandboxes whose process is gone are marked
//! crashed, files nothing needs are collected, and the networks of the sandboxes still
//! recorded are taken over (the rest removed).

use super::*;

impl Host {
    /// After a service restart: running sandboxes whose process is gone are marked crashed;
    /// the rest are the registry's. Returns (running, paused, crashed) counts.
    pub fn recover(&self) -> Result<(usize, usize, usize)> {
        self.reap()?;
        self.collect_garbage()?;
        let all = self.reg().all()?;
        // Networks no sandbox holds (a crash's leftovers) go; the rest are taken over.
        if let Ok(n) = &self.networks {
            let mut keep = Vec::new();
            for r in &all {
                if let Some(i) = r.net {
                    // Its rules stay in its namespace as they were; its DNS resolves
                    // nothing if the recorded policy cannot be read.
                    let policy = policy_of(r).unwrap_or_else(|e| {
                        tracing::error!("{e}: the sandbox's DNS answers nothing");
                        EgressPolicy::deny_all()
                    });
                    keep.push((i, policy));
                }
            }
            n.recover(&keep)?;
        }
        let count = |s: State| all.iter().filter(|r| r.state == s).count();
        Ok((
            count(State::Running),
            count(State::Paused),
            count(State::Crashed),
        ))
    }
}

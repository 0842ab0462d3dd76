//! The cluster's say in the lifecycle (`clade serve --cluster`): before a change to a
//! sandbox, whether this host still owns it (the fence: one another host took over is
//! forgotten here), room for new VMs (admission), and telling the cluster what this host
//! holds after each change. Without a cluster every check here passes.

use super::*;

impl Host {
    /// Makes the host a node of a cluster: `o` is asked before every change to a sandbox
    /// and told what the host holds (see [`crate::ownership`]). Before [`Host::recover`].
    pub fn set_ownership(&mut self, o: Arc<dyn crate::ownership::Ownership>) {
        self.ownership = Some(o);
    }

    /// Tells the cluster (if any) that this host holds `rec` as it is now. A failure is
    /// logged: the change was made, and the cluster learns the state at the next one.
    pub(super) fn owned(&self, rec: &Record) {
        if let Some(o) = &self.ownership {
            if let Err(e) = o.record(rec) {
                tracing::warn!(sandbox = %rec.id, "recording it in the cluster: {e}");
            }
        }
    }

    /// Before a change to `rec` (its lock held): whether this host still owns it. One
    /// another host took over is forgotten here (its VM stopped, its local files
    /// removed; nothing of it in the store is touched).
    pub(super) fn fence(&self, rec: &Record) -> Result<()> {
        let Some(o) = &self.ownership else {
            return Ok(());
        };
        self.forget_if_fenced(rec, o.check(&rec.id))
    }

    /// `r` is what the cluster or the store said of sandbox `rec` (its lock held): if it
    /// is [`Error::Fenced`], this host forgets its copy (without touching the store).
    pub(super) fn forget_if_fenced(&self, rec: &Record, r: Result<()>) -> Result<()> {
        match r {
            Err(e @ Error::Fenced { .. }) => {
                tracing::warn!(sandbox = %rec.id, "{e}: forgetting this host's copy");
                if let Err(f) = self.teardown_locked(rec.clone()) {
                    tracing::warn!(sandbox = %rec.id, "forgetting it: {f}");
                }
                Err(e)
            }
            r => r,
        }
    }

    /// Every sandbox of this host another host owns now is forgotten (see
    /// [`Host::fence`]): after this node lost its cluster lease. Returns how many.
    pub fn forget_taken(&self) -> Result<usize> {
        let mut n = 0;
        // Read first: the registry's lock is taken again for each.
        let all = self.reg().all()?;
        for rec in all {
            let lock = self.lock_of(&rec.id);
            let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
            if let Ok(r) = self.load(&rec.id) {
                if matches!(self.fence(&r), Err(Error::Fenced { .. })) {
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// Room for `count` VMs of `vcpus` and `mem_mib` each, when the cluster counts it
    /// ([`crate::ownership::Ownership::admit`]).
    pub(super) fn admit(
        &self,
        vcpus: u32,
        mem_mib: u64,
        count: usize,
    ) -> Result<Option<crate::ownership::Reservation>> {
        match &self.ownership {
            Some(o) => o.admit(vcpus, mem_mib, u32::try_from(count).unwrap_or(u32::MAX)),
            None => Ok(None),
        }
    }

    /// The hosts of the cluster this host is in (`None`: it is in none).
    pub fn cluster_nodes(&self) -> Result<Option<Vec<crate::ownership::NodeSummary>>> {
        match &self.ownership {
            Some(o) => o.nodes(),
            None => Ok(None),
        }
    }
}

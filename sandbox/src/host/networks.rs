//! Sandbox networks as the lifecycle uses them: one per sandbox with a network device,
//! taken at create, kept while paused, given back at kill; and its egress policy (set at
//! create, replaced by `set_egress`, inherited by fork children). The namespaces, NAT and
//! DNS themselves are in `crate::net`.

use super::*;

impl Host {
    /// Gives the host its sandbox networks (`Ok`), or says why it has none (`Err`: set-up
    /// failed, or turned off). Before [`Host::recover`].
    pub fn set_networks(&mut self, n: std::result::Result<Arc<Networks>, String>) {
        self.networks = n;
    }

    pub(super) fn networks(&self) -> Result<&Arc<Networks>> {
        self.networks.as_ref().map_err(|why| {
            Error::Network(format!(
                "this template's VM has a network device, but the host has no sandbox \
                 networking: {why}"
            ))
        })
    }

    /// A network for a new VM of `template` (none for a template without a network device).
    pub(super) fn acquire_net(
        &self,
        template: &Template,
        policy: &EgressPolicy,
    ) -> Result<Option<u32>> {
        if !template.net {
            return Ok(None);
        }
        self.networks()?.acquire(policy).map(Some)
    }

    /// Removes the ready networks of the pool (the service stops; sandboxes keep theirs).
    pub fn shutdown_networks(&self) {
        if let Ok(n) = &self.networks {
            n.shutdown();
        }
    }

    /// Gives a sandbox's network back (its sandbox is gone, or never started).
    pub(super) fn release_net(&self, net: Option<u32>) {
        if let (Some(i), Ok(n)) = (net, &self.networks) {
            n.release(i);
        }
    }

    /// Where the guest of `rec` is reached from this host (its exposed ports): its network
    /// namespace's outer address; `None` for a sandbox without a network.
    pub fn guest_ip(&self, rec: &Record) -> Option<std::net::IpAddr> {
        if self.driver.guest_is_host() {
            return Some(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let n = self.networks.as_ref().ok()?;
        rec.net.map(|i| n.outer_ip(i).into())
    }

    /// Replaces a sandbox's egress policy (E2B `PUT /sandboxes/{id}/network`), running or
    /// paused; kept for its resumes and forks.
    pub fn set_egress(&self, id: &str, policy: &EgressPolicy) -> Result<Record> {
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_owned(id)?;
        lifecycle::permit(Op::SetEgress, &rec)?;
        let Some(i) = rec.net else {
            return Err(Error::BadRequest(format!(
                "sandbox {id} has no network (its template's VM has no network device)"
            )));
        };
        self.networks()?.set_policy(i, policy)?;
        rec.egress = policy_json(policy)?;
        self.reg().update(&rec)?;
        tracing::info!(sandbox = %id, ?policy, "egress policy replaced");
        Ok(rec)
    }
}

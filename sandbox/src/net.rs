//! Sandbox networks as the host service keeps them: one `hostnet::SandboxNet` (namespace,
//! veth pair, persistent TAP, NAT, egress policy) per sandbox whose template has a network
//! device, held from its creation to its kill (a paused sandbox keeps its namespace: its
//! outer address and policy stay, and a resume only hands a new VM process the TAP).
//!
//! A network's TAP is opened by the service ahead of the VM that will use it — when the
//! network is made (a pool's refill), taken over after a restart, or its sandbox's VM
//! ended (a pause) — and handed to that VM process with its start ([`Networks::take_tap`]:
//! over the standby's control socket, or inherited), so no restore attaches to a TAP on
//! its path. The service keeps no descriptor of a TAP a VM uses: a TAP takes one
//! attachment at a time, and a VM that opens its own by name (a fork child, whose parent
//! VM process starts it; a start after a crash) must find it free. While a paused
//! sandbox's TAP is held by the service, frames sent towards its guest queue in the TAP and
//! are dropped when its queue is full, as they would be by a VM that does not read them.
//!
//! Each network answers DNS on its gateway ([`dns`]: a forwarder to the host's resolver,
//! which also applies the domain names of the sandbox's egress policy).
//!
//! Making a namespace costs milliseconds of netlink and `nft` work, so a small pool of
//! ready networks (allow-all) is kept off the create path and refilled in the background;
//! a create with another policy takes one and replaces its rules (one `nft` transaction).
//!
//! After a service restart, [`Networks::recover`] sweeps every namespace and host veth of
//! the range that no sandbox in the registry holds (a crashed service's pool, a sandbox
//! whose kill was cut short) and takes the rest over.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hostnet::{EgressPolicy, HostNet, NetRange, Options, SandboxNet};

use crate::error::{Error, Result};

pub mod dns;
pub mod own;

/// A network as this service keeps it: the namespace and rules, and the DNS forwarder on
/// its gateway (stopped first when it goes).
struct Net {
    dns: Option<dns::Forwarder>,
    /// Its TAP, opened ahead for the next VM to start on it (`None` while a VM uses it,
    /// or if opening failed: a VM then opens it by name).
    tap: Option<Arc<vmm::Tap>>,
    net: SandboxNet,
}

impl Net {
    /// Replaces the policy: the rules, and what its DNS forwarder resolves and learns.
    fn set_policy(&self, policy: &EgressPolicy) -> Result<()> {
        let apply = || {
            self.net
                .set_policy(policy)
                .map_err(net_err("egress policy"))
        };
        match &self.dns {
            Some(d) => d.set_policy(policy, apply),
            None => apply(),
        }
    }

    fn destroy(self) -> hostnet::Result<()> {
        drop(self.dns);
        drop(self.tap);
        self.net.destroy()
    }
}

/// The service's sandbox networks (see the module docs).
pub struct Networks {
    range: NetRange,
    /// Networks held by sandboxes, by index.
    held: Mutex<BTreeMap<u32, Net>>,
    /// Ready networks (allow-all), not yet any sandbox's.
    pool: Mutex<Vec<Net>>,
    /// The resolver the guests' DNS queries go to (none: no DNS in sandboxes).
    dns_upstream: Option<SocketAddr>,
    /// How many ready networks to keep.
    pool_size: usize,
    refilling: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn net_err(what: &str) -> impl FnOnce(hostnet::Error) -> Error + '_ {
    move |e| Error::Network(format!("{what}: {e}"))
}

impl Networks {
    /// Sets up the host side (forwarding, the host's NAT and isolation rules) for `range`.
    /// Guests' DNS queries go to `dns_upstream` (see [`dns`]). Needs root; fails when `nft`
    /// or the kernel's nftables are missing.
    pub fn init(
        range: NetRange,
        pool_size: usize,
        dns_upstream: Option<SocketAddr>,
    ) -> Result<Arc<Networks>> {
        HostNet::init(&range).map_err(net_err("host network set-up"))?;
        if dns_upstream.is_none() {
            tracing::warn!("no DNS resolver for sandboxes (no nameserver in /etc/resolv.conf)");
        }
        Ok(Arc::new(Networks {
            range,
            held: Mutex::new(BTreeMap::new()),
            pool: Mutex::new(Vec::new()),
            pool_size,
            refilling: AtomicBool::new(false),
            dns_upstream,
        }))
    }

    /// `net` as this service keeps it: with its DNS forwarder started, under `policy`.
    fn keep(&self, net: SandboxNet, policy: &EgressPolicy) -> Result<Net> {
        let dns = match self.dns_upstream {
            Some(up) => Some(dns::Forwarder::start(
                net.netns_path(),
                SocketAddr::new(hostnet::GUEST_GATEWAY.into(), 53),
                up,
                policy,
            )?),
            None => None,
        };
        let tap = open_tap_ahead(net.index(), net.netns_path());
        Ok(Net { dns, tap, net })
    }

    /// After a (re)start: keeps the networks of `keep` (the registry's sandboxes, with
    /// their policies), removes every other one of the range; then fills the pool.
    pub fn recover(self: &Arc<Self>, keep: &[(u32, EgressPolicy)]) -> Result<()> {
        let indices: Vec<u32> = keep.iter().map(|(i, _)| *i).collect();
        let swept = hostnet::sweep(&self.range, &indices).map_err(net_err("sweeping networks"))?;
        if !swept.namespaces.is_empty() || !swept.veths.is_empty() {
            tracing::info!(?swept, "removed networks no sandbox holds");
        }
        for (i, policy) in keep {
            let i = *i;
            match SandboxNet::adopt(&self.range, i)
                .map_err(net_err("taking a network over"))
                .and_then(|n| self.keep(n, policy))
            {
                Ok(n) => {
                    lock(&self.held).insert(i, n);
                }
                // Its sandbox keeps the index; a resume then fails with a clear error.
                Err(e) => tracing::warn!(net = i, "a sandbox's network is gone: {e}"),
            }
        }
        self.refill();
        Ok(())
    }

    /// A network for a new sandbox (or fork child) with `policy`; returns its index.
    pub fn acquire(self: &Arc<Self>, policy: &EgressPolicy) -> Result<u32> {
        let ready = lock(&self.pool).pop();
        let net = match ready {
            Some(n) => {
                if *policy != EgressPolicy::allow_all() {
                    n.set_policy(policy)?;
                }
                n
            }
            None => self.make(policy)?,
        };
        let i = net.net.index();
        lock(&self.held).insert(i, net);
        self.refill();
        Ok(i)
    }

    /// Makes a network at the lowest free index (one some other user of the range holds,
    /// such as a template build, is skipped).
    fn make(&self, policy: &EgressPolicy) -> Result<Net> {
        let opts = Options {
            policy: policy.clone(),
            ..Options::default()
        };
        let mut i = 0;
        loop {
            let taken = {
                let held = lock(&self.held);
                let pool = lock(&self.pool);
                held.contains_key(&i) || pool.iter().any(|n| n.net.index() == i)
            };
            if !taken {
                match SandboxNet::create_with(&self.range, i, &opts) {
                    Ok(n) => return self.keep(n, policy),
                    Err(hostnet::Error::Exists(_)) => {}
                    Err(e) => return Err(net_err("making a sandbox network")(e)),
                }
            }
            i += 1;
            if i >= self.range.capacity() {
                return Err(Error::Network(format!(
                    "all {} networks of {} are in use",
                    self.range.capacity(),
                    self.range.cidr
                )));
            }
        }
    }

    /// Tops the pool up in the background (one refill at a time).
    fn refill(self: &Arc<Self>) {
        if lock(&self.pool).len() >= self.pool_size || self.refilling.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("net-pool".into())
            .spawn(move || {
                while lock(&me.pool).len() < me.pool_size {
                    match me.make(&EgressPolicy::allow_all()) {
                        Ok(n) => lock(&me.pool).push(n),
                        Err(e) => {
                            tracing::warn!("network pool: {e}");
                            break;
                        }
                    }
                }
                me.refilling.store(false, Ordering::Release);
            });
        if spawned.is_err() {
            self.refilling.store(false, Ordering::Release);
        }
    }

    /// Replaces the egress policy of network `i` (a running or paused sandbox's).
    pub fn set_policy(&self, i: u32, policy: &EgressPolicy) -> Result<()> {
        match lock(&self.held).get(&i) {
            Some(n) => n.set_policy(policy),
            None => Err(Error::Network(format!(
                "the sandbox's network ({i}) is gone"
            ))),
        }
    }

    /// Removes network `i` (its sandbox is gone). Errors are logged: what is left is swept
    /// at the next start.
    pub fn release(&self, i: u32) {
        let held = lock(&self.held).remove(&i);
        if let Some(Err(e)) = held.map(Net::destroy) {
            tracing::error!(net = i, "removing a sandbox network: {e}");
        }
    }

    /// The VMM's `--net` for network `i`: the TAP inside its namespace.
    pub fn tap_spec(&self, i: u32) -> String {
        format!(
            "tap={},netns={}",
            hostnet::TAP_NAME,
            self.range.netns_path(i).display()
        )
    }

    /// Network `i`'s TAP opened ahead, for a VM process about to start on it; the service
    /// lets go of it (see the module docs). `None`: the VM opens the TAP by name.
    pub fn take_tap(&self, i: u32) -> Option<Arc<vmm::Tap>> {
        lock(&self.held).get_mut(&i).and_then(|n| n.tap.take())
    }

    /// Opens network `i`'s TAP ahead again once no VM uses it (its sandbox paused, or a
    /// start failed), for the next start; nothing if it is held already.
    pub fn reopen_tap(&self, i: u32) {
        if lock(&self.held).get(&i).is_none_or(|n| n.tap.is_some()) {
            return;
        }
        let tap = open_tap_ahead(i, &self.range.netns_path(i));
        if let Some(n) = lock(&self.held).get_mut(&i) {
            if n.tap.is_none() {
                n.tap = tap;
            }
        }
    }

    /// The address the host reaches network `i`'s guest at (its exposed ports).
    pub fn outer_ip(&self, i: u32) -> Ipv4Addr {
        self.range.outer_ip(i)
    }

    /// Removes the pool's ready networks (the service stops); held ones stay, as their
    /// sandboxes do (the next service takes them over, [`Networks::recover`]): they are let
    /// go here, so that dropping this value afterwards removes nothing.
    pub fn shutdown(&self) {
        for n in lock(&self.pool).drain(..) {
            if let Err(e) = n.destroy() {
                tracing::warn!("removing a pooled network: {e}");
            }
        }
        for (_, n) in std::mem::take(&mut *lock(&self.held)) {
            drop(n.dns);
            drop(n.tap);
            n.net.leak();
        }
    }
}

/// Template builds' VMs on the service's sandbox networks: each VM process gets a network
/// of its own (allow-all, as a build fetches packages), its TAP handed over as a
/// descriptor (a jailed VM cannot open one), removed once the process ended.
pub struct BuildNetworks(Arc<Networks>);

impl std::fmt::Debug for BuildNetworks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("BuildNetworks")
            .field(&self.0.range.cidr)
            .finish()
    }
}

impl BuildNetworks {
    /// Build VMs on `networks`.
    pub fn new(networks: Arc<Networks>) -> Self {
        Self(networks)
    }
}

/// A build VM's network while its process lives.
struct BuildNet {
    networks: Arc<Networks>,
    index: u32,
    /// The descriptor the VM inherited (kept open here until it ended).
    tap: Option<Arc<vmm::Tap>>,
}

impl Drop for BuildNet {
    fn drop(&mut self) {
        drop(self.tap.take());
        self.networks.release(self.index);
    }
}

impl clade_builder::vm::AttachNetwork for BuildNetworks {
    fn attach(
        &self,
        cmd: &mut std::process::Command,
    ) -> std::result::Result<Box<dyn Send>, String> {
        use std::os::fd::{AsFd, AsRawFd};
        let index = self
            .0
            .acquire(&EgressPolicy::allow_all())
            .map_err(|e| e.to_string())?;
        let mut net = BuildNet {
            networks: Arc::clone(&self.0),
            index,
            tap: None,
        };
        let tap = self.0.take_tap(index).ok_or_else(|| {
            format!("the TAP of network {index} could not be opened for the build VM")
        })?;
        let fd = tap.as_fd().as_raw_fd();
        cmd.arg("--net").arg(format!("fd={fd}"));
        crate::vmproc::inherit_descriptor(cmd, fd);
        net.tap = Some(tap);
        tracing::info!(net = index, "build VM network");
        Ok(Box::new(net))
    }

    fn guest_cmdline(&self) -> String {
        guest_cmdline()
    }
}

/// Opens the TAP of network `index` (in namespace `netns`) ahead of a VM; `None` if it
/// cannot be, e.g. while a VM is on it (after a service restart): that VM's next start
/// opens it by name.
fn open_tap_ahead(index: u32, netns: &std::path::Path) -> Option<Arc<vmm::Tap>> {
    vmm::open_tap(&vmm::NetConfig {
        tap: vmm::TapSource::Name(hostnet::TAP_NAME.into()),
        mac: None,
        netns: Some(netns.to_path_buf()),
    })
    .map_err(|e| tracing::debug!(net = index, "TAP not opened ahead: {e}"))
    .ok()
}

/// The guest side of every sandbox network, for a template's kernel command line
/// (`clade.net=ADDR/PREFIX,GATEWAY clade.dns=GATEWAY`, read by the guest agent: the
/// resolver is the service's forwarder on the gateway, [`dns`]).
pub fn guest_cmdline() -> String {
    format!(
        "clade.net={}/{},{gw} clade.dns={gw}",
        hostnet::GUEST_IP,
        hostnet::GUEST_PREFIX,
        gw = hostnet::GUEST_GATEWAY
    )
}

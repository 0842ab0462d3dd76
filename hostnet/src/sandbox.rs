//! One sandbox's network: its namespace, veth pair, persistent TAP, NAT and egress policy.
//!
//! Inside, every sandbox looks the same (the guest is [`GUEST_IP`], its gateway
//! [`GUEST_GATEWAY`] on [`TAP_NAME`] with MAC [`TAP_MAC`]), so a snapshot restored anywhere
//! or a forked child keeps working without the guest noticing; outside, each has its own
//! /30 of the [`NetRange`].
//!
//! Lifetime: dropping a `SandboxNet` destroys it (errors are logged), like any owned
//! resource; a network that must outlive its handle (handed over to another process, or a
//! test simulating a crash) is given up explicitly with [`SandboxNet::leak`], and what a
//! crash leaks is removed by [`crate::sweep`].

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::policy::EgressPolicy;
use crate::range::NetRange;
use crate::{io_err, netlink, netns, nft, tap, Result};

/// The TAP inside every sandbox namespace (the VMM's `--net netns=PATH,tap=tap0`).
pub const TAP_NAME: &str = "tap0";
/// MAC address of the TAP (the guest's gateway): 02:00:ac:10:00:01.
pub const TAP_MAC: [u8; 6] = [0x02, 0x00, 0xac, 0x10, 0x00, 0x01];
/// The guest's address, the same in every sandbox.
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
/// The guest's gateway: the TAP's address.
pub const GUEST_GATEWAY: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// Prefix length of the guest's link.
pub const GUEST_PREFIX: u8 = 30;

/// What stands in the namespace for the guest's link.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum InnerLink {
    /// A persistent TAP [`TAP_NAME`] (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`) the VMM attaches
    /// to: the production case.
    #[default]
    Tap,
    /// A veth named [`TAP_NAME`] whose peer `eth0` is put, with [`GUEST_IP`] and a default
    /// route, into the existing namespace at this path: a "guest" made of a namespace, for
    /// end-to-end tests of the rules with ordinary sockets (or a process-based guest).
    Veth {
        /// The guest's namespace (e.g. `/run/netns/NAME`).
        guest_netns: PathBuf,
    },
}

/// How to create a sandbox's network.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The egress policy in force from the start (default: allow all).
    pub policy: EgressPolicy,
    /// The guest's link.
    pub inner: InnerLink,
}

/// A sandbox's network, created by [`SandboxNet::create`]; destroyed when dropped.
#[derive(Debug)]
pub struct SandboxNet {
    range: NetRange,
    index: u32,
    netns_path: PathBuf,
    live: bool,
}

impl SandboxNet {
    /// Creates sandbox `index`'s network with the default [`Options`] (a TAP, allow all).
    pub fn create(range: &NetRange, index: u32) -> Result<SandboxNet> {
        Self::create_with(range, index, &Options::default())
    }

    /// Creates sandbox `index`'s network: the namespace `<name>-<index>` (pinned at
    /// `/run/netns/`), the veth pair (`<link_prefix>h<index>` on the host with the block's
    /// `.1`, `<link_prefix>n` inside with `.2` and the default route), `lo` up, the guest
    /// link (`tap0`, [`GUEST_GATEWAY`]/30, [`TAP_MAC`]), forwarding on, and the namespace's
    /// nftables table with `opts.policy`. On failure, whatever was made is removed again.
    pub fn create_with(range: &NetRange, index: u32, opts: &Options) -> Result<SandboxNet> {
        range.checked(index)?;
        let start = Instant::now();
        let mut net = SandboxNet {
            range: range.clone(),
            index,
            netns_path: range.netns_path(index),
            live: true,
        };
        let (r, o) = (range.clone(), opts.clone());
        if let Err(e) = netns::on_thread(move || build(&r, index, &o)) {
            // Only remove what is ours: a namespace that already existed was refused before
            // anything was made, and must not be torn down here.
            net.live = false;
            if !matches!(e, crate::Error::Exists(_)) {
                if let Err(t) = net.teardown() {
                    tracing::error!(index, error = %t, "cleaning up after a failed create");
                }
            }
            return Err(e);
        }
        tracing::debug!(index, elapsed = ?start.elapsed(), "sandbox network created");
        Ok(net)
    }

    /// The net index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The namespace's path, for `setns` (the VMM's `--net netns=PATH,tap=tap0`).
    pub fn netns_path(&self) -> &Path {
        &self.netns_path
    }

    /// The outer address: the host reaches the guest's TCP port P at `outer_ip():P`.
    pub fn outer_ip(&self) -> Ipv4Addr {
        self.range.outer_ip(self.index)
    }

    /// The host's end of the veth pair (`<link_prefix>h<index>`).
    pub fn host_veth(&self) -> String {
        self.range.host_veth(self.index)
    }

    /// The name of the guest's link in the namespace ([`TAP_NAME`]).
    pub fn tap_name(&self) -> &'static str {
        TAP_NAME
    }

    /// Replaces the egress policy of the running sandbox, atomically (one nftables
    /// transaction: the `egress` chain is flushed and refilled; packets never see a half).
    pub fn set_policy(&self, policy: &EgressPolicy) -> Result<()> {
        let doc = policy.compile()?;
        let ns = netns::open(&self.netns_path)?;
        nft::apply(Some(&ns), &doc)
    }

    /// Lets the guest reach `learned`: addresses an allowed domain resolved to, each with
    /// its DNS TTL (see [`crate::learned_addresses`]).
    pub fn allow_learned(&self, learned: &[(Ipv4Addr, u32)]) -> Result<()> {
        allow_learned(&self.netns_path, learned)
    }

    /// Removes the network: the host's veth end (which takes the namespace's end with it)
    /// and the namespace's pin (the namespace, its TAP and rules go away once no process
    /// is left in it).
    pub fn destroy(mut self) -> Result<()> {
        self.live = false;
        self.teardown()
    }

    /// Gives the network up without removing it (it stays until [`crate::sweep`] or
    /// another owner removes it); returns its index.
    pub fn leak(mut self) -> u32 {
        self.live = false;
        self.index
    }

    fn teardown(&self) -> Result<()> {
        let start = Instant::now();
        let veth = self.host_veth();
        netns::on_thread(move || {
            let rt = netlink::runtime()?;
            let host = netlink::connect(&rt)?;
            rt.block_on(netlink::del_link(&host, &veth))
        })?;
        netns::remove(&self.netns_path)?;
        tracing::debug!(index = self.index, elapsed = ?start.elapsed(), "sandbox network destroyed");
        Ok(())
    }
}

impl Drop for SandboxNet {
    fn drop(&mut self) {
        if self.live {
            self.live = false;
            if let Err(e) = self.teardown() {
                tracing::error!(index = self.index, error = %e, "destroying a sandbox network on drop");
            }
        }
    }
}

/// Everything `create_with` does, on a thread of its own that ends inside the new namespace.
fn build(range: &NetRange, index: u32, opts: &Options) -> Result<()> {
    let host_ns = netns::open(Path::new("/proc/thread-self/ns/net"))?;
    let rt = netlink::runtime()?;
    let host = netlink::connect(&rt)?;
    let path = range.netns_path(index);
    netns::create_here(&path)?;
    let sandbox_ns = netns::open(&path)?;
    // IPv4 only (the guest has no IPv6): no link-local chatter to the guest, no path around
    // the IPv4 rules. Kernels without IPv6 have no such file, which is fine.
    for f in ["all", "default"] {
        let p = format!("/proc/sys/net/ipv6/conf/{f}/disable_ipv6");
        if Path::new(&p).exists() {
            std::fs::write(&p, "1").map_err(io_err(format!("write {p}")))?;
        }
    }
    let inner = netlink::connect(&rt)?;
    let (host_veth, ns_veth) = (range.host_veth(index), range.ns_veth());
    let (host_ip, outer_ip) = (range.host_ip(index), range.outer_ip(index));

    rt.block_on(async {
        // Made from inside, with the peer put straight into the host's namespace: the
        // inner name is the same in every sandbox and would collide on the host.
        netlink::add_veth(&inner, &ns_veth, &host_veth, host_ns.as_raw_fd()).await?;
        let h = netlink::must_link_index(&host, &host_veth).await?;
        netlink::add_addr(&host, h, host_ip, 30).await?;
        netlink::link_up(&host, h, None).await?;
        let lo = netlink::must_link_index(&inner, "lo").await?;
        netlink::link_up(&inner, lo, None).await?;
        let n = netlink::must_link_index(&inner, &ns_veth).await?;
        netlink::add_addr(&inner, n, outer_ip, 30).await?;
        netlink::link_up(&inner, n, None).await?;
        netlink::add_default_route(&inner, host_ip).await
    })?;

    match &opts.inner {
        InnerLink::Tap => tap::create_persistent(TAP_NAME)?,
        InnerLink::Veth { guest_netns } => {
            let guest_ns = netns::open(guest_netns)?;
            netns::enter(&guest_ns)?;
            let guest = netlink::connect(&rt);
            netns::enter(&sandbox_ns)?;
            let guest = guest?;
            rt.block_on(async {
                netlink::add_veth(&inner, TAP_NAME, "eth0", guest_ns.as_raw_fd()).await?;
                let lo = netlink::must_link_index(&guest, "lo").await?;
                netlink::link_up(&guest, lo, None).await?;
                let e = netlink::must_link_index(&guest, "eth0").await?;
                netlink::add_addr(&guest, e, GUEST_IP, GUEST_PREFIX).await?;
                netlink::link_up(&guest, e, None).await?;
                netlink::add_default_route(&guest, GUEST_GATEWAY).await
            })?;
        }
    }
    rt.block_on(async {
        let t = netlink::must_link_index(&inner, TAP_NAME).await?;
        netlink::link_up(&inner, t, Some(TAP_MAC)).await?;
        netlink::add_addr(&inner, t, GUEST_GATEWAY, GUEST_PREFIX).await
    })?;

    // This thread is in the sandbox's namespace, so this is the namespace's own sysctl.
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        .map_err(io_err("enable ip_forward in the namespace"))?;

    let doc = nft::sandbox_table(&ns_veth, TAP_NAME, outer_ip, GUEST_IP, opts.policy.rules()?);
    nft::apply(Some(&sandbox_ns), &doc)?;
    Ok(())
}

impl SandboxNet {
    /// Takes over sandbox `index`'s network made earlier (by a previous run of the same
    /// service, found again after a restart): its namespace must be pinned. Dropping or
    /// destroying the handle then removes it like one this process made.
    pub fn adopt(range: &NetRange, index: u32) -> Result<SandboxNet> {
        range.checked(index)?;
        let netns_path = range.netns_path(index);
        if !netns_path.exists() {
            return Err(crate::Error::Config(format!(
                "no network {index} to take over: {} does not exist",
                netns_path.display()
            )));
        }
        Ok(SandboxNet {
            range: range.clone(),
            index,
            netns_path,
            live: true,
        })
    }
}

/// [`SandboxNet::allow_learned`] for the sandbox network whose namespace is pinned at
/// `netns_path` (for a holder of the path only, such as its DNS forwarder).
pub fn allow_learned(netns_path: &Path, learned: &[(Ipv4Addr, u32)]) -> Result<()> {
    if learned.is_empty() {
        return Ok(());
    }
    let ns = netns::open(netns_path)?;
    nft::apply(Some(&ns), &crate::policy::learned_addresses(learned))
}

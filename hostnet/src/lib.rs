//! The host side of a sandbox's network.
//!
//! Every sandbox gets its own network namespace, the way Firecracker hosts (and E2B) do it,
//! so that the network looks the same inside every sandbox: "network for clones". A
//! snapshot restored many times, or a forked child, keeps the address its guest had when the
//! snapshot was taken, so the guest side must be identical everywhere:
//!
//! ```text
//!  guest eth0 172.16.0.2/30 ── tap0 172.16.0.1/30, MAC 02:00:ac:10:00:01   (namespace clade-<i>)
//!                                 │  forward chain: the egress policy
//!                                 │  SNAT guest -> outer, DNAT outer:tcp/* -> guest
//!                              cvn 10.200.<4i>.2/30 ── cvh<i> 10.200.<4i>.1/30   (host)
//!                                                       │  host table `clade`: masquerade of
//!                                                       │  the range leaving the host, no
//!                                                       │  access from a sandbox to the host
//! ```
//!
//! What differs between sandboxes is only the outer /30 (`NetRange`, by net index `i`).
//! The host reaches a guest's listening TCP port at `outer_ip:port` (DNAT inside the
//! namespace); the guest reaches outside networks through two NATs (in its namespace to
//! the outer address, on the host to the host's address) and never the host itself.
//!
//! * [`NetRange`]: the outer range and the names, with a prefix so test runs and a running
//!   service never collide.
//! * [`SandboxNet`]: one sandbox's namespace, veth pair, persistent TAP and rules.
//! * [`HostNet::init`]: the host-wide part (forwarding, masquerade, no access to the host).
//! * [`sweep`]: removes what a crashed service or a killed VMM left behind.
//! * [`EgressPolicy`]: E2B's allow/deny lists, compiled to nftables rules by a pure function
//!   ([`EgressPolicy::compile`]) and applied atomically to a running sandbox.
//!
//! Links, addresses, routes and namespaces are made over rtnetlink (no `ip` process);
//! firewall rules are nftables JSON fed to `nft -j -f -` (the `nftables` crate's schema types),
//! run inside the sandbox's namespace when the rules belong there. The API is blocking: each
//! call runs its netlink work on a short-lived thread of its own with a current-thread tokio
//! runtime, so it may be called from plain threads and (through `spawn_blocking`) from async
//! code alike, and a thread that enters a namespace never is the caller's.
//!
//! Everything needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for the namespace mounts).

mod host;
mod netlink;
mod netns;
mod nft;
mod policy;
mod range;
mod sandbox;
mod tap;

pub use host::{sweep, HostNet, Swept};
pub use netns::{add_netns, in_netns, remove_netns};
pub use policy::{
    learned_addresses, parse_cidr, parse_domain, Default as PolicyDefault, EgressPolicy,
    MAX_ENTRIES, MAX_LEARNED_SECS, MIN_LEARNED_SECS,
};
pub use range::NetRange;
pub use sandbox::{
    allow_learned, InnerLink, Options, SandboxNet, GUEST_GATEWAY, GUEST_IP, GUEST_PREFIX, TAP_MAC,
    TAP_NAME,
};

/// Everything that can go wrong here.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CIDR or address in a policy or range did not parse.
    #[error("invalid address or CIDR {input:?}: {reason}")]
    InvalidCidr { input: String, reason: String },
    /// A domain name in a policy did not parse.
    #[error("invalid domain name {input:?}: {reason}")]
    InvalidDomain { input: String, reason: String },
    /// The sandbox's namespace already exists (a leak to sweep, or an index in use).
    #[error("{0}")]
    Exists(String),
    /// A configuration value is out of range.
    #[error("invalid network configuration: {0}")]
    Config(String),
    /// A netlink request failed.
    #[error("netlink: {what}: {source}")]
    Netlink {
        what: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// A system call or file operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// `nft` could not be run or refused the rules.
    #[error("nft: {0}")]
    Nft(String),
}

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

pub(crate) fn nix_err(what: impl Into<String>) -> impl FnOnce(nix::Error) -> Error {
    let what = what.into();
    move |e| Error::Io {
        what,
        source: std::io::Error::from(e),
    }
}

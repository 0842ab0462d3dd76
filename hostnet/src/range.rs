//! The outer addressing and the names of one service's sandboxes.
//!
//! A service owns one IPv4 range, carved into /30 blocks by a sandbox's net index: block `i`
//! is `base + 4i`, its `.1` on the host's veth end and its `.2` on the namespace's. The
//! names carry a prefix so that two users of this crate on one host (a running service and
//! a test run, two test binaries) never touch each other's namespaces, links or rules: every
//! name is derived from `name` (namespaces, the host's nftables table) and `link_prefix`
//! (host veth ends), and [`crate::sweep`] only ever removes names of its own range.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use ipnet::Ipv4Net;

use crate::{Error, Result};

/// Where namespaces are bind-mounted, shared with `ip netns`.
pub(crate) const NETNS_DIR: &str = "/run/netns";

/// Longest interface name the kernel takes (IFNAMSIZ - 1).
const IFNAME_MAX: usize = 15;

/// One service's outer range and the prefixes of its names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetRange {
    /// The outer range, carved into /30 blocks. Default `10.200.0.0/16`.
    pub cidr: Ipv4Net,
    /// Prefix of namespace names (`<name>-<i>`) and the host's nftables table (`<name>`).
    /// Default `clade`.
    pub name: String,
    /// Prefix of the host veth ends (`<link_prefix>h<i>`) and name of the namespace end
    /// (`<link_prefix>n`, inside the namespace). Default `cv`.
    pub link_prefix: String,
}

impl Default for NetRange {
    fn default() -> Self {
        NetRange {
            cidr: "10.200.0.0/16".parse().expect("a valid literal"),
            name: "clade".into(),
            link_prefix: "cv".into(),
        }
    }
}

impl NetRange {
    /// A range with its own prefixes; checks that every name it can make is valid.
    pub fn new(cidr: Ipv4Net, name: &str, link_prefix: &str) -> Result<Self> {
        let r = NetRange {
            cidr: cidr.trunc(),
            name: name.into(),
            link_prefix: link_prefix.into(),
        };
        r.validate()?;
        Ok(r)
    }

    /// Checks the prefixes (`[a-z0-9]`, short enough for the largest index) and the range
    /// (at least one /30).
    pub fn validate(&self) -> Result<()> {
        let ok = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        };
        if !ok(&self.name) || self.name.len() > 32 {
            return Err(Error::Config(format!(
                "name {:?}: 1 to 32 characters of [a-z0-9]",
                self.name
            )));
        }
        if !ok(&self.link_prefix) {
            return Err(Error::Config(format!(
                "link prefix {:?}: characters of [a-z0-9]",
                self.link_prefix
            )));
        }
        if self.cidr.prefix_len() > 30 {
            return Err(Error::Config(format!(
                "range {} holds no /30 block",
                self.cidr
            )));
        }
        let longest = self.host_veth(self.capacity() - 1);
        if longest.len() > IFNAME_MAX {
            return Err(Error::Config(format!(
                "link prefix {:?}: interface name {longest:?} is longer than {IFNAME_MAX}",
                self.link_prefix
            )));
        }
        Ok(())
    }

    /// How many sandboxes the range holds (its /30 blocks).
    pub fn capacity(&self) -> u32 {
        let blocks = 1u64 << (30 - self.cidr.prefix_len());
        blocks.min(u32::MAX as u64) as u32
    }

    fn check_index(&self, i: u32) -> Result<()> {
        if i >= self.capacity() {
            return Err(Error::Config(format!(
                "net index {i} is outside range {} ({} blocks)",
                self.cidr,
                self.capacity()
            )));
        }
        Ok(())
    }

    fn block(&self, i: u32) -> u32 {
        u32::from(self.cidr.network()) + 4 * i
    }

    /// The host's address on sandbox `i`'s veth (`.1` of its block): the namespace's
    /// default gateway.
    pub fn host_ip(&self, i: u32) -> Ipv4Addr {
        Ipv4Addr::from(self.block(i) + 1)
    }

    /// Sandbox `i`'s outer address (`.2` of its block): where the host reaches the guest's
    /// ports, and the source of the guest's traffic as the host sees it.
    pub fn outer_ip(&self, i: u32) -> Ipv4Addr {
        Ipv4Addr::from(self.block(i) + 2)
    }

    /// Namespace name of sandbox `i`.
    pub fn netns_name(&self, i: u32) -> String {
        format!("{}-{i}", self.name)
    }

    /// Path of sandbox `i`'s namespace (a bind mount, like `ip netns add` makes).
    pub fn netns_path(&self, i: u32) -> PathBuf {
        PathBuf::from(NETNS_DIR).join(self.netns_name(i))
    }

    /// Host veth end of sandbox `i`.
    pub fn host_veth(&self, i: u32) -> String {
        format!("{}h{i}", self.link_prefix)
    }

    /// The namespace's veth end (the same name in every namespace).
    pub fn ns_veth(&self) -> String {
        format!("{}n", self.link_prefix)
    }

    /// nftables table of the host-wide rules.
    pub fn host_table(&self) -> String {
        self.name.clone()
    }

    /// `i` if `name` is `<name>-<i>`.
    pub(crate) fn parse_netns_name(&self, name: &str) -> Option<u32> {
        parse_index(name.strip_prefix(&self.name)?.strip_prefix('-')?)
    }

    /// `i` if `name` is `<link_prefix>h<i>`.
    pub(crate) fn parse_host_veth(&self, name: &str) -> Option<u32> {
        parse_index(name.strip_prefix(&self.link_prefix)?.strip_prefix('h')?)
    }

    pub(crate) fn checked(&self, i: u32) -> Result<()> {
        self.validate()?;
        self.check_index(i)
    }
}

/// A canonical decimal index (no sign, no leading zero), so exactly one name maps to it.
fn parse_index(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_blocks_and_names() {
        let r = NetRange::default();
        r.validate().unwrap();
        assert_eq!(r.capacity(), 16384);
        assert_eq!(r.host_ip(0), Ipv4Addr::new(10, 200, 0, 1));
        assert_eq!(r.outer_ip(0), Ipv4Addr::new(10, 200, 0, 2));
        assert_eq!(r.outer_ip(1), Ipv4Addr::new(10, 200, 0, 6));
        assert_eq!(r.outer_ip(64), Ipv4Addr::new(10, 200, 1, 2));
        assert_eq!(r.outer_ip(16383), Ipv4Addr::new(10, 200, 255, 254));
        assert_eq!(r.netns_name(7), "clade-7");
        assert_eq!(r.netns_path(7), PathBuf::from("/run/netns/clade-7"));
        assert_eq!(r.host_veth(7), "cvh7");
        assert_eq!(r.ns_veth(), "cvn");
        assert!(r.checked(16384).is_err());
        assert!(r.checked(16383).is_ok());
    }

    #[test]
    fn names_parse_back_exactly() {
        let r = NetRange::new("10.251.0.0/16".parse().unwrap(), "t1", "t1").unwrap();
        assert_eq!(r.parse_netns_name("t1-12"), Some(12));
        assert_eq!(r.parse_netns_name("t1-012"), None);
        assert_eq!(r.parse_netns_name("t12-1"), None);
        assert_eq!(r.parse_netns_name("t1-"), None);
        assert_eq!(r.parse_netns_name("t1-+1"), None);
        assert_eq!(r.parse_host_veth("t1h0"), Some(0));
        assert_eq!(r.parse_host_veth("t12h0"), None);
        assert_eq!(r.parse_host_veth("t1h1x"), None);
    }

    #[test]
    fn rejects_bad_config() {
        let net: Ipv4Net = "10.0.0.0/31".parse().unwrap();
        assert!(NetRange::new(net, "a", "b").is_err());
        let net: Ipv4Net = "10.0.0.0/8".parse().unwrap();
        assert!(NetRange::new(net, "Bad", "b").is_err());
        assert!(NetRange::new(net, "a", "b-c").is_err());
        // 2^22 blocks: "abcdefghijh4194303" is too long for an interface name.
        assert!(NetRange::new(net, "a", "abcdefghij").is_err());
        assert!(NetRange::new(net, "a", "cv").is_ok());
    }
}

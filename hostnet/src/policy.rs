//! A sandbox's egress policy: which destinations the guest may send to.
//!
//! Semantics, after E2B's (its "internet access" docs and `PUT /sandboxes/{id}/network`):
//!
//! * By default a sandbox reaches every destination (`default: Allow`).
//! * `allow_internet_access = false` is E2B's shorthand for `deny_out = ["0.0.0.0/0"]`:
//!   here `default: Deny` (`from_e2b` maps it so).
//! * `deny_out`: destinations (CIDRs or bare addresses) the guest may not reach.
//! * `allow_out`: destinations the guest may reach even when they are denied: "allowed
//!   entries always take precedence over denied entries". An allow list on its own (nothing
//!   denied) changes nothing. So the rule for a packet from the guest to D is:
//!   D in allow -> pass; else D in deny -> drop; else the default.
//! * Only IPv4 (the sandbox has no IPv6). Domain names in `allow_out` (E2B filters those
//!   by the TLS SNI / HTTP Host of ports 443 / 80 in a proxy) are NOT supported here: they
//!   are refused with [`Error::InvalidCidr`] so a caller never silently drops a rule; a
//!   domain policy needs an egress proxy, which is a separate piece of work.
//!
//! The policy is enforced in the sandbox's namespace (forward chain `egress`, see
//! `nft.rs`), on every packet the guest sends out (so replacing the policy of a running
//! sandbox also cuts its connections to destinations no longer allowed), except its
//! replies on connections made to it through an exposed port. Replies toward the guest
//! (`ct state established,related`) always pass.

use std::borrow::Cow;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::Ipv4Net;
use nftables::expr::{Expression, NamedExpression, SetItem};
use nftables::schema::Nftables;

use crate::nft::{self, accept, daddr_in, drop, EGRESS_CHAIN, NS_TABLE};
use crate::{Error, Result};

/// Most entries accepted in one list (each becomes a set element; a request is untrusted).
pub const MAX_ENTRIES: usize = 4096;

/// What happens to traffic neither list names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Default {
    /// Passes (E2B's default: internet access on).
    #[default]
    Allow,
    /// Dropped (`allow_internet_access = false`).
    Deny,
}

/// A sandbox's egress policy (see the module docs for the exact semantics).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct EgressPolicy {
    /// Verdict for destinations neither list names.
    pub default: Default,
    /// Always reachable, whatever `deny` and `default` say.
    pub allow: Vec<Ipv4Net>,
    /// Not reachable unless in `allow`.
    pub deny: Vec<Ipv4Net>,
}

impl EgressPolicy {
    /// Everything reachable.
    pub fn allow_all() -> Self {
        EgressPolicy::default()
    }

    /// Nothing reachable.
    pub fn deny_all() -> Self {
        EgressPolicy {
            default: Default::Deny,
            ..EgressPolicy::default()
        }
    }

    /// From E2B's create/update parameters: `allow_internet_access` (default true),
    /// `network.allow_out` and `network.deny_out` (CIDRs or bare IPv4 addresses).
    pub fn from_e2b<S: AsRef<str>>(
        allow_internet_access: bool,
        allow_out: &[S],
        deny_out: &[S],
    ) -> Result<Self> {
        Ok(EgressPolicy {
            default: if allow_internet_access {
                Default::Allow
            } else {
                Default::Deny
            },
            allow: parse_list(allow_out)?,
            deny: parse_list(deny_out)?,
        })
    }

    /// Whether a packet to `dst` passes (the compiled rules' meaning, for callers and tests).
    pub fn permits(&self, dst: Ipv4Addr) -> bool {
        if self.allow.iter().any(|n| n.contains(&dst)) {
            return true;
        }
        if self.deny.iter().any(|n| n.contains(&dst)) {
            return false;
        }
        self.default == Default::Allow
    }

    /// The nftables transaction that makes this the policy of a sandbox: flush its `egress`
    /// chain, then its rules (a pure function; applied inside the namespace by
    /// [`crate::SandboxNet::set_policy`]).
    pub fn compile(&self) -> Result<Nftables<'static>> {
        let mut objects = vec![nft::flush_chain(NS_TABLE, EGRESS_CHAIN)];
        objects.extend(self.rules()?);
        Ok(Nftables {
            objects: Cow::Owned(objects),
        })
    }

    /// The `egress` chain's rules: `daddr in allow -> accept`, `daddr in deny -> drop`,
    /// then the default verdict. Lists are merged into the fewest prefixes first (nftables
    /// refuses overlapping intervals in one set).
    pub(crate) fn rules(&self) -> Result<Vec<nftables::schema::NfObject<'static>>> {
        for (name, list) in [("allow", &self.allow), ("deny", &self.deny)] {
            if list.len() > MAX_ENTRIES {
                return Err(Error::Config(format!(
                    "{name} list has {} entries, at most {MAX_ENTRIES}",
                    list.len()
                )));
            }
        }
        let mut rules = Vec::new();
        let set = |list: &[Ipv4Net]| {
            let merged = Ipv4Net::aggregate(&list.iter().map(|n| n.trunc()).collect());
            Expression::Named(NamedExpression::Set(
                merged
                    .iter()
                    .map(|n| SetItem::Element(nft::net_expr(n)))
                    .collect(),
            ))
        };
        if !self.allow.is_empty() {
            rules.push(nft::rule(
                NS_TABLE,
                EGRESS_CHAIN,
                vec![daddr_in(set(&self.allow)), accept()],
            ));
        }
        if !self.deny.is_empty() {
            rules.push(nft::rule(
                NS_TABLE,
                EGRESS_CHAIN,
                vec![daddr_in(set(&self.deny)), drop()],
            ));
        }
        let last = match self.default {
            Default::Allow => accept(),
            Default::Deny => drop(),
        };
        rules.push(nft::rule(NS_TABLE, EGRESS_CHAIN, vec![last]));
        Ok(rules)
    }
}

fn parse_list<S: AsRef<str>>(items: &[S]) -> Result<Vec<Ipv4Net>> {
    if items.len() > MAX_ENTRIES {
        return Err(Error::Config(format!(
            "{} entries, at most {MAX_ENTRIES}",
            items.len()
        )));
    }
    items.iter().map(|s| parse_cidr(s.as_ref())).collect()
}

/// Parses `a.b.c.d/n` or a bare `a.b.c.d` (a /32). Host bits below the prefix are cleared
/// (`10.1.2.3/8` is `10.0.0.0/8`). IPv6 and domain names are refused with a reason.
pub fn parse_cidr(input: &str) -> Result<Ipv4Net> {
    let err = |reason: &str| Error::InvalidCidr {
        input: input.chars().take(100).collect(),
        reason: reason.into(),
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let ip: IpAddr = match addr.parse() {
        Ok(ip) => ip,
        Err(_) if len.is_none() && looks_like_domain(addr) => {
            return Err(err(
                "domain names are not supported (only IPv4 addresses and CIDRs)",
            ))
        }
        Err(_) => return Err(err("not an IPv4 address")),
    };
    let IpAddr::V4(ip) = ip else {
        return Err(err("IPv6 is not supported (sandboxes have IPv4 only)"));
    };
    let len = match len {
        None => 32,
        Some(l) if !l.is_empty() && l.len() <= 2 && l.bytes().all(|b| b.is_ascii_digit()) => {
            l.parse::<u8>().map_err(|_| err("bad prefix length"))?
        }
        Some(_) => return Err(err("prefix length must be a number from 0 to 32")),
    };
    let net = Ipv4Net::new(ip, len).map_err(|_| err("prefix length must be from 0 to 32"))?;
    Ok(net.trunc())
}

fn looks_like_domain(s: &str) -> bool {
    s.contains('.')
        && s.bytes().any(|b| b.is_ascii_alphabetic())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn parses_cidrs_and_addresses() {
        assert_eq!(parse_cidr("1.1.1.1").unwrap(), net("1.1.1.1/32"));
        assert_eq!(parse_cidr(" 8.8.8.0/24 ").unwrap(), net("8.8.8.0/24"));
        assert_eq!(parse_cidr("0.0.0.0/0").unwrap(), net("0.0.0.0/0"));
        assert_eq!(parse_cidr("10.1.2.3/8").unwrap(), net("10.0.0.0/8"));
    }

    #[test]
    fn refuses_bad_input_with_a_reason() {
        let reason = |s: &str| match parse_cidr(s) {
            Err(Error::InvalidCidr { reason, .. }) => reason,
            other => panic!("{s:?}: {other:?}"),
        };
        assert!(reason("").contains("empty"));
        assert!(reason("example.com").contains("domain"));
        assert!(reason("*.example.com").contains("domain"));
        assert!(reason("::1").contains("IPv6"));
        assert!(reason("2001:db8::/32").contains("IPv6"));
        assert!(reason("1.2.3.4/33").contains("0 to 32"));
        assert!(reason("1.2.3.4/").contains("number"));
        assert!(reason("1.2.3.4/-1").contains("number"));
        assert!(reason("1.2.3.4/+8").contains("number"));
        assert!(reason("1.2.3.4/008").contains("number"));
        assert!(reason("1.2.3").contains("IPv4"));
        assert!(reason("256.1.1.1").contains("IPv4"));
        assert!(reason("1.2.3.4/8/8").contains("number"));
    }

    /// Cheap property check: no input panics, every accepted input is a canonical network
    /// that round-trips through its own text.
    #[test]
    fn parser_never_panics_and_round_trips() {
        let alphabet: &[u8] = b"0123456789./:abx* -";
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = (seed % 20) as usize;
            let s: String = (0..len)
                .map(|k| alphabet[((seed >> (k * 3)) as usize + k) % alphabet.len()] as char)
                .collect();
            if let Ok(n) = parse_cidr(&s) {
                assert_eq!(n, n.trunc(), "{s:?}");
                assert_eq!(parse_cidr(&n.to_string()).unwrap(), n, "{s:?}");
            }
        }
        let long = "1".repeat(100_000);
        assert!(parse_cidr(&long).is_err());
    }

    #[test]
    fn e2b_semantics() {
        let p = EgressPolicy::from_e2b::<&str>(true, &[], &[]).unwrap();
        assert!(p.permits("1.2.3.4".parse().unwrap()));
        let p = EgressPolicy::from_e2b::<&str>(false, &[], &[]).unwrap();
        assert!(!p.permits("1.2.3.4".parse().unwrap()));
        // Deny all but an allow list: allow wins.
        let p = EgressPolicy::from_e2b(true, &["1.1.1.1", "8.8.8.0/24"], &["0.0.0.0/0"]).unwrap();
        assert!(p.permits("8.8.8.8".parse().unwrap()));
        assert!(p.permits("1.1.1.1".parse().unwrap()));
        assert!(!p.permits("1.1.1.2".parse().unwrap()));
        // A deny list on its own.
        let p = EgressPolicy::from_e2b(true, &[], &["8.8.8.8"]).unwrap();
        assert!(!p.permits("8.8.8.8".parse().unwrap()));
        assert!(p.permits("8.8.4.4".parse().unwrap()));
        // A domain is refused, not ignored.
        assert!(EgressPolicy::from_e2b(true, &["example.com"], &[]).is_err());
    }

    #[test]
    fn compiles_to_a_flush_then_ordered_rules() {
        let p = EgressPolicy {
            default: Default::Deny,
            allow: vec![net("10.0.0.0/8"), net("10.1.0.0/16"), net("192.0.2.7/32")],
            deny: vec![net("192.0.2.0/24")],
        };
        let json = serde_json::to_value(p.compile().unwrap()).unwrap();
        let o = json["nftables"].as_array().unwrap();
        assert_eq!(o.len(), 4, "{json}");
        assert_eq!(o[0]["flush"]["chain"]["name"], "egress");
        assert_eq!(o[0]["flush"]["chain"]["table"], "sandbox");
        // Allow first, merged (10.1/16 is inside 10/8), as a set of prefixes and addresses.
        let allow = &o[1]["add"]["rule"]["expr"];
        assert_eq!(allow[0]["match"]["left"]["payload"]["field"], "daddr");
        let set = allow[0]["match"]["right"]["set"].as_array().unwrap();
        assert_eq!(set.len(), 2, "{json}");
        assert_eq!(set[0]["prefix"]["addr"], "10.0.0.0");
        assert_eq!(set[0]["prefix"]["len"], 8);
        assert_eq!(set[1], "192.0.2.7");
        assert!(allow[1].get("accept").is_some(), "{json}");
        let deny = &o[2]["add"]["rule"]["expr"];
        assert_eq!(
            deny[0]["match"]["right"]["set"][0]["prefix"]["addr"],
            "192.0.2.0"
        );
        assert!(deny[1].get("drop").is_some(), "{json}");
        // The default verdict last.
        let last = &o[3]["add"]["rule"]["expr"];
        assert_eq!(last.as_array().unwrap().len(), 1);
        assert!(last[0].get("drop").is_some(), "{json}");

        let json = serde_json::to_value(EgressPolicy::allow_all().compile().unwrap()).unwrap();
        let o = json["nftables"].as_array().unwrap();
        assert_eq!(o.len(), 2, "{json}");
        assert!(
            o[1]["add"]["rule"]["expr"][0].get("accept").is_some(),
            "{json}"
        );
    }

    #[test]
    fn refuses_oversized_lists() {
        let many: Vec<String> = (0..=MAX_ENTRIES)
            .map(|k| format!("10.0.{}.{}", k / 256, k % 256))
            .collect();
        assert!(EgressPolicy::from_e2b(true, &many, &[]).is_err());
        let p = EgressPolicy {
            deny: vec![net("10.0.0.1/32"); MAX_ENTRIES + 1],
            ..EgressPolicy::default()
        };
        assert!(p.compile().is_err());
    }
}

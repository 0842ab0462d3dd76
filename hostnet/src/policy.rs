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
//! * Only IPv4 (the sandbox has no IPv6).
//! * Domain names in `allow_out` (`example.com`, or `*.example.com` for every name under
//!   it; `allow_domains`): E2B filters those by TLS SNI / HTTP Host in a proxy; here the
//!   sandbox's DNS forwarder (the guest's only resolver, see the service's `net/dns.rs`)
//!   learns them: when an allowed name resolves, its IPv4 addresses join the namespace's
//!   set `dns_allowed` (with a timeout of at least [`MIN_LEARNED_SECS`], renewed by each
//!   lookup) and pass like `allow` entries. So a domain entry allows what the name
//!   resolves to *through that forwarder*: an address the guest hard-codes passes only if
//!   some allowed name resolved to it. Domain names in `deny_out` are refused (a name
//!   cannot be denied by address: any other name may resolve to the same one).
//! * DNS follows the policy: with `default: Deny`, the forwarder answers REFUSED to names
//!   not in `allow_domains` (instead of resolving them: a lookup would leak the name to
//!   the upstream resolver and tell the guest addresses it cannot reach anyway).
//! * Replacing the policy empties the learned set (names resolve again under the new one).
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

/// The namespace's set of addresses learned from allowed domains' DNS answers.
pub(crate) const DNS_ALLOWED_SET: &str = "dns_allowed";

/// Shortest time a learned address stays allowed (a DNS TTL is often seconds; a connection
/// made to the address lasts longer, and every packet it sends is checked).
pub const MIN_LEARNED_SECS: u32 = 3600;

/// Longest time a learned address stays allowed without a new lookup.
pub const MAX_LEARNED_SECS: u32 = 86_400;

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
    /// Names whose resolved addresses are reachable like `allow` entries: lower case, no
    /// trailing dot; `*.example.com` matches every name under `example.com` (not the name
    /// itself). See the module docs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_domains: Vec<String>,
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
    /// `network.allow_out` (CIDRs, bare IPv4 addresses or domain names) and
    /// `network.deny_out` (CIDRs or bare IPv4 addresses).
    pub fn from_e2b<S: AsRef<str>>(
        allow_internet_access: bool,
        allow_out: &[S],
        deny_out: &[S],
    ) -> Result<Self> {
        let (domains, addresses): (Vec<&str>, Vec<&str>) = allow_out
            .iter()
            .map(|s| s.as_ref())
            .partition(|s| looks_like_domain(s.trim()));
        Ok(EgressPolicy {
            default: if allow_internet_access {
                Default::Allow
            } else {
                Default::Deny
            },
            allow: parse_list(&addresses)?,
            deny: parse_list(deny_out)?,
            allow_domains: parse_domains(&domains)?,
        })
    }

    /// Whether `name`'s addresses are learned (it matches an `allow_domains` entry).
    pub fn allows_domain(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        self.allow_domains
            .iter()
            .any(|d| match d.strip_prefix("*.") {
                Some(parent) => name
                    .strip_suffix(parent)
                    .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
                None => *d == name,
            })
    }

    /// Whether the sandbox's DNS forwarder resolves `name` at all (see the module docs).
    pub fn resolves(&self, name: &str) -> bool {
        self.default == Default::Allow || self.allows_domain(name)
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
        for (name, len) in [
            ("allow", self.allow.len()),
            ("deny", self.deny.len()),
            ("allowed domain", self.allow_domains.len()),
        ] {
            if len > MAX_ENTRIES {
                return Err(Error::Config(format!(
                    "{name} list has {len} entries, at most {MAX_ENTRIES}"
                )));
            }
        }
        // The learned addresses' set, there (and empty) whatever the policy.
        let mut rules = nft::timeout_set(NS_TABLE, DNS_ALLOWED_SET);
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
        if !self.allow_domains.is_empty() {
            rules.push(nft::rule(
                NS_TABLE,
                EGRESS_CHAIN,
                vec![
                    daddr_in(Expression::String(format!("@{DNS_ALLOWED_SET}").into())),
                    accept(),
                ],
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

/// The nftables transaction that lets the guest reach `learned` (addresses an allowed name
/// resolved to, each with its DNS TTL in seconds): each joins the `dns_allowed` set for
/// its TTL, clamped to [`MIN_LEARNED_SECS`]..=[`MAX_LEARNED_SECS`].
pub fn learned_addresses(learned: &[(Ipv4Addr, u32)]) -> Nftables<'static> {
    let elems = learned
        .iter()
        .map(|(ip, ttl)| (*ip, (*ttl).clamp(MIN_LEARNED_SECS, MAX_LEARNED_SECS)))
        .collect::<Vec<_>>();
    Nftables {
        objects: Cow::Owned(vec![nft::add_timed_elements(
            NS_TABLE,
            DNS_ALLOWED_SET,
            &elems,
        )]),
    }
}

/// Most characters in a domain name (RFC 1035).
const MAX_DOMAIN: usize = 253;

fn parse_domains(items: &[&str]) -> Result<Vec<String>> {
    if items.len() > MAX_ENTRIES {
        return Err(Error::Config(format!(
            "{} domain names, at most {MAX_ENTRIES}",
            items.len()
        )));
    }
    items.iter().map(|s| parse_domain(s)).collect()
}

/// A domain entry, normalised: `example.com`, `Example.COM.` or `*.example.com`. Labels of
/// letters, digits and `-` (1 to 63 characters, not starting or ending with `-`); a `*`
/// only as the whole first label.
pub fn parse_domain(input: &str) -> Result<String> {
    let err = |reason: &str| Error::InvalidDomain {
        input: input.chars().take(100).collect(),
        reason: reason.into(),
    };
    let s = input.trim().trim_end_matches('.').to_ascii_lowercase();
    if s.is_empty() || s.len() > MAX_DOMAIN {
        return Err(err("a domain name has 1 to 253 characters"));
    }
    let body = s.strip_prefix("*.").unwrap_or(&s);
    let labels: Vec<&str> = body.split('.').collect();
    if labels.len() < 2 {
        return Err(err("a name with at least two labels (example.com)"));
    }
    for l in &labels {
        if l.is_empty() || l.len() > 63 {
            return Err(err("each label has 1 to 63 characters"));
        }
        if !l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(err(
                "letters, digits and '-' only ('*' only as '*.' in front)",
            ));
        }
        if l.starts_with('-') || l.ends_with('-') {
            return Err(err("a label does not start or end with '-'"));
        }
    }
    Ok(s)
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
                "a domain name, where only IPv4 addresses and CIDRs are taken (domain names \
                 go in allow_out)",
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
        // A domain in allow_out is learned through DNS; in deny_out it is refused.
        let p =
            EgressPolicy::from_e2b(false, &["Example.COM.", "*.pkg.dev", "1.2.3.4"], &[]).unwrap();
        assert_eq!(p.allow_domains, ["example.com", "*.pkg.dev"]);
        assert_eq!(p.allow, [net("1.2.3.4/32")]);
        assert!(EgressPolicy::from_e2b(true, &[] as &[&str], &["example.com"]).is_err());
        assert!(EgressPolicy::from_e2b(true, &["exa_mple.com"], &[]).is_err());
    }

    #[test]
    fn domains_match_exactly_or_below_a_wildcard_and_dns_follows_the_default() {
        let p = EgressPolicy::from_e2b(false, &["example.com", "*.pkg.dev"], &[]).unwrap();
        assert!(p.allows_domain("example.com"));
        assert!(p.allows_domain("EXAMPLE.com."));
        assert!(!p.allows_domain("www.example.com"));
        assert!(!p.allows_domain("badexample.com"));
        assert!(p.allows_domain("a.pkg.dev"));
        assert!(p.allows_domain("a.b.pkg.dev"));
        assert!(!p.allows_domain("pkg.dev"));
        assert!(!p.allows_domain("xpkg.dev"));
        assert!(!p.allows_domain(".pkg.dev"));
        // Deny by default: only allowed names resolve; allow by default: every name.
        assert!(p.resolves("a.pkg.dev"));
        assert!(!p.resolves("other.org"));
        assert!(EgressPolicy::allow_all().resolves("other.org"));
        for bad in [
            "",
            "com",
            "a..b",
            "-a.com",
            "a-.com",
            "*.com",
            "a.*.com",
            "*",
            &"a".repeat(64),
        ] {
            let input = if bad.len() == 64 {
                format!("{bad}.com")
            } else {
                bad.to_string()
            };
            assert!(parse_domain(&input).is_err(), "{input:?}");
        }
        assert!(parse_domain(&format!("{}.com", "a.".repeat(130))).is_err());
    }

    #[test]
    fn learned_addresses_join_the_set_for_at_least_the_minimum() {
        let doc = learned_addresses(&[
            ("192.0.2.1".parse().unwrap(), 5),
            ("192.0.2.2".parse().unwrap(), 999_999),
        ]);
        let json = serde_json::to_value(doc).unwrap();
        let e = &json["nftables"][0]["add"]["element"];
        assert_eq!(e["name"], DNS_ALLOWED_SET);
        assert_eq!(e["elem"][0]["elem"]["val"], "192.0.2.1");
        assert_eq!(e["elem"][0]["elem"]["timeout"], MIN_LEARNED_SECS);
        assert_eq!(e["elem"][1]["elem"]["timeout"], MAX_LEARNED_SECS);
    }

    #[test]
    fn compiles_to_a_flush_then_ordered_rules() {
        let p = EgressPolicy {
            default: Default::Deny,
            allow: vec![net("10.0.0.0/8"), net("10.1.0.0/16"), net("192.0.2.7/32")],
            deny: vec![net("192.0.2.0/24")],
            allow_domains: vec!["example.com".into()],
        };
        let json = serde_json::to_value(p.compile().unwrap()).unwrap();
        let o = json["nftables"].as_array().unwrap().clone();
        assert_eq!(o.len(), 7, "{json}");
        assert_eq!(o[0]["flush"]["chain"]["name"], "egress");
        assert_eq!(o[0]["flush"]["chain"]["table"], "sandbox");
        // The learned set: made if missing, emptied (a new policy learns anew).
        assert_eq!(o[1]["add"]["set"]["name"], DNS_ALLOWED_SET);
        assert_eq!(o[2]["flush"]["set"]["name"], DNS_ALLOWED_SET);
        // Learned addresses pass after the allow list, before the deny list.
        assert_eq!(
            o[4]["add"]["rule"]["expr"][0]["match"]["right"],
            "@dns_allowed"
        );
        let o: Vec<_> = o
            .iter()
            .enumerate()
            .filter(|(i, _)| ![1, 2, 4].contains(i))
            .map(|(_, v)| v.clone())
            .collect();
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
        assert_eq!(o.len(), 4, "{json}");
        assert!(
            o[3]["add"]["rule"]["expr"][0].get("accept").is_some(),
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

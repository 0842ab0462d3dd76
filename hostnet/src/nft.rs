//! nftables rules: the sandbox namespace's table, the host's table, and applying them.
//!
//! Rules are built as the `nftables` crate's JSON schema types and applied in one `nft -j -f -`
//! transaction each (atomic: all or nothing). When the rules belong in a sandbox's namespace,
//! `nft` itself is started in it (`setns` between fork and exec), since nftables state is per
//! network namespace.
//!
//! The sandbox's table (`ip sandbox`, in its namespace):
//!
//! ```text
//! prerouting  (nat, dstnat):  iifname NS_VETH ip daddr OUTER meta l4proto tcp dnat to GUEST
//! postrouting (nat, srcnat):  oifname NS_VETH ip saddr GUEST snat to OUTER
//! forward (filter, policy drop):
//!     ct status dnat accept                          exposed ports, both directions
//!     iifname tap0 oifname NS_VETH jump egress       everything the guest sends out
//!     oifname tap0 ct state established,related accept    replies toward the guest
//! egress: the compiled EgressPolicy (always ends in a verdict)
//! ```
//!
//! The egress chain sees every packet the guest sends out, not only the first one of a
//! connection: a policy replaced on a running sandbox also cuts the connections it no longer
//! allows. Replies of the guest to connections made TO it through an exposed port match
//! `ct status dnat` first, so a deny-all policy never breaks exposed ports.
//!
//! The host's table (`ip <name>`): masquerade of the range leaving it toward other
//! networks, no packet from a sandbox veth to the host itself (except replies to
//! connections the host opened: `ct state established,related`), and none from one sandbox
//! to another. Nothing in it is per sandbox (interface names are matched by wildcard), so a
//! sandbox's rules all die with its namespace.

use std::borrow::Cow;
use std::fs::File;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use ipnet::Ipv4Net;
use nftables::expr::{
    Elem, Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix, CT,
};
use nftables::schema::{
    Chain, Element, FlushObject, NfCmd, NfListObject, NfObject, Nftables, Rule, Set, SetFlag,
    SetType, SetTypeValue, Table,
};
use nftables::stmt::{JumpTarget, Match, Operator, Statement, NAT};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};

use crate::{io_err, Error, Result};

/// Table of a sandbox's own rules, inside its namespace.
pub(crate) const NS_TABLE: &str = "sandbox";
/// Chain holding the compiled egress policy.
pub(crate) const EGRESS_CHAIN: &str = "egress";

const FAMILY: NfFamily = NfFamily::IP;

// ---- expression and statement helpers ----

fn s(v: impl Into<String>) -> Expression<'static> {
    Expression::String(Cow::Owned(v.into()))
}

fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

fn ip_field(field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: "ip".into(),
            field: field.into(),
        },
    )))
}

fn ct(key: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::CT(CT {
        key: key.into(),
        family: None,
        dir: None,
    }))
}

/// An address or prefix as an nftables expression (a /32 is the bare address).
pub(crate) fn net_expr(net: &Ipv4Net) -> Expression<'static> {
    if net.prefix_len() == 32 {
        s(net.addr().to_string())
    } else {
        Expression::Named(NamedExpression::Prefix(Prefix {
            addr: Box::new(s(net.network().to_string())),
            len: net.prefix_len() as u32,
        }))
    }
}

fn matches(
    left: Expression<'static>,
    op: Operator,
    right: Expression<'static>,
) -> Statement<'static> {
    Statement::Match(Match { left, right, op })
}

fn eq(left: Expression<'static>, right: Expression<'static>) -> Statement<'static> {
    matches(left, Operator::EQ, right)
}

pub(crate) fn iifname(name: &str) -> Statement<'static> {
    eq(meta(MetaKey::Iifname), s(name))
}

pub(crate) fn oifname(name: &str) -> Statement<'static> {
    eq(meta(MetaKey::Oifname), s(name))
}

pub(crate) fn daddr_in(set: Expression<'static>) -> Statement<'static> {
    eq(ip_field("daddr"), set)
}

fn ct_established() -> Statement<'static> {
    matches(
        ct("state"),
        Operator::IN,
        Expression::List(vec![s("established"), s("related")]),
    )
}

pub(crate) fn accept() -> Statement<'static> {
    Statement::Accept(None)
}

pub(crate) fn drop() -> Statement<'static> {
    Statement::Drop(None)
}

fn nat_to(addr: Ipv4Addr) -> Option<NAT<'static>> {
    Some(NAT {
        addr: Some(s(addr.to_string())),
        family: None,
        port: None,
        flags: None,
    })
}

// ---- objects ----

fn add(o: NfListObject<'static>) -> NfObject<'static> {
    NfObject::CmdObject(NfCmd::Add(o))
}

fn table(name: &str) -> Table<'static> {
    Table {
        family: FAMILY,
        name: Cow::Owned(name.into()),
        handle: None,
    }
}

fn base_chain(
    table: &str,
    name: &'static str,
    kind: NfChainType,
    hook: NfHook,
    prio: i32,
    policy: NfChainPolicy,
) -> NfObject<'static> {
    add(NfListObject::Chain(Chain {
        family: FAMILY,
        table: Cow::Owned(table.into()),
        name: name.into(),
        _type: Some(kind),
        hook: Some(hook),
        prio: Some(prio),
        policy: Some(policy),
        ..Chain::default()
    }))
}

fn chain(table: &str, name: &'static str) -> NfObject<'static> {
    add(NfListObject::Chain(Chain {
        family: FAMILY,
        table: Cow::Owned(table.into()),
        name: name.into(),
        ..Chain::default()
    }))
}

pub(crate) fn rule(
    table: &str,
    chain: &'static str,
    expr: Vec<Statement<'static>>,
) -> NfObject<'static> {
    add(NfListObject::Rule(Rule {
        family: FAMILY,
        table: Cow::Owned(table.into()),
        chain: chain.into(),
        expr: Cow::Owned(expr),
        handle: None,
        index: None,
        comment: None,
    }))
}

pub(crate) fn flush_chain(table: &str, name: &'static str) -> NfObject<'static> {
    NfObject::CmdObject(NfCmd::Flush(FlushObject::Chain(Chain {
        family: FAMILY,
        table: Cow::Owned(table.into()),
        name: name.into(),
        ..Chain::default()
    })))
}

fn ipv4_set(table: &str, name: &'static str) -> Set<'static> {
    Set {
        family: FAMILY,
        table: Cow::Owned(table.into()),
        name: name.into(),
        set_type: SetTypeValue::Single(SetType::Ipv4Addr),
        flags: Some([SetFlag::Timeout].into_iter().collect()),
        ..Set::default()
    }
}

/// `add set` (a set of IPv4 addresses whose elements time out; kept if it exists) then
/// `flush set`: the set is there, and empty.
pub(crate) fn timeout_set(table: &str, name: &'static str) -> Vec<NfObject<'static>> {
    vec![
        add(NfListObject::Set(Box::new(ipv4_set(table, name)))),
        NfObject::CmdObject(NfCmd::Flush(FlushObject::Set(Box::new(ipv4_set(
            table, name,
        ))))),
    ]
}

/// `add element`: each address into the set `name` with its timeout (seconds); an address
/// already there gets the new timeout.
pub(crate) fn add_timed_elements(
    table: &str,
    name: &'static str,
    elems: &[(Ipv4Addr, u32)],
) -> NfObject<'static> {
    add(NfListObject::Element(Element {
        family: FAMILY,
        table: Cow::Owned(table.into()),
        name: name.into(),
        elem: Cow::Owned(
            elems
                .iter()
                .map(|(ip, secs)| {
                    Expression::Named(NamedExpression::Elem(Elem {
                        val: Box::new(s(ip.to_string())),
                        timeout: Some(*secs),
                        ..Elem::default()
                    }))
                })
                .collect(),
        ),
    }))
}

/// `add table; delete table; add table`: a fresh table in one transaction, whether or not
/// it existed (so applying the same document twice gives the same result).
fn fresh_table(name: &str) -> Vec<NfObject<'static>> {
    vec![
        add(NfListObject::Table(table(name))),
        NfObject::CmdObject(NfCmd::Delete(NfListObject::Table(table(name)))),
        add(NfListObject::Table(table(name))),
    ]
}

/// The sandbox namespace's table, with `egress` holding `policy_rules` (see the module docs).
pub(crate) fn sandbox_table(
    ns_veth: &str,
    tap: &str,
    outer: Ipv4Addr,
    guest: Ipv4Addr,
    policy_rules: Vec<NfObject<'static>>,
) -> Nftables<'static> {
    let t = NS_TABLE;
    let mut o = fresh_table(t);
    o.push(base_chain(
        t,
        "prerouting",
        NfChainType::NAT,
        NfHook::Prerouting,
        -100,
        NfChainPolicy::Accept,
    ));
    o.push(base_chain(
        t,
        "postrouting",
        NfChainType::NAT,
        NfHook::Postrouting,
        100,
        NfChainPolicy::Accept,
    ));
    o.push(base_chain(
        t,
        "forward",
        NfChainType::Filter,
        NfHook::Forward,
        0,
        NfChainPolicy::Drop,
    ));
    o.push(chain(t, EGRESS_CHAIN));
    o.push(rule(
        t,
        "prerouting",
        vec![
            iifname(ns_veth),
            daddr_in(s(outer.to_string())),
            eq(meta(MetaKey::L4proto), s("tcp")),
            Statement::DNAT(nat_to(guest)),
        ],
    ));
    o.push(rule(
        t,
        "postrouting",
        vec![
            oifname(ns_veth),
            eq(ip_field("saddr"), s(guest.to_string())),
            Statement::SNAT(nat_to(outer)),
        ],
    ));
    o.push(rule(
        t,
        "forward",
        vec![matches(ct("status"), Operator::IN, s("dnat")), accept()],
    ));
    o.push(rule(
        t,
        "forward",
        vec![
            iifname(tap),
            oifname(ns_veth),
            Statement::Jump(JumpTarget {
                target: EGRESS_CHAIN.into(),
            }),
        ],
    ));
    o.push(rule(
        t,
        "forward",
        vec![oifname(tap), ct_established(), accept()],
    ));
    o.extend(policy_rules);
    Nftables {
        objects: Cow::Owned(o),
    }
}

/// The host's table `name` (see the module docs).
pub(crate) fn host_table(name: &str, range: &Ipv4Net, host_veth_glob: &str) -> Nftables<'static> {
    let mut o = fresh_table(name);
    o.push(base_chain(
        name,
        "postrouting",
        NfChainType::NAT,
        NfHook::Postrouting,
        100,
        NfChainPolicy::Accept,
    ));
    o.push(base_chain(
        name,
        "input",
        NfChainType::Filter,
        NfHook::Input,
        0,
        NfChainPolicy::Accept,
    ));
    o.push(base_chain(
        name,
        "forward",
        NfChainType::Filter,
        NfHook::Forward,
        0,
        NfChainPolicy::Accept,
    ));
    o.push(rule(
        name,
        "postrouting",
        vec![
            eq(ip_field("saddr"), net_expr(range)),
            matches(ip_field("daddr"), Operator::NEQ, net_expr(range)),
            Statement::Masquerade(None),
        ],
    ));
    o.push(rule(
        name,
        "input",
        vec![iifname(host_veth_glob), ct_established(), accept()],
    ));
    o.push(rule(name, "input", vec![iifname(host_veth_glob), drop()]));
    o.push(rule(
        name,
        "forward",
        vec![iifname(host_veth_glob), oifname(host_veth_glob), drop()],
    ));
    Nftables {
        objects: Cow::Owned(o),
    }
}

/// Deletes the host's table `name` (`Ok` if there was none).
pub(crate) fn delete_table_doc(name: &str) -> Nftables<'static> {
    Nftables {
        objects: Cow::Owned(vec![
            add(NfListObject::Table(table(name))),
            NfObject::CmdObject(NfCmd::Delete(NfListObject::Table(table(name)))),
        ]),
    }
}

/// The `nft` binary: /usr/sbin/nft where it is (root's PATH may lack /usr/sbin), else PATH.
fn nft_program() -> &'static str {
    if std::path::Path::new("/usr/sbin/nft").exists() {
        "/usr/sbin/nft"
    } else {
        "nft"
    }
}

/// Applies `doc` in one transaction, inside the namespace `netns` (the host's if `None`).
pub(crate) fn apply(netns: Option<&File>, doc: &Nftables) -> Result<()> {
    let json = serde_json::to_string(doc).map_err(|e| Error::Nft(format!("serialize: {e}")))?;
    tracing::trace!(%json, "nft -j -f -");
    let mut cmd = Command::new(nft_program());
    // Nothing of the service's environment (its secrets, see `vmm::host::clean_child`)
    // but where programs are found.
    cmd.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    cmd.args(["-j", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(ns) = netns {
        let fd = ns.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and only makes the
        // async-signal-safe setns system call on a descriptor that stays open (it belongs to
        // `ns`, borrowed across the spawn; O_CLOEXEC only closes it at exec).
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            Error::Nft("the nft program is not installed (apt-get install nftables)".into())
        }
        _ => io_err("run nft")(e),
    })?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let wrote = stdin.write_all(json.as_bytes());
    std::mem::drop(stdin);
    let out = child.wait_with_output().map_err(io_err("wait for nft"))?;
    wrote.map_err(io_err("write to nft"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(Error::Nft(format!(
            "{}: {}",
            out.status,
            err.trim().chars().take(2000).collect::<String>()
        )));
    }
    Ok(())
}

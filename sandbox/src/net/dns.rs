//! DNS for sandboxes: a forwarder on each sandbox network's gateway address (port 53 of
//! `hostnet::GUEST_GATEWAY`, which the guest agent writes into the guest's
//! `/etc/resolv.conf`), passing queries to the host's resolver and the answers back.
//!
//! Why a forwarder and not the host's resolver directly: the host's resolver is often on
//! a loopback address (systemd-resolved's 127.0.0.53), which a sandbox's namespace cannot
//! reach; and every sandbox has the same inner addressing, so the one address the guest
//! knows must be answered inside its own namespace. The socket is bound inside the
//! namespace (it keeps that namespace for life) and the query goes out from this process,
//! in the host's namespace, like any lookup of the host's own.
//!
//! The forwarder is also where a sandbox's egress policy meets names
//! (`hostnet::EgressPolicy`): a query is parsed (the `simple-dns` crate) for its name;
//! under a deny-by-default policy a name not in `allow_domains` gets REFUSED without
//! reaching the upstream resolver; the answer for an allowed name has its IPv4 addresses
//! added to the namespace's learned set (`hostnet::allow_learned`) *before* the guest sees
//! the answer, so its connection right after the lookup passes. Adding costs an `nft` run
//! (milliseconds), so an address learned less than [`RELEARN_AFTER`] ago is not added
//! again (its element keeps most of its timeout). A policy replaced while a query is out
//! is the one its answer is judged by: replacing the rules (which empties the learned
//! set) and learning are serialised, so nothing learned under the old policy survives.
//!
//! Written here (UDP relaying) rather than with a DNS server crate: messages are parsed
//! only for the question's name and the answer's A records. One query at a time per
//! sandbox, each answered or dropped within [`UPSTREAM_TIMEOUT`]; the guest retries as
//! resolvers do. TCP (answers over 512 bytes without EDNS) is not forwarded.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hostnet::EgressPolicy;
use simple_dns::rdata::RData;
use simple_dns::{Packet, CLASS, RCODE};

use crate::error::{Error, Result};

/// How long the host's resolver may take to answer one query.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest query or answer relayed (EDNS's common buffer size).
const MAX_MESSAGE: usize = 4096;
/// How often the relay thread looks at its stop flag.
const POLL: Duration = Duration::from_millis(200);
/// An address learned less than this long ago is not added to the set again (it is there
/// for at least `hostnet::MIN_LEARNED_SECS`).
pub const RELEARN_AFTER: Duration = Duration::from_secs(600);
/// Most addresses remembered as learned (then the memory starts over).
const MAX_REMEMBERED: usize = 4096;

/// The first `nameserver` of a resolv.conf text, on port 53.
pub fn upstream_from(resolv_conf: &str) -> Option<SocketAddr> {
    resolv_conf
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .next()
}

/// What the forwarder does with the addresses an allowed name resolved to (with their
/// TTLs): in service, [`hostnet::allow_learned`] in the sandbox's namespace.
type Learn = Box<dyn Fn(&[(Ipv4Addr, u32)]) -> std::result::Result<(), String> + Send>;

/// A running forwarder; stopped (and its socket closed) when dropped.
pub struct Forwarder {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    policy: Arc<RwLock<PolicyState>>,
}

/// The policy the forwarder applies, and how many times it was replaced.
struct PolicyState {
    generation: u64,
    policy: EgressPolicy,
}

impl Forwarder {
    /// Binds `listen` (UDP) inside the network namespace at `netns` and relays what
    /// arrives there to `upstream`, under `policy` (see the module docs).
    pub fn start(
        netns: &Path,
        listen: SocketAddr,
        upstream: SocketAddr,
        policy: &EgressPolicy,
    ) -> Result<Forwarder> {
        let socket = hostnet::in_netns(netns, move || UdpSocket::bind(listen))
            .map_err(|e| Error::Network(format!("DNS forwarder: {e}")))?
            .map_err(|e| Error::Network(format!("DNS forwarder: binding {listen}: {e}")))?;
        let netns = netns.to_path_buf();
        let learn: Learn = Box::new(move |learned| {
            hostnet::allow_learned(&netns, learned).map_err(|e| e.to_string())
        });
        Forwarder::serve(socket, upstream, policy, learn)
    }

    /// Relays what arrives on `socket`; `learn` takes allowed names' addresses.
    fn serve(
        socket: UdpSocket,
        upstream: SocketAddr,
        policy: &EgressPolicy,
        learn: Learn,
    ) -> Result<Forwarder> {
        socket
            .set_read_timeout(Some(POLL))
            .map_err(|e| Error::Network(format!("DNS forwarder: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let policy = Arc::new(RwLock::new(PolicyState {
            generation: 0,
            policy: policy.clone(),
        }));
        let relay_state = Relay {
            upstream,
            stop: stop.clone(),
            policy: policy.clone(),
            learn,
            remembered: HashMap::new(),
            remembered_generation: 0,
        };
        let thread = std::thread::Builder::new()
            .name("dns-forward".into())
            .spawn(move || relay_state.run(&socket))
            .map_err(|e| Error::Network(format!("DNS forwarder thread: {e}")))?;
        Ok(Forwarder {
            stop,
            thread: Some(thread),
            policy,
        })
    }

    /// Replaces the policy: `apply` puts its rules in place (emptying the learned set),
    /// with no learning meanwhile; names resolve under `policy` from then on. On an error
    /// from `apply` the old policy stays.
    pub fn set_policy(
        &self,
        policy: &EgressPolicy,
        apply: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut state = self.policy.write().unwrap_or_else(|p| p.into_inner());
        apply()?;
        state.policy = policy.clone();
        state.generation += 1;
        Ok(())
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The relay thread's state.
struct Relay {
    upstream: SocketAddr,
    stop: Arc<AtomicBool>,
    policy: Arc<RwLock<PolicyState>>,
    learn: Learn,
    /// Addresses added to the set, and when (under policy `remembered_generation`).
    remembered: HashMap<Ipv4Addr, Instant>,
    remembered_generation: u64,
}

/// What the policy says about one query.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Answered REFUSED here.
    Refuse,
    /// Relayed; `learn`: the answer's addresses join the learned set.
    Relay { learn: bool },
}

impl Relay {
    /// What `policy` says about `query`.
    fn verdict(policy: &EgressPolicy, query: &[u8]) -> Verdict {
        let name = Packet::parse(query)
            .ok()
            .and_then(|p| p.questions.first().map(|q| q.qname.to_string()));
        match name {
            Some(n) if policy.resolves(&n) => Verdict::Relay {
                learn: policy.allows_domain(&n),
            },
            Some(_) => Verdict::Refuse,
            // Not a query we can read: relayed only where every name would be.
            None if policy.default == hostnet::PolicyDefault::Allow => {
                Verdict::Relay { learn: false }
            }
            None => Verdict::Refuse,
        }
    }

    fn run(mut self, socket: &UdpSocket) {
        let mut buf = vec![0u8; MAX_MESSAGE];
        while !self.stop.load(Ordering::Relaxed) {
            let Some((n, from)) = receive(socket, &mut buf) else {
                continue;
            };
            if let Some(a) = self.answer(&buf[..n]) {
                let _ = socket.send_to(&a, from);
            }
        }
    }

    /// The answer to `query` under the policy in force when the answer is back (None: no
    /// answer, the guest retries).
    fn answer(&mut self, query: &[u8]) -> Option<Vec<u8>> {
        let (generation, verdict) = {
            let state = self.policy.read().unwrap_or_else(|p| p.into_inner());
            (state.generation, Relay::verdict(&state.policy, query))
        };
        if verdict == Verdict::Refuse {
            return refused(query);
        }
        let answer = match ask(query, self.upstream) {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!("DNS forwarder: {}: {e}", self.upstream);
                return None;
            }
        };
        let policy = Arc::clone(&self.policy);
        let state = policy.read().unwrap_or_else(|p| p.into_inner());
        let verdict = if state.generation == generation {
            verdict
        } else {
            Relay::verdict(&state.policy, query)
        };
        match verdict {
            Verdict::Refuse => refused(query),
            Verdict::Relay { learn: false } => Some(answer),
            Verdict::Relay { learn: true } => {
                // Under the read lock: a policy replaced meanwhile waits until this is in.
                self.learn_from(state.generation, &answer);
                Some(answer)
            }
        }
    }

    /// Adds the addresses in `answer` not added lately (under policy `generation`).
    fn learn_from(&mut self, generation: u64, answer: &[u8]) {
        if generation != self.remembered_generation || self.remembered.len() > MAX_REMEMBERED {
            self.remembered.clear();
            self.remembered_generation = generation;
        }
        let now = Instant::now();
        let fresh: Vec<(Ipv4Addr, u32)> = a_records(answer)
            .into_iter()
            .filter(|(ip, _)| {
                self.remembered
                    .get(ip)
                    .is_none_or(|t| now.duration_since(*t) >= RELEARN_AFTER)
            })
            .collect();
        if fresh.is_empty() {
            return;
        }
        match (self.learn)(&fresh) {
            Ok(()) => {
                for (ip, _) in &fresh {
                    self.remembered.insert(*ip, now);
                }
            }
            Err(e) => tracing::warn!("DNS forwarder: allowing {fresh:?}: {e}"),
        }
    }
}

/// The REFUSED answer to `query` (None when it does not parse: dropped).
fn refused(query: &[u8]) -> Option<Vec<u8>> {
    let mut reply = Packet::parse(query).ok()?.into_reply();
    *reply.rcode_mut() = RCODE::Refused;
    reply.answers.clear();
    reply.name_servers.clear();
    reply.additional_records.clear();
    reply.build_bytes_vec().ok()
}

/// The IPv4 addresses in an answer, with their TTLs.
fn a_records(answer: &[u8]) -> Vec<(Ipv4Addr, u32)> {
    let Ok(p) = Packet::parse(answer) else {
        return Vec::new();
    };
    p.answers
        .iter()
        .filter(|rr| rr.class == CLASS::IN)
        .filter_map(|rr| match &rr.rdata {
            RData::A(a) => Some((Ipv4Addr::from(a.address), rr.ttl)),
            _ => None,
        })
        .collect()
}

/// One datagram of at least a DNS header's 12 bytes (None: a timeout, an error, a runt).
fn receive(socket: &UdpSocket, buf: &mut [u8]) -> Option<(usize, SocketAddr)> {
    loop {
        return match socket.recv_from(buf) {
            // A DNS header is 12 bytes; anything shorter is not a query.
            Ok((n, from)) if n >= 12 => Some((n, from)),
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                None
            }
            Err(e) => {
                tracing::warn!("DNS forwarder: {e}");
                std::thread::sleep(POLL);
                None
            }
        };
    }
}

/// One query to the upstream resolver; its answer (the one with the query's id).
fn ask(query: &[u8], upstream: SocketAddr) -> std::io::Result<Vec<u8>> {
    let local: SocketAddr = match upstream {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("literal"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("literal"),
    };
    let s = UdpSocket::bind(local)?;
    s.connect(upstream)?;
    s.set_read_timeout(Some(UPSTREAM_TIMEOUT))?;
    s.send(query)?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let n = s.recv(&mut buf)?;
        if n >= 12 && buf[..2] == query[..2] {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_nameserver_is_the_upstream() {
        let conf = "# generated\nsearch example\nnameserver  10.0.0.53 \nnameserver 1.1.1.1\n";
        assert_eq!(upstream_from(conf), Some("10.0.0.53:53".parse().unwrap()));
        assert_eq!(
            upstream_from("nameserver ::1\n"),
            Some("[::1]:53".parse().unwrap())
        );
        assert_eq!(upstream_from("nameserver bogus\noptions edns0\n"), None);
        assert_eq!(upstream_from(""), None);
    }

    use simple_dns::rdata::A;
    use simple_dns::{Name, Question, ResourceRecord, CLASS, QCLASS, QTYPE, TYPE};
    use std::sync::mpsc;

    fn query(id: u16, name: &str) -> Vec<u8> {
        let mut q = Packet::new_query(id);
        q.questions.push(Question::new(
            Name::new_unchecked(name),
            QTYPE::TYPE(TYPE::A),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
        q.build_bytes_vec().unwrap()
    }

    /// An upstream that answers every query with `addr` (TTL 30) and reports each name.
    fn upstream(addr: Ipv4Addr) -> (SocketAddr, mpsc::Receiver<String>) {
        let up = UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = up.local_addr().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || loop {
            let mut b = [0u8; 512];
            let Ok((n, from)) = up.recv_from(&mut b) else {
                return;
            };
            let q = Packet::parse(&b[..n]).unwrap();
            let name = q.questions[0].qname.to_string();
            let mut a = q.clone().into_reply();
            a.answers.push(ResourceRecord::new(
                Name::new_unchecked(&name),
                CLASS::IN,
                30,
                RData::A(A {
                    address: addr.into(),
                }),
            ));
            up.send_to(&a.build_bytes_vec().unwrap(), from).unwrap();
            let _ = tx.send(name);
        });
        (at, rx)
    }

    /// Asks `forwarder` at `at` for `name`; the answer's RCODE and addresses.
    fn resolve(at: SocketAddr, id: u16, name: &str) -> (RCODE, Vec<(Ipv4Addr, u32)>) {
        let c = UdpSocket::bind("127.0.0.1:0").unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.send_to(&query(id, name), at).unwrap();
        let mut b = [0u8; 512];
        let n = c.recv(&mut b).unwrap();
        let p = Packet::parse(&b[..n]).unwrap();
        assert_eq!(p.id(), id);
        (p.rcode(), a_records(&b[..n]))
    }

    #[test]
    fn names_resolve_as_the_policy_says_and_allowed_ones_are_learned_first() {
        let addr: Ipv4Addr = "192.0.2.9".parse().unwrap();
        let (up, asked) = upstream(addr);
        let (learned_tx, learned) = mpsc::channel();
        let learn: Learn = Box::new(move |l| {
            learned_tx.send(l.to_vec()).unwrap();
            Ok(())
        });
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = socket.local_addr().unwrap();
        let deny = EgressPolicy::from_e2b(false, &["allowed.test", "*.pkg.test"], &[]).unwrap();
        let f = Forwarder::serve(socket, up, &deny, learn).unwrap();

        // Not allowed: REFUSED here, the upstream never asked.
        assert_eq!(resolve(at, 1, "other.test"), (RCODE::Refused, vec![]));
        assert!(asked.try_recv().is_err());
        // Allowed: relayed, and learned before the answer reached the guest.
        assert_eq!(
            resolve(at, 2, "allowed.test"),
            (RCODE::NoError, vec![(addr, 30)])
        );
        assert_eq!(learned.try_recv().unwrap(), vec![(addr, 30)]);
        assert_eq!(asked.recv().unwrap(), "allowed.test");
        // Another allowed name, the same address, learned lately: not added again.
        assert_eq!(resolve(at, 3, "a.pkg.test").1, vec![(addr, 30)]);
        assert!(learned.try_recv().is_err());
        // Garbage under deny: no answer at all.
        let c = UdpSocket::bind("127.0.0.1:0").unwrap();
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        c.send_to(&[0xffu8; 20], at).unwrap();
        assert!(c.recv(&mut [0u8; 64]).is_err());

        // A policy whose rules fail to apply does not take over.
        assert!(f
            .set_policy(&EgressPolicy::allow_all(), || Err(Error::Network(
                "nft".into()
            )))
            .is_err());
        assert_eq!(resolve(at, 7, "other.test").0, RCODE::Refused);
        // Allow by default: every name resolves, only allowed ones are learned (anew: the
        // rules were replaced, the learned set emptied).
        let allow = EgressPolicy::from_e2b(true, &["allowed.test"], &[]).unwrap();
        f.set_policy(&allow, || Ok(())).unwrap();
        assert_eq!(resolve(at, 4, "other.test").1, vec![(addr, 30)]);
        assert!(learned.try_recv().is_err());
        assert_eq!(resolve(at, 5, "Allowed.Test").1, vec![(addr, 30)]);
        assert_eq!(learned.try_recv().unwrap(), vec![(addr, 30)]);
    }

    /// What a guest sends and what an upstream answers are untrusted: mutated queries and
    /// answers (bytes flipped, truncated, extended) never panic the verdict, the REFUSED
    /// reply or the address extraction, and a REFUSED reply keeps the query's id.
    #[test]
    fn mutated_queries_and_answers_never_panic() {
        let deny = EgressPolicy::from_e2b(false, &["allowed.test"], &[]).unwrap();
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let base = query(0x4242, "allowed.test");
        let mut answer = Packet::parse(&base).unwrap().into_reply();
        answer.answers.push(ResourceRecord::new(
            Name::new_unchecked("allowed.test"),
            CLASS::IN,
            30,
            RData::A(A { address: 1 }),
        ));
        let answer = answer.build_bytes_vec().unwrap();
        for _ in 0..20_000 {
            for seedling in [&base, &answer] {
                let mut m = seedling.clone();
                for _ in 0..(next() % 4 + 1) {
                    match next() % 3 {
                        0 if !m.is_empty() => {
                            let i = (next() as usize) % m.len();
                            m[i] = next() as u8;
                        }
                        1 => m.truncate((next() as usize) % (m.len() + 1)),
                        _ => m.push(next() as u8),
                    }
                }
                let _ = Relay::verdict(&deny, &m);
                let _ = Relay::verdict(&EgressPolicy::allow_all(), &m);
                if let Some(r) = refused(&m) {
                    assert_eq!(r[..2], m[..2]);
                }
                let _ = a_records(&m);
            }
        }
    }

    #[test]
    fn a_query_is_relayed_and_only_its_own_answer_comes_back() {
        // The "upstream": answers each query with its id, first a wrong one.
        let up = UdpSocket::bind("127.0.0.1:0").unwrap();
        let up_addr = up.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut b = [0u8; 512];
            let (n, from) = up.recv_from(&mut b).unwrap();
            let mut wrong = b[..n].to_vec();
            wrong[0] ^= 0xff;
            up.send_to(&wrong, from).unwrap();
            let mut answer = b[..n].to_vec();
            answer.extend_from_slice(b"answer");
            up.send_to(&answer, from).unwrap();
        });
        let query = [0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 7];
        let answer = ask(&query, up_addr).unwrap();
        assert_eq!(&answer[..2], &[0x12, 0x34]);
        assert!(answer.ends_with(b"answer"));
    }
}

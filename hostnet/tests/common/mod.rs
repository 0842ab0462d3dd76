//! Test fixtures: every test works in its own names and ranges (`hnt<k>`, 10.251.<k>.0/26
//! for its sandboxes; `hnw<k>`, 10.252.<k>.0/26 for its "world" servers), sends traffic
//! only to addresses in namespaces it made, and removes all of it on drop, also when it
//! fails.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hostnet::{
    add_netns, in_netns, remove_netns, sweep, HostNet, InnerLink, NetRange, Options, SandboxNet,
};

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: needs root");
    }
    root
}

/// Everything one test makes; removed on drop.
pub struct Fixture {
    pub k: u8,
    /// The sandboxes' range, with its host table installed.
    pub range: NetRange,
    /// The world servers' range (no host table: they are only destinations).
    pub world: NetRange,
    host: Option<HostNet>,
    guests: Vec<PathBuf>,
}

impl Fixture {
    pub fn new(k: u8) -> Fixture {
        let range = NetRange::new(
            format!("10.251.{k}.0/26").parse().unwrap(),
            &format!("hnt{k}"),
            &format!("h{k}"),
        )
        .unwrap();
        let world = NetRange::new(
            format!("10.252.{k}.0/26").parse().unwrap(),
            &format!("hnw{k}"),
            &format!("w{k}"),
        )
        .unwrap();
        let mut f = Fixture {
            k,
            range,
            world,
            host: None,
            guests: Vec::new(),
        };
        f.cleanup(); // leftovers of an earlier run that was killed
        f.host = Some(HostNet::init(&f.range).unwrap());
        f
    }

    /// A namespace standing in for a guest (see `InnerLink::Veth`).
    pub fn guest_ns(&mut self, name: &str) -> PathBuf {
        let p = PathBuf::from(format!("/run/netns/hnt{}g{name}", self.k));
        let _ = remove_netns(&p);
        add_netns(&p).unwrap();
        self.guests.push(p.clone());
        p
    }

    /// Sandbox `i` of `range` with a namespace guest; returns it and the guest's namespace.
    pub fn sandbox(&mut self, world: bool, i: u32) -> (SandboxNet, PathBuf) {
        let g = self.guest_ns(&format!("{}{i}", if world { "w" } else { "s" }));
        let range = if world { &self.world } else { &self.range };
        let opts = Options {
            inner: InnerLink::Veth {
                guest_netns: g.clone(),
            },
            ..Options::default()
        };
        (SandboxNet::create_with(range, i, &opts).unwrap(), g)
    }

    /// Two "world" servers (echo on `port` in world sandboxes 0 and 1, reached at their
    /// outer addresses) and sandbox 0 of `range` to reach them from.
    pub fn two_servers_and_a_sandbox(&mut self, port: u16) -> TwoServers {
        let (wa, ga) = self.sandbox(true, 0);
        let (wb, gb) = self.sandbox(true, 1);
        let echoes = [
            Echo::start(Some(&ga), sa(hostnet::GUEST_IP, port)),
            Echo::start(Some(&gb), sa(hostnet::GUEST_IP, port)),
        ];
        let a = sa(self.world.outer_ip(0), port);
        let b = sa(self.world.outer_ip(1), port);
        let (sb, g) = self.sandbox(false, 0);
        TwoServers {
            a,
            b,
            sb,
            g,
            world: (wa, wb, echoes),
        }
    }

    fn cleanup(&mut self) {
        for r in [&self.range, &self.world] {
            if let Err(e) = sweep(r, &[]) {
                eprintln!("cleanup sweep: {e}");
            }
        }
        for g in self.guests.drain(..) {
            let _ = remove_netns(&g);
        }
        for k in ["gs0", "gs1", "gs2", "gw0", "gw1"] {
            let _ = remove_netns(Path::new(&format!("/run/netns/hnt{}{k}", self.k)));
        }
        if let Some(h) = self.host.take() {
            if let Err(e) = h.remove() {
                eprintln!("cleanup host table: {e}");
            }
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// A TCP server that answers each connection's first byte with the same byte, in a
/// namespace (the listener is opened there; the serving thread stays outside).
/// What [`Fixture::two_servers_and_a_sandbox`] made.
pub struct TwoServers {
    /// Server A's address.
    pub a: SocketAddrV4,
    /// Server B's address.
    pub b: SocketAddrV4,
    /// The sandbox.
    pub sb: SandboxNet,
    /// Its guest's namespace.
    pub g: PathBuf,
    /// The world sandboxes and their servers (bind it: dropping it stops them).
    pub world: (SandboxNet, SandboxNet, [Echo; 2]),
}

pub struct Echo {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Echo {
    pub fn start(netns: Option<&Path>, addr: SocketAddrV4) -> Echo {
        let listener = match netns {
            Some(ns) => in_netns(ns, move || TcpListener::bind(addr))
                .unwrap()
                .unwrap(),
            None => TcpListener::bind(addr).unwrap(),
        };
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    // A thread per connection: one whose peer went silent (its packets
                    // dropped by a policy) must not hold up the next.
                    Ok((mut c, _)) => {
                        std::thread::spawn(move || {
                            c.set_nonblocking(false).unwrap();
                            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                            let mut b = [0u8; 1];
                            while let Ok(1) = c.read(&mut b) {
                                if c.write_all(&b).is_err() {
                                    break;
                                }
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Echo {
            addr: SocketAddr::V4(addr),
            stop,
            thread: Some(thread),
        }
    }
}

impl Echo {
    /// Echoes UDP datagrams on `addr`, bound inside `netns`.
    pub fn start_udp(netns: &Path, addr: SocketAddrV4) -> Echo {
        let udp = in_netns(netns, move || UdpSocket::bind(addr))
            .unwrap()
            .unwrap();
        udp.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut d = [0u8; 64];
            while !s.load(Ordering::Relaxed) {
                if let Ok((n, from)) = udp.recv_from(&mut d) {
                    let _ = udp.send_to(&d[..n], from);
                }
            }
        });
        Echo {
            addr: SocketAddr::V4(addr),
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long a connection that is let through may take (all local).
pub const CONNECT: Duration = Duration::from_millis(800);

/// One round trip (a byte out, the same byte back) from inside `netns` (the host's if
/// `None`) to `dst`: true if it made it.
pub fn reaches(netns: Option<&Path>, dst: SocketAddrV4) -> bool {
    let go = move || -> bool {
        let Ok(mut c) = TcpStream::connect_timeout(&SocketAddr::V4(dst), CONNECT) else {
            return false;
        };
        c.set_read_timeout(Some(CONNECT)).unwrap();
        let mut b = [0u8; 1];
        c.write_all(b"x").is_ok() && c.read(&mut b).ok() == Some(1) && b == *b"x"
    };
    match netns {
        Some(ns) => in_netns(ns, go).unwrap(),
        None => go(),
    }
}

/// One UDP round trip (a datagram out, the same one back) from inside `netns` to `dst`:
/// true if it made it (a few tries, as UDP is).
pub fn reaches_udp(netns: &Path, dst: SocketAddrV4) -> bool {
    in_netns(netns, move || -> bool {
        let s = UdpSocket::bind(sa(Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        s.set_read_timeout(Some(CONNECT / 4)).unwrap();
        let mut b = [0u8; 8];
        (0..4).any(|_| {
            s.send_to(b"udp-echo", dst).is_ok()
                && matches!(s.recv_from(&mut b), Ok((8, from)) if from == SocketAddr::V4(dst))
                && &b == b"udp-echo"
        })
    })
    .unwrap()
}

/// A connection opened from inside `netns` (for checks on established connections).
pub fn connect_from(netns: &Path, dst: SocketAddrV4) -> TcpStream {
    in_netns(netns, move || {
        TcpStream::connect_timeout(&SocketAddr::V4(dst), CONNECT)
    })
    .unwrap()
    .unwrap()
}

/// True if a byte sent over `c` comes back.
pub fn echoes(c: &mut TcpStream) -> bool {
    c.set_read_timeout(Some(CONNECT)).unwrap();
    let mut b = [0u8; 1];
    c.write_all(b"y").is_ok() && c.read(&mut b).ok() == Some(1) && b == *b"y"
}

pub fn sa(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// Median of a few durations.
pub fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub fn since(t: Instant) -> Duration {
    t.elapsed()
}

//! End-to-end tests of sandbox networks, without a VM: the guest is a namespace behind a
//! veth named `tap0` (`InnerLink::Veth`), except in the TAP test, which attaches to the real
//! persistent TAP the way the VMM does and speaks raw Ethernet through it. The "world" the
//! guests talk to is made of more sandboxes of a second range (their guests run the
//! servers, reached at their outer addresses), so every address used is in a namespace the
//! test made. Needs root (skipped otherwise).

mod common;

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use hostnet::{
    in_netns, sweep, EgressPolicy, PolicyDefault, SandboxNet, Swept, GUEST_IP, TAP_MAC, TAP_NAME,
};

const PORT: u16 = 8080;

fn netns_exists(p: &Path) -> bool {
    p.exists()
}

fn host_link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

#[test]
fn egress_policy_allows_denies_and_changes_live() {
    if !is_root() {
        return;
    }
    let mut f = Fixture::new(1);
    let TwoServers {
        a,
        b,
        sb,
        g,
        world: _world,
    } = f.two_servers_and_a_sandbox(PORT);
    // UDP echoes in the world sandboxes' own namespaces, at their outer addresses (exposed
    // ports forward TCP only): the policy applies to every protocol alike.
    let _udp = [
        Echo::start_udp(&f.world.netns_path(0), a),
        Echo::start_udp(&f.world.netns_path(1), b),
    ];

    // Allow all (the default): both servers.
    assert!(reaches(Some(&g), a), "allow-all: A");
    assert!(reaches(Some(&g), b), "allow-all: B");
    assert!(reaches_udp(&g, a) && reaches_udp(&g, b), "allow-all: UDP");
    let mut open = connect_from(&g, a);
    assert!(echoes(&mut open));

    // Deny all: neither, and the connection made before is cut too.
    sb.set_policy(&EgressPolicy::deny_all()).unwrap();
    assert!(!reaches(Some(&g), a), "deny-all: A");
    assert!(!reaches(Some(&g), b), "deny-all: B");
    assert!(!reaches_udp(&g, a) && !reaches_udp(&g, b), "deny-all: UDP");
    assert!(!echoes(&mut open), "deny-all: an established connection");
    drop(open);

    // Deny all but an allow list (E2B: allow wins over deny).
    let p =
        EgressPolicy::from_e2b(true, &[a.ip().to_string()], &["0.0.0.0/0".to_string()]).unwrap();
    sb.set_policy(&p).unwrap();
    assert!(reaches(Some(&g), a), "allow-list: A");
    assert!(!reaches(Some(&g), b), "allow-list: B");
    assert!(reaches_udp(&g, a) && !reaches_udp(&g, b), "allow-list: UDP");
    let p = EgressPolicy {
        default: PolicyDefault::Deny,
        allow: vec![format!("{}/32", b.ip()).parse().unwrap()],
        deny: vec![],
        allow_domains: vec![],
    };
    sb.set_policy(&p).unwrap();
    assert!(!reaches(Some(&g), a), "allow-list B: A");
    assert!(reaches(Some(&g), b), "allow-list B: B");

    // A deny list on its own.
    let p = EgressPolicy::from_e2b(true, &[], &[b.ip().to_string()]).unwrap();
    sb.set_policy(&p).unwrap();
    assert!(reaches(Some(&g), a), "deny-list: A");
    assert!(!reaches(Some(&g), b), "deny-list: B");
    assert!(reaches_udp(&g, a) && !reaches_udp(&g, b), "deny-list: UDP");

    // Back to allow all, on the live sandbox.
    sb.set_policy(&EgressPolicy::allow_all()).unwrap();
    assert!(reaches(Some(&g), a), "allow-all again: A");
    assert!(reaches(Some(&g), b), "allow-all again: B");

    sb.destroy().unwrap();
    assert!(!netns_exists(&f.range.netns_path(0)));
    assert!(!host_link_exists(&f.range.host_veth(0)));
}

#[test]
fn addresses_learned_for_allowed_domains_pass_until_the_policy_changes() {
    if !is_root() {
        return;
    }
    let mut f = Fixture::new(6);
    let TwoServers {
        a,
        b,
        sb,
        g,
        world: _world,
    } = f.two_servers_and_a_sandbox(PORT);

    // Deny all but a domain: nothing passes until the name is resolved.
    let p = EgressPolicy::from_e2b(false, &["a.example"], &[]).unwrap();
    sb.set_policy(&p).unwrap();
    assert!(!reaches(Some(&g), a), "before the lookup: A");
    // What the forwarder does with an allowed name's answer (a TTL shorter than the
    // minimum still lets the address pass).
    sb.allow_learned(&[(*a.ip(), 1)]).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(reaches(Some(&g), a), "learned: A");
    assert!(!reaches(Some(&g), b), "not learned: B");
    // Learned addresses pass ahead of the deny list, like allow entries.
    let p = EgressPolicy::from_e2b(true, &["a.example"], &["0.0.0.0/0"]).unwrap();
    sb.set_policy(&p).unwrap();
    assert!(!reaches(Some(&g), a), "a new policy learns anew: A");
    hostnet::allow_learned(&f.range.netns_path(0), &[(*b.ip(), 60)]).unwrap();
    assert!(reaches(Some(&g), b), "learned under the new policy: B");
    assert!(!reaches(Some(&g), a), "A");
    sb.destroy().unwrap();
}

#[test]
fn exposed_ports_and_isolation_from_the_host_and_other_sandboxes() {
    if !is_root() {
        return;
    }
    let mut f = Fixture::new(2);
    let (s0, g0) = f.sandbox(false, 0);
    let (s1, g1) = f.sandbox(false, 1);
    // Both guests are 172.16.0.2 and both listen on the same port.
    let _e0 = Echo::start(Some(&g0), sa(GUEST_IP, PORT));
    let _e1 = Echo::start(Some(&g1), sa(GUEST_IP, PORT));

    // The host reaches each guest's port at the sandbox's outer address (DNAT)...
    assert!(reaches(None, sa(s0.outer_ip(), PORT)), "host -> sandbox 0");
    assert!(reaches(None, sa(s1.outer_ip(), PORT)), "host -> sandbox 1");
    // ... also under deny-all (exposed ports are not egress).
    s0.set_policy(&EgressPolicy::deny_all()).unwrap();
    assert!(
        reaches(None, sa(s0.outer_ip(), PORT)),
        "host -> sandbox 0, deny-all"
    );
    s0.set_policy(&EgressPolicy::allow_all()).unwrap();

    // The guest does not reach the host: not its gateway address, not its other addresses.
    let host_ip = f.range.host_ip(0);
    let _h = Echo::start(None, sa(host_ip, PORT + 1));
    assert!(
        reaches(None, sa(host_ip, PORT + 1)),
        "the host's own listener works"
    );
    assert!(
        !reaches(Some(&g0), sa(host_ip, PORT + 1)),
        "guest -> host gateway address"
    );
    let other = f.range.host_ip(1);
    let _h1 = Echo::start(None, sa(other, PORT + 2));
    assert!(
        !reaches(Some(&g0), sa(other, PORT + 2)),
        "guest -> another host address"
    );

    // Nor another sandbox, though the host does.
    assert!(
        !reaches(Some(&g0), sa(s1.outer_ip(), PORT)),
        "sandbox 0 -> sandbox 1"
    );
    assert!(
        !reaches(Some(&g1), sa(s0.outer_ip(), PORT)),
        "sandbox 1 -> sandbox 0"
    );

    // Re-initializing the host rules changes nothing (idempotent, no duplicate rules).
    let count = || {
        let out = std::process::Command::new("nft")
            .args(["-j", "list", "table", "ip", &f.range.host_table()])
            .output()
            .unwrap();
        assert!(out.status.success());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o.get("rule").is_some())
            .count()
    };
    let before = count();
    assert_eq!(before, 4);
    hostnet::HostNet::init(&f.range).unwrap();
    assert_eq!(count(), before);
    assert!(reaches(None, sa(s0.outer_ip(), PORT)));
    assert!(!reaches(Some(&g0), sa(host_ip, PORT + 1)));
}

/// The VMM's side: attach to the persistent TAP by name from inside the namespace, with
/// the VMM's flags, and exchange raw frames: an ARP request answered with the TAP's MAC,
/// then a UDP datagram that reaches a world server with the sandbox's outer address as
/// its source (after the host's masquerade: the host's address on the world's link).
#[test]
fn persistent_tap_attach_arp_and_udp() {
    if !is_root() {
        return;
    }
    let mut f = Fixture::new(3);
    // The world server listens in a world sandbox's namespace itself, at its outer
    // address (its DNAT is for TCP only).
    let (w, _gw) = f.sandbox(true, 0);
    let outer = w.outer_ip();
    let server = in_netns(w.netns_path(), move || UdpSocket::bind((outer, 9000)))
        .unwrap()
        .unwrap();
    server
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let sb = SandboxNet::create(&f.range, 0).unwrap();
    assert_eq!(sb.tap_name(), TAP_NAME);

    let tap = in_netns(sb.netns_path(), || {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/net/tun")?;
        // SAFETY: an all-zero ifreq is valid; TUNSETIFF reads and writes one ifreq that
        // lives across the call, on the tun descriptor just opened.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(TAP_NAME.bytes()) {
            *d = s as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
        // SAFETY: see above.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(file)
    })
    .unwrap()
    .expect("attach to the persistent TAP by name");
    let mut tap = tap;
    const VNET: usize = 10; // struct virtio_net_hdr, the TAP's default header size
    let guest_mac = [0x02, 0x00, 0xac, 0x10, 0x00, 0x02];

    // ARP: who has 172.16.0.1? The TAP answers with its fixed MAC.
    let mut arp = vec![0u8; VNET];
    arp.extend_from_slice(&[0xff; 6]);
    arp.extend_from_slice(&guest_mac);
    arp.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    arp.extend_from_slice(&guest_mac);
    arp.extend_from_slice(&GUEST_IP.octets());
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&hostnet::GUEST_GATEWAY.octets());
    // Resent until answered: the TAP only starts transmitting once the kernel has noticed
    // its carrier (link watch, up to a second after the attach), as a guest's ARP retries.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut buf = [0u8; 2048];
    let mut answered = false;
    while Instant::now() < deadline && !answered {
        tap.write_all(&arp).unwrap();
        let wait = (Instant::now() + Duration::from_millis(250)).min(deadline);
        while !answered {
            let n = read_with_timeout(&mut tap, &mut buf, wait);
            if n == 0 {
                break;
            }
            let frame = &buf[VNET.min(n)..n];
            // An ARP reply (opcode 2) from the TAP's MAC for 172.16.0.1.
            if frame.len() >= 42 && frame[12..14] == [0x08, 0x06] && frame[20..22] == [0, 2] {
                assert_eq!(frame[22..28], TAP_MAC);
                assert_eq!(frame[28..32], hostnet::GUEST_GATEWAY.octets());
                answered = true;
            }
            // Nothing but ARP and IPv4: the namespace has IPv6 off.
            assert!(
                frame.len() < 14 || frame[12..14] != [0x86, 0xdd],
                "an IPv6 frame on the TAP"
            );
        }
    }
    assert!(answered, "no ARP reply from the TAP");

    // UDP from the guest to the world server, through SNAT and the host's masquerade.
    let dst = f.world.outer_ip(0);
    let payload = b"hello from the guest";
    let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, 17, 0, 0];
    ip.extend_from_slice(&GUEST_IP.octets());
    ip.extend_from_slice(&dst.octets());
    let total = (20 + 8 + payload.len()) as u16;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    let sum = checksum(&ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut frame = vec![0u8; VNET];
    frame.extend_from_slice(&TAP_MAC);
    frame.extend_from_slice(&guest_mac);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&4000u16.to_be_bytes());
    frame.extend_from_slice(&9000u16.to_be_bytes());
    frame.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    frame.extend_from_slice(&[0, 0]); // no UDP checksum
    frame.extend_from_slice(payload);
    tap.write_all(&frame).unwrap();
    let mut got = [0u8; 64];
    let (n, from) = server
        .recv_from(&mut got)
        .expect("the datagram reaches the world server");
    assert_eq!(&got[..n], payload);
    // The world sees the host (its masquerade), never the guest's inner address.
    assert_ne!(from.ip(), std::net::IpAddr::V4(GUEST_IP));

    // With deny-all the same datagram does not arrive.
    sb.set_policy(&EgressPolicy::deny_all()).unwrap();
    tap.write_all(&frame).unwrap();
    server
        .set_read_timeout(Some(Duration::from_millis(700)))
        .unwrap();
    assert!(
        server.recv_from(&mut got).is_err(),
        "deny-all let a datagram through"
    );

    drop(tap);
    let path = sb.netns_path().to_path_buf();
    sb.destroy().unwrap();
    assert!(!path.exists());
}

fn read_with_timeout(tap: &mut std::fs::File, buf: &mut [u8], deadline: Instant) -> usize {
    let left = deadline.saturating_duration_since(Instant::now());
    let mut pfd = libc::pollfd {
        fd: tap.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes one pollfd that lives across the call.
    let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
    if r <= 0 {
        return 0;
    }
    tap.read(buf).unwrap_or(0)
}

fn checksum(b: &[u8]) -> u16 {
    let mut s: u32 = 0;
    for c in b.chunks(2) {
        s += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

#[test]
fn sweep_removes_what_a_crash_left() {
    if !is_root() {
        return;
    }
    let f = Fixture::new(4);
    let leaked: Vec<u32> = (0..3)
        .map(|i| SandboxNet::create(&f.range, i).unwrap().leak())
        .collect();
    assert_eq!(leaked, vec![0, 1, 2]);
    for i in 0..3 {
        assert!(netns_exists(&f.range.netns_path(i)));
        assert!(host_link_exists(&f.range.host_veth(i)));
    }
    // A second create on a leaked index is refused without touching it.
    assert!(matches!(
        SandboxNet::create(&f.range, 1),
        Err(hostnet::Error::Exists(_))
    ));
    assert!(netns_exists(&f.range.netns_path(1)));

    let swept = sweep(&f.range, &[1]).unwrap();
    assert_eq!(
        swept,
        Swept {
            namespaces: vec![0, 2],
            veths: vec![0, 2]
        }
    );
    assert!(!netns_exists(&f.range.netns_path(0)));
    assert!(!host_link_exists(&f.range.host_veth(2)));
    assert!(netns_exists(&f.range.netns_path(1)));
    assert!(host_link_exists(&f.range.host_veth(1)));
    // Other ranges' networks are never touched.
    assert_eq!(sweep(&f.world, &[]).unwrap(), Swept::default());
    let swept = sweep(&f.range, &[]).unwrap();
    assert_eq!(swept.namespaces, vec![1]);
    assert!(!host_link_exists(&f.range.host_veth(1)));
    assert_eq!(sweep(&f.range, &[]).unwrap(), Swept::default());
    // The index is usable again.
    SandboxNet::create(&f.range, 1).unwrap().destroy().unwrap();
}

#[test]
fn create_and_destroy_cost() {
    if !is_root() {
        return;
    }
    let f = Fixture::new(5);
    let (mut c, mut d) = (Vec::new(), Vec::new());
    for round in 0..20 {
        let i = round % 4;
        let t = Instant::now();
        let sb = SandboxNet::create(&f.range, i).unwrap();
        c.push(t.elapsed());
        let t = Instant::now();
        sb.destroy().unwrap();
        d.push(t.elapsed());
        assert!(!netns_exists(&f.range.netns_path(i)));
        assert!(!host_link_exists(&f.range.host_veth(i)));
    }
    eprintln!(
        "sandbox network over 20 rounds: create p50 {:.1} ms (max {:.1}), destroy p50 {:.1} ms (max {:.1})",
        ms(p50(c.clone())),
        ms(*c.iter().max().unwrap()),
        ms(p50(d.clone())),
        ms(*d.iter().max().unwrap())
    );
    // Dropping one destroys it too.
    {
        let _sb = SandboxNet::create(&f.range, 9).unwrap();
        assert!(netns_exists(&f.range.netns_path(9)));
    }
    assert!(!netns_exists(&f.range.netns_path(9)));
    assert!(!host_link_exists(&f.range.host_veth(9)));
}

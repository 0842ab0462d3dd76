//! Native KVM tier: virtio-vsock end to end. The native test guest's `vsock` step drives the
//! VMM's virtio-mmio vsock device with its own polling driver and answers the agent
//! protocol's Hello and Ping on port 52; the host side is `vmm::agent::Client`, the client
//! real agents are reached with, through the VM's Unix socket (`CONNECT 52`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clade_tests::guest_config;
use vmm::agent::{Client, ErrorKind, Transport, AGENT_VSOCK_PORT};
use vmm::config::VsockConfig;
use vmm::{Error, ExitStatus, Vm};

const T: Duration = Duration::from_secs(30);
const AGENT: Transport = Transport::Vsock {
    port: AGENT_VSOCK_PORT,
};
const GUEST_AGENT_VERSION: &str = "clade-native-guest 0.1.0";

/// A VM running the native guest with `steps` and a vsock device on a socket of its own.
fn start(steps: &str, name: &str) -> (Vm, PathBuf) {
    let sock = std::env::temp_dir().join(format!(
        "clade-vsock-test-{}-{name}.sock",
        std::process::id()
    ));
    let mut c = guest_config(steps);
    c.vsock = Some(VsockConfig {
        uds_path: sock.clone(),
        guest_cid: 3,
    });
    let mut vm = Vm::new(c).expect("building the VM");
    vm.start().expect("starting the VM");
    (vm, sock)
}

fn serial(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned()
}

fn connect(vm: &Vm, sock: &PathBuf) -> Client {
    Client::connect_timeout(sock, AGENT, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("connect: {e}; serial:\n{}", serial(vm)))
}

/// Waits for the guest to finish on its own, and checks it succeeded.
fn finish(mut vm: Vm) -> String {
    let status = vm.wait_timeout(T).unwrap();
    let out = serial(&vm);
    let Some(status) = status else {
        vm.shutdown();
        panic!("guest still running after the connection ended; serial:\n{out}");
    };
    assert_eq!(status, ExitStatus::TestExit(0), "serial:\n{out}");
    out
}

#[test]
fn agent_client_pings_the_native_guest_over_virtio_vsock() {
    let created = Instant::now();
    let (vm, sock) = start("vsock", "ping");
    let client = connect(&vm, &sock);
    assert_eq!(client.agent_version(), GUEST_AGENT_VERSION);
    assert_eq!(client.protocol(), 1);

    let mut last_uptime = Duration::ZERO;
    for i in 0..5 {
        let p = client
            .ping()
            .unwrap_or_else(|e| panic!("ping {i}: {e}; serial:\n{}", serial(&vm)));
        assert_eq!(p.agent_version, GUEST_AGENT_VERSION);
        assert_eq!(p.protocol, 1);
        assert_eq!(p.running_execs, 0);
        // The guest's TSC clock: it spent 10 ms calibrating before the device came up, and
        // cannot have run longer than the VM exists (allowing for calibration error).
        assert!(p.uptime >= Duration::from_millis(10), "{p:?}");
        let bound = created.elapsed().mul_f64(1.25) + Duration::from_millis(5);
        assert!(p.uptime <= bound, "{p:?} but the VM exists for {bound:?}");
        assert!(p.uptime >= last_uptime, "uptime went backwards: {p:?}");
        last_uptime = p.uptime;
    }

    // An operation a bare-metal guest cannot do: a well-formed Error frame, and the
    // connection keeps working.
    match client.stat("/") {
        Err(Error::Agent(e)) => assert_eq!(e.kind, ErrorKind::Unsupported, "{e}"),
        other => panic!("stat on the native guest: {other:?}"),
    }
    client.ping().expect("ping after an error reply");

    // Closing the connection ends the step, and the guest with it.
    drop(client);
    let out = finish(vm);
    assert!(
        out.contains("vsock: device in slot 0 at 0xd0001000, guest CID 3"),
        "{out}"
    );
    assert!(
        out.contains("(host closed it): 1 hello, 6 pings, 1 error replies"),
        "{out}"
    );
    assert!(out.contains("step vsock ok"), "{out}");
    assert!(!sock.exists(), "the VM removes its socket when dropped");
}

#[test]
fn guest_refuses_other_ports_and_closes_after_its_ping_limit() {
    let (vm, sock) = start("vsock:3", "limit");
    // Nothing listens on port 53: the guest answers the request with a reset.
    match Client::connect_with(&sock, Transport::Vsock { port: 53 }) {
        Err(Error::AgentHandshake {
            port: 53, reason, ..
        }) => {
            assert!(reason.starts_with("connection closed"), "{reason}")
        }
        other => panic!("connect to port 53: {other:?}; serial:\n{}", serial(&vm)),
    }
    let client = connect(&vm, &sock);
    for i in 0..3 {
        client
            .ping()
            .unwrap_or_else(|e| panic!("ping {i}: {e}; serial:\n{}", serial(&vm)));
    }
    // The guest closed the connection after the third pong.
    match client.ping() {
        Err(Error::AgentDisconnected) => {}
        other => panic!("fourth ping: {other:?}"),
    }
    let out = finish(vm);
    assert!(
        out.contains(
            "(guest closed it after the requested number of pings): 1 hello, 3 pings, \
             0 error replies"
        ),
        "{out}"
    );
    assert_eq!(out.matches("vsock: connection from").count(), 1, "{out}");
}

#[test]
fn device_reset_and_reinitialisation_serve_a_second_connection() {
    // Step one closes after one ping and resets the device; step two sets it up again.
    let (vm, sock) = start("vsock:1,vsock", "reset");
    let first = connect(&vm, &sock);
    first.ping().expect("ping on the first connection");
    drop(first);
    // Retries while the first step winds down (its connection requests are refused).
    let second = connect(&vm, &sock);
    for _ in 0..3 {
        second.ping().expect("ping on the second connection");
    }
    drop(second);
    let out = finish(vm);
    assert_eq!(out.matches("vsock: device in slot 0").count(), 2, "{out}");
    assert!(out.contains("1 hello, 1 pings"), "{out}");
    assert!(out.contains("(host closed it): 1 hello, 3 pings"), "{out}");
    assert!(out.contains("step vsock:1 ok"), "{out}");
    assert!(out.contains("step vsock ok"), "{out}");
}

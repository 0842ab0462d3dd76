//! Native KVM tier: virtio-vsock end to end. The native test guest's `vsock` step drives the
//! VMM's virtio-mmio vsock device with its own polling driver and answers the agent
//! protocol's Hello and Ping on port 52; the host side is `vmm::agent::Client`, the client
//! real agents are reached with, through the VM's Unix socket (`CONNECT 52`).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use clade_tests::guest_config;
use guest_agent::proto::{self, AgentMsg, Frame, HostMsg, Msg, MAX_FRAME_LEN};
use vmm::agent::{Client, ErrorKind, Pong, Transport, AGENT_VSOCK_PORT};
use vmm::VsockConfig;
use vmm::{Error, Vm, VmExit};

const T: Duration = Duration::from_secs(30);
/// Longest any client call may block (a connect retries for 10 s, each try for up to 10 s).
const STUCK: Duration = Duration::from_secs(25);
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
    let mut vm = vmm::boot(c).expect("building the VM");
    vm.start().expect("starting the VM");
    (vm, sock)
}

fn serial(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned()
}

/// Runs `f` on a thread of its own: the client's calls block without a timeout, and a
/// stuck device or driver must fail the test, not hang it.
fn within<T: Send + 'static>(vm: &Vm, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(STUCK) {
        Ok(v) => v,
        Err(RecvTimeoutError::Timeout) => {
            panic!(
                "{what}: no answer within {STUCK:?}; serial:\n{}",
                serial(vm)
            )
        }
        Err(RecvTimeoutError::Disconnected) => {
            panic!(
                "{what}: the client thread panicked; serial:\n{}",
                serial(vm)
            )
        }
    }
}

fn connect(vm: &Vm, sock: &Path) -> Client {
    let sock = sock.to_path_buf();
    within(vm, "connect", move || {
        Client::connect_timeout(sock, AGENT, Duration::from_secs(10))
    })
    .unwrap_or_else(|e| panic!("connect: {e}; serial:\n{}", serial(vm)))
}

fn ping(vm: &Vm, client: &Client) -> vmm::Result<Pong> {
    let c = client.clone();
    within(vm, "ping", move || c.ping())
}

/// Waits for the guest to finish on its own, and checks it succeeded.
fn finish(mut vm: Vm) -> String {
    let status = vm.wait_timeout(T).unwrap();
    let out = serial(&vm);
    let Some(status) = status else {
        vm.shutdown();
        panic!("guest still running after the connection ended; serial:\n{out}");
    };
    assert_eq!(status, VmExit::TestExit(0), "serial:\n{out}");
    out
}

#[test]
fn agent_client_pings_the_native_guest_over_virtio_vsock() {
    let created = Instant::now();
    let (vm, sock) = start("vsock:1", "ping");
    let client = connect(&vm, &sock);
    assert_eq!(client.agent_version(), GUEST_AGENT_VERSION);
    assert_eq!(client.protocol(), 1);

    let mut last_uptime = Duration::ZERO;
    for i in 0..5 {
        let p = ping(&vm, &client)
            .unwrap_or_else(|e| panic!("ping {i}: {e}; serial:\n{}", serial(&vm)));
        assert_eq!(p.agent_version, GUEST_AGENT_VERSION);
        assert_eq!(p.protocol, 1);
        assert_eq!(p.running_execs, 0);
        // The guest's TSC clock: it spent 30 ms calibrating before the device came up, and
        // cannot have run longer than the VM exists (allowing for calibration error).
        assert!(p.uptime >= Duration::from_millis(30), "{p:?}");
        let bound = created.elapsed().mul_f64(1.25) + Duration::from_millis(5);
        assert!(p.uptime <= bound, "{p:?} but the VM exists for {bound:?}");
        assert!(p.uptime >= last_uptime, "uptime went backwards: {p:?}");
        last_uptime = p.uptime;
    }

    // An operation a bare-metal guest cannot do: a well-formed Error frame, and the
    // connection keeps working.
    let c = client.clone();
    match within(&vm, "stat", move || c.stat("/")) {
        Err(Error::Agent(e)) => assert_eq!(e.kind, ErrorKind::Unsupported, "{e}"),
        other => panic!("stat on the native guest: {other:?}"),
    }
    ping(&vm, &client).expect("ping after an error reply");

    // Closing the connection ends the step (limited to one connection), and the guest.
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
    assert!(out.contains("step vsock:1 ok"), "{out}");
    assert!(!sock.exists(), "the VM removes its socket when dropped");
}

#[test]
fn guest_refuses_other_ports_and_closes_after_its_ping_limit() {
    let (vm, sock) = start("vsock:1:3", "limit");
    // Nothing listens on port 53: the guest answers the request with a reset.
    let s = sock.clone();
    match within(&vm, "connect to port 53", move || {
        Client::connect_with(s, Transport::Vsock { port: 53 })
    }) {
        Err(Error::AgentHandshake {
            port: 53, reason, ..
        }) => {
            assert!(reason.starts_with("connection closed"), "{reason}")
        }
        other => panic!("connect to port 53: {other:?}; serial:\n{}", serial(&vm)),
    }
    let client = connect(&vm, &sock);
    for i in 0..3 {
        ping(&vm, &client).unwrap_or_else(|e| panic!("ping {i}: {e}; serial:\n{}", serial(&vm)));
    }
    // The guest closed the connection after the third pong.
    match ping(&vm, &client) {
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
    assert_eq!(
        out.matches(" done (").count(),
        1,
        "one connection served: {out}"
    );
}

#[test]
fn device_reset_and_reinitialisation_serve_a_second_connection() {
    // Step one closes after one ping and resets the device; step two sets it up again.
    let (vm, sock) = start("vsock:1:1,vsock:1", "reset");
    let first = connect(&vm, &sock);
    ping(&vm, &first).expect("ping on the first connection");
    drop(first);
    // Retries while the first step winds down (its connection requests are refused).
    let second = connect(&vm, &sock);
    for _ in 0..3 {
        ping(&vm, &second).expect("ping on the second connection");
    }
    drop(second);
    let out = finish(vm);
    assert_eq!(out.matches("vsock: device in slot 0").count(), 2, "{out}");
    assert!(out.contains("1 hello, 1 pings"), "{out}");
    assert!(out.contains("(host closed it): 1 hello, 3 pings"), "{out}");
    assert!(out.contains("step vsock:1:1 ok"), "{out}");
    assert!(out.contains("step vsock:1 ok"), "{out}");
}

/// `conn_log=0`: the guest reports its totals only, no line per connection (a benchmark of
/// what follows a connection must not find the guest writing that line, an exit per byte).
#[test]
fn without_conn_log_the_guest_reports_totals_only() {
    let (vm, sock) = start("vsock:2 conn_log=0", "quiet");
    for _ in 0..2 {
        let c = connect(&vm, &sock);
        for _ in 0..2 {
            ping(&vm, &c).expect("ping");
        }
        drop(c);
    }
    let out = finish(vm);
    assert!(out.contains("vsock: served 2 connections"), "{out}");
    assert!(!out.contains(" done ("), "{out}");
    assert!(out.contains("step vsock:2 ok"), "{out}");
}

/// Waits until the guest reported `n` ended connections.
fn wait_for_ends(vm: &Vm, n: usize) -> String {
    let t = Instant::now();
    loop {
        let out = serial(vm);
        if out.matches(" done (").count() >= n {
            return out;
        }
        assert!(
            t.elapsed() < STUCK,
            "{n} connections never ended; serial:\n{out}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn one_vm_serves_connection_after_connection_and_several_at_once() {
    let (mut vm, sock) = start("vsock", "many");
    // Three in turn, each a session of its own (a Hello on each).
    for i in 0..3 {
        let c = connect(&vm, &sock);
        for _ in 0..2 {
            ping(&vm, &c).unwrap_or_else(|e| panic!("connection {i}: {e}"));
        }
        drop(c);
        wait_for_ends(&vm, i + 1);
    }
    // Two at once, requests interleaved.
    let a = connect(&vm, &sock);
    let b = connect(&vm, &sock);
    for _ in 0..3 {
        ping(&vm, &a).expect("ping on a");
        ping(&vm, &b).expect("ping on b");
    }
    drop(a);
    ping(&vm, &b).expect("b answers after a closed");
    drop(b);
    wait_for_ends(&vm, 5);

    // Eight at once fill the guest's table; a ninth request is refused with a reset, and
    // a slot freed by a closed connection serves a new one.
    let mut all: Vec<Client> = (0..8).map(|_| connect(&vm, &sock)).collect();
    for c in &all {
        ping(&vm, c).expect("ping on one of eight");
    }
    let s = sock.clone();
    match within(&vm, "a ninth connection", move || {
        Client::connect_with(s, AGENT)
    }) {
        Err(Error::AgentHandshake { reason, .. }) => {
            assert!(reason.starts_with("connection closed"), "{reason}")
        }
        other => panic!("ninth connection: {other:?}; serial:\n{}", serial(&vm)),
    }
    drop(all.pop());
    wait_for_ends(&vm, 6);
    let ninth = connect(&vm, &sock);
    ping(&vm, &ninth).expect("ping on the connection that took the freed slot");
    drop(ninth);
    drop(all);
    let out = wait_for_ends(&vm, 6 + 1 + 7);

    // Still serving: the step never ended (no "step vsock" line) until the host stops it.
    let last = connect(&vm, &sock);
    ping(&vm, &last).expect("ping after fourteen connections");
    assert!(!out.contains("step vsock"), "{out}");
    assert_eq!(
        out.matches("(host closed it): 1 hello, 2 pings").count(),
        3,
        "{out}"
    );
    assert_eq!(vm.shutdown(), VmExit::Stopped);
}

/// A raw connection through the VM's socket, speaking frames by hand.
struct Raw(UnixStream);

impl Raw {
    fn connect(sock: &Path) -> Raw {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut s = UnixStream::connect(sock).expect("connect to the VM's vsock socket");
            s.set_read_timeout(Some(STUCK)).unwrap();
            s.write_all(b"CONNECT 52\n").unwrap();
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while line.last() != Some(&b'\n') {
                match s.read(&mut b) {
                    Ok(1) => line.push(b[0]),
                    _ => break,
                }
            }
            if line.starts_with(b"OK ") && line.ends_with(b"\n") {
                return Raw(s);
            }
            assert!(
                line.is_empty() && Instant::now() < deadline,
                "CONNECT 52 answered {line:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).expect("write to the guest");
    }

    fn host(&mut self, id: u32, msg: &HostMsg) {
        let f = proto::encode_host(id, msg).unwrap();
        self.send(&f);
    }

    /// The next frame, decoded by the agent protocol's own decoder.
    fn recv(&mut self) -> Frame {
        let f = proto::read_frame(&mut self.0, MAX_FRAME_LEN)
            .expect("read a frame from the guest")
            .expect("the guest closed the connection");
        proto::decode_frame(&f).expect("the guest's frame decodes")
    }

    /// Expects an Error frame with `id` and `kind`.
    fn expect_error(&mut self, id: u32, kind: ErrorKind) {
        match self.recv() {
            Frame {
                id: got,
                msg: Msg::Agent(AgentMsg::Error(e)),
            } if got == id && e.kind == kind => {}
            other => panic!("expected Error({kind:?}) on id {id}, got {other:?}"),
        }
    }

    fn expect_pong(&mut self, id: u32) {
        match self.recv() {
            Frame {
                id: got,
                msg: Msg::Agent(AgentMsg::Pong { agent_version, .. }),
            } if got == id => assert_eq!(agent_version, GUEST_AGENT_VERSION),
            other => panic!("expected Pong on id {id}, got {other:?}"),
        }
    }
}

#[test]
fn hand_made_frames_get_the_agents_answers_and_credit_flows() {
    let (vm, sock) = start("vsock:1", "raw");
    let s = sock.clone();
    within(&vm, "raw protocol exchange", move || {
        let mut r = Raw::connect(&s);
        // Before the handshake.
        r.host(7, &HostMsg::Ping);
        r.expect_error(7, ErrorKind::HandshakeRequired);
        // A frame too short to have an id, an unknown tag, a Ping with a payload.
        r.send(&[3, 0, 0, 0, 2, 1, 0]);
        r.expect_error(0, ErrorKind::BadFrame);
        r.send(&[5, 0, 0, 0, 0x7f, 9, 0, 0, 0]);
        r.expect_error(9, ErrorKind::UnknownMessage);
        r.send(&[6, 0, 0, 0, 2, 5, 0, 0, 0, 0xaa]);
        r.expect_error(5, ErrorKind::BadFrame);
        // The handshake, and only once.
        let hello = HostMsg::Hello {
            min_version: 1,
            max_version: 9,
            client: "raw".into(),
        };
        r.host(0, &hello);
        match r.recv() {
            Frame {
                id: 0,
                msg:
                    Msg::Agent(AgentMsg::HelloOk {
                        version: 1,
                        agent_version,
                        max_frame_len,
                    }),
            } => {
                assert_eq!(agent_version, GUEST_AGENT_VERSION);
                assert!(max_frame_len >= 64, "{max_frame_len}");
            }
            other => panic!("expected HelloOk, got {other:?}"),
        }
        r.host(0, &hello);
        r.expect_error(0, ErrorKind::InvalidArgument);
        r.host(0, &HostMsg::Ping);
        r.expect_error(0, ErrorKind::InvalidArgument);
        r.host(1, &HostMsg::Ping);
        r.expect_pong(1);
        // Operations a bare-metal guest does not have.
        r.host(2, &HostMsg::Sync);
        r.expect_error(2, ErrorKind::Unsupported);
        // Frames beyond the guest's 8 KiB receive buffer: answered, skipped, and the stream
        // stays in step. 600 KB is more than twice the credit the device starts with, so
        // this only completes if the guest keeps granting credit as it consumes.
        for (id, size) in [(3, 10_000), (4, 600_000)] {
            r.host(id, &HostMsg::FileData(vec![0x5a; size]));
            r.expect_error(id, ErrorKind::Unsupported);
            r.host(id + 100, &HostMsg::Ping);
            r.expect_pong(id + 100);
        }
        // Pipelined requests are answered in order.
        let mut burst = Vec::new();
        for id in 10..60 {
            burst.extend(proto::encode_host(id, &HostMsg::Ping).unwrap());
        }
        r.send(&burst);
        for id in 10..60 {
            r.expect_pong(id);
        }
        // A length above the protocol's limit: FrameTooLarge, then the guest closes.
        r.send(&(MAX_FRAME_LEN + 1).to_le_bytes());
        r.expect_error(0, ErrorKind::FrameTooLarge);
        let mut rest = Vec::new();
        r.0.read_to_end(&mut rest).expect("read to the end");
        assert!(rest.is_empty(), "{rest:?}");
    });
    let out = finish(vm);
    assert!(
        out.contains(
            "(guest closed it after a frame length above the limit): 1 hello, 53 pings, \
             10 error replies"
        ),
        "{out}"
    );
}

#[test]
fn vsock_step_fails_cleanly_without_a_device() {
    let (status, out) = clade_tests::run_to_end(guest_config("vsock"), T);
    assert_eq!(status, VmExit::TestExit(1), "{out}");
    assert!(
        out.contains("step vsock FAIL device setup: no virtio-vsock device"),
        "{out}"
    );
}

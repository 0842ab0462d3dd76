//! `vmm::agent::Client` and the `clade exec` / `cp` / `ping` commands against a real
//! `clade-agent --listen-unix` process (no VM): directly, and through a stand-in for a
//! VMM's vsock Unix socket that implements Firecracker's `CONNECT <port>` convention.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use vmm::agent::{Client, Command, ErrorKind, ExecEvent, ExitStatus, FileKind, Transport, WinSize};
use vmm::Error;

/// Builds `clade-agent` once per test run, in a target directory of its own (the outer
/// `cargo test` holds the main one; the vmm crate cannot depend on another crate's binary).
fn agent_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("agent-build");
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-agent/Cargo.toml");
        let status = std::process::Command::new(env!("CARGO"))
            .args([
                "build",
                "--quiet",
                "--bin",
                "clade-agent",
                "--manifest-path",
            ])
            .arg(&manifest)
            .arg("--target-dir")
            .arg(&target)
            .status()
            .expect("run cargo build for clade-agent");
        assert!(status.success(), "building clade-agent failed");
        target.join("debug/clade-agent")
    })
}

struct Agent {
    child: Child,
    dir: PathBuf,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Agent {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "clade-vmm-agent-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("agent.sock");
        let mut child = std::process::Command::new(agent_bin())
            .arg("--listen-unix")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start clade-agent");
        let mut line = [0u8; 21];
        child.stdout.take().unwrap().read_exact(&mut line).unwrap();
        assert_eq!(&line, b"CLADE-AGENT-LISTENING");
        Agent { child, dir, sock }
    }

    fn client(&self) -> Client {
        Client::connect_with(&self.sock, Transport::Direct).unwrap()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A stand-in for a VMM's vsock Unix socket: accepts `CONNECT <port>\n`; for `port`, answers
/// `OK <n>\n` and splices the stream to the agent; for any other port, closes (what
/// Firecracker does when nothing listens on the guest port).
fn vsock_muxer(agent_sock: PathBuf, path: PathBuf, port: u32) {
    let listener = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        for (n, conn) in listener.incoming().enumerate() {
            let Ok(mut host) = conn else { return };
            let agent_sock = agent_sock.clone();
            std::thread::spawn(move || {
                let mut line = Vec::new();
                let mut b = [0u8; 1];
                while line.last() != Some(&b'\n') {
                    if host.read(&mut b).unwrap_or(0) == 0 {
                        return;
                    }
                    line.push(b[0]);
                }
                if line != format!("CONNECT {port}\n").as_bytes() {
                    return;
                }
                let guest = UnixStream::connect(&agent_sock).unwrap();
                host.write_all(format!("OK {}\n", 1_000_000 + n).as_bytes())
                    .unwrap();
                let (mut h2, mut g2) = (host.try_clone().unwrap(), guest.try_clone().unwrap());
                let mut host_r = host;
                let mut guest_r = guest;
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut guest_r, &mut h2);
                    let _ = h2.shutdown(std::net::Shutdown::Both);
                });
                let _ = std::io::copy(&mut host_r, &mut g2);
                let _ = g2.shutdown(std::net::Shutdown::Both);
            });
        }
    });
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn sha256_of_file(p: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(p)
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

fn sh(script: &str) -> Command {
    Command::new("sh").arg("-c").arg(script)
}

fn remote_kind(e: &Error) -> ErrorKind {
    match e {
        Error::Agent(r) => r.kind,
        other => panic!("expected an agent error, got {other}"),
    }
}

#[test]
fn transports_direct_auto_and_vsock_handshake() {
    let agent = Agent::start();
    // Direct and auto-detected direct.
    let p = agent.client().ping().unwrap();
    assert_eq!(p.agent_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(p.protocol, 1);
    let c = Client::connect(&agent.sock).unwrap();
    c.ping().unwrap();
    // The explicit vsock transport refuses a direct agent socket.
    let e = Client::connect_with(&agent.sock, Transport::Vsock { port: 52 }).unwrap_err();
    assert!(matches!(e, Error::AgentHandshake { .. }), "{e}");

    // Through a Firecracker-style vsock socket: auto and explicit.
    let mux = agent.dir.join("vsock.sock");
    vsock_muxer(agent.sock.clone(), mux.clone(), 52);
    let c = Client::connect(&mux).unwrap();
    assert_eq!(
        c.output(&Command::new("echo").arg("via vsock"), None)
            .unwrap()
            .stdout,
        b"via vsock\n"
    );
    Client::connect_with(&mux, Transport::Vsock { port: 52 })
        .unwrap()
        .ping()
        .unwrap();
    // Nothing listening on that guest port: a clear handshake error.
    let e = Client::connect_with(&mux, Transport::Vsock { port: 53 }).unwrap_err();
    match &e {
        Error::AgentHandshake { port, reason, .. } => {
            assert_eq!(*port, 53);
            assert!(reason.contains("nothing listens"), "{reason}");
        }
        other => panic!("{other}"),
    }
    // A missing socket, retried until the timeout.
    let t0 = Instant::now();
    let e = Client::connect_timeout(
        agent.dir.join("missing.sock"),
        Transport::Auto,
        Duration::from_millis(300),
    )
    .unwrap_err();
    assert!(matches!(e, Error::AgentConnect { .. }), "{e}");
    assert!(t0.elapsed() >= Duration::from_millis(300));
}

#[test]
fn exec_output_exit_codes_and_errors() {
    let agent = Agent::start();
    let c = agent.client();
    let out = c.output(&Command::new("echo").arg("hello"), None).unwrap();
    assert_eq!(out.stdout, b"hello\n");
    assert!(out.status.success());
    assert_eq!(
        c.output(&sh("exit 1"), None).unwrap().status,
        ExitStatus::Exited(1)
    );
    let killed = c.output(&sh("kill -KILL $$"), None).unwrap().status;
    assert_eq!(killed.code(), 137);

    let out = c
        .output(&Command::new("ls").arg("/nonexistent"), None)
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("No such file"));
    assert_ne!(out.status.code(), 0);

    let out = c
        .output(&sh("echo \"$A\"; pwd").env("A", "b").cwd(&agent.dir), None)
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("b\n{}\n", agent.dir.display())
    );

    let e = c.spawn(&Command::new("no-such-command-xyz")).err().unwrap();
    assert_eq!(remote_kind(&e), ErrorKind::NotFound);
}

/// Collected output is bounded: a command that writes past the limit is killed and the
/// call fails with a typed error; the connection keeps working.
#[test]
fn collected_output_is_bounded() {
    let agent = Agent::start();
    let c = agent.client();
    let exec = c.spawn(&Command::new("yes")).unwrap();
    let e = exec.wait_with_output_limit(1 << 20).unwrap_err();
    assert!(
        matches!(e, Error::AgentOutputTooLarge { limit } if limit == 1 << 20),
        "{e}"
    );
    let out = c.output(&sh("echo still here"), None).unwrap();
    assert_eq!(out.stdout, b"still here\n");
}

#[test]
fn ten_mib_stdin_and_fifty_mib_stdout() {
    let agent = Agent::start();
    let c = agent.client();
    let data = pattern(10 << 20, 1);
    let f = agent.dir.join("in.bin");
    std::fs::write(&f, &data).unwrap();
    let out = c.output(&Command::new("sha256sum"), Some(&data)).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout[..64]),
        sha256_of_file(&f)
    );

    let big = pattern(50 << 20, 2);
    let f = agent.dir.join("out.bin");
    std::fs::write(&f, &big).unwrap();
    let exec = c.spawn(&Command::new("cat").arg(&f)).unwrap();
    let mut got = Vec::with_capacity(big.len());
    let status = exec
        .wait_with(|d| got.extend_from_slice(d), |_| {})
        .unwrap();
    assert!(status.success());
    assert!(got == big, "50 MiB stdout differs ({} bytes)", got.len());

    // Streaming stdin by hand, interleaved with events.
    let mut exec = c.spawn(&Command::new("cat").stdin(true)).unwrap();
    let mut stdin = exec.take_stdin().unwrap();
    stdin.write_all(b"line one\n").unwrap();
    match exec.next_event().unwrap() {
        Some(ExecEvent::Stdout(d)) => assert_eq!(d, b"line one\n"),
        other => panic!("{other:?}"),
    }
    stdin.close().unwrap();
    assert_eq!(
        exec.next_event().unwrap(),
        Some(ExecEvent::Exited(ExitStatus::Exited(0)))
    );
    assert_eq!(exec.next_event().unwrap(), None);
}

#[test]
fn eight_concurrent_execs_share_one_client() {
    let agent = Agent::start();
    let c = Arc::new(agent.client());
    let t0 = Instant::now();
    let threads: Vec<_> = (0..8)
        .map(|n| {
            let c = c.clone();
            std::thread::spawn(move || {
                let out = c
                    .output(&sh(&format!("sleep 1; echo job{n}; exit {n}")), None)
                    .unwrap();
                assert_eq!(out.stdout, format!("job{n}\n").into_bytes());
                assert_eq!(out.status, ExitStatus::Exited(n));
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(c.ping().unwrap().running_execs, 0);
}

#[test]
fn signals_and_pty() {
    let agent = Agent::start();
    let c = agent.client();
    let exec = c.spawn(&Command::new("sleep").arg("30")).unwrap();
    let h = exec.handle();
    h.signal(libc::SIGTERM).unwrap();
    assert_eq!(
        exec.wait().unwrap(),
        ExitStatus::Signaled {
            signal: libc::SIGTERM,
            core_dumped: false
        }
    );
    let e = h.signal(libc::SIGTERM).unwrap_err();
    assert_eq!(remote_kind(&e), ErrorKind::UnknownId);

    let cmd = sh("stty size; read x; stty size")
        .tty(WinSize {
            rows: 30,
            cols: 100,
        })
        .stdin(true);
    let mut exec = c.spawn(&cmd).unwrap();
    let mut text = String::new();
    while !text.contains("30 100") {
        match exec.next_event().unwrap() {
            Some(ExecEvent::Stdout(d)) => text.push_str(&String::from_utf8_lossy(&d)),
            other => panic!("{other:?}"),
        }
    }
    exec.resize(WinSize {
        rows: 40,
        cols: 120,
    })
    .unwrap();
    let mut stdin = exec.take_stdin().unwrap();
    stdin.write_all(b"\n").unwrap();
    drop(stdin);
    let out = exec.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("40 120"));
    assert!(out.status.success());
}

#[test]
fn files_and_system_operations() {
    let agent = Agent::start();
    let c = agent.client();
    let data = pattern(5 << 20, 9);
    let p = agent.dir.join("f.bin");
    assert_eq!(c.write_file(&p, 0o600, &data).unwrap(), data.len() as u64);
    assert!(c.read_file(&p).unwrap() == data);
    let mut streamed = Vec::new();
    assert_eq!(
        c.read_file_to(&p, &mut streamed).unwrap(),
        data.len() as u64
    );
    assert!(streamed == data);
    let st = c.stat(&p).unwrap();
    assert_eq!(
        (st.kind, st.size, st.mode),
        (FileKind::File, data.len() as u64, 0o600)
    );
    let names: Vec<_> = c
        .list(&agent.dir)
        .unwrap()
        .into_iter()
        .map(|e| e.name.into_string().unwrap())
        .collect();
    assert_eq!(names, vec!["agent.sock", "f.bin"]);
    assert_eq!(
        c.lstat(agent.dir.join("agent.sock")).unwrap().kind,
        FileKind::Other
    );
    c.remove(&p, false).unwrap();
    assert_eq!(remote_kind(&c.stat(&p).unwrap_err()), ErrorKind::NotFound);
    assert_eq!(
        remote_kind(&c.read_file(&p).unwrap_err()),
        ErrorKind::NotFound
    );
    assert_eq!(
        remote_kind(&c.write_file("/nonexistent-dir/x", 0o644, b"x").unwrap_err()),
        ErrorKind::NotFound
    );

    c.set_clock(std::time::SystemTime::now()).unwrap();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    match c.add_entropy(&pattern(32, 4)) {
        Ok(()) => assert!(root),
        Err(e) => assert_eq!(remote_kind(&e), ErrorKind::PermissionDenied),
    }
    c.sync().unwrap();
    c.power_off().unwrap();
    assert!(matches!(c.ping(), Err(Error::AgentDisconnected)));
}

// ----------------------------------------------------------------------------- CLI

fn clade() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_clade"))
}

#[test]
fn cli_exec_streams_forwards_stdin_and_exits_with_the_code() {
    let agent = Agent::start();
    let s = agent.sock.to_str().unwrap();
    let out = clade()
        .args([
            "exec",
            s,
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.status.code(), Some(3));

    let out = clade()
        .args(["exec", "--direct", s, "--", "sh", "-c", "kill -9 $$"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(137));

    let out = clade()
        .args([
            "exec",
            s,
            "--env",
            "X=1",
            "--cwd",
            "/tmp",
            "--",
            "sh",
            "-c",
            "echo $X; pwd",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"1\n/tmp\n");

    let out = clade()
        .args(["exec", s, "ls", "/nonexistent"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("No such file"));
    assert_eq!(out.status.code(), Some(2));

    // stdin forwarding: 3 MiB through sha256sum.
    let data = pattern(3 << 20, 8);
    let f = agent.dir.join("stdin.bin");
    std::fs::write(&f, &data).unwrap();
    let mut child = clade()
        .args(["exec", s, "--", "sha256sum"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || stdin.write_all(&data).unwrap());
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout[..64]),
        sha256_of_file(&f)
    );

    // SIGTERM to clade is forwarded to the command.
    let mut child = clade()
        .args(["exec", s, "--", "sh", "-c"])
        .arg("trap 'echo term; exit 9' TERM; echo up; while :; do sleep 0.05; done")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut up = [0u8; 3];
    stdout.read_exact(&mut up).unwrap();
    assert_eq!(&up, b"up\n");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "term\n");
    assert_eq!(child.wait().unwrap().code(), Some(9));

    // A command that ignores SIGTERM: clade exec leaves it after its grace period, with
    // 128 + SIGTERM, rather than outlive a `timeout` around it.
    let mut child = clade()
        .args(["exec", s, "--", "sh", "-c"])
        .arg("trap '' TERM; echo up; exec sleep 60")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut up = [0u8; 3];
    stdout.read_exact(&mut up).unwrap();
    assert_eq!(&up, b"up\n");
    let t = std::time::Instant::now();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM));
    assert!(
        (std::time::Duration::from_secs(4)..std::time::Duration::from_secs(30))
            .contains(&t.elapsed()),
        "{:?}",
        t.elapsed()
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("did not end"));
}

#[test]
fn cli_cp_and_ping() {
    let agent = Agent::start();
    let s = agent.sock.to_str().unwrap();
    let src = agent.dir.join("host-src.bin");
    let data = pattern((5 << 20) + 123, 5);
    std::fs::write(&src, &data).unwrap();
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o751)).unwrap();
    let guest_dir = agent.dir.join("guest");
    std::fs::create_dir(&guest_dir).unwrap();

    // Upload into a directory: keeps the name and the mode.
    let st = clade()
        .args([
            "cp",
            src.to_str().unwrap(),
            &format!("{s}:{}", guest_dir.display()),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    let uploaded = guest_dir.join("host-src.bin");
    assert!(std::fs::read(&uploaded).unwrap() == data);
    assert_eq!(
        std::fs::metadata(&uploaded).unwrap().permissions().mode() & 0o7777,
        0o751
    );

    // Download to a new name.
    let back = agent.dir.join("back.bin");
    let st = clade()
        .args([
            "cp",
            &format!("{s}:{}", uploaded.display()),
            back.to_str().unwrap(),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(sha256_of_file(&back), sha256_of_file(&src));

    // To stdout.
    let out = clade()
        .args(["cp", &format!("{s}:{}", uploaded.display()), "-"])
        .output()
        .unwrap();
    assert!(out.stdout == data);

    // Errors: one line, non-zero.
    let out = clade()
        .args([
            "cp",
            &format!("{s}:/nonexistent/file"),
            back.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    let out = clade()
        .args(["cp", "/etc/hostname", "/tmp/x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));

    let out = clade().args(["ping", s]).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout)
        .starts_with(&format!("agent {}", env!("CARGO_PKG_VERSION"))));
}

/// `clade cp` of a large file draws a progress bar on a terminal and ends it at 100 %;
/// when stderr is not a terminal it prints nothing extra.
#[test]
fn cli_cp_progress_only_on_a_terminal() {
    let agent = Agent::start();
    let s = agent.sock.to_str().unwrap();
    let src = agent.dir.join("big.bin");
    let data = pattern(24 << 20, 9);
    std::fs::write(&src, &data).unwrap();
    let up = agent.dir.join("up.bin");
    let down = agent.dir.join("down.bin");
    let bin = env!("CARGO_BIN_EXE_clade");
    // Under a pseudo-terminal: util-linux `script` runs the command with its stdio on one
    // and copies what the terminal shows to our stdout.
    for (from, to) in [
        (src.display().to_string(), format!("{s}:{}", up.display())),
        (format!("{s}:{}", up.display()), down.display().to_string()),
    ] {
        let cmd = format!("{bin} cp {from} {to}");
        let out = std::process::Command::new("script")
            .args(["-qefc", &cmd, "/dev/null"])
            .output()
            .expect("run script(1)");
        let shown = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{cmd}: {shown}");
        assert!(
            shown.contains("100%"),
            "no finished bar for {cmd}: {shown:?}"
        );
        assert!(shown.contains("24.00 MiB/24.00 MiB"), "{shown:?}");
    }
    assert_eq!(sha256_of_file(&down), sha256_of_file(&src));
    // Not a terminal: the output is what it always was (nothing).
    let out = clade()
        .args([
            "cp",
            src.to_str().unwrap(),
            &format!("{s}:{}", up.display()),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(out.stderr.is_empty() && out.stdout.is_empty(), "{out:?}");
}

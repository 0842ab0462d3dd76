//! Host-side tests of the agent server: the real `clade-agent` binary in
//! `--listen-unix` mode, driven frame by frame over its Unix socket with the protocol
//! library (no VM involved). Every operation of the protocol is exercised here.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use guest_agent::proto::{
    decode_frame, encode_host, read_frame, AgentMsg, ErrorKind, ExecSpec, ExitStatus, FileKind,
    HostMsg, Msg, RemoteError, WinSize, CHUNK_LEN, MAX_FRAME_LEN, PROTOCOL_VERSION, STDIN_WINDOW,
};

const TIMEOUT: Duration = Duration::from_secs(60);

/// A `clade-agent --listen-unix` process in a scratch directory.
struct Agent {
    child: Child,
    dir: PathBuf,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Agent {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "clade-agent-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("agent.sock");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_clade-agent"))
            .arg("--listen-unix")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start clade-agent");
        // The agent prints its listening line once the socket is bound.
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("CLADE-AGENT-LISTENING"), "{line:?}");
        Agent { child, dir, sock }
    }

    fn connect(&self) -> Conn {
        let mut c = self.connect_raw();
        c.hello();
        c
    }

    fn connect_raw(&self) -> Conn {
        let s = UnixStream::connect(&self.sock).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        Conn {
            s,
            next_id: 1,
            queued: HashMap::new(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A single-threaded protocol client: frames for other ids are queued until asked for.
struct Conn {
    s: UnixStream,
    next_id: u32,
    queued: HashMap<u32, VecDeque<AgentMsg>>,
}

impl Conn {
    fn id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    fn send(&mut self, id: u32, msg: &HostMsg) {
        let f = encode_host(id, msg).unwrap();
        self.s.write_all(&f).unwrap();
    }

    /// Next frame from the agent, whatever its id; None when the agent closed.
    fn recv_any(&mut self) -> Option<(u32, AgentMsg)> {
        let f = read_frame(&mut self.s, MAX_FRAME_LEN).unwrap()?;
        match decode_frame(&f).unwrap() {
            guest_agent::Frame {
                id,
                msg: Msg::Agent(m),
            } => Some((id, m)),
            other => panic!("agent sent {other:?}"),
        }
    }

    fn recv(&mut self, id: u32) -> AgentMsg {
        if let Some(m) = self.queued.get_mut(&id).and_then(|q| q.pop_front()) {
            return m;
        }
        loop {
            let (got, m) = self.recv_any().expect("connection closed");
            if got == id {
                return m;
            }
            self.queued.entry(got).or_default().push_back(m);
        }
    }

    fn call(&mut self, msg: &HostMsg) -> AgentMsg {
        let id = self.id();
        self.send(id, msg);
        self.recv(id)
    }

    fn call_err(&mut self, msg: &HostMsg) -> RemoteError {
        match self.call(msg) {
            AgentMsg::Error(e) => e,
            m => panic!("expected an error for {msg:?}, got {m:?}"),
        }
    }

    fn hello(&mut self) {
        self.send(
            0,
            &HostMsg::Hello {
                min_version: 1,
                max_version: PROTOCOL_VERSION,
                client: "test".into(),
            },
        );
        match self.recv(0) {
            AgentMsg::HelloOk { version, .. } => assert_eq!(version, PROTOCOL_VERSION),
            m => panic!("hello: {m:?}"),
        }
    }

    fn ping(&mut self) {
        match self.call(&HostMsg::Ping) {
            AgentMsg::Pong {
                agent_version,
                protocol,
                ..
            } => {
                assert_eq!(agent_version, env!("CARGO_PKG_VERSION"));
                assert_eq!(protocol, PROTOCOL_VERSION);
            }
            m => panic!("ping: {m:?}"),
        }
    }

    /// Starts an exec; returns (id, pid).
    fn spawn(&mut self, spec: ExecSpec) -> (u32, u32) {
        let id = self.id();
        self.send(id, &HostMsg::Exec(spec));
        match self.recv(id) {
            AgentMsg::Started { pid } => (id, pid),
            m => panic!("exec: {m:?}"),
        }
    }

    /// Collects an exec's output until it exits.
    fn finish(&mut self, id: u32) -> Out {
        let mut out = Out::default();
        loop {
            match self.recv(id) {
                AgentMsg::Stdout(d) => out.stdout.extend_from_slice(&d),
                AgentMsg::Stderr(d) => out.stderr.extend_from_slice(&d),
                AgentMsg::StdinAck(_) => {}
                AgentMsg::Exited(st) => {
                    out.status = Some(st);
                    return out;
                }
                m => panic!("exec {id}: {m:?}"),
            }
        }
    }

    fn run(&mut self, spec: ExecSpec) -> Out {
        let (id, _) = self.spawn(spec);
        self.finish(id)
    }

    /// Sends `data` as stdin, honouring the agent's window, then closes stdin.
    fn feed_stdin(&mut self, id: u32, data: &[u8]) -> Out {
        let mut out = Out::default();
        let mut in_flight: u64 = 0;
        let mut max_in_flight = 0;
        for chunk in data.chunks(CHUNK_LEN) {
            while in_flight + chunk.len() as u64 > u64::from(STDIN_WINDOW) {
                match self.recv(id) {
                    AgentMsg::StdinAck(n) => in_flight -= u64::from(n),
                    AgentMsg::Stdout(d) => out.stdout.extend_from_slice(&d),
                    AgentMsg::Stderr(d) => out.stderr.extend_from_slice(&d),
                    m => panic!("while feeding stdin: {m:?}"),
                }
            }
            self.send(id, &HostMsg::Stdin(chunk.to_vec()));
            in_flight += chunk.len() as u64;
            max_in_flight = max_in_flight.max(in_flight);
        }
        assert!(max_in_flight <= u64::from(STDIN_WINDOW));
        self.send(id, &HostMsg::StdinClose);
        let rest = self.finish(id);
        out.stdout.extend_from_slice(&rest.stdout);
        out.stderr.extend_from_slice(&rest.stderr);
        out.status = rest.status;
        out
    }

    fn read_file(&mut self, path: &Path) -> Result<Vec<u8>, RemoteError> {
        let id = self.id();
        self.send(
            id,
            &HostMsg::ReadFile {
                path: path.to_path_buf(),
            },
        );
        let mut data = Vec::new();
        loop {
            match self.recv(id) {
                AgentMsg::FileData(d) => {
                    assert!(d.len() <= CHUNK_LEN);
                    data.extend_from_slice(&d);
                }
                AgentMsg::FileDone { bytes } => {
                    assert_eq!(bytes, data.len() as u64);
                    return Ok(data);
                }
                AgentMsg::Error(e) => return Err(e),
                m => panic!("read_file: {m:?}"),
            }
        }
    }

    fn write_file(&mut self, path: &Path, mode: u32, data: &[u8]) -> Result<u64, RemoteError> {
        let id = self.id();
        self.send(
            id,
            &HostMsg::WriteFile {
                path: path.to_path_buf(),
                mode,
            },
        );
        match self.recv(id) {
            AgentMsg::Ok => {}
            AgentMsg::Error(e) => return Err(e),
            m => panic!("write_file: {m:?}"),
        }
        for c in data.chunks(CHUNK_LEN) {
            self.send(id, &HostMsg::FileData(c.to_vec()));
        }
        self.send(id, &HostMsg::FileEnd);
        match self.recv(id) {
            AgentMsg::FileDone { bytes } => Ok(bytes),
            AgentMsg::Error(e) => Err(e),
            m => panic!("write_file: {m:?}"),
        }
    }
}

#[derive(Debug, Default)]
struct Out {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    status: Option<ExitStatus>,
}

impl Out {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

fn cmd(argv: &[&str]) -> ExecSpec {
    ExecSpec {
        argv: argv.iter().map(OsString::from).collect(),
        ..Default::default()
    }
}

fn sh(script: &str) -> ExecSpec {
    cmd(&["sh", "-c", script])
}

/// Deterministic test data.
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

/// `sha256sum FILE` on the host, for reference digests.
fn sha256_of_file(p: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(p)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn handshake_version_and_ping() {
    let agent = Agent::start();
    let mut c = agent.connect_raw();
    // Nothing but Hello before the handshake.
    assert_eq!(
        c.call_err(&HostMsg::Ping).kind,
        ErrorKind::HandshakeRequired
    );
    // No common version.
    c.send(
        0,
        &HostMsg::Hello {
            min_version: 99,
            max_version: 100,
            client: "future".into(),
        },
    );
    match c.recv(0) {
        AgentMsg::Error(e) => assert_eq!(e.kind, ErrorKind::UnsupportedVersion),
        m => panic!("{m:?}"),
    }
    c.hello();
    c.ping();
    // Only one Hello per connection.
    c.send(
        0,
        &HostMsg::Hello {
            min_version: 1,
            max_version: 1,
            client: "again".into(),
        },
    );
    assert!(matches!(c.recv(0), AgentMsg::Error(e) if e.kind == ErrorKind::InvalidArgument));
    // Id 0 is not a request id.
    c.send(0, &HostMsg::Ping);
    assert!(matches!(c.recv(0), AgentMsg::Error(e) if e.kind == ErrorKind::InvalidArgument));
    c.ping();
}

#[test]
fn echo_and_exit_codes() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let out = c.run(cmd(&["echo", "hello", "world"]));
    assert_eq!(out.text(), "hello world\n");
    assert_eq!(out.status, Some(ExitStatus::Exited(0)));

    assert_eq!(c.run(sh("exit 1")).status, Some(ExitStatus::Exited(1)));
    assert_eq!(c.run(sh("exit 255")).status, Some(ExitStatus::Exited(255)));
    let killed = c.run(sh("kill -9 $$")).status.unwrap();
    assert_eq!(
        killed,
        ExitStatus::Signaled {
            signal: 9,
            core_dumped: false
        }
    );
    assert_eq!(killed.code(), 137);
}

#[test]
fn ls_of_a_missing_path_reports_real_stderr_and_exit_code() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let out = c.run(cmd(&["ls", "/nonexistent"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent"), "{stderr:?}");
    assert!(stderr.contains("No such file"), "{stderr:?}");
    assert!(out.stdout.is_empty());
    // GNU ls exits 2 for a missing operand (busybox: 1): what matters is that it is the
    // program's own code.
    let expected = std::process::Command::new("ls")
        .arg("/nonexistent")
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .code()
        .unwrap();
    assert_eq!(out.status, Some(ExitStatus::Exited(expected)));
}

#[test]
fn exec_environment_cwd_and_user() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut spec = sh("echo \"$FOO\"; pwd; echo \"$PATH\"");
    spec.env = vec![("FOO".into(), "bar baz".into())];
    spec.cwd = Some(agent.dir.clone());
    let out = c.run(spec);
    let expected = format!(
        "bar baz\n{}\n{}\n",
        agent.dir.display(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    );
    assert_eq!(out.text(), expected);

    // Default cwd is /; stdin is /dev/null unless requested.
    let out = c.run(sh("pwd; cat; echo eof"));
    assert_eq!(out.text(), "/\neof\n");

    if is_root() {
        let mut spec = sh("id -u; id -g; id -G");
        spec.uid = Some(65534);
        spec.gid = Some(65533);
        let out = c.run(spec);
        assert_eq!(out.text(), "65534\n65533\n65533\n");
    }
}

#[test]
fn exec_errors_are_typed() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let e = c.call_err(&HostMsg::Exec(cmd(&["no-such-command-xyz"])));
    assert_eq!(e.kind, ErrorKind::NotFound);
    let e = c.call_err(&HostMsg::Exec(cmd(&["/nonexistent/bin/x"])));
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert!(e.message.contains("execve"), "{e}");
    let mut spec = cmd(&["true"]);
    spec.cwd = Some("/nonexistent-dir".into());
    let e = c.call_err(&HostMsg::Exec(spec));
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert!(e.message.contains("chdir /nonexistent-dir"), "{e}");
    let e = c.call_err(&HostMsg::Exec(ExecSpec::default()));
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    // A non-executable file.
    let f = agent.dir.join("not-exec");
    std::fs::write(&f, "x").unwrap();
    let e = c.call_err(&HostMsg::Exec(cmd(&[f.to_str().unwrap()])));
    assert_eq!(e.kind, ErrorKind::PermissionDenied);
    c.ping();
}

#[test]
fn ten_mib_of_stdin_through_sha256sum() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let data = pattern(10 << 20, 7);
    let reference = agent.dir.join("stdin.bin");
    std::fs::write(&reference, &data).unwrap();
    let mut spec = cmd(&["sha256sum"]);
    spec.stdin = true;
    let (id, _) = c.spawn(spec);
    let out = c.feed_stdin(id, &data);
    assert_eq!(out.status, Some(ExitStatus::Exited(0)));
    assert_eq!(&out.text()[..64], sha256_of_file(&reference));
}

#[test]
fn fifty_mib_of_stdout_arrive_intact() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let data = pattern(50 << 20, 11);
    let f = agent.dir.join("big.bin");
    std::fs::write(&f, &data).unwrap();
    let out = c.run(cmd(&["cat", f.to_str().unwrap()]));
    assert_eq!(out.status, Some(ExitStatus::Exited(0)));
    assert_eq!(out.stdout.len(), data.len());
    assert!(out.stdout == data, "stdout differs from the file");
}

#[test]
fn stdout_and_stderr_are_separate_streams() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let out = c.run(sh("echo out; echo err >&2; echo out2"));
    assert_eq!(out.text(), "out\nout2\n");
    assert_eq!(out.stderr, b"err\n");
}

#[test]
fn eight_concurrent_execs_on_one_connection() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let t0 = Instant::now();
    let mut ids = Vec::new();
    for n in 0..8 {
        let (id, _) = c.spawn(sh(&format!(
            "sleep 1; echo job{n}; echo err{n} >&2; exit {n}"
        )));
        ids.push((id, n));
    }
    // While they run, the connection still answers.
    c.ping();
    for (id, n) in ids {
        let out = c.finish(id);
        assert_eq!(out.text(), format!("job{n}\n"));
        assert_eq!(out.stderr, format!("err{n}\n").into_bytes());
        assert_eq!(out.status, Some(ExitStatus::Exited(n)));
    }
    // Sequentially this would take 8 s.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn concurrent_connections() {
    let agent = Agent::start();
    let handles: Vec<_> = (0..4)
        .map(|n| {
            let mut c = agent.connect();
            std::thread::spawn(move || {
                for i in 0..5 {
                    let out = c.run(sh(&format!("echo {n}-{i}")));
                    assert_eq!(out.text(), format!("{n}-{i}\n"));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn five_mib_file_write_read_with_checksum() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let data = pattern(5 << 20, 3);
    let path = agent.dir.join("upload.bin");
    assert_eq!(
        c.write_file(&path, 0o640, &data).unwrap(),
        data.len() as u64
    );
    // On disk (the agent runs on this host): same bytes, exact mode.
    let meta = std::fs::metadata(&path).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
    // Checksum computed by the agent's side matches ours.
    let out = c.run(cmd(&["sha256sum", path.to_str().unwrap()]));
    let reference = agent.dir.join("reference.bin");
    std::fs::write(&reference, &data).unwrap();
    assert_eq!(&out.text()[..64], sha256_of_file(&reference));
    // And it reads back identical.
    let back = c.read_file(&path).unwrap();
    assert!(back == data, "read back differs");
    // Overwrite with something shorter: truncated.
    c.write_file(&path, 0o600, b"short").unwrap();
    assert_eq!(c.read_file(&path).unwrap(), b"short");
    // Empty file.
    c.write_file(&path, 0o600, b"").unwrap();
    assert_eq!(c.read_file(&path).unwrap(), b"");
}

#[test]
fn file_errors_stat_list_remove() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let d = &agent.dir;
    let e = c.read_file(&d.join("missing")).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert_eq!(e.errno, libc::ENOENT);
    let e = c
        .write_file(&d.join("no/such/dir/f"), 0o644, b"x")
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    let e = c.read_file(d).unwrap_err();
    assert_eq!(e.errno, libc::EISDIR);

    std::fs::create_dir(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/a.txt"), "hello").unwrap();
    std::fs::write(d.join("sub/b.txt"), "").unwrap();
    std::os::unix::fs::symlink("a.txt", d.join("sub/link")).unwrap();

    match c.call(&HostMsg::Stat {
        path: d.join("sub/a.txt"),
        follow_symlinks: true,
    }) {
        AgentMsg::Stat(s) => {
            assert_eq!(s.kind, FileKind::File);
            assert_eq!(s.size, 5);
            assert!(s.mtime_ns > 1_600_000_000_000_000_000);
        }
        m => panic!("{m:?}"),
    }
    match c.call(&HostMsg::Stat {
        path: d.join("sub/link"),
        follow_symlinks: false,
    }) {
        AgentMsg::Stat(s) => assert_eq!(s.kind, FileKind::Symlink),
        m => panic!("{m:?}"),
    }
    match c.call(&HostMsg::Stat {
        path: d.join("sub/link"),
        follow_symlinks: true,
    }) {
        AgentMsg::Stat(s) => assert_eq!(s.kind, FileKind::File),
        m => panic!("{m:?}"),
    }
    let e = c.call_err(&HostMsg::Stat {
        path: d.join("nope"),
        follow_symlinks: true,
    });
    assert_eq!(e.kind, ErrorKind::NotFound);

    let id = c.id();
    c.send(
        id,
        &HostMsg::List {
            path: d.join("sub"),
        },
    );
    let mut names = Vec::new();
    loop {
        match c.recv(id) {
            AgentMsg::DirEntries(es) => {
                names.extend(es.into_iter().map(|e| (e.name, e.stat.kind, e.stat.size)))
            }
            AgentMsg::Ok => break,
            m => panic!("{m:?}"),
        }
    }
    assert_eq!(
        names,
        vec![
            ("a.txt".into(), FileKind::File, 5),
            ("b.txt".into(), FileKind::File, 0),
            ("link".into(), FileKind::Symlink, 5),
        ]
    );
    let e = c.call_err(&HostMsg::List {
        path: d.join("nope"),
    });
    assert_eq!(e.kind, ErrorKind::NotFound);

    // Non-recursive removal of a non-empty directory fails; recursive works.
    let e = c.call_err(&HostMsg::Remove {
        path: d.join("sub"),
        recursive: false,
    });
    assert_eq!(e.errno, libc::ENOTEMPTY);
    assert_eq!(
        c.call(&HostMsg::Remove {
            path: d.join("sub/b.txt"),
            recursive: false
        }),
        AgentMsg::Ok
    );
    assert!(!d.join("sub/b.txt").exists());
    assert_eq!(
        c.call(&HostMsg::Remove {
            path: d.join("sub"),
            recursive: true
        }),
        AgentMsg::Ok
    );
    assert!(!d.join("sub").exists());
    let e = c.call_err(&HostMsg::Remove {
        path: d.join("sub"),
        recursive: true,
    });
    assert_eq!(e.kind, ErrorKind::NotFound);
}

#[test]
fn make_dir_and_rename() {
    use std::os::unix::fs::PermissionsExt;
    let agent = Agent::start();
    let mut c = agent.connect();
    let d = agent.dir.join("mk");
    // Without parents, a missing parent is NotFound.
    let e = c.call_err(&HostMsg::MakeDir {
        path: d.join("a/b"),
        mode: 0o700,
        parents: false,
    });
    assert_eq!(e.kind, ErrorKind::NotFound);
    // With parents, the whole path appears; the leaf has exactly the mode asked for.
    let mk = |parents| HostMsg::MakeDir {
        path: d.join("a/b"),
        mode: 0o750,
        parents,
    };
    assert_eq!(c.call(&mk(true)), AgentMsg::Ok);
    let m = std::fs::metadata(d.join("a/b")).unwrap();
    assert!(m.is_dir());
    assert_eq!(m.permissions().mode() & 0o7777, 0o750);
    // Existing: fine with parents (mkdir -p), AlreadyExists without.
    assert_eq!(c.call(&mk(true)), AgentMsg::Ok);
    assert_eq!(c.call_err(&mk(false)).kind, ErrorKind::AlreadyExists);
    // A file in the way is AlreadyExists even with parents.
    std::fs::write(d.join("f"), "x").unwrap();
    let e = c.call_err(&HostMsg::MakeDir {
        path: d.join("f"),
        mode: 0o755,
        parents: true,
    });
    assert_eq!(e.kind, ErrorKind::AlreadyExists);

    // Rename a file, then a directory; a missing source is NotFound.
    assert_eq!(
        c.call(&HostMsg::Rename {
            from: d.join("f"),
            to: d.join("a/g"),
        }),
        AgentMsg::Ok
    );
    assert_eq!(std::fs::read(d.join("a/g")).unwrap(), b"x");
    assert!(!d.join("f").exists());
    assert_eq!(
        c.call(&HostMsg::Rename {
            from: d.join("a"),
            to: d.join("z"),
        }),
        AgentMsg::Ok
    );
    assert!(d.join("z/b").is_dir());
    let e = c.call_err(&HostMsg::Rename {
        from: d.join("a"),
        to: d.join("y"),
    });
    assert_eq!(e.kind, ErrorKind::NotFound);
}

#[test]
fn large_directory_listing_spans_frames() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let dir = agent.dir.join("many");
    std::fs::create_dir(&dir).unwrap();
    // Long names so that the listing needs several frames.
    for i in 0..6000 {
        std::fs::write(dir.join(format!("{i:05}-{}", "x".repeat(200))), "").unwrap();
    }
    let id = c.id();
    c.send(id, &HostMsg::List { path: dir.clone() });
    let (mut frames, mut count) = (0, 0);
    loop {
        match c.recv(id) {
            AgentMsg::DirEntries(es) => {
                frames += 1;
                count += es.len();
            }
            AgentMsg::Ok => break,
            m => panic!("{m:?}"),
        }
    }
    assert_eq!(count, 6000);
    assert!(frames > 1);
}

#[test]
fn garbage_frames_get_errors_and_the_agent_keeps_answering() {
    let agent = Agent::start();
    let mut c = agent.connect();

    // A well-framed body with an unknown tag: error with its id, same connection goes on.
    let mut body = vec![0x55u8];
    body.extend_from_slice(&77u32.to_le_bytes());
    body.extend_from_slice(b"junk");
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&body);
    c.s.write_all(&f).unwrap();
    match c.recv(77) {
        AgentMsg::Error(e) => assert_eq!(e.kind, ErrorKind::UnknownMessage),
        m => panic!("{m:?}"),
    }
    c.ping();

    // A known tag with a truncated payload.
    let mut f = encode_host(78, &HostMsg::ReadFile { path: "/x".into() }).unwrap();
    f.truncate(f.len() - 1);
    let len = (f.len() - 4) as u32;
    f[..4].copy_from_slice(&len.to_le_bytes());
    c.s.write_all(&f).unwrap();
    match c.recv(78) {
        AgentMsg::Error(e) => assert_eq!(e.kind, ErrorKind::BadFrame),
        m => panic!("{m:?}"),
    }
    // A frame too short to hold an id: error on id 0.
    c.s.write_all(&[2, 0, 0, 0, 0x02, 0x00]).unwrap();
    match c.recv(0) {
        AgentMsg::Error(e) => assert_eq!(e.kind, ErrorKind::BadFrame),
        m => panic!("{m:?}"),
    }
    // An agent-to-host message sent to the agent.
    let mut f = guest_agent::proto::encode_agent(79, &AgentMsg::Ok).unwrap();
    c.s.write_all(&f).unwrap();
    assert!(matches!(c.recv(79), AgentMsg::Error(e) if e.kind == ErrorKind::UnknownMessage));
    c.ping();

    // Oversized length: error on id 0, then the agent closes this connection.
    f = (MAX_FRAME_LEN + 1).to_le_bytes().to_vec();
    c.s.write_all(&f).unwrap();
    match c.recv_any() {
        Some((0, AgentMsg::Error(e))) => assert_eq!(e.kind, ErrorKind::FrameTooLarge),
        m => panic!("{m:?}"),
    }
    assert!(c.recv_any().is_none(), "connection should be closed");

    // Raw noise on fresh connections, with and without a handshake.
    for seed in 1..20u64 {
        let mut c = if seed % 2 == 0 {
            agent.connect()
        } else {
            agent.connect_raw()
        };
        let noise = pattern(64 + (seed as usize * 37) % 2000, seed);
        let _ = c.s.write_all(&noise);
        let _ = c.s.shutdown(std::net::Shutdown::Write);
        // Drain whatever error replies come until the agent closes.
        let mut sink = Vec::new();
        let _ = c.s.read_to_end(&mut sink);
    }
    // The agent is alive and well.
    let mut c = agent.connect();
    c.ping();
    assert_eq!(c.run(cmd(&["echo", "still here"])).text(), "still here\n");
}

#[test]
fn signals_reach_running_execs() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let (id, _pid) = c.spawn(cmd(&["sleep", "30"]));
    assert_eq!(
        c.call(&HostMsg::Signal {
            target: id,
            signal: libc::SIGTERM,
            group: false
        }),
        AgentMsg::Ok
    );
    let out = c.finish(id);
    assert_eq!(
        out.status,
        Some(ExitStatus::Signaled {
            signal: libc::SIGTERM,
            core_dumped: false
        })
    );
    // The exec is gone: its id is unknown now.
    let e = c.call_err(&HostMsg::Signal {
        target: id,
        signal: libc::SIGTERM,
        group: false,
    });
    assert_eq!(e.kind, ErrorKind::UnknownId);
    let e = c.call_err(&HostMsg::Signal {
        target: 123_456,
        signal: 9,
        group: false,
    });
    assert_eq!(e.kind, ErrorKind::UnknownId);

    // A trap handler sees the signal; a group signal reaches the child of the shell too.
    let (id, _) = c.spawn(sh(
        "trap 'echo got-usr1; exit 3' USR1; echo ready; while :; do sleep 0.05; done",
    ));
    match c.recv(id) {
        AgentMsg::Stdout(d) => assert_eq!(d, b"ready\n"),
        m => panic!("{m:?}"),
    }
    assert_eq!(
        c.call(&HostMsg::Signal {
            target: id,
            signal: libc::SIGUSR1,
            group: false
        }),
        AgentMsg::Ok
    );
    let out = c.finish(id);
    assert_eq!(out.text(), "got-usr1\n");
    assert_eq!(out.status, Some(ExitStatus::Exited(3)));

    let (id, _) = c.spawn(sh("sleep 30; echo not-reached"));
    std::thread::sleep(Duration::from_millis(200));
    c.call(&HostMsg::Signal {
        target: id,
        signal: libc::SIGKILL,
        group: true,
    });
    let out = c.finish(id);
    assert_eq!(out.status.unwrap().code(), 137);
    assert!(out.stdout.is_empty());
}

#[test]
fn pty_mode_with_resize() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut spec = sh("[ -t 0 ] && [ -t 1 ] && echo is-a-tty; stty size; read line; stty size; echo \"got $line\"");
    spec.tty = Some(WinSize { rows: 24, cols: 80 });
    spec.stdin = true;
    let (id, _) = c.spawn(spec);
    // Wait for the first size report before resizing.
    let mut text = String::new();
    while !text.contains("24 80") {
        match c.recv(id) {
            AgentMsg::Stdout(d) => text.push_str(&String::from_utf8_lossy(&d)),
            AgentMsg::Stderr(d) => panic!("tty mode has no separate stderr: {d:?}"),
            m => panic!("{m:?}"),
        }
    }
    assert_eq!(
        c.call(&HostMsg::Resize {
            target: id,
            size: WinSize {
                rows: 50,
                cols: 132
            }
        }),
        AgentMsg::Ok
    );
    c.send(id, &HostMsg::Stdin(b"hello\n".to_vec()));
    c.send(id, &HostMsg::StdinClose);
    let out = c.finish(id);
    text.push_str(&out.text());
    assert_eq!(out.status, Some(ExitStatus::Exited(0)));
    // Terminal output: CRLF line ends, input echoed.
    assert!(text.contains("is-a-tty\r\n"), "{text:?}");
    assert!(text.contains("50 132\r\n"), "{text:?}");
    assert!(text.contains("got hello\r\n"), "{text:?}");

    // Resizing a non-tty exec is refused.
    let (id, _) = c.spawn(cmd(&["sleep", "5"]));
    let e = c.call_err(&HostMsg::Resize {
        target: id,
        size: WinSize { rows: 1, cols: 1 },
    });
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    c.call(&HostMsg::Signal {
        target: id,
        signal: 9,
        group: false,
    });
    c.finish(id);
}

#[test]
fn pty_stdin_close_is_eof() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut spec = cmd(&["cat"]);
    spec.tty = Some(WinSize { rows: 24, cols: 80 });
    spec.stdin = true;
    let (id, _) = c.spawn(spec);
    c.send(id, &HostMsg::Stdin(b"partial".to_vec()));
    c.send(id, &HostMsg::StdinClose);
    let out = c.finish(id);
    assert_eq!(out.status, Some(ExitStatus::Exited(0)));
    assert!(out.text().contains("partial"), "{:?}", out.text());
}

#[test]
fn system_operations() {
    let agent = Agent::start();
    let mut c = agent.connect();
    // Host-test mode validates but does not touch the host clock.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    assert_eq!(c.call(&HostMsg::SetClock { unix_ns: now }), AgentMsg::Ok);
    let e = c.call_err(&HostMsg::SetClock { unix_ns: -5 });
    assert_eq!(e.kind, ErrorKind::InvalidArgument);

    // RNDADDENTROPY needs CAP_SYS_ADMIN.
    match c.call(&HostMsg::AddEntropy(pattern(64, 5))) {
        AgentMsg::Ok => assert!(is_root()),
        AgentMsg::Error(e) => {
            assert!(!is_root(), "{e}");
            assert_eq!(e.kind, ErrorKind::PermissionDenied);
        }
        m => panic!("{m:?}"),
    }
    let e = c.call_err(&HostMsg::AddEntropy(vec![0; 65 * 1024]));
    assert_eq!(e.kind, ErrorKind::InvalidArgument);

    assert_eq!(c.call(&HostMsg::Sync), AgentMsg::Ok);
    match c.call(&HostMsg::Ping) {
        AgentMsg::Pong { uptime_ms, .. } => assert!(uptime_ms > 0),
        m => panic!("{m:?}"),
    }
}

#[test]
fn power_off_ends_the_test_server() {
    let mut agent = Agent::start();
    let mut c = agent.connect();
    assert_eq!(c.call(&HostMsg::PowerOff), AgentMsg::Ok);
    let t0 = Instant::now();
    loop {
        if let Some(st) = agent.child.try_wait().unwrap() {
            assert!(st.success(), "{st:?}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "agent did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Children of `pid` that are zombies.
fn zombie_children(pid: u32) -> Vec<String> {
    let mut z = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 1 && f[0] == "Z" && f[1] == pid.to_string() {
            z.push(stat);
        }
    }
    z
}

#[test]
fn orphans_are_reaped_and_exit_statuses_kept() {
    let agent = Agent::start();
    let mut c = agent.connect();
    // The shell's background children outlive it and are re-parented to the agent
    // (subreaper here, PID 1 in a guest), which must reap them without stealing the
    // statuses of its own execs.
    for _ in 0..5 {
        let out = c.run(sh("(sleep 0.2; exit 7) & (sleep 0.1 & ) ; exit 5"));
        assert_eq!(out.status, Some(ExitStatus::Exited(5)));
    }
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(zombie_children(agent.pid()), Vec::<String>::new());
    // Statuses still arrive correctly afterwards.
    assert_eq!(c.run(sh("exit 4")).status, Some(ExitStatus::Exited(4)));
}

#[test]
fn background_child_holding_stdout_does_not_block_exit() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let t0 = Instant::now();
    let out = c.run(sh("echo started; sleep 30 & exit 0"));
    assert_eq!(out.text(), "started\n");
    assert_eq!(out.status, Some(ExitStatus::Exited(0)));
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn disconnect_kills_the_connections_execs() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let (_, pid) = c.spawn(sh("sleep 60"));
    drop(c);
    let t0 = Instant::now();
    // SAFETY: kill with signal 0 only checks for existence.
    while unsafe { libc::kill(pid as i32, 0) } == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "exec survived its connection"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = agent.connect();
    match c.call(&HostMsg::Ping) {
        AgentMsg::Pong { running_execs, .. } => assert_eq!(running_execs, 0),
        m => panic!("{m:?}"),
    }
}

#[test]
fn stdin_for_a_finished_exec_is_dropped_and_ids_are_checked() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut spec = sh("exit 0");
    spec.stdin = true;
    let (id, _) = c.spawn(spec);
    let out = c.finish(id);
    assert_eq!(out.status, Some(ExitStatus::Exited(0)));
    // Racing stdin after the end is silently dropped.
    c.send(id, &HostMsg::Stdin(b"late".to_vec()));
    c.send(id, &HostMsg::StdinClose);
    c.ping();
    // A second exec under an id still in flight is refused.
    let (id, _) = c.spawn(cmd(&["sleep", "5"]));
    c.send(id, &HostMsg::Exec(cmd(&["true"])));
    match c.recv(id) {
        AgentMsg::Error(e) => assert_eq!(e.kind, ErrorKind::IdInUse),
        m => panic!("{m:?}"),
    }
    c.call(&HostMsg::Signal {
        target: id,
        signal: 9,
        group: false,
    });
    assert_eq!(c.finish(id).status.unwrap().code(), 137);
    // Upload frames for an unknown id are errors.
    let e = c.call_err(&HostMsg::FileData(b"x".to_vec()));
    assert_eq!(e.kind, ErrorKind::UnknownId);
}

// ----------------------------------------------------------------------------- kept processes

fn spawn_kept(c: &mut Conn, spec: ExecSpec, tag: Option<&str>, meta: &[u8]) -> (u32, u32) {
    let id = c.id();
    c.send(
        id,
        &HostMsg::Spawn {
            spec,
            tag: tag.map(String::from),
            meta: meta.to_vec(),
        },
    );
    match c.recv(id) {
        AgentMsg::Started { pid } => (id, pid),
        m => panic!("spawn: {m:?}"),
    }
}

fn attach(c: &mut Conn, pid: u32, output: bool) -> Result<u32, RemoteError> {
    let id = c.id();
    c.send(id, &HostMsg::Attach { pid, output });
    match c.recv(id) {
        AgentMsg::Started { pid: p } => {
            assert_eq!(p, pid);
            Ok(id)
        }
        AgentMsg::Error(e) => Err(e),
        m => panic!("attach: {m:?}"),
    }
}

fn list_procs(c: &mut Conn) -> Vec<guest_agent::proto::ProcInfo> {
    let id = c.id();
    c.send(id, &HostMsg::ListProcs);
    let mut all = Vec::new();
    loop {
        match c.recv(id) {
            AgentMsg::ProcList(mut v) => all.append(&mut v),
            AgentMsg::Ok => return all,
            m => panic!("list_procs: {m:?}"),
        }
    }
}

fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

/// Reads `id`'s stdout until `want` appears in what arrived (other frames are skipped).
fn read_until(c: &mut Conn, id: u32, want: &str) -> String {
    let mut got = String::new();
    while !got.contains(want) {
        match c.recv(id) {
            AgentMsg::Stdout(d) => got.push_str(&String::from_utf8_lossy(&d)),
            AgentMsg::StdinAck(_) => {}
            m => panic!("waiting for {want:?} after {got:?}: {m:?}"),
        }
    }
    got
}

#[test]
fn a_kept_process_survives_its_connection_and_is_attached_from_another() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut spec = sh("while read l; do echo got-$l; done; echo eof; exit 7");
    spec.stdin = true;
    spec.env = vec![("K".into(), "v".into())];
    spec.cwd = Some("/tmp".into());
    let (id, pid) = spawn_kept(&mut c, spec, Some("srv"), b"meta!");
    c.send(id, &HostMsg::Stdin(b"one\n".to_vec()));
    read_until(&mut c, id, "got-one\n");
    drop(c);
    std::thread::sleep(Duration::from_millis(200));
    assert!(alive(pid), "a kept process died with its connection");

    let mut c2 = agent.connect();
    let procs = list_procs(&mut c2);
    let p = procs.iter().find(|p| p.pid == pid).expect("listed");
    assert_eq!(p.tag.as_deref(), Some("srv"));
    assert_eq!(p.meta, b"meta!");
    assert_eq!(p.argv[0], "sh");
    assert_eq!(p.env, vec![("K".into(), "v".into())]);
    assert_eq!(p.cwd.as_deref(), Some(Path::new("/tmp")));
    assert!(p.stdin && !p.tty && p.exit.is_none());

    // Two attachments: one with output, one control-only; stdin from the control one is
    // acknowledged to it, the output goes to the other.
    let a = attach(&mut c2, pid, true).unwrap();
    let ctl = attach(&mut c2, pid, false).unwrap();
    c2.send(ctl, &HostMsg::Stdin(b"two\n".to_vec()));
    assert_eq!(c2.recv(ctl), AgentMsg::StdinAck(4));
    assert_eq!(read_until(&mut c2, a, "got-two\n"), "got-two\n");
    c2.send(ctl, &HostMsg::StdinClose);
    let rest = c2.finish(a);
    assert_eq!(rest.text(), "eof\n");
    assert_eq!(rest.status, Some(ExitStatus::Exited(7)));
    assert_eq!(c2.recv(ctl), AgentMsg::Exited(ExitStatus::Exited(7)));

    // Recently ended: listed with its status, and a late Attach gets the exit at once.
    let procs = list_procs(&mut c2);
    let p = procs.iter().find(|p| p.pid == pid).unwrap();
    assert_eq!(p.exit, Some(ExitStatus::Exited(7)));
    let late = attach(&mut c2, pid, true).unwrap();
    assert_eq!(c2.recv(late), AgentMsg::Exited(ExitStatus::Exited(7)));
    // Its ids name nothing any more.
    let e = c2.call_err(&HostMsg::Signal {
        target: a,
        signal: 15,
        group: true,
    });
    assert_eq!(e.kind, ErrorKind::UnknownId);
}

#[test]
fn kept_processes_are_signalled_and_resized_through_attachments() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut spec = sh("trap 'echo term; exit 3' TERM; echo ready; while :; do sleep 0.05; done");
    spec.tty = Some(WinSize { rows: 10, cols: 40 });
    let (id, pid) = spawn_kept(&mut c, spec, None, b"");
    // The trap is installed before "ready" is printed: a SIGTERM sent earlier
    // would kill the shell outright instead of running the trap.
    read_until(&mut c, id, "ready");
    drop(c);
    let mut c = agent.connect();
    let a = attach(&mut c, pid, true).unwrap();
    c.call(&HostMsg::Resize {
        target: a,
        size: WinSize {
            rows: 30,
            cols: 100,
        },
    });
    // Attachments to unknown pids, and plain execs, are not found.
    assert_eq!(
        attach(&mut c, 1, true).unwrap_err().kind,
        ErrorKind::NotFound
    );
    let (_, exec_pid) = c.spawn(cmd(&["sleep", "5"]));
    assert_eq!(
        attach(&mut c, exec_pid, true).unwrap_err().kind,
        ErrorKind::NotFound
    );
    assert!(!list_procs(&mut c).iter().any(|p| p.pid == exec_pid));
    match c.call(&HostMsg::Signal {
        target: a,
        signal: libc::SIGTERM,
        group: false,
    }) {
        AgentMsg::Ok => {}
        m => panic!("{m:?}"),
    }
    let out = c.finish(a);
    assert_eq!(out.status, Some(ExitStatus::Exited(3)), "{}", out.text());
}

#[test]
fn unattached_output_is_drained_so_the_process_never_blocks() {
    let agent = Agent::start();
    let mut c = agent.connect();
    // 8 MiB of output, far beyond a pipe's buffer, with nobody attached.
    let (_, pid) = spawn_kept(
        &mut c,
        sh("head -c 8388608 /dev/zero; echo; echo done-writing; sleep 30"),
        None,
        b"",
    );
    drop(c);
    let t0 = Instant::now();
    let mut c = agent.connect();
    loop {
        // Each wait for the output to drain gets a fresh attachment: only output from the
        // moment of attaching arrives, so the marker may already be gone; the process's
        // state tells: it reaches the sleep only if its writes did not block.
        let out = c.run(sh(&format!("cat /proc/{pid}/task/*/children 2>/dev/null")));
        let kids = out.text();
        if let Some(child) = kids.split_whitespace().next() {
            let comm = std::fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
            if comm.trim() == "sleep" {
                break;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "output was not drained"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let a = attach(&mut c, pid, true).unwrap();
    c.call(&HostMsg::Signal {
        target: a,
        signal: 9,
        group: true,
    });
    assert_eq!(c.finish(a).status.unwrap().code(), 137);
}

#[test]
fn spawn_and_attach_bad_input() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let long_tag = "t".repeat(guest_agent::proto::MAX_TAG_LEN + 1);
    let e = c.call_err(&HostMsg::Spawn {
        spec: cmd(&["true"]),
        tag: Some(long_tag),
        meta: vec![],
    });
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    let e = c.call_err(&HostMsg::Spawn {
        spec: cmd(&["true"]),
        tag: None,
        meta: vec![0; guest_agent::proto::MAX_META_LEN + 1],
    });
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    let e = c.call_err(&HostMsg::Spawn {
        spec: cmd(&["no-such-command-xyz"]),
        tag: None,
        meta: vec![],
    });
    assert_eq!(e.kind, ErrorKind::NotFound);
    // Attach under an id in flight.
    let (id, pid) = spawn_kept(&mut c, cmd(&["sleep", "30"]), None, b"");
    c.send(id, &HostMsg::Attach { pid, output: true });
    match c.recv(id) {
        AgentMsg::Error(e) => assert_eq!(e.kind, ErrorKind::IdInUse),
        m => panic!("{m:?}"),
    }
    // Stdin for a process without one is dropped but acknowledged (the window drains).
    c.send(id, &HostMsg::Stdin(b"xyz".to_vec()));
    assert_eq!(c.recv(id), AgentMsg::StdinAck(3));
    // A truncated Attach frame is a bad frame; the connection goes on.
    let mut f = encode_host(99, &HostMsg::Attach { pid, output: true }).unwrap();
    f.pop();
    let len = (f.len() - 4) as u32;
    f[..4].copy_from_slice(&len.to_le_bytes());
    c.s.write_all(&f).unwrap();
    match c.recv(99) {
        AgentMsg::Error(e) => assert_eq!(e.kind, ErrorKind::BadFrame),
        m => panic!("{m:?}"),
    }
    c.ping();
    c.call(&HostMsg::Signal {
        target: id,
        signal: 9,
        group: true,
    });
    assert_eq!(c.finish(id).status.unwrap().code(), 137);
}

#[test]
fn kept_processes_are_bounded() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut ids = Vec::new();
    for _ in 0..256 {
        ids.push(spawn_kept(&mut c, cmd(&["sleep", "60"]), None, b"").0);
    }
    let e = c.call_err(&HostMsg::Spawn {
        spec: cmd(&["sleep", "60"]),
        tag: None,
        meta: vec![],
    });
    assert_eq!(e.errno, libc::EAGAIN, "{e}");
    assert_eq!(list_procs(&mut c).len(), 256);
    // Plain execs are not counted against kept processes.
    assert_eq!(c.run(cmd(&["true"])).status, Some(ExitStatus::Exited(0)));
    // One ends: there is room again.
    c.call(&HostMsg::Signal {
        target: ids[0],
        signal: 9,
        group: true,
    });
    c.finish(ids[0]);
    let (id, _) = spawn_kept(&mut c, cmd(&["true"]), None, b"");
    assert_eq!(c.finish(id).status, Some(ExitStatus::Exited(0)));
    for id in &ids[1..] {
        c.call(&HostMsg::Signal {
            target: *id,
            signal: 9,
            group: true,
        });
    }
}

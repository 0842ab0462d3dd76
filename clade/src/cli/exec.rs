//! `clade exec`, `clade ping`, `clade poweroff`: talk to the guest's agent.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use std::os::unix::net::UnixStream;

use anyhow::{bail, Context};
use clap::Args;
use guest_agent::proto::{self, AgentMsg, ErrorKind, HostMsg, Msg};
use vmm::agent::{Client, Command, ExecEvent, ExitStatus, Transport, WinSize};

/// How to reach the agent behind a socket path (shared by exec, cp, ping).
#[derive(Debug, Args, Clone)]
pub struct AgentOpts {
    /// The socket is the agent itself (`clade-agent --listen-unix`): skip the vsock
    /// `CONNECT` handshake. Default: try the handshake, fall back to direct if the socket
    /// answers like an agent.
    #[arg(long, conflicts_with = "port")]
    direct: bool,
    /// Guest vsock port of the agent (vsock handshake only, no fallback) [default: 52].
    #[arg(long)]
    port: Option<u32>,
    /// Keep trying to connect for this many seconds (while the VM boots).
    #[arg(long, default_value_t = 0.0)]
    wait: f64,
}

impl AgentOpts {
    fn transport(&self) -> Transport {
        match (self.direct, self.port) {
            (true, _) => Transport::Direct,
            (false, Some(port)) => Transport::Vsock { port },
            (false, None) => Transport::Auto,
        }
    }

    fn wait(&self) -> Duration {
        Duration::try_from_secs_f64(self.wait.max(0.0)).unwrap_or(Duration::ZERO)
    }

    pub fn connect(&self, socket: &Path) -> anyhow::Result<Client> {
        Ok(Client::connect_timeout(
            socket,
            self.transport(),
            self.wait(),
        )?)
    }
}

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The VM's vsock Unix socket (`clade run --vsock PATH`) or an agent socket.
    socket: PathBuf,
    /// Set an environment variable (repeatable). The command gets only these (plus TERM
    /// with --tty, and a default PATH).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_env)]
    env: Vec<(OsString, OsString)>,
    /// Working directory in the guest [default: /].
    #[arg(long, value_name = "DIR")]
    cwd: Option<PathBuf>,
    /// Run on a pseudo-terminal (interactive programs; stderr merges into stdout).
    #[arg(long, short = 't')]
    tty: bool,
    /// Run as UID[:GID].
    #[arg(long, value_name = "UID[:GID]", value_parser = parse_user)]
    user: Option<(u32, Option<u32>)>,
    /// Do not forward stdin (the command reads /dev/null).
    #[arg(long, short = 'n')]
    no_stdin: bool,
    #[command(flatten)]
    agent: AgentOpts,
    /// The command and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

fn parse_env(s: &str) -> Result<(OsString, OsString), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.into(), v.into())),
        _ => Err(format!("'{s}' is not K=V")),
    }
}

fn parse_user(s: &str) -> Result<(u32, Option<u32>), String> {
    let bad = || format!("'{s}' is not UID or UID:GID (numbers)");
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    let uid = u.parse().map_err(|_| bad())?;
    let gid = g.map(|g| g.parse().map_err(|_| bad())).transpose()?;
    Ok((uid, gid))
}

/// Signal caught by clade, to forward to the command (0: none).
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How long the command may take to end after a SIGTERM or SIGHUP was forwarded to it;
/// then `clade exec` ends itself (exit status 128 + the signal), so that `timeout`, a
/// supervisor or a closed terminal ends it even when the guest no longer answers. (SIGINT
/// is only forwarded: a command may catch it and go on.)
const SIGNAL_GRACE: Duration = Duration::from_secs(5);
static WINDOW_CHANGED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_forward_signal(num: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    if num == libc::SIGWINCH {
        WINDOW_CHANGED.store(true, Ordering::SeqCst);
    } else {
        PENDING_SIGNAL.store(num, Ordering::SeqCst);
    }
}

/// The terminal size of `fd`, if it is a terminal.
fn terminal_size(fd: libc::c_int) -> Option<WinSize> {
    // SAFETY: winsize is plain data; TIOCGWINSZ fills it.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one winsize through the valid pointer.
    if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } != 0 || ws.ws_row == 0 {
        return None;
    }
    Some(WinSize {
        rows: ws.ws_row,
        cols: ws.ws_col,
    })
}

/// Puts a terminal in raw mode until dropped.
struct RawMode {
    fd: libc::c_int,
    saved: libc::termios,
}

impl RawMode {
    fn enable(fd: libc::c_int) -> Option<Self> {
        // SAFETY: termios is plain data; tcgetattr fills it.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: tcgetattr writes the valid termios.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw edits the valid termios; tcsetattr reads it.
        unsafe {
            libc::cfmakeraw(&mut raw);
            if libc::tcsetattr(fd, libc::TCSANOW, &raw) != 0 {
                return None;
            }
        }
        Some(RawMode { fd, saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the termios saved from this fd.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}

/// Runs `command` in the guest behind the vsock socket `socket` (agent port 52) as
/// `clade exec` does: stdin forwarded, a terminal when both ends are one, signals passed
/// on; returns its exit code.
pub fn exec_in(
    socket: &Path,
    command: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    cwd: Option<PathBuf>,
    user: Option<(u32, Option<u32>)>,
) -> anyhow::Result<u8> {
    use std::io::IsTerminal;
    let tty = io::stdin().is_terminal() && io::stdout().is_terminal();
    exec(ExecArgs {
        socket: socket.to_path_buf(),
        env,
        cwd,
        tty,
        user,
        no_stdin: false,
        agent: AgentOpts {
            direct: false,
            port: Some(52),
            wait: 0.0,
        },
        command,
    })
}

pub fn exec(args: ExecArgs) -> anyhow::Result<u8> {
    let client = args
        .agent
        .connect(&args.socket)
        .with_context(|| format!("connect to the agent at {}", args.socket.display()))?;
    let mut argv = args.command.iter();
    let Some(program) = argv.next() else {
        bail!("no command given");
    };
    let mut cmd = Command::new(program).args(argv).stdin(!args.no_stdin);
    for (k, v) in &args.env {
        cmd = cmd.env(k, v);
    }
    if let Some(dir) = &args.cwd {
        cmd = cmd.cwd(dir);
    }
    if let Some((uid, gid)) = args.user {
        cmd = cmd.uid(uid);
        if let Some(gid) = gid {
            cmd = cmd.gid(gid);
        }
    }
    let stdin_fd = io::stdin().as_raw_fd();
    if args.tty {
        let size = terminal_size(io::stdout().as_raw_fd())
            .or_else(|| terminal_size(stdin_fd))
            .unwrap_or(WinSize { rows: 24, cols: 80 });
        cmd = cmd.tty(size);
        if !args.env.iter().any(|(k, _)| k == "TERM") {
            let term = std::env::var_os("TERM").unwrap_or_else(|| "xterm".into());
            cmd = cmd.env("TERM", term);
        }
    }

    for sig in [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGQUIT,
        libc::SIGWINCH,
    ] {
        vmm_sys_util::signal::register_signal_handler(sig, on_forward_signal)?;
    }
    let mut exec = client.spawn(&cmd)?;
    // Raw mode only once the command runs, so an error above leaves the terminal alone.
    let _raw = if args.tty {
        RawMode::enable(stdin_fd)
    } else {
        None
    };

    if let Some(mut stdin) = exec.take_stdin() {
        // Detached: a read from a terminal cannot be interrupted; the process exits anyway.
        std::thread::Builder::new()
            .name("stdin".into())
            .spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                let mut input = io::stdin().lock();
                loop {
                    match input.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            if stdin.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
                let _ = stdin.close();
            })?;
    }

    let handle = exec.handle();
    let tty = args.tty;
    // The terminal's settings, for an exit from the signal thread (see SIGNAL_GRACE).
    let terminal = _raw.as_ref().map(|r| (r.fd, r.saved));
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut ending: Option<(i32, std::time::Instant)> = None;
            while !done2.load(Ordering::SeqCst) {
                let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
                if sig != 0 {
                    if let Err(e) = handle.signal_group(sig) {
                        tracing::debug!("forward signal {sig}: {e}");
                    }
                    if ending.is_none() && (sig == libc::SIGTERM || sig == libc::SIGHUP) {
                        ending = Some((sig, std::time::Instant::now()));
                    }
                }
                if let Some((sig, since)) = ending {
                    if since.elapsed() > SIGNAL_GRACE && !done2.load(Ordering::SeqCst) {
                        if let Some((fd, saved)) = terminal {
                            // SAFETY: restores the termios saved from this fd.
                            unsafe { libc::tcsetattr(fd, libc::TCSANOW, &saved) };
                        }
                        eprintln!(
                            "clade exec: the command did not end within {SIGNAL_GRACE:?} of \
                             signal {sig}; leaving it"
                        );
                        std::process::exit(128 + sig);
                    }
                }
                if tty && WINDOW_CHANGED.swap(false, Ordering::SeqCst) {
                    if let Some(size) = terminal_size(libc::STDOUT_FILENO) {
                        let _ = handle.resize(size);
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })?;

    let mut out = io::stdout();
    let mut err = io::stderr();
    let status = loop {
        match exec.next_event()? {
            Some(ExecEvent::Stdout(d)) => {
                out.write_all(&d).and_then(|()| out.flush())?;
            }
            Some(ExecEvent::Stderr(d)) => {
                err.write_all(&d).and_then(|()| err.flush())?;
            }
            Some(ExecEvent::Exited(st)) => break st,
            None => bail!("the command ended without an exit status"),
        }
    };
    done.store(true, Ordering::SeqCst);
    Ok(exit_code(status))
}

/// The shell convention, clamped to a process exit code.
fn exit_code(status: ExitStatus) -> u8 {
    match status {
        ExitStatus::Exited(c) => (c & 0xff) as u8,
        ExitStatus::Signaled { signal, .. } => (128 + signal).clamp(0, 255) as u8,
    }
}

#[derive(Debug, Args)]
pub struct PingArgs {
    /// The VM's vsock Unix socket (`clade run --vsock PATH`) or an agent socket.
    socket: PathBuf,
    /// Robustness check (tests, debugging): on a connection of its own, send malformed
    /// frames (unknown tag, undecodable payloads, then a length field above the 1 MiB
    /// limit); each must get its error reply (printed), a ping between them must succeed,
    /// and so must the final ping on a fresh connection.
    #[arg(long)]
    garbage_frame: bool,
    #[command(flatten)]
    agent: AgentOpts,
}

pub fn ping(args: PingArgs) -> anyhow::Result<u8> {
    if args.garbage_frame {
        garbage_frames(&args.socket, &args.agent, GARBAGE_REPLY_TIMEOUT)
            .with_context(|| format!("garbage-frame check at {}", args.socket.display()))?;
    }
    let client = args
        .agent
        .connect(&args.socket)
        .with_context(|| format!("connect to the agent at {}", args.socket.display()))?;
    let p = client.ping()?;
    println!(
        "agent {} protocol {} uptime {:.1}s running_execs {} rtt {:.3}ms",
        p.agent_version,
        p.protocol,
        p.uptime.as_secs_f64(),
        p.running_execs,
        p.rtt.as_secs_f64() * 1e3
    );
    Ok(0)
}

/// How long `ping --garbage-frame` waits for each answer (the nested test tier runs the
/// guest under emulation).
const GARBAGE_REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// One frame as the wire carries it, whatever `tag` and `payload` hold.
fn raw_frame(tag: u8, id: u32, payload: &[u8]) -> Vec<u8> {
    let len = (proto::FRAME_HEADER_LEN + payload.len()) as u32;
    let mut f = len.to_le_bytes().to_vec();
    f.push(tag);
    f.extend_from_slice(&id.to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// The next frame from the agent: (id, message).
fn read_agent_frame(s: &mut UnixStream) -> anyhow::Result<(u32, AgentMsg)> {
    let frame = proto::read_frame(s, proto::MAX_FRAME_LEN)
        .context("read the agent's answer")?
        .context("the agent closed the connection")?;
    match proto::decode_frame(&frame).context("decode the agent's answer")? {
        proto::Frame {
            id,
            msg: Msg::Agent(m),
        } => Ok((id, m)),
        f => bail!("the agent sent a host message: {f:?}"),
    }
}

/// `ping --garbage-frame`: malformed input on a raw connection must get error replies and
/// leave the agent serving (`guest-agent/PROTOCOL.md`, "Bad input"). Prints one line per
/// check.
fn garbage_frames(socket: &Path, opts: &AgentOpts, reply_timeout: Duration) -> anyhow::Result<()> {
    let mut s = vmm::agent::connect_raw(socket, opts.transport(), opts.wait())?;
    s.set_read_timeout(Some(reply_timeout))?;
    s.set_write_timeout(Some(reply_timeout))?;

    let hello = HostMsg::Hello {
        min_version: proto::MIN_PROTOCOL_VERSION,
        max_version: proto::PROTOCOL_VERSION,
        client: format!("clade {} (garbage-frame check)", env!("CARGO_PKG_VERSION")),
    };
    s.write_all(&proto::encode_host(0, &hello)?)?;
    match read_agent_frame(&mut s)? {
        (
            0,
            AgentMsg::HelloOk {
                version,
                agent_version,
                ..
            },
        ) => {
            println!("garbage-frame: hello ok: agent {agent_version}, protocol {version}")
        }
        other => bail!("unexpected answer to Hello: {other:?}"),
    }

    // Frames whose framing is intact: an error reply on their id, the connection stays.
    let cases: [(&str, Vec<u8>, u32, ErrorKind); 3] = [
        (
            "unknown tag 0x7e",
            raw_frame(0x7e, 101, b"garbage"),
            101,
            ErrorKind::UnknownMessage,
        ),
        (
            "Ping with 3 trailing bytes",
            raw_frame(0x02, 102, b"xyz"),
            102,
            ErrorKind::BadFrame,
        ),
        (
            "Exec whose argv count (2^32-1) runs past the frame",
            raw_frame(0x03, 103, &u32::MAX.to_le_bytes()),
            103,
            ErrorKind::BadFrame,
        ),
    ];
    for (what, frame, id, kind) in cases {
        s.write_all(&frame)?;
        match read_agent_frame(&mut s).with_context(|| format!("after {what}"))? {
            (got, AgentMsg::Error(e)) if got == id && e.kind == kind => {
                println!("garbage-frame: {what} (id {id}) -> error on id {got}: {e}")
            }
            other => bail!("{what} (id {id}): expected a {kind} error, got {other:?}"),
        }
    }

    let t0 = std::time::Instant::now();
    s.write_all(&proto::encode_host(104, &HostMsg::Ping)?)?;
    match read_agent_frame(&mut s).context("ping after the bad frames")? {
        (104, AgentMsg::Pong { agent_version, .. }) => println!(
            "garbage-frame: ping on the same connection -> pong from agent {agent_version} \
             ({:.3}ms)",
            t0.elapsed().as_secs_f64() * 1e3
        ),
        other => bail!("ping after the bad frames: got {other:?}"),
    }

    // A length field above the limit: error on id 0, then the agent closes the connection
    // (the stream is no longer at a frame boundary).
    let len = 0xffff_fff0u32;
    let mut frame = len.to_le_bytes().to_vec();
    frame.extend_from_slice(&[0x02, 105, 0, 0, 0]);
    s.write_all(&frame)?;
    let reply = match read_agent_frame(&mut s).context("after an oversized length field")? {
        (0, AgentMsg::Error(e)) if e.kind == ErrorKind::FrameTooLarge => e,
        other => bail!("length {len:#x}: expected a FrameTooLarge error on id 0, got {other:?}"),
    };
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) if rest.is_empty() => {}
        Ok(_) => bail!("{} more bytes after the FrameTooLarge error", rest.len()),
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => bail!("the agent did not close the connection after FrameTooLarge: {e}"),
    }
    println!(
        "garbage-frame: length {len:#x} (> {} bytes) -> error on id 0: {reply}; connection \
         closed by the agent",
        proto::MAX_FRAME_LEN
    );

    let p = opts
        .connect(socket)
        .context("connect again after the bad frames")?
        .ping()
        .context("ping on a fresh connection after the bad frames")?;
    println!(
        "garbage-frame: ping on a fresh connection -> pong, running_execs {}",
        p.running_execs
    );
    Ok(())
}

#[derive(Debug, Args)]
pub struct PowerOffArgs {
    /// The VM's vsock Unix socket (`clade run --vsock PATH`) or an agent socket.
    socket: PathBuf,
    #[command(flatten)]
    agent: AgentOpts,
}

pub fn power_off(args: PowerOffArgs) -> anyhow::Result<u8> {
    let client = args
        .agent
        .connect(&args.socket)
        .with_context(|| format!("connect to the agent at {}", args.socket.display()))?;
    client.power_off()?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_and_user_parse() {
        assert_eq!(parse_env("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert_eq!(parse_env("A="), Ok(("A".into(), "".into())));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("novalue").is_err());
        assert_eq!(parse_user("1000"), Ok((1000, None)));
        assert_eq!(parse_user("1000:100"), Ok((1000, Some(100))));
        assert!(parse_user("root").is_err());
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code(ExitStatus::Exited(3)), 3);
        assert_eq!(exit_code(ExitStatus::Exited(256 + 7)), 7);
        let killed = ExitStatus::Signaled {
            signal: 9,
            core_dumped: false,
        };
        assert_eq!(exit_code(killed), 137);
    }

    /// A stand-in agent on a Unix socket that handles bad input as `PROTOCOL.md` says (the
    /// real one, `guest_agent::server`, reaps every child of the process: not in a test
    /// binary). With `faulty`, it answers the unknown tag with a Pong instead.
    fn fake_agent(sock: &Path, faulty: bool) {
        let listener = std::os::unix::net::UnixListener::bind(sock).unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut c) = conn else { return };
                std::thread::spawn(move || loop {
                    let reply = |c: &mut UnixStream, id, m: &AgentMsg| {
                        c.write_all(&proto::encode_agent(id, m).unwrap()).unwrap()
                    };
                    let frame = match proto::read_frame(&mut c, proto::MAX_FRAME_LEN) {
                        Ok(Some(f)) => f,
                        Err(guest_agent::Error::FrameTooLarge { .. }) => {
                            let e = guest_agent::RemoteError::new(ErrorKind::FrameTooLarge, "big");
                            return reply(&mut c, 0, &AgentMsg::Error(e));
                        }
                        _ => return,
                    };
                    let (id, msg) = match proto::decode_frame(&frame) {
                        Ok(f) => (f.id, f.msg),
                        Err(e) => {
                            let id = proto::body_id(&frame[4..]).unwrap_or(0);
                            let m = match e {
                                guest_agent::Error::UnknownTag(_) if faulty => pong(),
                                guest_agent::Error::UnknownTag(_) => AgentMsg::Error(
                                    guest_agent::RemoteError::new(ErrorKind::UnknownMessage, "?"),
                                ),
                                _ => AgentMsg::Error(guest_agent::RemoteError::new(
                                    ErrorKind::BadFrame,
                                    "bad",
                                )),
                            };
                            reply(&mut c, id, &m);
                            continue;
                        }
                    };
                    let m = match msg {
                        Msg::Host(HostMsg::Hello { .. }) => AgentMsg::HelloOk {
                            version: 1,
                            agent_version: "fake".into(),
                            max_frame_len: proto::MAX_FRAME_LEN,
                        },
                        Msg::Host(HostMsg::Ping) => pong(),
                        _ => return,
                    };
                    reply(&mut c, id, &m);
                });
            }
        });
    }

    fn pong() -> AgentMsg {
        AgentMsg::Pong {
            agent_version: "fake".into(),
            protocol: 1,
            uptime_ms: 1,
            running_execs: 0,
        }
    }

    #[test]
    fn garbage_frame_check_wants_error_replies_and_a_live_agent() {
        let dir = std::env::temp_dir().join(format!("clade-garbage-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let opts = AgentOpts {
            direct: false,
            port: None,
            wait: 0.0,
        };
        let t = Duration::from_secs(10);

        let good = dir.join("good.sock");
        fake_agent(&good, false);
        garbage_frames(&good, &opts, t).unwrap();

        let bad = dir.join("bad.sock");
        fake_agent(&bad, true);
        let err = garbage_frames(&bad, &opts, t).unwrap_err();
        assert!(
            format!("{err:#}").contains("unknown tag 0x7e (id 101): expected"),
            "{err:#}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

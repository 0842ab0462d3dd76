//! Exec: fork/exec a command with pipes or a PTY, stream its output, feed its stdin, report
//! its exit.
//!
//! A plain `Exec` belongs to its connection (output and exit go there; it is killed when
//! the connection closes). A `Spawn` belongs to the agent ([`super::procs`]): its output
//! and exit go to whichever connections are attached at the time.
//!
//! The fork is done by hand (not `std::process::Command`) because the agent's reaper
//! collects every child: std's `Command` waits for a child whose exec failed itself and
//! would find it already reaped. The child runs only async-signal-safe calls between fork
//! and exec; everything it needs (C strings, pointer arrays, descriptors) is prepared
//! before the fork.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::conn::{Conn, ExecEntry, StdinCmd};
use super::pipe;
use super::procs::Kept;
use crate::proto::{
    AgentMsg, ErrorKind, ExecSpec, ExitStatus, ProcInfo, RemoteError, WinSize, CHUNK_LEN,
};
use crate::reaper::Reaper;

/// `PATH` given to a child whose environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// After the process has exited, output readers stop once its pipes have been silent this
/// long (a background grandchild may hold them open forever).
const EXIT_OUTPUT_GRACE: Duration = Duration::from_millis(250);

const THREAD_STACK: usize = 256 * 1024;

/// Everything the child needs, prepared before the fork.
struct Plan {
    program: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    cwd: Option<CString>,
    uid: Option<u32>,
    gid: Option<u32>,
}

fn cstring(bytes: &[u8], what: &str) -> Result<CString, RemoteError> {
    CString::new(bytes).map_err(|_| {
        RemoteError::new(
            ErrorKind::InvalidArgument,
            format!("{what} contains a NUL byte"),
        )
    })
}

impl Plan {
    fn new(spec: &ExecSpec) -> Result<Self, RemoteError> {
        let argv0 = spec
            .argv
            .first()
            .ok_or_else(|| RemoteError::new(ErrorKind::InvalidArgument, "empty argv"))?;
        let argv = spec
            .argv
            .iter()
            .map(|a| cstring(a.as_bytes(), "argv"))
            .collect::<Result<Vec<_>, _>>()?;
        let mut env = Vec::with_capacity(spec.env.len() + 1);
        let mut path_var: Option<&OsStr> = None;
        for (k, v) in &spec.env {
            if k.is_empty() || k.as_bytes().contains(&b'=') {
                return Err(RemoteError::new(
                    ErrorKind::InvalidArgument,
                    format!("bad environment variable name {k:?}"),
                ));
            }
            if k == "PATH" {
                path_var = Some(v);
            }
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            env.push(cstring(&kv, "environment")?);
        }
        if path_var.is_none() {
            env.push(cstring(format!("PATH={DEFAULT_PATH}").as_bytes(), "PATH")?);
        }
        let search = path_var.unwrap_or(OsStr::new(DEFAULT_PATH));
        let program = resolve_program(argv0, search, spec.cwd.as_deref())?;
        let cwd = match &spec.cwd {
            Some(c) => Some(cstring(c.as_os_str().as_bytes(), "cwd")?),
            None => Some(cstring(b"/", "cwd")?),
        };
        Ok(Plan {
            program: cstring(program.as_os_str().as_bytes(), "program")?,
            argv,
            env,
            cwd,
            uid: spec.uid,
            gid: spec.gid,
        })
    }
}

/// `argv0` with a `/` is used as is (relative to the child's cwd); otherwise the first
/// executable regular file `dir/argv0` along `path_var`, like execvp.
fn resolve_program(
    argv0: &OsStr,
    path_var: &OsStr,
    cwd: Option<&Path>,
) -> Result<PathBuf, RemoteError> {
    if argv0.is_empty() {
        return Err(RemoteError::new(
            ErrorKind::InvalidArgument,
            "empty program name",
        ));
    }
    if argv0.as_bytes().contains(&b'/') {
        return Ok(PathBuf::from(argv0));
    }
    for dir in path_var.as_bytes().split(|&b| b == b':') {
        let dir = if dir.is_empty() { &b"."[..] } else { dir };
        let mut cand = PathBuf::from(OsStr::from_bytes(dir));
        if cand.is_relative() {
            cand = cwd.unwrap_or(Path::new("/")).join(cand);
        }
        cand.push(argv0);
        if let Ok(m) = std::fs::metadata(&cand) {
            if m.is_file() && m.permissions().mode() & 0o111 != 0 {
                return Ok(cand);
            }
        }
    }
    Err(RemoteError {
        kind: ErrorKind::NotFound,
        errno: libc::ENOENT,
        message: format!(
            "{}: command not found (PATH={})",
            argv0.to_string_lossy(),
            path_var.to_string_lossy()
        ),
    })
}

/// Steps of the child's setup, reported with errno through the error pipe on failure.
#[repr(u8)]
#[derive(Clone, Copy)]
enum Step {
    Stdio = 1,
    Terminal = 2,
    Groups = 3,
    Gid = 4,
    Uid = 5,
    Chdir = 6,
    Exec = 7,
}

fn step_name(step: u8) -> &'static str {
    match step {
        1 => "set up stdio",
        2 => "set controlling terminal",
        3 => "setgroups",
        4 => "setgid",
        5 => "setuid",
        6 => "chdir",
        7 => "execve",
        _ => "start",
    }
}

/// The child side of the fork: set up and exec, or report the failed step and errno.
///
/// # Safety
/// Must be called only in the child right after fork(): it uses only async-signal-safe
/// calls and never returns.
unsafe fn child_exec(
    plan: &Plan,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    stdio: [libc::c_int; 3],
    tty: bool,
    err_fd: libc::c_int,
) -> ! {
    let fail = |step: Step| -> ! {
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
        let mut buf = [0u8; 5];
        buf[0] = step as u8;
        buf[1..].copy_from_slice(&errno.to_ne_bytes());
        // SAFETY: (whole block) async-signal-safe calls on valid buffers and descriptors,
        // in the single-threaded child.
        unsafe {
            libc::write(err_fd, buf.as_ptr().cast(), buf.len());
            libc::_exit(127)
        }
    };
    // SAFETY: (whole block) we are the freshly forked child; every call below is
    // async-signal-safe and gets valid pointers prepared before the fork.
    unsafe {
        // A clean signal state: nothing blocked, SIGPIPE back to default (Rust ignores it).
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);

        // Own session and process group: signals to the group reach the whole job.
        libc::setsid();
        if tty && libc::ioctl(stdio[0], libc::TIOCSCTTY, 0) != 0 {
            fail(Step::Terminal);
        }
        // Move sources out of 0..2 first so the dup2 calls cannot clobber each other.
        let mut src = stdio;
        for fd in src.iter_mut() {
            if *fd < 3 {
                let moved = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 3);
                if moved < 0 {
                    fail(Step::Stdio);
                }
                *fd = moved;
            }
        }
        for (target, fd) in src.iter().enumerate() {
            if libc::dup2(*fd, target as libc::c_int) < 0 {
                fail(Step::Stdio);
            }
        }
        if plan.uid.is_some() || plan.gid.is_some() {
            // Raw syscalls: they affect only this (single) thread, no libc setxid machinery.
            let gid = plan.gid.unwrap_or_else(|| libc::getgid());
            if libc::syscall(libc::SYS_setgroups, 1 as libc::c_long, &gid as *const u32) != 0 {
                fail(Step::Groups);
            }
            if let Some(g) = plan.gid {
                if libc::syscall(libc::SYS_setresgid, g, g, g) != 0 {
                    fail(Step::Gid);
                }
            }
            if let Some(u) = plan.uid {
                if libc::syscall(libc::SYS_setresuid, u, u, u) != 0 {
                    fail(Step::Uid);
                }
            }
        }
        if let Some(cwd) = &plan.cwd {
            if libc::chdir(cwd.as_ptr()) != 0 {
                fail(Step::Chdir);
            }
        }
        libc::execve(plan.program.as_ptr(), argv.as_ptr(), envp.as_ptr());
        fail(Step::Exec)
    }
}

/// Descriptors of a starting exec.
struct Stdio {
    /// What the child gets as fd 0, 1, 2.
    child: Vec<OwnedFd>,
    /// Parent side: stdin writer, stdout reader, stderr reader (pipe mode).
    stdin: Option<OwnedFd>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    /// PTY master (tty mode).
    master: Option<OwnedFd>,
}

impl Stdio {
    fn new(spec: &ExecSpec) -> io::Result<Self> {
        if let Some(size) = spec.tty {
            let (master, slave) = open_pty(size)?;
            let stdin = if spec.stdin {
                Some(master.try_clone()?)
            } else {
                None
            };
            return Ok(Stdio {
                child: vec![slave],
                stdin,
                stdout: None,
                stderr: None,
                master: Some(master),
            });
        }
        let (stdin_child, stdin) = if spec.stdin {
            let (r, w) = pipe()?;
            (r, Some(w))
        } else {
            let null = File::open("/dev/null")?;
            (OwnedFd::from(null), None)
        };
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        Ok(Stdio {
            child: vec![stdin_child, out_w, err_w],
            stdin,
            stdout: Some(out_r),
            stderr: Some(err_r),
            master: None,
        })
    }

    fn child_fds(&self) -> [libc::c_int; 3] {
        match self.child.as_slice() {
            [t] => [t.as_raw_fd(); 3],
            [i, o, e] => [i.as_raw_fd(), o.as_raw_fd(), e.as_raw_fd()],
            _ => [-1; 3],
        }
    }
}

/// A new PTY pair (both close-on-exec), with the window size set.
fn open_pty(size: WinSize) -> io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: posix_openpt opens /dev/ptmx; the result is checked.
    let m = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if m < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: m is a new descriptor we own.
    let master = unsafe { OwnedFd::from_raw_fd(m) };
    // SAFETY: grantpt/unlockpt on our PTY master.
    if unsafe { libc::grantpt(m) } != 0 || unsafe { libc::unlockpt(m) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: TIOCGPTPEER opens the peer of our master and returns a new descriptor.
    let s = unsafe {
        libc::ioctl(
            m,
            libc::TIOCGPTPEER,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: s is a new descriptor we own.
    let slave = unsafe { OwnedFd::from_raw_fd(s) };
    super::set_winsize(m, size)?;
    Ok((master, slave))
}

fn spawn_thread(name: String, f: impl FnOnce() + Send + 'static) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .stack_size(THREAD_STACK)
        .spawn(f)
}

/// What a Spawn adds to an Exec.
pub(crate) struct Keep {
    pub(crate) tag: Option<String>,
    pub(crate) meta: Vec<u8>,
}

/// Where a process's output and exit go.
enum Sink {
    /// A plain Exec: its connection's operation.
    Conn(Arc<Conn>, u32),
    /// A kept process: whoever is attached.
    Kept(Arc<Kept>),
}

impl Sink {
    /// Forwards output; false once nobody can receive it any more (keep draining anyway).
    fn output(&self, msg: &AgentMsg) -> bool {
        match self {
            Sink::Conn(c, id) => c.send(*id, msg),
            Sink::Kept(k) => {
                k.broadcast(msg);
                true
            }
        }
    }
}

/// Starts `spec` for request `id` (a Spawn when `keep` is given): on success `Started`
/// has been sent and helper threads stream output and finally send `Exited`; on error
/// nothing has been sent.
pub(crate) fn start(
    conn: &Arc<Conn>,
    id: u32,
    spec: ExecSpec,
    keep: Option<Keep>,
) -> Result<(), RemoteError> {
    let plan = Plan::new(&spec)?;
    let shared = conn.shared.clone();
    let slot = match &keep {
        Some(_) => Some(shared.procs.reserve()?),
        None => None,
    };
    let name = spec.argv[0].to_string_lossy().into_owned();
    let stdio = Stdio::new(&spec).map_err(|e| RemoteError::from_io(&e, "exec stdio"))?;
    let (err_r, err_w) = pipe().map_err(|e| RemoteError::from_io(&e, "exec pipe"))?;

    let mut argv: Vec<*const libc::c_char> = plan.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = plan.env.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    let child_fds = stdio.child_fds();
    let tty = spec.tty.is_some();
    let err_raw = err_w.as_raw_fd();

    let (pid, ()) = Reaper::global()
        .spawn_watched(|| {
            // SAFETY: fork(2). The child calls only async-signal-safe functions (child_exec)
            // on data prepared above, then execs or _exits.
            let pid = unsafe { libc::fork() };
            if pid < 0 {
                return Err(io::Error::last_os_error());
            }
            if pid == 0 {
                // SAFETY: we are the child right after fork.
                unsafe { child_exec(&plan, &argv, &envp, child_fds, tty, err_raw) };
            }
            Ok((pid, ()))
        })
        .map_err(|e| RemoteError::from_io(&e, "fork"))?;
    drop(err_w);
    let Stdio {
        child,
        stdin,
        stdout,
        stderr,
        master,
    } = stdio;
    drop(child);

    // The error pipe closes on a successful exec; otherwise it carries step + errno.
    let mut report = Vec::with_capacity(5);
    let _ = File::from(err_r).read_to_end(&mut report);
    if report.len() >= 5 {
        Reaper::global().unwatch(pid);
        let errno = i32::from_ne_bytes([report[1], report[2], report[3], report[4]]);
        let err = io::Error::from_raw_os_error(errno);
        // Name what the failing step acted on: the directory for chdir, the program
        // otherwise.
        let subject = match (report[0], spec.cwd.as_deref()) {
            (6, Some(dir)) => dir.display().to_string(),
            _ => name.to_string(),
        };
        return Err(RemoteError::from_io(
            &err,
            format_args!("{} {subject}", step_name(report[0])),
        ));
    }

    let master = master.map(Arc::new);
    let (stdin_tx, stdin_rx) = mpsc::channel();
    let entry = Arc::new(ExecEntry::new(
        pid,
        stdin.as_ref().map(|_| stdin_tx),
        master.clone(),
        keep.is_some(),
    ));
    conn.shared.exec_started();
    let sink = match (keep, slot) {
        (Some(k), Some(slot)) => {
            let info = ProcInfo {
                pid: pid as u32,
                tag: k.tag,
                meta: k.meta,
                argv: spec.argv,
                env: spec.env,
                cwd: spec.cwd,
                tty,
                stdin: spec.stdin,
                exit: None,
            };
            let kept = Arc::new(Kept::new(info, entry.clone()));
            shared.procs.insert(slot, kept.clone());
            // Nothing can be output before the readers start: Started comes first.
            if let Err(e) = kept.attach(conn, id, true) {
                conn.send_err(id, e);
            }
            Sink::Kept(kept)
        }
        _ => {
            conn.execs().insert(id, entry.clone());
            conn.send(id, &AgentMsg::Started { pid: pid as u32 });
            Sink::Conn(conn.clone(), id)
        }
    };
    let sink = Arc::new(sink);
    tracing::debug!(conn = conn.n, id, pid, kept = entry.kept, "started {name}");

    let exited = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    let mut failure = None;
    let outputs: Vec<(OwnedFd, bool)> = match (&master, stdout, stderr) {
        (Some(m), _, _) => match m.try_clone() {
            Ok(fd) => vec![(fd, true)],
            Err(e) => {
                failure = Some(e);
                vec![]
            }
        },
        (None, Some(o), Some(e)) => vec![(o, true), (e, false)],
        _ => vec![],
    };
    for (fd, is_stdout) in outputs {
        let (s, x) = (sink.clone(), exited.clone());
        match spawn_thread(format!("out-{pid}"), move || {
            pump_output(&s, fd, is_stdout, &x)
        }) {
            Ok(h) => readers.push(h),
            Err(e) => failure = Some(e),
        }
    }
    if let Some(fd) = stdin {
        if let Err(e) = spawn_thread(format!("in-{pid}"), move || pump_stdin(fd, stdin_rx, tty)) {
            failure = Some(e);
        }
    }
    if let Some(e) = &failure {
        // Cannot stream: kill it; the waiter still reports how it ended.
        tracing::error!(conn = conn.n, id, "exec helper thread: {e}");
        entry.kill_group();
    }
    let (s, e2) = (sink.clone(), entry.clone());
    let waiter = spawn_thread(format!("wait-{pid}"), move || {
        let status = Reaper::global().wait(pid);
        exited.store(true, Ordering::Relaxed);
        for r in readers {
            let _ = r.join();
        }
        e2.drop_stdin();
        shared.exec_ended();
        finish(
            &shared,
            &s,
            pid,
            status.and_then(ExitStatus::from_wait_status),
        );
    });
    if let Err(e) = waiter {
        // Nobody would report the end: stop it and report a lost status now.
        entry.kill_group();
        Reaper::global().unwatch(pid);
        entry.drop_stdin();
        conn.shared.exec_ended();
        tracing::error!(conn = conn.n, id, "exec waiter thread: {e}");
        finish(&conn.shared, &sink, pid, None);
    }
    Ok(())
}

/// The final frame of a process to wherever its output went.
fn finish(shared: &super::Shared, sink: &Sink, pid: libc::pid_t, status: Option<ExitStatus>) {
    match sink {
        Sink::Conn(c, id) => {
            c.execs().remove(id);
            match status {
                Some(st) => {
                    tracing::debug!(conn = c.n, id, pid, "{st}");
                    c.send(*id, &AgentMsg::Exited(st));
                }
                None => {
                    c.send_err(
                        *id,
                        RemoteError::new(ErrorKind::Internal, "lost the exit status"),
                    );
                }
            }
        }
        Sink::Kept(k) => {
            tracing::debug!(pid, ?status, "kept process ended");
            shared.procs.ended(pid as u32);
            k.finish(status);
        }
    }
}

/// Forwards one output descriptor as Stdout/Stderr frames until EOF (or EIO: the PTY's
/// last slave closed), or until it has been idle for [`EXIT_OUTPUT_GRACE`] after the process
/// exited.
fn pump_output(sink: &Sink, fd: OwnedFd, is_stdout: bool, exited: &AtomicBool) {
    let mut file = File::from(fd);
    let raw = file.as_raw_fd();
    let mut buf = vec![0u8; CHUNK_LEN];
    let mut forward = true;
    let mut idle_since: Option<Instant> = None;
    loop {
        let mut pfd = libc::pollfd {
            fd: raw,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, 100) };
        if rc < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        if rc == 0 {
            if exited.load(Ordering::Relaxed) {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= EXIT_OUTPUT_GRACE {
                    break;
                }
            }
            continue;
        }
        idle_since = None;
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if forward {
                    let data = buf[..n].to_vec();
                    let msg = if is_stdout {
                        AgentMsg::Stdout(data)
                    } else {
                        AgentMsg::Stderr(data)
                    };
                    // Keep draining after the host went away so the process is not blocked.
                    forward = sink.output(&msg);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            // EIO: the PTY has no slave open any more: the normal end in tty mode.
            Err(_) => break,
        }
    }
}

/// Writes host stdin to the process and acknowledges every chunk to the operation that
/// sent it (the host's window). Data for a process that closed its stdin is dropped but
/// still acknowledged. Ends when stdin is closed or the process has ended.
fn pump_stdin(fd: OwnedFd, rx: mpsc::Receiver<StdinCmd>, tty: bool) {
    let mut file = File::from(fd);
    let mut broken = false;
    let mut at_line_start = true;
    for cmd in rx {
        match cmd {
            StdinCmd::Data { data: d, ack } => {
                if !broken && !d.is_empty() {
                    if let Err(e) = file.write_all(&d) {
                        tracing::debug!("stdin: {e}");
                        broken = true;
                    }
                    at_line_start = d.last() == Some(&b'\n');
                }
                let n = u32::try_from(d.len()).unwrap_or(u32::MAX);
                if let Some(c) = ack.0.upgrade() {
                    c.send(ack.1, &AgentMsg::StdinAck(n));
                }
            }
            StdinCmd::Close => {
                if tty && !broken {
                    // EOF on a terminal is VEOF (^D) at the start of a line; a first ^D
                    // pushes out a pending partial line.
                    let eof: &[u8] = if at_line_start { b"\x04" } else { b"\x04\x04" };
                    let _ = file.write_all(eof);
                }
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn env_of(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect()
    }

    #[test]
    fn programs_resolve_along_path() {
        let sh = resolve_program(
            OsStr::new("sh"),
            OsStr::new("/nonexistent:/bin:/usr/bin"),
            None,
        )
        .unwrap();
        assert!(sh.ends_with("sh") && sh.is_absolute(), "{sh:?}");
        let e =
            resolve_program(OsStr::new("no-such-cmd-xyz"), OsStr::new("/bin"), None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        assert_eq!(
            resolve_program(OsStr::new("./x"), OsStr::new("/bin"), None).unwrap(),
            PathBuf::from("./x")
        );
    }

    #[test]
    fn plans_validate_their_input() {
        let spec = |argv: &[&str], env: &[(&str, &str)]| ExecSpec {
            argv: argv.iter().map(OsString::from).collect(),
            env: env_of(env),
            ..Default::default()
        };
        assert_eq!(
            Plan::new(&spec(&[], &[])).err().unwrap().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            Plan::new(&spec(&["sh", "a\0b"], &[])).err().unwrap().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            Plan::new(&spec(&["sh"], &[("A=B", "c")]))
                .err()
                .unwrap()
                .kind,
            ErrorKind::InvalidArgument
        );
        let p = Plan::new(&spec(&["sh"], &[("X", "1")])).unwrap();
        assert_eq!(p.env[0].as_bytes(), b"X=1");
        assert!(p.env[1].as_bytes().starts_with(b"PATH="));
    }
}

//! Running commands in the guest: [`Command`] describes one, [`Exec`] follows a running one.

use std::ffi::OsStr;
use std::io::{self, Write};
use std::path::Path;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use guest_agent::proto::{AgentMsg, ExecSpec, HostMsg};

use super::connection::{Inner, Registration, Window};
use super::{check, recv, unexpected};
use super::{ExitStatus, WinSize};
use crate::error::{Error, Result};

/// A command to run in the guest (builder over the protocol's `ExecSpec`).
///
/// The environment is exactly what is given here (the agent adds only a default `PATH`);
/// the working directory defaults to `/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    spec: ExecSpec,
}

impl Command {
    /// `program` is looked up in the command's `PATH` unless it contains a `/`.
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        Command {
            spec: ExecSpec {
                argv: vec![program.as_ref().to_os_string()],
                ..Default::default()
            },
        }
    }

    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.spec.argv.push(a.as_ref().to_os_string());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.spec
            .argv
            .extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.spec
            .env
            .push((key.as_ref().to_os_string(), value.as_ref().to_os_string()));
        self
    }

    pub fn cwd(mut self, dir: impl AsRef<Path>) -> Self {
        self.spec.cwd = Some(dir.as_ref().to_path_buf());
        self
    }

    pub fn uid(mut self, uid: u32) -> Self {
        self.spec.uid = Some(uid);
        self
    }

    pub fn gid(mut self, gid: u32) -> Self {
        self.spec.gid = Some(gid);
        self
    }

    /// Runs the command on a new pseudo-terminal (stderr is merged into stdout).
    pub fn tty(mut self, size: WinSize) -> Self {
        self.spec.tty = Some(size);
        self
    }

    /// Whether the host will send stdin ([`Exec::take_stdin`]); otherwise it is `/dev/null`.
    pub fn stdin(mut self, yes: bool) -> Self {
        self.spec.stdin = yes;
        self
    }

    /// The protocol message this becomes.
    pub fn spec(&self) -> &ExecSpec {
        &self.spec
    }
}

/// Something a running command did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// The last event.
    Exited(ExitStatus),
}

/// Result of [`super::Client::output`] / [`Exec::wait_with_output`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// A running command.
pub struct Exec {
    inner: Arc<Inner>,
    reg: Registration,
    rx: Receiver<AgentMsg>,
    pid: u32,
    stdin: Option<StdinWriter>,
    done: bool,
}

/// Signals and resizes an exec from any thread (e.g. a signal forwarder).
#[derive(Clone)]
pub struct ExecHandle {
    inner: Arc<Inner>,
    id: u32,
}

impl ExecHandle {
    /// Sends `signal` to the process.
    pub fn signal(&self, signal: i32) -> Result<()> {
        self.signal_impl(signal, false)
    }

    /// Sends `signal` to the process group (the command and what it started).
    pub fn signal_group(&self, signal: i32) -> Result<()> {
        self.signal_impl(signal, true)
    }

    fn signal_impl(&self, signal: i32, group: bool) -> Result<()> {
        let (_reg, rx) = self.inner.start(
            &HostMsg::Signal {
                target: self.id,
                signal,
                group,
            },
            None,
        )?;
        match check(recv(&rx)?)? {
            AgentMsg::Ok => Ok(()),
            m => Err(unexpected("signal", &m)),
        }
    }

    /// Changes the terminal size of a `tty` exec.
    pub fn resize(&self, size: WinSize) -> Result<()> {
        let (_reg, rx) = self.inner.start(
            &HostMsg::Resize {
                target: self.id,
                size,
            },
            None,
        )?;
        match check(recv(&rx)?)? {
            AgentMsg::Ok => Ok(()),
            m => Err(unexpected("resize", &m)),
        }
    }
}

pub(crate) fn spawn(inner: &Arc<Inner>, cmd: &Command) -> Result<Exec> {
    let window = cmd.spec.stdin.then(|| Arc::new(Window::new()));
    start(inner, &HostMsg::Exec(cmd.spec.clone()), window, true)
}

pub(crate) fn spawn_kept(
    inner: &Arc<Inner>,
    cmd: &Command,
    tag: Option<&str>,
    meta: &[u8],
) -> Result<Exec> {
    let window = cmd.spec.stdin.then(|| Arc::new(Window::new()));
    let msg = HostMsg::Spawn {
        spec: cmd.spec.clone(),
        tag: tag.map(String::from),
        meta: meta.to_vec(),
    };
    start(inner, &msg, window, false)
}

pub(crate) fn attach(inner: &Arc<Inner>, pid: u32, output: bool) -> Result<Exec> {
    // Whether the process takes stdin is not known here; bytes for one that does not are
    // acknowledged and dropped by the agent.
    let window = Some(Arc::new(Window::new()));
    let exec = start(inner, &HostMsg::Attach { pid, output }, window, false)?;
    if exec.pid != pid {
        return Err(Error::AgentProtocol(format!(
            "attach to {pid} answered for pid {}",
            exec.pid
        )));
    }
    Ok(exec)
}

/// Sends an Exec/Spawn/Attach and waits for `Started`.
fn start(
    inner: &Arc<Inner>,
    msg: &HostMsg,
    window: Option<Arc<Window>>,
    close_stdin_on_drop: bool,
) -> Result<Exec> {
    let (reg, rx) = inner.start(msg, window.clone())?;
    let pid = match check(recv(&rx)?)? {
        AgentMsg::Started { pid } => pid,
        m => return Err(unexpected("exec", &m)),
    };
    let stdin = window.map(|window| StdinWriter {
        inner: inner.clone(),
        id: reg.id,
        window,
        closed: !close_stdin_on_drop,
    });
    Ok(Exec {
        inner: inner.clone(),
        reg,
        rx,
        pid,
        stdin,
        done: false,
    })
}

pub(crate) fn output(inner: &Arc<Inner>, cmd: &Command, stdin: Option<&[u8]>) -> Result<Output> {
    let cmd = cmd.clone().stdin(stdin.is_some());
    let mut exec = spawn(inner, &cmd)?;
    let writer = exec.take_stdin();
    std::thread::scope(|s| {
        if let (Some(mut w), Some(data)) = (writer, stdin) {
            s.spawn(move || {
                // A command that exits without reading all its input is not an error here.
                let _ = w.write_all(data);
                let _ = w.close();
            });
        }
        exec.wait_with_output()
    })
}

impl Exec {
    /// The request id (the target for signals and resizes).
    pub fn id(&self) -> u32 {
        self.reg.id
    }

    /// The process id in the guest.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The stdin writer (once), if the command was started with [`Command::stdin`].
    pub fn take_stdin(&mut self) -> Option<StdinWriter> {
        self.stdin.take()
    }

    /// A handle to signal or resize this exec from another thread.
    pub fn handle(&self) -> ExecHandle {
        ExecHandle {
            inner: self.inner.clone(),
            id: self.reg.id,
        }
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: i32) -> Result<()> {
        self.handle().signal(signal)
    }

    /// Changes the terminal size of a `tty` exec.
    pub fn resize(&self, size: WinSize) -> Result<()> {
        self.handle().resize(size)
    }

    /// The next event; `None` after [`ExecEvent::Exited`].
    pub fn next_event(&mut self) -> Result<Option<ExecEvent>> {
        if self.done {
            return Ok(None);
        }
        let ev = match recv(&self.rx) {
            Ok(m) => check(m),
            Err(e) => Err(e),
        };
        let ev = match ev {
            Ok(AgentMsg::Stdout(d)) => ExecEvent::Stdout(d),
            Ok(AgentMsg::Stderr(d)) => ExecEvent::Stderr(d),
            Ok(AgentMsg::Exited(st)) => {
                self.done = true;
                ExecEvent::Exited(st)
            }
            Ok(m) => {
                self.done = true;
                return Err(unexpected("exec", &m));
            }
            Err(e) => {
                self.done = true;
                return Err(e);
            }
        };
        Ok(Some(ev))
    }

    /// Closes stdin if still held here, then streams output to the callbacks until the
    /// command exits.
    pub fn wait_with(
        mut self,
        mut on_stdout: impl FnMut(&[u8]),
        mut on_stderr: impl FnMut(&[u8]),
    ) -> Result<ExitStatus> {
        drop(self.stdin.take());
        while let Some(ev) = self.next_event()? {
            match ev {
                ExecEvent::Stdout(d) => on_stdout(&d),
                ExecEvent::Stderr(d) => on_stderr(&d),
                ExecEvent::Exited(st) => return Ok(st),
            }
        }
        Err(Error::AgentProtocol(
            "exec ended without an exit status".into(),
        ))
    }

    /// Closes stdin if still held here and waits, discarding output.
    pub fn wait(self) -> Result<ExitStatus> {
        self.wait_with(|_| {}, |_| {})
    }

    /// Closes stdin if still held here and collects all output, at most
    /// [`super::MAX_OUTPUT`] bytes of stdout and stderr together.
    pub fn wait_with_output(self) -> Result<Output> {
        self.wait_with_output_limit(super::MAX_OUTPUT)
    }

    /// [`Exec::wait_with_output`] with at most `limit` bytes of output kept in memory. A
    /// command that writes more is killed (SIGKILL) and the call fails with
    /// [`Error::AgentOutputTooLarge`] once it has ended.
    pub fn wait_with_output_limit(self, limit: u64) -> Result<Output> {
        use std::cell::Cell;
        let handle = self.handle();
        let (total, over) = (Cell::new(0u64), Cell::new(false));
        let keep = |buf: &mut Vec<u8>, d: &[u8]| {
            if over.get() {
                return;
            }
            total.set(total.get() + d.len() as u64);
            if total.get() > limit {
                over.set(true);
                if let Err(e) = handle.signal(libc::SIGKILL) {
                    tracing::warn!("killing a command whose output is too large: {e}");
                }
            } else {
                buf.extend_from_slice(d);
            }
        };
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let status = self.wait_with(|d| keep(&mut stdout, d), |d| keep(&mut stderr, d))?;
        if over.get() {
            return Err(Error::AgentOutputTooLarge { limit });
        }
        Ok(Output {
            status,
            stdout,
            stderr,
        })
    }
}

/// The command's stdin. Writes block while the agent has 256 KiB unacknowledged; `flush`
/// waits until the agent has written everything to the process. Dropping it closes stdin
/// (EOF for the command; `^D` on a terminal), except for kept processes (spawned with
/// [`super::Client::spawn_kept`] or attached): their stdin is closed only by
/// [`StdinWriter::close`].
pub struct StdinWriter {
    inner: Arc<Inner>,
    id: u32,
    window: Arc<Window>,
    /// Nothing to send on drop.
    closed: bool,
}

impl StdinWriter {
    /// Closes stdin.
    pub fn close(mut self) -> Result<()> {
        self.closed = true;
        self.inner.send(self.id, &HostMsg::StdinClose)
    }
}

impl Write for StdinWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let n = self
            .window
            .reserve(buf.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "the command has exited"))?;
        self.inner
            .send(self.id, &HostMsg::Stdin(buf[..n].to_vec()))
            .map_err(|e| io::Error::new(io::ErrorKind::BrokenPipe, e.to_string()))?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.window.drained() {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the command ended before its stdin was written",
            ))
        }
    }
}

impl Drop for StdinWriter {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self.inner.send(self.id, &HostMsg::StdinClose);
        }
    }
}

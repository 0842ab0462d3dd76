//! `process.Process`: Start, Connect, List, SendInput, CloseStdin, SendSignal, Update.
//!
//! Nothing about a process lives here: processes are the agent's *kept* processes
//! (protocol `Spawn`/`Attach`/`ListProcs`), so they survive the HTTP stream that started
//! them, a pause and resume of the sandbox (the VM keeps them in its snapshot), and a
//! restart of this service. What the client asked for (E2B's `ProcessConfig`: cmd, args,
//! envs, cwd, before the service adds the sandbox's variables) is stored with the process
//! in the agent as its `meta` (protobuf), and its E2B tag as its tag, so `List` reports
//! exactly that.
//!
//! Every `Start`/`Connect` stream is one agent connection attached to the process, read
//! by a blocking pump thread; when the stream ends (client gone, deadline, end of the
//! process) the connection is closed, which detaches it. The unary calls
//! (SendInput, CloseStdin, SendSignal, Update) each attach a control-only handle on a
//! connection of their own for the call (connection setup is a local socket round trip),
//! so nothing is left behind. A `Start` whose `Connect-Timeout-Ms` deadline passes kills
//! the process's group (SIGKILL), as envd does; a `Connect` deadline ends only its stream.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::response::Response;
use prost::Message;
use std::sync::Arc;
use tokio::sync::mpsc;
use vmm::agent::{Client, Command, Exec, ExecEvent, ExecHandle, ExitStatus, ProcInfo, WinSize};

use super::connect::{self, Code, Codec, RpcError};
use super::pb::{self, Event};
use super::{read_body, target_sandbox, DataPlane, SandboxConn, Target};

/// Events buffered per stream before the process's pump waits.
const SUB_DEPTH: usize = 64;
const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";

/// Go's `ProcessState.String()` wording, which envd reports as `status`.
fn status_text(st: &ExitStatus) -> String {
    match st {
        ExitStatus::Exited(c) => format!("exit status {c}"),
        ExitStatus::Signaled { signal, .. } => {
            let name = match *signal {
                libc::SIGKILL => "killed".to_string(),
                libc::SIGTERM => "terminated".to_string(),
                libc::SIGINT => "interrupt".to_string(),
                libc::SIGHUP => "hangup".to_string(),
                libc::SIGPIPE => "broken pipe".to_string(),
                libc::SIGSEGV => "segmentation fault".to_string(),
                libc::SIGABRT => "aborted".to_string(),
                n => format!("signal {n}"),
            };
            format!("signal: {name}")
        }
    }
}

fn end_event(st: &ExitStatus) -> pb::EndEvent {
    let (code, exited) = match st {
        ExitStatus::Exited(c) => (*c, true),
        // Go's ExitCode() is -1 for a process killed by a signal.
        ExitStatus::Signaled { .. } => (-1, false),
    };
    let status = status_text(st);
    pb::EndEvent {
        exit_code: code,
        exited,
        error: (code != 0).then(|| status.clone()),
        status,
    }
}

/// The pump (a blocking thread): an attached process's events to its stream, until its
/// end, the stream's end, or the connection's.
fn pump(sandbox: String, mut exec: Exec, pty: bool, tx: mpsc::Sender<Event>) {
    loop {
        let ev = match exec.next_event() {
            Ok(Some(ExecEvent::Stdout(d))) => Event::Data(pb::DataEvent {
                output: Some(if pty {
                    pb::Output::Pty(d)
                } else {
                    pb::Output::Stdout(d)
                }),
            }),
            Ok(Some(ExecEvent::Stderr(d))) => Event::Data(pb::DataEvent {
                output: Some(pb::Output::Stderr(d)),
            }),
            Ok(Some(ExecEvent::Exited(st))) => {
                let _ = tx.blocking_send(Event::End(end_event(&st)));
                return;
            }
            // The connection closed (stream over, or the sandbox paused): the process
            // runs on; the stream ends without an end event.
            Ok(None) | Err(vmm::Error::AgentDisconnected) => return,
            Err(e) => {
                tracing::warn!(sandbox = %sandbox, pid = exec.pid(), "process stream: {e}");
                return;
            }
        };
        if tx.blocking_send(ev).is_err() {
            return;
        }
    }
}

/// Starts the pump of an attached process; the receiver feeds its stream.
fn start_pump(sb: &SandboxConn, exec: Exec, pty: bool) -> Result<mpsc::Receiver<Event>, RpcError> {
    let (tx, rx) = mpsc::channel(SUB_DEPTH);
    let name = format!("envd-proc-{}", exec.pid());
    let id = sb.id.clone();
    std::thread::Builder::new()
        .name(name)
        .spawn(move || pump(id, exec, pty, tx))
        .map_err(|e| RpcError::new(Code::Internal, format!("starting a thread: {e}")))?;
    Ok(rx)
}

/// Held by a stream: closes its agent connection when the stream ends (which detaches
/// it from the process and ends the pump); `kill` is the `Start` deadline's action.
struct Attached {
    client: Client,
    kill: Option<ExecHandle>,
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.client.close();
    }
}

/// `POST /process.Process/{method}`.
pub(crate) async fn dispatch(
    State(dp): State<Arc<DataPlane>>,
    Path(method): Path<String>,
    req: Request,
) -> Response {
    if method == "StreamInput" {
        return stream_input(dp, req).await;
    }
    let streaming = matches!(method.as_str(), "Start" | "Connect");
    let known = matches!(
        method.as_str(),
        "Start" | "Connect" | "List" | "SendInput" | "CloseStdin" | "SendSignal" | "Update"
    );
    if !known {
        return RpcError::new(
            Code::Unimplemented,
            format!("unknown method process.Process/{method}"),
        )
        .unary_response();
    }
    let codec = match Codec::from_headers(req.headers(), streaming) {
        Ok(c) => c,
        Err(e) => return e.unary_response(),
    };
    let fail = |e: RpcError| {
        if streaming {
            connect::stream_error(codec, &e)
        } else {
            e.unary_response()
        }
    };
    // The (bounded) body is read before the sandbox is looked up: a request answered
    // without reading its body makes the server close the connection, and a client that
    // reuses it at that moment sees it closed (e.g. a command sent to a killed sandbox).
    let target = req.extensions().get::<Target>().cloned();
    let headers = req.headers().clone();
    let body = match read_body(req, connect::MAX_MESSAGE + 5).await {
        Ok(b) => b,
        Err(e) => return fail(e),
    };
    let sb = match target_sandbox(&dp, target).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let msg: &[u8] = if streaming {
        match connect::unwrap_envelope(&body) {
            Ok(m) => m,
            Err(e) => return fail(e),
        }
    } else {
        &body
    };
    let r = match method.as_str() {
        "Start" => match codec.decode(msg) {
            Ok(m) => start(sb, codec, &headers, m).await,
            Err(e) => Err(e),
        },
        "Connect" => match codec.decode(msg) {
            Ok(m) => connect_(sb, codec, &headers, m).await,
            Err(e) => Err(e),
        },
        "List" => match codec.decode::<pb::ListRequest>(msg) {
            Ok(_) => list(sb).await.map(|l| connect::unary_ok(codec, &l)),
            Err(e) => Err(e),
        },
        "SendInput" => match codec.decode(msg) {
            Ok(m) => send_input(sb, m)
                .await
                .map(|_| connect::unary_ok(codec, &pb::Empty {})),
            Err(e) => Err(e),
        },
        "CloseStdin" => match codec.decode(msg) {
            Ok(m) => close_stdin(sb, m)
                .await
                .map(|_| connect::unary_ok(codec, &pb::Empty {})),
            Err(e) => Err(e),
        },
        "SendSignal" => match codec.decode(msg) {
            Ok(m) => send_signal(sb, m)
                .await
                .map(|_| connect::unary_ok(codec, &pb::Empty {})),
            Err(e) => Err(e),
        },
        _ => match codec.decode(msg) {
            Ok(m) => update(sb, m)
                .await
                .map(|_| connect::unary_ok(codec, &pb::Empty {})),
            Err(e) => Err(e),
        },
    };
    r.unwrap_or_else(fail)
}

/// Runs blocking agent work off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, RpcError> + Send + 'static,
) -> Result<T, RpcError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RpcError::new(Code::Internal, format!("worker: {e}")))?
}

fn not_found(sel: &pb::Selector) -> RpcError {
    let what = match sel {
        pb::Selector::Pid(pid) => format!("pid {pid}"),
        pb::Selector::Tag(t) => format!("tag '{t}'"),
    };
    RpcError::new(Code::NotFound, format!("process with {what} not found"))
}

fn selector(sel: Option<&pb::ProcessSelector>) -> Result<pb::Selector, RpcError> {
    sel.and_then(|s| s.selector.clone()).ok_or_else(|| {
        RpcError::new(
            Code::InvalidArgument,
            "a process selector (pid or tag) is required",
        )
    })
}

/// The agent's kept processes (running and recently ended).
fn agent_procs(sb: &SandboxConn) -> Result<Vec<ProcInfo>, RpcError> {
    sb.with_client(|c| c.list_procs())
}

/// The running process a selector names (blocking).
fn resolve(sb: &SandboxConn, sel: &pb::Selector) -> Result<ProcInfo, RpcError> {
    agent_procs(sb)?
        .into_iter()
        .filter(|p| p.exit.is_none())
        .find(|p| match sel {
            pb::Selector::Pid(pid) => p.pid == *pid,
            pb::Selector::Tag(t) => p.tag.as_deref() == Some(t.as_str()),
        })
        .ok_or_else(|| not_found(sel))
}

/// Attaches to `pid` on a new connection (blocking); an agent NotFound becomes ours.
fn attach(sb: &SandboxConn, pid: u32, output: bool) -> Result<(Client, Exec), RpcError> {
    let client = sb.connect_new()?;
    match client.attach(pid, output) {
        Ok(exec) => Ok((client, exec)),
        Err(vmm::Error::Agent(e)) if e.kind == vmm::agent::ErrorKind::NotFound => {
            Err(not_found(&pb::Selector::Pid(pid)))
        }
        Err(e) => Err(RpcError::from(e)),
    }
}

async fn start(
    sb: Arc<SandboxConn>,
    codec: Codec,
    headers: &HeaderMap,
    req: pb::StartRequest,
) -> Result<Response, RpcError> {
    let config = req
        .process
        .ok_or_else(|| RpcError::new(Code::InvalidArgument, "process config is required"))?;
    if config.cmd.is_empty() {
        return Err(RpcError::new(Code::InvalidArgument, "cmd is empty"));
    }
    if config.cmd.contains('\0') || config.args.iter().any(|a| a.contains('\0')) {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "NUL byte in the command",
        ));
    }
    let user_name = super::basic_user(headers);
    let pty = req.pty.map(|p| p.size.unwrap_or_default());
    // Clients before envd 0.3.0 always had stdin; the SDK sends `stdin` explicitly.
    let want_stdin = pty.is_some() || req.stdin.unwrap_or(true);
    let tag = req.tag;
    let sb2 = sb.clone();
    let (pid, attached, rx) = blocking(move || {
        let user = sb2.user(user_name.as_deref())?;
        let mut cmd = Command::new(&config.cmd).args(&config.args);
        // E2B's variables, under the sandbox's own (create time) and the command's.
        for (k, v) in [
            ("E2B_SANDBOX", "true"),
            ("E2B_SANDBOX_ID", sb2.id.as_str()),
            ("E2B_TEMPLATE_ID", sb2.template.as_str()),
        ] {
            cmd = cmd.env(k, v);
        }
        for (k, v) in &sb2.env {
            cmd = cmd.env(k, v);
        }
        let home = user.home.to_string_lossy().into_owned();
        for (k, v) in [
            ("HOME", home.as_str()),
            ("USER", &user.name),
            ("LOGNAME", &user.name),
        ] {
            if !config.envs.contains_key(k) {
                cmd = cmd.env(k, v);
            }
        }
        for (k, v) in &config.envs {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    format!("invalid environment variable {k:?}"),
                ));
            }
            cmd = cmd.env(k, v);
        }
        cmd = cmd.cwd(user.resolve(start_dir(config.cwd.as_deref(), sb2.default_cwd.as_deref())));
        if user.uid != 0 {
            cmd = cmd.uid(user.uid).gid(user.gid);
        }
        if let Some(size) = &pty {
            cmd = cmd.tty(WinSize {
                rows: size.rows.clamp(1, u16::MAX as u32) as u16,
                cols: size.cols.clamp(1, u16::MAX as u32) as u16,
            });
        }
        cmd = cmd.stdin(want_stdin);
        let client = sb2.connect_new()?;
        let meta = config.encode_to_vec();
        let exec = client
            .spawn_kept(&cmd, tag.as_deref(), &meta)
            .map_err(|e| {
                let mut r = RpcError::from(e);
                r.message = format!("starting {}: {}", config.cmd, r.message);
                r
            })?;
        let pid = exec.pid();
        let attached = Attached {
            client,
            kill: Some(exec.handle()),
        };
        let rx = start_pump(&sb2, exec, pty.is_some())?;
        Ok((pid, attached, rx))
    })
    .await?;
    tracing::debug!(sandbox = %sb.id, pid, "process started");
    Ok(stream(codec, headers, pid, rx, attached))
}

async fn connect_(
    sb: Arc<SandboxConn>,
    codec: Codec,
    headers: &HeaderMap,
    req: pb::SelectorRequest,
) -> Result<Response, RpcError> {
    let sel = selector(req.process.as_ref())?;
    let (pid, attached, rx) = blocking(move || {
        let (pid, pty) = match &sel {
            // By pid: a process that ended a moment ago still yields its end.
            pb::Selector::Pid(pid) => (*pid, None),
            pb::Selector::Tag(_) => {
                let p = resolve(&sb, &sel)?;
                (p.pid, Some(p.tty))
            }
        };
        let pty = match pty {
            Some(t) => t,
            None => agent_procs(&sb)?
                .iter()
                .find(|p| p.pid == pid)
                .is_some_and(|p| p.tty),
        };
        let (client, exec) = attach(&sb, pid, true)?;
        let rx = start_pump(&sb, exec, pty)?;
        Ok((pid, Attached { client, kill: None }, rx))
    })
    .await?;
    Ok(stream(codec, headers, pid, rx, attached))
}

/// The response stream of Start/Connect: the start event, the process's events as they
/// come (keepalives in between if the client asked for them), the end, end-of-stream. A
/// `Connect-Timeout-Ms` deadline ends the stream with `deadline_exceeded`, after killing
/// the process if `attached` says so (a Start).
fn stream(
    codec: Codec,
    headers: &HeaderMap,
    pid: u32,
    mut rx: mpsc::Receiver<Event>,
    attached: Attached,
) -> Response {
    let keepalive = headers
        .get(KEEPALIVE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs);
    let deadline = connect::timeout(headers).map(|d| tokio::time::Instant::now() + d);
    let (tx, out) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let enc = move |e: Event| connect::envelope(&codec.encode(&pb::EventResponse::new(e)));
    tokio::spawn(async move {
        // Dropped at the end of this task, whichever way it ends: detaches.
        let mut attached = attached;
        let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86400);
        let sleep = tokio::time::sleep_until(deadline.unwrap_or(far));
        tokio::pin!(sleep);
        // `None`: the client went away.
        let end: Option<Option<RpcError>> = 'stream: {
            if tx
                .send(Ok(enc(Event::Start(pb::StartEvent { pid }))))
                .await
                .is_err()
            {
                break 'stream None;
            }
            let mut ka = tokio::time::interval(keepalive.unwrap_or(Duration::from_secs(3600)));
            ka.tick().await;
            loop {
                tokio::select! {
                    ev = rx.recv() => match ev {
                        Some(ev) => {
                            let last = matches!(ev, Event::End(_));
                            if last {
                                // Ended by itself: nothing left to kill.
                                attached.kill = None;
                            }
                            if tx.send(Ok(enc(ev))).await.is_err() {
                                break 'stream None;
                            }
                            if last {
                                break 'stream Some(None);
                            }
                        }
                        None => {
                            // The agent connection is gone (a pause): it cannot kill any more.
                            attached.kill = None;
                            break 'stream Some(Some(RpcError::new(
                                Code::Unavailable,
                                "the connection to the process was lost (the sandbox was paused?); it may still run: connect to it again",
                            )));
                        }
                    },
                    _ = ka.tick(), if keepalive.is_some() => {
                        if tx.send(Ok(enc(Event::Keepalive(pb::Empty {})))).await.is_err() {
                            break 'stream None;
                        }
                    }
                    _ = tx.closed() => break 'stream None,
                    _ = &mut sleep => {
                        let msg = if kill_timed_out(pid, &mut attached).await {
                            "the command's timeout passed: it was killed"
                        } else {
                            "the stream's deadline passed (the process keeps running)"
                        };
                        break 'stream Some(Some(RpcError::new(Code::DeadlineExceeded, msg)));
                    }
                }
            }
        };
        match end {
            Some(err) => {
                let _ = tx.send(Ok(connect::end_envelope(err.as_ref()))).await;
            }
            // The client left before the command's timeout: the timeout still applies.
            None if attached.kill.is_some() && deadline.is_some() => {
                drop(rx);
                sleep.await;
                kill_timed_out(pid, &mut attached).await;
            }
            None => {}
        }
    });
    let body = connect::coalesced_body(out);
    connect::stream_response(codec, body)
}

/// A Start's timeout: SIGKILL to the process group (envd's behaviour). False if this
/// stream does not own a timeout (a Connect).
async fn kill_timed_out(pid: u32, attached: &mut Attached) -> bool {
    let Some(h) = attached.kill.take() else {
        return false;
    };
    let r = tokio::task::spawn_blocking(move || h.signal_group(libc::SIGKILL)).await;
    if let Ok(Err(e)) = r {
        // It ended meanwhile (UnknownId), or the sandbox went away.
        tracing::debug!(pid, "killing a timed-out process: {e}");
    }
    true
}

/// What `List` shows of a kept process: the config its client gave (from `meta`), or,
/// for a process started otherwise, what the agent knows.
fn process_info(p: ProcInfo) -> pb::ProcessInfo {
    let config = pb::ProcessConfig::decode(p.meta.as_slice())
        .ok()
        .filter(|c| !c.cmd.is_empty())
        .unwrap_or_else(|| {
            let s = |o: &std::ffi::OsStr| o.to_string_lossy().into_owned();
            pb::ProcessConfig {
                cmd: p.argv.first().map(|a| s(a)).unwrap_or_default(),
                args: p.argv.iter().skip(1).map(|a| s(a)).collect(),
                envs: p.env.iter().map(|(k, v)| (s(k), s(v))).collect(),
                cwd: p.cwd.as_ref().map(|c| c.to_string_lossy().into_owned()),
            }
        });
    pb::ProcessInfo {
        config: Some(config),
        pid: p.pid,
        tag: p.tag,
    }
}

async fn list(sb: Arc<SandboxConn>) -> Result<pb::ListResponse, RpcError> {
    let procs = blocking(move || agent_procs(&sb)).await?;
    let mut processes: Vec<pb::ProcessInfo> = procs
        .into_iter()
        .filter(|p| p.exit.is_none())
        .map(process_info)
        .collect();
    processes.sort_by_key(|p| p.pid);
    Ok(pb::ListResponse { processes })
}

async fn send_input(sb: Arc<SandboxConn>, req: pb::SendInputRequest) -> Result<(), RpcError> {
    let sel = selector(req.process.as_ref())?;
    let data = match req.input.and_then(|i| i.input) {
        Some(pb::Input::Stdin(d)) | Some(pb::Input::Pty(d)) => d,
        None => return Err(RpcError::new(Code::InvalidArgument, "input is required")),
    };
    blocking(move || {
        use std::io::Write;
        let p = resolve(&sb, &sel)?;
        if !p.stdin {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                format!("process {} was not started with stdin", p.pid),
            ));
        }
        let (_client, mut exec) = attach(&sb, p.pid, false)?;
        let mut w = exec
            .take_stdin()
            .ok_or_else(|| RpcError::new(Code::Internal, "attachment without stdin"))?;
        // Written and acknowledged by the agent before the call returns.
        w.write_all(&data)
            .and_then(|_| w.flush())
            .map_err(|e| RpcError::new(Code::FailedPrecondition, format!("stdin: {e}")))
    })
    .await
}

/// `StreamInput`, a client stream: a `start` naming the process, then `data` (stdin or
/// PTY bytes, written in order, each acknowledged by the agent before the next) and
/// `keepalive` messages; the answer (one empty message, then the end of the stream) comes
/// once the client's stream ended and everything was written. Each message is bounded
/// ([`connect::MAX_MESSAGE`]); at most [`STREAM_INPUT_QUEUE`] wait for the agent, so a
/// slow process slows the client instead of filling memory.
async fn stream_input(dp: Arc<DataPlane>, req: Request) -> Response {
    use futures_util::StreamExt;
    let codec = match Codec::from_headers(req.headers(), true) {
        Ok(c) => c,
        Err(e) => return e.unary_response(),
    };
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let mut body = req.into_body().into_data_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut writer: Option<InputWriter> = None;
    let mut ended = false;
    let result: Result<(), RpcError> = loop {
        // Every whole envelope in the buffer, in order.
        match connect::next_envelope(&buf) {
            Err(e) => break Err(e),
            Ok(Some((msg, used))) => {
                let m: pb::StreamInputRequest = match codec.decode(msg) {
                    Ok(m) => m,
                    Err(e) => break Err(e),
                };
                buf.drain(..used);
                match (m.event, &writer) {
                    (Some(pb::StreamInputEvent::Start(st)), None) => {
                        match start_input(sb.clone(), st).await {
                            Ok(w) => writer = Some(w),
                            Err(e) => break Err(e),
                        }
                    }
                    (Some(pb::StreamInputEvent::Start(_)), Some(_)) => {
                        break Err(RpcError::new(Code::InvalidArgument, "a second start event"))
                    }
                    (_, None) => {
                        break Err(RpcError::new(
                            Code::InvalidArgument,
                            "the stream must begin with a start event",
                        ))
                    }
                    (Some(pb::StreamInputEvent::Data(d)), Some((tx, _))) => {
                        let data = match d.input.and_then(|i| i.input) {
                            Some(pb::Input::Stdin(b)) | Some(pb::Input::Pty(b)) => b,
                            None => {
                                break Err(RpcError::new(
                                    Code::InvalidArgument,
                                    "input is required",
                                ))
                            }
                        };
                        if tx.send(data).await.is_err() {
                            // The writer stopped: its error is the answer.
                            break Ok(());
                        }
                    }
                    (Some(pb::StreamInputEvent::Keepalive(_)) | None, Some(_)) => {}
                }
                continue;
            }
            Ok(None) if ended => {
                if !buf.is_empty() {
                    break Err(RpcError::new(
                        Code::InvalidArgument,
                        "bad envelope: the stream ended inside a message",
                    ));
                }
                break Ok(());
            }
            Ok(None) => {}
        }
        match body.next().await {
            Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
            Some(Err(e)) => {
                break Err(RpcError::new(
                    Code::Canceled,
                    format!("reading the request: {e}"),
                ))
            }
            None => ended = true,
        }
    };
    if !ended {
        // Refused before the client's stream ended: read (a bounded amount of) what it
        // still sends, so that the connection stays usable for its next request: a server
        // that answers without reading the body closes the connection, and a client that
        // reuses it at that moment sees it closed.
        let drain = async {
            let mut left = connect::MAX_MESSAGE;
            while let Some(Ok(chunk)) = body.next().await {
                left = left.saturating_sub(chunk.len());
                if left == 0 {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
    }
    let written = match writer {
        Some((tx, worker)) => {
            drop(tx);
            match worker.await {
                Ok(r) => r,
                Err(e) => Err(RpcError::new(Code::Internal, format!("worker: {e}"))),
            }
        }
        None if result.is_ok() => Err(RpcError::new(
            Code::InvalidArgument,
            "the stream must begin with a start event",
        )),
        None => Ok(()),
    };
    match result.and(written) {
        Ok(()) => {
            let mut out = connect::envelope(&codec.encode(&pb::Empty {})).to_vec();
            out.extend_from_slice(&connect::end_envelope(None));
            connect::stream_response(codec, axum::body::Body::from(out))
        }
        Err(e) => connect::stream_error(codec, &e),
    }
}

/// Messages of a `StreamInput` waiting for the agent.
const STREAM_INPUT_QUEUE: usize = 8;

/// A `StreamInput`'s feed to its process (see [`start_input`]).
type InputWriter = (
    tokio::sync::mpsc::Sender<Vec<u8>>,
    tokio::task::JoinHandle<Result<(), RpcError>>,
);

/// `StreamInput`'s start: the process's stdin, written by a blocking worker fed by the
/// returned channel; the worker ends with the channel, answering how the writes went.
async fn start_input(
    sb: Arc<SandboxConn>,
    st: pb::StreamInputStart,
) -> Result<InputWriter, RpcError> {
    let sel = selector(st.process.as_ref())?;
    let (client, mut exec) = blocking(move || {
        let p = resolve(&sb, &sel)?;
        if !p.stdin {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                format!("process {} was not started with stdin", p.pid),
            ));
        }
        attach(&sb, p.pid, false)
    })
    .await?;
    let mut w = exec
        .take_stdin()
        .ok_or_else(|| RpcError::new(Code::Internal, "attachment without stdin"))?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(STREAM_INPUT_QUEUE);
    let worker = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let _keep = (client, exec);
        while let Some(data) = rx.blocking_recv() {
            w.write_all(&data)
                .and_then(|_| w.flush())
                .map_err(|e| RpcError::new(Code::FailedPrecondition, format!("stdin: {e}")))?;
        }
        Ok(())
    });
    Ok((tx, worker))
}

async fn close_stdin(sb: Arc<SandboxConn>, req: pb::SelectorRequest) -> Result<(), RpcError> {
    let sel = selector(req.process.as_ref())?;
    blocking(move || {
        let pid = match &sel {
            pb::Selector::Pid(pid) => *pid,
            pb::Selector::Tag(_) => resolve(&sb, &sel)?.pid,
        };
        let (_client, mut exec) = attach(&sb, pid, false)?;
        match exec.take_stdin() {
            Some(w) => w.close().map_err(RpcError::from),
            None => Ok(()),
        }
    })
    .await
}

async fn send_signal(sb: Arc<SandboxConn>, req: pb::SendSignalRequest) -> Result<(), RpcError> {
    let sel = selector(req.process.as_ref())?;
    let sig = match pb::Signal::try_from(req.signal) {
        Ok(pb::Signal::Sigkill) => libc::SIGKILL,
        Ok(pb::Signal::Sigterm) => libc::SIGTERM,
        _ => {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("unsupported signal {}", req.signal),
            ))
        }
    };
    blocking(move || {
        let pid = match &sel {
            pb::Selector::Pid(pid) => *pid,
            pb::Selector::Tag(_) => resolve(&sb, &sel)?.pid,
        };
        let (_client, exec) = attach(&sb, pid, false)?;
        match exec.handle().signal_group(sig) {
            // It has ended (an attachment to an ended process names nothing).
            Err(vmm::Error::Agent(e)) if e.kind == vmm::agent::ErrorKind::UnknownId => Err(
                RpcError::new(Code::NotFound, format!("process {pid} has ended")),
            ),
            r => r.map_err(RpcError::from),
        }
    })
    .await
}

async fn update(sb: Arc<SandboxConn>, req: pb::UpdateRequest) -> Result<(), RpcError> {
    let sel = selector(req.process.as_ref())?;
    let Some(size) = req.pty.and_then(|p| p.size) else {
        // Nothing to change; the process must still exist.
        return blocking(move || resolve(&sb, &sel).map(|_| ())).await;
    };
    let ws = WinSize {
        rows: size.rows.clamp(1, u16::MAX as u32) as u16,
        cols: size.cols.clamp(1, u16::MAX as u32) as u16,
    };
    blocking(move || {
        let p = resolve(&sb, &sel)?;
        if !p.tty {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                format!("process {} has no terminal", p.pid),
            ));
        }
        let (_client, exec) = attach(&sb, p.pid, false)?;
        exec.resize(ws).map_err(RpcError::from)
    })
    .await
}

/// The working directory a command starts in, before the user's home resolves it: the one
/// it names, else its template's (envd's default workdir), else "" (the home).
fn start_dir<'a>(named: Option<&'a str>, template: Option<&'a str>) -> &'a str {
    match named {
        Some(c) if !c.is_empty() => c,
        _ => template.unwrap_or(""),
    }
}

#[cfg(test)]
mod tests {
    use super::start_dir;

    #[test]
    fn a_command_starts_where_it_says_else_in_its_templates_workdir_else_home() {
        assert_eq!(start_dir(Some("/tmp"), Some("/srv")), "/tmp");
        assert_eq!(start_dir(Some("rel"), Some("/srv")), "rel");
        assert_eq!(start_dir(Some(""), Some("/srv")), "/srv");
        assert_eq!(start_dir(None, Some("/srv")), "/srv");
        assert_eq!(start_dir(None, None), "");
    }
}

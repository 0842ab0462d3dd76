//! `process.Process`: Start, Connect, List, SendInput, CloseStdin, SendSignal, Update.
//!
//! Each started process is a [`Proc`] in its sandbox's table, with an agent connection of
//! its own (the agent ties an exec's life to its connection) and a pump thread that reads
//! the exec's events and hands them to the streams subscribed to it (the `Start` stream,
//! `Connect` streams). A stream that goes away unsubscribes; the process runs on (E2B's
//! `disconnect()` semantics). Subscribers' channels are bounded, so a slow client slows
//! that process's output, nothing else.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::response::Response;
use tokio::sync::mpsc;
use vmm::agent::{Command, ExecEvent, ExecHandle, ExitStatus, StdinWriter, WinSize};

use super::connect::{self, Code, Codec, RpcError};
use super::pb::{self, Event};
use super::{lock, read_body, target_sandbox, DataPlane, SandboxConn, Target};

/// Events buffered per subscriber before the process's pump waits.
const SUB_DEPTH: usize = 64;
/// Longest stdin chunk accepted in one SendInput (the message limit bounds it anyway).
const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";

struct Subs {
    list: Vec<mpsc::Sender<Event>>,
    end: Option<pb::EndEvent>,
}

/// A process started through the data plane.
pub(crate) struct Proc {
    pid: u32,
    tag: Option<String>,
    config: pb::ProcessConfig,
    pty: bool,
    handle: ExecHandle,
    stdin: Mutex<Option<StdinWriter>>,
    subs: Mutex<Subs>,
}

impl Proc {
    /// A receiver of this process's events from now on (just its end if it has ended).
    fn subscribe(&self) -> mpsc::Receiver<Event> {
        let (tx, rx) = mpsc::channel(SUB_DEPTH);
        let mut s = lock(&self.subs);
        match &s.end {
            Some(end) => {
                let _ = tx.try_send(Event::End(end.clone()));
            }
            None => s.list.push(tx),
        }
        rx
    }

    /// Hands `ev` to every subscriber (blocking: runs on the pump thread).
    fn broadcast(&self, ev: &Event) {
        let subs: Vec<_> = lock(&self.subs).list.clone();
        let mut gone = Vec::new();
        for s in &subs {
            if s.blocking_send(ev.clone()).is_err() {
                gone.push(s.clone());
            }
        }
        if !gone.is_empty() {
            lock(&self.subs)
                .list
                .retain(|s| !gone.iter().any(|g| g.same_channel(s)));
        }
    }
}

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

/// The pump: the exec's events to the subscribers, then the end, then out of the table.
fn pump(sb: Arc<SandboxConn>, proc_: Arc<Proc>, mut exec: vmm::agent::Exec) {
    let end = loop {
        match exec.next_event() {
            Ok(Some(ExecEvent::Stdout(d))) => {
                let out = if proc_.pty {
                    pb::Output::Pty(d)
                } else {
                    pb::Output::Stdout(d)
                };
                proc_.broadcast(&Event::Data(pb::DataEvent { output: Some(out) }));
            }
            Ok(Some(ExecEvent::Stderr(d))) => proc_.broadcast(&Event::Data(pb::DataEvent {
                output: Some(pb::Output::Stderr(d)),
            })),
            Ok(Some(ExecEvent::Exited(st))) => break end_event(&st),
            Ok(None) => {
                break pb::EndEvent {
                    exit_code: -1,
                    status: "ended without an exit status".into(),
                    error: Some("ended without an exit status".into()),
                    ..Default::default()
                }
            }
            Err(e) => {
                tracing::warn!(sandbox = %sb.id, pid = proc_.pid, "process stream: {e}");
                break pb::EndEvent {
                    exit_code: -1,
                    status: "error".into(),
                    error: Some(format!("lost the process: {e}")),
                    ..Default::default()
                };
            }
        }
    };
    let subs = {
        let mut s = lock(&proc_.subs);
        s.end = Some(end.clone());
        std::mem::take(&mut s.list)
    };
    lock(&sb.procs).remove(&proc_.pid);
    drop(lock(&proc_.stdin).take());
    for s in subs {
        let _ = s.blocking_send(Event::End(end.clone()));
    }
}

/// `POST /process.Process/{method}`.
pub(crate) async fn dispatch(
    State(dp): State<Arc<DataPlane>>,
    Path(method): Path<String>,
    req: Request,
) -> Response {
    let streaming = matches!(method.as_str(), "Start" | "Connect");
    let known = matches!(
        method.as_str(),
        "Start" | "Connect" | "List" | "SendInput" | "CloseStdin" | "SendSignal" | "Update"
    );
    if !known {
        let e = if method == "StreamInput" {
            RpcError::new(
                Code::Unimplemented,
                "process.Process/StreamInput is not served (use SendInput)",
            )
        } else {
            RpcError::new(
                Code::Unimplemented,
                format!("unknown method process.Process/{method}"),
            )
        };
        return e.unary_response();
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
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let headers = req.headers().clone();
    let body = match read_body(req, connect::MAX_MESSAGE + 5).await {
        Ok(b) => b,
        Err(e) => return fail(e),
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
            Ok(m) => connect_(sb, codec, &headers, m),
            Err(e) => Err(e),
        },
        "List" => codec
            .decode::<pb::ListRequest>(msg)
            .map(|_| connect::unary_ok(codec, &list(&sb))),
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

fn find(sb: &SandboxConn, sel: Option<&pb::ProcessSelector>) -> Result<Arc<Proc>, RpcError> {
    let procs = lock(&sb.procs);
    let found = match sel.and_then(|s| s.selector.as_ref()) {
        Some(pb::Selector::Pid(pid)) => procs.get(pid).cloned(),
        Some(pb::Selector::Tag(tag)) => procs
            .values()
            .find(|p| p.tag.as_deref() == Some(tag.as_str()))
            .cloned(),
        None => {
            return Err(RpcError::new(
                Code::InvalidArgument,
                "a process selector (pid or tag) is required",
            ))
        }
    };
    found.ok_or_else(|| {
        let what = match sel.and_then(|s| s.selector.as_ref()) {
            Some(pb::Selector::Pid(pid)) => format!("pid {pid}"),
            Some(pb::Selector::Tag(t)) => format!("tag '{t}'"),
            None => String::new(),
        };
        RpcError::new(Code::NotFound, format!("process with {what} not found"))
    })
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
    let (proc_, rx) = tokio::task::spawn_blocking(move || {
        let user = sb2.user(user_name.as_deref())?;
        let mut cmd = Command::new(&config.cmd).args(&config.args);
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
        cmd = cmd.cwd(user.resolve(config.cwd.as_deref().unwrap_or("")));
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
        let mut exec = client.spawn(&cmd).map_err(|e| {
            let mut r = RpcError::from(e);
            r.message = format!("starting {}: {}", config.cmd, r.message);
            r
        })?;
        let proc_ = Arc::new(Proc {
            pid: exec.pid(),
            tag,
            config,
            pty: pty.is_some(),
            handle: exec.handle(),
            stdin: Mutex::new(exec.take_stdin()),
            subs: Mutex::new(Subs {
                list: Vec::new(),
                end: None,
            }),
        });
        let rx = proc_.subscribe();
        lock(&sb2.procs).insert(proc_.pid, proc_.clone());
        let (p2, sb3) = (proc_.clone(), sb2.clone());
        std::thread::Builder::new()
            .name(format!("envd-proc-{}", proc_.pid))
            .spawn(move || {
                // The exec's connection lives as long as the pump.
                let _client = client;
                pump(sb3, p2, exec)
            })
            .map_err(|e| RpcError::new(Code::Internal, format!("starting a thread: {e}")))?;
        Ok::<_, RpcError>((proc_, rx))
    })
    .await
    .map_err(|e| RpcError::new(Code::Internal, format!("worker: {e}")))??;
    tracing::debug!(sandbox = %sb.id, pid = proc_.pid, "process started");
    Ok(stream(codec, headers, proc_.pid, rx))
}

fn connect_(
    sb: Arc<SandboxConn>,
    codec: Codec,
    headers: &HeaderMap,
    req: pb::SelectorRequest,
) -> Result<Response, RpcError> {
    let p = find(&sb, req.process.as_ref())?;
    let rx = p.subscribe();
    Ok(stream(codec, headers, p.pid, rx))
}

/// The response stream of Start/Connect: the start event, the process's events as they
/// come (keepalives in between if the client asked for them), the end, end-of-stream. A
/// `Connect-Timeout-Ms` deadline ends the stream (not the process) with
/// `deadline_exceeded`.
fn stream(codec: Codec, headers: &HeaderMap, pid: u32, mut rx: mpsc::Receiver<Event>) -> Response {
    let keepalive = headers
        .get(KEEPALIVE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs);
    let deadline = connect::timeout(headers).map(|d| tokio::time::Instant::now() + d);
    let (tx, mut out) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let enc = move |e: Event| connect::envelope(&codec.encode(&pb::EventResponse::new(e)));
    tokio::spawn(async move {
        if tx
            .send(Ok(enc(Event::Start(pb::StartEvent { pid }))))
            .await
            .is_err()
        {
            return;
        }
        let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86400);
        let sleep = tokio::time::sleep_until(deadline.unwrap_or(far));
        tokio::pin!(sleep);
        let mut ka = tokio::time::interval(keepalive.unwrap_or(Duration::from_secs(3600)));
        ka.tick().await;
        let err = loop {
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => {
                        let last = matches!(ev, Event::End(_));
                        if tx.send(Ok(enc(ev))).await.is_err() {
                            return;
                        }
                        if last {
                            break None;
                        }
                    }
                    None => break Some(RpcError::new(Code::Unavailable, "the process stream ended")),
                },
                _ = ka.tick(), if keepalive.is_some() => {
                    if tx.send(Ok(enc(Event::Keepalive(pb::Empty {})))).await.is_err() {
                        return;
                    }
                }
                _ = &mut sleep => break Some(RpcError::new(
                    Code::DeadlineExceeded,
                    "the stream's deadline passed (the process keeps running)",
                )),
            }
        };
        let _ = tx.send(Ok(connect::end_envelope(err.as_ref()))).await;
    });
    let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| out.poll_recv(cx)));
    connect::stream_response(codec, body)
}

fn list(sb: &SandboxConn) -> pb::ListResponse {
    let mut processes: Vec<pb::ProcessInfo> = lock(&sb.procs)
        .values()
        .map(|p| pb::ProcessInfo {
            config: Some(p.config.clone()),
            pid: p.pid,
            tag: p.tag.clone(),
        })
        .collect();
    processes.sort_by_key(|p| p.pid);
    pb::ListResponse { processes }
}

async fn send_input(sb: Arc<SandboxConn>, req: pb::SendInputRequest) -> Result<(), RpcError> {
    let p = find(&sb, req.process.as_ref())?;
    let data = match req.input.and_then(|i| i.input) {
        Some(pb::Input::Stdin(d)) | Some(pb::Input::Pty(d)) => d,
        None => return Err(RpcError::new(Code::InvalidArgument, "input is required")),
    };
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut g = lock(&p.stdin);
        let w = g.as_mut().ok_or_else(|| {
            RpcError::new(
                Code::FailedPrecondition,
                format!(
                    "process {} has no stdin (not started with stdin, or closed)",
                    p.pid
                ),
            )
        })?;
        w.write_all(&data)
            .map_err(|e| RpcError::new(Code::FailedPrecondition, format!("stdin: {e}")))
    })
    .await
    .map_err(|e| RpcError::new(Code::Internal, format!("worker: {e}")))?
}

async fn close_stdin(sb: Arc<SandboxConn>, req: pb::SelectorRequest) -> Result<(), RpcError> {
    let p = find(&sb, req.process.as_ref())?;
    let w = lock(&p.stdin).take();
    match w {
        Some(w) => w.close().map_err(RpcError::from),
        // Closing twice, or a process without stdin: nothing to do.
        None => Ok(()),
    }
}

async fn send_signal(sb: Arc<SandboxConn>, req: pb::SendSignalRequest) -> Result<(), RpcError> {
    let p = find(&sb, req.process.as_ref())?;
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
    tokio::task::spawn_blocking(move || match p.handle.signal_group(sig) {
        // It ended meanwhile.
        Err(vmm::Error::Agent(e)) if e.kind == guest_agent::proto::ErrorKind::UnknownId => Err(
            RpcError::new(Code::NotFound, format!("process {} has ended", p.pid)),
        ),
        r => r.map_err(RpcError::from),
    })
    .await
    .map_err(|e| RpcError::new(Code::Internal, format!("worker: {e}")))?
}

async fn update(sb: Arc<SandboxConn>, req: pb::UpdateRequest) -> Result<(), RpcError> {
    let p = find(&sb, req.process.as_ref())?;
    let Some(size) = req.pty.and_then(|p| p.size) else {
        return Ok(());
    };
    if !p.pty {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            format!("process {} has no terminal", p.pid),
        ));
    }
    let ws = WinSize {
        rows: size.rows.clamp(1, u16::MAX as u32) as u16,
        cols: size.cols.clamp(1, u16::MAX as u32) as u16,
    };
    tokio::task::spawn_blocking(move || p.handle.resize(ws).map_err(RpcError::from))
        .await
        .map_err(|e| RpcError::new(Code::Internal, format!("worker: {e}")))?
}

//! One connection: read frames, dispatch them to the operations (exec, files, watches,
//! kept processes), and end what the connection owned when it closes.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::conn::{Conn, ExecEntry};
use super::exec;
use super::files::{self, Upload};
use super::watch::Watches;
use super::{Shared, SystemMode};
use crate::proto::{
    self, decode_frame, AgentMsg, ErrorKind, HostMsg, Msg, RemoteError, MAX_ENTROPY_LEN,
    MAX_FRAME_LEN, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use crate::Error;

/// Per-connection state owned by the reading thread.
struct Session {
    conn: Arc<Conn>,
    negotiated: bool,
    uploads: HashMap<u32, Upload>,
    /// Directory watches; dropped (stopped) when the connection ends.
    watches: Watches,
    /// Whether AsUser gave this connection's thread a user's filesystem credentials (it
    /// then runs no Exec or Spawn: their processes would start with them).
    as_user: bool,
}

/// Serves one accepted connection until the peer closes it, then kills the execs it
/// started (their output has nowhere to go); kept processes (Spawn) run on.
pub(crate) fn serve_connection(n: u64, fd: OwnedFd, shared: Arc<Shared>) {
    tracing::debug!(conn = n, "connected");
    let out = match fd.try_clone() {
        Ok(f) => File::from(f),
        Err(e) => {
            tracing::error!(conn = n, "dup connection: {e}");
            return;
        }
    };
    let raw = fd.as_raw_fd();
    let conn = Arc::new(Conn::new(n, out, shared));
    let mut session = Session {
        conn: conn.clone(),
        negotiated: false,
        uploads: HashMap::new(),
        watches: Watches::default(),
        as_user: false,
    };
    let mut input = BufReader::with_capacity(128 * 1024, File::from(fd));
    loop {
        let frame = match proto::read_frame(&mut input, MAX_FRAME_LEN) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(Error::FrameTooLarge { len, max }) => {
                // The stream is no longer at a known frame boundary: answer, then close.
                conn.send_err(
                    0,
                    RemoteError::new(
                        ErrorKind::FrameTooLarge,
                        format!("frame length {len} exceeds {max}; closing the connection"),
                    ),
                );
                break;
            }
            Err(e) => {
                tracing::debug!(conn = n, "read: {e}");
                break;
            }
        };
        match decode_frame(&frame) {
            Ok(f) => match f.msg {
                Msg::Host(m) => session.handle(f.id, m),
                Msg::Agent(_) => {
                    conn.send_err(
                        f.id,
                        RemoteError::new(
                            ErrorKind::UnknownMessage,
                            "agent-to-host message sent to the agent",
                        ),
                    );
                }
            },
            Err(e) => {
                let id = proto::body_id(&frame[4..]).unwrap_or(0);
                let kind = match e {
                    Error::UnknownTag(_) => ErrorKind::UnknownMessage,
                    _ => ErrorKind::BadFrame,
                };
                tracing::debug!(conn = n, id, "bad frame: {e}");
                conn.send_err(id, RemoteError::new(kind, e.to_string()));
            }
        }
    }
    tracing::debug!(conn = n, "closed");
    conn.mark_broken();
    // SAFETY: shutdown on the connection socket, which stays open until `input` drops below;
    // it makes blocked writers on other threads fail instead of hanging.
    unsafe { libc::shutdown(raw, libc::SHUT_RDWR) };
    let execs: Vec<Arc<ExecEntry>> = conn.execs().drain().map(|(_, e)| e).collect();
    for e in execs.iter().filter(|e| !e.kept) {
        e.kill_group();
    }
    drop(input);
}

impl Session {
    fn handle(&mut self, id: u32, msg: HostMsg) {
        let conn = &self.conn;
        match msg {
            HostMsg::Hello {
                min_version,
                max_version,
                client,
            } => self.hello(id, min_version, max_version, &client),
            _ if !self.negotiated => {
                conn.send_err(
                    id,
                    RemoteError::new(ErrorKind::HandshakeRequired, "send Hello first"),
                );
            }
            _ if id == 0 => {
                conn.send_err(
                    0,
                    RemoteError::new(
                        ErrorKind::InvalidArgument,
                        "id 0 is reserved for the handshake",
                    ),
                );
            }
            HostMsg::Ping => {
                conn.send(
                    id,
                    &AgentMsg::Pong {
                        agent_version: proto::AGENT_VERSION.to_string(),
                        protocol: PROTOCOL_VERSION,
                        uptime_ms: crate::system::uptime_ms(),
                        running_execs: conn.shared.running_execs.load(Ordering::Relaxed),
                    },
                );
            }
            HostMsg::Exec(_) | HostMsg::Spawn { .. } if self.as_user => {
                conn.send_err(
                    id,
                    RemoteError::new(
                        ErrorKind::InvalidArgument,
                        "this connection has a user's file credentials (AsUser): no processes",
                    ),
                );
            }
            HostMsg::AsUser { uid, gid, groups } => {
                match crate::system::thread_fs_credentials(uid, gid, &groups) {
                    Ok(()) => {
                        self.as_user = true;
                        conn.send(id, &AgentMsg::Ok);
                    }
                    Err(e) => {
                        conn.send_err(id, RemoteError::from_io(&e, "AsUser"));
                    }
                }
            }
            HostMsg::Exec(spec) => {
                if self.uploads.contains_key(&id) || conn.execs().contains_key(&id) {
                    conn.send_err(id, id_in_use(id));
                } else if let Err(e) = exec::start(conn, id, spec, None) {
                    conn.send_err(id, e);
                }
            }
            HostMsg::Spawn { spec, tag, meta } => {
                if self.uploads.contains_key(&id) || conn.execs().contains_key(&id) {
                    conn.send_err(id, id_in_use(id));
                } else if let Err(e) = spawn(conn, id, spec, tag, meta) {
                    conn.send_err(id, e);
                }
            }
            HostMsg::Attach { pid, output } => {
                if self.uploads.contains_key(&id) || conn.execs().contains_key(&id) {
                    conn.send_err(id, id_in_use(id));
                    return;
                }
                let r = match conn.shared.procs.get(pid) {
                    Some(k) => k.attach(conn, id, output),
                    None => Err(RemoteError::new(
                        ErrorKind::NotFound,
                        format!("no kept process with pid {pid}"),
                    )),
                };
                if let Err(e) = r {
                    conn.send_err(id, e);
                }
            }
            HostMsg::ListProcs => {
                // Batches well under the frame limit; an entry always fits a frame alone
                // (Spawn refuses bigger ones).
                let mut batch = Vec::new();
                let mut size = 0;
                for p in conn.shared.procs.list() {
                    let n = proto::proc_info_wire_len(&p);
                    if !batch.is_empty() && size + n > PROC_LIST_BATCH {
                        conn.send(id, &AgentMsg::ProcList(std::mem::take(&mut batch)));
                        size = 0;
                    }
                    size += n;
                    batch.push(p);
                }
                if !batch.is_empty() {
                    conn.send(id, &AgentMsg::ProcList(batch));
                }
                conn.send(id, &AgentMsg::Ok);
            }
            HostMsg::Stdin(data) => {
                // Stdin may race with the exec's end: data for a finished exec is dropped.
                if let Some(e) = conn.execs().get(&id).cloned() {
                    e.stdin_data(data, conn, id);
                }
            }
            HostMsg::StdinClose => {
                if let Some(e) = conn.execs().get(&id).cloned() {
                    e.stdin_close();
                }
            }
            HostMsg::Signal {
                target,
                signal,
                group,
            } => {
                let entry = conn.execs().get(&target).cloned();
                let r = match entry {
                    Some(e) => e.signal(signal, group),
                    None => Err(no_exec(target)),
                };
                reply_unit(conn, id, r);
            }
            HostMsg::Resize { target, size } => {
                let entry = conn.execs().get(&target).cloned();
                let r = match entry {
                    Some(e) => e.resize(size),
                    None => Err(no_exec(target)),
                };
                reply_unit(conn, id, r);
            }
            HostMsg::ReadFile { path } => files::start_read(conn, id, path),
            HostMsg::WriteFile { path, mode } => {
                if self.uploads.contains_key(&id) || conn.execs().contains_key(&id) {
                    conn.send_err(id, id_in_use(id));
                    return;
                }
                match files::open_upload(&path, mode) {
                    Ok(up) => {
                        self.uploads.insert(id, up);
                        conn.send(id, &AgentMsg::Ok);
                    }
                    Err(e) => {
                        conn.send_err(id, e);
                    }
                }
            }
            HostMsg::FileData(data) => match self.uploads.get_mut(&id) {
                Some(up) => {
                    if let Some(err) = up.write(&data) {
                        conn.send_err(id, err);
                    }
                }
                None => {
                    conn.send_err(
                        id,
                        RemoteError::new(ErrorKind::UnknownId, "no upload with this id"),
                    );
                }
            },
            HostMsg::FileEnd => match self.uploads.remove(&id) {
                Some(up) => {
                    if let Some(reply) = up.finish() {
                        conn.send(id, &reply);
                    }
                }
                None => {
                    conn.send_err(
                        id,
                        RemoteError::new(ErrorKind::UnknownId, "no upload with this id"),
                    );
                }
            },
            HostMsg::Stat {
                path,
                follow_symlinks,
            } => match files::stat(&path, follow_symlinks) {
                Ok(s) => {
                    conn.send(id, &AgentMsg::Stat(s));
                }
                Err(e) => {
                    conn.send_err(id, e);
                }
            },
            HostMsg::List { path } => files::list(conn, id, &path),
            HostMsg::Remove { path, recursive } => {
                reply_unit(conn, id, files::remove(&path, recursive));
            }
            HostMsg::MakeDir {
                path,
                mode,
                parents,
            } => {
                reply_unit(conn, id, files::make_dir(&path, mode, parents));
            }
            HostMsg::Rename { from, to } => {
                reply_unit(conn, id, files::rename(&from, &to));
            }
            HostMsg::GetXattrs { paths, prefix } => match files::get_xattrs(&paths, &prefix) {
                Ok(lists) => {
                    conn.send(id, &AgentMsg::Xattrs(lists));
                }
                Err(e) => {
                    conn.send_err(id, e);
                }
            },
            HostMsg::SetXattrs { path, prefix, set } => {
                reply_unit(conn, id, files::set_xattrs(&path, &prefix, &set));
            }
            HostMsg::ReadLink { path } => match files::read_link(&path) {
                Ok(target) => {
                    conn.send(id, &AgentMsg::LinkTarget { target });
                }
                Err(e) => {
                    conn.send_err(id, e);
                }
            },
            HostMsg::Watch { path, recursive } => {
                if self.uploads.contains_key(&id)
                    || conn.execs().contains_key(&id)
                    || self.watches.contains(id)
                {
                    conn.send_err(id, id_in_use(id));
                } else if let Err(e) = self.watches.start(conn, id, &path, recursive) {
                    conn.send_err(id, e);
                }
            }
            HostMsg::Unwatch { target } => {
                let r = self.watches.stop(target);
                reply_unit(conn, id, r);
            }
            HostMsg::SetClock { unix_ns } => {
                let r = match conn.shared.opts.mode {
                    SystemMode::Guest => crate::system::set_clock(unix_ns)
                        .map_err(|e| RemoteError::from_io(&e, "clock_settime")),
                    SystemMode::HostTest if unix_ns < 0 => Err(RemoteError::new(
                        ErrorKind::InvalidArgument,
                        "time before the epoch",
                    )),
                    SystemMode::HostTest => {
                        tracing::info!(unix_ns, "set clock (host-test mode: not applied)");
                        Ok(())
                    }
                };
                reply_unit(conn, id, r);
            }
            HostMsg::AddEntropy(data) => {
                let r = if data.len() > MAX_ENTROPY_LEN {
                    Err(RemoteError::new(
                        ErrorKind::InvalidArgument,
                        format!("at most {MAX_ENTROPY_LEN} bytes of entropy at once"),
                    ))
                } else {
                    crate::system::add_entropy(&data)
                        .map_err(|e| RemoteError::from_io(&e, "RNDADDENTROPY"))
                };
                reply_unit(conn, id, r);
            }
            HostMsg::Sync => {
                crate::system::sync();
                conn.send(id, &AgentMsg::Ok);
            }
            HostMsg::PowerOff => {
                tracing::info!(conn = conn.n, "power off");
                crate::system::sync();
                conn.send(id, &AgentMsg::Ok);
                conn.shared.request_power_off();
            }
        }
    }

    fn hello(&mut self, id: u32, min_version: u16, max_version: u16, client: &str) {
        let conn = &self.conn;
        if self.negotiated {
            conn.send_err(
                id,
                RemoteError::new(
                    ErrorKind::InvalidArgument,
                    "Hello already done on this connection",
                ),
            );
            return;
        }
        let version = max_version.min(PROTOCOL_VERSION);
        if version < min_version.max(MIN_PROTOCOL_VERSION) {
            conn.send_err(
                id,
                RemoteError::new(
                    ErrorKind::UnsupportedVersion,
                    format!(
                        "client speaks {min_version}..={max_version}, agent speaks \
                         {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}"
                    ),
                ),
            );
            return;
        }
        tracing::debug!(conn = conn.n, client, version, "hello");
        self.negotiated = true;
        conn.send(
            id,
            &AgentMsg::HelloOk {
                version,
                agent_version: proto::AGENT_VERSION.to_string(),
                max_frame_len: MAX_FRAME_LEN,
            },
        );
    }
}

/// Bytes of process entries per ProcList frame (more entries go to further frames).
const PROC_LIST_BATCH: usize = 256 * 1024;

/// Validates a Spawn's additions and starts the kept process.
fn spawn(
    conn: &Arc<Conn>,
    id: u32,
    spec: proto::ExecSpec,
    tag: Option<String>,
    meta: Vec<u8>,
) -> Result<(), RemoteError> {
    if tag.as_ref().is_some_and(|t| t.len() > proto::MAX_TAG_LEN) {
        return Err(RemoteError::new(
            ErrorKind::InvalidArgument,
            format!("tag longer than {} bytes", proto::MAX_TAG_LEN),
        ));
    }
    if meta.len() > proto::MAX_META_LEN {
        return Err(RemoteError::new(
            ErrorKind::InvalidArgument,
            format!("meta longer than {} bytes", proto::MAX_META_LEN),
        ));
    }
    // Its ListProcs entry (with an exit status) must fit one frame.
    let entry = proto::ProcInfo {
        pid: 0,
        tag: tag.clone(),
        meta: meta.clone(),
        argv: spec.argv.clone(),
        env: spec.env.clone(),
        cwd: spec.cwd.clone(),
        tty: false,
        stdin: false,
        exit: Some(proto::ExitStatus::Exited(0)),
    };
    if proto::proc_info_wire_len(&entry) + proto::FRAME_HEADER_LEN + 4 > MAX_FRAME_LEN as usize {
        return Err(RemoteError::new(
            ErrorKind::InvalidArgument,
            "the command, environment, tag and meta together are too large",
        ));
    }
    exec::start(conn, id, spec, Some(exec::Keep { tag, meta }))
}

fn reply_unit(conn: &Conn, id: u32, r: Result<(), RemoteError>) {
    match r {
        Ok(()) => conn.send(id, &AgentMsg::Ok),
        Err(e) => conn.send_err(id, e),
    };
}

fn id_in_use(id: u32) -> RemoteError {
    RemoteError::new(
        ErrorKind::IdInUse,
        format!("id {id} is in use by an operation in flight"),
    )
}

fn no_exec(target: u32) -> RemoteError {
    RemoteError::new(
        ErrorKind::UnknownId,
        format!("no running exec or attachment with id {target} on this connection"),
    )
}

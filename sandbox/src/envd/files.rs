//! `filesystem.Filesystem` (Stat, ListDir, MakeDir, Move, Remove, the WatchDir stream and
//! the polling watchers CreateWatcher / GetWatcherEvents / RemoveWatcher) and envd's plain
//! HTTP `/files` (download; upload as multipart or octet-stream, optionally gzip), over
//! the agent's file operations and directory watches.
//!
//! Transfers stream: each `/files` request gets an agent connection of its own (the
//! agent client stalls a whole connection while one operation's reader lags, so a slow
//! HTTP client must not hold up the sandbox's shared connection), and bytes move through
//! bounded channels between the async side and the blocking agent calls.
//!
//! Watches: each `WatchDir` stream and each polling watcher holds an agent connection of
//! its own with one agent watch on it (a watch's events must be read promptly, and the
//! agent ends a connection's watches when it closes, so a watcher's end cannot leak one).
//! A pump thread per watch reads its events: into the stream (bounded channel; a slow
//! client slows the watch, whose events then wait in the guest kernel's bounded queue)
//! or into the watcher's queue (bounded: [`MAX_WATCHER_EVENTS`]). Lost events (a queue
//! overflow) end the watch with an error, as envd's fsnotify watcher does.
//!
//! File metadata (envd 0.6.2) is the guest's extended attributes `user.e2b.<key>`: an
//! upload's `X-Metadata-<key>` headers become exactly the file's set (an upload without
//! them clears it), and every `EntryInfo` (Stat, ListDir, Move, watch events) shows them,
//! whoever set them (a program in the guest too). A watch with `include_entry` (envd
//! 0.6.3) carries each event's entry as it is when the event is read (none for a
//! removal). Not served: `allow_network_mounts` (0.6.4; the SDK refuses it client-side).

use std::collections::HashMap;
use std::io::Read;
use std::path::Path as FsPath;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Multipart, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use tokio::sync::mpsc;
use vmm::agent::{Client, FileKind, FileStat, Watch, WatchEvent, WatchKind, WatchStopper};

use super::access::{Grant, Operation};
use super::connect::{self, Code, Codec, RpcError};
use super::pb;
use super::{lock, read_body, target_sandbox, DataPlane, SandboxConn, Target, User};

/// Depth of a ListDir without one (envd's default).
const DEFAULT_DEPTH: u32 = 1;
/// Most entries one ListDir returns.
const MAX_ENTRIES: usize = 100_000;
/// Polling watchers one sandbox may have (removed or not).
const MAX_WATCHERS: usize = 64;
/// Events a polling watcher keeps until they are collected; more ends it with an error.
pub(crate) const MAX_WATCHER_EVENTS: usize = 16_384;
/// Events buffered between a WatchDir stream's pump and its HTTP response.
const WATCH_STREAM_DEPTH: usize = 64;
/// envd's keepalive request header (seconds between keepalive messages).
const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";

/// Go's `FileMode.String()` (`-rw-r--r--`, `drwxr-xr-x`, `Lrwxrwxrwx`), as envd reports
/// `permissions`.
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    });
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

fn entry(
    sb: &SandboxConn,
    user: &User,
    path: &FsPath,
    st: &FileStat,
    target: Option<&FileStat>,
) -> pb::EntryInfo {
    let shown = target.unwrap_or(st);
    let ty = match shown.kind {
        FileKind::Dir => pb::FileType::Directory,
        FileKind::File => pb::FileType::File,
        FileKind::Symlink => pb::FileType::Symlink,
        _ => pb::FileType::Unspecified,
    };
    let (owner, group) = sb.names(st.uid, st.gid);
    pb::EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        r#type: ty as i32,
        path: path.to_string_lossy().into_owned(),
        size: shown.size.min(i64::MAX as u64) as i64,
        // The permission bits, as E2B reports them (a 0755 directory is 493); the type
        // is in `type` and `permissions`.
        mode: st.mode & 0o777,
        permissions: permissions(st.kind, st.mode),
        owner,
        group,
        modified_time: Some(pb::Timestamp {
            seconds: st.mtime_ns.div_euclid(1_000_000_000),
            nanos: st.mtime_ns.rem_euclid(1_000_000_000) as i32,
        }),
        symlink_target: link_target(sb, user, path, st),
        metadata: Default::default(),
        is_symlink: st.kind == FileKind::Symlink,
    }
}

/// A symlink's target for `EntryInfo` (as envd gives it: absolute; a relative target is
/// taken relative to the link's directory, lexically), `None` for anything else or a
/// link that cannot be read.
fn link_target(sb: &SandboxConn, user: &User, path: &FsPath, st: &FileStat) -> Option<String> {
    if st.kind != FileKind::Symlink {
        return None;
    }
    let t = sb.with_user(user, |c| c.read_link(path)).ok()?;
    let t = if t.is_absolute() {
        t
    } else {
        path.parent().unwrap_or(FsPath::new("/")).join(t)
    };
    Some(t.to_string_lossy().into_owned())
}

/// The extended-attribute namespace of file metadata (envd's): `user.e2b.<key>`.
pub(crate) const META_PREFIX: &str = "user.e2b.";
/// Paths asked about in one GetXattrs.
const META_BATCH: usize = 256;
/// Most metadata entries one upload may set.
const MAX_META: usize = 64;

/// Metadata as `EntryInfo` shows it: the keys without the prefix.
fn meta_map(l: Vec<(String, Vec<u8>)>) -> HashMap<String, String> {
    l.into_iter()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix(META_PREFIX)?.to_string();
            Some((key, String::from_utf8_lossy(&v).into_owned()))
        })
        .collect()
}

/// Fills the metadata of `entries` (one GetXattrs per [`META_BATCH`] of them). A guest
/// agent older than the operation, or a filesystem without extended attributes, leaves
/// them without any.
fn fill_metadata(sb: &SandboxConn, user: &User, entries: &mut [pb::EntryInfo]) {
    for chunk in entries.chunks_mut(META_BATCH) {
        let paths: Vec<std::path::PathBuf> = chunk.iter().map(|e| e.path.clone().into()).collect();
        match sb.with_user(user, |c| c.get_xattrs(&paths, META_PREFIX)) {
            Ok(lists) => {
                for (e, l) in chunk.iter_mut().zip(lists) {
                    e.metadata = meta_map(l);
                }
            }
            Err(e) => {
                tracing::debug!(sandbox = %sb.id, "file metadata not read: {}", e.message);
                return;
            }
        }
    }
}

/// The metadata an upload sets (`X-Metadata-<key>: value`, keys lowercased), as full
/// attribute names, or why it cannot be set.
pub(crate) fn upload_metadata(h: &HeaderMap) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut out = Vec::new();
    for (name, value) in h {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        if key.is_empty() || key.len() > 200 {
            return Err(format!("metadata key {key:?}: 1 to 200 characters"));
        }
        let v = value
            .to_str()
            .ok()
            .filter(|v| v.len() <= 4096 && v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| {
                format!("metadata {key:?}: the value must be printable ASCII, at most 4096 bytes")
            })?;
        out.push((
            format!("{META_PREFIX}{}", key.to_ascii_lowercase()),
            v.as_bytes().to_vec(),
        ));
    }
    if out.len() > MAX_META {
        return Err(format!("at most {MAX_META} metadata entries per upload"));
    }
    out.sort();
    out.dedup_by(|a, b| a.0 == b.0);
    Ok(out)
}

/// lstat, and for a symlink also the target's stat (if it resolves).
fn stat_entry(sb: &SandboxConn, user: &User, path: &FsPath) -> Result<pb::EntryInfo, RpcError> {
    let st = sb
        .with_user(user, |c| c.lstat(path))
        .map_err(|e| missing(e, path))?;
    let target = if st.kind == FileKind::Symlink {
        sb.with_user(user, |c| c.stat(path)).ok()
    } else {
        None
    };
    let mut e = [entry(sb, user, path, &st, target.as_ref())];
    fill_metadata(sb, user, &mut e);
    let [e] = e;
    Ok(e)
}

fn missing(mut e: RpcError, path: &FsPath) -> RpcError {
    if e.code == Code::NotFound {
        e.message = format!("path '{}' does not exist", path.display());
    }
    e
}

fn check_path(p: &str) -> Result<(), RpcError> {
    if p.contains('\0') {
        return Err(RpcError::new(Code::InvalidArgument, "NUL byte in the path"));
    }
    Ok(())
}

/// `POST /filesystem.Filesystem/{method}` (all unary).
pub(crate) async fn dispatch(
    State(dp): State<Arc<DataPlane>>,
    Path(method): Path<String>,
    req: Request,
) -> Response {
    if method == "WatchDir" {
        return watch_dir(dp, req).await;
    }
    if !matches!(
        method.as_str(),
        "Stat"
            | "ListDir"
            | "MakeDir"
            | "Move"
            | "Remove"
            | "CreateWatcher"
            | "GetWatcherEvents"
            | "RemoveWatcher"
    ) {
        return RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{method} is not served"),
        )
        .unary_response();
    }
    let codec = match Codec::from_headers(req.headers(), false) {
        Ok(c) => c,
        Err(e) => return e.unary_response(),
    };
    // Body first (bounded): see process::dispatch.
    let target = req.extensions().get::<Target>().cloned();
    let user_name = super::basic_user(req.headers());
    let body = match read_body(req, connect::MAX_MESSAGE).await {
        Ok(b) => b,
        Err(e) => return e.unary_response(),
    };
    let sb = match target_sandbox(&dp, target).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let r = tokio::task::spawn_blocking(move || {
        let user = sb.user(user_name.as_deref())?;
        fs_call(&sb, &user, codec, &method, &body)
    })
    .await
    .unwrap_or_else(|e| Err(RpcError::new(Code::Internal, format!("worker: {e}"))));
    r.unwrap_or_else(|e| e.unary_response())
}

fn fs_call(
    sb: &Arc<SandboxConn>,
    user: &User,
    codec: Codec,
    method: &str,
    body: &[u8],
) -> Result<Response, RpcError> {
    match method {
        "Stat" => {
            let r: pb::PathRequest = codec.decode(body)?;
            check_path(&r.path)?;
            let p = user.resolve(&r.path);
            let e = stat_entry(sb, user, &p)?;
            Ok(connect::unary_ok(
                codec,
                &pb::EntryResponse { entry: Some(e) },
            ))
        }
        "ListDir" => {
            let r: pb::ListDirRequest = codec.decode(body)?;
            check_path(&r.path)?;
            let root = user.resolve(&r.path);
            let depth = if r.depth == 0 { DEFAULT_DEPTH } else { r.depth };
            let st = sb
                .with_user(user, |c| c.stat(&root))
                .map_err(|e| missing(e, &root))?;
            if st.kind != FileKind::Dir {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    format!("path '{}' is not a directory", root.display()),
                ));
            }
            let mut entries = Vec::new();
            let mut level = vec![root];
            for _ in 0..depth {
                let mut next = Vec::new();
                for dir in &level {
                    let list = match sb.with_user(user, |c| c.list(dir)) {
                        Ok(l) => l,
                        // A subdirectory that vanished or cannot be read is skipped.
                        Err(_) if !entries.is_empty() => continue,
                        Err(e) => return Err(missing(e, dir)),
                    };
                    for d in list {
                        let p = dir.join(&d.name);
                        if d.stat.kind == FileKind::Dir {
                            next.push(p.clone());
                        }
                        entries.push(entry(sb, user, &p, &d.stat, None));
                        if entries.len() > MAX_ENTRIES {
                            return Err(RpcError::new(
                                Code::ResourceExhausted,
                                format!("more than {MAX_ENTRIES} entries"),
                            ));
                        }
                    }
                }
                level = next;
                if level.is_empty() {
                    break;
                }
            }
            fill_metadata(sb, user, &mut entries);
            Ok(connect::unary_ok(codec, &pb::ListDirResponse { entries }))
        }
        "MakeDir" => {
            let r: pb::PathRequest = codec.decode(body)?;
            check_path(&r.path)?;
            let p = user.resolve(&r.path);
            if sb.with_user(user, |c| c.lstat(&p)).is_ok() {
                return Err(RpcError::new(
                    Code::AlreadyExists,
                    format!("path '{}' already exists", p.display()),
                ));
            }
            sb.with_user(user, |c| c.make_dir(&p, 0o755, true))?;
            let e = stat_entry(sb, user, &p)?;
            Ok(connect::unary_ok(
                codec,
                &pb::EntryResponse { entry: Some(e) },
            ))
        }
        "Move" => {
            let r: pb::MoveRequest = codec.decode(body)?;
            check_path(&r.source)?;
            check_path(&r.destination)?;
            let (from, to) = (user.resolve(&r.source), user.resolve(&r.destination));
            sb.with_user(user, |c| c.rename(&from, &to))
                .map_err(|e| missing(e, &from))?;
            let e = stat_entry(sb, user, &to)?;
            Ok(connect::unary_ok(
                codec,
                &pb::EntryResponse { entry: Some(e) },
            ))
        }
        "CreateWatcher" => {
            let r: pb::WatchRequest = codec.decode(body)?;
            let id = create_watcher(sb, user, &r)?;
            Ok(connect::unary_ok(
                codec,
                &pb::CreateWatcherResponse { watcher_id: id },
            ))
        }
        "GetWatcherEvents" => {
            let r: pb::WatcherRequest = codec.decode(body)?;
            let events = sb.watchers.take_events(&r.watcher_id)?;
            Ok(connect::unary_ok(
                codec,
                &pb::GetWatcherEventsResponse { events },
            ))
        }
        "RemoveWatcher" => {
            let r: pb::WatcherRequest = codec.decode(body)?;
            sb.watchers.remove(&r.watcher_id)?;
            Ok(connect::unary_ok(codec, &pb::Empty {}))
        }
        _ => {
            let r: pb::PathRequest = codec.decode(body)?;
            check_path(&r.path)?;
            let p = user.resolve(&r.path);
            // As envd (Go's os.RemoveAll): a path that is not there is already removed.
            match sb.with_user(user, |c| c.remove(&p, true)) {
                Err(e) if e.code == Code::NotFound => {}
                r => r?,
            }
            Ok(connect::unary_ok(codec, &pb::Empty {}))
        }
    }
}

// ------------------------------------------------------------------------- watches

/// A sandbox's polling watchers, by id.
#[derive(Default)]
pub(crate) struct Watchers {
    map: Mutex<HashMap<String, Arc<Watcher>>>,
}

/// One polling watcher: its events until collected, and how it ended.
pub(crate) struct Watcher {
    state: Mutex<WatcherState>,
    stopper: WatchStopper,
}

#[derive(Default)]
struct WatcherState {
    events: Vec<pb::FilesystemEvent>,
    /// Why the watch ended on its own (reported once its events are collected).
    error: Option<RpcError>,
}

impl Watchers {
    fn get(&self, id: &str) -> Result<Arc<Watcher>, RpcError> {
        lock(&self.map)
            .get(id)
            .cloned()
            .ok_or_else(|| no_watcher(id))
    }

    /// The events since the last call; once there are none left, the error that ended
    /// the watch, if one did.
    pub(crate) fn take_events(&self, id: &str) -> Result<Vec<pb::FilesystemEvent>, RpcError> {
        let w = self.get(id)?;
        let mut st = lock(&w.state);
        if st.events.is_empty() {
            if let Some(e) = &st.error {
                return Err(e.clone());
            }
        }
        Ok(std::mem::take(&mut st.events))
    }

    /// Stops the watch and forgets the watcher.
    pub(crate) fn remove(&self, id: &str) -> Result<(), RpcError> {
        let w = lock(&self.map).remove(id).ok_or_else(|| no_watcher(id))?;
        // Its connection may be gone already (the watch ended): nothing left to stop.
        if let Err(e) = w.stopper.stop() {
            tracing::debug!(watcher = id, "stop: {e}");
        }
        Ok(())
    }
}

fn no_watcher(id: &str) -> RpcError {
    RpcError::new(Code::NotFound, format!("watcher with id {id} not found"))
}

/// An agent watch on a connection of its own, for a WatchDir / CreateWatcher request.
fn open_watch(
    sb: &SandboxConn,
    user: &User,
    r: &pb::WatchRequest,
) -> Result<(Client, Watch), RpcError> {
    check_path(&r.path)?;
    let p = user.resolve(&r.path);
    let client = sb.connect_as(user)?;
    let watch = client
        .watch(&p, r.recursive)
        .map_err(|e| watch_error(e, &p))?;
    Ok((client, watch))
}

fn watch_error(e: vmm::Error, p: &FsPath) -> RpcError {
    if let vmm::Error::Agent(r) = &e {
        if r.errno == libc::EMFILE || r.errno == libc::ENOSPC {
            return RpcError::new(Code::ResourceExhausted, r.message.clone());
        }
        if r.errno == libc::ENOTDIR {
            return RpcError::new(
                Code::InvalidArgument,
                format!("path {} not a directory", p.display()),
            );
        }
    }
    let mut e = RpcError::from(e);
    if e.code == Code::NotFound {
        e.message = format!("path {} not found", p.display());
    }
    e
}

/// An agent event as envd reports it: `None` for kinds envd has no name for; lost
/// events end the watch (envd's watcher fails on an fsnotify overflow).
fn fs_event(ev: WatchEvent) -> Result<Option<pb::FilesystemEvent>, RpcError> {
    let ty = match ev.kind {
        WatchKind::Create => pb::EventType::Create,
        WatchKind::Write => pb::EventType::Write,
        WatchKind::Remove => pb::EventType::Remove,
        WatchKind::Rename => pb::EventType::Rename,
        WatchKind::Chmod => pb::EventType::Chmod,
        WatchKind::Overflow if ev.name.as_os_str().is_empty() => {
            return Err(RpcError::new(
                Code::Internal,
                "watcher error: event queue overflow, events were lost",
            ))
        }
        WatchKind::Overflow => {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!(
                    "watcher error: too many directories to watch ({} was not watched)",
                    ev.name.display()
                ),
            ))
        }
        WatchKind::Other(_) => return Ok(None),
    };
    Ok(Some(pb::FilesystemEvent {
        name: ev.name.to_string_lossy().into_owned(),
        r#type: ty as i32,
        entry: None,
    }))
}

/// What a watch with `include_entry` (envd 0.6.3) adds to an event: the entry's info as
/// it is now (none for a removal, or for an entry gone again).
struct EventEntries {
    sb: Arc<SandboxConn>,
    user: User,
    dir: std::path::PathBuf,
}

impl EventEntries {
    fn of(sb: &Arc<SandboxConn>, user: &User, r: &pb::WatchRequest) -> Option<Self> {
        r.include_entry.then(|| EventEntries {
            sb: sb.clone(),
            user: user.clone(),
            dir: user.resolve(&r.path),
        })
    }

    fn add(this: &Option<Self>, e: &mut pb::FilesystemEvent) {
        let Some(x) = this else { return };
        if e.r#type != pb::EventType::Remove as i32 {
            e.entry = stat_entry(&x.sb, &x.user, &x.dir.join(&e.name)).ok();
        }
    }
}

/// How a watch's event stream ended, as an error to report (`None`: stopped).
fn ended(r: vmm::Result<Option<WatchEvent>>) -> Option<RpcError> {
    match r {
        Ok(_) => None,
        Err(vmm::Error::Agent(e)) if e.kind == vmm::agent::ErrorKind::NotFound => Some(
            RpcError::new(Code::NotFound, format!("watch ended: {}", e.message)),
        ),
        Err(e) => Some(RpcError::from(e)),
    }
}

fn create_watcher(
    sb: &Arc<SandboxConn>,
    user: &User,
    r: &pb::WatchRequest,
) -> Result<String, RpcError> {
    let full = || {
        RpcError::new(
            Code::ResourceExhausted,
            format!("at most {MAX_WATCHERS} watchers per sandbox; remove one first"),
        )
    };
    if lock(&sb.watchers.map).len() >= MAX_WATCHERS {
        return Err(full());
    }
    let (client, mut watch) = open_watch(sb, user, r)?;
    let entries = EventEntries::of(sb, user, r);
    let w = Arc::new(Watcher {
        state: Mutex::new(WatcherState::default()),
        stopper: watch.stopper(),
    });
    let id = {
        let mut map = lock(&sb.watchers.map);
        if map.len() >= MAX_WATCHERS {
            return Err(full());
        }
        let id = format!("w{}", crate::ids::random_string(20));
        map.insert(id.clone(), w.clone());
        id
    };
    let pump_id = id.clone();
    let spawned = std::thread::Builder::new()
        .name("watcher".into())
        .spawn(move || {
            // The connection lives as long as the watch; both go when the pump ends.
            let _client = client;
            let error = loop {
                let r = watch.next_event();
                match r {
                    Ok(Some(ev)) => match fs_event(ev) {
                        Ok(Some(mut e)) => {
                            EventEntries::add(&entries, &mut e);
                            let mut st = lock(&w.state);
                            if st.events.len() >= MAX_WATCHER_EVENTS {
                                break Some(RpcError::new(
                                    Code::ResourceExhausted,
                                    format!(
                                        "watcher error: more than {MAX_WATCHER_EVENTS} events \
                                         were not collected; later ones were lost"
                                    ),
                                ));
                            }
                            st.events.push(e);
                        }
                        Ok(None) => {}
                        Err(e) => break Some(e),
                    },
                    r => break ended(r),
                }
            };
            tracing::debug!(watcher = pump_id, ?error, "watch ended");
            lock(&w.state).error = error;
        });
    if let Err(e) = spawned {
        lock(&sb.watchers.map).remove(&id);
        return Err(RpcError::new(
            Code::Internal,
            format!("watcher thread: {e}"),
        ));
    }
    Ok(id)
}

/// Stops a watch when the stream that owns it ends, however it ends (on a thread: the
/// stop waits for the agent's answer).
struct StopOnDrop(Option<WatchStopper>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            let _ = std::thread::Builder::new()
                .name("unwatch".into())
                .spawn(move || {
                    let _ = s.stop();
                });
        }
    }
}

fn keepalive_interval(h: &HeaderMap) -> Option<Duration> {
    h.get(KEEPALIVE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
}

/// `WatchDir` (server streaming): the start event once the agent watches, then the
/// directory's events as they come (keepalives in between if the client asked for them),
/// until the client goes, its `Connect-Timeout-Ms` passes (`deadline_exceeded`), or the
/// watch fails (the directory was removed, events were lost).
async fn watch_dir(dp: Arc<DataPlane>, req: Request) -> Response {
    let codec = match Codec::from_headers(req.headers(), true) {
        Ok(c) => c,
        Err(e) => return e.unary_response(),
    };
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let headers = req.headers().clone();
    let user_name = super::basic_user(&headers);
    let body = match read_body(req, connect::MAX_MESSAGE + 5).await {
        Ok(b) => b,
        Err(e) => return connect::stream_error(codec, &e),
    };
    let msg: pb::WatchRequest = match connect::unwrap_envelope(&body).and_then(|m| codec.decode(m))
    {
        Ok(m) => m,
        Err(e) => return connect::stream_error(codec, &e),
    };
    let opened = tokio::task::spawn_blocking(move || {
        let user = sb.user(user_name.as_deref())?;
        let entries = EventEntries::of(&sb, &user, &msg);
        open_watch(&sb, &user, &msg).map(|(c, w)| (c, w, entries))
    })
    .await
    .unwrap_or_else(|e| Err(RpcError::new(Code::Internal, format!("worker: {e}"))));
    let (client, mut watch, entries) = match opened {
        Ok(x) => x,
        Err(e) => return connect::stream_error(codec, &e),
    };
    let guard = StopOnDrop(Some(watch.stopper()));
    let (ev_tx, mut ev_rx) =
        mpsc::channel::<Result<pb::FilesystemEvent, RpcError>>(WATCH_STREAM_DEPTH);
    let spawned = std::thread::Builder::new()
        .name("watch-dir".into())
        .spawn(move || {
            let _client = client;
            loop {
                let r = watch.next_event();
                let item = match r {
                    Ok(Some(ev)) => match fs_event(ev) {
                        Ok(Some(mut e)) => {
                            EventEntries::add(&entries, &mut e);
                            Ok(e)
                        }
                        Ok(None) => continue,
                        Err(e) => Err(e),
                    },
                    r => match ended(r) {
                        Some(e) => Err(e),
                        None => return,
                    },
                };
                let last = item.is_err();
                // The stream is gone: dropping the watch stops it.
                if ev_tx.blocking_send(item).is_err() || last {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        return connect::stream_error(
            codec,
            &RpcError::new(Code::Internal, format!("watch thread: {e}")),
        );
    }
    let keepalive = keepalive_interval(&headers);
    let deadline = connect::timeout(&headers).map(|d| tokio::time::Instant::now() + d);
    let (tx, mut out) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let enc =
        move |e: pb::WatchDirEvent| connect::envelope(&codec.encode(&pb::WatchDirResponse::new(e)));
    tokio::spawn(async move {
        let _guard = guard;
        if tx
            .send(Ok(enc(pb::WatchDirEvent::Start(pb::Empty {}))))
            .await
            .is_err()
        {
            return;
        }
        let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86400);
        let sleep = tokio::time::sleep_until(deadline.unwrap_or(far));
        tokio::pin!(sleep);
        let period = keepalive.unwrap_or(Duration::from_secs(3600));
        let mut ka = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let err = loop {
            tokio::select! {
                ev = ev_rx.recv() => match ev {
                    Some(Ok(e)) => {
                        if tx.send(Ok(enc(pb::WatchDirEvent::Filesystem(e)))).await.is_err() {
                            return;
                        }
                        ka.reset();
                    }
                    Some(Err(e)) => break Some(e),
                    None => break None,
                },
                _ = ka.tick(), if keepalive.is_some() => {
                    if tx.send(Ok(enc(pb::WatchDirEvent::Keepalive(pb::Empty {})))).await.is_err() {
                        return;
                    }
                }
                _ = &mut sleep => break Some(RpcError::new(
                    Code::DeadlineExceeded,
                    "the watch's deadline passed",
                )),
                _ = tx.closed() => return,
            }
        };
        let _ = tx.send(Ok(connect::end_envelope(err.as_ref()))).await;
    });
    let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| out.poll_recv(cx)));
    connect::stream_response(codec, body)
}

/// Most of a refused upload's body read before answering (see [`drained`]).
const DRAIN_MAX: usize = 8 << 20;

/// `answer`, after reading and dropping what is left of `req`'s body (at most
/// [`DRAIN_MAX`] bytes, for at most a second): a server that answers without reading the
/// body closes the connection, and a client that reuses it at that moment sees it closed.
async fn drained(req: Request, answer: Response) -> Response {
    let drain = async {
        let mut left = DRAIN_MAX;
        let mut body = req.into_body().into_data_stream();
        while let Some(Ok(chunk)) = futures_util::StreamExt::next(&mut body).await {
            left = left.saturating_sub(chunk.len());
            if left == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), drain).await;
    answer
}

/// envd's `/files` error body.
fn http_error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(serde_json::json!({"code": status.as_u16(), "message": message.into()})),
    )
        .into_response()
}

fn rpc_to_http(e: RpcError) -> Response {
    let status = match e.code {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::AlreadyExists => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        Code::Unavailable => StatusCode::BAD_GATEWAY,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    http_error(status, e.message)
}

/// What a `/files` request acts on: the path and user its query (and, with full access,
/// its `Authorization` header) names, or exactly a signed URL's.
struct FileTarget {
    path: Option<String>,
    user: Option<String>,
    /// Authorised by a signature: `path` and `user` are the signed ones.
    signed: bool,
}

/// The [`FileTarget`] of a `/files` request for `op`, by its [`Grant`], or why it is
/// refused (401; no grant: a request that did not pass the access check never acts).
fn file_target(req: &Request, op: Operation) -> Result<FileTarget, &'static str> {
    match req.extensions().get::<Grant>() {
        Some(Grant::Full) => {
            let (path, qs_user) = file_query(req);
            let user = qs_user.or_else(|| super::basic_user(req.headers()));
            Ok(FileTarget {
                path,
                user,
                signed: false,
            })
        }
        Some(Grant::Signed {
            operation,
            path,
            user,
        }) if *operation == op => Ok(FileTarget {
            path: Some(path.clone()),
            user: user.clone(),
            signed: true,
        }),
        Some(Grant::Signed { .. }) => Err("the URL is signed for another operation"),
        None => Err("the request was not authorised"),
    }
}

/// `path` and `username` of a `/files` query.
fn file_query(req: &Request) -> (Option<String>, Option<String>) {
    let (mut path, mut user) = (None, None);
    if let Some(q) = req.uri().query() {
        for (k, v) in form_urlencoded::parse(q.as_bytes()) {
            match &*k {
                "path" => path = Some(v.into_owned()),
                "username" => user = Some(v.into_owned()),
                _ => {}
            }
        }
    }
    (path, user)
}

/// Whether a response may be gzipped, by `Accept-Encoding` as envd decides: gzip when
/// listed with a non-zero quality not below identity's, or when identity is refused
/// (`identity;q=0`) and `*` is accepted.
fn accepts_gzip(h: &HeaderMap) -> bool {
    let (mut gzip, mut identity, mut star) = (None, None, None);
    for v in h.get_all(header::ACCEPT_ENCODING) {
        let Ok(v) = v.to_str() else { continue };
        for item in v.split(',') {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.trim().strip_prefix("q=").or(p.trim().strip_prefix("Q=")))
                .find_map(|q| q.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            match name.as_str() {
                "gzip" | "x-gzip" => gzip = Some(q),
                "identity" => identity = Some(q),
                "*" => star = Some(q),
                _ => {}
            }
        }
    }
    match gzip {
        Some(q) => q > 0.0 && identity.is_none_or(|i| q >= i),
        None => identity == Some(0.0) && star.is_some_and(|q| q > 0.0),
    }
}

/// `GET /files?path=…&username=…`: the file's bytes, streamed (gzipped on the fly when
/// the client accepts it, at the fastest level: the transfer is local, CPU is the cost).
/// A signed URL reads its signed path as its signed user only ([`file_target`]).
pub(crate) async fn download(State(dp): State<Arc<DataPlane>>, req: Request) -> Response {
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (path, user_name) = match file_target(&req, Operation::Read) {
        Ok(t) => (t.path, t.user),
        Err(m) => return http_error(StatusCode::UNAUTHORIZED, m),
    };
    let gzip = accepts_gzip(req.headers());
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        return http_error(StatusCode::BAD_REQUEST, "the path parameter is required");
    };
    if let Err(e) = check_path(&path) {
        return rpc_to_http(e);
    }
    let sb2 = sb.clone();
    let prep = tokio::task::spawn_blocking(move || {
        let user = sb2.user(user_name.as_deref())?;
        let p = user.resolve(&path);
        let st = sb2
            .with_user(&user, |c| c.stat(&p))
            .map_err(|e| missing(e, &p))?;
        if st.kind == FileKind::Dir {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("path '{}' is a directory", p.display()),
            ));
        }
        let client = sb2.connect_as(&user)?;
        Ok((p, st.size, client))
    })
    .await
    .unwrap_or_else(|e| Err(RpcError::new(Code::Internal, format!("worker: {e}"))));
    let (p, size, client) = match prep {
        Ok(x) => x,
        Err(e) => return rpc_to_http(e),
    };
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    // How the read began: the status line waits for it, so that a file the agent cannot
    // open (permissions, gone since the stat) is an HTTP error, not a broken body.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<Result<(), RpcError>>();
    tokio::task::spawn_blocking(move || {
        let w = ChanWriter {
            tx: tx.clone(),
            first: Some(first_tx),
        };
        let (r, first) = if gzip {
            let mut gz = flate2::write::GzEncoder::new(w, flate2::Compression::fast());
            let r = client.read_file_to(&p, &mut gz).and_then(|_| {
                gz.try_finish().map_err(|e| vmm::Error::Io {
                    context: "gzip the download",
                    source: e,
                })
            });
            let first = gz.get_mut().first.take();
            (r.map(drop), first)
        } else {
            let mut w = w;
            let r = client.read_file_to(&p, &mut w).map(drop);
            (r, w.first.take())
        };
        match (r, first) {
            // Nothing was sent yet: the answer is this outcome.
            (r, Some(first)) => {
                let _ = first.send(r.map_err(|e| missing(RpcError::from(e), &p)));
            }
            // The status line is gone: fail the body so the client sees a broken transfer.
            (Err(e), None) => {
                let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
            }
            (Ok(()), None) => {}
        }
    });
    match first_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return rpc_to_http(e),
        Err(_) => return rpc_to_http(RpcError::new(Code::Internal, "the download worker ended")),
    }
    let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    r.headers_mut()
        .insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    if gzip {
        r.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    // Only a hint: the agent streams what the file holds when it reads it.
    let _ = size;
    r
}

struct ChanWriter {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    /// Told `Ok` at the first bytes (the read began well).
    first: Option<tokio::sync::oneshot::Sender<Result<(), RpcError>>>,
}

impl std::io::Write for ChanWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(first) = self.first.take() {
            let _ = first.send(Ok(()));
        }
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client went away"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Bytes from the async side, read by a blocking agent upload.
struct ChanReader {
    rx: mpsc::Receiver<Result<Bytes, String>>,
    cur: Bytes,
}

impl Read for ChanReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(std::io::Error::other(e)),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur = self.cur.slice(n..);
        Ok(n)
    }
}

/// One file upload: parents made, bytes streamed in from `rx` (gunzipped if `gzip`).
fn write_one(
    sb: &SandboxConn,
    client: &vmm::agent::Client,
    user: &User,
    path: &FsPath,
    rx: mpsc::Receiver<Result<Bytes, String>>,
    gzip: bool,
    meta: &[(String, Vec<u8>)],
) -> Result<pb::EntryInfo, RpcError> {
    if let Some(parent) = path.parent() {
        client
            .make_dir(parent, 0o755, true)
            .map_err(RpcError::from)?;
    }
    let raw = ChanReader {
        rx,
        cur: Bytes::new(),
    };
    let mut reader: Box<dyn Read> = if gzip {
        Box::new(flate2::read::GzDecoder::new(raw))
    } else {
        Box::new(raw)
    };
    client
        .write_file_from(path, 0o644, &mut reader)
        .map_err(|e| match e {
            vmm::Error::Io { source, .. } => {
                RpcError::new(Code::InvalidArgument, format!("upload body: {source}"))
            }
            e => RpcError::from(e),
        })?;
    // The file's metadata becomes what this upload gave (none: cleared, as envd does
    // for a file overwritten without it).
    match client.set_xattrs(path, META_PREFIX, meta.to_vec()) {
        Ok(()) => {}
        // Nothing to set: an agent without the operation, or a filesystem without
        // extended attributes, has nothing to clear either.
        Err(e) if meta.is_empty() => {
            tracing::debug!(sandbox = %sb.id, "file metadata not cleared: {e}");
        }
        Err(vmm::Error::Agent(e)) if e.kind == vmm::agent::ErrorKind::UnknownMessage => {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "file metadata needs a newer guest agent: rebuild this sandbox's template",
            ))
        }
        Err(e) => {
            let mut e = RpcError::from(e);
            e.message = format!("file metadata of {}: {}", path.display(), e.message);
            return Err(e);
        }
    }
    let _ = user;
    Ok(pb::EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        r#type: pb::FileType::File as i32,
        path: path.to_string_lossy().into_owned(),
        metadata: meta_map(meta.to_vec()),
        ..Default::default()
    })
}

/// `WriteInfo` of the `/files` answer.
fn write_info(e: &pb::EntryInfo) -> serde_json::Value {
    let mut v = serde_json::json!({"name": e.name, "type": "file", "path": e.path});
    if !e.metadata.is_empty() {
        v["metadata"] = serde_json::json!(e.metadata);
    }
    v
}

/// `POST /files?path=…&username=…`: multipart (`file` parts, each named by its
/// filename when no `path` is given) or an octet-stream body (one file at `path`,
/// `Content-Encoding: gzip` allowed). Answers `[WriteInfo]`.
///
/// A signed URL ([`Grant::Signed`]) writes exactly its path as its user: as envd, only
/// `file` parts are read, the first goes to the signed path whatever its file name, and
/// a second is refused (400) without being written anywhere; an `Authorization` header
/// does not choose the user.
pub(crate) async fn upload(State(dp): State<Arc<DataPlane>>, req: Request) -> Response {
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return drained(req, r).await,
    };
    let (qpath, user_name, signed) = match file_target(&req, Operation::Write) {
        Ok(t) => (t.path, t.user, t.signed),
        Err(m) => return drained(req, http_error(StatusCode::UNAUTHORIZED, m)).await,
    };
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let gzip = req
        .headers()
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().eq_ignore_ascii_case("gzip"))
        .unwrap_or(false);
    for p in qpath.iter() {
        if let Err(e) = check_path(p) {
            return drained(req, rpc_to_http(e)).await;
        }
    }
    let meta = match upload_metadata(req.headers()) {
        Ok(m) => Arc::new(m),
        Err(e) => return drained(req, http_error(StatusCode::BAD_REQUEST, e)).await,
    };
    let sb2 = sb.clone();
    let setup = tokio::task::spawn_blocking(move || {
        let user = sb2.user(user_name.as_deref())?;
        let client = sb2.connect_as(&user)?;
        Ok::<_, RpcError>((user, client))
    })
    .await
    .unwrap_or_else(|e| Err(RpcError::new(Code::Internal, format!("worker: {e}"))));
    let (user, client) = match setup {
        Ok(x) => x,
        Err(e) => return drained(req, rpc_to_http(e)).await,
    };
    let mut written = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let mut mp = match Multipart::from_request(req, &()).await {
            Ok(m) => m,
            Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("multipart: {e}")),
        };
        let mut n = 0usize;
        loop {
            let mut field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("multipart: {e}")),
            };
            n += 1;
            let target = if signed {
                // As envd: only `file` parts count, each goes to the signed path (its
                // own file name is not looked at), and a second one is refused.
                if field.name() != Some("file") {
                    continue;
                }
                match (&qpath, written.is_empty()) {
                    (Some(p), true) => p.clone(),
                    _ => {
                        return http_error(
                            StatusCode::BAD_REQUEST,
                            format!(
                                "you cannot upload multiple files to the same path '{}' in one \
                                 upload request, only the first specified file was uploaded",
                                qpath.as_deref().unwrap_or_default()
                            ),
                        )
                    }
                }
            } else {
                match (&qpath, field.file_name()) {
                    (Some(p), _) if n == 1 => p.clone(),
                    (_, Some(f)) if !f.is_empty() => f.to_string(),
                    _ => {
                        return http_error(
                            StatusCode::BAD_REQUEST,
                            "a multipart part without a file name (and no path parameter)",
                        )
                    }
                }
            };
            if let Err(e) = check_path(&target) {
                return rpc_to_http(e);
            }
            let path = user.resolve(&target);
            let (tx, rx) = mpsc::channel(8);
            let (sb3, c3, u3, p3) = (sb.clone(), client.clone(), user.clone(), path.clone());
            let m3 = meta.clone();
            let job =
                tokio::task::spawn_blocking(move || write_one(&sb3, &c3, &u3, &p3, rx, false, &m3));
            let mut feed_err = None;
            loop {
                match field.chunk().await {
                    Ok(Some(b)) => {
                        if tx.send(Ok(b)).await.is_err() {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string())).await;
                        feed_err = Some(e.to_string());
                        break;
                    }
                }
            }
            drop(tx);
            match job.await {
                Ok(Ok(e)) if feed_err.is_none() => written.push(e),
                Ok(Ok(_)) => {
                    return http_error(
                        StatusCode::BAD_REQUEST,
                        format!("multipart: {}", feed_err.unwrap_or_default()),
                    )
                }
                Ok(Err(e)) => return rpc_to_http(e),
                Err(e) => return http_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }
    } else {
        let Some(target) = qpath.filter(|p| !p.is_empty()) else {
            return http_error(StatusCode::BAD_REQUEST, "the path parameter is required");
        };
        let path = user.resolve(&target);
        let (tx, rx) = mpsc::channel(8);
        let (sb3, c3, u3, p3) = (sb.clone(), client.clone(), user.clone(), path.clone());
        let m3 = meta.clone();
        let job =
            tokio::task::spawn_blocking(move || write_one(&sb3, &c3, &u3, &p3, rx, gzip, &m3));
        let mut stream = req.into_body().into_data_stream();
        while let Some(chunk) = stream.next().await {
            let r = chunk.map_err(|e| e.to_string());
            let stop = r.is_err();
            if tx.send(r).await.is_err() || stop {
                break;
            }
        }
        drop(tx);
        match job.await {
            Ok(Ok(e)) => written.push(e),
            Ok(Err(e)) => return rpc_to_http(e),
            Err(e) => return http_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
    let out: Vec<serde_json::Value> = written.iter().map(write_info).collect();
    axum::Json(out).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_by_accept_encoding() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT_ENCODING, v.parse().unwrap());
            accepts_gzip(&h)
        };
        assert!(!accepts_gzip(&HeaderMap::new()));
        assert!(with("gzip"));
        assert!(with("gzip, deflate, br"));
        assert!(with("GZIP;q=0.5"));
        assert!(!with("gzip;q=0"));
        assert!(!with("deflate, br"));
        assert!(!with("gzip;q=0.5, identity"));
        assert!(!with("*"));
        assert!(with("identity;q=0, *"));
        // An unparsable quality counts as 1, as envd reads it.
        assert!(with("gzip;q=nonsense;;,,"));
    }

    #[test]
    fn permissions_like_go() {
        assert_eq!(permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::Symlink, 0o777), "Lrwxrwxrwx");
    }
}

//! The unary `filesystem.Filesystem` methods (Stat, ListDir, MakeDir, Move, Remove, and
//! the polling watchers' CreateWatcher / GetWatcherEvents / RemoveWatcher): the Connect
//! request decoded (its body bounded, the method named), each path checked, and the
//! agent's file operations run on the blocking pool. `WatchDir`, the streaming method, is
//! in `watch_dir`.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::response::Response;
use vmm::agent::FileKind;

use super::entries::{entry, stat_entry};
use super::metadata::fill_metadata;
use super::watch_dir::watch_dir;
use super::watchers::create_watcher;
use super::{check_path, missing};
use crate::envd::connect::{self, Code, Codec, RpcError};
use crate::envd::{pb, read_body, target_sandbox, DataPlane, SandboxConn, Target, User};

/// Depth of a ListDir without one (envd's default).
const DEFAULT_DEPTH: u32 = 1;
/// Most entries one ListDir returns.
const MAX_ENTRIES: usize = 100_000;

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
    let user_name = crate::envd::basic_user(req.headers());
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

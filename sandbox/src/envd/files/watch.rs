//! What both kinds of directory watch share: an agent watch opened on a connection of its
//! own ([`open_watch`]), its events as envd names them ([`fs_event`]; lost events end the
//! watch), the entries a watch with `include_entry` adds ([`EventEntries`]), and how a
//! watch's end is reported ([`ended`]). The two kinds are in `watchers` (polled) and
//! `watch_dir` (streamed).

use std::path::Path as FsPath;
use std::sync::Arc;

use vmm::agent::{Client, Watch, WatchEvent, WatchKind};

use super::check_path;
use super::entries::stat_entry;
use crate::envd::connect::{Code, RpcError};
use crate::envd::{pb, SandboxConn, User};

/// An agent watch on a connection of its own, for a WatchDir / CreateWatcher request.
pub(super) fn open_watch(
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
pub(super) fn fs_event(ev: WatchEvent) -> Result<Option<pb::FilesystemEvent>, RpcError> {
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
pub(super) struct EventEntries {
    sb: Arc<SandboxConn>,
    user: User,
    dir: std::path::PathBuf,
}

impl EventEntries {
    pub(super) fn of(sb: &Arc<SandboxConn>, user: &User, r: &pb::WatchRequest) -> Option<Self> {
        r.include_entry.then(|| EventEntries {
            sb: sb.clone(),
            user: user.clone(),
            dir: user.resolve(&r.path),
        })
    }

    pub(super) fn add(this: &Option<Self>, e: &mut pb::FilesystemEvent) {
        let Some(x) = this else { return };
        if e.r#type != pb::EventType::Remove as i32 {
            e.entry = stat_entry(&x.sb, &x.user, &x.dir.join(&e.name)).ok();
        }
    }
}

/// How a watch's event stream ended, as an error to report (`None`: stopped).
pub(super) fn ended(r: vmm::Result<Option<WatchEvent>>) -> Option<RpcError> {
    match r {
        Ok(_) => None,
        Err(vmm::Error::Agent(e)) if e.kind == vmm::agent::ErrorKind::NotFound => Some(
            RpcError::new(Code::NotFound, format!("watch ended: {}", e.message)),
        ),
        Err(e) => Some(RpcError::from(e)),
    }
}

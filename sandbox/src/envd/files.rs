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
//! or into the watcher's queue (bounded:
//! [`MAX_WATCHER_EVENTS`](watchers::MAX_WATCHER_EVENTS)). Lost events (a queue overflow)
//! end the watch with an error, as envd's fsnotify watcher does.
//!
//! File metadata (envd 0.6.2) is the guest's extended attributes `user.e2b.<key>`: an
//! upload's `X-Metadata-<key>` headers become exactly the file's set (an upload without
//! them clears it), and every `EntryInfo` (Stat, ListDir, Move, watch events) shows them,
//! whoever set them (a program in the guest too). A watch with `include_entry` (envd
//! 0.6.3) carries each event's entry as it is when the event is read (none for a
//! removal). Not served: `allow_network_mounts` (0.6.4; the SDK refuses it client-side).
//!
//! Where each part is: `filesystem` (the unary methods), `entries` (`EntryInfo`) and
//! `metadata` (extended attributes); the watches in `watch` (what both kinds share),
//! `watchers` (polled) and `watch_dir` (streamed); `/files` in `download` and `upload`,
//! with what they share (the path and user a request acts on, the error body) in
//! `transfer`. This file holds the path check every operation makes first.

mod download;
mod entries;
mod filesystem;
mod metadata;
mod transfer;
mod upload;
mod watch;
mod watch_dir;
mod watchers;

use std::path::Path as FsPath;

use super::connect::{Code, RpcError};

pub(crate) use download::download;
pub(crate) use filesystem::dispatch;
pub(crate) use upload::upload;
pub(crate) use watchers::Watchers;

/// `e`, with envd's message when it says `path` is not there.
fn missing(mut e: RpcError, path: &FsPath) -> RpcError {
    if e.code == Code::NotFound {
        e.message = format!("path '{}' does not exist", path.display());
    }
    e
}

/// The check every path of a request passes before anything acts on it: no NUL byte (a
/// path of the agent protocol holds none: `guest-agent/PROTOCOL.md`).
fn check_path(p: &str) -> Result<(), RpcError> {
    if p.contains('\0') {
        return Err(RpcError::new(Code::InvalidArgument, "NUL byte in the path"));
    }
    Ok(())
}

//! The polling watchers (`CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`): a
//! sandbox's [`Watchers`] by id (at most `MAX_WATCHERS`), each with a pump thread that
//! queues its events (at most [`MAX_WATCHER_EVENTS`]: more ends it with an error) until
//! they are collected.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use vmm::agent::WatchStopper;

use super::watch::{ended, fs_event, open_watch, EventEntries};
use crate::envd::connect::{Code, RpcError};
use crate::envd::{lock, pb, SandboxConn, User};

/// Polling watchers one sandbox may have (removed or not).
const MAX_WATCHERS: usize = 64;
/// Events a polling watcher keeps until they are collected; more ends it with an error.
pub(crate) const MAX_WATCHER_EVENTS: usize = 16_384;

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

pub(super) fn create_watcher(
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

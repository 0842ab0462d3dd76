//! Directory watches: [`Watch`] follows one (`Watch` / `WatchEvent` / `Unwatch` in
//! `guest-agent/PROTOCOL.md`), [`WatchStopper`] ends it from another thread.

use std::path::{Path, PathBuf};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use guest_agent::proto::{AgentMsg, HostMsg};

use super::connection::{Inner, Registration};
use super::{check, recv, unexpected};
use crate::error::Result;
pub use guest_agent::proto::WatchKind;

/// One change in a watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// Relative to the watched directory (`sub/f.txt` in a recursive watch); empty for
    /// a kernel queue overflow.
    pub name: PathBuf,
    pub kind: WatchKind,
}

/// A running watch. Its events must be consumed promptly (they share the connection's
/// buffers); dropping it stops the watch.
pub struct Watch {
    inner: Arc<Inner>,
    reg: Registration,
    rx: Receiver<AgentMsg>,
    done: bool,
}

/// Stops a [`Watch`] from any thread.
#[derive(Clone)]
pub struct WatchStopper {
    inner: Arc<Inner>,
    id: u32,
}

impl WatchStopper {
    /// Asks the agent to stop the watch: its [`Watch::next_event`] then returns `None`.
    /// A watch that has ended already is not an error.
    pub fn stop(&self) -> Result<()> {
        let (_reg, rx) = self
            .inner
            .start(&HostMsg::Unwatch { target: self.id }, None)?;
        match recv(&rx)? {
            AgentMsg::Ok => Ok(()),
            AgentMsg::Error(e) if e.kind == guest_agent::proto::ErrorKind::UnknownId => Ok(()),
            m => Err(unexpected("unwatch", &check(m)?)),
        }
    }
}

pub(crate) fn start(inner: &Arc<Inner>, path: &Path, recursive: bool) -> Result<Watch> {
    let (reg, rx) = inner.start(
        &HostMsg::Watch {
            path: path.to_path_buf(),
            recursive,
        },
        None,
    )?;
    match check(recv(&rx)?)? {
        AgentMsg::Ok => {}
        m => return Err(unexpected("watch", &m)),
    }
    Ok(Watch {
        inner: inner.clone(),
        reg,
        rx,
        done: false,
    })
}

impl Watch {
    /// The next event; `None` once the watch was stopped. An error ends the watch (the
    /// watched directory was removed: [`crate::Error::Agent`] with `NotFound`; the
    /// connection was lost).
    pub fn next_event(&mut self) -> Result<Option<WatchEvent>> {
        if self.done {
            return Ok(None);
        }
        let m = recv(&self.rx);
        let m = match m.and_then(check) {
            Ok(m) => m,
            Err(e) => {
                self.done = true;
                return Err(e);
            }
        };
        match m {
            AgentMsg::WatchEvent { name, kind } => Ok(Some(WatchEvent { name, kind })),
            AgentMsg::Ok => {
                self.done = true;
                Ok(None)
            }
            m => {
                self.done = true;
                Err(unexpected("watch", &m))
            }
        }
    }

    /// A handle that stops this watch from another thread.
    pub fn stopper(&self) -> WatchStopper {
        WatchStopper {
            inner: self.inner.clone(),
            id: self.reg.id,
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.done {
            // Best effort, without waiting for the answers (no one reads them).
            if let Ok((reg, _rx)) = self.inner.register(None) {
                let _ = self.inner.send(
                    reg.id,
                    &HostMsg::Unwatch {
                        target: self.reg.id,
                    },
                );
            }
        }
    }
}

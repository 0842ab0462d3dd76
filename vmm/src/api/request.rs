//! The API's messages: [`Request`] (with [`RestoreRequest`], the options of a restore) and
//! [`Response`], as they are encoded on the wire (one JSON object a line). Kept apart from
//! the sockets that carry them: the host layer and the clients only need these types.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{QUICK_ANSWER_TIMEOUT, WORK_ANSWER_TIMEOUT};

/// A control request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The VM's state.
    Status,
    /// Pause all vCPUs.
    Pause,
    /// Let paused vCPUs run again (`"resume"` is accepted too, the op's earlier name).
    #[serde(alias = "resume")]
    Unpause,
    /// Stop the VM.
    Shutdown,
    /// Write a snapshot into `dir`.
    Snapshot {
        /// Target directory.
        dir: PathBuf,
        /// "full" or "diff".
        #[serde(default = "default_kind")]
        kind: String,
    },
    /// Freeze the disk's top layer as it is now and let the VM continue on a new overlay
    /// on it (a build's step made a layer; the guest should have synced first).
    FreezeDisk,
    /// Fork the VM into `count` child VM processes (see `clade fork`).
    Fork {
        /// Number of children.
        count: usize,
        /// Directory for the children's sockets and logs (default: the API socket's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prefix: Option<PathBuf>,
        /// Give each child's guest agent the time, entropy and a hostname suffix.
        #[serde(default = "default_true")]
        agent_sync: bool,
        /// Each child's TAP, as `--net` takes it (`tap=NAME[,netns=PATH]`): one per child,
        /// required when the VM has a network device.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        nets: Vec<String>,
    },
    /// Restore a snapshot into this process's pre-built VM shell (a standby process only,
    /// once; see [`crate::host::standby`]).
    Restore(RestoreRequest),
    /// Open a snapshot ahead, so that a later `restore` of it skips that part (a standby
    /// process only; see [`crate::host::standby`]).
    Preload {
        /// The snapshot directory (absolute, no `..`).
        snapshot: PathBuf,
    },
}

impl Request {
    /// How long a client waits for this request's answer: a VM process that has not
    /// answered by then is taken as wedged (its caller ends it) rather than waited on
    /// forever.
    pub fn answer_timeout(&self) -> Duration {
        match self {
            Request::Status
            | Request::Pause
            | Request::Unpause
            | Request::Shutdown
            | Request::FreezeDisk => QUICK_ANSWER_TIMEOUT,
            Request::Snapshot { .. }
            | Request::Fork { .. }
            | Request::Restore(_)
            | Request::Preload { .. } => WORK_ANSWER_TIMEOUT,
        }
    }
}

/// What a VM is restored from and where its files go: the options of `clade restore`, as
/// one value, so that the command line and a standby process's `restore` request restore
/// through the same code ([`crate::host::restore_request`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreRequest {
    /// The snapshot directory.
    pub snapshot: PathBuf,
    /// How guest memory is restored: "uffd" (default), "file" or "copy".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The vsock device's Unix socket (default: the snapshot's, which must be free).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<PathBuf>,
    /// Where the serial console goes (default: standard output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_file: Option<PathBuf>,
    /// A snapshot with a disk: the VM's own overlay on the snapshot's frozen layer (must
    /// not exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_overlay: Option<PathBuf>,
    /// The VMM's log (its standard error) from the restore on, appended (standby only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
    /// Give the guest agent the time and fresh entropy after the restore.
    #[serde(default = "default_true")]
    pub agent_sync: bool,
    /// How long the agent sync may take, in milliseconds (default 5000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_sync_timeout_ms: Option<u64>,
    /// `uffd`: record and prefetch a working set.
    #[serde(default = "default_true")]
    pub working_set: bool,
    /// `uffd`, when the snapshot has no working set yet: where the one recorded is written,
    /// instead of the snapshot's directory (which a jailed VM may not write); its service
    /// installs it there. Under the files root, like the other files the VM makes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_set_to: Option<PathBuf>,
    /// The virtio-net device's TAP, as `--net` takes it (`tap=NAME[,mac=MAC]` or
    /// `fd=N[,mac=MAC]`); required when the snapshot has a network device, unless
    /// `tap_passed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<String>,
    /// The TAP is the descriptor sent with this request (`SCM_RIGHTS`, API requests only;
    /// `net` then unset): a host service opens its networks' TAPs ahead, so a restore
    /// does not attach to one on its path.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tap_passed: bool,
}

impl RestoreRequest {
    /// A request for `snapshot` with every other option at its default.
    pub fn new(snapshot: PathBuf) -> Self {
        RestoreRequest {
            snapshot,
            backend: None,
            vsock: None,
            serial_file: None,
            disk_overlay: None,
            log: None,
            agent_sync: true,
            agent_sync_timeout_ms: None,
            working_set: true,
            working_set_to: None,
            net: None,
            tap_passed: false,
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_kind() -> String {
    "full".into()
}

/// A response: `ok` plus either result fields or an error message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// Whether the request succeeded.
    pub ok: bool,
    /// Error message when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Result fields when `ok` is true.
    #[serde(flatten)]
    pub fields: serde_json::Map<String, serde_json::Value>,
}

impl Response {
    /// A success with these fields.
    pub fn ok(fields: serde_json::Value) -> Self {
        Self {
            ok: true,
            error: None,
            fields: match fields {
                serde_json::Value::Object(m) => m,
                _ => serde_json::Map::new(),
            },
        }
    }

    /// A failure.
    pub fn err(msg: impl ToString) -> Self {
        Self {
            ok: false,
            error: Some(msg.to_string()),
            fields: serde_json::Map::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn a_huge_fork_count_is_a_request_not_a_crash() {
        let r: Request =
            serde_json::from_str(r#"{"op":"fork","count":18446744073709551615}"#).unwrap();
        assert_eq!(
            r,
            Request::Fork {
                count: usize::MAX,
                prefix: None,
                agent_sync: true,
                nets: Vec::new(),
            }
        );
        assert!(crate::fork::check_child_count(usize::MAX).is_err());
        assert!(crate::fork::check_child_count(0).is_err());
        assert!(crate::fork::check_child_count(crate::fork::MAX_FORK_CHILDREN).is_ok());
    }

    #[test]
    fn a_restore_request_has_the_restore_commands_defaults() {
        let r: Request = serde_json::from_str(r#"{"op":"restore","snapshot":"/s"}"#).unwrap();
        assert_eq!(r, Request::Restore(RestoreRequest::new("/s".into())));
        let Request::Restore(full) = serde_json::from_str::<Request>(
            r#"{"op":"restore","snapshot":"/s","vsock":"/r/v","serial_file":"/r/s",
                "disk_overlay":"/r/d","log":"/r/l","agent_sync":false,
                "agent_sync_timeout_ms":250,"backend":"file","working_set":false}"#,
        )
        .unwrap() else {
            panic!("not a restore")
        };
        assert_eq!(full.vsock.as_deref(), Some(Path::new("/r/v")));
        assert_eq!(full.agent_sync_timeout_ms, Some(250));
        assert!(!full.agent_sync && !full.working_set);
        // Round trip, and a request without its snapshot is a bad request.
        let again: Request =
            serde_json::from_str(&serde_json::to_string(&Request::Restore(full.clone())).unwrap())
                .unwrap();
        assert_eq!(again, Request::Restore(full));
        assert!(serde_json::from_str::<Request>(r#"{"op":"restore"}"#).is_err());
    }
}

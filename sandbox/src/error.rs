//! The crate's one error type. Each variant says what failed and maps to one HTTP status
//! (see `http`): the control API's error bodies come from here.

use std::path::PathBuf;

/// Everything the sandbox host can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No sandbox with this id (or it was killed).
    #[error("sandbox {0} not found")]
    NotFound(String),
    /// A sandbox whose VM process ended without being asked to.
    #[error("sandbox {id} is not running: its VM process ended unexpectedly ({why}); kill it to remove it")]
    Crashed {
        /// The sandbox.
        id: String,
        /// What was observed (exit status, or "process gone").
        why: String,
    },
    /// The request is not acceptable (bad value, unknown template, over a limit).
    #[error("{0}")]
    BadRequest(String),
    /// The sandbox is in a state that does not allow the operation (pause of a paused one).
    #[error("{0}")]
    Conflict(String),
    /// Another host of the cluster owns the sandbox now (see `ownership`): this host
    /// forgot its copy and changed nothing.
    #[error("sandbox {id} is owned by another node now: {why}")]
    Fenced {
        /// The sandbox.
        id: String,
        /// What the cluster said.
        why: String,
    },
    /// This host has no room for the VMs asked for (in a cluster, its committed vCPUs or
    /// memory would pass what it may commit, see `ownership`): nothing was started.
    #[error("{0}")]
    NoRoom(String),
    /// The cluster's registry could not be asked (see `ownership`): nothing was changed.
    #[error("cluster registry: {0}")]
    Cluster(String),
    /// The guest agent did not answer what the operation needs of it (a filesystem-only
    /// pause's flush, a pause that requires a healthy guest): the sandbox runs on as it was.
    #[error("sandbox {id}: {why}; the sandbox keeps running")]
    GuestUnresponsive {
        /// The sandbox.
        id: String,
        /// What did not answer, and how.
        why: String,
    },
    /// No live snapshot with this id or name.
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    /// No template with this name.
    #[error("template {0} not found")]
    TemplateNotFound(String),
    /// A template's files are missing or unreadable.
    #[error("template {name}: {why}")]
    TemplateBroken {
        /// The template.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// The registry database failed.
    #[error("registry database: {0}")]
    Db(#[from] rusqlite::Error),
    /// A file or process operation failed.
    #[error("{context} {path}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// On which path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A VM process could not be started, or did not come up.
    #[error("VM process: {0}")]
    Vm(String),
    /// A VM's control API refused a request or failed.
    #[error("VM control API ({op}): {message}")]
    VmApi {
        /// The operation.
        op: &'static str,
        /// The VM's answer or the transport error.
        message: String,
    },
    /// Stored data that does not parse (metadata JSON, template file).
    #[error("stored data: {0}")]
    Corrupt(String),
    /// A sandbox network could not be made, changed or removed (or networking is off).
    #[error("network: {0}")]
    Network(String),
    /// The object store (`clade serve --store`) failed or holds something unusable.
    #[error("object store: {0}")]
    Store(String),
}

impl Error {
    pub(crate) fn io(
        context: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io {
            context,
            path,
            source,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

//! The messages: [`HostMsg`] (host -> agent, tags below 0x80) and [`AgentMsg`] (agent ->
//! host, tags from 0x80), either direction as [`Msg`], and a decoded [`Frame`]. What each
//! message means is documented here; how it is laid out on the wire is in `encode.rs` and
//! `decode.rs`.

use std::path::PathBuf;

use super::{
    DirEntry, ExecSpec, ExitStatus, FileStat, ProcInfo, RemoteError, WatchKind, WinSize, XattrList,
};

/// Messages host -> agent (tags 0x01..0x7f).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMsg {
    /// Version negotiation; must be the first frame (id 0).
    Hello {
        min_version: u16,
        max_version: u16,
        client: String,
    },
    Ping,
    Exec(ExecSpec),
    /// Stdin bytes for the exec with this frame's id.
    Stdin(Vec<u8>),
    /// End of stdin for the exec with this frame's id.
    StdinClose,
    /// Send `signal` to the exec `target` (its process group if `group`).
    Signal {
        target: u32,
        signal: i32,
        group: bool,
    },
    /// Resize the PTY of the exec `target`.
    Resize {
        target: u32,
        size: WinSize,
    },
    ReadFile {
        path: PathBuf,
    },
    /// Create/truncate `path` with permission bits `mode`; data follows as FileData, FileEnd.
    WriteFile {
        path: PathBuf,
        mode: u32,
    },
    /// A chunk of the upload with this frame's id.
    FileData(Vec<u8>),
    /// End of the upload with this frame's id.
    FileEnd,
    Stat {
        path: PathBuf,
        follow_symlinks: bool,
    },
    List {
        path: PathBuf,
    },
    Remove {
        path: PathBuf,
        recursive: bool,
    },
    /// Set CLOCK_REALTIME to this many nanoseconds since the Unix epoch.
    SetClock {
        unix_ns: i64,
    },
    /// Mix these bytes into the kernel RNG and credit them (RNDADDENTROPY).
    AddEntropy(Vec<u8>),
    Sync,
    PowerOff,
    /// Create a directory with exactly `mode` (umask ignored); with `parents`, missing
    /// parents too (mode 0o755) and no error if it exists already as a directory.
    MakeDir {
        path: PathBuf,
        mode: u32,
        parents: bool,
    },
    /// rename(2) `from` to `to` (same filesystem; replaces a file at `to`).
    Rename {
        from: PathBuf,
        to: PathBuf,
    },
    /// readlink(2): what the symbolic link `path` points to, as written in it.
    ReadLink {
        path: PathBuf,
    },
    /// The extended attributes under `prefix` (a `user.` name prefix) of each of `paths`
    /// (at most [`MAX_XATTR_PATHS`](super::MAX_XATTR_PATHS)): one list per path, in
    /// order; a path that is gone or whose attributes cannot be read has an empty one.
    GetXattrs {
        paths: Vec<PathBuf>,
        prefix: String,
    },
    /// Makes the extended attributes under `prefix` (a `user.` name prefix) of `path`
    /// exactly `set` (full names, each under `prefix`; at most
    /// [`MAX_XATTRS`](super::MAX_XATTRS)): the others under it are removed.
    SetXattrs {
        path: PathBuf,
        prefix: String,
        set: XattrList,
    },
    /// File operations on this connection from now on run with these filesystem
    /// credentials (fsuid, fsgid, supplementary groups: at most
    /// [`MAX_GROUPS`](super::MAX_GROUPS)), so the kernel checks the user's permissions and
    /// what is created is the user's. The connection may then no longer Exec or Spawn.
    AsUser {
        uid: u32,
        gid: u32,
        groups: Vec<u32>,
    },
    /// Like Exec, but the process belongs to the agent, not to this connection: it keeps
    /// running when the connection closes, and any connection can Attach to it by pid.
    Spawn {
        spec: ExecSpec,
        /// A name to find it by (at most [`MAX_TAG_LEN`](super::MAX_TAG_LEN) bytes).
        tag: Option<String>,
        /// Opaque to the agent (at most [`MAX_META_LEN`](super::MAX_META_LEN) bytes);
        /// returned by ListProcs.
        meta: Vec<u8>,
    },
    /// Follow a kept process: this id then names it (Stdin, StdinClose, Signal, Resize) and,
    /// with `output`, receives its Stdout/Stderr; it ends with Exited.
    Attach {
        pid: u32,
        output: bool,
    },
    /// The kept processes (running, and recently ended).
    ListProcs,
    /// Watch the directory `path` (and with `recursive` its subdirectories, also those
    /// made later): `Ok` once watching, then WatchEvent frames on this id until Unwatch
    /// (final `Ok`) or an `Error` (final).
    Watch {
        path: PathBuf,
        recursive: bool,
    },
    /// Stop the watch `target`.
    Unwatch {
        target: u32,
    },
}

/// Messages agent -> host (tags 0x80..0xff).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentMsg {
    HelloOk {
        version: u16,
        agent_version: String,
        max_frame_len: u32,
    },
    /// Generic success.
    Ok,
    Error(RemoteError),
    Pong {
        agent_version: String,
        protocol: u16,
        /// Guest uptime (CLOCK_BOOTTIME).
        uptime_ms: u64,
        /// Execs running, all connections.
        running_execs: u32,
    },
    Started {
        pid: u32,
    },
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// The agent wrote this many stdin bytes to the process (or dropped them: stdin closed).
    StdinAck(u32),
    Exited(ExitStatus),
    /// A chunk of a ReadFile download.
    FileData(Vec<u8>),
    /// End of a ReadFile download, or result of a WriteFile upload: the byte count.
    FileDone {
        bytes: u64,
    },
    Stat(FileStat),
    /// Part of a List reply (more may follow; Ok ends the listing).
    DirEntries(Vec<DirEntry>),
    /// Part of a ListProcs reply (more may follow; Ok ends the listing).
    ProcList(Vec<ProcInfo>),
    /// Something happened in a watched directory: `name` is relative to it.
    WatchEvent {
        name: PathBuf,
        kind: WatchKind,
    },
    /// Reply to ReadLink.
    LinkTarget {
        target: PathBuf,
    },
    /// Reply to GetXattrs: one list of (name, value) per path asked about, in order.
    Xattrs(Vec<XattrList>),
}

/// Either direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Host(HostMsg),
    Agent(AgentMsg),
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub id: u32,
    pub msg: Msg,
}

//! The wire protocol between the host and `clade-agent` (specification: `PROTOCOL.md`).
//!
//! A connection carries length-prefixed frames in both directions:
//!
//! ```text
//! frame := len:u32le  tag:u8  id:u32le  payload      (len counts tag + id + payload)
//! ```
//!
//! Tags below 0x80 travel host -> agent ([`HostMsg`]); tags from 0x80 travel agent -> host
//! ([`AgentMsg`]). The `id` names the operation a frame belongs to, so any number of
//! operations can be in flight on one connection. Payload fields use a small fixed binary
//! encoding (little-endian integers, `u32`-length-prefixed byte strings), written and read by
//! hand here: no serde, no format crate, and every length is checked against the bytes that
//! are really there before anything is allocated, so [`decode_frame`] can be fed anything.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use crate::Error;

/// Newest protocol version this crate speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Oldest protocol version this crate speaks.
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// The agent's version string (the crate version), reported by `HelloOk` and `Pong`.
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");
/// The vsock port the agent listens on inside the guest.
pub const AGENT_VSOCK_PORT: u32 = 52;
/// Largest allowed value of a frame's length field (tag + id + payload), both directions.
pub const MAX_FRAME_LEN: u32 = 1024 * 1024;
/// Bytes of tag + id at the start of every frame body.
pub const FRAME_HEADER_LEN: usize = 5;
/// Largest data chunk a sender should put in one Stdin/Stdout/Stderr/FileData frame.
pub const CHUNK_LEN: usize = 64 * 1024;
/// Bytes of exec stdin the host may have sent but the agent not yet acknowledged (StdinAck).
pub const STDIN_WINDOW: u32 = 256 * 1024;
/// Largest AddEntropy payload the agent accepts.
pub const MAX_ENTROPY_LEN: usize = 64 * 1024;
/// Longest `tag` of a Spawn.
pub const MAX_TAG_LEN: usize = 256;
/// Most supplementary groups an AsUser may carry (NGROUPS is far larger; no sandbox user
/// needs more).
pub const MAX_GROUPS: usize = 64;
/// Most paths one GetXattrs may ask about (a directory listing's worth at a time).
pub const MAX_XATTR_PATHS: usize = 4096;
/// Most extended attributes one SetXattrs sets, or one path reports.
pub const MAX_XATTRS: usize = 256;

/// A file's extended attributes: (full name, value) pairs.
pub type XattrList = Vec<(String, Vec<u8>)>;
/// Longest `meta` of a Spawn (opaque to the agent, returned by ListProcs).
pub const MAX_META_LEN: usize = 64 * 1024;

/// Terminal size for PTY execs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WinSize {
    pub rows: u16,
    pub cols: u16,
}

/// What to run (the payload of [`HostMsg::Exec`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecSpec {
    /// Program and arguments; `argv[0]` without a `/` is looked up in the child's `PATH`.
    pub argv: Vec<OsString>,
    /// The child's whole environment (the agent adds only a default `PATH` if absent).
    pub env: Vec<(OsString, OsString)>,
    /// Working directory (default: `/`).
    pub cwd: Option<PathBuf>,
    /// Run as this user id (default: the agent's, root).
    pub uid: Option<u32>,
    /// Run as this group id (default: the agent's); supplementary groups are cleared when
    /// `uid` or `gid` is given.
    pub gid: Option<u32>,
    /// Run on a new pseudo-terminal of this size (stdout and stderr both arrive as Stdout).
    pub tty: Option<WinSize>,
    /// The host will send stdin (Stdin / StdinClose); otherwise stdin is `/dev/null`.
    pub stdin: bool,
}

/// One kept process (started by Spawn) as ListProcs reports it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProcInfo {
    pub pid: u32,
    /// The Spawn's tag.
    pub tag: Option<String>,
    /// The Spawn's opaque metadata.
    pub meta: Vec<u8>,
    pub argv: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    pub cwd: Option<PathBuf>,
    /// It runs on a PTY.
    pub tty: bool,
    /// It was started with a stdin pipe (or PTY input).
    pub stdin: bool,
    /// `None` while it runs; how it ended for a recently ended process.
    pub exit: Option<ExitStatus>,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// It called exit with this code.
    Exited(i32),
    /// A signal killed it.
    Signaled { signal: i32, core_dumped: bool },
}

impl ExitStatus {
    /// The shell convention: the exit code, or 128 + signal number.
    pub fn code(&self) -> i32 {
        match *self {
            ExitStatus::Exited(c) => c,
            ExitStatus::Signaled { signal, .. } => 128 + signal,
        }
    }

    /// Exited with code 0.
    pub fn success(&self) -> bool {
        *self == ExitStatus::Exited(0)
    }

    /// From a raw `waitpid` status; `None` for stop/continue reports.
    pub fn from_wait_status(status: i32) -> Option<Self> {
        if libc::WIFEXITED(status) {
            Some(ExitStatus::Exited(libc::WEXITSTATUS(status)))
        } else if libc::WIFSIGNALED(status) {
            Some(ExitStatus::Signaled {
                signal: libc::WTERMSIG(status),
                core_dumped: libc::WCOREDUMP(status),
            })
        } else {
            None
        }
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            ExitStatus::Exited(c) => write!(f, "exit code {c}"),
            ExitStatus::Signaled {
                signal,
                core_dumped,
            } => write!(
                f,
                "killed by signal {signal}{}",
                if core_dumped { " (core dumped)" } else { "" }
            ),
        }
    }
}

/// File type in [`FileStat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

impl FileKind {
    fn code(self) -> u8 {
        match self {
            FileKind::File => 0,
            FileKind::Dir => 1,
            FileKind::Symlink => 2,
            FileKind::Other => 3,
        }
    }

    fn from_code(c: u8) -> Result<Self, Error> {
        Ok(match c {
            0 => FileKind::File,
            1 => FileKind::Dir,
            2 => FileKind::Symlink,
            3 => FileKind::Other,
            _ => return Err(Error::Invalid("file kind")),
        })
    }
}

/// Metadata of one file (reply to Stat; one per List entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStat {
    pub kind: FileKind,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub size: u64,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
}

/// One directory entry (List reply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: OsString,
    pub stat: FileStat,
}

/// What happened to an entry of a watched directory ([`AgentMsg::WatchEvent`]). The wire
/// codes of the five kinds are envd's `EventType` numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchKind {
    /// Events were lost: the kernel's queue overflowed (empty name), or a subdirectory
    /// (the name) could not be watched (the per-watch directory limit was reached).
    Overflow,
    /// Created, or moved into the watched tree.
    Create,
    /// Its content was written.
    Write,
    /// Removed.
    Remove,
    /// Moved away from this name (the new name, if inside the tree, gets a Create).
    Rename,
    /// Its metadata (mode, owner, times) changed.
    Chmod,
    /// A code this version does not know (newer agent).
    Other(u8),
}

impl WatchKind {
    /// Wire code.
    pub fn code(self) -> u8 {
        match self {
            WatchKind::Overflow => 0,
            WatchKind::Create => 1,
            WatchKind::Write => 2,
            WatchKind::Remove => 3,
            WatchKind::Rename => 4,
            WatchKind::Chmod => 5,
            WatchKind::Other(c) => c,
        }
    }

    /// From a wire code (unknown codes become [`WatchKind::Other`]).
    pub fn from_code(c: u8) -> Self {
        match c {
            0 => WatchKind::Overflow,
            1 => WatchKind::Create,
            2 => WatchKind::Write,
            3 => WatchKind::Remove,
            4 => WatchKind::Rename,
            5 => WatchKind::Chmod,
            c => WatchKind::Other(c),
        }
    }
}

/// Error categories carried by an [`AgentMsg::Error`] frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The frame could not be decoded.
    BadFrame,
    /// The frame's length field exceeds [`MAX_FRAME_LEN`]; the agent closes the connection.
    FrameTooLarge,
    /// No protocol version in common.
    UnsupportedVersion,
    /// A request arrived before Hello.
    HandshakeRequired,
    /// The tag is not a host -> agent message this agent knows.
    UnknownMessage,
    /// The id (or target) names no operation in flight.
    UnknownId,
    /// The id is already used by an operation in flight.
    IdInUse,
    /// A field has an unusable value.
    InvalidArgument,
    /// ENOENT.
    NotFound,
    /// EACCES / EPERM.
    PermissionDenied,
    /// EEXIST.
    AlreadyExists,
    /// Another OS error; see the frame's errno.
    Io,
    /// The operation is not available in this agent mode.
    Unsupported,
    /// A bug or resource failure in the agent.
    Internal,
    /// A code this version does not know (newer agent).
    Other(u16),
}

impl ErrorKind {
    /// Wire code.
    pub fn code(self) -> u16 {
        match self {
            ErrorKind::BadFrame => 1,
            ErrorKind::FrameTooLarge => 2,
            ErrorKind::UnsupportedVersion => 3,
            ErrorKind::HandshakeRequired => 4,
            ErrorKind::UnknownMessage => 5,
            ErrorKind::UnknownId => 6,
            ErrorKind::IdInUse => 7,
            ErrorKind::InvalidArgument => 8,
            ErrorKind::NotFound => 9,
            ErrorKind::PermissionDenied => 10,
            ErrorKind::AlreadyExists => 11,
            ErrorKind::Io => 12,
            ErrorKind::Unsupported => 13,
            ErrorKind::Internal => 14,
            ErrorKind::Other(c) => c,
        }
    }

    /// From a wire code (unknown codes become [`ErrorKind::Other`]).
    pub fn from_code(c: u16) -> Self {
        match c {
            1 => ErrorKind::BadFrame,
            2 => ErrorKind::FrameTooLarge,
            3 => ErrorKind::UnsupportedVersion,
            4 => ErrorKind::HandshakeRequired,
            5 => ErrorKind::UnknownMessage,
            6 => ErrorKind::UnknownId,
            7 => ErrorKind::IdInUse,
            8 => ErrorKind::InvalidArgument,
            9 => ErrorKind::NotFound,
            10 => ErrorKind::PermissionDenied,
            11 => ErrorKind::AlreadyExists,
            12 => ErrorKind::Io,
            13 => ErrorKind::Unsupported,
            14 => ErrorKind::Internal,
            c => ErrorKind::Other(c),
        }
    }

    /// The kind for an OS errno.
    pub fn from_errno(errno: i32) -> Self {
        match errno {
            libc::ENOENT => ErrorKind::NotFound,
            libc::EACCES | libc::EPERM => ErrorKind::PermissionDenied,
            libc::EEXIST => ErrorKind::AlreadyExists,
            libc::EINVAL => ErrorKind::InvalidArgument,
            _ => ErrorKind::Io,
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            ErrorKind::BadFrame => "bad frame",
            ErrorKind::FrameTooLarge => "frame too large",
            ErrorKind::UnsupportedVersion => "unsupported protocol version",
            ErrorKind::HandshakeRequired => "handshake required",
            ErrorKind::UnknownMessage => "unknown message",
            ErrorKind::UnknownId => "unknown id",
            ErrorKind::IdInUse => "id in use",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::NotFound => "not found",
            ErrorKind::PermissionDenied => "permission denied",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::Io => "I/O error",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Internal => "internal error",
            ErrorKind::Other(c) => return write!(f, "error kind {c}"),
        };
        f.write_str(s)
    }
}

/// A typed error reply from the agent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct RemoteError {
    pub kind: ErrorKind,
    /// The OS errno behind it, 0 if none.
    pub errno: i32,
    pub message: String,
}

impl RemoteError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        RemoteError {
            kind,
            errno: 0,
            message: message.into(),
        }
    }

    /// From an OS error, with what was being done (`"open /etc/x"`) as context.
    pub fn from_io(err: &io::Error, context: impl std::fmt::Display) -> Self {
        let errno = err.raw_os_error().unwrap_or(0);
        let kind = if errno != 0 {
            ErrorKind::from_errno(errno)
        } else {
            match err.kind() {
                io::ErrorKind::NotFound => ErrorKind::NotFound,
                io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                io::ErrorKind::AlreadyExists => ErrorKind::AlreadyExists,
                io::ErrorKind::InvalidInput => ErrorKind::InvalidArgument,
                _ => ErrorKind::Io,
            }
        };
        RemoteError {
            kind,
            errno,
            message: format!("{context}: {err}"),
        }
    }
}

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
    /// (at most [`MAX_XATTR_PATHS`]): one list per path, in order; a path that is gone or
    /// whose attributes cannot be read has an empty one.
    GetXattrs {
        paths: Vec<PathBuf>,
        prefix: String,
    },
    /// Makes the extended attributes under `prefix` (a `user.` name prefix) of `path`
    /// exactly `set` (full names, each under `prefix`; at most [`MAX_XATTRS`]): the others
    /// under it are removed.
    SetXattrs {
        path: PathBuf,
        prefix: String,
        set: XattrList,
    },
    /// File operations on this connection from now on run with these filesystem
    /// credentials (fsuid, fsgid, supplementary groups: at most [`MAX_GROUPS`]), so the
    /// kernel checks the user's permissions and what is created is the user's. The
    /// connection may then no longer Exec or Spawn.
    AsUser {
        uid: u32,
        gid: u32,
        groups: Vec<u32>,
    },
    /// Like Exec, but the process belongs to the agent, not to this connection: it keeps
    /// running when the connection closes, and any connection can Attach to it by pid.
    Spawn {
        spec: ExecSpec,
        /// A name to find it by (at most [`MAX_TAG_LEN`] bytes).
        tag: Option<String>,
        /// Opaque to the agent (at most [`MAX_META_LEN`] bytes); returned by ListProcs.
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

// ----------------------------------------------------------------------------- tags

mod tag {
    pub const HELLO: u8 = 0x01;
    pub const PING: u8 = 0x02;
    pub const EXEC: u8 = 0x03;
    pub const STDIN: u8 = 0x04;
    pub const STDIN_CLOSE: u8 = 0x05;
    pub const SIGNAL: u8 = 0x06;
    pub const RESIZE: u8 = 0x07;
    pub const READ_FILE: u8 = 0x08;
    pub const WRITE_FILE: u8 = 0x09;
    pub const FILE_DATA_UP: u8 = 0x0a;
    pub const FILE_END: u8 = 0x0b;
    pub const STAT: u8 = 0x0c;
    pub const LIST: u8 = 0x0d;
    pub const REMOVE: u8 = 0x0e;
    pub const SET_CLOCK: u8 = 0x0f;
    pub const ADD_ENTROPY: u8 = 0x10;
    pub const SYNC: u8 = 0x11;
    pub const POWER_OFF: u8 = 0x12;
    pub const MAKE_DIR: u8 = 0x13;
    pub const RENAME: u8 = 0x14;
    pub const SPAWN: u8 = 0x15;
    pub const ATTACH: u8 = 0x16;
    pub const LIST_PROCS: u8 = 0x17;
    pub const WATCH: u8 = 0x18;
    pub const UNWATCH: u8 = 0x19;
    pub const READ_LINK: u8 = 0x1a;
    pub const AS_USER: u8 = 0x1b;
    pub const GET_XATTRS: u8 = 0x1c;
    pub const SET_XATTRS: u8 = 0x1d;

    pub const HELLO_OK: u8 = 0x80;
    pub const OK: u8 = 0x81;
    pub const ERROR: u8 = 0x82;
    pub const PONG: u8 = 0x83;
    pub const STARTED: u8 = 0x84;
    pub const STDOUT: u8 = 0x85;
    pub const STDERR: u8 = 0x86;
    pub const STDIN_ACK: u8 = 0x87;
    pub const EXITED: u8 = 0x88;
    pub const FILE_DATA_DOWN: u8 = 0x89;
    pub const FILE_DONE: u8 = 0x8a;
    pub const STAT_REPLY: u8 = 0x8b;
    pub const DIR_ENTRIES: u8 = 0x8c;
    pub const PROC_LIST: u8 = 0x8d;
    pub const WATCH_EVENT: u8 = 0x90;
    pub const LINK_TARGET: u8 = 0x91;
    pub const XATTRS: u8 = 0x92;
}

// ----------------------------------------------------------------------------- encoding

/// Builds one frame: reserves the length prefix, then fills it in at the end.
struct Enc {
    buf: Vec<u8>,
}

impl Enc {
    fn new(tag: u8, id: u32) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&[0; 4]);
        buf.push(tag);
        buf.extend_from_slice(&id.to_le_bytes());
        Enc { buf }
    }
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    fn bool(&mut self, v: bool) {
        self.buf.push(u8::from(v));
    }
    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn i32(&mut self, v: i32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        // Lengths beyond u32 cannot fit a frame anyway; finish() rejects the frame.
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.buf.extend_from_slice(b);
    }
    fn os(&mut self, s: &std::ffi::OsStr) {
        self.bytes(s.as_bytes());
    }
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    fn spec(&mut self, spec: &ExecSpec) {
        self.argv_env_cwd(&spec.argv, &spec.env, spec.cwd.as_deref());
        self.opt_u32(spec.uid);
        self.opt_u32(spec.gid);
        match spec.tty {
            None => self.u8(0),
            Some(ws) => {
                self.u8(1);
                self.u16(ws.rows);
                self.u16(ws.cols);
            }
        }
        self.bool(spec.stdin);
    }
    fn argv_env_cwd(
        &mut self,
        argv: &[OsString],
        env: &[(OsString, OsString)],
        cwd: Option<&std::path::Path>,
    ) {
        self.count(argv.len());
        for a in argv {
            self.os(a);
        }
        self.count(env.len());
        for (k, v) in env {
            self.os(k);
            self.os(v);
        }
        match cwd {
            None => self.u8(0),
            Some(p) => {
                self.u8(1);
                self.os(p.as_os_str());
            }
        }
    }
    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            None => self.u8(0),
            Some(s) => {
                self.u8(1);
                self.str(s);
            }
        }
    }
    fn exit(&mut self, st: &ExitStatus) {
        match *st {
            ExitStatus::Exited(c) => {
                self.u8(0);
                self.i32(c);
                self.bool(false);
            }
            ExitStatus::Signaled {
                signal,
                core_dumped,
            } => {
                self.u8(1);
                self.i32(signal);
                self.bool(core_dumped);
            }
        }
    }
    fn proc_info(&mut self, p: &ProcInfo) {
        self.u32(p.pid);
        self.opt_str(p.tag.as_deref());
        self.bytes(&p.meta);
        self.argv_env_cwd(&p.argv, &p.env, p.cwd.as_deref());
        self.bool(p.tty);
        self.bool(p.stdin);
        match &p.exit {
            None => self.u8(0),
            Some(st) => {
                self.u8(1);
                self.exit(st);
            }
        }
    }
    fn opt_u32(&mut self, v: Option<u32>) {
        match v {
            None => self.u8(0),
            Some(v) => {
                self.u8(1);
                self.u32(v);
            }
        }
    }
    fn stat(&mut self, s: &FileStat) {
        self.u8(s.kind.code());
        self.u32(s.mode);
        self.u64(s.size);
        self.u32(s.uid);
        self.u32(s.gid);
        self.i64(s.mtime_ns);
    }
    fn count(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    fn xattr_list(&mut self, l: &[(String, Vec<u8>)]) {
        self.count(l.len());
        for (name, value) in l {
            self.str(name);
            self.bytes(value);
        }
    }
    fn finish(mut self) -> Result<Vec<u8>, Error> {
        let len = self.buf.len() - 4;
        if len > MAX_FRAME_LEN as usize {
            return Err(Error::FrameTooLarge {
                len: len as u64,
                max: MAX_FRAME_LEN,
            });
        }
        self.buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
        Ok(self.buf)
    }
}

/// Encodes a host -> agent frame (length prefix included). Fails only if it would exceed
/// [`MAX_FRAME_LEN`].
pub fn encode_host(id: u32, msg: &HostMsg) -> Result<Vec<u8>, Error> {
    let e = match msg {
        HostMsg::Hello {
            min_version,
            max_version,
            client,
        } => {
            let mut e = Enc::new(tag::HELLO, id);
            e.u16(*min_version);
            e.u16(*max_version);
            e.str(client);
            e
        }
        HostMsg::Ping => Enc::new(tag::PING, id),
        HostMsg::Exec(spec) => {
            let mut e = Enc::new(tag::EXEC, id);
            e.spec(spec);
            e
        }
        HostMsg::Spawn {
            spec,
            tag: name,
            meta,
        } => {
            let mut e = Enc::new(tag::SPAWN, id);
            e.spec(spec);
            e.opt_str(name.as_deref());
            e.bytes(meta);
            e
        }
        HostMsg::Attach { pid, output } => {
            let mut e = Enc::new(tag::ATTACH, id);
            e.u32(*pid);
            e.bool(*output);
            e
        }
        HostMsg::ListProcs => Enc::new(tag::LIST_PROCS, id),
        HostMsg::Stdin(data) => {
            let mut e = Enc::new(tag::STDIN, id);
            e.bytes(data);
            e
        }
        HostMsg::StdinClose => Enc::new(tag::STDIN_CLOSE, id),
        HostMsg::Signal {
            target,
            signal,
            group,
        } => {
            let mut e = Enc::new(tag::SIGNAL, id);
            e.u32(*target);
            e.i32(*signal);
            e.bool(*group);
            e
        }
        HostMsg::Resize { target, size } => {
            let mut e = Enc::new(tag::RESIZE, id);
            e.u32(*target);
            e.u16(size.rows);
            e.u16(size.cols);
            e
        }
        HostMsg::ReadFile { path } => {
            let mut e = Enc::new(tag::READ_FILE, id);
            e.os(path.as_os_str());
            e
        }
        HostMsg::WriteFile { path, mode } => {
            let mut e = Enc::new(tag::WRITE_FILE, id);
            e.os(path.as_os_str());
            e.u32(*mode);
            e
        }
        HostMsg::FileData(data) => {
            let mut e = Enc::new(tag::FILE_DATA_UP, id);
            e.bytes(data);
            e
        }
        HostMsg::FileEnd => Enc::new(tag::FILE_END, id),
        HostMsg::Stat {
            path,
            follow_symlinks,
        } => {
            let mut e = Enc::new(tag::STAT, id);
            e.os(path.as_os_str());
            e.bool(*follow_symlinks);
            e
        }
        HostMsg::List { path } => {
            let mut e = Enc::new(tag::LIST, id);
            e.os(path.as_os_str());
            e
        }
        HostMsg::Remove { path, recursive } => {
            let mut e = Enc::new(tag::REMOVE, id);
            e.os(path.as_os_str());
            e.bool(*recursive);
            e
        }
        HostMsg::SetClock { unix_ns } => {
            let mut e = Enc::new(tag::SET_CLOCK, id);
            e.i64(*unix_ns);
            e
        }
        HostMsg::AddEntropy(data) => {
            let mut e = Enc::new(tag::ADD_ENTROPY, id);
            e.bytes(data);
            e
        }
        HostMsg::Sync => Enc::new(tag::SYNC, id),
        HostMsg::PowerOff => Enc::new(tag::POWER_OFF, id),
        HostMsg::MakeDir {
            path,
            mode,
            parents,
        } => {
            let mut e = Enc::new(tag::MAKE_DIR, id);
            e.os(path.as_os_str());
            e.u32(*mode);
            e.bool(*parents);
            e
        }
        HostMsg::Rename { from, to } => {
            let mut e = Enc::new(tag::RENAME, id);
            e.os(from.as_os_str());
            e.os(to.as_os_str());
            e
        }
        HostMsg::ReadLink { path } => {
            let mut e = Enc::new(tag::READ_LINK, id);
            e.os(path.as_os_str());
            e
        }
        HostMsg::GetXattrs { paths, prefix } => {
            let mut e = Enc::new(tag::GET_XATTRS, id);
            e.count(paths.len());
            for p in paths {
                e.os(p.as_os_str());
            }
            e.str(prefix);
            e
        }
        HostMsg::SetXattrs { path, prefix, set } => {
            let mut e = Enc::new(tag::SET_XATTRS, id);
            e.os(path.as_os_str());
            e.str(prefix);
            e.xattr_list(set);
            e
        }
        HostMsg::AsUser { uid, gid, groups } => {
            let mut e = Enc::new(tag::AS_USER, id);
            e.u32(*uid);
            e.u32(*gid);
            e.u32(groups.len() as u32);
            for g in groups {
                e.u32(*g);
            }
            e
        }
        HostMsg::Watch { path, recursive } => {
            let mut e = Enc::new(tag::WATCH, id);
            e.os(path.as_os_str());
            e.bool(*recursive);
            e
        }
        HostMsg::Unwatch { target } => {
            let mut e = Enc::new(tag::UNWATCH, id);
            e.u32(*target);
            e
        }
    };
    e.finish()
}

/// Encodes an agent -> host frame (length prefix included). Fails only if it would exceed
/// [`MAX_FRAME_LEN`].
pub fn encode_agent(id: u32, msg: &AgentMsg) -> Result<Vec<u8>, Error> {
    let e = match msg {
        AgentMsg::HelloOk {
            version,
            agent_version,
            max_frame_len,
        } => {
            let mut e = Enc::new(tag::HELLO_OK, id);
            e.u16(*version);
            e.str(agent_version);
            e.u32(*max_frame_len);
            e
        }
        AgentMsg::Ok => Enc::new(tag::OK, id),
        AgentMsg::Error(err) => {
            let mut e = Enc::new(tag::ERROR, id);
            e.u16(err.kind.code());
            e.i32(err.errno);
            // Keep error frames small whatever the message (it may quote paths).
            let msg = truncate_utf8(&err.message, 4096);
            e.str(msg);
            e
        }
        AgentMsg::Pong {
            agent_version,
            protocol,
            uptime_ms,
            running_execs,
        } => {
            let mut e = Enc::new(tag::PONG, id);
            e.str(agent_version);
            e.u16(*protocol);
            e.u64(*uptime_ms);
            e.u32(*running_execs);
            e
        }
        AgentMsg::Started { pid } => {
            let mut e = Enc::new(tag::STARTED, id);
            e.u32(*pid);
            e
        }
        AgentMsg::Stdout(d) => {
            let mut e = Enc::new(tag::STDOUT, id);
            e.bytes(d);
            e
        }
        AgentMsg::Stderr(d) => {
            let mut e = Enc::new(tag::STDERR, id);
            e.bytes(d);
            e
        }
        AgentMsg::StdinAck(n) => {
            let mut e = Enc::new(tag::STDIN_ACK, id);
            e.u32(*n);
            e
        }
        AgentMsg::Exited(st) => {
            let mut e = Enc::new(tag::EXITED, id);
            e.exit(st);
            e
        }
        AgentMsg::ProcList(procs) => {
            let mut e = Enc::new(tag::PROC_LIST, id);
            e.count(procs.len());
            for p in procs {
                e.proc_info(p);
            }
            e
        }
        AgentMsg::FileData(d) => {
            let mut e = Enc::new(tag::FILE_DATA_DOWN, id);
            e.bytes(d);
            e
        }
        AgentMsg::FileDone { bytes } => {
            let mut e = Enc::new(tag::FILE_DONE, id);
            e.u64(*bytes);
            e
        }
        AgentMsg::Stat(s) => {
            let mut e = Enc::new(tag::STAT_REPLY, id);
            e.stat(s);
            e
        }
        AgentMsg::DirEntries(entries) => {
            let mut e = Enc::new(tag::DIR_ENTRIES, id);
            e.count(entries.len());
            for d in entries {
                e.os(&d.name);
                e.stat(&d.stat);
            }
            e
        }
        AgentMsg::WatchEvent { name, kind } => {
            let mut e = Enc::new(tag::WATCH_EVENT, id);
            e.os(name.as_os_str());
            e.u8(kind.code());
            e
        }
        AgentMsg::LinkTarget { target } => {
            let mut e = Enc::new(tag::LINK_TARGET, id);
            e.os(target.as_os_str());
            e
        }
        AgentMsg::Xattrs(lists) => {
            let mut e = Enc::new(tag::XATTRS, id);
            e.count(lists.len());
            for l in lists {
                e.xattr_list(l);
            }
            e
        }
    };
    e.finish()
}

/// Encoded size of a [`ProcInfo`] inside a ProcList frame (to batch listings).
pub fn proc_info_wire_len(p: &ProcInfo) -> usize {
    let os = |s: &std::ffi::OsStr| 4 + s.len();
    4 + 1
        + p.tag.as_ref().map_or(0, |t| 4 + t.len())
        + 4
        + p.meta.len()
        + 4
        + p.argv.iter().map(|a| os(a)).sum::<usize>()
        + 4
        + p.env.iter().map(|(k, v)| os(k) + os(v)).sum::<usize>()
        + 1
        + p.cwd.as_ref().map_or(0, |c| os(c.as_os_str()))
        + 2
        + 1
        + if p.exit.is_some() { 6 } else { 0 }
}

/// Encoded size of a [`DirEntry`] inside a DirEntries frame (to batch listings).
pub fn dir_entry_wire_len(d: &DirEntry) -> usize {
    4 + d.name.len() + 1 + 4 + 8 + 4 + 4 + 8
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

// ----------------------------------------------------------------------------- decoding

type ArgvEnvCwd = (Vec<OsString>, Vec<(OsString, OsString)>, Option<PathBuf>);

/// Reads fields from a frame body; every read is bounds-checked.
struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], Error> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(Error::Truncated(what))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn arr<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], Error> {
        let s = self.take(N, what)?;
        let mut a = [0; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, Error> {
        Ok(self.arr::<1>(what)?[0])
    }
    fn bool(&mut self, what: &'static str) -> Result<bool, Error> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(Error::Invalid(what)),
        }
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, Error> {
        Ok(u16::from_le_bytes(self.arr(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn i32(&mut self, what: &'static str) -> Result<i32, Error> {
        Ok(i32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn i64(&mut self, what: &'static str) -> Result<i64, Error> {
        Ok(i64::from_le_bytes(self.arr(what)?))
    }
    fn bytes(&mut self, what: &'static str) -> Result<Vec<u8>, Error> {
        let n = self.u32(what)? as usize;
        Ok(self.take(n, what)?.to_vec())
    }
    fn os(&mut self, what: &'static str) -> Result<OsString, Error> {
        Ok(OsString::from_vec(self.bytes(what)?))
    }
    fn path(&mut self, what: &'static str) -> Result<PathBuf, Error> {
        Ok(PathBuf::from(self.os(what)?))
    }
    fn string(&mut self, what: &'static str) -> Result<String, Error> {
        String::from_utf8(self.bytes(what)?).map_err(|_| Error::Invalid(what))
    }
    fn option(&mut self, what: &'static str) -> Result<bool, Error> {
        self.bool(what)
    }
    fn opt_u32(&mut self, what: &'static str) -> Result<Option<u32>, Error> {
        Ok(if self.option(what)? {
            Some(self.u32(what)?)
        } else {
            None
        })
    }
    fn opt_string(&mut self, what: &'static str) -> Result<Option<String>, Error> {
        Ok(if self.option(what)? {
            Some(self.string(what)?)
        } else {
            None
        })
    }
    fn argv_env_cwd(&mut self) -> Result<ArgvEnvCwd, Error> {
        let n = self.count(4, "argv")?;
        let mut argv = Vec::with_capacity(n);
        for _ in 0..n {
            argv.push(self.os("argv")?);
        }
        let n = self.count(8, "env")?;
        let mut env = Vec::with_capacity(n);
        for _ in 0..n {
            env.push((self.os("env key")?, self.os("env value")?));
        }
        let cwd = if self.option("cwd")? {
            Some(self.path("cwd")?)
        } else {
            None
        };
        Ok((argv, env, cwd))
    }
    fn spec(&mut self) -> Result<ExecSpec, Error> {
        let (argv, env, cwd) = self.argv_env_cwd()?;
        let uid = self.opt_u32("uid")?;
        let gid = self.opt_u32("gid")?;
        let tty = if self.option("tty")? {
            Some(WinSize {
                rows: self.u16("rows")?,
                cols: self.u16("cols")?,
            })
        } else {
            None
        };
        let stdin = self.bool("stdin")?;
        Ok(ExecSpec {
            argv,
            env,
            cwd,
            uid,
            gid,
            tty,
            stdin,
        })
    }
    fn exit(&mut self) -> Result<ExitStatus, Error> {
        let kind = self.u8("exit kind")?;
        let value = self.i32("exit value")?;
        let core_dumped = self.bool("core_dumped")?;
        Ok(match kind {
            0 if !core_dumped => ExitStatus::Exited(value),
            1 => ExitStatus::Signaled {
                signal: value,
                core_dumped,
            },
            _ => return Err(Error::Invalid("exit kind")),
        })
    }
    fn proc_info(&mut self) -> Result<ProcInfo, Error> {
        let pid = self.u32("pid")?;
        let tag = self.opt_string("tag")?;
        let meta = self.bytes("meta")?;
        let (argv, env, cwd) = self.argv_env_cwd()?;
        let tty = self.bool("tty")?;
        let stdin = self.bool("stdin")?;
        let exit = if self.option("exit")? {
            Some(self.exit()?)
        } else {
            None
        };
        Ok(ProcInfo {
            pid,
            tag,
            meta,
            argv,
            env,
            cwd,
            tty,
            stdin,
            exit,
        })
    }
    /// A list count, checked against the bytes left (each item takes at least `min_item`
    /// bytes), so a lying count cannot make us allocate.
    fn xattr_list(&mut self) -> Result<XattrList, Error> {
        let n = self.count(8, "xattrs")?;
        if n > MAX_XATTRS {
            return Err(Error::Invalid("xattrs (more than MAX_XATTRS)"));
        }
        let mut l = Vec::with_capacity(n);
        for _ in 0..n {
            l.push((self.string("xattr name")?, self.bytes("xattr value")?));
        }
        Ok(l)
    }
    fn count(&mut self, min_item: usize, what: &'static str) -> Result<usize, Error> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_item) > self.remaining() {
            return Err(Error::Truncated(what));
        }
        Ok(n)
    }
    fn stat(&mut self) -> Result<FileStat, Error> {
        Ok(FileStat {
            kind: FileKind::from_code(self.u8("stat kind")?)?,
            mode: self.u32("stat mode")?,
            size: self.u64("stat size")?,
            uid: self.u32("stat uid")?,
            gid: self.u32("stat gid")?,
            mtime_ns: self.i64("stat mtime")?,
        })
    }
}

/// Decodes one complete frame: the 4-byte length prefix followed by exactly that many bytes.
///
/// Never panics, whatever `frame` holds; allocates at most about `frame.len()` bytes.
pub fn decode_frame(frame: &[u8]) -> Result<Frame, Error> {
    if frame.len() < 4 {
        return Err(Error::Truncated("length prefix"));
    }
    let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]);
    if len > MAX_FRAME_LEN {
        return Err(Error::FrameTooLarge {
            len: u64::from(len),
            max: MAX_FRAME_LEN,
        });
    }
    let body = &frame[4..];
    if body.len() != len as usize {
        return Err(Error::LengthMismatch {
            declared: len,
            actual: body.len(),
        });
    }
    decode_body(body)
}

/// The id of a frame body, if it is long enough to have one (for error replies to frames
/// that do not decode).
pub fn body_id(body: &[u8]) -> Option<u32> {
    body.get(1..5)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Decodes a frame body (what follows the length prefix).
pub fn decode_body(body: &[u8]) -> Result<Frame, Error> {
    let mut d = Dec { buf: body, pos: 0 };
    let t = d.u8("tag")?;
    let id = d.u32("id")?;
    let msg = if t < 0x80 {
        Msg::Host(decode_host(t, &mut d)?)
    } else {
        Msg::Agent(decode_agent(t, &mut d)?)
    };
    if d.remaining() != 0 {
        return Err(Error::TrailingBytes(d.remaining()));
    }
    Ok(Frame { id, msg })
}

fn decode_host(t: u8, d: &mut Dec<'_>) -> Result<HostMsg, Error> {
    Ok(match t {
        tag::HELLO => HostMsg::Hello {
            min_version: d.u16("min_version")?,
            max_version: d.u16("max_version")?,
            client: d.string("client")?,
        },
        tag::PING => HostMsg::Ping,
        tag::EXEC => HostMsg::Exec(d.spec()?),
        tag::SPAWN => HostMsg::Spawn {
            spec: d.spec()?,
            tag: d.opt_string("tag")?,
            meta: d.bytes("meta")?,
        },
        tag::ATTACH => HostMsg::Attach {
            pid: d.u32("pid")?,
            output: d.bool("output")?,
        },
        tag::LIST_PROCS => HostMsg::ListProcs,
        tag::STDIN => HostMsg::Stdin(d.bytes("data")?),
        tag::STDIN_CLOSE => HostMsg::StdinClose,
        tag::SIGNAL => HostMsg::Signal {
            target: d.u32("target")?,
            signal: d.i32("signal")?,
            group: d.bool("group")?,
        },
        tag::RESIZE => HostMsg::Resize {
            target: d.u32("target")?,
            size: WinSize {
                rows: d.u16("rows")?,
                cols: d.u16("cols")?,
            },
        },
        tag::READ_FILE => HostMsg::ReadFile {
            path: d.path("path")?,
        },
        tag::WRITE_FILE => HostMsg::WriteFile {
            path: d.path("path")?,
            mode: d.u32("mode")?,
        },
        tag::FILE_DATA_UP => HostMsg::FileData(d.bytes("data")?),
        tag::FILE_END => HostMsg::FileEnd,
        tag::STAT => HostMsg::Stat {
            path: d.path("path")?,
            follow_symlinks: d.bool("follow_symlinks")?,
        },
        tag::LIST => HostMsg::List {
            path: d.path("path")?,
        },
        tag::REMOVE => HostMsg::Remove {
            path: d.path("path")?,
            recursive: d.bool("recursive")?,
        },
        tag::SET_CLOCK => HostMsg::SetClock {
            unix_ns: d.i64("unix_ns")?,
        },
        tag::ADD_ENTROPY => HostMsg::AddEntropy(d.bytes("data")?),
        tag::SYNC => HostMsg::Sync,
        tag::POWER_OFF => HostMsg::PowerOff,
        tag::MAKE_DIR => HostMsg::MakeDir {
            path: d.path("path")?,
            mode: d.u32("mode")?,
            parents: d.bool("parents")?,
        },
        tag::RENAME => HostMsg::Rename {
            from: d.path("from")?,
            to: d.path("to")?,
        },
        tag::READ_LINK => HostMsg::ReadLink {
            path: d.path("path")?,
        },
        tag::GET_XATTRS => {
            let n = d.count(4, "paths")?;
            if n > MAX_XATTR_PATHS {
                return Err(Error::Invalid("paths (more than MAX_XATTR_PATHS)"));
            }
            let mut paths = Vec::with_capacity(n);
            for _ in 0..n {
                paths.push(d.path("path")?);
            }
            HostMsg::GetXattrs {
                paths,
                prefix: d.string("prefix")?,
            }
        }
        tag::SET_XATTRS => HostMsg::SetXattrs {
            path: d.path("path")?,
            prefix: d.string("prefix")?,
            set: d.xattr_list()?,
        },
        tag::AS_USER => {
            let uid = d.u32("uid")?;
            let gid = d.u32("gid")?;
            let n = d.count(4, "groups")?;
            if n > MAX_GROUPS {
                return Err(Error::Invalid("groups (more than MAX_GROUPS)"));
            }
            let mut groups = Vec::with_capacity(n);
            for _ in 0..n {
                groups.push(d.u32("group")?);
            }
            HostMsg::AsUser { uid, gid, groups }
        }
        tag::WATCH => HostMsg::Watch {
            path: d.path("path")?,
            recursive: d.bool("recursive")?,
        },
        tag::UNWATCH => HostMsg::Unwatch {
            target: d.u32("target")?,
        },
        other => return Err(Error::UnknownTag(other)),
    })
}

fn decode_agent(t: u8, d: &mut Dec<'_>) -> Result<AgentMsg, Error> {
    Ok(match t {
        tag::HELLO_OK => AgentMsg::HelloOk {
            version: d.u16("version")?,
            agent_version: d.string("agent_version")?,
            max_frame_len: d.u32("max_frame_len")?,
        },
        tag::OK => AgentMsg::Ok,
        tag::ERROR => AgentMsg::Error(RemoteError {
            kind: ErrorKind::from_code(d.u16("error kind")?),
            errno: d.i32("errno")?,
            message: d.string("error message")?,
        }),
        tag::PONG => AgentMsg::Pong {
            agent_version: d.string("agent_version")?,
            protocol: d.u16("protocol")?,
            uptime_ms: d.u64("uptime_ms")?,
            running_execs: d.u32("running_execs")?,
        },
        tag::STARTED => AgentMsg::Started { pid: d.u32("pid")? },
        tag::STDOUT => AgentMsg::Stdout(d.bytes("data")?),
        tag::STDERR => AgentMsg::Stderr(d.bytes("data")?),
        tag::STDIN_ACK => AgentMsg::StdinAck(d.u32("bytes")?),
        tag::EXITED => AgentMsg::Exited(d.exit()?),
        tag::PROC_LIST => {
            // pid, tag, meta, argv, env, cwd, tty, stdin, exit: at least 24 bytes each.
            let n = d.count(24, "procs")?;
            let mut procs = Vec::with_capacity(n);
            for _ in 0..n {
                procs.push(d.proc_info()?);
            }
            AgentMsg::ProcList(procs)
        }
        tag::FILE_DATA_DOWN => AgentMsg::FileData(d.bytes("data")?),
        tag::FILE_DONE => AgentMsg::FileDone {
            bytes: d.u64("bytes")?,
        },
        tag::STAT_REPLY => AgentMsg::Stat(d.stat()?),
        tag::DIR_ENTRIES => {
            let n = d.count(4 + 29, "entries")?;
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                entries.push(DirEntry {
                    name: d.os("name")?,
                    stat: d.stat()?,
                });
            }
            AgentMsg::DirEntries(entries)
        }
        tag::WATCH_EVENT => AgentMsg::WatchEvent {
            name: d.path("name")?,
            kind: WatchKind::from_code(d.u8("watch kind")?),
        },
        tag::LINK_TARGET => AgentMsg::LinkTarget {
            target: d.path("target")?,
        },
        tag::XATTRS => {
            let n = d.count(4, "xattr lists")?;
            if n > MAX_XATTR_PATHS {
                return Err(Error::Invalid("xattr lists (more than MAX_XATTR_PATHS)"));
            }
            let mut lists = Vec::with_capacity(n);
            for _ in 0..n {
                lists.push(d.xattr_list()?);
            }
            AgentMsg::Xattrs(lists)
        }
        other => return Err(Error::UnknownTag(other)),
    })
}

// ----------------------------------------------------------------------------- stream I/O

/// Reads one frame (length prefix included) from a byte stream.
///
/// `Ok(None)`: clean end of stream before the first byte of a frame.
/// `Err(Error::FrameTooLarge)`: the length field exceeds `max`; nothing more was read, and
/// the stream can no longer be trusted to be at a frame boundary.
pub fn read_frame(r: &mut impl Read, max: u32) -> Result<Option<Vec<u8>>, Error> {
    let mut prefix = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(Error::Closed),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Io(e)),
        }
    }
    let len = u32::from_le_bytes(prefix);
    if len > max {
        return Err(Error::FrameTooLarge {
            len: u64::from(len),
            max,
        });
    }
    let mut frame = vec![0u8; 4 + len as usize];
    frame[..4].copy_from_slice(&prefix);
    r.read_exact(&mut frame[4..]).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Error::Closed
        } else {
            Error::Io(e)
        }
    })?;
    Ok(Some(frame))
}

/// Writes one encoded frame.
pub fn write_frame(w: &mut impl Write, frame: &[u8]) -> Result<(), Error> {
    w.write_all(frame).map_err(Error::Io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat() -> FileStat {
        FileStat {
            kind: FileKind::Symlink,
            mode: 0o4755,
            size: u64::MAX - 3,
            uid: 1000,
            gid: 65534,
            mtime_ns: -1_234_567,
        }
    }

    fn host_samples() -> Vec<HostMsg> {
        vec![
            HostMsg::Hello {
                min_version: 1,
                max_version: 7,
                client: "clade-test".into(),
            },
            HostMsg::Ping,
            HostMsg::Exec(ExecSpec::default()),
            HostMsg::Exec(ExecSpec {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    OsString::from_vec(vec![0xff, 0, 1]),
                ],
                env: vec![("PATH".into(), "/bin".into()), ("X".into(), "".into())],
                cwd: Some("/tmp".into()),
                uid: Some(1000),
                gid: Some(0),
                tty: Some(WinSize { rows: 24, cols: 80 }),
                stdin: true,
            }),
            HostMsg::Stdin(vec![1, 2, 3]),
            HostMsg::Stdin(vec![]),
            HostMsg::StdinClose,
            HostMsg::Signal {
                target: 9,
                signal: 15,
                group: true,
            },
            HostMsg::Resize {
                target: 3,
                size: WinSize {
                    rows: 50,
                    cols: 132,
                },
            },
            HostMsg::ReadFile {
                path: "/etc/hostname".into(),
            },
            HostMsg::WriteFile {
                path: "/tmp/x".into(),
                mode: 0o644,
            },
            HostMsg::FileData(vec![0; 1000]),
            HostMsg::FileEnd,
            HostMsg::Stat {
                path: "/".into(),
                follow_symlinks: false,
            },
            HostMsg::List { path: "/".into() },
            HostMsg::Remove {
                path: "/tmp/x".into(),
                recursive: true,
            },
            HostMsg::SetClock { unix_ns: i64::MIN },
            HostMsg::AddEntropy(vec![7; 32]),
            HostMsg::Sync,
            HostMsg::PowerOff,
            HostMsg::MakeDir {
                path: "/tmp/d/e".into(),
                mode: 0o750,
                parents: true,
            },
            HostMsg::Rename {
                from: "/tmp/a".into(),
                to: "/tmp/b".into(),
            },
            HostMsg::Spawn {
                spec: ExecSpec {
                    argv: vec!["sleep".into(), "9".into()],
                    env: vec![("A".into(), "b".into())],
                    cwd: Some("/".into()),
                    uid: None,
                    gid: Some(5),
                    tty: Some(WinSize { rows: 1, cols: 2 }),
                    stdin: true,
                },
                tag: Some("server".into()),
                meta: vec![0, 1, 2],
            },
            HostMsg::Spawn {
                spec: ExecSpec::default(),
                tag: None,
                meta: vec![],
            },
            HostMsg::Attach {
                pid: 4242,
                output: true,
            },
            HostMsg::Attach {
                pid: 1,
                output: false,
            },
            HostMsg::ListProcs,
            HostMsg::Watch {
                path: "/tmp/w".into(),
                recursive: true,
            },
            HostMsg::Unwatch { target: 77 },
            HostMsg::ReadLink {
                path: "/tmp/link".into(),
            },
            HostMsg::AsUser {
                uid: 1000,
                gid: 1000,
                groups: vec![1000, 27],
            },
            HostMsg::AsUser {
                uid: 0,
                gid: 0,
                groups: vec![],
            },
            HostMsg::GetXattrs {
                paths: vec!["/a".into(), "/b c".into()],
                prefix: "user.e2b.".into(),
            },
            HostMsg::GetXattrs {
                paths: vec![],
                prefix: String::new(),
            },
            HostMsg::SetXattrs {
                path: "/a".into(),
                prefix: "user.e2b.".into(),
                set: vec![
                    ("user.e2b.k".into(), b"v".to_vec()),
                    ("user.e2b.e".into(), vec![]),
                ],
            },
        ]
    }

    fn agent_samples() -> Vec<AgentMsg> {
        vec![
            AgentMsg::HelloOk {
                version: 1,
                agent_version: "0.1.0".into(),
                max_frame_len: MAX_FRAME_LEN,
            },
            AgentMsg::Ok,
            AgentMsg::Error(RemoteError {
                kind: ErrorKind::NotFound,
                errno: 2,
                message: "open /x: no such file".into(),
            }),
            AgentMsg::Error(RemoteError::new(ErrorKind::Other(999), "future")),
            AgentMsg::Pong {
                agent_version: "0.1.0".into(),
                protocol: 1,
                uptime_ms: 123_456,
                running_execs: 3,
            },
            AgentMsg::Started { pid: 42 },
            AgentMsg::Stdout(b"hello\n".to_vec()),
            AgentMsg::Stderr(vec![]),
            AgentMsg::StdinAck(65536),
            AgentMsg::Exited(ExitStatus::Exited(-1)),
            AgentMsg::Exited(ExitStatus::Signaled {
                signal: 9,
                core_dumped: true,
            }),
            AgentMsg::FileData(vec![9; CHUNK_LEN]),
            AgentMsg::FileDone { bytes: 5 << 20 },
            AgentMsg::Stat(stat()),
            AgentMsg::DirEntries(vec![]),
            AgentMsg::DirEntries(vec![
                DirEntry {
                    name: "a".into(),
                    stat: stat(),
                },
                DirEntry {
                    name: OsString::from_vec(vec![0x80, b'b']),
                    stat: FileStat {
                        kind: FileKind::Dir,
                        ..stat()
                    },
                },
            ]),
            AgentMsg::ProcList(vec![]),
            AgentMsg::ProcList(vec![
                ProcInfo {
                    pid: 77,
                    tag: Some("t".into()),
                    meta: b"{}".to_vec(),
                    argv: vec!["sh".into(), "-c".into(), "x".into()],
                    env: vec![("K".into(), OsString::from_vec(vec![0xfe]))],
                    cwd: Some("/tmp".into()),
                    tty: true,
                    stdin: false,
                    exit: None,
                },
                ProcInfo {
                    pid: 78,
                    exit: Some(ExitStatus::Signaled {
                        signal: 9,
                        core_dumped: false,
                    }),
                    ..Default::default()
                },
            ]),
            AgentMsg::WatchEvent {
                name: "sub/f.txt".into(),
                kind: WatchKind::Create,
            },
            AgentMsg::WatchEvent {
                name: "".into(),
                kind: WatchKind::Overflow,
            },
            AgentMsg::WatchEvent {
                name: PathBuf::from(OsString::from_vec(vec![0xfe])),
                kind: WatchKind::Other(200),
            },
            AgentMsg::LinkTarget {
                target: PathBuf::from(OsString::from_vec(vec![b'.', b'/', 0xfe])),
            },
            AgentMsg::Xattrs(vec![vec![], vec![("user.e2b.x".into(), vec![0, 255])]]),
        ]
    }

    fn all_frames() -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = host_samples()
            .iter()
            .enumerate()
            .map(|(i, m)| encode_host(i as u32, m).unwrap())
            .collect();
        v.extend(
            agent_samples()
                .iter()
                .enumerate()
                .map(|(i, m)| encode_agent(u32::MAX - i as u32, m).unwrap()),
        );
        v
    }

    #[test]
    fn every_message_round_trips() {
        for (i, m) in host_samples().into_iter().enumerate() {
            let f = encode_host(i as u32, &m).unwrap();
            let back = decode_frame(&f).unwrap();
            assert_eq!(
                back,
                Frame {
                    id: i as u32,
                    msg: Msg::Host(m)
                }
            );
        }
        for (i, m) in agent_samples().into_iter().enumerate() {
            let f = encode_agent(i as u32 + 1000, &m).unwrap();
            let back = decode_frame(&f).unwrap();
            assert_eq!(
                back,
                Frame {
                    id: i as u32 + 1000,
                    msg: Msg::Agent(m)
                }
            );
        }
    }

    #[test]
    fn proc_info_wire_len_matches_the_encoding() {
        for m in agent_samples() {
            if let AgentMsg::ProcList(procs) = &m {
                let f = encode_agent(1, &m).unwrap();
                let want: usize = procs.iter().map(proc_info_wire_len).sum();
                assert_eq!(f.len(), 4 + FRAME_HEADER_LEN + 4 + want);
            }
        }
    }

    #[test]
    fn frames_read_back_from_a_stream() {
        let frames = all_frames();
        let stream: Vec<u8> = frames.concat();
        let mut r = &stream[..];
        for f in &frames {
            let got = read_frame(&mut r, MAX_FRAME_LEN).unwrap().unwrap();
            assert_eq!(&got, f);
        }
        assert!(read_frame(&mut r, MAX_FRAME_LEN).unwrap().is_none());
    }

    #[test]
    fn oversized_frames_are_refused_both_ways() {
        let big = HostMsg::FileData(vec![0; MAX_FRAME_LEN as usize]);
        assert!(matches!(
            encode_host(1, &big),
            Err(Error::FrameTooLarge { .. })
        ));
        let mut prefix = &(MAX_FRAME_LEN + 1).to_le_bytes()[..];
        assert!(matches!(
            read_frame(&mut prefix, MAX_FRAME_LEN),
            Err(Error::FrameTooLarge { .. })
        ));
        let mut f = (MAX_FRAME_LEN + 1).to_le_bytes().to_vec();
        f.extend_from_slice(&[0; 16]);
        assert!(matches!(decode_frame(&f), Err(Error::FrameTooLarge { .. })));
    }

    #[test]
    fn malformed_frames_are_errors() {
        // Truncated at every possible point.
        for f in all_frames() {
            for cut in 0..f.len() {
                let mut g = f[..cut].to_vec();
                if g.len() >= 4 {
                    let len = (g.len() - 4) as u32;
                    g[..4].copy_from_slice(&len.to_le_bytes());
                }
                assert!(decode_frame(&g).is_err(), "cut {cut} of {f:?}");
            }
            // Trailing garbage.
            let mut g = f.clone();
            g.push(0);
            let len = (g.len() - 4) as u32;
            g[..4].copy_from_slice(&len.to_le_bytes());
            assert!(matches!(decode_frame(&g), Err(Error::TrailingBytes(1))));
        }
        // Unknown tags, bad bools, lying counts.
        let mut f = encode_host(1, &HostMsg::Ping).unwrap();
        f[4] = 0x7f;
        assert!(matches!(decode_frame(&f), Err(Error::UnknownTag(0x7f))));
        let mut f = encode_host(1, &HostMsg::Sync).unwrap();
        f[4] = 0xff;
        assert!(matches!(decode_frame(&f), Err(Error::UnknownTag(0xff))));
        let mut f = encode_host(
            1,
            &HostMsg::Stat {
                path: "/".into(),
                follow_symlinks: true,
            },
        )
        .unwrap();
        *f.last_mut().unwrap() = 2;
        assert!(matches!(decode_frame(&f), Err(Error::Invalid(_))));
        let mut f = encode_agent(1, &AgentMsg::DirEntries(vec![])).unwrap();
        f[9..13].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode_frame(&f), Err(Error::Truncated(_))));
    }

    /// xorshift64*: deterministic pseudo-random bytes without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Property: decoding arbitrary bytes returns Ok or Err, never panics, and whatever
    /// decodes re-encodes to the same bytes (the encoding is canonical).
    #[test]
    fn random_bytes_never_panic() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let seeds = all_frames();
        let mut decoded = 0;
        for round in 0..200_000 {
            let mut f = if round % 2 == 0 {
                // Pure noise, sometimes with a consistent length prefix.
                let n = rng.below(96);
                let mut f: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                if f.len() >= 4 && rng.below(2) == 0 {
                    let len = (f.len() - 4) as u32;
                    f[..4].copy_from_slice(&len.to_le_bytes());
                }
                f
            } else {
                // A valid frame with a few bytes flipped (length prefix kept consistent).
                let mut f = seeds[rng.below(seeds.len())].clone();
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(f.len());
                    f[i] = rng.next() as u8;
                }
                if rng.below(4) != 0 {
                    let len = (f.len() - 4) as u32;
                    f[..4].copy_from_slice(&len.to_le_bytes());
                }
                f
            };
            if let Ok(frame) = decode_frame(&f) {
                decoded += 1;
                let again = match &frame.msg {
                    Msg::Host(m) => encode_host(frame.id, m).unwrap(),
                    Msg::Agent(m) => encode_agent(frame.id, m).unwrap(),
                };
                // Error messages are truncated on encode; nothing else changes.
                assert_eq!(again, f, "{frame:?}");
            }
            // Streams of noise never panic the frame reader either.
            f.truncate(64);
            let mut r = &f[..];
            while let Ok(Some(_)) = read_frame(&mut r, 1024) {}
        }
        assert!(decoded > 1000, "mutations should often still decode");
    }
}

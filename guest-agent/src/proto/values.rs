//! The values that messages carry: what to run ([`ExecSpec`]), kept processes
//! ([`ProcInfo`]) and how processes end ([`ExitStatus`]), file metadata ([`FileStat`],
//! [`DirEntry`]) and what happened in a watched directory ([`WatchKind`]). Plain data with
//! their wire codes; the byte layout is in `encode.rs` and `decode.rs`.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::Error;

/// Terminal size for PTY execs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WinSize {
    pub rows: u16,
    pub cols: u16,
}

/// What to run (the payload of [`HostMsg::Exec`](super::HostMsg::Exec)).
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
    pub(super) fn code(self) -> u8 {
        match self {
            FileKind::File => 0,
            FileKind::Dir => 1,
            FileKind::Symlink => 2,
            FileKind::Other => 3,
        }
    }

    pub(super) fn from_code(c: u8) -> Result<Self, Error> {
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

/// What happened to an entry of a watched directory
/// ([`AgentMsg::WatchEvent`](super::AgentMsg::WatchEvent)). The wire codes of the five
/// kinds are envd's `EventType` numbers.
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

//! Error replies: the categories an [`AgentMsg::Error`](super::AgentMsg::Error) frame
//! carries ([`ErrorKind`], with their wire codes and the mapping from OS errors) and the
//! typed error a host gets back ([`RemoteError`]).

use std::io;

/// Error categories carried by an [`AgentMsg::Error`](super::AgentMsg::Error) frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The frame could not be decoded.
    BadFrame,
    /// The frame's length field exceeds [`MAX_FRAME_LEN`](super::MAX_FRAME_LEN); the
    /// agent closes the connection.
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

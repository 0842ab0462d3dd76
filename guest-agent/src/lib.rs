//! Clade's in-guest agent: the wire protocol and the server behind `clade-agent`.
//!
//! - [`proto`]: frames and messages, encoding and decoding ([`decode_frame`] is safe on any
//!   input). The one-page specification is `guest-agent/PROTOCOL.md`.
//! - [`server`]: serves the protocol on a listener (AF_VSOCK port 52 in the guest, or a
//!   Unix socket for host-side tests), one thread per connection.
//! - [`reaper`]: the child reaper for PID 1 that keeps exec exit statuses by pid.
//! - [`system`]: the guest-wide operations (modules, clock, entropy, power).
//!
//! The host side (client) lives in the `vmm` crate (`vmm::agent`); this crate depends on no
//! host crate so that it builds as a small static binary for the guest.

pub mod proto;
pub mod reaper;
pub mod server;
pub mod system;

pub use proto::{
    decode_frame, AgentMsg, DirEntry, ErrorKind, ExecSpec, ExitStatus, FileKind, FileStat, Frame,
    HostMsg, Msg, RemoteError, WatchKind, WinSize, AGENT_VSOCK_PORT, MAX_FRAME_LEN,
    PROTOCOL_VERSION,
};

/// Errors of this crate: framing and decoding, and I/O on the connection.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A frame's length field is above the limit.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge { len: u64, max: u32 },
    /// The buffer given to `decode_frame` does not hold exactly the declared length.
    #[error("frame declares {declared} bytes but {actual} follow the length prefix")]
    LengthMismatch { declared: u32, actual: usize },
    /// A field runs past the end of the frame.
    #[error("frame truncated in field '{0}'")]
    Truncated(&'static str),
    /// The tag is not a known message.
    #[error("unknown message tag {0:#04x}")]
    UnknownTag(u8),
    /// A field holds a value outside its domain.
    #[error("invalid value in field '{0}'")]
    Invalid(&'static str),
    /// Bytes left over after the last field.
    #[error("{0} unexpected bytes after the message")]
    TrailingBytes(usize),
    /// The peer closed the connection in the middle of a frame.
    #[error("connection closed mid-frame")]
    Closed,
    /// Reading or writing the connection failed.
    #[error("connection I/O: {0}")]
    Io(#[source] std::io::Error),
    /// Setting up a listener or a system facility failed.
    #[error("{context}: {source}")]
    Os {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// An OS error with what was being done.
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }
}

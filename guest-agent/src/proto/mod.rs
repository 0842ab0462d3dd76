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
//!
//! This file has the protocol's constants; the rest is one file per concern, each
//! re-exported here: `values.rs` (what messages carry: exec specs, process and file
//! metadata, exit statuses, watch event kinds), `errors.rs` (error replies),
//! `messages.rs` (the messages of each direction), `tag.rs` (their wire tags),
//! `encode.rs`, `decode.rs` (the checks on untrusted input are all there) and `stream.rs`
//! (frames on a byte stream).

mod decode;
mod encode;
mod errors;
mod messages;
mod stream;
mod tag;
mod values;

pub use decode::{body_id, decode_body, decode_frame};
pub use encode::{dir_entry_wire_len, encode_agent, encode_host, proc_info_wire_len};
pub use errors::{ErrorKind, RemoteError};
pub use messages::{AgentMsg, Frame, HostMsg, Msg};
pub use stream::{read_frame, write_frame};
pub use values::{
    DirEntry, ExecSpec, ExitStatus, FileKind, FileStat, ProcInfo, WatchKind, WinSize,
};

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

#[cfg(test)]
mod tests;

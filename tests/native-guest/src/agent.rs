//! The part of the Clade agent protocol this guest answers: `Hello` and `Ping`.
//!
//! Specification: guest-agent/PROTOCOL.md (version 1). The real encoder/decoder is
//! guest-agent/src/proto/, which needs std, so the frames used here are re-implemented
//! byte for byte:
//!
//! ```text
//! frame   := len:u32le  tag:u8  id:u32le  payload        (len counts tag + id + payload)
//! Hello   01  min_version u16, max_version u16, client str   (str = u32le length + UTF-8)
//! Ping    02  -
//! HelloOk 80  version u16, agent_version str, max_frame_len u32
//! Error   82  kind u16, errno i32, message str
//! Pong    83  agent_version str, protocol u16, uptime_ms u64, running_execs u32
//! ```
//!
//! Requests are checked in the same order as the real agent (guest-agent/src/server/conn.rs):
//! a frame that does not decode gets `BadFrame` (`UnknownMessage` for an unknown tag), then
//! anything but Hello before the handshake gets `HandshakeRequired`, then id 0 gets
//! `InvalidArgument`. The agent's other operations (Exec, files, ...) cannot exist in a
//! bare-metal guest: they are answered with `Unsupported` (the real agent would decode their
//! payload first; here it is not looked at).

/// Protocol versions spoken (PROTOCOL_VERSION / MIN_PROTOCOL_VERSION in guest-agent/src/proto/mod.rs).
pub const PROTOCOL_VERSION: u16 = 1;
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// The vsock port the agent listens on (AGENT_VSOCK_PORT).
pub const AGENT_PORT: u32 = 52;
/// Largest length field any frame may have (MAX_FRAME_LEN): above it the connection closes.
pub const MAX_FRAME_LEN: u32 = 1024 * 1024;
/// tag + id.
pub const FRAME_HEADER_LEN: usize = 5;
/// What this guest reports as its agent version (HelloOk, Pong).
pub const AGENT_VERSION: &str = concat!("clade-native-guest ", env!("CARGO_PKG_VERSION"));

const TAG_HELLO: u8 = 0x01;
const TAG_PING: u8 = 0x02;
/// Last host -> agent tag the real agent knows (PowerOff).
const TAG_LAST_KNOWN: u8 = 0x12;
const TAG_HELLO_OK: u8 = 0x80;
const TAG_ERROR: u8 = 0x82;
const TAG_PONG: u8 = 0x83;

/// Error kinds (PROTOCOL.md, "Errors").
pub const E_BAD_FRAME: u16 = 1;
pub const E_FRAME_TOO_LARGE: u16 = 2;
pub const E_UNSUPPORTED_VERSION: u16 = 3;
pub const E_HANDSHAKE_REQUIRED: u16 = 4;
pub const E_UNKNOWN_MESSAGE: u16 = 5;
pub const E_INVALID_ARGUMENT: u16 = 8;
pub const E_UNSUPPORTED: u16 = 13;

/// Longest encoded reply.
pub const MAX_REPLY: usize = 256;

/// One frame being built (like `Enc` in guest-agent/src/proto/encode.rs): length prefix reserved, filled by `finish`.
pub struct Enc {
    buf: [u8; MAX_REPLY],
    len: usize,
}

impl Enc {
    fn new(tag: u8, id: u32) -> Enc {
        let mut e = Enc {
            buf: [0; MAX_REPLY],
            len: 4,
        };
        e.put(&[tag]);
        e.u32(id);
        e
    }

    fn put(&mut self, b: &[u8]) {
        // Replies are small and fixed in shape; only error messages could be long, and
        // they are truncated (as the real agent truncates them at 4096 bytes).
        let n = b.len().min(MAX_REPLY - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&b[..n]);
        self.len += n;
    }

    fn u16(&mut self, v: u16) {
        self.put(&v.to_le_bytes());
    }

    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }

    fn i32(&mut self, v: i32) {
        self.put(&v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }

    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.put(s.as_bytes());
    }

    /// The whole frame, length prefix included.
    pub fn finish(&mut self) -> &[u8] {
        let body = (self.len - 4) as u32;
        self.buf[..4].copy_from_slice(&body.to_le_bytes());
        &self.buf[..self.len]
    }
}

/// An `Error` frame with errno 0. `message` must fit a reply (keep it short).
pub fn error(id: u32, kind: u16, message: &str) -> Enc {
    let room = MAX_REPLY - 4 - FRAME_HEADER_LEN - 2 - 4 - 4;
    let mut n = message.len().min(room);
    while !message.is_char_boundary(n) {
        n -= 1;
    }
    let mut e = Enc::new(TAG_ERROR, id);
    e.u16(kind);
    e.i32(0);
    e.str(&message[..n]);
    e
}

/// Reads the payload fields of a frame body, never past its end.
struct Dec<'a> {
    b: &'a [u8],
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Some(h)
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn str(&mut self) -> Option<&'a str> {
        let n = self.u32()? as usize;
        core::str::from_utf8(self.take(n)?).ok()
    }
}

/// What a request was, for the caller's statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    Hello,
    Ping,
    /// Answered with an Error frame.
    Refused,
}

/// The protocol state of one connection.
pub struct Session {
    negotiated: bool,
    /// Largest frame length field this guest can buffer (reported in HelloOk).
    max_frame_len: u32,
}

impl Session {
    pub const fn new(max_frame_len: u32) -> Session {
        Session {
            negotiated: false,
            max_frame_len,
        }
    }

    /// Answers one complete frame: `frame` is the length prefix plus exactly `len` bytes.
    /// `uptime_ms` is only evaluated for a Ping.
    pub fn handle(&mut self, frame: &[u8], uptime_ms: impl FnOnce() -> u64) -> (Handled, Enc) {
        let body = &frame[4..];
        if body.len() < FRAME_HEADER_LEN {
            // proto::decode_frame fails; body_id has no id to offer.
            return (
                Handled::Refused,
                error(0, E_BAD_FRAME, "frame shorter than tag and id"),
            );
        }
        let tag = body[0];
        let id = u32::from_le_bytes([body[1], body[2], body[3], body[4]]);
        let mut d = Dec {
            b: &body[FRAME_HEADER_LEN..],
        };
        match tag {
            TAG_HELLO => {
                let fields = (|| Some((d.u16()?, d.u16()?, d.str()?)))();
                let Some((min, max, _client)) = fields else {
                    return (
                        Handled::Refused,
                        error(id, E_BAD_FRAME, "bad Hello payload"),
                    );
                };
                if !d.b.is_empty() {
                    return (Handled::Refused, error(id, E_BAD_FRAME, "trailing bytes"));
                }
                self.hello(id, min, max)
            }
            TAG_PING => {
                if !d.b.is_empty() {
                    return (Handled::Refused, error(id, E_BAD_FRAME, "trailing bytes"));
                }
                if let Some(e) = self.check_session(id) {
                    return (Handled::Refused, e);
                }
                let mut e = Enc::new(TAG_PONG, id);
                e.str(AGENT_VERSION);
                e.u16(PROTOCOL_VERSION);
                e.u64(uptime_ms());
                e.u32(0); // running_execs: this guest runs none
                (Handled::Ping, e)
            }
            0x03..=TAG_LAST_KNOWN => {
                let e = self.check_session(id).unwrap_or_else(|| {
                    error(
                        id,
                        E_UNSUPPORTED,
                        "not available in the native test guest (Hello and Ping only)",
                    )
                });
                (Handled::Refused, e)
            }
            0x80..=0xff => (
                Handled::Refused,
                error(
                    id,
                    E_UNKNOWN_MESSAGE,
                    "agent-to-host message sent to the agent",
                ),
            ),
            _ => (
                Handled::Refused,
                error(id, E_UNKNOWN_MESSAGE, "unknown message tag"),
            ),
        }
    }

    /// The checks every request but Hello goes through, in the real agent's order.
    fn check_session(&self, id: u32) -> Option<Enc> {
        if !self.negotiated {
            Some(error(id, E_HANDSHAKE_REQUIRED, "send Hello first"))
        } else if id == 0 {
            Some(error(
                0,
                E_INVALID_ARGUMENT,
                "id 0 is reserved for the handshake",
            ))
        } else {
            None
        }
    }

    fn hello(&mut self, id: u32, min_version: u16, max_version: u16) -> (Handled, Enc) {
        if self.negotiated {
            return (
                Handled::Refused,
                error(
                    id,
                    E_INVALID_ARGUMENT,
                    "Hello already done on this connection",
                ),
            );
        }
        let version = max_version.min(PROTOCOL_VERSION);
        if version < min_version.max(MIN_PROTOCOL_VERSION) {
            return (
                Handled::Refused,
                error(
                    id,
                    E_UNSUPPORTED_VERSION,
                    "no common protocol version (this guest speaks 1..=1)",
                ),
            );
        }
        self.negotiated = true;
        let mut e = Enc::new(TAG_HELLO_OK, id);
        e.u16(version);
        e.str(AGENT_VERSION);
        e.u32(self.max_frame_len);
        (Handled::Hello, e)
    }
}

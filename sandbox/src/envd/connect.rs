//! The Connect protocol (connectrpc.com/docs/protocol) as envd speaks it over HTTP/1.1:
//! unary calls (`application/proto` or `application/json` body, error as a JSON
//! `{code, message}` with the code's HTTP status) and server-streaming calls
//! (`application/connect+proto|json`: the request and each response message in an envelope
//! of one flag byte and a 4-byte big-endian length; the stream ends with an end-of-stream
//! envelope, flag 0x02, carrying JSON `{}` or `{"error": {code, message}}`, always under
//! HTTP 200).
//!
//! Everything here parses client input: lengths are checked against the bytes present and
//! a size limit, never trusted.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Largest request message accepted (SendInput chunks, paths): 4 MiB.
pub const MAX_MESSAGE: usize = 4 << 20;

/// Envelope flag: the payload is compressed (not supported: the SDK never compresses).
const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: end of stream.
const FLAG_END: u8 = 0x02;

/// Connect error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
        }
    }

    /// The HTTP status of a unary error (Connect's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// A Connect error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }

    /// The unary error response.
    pub fn unary_response(&self) -> Response {
        let body = serde_json::to_vec(&self.json()).unwrap_or_default();
        (
            self.code.http_status(),
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}

impl From<vmm::Error> for RpcError {
    fn from(e: vmm::Error) -> Self {
        use guest_agent::proto::ErrorKind as K;
        let code = match &e {
            vmm::Error::Agent(r) => match r.kind {
                K::NotFound | K::UnknownId => Code::NotFound,
                K::PermissionDenied => Code::PermissionDenied,
                K::AlreadyExists => Code::AlreadyExists,
                K::InvalidArgument => Code::InvalidArgument,
                K::Unsupported => Code::Unimplemented,
                K::Io if r.errno == libc::ENOTDIR || r.errno == libc::EISDIR => {
                    Code::InvalidArgument
                }
                K::Io if r.errno == libc::ENOTEMPTY => Code::FailedPrecondition,
                _ => Code::Internal,
            },
            vmm::Error::AgentConnect { .. } | vmm::Error::AgentDisconnected => Code::Unavailable,
            _ => Code::Internal,
        };
        let message = match &e {
            vmm::Error::Agent(r) => r.message.clone(),
            other => other.to_string(),
        };
        RpcError::new(code, message)
    }
}

/// The codec of a call, from its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Proto,
    Json,
}

impl Codec {
    /// `application/proto|json` (unary) or `application/connect+proto|json` (streaming).
    pub fn from_headers(h: &HeaderMap, streaming: bool) -> Result<Codec, RpcError> {
        let ct = h
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        let name = if streaming {
            ct.strip_prefix("application/connect+")
        } else {
            ct.strip_prefix("application/")
        };
        match name {
            Some("proto") => Ok(Codec::Proto),
            Some("json") => Ok(Codec::Json),
            _ => Err(RpcError::new(
                Code::Unimplemented,
                format!(
                    "content type '{ct}' is not served here (expected application/{}proto or application/{}json)",
                    if streaming { "connect+" } else { "" },
                    if streaming { "connect+" } else { "" }
                ),
            )),
        }
    }

    pub fn content_type(self, streaming: bool) -> &'static str {
        match (self, streaming) {
            (Codec::Proto, false) => "application/proto",
            (Codec::Json, false) => "application/json",
            (Codec::Proto, true) => "application/connect+proto",
            (Codec::Json, true) => "application/connect+json",
        }
    }

    pub fn decode<T: prost::Message + DeserializeOwned + Default>(
        self,
        b: &[u8],
    ) -> Result<T, RpcError> {
        match self {
            Codec::Proto => T::decode(b).map_err(|e| {
                RpcError::new(Code::InvalidArgument, format!("malformed protobuf: {e}"))
            }),
            Codec::Json if b.iter().all(u8::is_ascii_whitespace) => Ok(T::default()),
            Codec::Json => serde_json::from_slice(b)
                .map_err(|e| RpcError::new(Code::InvalidArgument, format!("malformed JSON: {e}"))),
        }
    }

    pub fn encode<T: prost::Message + Serialize>(self, m: &T) -> Vec<u8> {
        match self {
            Codec::Proto => m.encode_to_vec(),
            Codec::Json => serde_json::to_vec(m).unwrap_or_default(),
        }
    }
}

/// The single message of a streaming request: one envelope, nothing after it.
pub fn unwrap_envelope(body: &[u8]) -> Result<&[u8], RpcError> {
    let bad = |m: &str| RpcError::new(Code::InvalidArgument, format!("bad envelope: {m}"));
    if body.len() < 5 {
        return Err(bad("shorter than its 5-byte prefix"));
    }
    let flags = body[0];
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if flags & FLAG_COMPRESSED != 0 {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    if flags & !FLAG_COMPRESSED != 0 {
        return Err(bad(&format!("unexpected flags {flags:#04x}")));
    }
    if len > MAX_MESSAGE {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("message of {len} bytes is over the {MAX_MESSAGE}-byte limit"),
        ));
    }
    let rest = &body[5..];
    if rest.len() != len {
        return Err(bad(&format!(
            "length {len} but {} bytes follow",
            rest.len()
        )));
    }
    Ok(rest)
}

/// The first whole envelope at the start of `buf` of a client stream: its message and
/// how many bytes it took; `None` while more bytes are needed. Compressed, end-of-stream
/// or oversized envelopes are errors.
pub fn next_envelope(buf: &[u8]) -> Result<Option<(&[u8], usize)>, RpcError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let flags = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if flags & FLAG_COMPRESSED != 0 {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    if flags != 0 {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("bad envelope: unexpected flags {flags:#04x}"),
        ));
    }
    if len > MAX_MESSAGE {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("message of {len} bytes is over the {MAX_MESSAGE}-byte limit"),
        ));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    Ok(Some((&buf[5..5 + len], 5 + len)))
}

/// Most bytes [`coalesced_body`] joins into one write.
const COALESCE_MAX: usize = 256 * 1024;

/// A streaming response body fed by `rx`: what is already waiting in the channel when the
/// body is polled goes out as one write (up to [`COALESCE_MAX`]), not one HTTP chunk per
/// message: a command's fast output is many small envelopes.
pub fn coalesced_body(
    mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::convert::Infallible>>,
) -> Body {
    use std::task::Poll;
    Body::from_stream(futures_util::stream::poll_fn(move |cx| {
        let first = match rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(b))) => b,
            other => return other,
        };
        let mut joined: Option<Vec<u8>> = None;
        while joined.as_ref().map_or(first.len(), Vec::len) < COALESCE_MAX {
            // The end (None) is seen again at the next poll: a closed channel keeps
            // answering it.
            let Poll::Ready(Some(Ok(b))) = rx.poll_recv(cx) else {
                break;
            };
            joined
                .get_or_insert_with(|| first.to_vec())
                .extend_from_slice(&b);
        }
        Poll::Ready(Some(Ok(joined.map_or(first, Bytes::from))))
    }))
}

/// One message envelope.
pub fn envelope(payload: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(5 + payload.len());
    v.push(0);
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v.into()
}

/// The end-of-stream envelope, with the error if the call failed.
pub fn end_envelope(err: Option<&RpcError>) -> Bytes {
    let body = match err {
        Some(e) => serde_json::json!({"error": e.json()}),
        None => serde_json::json!({}),
    };
    let payload = serde_json::to_vec(&body).unwrap_or_default();
    let mut v = Vec::with_capacity(5 + payload.len());
    v.push(FLAG_END);
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(&payload);
    v.into()
}

/// A unary success.
pub fn unary_ok<T: prost::Message + Serialize>(codec: Codec, m: &T) -> Response {
    let mut r = Response::new(Body::from(codec.encode(m)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(codec.content_type(false)),
    );
    r
}

/// A streaming response over `body` (HTTP 200, streaming content type).
pub fn stream_response(codec: Codec, body: Body) -> Response {
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(codec.content_type(true)),
    );
    r
}

/// A streaming call that failed before its first message: HTTP 200 and an end-of-stream
/// envelope carrying the error, as Connect servers answer.
pub fn stream_error(codec: Codec, e: &RpcError) -> Response {
    stream_response(codec, Body::from(end_envelope(Some(e))))
}

/// `Connect-Timeout-Ms`, if given and valid (at most 10 digits, as the spec says).
pub fn timeout(h: &HeaderMap) -> Option<std::time::Duration> {
    let v = h.get("connect-timeout-ms")?.to_str().ok()?;
    if v.is_empty() || v.len() > 10 {
        return None;
    }
    v.parse::<u64>()
        .ok()
        .filter(|ms| *ms > 0)
        .map(std::time::Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_are_checked() {
        let ok = envelope(b"{}");
        assert_eq!(unwrap_envelope(&ok).unwrap(), b"{}");
        assert_eq!(
            unwrap_envelope(&[0, 0, 0]).unwrap_err().code,
            Code::InvalidArgument
        );
        // Length says 10, 2 bytes follow.
        assert_eq!(
            unwrap_envelope(&[0, 0, 0, 0, 10, b'{', b'}'])
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );
        // Trailing bytes after the one message.
        let mut two = ok.to_vec();
        two.extend_from_slice(&ok);
        assert_eq!(
            unwrap_envelope(&two).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            unwrap_envelope(&[1, 0, 0, 0, 0]).unwrap_err().code,
            Code::Unimplemented
        );
        assert_eq!(
            unwrap_envelope(&[0, 0xff, 0xff, 0xff, 0xff])
                .unwrap_err()
                .code,
            Code::ResourceExhausted
        );
        let end = end_envelope(Some(&RpcError::new(Code::NotFound, "x")));
        assert_eq!(end[0], 2);
        let v: serde_json::Value = serde_json::from_slice(&end[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
    }

    #[test]
    fn codecs_by_content_type() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "application/connect+json".parse().unwrap(),
        );
        assert_eq!(Codec::from_headers(&h, true).unwrap(), Codec::Json);
        assert!(Codec::from_headers(&h, false).is_err());
        h.insert(
            header::CONTENT_TYPE,
            "application/proto; charset=x".parse().unwrap(),
        );
        assert_eq!(Codec::from_headers(&h, false).unwrap(), Codec::Proto);
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        assert_eq!(
            Codec::from_headers(&h, false).unwrap_err().code,
            Code::Unimplemented
        );
    }
}

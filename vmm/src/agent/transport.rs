//! Reaching the agent: a Unix socket speaking the protocol directly, or a VMM's vsock
//! Unix socket with Firecracker's host-initiated convention (`CONNECT <port>\n` ->
//! `OK <host port>\n`, then the stream is the guest connection).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use guest_agent::proto::{self, AgentMsg, ErrorKind, Msg, AGENT_VSOCK_PORT, MAX_FRAME_LEN};

use crate::error::{Error, Result};

/// How to speak to the socket at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// Try the vsock handshake for port 52; if the socket answers like an agent instead
    /// (`clade-agent --listen-unix`), reconnect and speak the protocol directly.
    #[default]
    Auto,
    /// The socket is the agent itself (`clade-agent --listen-unix`).
    Direct,
    /// The socket is a VMM's vsock Unix socket: `CONNECT <port>` first.
    Vsock { port: u32 },
}

/// Time allowed for the vsock handshake and the protocol Hello.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest `OK <port>\n` line accepted.
const MAX_OK_LINE: usize = 32;

/// Start of the reason of a handshake that timed out (retried while waiting).
const NO_ANSWER: &str = "no answer within";

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn connect_error(path: &Path, source: std::io::Error) -> Error {
    Error::AgentConnect {
        path: path.to_path_buf(),
        source,
    }
}

fn unix_connect(path: &Path) -> Result<UnixStream> {
    let s = UnixStream::connect(path).map_err(|e| connect_error(path, e))?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(HANDSHAKE_TIMEOUT)))
        .map_err(|e| connect_error(path, e))?;
    Ok(s)
}

/// What answered a `CONNECT` line.
enum Answer {
    /// `OK <port>`: a vsock muxer forwarded us to the guest.
    Vsock,
    /// An agent frame: the socket is the agent itself.
    Agent,
}

/// Opens a stream on which the protocol can start (Hello not yet sent). Read/write
/// timeouts are set to [`HANDSHAKE_TIMEOUT`]; the caller clears them.
pub(crate) fn open(path: &Path, transport: Transport) -> Result<UnixStream> {
    match transport {
        Transport::Direct => unix_connect(path),
        Transport::Vsock { port } => {
            let mut s = unix_connect(path)?;
            match vsock_connect(path, &mut s, port)? {
                Answer::Vsock => Ok(s),
                Answer::Agent => Err(handshake(
                    path,
                    port,
                    "the socket is an agent, not a vsock socket (use the direct transport)",
                )),
            }
        }
        Transport::Auto => {
            let mut s = unix_connect(path)?;
            match vsock_connect(path, &mut s, AGENT_VSOCK_PORT)? {
                Answer::Vsock => Ok(s),
                Answer::Agent => {
                    // The agent closes a connection after an unframeable input; start over.
                    tracing::debug!("{}: direct agent socket", path.display());
                    unix_connect(path)
                }
            }
        }
    }
}

fn handshake(path: &Path, port: u32, reason: impl Into<String>) -> Error {
    Error::AgentHandshake {
        path: path.to_path_buf(),
        port,
        reason: reason.into(),
    }
}

/// Sends `CONNECT <port>\n` and classifies the answer.
///
/// An agent reading `CONN` as a frame length (0x4e4e4f43, far above [`MAX_FRAME_LEN`])
/// answers with a FrameTooLarge error frame; `OK ` followed by a digit can never start an
/// agent frame, since as a length it would exceed the limit too. So the two are told apart
/// by the first four bytes.
fn vsock_connect(path: &Path, s: &mut UnixStream, port: u32) -> Result<Answer> {
    s.write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(|e| connect_error(path, e))?;
    let mut head = [0u8; 4];
    let mut got = 0;
    while got < head.len() {
        match s.read(&mut head[got..]) {
            Ok(0) => {
                return Err(handshake(
                    path,
                    port,
                    "connection closed: nothing listens on that port in the guest \
                     (agent not started yet?)",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // A VMM holds connections made before the guest's vsock driver is up.
            Err(e) if is_timeout(&e) => {
                return Err(handshake(
                    path,
                    port,
                    format!(
                        "{NO_ANSWER} {} s (guest vsock driver not up yet?)",
                        HANDSHAKE_TIMEOUT.as_secs()
                    ),
                ))
            }
            Err(e) => return Err(handshake(path, port, format!("no answer: {e}"))),
        }
    }
    if head.starts_with(b"OK ") {
        let mut line = head.to_vec();
        let mut b = [0u8; 1];
        while line.last() != Some(&b'\n') {
            if line.len() >= MAX_OK_LINE {
                return Err(handshake(path, port, "over-long OK line"));
            }
            match s.read(&mut b) {
                Ok(1) => line.push(b[0]),
                Ok(_) => return Err(handshake(path, port, "connection closed in the OK line")),
                Err(e) => return Err(handshake(path, port, format!("reading the OK line: {e}"))),
            }
        }
        let text = String::from_utf8_lossy(&line);
        let num = text.trim_end().trim_start_matches("OK ");
        if num.parse::<u32>().is_err() {
            return Err(handshake(path, port, format!("unexpected answer {text:?}")));
        }
        return Ok(Answer::Vsock);
    }
    let len = u32::from_le_bytes(head);
    if len <= MAX_FRAME_LEN {
        let mut frame = head.to_vec();
        frame.resize(4 + len as usize, 0);
        if s.read_exact(&mut frame[4..]).is_ok() {
            if let Ok(f) = proto::decode_frame(&frame) {
                if let Msg::Agent(AgentMsg::Error(e)) = f.msg {
                    if e.kind == ErrorKind::FrameTooLarge {
                        return Ok(Answer::Agent);
                    }
                }
            }
        }
    }
    Err(handshake(
        path,
        port,
        format!("unexpected answer starting with {head:02x?}"),
    ))
}

/// Retries `f` until it succeeds or `timeout` has passed, for sockets whose VM (or agent)
/// is still starting: connection refused, socket missing, nothing listening yet, no
/// answer to `CONNECT` yet (the guest's vsock driver is not up), or a connection closed
/// before the agent's `HelloOk` (a just-restored guest resets every connection it had
/// when it handles the device's transport-reset event, which can race a new one).
pub(crate) fn retry<T>(timeout: Duration, mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() < deadline && retryable(&e) => {
                tracing::debug!("agent not reachable yet: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
}

fn retryable(e: &Error) -> bool {
    match e {
        Error::AgentConnect { source, .. } => matches!(
            source.kind(),
            std::io::ErrorKind::NotFound
                | std::io::ErrorKind::ConnectionRefused
                // Our first write met a connection the VMM closed (see `AgentDisconnected`).
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
        ),
        Error::AgentHandshake { reason, .. } => {
            reason.starts_with("connection closed") || reason.starts_with(NO_ANSWER)
        }
        Error::AgentDisconnected => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booting_guests_are_waited_for() {
        let p = Path::new("/vm.sock");
        let closed = handshake(p, 52, "connection closed: nothing listens on that port");
        let silent = handshake(
            p,
            52,
            format!("{NO_ANSWER} 10 s (guest vsock driver not up yet?)"),
        );
        let refused = connect_error(p, std::io::ErrorKind::ConnectionRefused.into());
        assert!(retryable(&closed) && retryable(&silent) && retryable(&refused));
        let reset = handshake(p, 52, "no answer: Connection reset by peer");
        let other = handshake(p, 52, "unexpected answer \"HTTP/1.1\"");
        assert!(!retryable(&reset) && !retryable(&other));

        // A timed-out read is reported as the retryable "no answer within".
        let (mut a, _b) = UnixStream::pair().unwrap();
        a.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
        let mut buf = [0u8; 1];
        assert!(is_timeout(&a.read(&mut buf).unwrap_err()));
    }

    /// A connection the VMM closes before the agent answered Hello (our Hello unread: the
    /// reader sees a reset) is retried like one closed cleanly: a resumed guest's transport
    /// reset drops connections made just before it took effect.
    #[test]
    fn a_connection_reset_before_the_hello_answer_is_retried() {
        use std::io::Read;
        let (a, mut b) = UnixStream::pair().unwrap();
        let peer = std::thread::spawn(move || {
            let mut first = [0u8; 1];
            b.read_exact(&mut first).unwrap();
            // Closed with the rest of the Hello unread: the client's read gets a reset.
        });
        let r = super::super::Client::handshake(Path::new("/vm.sock"), a);
        peer.join().unwrap();
        let Err(e) = r else {
            panic!("no agent answered")
        };
        assert!(matches!(e, Error::AgentDisconnected), "{e}");
        assert!(retryable(&e));
        let pipe = connect_error(Path::new("/vm.sock"), std::io::ErrorKind::BrokenPipe.into());
        assert!(retryable(&pipe));
    }
}

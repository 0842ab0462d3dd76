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

/// Opens a stream on which the protocol can start, with `first` (the protocol's first
/// frame, or nothing) already sent. Read/write timeouts are set to [`HANDSHAKE_TIMEOUT`];
/// the caller clears them.
///
/// Through a vsock socket, `first` goes in the same write as the `CONNECT` line: a VMM's
/// vsock muxer keeps what follows the line for the guest connection it opens (ours keeps
/// the bytes it read past the line; Firecracker's reads the line a byte at a time), so the
/// guest gets the frame as soon as it accepts, a round trip through the host program
/// (`OK` back, then the frame) sooner.
pub(crate) fn open(path: &Path, transport: Transport, first: &[u8]) -> Result<UnixStream> {
    let direct = || {
        let mut s = unix_connect(path)?;
        s.write_all(first).map_err(|e| connect_error(path, e))?;
        Ok(s)
    };
    match transport {
        Transport::Direct => direct(),
        Transport::Vsock { port } => {
            let mut s = unix_connect(path)?;
            match vsock_connect(path, &mut s, port, first)? {
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
            match vsock_connect(path, &mut s, AGENT_VSOCK_PORT, first)? {
                Answer::Vsock => Ok(s),
                Answer::Agent => {
                    // The agent closes a connection after an unframeable input (`first`
                    // went unread with it); start over.
                    tracing::debug!("{}: direct agent socket", path.display());
                    direct()
                }
            }
        }
    }
}

/// Nothing listens on `port` in the guest (yet): the muxer closed the connection.
fn closed(path: &Path, port: u32) -> Error {
    handshake(
        path,
        port,
        "connection closed: nothing listens on that port in the guest (agent not started yet?)",
    )
}

fn handshake(path: &Path, port: u32, reason: impl Into<String>) -> Error {
    Error::AgentHandshake {
        path: path.to_path_buf(),
        port,
        reason: reason.into(),
    }
}

/// Sends `CONNECT <port>\n` with `first` behind it (see [`open`]) and classifies the answer.
///
/// An agent reading `CONN` as a frame length (0x4e4e4f43, far above [`MAX_FRAME_LEN`])
/// answers with a FrameTooLarge error frame; `OK ` followed by a digit can never start an
/// agent frame, since as a length it would exceed the limit too. So the two are told apart
/// by the first four bytes.
fn vsock_connect(path: &Path, s: &mut UnixStream, port: u32, first: &[u8]) -> Result<Answer> {
    let mut opening = format!("CONNECT {port}\n").into_bytes();
    opening.extend_from_slice(first);
    s.write_all(&opening).map_err(|e| connect_error(path, e))?;
    let mut head = [0u8; 4];
    let mut got = 0;
    while got < head.len() {
        match s.read(&mut head[got..]) {
            // A muxer that closes with `first` still unread (nothing listens on the guest
            // port) is seen as a reset rather than an end of stream: the same answer.
            Ok(0) => return Err(closed(path, port)),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(closed(path, port))
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
    use guest_agent::proto::{HostMsg, RemoteError};

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
        (&a).write_all(&super::super::handshake::hello_frame().unwrap())
            .unwrap();
        let mut reader = Some(super::super::connection::PendingReader::start().unwrap());
        let r = super::super::Client::handshake(Path::new("/vm.sock"), a, &mut reader, None);
        peer.join().unwrap();
        // The reader thread waits on for the retry's connection.
        assert!(reader.is_some());
        let Err(e) = r else {
            panic!("no agent answered")
        };
        assert!(matches!(e, Error::AgentDisconnected), "{e}");
        assert!(retryable(&e));
        let pipe = connect_error(Path::new("/vm.sock"), std::io::ErrorKind::BrokenPipe.into());
        assert!(retryable(&pipe));
    }

    /// A vsock muxer on a new socket that reads the `CONNECT` line a byte at a time (as
    /// Firecracker's does), checks it, and leaves the connection to `serve`. Returns the
    /// socket's path and the muxer's thread (which gives the connection back).
    fn fake_muxer(
        name: &str,
        serve: impl FnOnce(&mut UnixStream) + Send + 'static,
    ) -> (std::path::PathBuf, std::thread::JoinHandle<UnixStream>) {
        use std::os::unix::net::UnixListener;
        let dir = std::env::temp_dir().join(format!("clade-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("v.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let muxer = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while line.last() != Some(&b'\n') {
                s.read_exact(&mut b).unwrap();
                line.push(b[0]);
            }
            assert_eq!(line, b"CONNECT 52\n");
            // Nothing answered yet: what the client sends first must already be here.
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            serve(&mut s);
            s
        });
        (path, muxer)
    }

    fn hello_ok() -> Vec<u8> {
        let ok = AgentMsg::HelloOk {
            version: guest_agent::proto::PROTOCOL_VERSION,
            agent_version: "test".into(),
            max_frame_len: MAX_FRAME_LEN,
        };
        proto::encode_agent(0, &ok).unwrap()
    }

    fn pong(id: u32) -> Vec<u8> {
        let pong = AgentMsg::Pong {
            agent_version: "test".into(),
            protocol: guest_agent::proto::PROTOCOL_VERSION,
            uptime_ms: 7,
            running_execs: 0,
        };
        proto::encode_agent(id, &pong).unwrap()
    }

    /// Through a vsock socket the Hello goes out with the `CONNECT` line: a muxer that
    /// reads the line a byte at a time finds the whole Hello behind it before it has
    /// answered `OK`.
    #[test]
    fn the_hello_goes_out_with_the_connect_line() {
        let (path, muxer) = fake_muxer("hello", |s| {
            let frame = proto::read_frame(s, MAX_FRAME_LEN).unwrap().unwrap();
            assert_eq!(frame, super::super::handshake::hello_frame().unwrap());
            s.write_all(b"OK 1024\n").unwrap();
            s.write_all(&hello_ok()).unwrap();
        });
        let c = super::super::Client::connect_with(&path, Transport::Vsock { port: 52 }).unwrap();
        assert_eq!(c.agent_version(), "test");
        drop(muxer.join().unwrap());
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    /// `connect_and_ping`: the Ping (id 1) goes out behind the Hello, before anything is
    /// answered; its Pong is read with the handshake, and the connection's own requests
    /// are numbered after it.
    #[test]
    fn a_ping_goes_out_behind_the_hello() {
        let (path, muxer) = fake_muxer("ping", |s| {
            let hello = proto::read_frame(s, MAX_FRAME_LEN).unwrap().unwrap();
            assert_eq!(hello, super::super::handshake::hello_frame().unwrap());
            let ping = proto::read_frame(s, MAX_FRAME_LEN).unwrap().unwrap();
            let f = proto::decode_frame(&ping).unwrap();
            assert_eq!(f.id, 1);
            assert!(matches!(f.msg, Msg::Host(HostMsg::Ping)), "{:?}", f.msg);
            s.write_all(b"OK 1024\n").unwrap();
            s.write_all(&[hello_ok(), pong(1)].concat()).unwrap();
            // The next request is the connection's own, id 2.
            let next = proto::read_frame(s, MAX_FRAME_LEN).unwrap().unwrap();
            assert_eq!(proto::decode_frame(&next).unwrap().id, 2);
            s.write_all(&pong(2)).unwrap();
        });
        let (c, p) = super::super::Client::connect_and_ping(
            &path,
            Transport::Vsock { port: 52 },
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(
            (p.agent_version.as_str(), p.uptime),
            ("test", Duration::from_millis(7))
        );
        assert_eq!(c.ping().unwrap().uptime, Duration::from_millis(7));
        drop(muxer.join().unwrap());
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    /// `probe`: the same Hello and Ping in the opening; the Pong is returned and the
    /// connection closed (the agent reads its end), no client kept. An agent that refuses
    /// the Hello fails the probe with what it said.
    #[test]
    fn a_probe_pings_and_hangs_up() {
        let (path, muxer) = fake_muxer("probe", |s| {
            let hello = proto::read_frame(s, MAX_FRAME_LEN).unwrap().unwrap();
            assert_eq!(hello, super::super::handshake::hello_frame().unwrap());
            let ping = proto::read_frame(s, MAX_FRAME_LEN).unwrap().unwrap();
            assert_eq!(proto::decode_frame(&ping).unwrap().id, 1);
            s.write_all(b"OK 1024\n").unwrap();
            s.write_all(&[hello_ok(), pong(1)].concat()).unwrap();
            // The probe hangs up after the Pong.
            assert_eq!(proto::read_frame(s, MAX_FRAME_LEN).unwrap(), None);
        });
        let p = super::super::probe(&path, Transport::Vsock { port: 52 }, Duration::from_secs(5))
            .unwrap();
        assert_eq!(p.uptime, Duration::from_millis(7));
        drop(muxer.join().unwrap());
        let _ = std::fs::remove_dir_all(path.parent().unwrap());

        let refused = AgentMsg::Error(RemoteError::new(ErrorKind::Unsupported, "no hello"));
        let (path, muxer) = fake_muxer("probe-refused", move |s| {
            for _ in 0..2 {
                proto::read_frame(s, MAX_FRAME_LEN).unwrap().unwrap();
            }
            s.write_all(b"OK 1024\n").unwrap();
            s.write_all(&proto::encode_agent(0, &refused).unwrap())
                .unwrap();
        });
        let e = super::super::probe(&path, Transport::Vsock { port: 52 }, Duration::from_secs(5))
            .unwrap_err();
        assert!(matches!(e, Error::Agent(_)), "{e}");
        drop(muxer.join().unwrap());
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    /// An agent that answers the first ping with something else (here: an error under
    /// the ping's id, then a frame for another id) fails the connection with what it said.
    #[test]
    fn a_first_ping_answered_wrongly_fails_the_connection() {
        let err = AgentMsg::Error(RemoteError::new(ErrorKind::Unsupported, "no pings"));
        let answers = [
            ("badping", proto::encode_agent(1, &err).unwrap()),
            ("otherid", pong(5)),
        ];
        let mut errors = Vec::new();
        for (name, answer) in answers {
            let (path, muxer) = fake_muxer(name, move |s| {
                for _ in 0..2 {
                    proto::read_frame(s, MAX_FRAME_LEN).unwrap().unwrap();
                }
                s.write_all(b"OK 1024\n").unwrap();
                s.write_all(&[hello_ok(), answer].concat()).unwrap();
            });
            let r = super::super::Client::connect_and_ping(
                &path,
                Transport::Vsock { port: 52 },
                Duration::from_secs(5),
            );
            errors.push(r.unwrap_err());
            drop(muxer.join().unwrap());
            let _ = std::fs::remove_dir_all(path.parent().unwrap());
        }
        assert!(matches!(errors[0], Error::Agent(_)), "{}", errors[0]);
        assert!(
            matches!(errors[1], Error::AgentProtocol(_)),
            "{}",
            errors[1]
        );
    }
}

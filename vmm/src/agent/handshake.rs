//! Opening a connection to the agent: the transport's opening, the protocol's Hello (with
//! a first Ping behind it when asked), the agent's answers, and the hand-over of the
//! stream to the connection's reader thread. [`Client::connect`] and its variants, and
//! [`probe`] and [`connect_raw`], which connect without a [`Client`].

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guest_agent::proto::{
    self, AgentMsg, HostMsg, Msg, MAX_FRAME_LEN, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};

use super::connection::{Inner, PendingReader, Routes};
use super::{check, transport, unexpected, Client, Pong, Transport};
use crate::error::{Error, Result};

/// A raw stream to the agent at `path`: the [`Transport`] is set up (the vsock `CONNECT`
/// handshake done) but the protocol has not started (no `Hello` sent), retrying for up to
/// `timeout` like [`Client::connect_timeout`]. Read and write timeouts are set to 10 s.
///
/// For protocol checks and debugging tools that write frames of their own, malformed ones
/// included (`clade ping --garbage-frame`); everything else uses a [`Client`].
pub fn connect_raw(
    path: impl AsRef<Path>,
    transport: Transport,
    timeout: Duration,
) -> Result<UnixStream> {
    let path = path.as_ref();
    transport::retry(timeout, || transport::open(path, transport, &[]))
}

/// Connects to the agent at `path`, has it answer a Hello and a Ping (sent together, as
/// [`Client::connect_and_ping`] does), and closes, retrying for up to `timeout` like it:
/// whether a guest is ready, without a [`Client`] and so without the connection's reader
/// thread (starting and ending a thread maps and unmaps its stack, which in a process that
/// holds many VMs interrupts each of them: a probe of 100 fork children at once is where
/// that shows).
pub fn probe(path: impl AsRef<Path>, transport: Transport, timeout: Duration) -> Result<Pong> {
    let path = path.as_ref();
    let first = opening(true)?;
    transport::retry(timeout, || {
        let t0 = Instant::now();
        let mut stream = transport::open(path, transport, &first)?;
        let (_, _, pong) = read_handshake_replies(&mut stream, Some(t0))?;
        pong.ok_or_else(|| Error::AgentProtocol("no answer to the ping".into()))
    })
}

impl Client {
    /// Connects to `path` ([`Transport::Auto`]: a VMM vsock socket, port 52, or a direct
    /// agent socket).
    pub fn connect(path: impl AsRef<Path>) -> Result<Self> {
        Self::connect_with(path, Transport::Auto)
    }

    /// Connects with an explicit transport.
    pub fn connect_with(path: impl AsRef<Path>, transport: Transport) -> Result<Self> {
        Self::connect_once(path.as_ref(), transport, &mut None, false).map(|(c, _)| c)
    }

    /// Like [`Client::connect_with`], retrying for up to `timeout` while the socket is
    /// missing or refuses, or nothing listens on the guest port yet (a VM still booting).
    pub fn connect_timeout(
        path: impl AsRef<Path>,
        transport: Transport,
        timeout: Duration,
    ) -> Result<Self> {
        let path = path.as_ref();
        // One reader thread waits through all the attempts.
        let mut reader = None;
        transport::retry(timeout, || {
            Self::connect_once(path, transport, &mut reader, false).map(|(c, _)| c)
        })
    }

    /// Like [`Client::connect_timeout`], and the agent answered a ping: what waiting for a
    /// sandbox to be ready is. The Ping goes out behind the Hello, in the opening's write
    /// (the agent answers a connection's requests in order, and one that arrives before
    /// the handshake is done is refused, so it cannot overtake the Hello): the guest
    /// answers both at one wake-up instead of a round trip each. The Pong's `rtt` counts
    /// from the opening.
    pub fn connect_and_ping(
        path: impl AsRef<Path>,
        transport: Transport,
        timeout: Duration,
    ) -> Result<(Self, Pong)> {
        let path = path.as_ref();
        let mut reader = None;
        transport::retry(timeout, || {
            let (c, pong) = Self::connect_once(path, transport, &mut reader, true)?;
            let pong = pong.ok_or_else(|| Error::AgentProtocol("no answer to the ping".into()))?;
            Ok((c, pong))
        })
    }

    /// One attempt to connect (and, with `ping`, to ping behind the Hello). The
    /// connection's reader thread is started first (or the one a failed attempt left in
    /// `reader` is used): starting a thread costs ~20-35 us here, which then overlaps the
    /// wait for the agent's answer instead of delaying the first call. It is taken from
    /// `reader` only when the connection is made.
    fn connect_once(
        path: &Path,
        transport: Transport,
        reader: &mut Option<PendingReader>,
        ping: bool,
    ) -> Result<(Self, Option<Pong>)> {
        if reader.is_none() {
            *reader = Some(PendingReader::start()?);
        }
        let first = opening(ping)?;
        let t0 = Instant::now();
        let stream = transport::open(path, transport, &first)?;
        Self::handshake(path, stream, reader, ping.then_some(t0))
    }

    /// Finishes a connection whose Hello ([`hello_frame`]) went out with the transport's
    /// opening (followed by a Ping with id [`FIRST_PING_ID`], sent at `ping_sent`): reads
    /// the agent's answers, then hands the stream to the reader thread taken from `reader`
    /// (left there if the handshake fails; one is started if there is none).
    pub(super) fn handshake(
        path: &Path,
        mut stream: UnixStream,
        reader: &mut Option<PendingReader>,
        ping_sent: Option<Instant>,
    ) -> Result<(Self, Option<Pong>)> {
        let io_err = |e: std::io::Error| Error::AgentConnect {
            path: path.to_path_buf(),
            source: e,
        };
        let (version, agent_version, pong) = read_handshake_replies(&mut stream, ping_sent)?;
        stream.set_read_timeout(None).map_err(io_err)?;
        stream.set_write_timeout(None).map_err(io_err)?;
        let stream_reader = stream.try_clone().map_err(io_err)?;
        let writer = stream.try_clone().map_err(io_err)?;
        let routes = Arc::new(Routes {
            map: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        });
        let pending = match reader.take() {
            Some(p) => p,
            None => PendingReader::start()?,
        };
        pending.run(stream_reader, routes.clone())?;
        tracing::debug!(
            "{}: agent {agent_version}, protocol {version}",
            path.display()
        );
        let client = Client {
            inner: Arc::new(Inner {
                sock: stream,
                writer: Mutex::new(writer),
                routes,
                next_id: AtomicU32::new(FIRST_PING_ID + 1),
                agent_version,
                protocol: version,
            }),
        };
        Ok((client, pong))
    }
}

/// The id of the Ping [`Client::connect_and_ping`] sends behind the Hello (id 0); the
/// connection's own requests are numbered after it.
const FIRST_PING_ID: u32 = 1;

/// The answer to a Ping sent at `t0`.
pub(super) fn pong_from(msg: AgentMsg, t0: Instant) -> Result<Pong> {
    match msg {
        AgentMsg::Pong {
            agent_version,
            protocol,
            uptime_ms,
            running_execs,
        } => Ok(Pong {
            agent_version,
            protocol,
            uptime: Duration::from_millis(uptime_ms),
            running_execs,
            rtt: t0.elapsed(),
        }),
        m => Err(unexpected("ping", &m)),
    }
}

/// Reads one answer during the handshake (to the `what` request). A connection reset
/// before it is a connection closed before it (the VMM closes a connection the guest
/// dropped, our Hello still unread: a resumed guest's transport reset drops connections
/// made just before it took effect); both are [`Error::AgentDisconnected`], which a
/// connect retries.
fn read_handshake_frame(stream: &mut UnixStream, what: &str) -> Result<Vec<u8>> {
    proto::read_frame(stream, MAX_FRAME_LEN)
        .map_err(|e| match e {
            guest_agent::Error::Io(io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ) =>
            {
                Error::AgentDisconnected
            }
            e => Error::AgentProtocol(format!("{what}: {e}")),
        })?
        .ok_or(Error::AgentDisconnected)
}

/// Reads the agent's answers to a Hello ([`hello_frame`]) and, when `ping_sent` is set, to
/// the Ping with id [`FIRST_PING_ID`] sent behind it: the protocol version, the agent's
/// version and the Pong.
fn read_handshake_replies(
    stream: &mut UnixStream,
    ping_sent: Option<Instant>,
) -> Result<(u16, String, Option<Pong>)> {
    let reply = read_handshake_frame(stream, "hello")?;
    let f = proto::decode_frame(&reply).map_err(|e| Error::AgentProtocol(format!("hello: {e}")))?;
    let (version, agent_version) = match f.msg {
        Msg::Agent(AgentMsg::HelloOk {
            version,
            agent_version,
            ..
        }) if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) => {
            (version, agent_version)
        }
        Msg::Agent(AgentMsg::Error(e)) => return Err(Error::Agent(e)),
        other => {
            return Err(Error::AgentProtocol(format!(
                "unexpected answer to Hello: {other:?}"
            )))
        }
    };
    let pong = match ping_sent {
        None => None,
        Some(t0) => {
            let reply = read_handshake_frame(stream, "ping")?;
            let f = proto::decode_frame(&reply)
                .map_err(|e| Error::AgentProtocol(format!("ping: {e}")))?;
            match f.msg {
                Msg::Agent(m) if f.id == FIRST_PING_ID => Some(pong_from(check(m)?, t0)?),
                other => {
                    return Err(Error::AgentProtocol(format!(
                        "unexpected answer to the first ping (id {}): {other:?}",
                        f.id
                    )))
                }
            }
        }
    };
    Ok((version, agent_version, pong))
}

/// What a connection opens with: the Hello ([`hello_frame`]), and with `ping` a Ping with
/// id [`FIRST_PING_ID`] behind it.
fn opening(ping: bool) -> Result<Vec<u8>> {
    let mut first = hello_frame()?;
    if ping {
        first.extend(
            proto::encode_host(FIRST_PING_ID, &HostMsg::Ping)
                .map_err(|e| Error::AgentProtocol(e.to_string()))?,
        );
    }
    Ok(first)
}

/// The protocol's first frame: Hello, with the versions this client speaks.
pub(super) fn hello_frame() -> Result<Vec<u8>> {
    let hello = HostMsg::Hello {
        min_version: MIN_PROTOCOL_VERSION,
        max_version: PROTOCOL_VERSION,
        client: format!("clade {}", env!("CARGO_PKG_VERSION")),
    };
    proto::encode_host(0, &hello).map_err(|e| Error::AgentProtocol(e.to_string()))
}

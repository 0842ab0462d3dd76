//! DNS for sandboxes: a forwarder on each sandbox network's gateway address (port 53 of
//! `hostnet::GUEST_GATEWAY`, which the guest agent writes into the guest's
//! `/etc/resolv.conf`), passing queries to the host's resolver and the answers back.
//!
//! Why a forwarder and not the host's resolver directly: the host's resolver is often on
//! a loopback address (systemd-resolved's 127.0.0.53), which a sandbox's namespace cannot
//! reach; and every sandbox has the same inner addressing, so the one address the guest
//! knows must be answered inside its own namespace. The socket is bound inside the
//! namespace (it keeps that namespace for life) and the query goes out from this process,
//! in the host's namespace, like any lookup of the host's own.
//!
//! Written here (a few dozen lines of UDP relaying) rather than with a DNS crate: nothing
//! is parsed beyond the 2-byte query id that pairs an answer with its query. One query at a
//! time per sandbox, each answered or dropped within [`UPSTREAM_TIMEOUT`]; the guest
//! retries as resolvers do. TCP (answers over 512 bytes without EDNS) is not forwarded.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, Result};

/// How long the host's resolver may take to answer one query.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest query or answer relayed (EDNS's common buffer size).
const MAX_MESSAGE: usize = 4096;
/// How often the relay thread looks at its stop flag.
const POLL: Duration = Duration::from_millis(200);

/// The first `nameserver` of a resolv.conf text, on port 53.
pub fn upstream_from(resolv_conf: &str) -> Option<SocketAddr> {
    resolv_conf
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .next()
}

/// A running forwarder; stopped (and its socket closed) when dropped.
pub struct Forwarder {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Binds `listen` (UDP) inside the network namespace at `netns` and relays what
    /// arrives there to `upstream`.
    pub fn start(netns: &Path, listen: SocketAddr, upstream: SocketAddr) -> Result<Forwarder> {
        let socket = hostnet::in_netns(netns, move || UdpSocket::bind(listen))
            .map_err(|e| Error::Network(format!("DNS forwarder: {e}")))?
            .map_err(|e| Error::Network(format!("DNS forwarder: binding {listen}: {e}")))?;
        socket
            .set_read_timeout(Some(POLL))
            .map_err(|e| Error::Network(format!("DNS forwarder: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("dns-forward".into())
            .spawn(move || relay(&socket, upstream, &flag))
            .map_err(|e| Error::Network(format!("DNS forwarder thread: {e}")))?;
        Ok(Forwarder {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn relay(socket: &UdpSocket, upstream: SocketAddr, stop: &AtomicBool) {
    let mut buf = vec![0u8; MAX_MESSAGE];
    while !stop.load(Ordering::Relaxed) {
        let (n, from) = match socket.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => {
                tracing::warn!("DNS forwarder: {e}");
                std::thread::sleep(POLL);
                continue;
            }
        };
        // A DNS header is 12 bytes; anything shorter is not a query.
        if n < 12 {
            continue;
        }
        match ask(&buf[..n], upstream) {
            Ok(answer) => {
                let _ = socket.send_to(&answer, from);
            }
            Err(e) => tracing::debug!("DNS forwarder: {upstream}: {e}"),
        }
    }
}

/// One query to the upstream resolver; its answer (the one with the query's id).
fn ask(query: &[u8], upstream: SocketAddr) -> std::io::Result<Vec<u8>> {
    let local: SocketAddr = match upstream {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("literal"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("literal"),
    };
    let s = UdpSocket::bind(local)?;
    s.connect(upstream)?;
    s.set_read_timeout(Some(UPSTREAM_TIMEOUT))?;
    s.send(query)?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let n = s.recv(&mut buf)?;
        if n >= 12 && buf[..2] == query[..2] {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_nameserver_is_the_upstream() {
        let conf = "# generated\nsearch example\nnameserver  10.0.0.53 \nnameserver 1.1.1.1\n";
        assert_eq!(upstream_from(conf), Some("10.0.0.53:53".parse().unwrap()));
        assert_eq!(
            upstream_from("nameserver ::1\n"),
            Some("[::1]:53".parse().unwrap())
        );
        assert_eq!(upstream_from("nameserver bogus\noptions edns0\n"), None);
        assert_eq!(upstream_from(""), None);
    }

    #[test]
    fn a_query_is_relayed_and_only_its_own_answer_comes_back() {
        // The "upstream": answers each query with its id, first a wrong one.
        let up = UdpSocket::bind("127.0.0.1:0").unwrap();
        let up_addr = up.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut b = [0u8; 512];
            let (n, from) = up.recv_from(&mut b).unwrap();
            let mut wrong = b[..n].to_vec();
            wrong[0] ^= 0xff;
            up.send_to(&wrong, from).unwrap();
            let mut answer = b[..n].to_vec();
            answer.extend_from_slice(b"answer");
            up.send_to(&answer, from).unwrap();
        });
        let query = [0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 7];
        let answer = ask(&query, up_addr).unwrap();
        assert_eq!(&answer[..2], &[0x12, 0x34]);
        assert!(answer.ends_with(b"answer"));
    }
}

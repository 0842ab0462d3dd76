//! [`ApiClient`]: the client end of a VM's API socket (what `clade snapshot`, the host
//! services and the tests use): one request at a time, each answered within its time limit.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::{io_err, Request, Response};
use crate::error::{Error, Result};

/// A client of a VM's API socket.
pub struct ApiClient {
    pub(super) stream: BufReader<UnixStream>,
    /// Replaces [`Request::answer_timeout`] for every request (see
    /// [`ApiClient::set_answer_timeout`]).
    answer_timeout: Option<Duration>,
    /// The limit the socket has now (set again only when a request needs another: two
    /// system calls saved on each call of a standby's restore path).
    applied_timeout: Option<Duration>,
}

impl ApiClient {
    /// Connects to the socket at `path`.
    pub fn connect(path: &Path) -> Result<Self> {
        let stream = UnixStream::connect(path).map_err(|source| Error::Io {
            context: "connecting to the VM's API socket",
            source,
        })?;
        Ok(Self {
            stream: BufReader::new(stream),
            answer_timeout: None,
            applied_timeout: None,
        })
    }

    /// Waits at most `limit` for each answer from now on, whatever the request.
    pub fn set_answer_timeout(&mut self, limit: Duration) {
        self.answer_timeout = Some(limit);
    }

    /// Sends `request` and waits for the response.
    pub fn call(&mut self, request: &Request) -> Result<Response> {
        self.call_with_fds(request, &[])
    }

    /// Sends `request` with descriptors `fds` (`SCM_RIGHTS`, at most
    /// [`MAX_REQUEST_FDS`](super::MAX_REQUEST_FDS); the server gets duplicates, these stay
    /// the caller's) and waits for the response, at most [`Request::answer_timeout`] (or
    /// the limit set with [`ApiClient::set_answer_timeout`]).
    pub fn call_with_fds(&mut self, request: &Request, fds: &[BorrowedFd<'_>]) -> Result<Response> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let limit = self
            .answer_timeout
            .unwrap_or_else(|| request.answer_timeout());
        if self.applied_timeout != Some(limit) {
            let sock = self.stream.get_ref();
            sock.set_read_timeout(Some(limit))
                .and_then(|()| sock.set_write_timeout(Some(limit)))
                .map_err(io_err("setting the API socket's timeouts"))?;
            self.applied_timeout = Some(limit);
        }
        let mut line = serde_json::to_string(request)
            .map_err(|e| Error::Config(format!("encoding request: {e}")))?;
        line.push('\n');
        let mut bytes = line.as_bytes();
        if !fds.is_empty() {
            // The descriptors go with the line's first bytes.
            let raw: Vec<std::os::fd::RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
            let sent = loop {
                match sendmsg::<()>(
                    self.stream.get_ref().as_raw_fd(),
                    &[std::io::IoSlice::new(bytes)],
                    &[ControlMessage::ScmRights(&raw)],
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                ) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    r => break r,
                }
            }
            .map_err(|e| Error::Io {
                context: "writing an API request with descriptors",
                source: std::io::Error::from_raw_os_error(e as i32),
            })?;
            bytes = &bytes[sent..];
        }
        self.stream
            .get_mut()
            .write_all(bytes)
            .map_err(io_err("writing an API request"))?;
        let mut answer = String::new();
        self.stream
            .read_line(&mut answer)
            .map_err(|source| Error::Io {
                context: if matches!(
                    source.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) {
                    "no API response in the request's time limit (the VM process is wedged?)"
                } else {
                    "reading an API response"
                },
                source,
            })?;
        serde_json::from_str(&answer).map_err(|e| Error::Config(format!("bad API response: {e}")))
    }
}

//! One API connection's traffic: request lines read with the descriptors sent along
//! ([`LineReader`], [`next_request`]), answers written back ([`write_response`]), and the
//! [`PendingRequest`] that carries a request to the VM's owner and its answer back. Shared
//! by the listener served on the caller's thread and the server thread.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::Sender;

use super::{Request, Response, MAX_REQUEST, MAX_REQUEST_FDS};

/// A request waiting for the VM owner's answer.
pub struct PendingRequest {
    /// What was asked.
    pub request: Request,
    /// Descriptors that came with the request line (`SCM_RIGHTS`, at most
    /// [`MAX_REQUEST_FDS`]), e.g. a standby's TAP; closed with the request unless taken.
    pub(super) fds: Vec<OwnedFd>,
    pub(super) reply: Reply,
}

/// Where a request's answer goes.
pub(super) enum Reply {
    /// To the connection thread that read it ([`ApiServer`]).
    ///
    /// [`ApiServer`]: super::ApiServer
    Thread(Sender<Response>),
    /// Straight onto its connection, which closes then ([`ApiListener::next_request`]).
    ///
    /// [`ApiListener::next_request`]: super::ApiListener::next_request
    Connection(UnixStream),
}

impl PendingRequest {
    /// Takes the descriptors that came with the request.
    pub fn take_fds(&mut self) -> Vec<OwnedFd> {
        std::mem::take(&mut self.fds)
    }

    /// Sends the answer back to the client.
    pub fn respond(self, response: Response) {
        match self.reply {
            Reply::Thread(tx) => {
                let _ = tx.send(response);
            }
            Reply::Connection(mut stream) => {
                let _ = write_response(&mut stream, &response);
            }
        }
    }
}

pub(super) fn write_response(stream: &mut UnixStream, r: &Response) -> std::io::Result<()> {
    let mut line = serde_json::to_string(r).unwrap_or_else(|_| "{\"ok\":false}".into());
    line.push('\n');
    stream.write_all(line.as_bytes())
}

/// What the next line of a connection is.
pub(super) enum NextRequest {
    Request(Request, Vec<OwnedFd>),
    /// Not a request: this answer, and the connection stays usable.
    Bad(Response),
    /// This answer, then the connection closes (the line was too long to find its end).
    Fatal(Response),
    /// The peer went away, or the socket failed or timed out.
    End,
}

pub(super) fn next_request(reader: &mut LineReader) -> NextRequest {
    match reader.next_line() {
        Ok(Some((line, fds))) => match serde_json::from_slice::<Request>(&line) {
            Ok(request) => NextRequest::Request(request, fds),
            Err(e) => NextRequest::Bad(Response::err(format!("bad request: {e}"))),
        },
        Ok(None) | Err(LineError::Io) => NextRequest::End,
        Err(LineError::TooLong) => NextRequest::Fatal(Response::err("request too long")),
        Err(LineError::TooManyFds) => NextRequest::Bad(Response::err(format!(
            "bad request: more than {MAX_REQUEST_FDS} descriptors sent with it"
        ))),
    }
}

/// A request line (with its newline) and the descriptors that came with it.
type Line = (Vec<u8>, Vec<OwnedFd>);

enum LineError {
    /// The peer went away, or the socket failed or timed out.
    Io,
    /// A line longer than [`MAX_REQUEST`].
    TooLong,
    /// A line sent with more descriptors than [`MAX_REQUEST_FDS`].
    TooManyFds,
}

/// Reads request lines with `recvmsg`, so that descriptors sent with a line
/// (`SCM_RIGHTS`) come along with it: every descriptor received until a line ends belongs
/// to that line. A buffered reader would drop them (`read` discards control messages).
/// std and the rust-vmm crates have no line reader that keeps them; this one is ours.
pub(super) struct LineReader {
    stream: UnixStream,
    buf: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// Descriptors of the current line were cut off (`MSG_CTRUNC`).
    truncated: bool,
}

impl LineReader {
    pub(super) fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            buf: Vec::new(),
            fds: Vec::new(),
            truncated: false,
        }
    }

    /// The next line (with its newline) and its descriptors; `None` at the end.
    fn next_line(&mut self) -> std::result::Result<Option<Line>, LineError> {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        use std::os::fd::FromRawFd;
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                if end > MAX_REQUEST {
                    return Err(LineError::TooLong);
                }
                let rest = self.buf.split_off(end + 1);
                let line = std::mem::replace(&mut self.buf, rest);
                if std::mem::take(&mut self.truncated) || self.fds.len() > MAX_REQUEST_FDS {
                    self.fds.clear();
                    return Err(LineError::TooManyFds);
                }
                return Ok(Some((line, std::mem::take(&mut self.fds))));
            }
            if self.buf.len() > MAX_REQUEST {
                return Err(LineError::TooLong);
            }
            let mut chunk = [0u8; 4096];
            let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; MAX_REQUEST_FDS + 1]);
            let mut iov = [std::io::IoSliceMut::new(&mut chunk)];
            let msg = match recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(m) => m,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => return Err(LineError::Io),
            };
            let n = msg.bytes;
            for c in msg.cmsgs() {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    for fd in fds {
                        // SAFETY: the kernel installed `fd` in this process for this
                        // message; nothing else owns it.
                        self.fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
            // More descriptors than the buffer holds (the kernel closed the rest): the
            // line is refused for carrying too many.
            self.truncated |= msg.flags.contains(MsgFlags::MSG_CTRUNC);
            if n == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(LineError::Io)
                };
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

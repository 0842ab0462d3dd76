//! One vsock stream between the guest and a host Unix socket, and its flow control.
//!
//! Byte counters follow the virtio-vsock spec, all wrapping `u32`:
//!
//! - guest -> host: the guest may have at most [`CONN_BUF_SIZE`] (our `buf_alloc`) bytes in
//!   flight that we have not yet written to the host socket. `recv_cnt` counts bytes received
//!   from the guest, `fwd_cnt` bytes written to the host; `recv_cnt - fwd_cnt` bytes wait in
//!   `tx_buf` (only when the host reader is slow). A guest that sends beyond its credit is
//!   reset. Every packet we send carries `fwd_cnt`; when the guest may be short of credit and
//!   we made progress, we queue a CREDIT_UPDATE.
//! - host -> guest: we read from the host socket only into guest rx buffers, and only as
//!   many bytes as the guest's credit (`peer_buf_alloc - (rx_cnt - peer_fwd_cnt)`) allows.
//!   Without credit we stop polling the socket and send one CREDIT_REQUEST. Nothing is
//!   buffered on the host side beyond the socket's own kernel buffer, so a guest that stops
//!   reading cannot make the VMM grow.

use std::collections::VecDeque;
use std::io::{ErrorKind, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice, WriteVolatile};
use vmm_sys_util::epoll::EventSet;

use super::{
    Hdr, CONNECT_TIMEOUT, CONN_BUF_SIZE, MAX_PKT_DATA, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE,
    OP_REQUEST, OP_RESPONSE, OP_RW, OP_SHUTDOWN, SHUTDOWN_RCV, SHUTDOWN_SEND, SHUTDOWN_TIMEOUT,
};

/// A connection is named by its host-side port and its guest-side port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ConnKey {
    pub local_port: u32,
    pub peer_port: u32,
}

impl std::fmt::Display for ConnKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "host:{} <-> guest:{}", self.local_port, self.peer_port)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnState {
    /// Host-initiated: REQUEST queued or sent, waiting for the guest's RESPONSE.
    Connecting,
    /// Data may flow (each direction until shut down).
    Established,
}

// Control packets waiting for an rx buffer.
const P_REQUEST: u8 = 1;
const P_RESPONSE: u8 = 2;
const P_CREDIT_UPDATE: u8 = 4;
const P_CREDIT_REQUEST: u8 = 8;
const P_SHUTDOWN: u8 = 16;

const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;

/// Why a connection must end with an RST.
pub(crate) type KillReason = &'static str;

fn io_kind(e: &VolatileMemoryError) -> Option<ErrorKind> {
    match e {
        VolatileMemoryError::IOError(io) => Some(io.kind()),
        _ => None,
    }
}

pub(crate) struct Connection {
    pub stream: UnixStream,
    pub key: ConnKey,
    pub state: ConnState,
    /// When the connection is given up if nothing else happens (connect or close timeout).
    pub deadline: Option<Instant>,

    // guest -> host
    tx_buf: VecDeque<u8>,
    /// Bytes for the host that are not guest data (the `OK <port>` line).
    ctrl_out: Vec<u8>,
    recv_cnt: Wrapping<u32>,
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,

    // host -> guest
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    rx_cnt: Wrapping<u32>,
    /// Host bytes read together with the `CONNECT` line, sent before anything else.
    host_prefix: Vec<u8>,

    pending: u8,
    shutdown_flags: u32,
    shutdown_sent: u32,
    /// Shutdown flags received from the guest.
    peer_shutdown: u32,
    /// The host's write side ended (read returned 0).
    local_eof: bool,
    /// The host closed its end entirely (EPOLLHUP): nothing more can be written to it.
    local_hup: bool,
    write_shut: bool,
    /// The host socket may have data (or EOF) to read.
    readable: bool,
    credit_requested: bool,

    // Bookkeeping of the worker.
    /// Current epoll registration (`None`: not registered).
    pub interest: Option<EventSet>,
    /// In the worker's rx round-robin queue.
    pub queued: bool,
    /// In the worker's list of connections whose registration must be synced.
    pub dirty: bool,
}

impl Connection {
    fn new(stream: UnixStream, key: ConnKey, state: ConnState) -> Self {
        Self {
            stream,
            key,
            state,
            deadline: None,
            tx_buf: VecDeque::new(),
            ctrl_out: Vec::new(),
            recv_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            host_prefix: Vec::new(),
            pending: 0,
            shutdown_flags: 0,
            shutdown_sent: 0,
            peer_shutdown: 0,
            local_eof: false,
            local_hup: false,
            write_shut: false,
            readable: false,
            credit_requested: false,
            interest: None,
            queued: false,
            dirty: false,
        }
    }

    /// A host program asked (through `CONNECT <port>`) to reach guest port `key.peer_port`.
    /// `prefix`: bytes it sent after the line. `interest`: the stream's current registration.
    pub fn host_initiated(
        stream: UnixStream,
        key: ConnKey,
        prefix: Vec<u8>,
        interest: Option<EventSet>,
        now: Instant,
    ) -> Self {
        let mut c = Self::new(stream, key, ConnState::Connecting);
        c.host_prefix = prefix;
        c.pending = P_REQUEST;
        c.deadline = Some(now + CONNECT_TIMEOUT);
        c.interest = interest;
        c
    }

    /// The guest connected to host port `key.local_port` and we reached the host listener.
    pub fn guest_initiated(stream: UnixStream, key: ConnKey, buf_alloc: u32, fwd_cnt: u32) -> Self {
        let mut c = Self::new(stream, key, ConnState::Established);
        c.peer_buf_alloc = buf_alloc;
        c.peer_fwd_cnt = Wrapping(fwd_cnt);
        c.pending = P_RESPONSE;
        c.readable = true;
        c
    }

    fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Every guest packet of this connection carries the guest's receive-buffer state.
    pub fn update_peer_credit(&mut self, buf_alloc: u32, fwd_cnt: u32) {
        self.peer_buf_alloc = buf_alloc;
        self.peer_fwd_cnt = Wrapping(fwd_cnt);
        // New information: a later stall may ask again.
        self.credit_requested = false;
        if self.peer_credit() > 0 {
            self.pending &= !P_CREDIT_REQUEST;
        }
    }

    /// The guest accepted our REQUEST: tell the host program, then let data flow.
    pub fn on_response(&mut self) -> Result<(), KillReason> {
        if self.state != ConnState::Connecting || self.pending & P_REQUEST != 0 {
            return Err("RESPONSE to a connection that did not ask for one");
        }
        self.state = ConnState::Established;
        self.deadline = None;
        self.ctrl_out = format!("OK {}\n", self.key.local_port).into_bytes();
        self.readable = true;
        self.flush()
    }

    pub fn on_credit_request(&mut self) {
        self.pending |= P_CREDIT_UPDATE;
    }

    /// Data from the guest: write it to the host now, or keep it until the host reads.
    pub fn on_rw<B: BitmapSlice>(
        &mut self,
        data: Option<&VolatileSlice<'_, B>>,
        len: u32,
    ) -> Result<(), KillReason> {
        if self.state != ConnState::Established {
            return Err("data before the connection was established");
        }
        if self.peer_shutdown & SHUTDOWN_SEND != 0 {
            return Err("data after the guest shut down sending");
        }
        if len == 0 {
            return Ok(());
        }
        let Some(data) = data else {
            return Err("data packet without data");
        };
        let buffered = (self.recv_cnt - self.fwd_cnt).0;
        if u64::from(buffered) + u64::from(len) > u64::from(CONN_BUF_SIZE) {
            return Err("guest sent more than the credit it was given");
        }
        self.recv_cnt += len;
        if self.local_hup {
            // Nobody left to read it.
            self.fwd_cnt += len;
            return Ok(());
        }
        let len = len as usize;
        let mut written = 0usize;
        if self.tx_buf.is_empty() && self.ctrl_out.is_empty() {
            loop {
                match self.stream.write_volatile(data) {
                    Ok(n) => {
                        written = n;
                        break;
                    }
                    Err(e) => match io_kind(&e) {
                        Some(ErrorKind::WouldBlock) => break,
                        Some(ErrorKind::Interrupted) => continue,
                        _ => return Err("writing to the host socket failed"),
                    },
                }
            }
            self.fwd_cnt += written as u32;
        }
        if written < len {
            let rest = data
                .subslice(written, len - written)
                .map_err(|_| "guest data slice out of range")?;
            let mut tmp = vec![0u8; len - written];
            rest.copy_to(&mut tmp[..]);
            self.tx_buf.extend(tmp);
        }
        self.maybe_credit_update();
        Ok(())
    }

    pub fn on_shutdown(&mut self, flags: u32, now: Instant) -> Result<(), KillReason> {
        self.peer_shutdown |= flags & SHUTDOWN_BOTH;
        if self.peer_shutdown & SHUTDOWN_RCV != 0 {
            // The guest reads no more: drop what we would have sent.
            self.host_prefix.clear();
            self.pending &= !P_CREDIT_REQUEST;
        }
        if self.peer_shutdown == SHUTDOWN_BOTH && self.deadline.is_none() {
            // Normally ends as soon as pending data reaches the host; a host that never
            // reads must not keep the connection forever.
            self.deadline = Some(now + SHUTDOWN_TIMEOUT);
        }
        // With nothing left to write, this shuts the host's read side now.
        self.flush()
    }

    /// The host stream became writable, or there is new data: write what we can.
    pub fn flush(&mut self) -> Result<(), KillReason> {
        if self.local_hup {
            return Ok(());
        }
        while !self.ctrl_out.is_empty() {
            match self.stream.write(&self.ctrl_out) {
                Ok(0) => return Err("host socket closed"),
                Ok(n) => {
                    self.ctrl_out.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Err("writing to the host socket failed"),
            }
        }
        while !self.tx_buf.is_empty() {
            let (chunk, _) = self.tx_buf.as_slices();
            match self.stream.write(chunk) {
                Ok(0) => return Err("host socket closed"),
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    self.fwd_cnt += n as u32;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Err("writing to the host socket failed"),
            }
        }
        if self.tx_buf.is_empty() {
            if self.tx_buf.capacity() > 64 * 1024 {
                self.tx_buf = VecDeque::new();
            }
            if self.peer_shutdown & SHUTDOWN_SEND != 0 && !self.write_shut {
                self.write_shut = true;
                // The host program reads EOF. ENOTCONN (it already left) changes nothing.
                let _ = self.stream.shutdown(std::net::Shutdown::Write);
            }
        }
        self.maybe_credit_update();
        Ok(())
    }

    /// Queue a CREDIT_UPDATE when the guest may be running short of credit and we have
    /// freed space it does not know about.
    fn maybe_credit_update(&mut self) {
        let unadvertised = (self.fwd_cnt - self.last_fwd_cnt_sent).0;
        if unadvertised == 0 || self.peer_shutdown & SHUTDOWN_SEND != 0 {
            return;
        }
        let guest_view_used = (self.recv_cnt - self.last_fwd_cnt_sent).0;
        let guest_view_free = CONN_BUF_SIZE.saturating_sub(guest_view_used);
        if guest_view_free < CONN_BUF_SIZE / 4 || unadvertised >= CONN_BUF_SIZE / 2 {
            self.pending |= P_CREDIT_UPDATE;
        }
    }

    /// The host socket is readable (data or EOF).
    pub fn on_readable(&mut self) {
        self.readable = true;
    }

    /// The host closed its end entirely.
    pub fn on_hup(&mut self) {
        self.local_hup = true;
        // Remaining data (if any) and then EOF can be read without blocking.
        self.readable = true;
        self.ctrl_out.clear();
        let dropped = self.tx_buf.len() as u32;
        self.tx_buf = VecDeque::new();
        self.fwd_cnt += dropped;
        if self.local_eof && self.shutdown_sent & SHUTDOWN_RCV == 0 {
            self.shutdown_flags = SHUTDOWN_BOTH;
            self.pending |= P_SHUTDOWN;
        }
    }

    fn on_local_eof(&mut self) {
        self.local_eof = true;
        self.readable = false;
        self.shutdown_flags = if self.local_hup {
            SHUTDOWN_BOTH
        } else {
            SHUTDOWN_SEND
        };
        self.pending |= P_SHUTDOWN;
    }

    fn wants_data_out(&self) -> bool {
        self.state == ConnState::Established
            && self.peer_shutdown & SHUTDOWN_RCV == 0
            && (!self.host_prefix.is_empty() || (self.readable && !self.local_eof))
    }

    /// Something to put in a guest rx buffer.
    pub fn has_rx(&self) -> bool {
        self.pending != 0
            || (self.wants_data_out() && (self.peer_credit() > 0 || !self.credit_requested))
    }

    /// The epoll events this connection needs now; `None` when it must not be polled at all
    /// (the host hung up: EPOLLHUP would be reported forever).
    pub fn desired_interest(&self) -> Option<EventSet> {
        if self.local_hup {
            return None;
        }
        let mut set = EventSet::empty();
        if self.state == ConnState::Established
            && !self.readable
            && !self.local_eof
            && self.peer_shutdown & SHUTDOWN_RCV == 0
            && self.peer_credit() > 0
        {
            set |= EventSet::IN;
        }
        if !self.tx_buf.is_empty() || !self.ctrl_out.is_empty() {
            set |= EventSet::OUT;
        }
        Some(set)
    }

    /// `Some(reason)` when the connection is over and must be reset and forgotten.
    pub fn end_reason(&self, now: Instant) -> Option<KillReason> {
        if self.deadline.is_some_and(|d| now >= d) {
            return Some(match self.state {
                ConnState::Connecting => "the guest did not answer the connection request",
                ConnState::Established => "shutdown timed out",
            });
        }
        if self.state == ConnState::Connecting && self.local_hup {
            return Some("the host program left before the guest accepted");
        }
        let flushed = self.tx_buf.is_empty() && self.ctrl_out.is_empty();
        if self.peer_shutdown == SHUTDOWN_BOTH && (flushed || self.local_hup) {
            return Some("closed by the guest");
        }
        if self.local_hup && self.peer_shutdown & SHUTDOWN_RCV != 0 {
            return Some("closed by both sides");
        }
        None
    }

    /// Reads host data into `buf` (at most the guest's credit). `Ok(None)`: nothing now.
    fn read_data<B: BitmapSlice>(
        &mut self,
        buf: Option<&VolatileSlice<'_, B>>,
    ) -> Result<Option<u32>, KillReason> {
        if !self.wants_data_out() {
            return Ok(None);
        }
        let credit = self.peer_credit();
        if credit == 0 {
            if !self.credit_requested {
                self.credit_requested = true;
                self.pending |= P_CREDIT_REQUEST;
            }
            return Ok(None);
        }
        let Some(buf) = buf else {
            return Ok(None);
        };
        let max = buf.len().min(credit as usize).min(MAX_PKT_DATA as usize);
        if max == 0 {
            return Ok(None);
        }
        let mut dst = buf.subslice(0, max).map_err(|_| "rx buffer slice")?;
        if !self.host_prefix.is_empty() {
            let n = max.min(self.host_prefix.len());
            dst.copy_from(&self.host_prefix[..n]);
            self.host_prefix.drain(..n);
            self.rx_cnt += n as u32;
            return Ok(Some(n as u32));
        }
        loop {
            match self.stream.read_volatile(&mut dst) {
                Ok(0) => {
                    self.on_local_eof();
                    return Ok(None);
                }
                Ok(n) => {
                    self.rx_cnt += n as u32;
                    return Ok(Some(n as u32));
                }
                Err(e) => match io_kind(&e) {
                    Some(ErrorKind::WouldBlock) => {
                        self.readable = false;
                        return Ok(None);
                    }
                    Some(ErrorKind::Interrupted) => {}
                    _ => return Err("reading from the host socket failed"),
                },
            }
        }
    }

    /// Fills one guest rx packet with the next thing this connection has to say. Returns
    /// the header to write and the number of data bytes already placed in `buf`.
    pub fn next_rx<B: BitmapSlice>(
        &mut self,
        buf: Option<&VolatileSlice<'_, B>>,
        now: Instant,
    ) -> Result<Option<(Hdr, u32)>, KillReason> {
        let (op, flags, len) = if self.pending & P_REQUEST != 0 {
            self.pending &= !P_REQUEST;
            (OP_REQUEST, 0, 0)
        } else if self.pending & P_RESPONSE != 0 {
            self.pending &= !P_RESPONSE;
            (OP_RESPONSE, 0, 0)
        } else if let Some(n) = self.read_data(buf)? {
            (OP_RW, 0, n)
        } else if self.pending & P_SHUTDOWN != 0 {
            self.pending &= !P_SHUTDOWN;
            self.shutdown_sent |= self.shutdown_flags;
            if self.shutdown_sent == SHUTDOWN_BOTH && self.deadline.is_none() {
                // We are done both ways; the guest answers with RST.
                self.deadline = Some(now + SHUTDOWN_TIMEOUT);
            }
            (OP_SHUTDOWN, self.shutdown_flags, 0)
        } else if self.pending & P_CREDIT_UPDATE != 0 {
            (OP_CREDIT_UPDATE, 0, 0)
        } else if self.pending & P_CREDIT_REQUEST != 0 {
            self.pending &= !P_CREDIT_REQUEST;
            (OP_CREDIT_REQUEST, 0, 0)
        } else {
            return Ok(None);
        };
        // Every header carries our fwd_cnt: no separate update needed after this one.
        self.pending &= !P_CREDIT_UPDATE;
        self.last_fwd_cnt_sent = self.fwd_cnt;
        Ok(Some((self.hdr(op, flags, len), len)))
    }

    /// A header from us (host) to the guest for this connection; the worker fills the CIDs.
    fn hdr(&self, op: u16, flags: u32, len: u32) -> Hdr {
        Hdr {
            src_port: self.key.local_port,
            dst_port: self.key.peer_port,
            len,
            op,
            flags,
            buf_alloc: CONN_BUF_SIZE,
            fwd_cnt: self.fwd_cnt.0,
            ..Hdr::default()
        }
    }
}

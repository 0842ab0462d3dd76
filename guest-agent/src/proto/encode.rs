//! Encoding frames: [`encode_host`] and [`encode_agent`] write a message's fields in the
//! protocol's fixed binary layout (little-endian integers, `u32`-length-prefixed byte
//! strings) and refuse a frame over [`MAX_FRAME_LEN`]; and the encoded sizes of listing
//! entries, for batching them into frames.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;

use super::tag;
use super::{AgentMsg, DirEntry, ExecSpec, ExitStatus, FileStat, HostMsg, ProcInfo, MAX_FRAME_LEN};
use crate::Error;

/// Builds one frame: reserves the length prefix, then fills it in at the end.
struct Enc {
    buf: Vec<u8>,
}

impl Enc {
    fn new(tag: u8, id: u32) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&[0; 4]);
        buf.push(tag);
        buf.extend_from_slice(&id.to_le_bytes());
        Enc { buf }
    }
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    fn bool(&mut self, v: bool) {
        self.buf.push(u8::from(v));
    }
    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn i32(&mut self, v: i32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        // Lengths beyond u32 cannot fit a frame anyway; finish() rejects the frame.
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.buf.extend_from_slice(b);
    }
    fn os(&mut self, s: &std::ffi::OsStr) {
        self.bytes(s.as_bytes());
    }
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    fn spec(&mut self, spec: &ExecSpec) {
        self.argv_env_cwd(&spec.argv, &spec.env, spec.cwd.as_deref());
        self.opt_u32(spec.uid);
        self.opt_u32(spec.gid);
        match spec.tty {
            None => self.u8(0),
            Some(ws) => {
                self.u8(1);
                self.u16(ws.rows);
                self.u16(ws.cols);
            }
        }
        self.bool(spec.stdin);
    }
    fn argv_env_cwd(
        &mut self,
        argv: &[OsString],
        env: &[(OsString, OsString)],
        cwd: Option<&std::path::Path>,
    ) {
        self.count(argv.len());
        for a in argv {
            self.os(a);
        }
        self.count(env.len());
        for (k, v) in env {
            self.os(k);
            self.os(v);
        }
        match cwd {
            None => self.u8(0),
            Some(p) => {
                self.u8(1);
                self.os(p.as_os_str());
            }
        }
    }
    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            None => self.u8(0),
            Some(s) => {
                self.u8(1);
                self.str(s);
            }
        }
    }
    fn exit(&mut self, st: &ExitStatus) {
        match *st {
            ExitStatus::Exited(c) => {
                self.u8(0);
                self.i32(c);
                self.bool(false);
            }
            ExitStatus::Signaled {
                signal,
                core_dumped,
            } => {
                self.u8(1);
                self.i32(signal);
                self.bool(core_dumped);
            }
        }
    }
    fn proc_info(&mut self, p: &ProcInfo) {
        self.u32(p.pid);
        self.opt_str(p.tag.as_deref());
        self.bytes(&p.meta);
        self.argv_env_cwd(&p.argv, &p.env, p.cwd.as_deref());
        self.bool(p.tty);
        self.bool(p.stdin);
        match &p.exit {
            None => self.u8(0),
            Some(st) => {
                self.u8(1);
                self.exit(st);
            }
        }
    }
    fn opt_u32(&mut self, v: Option<u32>) {
        match v {
            None => self.u8(0),
            Some(v) => {
                self.u8(1);
                self.u32(v);
            }
        }
    }
    fn stat(&mut self, s: &FileStat) {
        self.u8(s.kind.code());
        self.u32(s.mode);
        self.u64(s.size);
        self.u32(s.uid);
        self.u32(s.gid);
        self.i64(s.mtime_ns);
    }
    fn count(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    fn xattr_list(&mut self, l: &[(String, Vec<u8>)]) {
        self.count(l.len());
        for (name, value) in l {
            self.str(name);
            self.bytes(value);
        }
    }
    fn finish(mut self) -> Result<Vec<u8>, Error> {
        let len = self.buf.len() - 4;
        if len > MAX_FRAME_LEN as usize {
            return Err(Error::FrameTooLarge {
                len: len as u64,
                max: MAX_FRAME_LEN,
            });
        }
        self.buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
        Ok(self.buf)
    }
}

/// Encodes a host -> agent frame (length prefix included). Fails only if it would exceed
/// [`MAX_FRAME_LEN`].
pub fn encode_host(id: u32, msg: &HostMsg) -> Result<Vec<u8>, Error> {
    let e = match msg {
        HostMsg::Hello {
            min_version,
            max_version,
            client,
        } => {
            let mut e = Enc::new(tag::HELLO, id);
            e.u16(*min_version);
            e.u16(*max_version);
            e.str(client);
            e
        }
        HostMsg::Ping => Enc::new(tag::PING, id),
        HostMsg::Exec(spec) => {
            let mut e = Enc::new(tag::EXEC, id);
            e.spec(spec);
            e
        }
        HostMsg::Spawn {
            spec,
            tag: name,
            meta,
        } => {
            let mut e = Enc::new(tag::SPAWN, id);
            e.spec(spec);
            e.opt_str(name.as_deref());
            e.bytes(meta);
            e
        }
        HostMsg::Attach { pid, output } => {
            let mut e = Enc::new(tag::ATTACH, id);
            e.u32(*pid);
            e.bool(*output);
            e
        }
        HostMsg::ListProcs => Enc::new(tag::LIST_PROCS, id),
        HostMsg::Stdin(data) => {
            let mut e = Enc::new(tag::STDIN, id);
            e.bytes(data);
            e
        }
        HostMsg::StdinClose => Enc::new(tag::STDIN_CLOSE, id),
        HostMsg::Signal {
            target,
            signal,
            group,
        } => {
            let mut e = Enc::new(tag::SIGNAL, id);
            e.u32(*target);
            e.i32(*signal);
            e.bool(*group);
            e
        }
        HostMsg::Resize { target, size } => {
            let mut e = Enc::new(tag::RESIZE, id);
            e.u32(*target);
            e.u16(size.rows);
            e.u16(size.cols);
            e
        }
        HostMsg::ReadFile { path } => {
            let mut e = Enc::new(tag::READ_FILE, id);
            e.os(path.as_os_str());
            e
        }
        HostMsg::WriteFile { path, mode } => {
            let mut e = Enc::new(tag::WRITE_FILE, id);
            e.os(path.as_os_str());
            e.u32(*mode);
            e
        }
        HostMsg::FileData(data) => {
            let mut e = Enc::new(tag::FILE_DATA_UP, id);
            e.bytes(data);
            e
        }
        HostMsg::FileEnd => Enc::new(tag::FILE_END, id),
        HostMsg::Stat {
            path,
            follow_symlinks,
        } => {
            let mut e = Enc::new(tag::STAT, id);
            e.os(path.as_os_str());
            e.bool(*follow_symlinks);
            e
        }
        HostMsg::List { path } => {
            let mut e = Enc::new(tag::LIST, id);
            e.os(path.as_os_str());
            e
        }
        HostMsg::Remove { path, recursive } => {
            let mut e = Enc::new(tag::REMOVE, id);
            e.os(path.as_os_str());
            e.bool(*recursive);
            e
        }
        HostMsg::SetClock { unix_ns } => {
            let mut e = Enc::new(tag::SET_CLOCK, id);
            e.i64(*unix_ns);
            e
        }
        HostMsg::AddEntropy(data) => {
            let mut e = Enc::new(tag::ADD_ENTROPY, id);
            e.bytes(data);
            e
        }
        HostMsg::Sync => Enc::new(tag::SYNC, id),
        HostMsg::PowerOff => Enc::new(tag::POWER_OFF, id),
        HostMsg::MakeDir {
            path,
            mode,
            parents,
        } => {
            let mut e = Enc::new(tag::MAKE_DIR, id);
            e.os(path.as_os_str());
            e.u32(*mode);
            e.bool(*parents);
            e
        }
        HostMsg::Rename { from, to } => {
            let mut e = Enc::new(tag::RENAME, id);
            e.os(from.as_os_str());
            e.os(to.as_os_str());
            e
        }
        HostMsg::ReadLink { path } => {
            let mut e = Enc::new(tag::READ_LINK, id);
            e.os(path.as_os_str());
            e
        }
        HostMsg::GetXattrs { paths, prefix } => {
            let mut e = Enc::new(tag::GET_XATTRS, id);
            e.count(paths.len());
            for p in paths {
                e.os(p.as_os_str());
            }
            e.str(prefix);
            e
        }
        HostMsg::SetXattrs { path, prefix, set } => {
            let mut e = Enc::new(tag::SET_XATTRS, id);
            e.os(path.as_os_str());
            e.str(prefix);
            e.xattr_list(set);
            e
        }
        HostMsg::AsUser { uid, gid, groups } => {
            let mut e = Enc::new(tag::AS_USER, id);
            e.u32(*uid);
            e.u32(*gid);
            e.u32(groups.len() as u32);
            for g in groups {
                e.u32(*g);
            }
            e
        }
        HostMsg::Watch { path, recursive } => {
            let mut e = Enc::new(tag::WATCH, id);
            e.os(path.as_os_str());
            e.bool(*recursive);
            e
        }
        HostMsg::Unwatch { target } => {
            let mut e = Enc::new(tag::UNWATCH, id);
            e.u32(*target);
            e
        }
    };
    e.finish()
}

/// Encodes an agent -> host frame (length prefix included). Fails only if it would exceed
/// [`MAX_FRAME_LEN`].
pub fn encode_agent(id: u32, msg: &AgentMsg) -> Result<Vec<u8>, Error> {
    let e = match msg {
        AgentMsg::HelloOk {
            version,
            agent_version,
            max_frame_len,
        } => {
            let mut e = Enc::new(tag::HELLO_OK, id);
            e.u16(*version);
            e.str(agent_version);
            e.u32(*max_frame_len);
            e
        }
        AgentMsg::Ok => Enc::new(tag::OK, id),
        AgentMsg::Error(err) => {
            let mut e = Enc::new(tag::ERROR, id);
            e.u16(err.kind.code());
            e.i32(err.errno);
            // Keep error frames small whatever the message (it may quote paths).
            let msg = truncate_utf8(&err.message, 4096);
            e.str(msg);
            e
        }
        AgentMsg::Pong {
            agent_version,
            protocol,
            uptime_ms,
            running_execs,
        } => {
            let mut e = Enc::new(tag::PONG, id);
            e.str(agent_version);
            e.u16(*protocol);
            e.u64(*uptime_ms);
            e.u32(*running_execs);
            e
        }
        AgentMsg::Started { pid } => {
            let mut e = Enc::new(tag::STARTED, id);
            e.u32(*pid);
            e
        }
        AgentMsg::Stdout(d) => {
            let mut e = Enc::new(tag::STDOUT, id);
            e.bytes(d);
            e
        }
        AgentMsg::Stderr(d) => {
            let mut e = Enc::new(tag::STDERR, id);
            e.bytes(d);
            e
        }
        AgentMsg::StdinAck(n) => {
            let mut e = Enc::new(tag::STDIN_ACK, id);
            e.u32(*n);
            e
        }
        AgentMsg::Exited(st) => {
            let mut e = Enc::new(tag::EXITED, id);
            e.exit(st);
            e
        }
        AgentMsg::ProcList(procs) => {
            let mut e = Enc::new(tag::PROC_LIST, id);
            e.count(procs.len());
            for p in procs {
                e.proc_info(p);
            }
            e
        }
        AgentMsg::FileData(d) => {
            let mut e = Enc::new(tag::FILE_DATA_DOWN, id);
            e.bytes(d);
            e
        }
        AgentMsg::FileDone { bytes } => {
            let mut e = Enc::new(tag::FILE_DONE, id);
            e.u64(*bytes);
            e
        }
        AgentMsg::Stat(s) => {
            let mut e = Enc::new(tag::STAT_REPLY, id);
            e.stat(s);
            e
        }
        AgentMsg::DirEntries(entries) => {
            let mut e = Enc::new(tag::DIR_ENTRIES, id);
            e.count(entries.len());
            for d in entries {
                e.os(&d.name);
                e.stat(&d.stat);
            }
            e
        }
        AgentMsg::WatchEvent { name, kind } => {
            let mut e = Enc::new(tag::WATCH_EVENT, id);
            e.os(name.as_os_str());
            e.u8(kind.code());
            e
        }
        AgentMsg::LinkTarget { target } => {
            let mut e = Enc::new(tag::LINK_TARGET, id);
            e.os(target.as_os_str());
            e
        }
        AgentMsg::Xattrs(lists) => {
            let mut e = Enc::new(tag::XATTRS, id);
            e.count(lists.len());
            for l in lists {
                e.xattr_list(l);
            }
            e
        }
    };
    e.finish()
}

/// Encoded size of a [`ProcInfo`] inside a ProcList frame (to batch listings).
pub fn proc_info_wire_len(p: &ProcInfo) -> usize {
    let os = |s: &std::ffi::OsStr| 4 + s.len();
    4 + 1
        + p.tag.as_ref().map_or(0, |t| 4 + t.len())
        + 4
        + p.meta.len()
        + 4
        + p.argv.iter().map(|a| os(a)).sum::<usize>()
        + 4
        + p.env.iter().map(|(k, v)| os(k) + os(v)).sum::<usize>()
        + 1
        + p.cwd.as_ref().map_or(0, |c| os(c.as_os_str()))
        + 2
        + 1
        + if p.exit.is_some() { 6 } else { 0 }
}

/// Encoded size of a [`DirEntry`] inside a DirEntries frame (to batch listings).
pub fn dir_entry_wire_len(d: &DirEntry) -> usize {
    4 + d.name.len() + 1 + 4 + 8 + 4 + 4 + 8
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

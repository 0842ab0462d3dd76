//! Decoding frames, whatever bytes arrive: every read is bounds-checked, every count is
//! checked against the bytes really there (and against its limit) before anything is
//! allocated, every enum and bool must hold a known value, and a frame must be used up
//! exactly. [`decode_frame`] never panics and allocates at most about the frame's size.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

use super::tag;
use super::{
    AgentMsg, DirEntry, ErrorKind, ExecSpec, ExitStatus, FileKind, FileStat, Frame, HostMsg, Msg,
    ProcInfo, RemoteError, WatchKind, WinSize, XattrList, MAX_FRAME_LEN, MAX_GROUPS, MAX_XATTRS,
    MAX_XATTR_PATHS,
};
use crate::Error;

type ArgvEnvCwd = (Vec<OsString>, Vec<(OsString, OsString)>, Option<PathBuf>);

/// Reads fields from a frame body; every read is bounds-checked.
struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], Error> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(Error::Truncated(what))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn arr<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], Error> {
        let s = self.take(N, what)?;
        let mut a = [0; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, Error> {
        Ok(self.arr::<1>(what)?[0])
    }
    fn bool(&mut self, what: &'static str) -> Result<bool, Error> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(Error::Invalid(what)),
        }
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, Error> {
        Ok(u16::from_le_bytes(self.arr(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn i32(&mut self, what: &'static str) -> Result<i32, Error> {
        Ok(i32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn i64(&mut self, what: &'static str) -> Result<i64, Error> {
        Ok(i64::from_le_bytes(self.arr(what)?))
    }
    fn bytes(&mut self, what: &'static str) -> Result<Vec<u8>, Error> {
        let n = self.u32(what)? as usize;
        Ok(self.take(n, what)?.to_vec())
    }
    fn os(&mut self, what: &'static str) -> Result<OsString, Error> {
        Ok(OsString::from_vec(self.bytes(what)?))
    }
    fn path(&mut self, what: &'static str) -> Result<PathBuf, Error> {
        Ok(PathBuf::from(self.os(what)?))
    }
    fn string(&mut self, what: &'static str) -> Result<String, Error> {
        String::from_utf8(self.bytes(what)?).map_err(|_| Error::Invalid(what))
    }
    fn option(&mut self, what: &'static str) -> Result<bool, Error> {
        self.bool(what)
    }
    fn opt_u32(&mut self, what: &'static str) -> Result<Option<u32>, Error> {
        Ok(if self.option(what)? {
            Some(self.u32(what)?)
        } else {
            None
        })
    }
    fn opt_string(&mut self, what: &'static str) -> Result<Option<String>, Error> {
        Ok(if self.option(what)? {
            Some(self.string(what)?)
        } else {
            None
        })
    }
    fn argv_env_cwd(&mut self) -> Result<ArgvEnvCwd, Error> {
        let n = self.count(4, "argv")?;
        let mut argv = Vec::with_capacity(n);
        for _ in 0..n {
            argv.push(self.os("argv")?);
        }
        let n = self.count(8, "env")?;
        let mut env = Vec::with_capacity(n);
        for _ in 0..n {
            env.push((self.os("env key")?, self.os("env value")?));
        }
        let cwd = if self.option("cwd")? {
            Some(self.path("cwd")?)
        } else {
            None
        };
        Ok((argv, env, cwd))
    }
    fn spec(&mut self) -> Result<ExecSpec, Error> {
        let (argv, env, cwd) = self.argv_env_cwd()?;
        let uid = self.opt_u32("uid")?;
        let gid = self.opt_u32("gid")?;
        let tty = if self.option("tty")? {
            Some(WinSize {
                rows: self.u16("rows")?,
                cols: self.u16("cols")?,
            })
        } else {
            None
        };
        let stdin = self.bool("stdin")?;
        Ok(ExecSpec {
            argv,
            env,
            cwd,
            uid,
            gid,
            tty,
            stdin,
        })
    }
    fn exit(&mut self) -> Result<ExitStatus, Error> {
        let kind = self.u8("exit kind")?;
        let value = self.i32("exit value")?;
        let core_dumped = self.bool("core_dumped")?;
        Ok(match kind {
            0 if !core_dumped => ExitStatus::Exited(value),
            1 => ExitStatus::Signaled {
                signal: value,
                core_dumped,
            },
            _ => return Err(Error::Invalid("exit kind")),
        })
    }
    fn proc_info(&mut self) -> Result<ProcInfo, Error> {
        let pid = self.u32("pid")?;
        let tag = self.opt_string("tag")?;
        let meta = self.bytes("meta")?;
        let (argv, env, cwd) = self.argv_env_cwd()?;
        let tty = self.bool("tty")?;
        let stdin = self.bool("stdin")?;
        let exit = if self.option("exit")? {
            Some(self.exit()?)
        } else {
            None
        };
        Ok(ProcInfo {
            pid,
            tag,
            meta,
            argv,
            env,
            cwd,
            tty,
            stdin,
            exit,
        })
    }
    /// A list count, checked against the bytes left (each item takes at least `min_item`
    /// bytes), so a lying count cannot make us allocate.
    fn xattr_list(&mut self) -> Result<XattrList, Error> {
        let n = self.count(8, "xattrs")?;
        if n > MAX_XATTRS {
            return Err(Error::Invalid("xattrs (more than MAX_XATTRS)"));
        }
        let mut l = Vec::with_capacity(n);
        for _ in 0..n {
            l.push((self.string("xattr name")?, self.bytes("xattr value")?));
        }
        Ok(l)
    }
    fn count(&mut self, min_item: usize, what: &'static str) -> Result<usize, Error> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_item) > self.remaining() {
            return Err(Error::Truncated(what));
        }
        Ok(n)
    }
    fn stat(&mut self) -> Result<FileStat, Error> {
        Ok(FileStat {
            kind: FileKind::from_code(self.u8("stat kind")?)?,
            mode: self.u32("stat mode")?,
            size: self.u64("stat size")?,
            uid: self.u32("stat uid")?,
            gid: self.u32("stat gid")?,
            mtime_ns: self.i64("stat mtime")?,
        })
    }
}

/// Decodes one complete frame: the 4-byte length prefix followed by exactly that many bytes.
///
/// Never panics, whatever `frame` holds; allocates at most about `frame.len()` bytes.
pub fn decode_frame(frame: &[u8]) -> Result<Frame, Error> {
    if frame.len() < 4 {
        return Err(Error::Truncated("length prefix"));
    }
    let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]);
    if len > MAX_FRAME_LEN {
        return Err(Error::FrameTooLarge {
            len: u64::from(len),
            max: MAX_FRAME_LEN,
        });
    }
    let body = &frame[4..];
    if body.len() != len as usize {
        return Err(Error::LengthMismatch {
            declared: len,
            actual: body.len(),
        });
    }
    decode_body(body)
}

/// The id of a frame body, if it is long enough to have one (for error replies to frames
/// that do not decode).
pub fn body_id(body: &[u8]) -> Option<u32> {
    body.get(1..5)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Decodes a frame body (what follows the length prefix).
pub fn decode_body(body: &[u8]) -> Result<Frame, Error> {
    let mut d = Dec { buf: body, pos: 0 };
    let t = d.u8("tag")?;
    let id = d.u32("id")?;
    let msg = if t < 0x80 {
        Msg::Host(decode_host(t, &mut d)?)
    } else {
        Msg::Agent(decode_agent(t, &mut d)?)
    };
    if d.remaining() != 0 {
        return Err(Error::TrailingBytes(d.remaining()));
    }
    Ok(Frame { id, msg })
}

fn decode_host(t: u8, d: &mut Dec<'_>) -> Result<HostMsg, Error> {
    Ok(match t {
        tag::HELLO => HostMsg::Hello {
            min_version: d.u16("min_version")?,
            max_version: d.u16("max_version")?,
            client: d.string("client")?,
        },
        tag::PING => HostMsg::Ping,
        tag::EXEC => HostMsg::Exec(d.spec()?),
        tag::SPAWN => HostMsg::Spawn {
            spec: d.spec()?,
            tag: d.opt_string("tag")?,
            meta: d.bytes("meta")?,
        },
        tag::ATTACH => HostMsg::Attach {
            pid: d.u32("pid")?,
            output: d.bool("output")?,
        },
        tag::LIST_PROCS => HostMsg::ListProcs,
        tag::STDIN => HostMsg::Stdin(d.bytes("data")?),
        tag::STDIN_CLOSE => HostMsg::StdinClose,
        tag::SIGNAL => HostMsg::Signal {
            target: d.u32("target")?,
            signal: d.i32("signal")?,
            group: d.bool("group")?,
        },
        tag::RESIZE => HostMsg::Resize {
            target: d.u32("target")?,
            size: WinSize {
                rows: d.u16("rows")?,
                cols: d.u16("cols")?,
            },
        },
        tag::READ_FILE => HostMsg::ReadFile {
            path: d.path("path")?,
        },
        tag::WRITE_FILE => HostMsg::WriteFile {
            path: d.path("path")?,
            mode: d.u32("mode")?,
        },
        tag::FILE_DATA_UP => HostMsg::FileData(d.bytes("data")?),
        tag::FILE_END => HostMsg::FileEnd,
        tag::STAT => HostMsg::Stat {
            path: d.path("path")?,
            follow_symlinks: d.bool("follow_symlinks")?,
        },
        tag::LIST => HostMsg::List {
            path: d.path("path")?,
        },
        tag::REMOVE => HostMsg::Remove {
            path: d.path("path")?,
            recursive: d.bool("recursive")?,
        },
        tag::SET_CLOCK => HostMsg::SetClock {
            unix_ns: d.i64("unix_ns")?,
        },
        tag::ADD_ENTROPY => HostMsg::AddEntropy(d.bytes("data")?),
        tag::SYNC => HostMsg::Sync,
        tag::POWER_OFF => HostMsg::PowerOff,
        tag::MAKE_DIR => HostMsg::MakeDir {
            path: d.path("path")?,
            mode: d.u32("mode")?,
            parents: d.bool("parents")?,
        },
        tag::RENAME => HostMsg::Rename {
            from: d.path("from")?,
            to: d.path("to")?,
        },
        tag::READ_LINK => HostMsg::ReadLink {
            path: d.path("path")?,
        },
        tag::GET_XATTRS => {
            let n = d.count(4, "paths")?;
            if n > MAX_XATTR_PATHS {
                return Err(Error::Invalid("paths (more than MAX_XATTR_PATHS)"));
            }
            let mut paths = Vec::with_capacity(n);
            for _ in 0..n {
                paths.push(d.path("path")?);
            }
            HostMsg::GetXattrs {
                paths,
                prefix: d.string("prefix")?,
            }
        }
        tag::SET_XATTRS => HostMsg::SetXattrs {
            path: d.path("path")?,
            prefix: d.string("prefix")?,
            set: d.xattr_list()?,
        },
        tag::AS_USER => {
            let uid = d.u32("uid")?;
            let gid = d.u32("gid")?;
            let n = d.count(4, "groups")?;
            if n > MAX_GROUPS {
                return Err(Error::Invalid("groups (more than MAX_GROUPS)"));
            }
            let mut groups = Vec::with_capacity(n);
            for _ in 0..n {
                groups.push(d.u32("group")?);
            }
            HostMsg::AsUser { uid, gid, groups }
        }
        tag::WATCH => HostMsg::Watch {
            path: d.path("path")?,
            recursive: d.bool("recursive")?,
        },
        tag::UNWATCH => HostMsg::Unwatch {
            target: d.u32("target")?,
        },
        other => return Err(Error::UnknownTag(other)),
    })
}

fn decode_agent(t: u8, d: &mut Dec<'_>) -> Result<AgentMsg, Error> {
    Ok(match t {
        tag::HELLO_OK => AgentMsg::HelloOk {
            version: d.u16("version")?,
            agent_version: d.string("agent_version")?,
            max_frame_len: d.u32("max_frame_len")?,
        },
        tag::OK => AgentMsg::Ok,
        tag::ERROR => AgentMsg::Error(RemoteError {
            kind: ErrorKind::from_code(d.u16("error kind")?),
            errno: d.i32("errno")?,
            message: d.string("error message")?,
        }),
        tag::PONG => AgentMsg::Pong {
            agent_version: d.string("agent_version")?,
            protocol: d.u16("protocol")?,
            uptime_ms: d.u64("uptime_ms")?,
            running_execs: d.u32("running_execs")?,
        },
        tag::STARTED => AgentMsg::Started { pid: d.u32("pid")? },
        tag::STDOUT => AgentMsg::Stdout(d.bytes("data")?),
        tag::STDERR => AgentMsg::Stderr(d.bytes("data")?),
        tag::STDIN_ACK => AgentMsg::StdinAck(d.u32("bytes")?),
        tag::EXITED => AgentMsg::Exited(d.exit()?),
        tag::PROC_LIST => {
            // pid, tag, meta, argv, env, cwd, tty, stdin, exit: at least 24 bytes each.
            let n = d.count(24, "procs")?;
            let mut procs = Vec::with_capacity(n);
            for _ in 0..n {
                procs.push(d.proc_info()?);
            }
            AgentMsg::ProcList(procs)
        }
        tag::FILE_DATA_DOWN => AgentMsg::FileData(d.bytes("data")?),
        tag::FILE_DONE => AgentMsg::FileDone {
            bytes: d.u64("bytes")?,
        },
        tag::STAT_REPLY => AgentMsg::Stat(d.stat()?),
        tag::DIR_ENTRIES => {
            let n = d.count(4 + 29, "entries")?;
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                entries.push(DirEntry {
                    name: d.os("name")?,
                    stat: d.stat()?,
                });
            }
            AgentMsg::DirEntries(entries)
        }
        tag::WATCH_EVENT => AgentMsg::WatchEvent {
            name: d.path("name")?,
            kind: WatchKind::from_code(d.u8("watch kind")?),
        },
        tag::LINK_TARGET => AgentMsg::LinkTarget {
            target: d.path("target")?,
        },
        tag::XATTRS => {
            let n = d.count(4, "xattr lists")?;
            if n > MAX_XATTR_PATHS {
                return Err(Error::Invalid("xattr lists (more than MAX_XATTR_PATHS)"));
            }
            let mut lists = Vec::with_capacity(n);
            for _ in 0..n {
                lists.push(d.xattr_list()?);
            }
            AgentMsg::Xattrs(lists)
        }
        other => return Err(Error::UnknownTag(other)),
    })
}

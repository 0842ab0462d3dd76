//! The guest's files through a [`Client`]: reading and writing them (streamed in chunks),
//! their metadata, directories, links, extended attributes, renames, and the credentials
//! file operations run with. Apart from `mod.rs` so that the connection's own operations
//! (processes, clock, power) stay short to read.

use std::io::{Read, Write};
use std::path::Path;

use guest_agent::proto::{AgentMsg, HostMsg, CHUNK_LEN};

use super::{check, recv, unexpected, Client, DirEntry, FileStat, MAX_LIST_ENTRIES, MAX_READ_FILE};
use crate::error::{Error, Result};

impl Client {
    /// Reads a whole file into memory (at most [`MAX_READ_FILE`] bytes).
    pub fn read_file(&self, path: impl AsRef<Path>) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.read_file_limited(path.as_ref(), &mut out, MAX_READ_FILE)?;
        Ok(out)
    }

    /// Streams a file into `w`; returns its size.
    pub fn read_file_to(&self, path: impl AsRef<Path>, w: &mut dyn Write) -> Result<u64> {
        self.read_file_limited(path.as_ref(), w, u64::MAX)
    }

    fn read_file_limited(&self, path: &Path, w: &mut dyn Write, limit: u64) -> Result<u64> {
        let (_reg, rx) = self.inner.start(
            &HostMsg::ReadFile {
                path: path.to_path_buf(),
            },
            None,
        )?;
        let mut total: u64 = 0;
        loop {
            match check(recv(&rx)?)? {
                AgentMsg::FileData(d) => {
                    total += d.len() as u64;
                    if total > limit {
                        return Err(Error::AgentProtocol(format!(
                            "{}: larger than {limit} bytes",
                            path.display()
                        )));
                    }
                    w.write_all(&d).map_err(|e| Error::Io {
                        context: "write downloaded file data",
                        source: e,
                    })?;
                }
                AgentMsg::FileDone { bytes } if bytes == total => return Ok(total),
                AgentMsg::FileDone { bytes } => {
                    return Err(Error::AgentProtocol(format!(
                        "{}: agent reports {bytes} bytes but sent {total}",
                        path.display()
                    )))
                }
                m => return Err(unexpected("read_file", &m)),
            }
        }
    }

    /// Creates or replaces `path` with `data`, permission bits `mode`.
    pub fn write_file(&self, path: impl AsRef<Path>, mode: u32, data: &[u8]) -> Result<u64> {
        let mut r = data;
        self.write_file_from(path, mode, &mut r)
    }

    /// Creates or replaces `path` with everything `r` yields (streamed in chunks).
    pub fn write_file_from(
        &self,
        path: impl AsRef<Path>,
        mode: u32,
        r: &mut dyn Read,
    ) -> Result<u64> {
        let (reg, rx) = self.inner.start(
            &HostMsg::WriteFile {
                path: path.as_ref().to_path_buf(),
                mode,
            },
            None,
        )?;
        match check(recv(&rx)?)? {
            AgentMsg::Ok => {}
            m => return Err(unexpected("write_file", &m)),
        }
        let mut buf = vec![0u8; CHUNK_LEN];
        let mut sent: u64 = 0;
        loop {
            // A write error in the guest arrives early: stop sending.
            if let Ok(m) = rx.try_recv() {
                let _ = self.inner.send(reg.id, &HostMsg::FileEnd);
                check(m)?;
                return Err(Error::AgentProtocol(
                    "unexpected reply during upload".into(),
                ));
            }
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Finish the upload so the agent frees it; report the local error.
                    let _ = self.inner.send(reg.id, &HostMsg::FileEnd);
                    return Err(Error::Io {
                        context: "read the data to upload",
                        source: e,
                    });
                }
            };
            self.inner
                .send(reg.id, &HostMsg::FileData(buf[..n].to_vec()))?;
            sent += n as u64;
        }
        self.inner.send(reg.id, &HostMsg::FileEnd)?;
        match check(recv(&rx)?)? {
            AgentMsg::FileDone { bytes } if bytes == sent => Ok(bytes),
            AgentMsg::FileDone { bytes } => Err(Error::AgentProtocol(format!(
                "agent wrote {bytes} bytes of {sent}"
            ))),
            m => Err(unexpected("write_file", &m)),
        }
    }

    /// Metadata of `path`, following symlinks.
    pub fn stat(&self, path: impl AsRef<Path>) -> Result<FileStat> {
        self.stat_impl(path.as_ref(), true)
    }

    /// Metadata of `path` itself (a symlink is reported as one).
    pub fn lstat(&self, path: impl AsRef<Path>) -> Result<FileStat> {
        self.stat_impl(path.as_ref(), false)
    }

    fn stat_impl(&self, path: &Path, follow_symlinks: bool) -> Result<FileStat> {
        match self.call(&HostMsg::Stat {
            path: path.to_path_buf(),
            follow_symlinks,
        })? {
            AgentMsg::Stat(s) => Ok(s),
            m => Err(unexpected("stat", &m)),
        }
    }

    /// Directory entries of `path`, sorted by name (symlinks not followed).
    pub fn list(&self, path: impl AsRef<Path>) -> Result<Vec<DirEntry>> {
        let (_reg, rx) = self.inner.start(
            &HostMsg::List {
                path: path.as_ref().to_path_buf(),
            },
            None,
        )?;
        let mut all = Vec::new();
        loop {
            match check(recv(&rx)?)? {
                AgentMsg::DirEntries(mut e) => {
                    if all.len() + e.len() > MAX_LIST_ENTRIES {
                        return Err(Error::AgentProtocol(format!(
                            "more than {MAX_LIST_ENTRIES} directory entries"
                        )));
                    }
                    all.append(&mut e);
                }
                AgentMsg::Ok => return Ok(all),
                m => return Err(unexpected("list", &m)),
            }
        }
    }

    /// Removes a file, symlink or empty directory; with `recursive`, a whole tree.
    pub fn remove(&self, path: impl AsRef<Path>, recursive: bool) -> Result<()> {
        self.call_ok(
            "remove",
            &HostMsg::Remove {
                path: path.as_ref().to_path_buf(),
                recursive,
            },
        )
    }

    /// Creates directory `path` with permission bits `mode`; with `parents`, its missing
    /// parents too, and an existing directory at `path` is not an error.
    pub fn make_dir(&self, path: impl AsRef<Path>, mode: u32, parents: bool) -> Result<()> {
        self.call_ok(
            "make_dir",
            &HostMsg::MakeDir {
                path: path.as_ref().to_path_buf(),
                mode,
                parents,
            },
        )
    }

    /// From now on, file operations on this connection run with `uid`'s filesystem
    /// credentials (`gid`, `groups`): the guest's kernel checks that user's permissions and
    /// what is created is theirs. The connection can then run no processes.
    pub fn as_user(&self, uid: u32, gid: u32, groups: &[u32]) -> Result<()> {
        self.call_ok(
            "as_user",
            &HostMsg::AsUser {
                uid,
                gid,
                groups: groups.to_vec(),
            },
        )
    }

    /// What the symbolic link `path` points to (readlink(2): as written in the link).
    pub fn read_link(&self, path: impl AsRef<Path>) -> Result<std::path::PathBuf> {
        match self.call(&HostMsg::ReadLink {
            path: path.as_ref().to_path_buf(),
        })? {
            AgentMsg::LinkTarget { target } => Ok(target),
            m => Err(unexpected("read_link", &m)),
        }
    }

    /// The extended attributes under `prefix` (a `user.` prefix) of each of `paths`, one
    /// list of (name, value) per path, in order (empty where none can be read). An agent
    /// older than the operation answers `Error(UnknownMessage)`.
    pub fn get_xattrs(
        &self,
        paths: &[std::path::PathBuf],
        prefix: &str,
    ) -> Result<Vec<guest_agent::proto::XattrList>> {
        match self.call(&HostMsg::GetXattrs {
            paths: paths.to_vec(),
            prefix: prefix.to_string(),
        })? {
            AgentMsg::Xattrs(lists) if lists.len() == paths.len() => Ok(lists),
            m => Err(unexpected("get_xattrs", &m)),
        }
    }

    /// Makes the extended attributes under `prefix` of `path` exactly `set` (full names).
    pub fn set_xattrs(
        &self,
        path: impl AsRef<Path>,
        prefix: &str,
        set: Vec<(String, Vec<u8>)>,
    ) -> Result<()> {
        self.call_ok(
            "set_xattrs",
            &HostMsg::SetXattrs {
                path: path.as_ref().to_path_buf(),
                prefix: prefix.to_string(),
                set,
            },
        )
    }

    /// Renames `from` to `to` (rename(2): same filesystem, replaces a file at `to`).
    pub fn rename(&self, from: impl AsRef<Path>, to: impl AsRef<Path>) -> Result<()> {
        self.call_ok(
            "rename",
            &HostMsg::Rename {
                from: from.as_ref().to_path_buf(),
                to: to.as_ref().to_path_buf(),
            },
        )
    }
}

//! File operations: read (streamed in chunks), write (streamed uploads), stat, list, remove,
//! make directory, rename.

use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::conn::Conn;
use crate::proto::{
    dir_entry_wire_len, AgentMsg, DirEntry, ErrorKind, FileKind, FileStat, RemoteError, XattrList,
    CHUNK_LEN, MAX_FRAME_LEN, MAX_XATTRS,
};

fn io_err(e: &io::Error, op: &str, path: &Path) -> RemoteError {
    RemoteError::from_io(e, format_args!("{op} {}", path.display()))
}

fn file_stat(m: &Metadata) -> FileStat {
    let ft = m.file_type();
    let kind = if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    FileStat {
        kind,
        mode: m.mode() & 0o7777,
        size: m.size(),
        uid: m.uid(),
        gid: m.gid(),
        mtime_ns: m
            .mtime()
            .saturating_mul(1_000_000_000)
            .saturating_add(m.mtime_nsec()),
    }
}

pub(crate) fn stat(path: &Path, follow: bool) -> Result<FileStat, RemoteError> {
    let m = if follow {
        fs::metadata(path)
    } else {
        fs::symlink_metadata(path)
    };
    m.map(|m| file_stat(&m))
        .map_err(|e| io_err(&e, "stat", path))
}

/// Streams `path` as FileData frames then FileDone, from a thread of its own so that a large
/// file does not hold up the connection. Open errors are answered right away.
pub(crate) fn start_read(conn: &Arc<Conn>, id: u32, path: PathBuf) {
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) => {
            conn.send_err(id, io_err(&e, "open", &path));
            return;
        }
    };
    match file.metadata() {
        Ok(m) if m.is_dir() => {
            conn.send_err(
                id,
                io_err(&io::Error::from_raw_os_error(libc::EISDIR), "read", &path),
            );
            return;
        }
        Ok(_) => {}
        Err(e) => {
            conn.send_err(id, io_err(&e, "stat", &path));
            return;
        }
    }
    let c = conn.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("read-{id}"))
        .stack_size(256 * 1024)
        .spawn(move || stream_file(&c, id, file, &path));
    if let Err(e) = spawned {
        conn.send_err(id, RemoteError::from_io(&e, "read thread"));
    }
}

fn stream_file(conn: &Conn, id: u32, mut file: File, path: &Path) {
    let mut buf = vec![0u8; CHUNK_LEN];
    let mut total: u64 = 0;
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                total += n as u64;
                if !conn.send(id, &AgentMsg::FileData(buf[..n].to_vec())) {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                conn.send_err(id, io_err(&e, "read", path));
                return;
            }
        }
    }
    conn.send(id, &AgentMsg::FileDone { bytes: total });
}

/// An upload in progress.
pub(crate) enum Upload {
    Writing {
        file: File,
        path: PathBuf,
        bytes: u64,
    },
    /// A write failed and was reported; data is dropped until FileEnd.
    Failed,
}

pub(crate) fn open_upload(path: &Path, mode: u32) -> Result<Upload, RemoteError> {
    if mode & !0o7777 != 0 {
        return Err(RemoteError::new(
            ErrorKind::InvalidArgument,
            format!("mode {mode:#o} has bits beyond 0o7777"),
        ));
    }
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(|e| io_err(&e, "open", path))?;
    // The exact mode, whatever the umask or the mode of a file that existed.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| io_err(&e, "chmod", path))?;
    Ok(Upload::Writing {
        file,
        path: path.to_path_buf(),
        bytes: 0,
    })
}

impl Upload {
    /// Appends a chunk; returns the error to report if this write failed.
    pub(crate) fn write(&mut self, data: &[u8]) -> Option<RemoteError> {
        let Upload::Writing { file, path, bytes } = self else {
            return None;
        };
        match file.write_all(data) {
            Ok(()) => {
                *bytes += data.len() as u64;
                None
            }
            Err(e) => {
                let err = io_err(&e, "write", path);
                *self = Upload::Failed;
                Some(err)
            }
        }
    }

    /// Closes the file; the final reply, if one is still owed.
    pub(crate) fn finish(self) -> Option<AgentMsg> {
        match self {
            Upload::Writing { file, path, bytes } => Some(match file.sync_data() {
                Ok(()) => AgentMsg::FileDone { bytes },
                Err(e) => AgentMsg::Error(io_err(&e, "write", &path)),
            }),
            Upload::Failed => None,
        }
    }
}

/// Lists a directory (entries sorted by name, not following symlinks) in DirEntries frames
/// that fit the frame limit, then Ok.
pub(crate) fn list(conn: &Conn, id: u32, path: &Path) {
    let rd = match fs::read_dir(path) {
        Ok(rd) => rd,
        Err(e) => {
            conn.send_err(id, io_err(&e, "list", path));
            return;
        }
    };
    let mut entries: Vec<DirEntry> = Vec::new();
    for ent in rd {
        let ent = match ent {
            Ok(e) => e,
            Err(e) => {
                conn.send_err(id, io_err(&e, "list", path));
                return;
            }
        };
        // An entry removed meanwhile is skipped.
        if let Ok(m) = fs::symlink_metadata(ent.path()) {
            entries.push(DirEntry {
                name: ent.file_name(),
                stat: file_stat(&m),
            });
        }
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let budget = MAX_FRAME_LEN as usize - 64;
    let mut batch = Vec::new();
    let mut size = 4;
    for e in entries {
        let n = dir_entry_wire_len(&e);
        if size + n > budget && !batch.is_empty() {
            if !conn.send(id, &AgentMsg::DirEntries(std::mem::take(&mut batch))) {
                return;
            }
            size = 4;
        }
        size += n;
        batch.push(e);
    }
    if !batch.is_empty() && !conn.send(id, &AgentMsg::DirEntries(batch)) {
        return;
    }
    conn.send(id, &AgentMsg::Ok);
}

pub(crate) fn remove(path: &Path, recursive: bool) -> Result<(), RemoteError> {
    let m = fs::symlink_metadata(path).map_err(|e| io_err(&e, "remove", path))?;
    let r = if m.is_dir() {
        if recursive {
            fs::remove_dir_all(path)
        } else {
            fs::remove_dir(path)
        }
    } else {
        fs::remove_file(path)
    };
    r.map_err(|e| io_err(&e, "remove", path))
}

pub(crate) fn make_dir(path: &Path, mode: u32, parents: bool) -> Result<(), RemoteError> {
    use std::os::unix::fs::DirBuilderExt;
    let mut b = fs::DirBuilder::new();
    if parents {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            b.recursive(true)
                .mode(0o755)
                .create(parent)
                .map_err(|e| io_err(&e, "mkdir", parent))?;
        }
        b.recursive(false);
    }
    match b.mode(0o7777 & mode).create(path) {
        Ok(()) => {}
        Err(e) if parents && e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => {
            return Ok(())
        }
        Err(e) => return Err(io_err(&e, "mkdir", path)),
    }
    // Exactly `mode`, whatever the umask.
    fs::set_permissions(path, fs::Permissions::from_mode(0o7777 & mode))
        .map_err(|e| io_err(&e, "chmod", path))
}

pub(crate) fn read_link(path: &Path) -> Result<std::path::PathBuf, RemoteError> {
    fs::read_link(path).map_err(|e| io_err(&e, "readlink", path))
}

/// Whether `prefix` names user attributes only (the agent touches no other namespace:
/// `security.`, `trusted.` and `system.` attributes are not the host's to set).
fn user_prefix(prefix: &str) -> Result<(), RemoteError> {
    if prefix.starts_with("user.") && !prefix.contains('\0') {
        Ok(())
    } else {
        Err(RemoteError::new(
            ErrorKind::InvalidArgument,
            format!("xattr prefix {prefix:?}: only user. attributes"),
        ))
    }
}

/// The extended attributes under `prefix` of `path` (following a symlink).
fn xattrs_of(path: &Path, prefix: &str) -> io::Result<XattrList> {
    let mut out = Vec::new();
    for name in xattr::list_deref(path)? {
        let Some(name) = name.to_str().filter(|n| n.starts_with(prefix)) else {
            continue;
        };
        if out.len() == MAX_XATTRS {
            break;
        }
        // Removed between the list and the read: not there.
        if let Some(value) = xattr::get_deref(path, name)? {
            out.push((name.to_string(), value));
        }
    }
    out.sort();
    Ok(out)
}

/// GetXattrs: the attributes under `prefix` of each path (empty where they cannot be
/// read: gone, or a filesystem without them).
pub(crate) fn get_xattrs(paths: &[PathBuf], prefix: &str) -> Result<Vec<XattrList>, RemoteError> {
    user_prefix(prefix)?;
    Ok(paths
        .iter()
        .map(|p| xattrs_of(p, prefix).unwrap_or_default())
        .collect())
}

/// SetXattrs: the attributes under `prefix` of `path` become exactly `set`.
pub(crate) fn set_xattrs(
    path: &Path,
    prefix: &str,
    set: &[(String, Vec<u8>)],
) -> Result<(), RemoteError> {
    user_prefix(prefix)?;
    if let Some((bad, _)) = set
        .iter()
        .find(|(n, _)| !n.starts_with(prefix) || n.len() == prefix.len())
    {
        return Err(RemoteError::new(
            ErrorKind::InvalidArgument,
            format!("xattr {bad:?} is not a name under {prefix:?}"),
        ));
    }
    let err = |e: io::Error| io_err(&e, "setting extended attributes of", path);
    for (name, _) in xattrs_of(path, prefix).map_err(err)? {
        if !set.iter().any(|(n, _)| *n == name) {
            xattr::remove_deref(path, &name).map_err(err)?;
        }
    }
    for (name, value) in set {
        xattr::set_deref(path, name, value).map_err(err)?;
    }
    Ok(())
}

pub(crate) fn rename(from: &Path, to: &Path) -> Result<(), RemoteError> {
    fs::rename(from, to).map_err(|e| io_err(&e, &format!("rename to {}:", to.display()), from))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xattrs_under_a_user_prefix_are_read_and_made_exact() {
        let dir = std::env::temp_dir().join(format!("agent-xattr-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let f = dir.join("f");
        fs::write(&f, b"x").unwrap();
        let p = "user.e2b.";
        let set = |l: &[(&str, &str)]| {
            set_xattrs(
                &f,
                p,
                &l.iter()
                    .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
                    .collect::<Vec<_>>(),
            )
        };
        if let Err(e) = set(&[("user.e2b.a", "1")]) {
            // A filesystem without user attributes (some tmpfs): nothing to test here.
            eprintln!("skipped: {}", e.message);
            return;
        }
        set(&[("user.e2b.b", "2"), ("user.e2b.c", "")]).unwrap();
        xattr::set(&f, "user.other", b"kept").unwrap();
        let got = get_xattrs(&[f.clone(), dir.join("gone")], p).unwrap();
        assert_eq!(
            got,
            vec![
                vec![
                    ("user.e2b.b".to_string(), b"2".to_vec()),
                    ("user.e2b.c".to_string(), vec![]),
                ],
                vec![],
            ],
            "exactly the set given; a missing path has none"
        );
        assert_eq!(
            xattr::get(&f, "user.other").unwrap().as_deref(),
            Some(&b"kept"[..])
        );
        set(&[]).unwrap();
        assert_eq!(
            get_xattrs(std::slice::from_ref(&f), p).unwrap(),
            vec![vec![]]
        );
        // Only user attributes, only names under the prefix.
        assert!(get_xattrs(std::slice::from_ref(&f), "security.").is_err());
        assert!(set_xattrs(&f, "trusted.", &[]).is_err());
        assert!(set_xattrs(&f, p, &[("user.other".into(), vec![])]).is_err());
        assert!(set_xattrs(&f, p, &[("user.e2b.".into(), vec![])]).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}

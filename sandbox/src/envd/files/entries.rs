//! `EntryInfo` as envd reports it: type, Go-style permission string, owner and group
//! names, modification time, a symlink's target, and the file's metadata
//! ([`super::metadata`]). Separate because Stat, ListDir, MakeDir, Move and the watch
//! events all answer with it.

use std::path::Path as FsPath;

use vmm::agent::{FileKind, FileStat};

use super::metadata::fill_metadata;
use super::missing;
use crate::envd::connect::RpcError;
use crate::envd::{pb, SandboxConn, User};

/// Go's `FileMode.String()` (`-rw-r--r--`, `drwxr-xr-x`, `Lrwxrwxrwx`), as envd reports
/// `permissions`.
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    });
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

pub(super) fn entry(
    sb: &SandboxConn,
    user: &User,
    path: &FsPath,
    st: &FileStat,
    target: Option<&FileStat>,
) -> pb::EntryInfo {
    let shown = target.unwrap_or(st);
    let ty = match shown.kind {
        FileKind::Dir => pb::FileType::Directory,
        FileKind::File => pb::FileType::File,
        FileKind::Symlink => pb::FileType::Symlink,
        _ => pb::FileType::Unspecified,
    };
    let (owner, group) = sb.names(st.uid, st.gid);
    pb::EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        r#type: ty as i32,
        path: path.to_string_lossy().into_owned(),
        size: shown.size.min(i64::MAX as u64) as i64,
        // The permission bits, as E2B reports them (a 0755 directory is 493); the type
        // is in `type` and `permissions`.
        mode: st.mode & 0o777,
        permissions: permissions(st.kind, st.mode),
        owner,
        group,
        modified_time: Some(pb::Timestamp {
            seconds: st.mtime_ns.div_euclid(1_000_000_000),
            nanos: st.mtime_ns.rem_euclid(1_000_000_000) as i32,
        }),
        symlink_target: link_target(sb, user, path, st),
        metadata: Default::default(),
        is_symlink: st.kind == FileKind::Symlink,
    }
}

/// A symlink's target for `EntryInfo` (as envd gives it: absolute; a relative target is
/// taken relative to the link's directory, lexically), `None` for anything else or a
/// link that cannot be read.
fn link_target(sb: &SandboxConn, user: &User, path: &FsPath, st: &FileStat) -> Option<String> {
    if st.kind != FileKind::Symlink {
        return None;
    }
    let t = sb.with_user(user, |c| c.read_link(path)).ok()?;
    let t = if t.is_absolute() {
        t
    } else {
        path.parent().unwrap_or(FsPath::new("/")).join(t)
    };
    Some(t.to_string_lossy().into_owned())
}

/// lstat, and for a symlink also the target's stat (if it resolves).
pub(super) fn stat_entry(
    sb: &SandboxConn,
    user: &User,
    path: &FsPath,
) -> Result<pb::EntryInfo, RpcError> {
    let st = sb
        .with_user(user, |c| c.lstat(path))
        .map_err(|e| missing(e, path))?;
    let target = if st.kind == FileKind::Symlink {
        sb.with_user(user, |c| c.stat(path)).ok()
    } else {
        None
    };
    let mut e = [entry(sb, user, path, &st, target.as_ref())];
    fill_metadata(sb, user, &mut e);
    let [e] = e;
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_like_go() {
        assert_eq!(permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::Symlink, 0o777), "Lrwxrwxrwx");
    }
}

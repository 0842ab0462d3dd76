//! Applying an image's layers, in order, into a directory.
//!
//! Each entry's path is made relative to the tree (a leading `/` or `./` dropped; `..`
//! anywhere refused) and resolved one component at a time without following symbolic
//! links: a parent that is a symlink is an error (that is how a layer would write outside
//! the tree, with `etc -> /etc` planted by a lower layer), a missing parent is made. The
//! entry then replaces whatever was at its path. Whiteouts (`.wh.NAME`) remove NAME from
//! the lower layers, an opaque marker (`.wh..wh..opq`) everything a lower layer put in its
//! directory; what this layer itself made stays. Hard links must name a file inside the
//! tree. Modes without their set-id bits and modification times are set on the host;
//! directories get their times last, since later entries change them.
//!
//! Nothing an image holds becomes a usable host object: the tree is a host directory a
//! local user might reach, and it is made by root. So device nodes and FIFOs are empty
//! placeholder files, set-uid/set-gid bits are not set, every file is owned by the
//! service's user, and no xattr is set (`security.capability` would make a file-capability
//! binary). What the host tree lacks is recorded instead, per inode (so hard links, later
//! layers replacing a path and whiteouts need no bookkeeping), and handed back as
//! [`Fixup`]s by path once the last layer is applied: the caller carries them into the
//! filesystem image it makes of the tree (see `rootfs.rs`), where the guest sees the
//! image's owners, modes, capabilities and device nodes as they were.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::source::Source;

/// Prefix of a whiteout file's name.
const WHITEOUT: &str = ".wh.";
/// Name of the opaque-directory marker.
const OPAQUE: &str = ".wh..wh..opq";
/// What an entry other than file data counts for against [`UnpackLimits::max_bytes`]
/// (an inode and a directory entry, about).
const ENTRY_COST: u64 = 512;

/// Bounds of an unpack.
#[derive(Debug, Clone, Copy)]
pub struct UnpackLimits {
    /// Largest tree, bytes (file data plus [`ENTRY_COST`] per entry): an image larger than
    /// the disk it is for is refused while unpacking, not when the disk fills.
    pub max_bytes: u64,
}

impl UnpackLimits {
    /// The default [`UnpackLimits::max_bytes`]: 32 GiB, far above real images (Debian's
    /// is about 120 MiB, CUDA ones a few GiB) and below what fills a host's state
    /// directory by surprise. A disk size asked for (`clade template build --disk-size`,
    /// `clade serve --build-disk-size`) replaces it with 7/8 of that size.
    pub const DEFAULT_MAX_BYTES: u64 = 32 << 30;
}

impl Default for UnpackLimits {
    fn default() -> Self {
        UnpackLimits {
            max_bytes: Self::DEFAULT_MAX_BYTES,
        }
    }
}

/// What an unpack did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnpackReport {
    /// Layers applied.
    pub layers: usize,
    /// Entries written (files, directories, links, devices).
    pub entries: u64,
    /// Whiteouts and opaque markers applied.
    pub whiteouts: u64,
    /// Bytes counted against the limit.
    pub bytes: u64,
    /// What the tree does not hold of its entries (by path, sorted), for the filesystem
    /// image made of it.
    pub fixups: Vec<(PathBuf, Fixup)>,
}

/// A special file an image holds that the host tree has as an empty placeholder file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    /// A character device, (major, minor).
    Char(u32, u32),
    /// A block device, (major, minor).
    Block(u32, u32),
    /// A FIFO.
    Fifo,
}

/// What the host tree does not hold of one of its entries: to be set in the filesystem
/// image made from it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fixup {
    /// Its mode (file type and permission bits, set-id bits included), when the host's
    /// differs (set-id bits, a [`Node`], the tree's root).
    pub mode: Option<u32>,
    /// Its owner (uid, gid), when not the service's own.
    pub owner: Option<(u32, u32)>,
    /// Its xattrs (name, value), none of which is set on the host.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// The special file it is; the host has an empty regular file.
    pub node: Option<Node>,
    /// Its modification time (for a [`Node`], made anew in the image).
    pub mtime: u64,
}

impl Fixup {
    fn is_empty(&self) -> bool {
        self.mode.is_none() && self.owner.is_none() && self.xattrs.is_empty() && self.node.is_none()
    }
}

/// Unpacks every layer of `src` into `dest`, which must not exist yet (it is created,
/// and removed again if anything fails: a failed unpack leaves nothing behind).
pub fn unpack(src: &Source, dest: &Path, limits: UnpackLimits) -> Result<UnpackReport> {
    unpack_counted(src, dest, limits, None)
}

/// [`unpack`], adding the bytes of the stored layers it reads to `read` as it goes.
pub(crate) fn unpack_counted(
    src: &Source,
    dest: &Path,
    limits: UnpackLimits,
    read: Option<Arc<AtomicU64>>,
) -> Result<UnpackReport> {
    fs::create_dir(dest).map_err(|e| Error::io("creating", dest, e))?;
    // Private until the caller makes a filesystem of it: a local user sees none of it.
    fs::set_permissions(dest, fs::Permissions::from_mode(0o700))
        .map_err(|e| Error::io("setting the mode of", dest, e))?;
    let r = unpack_into(src, dest, limits, read);
    if r.is_err() {
        if let Err(e) = fs::remove_dir_all(dest) {
            tracing::warn!(path = %dest.display(), error = %e, "removing a failed unpack");
        }
    }
    r
}

fn unpack_into(
    src: &Source,
    dest: &Path,
    limits: UnpackLimits,
    read: Option<Arc<AtomicU64>>,
) -> Result<UnpackReport> {
    let mut report = UnpackReport::default();
    // The root's mode when no layer gives it one (the host's is 0700).
    let root_ino = fs::symlink_metadata(dest)
        .map_err(|e| Error::io("reading", dest, e))?
        .ino();
    let mut fixups = HashMap::from([(
        root_ino,
        Fixup {
            mode: Some(0o755),
            ..Fixup::default()
        },
    )]);
    for i in 0..src.layers().len() {
        let (stream, digest) = src.layer_tar(i, read.clone())?;
        let mut layer = LayerApply {
            root: dest,
            digest: &digest,
            made: HashSet::new(),
            dir_times: Vec::new(),
            limits,
            report: &mut report,
            fixups: &mut fixups,
        };
        let mut archive = tar::Archive::new(crate::tarlimit::TarLimit::new(stream));
        let entries = archive
            .entries()
            .map_err(|e| Error::BadBlob(format!("layer {digest}: not a tar stream: {e}")))?;
        for entry in entries {
            let entry =
                entry.map_err(|e| Error::BadBlob(format!("layer {digest}: corrupt tar: {e}")))?;
            layer.entry(entry)?;
        }
        layer.finish_dirs();
        archive
            .into_inner()
            .into_inner()
            .finish()
            .map_err(|e| match e {
                Error::BadBlob(m) => Error::BadBlob(format!("layer {digest}: {m}")),
                e => e,
            })?;
        report.layers += 1;
        tracing::debug!(layer = %digest, "layer applied");
    }
    report.fixups = fixups_by_path(dest, fixups)?;
    Ok(report)
}

/// The fix-ups of the inodes still in the tree at `root`, each under the first path of
/// its inode (a hard link shares its inode's), sorted by path.
fn fixups_by_path(root: &Path, mut by_ino: HashMap<u64, Fixup>) -> Result<Vec<(PathBuf, Fixup)>> {
    let mut out = Vec::new();
    if by_ino.is_empty() {
        return Ok(out);
    }
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let full = root.join(&rel);
        let m = fs::symlink_metadata(&full).map_err(|e| Error::io("reading", &full, e))?;
        if let Some(mut f) = by_ino.remove(&m.ino()) {
            let kind = match f.node {
                Some(Node::Char(..)) => libc::S_IFCHR,
                Some(Node::Block(..)) => libc::S_IFBLK,
                Some(Node::Fifo) => libc::S_IFIFO,
                None => m.mode() & libc::S_IFMT,
            };
            f.mode = f.mode.map(|p| p | kind);
            out.push((rel.clone(), f));
        }
        if m.is_dir() {
            for e in fs::read_dir(&full).map_err(|e| Error::io("reading", &full, e))? {
                let e = e.map_err(|e| Error::io("reading", &full, e))?;
                stack.push(rel.join(e.file_name()));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

struct LayerApply<'a> {
    root: &'a Path,
    digest: &'a str,
    /// Paths (relative) this layer made: a whiteout or opaque marker in the same layer
    /// applies to the layers below only.
    made: HashSet<PathBuf>,
    /// Directories and their modification times, set when the layer is done.
    dir_times: Vec<(PathBuf, filetime::FileTime)>,
    limits: UnpackLimits,
    report: &'a mut UnpackReport,
    /// What the tree does not hold, by inode (of the image's whole unpack).
    fixups: &'a mut HashMap<u64, Fixup>,
}

impl LayerApply<'_> {
    fn bad(&self, path: &Path, reason: impl Into<String>) -> Error {
        Error::BadEntry {
            layer: self.digest.to_string(),
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }

    fn io(&self, path: &Path, what: &str, e: std::io::Error) -> Error {
        self.bad(path, format!("{what}: {e}"))
    }

    /// A new file at `full` (`rel` in the image), private to the service and never through
    /// a link: an entry's data, or the placeholder of a node made in the image only.
    fn create_file(&self, rel: &Path, full: &Path) -> Result<File> {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(full)
            .map_err(|e| self.io(rel, "creating", e))
    }

    fn count(&mut self, n: u64) -> Result<()> {
        self.report.bytes = self.report.bytes.saturating_add(n);
        if self.report.bytes > self.limits.max_bytes {
            return Err(Error::TooLarge {
                limit: self.limits.max_bytes,
                needed: self.report.bytes,
            });
        }
        Ok(())
    }

    /// The entry's path relative to the tree; `None` for the tree's root itself.
    fn relative(&self, raw: &[u8]) -> Result<Option<PathBuf>> {
        let p = Path::new(std::ffi::OsStr::from_bytes(raw));
        let mut out = PathBuf::new();
        for c in p.components() {
            match c {
                Component::Normal(n) => out.push(n),
                Component::RootDir | Component::CurDir => {}
                Component::ParentDir => return Err(self.bad(p, "a path with `..`")),
                Component::Prefix(_) => return Err(self.bad(p, "not a Unix path")),
            }
        }
        Ok((!out.as_os_str().is_empty()).then_some(out))
    }

    /// Resolves the parent directories of `rel` in the tree without following symlinks;
    /// creates missing ones when `create`. Returns the full path of `rel`, or None when a
    /// parent is missing and not created.
    fn resolve_parents(&mut self, rel: &Path, create: bool) -> Result<Option<PathBuf>> {
        let mut cur = self.root.to_path_buf();
        let mut cur_rel = PathBuf::new();
        let parents: Vec<_> = rel
            .parent()
            .into_iter()
            .flat_map(|p| p.components())
            .collect();
        for c in parents {
            cur.push(c);
            cur_rel.push(c);
            match fs::symlink_metadata(&cur) {
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(self.bad(
                        rel,
                        format!("its parent {} is a symbolic link", cur_rel.display()),
                    ))
                }
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(self.bad(
                        rel,
                        format!("its parent {} is not a directory", cur_rel.display()),
                    ))
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    if !create {
                        return Ok(None);
                    }
                    fs::create_dir(&cur).map_err(|e| self.io(rel, "making a parent", e))?;
                    // A new inode: nothing recorded of a removed one of the same number.
                    if let Ok(m) = fs::symlink_metadata(&cur) {
                        self.fixups.remove(&m.ino());
                    }
                    self.made.insert(cur_rel.clone());
                }
                Err(e) => return Err(self.io(rel, "looking up a parent", e)),
            }
        }
        Ok(Some(self.root.join(rel)))
    }

    /// Removes whatever is at `full` (a directory with its contents; a symlink itself).
    fn remove(&self, rel: &Path, full: &Path) -> Result<()> {
        match fs::symlink_metadata(full) {
            Ok(m) if m.is_dir() => {
                fs::remove_dir_all(full).map_err(|e| self.io(rel, "removing a directory", e))
            }
            Ok(_) => fs::remove_file(full).map_err(|e| self.io(rel, "removing", e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.io(rel, "looking up", e)),
        }
    }

    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<()> {
        let raw = entry.path_bytes().into_owned();
        let Some(rel) = self.relative(&raw)? else {
            // The tree's root: its owner and mode.
            let root = self.root.to_path_buf();
            return self.metadata(&mut entry, Path::new("."), &root, true);
        };
        let name = rel.file_name().map(|n| n.as_bytes()).unwrap_or_default();
        if name == OPAQUE.as_bytes() {
            return self.opaque(&rel);
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT.as_bytes()) {
            let target = rel.with_file_name(std::ffi::OsStr::from_bytes(hidden));
            return self.whiteout(&target);
        }
        let kind = entry.header().entry_type();
        let Some(full) = self.resolve_parents(&rel, true)? else {
            return Ok(());
        };
        self.count(ENTRY_COST)?;
        use tar::EntryType as T;
        match kind {
            T::Directory => {
                let is_dir = fs::symlink_metadata(&full).is_ok_and(|m| m.is_dir());
                if !is_dir {
                    self.remove(&rel, &full)?;
                    fs::create_dir(&full).map_err(|e| self.io(&rel, "making", e))?;
                }
            }
            T::Regular | T::Continuous => {
                self.count(entry.size())?;
                self.remove(&rel, &full)?;
                let mut f = self.create_file(&rel, &full)?;
                std::io::copy(&mut entry, &mut f).map_err(|e| {
                    Error::BadBlob(format!(
                        "layer {}: {}: reading its data: {e}",
                        self.digest,
                        rel.display()
                    ))
                })?;
            }
            T::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.bad(&rel, "a symbolic link without a target"))?
                    .into_owned();
                self.remove(&rel, &full)?;
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(&target), &full)
                    .map_err(|e| self.io(&rel, "making a symbolic link", e))?;
            }
            T::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.bad(&rel, "a hard link without a target"))?
                    .into_owned();
                let trel = self
                    .relative(&target)?
                    .ok_or_else(|| self.bad(&rel, "a hard link to the tree's root"))?;
                let tfull = self.resolve_parents(&trel, false)?.ok_or_else(|| {
                    self.bad(
                        &rel,
                        format!("hard link to {}: not in the tree", trel.display()),
                    )
                })?;
                match fs::symlink_metadata(&tfull) {
                    Ok(m) if m.is_dir() => return Err(self.bad(&rel, "a hard link to a directory")),
                    Ok(m) if self.fixups.get(&m.ino()).is_some_and(|f| f.node.is_some()) => {
                        return Err(self.bad(
                            &rel,
                            "a hard link to a device node or FIFO is not supported",
                        ))
                    }
                    Ok(_) => {}
                    Err(_) => {
                        return Err(self.bad(
                            &rel,
                            format!("hard link to {}: not in the tree", trel.display()),
                        ))
                    }
                }
                if tfull != full {
                    self.remove(&rel, &full)?;
                    fs::hard_link(&tfull, &full)
                        .map_err(|e| self.io(&rel, "making a hard link", e))?;
                }
                // A hard link shares its target's inode: no metadata of its own.
                self.made.insert(rel);
                self.report.entries += 1;
                return Ok(());
            }
            T::Char | T::Block | T::Fifo => {
                // An empty placeholder: the node itself is made in the image only.
                self.remove(&rel, &full)?;
                self.create_file(&rel, &full)?;
            }
            other => {
                return Err(self.bad(&rel, format!("entry type {other:?} is not supported")));
            }
        }
        let is_dir = kind == T::Directory;
        self.metadata(&mut entry, &rel, &full, is_dir)?;
        self.made.insert(rel);
        self.report.entries += 1;
        Ok(())
    }

    /// Mode and times of an entry just written; what the host must not have of it (its
    /// owner, set-id bits, xattrs, the special file it is) recorded as its [`Fixup`].
    fn metadata<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        rel: &Path,
        full: &Path,
        is_dir: bool,
    ) -> Result<()> {
        use tar::EntryType as T;
        let h = entry.header();
        let kind = h.entry_type();
        let symlink = kind == T::Symlink;
        let uid = h.uid().map_err(|e| self.io(rel, "its uid", e))?;
        let gid = h.gid().map_err(|e| self.io(rel, "its gid", e))?;
        let mode = h.mode().map_err(|e| self.io(rel, "its mode", e))? & 0o7777;
        let mtime = h.mtime().unwrap_or(0);
        let (uid, gid) = (
            u32::try_from(uid).map_err(|_| self.bad(rel, "uid out of range"))?,
            u32::try_from(gid).map_err(|_| self.bad(rel, "gid out of range"))?,
        );
        let node = match kind {
            T::Char | T::Block => {
                let dev = |n: std::io::Result<Option<u32>>, what: &str| {
                    n.map_err(|e| self.io(rel, what, e)).map(|n| n.unwrap_or(0))
                };
                let (major, minor) = (
                    dev(h.device_major(), "its device major")?,
                    dev(h.device_minor(), "its device minor")?,
                );
                Some(if kind == T::Char {
                    Node::Char(major, minor)
                } else {
                    Node::Block(major, minor)
                })
            }
            T::Fifo => Some(Node::Fifo),
            _ => None,
        };
        // The tree's root stays private on the host: its mode is the image's only.
        let root = full == self.root;
        let mut fixup = Fixup {
            mode: (root || node.is_some() || mode & 0o6000 != 0).then_some(mode),
            owner: ((uid, gid) != service_ids()).then_some((uid, gid)),
            xattrs: Vec::new(),
            node,
            mtime,
        };
        if !symlink && node.is_none() && !root {
            // Never a set-id bit on the host (the owner is the service's: root).
            fs::set_permissions(full, fs::Permissions::from_mode(mode & !0o6000))
                .map_err(|e| self.io(rel, "setting its mode", e))?;
        }
        if let Some(pax) = entry
            .pax_extensions()
            .map_err(|e| self.io(rel, "its PAX header", e))?
        {
            for ext in pax {
                let ext = ext.map_err(|e| self.io(rel, "its PAX header", e))?;
                if let Some(name) = ext.key_bytes().strip_prefix(b"SCHILY.xattr.") {
                    fixup
                        .xattrs
                        .push((name.to_vec(), ext.value_bytes().to_vec()));
                }
            }
        }
        // The entry's inode is new, or its own again (a directory entry over a
        // directory): what it had before is replaced.
        let ino = fs::symlink_metadata(full)
            .map_err(|e| self.io(rel, "looking up", e))?
            .ino();
        if fixup.is_empty() {
            self.fixups.remove(&ino);
        } else {
            self.fixups.insert(ino, fixup);
        }
        let t = filetime::FileTime::from_unix_time(mtime as i64, 0);
        if is_dir {
            self.dir_times.push((full.to_path_buf(), t));
        } else {
            filetime::set_symlink_file_times(full, t, t)
                .map_err(|e| self.io(rel, "setting its times", e))?;
        }
        Ok(())
    }

    /// `.wh.NAME`: NAME, as lower layers made it, goes.
    fn whiteout(&mut self, rel: &Path) -> Result<()> {
        self.report.whiteouts += 1;
        if self.made.contains(rel) {
            return Ok(());
        }
        if let Some(full) = self.resolve_parents(rel, false)? {
            self.remove(rel, &full)?;
        }
        Ok(())
    }

    /// `DIR/.wh..wh..opq`: what lower layers put in DIR goes.
    fn opaque(&mut self, marker: &Path) -> Result<()> {
        self.report.whiteouts += 1;
        let dir_rel = marker.parent().unwrap_or(Path::new("")).to_path_buf();
        let Some(full) = self.resolve_parents(marker, false)? else {
            return Ok(());
        };
        let dir = full.parent().unwrap_or(self.root).to_path_buf();
        let children = match fs::read_dir(&dir) {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(self.io(marker, "reading its directory", e)),
        };
        for child in children {
            let child = child.map_err(|e| self.io(marker, "reading its directory", e))?;
            let crel = dir_rel.join(child.file_name());
            if !self.made.contains(&crel) {
                self.remove(&crel, &child.path())?;
            }
        }
        Ok(())
    }

    /// Directory times, deepest first (setting a child's does not change its parent's).
    fn finish_dirs(&mut self) {
        self.dir_times
            .sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (p, t) in self.dir_times.drain(..) {
            if let Err(e) = filetime::set_symlink_file_times(&p, t, t) {
                tracing::warn!(path = %p.display(), error = %e, "setting a directory's times");
            }
        }
    }
}

/// The service's own uid and gid: what every file of the host tree is owned by (and what
/// `mkfs.ext4 -d` gives the image's files unless a fix-up says otherwise).
pub(crate) fn service_ids() -> (u32, u32) {
    (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    )
}

//! An image's root filesystem as a Clade disk: the layers unpacked into a tree, the tree
//! made into an ext4 filesystem (`mkfs.ext4 -d`, which keeps modes, hard links and
//! symlinks; ext4 because every guest kernel Clade boots mounts it, the stock Debian one
//! included), imported as a frozen base layer. The tree and the raw image are the build's
//! own scratch files, in a `0700` directory, and are removed when done, whatever happens.
//!
//! The host tree holds no device node, set-id bit, xattr or tenant-chosen owner (see
//! `unpack.rs`): those are written into the filesystem image itself after `mkfs.ext4`
//! made it, by one `debugfs -w -f SCRIPT` batch (e2fsprogs, which writes the image file,
//! never the host's filesystem). This e2fsprogs (1.47.0) cannot make a filesystem from a
//! tar stream (`mkfs.ext4 -d` takes a tarball from 1.47.1 on), which would have needed no
//! tree at all. A name the script cannot express (a newline in it) is refused, never
//! dropped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::source::Source;
use crate::unpack::{unpack_counted, Fixup, Node, UnpackLimits, UnpackReport};

/// How far [`build_disk`] is, for a progress bar: its step, and the bytes of the image's
/// stored layers read so far of all of them (the unpack's measure; the steps after it
/// have none).
#[derive(Debug, Default)]
pub struct ConvertProgress {
    step: AtomicU8,
    read: Arc<AtomicU64>,
    total: AtomicU64,
}

/// A step of [`build_disk`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvertStep {
    /// Applying the layers to a tree.
    Unpack,
    /// Making the tree an ext4 filesystem.
    Mkfs,
    /// Importing it as a disk layer.
    Import,
}

impl ConvertStep {
    /// Its name, as a progress bar shows it.
    pub fn name(self) -> &'static str {
        match self {
            ConvertStep::Unpack => "unpack",
            ConvertStep::Mkfs => "mkfs.ext4",
            ConvertStep::Import => "import",
        }
    }
}

impl ConvertProgress {
    /// (step, stored bytes read, of all layers' stored bytes); `None` until a conversion
    /// started.
    pub fn get(&self) -> Option<(ConvertStep, u64, u64)> {
        let step = match self.step.load(Ordering::Relaxed) {
            0 => return None,
            1 => ConvertStep::Unpack,
            2 => ConvertStep::Mkfs,
            _ => ConvertStep::Import,
        };
        let total = self.total.load(Ordering::Relaxed);
        Some((step, self.read.load(Ordering::Relaxed).min(total), total))
    }

    fn set(&self, step: ConvertStep) {
        self.step.store(step as u8 + 1, Ordering::Relaxed);
    }
}

/// Directories the guest agent moves its mounts into when it makes the disk its root
/// (`/dev`, `/proc`, `/sys`, `/tmp`, `/run`), made when an image lacks them.
const MOUNT_POINTS: [(&str, u32); 5] = [
    ("dev", 0o755),
    ("proc", 0o555),
    ("sys", 0o555),
    ("tmp", 0o1777),
    ("run", 0o755),
];

/// Room left free on the disk beyond what the image needs, when no size is asked for.
const DEFAULT_FREE: u64 = 256 << 20;

/// What [`build_disk`] made.
#[derive(Debug, Clone)]
pub struct RootfsDisk {
    /// The frozen base layer.
    pub base: PathBuf,
    /// Its virtual size, bytes.
    pub size: u64,
    /// The unpack.
    pub unpacked: UnpackReport,
    /// Time unpacking the layers, making the filesystem, importing it as a layer.
    pub times: [std::time::Duration; 3],
}

/// Unpacks `src` and makes its tree the ext4 filesystem of a new frozen base layer at
/// `base`, of `size` bytes (default: what the tree needs plus [`DEFAULT_FREE`]); an image
/// that does not fit in `size` is refused. `scratch` (created, then removed) holds the
/// tree and the raw image meanwhile.
pub fn build_disk(
    src: &Source,
    scratch: &Path,
    base: &Path,
    size: Option<u64>,
    progress: Option<&ConvertProgress>,
) -> Result<RootfsDisk> {
    if let Some(parent) = scratch.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io("creating", parent, e))?;
    }
    // Private: nothing of the tree is reachable by a local user while it is there.
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(scratch)
        .map_err(|e| Error::io("creating", scratch, e))?;
    let r = build_in(src, scratch, base, size, progress);
    if let Err(e) = std::fs::remove_dir_all(scratch) {
        tracing::warn!(path = %scratch.display(), error = %e, "removing the image build's scratch");
    }
    if r.is_err() {
        let _ = std::fs::remove_file(base);
    }
    r
}

/// An e2fsprogs tool: in /usr/sbin or /sbin where it is (root's PATH may lack them),
/// else PATH.
fn sbin(name: &str) -> PathBuf {
    ["/usr/sbin", "/sbin"]
        .into_iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// `s` as one argument of a debugfs command: in double quotes, a quote doubled (how
/// debugfs's parser reads a quoted string; nothing else is special in it). A newline (the
/// script's line end) or a carriage return cannot be written: refused.
fn quoted(s: &[u8]) -> Result<Vec<u8>> {
    if s.iter().any(|&b| b == b'\n' || b == b'\r' || b == 0) {
        return Err(Error::NotAnImage(format!(
            "{}: a name with a newline cannot be given its owner, mode, xattrs or device \
             node in the image",
            String::from_utf8_lossy(s).escape_debug()
        )));
    }
    let mut out = Vec::with_capacity(s.len() + 2);
    out.push(b'"');
    for &b in s {
        if b == b'"' {
            out.push(b'"');
        }
        out.push(b);
    }
    out.push(b'"');
    Ok(out)
}

/// The debugfs script setting `fixups` in the image; xattr values are written to files
/// in `dir` (debugfs reads binary values from a file).
fn fixup_script(fixups: &[(PathBuf, Fixup)], dir: &Path) -> Result<Vec<u8>> {
    use std::io::Write;
    use std::os::unix::ffi::OsStrExt;
    let mut s = Vec::new();
    let mut line = |parts: &[&[u8]]| {
        s.extend_from_slice(&parts.join(&b' '));
        s.push(b'\n');
    };
    for (i, (rel, f)) in fixups.iter().enumerate() {
        let abs = Path::new("/").join(rel);
        let path = quoted(abs.as_os_str().as_bytes())?;
        if let Some(node) = f.node {
            // `mknod` makes NAME in the current directory: in the placeholder's, once it
            // is gone.
            let parent = abs.parent().unwrap_or(Path::new("/"));
            let name = quoted(rel.file_name().unwrap_or_default().as_bytes())?;
            line(&[b"cd", &quoted(parent.as_os_str().as_bytes())?]);
            line(&[b"rm", &path]);
            let (kind, numbers) = match node {
                Node::Char(a, b) => ("c", format!("{a} {b}")),
                Node::Block(a, b) => ("b", format!("{a} {b}")),
                Node::Fifo => ("p", String::new()),
            };
            let mut cmd: Vec<&[u8]> = vec![b"mknod", &name, kind.as_bytes()];
            if !numbers.is_empty() {
                cmd.push(numbers.as_bytes());
            }
            line(&cmd);
            line(&[b"cd", b"/"]);
            line(&[b"sif", &path, b"mtime", format!("@{}", f.mtime).as_bytes()]);
        }
        if let Some(mode) = f.mode {
            line(&[b"sif", &path, b"mode", format!("0{mode:o}").as_bytes()]);
        }
        // A node is made root's: its owner is set even when it is the service's.
        let owner = f.owner.or(f.node.map(|_| crate::unpack::service_ids()));
        if let Some((uid, gid)) = owner {
            line(&[b"sif", &path, b"uid", uid.to_string().as_bytes()]);
            line(&[b"sif", &path, b"gid", gid.to_string().as_bytes()]);
        }
        for (j, (name, value)) in f.xattrs.iter().enumerate() {
            let vf = dir.join(format!("xattr-{i}-{j}"));
            std::fs::File::create(&vf)
                .and_then(|mut w| w.write_all(value))
                .map_err(|e| Error::io("writing", &vf, e))?;
            line(&[
                b"ea_set",
                b"-f",
                &quoted(vf.as_os_str().as_bytes())?,
                &path,
                &quoted(name)?,
            ]);
        }
    }
    Ok(s)
}

/// debugfs's version line (`debugfs 1.47.0 (5-Feb-2023)`), the one line it writes to
/// stderr when all went well.
fn is_banner(line: &str) -> bool {
    line.strip_prefix("debugfs ")
        .is_some_and(|v| v.starts_with(|c: char| c.is_ascii_digit()))
}

/// The e2fsprogs program `name`, to run with no environment but `PATH`: the service that
/// converts an image holds its secrets in its own (see `vmm::host::clean_child`).
fn tool(name: &str) -> Command {
    without_environment(sbin(name))
}

/// `program`, to start with no variable of this process's environment but `PATH`.
fn without_environment(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    cmd
}

/// Writes `fixups` into the ext4 image `raw` with one debugfs batch (its files in `dir`).
/// debugfs reports a failed command on stderr only (its status is 0): any line there but
/// its banner is an error.
fn apply_fixups(raw: &Path, fixups: &[(PathBuf, Fixup)], dir: &Path) -> Result<()> {
    if fixups.is_empty() {
        return Ok(());
    }
    let script = dir.join("fixups.debugfs");
    let body = fixup_script(fixups, dir)?;
    std::fs::write(&script, body).map_err(|e| Error::io("writing", &script, e))?;
    let out = tool("debugfs")
        .arg("-w")
        .arg("-f")
        .arg(&script)
        .arg(raw)
        .output()
        .map_err(|e| Error::io("running debugfs (e2fsprogs) for", raw, e))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let failed: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty() && !is_banner(l))
        .collect();
    if !out.status.success() || !failed.is_empty() {
        return Err(Error::NotAnImage(format!(
            "setting owners, modes, xattrs and device nodes in the image (debugfs): {}",
            failed.join("; ")
        )));
    }
    tracing::debug!(entries = fixups.len(), "fix-ups written into the image");
    Ok(())
}

fn build_in(
    src: &Source,
    scratch: &Path,
    base: &Path,
    size: Option<u64>,
    progress: Option<&ConvertProgress>,
) -> Result<RootfsDisk> {
    let tree = scratch.join("tree");
    // ext4 needs room for its own metadata (inode tables, journal): an image is allowed
    // 7/8 of the disk asked for.
    let limit = size.map_or(UnpackLimits::DEFAULT_MAX_BYTES, |s| s / 8 * 7);
    let t = std::time::Instant::now();
    if let Some(p) = progress {
        p.set(ConvertStep::Unpack);
        p.total
            .store(src.layers().iter().map(|l| l.size).sum(), Ordering::Relaxed);
    }
    let unpacked = unpack_counted(
        src,
        &tree,
        UnpackLimits { max_bytes: limit },
        progress.map(|p| p.read.clone()),
    )?;
    if let Some(p) = progress {
        // What was read is all there is (a layer of unknown stored size counts so).
        let read = p.read.load(Ordering::Relaxed);
        p.total.fetch_max(read, Ordering::Relaxed);
        p.set(ConvertStep::Mkfs);
    }
    let t_unpack = t.elapsed();
    for (dir, mode) in MOUNT_POINTS {
        let p = tree.join(dir);
        if std::fs::symlink_metadata(&p).is_err() {
            std::fs::create_dir(&p).map_err(|e| Error::io("creating", &p, e))?;
            let perm: std::fs::Permissions = std::os::unix::fs::PermissionsExt::from_mode(mode);
            std::fs::set_permissions(&p, perm)
                .map_err(|e| Error::io("setting the mode of", &p, e))?;
        }
    }
    let size = size.unwrap_or_else(|| {
        let need = unpacked.bytes + unpacked.bytes / 4 + DEFAULT_FREE;
        need.div_ceil(1 << 20) << 20
    });
    let raw = scratch.join("rootfs.ext4");
    let f = std::fs::File::create(&raw).map_err(|e| Error::io("creating", &raw, e))?;
    f.set_len(size).map_err(|e| Error::io("sizing", &raw, e))?;
    drop(f);
    let t = std::time::Instant::now();
    let out = tool("mkfs.ext4")
        .args(["-q", "-F", "-L", "clade-root", "-b", "4096", "-m", "0"])
        .args([
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0",
        ])
        .args(["-O", "^resize_inode", "-d"])
        .arg(&tree)
        .arg(&raw)
        .output()
        .map_err(|e| Error::io("running mkfs.ext4 (e2fsprogs) for", &raw, e))?;
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr);
        let full = msg.contains("Could not allocate") || msg.contains("No space left");
        return Err(if full {
            Error::TooLarge {
                limit: size,
                needed: unpacked.bytes,
            }
        } else {
            Error::NotAnImage(format!("mkfs.ext4 failed: {}", msg.trim()))
        });
    }
    apply_fixups(&raw, &unpacked.fixups, scratch)?;
    let t_mkfs = t.elapsed();
    if let Some(p) = progress {
        p.set(ConvertStep::Import);
    }
    let t = std::time::Instant::now();
    disk::ops::import_raw(&raw, base, None)
        .map_err(|e| Error::NotAnImage(format!("importing the root filesystem: {e}")))?;
    Ok(RootfsDisk {
        base: base.to_path_buf(),
        size,
        unpacked,
        times: [t_unpack, t_mkfs, t.elapsed()],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_e2fsprogs_tools_get_no_variable_but_path() {
        // cargo gives the tests variables of their own (CARGO_*), as the service has its
        // secrets.
        assert!(std::env::vars().any(|(k, _)| k.starts_with("CARGO")));
        let out = without_environment("/usr/bin/env").output().unwrap();
        assert!(out.status.success());
        let names: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.split('=').next().unwrap_or_default().to_string())
            .collect();
        assert_eq!(names, ["PATH"]);
        assert!(tool("debugfs").get_envs().all(|(k, _)| k == "PATH"));
    }
}

//! An image's root filesystem as a Clade disk: the layers unpacked into a tree, the tree
//! made into an ext4 filesystem (`mkfs.ext4 -d`, which keeps owners, modes, xattrs, hard
//! links and device nodes; ext4 because every guest kernel Clade boots mounts it, the
//! stock Debian one included), imported as a frozen base layer. The tree and the raw image
//! are the build's own scratch files and are removed when done, whatever happens.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::source::Source;
use crate::unpack::{unpack_counted, UnpackLimits, UnpackReport};

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
    std::fs::create_dir_all(scratch).map_err(|e| Error::io("creating", scratch, e))?;
    let r = build_in(src, scratch, base, size, progress);
    if let Err(e) = std::fs::remove_dir_all(scratch) {
        tracing::warn!(path = %scratch.display(), error = %e, "removing the image build's scratch");
    }
    if r.is_err() {
        let _ = std::fs::remove_file(base);
    }
    r
}

/// `mkfs.ext4`: in /usr/sbin or /sbin where it is (root's PATH may lack them), else PATH.
fn mkfs_ext4() -> &'static str {
    ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("mkfs.ext4")
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
    let out = Command::new(mkfs_ext4())
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

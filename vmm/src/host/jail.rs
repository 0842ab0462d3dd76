//! The jail ([`enter`]): a VM process confined the way a multi-tenant host needs it, so a
//! guest that escapes into the VMM finds itself with no privileges, no view of the host's
//! files or processes and bounded resources.
//!
//! `enter` is called by a process that runs as root and has not started any thread. It
//! checks everything first (paths, ids, devices, cgroup support), then builds the jail in
//! new mount, IPC, UTS and network namespaces: it mounts a small tmpfs on the jail
//! directory and builds the VM's view of the world there: each path the VM needs is
//! bind-mounted at the same absolute path (files the VM only reads read-only; the
//! directories it writes into read-write; all `nosuid,nodev`), device nodes for
//! `/dev/kvm`, `/dev/userfaultfd` and block devices holding disk layers owned by the VM's
//! user, `null`, `zero`, `random`, `urandom`, and a `/proc`. It pivots the mount namespace
//! into that root, detaches the host's tree and makes the root read-only. The VM process
//! drops to `uid`/`gid` (no supplementary groups, no capabilities, `no_new_privs`, umask
//! `077`) and gets [`Jailed::Inside`]: the caller goes on to build and run the VM exactly
//! as it would unjailed, with the same paths.
//!
//! How many processes that takes depends on the cgroup:
//!
//! - **No cgroup of the jail's own** (every jail of `clade serve`, whose VM processes are in
//!   the service's cgroups): **one process**. The caller builds the jail around itself and
//!   becomes the VM process; nothing stays beside it. It keeps the host's PID namespace,
//!   and its `/proc` is mounted `hidepid=invisible`: it sees only processes it may trace,
//!   which is itself (the fork children it starts are its user's but not dumpable; they
//!   outlive it as they do unjailed).
//!   Every VM has a user of its own, so no VM can see, signal or trace another, nor any
//!   process of the host. A parent-death signal it was started with is kept across the
//!   change of credentials (which clears it), and [`StarterLink::outlive_starter`] clears it.
//! - **Limits** (`--jail-memory-max` and the like: a cgroup of the jail's own, which must be
//!   removed once every process in it ended): **three processes**.
//!   1. *The caller* stays in the host's namespaces, as root: it waits for the jail,
//!      passes SIGINT, SIGTERM and SIGHUP on, removes the jail's cgroup at the end, and
//!      gets [`Jailed::Ended`] with the VM's exit code. If it is killed, the whole jail
//!      is. A failure while the jail was being set up comes back to it as an
//!      [`Error::Jail`] (through a close-on-exec socket pair).
//!   2. *The keeper*: PID 1 of a new PID namespace, in the cgroup, builds the jail (its
//!      `/proc` is the new namespace's), starts the VM process, then gives up root as the
//!      VM process does, reaps and passes signals on, and ends with the VM's exit code
//!      once every process of the jail has ended.
//!   3. *The VM process*, as above.
//!
//! The network namespace is empty: a VM's network is the TAP descriptor it was handed
//! before (`--net fd=N`), and the host's abstract Unix sockets are out of its reach. The
//! system-call filter is installed by the owner loop as usual ([`super::own`]), after the
//! jail.
//!
//! Written with the `nix` crate's wrappers of the namespace, mount and credential calls.

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{chdir, pivot_root, setgroups, sethostname, setresgid, setresuid, Gid, Uid};

use crate::error::{Error, Result};

mod keeper;

/// How a path is shown inside the jail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Bind-mounted read-only (a file or a directory).
    ReadOnly,
    /// A directory the VM creates and writes files in (sockets, snapshots, disk layers),
    /// bind-mounted read-write.
    ReadWrite,
}

pub use super::cgroup::CgroupLimits;
use super::cgroup::{Cgroup, Hierarchy};

/// What a jail is made of.
#[derive(Debug, Clone)]
pub struct JailConfig {
    /// The directory the jail's root is mounted on (absolute; created if missing; must be
    /// empty). Nothing is written into it on the host: the jail's tree is a tmpfs that
    /// lives only in the jail's mount namespace.
    pub root: PathBuf,
    /// The user the VM process runs as (not 0).
    pub uid: u32,
    /// Its group (not 0).
    pub gid: u32,
    /// The jail's host name (UTS namespace) and the base of its cgroup's name.
    pub name: String,
    /// cgroup limits.
    pub limits: CgroupLimits,
    /// The paths the VM needs, each shown at the same absolute path inside.
    pub paths: Vec<(PathBuf, Access)>,
    /// The KVM device node whose twin the jail gets at the same path.
    pub kvm_device: PathBuf,
}

/// Which process [`enter`] returned in.
#[derive(Debug)]
pub enum Jailed {
    /// The VM process, inside the jail with its privileges dropped: go on and run the VM.
    /// The link to the caller tells it when the VM must outlive whoever started it.
    Inside(StarterLink),
    /// The original process: the jail ended; the VM process's exit code (128 + signal if a
    /// signal ended it).
    Ended(u8),
}

/// The VM process's link to the caller, which stays in the host's namespaces: a caller
/// started with a parent-death signal (a standby of a service: it ends with the service
/// while unused) clears it when told the VM must outlive its starter.
#[derive(Debug)]
pub struct StarterLink(Link);

#[derive(Debug)]
enum Link {
    /// The VM process is the caller itself (a jail with no cgroup of its own).
    Own,
    /// The caller waits for the jail at the other end.
    Caller(UnixStream),
}

impl StarterLink {
    /// The VM now outlives whoever started the jail (a standby that was given a sandbox).
    pub fn outlive_starter(self) {
        match self.0 {
            Link::Own => {
                // SAFETY: PR_SET_PDEATHSIG with 0 only changes this process's attribute.
                if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0) } != 0 {
                    tracing::warn!(
                        "jail: clearing the parent-death signal: {}",
                        std::io::Error::last_os_error()
                    );
                }
            }
            Link::Caller(mut s) => {
                if let Err(e) = s.write_all(&[1]) {
                    tracing::warn!("jail: telling the starter the VM outlives it: {e}");
                }
            }
        }
    }
}

/// Size of the jail's own tmpfs: it holds only mount points and device nodes.
const TMPFS_OPTIONS: &str = "mode=0755,size=1m,nr_inodes=4096";

fn jail_err(msg: impl Into<String>) -> Error {
    Error::Jail(msg.into())
}

fn errno_err(what: impl std::fmt::Display, e: Errno) -> Error {
    Error::Jail(format!("{what}: {}", e.desc()))
}

/// Everything checked before any namespace, process or mount exists.
#[derive(Debug)]
struct Checked {
    paths: Vec<(PathBuf, Access)>,
    kvm_rdev: u64,
    uffd_rdev: Option<u64>,
    /// Where the jail's cgroup goes, when limits were asked for.
    hierarchy: Option<Hierarchy>,
}

fn check(config: &JailConfig) -> Result<Checked> {
    if !Uid::effective().is_root() {
        return Err(jail_err(
            "the jail needs root (it creates namespaces, mounts and device nodes, then drops \
             to --uid/--gid)",
        ));
    }
    if config.uid == 0 || config.gid == 0 {
        return Err(jail_err(
            "--uid and --gid must not be 0: the jail exists to drop root",
        ));
    }
    let root = &config.root;
    if !root.is_absolute() || root.parent().is_none() {
        return Err(jail_err(format!(
            "jail directory {}: must be an absolute path other than /",
            root.display()
        )));
    }
    if config.name.is_empty()
        || config.name.len() > 64
        || !config
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(jail_err(format!(
            "jail name {:?}: 1 to 64 letters, digits, '-' or '_'",
            config.name
        )));
    }
    match fs::symlink_metadata(root) {
        Ok(m) if m.is_dir() => {
            let mut entries = fs::read_dir(root)
                .map_err(|e| jail_err(format!("jail directory {}: {e}", root.display())))?;
            if entries.next().is_some() {
                return Err(jail_err(format!(
                    "jail directory {}: not empty",
                    root.display()
                )));
            }
        }
        Ok(_) => {
            return Err(jail_err(format!(
                "jail directory {}: not a directory",
                root.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(root)
            .map_err(|e| jail_err(format!("jail directory {}: {e}", root.display())))?,
        Err(e) => return Err(jail_err(format!("jail directory {}: {e}", root.display()))),
    }
    // Every path: absolute, normal components only, existing, of the right kind, not the
    // jail itself or above it.
    let mut paths = Vec::with_capacity(config.paths.len());
    for (p, access) in &config.paths {
        if !p.is_absolute()
            || p.components()
                .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
        {
            return Err(jail_err(format!(
                "{}: paths shown in the jail must be absolute, without '.' or '..'",
                p.display()
            )));
        }
        if p.parent().is_none() {
            return Err(jail_err("the host's / cannot be shown in the jail"));
        }
        if root.starts_with(p) || p.starts_with(root) {
            return Err(jail_err(format!(
                "{}: overlaps the jail directory {}",
                p.display(),
                root.display()
            )));
        }
        let m = fs::metadata(p).map_err(|e| jail_err(format!("{}: {e}", p.display())))?;
        if *access == Access::ReadWrite && !m.is_dir() {
            return Err(jail_err(format!(
                "{}: a read-write path in the jail must be a directory",
                p.display()
            )));
        }
        if !m.is_dir() && !m.is_file() && !m.file_type().is_block_device() {
            return Err(jail_err(format!(
                "{}: only files, block devices and directories can be shown in the jail",
                p.display()
            )));
        }
        paths.push((p.clone(), *access));
    }
    // The VM process starts this executable again for fork children (through
    // /proc/self/exe): a dynamically linked one needs its loader and libraries in the jail.
    for lib in own_libraries()? {
        paths.push((lib, Access::ReadOnly));
    }
    // Shallow first, so a path inside an already shown directory is seen to be there.
    // (Then by path, so that the same path given twice is adjacent and merged below.)
    paths.sort_by(|(a, _), (b, _)| (a.components().count(), a).cmp(&(b.components().count(), b)));
    paths.dedup_by(|a, b| {
        a.0 == b.0 && {
            // Keep the wider access.
            if a.1 == Access::ReadWrite {
                b.1 = Access::ReadWrite;
            }
            true
        }
    });
    let kvm = fs::metadata(&config.kvm_device)
        .map_err(|e| jail_err(format!("{}: {e}", config.kvm_device.display())))?;
    if !kvm.file_type().is_char_device() {
        return Err(jail_err(format!(
            "{}: not a character device",
            config.kvm_device.display()
        )));
    }
    let uffd_rdev = fs::metadata("/dev/userfaultfd")
        .ok()
        .filter(|m| m.file_type().is_char_device())
        .map(|m| m.rdev());
    let hierarchy = if config.limits.any() {
        Some(Hierarchy::detect(&config.limits)?)
    } else {
        None
    };
    // fork() below is only sound while this process has one thread.
    let threads = fs::read_dir("/proc/self/task")
        .map_err(|e| jail_err(format!("/proc/self/task: {e}")))?
        .count();
    if threads != 1 {
        return Err(jail_err(format!(
            "the jail must be entered before any thread starts ({threads} threads)"
        )));
    }
    Ok(Checked {
        paths,
        kvm_rdev: kvm.rdev(),
        uffd_rdev,
        hierarchy,
    })
}

/// The program interpreter (dynamic loader) named by this executable and the shared
/// libraries mapped into this process: what running this executable again needs (nothing
/// for a static build).
fn own_libraries() -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    // The program headers and the interpreter's name sit at the start of the file.
    let mut exe = Vec::new();
    fs::File::open("/proc/self/exe")
        .and_then(|f| f.take(64 << 10).read_to_end(&mut exe))
        .map_err(|e| jail_err(format!("/proc/self/exe: {e}")))?;
    if let Some(interp) = elf_interpreter(&exe) {
        libs.push(interp);
    }
    let maps = fs::read_to_string("/proc/self/maps")
        .map_err(|e| jail_err(format!("/proc/self/maps: {e}")))?;
    for line in maps.lines() {
        // address perms offset dev inode path
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        let name = path.rsplit('/').next().unwrap_or("");
        if path.starts_with('/') && (name.ends_with(".so") || name.contains(".so.")) {
            let p = PathBuf::from(path);
            if !libs.contains(&p) {
                libs.push(p);
            }
        }
    }
    Ok(libs)
}

/// PT_INTERP of an x86_64 ELF image, if it has one. (A few fixed offsets of the ELF64
/// header and program headers: no ELF crate is needed for that.)
fn elf_interpreter(image: &[u8]) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    const PT_INTERP: u32 = 3;
    let u16_at = |o: usize| Some(u16::from_le_bytes(image.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(image.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(image.get(o..o + 8)?.try_into().ok()?));
    // ELF magic, 64-bit, little-endian.
    if image.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    if phentsize < 56 {
        return None;
    }
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(ph)? != PT_INTERP {
            continue;
        }
        let off = usize::try_from(u64_at(ph + 8)?).ok()?;
        let len = usize::try_from(u64_at(ph + 32)?).ok()?;
        let bytes = image.get(off..off.checked_add(len)?)?;
        let bytes = bytes.split(|&b| b == 0).next()?;
        let path = PathBuf::from(std::ffi::OsStr::from_bytes(bytes));
        return path.is_absolute().then_some(path);
    }
    None
}

/// Sets up the jail described by `config` and returns in the VM process
/// ([`Jailed::Inside`]) and, once the jail ended, in the caller ([`Jailed::Ended`]). See
/// the module documentation.
pub fn enter(config: &JailConfig) -> Result<Jailed> {
    let checked = check(config)?;
    let cgroup = match &checked.hierarchy {
        Some(h) => Some(Cgroup::create(
            h,
            &format!("clade/jail-{}-{}", config.name, std::process::id()),
            &config.limits,
        )?),
        None => None,
    };
    // A VM started at idle priority (a standby waiting to be taken) puts each of its
    // threads back at normal priority as they take up work; leaving SCHED_IDLE without
    // privileges needs a nice limit that allows nice 0 (RLIMIT_NICE 20). Set here, while
    // root, for the jail's processes to inherit; never higher than normal priority. A
    // root without CAP_SYS_RESOURCE (some containers) cannot: then whoever started the
    // VM at idle priority lifts its threads (`clade serve` does, thread by thread).
    if let Err(e) = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NICE, 20, 20)
    {
        tracing::debug!("jail: RLIMIT_NICE left as it is: {e}");
    }
    let Some(cgroup) = cgroup else {
        return enter_in_place(config, &checked);
    };
    keeper::enter_with_keeper(config, &checked, cgroup)
}

/// [`enter`] for a jail with no cgroup of its own: the caller builds the jail around
/// itself and becomes the VM process. Nothing waits beside it: whoever started it sees its
/// exit directly, and signals reach it directly.
fn enter_in_place(config: &JailConfig, checked: &Checked) -> Result<Jailed> {
    let (signal, parent) = (parent_death_signal(), nix::unistd::getppid());
    build_root(config, checked, None, ProcView::OwnUser)?;
    drop_privileges(config)?;
    // Changing credentials cleared the parent-death signal: set it again, and see that the
    // starter did not end meanwhile (it would have sent none).
    if signal != 0 {
        // SAFETY: prctl(PR_SET_PDEATHSIG) takes no pointers.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal, 0, 0, 0) };
        if nix::unistd::getppid() != parent {
            return Err(jail_err("the jail's starter ended while it was set up"));
        }
    }
    Ok(Jailed::Inside(StarterLink(Link::Own)))
}

/// The parent-death signal this process was started with (0: none).
fn parent_death_signal() -> libc::c_int {
    let mut signal: libc::c_int = 0;
    // SAFETY: PR_GET_PDEATHSIG writes one int through the pointer, which points at a live
    // local.
    unsafe {
        libc::prctl(
            libc::PR_GET_PDEATHSIG,
            &mut signal as *mut libc::c_int as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    signal
}

/// Makes `path` (absolute) relative to the jail root `root`.
fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// What the jail's `/proc` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProcView {
    /// The jail's own PID namespace (the keeper's).
    Namespace,
    /// The host's PID namespace with every process the reader may not trace hidden
    /// (`hidepid=invisible`): every process of another user, and VM processes (not
    /// dumpable) but the reader itself.
    OwnUser,
}

/// The jail's mount work, in its new namespaces.
fn build_root(
    config: &JailConfig,
    checked: &Checked,
    cgroup: Option<&Cgroup>,
    proc_view: ProcView,
) -> Result<()> {
    if let Some(cg) = cgroup {
        // "0": the writing process itself; its children follow.
        for f in cg.procs_files() {
            fs::write(&f, "0")
                .map_err(|e| jail_err(format!("joining cgroup {}: {e}", f.display())))?;
        }
    }
    // A network namespace of its own too, with nothing in it but a loopback that is down:
    // no route anywhere, and none of the host's abstract Unix sockets (those live in the
    // network namespace) to connect to. A VM with a network device is handed its TAP as a
    // descriptor opened before (`--net fd=N`), which keeps working here; Unix sockets
    // bound or connected by path (the API, vsock and fetcher sockets) are not the network
    // namespace's business.
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWNET,
    )
    .map_err(|e| errno_err("new mount, IPC, UTS and network namespaces", e))?;
    sethostname(&config.name).map_err(|e| errno_err("setting the jail's host name", e))?;
    // Nothing mounted from here on propagates back to the host.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| errno_err("making mounts private", e))?;
    let root = &config.root;
    mount(
        Some("tmpfs"),
        root,
        Some("tmpfs"),
        MsFlags::MS_NOSUID,
        Some(TMPFS_OPTIONS),
    )
    .map_err(|e| errno_err(format!("tmpfs on {}", root.display()), e))?;

    let mut shown: Vec<&Path> = Vec::new();
    for (path, access) in &checked.paths {
        if shown.iter().any(|d| path.starts_with(d)) {
            // Already visible through a directory shown before it.
            continue;
        }
        let meta = fs::metadata(path).map_err(|e| jail_err(format!("{}: {e}", path.display())))?;
        if meta.file_type().is_block_device() {
            // A disk layer on a block device: the jail's own node, which the VM's user
            // may open (read-only unless asked otherwise).
            let mode = if *access == Access::ReadOnly {
                0o400
            } else {
                0o600
            };
            let owner = Some((config.uid, config.gid));
            make_node(root, path, SFlag::S_IFBLK, meta.rdev(), mode, owner)?;
            continue;
        }
        bind(root, path, *access)?;
        if fs::metadata(path).map(|m| m.is_dir()).unwrap_or(false) {
            shown.push(path);
        }
    }

    let dev = root.join("dev");
    mkdir_all(&dev)?;
    let owner = Some((config.uid, config.gid));
    make_node(
        root,
        &config.kvm_device,
        SFlag::S_IFCHR,
        checked.kvm_rdev,
        0o600,
        owner,
    )?;
    if let Some(rdev) = checked.uffd_rdev {
        make_node(
            root,
            Path::new("/dev/userfaultfd"),
            SFlag::S_IFCHR,
            rdev,
            0o600,
            owner,
        )?;
    }
    for (name, minor) in [("null", 3), ("zero", 5), ("random", 8), ("urandom", 9)] {
        let path = PathBuf::from("/dev").join(name);
        make_node(root, &path, SFlag::S_IFCHR, makedev(1, minor), 0o666, None)?;
    }
    let proc_dir = root.join("proc");
    mkdir_all(&proc_dir)?;
    mount(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        (proc_view == ProcView::OwnUser).then_some("hidepid=invisible"),
    )
    .map_err(|e| errno_err("mounting /proc in the jail", e))?;

    // Into the new root; the host's tree is stacked below it and then detached.
    chdir(root).map_err(|e| errno_err(format!("chdir {}", root.display()), e))?;
    match pivot_root(".", ".") {
        Ok(()) => {
            umount2(".", MntFlags::MNT_DETACH)
                .map_err(|e| errno_err("detaching the host's tree", e))?;
        }
        // The host's root is the initramfs (rootfs), which cannot be pivoted away from:
        // move the jail's root over / and chroot into it instead. The host's tree stays
        // below it; leaving a chroot needs CAP_SYS_CHROOT, which the VM process drops.
        Err(Errno::EINVAL) if host_root_is_rootfs() => {
            tracing::debug!("jail: the host's root is rootfs; moving the jail's root over it");
            mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
                .map_err(|e| errno_err("moving the jail's root over /", e))?;
            nix::unistd::chroot(".").map_err(|e| errno_err("chroot into the jail", e))?;
        }
        Err(e) => return Err(errno_err("pivot_root into the jail", e)),
    }
    chdir("/").map_err(|e| errno_err("chdir /", e))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
        None::<&str>,
    )
    .map_err(|e| errno_err("making the jail's root read-only", e))?;
    Ok(())
}

/// True if / is the initramfs's rootfs (an initramfs-only host).
fn host_root_is_rootfs() -> bool {
    fs::read_to_string("/proc/self/mountinfo")
        .map(|m| {
            m.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                // mount-id parent-id dev root mount-point ... - fstype source options
                let fstype = f.iter().position(|&x| x == "-").and_then(|i| f.get(i + 1));
                f.get(4) == Some(&"/") && matches!(fstype, Some(&"rootfs"))
            })
        })
        .unwrap_or(false)
}

fn mkdir_all(dir: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|e| jail_err(format!("{}: {e}", dir.display())))
}

/// Bind-mounts `path` at the same path under `root`.
fn bind(root: &Path, path: &Path, access: Access) -> Result<()> {
    let target = inside(root, path);
    let is_dir = fs::metadata(path)
        .map_err(|e| jail_err(format!("{}: {e}", path.display())))?
        .is_dir();
    if is_dir {
        mkdir_all(&target)?;
    } else {
        if let Some(parent) = target.parent() {
            mkdir_all(parent)?;
        }
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&target)
            .map_err(|e| jail_err(format!("{}: {e}", target.display())))?;
    }
    mount(
        Some(path),
        &target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| errno_err(format!("showing {} in the jail", path.display()), e))?;
    let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_NOSUID;
    if !path.starts_with("/dev") {
        flags |= MsFlags::MS_NODEV;
    }
    if access == Access::ReadOnly {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, &target, None::<&str>, flags, None::<&str>)
        .map_err(|e| errno_err(format!("restricting {} in the jail", path.display()), e))?;
    tracing::debug!("jail: {} shown {:?}", path.display(), access);
    Ok(())
}

/// Creates a device node at `path` (absolute, inside `root`).
fn make_node(
    root: &Path,
    path: &Path,
    kind: SFlag,
    rdev: u64,
    mode: u32,
    owner: Option<(u32, u32)>,
) -> Result<()> {
    let target = inside(root, path);
    if let Some(parent) = target.parent() {
        mkdir_all(parent)?;
    }
    mknod(&target, kind, Mode::from_bits_truncate(mode), rdev)
        .map_err(|e| errno_err(format!("device node {}", path.display()), e))?;
    // mknod applies the umask; set the mode exactly.
    nix::sys::stat::fchmodat(
        None,
        &target,
        Mode::from_bits_truncate(mode),
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )
    .map_err(|e| errno_err(format!("device node {}", path.display()), e))?;
    if let Some((uid, gid)) = owner {
        nix::unistd::chown(&target, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
            .map_err(|e| errno_err(format!("device node {}", path.display()), e))?;
    }
    Ok(())
}

/// The VM process gives up root for good.
fn drop_privileges(config: &JailConfig) -> Result<()> {
    let (uid, gid) = (Uid::from_raw(config.uid), Gid::from_raw(config.gid));
    setgroups(&[gid]).map_err(|e| errno_err("setgroups", e))?;
    setresgid(gid, gid, gid).map_err(|e| errno_err("setresgid", e))?;
    setresuid(uid, uid, uid).map_err(|e| errno_err("setresuid", e))?;
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1) takes no pointers.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(jail_err(format!(
            "no_new_privs: {}",
            std::io::Error::last_os_error()
        )));
    }
    // What the VM writes (disk overlays, snapshots, sockets) is its own: a host that runs
    // several jailed VMs side by side shares files between them only on purpose.
    nix::sys::stat::umask(Mode::from_bits_truncate(0o077));
    // Changing every uid away from 0 cleared the capability sets; check it did.
    let status = fs::read_to_string("/proc/self/status")
        .map_err(|e| jail_err(format!("/proc/self/status: {e}")))?;
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(str::trim);
    if cap_eff != Some("0000000000000000") {
        return Err(jail_err(format!(
            "capabilities left after dropping privileges: CapEff {cap_eff:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::keeper::starter_gone;
    use super::*;

    #[test]
    fn a_keeper_sees_its_starter_gone() {
        let (starter, keeper) = UnixStream::pair().unwrap();
        assert!(!starter_gone(&keeper), "the starter holds its end");
        drop(starter);
        assert!(starter_gone(&keeper), "the starter's end is closed");
    }

    fn config(root: &Path) -> JailConfig {
        JailConfig {
            root: root.to_path_buf(),
            uid: 1000,
            gid: 1000,
            name: "t".into(),
            limits: CgroupLimits::default(),
            paths: vec![],
            kvm_device: "/dev/kvm".into(),
        }
    }

    #[test]
    fn refuses_root_ids_relative_paths_and_overlaps() {
        let tmp = std::env::temp_dir().join(format!("clade-jail-unit-{}", std::process::id()));
        let mut c = config(&tmp);
        c.uid = 0;
        let e = check(&c).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("root") || e.contains("0"), "{e}");
        if !Uid::effective().is_root() {
            return; // every other check comes after the root check
        }
        let mut c = config(&tmp);
        c.paths = vec![(PathBuf::from("relative/x"), Access::ReadOnly)];
        assert!(check(&c).unwrap_err().to_string().contains("absolute"));
        c.paths = vec![(PathBuf::from("/a/../b"), Access::ReadOnly)];
        assert!(check(&c).unwrap_err().to_string().contains("'..'"));
        c.paths = vec![(tmp.clone(), Access::ReadWrite)];
        assert!(check(&c).unwrap_err().to_string().contains("overlaps"));
        c.paths = vec![(PathBuf::from("/"), Access::ReadOnly)];
        assert!(check(&c).unwrap_err().to_string().contains("/"));
        c.paths = vec![(PathBuf::from("/etc/hostname"), Access::ReadWrite)];
        assert!(check(&c).unwrap_err().to_string().contains("directory"));
        c.paths = vec![];
        c.name = "../x".into();
        assert!(check(&c).unwrap_err().to_string().contains("jail name"));
        let _ = fs::remove_dir(&tmp);
    }

    #[test]
    fn elf_interpreter_of_this_test_binary() {
        let exe = fs::read("/proc/self/exe").unwrap();
        // Test binaries are dynamically linked (static builds set crt-static explicitly).
        if let Some(interp) = elf_interpreter(&exe) {
            assert!(interp.exists(), "{}", interp.display());
        }
        assert_eq!(elf_interpreter(b"\x7fELF\x02\x01"), None);
        assert_eq!(elf_interpreter(b"garbage"), None);
        let mut bad = exe.clone();
        bad.truncate(0x40);
        let _ = elf_interpreter(&bad);
    }

    #[test]
    fn a_non_empty_jail_directory_is_refused() {
        if !Uid::effective().is_root() {
            return;
        }
        let tmp = std::env::temp_dir().join(format!("clade-jail-unit2-{}", std::process::id()));
        fs::create_dir_all(tmp.join("x")).unwrap();
        let e = check(&config(&tmp)).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
        fs::remove_dir_all(&tmp).unwrap();
    }
}

//! The jail of every VM process the service starts: standbys, direct starts and so every
//! sandbox's VMM run unprivileged, each as a user of its own, in namespaces of their own
//! (`clade restore --jail`, [`vmm::host::jail`]).
//!
//! **Users.** Each VM process gets a uid (and a gid of the same number) from a range
//! ([`JailConfig::first_uid`], [`JailConfig::uids`]) that no live process and no file of a
//! sandbox holds ([`Jails::allocate`]). A standby gets its uid when it starts, before any
//! sandbox is known; the request that takes it hands the sandbox's directory over to that
//! uid ([`hand_over`]: its files chowned, the directory `0711`), so the VM can write its
//! serial file, sockets, disk overlay and snapshots there and nobody else's VM can.
//!
//! **What another sandbox's VMM sees.** Every VM process shows the sandboxes' directory
//! (its files root) at its own path, read-write — a standby cannot know which sandbox it
//! will be — but everything a jailed VMM writes is private (its umask is `077`) and owned
//! by its uid, so another sandbox's overlay, memory and state files are refused with a
//! permission error. What sandboxes share is made readable on purpose by the service:
//! templates ([`share_tree`]) and the base snapshot of a fork with the frozen disk layers
//! under it ([`share_files`]), in directories that can be traversed but not listed.
//!
//! **Reuse.** A uid is given again only once no process runs as it and no sandbox's
//! directory (or fork directory) is owned by it: the paused sandbox whose files it still
//! owns keeps it. Uids given in the last minute are skipped too, for a standby still
//! starting (it runs as root until its jail is built).
//!
//! **Roots.** A jail's root is an empty directory `<state>/jail/<token>` that the jail
//! mounts its tmpfs on inside its own mount namespace; nothing is written into it on the
//! host. Those of processes that ended are removed when the service starts.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How the service's VM processes are jailed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailConfig {
    /// The first uid (and gid) given to VM processes.
    pub first_uid: u32,
    /// How many uids from `first_uid` may be given.
    pub uids: u32,
}

impl Default for JailConfig {
    fn default() -> Self {
        // Above the ranges `useradd` gives to users and subordinate ids (100000 + 65536
        // per user for the first few users).
        Self {
            first_uid: 2_000_000,
            uids: 65_536,
        }
    }
}

impl JailConfig {
    /// Checks the range: no uid 0, no overflow.
    pub fn check(&self) -> Result<()> {
        if self.first_uid == 0 || self.uids == 0 {
            return Err(Error::BadRequest(
                "the jail's uid range must start above 0 and hold at least one uid".into(),
            ));
        }
        if self
            .first_uid
            .checked_add(self.uids)
            .is_none_or(|end| end > u32::MAX - 1)
        {
            return Err(Error::BadRequest(format!(
                "the jail's uid range {}+{} goes past the largest uid",
                self.first_uid, self.uids
            )));
        }
        Ok(())
    }

    fn contains(&self, uid: u32) -> bool {
        uid >= self.first_uid && uid - self.first_uid < self.uids
    }
}

/// How long a uid given to a process stays taken even if no process shows it yet.
const RECENT: Duration = Duration::from_secs(60);

/// The jails of one service: its uid range, where jail roots go and which directories
/// every VM process may read.
#[derive(Debug)]
pub struct Jails {
    cfg: JailConfig,
    /// `<state>/jail`.
    roots: PathBuf,
    /// The sandboxes' directory (whose entries' owners hold uids).
    sandboxes: PathBuf,
    /// Shown read-only in every jail (the templates' directory).
    read: Vec<PathBuf>,
    given: Mutex<Given>,
}

#[derive(Debug, Default)]
struct Given {
    next: u32,
    recent: HashMap<u32, Instant>,
}

/// A VM process's jail: its root and its user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailLease {
    /// Its root directory (removed once the process ended).
    pub root: PathBuf,
    /// Its uid and gid.
    pub uid: u32,
}

impl Jails {
    /// The jails of a service whose state directory is `state_dir`, its sandboxes in
    /// `sandboxes` and every VM process reading `read`: sweeps the roots of processes that
    /// ended and makes `read` readable (see [`share_tree`]).
    pub fn new(
        state_dir: &Path,
        sandboxes: &Path,
        read: Vec<PathBuf>,
        cfg: JailConfig,
    ) -> Result<Jails> {
        cfg.check()?;
        if !nix::unistd::Uid::effective().is_root() {
            return Err(Error::BadRequest(
                "jailing sandboxes needs root (namespaces, mounts, changing users): run the \
                 service as root, or with --no-jail for development"
                    .into(),
            ));
        }
        let roots = state_dir.join("jail");
        std::fs::create_dir_all(&roots).map_err(Error::io("creating", &roots))?;
        set_mode(&roots, 0o700)?;
        std::fs::create_dir_all(sandboxes).map_err(Error::io("creating", sandboxes))?;
        // Every VM process traverses the sandboxes' directory and the forks'; none lists
        // them.
        let forks = sandboxes.join("forks");
        std::fs::create_dir_all(&forks).map_err(Error::io("creating", &forks))?;
        set_mode(sandboxes, 0o711)?;
        set_mode(&forks, 0o711)?;
        for dir in &read {
            std::fs::create_dir_all(dir).map_err(Error::io("creating", dir))?;
            share_tree(dir)?;
        }
        let jails = Jails {
            cfg,
            roots,
            sandboxes: sandboxes.to_path_buf(),
            read,
            given: Mutex::new(Given::default()),
        };
        for extra in jails.template_extras() {
            if extra.is_dir() {
                share_tree(&extra)?;
            }
        }
        jails.sweep();
        Ok(jails)
    }

    /// A uid of the range that no process runs as, no sandbox directory is owned by and
    /// that was not given in the last minute.
    pub fn allocate(&self) -> Result<u32> {
        let mut taken = process_uids();
        taken.extend(self.directory_owners());
        let mut g = self.given.lock().unwrap_or_else(|p| p.into_inner());
        g.recent.retain(|_, at| at.elapsed() < RECENT);
        for _ in 0..self.cfg.uids {
            let uid = self.cfg.first_uid + g.next % self.cfg.uids;
            g.next = g.next.wrapping_add(1) % self.cfg.uids;
            if !taken.contains(&uid) && !g.recent.contains_key(&uid) {
                g.recent.insert(uid, Instant::now());
                return Ok(uid);
            }
        }
        Err(Error::Vm(format!(
            "no free uid left for a jailed VM process in {}+{} (clade serve --jail-uids)",
            self.cfg.first_uid, self.cfg.uids
        )))
    }

    /// Jails the `clade restore` that `cmd` starts: a new uid, a root named `token`, and
    /// the directories every VM process reads.
    pub fn prepare(&self, cmd: &mut Command, token: &str) -> Result<JailLease> {
        let lease = self.prepare_alone(cmd, token)?;
        for dir in self.read.iter().chain(&self.template_extras()) {
            cmd.arg("--jail-read").arg(dir);
        }
        Ok(lease)
    }

    /// As [`Jails::prepare`], without the directories every sandbox's VM process reads: for
    /// a process that reads only what its own arguments name (a template build's VM).
    pub fn prepare_alone(&self, cmd: &mut Command, token: &str) -> Result<JailLease> {
        let uid = self.allocate()?;
        let root = self.roots.join(token);
        cmd.arg("--jail")
            .arg(&root)
            .arg("--uid")
            .arg(uid.to_string())
            .arg("--gid")
            .arg(uid.to_string());
        Ok(JailLease { root, uid })
    }

    /// What the templates in the read directories stand on outside them: the targets of
    /// templates that are symbolic links, and disk layers elsewhere (a base image, a block
    /// device). Looked up at each start: templates come and go while the service runs.
    fn template_extras(&self) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = Vec::new();
        let add = |p: PathBuf, out: &mut Vec<PathBuf>| {
            if !self.reads(&p) && !out.contains(&p) {
                out.push(p);
            }
        };
        for dir in &self.read {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let Ok(real) = std::fs::canonicalize(e.path()) else {
                    continue;
                };
                add(real.clone(), &mut out);
                for f in std::fs::read_dir(&real).into_iter().flatten().flatten() {
                    if f.path().extension().is_none_or(|x| x != "cdsk") {
                        continue;
                    }
                    for layer in disk::ops::info(&f.path()).into_iter().flatten() {
                        add(layer.path, &mut out);
                    }
                }
            }
        }
        out
    }

    /// Whether `path` is in a directory every VM process reads (a template's snapshot).
    pub fn reads(&self, path: &Path) -> bool {
        self.read.iter().any(|d| path.starts_with(d))
    }

    /// Owners (in the range) of the sandboxes' directories and fork directories.
    fn directory_owners(&self) -> HashSet<u32> {
        let mut owners = HashSet::new();
        let mut look = |dir: &Path| {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                if let Ok(m) = e.metadata() {
                    if self.cfg.contains(m.uid()) {
                        owners.insert(m.uid());
                    }
                }
            }
        };
        look(&self.sandboxes);
        look(&self.sandboxes.join("forks"));
        owners
    }

    /// Removes the roots of jails whose processes ended (no live process names the root on
    /// its command line).
    pub fn sweep(&self) {
        let live = live_command_lines();
        for e in std::fs::read_dir(&self.roots)
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = e.path();
            let named = path.as_os_str().as_encoded_bytes();
            if !live
                .iter()
                .any(|c| c.split(|b| *b == 0).any(|arg| arg == named))
            {
                // Only an empty directory goes: a root is never written into on the host.
                let _ = std::fs::remove_dir(&path);
            }
        }
    }
}

/// The VM process of the jail started as process `pid`: `pid` itself (a jail with no
/// cgroup of its own is one process, as every jail of the service is now), or, for a VM
/// started by an earlier version (the process that waited for its jail, whose only child
/// is the jail's keeper in a PID namespace of its own, whose only child is the VM), the
/// keeper's child, once both exist.
pub fn vm_process(pid: u32) -> Option<u32> {
    let only_child = |p: u32| -> Option<u32> {
        let list = std::fs::read_to_string(format!("/proc/{p}/task/{p}/children")).ok()?;
        let mut kids = list.split_whitespace();
        let kid = kids.next()?.parse().ok()?;
        kids.next().is_none().then_some(kid)
    };
    let in_own_pid_namespace = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .is_some_and(|v| v.split_whitespace().count() > 1)
        })
    };
    match only_child(pid) {
        Some(keeper) if in_own_pid_namespace(keeper) && !in_own_pid_namespace(pid) => {
            only_child(keeper)
        }
        _ => Some(pid),
    }
}

/// As [`vm_process`] when `pid` was started jailed (`--jail` on its command line; a VM
/// restored through the store's fetcher is not): None otherwise.
pub fn jailed_vm_process(pid: u32) -> Option<u32> {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    cmd.split(|b| *b == 0)
        .any(|a| a == b"--jail")
        .then(|| vm_process(pid))
        .flatten()
}

/// Hands the directory `dir` of a sandbox (and everything in it) over to `uid`: its VM
/// process writes there from now on. The directory becomes `0711`.
pub fn hand_over(dir: &Path, uid: u32) -> Result<()> {
    chown_tree(dir, uid)?;
    set_mode(dir, 0o711)
}

/// Takes back a directory handed over to a VM process that has ended: it and everything
/// in it owned by root again (links not followed), readable by every jailed VM process
/// (see [`share_tree`]). For what a template build's VM wrote: frozen layers and the
/// template's snapshot.
pub fn take_back(dir: &Path) -> Result<()> {
    chown_tree(dir, 0)?;
    share_real_tree(dir)
}

fn chown_tree(path: &Path, uid: u32) -> Result<()> {
    let id = Some(uid);
    std::os::unix::fs::lchown(path, id, id).map_err(Error::io("handing over", path))?;
    let m = std::fs::symlink_metadata(path).map_err(Error::io("reading", path))?;
    if m.is_dir() {
        for e in std::fs::read_dir(path).map_err(Error::io("reading", path))? {
            let e = e.map_err(Error::io("reading", path))?;
            chown_tree(&e.path(), uid)?;
        }
    }
    Ok(())
}

/// Makes a tree every jailed VM process may read: directories `0755`, files readable by
/// all (owners unchanged). For templates, whose snapshot files are written `0600`.
pub fn share_tree(path: &Path) -> Result<()> {
    // A template may be a symbolic link to its directory elsewhere.
    let real = std::fs::canonicalize(path).map_err(Error::io("reading", path))?;
    share_real_tree(&real)
}

fn share_real_tree(path: &Path) -> Result<()> {
    let m = std::fs::symlink_metadata(path).map_err(Error::io("reading", path))?;
    if m.is_dir() {
        set_mode(path, 0o755)?;
        for e in std::fs::read_dir(path).map_err(Error::io("reading", path))? {
            let e = e.map_err(Error::io("reading", path))?;
            // An image conversion's private scratch (in a build cache): a tree of an
            // image's files, modes as the image has them, nothing a VM reads.
            if e.file_name().as_encoded_bytes().starts_with(b".scratch-") {
                continue;
            }
            share_real_tree(&e.path())?;
        }
    } else if m.is_file() && m.mode() & 0o044 != 0o044 {
        set_mode(path, (m.mode() & 0o7777) | 0o444)?;
    }
    Ok(())
}

/// Makes each of `files` readable by every jailed VM process and each directory from
/// `top` down to it traversable (`0711`: not listable): what fork children read of their
/// parent (its fork's base snapshot and the frozen disk layers below it).
pub fn share_files(top: &Path, files: &[PathBuf]) -> Result<()> {
    for f in files {
        if !f.starts_with(top) {
            continue;
        }
        let m = std::fs::metadata(f).map_err(Error::io("reading", f))?;
        set_mode(f, (m.mode() & 0o7777) | 0o444)?;
        let mut dir = f.parent();
        while let Some(d) = dir.filter(|d| d.starts_with(top) && *d != top) {
            let m = std::fs::metadata(d).map_err(Error::io("reading", d))?;
            if m.mode() & 0o011 != 0o011 {
                set_mode(d, (m.mode() & 0o7777) | 0o111)?;
            }
            dir = d.parent();
        }
    }
    Ok(())
}

/// Largest working-set file taken from a jailed VM (4 bytes a page: 16 MiB for a guest
/// of 16 GiB).
const MAX_WORKING_SET_BYTES: u64 = 64 << 20;

/// Installs the working set a jailed VM recorded at `recorded` (in its sandbox's
/// directory: it may not write into `snapshot`, a template every sandbox reads) as the
/// working set of `snapshot`, readable by every jailed VM. The VM's file is not trusted:
/// it is opened without following a link, must be a regular file of a bounded size and
/// is parsed and checked against the snapshot (id, page count, each page in range and
/// once); what is written is a new file made from that parse. `Ok(None)`: nothing to do
/// (no recording, or the snapshot has a working set already).
pub fn adopt_working_set(recorded: &Path, snapshot: &Path) -> Result<Option<usize>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    if snapshot.join(vmm::WORKING_SET_FILE).exists() {
        return Ok(None);
    }
    let file = match std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(recorded)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("opening", recorded)(e)),
    };
    let m = file.metadata().map_err(Error::io("reading", recorded))?;
    if !m.is_file() || m.len() > MAX_WORKING_SET_BYTES {
        return Err(Error::Vm(format!(
            "{}: not a working set (a {} of {} bytes)",
            recorded.display(),
            if m.is_file() { "file" } else { "non-file" },
            m.len()
        )));
    }
    let prepared = vmm::PreparedSnapshot::open(snapshot, vmm::CpuCheck::default())
        .map_err(|e| Error::Vm(format!("snapshot {}: {e}", snapshot.display())))?;
    // The descriptor opened above, whatever the path names by now.
    let opened = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let pages = prepared.adopt_working_set(&opened).map_err(|e| {
        Error::Vm(format!(
            "the working set {} for {}: {e}",
            recorded.display(),
            snapshot.display()
        ))
    })?;
    if pages.is_some() {
        set_mode(&snapshot.join(vmm::WORKING_SET_FILE), 0o644)?;
    }
    Ok(pages)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(Error::io("setting the mode of", path))
}

/// Real uids of every live process.
fn process_uids() -> HashSet<u32> {
    let mut uids = HashSet::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if e.file_name()
            .as_encoded_bytes()
            .iter()
            .all(u8::is_ascii_digit)
        {
            if let Ok(m) = std::fs::metadata(e.path()) {
                uids.insert(m.uid());
            }
        }
    }
    uids
}

fn live_command_lines() -> Vec<Vec<u8>> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .as_encoded_bytes()
                .iter()
                .all(u8::is_ascii_digit)
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("clade-jail-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn ranges_are_checked() {
        assert!(JailConfig::default().check().is_ok());
        assert!(JailConfig {
            first_uid: 0,
            uids: 10
        }
        .check()
        .is_err());
        assert!(JailConfig {
            first_uid: u32::MAX - 5,
            uids: 10
        }
        .check()
        .is_err());
        let c = JailConfig {
            first_uid: 100,
            uids: 3,
        };
        assert!(c.contains(100) && c.contains(102) && !c.contains(103) && !c.contains(99));
    }

    #[test]
    fn shared_files_are_readable_and_their_directories_traversable() {
        let d = scratch("share-files");
        let top = d.as_path();
        let sub = top.join("a/b");
        std::fs::create_dir_all(&sub).unwrap();
        set_mode(&top.join("a"), 0o700).unwrap();
        set_mode(&sub, 0o700).unwrap();
        let f = sub.join("layer");
        std::fs::write(&f, b"x").unwrap();
        set_mode(&f, 0o600).unwrap();
        let private = sub.join("overlay");
        std::fs::write(&private, b"y").unwrap();
        set_mode(&private, 0o600).unwrap();
        share_files(top, &[f.clone(), PathBuf::from("/etc/passwd")]).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&f), 0o644);
        assert_eq!(mode(&sub), 0o711);
        assert_eq!(mode(&top.join("a")), 0o711);
        assert_eq!(mode(&private), 0o600, "only the files named are shared");
    }

    #[test]
    fn a_working_set_is_taken_only_from_a_regular_file_when_the_snapshot_has_none() {
        let d = scratch("adopt-ws");
        let snapshot = d.join("template");
        std::fs::create_dir_all(&snapshot).unwrap();
        let sandbox = d.join("sandbox");
        std::fs::create_dir_all(&sandbox).unwrap();
        let recorded = sandbox.join(vmm::WORKING_SET_FILE);
        // Nothing recorded: nothing to do.
        assert!(adopt_working_set(&recorded, &snapshot).unwrap().is_none());
        // A link (to a file the VM could not read) is not followed.
        let secret = d.join("secret");
        std::fs::write(&secret, b"not for the VM").unwrap();
        std::os::unix::fs::symlink(&secret, &recorded).unwrap();
        let e = adopt_working_set(&recorded, &snapshot).unwrap_err();
        assert!(e.to_string().contains("opening"), "{e}");
        std::fs::remove_file(&recorded).unwrap();
        // Nor is a FIFO opened for a read that would wait for a writer.
        nix::unistd::mkfifo(&recorded, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = adopt_working_set(&recorded, &snapshot).unwrap_err();
        assert!(e.to_string().contains("not a working set"), "{e}");
        std::fs::remove_file(&recorded).unwrap();
        // A regular file that is no working set of the snapshot (here: no snapshot at all)
        // installs nothing.
        std::fs::write(&recorded, b"CLADEWSF garbage").unwrap();
        assert!(adopt_working_set(&recorded, &snapshot).is_err());
        assert!(!snapshot.join(vmm::WORKING_SET_FILE).exists());
        // A snapshot that has one keeps it, whatever was recorded.
        std::fs::write(snapshot.join(vmm::WORKING_SET_FILE), b"kept").unwrap();
        assert!(adopt_working_set(&recorded, &snapshot).unwrap().is_none());
        assert_eq!(
            std::fs::read(snapshot.join(vmm::WORKING_SET_FILE)).unwrap(),
            b"kept"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A tree shared with every jailed VM (the templates, at the service's start) leaves
    /// an image conversion's scratch in its build cache alone.
    #[test]
    fn sharing_a_tree_skips_a_conversions_scratch() {
        let d = scratch("share-skip");
        let f = d.join(".build-cache/images/.scratch-x/tree/etc/shadow");
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(&f, b"root:*:").unwrap();
        set_mode(&f, 0o600).unwrap();
        set_mode(&d.join(".build-cache/images/.scratch-x"), 0o700).unwrap();
        share_tree(&d).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&f), 0o600);
        assert_eq!(mode(&d.join(".build-cache/images/.scratch-x")), 0o700);
        assert_eq!(mode(&d.join(".build-cache/images")), 0o755);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn shared_trees_are_readable() {
        let d = scratch("share-tree");
        let f = d.join("t/mem");
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        set_mode(f.parent().unwrap(), 0o700).unwrap();
        std::fs::write(&f, b"x").unwrap();
        set_mode(&f, 0o600).unwrap();
        share_tree(&d).unwrap();
        assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o777, 0o644);
        assert_eq!(
            std::fs::metadata(f.parent().unwrap()).unwrap().mode() & 0o777,
            0o755
        );
    }
}

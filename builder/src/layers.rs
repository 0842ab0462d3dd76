//! A Dockerfile's steps run in a build VM, each step's result a frozen disk layer kept in
//! a cache by content.
//!
//! The cache (a directory the caller names: `clade` keeps it in `<state dir>/templates/.build-cache`) holds layers and an index: `index/<key>` names
//! the layer a step's key was built into. A key is the SHA-256 of the key before it (the
//! base image's for the first step), the step as evaluated (its command, environment,
//! working directory and user; not its line number) and, for a COPY, the names, modes,
//! link targets and bytes of what it copies. A build looks for the longest prefix of its
//! steps already in the index, boots one VM on that layer, and runs the rest: after each,
//! the guest syncs and the VM freezes its disk's top layer (the VM goes on on a new one),
//! and only then is the key recorded. A step that fails records nothing; the layers of
//! the steps before it stay cached. Layers are never moved once written (a layer names
//! its parent by path) and never removed by a build: templates stand on them. Only
//! [`LayerCache::prune`] removes them, those no template stands on, and never while a
//! build holds the cache ([`LayerCache::hold`]).

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use vmm::agent::Client;

use crate::dockerfile::{Action, Plan, Step};
use crate::error::{Error, Result};
use crate::vm::{resolve_user, BuildVm, VmSpec};

/// The most bytes of a failed step's output kept for its error.
const FAILED_OUTPUT_TAIL: usize = 4096;
/// The longest line of a step's output passed to the build's log, bytes: a longer one
/// (output without newlines: a progress bar, a binary) is passed in pieces, each marked
/// as split, so that no buffer grows with what a step prints.
pub const MAX_LOG_LINE: usize = 4096;
/// The version of the key derivation (a change to it must not reuse old layers).
const KEY_VERSION: &str = "clade-build-v1";

/// The layer cache of a state directory.
#[derive(Debug, Clone)]
pub struct LayerCache {
    dir: PathBuf,
}

/// A build's hold on a [`LayerCache`] (see [`LayerCache::hold`]).
#[derive(Debug)]
pub struct CacheHold {
    _lock: std::fs::File,
}

/// What [`LayerCache::prune`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PruneReport {
    /// Layers (files) removed.
    pub layers: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Scratch and run directories of killed builds removed.
    pub scratch: usize,
}

#[derive(Serialize, Deserialize)]
struct IndexEntry {
    layer: PathBuf,
}

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn random_hex() -> String {
    let mut h = Sha256::new();
    h.update(format!(
        "{:?}{}{:?}",
        std::time::SystemTime::now(),
        std::process::id(),
        std::thread::current().id()
    ));
    hex(h.finalize())[..16].to_string()
}

impl LayerCache {
    /// The cache in `dir` (created when first written).
    pub fn new(dir: &Path) -> Self {
        LayerCache {
            dir: dir.to_path_buf(),
        }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Holds the cache for a build (a shared lock on `<cache>/.lock`) until the guard is
    /// dropped: [`LayerCache::prune`] is refused meanwhile. Take it before the first
    /// layer is looked up, keep it until the template standing on the layers is made.
    pub fn hold(&self) -> Result<CacheHold> {
        let f = self.lock_file()?;
        f.lock_shared()
            .map_err(|e| Error::io("locking", self.dir.join(".lock"), e))?;
        Ok(CacheHold { _lock: f })
    }

    fn lock_file(&self) -> Result<std::fs::File> {
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io("creating", &self.dir, e))?;
        let p = self.dir.join(".lock");
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| Error::io("opening", &p, e))
    }

    /// Removes every layer of the cache that no disk in `in_use` stands on (`in_use`: the
    /// layers, canonical paths, of every chain the host still has: templates',
    /// sandboxes', snapshots'), with
    /// its index entries, and what killed builds left behind (scratch of conversions, run
    /// directories). Refused ([`Error::CacheBusy`]) while a build holds the cache.
    pub fn prune(&self, in_use: &std::collections::HashSet<PathBuf>) -> Result<PruneReport> {
        let f = self.lock_file()?;
        match f.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::CacheBusy(self.dir.clone()))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(Error::io("locking", self.dir.join(".lock"), e))
            }
        }
        let mut report = PruneReport::default();
        let remove = |p: &Path, report: &mut PruneReport| {
            let len = std::fs::symlink_metadata(p).map(|m| m.len()).unwrap_or(0);
            match std::fs::remove_file(p) {
                Ok(()) => {
                    report.layers += 1;
                    report.bytes += len;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(path = %p.display(), "pruning: {e}"),
            }
        };
        // Index entries of layers nothing stands on go, with their layers.
        let used = |p: &Path| {
            in_use.contains(p) || std::fs::canonicalize(p).is_ok_and(|c| in_use.contains(&c))
        };
        let mut kept: std::collections::HashSet<PathBuf> = Default::default();
        let idx = self.dir.join("index");
        if let Ok(rd) = std::fs::read_dir(&idx) {
            for e in rd.flatten() {
                let name = e.file_name();
                if name.to_string_lossy().starts_with('.') {
                    // A half-written entry of a killed build.
                    let _ = std::fs::remove_file(e.path());
                    continue;
                }
                let layer = std::fs::read(e.path())
                    .ok()
                    .and_then(|t| serde_json::from_slice::<IndexEntry>(&t).ok())
                    .map(|x| x.layer);
                match layer {
                    Some(l) if used(&l) => {
                        kept.insert(l);
                    }
                    Some(l) => {
                        let _ = std::fs::remove_file(e.path());
                        if l.starts_with(&self.dir) {
                            remove(&l, &mut report);
                        }
                    }
                    None => {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
        // Files of conversions and runs that no index entry keeps and nothing stands on
        // (a build killed before it recorded them), and their scratch directories.
        for sub in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let d = sub.path();
            let name = sub.file_name().to_string_lossy().into_owned();
            if !(name == "images" || name.starts_with("run-")) || !d.is_dir() {
                continue;
            }
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let p = e.path();
                if e.file_name().to_string_lossy().starts_with(".scratch-") {
                    if std::fs::remove_dir_all(&p).is_ok() {
                        report.scratch += 1;
                    }
                } else if !kept.contains(&p) && !used(&p) {
                    remove(&p, &mut report);
                }
            }
            if name.starts_with("run-") && std::fs::remove_dir(&d).is_ok() {
                report.scratch += 1;
            }
        }
        Ok(report)
    }

    fn index(&self, key: &str) -> PathBuf {
        self.dir.join("index").join(key)
    }

    /// The layer built for `key`, if one was and is still there.
    pub fn lookup(&self, key: &str) -> Option<PathBuf> {
        let text = std::fs::read(self.index(key)).ok()?;
        let e: IndexEntry = serde_json::from_slice(&text).ok()?;
        // Only a layer inside the cache is taken: the index is ours, but a state
        // directory can be copied or edited.
        let inside = e.layer.starts_with(&self.dir)
            && !e.layer.components().any(|c| c == Component::ParentDir);
        (inside && e.layer.is_file()).then_some(e.layer)
    }

    /// Records that `key` was built into `layer`.
    pub fn record(&self, key: &str, layer: &Path) -> Result<()> {
        let idx = self.dir.join("index");
        std::fs::create_dir_all(&idx).map_err(|e| Error::io("creating", &idx, e))?;
        let tmp = idx.join(format!(".{key}.{}", random_hex()));
        let body = serde_json::to_vec(&IndexEntry {
            layer: layer.to_path_buf(),
        })
        .expect("an index entry serialises");
        std::fs::write(&tmp, body).map_err(|e| Error::io("writing", &tmp, e))?;
        std::fs::rename(&tmp, self.index(key)).map_err(|e| Error::io("renaming", &tmp, e))
    }

    /// The frozen base layer of an image: converted once per image (its layers' digests,
    /// its defaults and the disk size), then taken from the cache. A conversion reports
    /// how far it is to `progress`.
    pub fn image_base(
        &self,
        src: &clade_image::Source,
        size: Option<u64>,
        progress: Option<&clade_image::ConvertProgress>,
    ) -> Result<(PathBuf, String, Option<clade_image::RootfsDisk>)> {
        let mut h = Sha256::new();
        h.update(KEY_VERSION);
        h.update("\0image\0");
        for l in src.layers() {
            h.update(&l.digest);
            h.update("\0");
        }
        h.update(serde_json::to_vec(src.defaults()).expect("defaults serialise"));
        h.update(format!("\0{size:?}"));
        let key = hex(h.finalize());
        if let Some(l) = self.lookup(&key) {
            return Ok((l, key, None));
        }
        let images = self.dir.join("images");
        std::fs::create_dir_all(&images).map_err(|e| Error::io("creating", &images, e))?;
        let base = images.join(format!("{}.cdsk", &key[..32]));
        let scratch = images.join(format!(".scratch-{}", random_hex()));
        let _ = std::fs::remove_file(&base);
        let disk = clade_image::build_disk(src, &scratch, &base, size, progress)?;
        self.record(&key, &base)?;
        Ok((base, key, Some(disk)))
    }
}

/// What a COPY puts where (computed on the host, from the context).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CopyEntry {
    Dir {
        dest: PathBuf,
        mode: u32,
    },
    File {
        src: PathBuf,
        dest: PathBuf,
        mode: u32,
    },
    Symlink {
        dest: PathBuf,
        target: PathBuf,
    },
}

/// Glob characters in a source.
fn is_glob(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

/// The entries a COPY of `srcs` to `dest` makes, from `context`. Every source must be
/// inside the context (also after following a symlink given as a source); symlinks met
/// inside a copied directory are copied as symlinks.
pub(crate) fn copy_entries(
    line: usize,
    context: &Path,
    srcs: &[String],
    dest: &str,
    chmod: Option<u32>,
) -> Result<Vec<CopyEntry>> {
    let ctx_err = |msg: String| Error::Context { line, msg };
    let root = std::fs::canonicalize(context)
        .map_err(|e| ctx_err(format!("the build context {}: {e}", context.display())))?;
    let mut matched: Vec<PathBuf> = Vec::new();
    for s in srcs {
        if is_glob(s) {
            let pattern = root.join(s);
            let pattern = pattern
                .to_str()
                .ok_or_else(|| ctx_err(format!("the source '{s}' is not UTF-8")))?;
            let mut found: Vec<PathBuf> = glob::glob(pattern)
                .map_err(|e| ctx_err(format!("the pattern '{s}': {e}")))?
                .filter_map(|p| p.ok())
                .collect();
            if found.is_empty() {
                return Err(ctx_err(format!(
                    "'{s}' matches no file in the build context"
                )));
            }
            found.sort();
            matched.extend(found);
        } else {
            matched.push(root.join(s));
        }
    }
    let dest_is_dir = dest.ends_with('/');
    if matched.len() > 1 && !dest_is_dir {
        return Err(ctx_err(format!(
            "{} sources: the destination '{dest}' must be a directory (end it with /)",
            matched.len()
        )));
    }
    let dest = PathBuf::from(dest.trim_end_matches('/'));
    let mut out = Vec::new();
    for m in matched {
        let real = std::fs::canonicalize(&m).map_err(|e| {
            ctx_err(format!(
                "'{}' is not in the build context: {e}",
                m.strip_prefix(&root).unwrap_or(&m).display()
            ))
        })?;
        if !real.starts_with(&root) {
            return Err(ctx_err(format!(
                "'{}' leads out of the build context",
                m.strip_prefix(&root).unwrap_or(&m).display()
            )));
        }
        let meta =
            std::fs::metadata(&real).map_err(|e| ctx_err(format!("{}: {e}", real.display())))?;
        if meta.is_dir() {
            let top = if dest.as_os_str().is_empty() {
                PathBuf::from("/")
            } else {
                dest.clone()
            };
            out.push(CopyEntry::Dir {
                dest: top.clone(),
                mode: chmod.unwrap_or(meta.mode() & 0o7777),
            });
            walk(&real, &top, chmod, &mut out).map_err(&ctx_err)?;
        } else if meta.is_file() {
            let target = if dest_is_dir || dest.as_os_str().is_empty() {
                dest.join(real.file_name().unwrap_or_default())
            } else {
                dest.clone()
            };
            out.push(CopyEntry::File {
                src: real,
                dest: target,
                mode: chmod.unwrap_or(meta.mode() & 0o7777),
            });
        } else {
            return Err(ctx_err(format!(
                "'{}' is not a file or a directory",
                real.display()
            )));
        }
    }
    Ok(out)
}

/// The entries under the directory `dir`, to go under `dest`, sorted by name.
fn walk(
    dir: &Path,
    dest: &Path,
    chmod: Option<u32>,
    out: &mut Vec<CopyEntry>,
) -> std::result::Result<(), String> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok())
        .collect();
    names.sort_by_key(|e| e.file_name());
    for e in names {
        let p = e.path();
        let to = dest.join(e.file_name());
        let meta = std::fs::symlink_metadata(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let ft = meta.file_type();
        if ft.is_symlink() {
            let target = std::fs::read_link(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            out.push(CopyEntry::Symlink { dest: to, target });
        } else if ft.is_dir() {
            out.push(CopyEntry::Dir {
                dest: to.clone(),
                mode: chmod.unwrap_or(meta.permissions().mode() & 0o7777),
            });
            walk(&p, &to, chmod, out)?;
        } else if ft.is_file() {
            out.push(CopyEntry::File {
                src: p,
                dest: to,
                mode: chmod.unwrap_or(meta.permissions().mode() & 0o7777),
            });
        } else {
            return Err(format!("{}: not a file, directory or symlink", p.display()));
        }
    }
    Ok(())
}

/// Hashes what `entries` copy (names, modes, targets, bytes).
fn hash_entries(entries: &[CopyEntry]) -> Result<String> {
    let mut h = Sha256::new();
    for e in entries {
        match e {
            CopyEntry::Dir { dest, mode } => h.update(format!("d\0{}\0{mode:o}\0", dest.display())),
            CopyEntry::Symlink { dest, target } => {
                h.update(format!("l\0{}\0{}\0", dest.display(), target.display()))
            }
            CopyEntry::File { src, dest, mode } => {
                h.update(format!("f\0{}\0{mode:o}\0", dest.display()));
                let mut f = std::fs::File::open(src).map_err(|e| Error::io("reading", src, e))?;
                let mut buf = vec![0u8; 1 << 16];
                let mut n_total = 0u64;
                loop {
                    let n = f.read(&mut buf).map_err(|e| Error::io("reading", src, e))?;
                    if n == 0 {
                        break;
                    }
                    n_total += n as u64;
                    h.update(&buf[..n]);
                }
                h.update(format!("\0{n_total}\0"));
            }
        }
    }
    Ok(hex(h.finalize()))
}

/// A step ready to run: the step, its COPY entries, its key.
struct Keyed<'a> {
    step: &'a Step,
    copies: Vec<CopyEntry>,
    key: String,
}

/// The key of `step` on `parent`.
pub(crate) fn step_key(parent: &str, step: &Step, content: &str) -> String {
    #[derive(Serialize)]
    struct K<'a> {
        action: &'a Action,
        env: &'a [(String, String)],
        cwd: &'a str,
        user: &'a str,
    }
    let mut h = Sha256::new();
    h.update(KEY_VERSION);
    h.update("\0step\0");
    h.update(parent);
    h.update("\0");
    h.update(
        serde_json::to_vec(&K {
            action: &step.action,
            env: &step.env,
            cwd: &step.cwd,
            user: &step.user,
        })
        .expect("a step serialises"),
    );
    h.update("\0");
    h.update(content);
    hex(h.finalize())
}

/// How a build went.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BuildReport {
    /// Steps that change the disk.
    pub steps: usize,
    /// Of them, taken from the cache.
    pub cached: usize,
    /// Each step run: its line and how long it took (the VM's boot not included).
    pub ran: Vec<(usize, Duration)>,
    /// The build VM's boot (none when every step was cached).
    pub boot: Option<Duration>,
}

/// What a build tells as it goes: its log lines, and how many of its steps are built.
/// A closure taking lines is one (it ignores the count).
pub trait BuildEvents {
    /// One line of the build's log.
    fn line(&mut self, text: &str);
    /// `done` of the plan's `total` steps are built (found in the cache or run).
    fn steps(&mut self, _done: usize, _total: usize) {}
}

impl<F: FnMut(&str)> BuildEvents for F {
    fn line(&mut self, text: &str) {
        self(text)
    }
}

/// Where a build's messages go.
pub type Log<'a> = &'a mut dyn BuildEvents;

/// A step's output cut into the build log's lines, none longer than [`MAX_LOG_LINE`].
#[derive(Debug, Default)]
pub(crate) struct LineBuffer {
    /// The line begun, not ended yet (at most [`MAX_LOG_LINE`] bytes between pushes).
    pending: String,
}

impl LineBuffer {
    /// Output `d`: every line it ends goes to `log`, and pieces of a line grown past
    /// [`MAX_LOG_LINE`].
    pub(crate) fn push(&mut self, d: &[u8], log: Log) {
        self.pending.push_str(&String::from_utf8_lossy(d));
        let mut start = 0;
        while let Some(i) = self.pending[start..].find('\n') {
            self.emit(start, start + i, log);
            start += i + 1;
        }
        while self.pending.len() - start > MAX_LOG_LINE {
            start = self.piece(start, log);
        }
        self.pending.drain(..start);
    }

    /// One line, `pending[start..end]`, in pieces when it is too long.
    fn emit(&self, mut start: usize, end: usize, log: Log) {
        while end - start > MAX_LOG_LINE {
            start = self.piece(start, log);
        }
        log.line(&self.pending[start..end]);
    }

    /// Logs the first [`MAX_LOG_LINE`] bytes (to a character's start) of `pending[start..]`,
    /// marked as split; returns where the rest begins.
    fn piece(&self, start: usize, log: Log) -> usize {
        let mut cut = start + MAX_LOG_LINE;
        while !self.pending.is_char_boundary(cut) {
            cut -= 1;
        }
        log.line(&format!(
            "{} [line split: longer than {MAX_LOG_LINE} bytes]",
            &self.pending[start..cut]
        ));
        cut
    }

    /// The output ended: the line it did not end goes to `log`.
    pub(crate) fn finish(self, log: Log) {
        if !self.pending.is_empty() {
            log.line(&self.pending);
        }
    }
}

/// Runs a command in the guest; a failure is [`Error::StepFailed`] with its output's end.
fn run_argv(
    agent: &Client,
    step: &Step,
    argv: &[String],
    env: &[(String, String)],
    cwd: &str,
    ids: (u32, u32),
    log: Log,
) -> Result<()> {
    let Some((prog, args)) = argv.split_first() else {
        return Err(Error::Dockerfile {
            line: step.line,
            msg: "an empty command".into(),
        });
    };
    let mut c = vmm::agent::Command::new(prog).args(args);
    for (k, v) in env {
        c = c.env(k, v);
    }
    if !cwd.is_empty() {
        c = c.cwd(cwd);
    }
    if ids != (0, 0) {
        c = c.uid(ids.0).gid(ids.1);
    }
    let exec = agent.spawn(&c).map_err(|e| Error::StepFailed {
        line: step.line,
        text: step.text.clone(),
        status: format!("could not start: {e}"),
        output: String::new(),
    })?;
    let mut tail: Vec<u8> = Vec::new();
    let mut lines = LineBuffer::default();
    let mut keep = |d: &[u8]| {
        tail.extend_from_slice(d);
        if tail.len() > 2 * FAILED_OUTPUT_TAIL {
            tail.drain(..tail.len() - FAILED_OUTPUT_TAIL);
        }
        lines.push(d, &mut *log);
    };
    let status = {
        let keep = std::cell::RefCell::new(&mut keep);
        exec.wait_with(|d| (keep.borrow_mut())(d), |d| (keep.borrow_mut())(d))
    }
    .map_err(Error::vm)?;
    lines.finish(log);
    if !status.success() {
        let t = &tail[tail.len().saturating_sub(FAILED_OUTPUT_TAIL)..];
        return Err(Error::StepFailed {
            line: step.line,
            text: step.text.clone(),
            status: status.to_string(),
            output: String::from_utf8_lossy(t).into_owned(),
        });
    }
    Ok(())
}

/// Runs one step in the build VM.
fn run_step(vm: &BuildVm, k: &Keyed, log: Log) -> Result<()> {
    let agent = vm.agent();
    let step = k.step;
    let vm_err = |what: &str, p: &Path, e: vmm::Error| Error::StepFailed {
        line: step.line,
        text: step.text.clone(),
        status: format!("{what} {}: {e}", p.display()),
        output: String::new(),
    };
    match &step.action {
        Action::Run { argv } => {
            let ids = resolve_user(agent, step.line, &step.user)?;
            if !step.cwd.is_empty() {
                agent.make_dir(&step.cwd, 0o755, true).map_err(|e| {
                    vm_err("creating the working directory", Path::new(&step.cwd), e)
                })?;
            }
            run_argv(agent, step, argv, &step.env, &step.cwd, ids, log)
        }
        Action::Copy { chown, .. } => {
            let mut made: Vec<PathBuf> = Vec::new();
            for e in &k.copies {
                match e {
                    CopyEntry::Dir { dest, mode } => {
                        agent
                            .make_dir(dest, *mode, true)
                            .map_err(|e| vm_err("creating", dest, e))?;
                        made.push(dest.clone());
                    }
                    CopyEntry::File { src, dest, mode } => {
                        if let Some(p) = dest.parent() {
                            agent
                                .make_dir(p, 0o755, true)
                                .map_err(|e| vm_err("creating", p, e))?;
                        }
                        let mut f =
                            std::fs::File::open(src).map_err(|e| Error::io("reading", src, e))?;
                        agent
                            .write_file_from(dest, *mode, &mut f)
                            .map_err(|e| vm_err("writing", dest, e))?;
                        made.push(dest.clone());
                    }
                    CopyEntry::Symlink { dest, target } => {
                        let argv: Vec<String> = vec![
                            "ln".into(),
                            "-sfn".into(),
                            target.to_string_lossy().into_owned(),
                            dest.to_string_lossy().into_owned(),
                        ];
                        run_argv(agent, step, &argv, &[], "", (0, 0), log)?;
                        made.push(dest.clone());
                    }
                }
            }
            if let Some(owner) = chown {
                let (uid, gid) = resolve_user(agent, step.line, owner)?;
                for chunk in made.chunks(256) {
                    let mut argv = vec!["chown".to_string(), "-h".into(), format!("{uid}:{gid}")];
                    argv.extend(chunk.iter().map(|p| p.to_string_lossy().into_owned()));
                    run_argv(agent, step, &argv, &[], "", (0, 0), log)?;
                }
            }
            Ok(())
        }
    }
}

/// Runs `plan`'s steps on the frozen layer `base` (whose key is `base_key`), reading COPY
/// sources from `context`, and returns the top frozen layer with a report. A step already
/// built (same key) is taken from `cache`.
pub fn build(
    plan: &Plan,
    base: &Path,
    base_key: &str,
    context: Option<&Path>,
    cache: &LayerCache,
    vm: &VmSpec,
    log: Log,
) -> Result<(PathBuf, BuildReport)> {
    // Keys first: a COPY's is its content's, read from the context now.
    let mut keyed = Vec::new();
    let mut parent = base_key.to_string();
    for step in &plan.steps {
        let (copies, content) = match &step.action {
            Action::Copy {
                srcs, dest, chmod, ..
            } => {
                let ctx = context.ok_or_else(|| Error::Context {
                    line: step.line,
                    msg: "COPY needs a build context (--context)".into(),
                })?;
                let e = copy_entries(step.line, ctx, srcs, dest, *chmod)?;
                let h = hash_entries(&e)?;
                (e, h)
            }
            Action::Run { .. } => (Vec::new(), String::new()),
        };
        let key = step_key(&parent, step, &content);
        parent = key.clone();
        keyed.push(Keyed { step, copies, key });
    }
    let mut report = BuildReport {
        steps: keyed.len(),
        ..Default::default()
    };
    // The longest prefix already built.
    let mut top = base.to_path_buf();
    let mut done = 0;
    for (i, k) in keyed.iter().enumerate() {
        if k.step.force {
            break;
        }
        match cache.lookup(&k.key) {
            Some(l) => {
                log.line(&format!(
                    "step {}/{} (line {}): cached: {}",
                    i + 1,
                    keyed.len(),
                    k.step.line,
                    k.step.text
                ));
                top = l;
                done = i + 1;
            }
            None => break,
        }
    }
    report.cached = done;
    log.steps(done, keyed.len());
    if done == keyed.len() {
        return Ok((top, report));
    }
    // One VM for the rest, its overlays in a run directory of the cache.
    let run = cache.dir().join(format!("run-{}", random_hex()));
    std::fs::create_dir_all(&run).map_err(|e| Error::io("creating", &run, e))?;
    let overlay = run.join("step.cdsk");
    disk::ops::create_overlay(&overlay, &top)?;
    let t = Instant::now();
    let r = (|| {
        let machine = BuildVm::start(vm, &run, Some(&overlay))?;
        report.boot = Some(t.elapsed());
        for (i, k) in keyed.iter().enumerate().skip(done) {
            log.line(&format!(
                "step {}/{} (line {}): {}",
                i + 1,
                keyed.len(),
                k.step.line,
                k.step.text
            ));
            let t = Instant::now();
            run_step(&machine, k, log)?;
            let layer = machine.freeze_disk()?;
            cache.record(&k.key, &layer)?;
            report.ran.push((k.step.line, t.elapsed()));
            log.steps(i + 1, keyed.len());
            top = layer;
        }
        machine.shutdown();
        Ok::<_, Error>(())
    })();
    // The VM's last (unfrozen) top and, on a failure, the step's half-written overlay go;
    // the frozen layers of the steps that ran stay, recorded.
    clean_run(&run, cache);
    r?;
    Ok((top, report))
}

/// Removes the files of `run` no index entry names (the directory itself when empty).
fn clean_run(run: &Path, cache: &LayerCache) {
    let mut kept: BTreeMap<PathBuf, ()> = BTreeMap::new();
    if let Ok(rd) = std::fs::read_dir(cache.dir().join("index")) {
        for e in rd.flatten() {
            if let Ok(t) = std::fs::read(e.path()) {
                if let Ok(x) = serde_json::from_slice::<IndexEntry>(&t) {
                    if x.layer.starts_with(run) {
                        kept.insert(x.layer, ());
                    }
                }
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir(run) {
        for e in rd.flatten() {
            let p = e.path();
            if !kept.contains_key(&p) {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    let _ = std::fs::remove_dir(run);
}

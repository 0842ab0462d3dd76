//! Template builds the service runs: E2B's template build API (`Template.build(...)` of
//! the SDK). A build is requested (a template name and its build id), the files its COPY
//! steps need are uploaded by content hash, then it is started with its base (a registry
//! image or another template) and steps; it runs in the background — its steps in a build
//! VM through [`clade_builder`], each step a cached disk layer, then the template VM with
//! its start and ready commands and its snapshot — while the client polls its status and
//! log lines. A template appears (its `template.json` written) only when all of that
//! succeeded; a failed build leaves its reason in its log and no template.
//!
//! Build records are kept in `<state dir>/builds/<id>.json`, written when a build is
//! requested, started and ended (not at each log line): a restarted service still answers
//! a build's status and log. A build the service was running when it stopped is an
//! error after the restart, with that reason (its half-made template never appeared).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use clade_builder::dockerfile::{Action, Plan, Step};
use clade_builder::layers::LayerCache;
use clade_builder::vm::{StartCmd, VmSpec};
use clade_image::ImageDefaults;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::template::{FromImage, Template, TemplateStore};

/// The largest upload of a COPY step's files (compressed).
pub const MAX_UPLOAD: u64 = 1 << 30;
/// How long an upload link the service gives is good for (seconds): the SDK uploads right
/// after asking for it.
pub const UPLOAD_LINK_LIFETIME_S: i64 = 3600;
/// The most bytes a COPY step's files may unpack to.
const MAX_UNPACKED: u64 = 16 << 30;
/// Log lines kept per build.
const MAX_LOG_LINES: usize = 20_000;
/// Bytes of log text kept per build (a line is at most
/// [`clade_builder::layers::MAX_LOG_LINE`] bytes of a step's output).
const MAX_LOG_BYTES: usize = 4 << 20;
/// Builds kept in memory (the oldest finished ones are forgotten first).
const MAX_BUILDS: usize = 256;
/// The longest wait for a template's ready command.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// What the service builds templates with (`clade serve --build-kernel …`).
#[derive(Debug, Clone)]
pub struct BuildConfig {
    /// The `clade` executable.
    pub exe: PathBuf,
    /// The guest kernel.
    pub kernel: PathBuf,
    /// Its initramfs (with clade-agent).
    pub initrd: Option<PathBuf>,
    /// Its command line.
    pub cmdline: String,
    /// The KVM device node.
    pub kvm_device: PathBuf,
    /// Each template's disk size (None: what the image needs plus a margin).
    pub disk_size: Option<u64>,
    /// What confines the build VMs (the service's jail and cgroups; None: unconfined,
    /// `--no-jail --no-limits`).
    pub confine: Option<Arc<dyn clade_builder::vm::Confine>>,
    /// The build VMs' network (the service's sandbox networks; None: none, and the
    /// templates built have no network device).
    pub network: Option<Arc<dyn clade_builder::vm::AttachNetwork>>,
}

/// A build's state as E2B names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    /// Requested, not started.
    Waiting,
    /// Running.
    Building,
    /// Done: the template exists.
    Ready,
    /// Failed: see its reason.
    Error,
}

impl BuildStatus {
    /// E2B's name.
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }
}

/// One log line of a build.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
pub struct LogLine {
    /// When (ms since the epoch).
    pub ms: i64,
    /// "info" or "error".
    pub level: String,
    /// The text.
    pub message: String,
}

/// One build.
#[derive(Debug, serde::Serialize, Deserialize)]
pub struct Build {
    /// The template it makes.
    pub template: String,
    /// Its vCPUs and memory.
    pub vcpus: u32,
    /// MiB.
    pub mem_mib: u64,
    /// Its state.
    pub status: BuildStatus,
    /// Its log.
    pub logs: Vec<LogLine>,
    /// Why it failed.
    pub reason: Option<String>,
    /// The tags it gets when done (`default` when none were asked for).
    #[serde(default)]
    pub tags: Vec<String>,
    /// The template directory it makes: the template's own (`name`), or `name@<build
    /// id>` when it is kept beside the template's other builds (set when it starts).
    #[serde(default)]
    pub dir: String,
    /// Bytes of log text kept by [`Build::log`] (not saved: a build read back is done).
    #[serde(skip)]
    log_bytes: usize,
}

impl Build {
    /// Adds a line to its log while the log is within [`MAX_LOG_LINES`] and
    /// [`MAX_LOG_BYTES`]; the first line past them is replaced by one saying the rest
    /// is left out, and nothing more is kept.
    fn log(&mut self, level: &str, message: &str) {
        if self.log_bytes > MAX_LOG_BYTES {
            return;
        }
        let (level, message) = if self.logs.len() + 1 >= MAX_LOG_LINES
            || self.log_bytes + message.len() > MAX_LOG_BYTES
        {
            self.log_bytes = MAX_LOG_BYTES + 1;
            (
                "warn",
                format!(
                    "the rest of this log is left out (more than {MAX_LOG_LINES} lines or \
                     {MAX_LOG_BYTES} bytes)"
                ),
            )
        } else {
            self.log_bytes += message.len();
            (level, message.to_string())
        };
        self.logs.push(LogLine {
            ms: crate::ids::now_ms(),
            level: level.to_string(),
            message,
        });
    }
}

/// A step as the SDK sends it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct E2bStep {
    /// COPY, RUN, ENV, WORKDIR, USER.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// COPY: the hash of its files.
    #[serde(default)]
    pub files_hash: Option<String>,
    /// Run even if cached.
    #[serde(default)]
    pub force: bool,
}

/// The body of a build's start.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartRequest {
    /// A registry image to start from.
    #[serde(default)]
    pub from_image: Option<String>,
    /// A template of this host to start from.
    #[serde(default)]
    pub from_template: Option<String>,
    /// Registry credentials (refused: the service reads Docker's `config.json`).
    #[serde(default)]
    pub from_image_registry: Option<serde_json::Value>,
    /// Build every step again.
    #[serde(default)]
    pub force: bool,
    /// The steps.
    #[serde(default)]
    pub steps: Vec<E2bStep>,
    /// Started before the snapshot; runs in every sandbox.
    #[serde(default)]
    pub start_cmd: Option<String>,
    /// Run until it succeeds before the snapshot.
    #[serde(default)]
    pub ready_cmd: Option<String>,
}

/// The service's builds.
pub struct Builds {
    state_dir: PathBuf,
    config: Option<BuildConfig>,
    /// Builds by id.
    builds: Mutex<BTreeMap<String, Arc<Mutex<Build>>>>,
    /// Signs upload links (random per service start).
    secret: [u8; 32],
    /// The scheme of upload links (`https` when the service serves TLS).
    scheme: &'static str,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A digest of the files a tar holds, as far as the SDK's files hash covers them: each
/// entry's path, type, permission bits, link target and contents, in order (owners and
/// times left out).
fn tar_files_digest(tar_path: &Path) -> Result<[u8; 32]> {
    fn field(h: &mut Sha256, b: &[u8]) {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    }
    let f = std::fs::File::open(tar_path).map_err(Error::io("reading", tar_path))?;
    let bad =
        |e: std::io::Error| Error::BadRequest(format!("the upload is not a tar archive: {e}"));
    let mut a = tar::Archive::new(std::io::BufReader::new(f));
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    for e in a.entries().map_err(bad)? {
        let mut e = e.map_err(bad)?;
        field(&mut h, &e.path_bytes());
        field(&mut h, &[e.header().entry_type().as_byte()]);
        field(&mut h, &e.header().mode().map_err(bad)?.to_le_bytes());
        field(&mut h, &e.link_name_bytes().unwrap_or_default());
        h.update(e.size().to_le_bytes());
        loop {
            let n = e.read(&mut buf).map_err(bad)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.finalize().into())
}

/// A files hash as the SDK makes it: 64 lowercase hex digits (never a path).
fn check_hash(h: &str) -> Result<()> {
    if h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(())
    } else {
        Err(Error::BadRequest(format!("'{h}' is not a files hash")))
    }
}

impl Builds {
    /// Builds in `state_dir` with `config` (None: the build API answers that builds are
    /// not configured).
    pub fn new(state_dir: &Path, config: Option<BuildConfig>) -> Self {
        let mut secret = [0u8; 32];
        if getrandom::fill(&mut secret).is_err() {
            // Without randomness upload links are still bound to this process.
            secret[..8].copy_from_slice(&(std::process::id() as u64).to_le_bytes());
        }
        let me = Builds {
            state_dir: state_dir.to_path_buf(),
            config,
            builds: Mutex::new(BTreeMap::new()),
            secret,
            scheme: "http",
        };
        me.load();
        me
    }

    fn records_dir(&self) -> PathBuf {
        self.state_dir.join("builds")
    }

    /// Writes build `id`'s record (a failure is logged: the build goes on in memory).
    fn save(&self, id: &str, b: &Build) {
        let dir = self.records_dir();
        let tmp = dir.join(format!(".{id}.json"));
        let r = std::fs::create_dir_all(&dir)
            .and_then(|_| {
                let body = serde_json::to_vec(b).map_err(std::io::Error::other)?;
                std::fs::write(&tmp, body)
            })
            .and_then(|_| std::fs::rename(&tmp, dir.join(format!("{id}.json"))));
        if let Err(e) = r {
            tracing::warn!(build = %id, "keeping the build's record: {e}");
        }
    }

    /// The builds of earlier runs of the service; those it was running when it stopped
    /// ended then. Work directories of such builds are removed.
    fn load(&self) {
        let Ok(rd) = std::fs::read_dir(self.records_dir()) else {
            return;
        };
        let mut found: Vec<(i64, String, Build)> = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".json") else {
                continue;
            };
            // Ids are UUIDs ([`Builds::request`]; 20 hex digits before tags existed);
            // anything else is not ours.
            let old_form = id.len() == 20 && id.bytes().all(|b| b.is_ascii_hexdigit());
            if !old_form && !crate::template::is_build_id(id) {
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            let b = std::fs::read(e.path())
                .ok()
                .and_then(|t| serde_json::from_slice::<Build>(&t).ok());
            let Some(mut b) = b else {
                tracing::warn!(path = %e.path().display(), "an unreadable build record: removed");
                let _ = std::fs::remove_file(e.path());
                continue;
            };
            if matches!(b.status, BuildStatus::Waiting | BuildStatus::Building) {
                let why =
                    "the service stopped during this build: nothing of it was kept; build again";
                b.status = BuildStatus::Error;
                b.reason = Some(why.into());
                b.logs.push(LogLine {
                    ms: crate::ids::now_ms(),
                    level: "error".into(),
                    message: why.into(),
                });
                self.save(id, &b);
                let _ = std::fs::remove_dir_all(self.state_dir.join("build-jobs").join(id));
            }
            let at = b.logs.last().map_or(0, |l| l.ms);
            found.push((at, id.to_string(), b));
        }
        // The newest MAX_BUILDS are kept.
        found.sort_by_key(|(at, _, _)| std::cmp::Reverse(*at));
        let mut g = lock(&self.builds);
        for (i, (_, id, b)) in found.into_iter().enumerate() {
            if i < MAX_BUILDS {
                g.insert(id, Arc::new(Mutex::new(b)));
            } else {
                let _ = std::fs::remove_file(self.records_dir().join(format!("{id}.json")));
            }
        }
    }

    /// Upload links say `https` (the service serves TLS).
    pub fn https(mut self, yes: bool) -> Self {
        self.scheme = if yes { "https" } else { "http" };
        self
    }

    /// The scheme of upload links.
    pub fn scheme(&self) -> &'static str {
        self.scheme
    }

    fn templates(&self) -> TemplateStore {
        TemplateStore::new(&self.state_dir)
    }

    fn files_dir(&self) -> PathBuf {
        self.state_dir.join("build-files")
    }

    /// Requests a build of template `name` (`[team/]name[:tag]`) to be tagged with `tags`
    /// as well as the tag in `name` (`default` when neither gives one); returns the
    /// template's id (its name) and the build's id.
    pub fn request(
        &self,
        name: &str,
        tags: &[String],
        vcpus: Option<u32>,
        mem_mib: Option<u64>,
    ) -> Result<(String, String, Vec<String>)> {
        if self.config.is_none() {
            return Err(Error::BadRequest(
                "this service builds no templates: start clade serve with --build-kernel (and --build-initrd)".into(),
            ));
        }
        let (name, tag) = crate::template::tags::parse_reference(name).map_err(|_| {
            Error::BadRequest(format!(
                "'{name}' is not a template name (letters, digits, '-', '_', '.'; optionally team/ before it and :tag after it)"
            ))
        })?;
        let mut all: Vec<String> = tag.into_iter().map(String::from).collect();
        for t in tags {
            crate::template::tags::check_tag(t)?;
            if !all.contains(t) {
                all.push(t.clone());
            }
        }
        if all.is_empty() {
            all.push(crate::template::tags::DEFAULT_TAG.to_string());
        }
        if all.len() > crate::template::tags::MAX_TAGS {
            return Err(Error::BadRequest(format!(
                "more than {} tags",
                crate::template::tags::MAX_TAGS
            )));
        }
        let vcpus = vcpus.unwrap_or(1);
        let mem_mib = mem_mib.unwrap_or(512);
        if vcpus == 0 || vcpus > 32 || !(128..=65536).contains(&mem_mib) {
            return Err(Error::BadRequest(format!(
                "cpuCount {vcpus} / memoryMB {mem_mib}: 1-32 vCPUs and 128-65536 MiB"
            )));
        }
        let build_id = crate::template::new_build_id()?;
        let mut g = lock(&self.builds);
        if g.len() >= MAX_BUILDS {
            let done: Vec<String> = g
                .iter()
                .filter(|(_, b)| matches!(lock(b).status, BuildStatus::Ready | BuildStatus::Error))
                .map(|(k, _)| k.clone())
                .take(g.len() + 1 - MAX_BUILDS)
                .collect();
            for k in done {
                g.remove(&k);
                let _ = std::fs::remove_file(self.records_dir().join(format!("{k}.json")));
            }
        }
        let b = Build {
            template: name.to_string(),
            vcpus,
            mem_mib,
            status: BuildStatus::Waiting,
            logs: Vec::new(),
            reason: None,
            tags: all.clone(),
            dir: String::new(),
            log_bytes: 0,
        };
        self.save(&build_id, &b);
        g.insert(build_id.clone(), Arc::new(Mutex::new(b)));
        Ok((name.to_string(), build_id, all))
    }

    /// The build `build_id` of `template`.
    pub fn get(&self, template: &str, build_id: &str) -> Result<Arc<Mutex<Build>>> {
        let g = lock(&self.builds);
        match g.get(build_id) {
            Some(b) if lock(b).template == template => Ok(b.clone()),
            _ => Err(Error::NotFound(format!(
                "build {build_id} of template {template}"
            ))),
        }
    }

    /// Whether the files of `hash` were uploaded.
    pub fn files_present(&self, hash: &str) -> Result<bool> {
        check_hash(hash)?;
        Ok(self.files_dir().join(format!("{hash}.tar")).is_file())
    }

    /// The token an upload of `hash` must carry until `expires` (unix seconds): its link
    /// is given with the API key, and the token binds it to both (a link for one hash, or
    /// with its expiry moved, is no link).
    pub fn upload_token(&self, hash: &str, expires: i64) -> String {
        let mut h = Sha256::new();
        h.update(self.secret);
        h.update(b"upload:");
        h.update(hash);
        h.update(b":");
        h.update(expires.to_string());
        hex(h.finalize())
    }

    /// The path of an upload link for the files of `hash` issued at `now_s` (unix
    /// seconds): `/build-files/{hash}/{expires}/{token}`, good for
    /// [`UPLOAD_LINK_LIFETIME_S`].
    pub fn upload_link_path(&self, hash: &str, now_s: i64) -> String {
        let expires = now_s.saturating_add(UPLOAD_LINK_LIFETIME_S);
        format!(
            "/build-files/{hash}/{expires}/{}",
            self.upload_token(hash, expires)
        )
    }

    /// Checks the upload link of the files of `hash` (`expires` and `token` from
    /// [`Builds::upload_link_path`]) at `now_s` before anything of its body is read, and
    /// returns where the body goes as it arrives (a scratch file of the build files'
    /// directory, given to [`Builds::keep_upload`]).
    pub fn upload_scratch(
        &self,
        hash: &str,
        expires: &str,
        token: &str,
        now_s: i64,
    ) -> Result<PathBuf> {
        check_hash(hash)?;
        let invalid = || Error::BadRequest("this upload link is not valid".into());
        let expires: i64 = expires.parse().map_err(|_| invalid())?;
        let want = self.upload_token(hash, expires);
        if !crate::envd::access::same_secret(token.as_bytes(), want.as_bytes()) {
            return Err(invalid());
        }
        if expires < now_s {
            return Err(Error::BadRequest(
                "this upload link has expired: ask for the files' link again".into(),
            ));
        }
        let dir = self.files_dir();
        std::fs::create_dir_all(&dir).map_err(Error::io("creating", &dir))?;
        Ok(dir.join(format!(".{hash}.{}.upload", crate::ids::random_string(12))))
    }

    /// Keeps an upload of the files of `hash` received into `raw` (from
    /// [`Builds::upload_scratch`]; removed whatever happens): a gzipped or plain tar,
    /// stored decompressed and checked to be a tar.
    ///
    /// The files of a hash, once kept, never change: builds that name the hash get what
    /// was first uploaded for it. A later upload for the same hash must hold the same
    /// files (paths, types, modes, link targets and contents: what the SDK's hash covers;
    /// not owners or times, which it leaves out) and is then a no-op; other files are
    /// refused (409) and nothing of them is kept. The SDK's hash itself cannot be checked
    /// here: it also covers the COPY step's source and destination (known only when the
    /// build starts) and the client's directory sizes (not in a tar).
    pub fn keep_upload(&self, hash: &str, raw: &Path) -> Result<()> {
        let r = self.unpack_upload(hash, raw);
        let _ = std::fs::remove_file(raw);
        r
    }

    fn unpack_upload(&self, hash: &str, raw: &Path) -> Result<()> {
        check_hash(hash)?;
        let mut file = std::fs::File::open(raw).map_err(Error::io("reading", raw))?;
        use std::io::Seek;
        let mut magic = [0u8; 2];
        let gz = matches!(file.read(&mut magic), Ok(2) if magic == [0x1f, 0x8b]);
        file.rewind().map_err(Error::io("reading", raw))?;
        let mut data: Box<dyn Read> = if gz {
            Box::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)))
        } else {
            Box::new(std::io::BufReader::new(file))
        };
        let dir = self.files_dir();
        let tmp = dir.join(format!(".{hash}.{}.tar", crate::ids::random_string(12)));
        let mut out = std::fs::File::create(&tmp).map_err(Error::io("creating", &tmp))?;
        let n = std::io::copy(&mut (&mut data).take(MAX_UNPACKED + 1), &mut out);
        let r = match n {
            Ok(n) if n > MAX_UNPACKED => Err(Error::BadRequest(format!(
                "the files unpack to more than {MAX_UNPACKED} bytes"
            ))),
            Ok(_) => {
                // Every entry readable: a truncated or corrupt tar is refused now.
                let f = std::fs::File::open(&tmp).map_err(Error::io("reading", &tmp))?;
                let mut a = tar::Archive::new(clade_image::TarLimit::new(f));
                a.entries()
                    .and_then(|mut es| es.try_for_each(|e| e.map(|_| ())))
                    .map_err(|e| Error::BadRequest(format!("the upload is not a tar archive: {e}")))
            }
            Err(e) => Err(Error::BadRequest(format!("the upload: {e}"))),
        };
        let r = r.and_then(|()| {
            // A hard link never replaces: two uploads of one hash at once keep one.
            let dst = dir.join(format!("{hash}.tar"));
            match std::fs::hard_link(&tmp, &dst) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if tar_files_digest(&tmp)? == tar_files_digest(&dst)? {
                        Ok(())
                    } else {
                        Err(Error::Conflict(format!(
                            "the files of {hash} were uploaded before, with other contents; \
                             files are kept by their hash and never replaced"
                        )))
                    }
                }
                Err(e) => Err(Error::io("linking", &dst)(e)),
            }
        });
        let _ = std::fs::remove_file(&tmp);
        r
    }

    /// [`Builds::upload_scratch`], the whole of `body` written there, then
    /// [`Builds::keep_upload`].
    #[cfg(test)]
    fn store_upload(&self, hash: &str, expires: i64, token: &str, body: &[u8]) -> Result<()> {
        let now = crate::ids::now_ms() / 1000;
        let raw = self.upload_scratch(hash, &expires.to_string(), token, now)?;
        std::fs::write(&raw, body).map_err(Error::io("writing", &raw))?;
        self.keep_upload(hash, &raw)
    }

    /// Starts build `build_id` of `template` in the background; `users` counts the
    /// sandboxes of the template's own directory (a build that replaces it needs none),
    /// `done` is called when it ends, whatever the result.
    pub fn start(
        self: &Arc<Self>,
        template: &str,
        build_id: &str,
        req: StartRequest,
        users: usize,
        done: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        let b = self.get(template, build_id)?;
        // An untagged build replaces the template's own directory while `default` means
        // it; any other is kept beside it, as `template@<build id>`.
        let in_place = {
            let tags = &lock(&b).tags;
            let default = crate::template::tags::DEFAULT_TAG;
            // Nothing but `default` may mean the directory it replaces.
            tags.len() == 1
                && tags[0] == default
                && self
                    .templates()
                    .tags(template)?
                    .tags
                    .iter()
                    .all(|(tag, t)| (tag == default) == (t.build == template))
        };
        // One build of a template at a time.
        let other = lock(&self.builds).iter().any(|(id, o)| {
            id != build_id && {
                let o = lock(o);
                o.template == template && o.status == BuildStatus::Building
            }
        });
        if other {
            return Err(Error::Conflict(format!(
                "template {template} is being built already"
            )));
        }
        {
            let mut g = lock(&b);
            if g.status != BuildStatus::Waiting {
                return Err(Error::Conflict(format!(
                    "build {build_id} was started already"
                )));
            }
            if in_place && users > 0 {
                return Err(Error::Conflict(format!(
                    "template {template} is used by {users} sandbox(es): kill them before building it again (or build it with a tag: it is then kept beside the one in use)"
                )));
            }
            if req.from_image_registry.is_some() {
                return Err(Error::BadRequest(
                    "registry credentials in a build request are not supported: give them to the \
                     service's user in ~/.docker/config.json"
                        .into(),
                ));
            }
            if in_place
                && req.from_template.as_deref().map(|t| {
                    crate::template::tags::parse_reference(t).is_ok_and(|(n, tag)| {
                        n == template && tag.is_none_or(|t| t == crate::template::tags::DEFAULT_TAG)
                    })
                }) == Some(true)
            {
                return Err(Error::BadRequest(format!(
                    "template {template} cannot be built on itself (its build replaces it)"
                )));
            }
            match (&req.from_image, &req.from_template) {
                (Some(_), Some(_)) => {
                    return Err(Error::BadRequest(
                        "fromImage and fromTemplate together".into(),
                    ))
                }
                (None, None) => {
                    return Err(Error::BadRequest(
                        "neither fromImage nor fromTemplate".into(),
                    ))
                }
                _ => {}
            }
            for (i, s) in req.steps.iter().enumerate() {
                if !["COPY", "RUN", "ENV", "WORKDIR", "USER"].contains(&s.kind.as_str()) {
                    return Err(Error::BadRequest(format!(
                        "step {}: type '{}' is not supported",
                        i + 1,
                        s.kind
                    )));
                }
                if let Some(h) = &s.files_hash {
                    check_hash(h)?;
                    if !self.files_present(h)? {
                        return Err(Error::BadRequest(format!(
                            "step {}: its files ({h}) were not uploaded",
                            i + 1
                        )));
                    }
                }
            }
            g.status = BuildStatus::Building;
            g.dir = if in_place {
                template.to_string()
            } else {
                crate::template::tags::build_dir_name(template, build_id)
            };
            self.save(build_id, &g);
        }
        let me = self.clone();
        let id = build_id.to_string();
        std::thread::Builder::new()
            .name(format!("build-{id}"))
            .spawn(move || {
                me.run(&b, &id, &req);
                done();
            })
            .map_err(|e| Error::Vm(format!("starting the build: {e}")))?;
        Ok(())
    }

    fn run(&self, b: &Arc<Mutex<Build>>, id: &str, req: &StartRequest) {
        let log = |level: &'static str, m: &str| lock(b).log(level, m);
        let work = self.state_dir.join("build-jobs").join(id);
        let r = self.build(b, id, req, &work, &log);
        let _ = std::fs::remove_dir_all(&work);
        let mut g = lock(b);
        match r {
            Ok(t) => {
                g.status = BuildStatus::Ready;
                let line = format!("template {} built", t.name);
                drop(g);
                log("info", &line);
            }
            Err(e) => {
                tracing::warn!("build {id}: {e}");
                g.status = BuildStatus::Error;
                g.reason = Some(e.to_string());
                drop(g);
                log("error", &e.to_string());
            }
        }
        self.save(id, &lock(b));
    }

    fn build(
        &self,
        b: &Arc<Mutex<Build>>,
        id: &str,
        req: &StartRequest,
        work: &Path,
        log: &dyn Fn(&'static str, &str),
    ) -> Result<Template> {
        let cfg = self
            .config
            .clone()
            .ok_or_else(|| Error::BadRequest("builds are not configured".into()))?;
        let (template, name, tags, vcpus, mem_mib) = {
            let g = lock(b);
            (
                g.template.clone(),
                g.dir.clone(),
                g.tags.clone(),
                g.vcpus,
                g.mem_mib,
            )
        };
        let verr = |e: clade_builder::Error| match e {
            clade_builder::Error::StepFailed {
                line,
                text,
                status,
                output,
            } => Error::BadRequest(format!(
                "step {line} `{text}` failed ({status}){}",
                if output.is_empty() {
                    String::new()
                } else {
                    format!(":\n{output}")
                }
            )),
            e => Error::Vm(e.to_string()),
        };
        let cache = LayerCache::new(&self.templates().build_cache_dir());
        // Its layers are not pruned while it builds.
        let _hold = cache.hold().map_err(verr)?;
        // E2B's base image (the SDK's default base, and `from_base_image`): this host's
        // base template when it has one (`clade template build base`, E2B's shape: no
        // registry needed), but for a build of that template itself.
        let mut from_image = req.from_image.clone();
        let mut from_template = req.from_template.clone();
        if let Some(img) = from_image.as_deref().filter(|i| is_e2b_base_image(i)) {
            let local = template != BASE_TEMPLATE
                && self
                    .templates()
                    .resolve(BASE_TEMPLATE)
                    .and_then(|t| self.templates().get(&t))
                    .is_ok();
            if local {
                log(
                    "info",
                    &format!(
                        "{img}: E2B's base image; built on this host's template {BASE_TEMPLATE}"
                    ),
                );
                from_image = None;
                from_template = Some(BASE_TEMPLATE.to_string());
            }
        }
        // The base: a registry image converted once, or a template's frozen disk.
        let (base, key, defaults, reference) = match (&from_image, &from_template) {
            (Some(img), _) => {
                if !clade_image::is_reference(img) {
                    return Err(Error::BadRequest(format!(
                        "fromImage '{img}' is not a registry reference"
                    )));
                }
                log("info", &format!("pulling {img}"));
                let pulled = clade_image::pull(img, &self.state_dir.join("images"), None)
                    .map_err(|e| Error::BadRequest(format!("fromImage {img}: {e}")))?;
                let src = clade_image::Source::open(&pulled.layout)
                    .map_err(|e| Error::BadRequest(format!("fromImage {img}: {e}")))?;
                let (base, key, converted) =
                    cache.image_base(&src, cfg.disk_size, None).map_err(verr)?;
                log(
                    "info",
                    &format!(
                        "{img}: {}",
                        if converted.is_some() {
                            "converted"
                        } else {
                            "cached"
                        }
                    ),
                );
                (base, key, src.defaults().clone(), img.clone())
            }
            (None, Some(reference)) => {
                let t = &self.templates().resolve(reference)?;
                let tpl = self.templates().get(t)?;
                let snap = self.templates().snapshot_dir(t)?;
                let prepared = vmm::PreparedSnapshot::open(&snap, vmm::CpuCheck::default())
                    .map_err(|e| Error::Vm(format!("template {t}: {e}")))?;
                let layer = prepared.disk().map(|d| d.layer.clone()).ok_or_else(|| {
                    Error::BadRequest(format!("template {t} has no disk to build on"))
                })?;
                let mut h = Sha256::new();
                h.update(format!("template\0{t}\0{}", tpl.created_ms));
                let d = tpl.image.as_ref().map(|i| ImageDefaults {
                    env: i.env.clone().into_iter().collect(),
                    cwd: i.cwd.clone(),
                    user: i.user.clone(),
                    entrypoint: Vec::new(),
                    cmd: i.start_cmd.clone(),
                });
                (
                    layer,
                    hex(h.finalize()),
                    d.unwrap_or_default(),
                    format!("template {t}"),
                )
            }
            (None, None) => return Err(Error::BadRequest("no base".into())),
        };
        // The COPY steps' files, unpacked into one context (member names are relative to
        // the SDK's context directory).
        // The build's own directory is private: a local user reaches nothing of them.
        std::fs::create_dir_all(work).map_err(Error::io("creating", work))?;
        std::fs::set_permissions(work, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(Error::io("setting the mode of", work))?;
        let ctx = work.join("context");
        std::fs::create_dir_all(&ctx).map_err(Error::io("creating", &ctx))?;
        for s in &req.steps {
            if let Some(h) = &s.files_hash {
                let f = self.files_dir().join(format!("{h}.tar"));
                unpack_context(&f, &ctx)
                    .map_err(|e| Error::BadRequest(format!("the files of a COPY ({h}): {e}")))?;
            }
        }
        let plan = plan_of(&defaults, req)?;
        // A jailed build VM reads the layers below its own: a base just converted is
        // the service's alone until shared.
        share_chain(&cache, &base)?;
        let spec = VmSpec {
            exe: cfg.exe.clone(),
            kernel: cfg.kernel.clone(),
            initrd: cfg.initrd.clone(),
            cmdline: cfg.cmdline.clone(),
            vcpus,
            mem_mib,
            kvm_device: cfg.kvm_device.clone(),
            net: None,
            test_device: false,
            agent_timeout: Duration::from_secs(240),
            confine: cfg.confine.clone(),
            network: cfg.network.clone(),
        };
        let (top, report) = clade_builder::layers::build(
            &plan,
            &base,
            &key,
            Some(&ctx),
            &cache,
            &spec,
            &mut |l: &str| log("info", l),
        )
        .map_err(verr)?;
        log(
            "info",
            &format!(
                "{} steps, {} cached, {} run",
                report.steps,
                report.cached,
                report.ran.len()
            ),
        );
        // The template VM, in the template's own directory (an old template of that name
        // goes only now, its sandboxes checked gone when the build started).
        let store = self.templates();
        let dir = store.prepare(&name, true)?;
        let r = (|| {
            let overlay = dir.join("disk.cdsk");
            disk::ops::create_overlay(&overlay, &top)
                .map_err(|e| Error::Vm(format!("the template's disk: {e}")))?;
            let start = req.start_cmd.as_ref().map(|c| StartCmd {
                cmd: c.clone(),
                ready: req.ready_cmd.clone(),
                env: plan.defaults.env.clone(),
                cwd: plan.defaults.cwd.clone(),
                user: plan.defaults.user.clone(),
                ready_timeout: READY_TIMEOUT,
            });
            log("info", "starting the template VM");
            clade_builder::vm::snapshot_template(
                &spec,
                &dir,
                Some(&overlay),
                &[],
                start.as_ref(),
                &store.snapshot_dir(&name)?,
            )
            .map_err(verr)?;
            let boot = store.keep_boot(&name, &cfg.kernel, cfg.initrd.as_deref(), &cfg.cmdline)?;
            let t = Template {
                name: name.clone(),
                vcpus,
                mem_mib,
                disk: true,
                test_guest: false,
                created_ms: crate::ids::now_ms(),
                setup: Vec::new(),
                // Its snapshot has the network device the build VM had.
                net: cfg.network.is_some(),
                image: Some(FromImage {
                    reference,
                    env: plan.defaults.env.iter().cloned().collect(),
                    cwd: plan.defaults.cwd.clone(),
                    user: plan.defaults.user.clone(),
                    start_cmd: req.start_cmd.iter().cloned().collect(),
                }),
                boot: Some(boot),
                build_id: Some(id.to_string()),
            };
            // Every jailed VM process reads the template and the layers it stands on.
            crate::vmproc::jail::share_tree(&dir)?;
            share_chain(&cache, &top)?;
            store.finish(&t)?;
            store.tag_build(&template, &name, &tags)?;
            Ok(t)
        })();
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        r
    }
}

/// Unpacks the tar `f` of a COPY's files into `ctx`, as host files that are no more than
/// files: owned by the service, no xattrs, and a device node, a FIFO or a set-id bit
/// refused (a COPY takes files, directories and symbolic links; the guest's set-id bits
/// are set by a RUN step), never made.
fn unpack_context(f: &Path, ctx: &Path) -> std::result::Result<(), String> {
    let file = std::fs::File::open(f).map_err(|e| format!("opening {}: {e}", f.display()))?;
    let mut a = tar::Archive::new(clade_image::TarLimit::new(file));
    a.set_preserve_permissions(false);
    a.set_preserve_ownerships(false);
    a.set_unpack_xattrs(false);
    a.set_overwrite(true);
    for e in a.entries().map_err(|e| e.to_string())? {
        let mut e = e.map_err(|e| e.to_string())?;
        let path = String::from_utf8_lossy(&e.path_bytes()).into_owned();
        use tar::EntryType as T;
        let kind = e.header().entry_type();
        if matches!(kind, T::Char | T::Block | T::Fifo) {
            return Err(format!(
                "{path}: a device node or FIFO (a COPY takes files, directories and links)"
            ));
        }
        let mode = e.header().mode().map_err(|e| format!("{path}: {e}"))?;
        if mode & 0o6000 != 0 && kind != T::Symlink {
            return Err(format!(
                "{path}: set-uid/set-gid bits are not taken from a COPY's files (set them with \
                 a RUN chmod step)"
            ));
        }
        e.unpack_in(ctx).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}

/// Makes the layers of the chain whose top is `top` that are in `cache` readable by every
/// jailed VM process, the directories down to them traversable, not listable. Only those
/// files: the cache also holds other builds' work (an image being unpacked into its
/// scratch, with the modes of the image's files), which a walk of the whole cache would
/// make readable to all.
fn share_chain(cache: &LayerCache, top: &Path) -> Result<()> {
    let dir = std::fs::canonicalize(cache.dir()).map_err(Error::io("reading", cache.dir()))?;
    // The cache itself is traversed by every VM (share_files sets the directories below).
    let m = std::fs::metadata(&dir).map_err(Error::io("reading", &dir))?;
    if std::os::unix::fs::MetadataExt::mode(&m) & 0o011 != 0o011 {
        let mode = (std::os::unix::fs::MetadataExt::mode(&m) & 0o7777) | 0o111;
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(mode))
            .map_err(Error::io("setting the mode of", &dir))?;
    }
    let layers = disk::ops::info(top)
        .map_err(|e| Error::Vm(format!("the layers of {}: {e}", top.display())))?;
    let mut files = Vec::new();
    for l in layers {
        files.push(std::fs::canonicalize(&l.path).map_err(Error::io("reading", &l.path))?);
    }
    crate::vmproc::jail::share_files(&dir, &files)
}

/// The steps of an E2B build evaluated on the base's `defaults`, as a Dockerfile's are.
fn plan_of(defaults: &ImageDefaults, req: &StartRequest) -> Result<Plan> {
    let mut env = defaults.env.clone();
    let mut cwd = defaults.cwd.clone();
    let mut user = defaults.user.clone();
    let mut steps = Vec::new();
    let mut forced = req.force;
    for (i, s) in req.steps.iter().enumerate() {
        let n = i + 1;
        let bad = |m: &str| Error::BadRequest(format!("step {n} ({}): {m}", s.kind));
        forced |= s.force;
        let text = format!("{} {}", s.kind, s.args.join(" "));
        let mut push = |action: Action, as_user: &str| {
            steps.push(Step {
                line: n,
                text: text.clone(),
                action,
                env: env.clone(),
                cwd: cwd.clone(),
                user: as_user.to_string(),
                force: forced,
            })
        };
        match s.kind.as_str() {
            "RUN" => {
                let cmd = s.args.first().ok_or_else(|| bad("no command"))?;
                let as_user = s
                    .args
                    .get(1)
                    .filter(|u| !u.is_empty())
                    .cloned()
                    .unwrap_or(user.clone());
                push(
                    Action::Run {
                        argv: vec!["/bin/sh".into(), "-c".into(), cmd.clone()],
                    },
                    &as_user,
                );
            }
            "COPY" => {
                let (src, dest) = match s.args.as_slice() {
                    [src, dest, ..] => (src, dest),
                    _ => return Err(bad("needs a source and a destination")),
                };
                let chown = s.args.get(2).filter(|u| !u.is_empty()).cloned();
                let chmod = match s.args.get(3).filter(|m| !m.is_empty()) {
                    None => None,
                    Some(m) => Some(
                        u32::from_str_radix(m, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| bad("its mode is not octal"))?,
                    ),
                };
                if s.files_hash.is_none() {
                    return Err(bad("no filesHash"));
                }
                let src = clade_builder::dockerfile::context_path(n, src)
                    .map_err(|e| bad(&e.to_string()))?;
                let dest = clade_builder::dockerfile::absolute_in(
                    if cwd.is_empty() { "/" } else { &cwd },
                    dest,
                );
                let u = user.clone();
                push(
                    Action::Copy {
                        srcs: vec![src],
                        dest,
                        chown,
                        chmod,
                    },
                    &u,
                );
            }
            "ENV" => {
                if s.args.len() % 2 != 0 {
                    return Err(bad("its arguments are not name/value pairs"));
                }
                for kv in s.args.chunks(2) {
                    if kv[0].is_empty() || kv[0].contains(['=', '\0']) {
                        return Err(bad(&format!("'{}' is not a variable name", kv[0])));
                    }
                    env.retain(|(k, _)| *k != kv[0]);
                    env.push((kv[0].clone(), kv[1].clone()));
                }
            }
            "WORKDIR" => {
                let w = s
                    .args
                    .first()
                    .filter(|w| !w.is_empty())
                    .ok_or_else(|| bad("no directory"))?;
                cwd = clade_builder::dockerfile::absolute_in(
                    if cwd.is_empty() { "/" } else { &cwd },
                    w,
                )
                .trim_end_matches('/')
                .to_string();
                if cwd.is_empty() {
                    cwd = "/".into();
                }
            }
            "USER" => {
                let u = s
                    .args
                    .first()
                    .filter(|u| !u.is_empty())
                    .ok_or_else(|| bad("no user"))?;
                user = u.clone();
            }
            _ => return Err(bad("not supported")),
        }
    }
    Ok(Plan {
        from: String::new(),
        steps,
        defaults: ImageDefaults {
            env,
            cwd,
            user,
            entrypoint: Vec::new(),
            cmd: req.start_cmd.iter().cloned().collect(),
        },
        ignored: Vec::new(),
        unused_args: Vec::new(),
    })
}

/// The template `clade template build base` makes: what E2B's base image stands for here.
pub const BASE_TEMPLATE: &str = "base";

/// Whether `image` names E2B's base image (`e2bdev/base`, the SDK's default base), with or
/// without Docker Hub's host and the `latest` tag.
fn is_e2b_base_image(image: &str) -> bool {
    let i = image
        .strip_prefix("docker.io/")
        .or_else(|| image.strip_prefix("index.docker.io/"))
        .or_else(|| image.strip_prefix("registry-1.docker.io/"))
        .unwrap_or(image);
    matches!(i, "e2bdev/base" | "e2bdev/base:latest")
}

/// Step and build names for tests.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2b_steps_become_a_plan() {
        let req: StartRequest = serde_json::from_value(serde_json::json!({
            "fromImage": "x", "force": false,
            "steps": [
                {"type": "COPY", "args": ["a.txt", "/app/", "", "0755"], "filesHash": "ab", "force": false},
                {"type": "RUN", "args": ["echo 1 && echo 2", "root"], "force": false},
                {"type": "ENV", "args": ["A", "1", "B", "two words"], "force": false},
                {"type": "WORKDIR", "args": ["/app"], "force": false},
                {"type": "USER", "args": ["user"], "force": true},
                {"type": "RUN", "args": ["make"], "force": false}
            ],
            "startCmd": "python -m http.server", "readyCmd": "true"
        }))
        .unwrap();
        let p = plan_of(&ImageDefaults::default(), &req).unwrap();
        assert_eq!(p.steps.len(), 3);
        assert!(
            matches!(&p.steps[0].action, Action::Copy { srcs, dest, chmod: Some(0o755), .. } if srcs == &["a.txt"] && dest == "/app/")
        );
        assert_eq!(p.steps[1].user, "root");
        assert!(!p.steps[1].force);
        assert_eq!(p.steps[2].user, "user");
        assert_eq!(p.steps[2].cwd, "/app");
        assert!(p.steps[2].env.contains(&("B".into(), "two words".into())));
        assert!(p.steps[2].force, "a forced step runs again");
        assert_eq!(p.defaults.user, "user");
        assert_eq!(p.defaults.cmd, vec!["python -m http.server".to_string()]);
        for bad in [
            serde_json::json!({"type": "COPY", "args": ["../x", "/y", "", ""], "filesHash": "ab"}),
            serde_json::json!({"type": "COPY", "args": ["x", "/y", "", "999"], "filesHash": "ab"}),
            serde_json::json!({"type": "COPY", "args": ["x", "/y", "", ""]}),
            serde_json::json!({"type": "ENV", "args": ["A"]}),
            serde_json::json!({"type": "RUN", "args": []}),
            serde_json::json!({"type": "USER", "args": [""]}),
            serde_json::json!({"type": "HEALTHCHECK", "args": ["x"]}),
        ] {
            let r: StartRequest = serde_json::from_value(
                serde_json::json!({"fromImage": "x", "steps": [bad.clone()]}),
            )
            .unwrap();
            assert!(
                matches!(
                    plan_of(&ImageDefaults::default(), &r),
                    Err(Error::BadRequest(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn e2bs_base_image_is_known_by_its_names() {
        for i in [
            "e2bdev/base",
            "e2bdev/base:latest",
            "docker.io/e2bdev/base",
            "index.docker.io/e2bdev/base:latest",
        ] {
            assert!(is_e2b_base_image(i), "{i}");
        }
        for i in [
            "e2bdev/base:v1",
            "e2bdev/code-interpreter",
            "base",
            "ghcr.io/e2bdev/base",
        ] {
            assert!(!is_e2b_base_image(i), "{i}");
        }
    }

    #[test]
    fn uploads_need_their_link_and_a_tar() {
        let d = std::env::temp_dir().join(format!("sandbox-builds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let b = Builds::new(&d, None);
        let h = "a".repeat(64);
        assert!(!b.files_present(&h).unwrap());
        assert!(b.files_present("../../etc/passwd").is_err());
        let mut t = tar::Builder::new(Vec::new());
        let mut hd = tar::Header::new_gnu();
        hd.set_size(2);
        hd.set_mode(0o644);
        hd.set_cksum();
        t.append_data(&mut hd, "f.txt", &b"hi"[..]).unwrap();
        let tar = t.into_inner().unwrap();
        let exp = crate::ids::now_ms() / 1000 + 60;
        let token = b.upload_token(&h, exp);
        assert!(b.store_upload(&h, exp, "wrong", &tar).is_err());
        assert!(b
            .store_upload(&h, exp, &token, b"not a tar at all, truncated")
            .is_err());
        assert!(!b.files_present(&h).unwrap());
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        b.store_upload(&h, exp, &token, &gz.finish().unwrap())
            .unwrap();
        assert!(b.files_present(&h).unwrap());
        // Without a build configuration nothing is built.
        assert!(matches!(
            b.request("t", &[], None, None),
            Err(Error::BadRequest(_))
        ));
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A build context whose tar has a PAX header over the metadata limit (2 MiB; the
    /// tar reader would hold it whole) is refused when it is uploaded, saying why.
    #[test]
    fn an_upload_with_a_huge_tar_header_is_refused() {
        let d = std::env::temp_dir().join(format!("sandbox-builds-pax-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let b = Builds::new(&d, None);
        let h = "b".repeat(64);
        let mut t = tar::Builder::new(Vec::new());
        let value = vec![b'v'; 2 << 20];
        t.append_pax_extensions([("comment", &value[..])]).unwrap();
        let mut hd = tar::Header::new_gnu();
        hd.set_size(2);
        hd.set_mode(0o644);
        t.append_data(&mut hd, "f.txt", &b"hi"[..]).unwrap();
        let tar = t.into_inner().unwrap();
        let exp = crate::ids::now_ms() / 1000 + 60;
        let e = b
            .store_upload(&h, exp, &b.upload_token(&h, exp), &tar)
            .unwrap_err();
        assert!(
            e.to_string().contains("a PAX extended header of")
                && e.to_string()
                    .contains("more than the 1048576 bytes allowed"),
            "{e}"
        );
        assert!(!b.files_present(&h).unwrap());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn builds_are_kept_across_a_restart() {
        let d = std::env::temp_dir().join(format!("sandbox-build-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let cfg = BuildConfig {
            exe: "/nonexistent".into(),
            kernel: "/nonexistent".into(),
            initrd: None,
            cmdline: String::new(),
            kvm_device: "/dev/kvm".into(),
            disk_size: None,
            confine: None,
            network: None,
        };
        let b = Builds::new(&d, Some(cfg.clone()));
        let (t, waiting, _) = b.request("app", &[], None, None).unwrap();
        let (_, done, tags) = b
            .request("team/app:v1", &["stable".to_string()], Some(2), Some(1024))
            .unwrap();
        assert_eq!(tags, ["v1", "stable"]);
        assert!(crate::template::is_build_id(&done), "{done}");
        {
            let x = b.get(&t, &done).unwrap();
            let mut g = lock(&x);
            g.status = BuildStatus::Ready;
            g.logs.push(LogLine {
                ms: 1,
                level: "info".into(),
                message: "template app built".into(),
            });
            b.save(&done, &g);
        }
        // A build that was running: its work directory is left behind.
        let work = d.join("build-jobs").join(&waiting);
        std::fs::create_dir_all(&work).unwrap();
        // Files that are no build's record.
        std::fs::write(d.join("builds/not-a-build.json"), b"{}").unwrap();
        std::fs::write(
            d.join("builds").join(format!("{}.json", "0".repeat(20))),
            b"garbage",
        )
        .unwrap();
        drop(b);

        let b = Builds::new(&d, Some(cfg));
        let x = b.get(&t, &done).unwrap();
        let g = lock(&x);
        assert_eq!(
            (g.status, g.vcpus, g.mem_mib),
            (BuildStatus::Ready, 2, 1024)
        );
        assert_eq!(g.logs[0].message, "template app built");
        drop(g);
        let x = b.get(&t, &waiting).unwrap();
        let g = lock(&x);
        assert_eq!(g.status, BuildStatus::Error);
        assert!(g
            .reason
            .as_deref()
            .unwrap()
            .contains("stopped during this build"));
        assert_eq!(g.logs.last().unwrap().level, "error");
        assert!(!work.exists());
        let left: Vec<String> = std::fs::read_dir(d.join("builds"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(b.get("other", &done).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// One build's conversion is unpacking an image into its scratch in the build cache
    /// (its `/etc/shadow` 0600 in a 0700 directory) while another build shares what its
    /// jailed VM reads of the same cache: only that build's layers become readable.
    #[test]
    fn a_build_sharing_its_layers_leaves_another_builds_tree_alone() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = std::env::temp_dir().join(format!("sandbox-build-share-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let cache = LayerCache::new(&d.join(".build-cache"));
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        // Build A, mid-unpack.
        let a_tree = cache.dir().join("images/.scratch-a/tree");
        std::fs::create_dir_all(a_tree.join("etc")).unwrap();
        std::fs::create_dir_all(a_tree.join("root/.ssh")).unwrap();
        std::fs::write(a_tree.join("etc/shadow"), b"root:*:").unwrap();
        std::fs::write(a_tree.join("root/.ssh/id_ed25519"), b"key").unwrap();
        let set = |p: PathBuf, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        set(cache.dir().join("images/.scratch-a"), 0o700);
        set(a_tree.join("etc/shadow"), 0o600);
        set(a_tree.join("root/.ssh"), 0o700);
        set(a_tree.join("root/.ssh/id_ed25519"), 0o600);
        // Build B: a converted base and a step layer on it, written 0600.
        let base = cache.dir().join("images/b.cdsk");
        disk::ops::create(
            &base,
            &disk::ops::CreateOptions {
                virtual_size: Some(1 << 20),
                ..Default::default()
            },
        )
        .unwrap();
        disk::ops::freeze(&base).unwrap();
        let run = cache.dir().join("run-b");
        std::fs::create_dir_all(&run).unwrap();
        let top = run.join("step.cdsk");
        disk::ops::create_overlay(&top, &base).unwrap();
        set(base.clone(), 0o600);
        set(top.clone(), 0o600);
        set(run.clone(), 0o700);

        set(cache.dir().to_path_buf(), 0o700);
        share_chain(&cache, &top).unwrap();
        assert_eq!(mode(cache.dir()), 0o711);

        assert_eq!(mode(&base) & 0o444, 0o444);
        assert_eq!(mode(&top) & 0o444, 0o444);
        assert_eq!(mode(&run) & 0o111, 0o111);
        assert_eq!(mode(&cache.dir().join("images/.scratch-a")), 0o700);
        assert_eq!(mode(&a_tree.join("etc/shadow")), 0o600);
        assert_eq!(mode(&a_tree.join("root/.ssh")), 0o700);
        assert_eq!(mode(&a_tree.join("root/.ssh/id_ed25519")), 0o600);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A COPY's files are host files only: a device node, a FIFO or a set-id bit in them
    /// is refused, never made; owners are the service's.
    #[test]
    fn a_copys_files_make_no_device_node_or_set_id_file() {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let d = std::env::temp_dir().join(format!("sandbox-build-ctx-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("ctx")).unwrap();
        let tar_of = |entries: &[(&str, tar::EntryType, u32, u64)]| {
            let mut t = tar::Builder::new(Vec::new());
            for &(name, kind, mode, uid) in entries {
                let mut h = tar::Header::new_gnu();
                h.set_entry_type(kind);
                h.set_size(if kind == tar::EntryType::Regular {
                    1
                } else {
                    0
                });
                h.set_mode(mode);
                h.set_uid(uid);
                h.set_gid(uid);
                if matches!(kind, tar::EntryType::Block | tar::EntryType::Char) {
                    h.set_device_major(1).unwrap();
                    h.set_device_minor(1).unwrap();
                }
                let data: &[u8] = if kind == tar::EntryType::Regular {
                    b"x"
                } else {
                    b""
                };
                t.append_data(&mut h, name, data).unwrap();
            }
            let p = d.join(format!("{}.tar", entries[0].0.replace('/', "_")));
            std::fs::write(&p, t.into_inner().unwrap()).unwrap();
            p
        };
        let ctx = d.join("ctx");
        let mut refused = Vec::new();
        for bad in [
            ("mem", tar::EntryType::Char, 0o666, 0),
            ("sda", tar::EntryType::Block, 0o666, 0),
            ("fifo", tar::EntryType::Fifo, 0o666, 0),
            ("suid-id", tar::EntryType::Regular, 0o4755, 0),
            ("sgid-id", tar::EntryType::Regular, 0o2755, 0),
        ] {
            refused.push((bad.0, unpack_context(&tar_of(&[bad]), &ctx).is_err()));
        }
        let ok = tar_of(&[
            ("app/run.sh", tar::EntryType::Regular, 0o755, 1234),
            ("app/key", tar::EntryType::Regular, 0o600, 1234),
        ]);
        unpack_context(&ok, &ctx).unwrap();
        let m = std::fs::metadata(ctx.join("app/key")).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o7777), (0, 0o600));
        assert_eq!(
            std::fs::metadata(ctx.join("app/run.sh")).unwrap().mode() & 0o7777,
            0o755
        );
        // Nothing of the refused entries on the host.
        for e in std::fs::read_dir(&ctx).unwrap().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            let ft = m.file_type();
            assert!(
                !(ft.is_char_device() || ft.is_block_device() || ft.is_fifo())
                    && m.mode() & 0o6000 == 0,
                "{}",
                e.path().display()
            );
        }
        assert!(refused.iter().all(|(_, r)| *r), "not refused: {refused:?}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A build whose steps print without end keeps at most [`MAX_LOG_BYTES`] of log
    /// text and says it left the rest out.
    #[test]
    fn a_builds_log_is_bounded_in_bytes() {
        let mut b = Build {
            template: "t".into(),
            vcpus: 1,
            mem_mib: 64,
            status: BuildStatus::Building,
            logs: Vec::new(),
            reason: None,
            tags: Vec::new(),
            dir: String::new(),
            log_bytes: 0,
        };
        let line = "x".repeat(clade_builder::layers::MAX_LOG_LINE);
        for _ in 0..10_000 {
            b.log("info", &line);
        }
        let kept: usize = b.logs.iter().map(|l| l.message.len()).sum();
        assert!(kept <= MAX_LOG_BYTES + 200, "{kept} bytes kept");
        let last = b.logs.last().unwrap();
        assert_eq!(last.level, "warn");
        assert!(last.message.contains("left out"), "{}", last.message);
        assert_eq!(b.logs.iter().filter(|l| l.level == "warn").count(), 1);
    }
}

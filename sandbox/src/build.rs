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
//!
//! This file holds the build's types and records ([`Builds`], [`Build`], its status and
//! log) and the service's limits; the work is in `records` (requesting, keeping and
//! reloading builds), `uploads` (COPY steps' files by hash, behind signed links), `start`
//! (a start's checks), `run` (the build itself, on its own thread) and `steps` (E2B's steps
//! as a Dockerfile plan).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::template::TemplateStore;

mod records;
mod run;
mod start;
mod steps;
mod uploads;

pub use run::BASE_TEMPLATE;

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
}

/// Step and build names for tests.
#[cfg(test)]
mod tests {
    use clade_builder::dockerfile::Action;
    use clade_builder::layers::LayerCache;
    use clade_image::ImageDefaults;

    use super::run::{is_e2b_base_image, share_chain, unpack_context};
    use super::steps::plan_of;
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

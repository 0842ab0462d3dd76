//! Templates: what a sandbox starts from. A template is a directory
//! `<state dir>/templates/<name>/` with `template.json` (this module's [`Template`]) and
//! `snapshot/` (a full snapshot of a VM that booted and ran the template's setup commands;
//! with a disk, the snapshot names its frozen disk layer, which lives next to it).
//!
//! `clade template build` writes one (it boots the VM; see the CLI); `clade serve` only
//! reads them: creating a sandbox restores `snapshot/`, so every sandbox of a template shares
//! the template's memory file and disk layer copy-on-write. A template is complete only once
//! `template.json` exists (written last, atomically), so a build that failed half-way is
//! never offered.
//!
//! A persistent snapshot of a sandbox (E2B `createSnapshot`) is a template too, in a second
//! store under `<state dir>/sandboxes/snapshots/` ([`TemplateStore::at`]): a running VM may
//! write snapshots only under the sandboxes directory (its `--files-root`), and the registry
//! records where each snapshot came from.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub mod tags;

/// The file that makes a template directory a template.
pub const TEMPLATE_FILE: &str = "template.json";
/// The snapshot directory inside a template.
pub const SNAPSHOT_DIR: &str = "snapshot";

/// A built template, as `template.json` records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// Its name (the E2B `templateID`).
    pub name: String,
    /// vCPUs of its VM.
    pub vcpus: u32,
    /// Guest memory (MiB).
    pub mem_mib: u64,
    /// Whether the VM has a disk (each sandbox then gets its own overlay).
    pub disk: bool,
    /// The project's bare-metal test guest (answers only the agent's Hello and Ping): no
    /// agent sync after restore or fork, no setup commands.
    pub test_guest: bool,
    /// When it was built (ms since the epoch).
    pub created_ms: i64,
    /// The setup commands it ran.
    #[serde(default)]
    pub setup: Vec<String>,
    /// The VM has a network device (virtio-net, the guest at `hostnet::GUEST_IP`): each
    /// sandbox then gets a network of its own (`crate::net`).
    #[serde(default)]
    pub net: bool,
    /// The container image its disk was made from, and the defaults its config gives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<FromImage>,
    /// How its VM booted: what a sandbox whose memory was dropped (a filesystem-only
    /// pause, a reboot on resume) boots from its own disk. `None`: a template built before
    /// builds recorded it; its sandboxes can only be restored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<BootRecord>,
    /// The id of the build that made it (E2B's `buildID`, a UUID). `None`: built by the
    /// CLI or before builds had ids; [`Template::build_id`] then derives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_id: Option<String>,
}

impl Template {
    /// Its build's id: the one recorded, else a UUID derived from its name and build time
    /// (the same as long as this build is the one there).
    pub fn build_id(&self) -> String {
        if let Some(id) = &self.build_id {
            return id.clone();
        }
        use sha2::Digest;
        let h = sha2::Sha256::digest(format!("clade-build\0{}\0{}", self.name, self.created_ms));
        let mut b = [0u8; 16];
        b.copy_from_slice(&h[..16]);
        uuid_text(b)
    }
}

/// A new random build id (a version-4 UUID, the form E2B's SDK parses).
pub fn new_build_id() -> Result<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| Error::Vm(format!("randomness: {e}")))?;
    Ok(uuid_text(b))
}

fn uuid_text(mut b: [u8; 16]) -> String {
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Whether `id` has a UUID's form (lower-case hex).
pub fn is_build_id(id: &str) -> bool {
    id.len() == 36
        && id.bytes().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
        })
}

/// Whether `dir` names a template's directory: a template name, or `name@<build id>` (a
/// build of template `name` kept under a tag, [`tags`]).
pub fn valid_dir_name(dir: &str) -> bool {
    match dir.split_once('@') {
        None => valid_name(dir),
        Some((name, id)) => valid_name(name) && is_build_id(id),
    }
}

/// The directory inside a template that holds the kernel and initramfs its VM booted.
pub const BOOT_DIR: &str = "boot";

/// How a template's VM booted. The kernel and initramfs are copies in the `boot/`
/// directory of the built template named `template` (a snapshot of a sandbox names the
/// template it stands on), so that they stay as long as the template does and are readable
/// wherever its snapshot is (a jailed VM process sees the templates directory).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootRecord {
    /// The built template whose `boot/` directory holds the files.
    pub template: String,
    /// The kernel's file name in it.
    pub kernel: String,
    /// The initramfs's file name in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<String>,
    /// The kernel command line it booted with (the network's addresses included).
    pub cmdline: String,
}

/// A boot record's files, resolved to paths in a template store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootFiles {
    /// The kernel.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: Option<PathBuf>,
    /// The kernel command line.
    pub cmdline: String,
}

/// What a template built from a container image keeps of it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FromImage {
    /// The image as given to the build.
    pub reference: String,
    /// The config's `Env`: every sandbox's environment, under the variables its create
    /// request sets.
    pub env: std::collections::BTreeMap<String, String>,
    /// The config's `WorkingDir` (or the Dockerfile's `WORKDIR`): where a command that
    /// names no working directory starts ("": the user's home).
    pub cwd: String,
    /// The config's `User` (or the Dockerfile's `USER`): whom a request that names no user
    /// runs as ("": root).
    pub user: String,
    /// `Entrypoint` + `Cmd` (recorded; not started by the service).
    pub start_cmd: Vec<String>,
}

/// Whether `name` is usable as a template name (a directory name; what E2B accepts as an id
/// or alias: letters, digits, `-`, `_`, `.`, not starting with `.`).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// The templates under one state directory.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    root: PathBuf,
}

impl TemplateStore {
    /// The store of `<state_dir>/templates`.
    pub fn new(state_dir: &Path) -> Self {
        Self {
            root: state_dir.join("templates"),
        }
    }

    /// A store rooted at `root` itself (the snapshot templates' store).
    pub fn at(root: PathBuf) -> Self {
        Self { root }
    }

    /// The directory template `name` lives (or would live) in.
    pub fn dir(&self, name: &str) -> Result<PathBuf> {
        if !valid_dir_name(name) {
            return Err(Error::BadRequest(format!(
                "'{name}' is not a template name (letters, digits, '-', '_', '.')"
            )));
        }
        Ok(self.root.join(name))
    }

    /// The layer cache of template builds (Dockerfile steps, E2B build steps, converted
    /// base images): `templates/.build-cache`, inside the templates directory because a
    /// template stands on its layers, and every jailed VM process sees that directory
    /// (also a standby jailed before the template was built). No template can be named so
    /// (names do not start with `.`).
    pub fn build_cache_dir(&self) -> PathBuf {
        self.root.join(".build-cache")
    }

    /// Its snapshot directory.
    pub fn snapshot_dir(&self, name: &str) -> Result<PathBuf> {
        Ok(self.dir(name)?.join(SNAPSHOT_DIR))
    }

    /// The files of `boot` in this store, checked to exist (a clear error naming what is
    /// missing, never a VM started without its kernel).
    pub fn boot_files(&self, boot: &BootRecord) -> Result<BootFiles> {
        let dir = self.dir(&boot.template)?.join(BOOT_DIR);
        let file = |name: &str| -> Result<PathBuf> {
            if !valid_name(name) {
                return Err(Error::TemplateBroken {
                    name: boot.template.clone(),
                    why: format!("'{name}' is not a file name in its boot directory"),
                });
            }
            let path = dir.join(name);
            if !path.is_file() {
                return Err(Error::TemplateBroken {
                    name: boot.template.clone(),
                    why: format!("{} is missing", path.display()),
                });
            }
            Ok(path)
        };
        Ok(BootFiles {
            kernel: file(&boot.kernel)?,
            initrd: boot.initrd.as_deref().map(file).transpose()?,
            cmdline: boot.cmdline.clone(),
        })
    }

    /// Keeps a copy of `kernel` and `initrd` in template `name`'s `boot/` directory (a hard
    /// link where the file system allows it) and returns the record of the boot.
    pub fn keep_boot(
        &self,
        name: &str,
        kernel: &Path,
        initrd: Option<&Path>,
        cmdline: &str,
    ) -> Result<BootRecord> {
        let dir = self.dir(name)?.join(BOOT_DIR);
        std::fs::create_dir_all(&dir).map_err(Error::io("creating", &dir))?;
        let keep = |src: &Path, as_name: &str| -> Result<String> {
            let dst = dir.join(as_name);
            let _ = std::fs::remove_file(&dst);
            if std::fs::hard_link(src, &dst).is_err() {
                std::fs::copy(src, &dst).map_err(Error::io("copying", src))?;
            }
            Ok(as_name.to_string())
        };
        Ok(BootRecord {
            template: name.to_string(),
            kernel: keep(kernel, "kernel")?,
            initrd: initrd.map(|i| keep(i, "initrd")).transpose()?,
            cmdline: cmdline.to_string(),
        })
    }

    /// The template `name`, if it was built completely.
    pub fn get(&self, name: &str) -> Result<Template> {
        let file = self.dir(name)?.join(TEMPLATE_FILE);
        let text = match std::fs::read_to_string(&file) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::TemplateNotFound(name.to_string()))
            }
            Err(e) => return Err(Error::io("reading", file)(e)),
        };
        let t: Template = serde_json::from_str(&text).map_err(|e| Error::TemplateBroken {
            name: name.into(),
            why: format!("{}: {e}", file.display()),
        })?;
        if t.name != name {
            return Err(Error::TemplateBroken {
                name: name.into(),
                why: format!("{} names template '{}'", file.display(), t.name),
            });
        }
        Ok(t)
    }

    /// Every complete template, by name.
    pub fn list(&self) -> Result<Vec<Template>> {
        let entries = match std::fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("listing", &self.root)(e)),
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            match self.get(&name) {
                Ok(t) => out.push(t),
                Err(Error::TemplateNotFound(_)) | Err(Error::BadRequest(_)) => {}
                Err(e) => tracing::warn!("skipping template {name}: {e}"),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Prepares an empty directory for building template `name` (refuses an existing one
    /// unless `replace`). Returns the directory.
    pub fn prepare(&self, name: &str, replace: bool) -> Result<PathBuf> {
        let dir = self.dir(name)?;
        if dir.exists() {
            if !replace && dir.join(TEMPLATE_FILE).exists() {
                return Err(Error::Conflict(format!(
                    "template {name} exists (remove it first: clade template rm {name})"
                )));
            }
            std::fs::remove_dir_all(&dir).map_err(Error::io("removing", &dir))?;
        }
        std::fs::create_dir_all(&dir).map_err(Error::io("creating", &dir))?;
        Ok(dir)
    }

    /// Records a finished build (written to a temporary file and renamed: atomic).
    pub fn finish(&self, t: &Template) -> Result<()> {
        let dir = self.dir(&t.name)?;
        let tmp = dir.join(".template.json.tmp");
        let text = serde_json::to_string_pretty(t).map_err(|e| Error::Corrupt(e.to_string()))?;
        std::fs::write(&tmp, text).map_err(Error::io("writing", &tmp))?;
        let file = dir.join(TEMPLATE_FILE);
        std::fs::rename(&tmp, &file).map_err(Error::io("renaming", &file))
    }

    /// Removes template `name`: every build of it and its tags. Sandboxes created from it
    /// must be gone first (their memory and disk are the template's files); `in_use` says
    /// how many are not (of all its builds, [`TemplateStore::builds`]).
    pub fn remove(&self, name: &str, in_use: usize) -> Result<()> {
        let builds = self.builds(name)?;
        if builds.is_empty() {
            return Err(Error::TemplateNotFound(name.to_string()));
        }
        if in_use > 0 {
            return Err(Error::Conflict(format!(
                "template {name} is used by {in_use} sandbox(es); kill them first"
            )));
        }
        for b in builds {
            self.remove_build(&b)?;
        }
        self.forget_tags(name)
    }

    /// Removes one build's directory (`name` or `name@<build id>`).
    pub fn remove_build(&self, build: &str) -> Result<()> {
        let dir = self.dir(build)?;
        std::fs::remove_dir_all(&dir).map_err(Error::io("removing", &dir))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sandbox-tpl-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn t(name: &str) -> Template {
        Template {
            name: name.into(),
            vcpus: 1,
            mem_mib: 64,
            disk: false,
            test_guest: true,
            created_ms: 1,
            setup: vec![],
            net: false,
            image: None,
            boot: None,
            build_id: None,
        }
    }

    #[test]
    fn build_list_get_remove() {
        let d = tmp("cycle");
        let s = TemplateStore::new(&d);
        assert!(s.list().unwrap().is_empty());
        assert!(matches!(s.get("a"), Err(Error::TemplateNotFound(_))));
        s.prepare("a", false).unwrap();
        // Not finished: not a template yet.
        assert!(s.list().unwrap().is_empty());
        s.finish(&t("a")).unwrap();
        assert_eq!(s.get("a").unwrap(), t("a"));
        assert!(matches!(s.prepare("a", false), Err(Error::Conflict(_))));
        s.prepare("b", false).unwrap();
        s.finish(&t("b")).unwrap();
        let names: Vec<_> = s.list().unwrap().into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(matches!(s.remove("a", 2), Err(Error::Conflict(_))));
        s.remove("a", 0).unwrap();
        assert!(matches!(s.get("a"), Err(Error::TemplateNotFound(_))));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_kept_boot_resolves_and_a_missing_or_escaping_file_is_refused() {
        let d = tmp("boot");
        let s = TemplateStore::new(&d);
        s.prepare("a", false).unwrap();
        let src = d.join("vmlinuz");
        std::fs::write(&src, b"kernel").unwrap();
        let boot = s.keep_boot("a", &src, None, "console=ttyS0").unwrap();
        let files = s.boot_files(&boot).unwrap();
        assert_eq!(std::fs::read(&files.kernel).unwrap(), b"kernel");
        assert_eq!(files.initrd, None);
        assert_eq!(files.cmdline, "console=ttyS0");
        // The source may go: the template keeps its own.
        std::fs::remove_file(&src).unwrap();
        assert!(s.boot_files(&boot).is_ok());
        for bad in ["../../etc/passwd", "missing", ""] {
            let b = BootRecord {
                kernel: bad.into(),
                ..boot.clone()
            };
            assert!(
                matches!(s.boot_files(&b), Err(Error::TemplateBroken { .. })),
                "{bad}"
            );
        }
        let b = BootRecord {
            template: "../x".into(),
            ..boot.clone()
        };
        assert!(s.boot_files(&b).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn names_cannot_escape_the_store() {
        let s = TemplateStore::new(Path::new("/nonexistent"));
        for bad in ["", "..", "../x", "a/b", ".hidden", "a b"] {
            assert!(matches!(s.dir(bad), Err(Error::BadRequest(_))), "{bad}");
        }
        assert!(s.dir("base-1.2_x").is_ok());
    }

    #[test]
    fn a_garbled_template_file_is_an_error_not_a_panic() {
        let d = tmp("garbled");
        let s = TemplateStore::new(&d);
        let dir = s.prepare("g", false).unwrap();
        std::fs::write(dir.join(TEMPLATE_FILE), "{not json").unwrap();
        assert!(matches!(s.get("g"), Err(Error::TemplateBroken { .. })));
        assert!(s.list().unwrap().is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }
}

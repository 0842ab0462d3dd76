//! `--jail DIR --uid U --gid G` for `clade run` and `clade restore`: which paths a VM
//! needs in its jail, worked out from its arguments (the jail itself is the library's,
//! [`vmm::host::jail`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use vmm::host::jail::{self, Access, CgroupLimits, JailConfig, Jailed, StarterLink};

/// What [`JailArgs::enter_linked`] returned in.
pub enum Entered {
    /// Go on and run the VM: in the jail (with its link to the waiting process), or
    /// unjailed.
    Run(Option<StarterLink>),
    /// The jailed VM ended with this code.
    Ended(u8),
}

/// Jail options shared by `run` and `restore`.
#[derive(Debug, Args, Clone)]
pub struct JailArgs {
    /// Run the VM in a jail whose root is mounted on DIR (empty or missing; nothing is
    /// written into it on the host): new mount, PID, IPC, UTS and network namespaces, only the
    /// files the VM needs (at their usual paths), privileges dropped to --uid/--gid.
    /// Needs root. The directories of the sockets, the serial file, the disk's top layer
    /// and --files-root are shown read-write: give the VM directories of its own.
    #[arg(long, value_name = "DIR", requires_all = ["uid", "gid"])]
    jail: Option<PathBuf>,
    /// The user the jailed VM runs as (not 0).
    #[arg(long, requires = "jail")]
    uid: Option<u32>,
    /// The group the jailed VM runs as (not 0).
    #[arg(long, requires = "jail")]
    gid: Option<u32>,
    /// The jail's cgroup memory limit (bytes, or 512M, 2G; guest memory counts).
    #[arg(long, value_name = "SIZE", requires = "jail", value_parser = parse_bytes)]
    jail_memory_max: Option<u64>,
    /// The jail's cgroup limit on processes and threads.
    #[arg(long, value_name = "N", requires = "jail")]
    jail_pids_max: Option<u64>,
    /// The jail's cgroup CPU limit, in CPUs (e.g. 1.5).
    #[arg(long, value_name = "CPUS", requires = "jail")]
    jail_cpus: Option<f64>,
    /// Also show this file or directory in the jail, read-only (repeatable): for a
    /// standby, the directories its restore requests may name snapshots in.
    #[arg(long, value_name = "PATH", requires = "jail")]
    jail_read: Vec<PathBuf>,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, shift) = match t.as_bytes().last() {
        Some(b'K' | b'k') => (&t[..t.len() - 1], 10),
        Some(b'M' | b'm') => (&t[..t.len() - 1], 20),
        Some(b'G' | b'g') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| format!("'{s}' is not a size (examples: 1073741824, 512M, 2G)"))
}

/// The paths a jailed VM needs, collected from its arguments.
#[derive(Debug, Default)]
pub struct JailPaths(Vec<(PathBuf, Access)>);

impl JailPaths {
    /// A file the VM only reads.
    pub fn read(&mut self, path: &Path) -> anyhow::Result<()> {
        let p = std::path::absolute(path)
            .with_context(|| format!("{}: cannot make the path absolute", path.display()))?;
        self.0.push((p, Access::ReadOnly));
        Ok(())
    }

    /// A directory the VM writes in.
    pub fn write_dir(&mut self, dir: &Path) -> anyhow::Result<()> {
        let p = std::path::absolute(dir)
            .with_context(|| format!("{}: cannot make the path absolute", dir.display()))?;
        self.0.push((p, Access::ReadWrite));
        Ok(())
    }

    /// The directory a file the VM creates (a socket, the serial file) goes in.
    pub fn write_dir_of(&mut self, file: &Path) -> anyhow::Result<()> {
        let p = std::path::absolute(file)
            .with_context(|| format!("{}: cannot make the path absolute", file.display()))?;
        match p.parent() {
            Some(dir) if dir != Path::new("/") => self.write_dir(dir),
            _ => bail!(
                "{}: a jailed VM's files must not be directly in /",
                p.display()
            ),
        }
    }

    /// A disk whose top layer is `top`: written, with new layers next to it when the VM
    /// snapshots (its directory read-write); the layers below it only read. A layer filled
    /// on demand (a store's, in its fetcher's cache) is shown with its marker: without it,
    /// the VM would take the layer for a whole one and read its missing blocks as zeros.
    pub fn disk(&mut self, top: &Path, writable: bool) -> anyhow::Result<()> {
        let layers = disk::ops::info(top).with_context(|| format!("disk {}", top.display()))?;
        for (i, layer) in layers.iter().enumerate() {
            if i == 0 && writable {
                self.write_dir_of(&layer.path)?;
            } else {
                self.read(&layer.path)?;
                if disk::remote::is_filled_on_demand(&layer.path) {
                    self.on_demand_sidecars(&layer.path)?;
                }
            }
        }
        Ok(())
    }
}

impl JailPaths {
    /// The files beside a layer filled on demand (`<layer>.present`, its entry and chunk
    /// checksums: `<layer>.<ext>`), which the VM reads to have its blocks fetched.
    fn on_demand_sidecars(&mut self, layer: &Path) -> anyhow::Result<()> {
        let (Some(dir), Some(name)) = (layer.parent(), layer.file_name()) else {
            return Ok(());
        };
        let mut prefix = name.to_os_string();
        prefix.push(".");
        let prefix = prefix.as_encoded_bytes().to_vec();
        let entries = std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))?;
        for e in entries.flatten() {
            if e.file_name().as_encoded_bytes().starts_with(&prefix) {
                self.read(&e.path())?;
            }
        }
        Ok(())
    }
}

impl JailArgs {
    /// Enters the jail if one was asked for: `Ok(None)` means go on running the VM (in the
    /// jail, or unjailed); `Ok(Some(code))` means the jailed VM ended with `code`.
    pub fn enter(
        &self,
        kvm_device: &Path,
        paths: impl FnOnce(&mut JailPaths) -> anyhow::Result<()>,
    ) -> anyhow::Result<Option<u8>> {
        Ok(match self.enter_linked(kvm_device, paths)? {
            Entered::Run(_) => None,
            Entered::Ended(code) => Some(code),
        })
    }

    /// [`Self::enter`], keeping the jailed VM's link to the process that waits for the
    /// jail (a standby tells it when it holds a sandbox's VM).
    pub fn enter_linked(
        &self,
        kvm_device: &Path,
        paths: impl FnOnce(&mut JailPaths) -> anyhow::Result<()>,
    ) -> anyhow::Result<Entered> {
        let Some(root) = &self.jail else {
            return Ok(Entered::Run(None));
        };
        let (Some(uid), Some(gid)) = (self.uid, self.gid) else {
            bail!("--jail needs --uid and --gid");
        };
        let mut p = JailPaths::default();
        paths(&mut p)?;
        for extra in &self.jail_read {
            p.read(extra)?;
        }
        let config = JailConfig {
            root: std::path::absolute(root)
                .with_context(|| format!("{}: cannot make the path absolute", root.display()))?,
            uid,
            gid,
            name: jail_name(root),
            limits: CgroupLimits {
                memory_max: self.jail_memory_max,
                pids_max: self.jail_pids_max,
                cpus: self.jail_cpus,
                ..Default::default()
            },
            paths: p.0,
            kvm_device: kvm_device.to_path_buf(),
        };
        Ok(match jail::enter(&config)? {
            Jailed::Inside(link) => Entered::Run(Some(link)),
            Jailed::Ended(code) => Entered::Ended(code),
        })
    }

    /// In a jail the working directory is its root: the paths the VM is given are made
    /// absolute first (nothing changes unjailed).
    pub fn absolute<'a>(
        &self,
        paths: impl IntoIterator<Item = &'a mut PathBuf>,
    ) -> anyhow::Result<()> {
        if self.jailed() {
            for p in paths {
                *p = std::path::absolute(&*p)
                    .with_context(|| format!("{}: cannot make the path absolute", p.display()))?;
            }
        }
        Ok(())
    }

    /// A jailed VM with a control API must be told where its snapshots and forks may go:
    /// only directories shown in the jail exist for it.
    pub fn require_files_root(&self, api_sock: bool, files_root: bool) -> anyhow::Result<()> {
        if self.jailed() && api_sock && !files_root {
            bail!(
                "a jailed VM with --api-sock needs --files-root (where its snapshots and forks go)"
            );
        }
        Ok(())
    }

    /// Whether a jail was asked for.
    pub fn jailed(&self) -> bool {
        self.jail.is_some()
    }
}

/// The jail's host name and cgroup name: its directory's name, reduced to letters, digits,
/// '-' and '_'.
fn jail_name(root: &Path) -> String {
    let name: String = root
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    if name.is_empty() {
        "vm".into()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert!(parse_bytes("many").is_err());
        assert!(parse_bytes("99999999999999G").is_err());
    }

    #[test]
    fn jail_names_are_safe() {
        assert_eq!(jail_name(Path::new("/srv/jails/vm 1.x")), "vm-1-x");
        assert_eq!(jail_name(Path::new("/")), "vm");
    }
}

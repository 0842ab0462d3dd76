//! cgroups for VM processes: CPU, memory, process and I/O limits, on cgroup v2 or v1.
//!
//! Hosts differ: a current distribution mounts one cgroup v2 hierarchy at `/sys/fs/cgroup`
//! with every controller; this project's own machines mount v1 hierarchies (one per
//! controller, at `/sys/fs/cgroup/<controller>`) and a v2 one without controllers. A
//! [`Hierarchy`] is what [`Hierarchy::detect`] finds: v2 when its root offers the
//! controllers the limits need, else the v1 mounts. Limits that cannot be applied are an
//! error that names what is missing — a VM never runs silently without the limits it was
//! given — except the I/O weight, which needs a block scheduler with weights (BFQ) and is
//! applied where the host has one ([`Hierarchy::io_weight_supported`] says which).
//!
//! A [`Cgroup`] is one group, named by a path relative to each hierarchy's root (the same
//! name in every v1 controller it uses). Processes join it by writing their pid to its
//! `cgroup.procs` files ([`Cgroup::procs_files`]: a process about to exec a VM can open them
//! first and write to them between fork and exec); it is removed once they ended.

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Limits of a cgroup. Each is applied only when set.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CgroupLimits {
    /// Memory, bytes (guest memory counts: it is the VM process's memory). No swap beyond
    /// it where the host can say so.
    pub memory_max: Option<u64>,
    /// Processes and threads.
    pub pids_max: Option<u64>,
    /// CPU time as a number of CPUs' worth (e.g. 1.5): a hard quota per 100 ms period.
    pub cpus: Option<f64>,
    /// Relative CPU weight under contention, 1..=10000 (v2 `cpu.weight`; 100 is the
    /// default; v1 `cpu.shares` = weight × 1024 / 100).
    pub cpu_weight: Option<u32>,
    /// Relative I/O weight, 1..=10000 (v2 `io.weight`/`io.bfq.weight`, v1
    /// `blkio.bfq.weight`/`blkio.weight` scaled to 1..=1000). Best effort: see the module
    /// documentation.
    pub io_weight: Option<u32>,
}

impl CgroupLimits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.memory_max.is_some()
            || self.pids_max.is_some()
            || self.cpus.is_some()
            || self.cpu_weight.is_some()
            || self.io_weight.is_some()
    }

    fn check(&self) -> Result<()> {
        if let Some(c) = self.cpus {
            if !(c.is_finite() && c > 0.0 && c <= 4096.0) {
                return Err(cg_err("the CPU limit must be a positive number of CPUs"));
            }
        }
        for (w, name) in [(self.cpu_weight, "CPU"), (self.io_weight, "I/O")] {
            if w.is_some_and(|w| !(1..=10_000).contains(&w)) {
                return Err(cg_err(format!("the {name} weight must be 1 to 10000")));
            }
        }
        if self.memory_max == Some(0) || self.pids_max == Some(0) {
            return Err(cg_err(
                "a memory or process limit of 0 would stop the VM at once",
            ));
        }
        Ok(())
    }

    /// The controllers these limits need (v1 names).
    fn controllers(&self) -> Vec<&'static str> {
        let mut c = Vec::new();
        if self.memory_max.is_some() {
            c.push("memory");
        }
        if self.pids_max.is_some() {
            c.push("pids");
        }
        if self.cpus.is_some() || self.cpu_weight.is_some() {
            c.push("cpu");
        }
        c
    }
}

fn cg_err(msg: impl Into<String>) -> Error {
    Error::Cgroup(msg.into())
}

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The controllers a v1 host mounts that a cgroup here uses.
const V1_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "blkio"];

/// Where this host's cgroups are.
#[derive(Debug, Clone, PartialEq)]
pub enum Hierarchy {
    /// One cgroup v2 hierarchy at this root.
    V2(PathBuf),
    /// cgroup v1: each controller's mount point.
    V1(Vec<(&'static str, PathBuf)>),
}

impl Hierarchy {
    /// Finds the hierarchy that can apply `limits`: cgroup v2 at `/sys/fs/cgroup` when it
    /// has their controllers, else the v1 controllers' mounts; an error naming what is
    /// missing otherwise.
    pub fn detect(limits: &CgroupLimits) -> Result<Hierarchy> {
        limits.check()?;
        let want = limits.controllers();
        let root = Path::new(CGROUP_ROOT);
        let mut v2_missing = Vec::new();
        if let Ok(have) = fs::read_to_string(root.join("cgroup.controllers")) {
            let have: Vec<&str> = have.split_whitespace().collect();
            v2_missing = want.iter().filter(|c| !have.contains(c)).copied().collect();
            if v2_missing.is_empty() {
                return Ok(Hierarchy::V2(root.to_path_buf()));
            }
        }
        let mounts = fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| cg_err(format!("/proc/self/mountinfo: {e}")))?;
        let v1 = v1_mounts(&mounts);
        let missing: Vec<&str> = want
            .iter()
            .filter(|c| !v1.iter().any(|(n, _)| n == *c))
            .copied()
            .collect();
        if missing.is_empty() {
            return Ok(Hierarchy::V1(v1));
        }
        Err(cg_err(if v2_missing.is_empty() {
            format!(
                "no cgroup hierarchy for the limits: no cgroup v2 at {CGROUP_ROOT} and no cgroup \
                 v1 mount of: {}",
                missing.join(", ")
            )
        } else {
            format!(
                "cgroup limits need these controllers, which neither this host's cgroup v2 \
                 (at {CGROUP_ROOT}) nor a cgroup v1 mount offers: {}",
                missing.join(", ")
            )
        }))
    }

    /// Whether an I/O weight can be applied to a cgroup made here and means something: a
    /// block device uses BFQ (the scheduler with weights) and the cgroup has its weight
    /// file. Creates and removes a probe group under `parent`.
    pub fn io_weight_supported(&self, parent: &str) -> bool {
        // A weight is honoured only by BFQ: some block device must use it.
        let bfq = fs::read_dir("/sys/block").is_ok_and(|rd| {
            rd.flatten().any(|d| {
                fs::read_to_string(d.path().join("queue/scheduler"))
                    .is_ok_and(|s| s.contains("[bfq]"))
            })
        });
        if !bfq {
            return false;
        }
        let probe = format!("{parent}/io-probe-{}", std::process::id());
        let Ok(cg) = Cgroup::create(self, &probe, &CgroupLimits::default()) else {
            return false;
        };
        let ok = cg.io_weight_file().is_some();
        let _ = cg.remove();
        ok
    }

    /// The cgroup named `name` (relative, e.g. `clade/vm-1`) whether or not it exists.
    pub fn cgroup(&self, name: &str) -> Result<Cgroup> {
        check_name(name)?;
        let dirs = match self {
            Hierarchy::V2(root) => vec![("", root.join(name))],
            Hierarchy::V1(mounts) => {
                let mut dirs: Vec<(&'static str, PathBuf)> = Vec::new();
                for (c, m) in mounts {
                    let d = m.join(name);
                    // Controllers may share one mount (memory,pids): one directory.
                    if !dirs.iter().any(|(_, x)| *x == d) {
                        dirs.push((c, d));
                    }
                }
                dirs
            }
        };
        Ok(Cgroup {
            v2: matches!(self, Hierarchy::V2(_)),
            dirs,
        })
    }

    /// Names (relative to `parent`) of the cgroups directly under `parent`.
    pub fn children(&self, parent: &str) -> Vec<String> {
        let Ok(cg) = self.cgroup(parent) else {
            return Vec::new();
        };
        let Some((_, dir)) = cg.dirs.first() else {
            return Vec::new();
        };
        fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The v1 controller mounts named in a `/proc/self/mountinfo` text.
fn v1_mounts(mountinfo: &str) -> Vec<(&'static str, PathBuf)> {
    let mut found = Vec::new();
    for line in mountinfo.lines() {
        // id parent major:minor root mount-point options [optional...] - fstype source super
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut r = right.split_whitespace();
        if r.next() != Some("cgroup") {
            continue;
        }
        let super_opts = r.nth(1).unwrap_or("");
        let Some(point) = left.split_whitespace().nth(4) else {
            continue;
        };
        for c in V1_CONTROLLERS {
            if super_opts.split(',').any(|o| o == c) && !found.iter().any(|(n, _)| *n == c) {
                found.push((c, PathBuf::from(point)));
            }
        }
    }
    found
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b))
    {
        return Err(cg_err(format!(
            "cgroup name {name:?}: relative, of letters, digits, '-', '_', '.' and '/'"
        )));
    }
    Ok(())
}

/// One cgroup: its directory in each hierarchy it uses.
#[derive(Debug, Clone, PartialEq)]
pub struct Cgroup {
    v2: bool,
    /// (v1 controller, or "" for v2; directory).
    dirs: Vec<(&'static str, PathBuf)>,
}

impl Cgroup {
    /// Creates the cgroup `name` (and its parents) in `h` with `limits`. An existing one is
    /// taken as it is and its limits set again.
    pub fn create(h: &Hierarchy, name: &str, limits: &CgroupLimits) -> Result<Cgroup> {
        limits.check()?;
        let mut cg = h.cgroup(name)?;
        if !cg.v2 {
            // Only the controllers its limits use: each v1 hierarchy a process joins is
            // one more migration, and each migration stalls every fork and thread exit
            // on the host for a moment (the kernel's cgroup_threadgroup_rwsem).
            let mut want = limits.controllers();
            if limits.io_weight.is_some() {
                want.push("blkio");
            }
            cg.dirs.retain(|(c, _)| want.contains(c));
        }
        if let Hierarchy::V2(root) = h {
            // Each level hands the controllers down to the next.
            let mut dir = root.clone();
            for part in Path::new(name).components() {
                for c in ["cpu", "memory", "pids", "io"] {
                    let _ = fs::write(dir.join("cgroup.subtree_control"), format!("+{c}"));
                }
                dir = dir.join(part);
                mkdir(&dir)?;
            }
        } else {
            for (_, d) in &cg.dirs {
                mkdir_all(d)?;
            }
        }
        cg.apply(limits)?;
        Ok(cg)
    }

    fn dir_of(&self, controller: &str) -> Option<&Path> {
        if self.v2 {
            return self.dirs.first().map(|(_, d)| d.as_path());
        }
        self.dirs
            .iter()
            .find(|(c, _)| *c == controller)
            .map(|(_, d)| d.as_path())
    }

    fn write(&self, controller: &str, file: &str, value: &str) -> Result<()> {
        let dir = self
            .dir_of(controller)
            .ok_or_else(|| cg_err(format!("no {controller} cgroup controller")))?;
        let path = dir.join(file);
        fs::write(&path, value)
            .map_err(|e| cg_err(format!("{}: writing {value}: {e}", path.display())))
    }

    /// Makes the group an idle one (`cpu.idle` 1: it runs only on CPU time nothing else
    /// wants, as if its every thread were `SCHED_IDLE`) or a normal one again (0, with
    /// `cpu_weight`: leaving idle, the kernel resets the weight to its default). A write
    /// or two, whatever the number of its threads. An error where the kernel or the
    /// group's controllers have no `cpu.idle` (before 5.15, or no CPU controller).
    pub fn set_idle(&self, idle: bool, cpu_weight: Option<u32>) -> Result<()> {
        self.write("cpu", "cpu.idle", if idle { "1" } else { "0" })?;
        if idle {
            Ok(())
        } else {
            self.set_cpu_weight(cpu_weight)
        }
    }

    /// Sets the relative CPU weight ([`CgroupLimits::cpu_weight`]'s scale), if any.
    fn set_cpu_weight(&self, weight: Option<u32>) -> Result<()> {
        let Some(w) = weight else { return Ok(()) };
        if self.v2 {
            self.write("", "cpu.weight", &w.to_string())
        } else {
            let shares = (u64::from(w) * 1024 / 100).max(2);
            self.write("cpu", "cpu.shares", &shares.to_string())
        }
    }

    fn apply(&self, limits: &CgroupLimits) -> Result<()> {
        let period = 100_000u64;
        if self.v2 {
            if let Some(m) = limits.memory_max {
                self.write("", "memory.max", &m.to_string())?;
                // No swapping the guest out behind the limit's back.
                if self.dirs[0].1.join("memory.swap.max").exists() {
                    self.write("", "memory.swap.max", "0")?;
                }
            }
            if let Some(p) = limits.pids_max {
                self.write("", "pids.max", &p.to_string())?;
            }
            if let Some(c) = limits.cpus {
                let quota = ((c * period as f64) as u64).max(1000);
                self.write("", "cpu.max", &format!("{quota} {period}"))?;
            }
            self.set_cpu_weight(limits.cpu_weight)?;
        } else {
            if let Some(m) = limits.memory_max {
                self.write("memory", "memory.limit_in_bytes", &m.to_string())?;
                // memsw (memory + swap) must not be below the memory limit: set after it.
                let memsw = self
                    .dir_of("memory")
                    .map(|d| d.join("memory.memsw.limit_in_bytes"));
                if memsw.is_some_and(|p| p.exists()) {
                    self.write("memory", "memory.memsw.limit_in_bytes", &m.to_string())?;
                }
            }
            if let Some(p) = limits.pids_max {
                self.write("pids", "pids.max", &p.to_string())?;
            }
            if let Some(c) = limits.cpus {
                let quota = ((c * period as f64) as u64).max(1000);
                self.write("cpu", "cpu.cfs_period_us", &period.to_string())?;
                self.write("cpu", "cpu.cfs_quota_us", &quota.to_string())?;
            }
            self.set_cpu_weight(limits.cpu_weight)?;
        }
        if let Some(w) = limits.io_weight {
            match self.io_weight_file() {
                Some((path, scaled_v1)) => {
                    let v = if scaled_v1 {
                        (w / 10).clamp(1, 1000)
                    } else {
                        w
                    };
                    fs::write(&path, v.to_string())
                        .map_err(|e| cg_err(format!("{}: writing {v}: {e}", path.display())))?;
                }
                None => tracing::debug!("no I/O weight for this cgroup: no weighted scheduler"),
            }
        }
        Ok(())
    }

    /// The I/O weight file and whether it takes v1's 1..=1000 scale.
    fn io_weight_file(&self) -> Option<(PathBuf, bool)> {
        let (names, v1): (&[&str], bool) = if self.v2 {
            (&["io.bfq.weight", "io.weight"], false)
        } else {
            (&["blkio.bfq.weight", "blkio.weight"], true)
        };
        let dir = self.dir_of(if self.v2 { "" } else { "blkio" })?;
        names
            .iter()
            .map(|n| dir.join(n))
            .find(|p| p.exists())
            .map(|p| (p, v1))
    }

    /// The `cgroup.procs` files a process writes its pid (or "0", itself) to, to join.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(_, d)| d.join("cgroup.procs"))
            .collect()
    }

    /// Moves process `pid` (all its threads) into this cgroup. Memory it already uses
    /// stays charged where it was on cgroup v1.
    pub fn add(&self, pid: i32) -> Result<()> {
        for f in self.procs_files() {
            fs::write(&f, pid.to_string())
                .map_err(|e| cg_err(format!("{}: adding pid {pid}: {e}", f.display())))?;
        }
        Ok(())
    }

    /// Pids of the processes in it.
    pub fn pids(&self) -> Vec<i32> {
        let Some((_, d)) = self.dirs.first() else {
            return Vec::new();
        };
        fs::read_to_string(d.join("cgroup.procs"))
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Memory charged to it, bytes.
    pub fn memory_bytes(&self) -> Option<u64> {
        let (dir, file) = if self.v2 {
            (self.dirs[0].1.as_path(), "memory.current")
        } else {
            (self.dir_of("memory")?, "memory.usage_in_bytes")
        };
        fs::read_to_string(dir.join(file)).ok()?.trim().parse().ok()
    }

    /// Times a process of it was killed for going over its memory limit (v2
    /// `memory.events` oom_kill; v1 `memory.oom_control` oom_kill).
    pub fn oom_kills(&self) -> Option<u64> {
        let (dir, file) = if self.v2 {
            (self.dirs[0].1.as_path(), "memory.events")
        } else {
            (self.dir_of("memory")?, "memory.oom_control")
        };
        fs::read_to_string(dir.join(file))
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
    }

    /// A limit as read back from the kernel: `memory`, `pids`, `cpus` (quota / period) or
    /// `cpu_weight` (in [`CgroupLimits::cpu_weight`]'s scale).
    pub fn read_limit(&self, which: &str) -> Option<f64> {
        let read = |c: &str, f: &str| -> Option<String> {
            fs::read_to_string(self.dir_of(c)?.join(f))
                .ok()
                .map(|s| s.trim().to_string())
        };
        let num = |s: String| s.parse::<f64>().ok();
        match (self.v2, which) {
            (true, "memory") => num(read("", "memory.max")?),
            (true, "pids") => num(read("", "pids.max")?),
            (true, "cpus") => {
                let s = read("", "cpu.max")?;
                let (q, p) = s.split_once(' ')?;
                Some(q.parse::<f64>().ok()? / p.parse::<f64>().ok()?)
            }
            (true, "cpu_weight") => num(read("", "cpu.weight")?),
            (false, "memory") => num(read("memory", "memory.limit_in_bytes")?),
            (false, "pids") => num(read("pids", "pids.max")?),
            (false, "cpus") => {
                let q = num(read("cpu", "cpu.cfs_quota_us")?)?;
                let p = num(read("cpu", "cpu.cfs_period_us")?)?;
                (q > 0.0).then_some(q / p)
            }
            (false, "cpu_weight") => Some(num(read("cpu", "cpu.shares")?)? * 100.0 / 1024.0),
            _ => None,
        }
    }

    /// The directory in the memory hierarchy (v2: the cgroup's directory).
    pub fn path(&self) -> &Path {
        self.dir_of("memory")
            .or_else(|| self.dirs.first().map(|(_, d)| d.as_path()))
            .unwrap_or(Path::new(CGROUP_ROOT))
    }

    /// Removes it (every hierarchy's directory) once its processes ended; the kernel may
    /// take a moment to let a directory go after its last process.
    pub fn remove(&self) -> Result<()> {
        for (_, d) in &self.dirs {
            let mut tries = 0;
            loop {
                match fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 50 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    Err(e) => return Err(cg_err(format!("removing cgroup {}: {e}", d.display()))),
                }
            }
        }
        Ok(())
    }
}

fn mkdir(dir: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o755).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(cg_err(format!("cgroup {}: {e}", dir.display()))),
    }
}

fn mkdir_all(dir: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .mode(0o755)
        .recursive(true)
        .create(dir)
        .map_err(|e| cg_err(format!("cgroup {}: {e}", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_mounts_are_read_from_mountinfo() {
        let info = "\
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
32 30 0:28 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
33 30 0:29 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
35 30 0:31 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
36 30 0:32 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
";
        let m = v1_mounts(info);
        let names: Vec<&str> = m.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["cpu", "memory", "pids"]);
        assert_eq!(m[1].1, PathBuf::from("/sys/fs/cgroup/memory"));
        let joint = "40 30 0:33 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n";
        let m = v1_mounts(joint);
        assert_eq!(m, [("cpu", PathBuf::from("/sys/fs/cgroup/cpu,cpuacct"))]);
        let shared = "41 30 0:34 / /sys/fs/cgroup/mp rw - cgroup cgroup rw,memory,pids\n";
        let m = v1_mounts(shared);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].1, m[1].1);
    }

    #[test]
    fn names_and_limits_are_checked() {
        let h = Hierarchy::V2(PathBuf::from("/nonexistent"));
        for bad in ["", "/abs", "../up", "a/../b", "sp ace", "a//b/./c"] {
            assert!(h.cgroup(bad).is_err(), "{bad:?}");
        }
        assert!(h.cgroup("clade/vm-1_x.y").is_ok());
        for bad in [
            CgroupLimits {
                cpus: Some(0.0),
                ..Default::default()
            },
            CgroupLimits {
                cpus: Some(f64::NAN),
                ..Default::default()
            },
            CgroupLimits {
                cpu_weight: Some(0),
                ..Default::default()
            },
            CgroupLimits {
                io_weight: Some(20_000),
                ..Default::default()
            },
            CgroupLimits {
                memory_max: Some(0),
                ..Default::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    /// On a host where this runs as root with cgroups: a group with every limit, a
    /// process in it, its usage read back, removed after. Skipped otherwise.
    #[test]
    fn a_cgroup_applies_and_reads_back_its_limits() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let limits = CgroupLimits {
            memory_max: Some(256 << 20),
            pids_max: Some(64),
            cpus: Some(0.5),
            cpu_weight: Some(200),
            io_weight: Some(500),
        };
        let h = match Hierarchy::detect(&limits) {
            Ok(h) => h,
            Err(e) => {
                eprintln!("skipped: {e}");
                return;
            }
        };
        let name = format!("clade-test/cg-{}", std::process::id());
        let cg = Cgroup::create(&h, &name, &limits).unwrap();
        assert_eq!(cg.read_limit("memory"), Some((256u64 << 20) as f64));
        assert_eq!(cg.read_limit("pids"), Some(64.0));
        assert_eq!(cg.read_limit("cpus"), Some(0.5));
        assert!((cg.read_limit("cpu_weight").unwrap() - 200.0).abs() < 1.0);
        // Idle (where the kernel has cpu.idle), then normal again with its weight back.
        if cg.set_idle(true, limits.cpu_weight).is_ok() {
            assert!(cg.read_limit("cpu_weight").unwrap() < 1.0);
            cg.set_idle(false, limits.cpu_weight).unwrap();
            assert!((cg.read_limit("cpu_weight").unwrap() - 200.0).abs() < 1.0);
        }
        // The shell waits to be told before its exec (v1 charges a group only what is
        // allocated after the move: the exec's new memory is).
        let mut child = std::process::Command::new("sh")
            .args(["-c", "read go; exec sleep 5"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        cg.add(child.id() as i32).unwrap();
        assert_eq!(cg.pids(), vec![child.id() as i32]);
        {
            use std::io::Write as _;
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(b"go\n").unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while cg.memory_bytes().is_none_or(|m| m == 0) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(cg.memory_bytes().is_some_and(|m| m > 0));
        assert!(cg.remove().is_err(), "a cgroup with a process is busy");
        child.kill().unwrap();
        child.wait().unwrap();
        cg.remove().unwrap();
        assert!(!cg.path().exists());
        let _ = h.cgroup("clade-test").unwrap().remove();
    }
}

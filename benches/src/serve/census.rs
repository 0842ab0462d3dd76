//! What the sandboxes of one `clade serve` cost the host, counted from `/proc` and the
//! cgroup tree ([`Census::take`]): their processes, threads and descriptors, their memory
//! (proportional set size, split into the guest's RAM and the rest, plus the kernel memory
//! charged to their cgroups), and the standby pool's processes, which are left out.
//!
//! **Which processes are a sandbox's.** Every process the service starts is a descendant
//! of its pid (VM processes are its children until the service ends; a jailed one may be
//! the jail's processes below such a child). The census takes every tree under a direct
//! child of the service's pid, the service itself not included, and sorts it by what its
//! processes hold, read from `/proc/PID/fd` and `fdinfo` (nothing is asked of the VMs, so
//! that counting 1,000 of them wakes none):
//! - a tree holding a descriptor open for writing on a file of a sandbox's directory
//!   (`<state>/sandboxes/<id>/…`: its VM's log and serial console) is that sandbox's — a
//!   standby that was given a sandbox is (its command line still says `--standby`);
//! - else a tree whose first process is a `clade restore --standby` is the standby pool's,
//!   left out (a standby only reads what it opens ahead of a sandbox's wake);
//! - anything else the service started is counted as the sandboxes' too (a helper).
//!
//! **Memory.** Each process's `/proc/PID/smaps`: the sum of its mappings' PSS (shared
//! pages split between the processes that map them, so the binary's pages shared by every
//! VM count once in all), and separately the PSS of its guest-RAM mappings — the writable
//! mappings exactly the size of the guest's memory — which is the memory the guest
//! touched (a restored guest's pages are faulted in on first touch). PSS counts user
//! space only: the kernel memory a VM costs (KVM's vCPU and MMU structures, page tables,
//! descriptors' objects) is read from its memory cgroup (cgroup v1
//! `memory.kmem.usage_in_bytes`, v2 `memory.stat`'s `kernel`), once per cgroup, for the
//! cgroups of the sandboxes' processes that are not the service's own.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// What [`Census::take`] counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Census {
    /// Processes of the sandboxes (see the module documentation).
    pub processes: usize,
    /// Their threads (each process's main thread included).
    pub threads: usize,
    /// Their open descriptors.
    pub fds: usize,
    /// Trees under the service's direct children that hold a sandbox's files.
    pub vm_trees: usize,
    /// The sandboxes those trees hold the files of (distinct ids).
    pub sandboxes: usize,
    /// Of `processes`, those outside any sandbox's tree (helpers).
    pub other_processes: usize,
    /// Standby trees, left out.
    pub standbys: usize,
    /// The standby trees' processes.
    pub standby_processes: usize,
    /// CPU time of the sandboxes' threads so far (`schedstat`), ns.
    pub cpu_ns: u64,
    /// Times their threads were scheduled on a CPU so far (`schedstat`).
    pub runs: u64,
    /// The sandboxes' processes.
    pub pids: Vec<u32>,
    /// Sum of the sandboxes' processes' PSS, KiB.
    pub pss_kib: u64,
    /// Of `pss_kib`, their guest-RAM mappings' (what the guests touched), KiB.
    pub guest_pss_kib: u64,
    /// Kernel memory charged to the sandboxes' cgroups, KiB; none without cgroups of
    /// their own (`--no-limits`) or a kernel that says.
    pub kernel_kib: Option<u64>,
    /// Cgroups the kernel memory was read from.
    pub cgroups: usize,
    /// The service's own open descriptors.
    pub service_fds: usize,
    /// The service's own threads.
    pub service_threads: usize,
}

/// One process's figures.
#[derive(Debug, Default)]
struct ProcFigures {
    threads: usize,
    fds: usize,
    pss_kib: u64,
    guest_pss_kib: u64,
    cpu_ns: u64,
    runs: u64,
}

impl Census {
    /// Counts the sandboxes of the service whose pid is `service` and whose sandboxes'
    /// directories are under `sandboxes` (`<state>/sandboxes`), whose guests have
    /// `guest_mem_mib` MiB of RAM.
    pub fn take(service: u32, sandboxes: &Path, guest_mem_mib: u64) -> Census {
        // As the kernel names the files descriptors are open on.
        let sandboxes = &sandboxes
            .canonicalize()
            .unwrap_or_else(|_| sandboxes.to_path_buf());
        let children = children_by_parent();
        let mut c = Census::default();
        let own = figures(service, 0);
        c.service_fds = own.fds;
        c.service_threads = own.threads;
        let service_cgroup = memory_cgroup(service);
        let mut cgroups = BTreeSet::new();
        let mut ids = BTreeSet::new();
        for &root in children.get(&service).map(Vec::as_slice).unwrap_or(&[]) {
            let tree = subtree(&children, root);
            let owner = tree.iter().find_map(|&p| sandbox_written(p, sandboxes));
            match owner {
                Some(id) => {
                    c.vm_trees += 1;
                    ids.insert(id);
                }
                None if cmdline(root).iter().any(|a| a == "--standby") => {
                    c.standbys += 1;
                    c.standby_processes += tree.len();
                    continue;
                }
                None => c.other_processes += tree.len(),
            }
            for pid in tree {
                let f = figures(pid, guest_mem_mib);
                c.pids.push(pid);
                c.processes += 1;
                c.threads += f.threads;
                c.fds += f.fds;
                c.pss_kib += f.pss_kib;
                c.guest_pss_kib += f.guest_pss_kib;
                c.cpu_ns += f.cpu_ns;
                c.runs += f.runs;
                if let Some(cg) = memory_cgroup(pid) {
                    if Some(&cg) != service_cgroup.as_ref() && cg.1 != Path::new("/") {
                        cgroups.insert(cg);
                    }
                }
            }
        }
        c.sandboxes = ids.len();
        c.cgroups = cgroups.len();
        if !cgroups.is_empty() {
            c.kernel_kib = cgroups
                .iter()
                .map(|(v2, path)| kernel_kib(*v2, path))
                .sum::<Option<u64>>();
        }
        c
    }

    /// Whether `other` counted the same processes and pool (the service at rest).
    pub fn same_as(&self, other: &Census) -> bool {
        (
            self.processes,
            self.vm_trees,
            self.standbys,
            self.standby_processes,
        ) == (
            other.processes,
            other.vm_trees,
            other.standbys,
            other.standby_processes,
        )
    }
}

/// The sandbox (its directory's name under `sandboxes`) of which process `pid` holds a
/// file open for writing, if any: its VM's log or serial console.
fn sandbox_written(pid: u32, sandboxes: &Path) -> Option<String> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    fds.flatten().find_map(|e| {
        let target = std::fs::read_link(e.path()).ok()?;
        let id = target
            .strip_prefix(sandboxes)
            .ok()?
            .components()
            .next()?
            .as_os_str()
            .to_str()?
            .to_owned();
        if id == "standby" {
            return None;
        }
        let fd = e.file_name();
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.to_str()?)).ok()?;
        // `flags:` in octal; the access mode is its low two bits.
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())?;
        (flags & 0o3 != 0).then_some(id)
    })
}

/// Every process's children, by parent pid (from each `/proc/PID/stat`).
fn children_by_parent() -> HashMap<u32, Vec<u32>> {
    let mut out: HashMap<u32, Vec<u32>> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: the command may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            out.entry(ppid).or_default().push(pid);
        }
    }
    out
}

/// `root` and all its descendants.
fn subtree(children: &HashMap<u32, Vec<u32>>, root: u32) -> Vec<u32> {
    let mut out = vec![root];
    let mut i = 0;
    while let Some(&p) = out.get(i) {
        out.extend(children.get(&p).into_iter().flatten());
        i += 1;
    }
    out
}

fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// Threads, descriptors and memory of `pid` (zeros for a process that ended meanwhile).
fn figures(pid: u32, guest_mem_mib: u64) -> ProcFigures {
    let threads = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let (pss_kib, guest_pss_kib) = pss(&smaps, guest_mem_mib);
    let (cpu_ns, runs) = cpu_of(&[pid]);
    ProcFigures {
        threads,
        fds,
        pss_kib,
        guest_pss_kib,
        cpu_ns,
        runs,
    }
}

/// The CPU time (ns) and times run so far of every thread of `pids` (`schedstat`: time
/// on a CPU, time waiting for one, times run); processes that ended count nothing.
pub fn cpu_of(pids: &[u32]) -> (u64, u64) {
    let (mut cpu_ns, mut runs) = (0, 0);
    for pid in pids {
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let s = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
            let v: Vec<u64> = s
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            if let [on_cpu, _, times, ..] = v[..] {
                cpu_ns += on_cpu;
                runs += times;
            }
        }
    }
    (cpu_ns, runs)
}

/// The host's CPU time so far, (busy, all), clock ticks (`/proc/stat`).
pub fn host_cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let all: u64 = v.iter().take(8).sum();
    // idle and iowait.
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((all.saturating_sub(idle), all))
}

/// The PSS of every mapping in `smaps` and of the guest-RAM ones (writable, exactly
/// `guest_mem_mib` MiB), KiB.
fn pss(smaps: &str, guest_mem_mib: u64) -> (u64, u64) {
    let (mut all, mut guest) = (0, 0);
    let mut in_guest = false;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let (Some(first), Some(second)) = (f.next(), f.next()) else {
            continue;
        };
        if let Some((lo, hi)) = first.split_once('-') {
            // A mapping's header: `lo-hi perms offset dev inode [path]`.
            if let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) {
                in_guest = guest_mem_mib > 0
                    && hi.saturating_sub(lo) == guest_mem_mib << 20
                    && second.starts_with("rw");
                continue;
            }
        }
        if first == "Pss:" {
            let kib: u64 = second.parse().unwrap_or(0);
            all += kib;
            if in_guest {
                guest += kib;
            }
        }
    }
    (all, guest)
}

/// The memory cgroup of `pid`: (cgroup v2, its path in the hierarchy).
fn memory_cgroup(pid: u32) -> Option<(bool, PathBuf)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let v1 = Path::new("/sys/fs/cgroup/memory").is_dir();
    text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, names, path) = (f.next()?, f.next()?, f.next()?);
        let hit = if v1 {
            names.split(',').any(|n| n == "memory")
        } else {
            names.is_empty()
        };
        hit.then(|| (!v1, PathBuf::from(path)))
    })
}

/// Kernel memory charged to the cgroup at `path`, KiB.
fn kernel_kib(v2: bool, path: &Path) -> Option<u64> {
    let rel = path.strip_prefix("/").unwrap_or(path);
    if v2 {
        let stat =
            std::fs::read_to_string(Path::new("/sys/fs/cgroup").join(rel).join("memory.stat"))
                .ok()?;
        stat.lines()
            .find_map(|l| l.strip_prefix("kernel "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|b| b / 1024)
    } else {
        std::fs::read_to_string(
            Path::new("/sys/fs/cgroup/memory")
                .join(rel)
                .join("memory.kmem.usage_in_bytes"),
        )
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(|b| b / 1024)
    }
}

/// The host's MemAvailable (/proc/meminfo), KiB.
pub fn mem_available_kib() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_ram_is_the_writable_mapping_of_its_size() {
        let smaps = "\
55c32e5b3000-55c32ffa3000 r-xp 009a1000 fe:00 5531521 /x/clade
Size:              26560 kB
Pss:                 445 kB
7f8267e00000-7f826be00000 rw-p 00000000 00:00 0
Size:              65536 kB
Pss:                   7 kB
7f8292400000-7f8296400000 rw-p 00000000 00:00 0
Size:              65536 kB
Pss:                 120 kB
7f8296400000-7f829a400000 r--p 00000000 00:00 0
Size:              65536 kB
Pss:                1000 kB
VmFlags: rd wr mr mw me um nr
";
        assert_eq!(pss(smaps, 64), (445 + 7 + 120 + 1000, 7 + 120));
        assert_eq!(pss(smaps, 0), (1572, 0));
    }

    #[test]
    fn this_process_is_counted_under_its_parent() {
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        let children = children_by_parent();
        assert!(children.get(&parent).is_some_and(|c| c.contains(&me)));
        assert!(subtree(&children, parent).contains(&me));
        let f = figures(me, 64);
        assert!(f.threads >= 1 && f.fds >= 1 && f.pss_kib > 0, "{f:?}");
        assert!(f.runs > 0, "{f:?}");
        assert!(mem_available_kib().is_some_and(|k| k > 0));
        assert!(host_cpu_ticks().is_some_and(|(busy, all)| busy <= all && all > 0));
    }

    #[test]
    fn a_file_written_in_a_sandboxs_directory_names_it() {
        let d = std::env::temp_dir().join(format!("clade-bench-census-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("abc")).unwrap();
        std::fs::create_dir_all(d.join("standby")).unwrap();
        let me = std::process::id();
        drop(std::fs::File::create(d.join("abc/snapshot.mem")).unwrap());
        let _r = std::fs::File::open(d.join("abc/snapshot.mem")).unwrap();
        let _s = std::fs::File::create(d.join("standby/sb-x.log")).unwrap();
        // Read only, or the pool's own directory: no sandbox's.
        assert_eq!(sandbox_written(me, &d), None);
        let _w = std::fs::File::create(d.join("abc/vm.log")).unwrap();
        assert_eq!(sandbox_written(me, &d).as_deref(), Some("abc"));
        let _ = std::fs::remove_dir_all(&d);
    }
}

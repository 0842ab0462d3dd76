//! Where a sandbox's metrics come from (Linux /proc and the sandbox's files):
//!
//! - CPU: the VM process's CPU time, the sum over its threads of
//!   `/proc/<pid>/task/<tid>/schedstat` (nanoseconds on a CPU), between two samples: the
//!   previous metrics call for this process when it was [`MIN_INTERVAL`] to [`MAX_INTERVAL`]
//!   ago, else a [`WINDOW`] measured now. Percent of one CPU (the caller divides by vCPUs).
//! - Memory: the VM process's proportional set size (`Pss` of `/proc/<pid>/smaps_rollup`):
//!   its private pages plus its share of the pages it shares with other sandboxes (guest
//!   memory mapped copy-on-write from a template's snapshot). That is what the sandbox
//!   costs the host; the guest's own view of free memory is not asked (the test guest has
//!   no agent that could say).
//! - Disk: used = blocks allocated by the sandbox's own files (disk overlays, pause
//!   snapshots, logs); total = the guest disk's size from its top layer's header (0 without
//!   a disk).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shortest interval between two metrics calls that is used as the CPU sample.
pub const MIN_INTERVAL: Duration = Duration::from_millis(200);
/// Longest: an older sample says little about now.
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);
/// The window measured when there is no usable previous sample.
pub const WINDOW: Duration = Duration::from_millis(100);

/// A VM process's CPU time at an instant.
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    at: Instant,
    cpu_ns: u64,
}

/// Nanoseconds the threads of `pid` have spent on a CPU.
pub fn cpu_ns(pid: i32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0u64;
    for t in tasks.flatten() {
        let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        total += s
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(total)
}

fn pct(a: CpuSample, b: CpuSample) -> f64 {
    let wall = b.at.duration_since(a.at).as_nanos().max(1) as f64;
    // Threads that ended between the samples take their time with them: never negative.
    b.cpu_ns.saturating_sub(a.cpu_ns) as f64 / wall * 100.0
}

/// Recent CPU use of `pid` in percent of one CPU (see the module docs); records the sample
/// for the next call.
pub fn recent_cpu(samples: &Mutex<HashMap<i32, CpuSample>>, pid: i32) -> Option<f64> {
    cpu_since(samples, pid, true)
}

/// As [`recent_cpu`]; without a usable previous sample and without `wait`, records this
/// one and says nothing (None) rather than measure a window now.
pub fn cpu_since(samples: &Mutex<HashMap<i32, CpuSample>>, pid: i32, wait: bool) -> Option<f64> {
    let now = CpuSample {
        at: Instant::now(),
        cpu_ns: cpu_ns(pid)?,
    };
    let prev = samples
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&pid)
        .copied()
        .filter(|p| {
            let age = now.at.duration_since(p.at);
            (MIN_INTERVAL..=MAX_INTERVAL).contains(&age) && p.cpu_ns <= now.cpu_ns
        });
    let (from, to) = match prev {
        Some(p) => (p, now),
        None if !wait => {
            samples
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(pid, now);
            return None;
        }
        None => {
            std::thread::sleep(WINDOW);
            let later = CpuSample {
                at: Instant::now(),
                cpu_ns: cpu_ns(pid)?,
            };
            (now, later)
        }
    };
    let mut s = samples.lock().unwrap_or_else(|p| p.into_inner());
    // Forget processes not asked about for a while (ended ones among them).
    s.retain(|_, v| to.at.duration_since(v.at) <= MAX_INTERVAL);
    s.insert(pid, to);
    Some(pct(from, to))
}

/// The proportional set size of `pid` in bytes (resident size where the kernel has no
/// `smaps_rollup`).
pub fn memory(pid: i32) -> Option<u64> {
    let field = |file: &str, key: &str| -> Option<u64> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    field("smaps_rollup", "Pss:").or_else(|| field("status", "VmRSS:"))
}

/// (bytes allocated by the files under `dir`, the guest disk's size).
pub fn disk(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut used = 0;
    // The newest layer file is the running VM's top layer.
    let mut top: Option<(std::time::SystemTime, std::path::PathBuf)> = None;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                used += m.blocks() * 512;
                let p = e.path();
                if d == dir && p.extension().is_some_and(|x| x == "cdsk") {
                    let t = m.modified().unwrap_or(std::time::UNIX_EPOCH);
                    if top.as_ref().is_none_or(|(tt, _)| t > *tt) {
                        top = Some((t, p));
                    }
                }
            }
        }
    }
    let total = top.and_then(|(_, p)| disk_size(&p)).unwrap_or(0);
    (used, total)
}

/// How often the service samples every running sandbox's metrics (E2B's interval).
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(5);
/// Samples kept per sandbox: the last hour.
pub const SAMPLES_KEPT: usize = 720;

/// The metrics samples of each sandbox, oldest first, at most [`SAMPLES_KEPT`] each: the
/// time series `GET /sandboxes/{id}/metrics` answers from. Kept in memory (a service
/// restart starts them again), for as long as the sandbox exists.
#[derive(Default)]
pub struct History {
    samples: Mutex<HashMap<String, std::collections::VecDeque<super::Metrics>>>,
    last: Mutex<Option<Instant>>,
}

impl History {
    /// Whether a sampling round is due (and if so, marks it started).
    pub fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|t| t.elapsed() < SAMPLE_INTERVAL) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// Adds a round's samples; forgets the sandboxes `exists` says are gone.
    pub fn record(&self, round: Vec<(String, super::Metrics)>, exists: impl Fn(&str) -> bool) {
        let mut all = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|id, _| exists(id));
        for (id, m) in round {
            let q = all.entry(id).or_default();
            q.push_back(m);
            while q.len() > SAMPLES_KEPT {
                q.pop_front();
            }
        }
    }

    /// The samples of `id` taken in `[from_ms, to_ms]`, oldest first.
    pub fn range(&self, id: &str, from_ms: i64, to_ms: i64) -> Vec<super::Metrics> {
        let all = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        all.get(id)
            .map(|q| {
                q.iter()
                    .filter(|m| (from_ms..=to_ms).contains(&m.at_ms))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Its newest sample.
    pub fn latest(&self, id: &str) -> Option<super::Metrics> {
        let all = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        all.get(id).and_then(|q| q.back().cloned())
    }

    /// Forgets `id` (killed).
    pub fn forget(&self, id: &str) {
        self.samples
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

/// The virtual size recorded in a disk layer's header.
fn disk_size(layer: &Path) -> Option<u64> {
    use std::io::Read;
    let mut buf = Vec::new();
    std::fs::File::open(layer)
        .ok()?
        .take(disk::HEADER_SIZE * disk::HEADER_SLOTS)
        .read_to_end(&mut buf)
        .ok()?;
    disk::decode_slots(layer, &buf)
        .ok()
        .map(|(h, _)| h.virtual_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_measured_over_the_recent_interval() {
        // A process of its own (this test process runs other tests' threads meanwhile):
        // busy for 300 ms once it says so (not while the interpreter starts, which may
        // wait on the disk), then asleep; the figure after the sleep reflects it only.
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import time\nprint('busy', flush=True)\nt = time.monotonic()\nwhile time.monotonic() - t < 0.3: pass\ntime.sleep(5)",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "busy");
        let pid = child.id() as i32;
        let samples = Mutex::new(HashMap::new());
        let busy = recent_cpu(&samples, pid).unwrap();
        std::thread::sleep(Duration::from_millis(600));
        let _ = recent_cpu(&samples, pid).unwrap();
        std::thread::sleep(Duration::from_millis(400));
        let idle = recent_cpu(&samples, pid).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        assert!(busy > 10.0, "busy interval measured {busy}%");
        assert!(idle < 5.0, "idle interval measured {idle}%");
        assert!(memory(std::process::id() as i32).unwrap() > 0);
        assert!(recent_cpu(&samples, -5).is_none());
    }

    fn m(at_ms: i64) -> super::super::Metrics {
        super::super::Metrics {
            at_ms,
            cpu_count: 1,
            cpu_used_pct: 0.0,
            mem_used: 1,
            mem_total: 2,
            disk_used: 0,
            disk_total: 0,
        }
    }

    #[test]
    fn history_keeps_a_bounded_series_per_sandbox() {
        let h = History::default();
        assert!(h.due());
        assert!(!h.due(), "not again within the interval");
        for i in 0..(SAMPLES_KEPT as i64 + 10) {
            h.record(vec![("a".into(), m(i * 1000)), ("b".into(), m(i))], |_| {
                true
            });
        }
        let all = h.range("a", i64::MIN, i64::MAX);
        assert_eq!(all.len(), SAMPLES_KEPT, "the oldest go");
        assert_eq!(all[0].at_ms, 10_000);
        assert_eq!(h.range("a", 20_000, 22_000).len(), 3, "inclusive range");
        assert!(h.range("a", 0, 5_000).is_empty(), "before anything kept");
        assert!(h.range("nope", i64::MIN, i64::MAX).is_empty());
        assert_eq!(h.latest("b").unwrap().at_ms, SAMPLES_KEPT as i64 + 9);
        // A round forgets sandboxes that are gone.
        h.record(vec![], |id| id == "a");
        assert!(h.latest("b").is_none());
        h.forget("a");
        assert!(h.latest("a").is_none());
    }

    #[test]
    fn cpu_without_a_previous_sample_waits_only_when_asked() {
        let samples = Mutex::new(HashMap::new());
        let me = std::process::id() as i32;
        assert!(
            cpu_since(&samples, me, false).is_none(),
            "first: a baseline only"
        );
        std::thread::sleep(MIN_INTERVAL + Duration::from_millis(20));
        assert!(cpu_since(&samples, me, false).is_some(), "then a figure");
    }

    #[test]
    fn disk_size_comes_from_the_newest_layer() {
        let d = std::env::temp_dir().join(format!("sandbox-usage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        assert_eq!(disk(&d), (0, 0));
        disk::ops::create(
            &d.join("disk-r0.cdsk"),
            &disk::ops::CreateOptions {
                virtual_size: Some(8 << 20),
                ..Default::default()
            },
        )
        .unwrap();
        std::fs::write(d.join("vm.log"), vec![b'x'; 10_000]).unwrap();
        let (used, total) = disk(&d);
        assert_eq!(total, 8 << 20);
        assert!(used >= 10_000, "{used}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}

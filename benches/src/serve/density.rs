//! `--running N`: many sandboxes running at once on one service. A service of its own is
//! started; with one sandbox running, `creates` creates are measured (each until its
//! agent answered, then killed, as the other serve cases do); then `N - 1` more are
//! created by concurrent clients and kept running, every one is asked envd's
//! `GET /health` through the service (routed by `E2b-Sandbox-Id` to its agent), the
//! host's cost of them is counted ([`Census`]: processes and memory per sandbox, the
//! standby pool left out), and the same creates are measured with the `N` running. Then
//! all but one are killed, the creates measured once more with one running (the drift of
//! the host meanwhile: other work on a shared machine moves both), the last one killed,
//! and what is left of the sandboxes' processes counted.
//!
//! The native test guest halts while idle (its vsock driver waits for an interrupt, as a
//! Linux guest does), so what the running sandboxes take of the host's CPUs while nobody
//! asks anything of them is their VM processes' own: it is measured over
//! [`IDLE_WINDOW`] once they all answered (their CPU time and how often their threads
//! ran, and the host's CPUs busy meanwhile, other work on the host included).

use std::time::{Duration, Instant};

use super::census::{cpu_of, host_cpu_ticks, mem_available_kib, Census};
use super::service::{Service, TEMPLATE_MEM_MIB};
use crate::error::{Context, Result};
use crate::guest::{probe, Guest};
use crate::stats::Samples;

/// The target of creates with many running: p50 with `N` running at most this many times
/// the p50 with one running (issue: 1,000 running).
pub const RUNNING_TARGET_RATIO: f64 = 1.5;
/// The target of processes per running sandbox.
pub const PROCESSES_TARGET: f64 = 1.0;
/// The target of host memory per running sandbox beyond what its guest touched, MiB.
pub const BEYOND_GUEST_TARGET_MIB: f64 = 1.0;

/// How long the standby pool may take to come to rest before a census is taken anyway.
const SETTLE_LIMIT: Duration = Duration::from_secs(60);
/// Times each running sandbox is asked `GET /health` before it counts as not answering.
pub const ANSWER_TRIES: usize = 3;
/// How long the running sandboxes' idle CPU use is measured.
pub const IDLE_WINDOW: Duration = Duration::from_secs(5);

/// What `--running N` measured.
#[derive(Debug, Clone)]
pub struct RunningRun {
    /// Sandboxes asked to run at once.
    pub n: usize,
    /// Concurrent clients that created them.
    pub clients: usize,
    /// Sandboxes that were running at once (the creates that succeeded, the first one
    /// included).
    pub running: usize,
    /// Creates of the fill that failed.
    pub create_failures: usize,
    /// The first of those failures.
    pub first_failure: Option<String>,
    /// How long the `N - 1` creates of the fill took.
    pub fill: Duration,
    /// Of `running`, those whose `GET /health` through the service answered 204 (asked up
    /// to [`ANSWER_TRIES`] times each).
    pub answering: usize,
    /// Of `answering`, those that answered at the first ask.
    pub answering_first: usize,
    /// Kills of the running sandboxes (all but one, at once) that failed.
    pub kill_failures: usize,
    /// The sandboxes' cost with `running` of them (the pool at rest).
    pub census: Census,
    /// The same with one running, before the fill.
    pub census_1: Census,
    /// Whether the pool came to rest before each census (else it was taken anyway).
    pub settled: bool,
    /// Over [`IDLE_WINDOW`] with `running` idle: the sandboxes' CPU time (ns),
    /// the times their threads ran, the host's CPU busy (% of all its CPUs) and the
    /// window's real length.
    pub idle_cpu_ns: u64,
    /// See `idle_cpu_ns`.
    pub idle_runs: u64,
    /// See `idle_cpu_ns`.
    pub idle_host_busy_pct: Option<f64>,
    /// See `idle_cpu_ns`.
    pub idle_window: Duration,
    /// The host's MemAvailable with one running minus with `running` (KiB; host-wide).
    pub mem_available_drop_kib: Option<i64>,
    /// Creates with one sandbox running.
    pub create_1: Samples,
    /// Creates with `running` running.
    pub create_n: Samples,
    /// Creates with one running again, after the others were killed.
    pub create_1_after: Samples,
    /// What was left after every sandbox was killed (its `processes` should be 0).
    pub left: Census,
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

impl RunningRun {
    /// Processes per running sandbox.
    pub fn processes_per_sandbox(&self) -> Option<f64> {
        self.per(self.census.processes as f64)
    }

    /// `v` per running sandbox.
    fn per(&self, v: f64) -> Option<f64> {
        (self.running > 0).then(|| v / self.running as f64)
    }

    /// PSS plus kernel memory per running sandbox, MiB.
    pub fn total_mib_per_sandbox(&self) -> Option<f64> {
        let c = &self.census;
        self.per(mib(c.pss_kib + c.kernel_kib.unwrap_or(0)))
    }

    /// Of [`Self::total_mib_per_sandbox`], the guest's RAM mappings (what it touched).
    pub fn guest_touched_mib_per_sandbox(&self) -> Option<f64> {
        self.per(mib(self.census.guest_pss_kib))
    }

    /// Host memory per running sandbox beyond what its guest touched: PSS outside the
    /// guest's RAM plus the kernel memory charged to its cgroup, MiB (`host_mib_per_sandbox`).
    pub fn host_mib_per_sandbox(&self) -> Option<f64> {
        Some(self.total_mib_per_sandbox()? - self.guest_touched_mib_per_sandbox()?)
    }

    /// MemAvailable's drop per sandbox added by the fill, MiB (host-wide: other work on
    /// the host moves it).
    pub fn mem_available_drop_mib_per_sandbox(&self) -> Option<f64> {
        let added = self.running.checked_sub(1).filter(|&a| a > 0)?;
        Some(self.mem_available_drop_kib? as f64 / 1024.0 / added as f64)
    }

    /// CPU time per idle running sandbox, % of one CPU.
    pub fn idle_cpu_pct_per_sandbox(&self) -> Option<f64> {
        let s = self.idle_window.as_secs_f64();
        (s > 0.0)
            .then(|| self.per(self.idle_cpu_ns as f64 / 1e9 / s * 100.0))
            .flatten()
    }

    /// Times per second an idle running sandbox's threads ran.
    pub fn idle_runs_per_s_per_sandbox(&self) -> Option<f64> {
        let s = self.idle_window.as_secs_f64();
        (s > 0.0)
            .then(|| self.per(self.idle_runs as f64 / s))
            .flatten()
    }

    /// Create p50 with `running` running over create p50 with one running.
    pub fn create_p50_ratio(&self) -> Option<f64> {
        Some(self.create_n.percentile(50.0)? / self.create_1.percentile(50.0)?)
    }
}

/// One create until the new sandbox's agent answered, then its kill, `n` times.
fn creates(service: &Service, n: usize, what: &str) -> Result<Samples> {
    let mut s = Samples::new();
    for _ in 0..n {
        let t = Instant::now();
        let id = service
            .create()
            .context_with(|| format!("a create {what}"))?;
        probe(&service.vsock(&id)).context_with(|| format!("a new sandbox's agent {what}"))?;
        s.push(t.elapsed());
        service.kill(&id)?;
    }
    Ok(s)
}

/// A census once the service is at rest (two in a row 300 ms apart agreeing), or after
/// [`SETTLE_LIMIT`] the last one; whether it came to rest.
fn settled_census(service: &Service) -> (Census, bool) {
    let take = || Census::take(service.pid(), &service.sandboxes_dir(), TEMPLATE_MEM_MIB);
    let t = Instant::now();
    let mut last = take();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let c = take();
        if c.same_as(&last) {
            return (c, true);
        }
        if t.elapsed() > SETTLE_LIMIT {
            return (c, false);
        }
        last = c;
    }
}

/// Runs the case (see the module documentation): `n` sandboxes at once, created by
/// `clients` concurrent clients, `creates_n` measured creates in each phase.
pub(super) fn running(
    clade: &std::path::Path,
    guest: &Guest,
    n: usize,
    creates_n: usize,
    clients: usize,
) -> Result<RunningRun> {
    let service = Service::start(clade, guest, &[], &[])?;
    let first = service.create()?;
    probe(&service.vsock(&first)).context("the first running sandbox's agent")?;
    // Warm-up (the new service's first creates), not measured.
    creates(&service, 3, "(warm-up)")?;
    let create_1 = creates(&service, creates_n, "with 1 running")?;
    let (census_1, settled_1) = settled_census(&service);
    let avail_1 = mem_available_kib();

    let t = Instant::now();
    let slots = vec![(); n.saturating_sub(1)];
    let made = service.in_parallel(clients, &slots, |c, ()| c.create())?;
    let fill = t.elapsed();
    let mut ids = vec![first];
    let mut create_failures = 0;
    let mut first_failure = None;
    for r in made {
        match r {
            Ok(id) => ids.push(id),
            Err(e) => {
                create_failures += 1;
                first_failure.get_or_insert_with(|| e.to_string());
            }
        }
    }
    tracing::info!(
        running = ids.len(),
        create_failures,
        fill_s = fill.as_secs_f64(),
        "bench serve --running: filled"
    );
    // Asked up to ANSWER_TRIES times each: on a host whose CPUs the idle VM processes
    // keep busy, an agent may miss the service's connect limit at the first ask.
    let answered = service.in_parallel(clients, &ids, |c, id| {
        (1..=ANSWER_TRIES).find(|&i| {
            let ok = c.health(id).is_ok();
            if !ok && i < ANSWER_TRIES {
                std::thread::sleep(Duration::from_secs(1));
            }
            ok
        })
    })?;
    let answering = answered.iter().flatten().count();
    let answering_first = answered.iter().filter(|a| **a == Some(1)).count();
    let (census, settled_n) = settled_census(&service);
    let avail_n = mem_available_kib();
    // Idle: the sandboxes' threads' CPU time over the window (only those counted read,
    // so that the window is not stretched by a census of them all on a busy host).
    let (cpu_0, runs_0) = cpu_of(&census.pids);
    let host_before = host_cpu_ticks();
    let t = Instant::now();
    std::thread::sleep(IDLE_WINDOW);
    let (cpu_1, runs_1) = cpu_of(&census.pids);
    let host_after = host_cpu_ticks();
    let idle_window = t.elapsed();
    let idle_host_busy_pct = host_before
        .zip(host_after)
        .and_then(|((b0, a0), (b1, a1))| {
            let all = a1.checked_sub(a0).filter(|&a| a > 0)?;
            Some(b1.saturating_sub(b0) as f64 / all as f64 * 100.0)
        });
    let (idle_cpu_ns, idle_runs) = (cpu_1.saturating_sub(cpu_0), runs_1.saturating_sub(runs_0));
    let label = format!("with {} running", ids.len());
    let create_n = creates(&service, creates_n, &label)?;

    let others = ids.split_off(1);
    let killed = service.in_parallel(clients, &others, |c, id| c.kill(id).is_ok())?;
    let kill_failures = killed.iter().filter(|&&k| !k).count();
    settled_census(&service);
    let create_1_after = creates(&service, creates_n, "with 1 running again")?;
    for id in &ids {
        service.kill(id)?;
    }
    let (left, _) = settled_census(&service);
    Ok(RunningRun {
        n,
        clients,
        running: others.len() + ids.len(),
        create_failures,
        first_failure,
        fill,
        answering,
        answering_first,
        kill_failures,
        census,
        census_1,
        settled: settled_1 && settled_n,
        idle_cpu_ns,
        idle_runs,
        idle_host_busy_pct,
        idle_window,
        mem_available_drop_kib: avail_1.zip(avail_n).map(|(a, b)| a as i64 - b as i64),
        create_1,
        create_n,
        create_1_after,
        left,
    })
}

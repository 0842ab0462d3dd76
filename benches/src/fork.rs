//! `fork`: fork a running native guest (its `vsock` step answering pings) into N children;
//! the parent's pause, each child's time to its first answered ping, all of them, and the
//! host memory an idle child adds; a fork by full memory copy as baseline.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm::{ChildSpec, ForkOptions, SerialOutput, Shell};

use crate::error::{Context, Error, Result};
use crate::guest::{connect, ping_once, Guest, Machine, Scratch};
use crate::net::BenchNets;
use crate::stats::{Samples, Summary};
use crate::FILL_BASE_MIB;

/// What `fork` measures.
#[derive(Debug, Clone)]
pub struct ForkParams {
    /// Number of children.
    pub n: usize,
    /// Percentage of the memory above 64 MiB the guest fills before the fork.
    pub fill_pct: u32,
    /// The parent has a network device and each child gets its own TAP, each in a
    /// network namespace made beforehand; the same fork without networking is measured in
    /// the same run first. Root only.
    pub net: bool,
    /// The parent is a restore, with this backend, of a snapshot of the booted guest.
    pub restored: Option<vmm::MemoryBackend>,
}

/// What `fork` reports.
#[derive(Debug, Clone)]
pub struct ForkReport {
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// MiB the guest filled before the fork.
    pub fill_mib: u64,
    /// Number of children.
    pub n: usize,
    /// How long the parent's vCPUs were paused.
    pub pause_time: Duration,
    /// Steps of that pause, in order.
    pub pause_steps: Vec<(&'static str, Duration)>,
    /// Each child's latency: the pause, its own build, then its first answered ping.
    pub child: Summary,
    /// From the fork call until every child was built.
    pub built: Duration,
    /// From the fork call until every child answered.
    pub all: Duration,
    /// PSS of an idle child, KiB.
    pub pss_per_child_kib: u64,
    /// PSS of the parent, KiB.
    pub parent_pss_kib: u64,
    /// Baseline (fork by full memory copy): pause, copy, build, first answered ping.
    pub baseline: Duration,
    /// The baseline's memory copy.
    pub copy_time: Duration,
    /// The parent's agent round trip before the fork (p50 of a few, one connection).
    pub parent_ping_before_us: f64,
    /// The parent's first round trip after the fork on that same connection, sent once
    /// every child answered (so that it measures the parent, not the children): the guest
    /// touches its responder's code, stack and queues again, each page a fault now (a
    /// read maps the frozen page, a write copies it).
    pub parent_first_ping: Duration,
    /// With `--restored`: the parent's memory backend.
    pub restored: Option<vmm::MemoryBackend>,
    /// With `--net`: this fork had network devices; the same fork without them.
    pub without_net: Option<Box<ForkReport>>,
    /// The host's noise, measured after the fork (children stopped).
    pub noise: crate::HostNoise,
}

fn shells(machine: &Machine, n: usize) -> Result<Vec<Shell>> {
    let spec = machine.shell_spec();
    (0..n)
        .map(|_| Shell::create(&spec).map_err(Into::into))
        .collect()
}

/// Boots the guest (filling `fill_pct` of its memory above 64 MiB, then answering pings),
/// forks it into `n` children and pings each; then forks it once more by full memory copy.
pub fn fork(guest: &Guest, machine: &Machine, params: &ForkParams) -> Result<ForkReport> {
    let without_net = if params.net {
        Some(Box::new(fork(
            guest,
            machine,
            &ForkParams {
                net: false,
                ..params.clone()
            },
        )?))
    } else {
        None
    };
    // --net: the parent's network (0), each child's (1..=n), and the baseline child's.
    let nets = if params.net {
        Some(BenchNets::new(params.n + 2)?)
    } else {
        None
    };
    let n = params.n;
    let mem_mib = machine.mem_mib;
    let scratch = Scratch::new("fork")?;
    let dir = &scratch.0;
    let psock = dir.join("p.sock");
    let fill_mib =
        (mem_mib.saturating_sub(FILL_BASE_MIB) * u64::from(params.fill_pct) / 100).max(1);
    let mut parent = crate::guest::boot_until_with(
        guest,
        machine,
        &format!("memfill:1:{fill_mib},vsock {}", crate::guest::NO_CONN_LOG),
        Some(&psock),
        "serving agent port",
        nets.as_ref().map(|b| b.config(0)),
    )?;
    if let Some(backend) = params.restored {
        // Snapshotted once booted and filled; the parent is a restore of it.
        let snap = dir.join("parent-snapshot");
        parent.pause()?;
        vmm::snapshot(&mut parent, &snap, vmm::SnapshotKind::Full)?;
        drop(parent);
        parent = vmm::restore(
            &snap,
            backend,
            vmm::RestoreOptions {
                net: nets.as_ref().map(|b| b.config(0)),
                ..vmm::RestoreOptions::default()
            },
        )?;
    }
    // One agent connection to the parent stays open across the fork: its round trip
    // before, then its first one after (the parent's first touches of its memory).
    let parent_conn = connect(&psock, Duration::from_secs(20))
        .context_with(|| format!("connecting to {}", psock.display()))?;
    let mut before = Samples::new();
    for _ in 0..PARENT_PINGS_BEFORE {
        let t = Instant::now();
        parent_conn.ping()?;
        before.push(t.elapsed());
    }
    let before = before.summary("parent_ping_before");
    // Shells are built ahead (a pool's job, not measured): the children's, with the
    // parent's memory mapped into them where that can be done before the fork (a booted
    // VM's: `Vm::map_into_shell`), and the one the parent moves onto at the fork.
    let pre = shells(machine, n)?
        .into_iter()
        .map(|s| parent.map_into_shell(s))
        .collect::<vmm::Result<Vec<_>>>()?;
    parent.give_shell(Shell::create(&parent.child_shell_spec())?)?;
    let paths: Vec<PathBuf> = (0..n).map(|i| dir.join(format!("c{i}.sock"))).collect();
    // Their vsock sockets too (as a service's waiting child processes bind theirs).
    let bound_ahead = paths
        .iter()
        .map(|p| vmm::bind_vsock_ahead(&p.with_extension("ahead")))
        .collect::<vmm::Result<Vec<_>>>()?;
    // The pingers are started before the fork and end after the last answer: a thread's
    // start and end map and unmap its stack, which in this process (it holds every child)
    // interrupts each VM in it; the children's readiness is measured, not that.
    let (answers, answered) = std::sync::mpsc::channel();
    let release = Arc::new(std::sync::Barrier::new(n + 2));
    let parent_pinger = Pinger::start(usize::MAX, &answers, &release, move || {
        parent_conn.ping().map(|_| ()).map_err(Into::into)
    })?;
    let pingers = paths
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, p)| Pinger::start(i, &answers, &release, move || crate::guest::probe(&p)))
        .collect::<Result<Vec<_>>>()?;
    drop(answers);
    let t0 = Instant::now();
    let (children, report) = vmm::fork_with_report(
        &mut parent,
        n,
        ForkOptions {
            serial: SerialOutput::Memory,
            vsock_paths: paths.clone(),
            shells: pre,
            vsock_bound_ahead: bound_ahead,
            start: true,
            nets: nets
                .as_ref()
                .map(|b| (1..=n).map(|i| b.config(i)).collect())
                .unwrap_or_default(),
            ..ForkOptions::default()
        },
    )?;
    let built = t0.elapsed();
    tracing::debug!(n, ?built, pause = ?report.pause_time, "forked");
    // Every child answers, all at once, each on a new connection; then the parent, on the
    // connection it had before the fork (its first round trip after it, which pays the
    // parent's first touches of its memory, measured on its own).
    for p in &pingers {
        p.go();
    }
    let mut ping_times = vec![Duration::ZERO; n];
    let mut parent_first_ping = None;
    let mut first_error = None;
    let mut all = None;
    let mut children_answered = 0;
    for _ in 0..=n {
        let (i, r) = answered
            .recv()
            .map_err(|_| Error::ThreadPanicked("pinger"))?;
        match (r, i) {
            (Ok(d), usize::MAX) => parent_first_ping = Some(d),
            (Ok(d), i) => ping_times[i] = d,
            (Err(e), _) => {
                first_error.get_or_insert(e);
            }
        }
        if i != usize::MAX {
            children_answered += 1;
            if children_answered == n {
                all = Some(t0.elapsed());
                parent_pinger.go();
            }
        }
    }
    release.wait();
    for p in std::iter::once(parent_pinger).chain(pingers) {
        p.join()?;
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let all = all.ok_or(Error::ThreadPanicked("pinger"))?;
    let parent_first_ping = parent_first_ping.ok_or(Error::ThreadPanicked("pinger"))?;
    // A child's latency: the pause plus its own build, then its first answered ping.
    let mut samples = Samples::new();
    for (b, p) in report.child_times.iter().zip(&ping_times) {
        samples.push(report.pause_time + *b + *p);
    }
    std::thread::sleep(Duration::from_millis(200));
    let pss: u64 = children
        .iter()
        .map(|c| c.memory_pss_kib())
        .collect::<vmm::Result<Vec<_>>>()?
        .iter()
        .sum();
    let pss_per_child_kib = pss / n.max(1) as u64;
    let parent_pss_kib = parent.memory_pss_kib()?;
    drop(children);

    // Baseline: a fork by full copy of guest memory (freeze, copy the frozen image, then
    // the same child build).
    let (frozen, freeze_report) = vmm::freeze(&mut parent)?;
    let tb = Instant::now();
    let frozen = frozen.with_copied_memory()?;
    let copy_time = tb.elapsed();
    let base_pause = freeze_report.pause_time;
    let bsock = dir.join("baseline.sock");
    let child = frozen.child(ChildSpec {
        disk_path: None,
        vsock_path: Some(bsock.clone()),
        guest_cid: 99,
        serial: SerialOutput::Memory,
        shell: shells(machine, 1)?.pop(),
        agent_sync: None,
        hostname_suffix: String::new(),
        start: true,
        vcpu_cpus: Vec::new(),
        net: nets.as_ref().map(|b| b.config(n + 1)),
        vsock_bound_ahead: None,
    })?;
    ping_once(&bsock)?;
    let baseline = base_pause + tb.elapsed();
    drop(child);
    drop(parent);

    Ok(ForkReport {
        mem_mib,
        fill_mib,
        n,
        pause_time: report.pause_time,
        pause_steps: report.pause_steps,
        child: samples.summary("child_first_ping"),
        built,
        all,
        pss_per_child_kib,
        parent_pss_kib,
        baseline,
        copy_time,
        parent_ping_before_us: before.p50_us,
        parent_first_ping,
        restored: params.restored,
        without_net,
        noise: crate::HostNoise::measure(crate::noise::NOISE_TRIES),
    })
}

/// A thread started ahead that, told to go, runs one ping, sends `(its index, the round
/// trip)` and ends when released (the barrier: every pinger and the benchmark).
struct Pinger {
    go: std::sync::mpsc::SyncSender<()>,
    handle: std::thread::JoinHandle<()>,
}

impl Pinger {
    fn start(
        index: usize,
        answers: &std::sync::mpsc::Sender<(usize, Result<Duration>)>,
        release: &Arc<std::sync::Barrier>,
        ping: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Result<Pinger> {
        let (go, wait) = std::sync::mpsc::sync_channel(1);
        let (answers, release) = (answers.clone(), Arc::clone(release));
        let handle = std::thread::Builder::new()
            .name("bench-pinger".into())
            .spawn(move || {
                // Never told to go: the benchmark failed before the fork.
                if wait.recv().is_err() {
                    return;
                }
                let t = Instant::now();
                let r = ping().map(|()| t.elapsed());
                let _ = answers.send((index, r));
                release.wait();
            })
            .context("starting a pinger thread")?;
        Ok(Pinger { go, handle })
    }

    fn go(&self) {
        // The thread waits for this; it cannot have ended before.
        let _ = self.go.send(());
    }

    fn join(self) -> Result<()> {
        self.handle
            .join()
            .map_err(|_| Error::ThreadPanicked("pinger"))
    }
}

/// Pings of the parent before the fork (their median is what its first ping after the
/// fork is compared with).
const PARENT_PINGS_BEFORE: usize = 20;

impl ForkReport {
    /// What the parent pays after the fork, as measured here: its first agent round trip
    /// after the fork minus its usual one before (the faults of the pages that round trip
    /// touches; a guest that rewrites more memory pays ~a copy of each page it writes).
    pub fn parent_after_us(&self) -> i64 {
        self.parent_first_ping.as_micros() as i64 - self.parent_ping_before_us as i64
    }

    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "bench": "fork",
            "mem_mib": self.mem_mib,
            "fill_mib": self.fill_mib,
            "n": self.n,
            "restored": self.restored.map(|b| b.to_string()),
            "pause_us": self.pause_time.as_micros() as u64,
            "pause_steps_us": self
                .pause_steps
                .iter()
                .map(|(k, d)| (k.to_string(), d.as_micros() as u64))
                .collect::<BTreeMap<_, _>>(),
            "child_p50_us": self.child.p50_us as u64,
            "child_p99_us": self.child.p99_us as u64,
            "children_built_ms": self.built.as_secs_f64() * 1e3,
            "all_ms": self.all.as_secs_f64() * 1e3,
            "parent_after_us": self.parent_after_us(),
            "parent_ping_before_us": self.parent_ping_before_us as u64,
            "parent_first_ping_us": self.parent_first_ping.as_micros() as u64,
            "pss_per_child_kib": self.pss_per_child_kib,
            "parent_pss_kib": self.parent_pss_kib,
            "baseline_child_p50_us": self.baseline.as_micros() as u64,
            "baseline_copy_us": self.copy_time.as_micros() as u64,
            "host_noise": self.noise.to_json(),
            "net": self.without_net.is_some(),
            "without_net_child_p50_us": self.without_net.as_ref().map(|w| w.child.p50_us as u64),
            "without_net_child_p99_us": self.without_net.as_ref().map(|w| w.child.p99_us as u64),
            "without_net_pause_us": self.without_net.as_ref().map(|w| w.pause_time.as_micros() as u64),
            "net_added_child_p50_pct": self.without_net.as_ref().map(|w| {
                ((self.child.p50_us - w.child.p50_us) / w.child.p50_us * 1000.0).round() / 10.0
            }),
        })
        .to_string()
    }
}

/// A few lines of text.
impl fmt::Display for ForkReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (mem_mib, fill_mib, n) = (self.mem_mib, self.fill_mib, self.n);
        writeln!(
            f,
            "fork of a {mem_mib} MiB guest ({fill_mib} MiB filled{}) into {n} children",
            self.restored
                .map(|b| format!(", restored with {b}"))
                .unwrap_or_default()
        )?;
        writeln!(
            f,
            "  parent paused       {:?} ({:?})",
            self.pause_time, self.pause_steps
        )?;
        writeln!(
            f,
            "  parent after        +{} us (first ping after the fork {} us, p50 before {} us)",
            self.parent_after_us(),
            self.parent_first_ping.as_micros(),
            self.parent_ping_before_us as u64
        )?;
        writeln!(
            f,
            "  child first ping    p50 {} us, p99 {} us",
            self.child.p50_us as u128, self.child.p99_us as u128
        )?;
        writeln!(
            f,
            "  all {n} answering    {:.2} ms (built in {:.2} ms)",
            self.all.as_secs_f64() * 1e3,
            self.built.as_secs_f64() * 1e3
        )?;
        writeln!(
            f,
            "  PSS per idle child  {} KiB (parent {} KiB)",
            self.pss_per_child_kib, self.parent_pss_kib
        )?;
        write!(
            f,
            "  baseline (full copy) child first ping {} us (copy {:?})",
            self.baseline.as_micros(),
            self.copy_time
        )?;
        if let Some(w) = &self.without_net {
            write!(
                f,
                "\n  the above with a NIC per VM (each TAP in its own namespace); without: \
                 pause {:?}, child first ping p50 {} us, p99 {} us -> networking adds \
                 {:+.1}% at p50",
                w.pause_time,
                w.child.p50_us as u128,
                w.child.p99_us as u128,
                (self.child.p50_us - w.child.p50_us) / w.child.p50_us * 100.0
            )?;
        }
        write!(f, "\n  {}", self.noise)
    }
}

impl crate::report::Reported for ForkReport {
    fn section(&self, scenario: &str) -> crate::report::Section {
        use crate::report::{Headline, Plot, Section, Series};
        use crate::stats::{us, Samples};
        let once = |d: Duration| Samples::from_us(vec![us(d)]);
        let child = |n| format!("child's first answered ping from the fork call, p50 ({n})");
        let mut headlines = vec![
            Headline::new(
                child("of a copy-on-write fork"),
                Some(self.child.p50_us),
                "us",
            )
            .against(
                "fork by full memory copy (one child)",
                Some(us(self.baseline)),
            ),
            Headline::new("parent paused", Some(us(self.pause_time)), "us"),
        ];
        if let Some(w) = &self.without_net {
            headlines.push(
                Headline::new(child("with a NIC"), Some(self.child.p50_us), "us")
                    .against("the same without network", Some(w.child.p50_us)),
            );
        }
        let mut seq = vec![Series::measured(
            "child: the pause, its build, its first answered ping",
            &self.child.samples,
        )];
        if let Some(w) = &self.without_net {
            seq.push(Series::baseline("same, without network", &w.child.samples));
        }
        seq.push(Series::baseline(
            "fork by full memory copy (baseline, one child)",
            &once(self.baseline),
        ));
        let pause: Vec<(String, f64)> = self
            .pause_steps
            .iter()
            .map(|(k, d)| (k.to_string(), us(*d)))
            .collect();
        Section::new(
            scenario,
            self.to_string(),
            &self.to_json(),
            vec![
                Plot::sequence(
                    "children",
                    "Each fork child's first answered ping, from the fork call",
                    "child",
                    seq,
                ),
                Plot::steps(
                    "pause",
                    "The parent's pause",
                    vec![("parent pause".into(), pause)],
                ),
                self.noise.plot(),
            ],
        )
        .with_headlines(headlines)
    }
}

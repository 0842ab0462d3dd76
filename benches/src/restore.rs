//! `restore` (alias `resume`): from `PreparedSnapshot::restore` until the native guest
//! (snapshotted while its `vsock` step waits for a connection) answered an agent ping over
//! vsock; page faults, bytes read, and the `copy` backend as the baseline.

use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use vmm::{MemoryBackend, PreparedSnapshot, RestoreOptions, SerialOutput, ShellPool, SnapshotKind};

use crate::error::{Context, Error, Result};
use crate::guest::{boot_until, connect_and_ping, serial, Guest, Machine, Scratch};
use crate::net::BenchNets;
use crate::noise::{HostNoise, NOISE_TRIES};
use crate::stats::{pct_u64, r1, us, Samples, StepTimes};
use crate::FILL_BASE_MIB;

/// What `restore` measures.
#[derive(Debug, Clone)]
pub struct RestoreParams {
    /// Memory backend measured.
    pub backend: MemoryBackend,
    /// Number of measured restores (at least 1).
    pub n: usize,
    /// Pre-built VM shells kept ready, with each restore's vsock socket bound ahead as a
    /// service's standby binds it (0: build a shell and bind the socket at each restore).
    pub pool: usize,
    /// With the pool: each shell prefilled for the restore before it is timed (as a
    /// standby's is: `PreparedSnapshot::prefill_shell`).
    pub prefill: bool,
    /// Percentage of the guest memory above 64 MiB the guest fills before the snapshot.
    pub fill_pct: u32,
    /// Restores of the copy baseline (`None`: `n`; 0: none).
    pub baseline_n: Option<usize>,
    /// Pin the VMM's threads to CPU 0 and the vCPUs to the other CPUs.
    pub pin: bool,
    /// Restore a VM with a network device, its TAP in a network namespace of its own
    /// (made beforehand, as `clade serve`'s pool does), and measure the same restores of
    /// the same guest without one in the same run: what networking adds (root only).
    pub net: bool,
}

/// The `--net` part of a restore report.
#[derive(Debug, Clone)]
pub struct NetRun {
    /// The same backend's restores of the guest without a network device.
    pub without: BackendRun,
    /// Making a sandbox network (namespace, veth pair, TAP, rules): a pool's refill, off
    /// the restore's path.
    pub create: Samples,
    /// Removing one.
    pub destroy: Samples,
}

/// One backend's restore measurements.
#[derive(Debug, Clone)]
pub struct BackendRun {
    /// The memory backend.
    pub backend: MemoryBackend,
    /// Restore call until the first answered ping.
    pub samples: Samples,
    /// Page faults served per restore.
    pub faults: Vec<u64>,
    /// Bytes read from the memory file per restore.
    pub bytes_read: Vec<u64>,
    /// Restore steps.
    pub steps: StepTimes,
    /// uffd: the first (recording) restore and its faults.
    pub cold: Option<(Duration, u64)>,
    /// uffd: pages of the working set recorded by the first restore.
    pub working_set_pages: Option<usize>,
    /// A second ping on the same connection right after the first (not in the restore's
    /// time): the guest's warm round trip, against which the first one's cost shows.
    pub second_ping: Samples,
}

/// What `restore` reports.
#[derive(Debug, Clone)]
pub struct RestoreReport {
    /// The machine restored.
    pub machine: Machine,
    /// Pre-built VM shells kept ready.
    pub pool: usize,
    /// Each shell prefilled for its restore, untimed.
    pub prefill: bool,
    /// CPUs the vCPUs were pinned to (empty: not pinned).
    pub vcpu_cpus: Vec<usize>,
    /// MiB the guest filled before the snapshot.
    pub fill_mib: u64,
    /// Pages the snapshot wrote.
    pub snapshot_pages: u64,
    /// Opening the snapshot.
    pub open: Samples,
    /// The measured backend.
    pub main: BackendRun,
    /// The copy baseline, when measured apart.
    pub baseline: Option<BackendRun>,
    /// With `--net`: `main` had a network device; this is the run without.
    pub net: Option<NetRun>,
    /// The host's noise, measured after the restores on the same thread.
    pub noise: HostNoise,
}

const STEP_ORDER: &[&str] = &[
    "read_check",
    "shell",
    "disk",
    "memory",
    "devices",
    "vm_state",
    "vcpu_state",
    "start",
    "devices_finish",
    "connect_ping",
];

/// Pins this thread (and so every VMM thread it starts from now on) to host CPU 0 until
/// the returned pin is dropped, and returns the CPUs left for vCPUs: the native guest
/// busy-polls, and a VMM thread queued behind a spinning vCPU on a 2-CPU host waits out a
/// scheduler time slice (~3 ms). Dropped at the end of its benchmark: what runs after it
/// (`clade bench all` starts services later) is not confined to CPU 0.
pub(crate) fn pin_vmm_threads() -> Result<(Option<vmm::CpuPin>, Vec<usize>)> {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    if cpus < 2 {
        return Ok((None, Vec::new()));
    }
    let pin = vmm::CpuPin::current_thread(0).context("pinning the VMM to CPU 0")?;
    Ok((Some(pin), (1..cpus).collect()))
}

impl BackendRun {
    pub(crate) fn new(backend: MemoryBackend) -> Self {
        BackendRun {
            backend,
            samples: Samples::new(),
            faults: Vec::new(),
            bytes_read: Vec::new(),
            steps: StepTimes::default(),
            cold: None,
            working_set_pages: None,
            second_ping: Samples::new(),
        }
    }
}

/// What one resume needs besides its round number.
pub(crate) struct Resume<'a> {
    pub(crate) snap: &'a PreparedSnapshot,
    pub(crate) sock: &'a Path,
    pub(crate) backend: MemoryBackend,
    pub(crate) pool: Option<&'a ShellPool>,
    pub(crate) prefill: bool,
    pub(crate) vcpu_cpus: &'a [usize],
    pub(crate) net: Option<&'a vmm::NetConfig>,
}

impl Resume<'_> {
    /// Rounds for `n` measured resumes: uffd's first one records the working set and is
    /// reported apart, as the cold resume.
    fn rounds(&self, n: usize) -> usize {
        n + usize::from(self.backend == MemoryBackend::Uffd)
    }

    /// Resume round `i`: from the call to `PreparedSnapshot::restore` until the guest
    /// answered a ping through vsock, into `run`.
    pub(crate) fn once(&self, i: usize, run: &mut BackendRun) -> Result<()> {
        let backend = self.backend;
        if let Some(p) = self.pool {
            // Resumes spaced so the pool is full again (its refill is not measured).
            if !p.wait_full(Duration::from_secs(10)) {
                return Err(Error::Guest(format!(
                    "the VM pool did not refill: {}",
                    p.last_error().unwrap_or_default()
                )));
            }
        }
        // With the pool, the VM's vsock socket is bound ahead too, as a service's standby
        // process binds it while it waits: the restore moves it into place.
        let bound_ahead = match self.pool {
            Some(_) => Some(
                vmm::bind_vsock_ahead(&self.sock.with_extension("ahead"))
                    .context("binding the vsock socket ahead")?,
            ),
            None => None,
        };
        // A standby prepares its shell while it waits: not timed.
        let shell = match self.pool.and_then(ShellPool::take) {
            Some(s) if self.prefill && backend == MemoryBackend::Uffd => Some(
                self.snap
                    .prefill_shell(s)
                    .context_with(|| format!("prefilling a shell for resume {i}"))?,
            ),
            s => s,
        };
        let t0 = Instant::now();
        let mut vm = self
            .snap
            .restore(
                backend,
                RestoreOptions {
                    serial: SerialOutput::Memory,
                    vsock_path: Some(self.sock.to_path_buf()),
                    vsock_bound_ahead: bound_ahead,
                    shell,
                    vcpu_cpus: self.vcpu_cpus.to_vec(),
                    net: self.net.cloned(),
                    ..RestoreOptions::default()
                },
            )
            .context_with(|| format!("{backend} resume {i}"))?;
        let t_resumed = t0.elapsed();
        // Connect, Hello and a Ping in one write, until the Pong (`connect_ping`).
        let client = connect_and_ping(self.sock, Duration::from_secs(10)).context_with(|| {
            format!(
                "{backend} resume {i}: connecting and pinging; serial:\n{}",
                serial(&vm)
            )
        })?;
        let total = t0.elapsed();
        let t = Instant::now();
        client
            .ping()
            .context_with(|| format!("{backend} resume {i}: a second ping"))?;
        let second_ping = t.elapsed();
        tracing::debug!(%backend, i, ?total, "restore");
        let stats = vm.page_server_stats();
        let report = vm.restore_report().cloned();
        if backend == MemoryBackend::Uffd && i == 0 {
            run.cold = Some((total, stats.map_or(0, |s| s.faults)));
            run.working_set_pages = vm.save_working_set()?;
        } else {
            run.samples.push(total);
            run.faults.push(stats.map_or(0, |s| s.faults));
            run.bytes_read.push(stats.map_or_else(
                || report.as_ref().map_or(0, |r| r.bytes_read),
                |s| s.bytes_read,
            ));
            if let Some(r) = &report {
                for (name, d) in &r.steps {
                    run.steps.add(name, *d);
                }
                run.steps
                    .add("start_to_return", t_resumed.saturating_sub(r.total));
            }
            run.steps.add("connect_ping", total - t_resumed);
            run.second_ping.push(second_ping);
        }
        drop(vm);
        drop(client);
        Ok(())
    }

    /// `n` measured resumes.
    fn measure(&self, n: usize) -> Result<BackendRun> {
        let mut run = BackendRun::new(self.backend);
        for i in 0..self.rounds(n) {
            self.once(i, &mut run)?;
        }
        Ok(run)
    }
}

/// The guest's steps for a snapshot of a machine that has touched some memory: fill
/// `fill_pct` percent of the memory above [`FILL_BASE_MIB`], then serve the agent on
/// vsock. Returns the MiB filled and the steps.
pub(crate) fn filled_then_serving(machine: &Machine, fill_pct: u32) -> (u64, String) {
    let fill_mib = machine.mem_mib.saturating_sub(FILL_BASE_MIB) * u64::from(fill_pct) / 100;
    let steps = if fill_mib > 0 {
        format!("memfill:5:{fill_mib},vsock")
    } else {
        "vsock".to_string()
    };
    (fill_mib, steps)
}

/// Boots the guest (filling `fill_pct` of its memory, then waiting in its `vsock` step),
/// snapshots it, and restores that snapshot `n` times with `backend`, then with the copy
/// backend as the baseline.
pub fn restore(guest: &Guest, machine: &Machine, params: &RestoreParams) -> Result<RestoreReport> {
    if params.n == 0 {
        return Err(Error::InvalidParams("-n must be at least 1".into()));
    }
    if params.fill_pct > 100 {
        return Err(Error::InvalidParams(
            "--fill must be a percentage (0..=100)".into(),
        ));
    }
    let (_pin, vcpu_cpus) = if params.pin {
        pin_vmm_threads()?
    } else {
        (None, Vec::new())
    };
    let scratch = Scratch::new("resume")?;
    let dir = scratch.0.join("snap");
    let sock = scratch.0.join("v.sock");
    let (fill_mib, steps) = filled_then_serving(machine, params.fill_pct);
    // --net: the sandbox network the restored VMs attach to (one, made before: a
    // service's pool makes them off the path), in a range and with names of this run's own.
    let sandbox_net = if params.net {
        Some(BenchNets::new(1)?)
    } else {
        None
    };
    let net_cfg = sandbox_net.as_ref().map(|n| n.config(0));
    let mut vm = crate::guest::boot_until_with(
        guest,
        machine,
        &steps,
        Some(&sock),
        "serving agent port",
        net_cfg.clone(),
    )?;
    let snap = vmm::snapshot(&mut vm, &dir, SnapshotKind::Full)?;
    vm.shutdown();
    drop(vm);
    // The same guest without a network device, for the comparison.
    let plain_dir = scratch.0.join("snap-plain");
    if params.net {
        let mut vm = boot_until(guest, machine, &steps, Some(&sock), "serving agent port")?;
        vmm::snapshot(&mut vm, &plain_dir, SnapshotKind::Full)?;
        vm.shutdown();
    }

    let pool = if params.pool > 0 {
        Some(ShellPool::new(machine.shell_spec(), params.pool)?)
    } else {
        None
    };
    // Opening a snapshot (reading and checking its files) is done once, as a service
    // resuming one snapshot many times would; its cost is reported apart.
    let mut open = Samples::new();
    for _ in 0..20 {
        let t = Instant::now();
        drop(PreparedSnapshot::open(&dir, Default::default())?);
        open.push(t.elapsed());
    }
    let prepared = PreparedSnapshot::open(&dir, Default::default())?;
    let resume = Resume {
        snap: &prepared,
        sock: &sock,
        backend: params.backend,
        pool: pool.as_ref(),
        prefill: params.prefill,
        vcpu_cpus: &vcpu_cpus,
        net: net_cfg.as_ref(),
    };
    let (main, net) = match &sandbox_net {
        None => (resume.measure(params.n)?, None),
        Some(bn) => {
            // With and without a NIC, round by round (a drift of the host hits both).
            let plain = PreparedSnapshot::open(&plain_dir, Default::default())?;
            let without_nic = Resume {
                snap: &plain,
                net: None,
                ..resume
            };
            let (mut main, mut without) = (
                BackendRun::new(params.backend),
                BackendRun::new(params.backend),
            );
            for i in 0..resume.rounds(params.n) {
                resume.once(i, &mut main)?;
                without_nic.once(i, &mut without)?;
            }
            let (create, destroy) = bn.setup_cost(20)?;
            (
                main,
                Some(NetRun {
                    without,
                    create,
                    destroy,
                }),
            )
        }
    };
    let baseline = match params.baseline_n {
        Some(0) => None,
        _ if params.backend == MemoryBackend::Copy => None,
        bn => Some(
            Resume {
                backend: MemoryBackend::Copy,
                ..resume
            }
            .measure(bn.unwrap_or(params.n))?,
        ),
    };
    Ok(RestoreReport {
        machine: machine.clone(),
        pool: params.pool,
        prefill: params.prefill && params.pool > 0,
        vcpu_cpus,
        fill_mib,
        snapshot_pages: snap.pages_written,
        open,
        main,
        baseline,
        net,
        noise: HostNoise::measure(NOISE_TRIES),
    })
}

impl RestoreReport {
    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let main = &self.main;
        let backend = main.backend;
        let s = main.samples.summary("resume_to_first_ping");
        let base_s = self
            .baseline
            .as_ref()
            .map(|b| b.samples.summary("resume_to_first_ping"));
        let (baseline_p50, baseline_p99) = match (&base_s, backend) {
            (Some(b), _) => (b.p50_us, b.p99_us),
            (None, MemoryBackend::Copy) => (s.p50_us, s.p99_us),
            (None, _) => (f64::NAN, f64::NAN),
        };
        json!({
            "backend": backend.name(),
            "mem_mib": self.machine.mem_mib,
            "vcpus": self.machine.vcpus,
            "n": s.n,
            "p50_us": r1(s.p50_us),
            "p99_us": r1(s.p99_us),
            "min_us": r1(s.min_us),
            "max_us": r1(s.max_us),
            "faults_p50": pct_u64(&main.faults, 50.0),
            "faults_p99": pct_u64(&main.faults, 99.0),
            "bytes_read_p50": pct_u64(&main.bytes_read, 50.0),
            "baseline_backend": "copy",
            "baseline_n": match (&base_s, backend) {
                (Some(b), _) => b.n,
                (None, MemoryBackend::Copy) => s.n,
                (None, _) => 0,
            },
            "baseline_p50_us": r1(baseline_p50),
            "baseline_p99_us": r1(baseline_p99),
            "baseline_bytes_read_p50": self.baseline.as_ref().map_or_else(
                || pct_u64(&main.bytes_read, 50.0),
                |b| pct_u64(&b.bytes_read, 50.0)
            ),
            "speedup_p50": r1(baseline_p50 / s.p50_us),
            "cold_us": main.cold.map(|c| r1(us(c.0))),
            "cold_faults": main.cold.map(|c| c.1),
            "working_set_pages": main.working_set_pages,
            "open_p50_us": r1(self.open.percentile(50.0).unwrap_or(f64::NAN)),
            "pool": self.pool,
            "prefill": self.prefill,
            "vcpu_cpus": self.vcpu_cpus,
            "fill_mib": self.fill_mib,
            "snapshot_pages": self.snapshot_pages,
            "measured": "PreparedSnapshot::restore call until a ping answered over vsock (vmm::agent::Client::connect_and_ping: a new connection whose Hello and Ping go out together; native guest `vsock` step); opening the snapshot (open_p50_us) is done once",
            "steps_p50_us": main.steps.p50_json(STEP_ORDER),
            "second_ping_p50_us": r1(main.second_ping.percentile(50.0).unwrap_or(f64::NAN)),
            "host_noise": self.noise.to_json(),
            "baseline_steps_p50_us": self.baseline.as_ref().map(|b| b.steps.p50_json(STEP_ORDER)),
            "net": self.net.is_some(),
            "without_net_p50_us": self.net.as_ref().map(|n| r1(n.without.samples.summary("x").p50_us)),
            "without_net_p99_us": self.net.as_ref().map(|n| r1(n.without.samples.summary("x").p99_us)),
            "net_added_p50_pct": self.net.as_ref().map(|n| {
                let w = n.without.samples.summary("x").p50_us;
                r1((s.p50_us - w) / w * 100.0)
            }),
            "without_net_steps_p50_us": self.net.as_ref().map(|n| n.without.steps.p50_json(STEP_ORDER)),
            "netns_create_p50_us": self.net.as_ref().map(|n| r1(n.create.percentile(50.0).unwrap_or(f64::NAN))),
            "netns_destroy_p50_us": self.net.as_ref().map(|n| r1(n.destroy.percentile(50.0).unwrap_or(f64::NAN))),
        })
        .to_string()
    }
}

/// A few lines of text.
impl fmt::Display for RestoreReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let main = &self.main;
        let s = main.samples.summary("resume_to_first_ping");
        write!(
            f,
            "resume_to_first_ping {}: n={} p50={:.1} us p99={:.1} us, faults p50 {}, \
             {} MiB guest ({} MiB filled), pool {}{}",
            main.backend,
            s.n,
            s.p50_us,
            s.p99_us,
            pct_u64(&main.faults, 50.0),
            self.machine.mem_mib,
            self.fill_mib,
            self.pool,
            if self.prefill {
                " (each shell prefilled for its restore, untimed)"
            } else {
                ""
            }
        )?;
        if let Some((cold, faults)) = main.cold {
            write!(
                f,
                "\n  cold (first, recording): {:.1} us, {faults} faults; working set {} pages",
                us(cold),
                main.working_set_pages.unwrap_or(0)
            )?;
        }
        write!(f, "\n  steps p50 (us): {}", main.steps.p50_json(STEP_ORDER))?;
        write!(
            f,
            "\n  a second ping on the same connection (the warm round trip): p50 {:.1} us",
            main.second_ping.percentile(50.0).unwrap_or(f64::NAN)
        )?;
        if let Some(n) = &self.net {
            let w = n.without.samples.summary("resume_to_first_ping");
            write!(
                f,
                "\n  with a NIC (TAP in its own namespace) above; without: n={} p50={:.1} us \
                 p99={:.1} us -> networking adds {:+.1}% at p50\n  making a sandbox \
                 network (off the path, a pool's refill): p50 {:.0} us, removing one p50 {:.0} us",
                w.n,
                w.p50_us,
                w.p99_us,
                (s.p50_us - w.p50_us) / w.p50_us * 100.0,
                n.create.percentile(50.0).unwrap_or(f64::NAN),
                n.destroy.percentile(50.0).unwrap_or(f64::NAN),
            )?;
        }
        if let Some(b) = &self.baseline {
            let b = b.samples.summary("resume_to_first_ping");
            write!(
                f,
                "\n  baseline copy: n={} p50={:.1} us p99={:.1} us -> {:.1}x",
                b.n,
                b.p50_us,
                b.p99_us,
                b.p50_us / s.p50_us
            )?;
        }
        write!(f, "\n  {}", self.noise)
    }
}

impl crate::report::Reported for RestoreReport {
    fn section(&self, scenario: &str) -> crate::report::Section {
        use crate::report::{Headline, Plot, Section, Series};
        let backend = self.main.backend.name();
        let p50 = self.main.samples.percentile(50.0);
        let mut main = Headline::new(
            format!("{backend} restore until the first answered ping, p50"),
            p50,
            "us",
        );
        if let Some(b) = &self.baseline {
            main = main.against("copy restore", b.samples.percentile(50.0));
        }
        let mut headlines = vec![main];
        if let Some(n) = &self.net {
            headlines.push(
                Headline::new(format!("{backend} restore with a NIC, p50"), p50, "us").against(
                    "the same without network",
                    n.without.samples.percentile(50.0),
                ),
            );
        }
        let mut dist = vec![Series::measured(
            format!("{backend} restore"),
            &self.main.samples,
        )];
        if let Some(b) = &self.baseline {
            dist.push(Series::baseline("copy restore (baseline)", &b.samples));
        }
        if let Some(n) = &self.net {
            dist.push(Series::baseline(
                "same, without network",
                &n.without.samples,
            ));
        }
        dist.push(Series::baseline(
            "warm round trip (second ping)",
            &self.main.second_ping,
        ));
        let mut bars = vec![(
            format!("{backend} restore"),
            self.main.steps.p50s(STEP_ORDER),
        )];
        if let Some(b) = &self.baseline {
            bars.push(("copy restore".into(), b.steps.p50s(STEP_ORDER)));
        }
        Section::new(
            scenario,
            self.to_string(),
            &self.to_json(),
            vec![
                Plot::distribution("restore", "Restore until the first answered ping", dist),
                Plot::steps("steps", "Restore steps", bars),
                self.noise.plot(),
            ],
        )
        .with_headlines(headlines)
    }
}

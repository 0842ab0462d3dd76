//! `serve`: the sandbox host as its users see it. `clade serve` runs as a child process and
//! is driven over HTTP/1.1 (a keep-alive connection, as the e2b SDK's client keeps one):
//!
//! - **create**: `POST /v2/sandboxes` of a template made from the native test guest, until
//!   the new sandbox's agent answered a ping over its vsock socket;
//! - **wake**: a paused sandbox, `POST /v2/sandboxes/{id}/connect`, until its agent
//!   answered a ping (the restore happens on the request's path).
//!
//! - **data plane**: what `clade serve`'s data plane adds to an agent round trip: envd's
//!   `GET /health` for a running sandbox (routed by its `E2b-Sandbox-Id` header, answered
//!   once the sandbox's agent answered a ping over vsock: HTTP + routing + the agent
//!   connection), against the same ping sent straight to the sandbox's vsock socket on a
//!   kept connection; the two interleaved, so drift hits both alike. Added = the
//!   difference of the p50s.
//!
//! Each is measured with `background` other sandboxes already on the host. Those are
//! *paused* (a paused sandbox holds no guest memory and no process), so these runs
//! measure what many sandboxes cost the service's bookkeeping; running ones are the
//! `--running` case's. HTTP is ureq (no TLS); the service is the real binary with its real
//! registry, processes and sockets.
//!
//! Two more cases, each on a service of its own, when asked for: `--running N`
//! ([`density`]: N sandboxes running at once, checked to answer, their processes and
//! memory counted, creates with N running against one running) and `--sustain SECONDS`
//! ([`sustain`]: creates by concurrent clients as fast as the host sustains them).

mod census;
mod density;
mod render;
pub(crate) mod service;
mod sustain;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Context, Error, Result};
use crate::guest::{probe, Guest};
use crate::stats::Samples;

pub use census::Census;
pub use density::{RunningRun, BEYOND_GUEST_TARGET_MIB, PROCESSES_TARGET, RUNNING_TARGET_RATIO};
pub(crate) use service::Service;
pub use sustain::{SustainRun, SUSTAIN_TARGET_PER_S};

/// What to run.
#[derive(Debug, Clone)]
pub struct ServeParams {
    /// The `clade` executable (its `template build` and `serve`).
    pub clade: PathBuf,
    /// Measured creates and wakes per run.
    pub n: usize,
    /// Runs: how many paused sandboxes are on the host during each.
    pub background: Vec<usize>,
    /// The `--running` case: this many sandboxes running at once (none: not run).
    pub running: Option<usize>,
    /// The `--sustain` case: creates for this many seconds (none: not run).
    pub sustain: Option<f64>,
    /// Concurrent clients of the `--running` fill and of `--sustain`.
    pub clients: usize,
}

/// One run's figures.
#[derive(Debug)]
pub struct ServeRun {
    /// Paused sandboxes on the host besides the measured ones.
    pub background: usize,
    /// create → ping answered.
    pub create: Samples,
    /// create → HTTP answer (the part of `create` spent in the service).
    pub create_http: Samples,
    /// connect of a paused sandbox → ping answered.
    pub wake: Samples,
    /// connect → HTTP answer (the part of `wake` spent in the service).
    pub wake_http: Samples,
}

/// The data-plane case (see the module documentation).
#[derive(Debug)]
pub struct DataPlaneRun {
    /// Agent ping straight over the sandbox's vsock socket (a kept connection).
    pub direct: Samples,
    /// `GET /health` through `clade serve` (a kept HTTP/1.1 connection).
    pub through: Samples,
}

impl DataPlaneRun {
    /// p50 through the data plane minus p50 direct, in µs.
    pub fn added_p50_us(&self) -> Option<f64> {
        Some(self.through.percentile(50.0)? - self.direct.percentile(50.0)?)
    }
}

/// Every run.
#[derive(Debug)]
pub struct ServeReport {
    /// In the order of [`ServeParams::background`].
    pub runs: Vec<ServeRun>,
    /// Measured once, with one running sandbox and the last run's paused ones.
    pub dataplane: DataPlaneRun,
    /// Confined (the default) against unconfined, interleaved.
    pub confinement: ConfinementRun,
    /// The `--running` case, when asked for.
    pub running: Option<RunningRun>,
    /// The `--sustain` case, when asked for.
    pub sustain: Option<SustainRun>,
    /// The host's noise, measured after the runs (the service and its sandboxes idle).
    pub noise: crate::HostNoise,
}

/// Runs the benchmark (see the module documentation).
pub fn serve(guest: &Guest, params: &ServeParams) -> Result<ServeReport> {
    if params.n == 0 {
        return Err(Error::InvalidParams("--n must be at least 1".into()));
    }
    if params.running == Some(0) {
        return Err(Error::InvalidParams("--running must be at least 1".into()));
    }
    if params.sustain.is_some_and(|s| !(s > 0.0 && s.is_finite())) {
        return Err(Error::InvalidParams(
            "--sustain must be above 0 seconds".into(),
        ));
    }
    if params.clients == 0 {
        return Err(Error::InvalidParams("--clients must be at least 1".into()));
    }
    let service = Service::start(&params.clade, guest, &[], &[])?;
    let mut paused = Vec::new();
    let mut runs = Vec::new();
    for &background in &params.background {
        while paused.len() < background {
            let id = service.create()?;
            probe(&service.vsock(&id)).context("a background sandbox's agent")?;
            service.pause(&id)?;
            paused.push(id);
        }
        let mut create = Samples::new();
        let mut create_http = Samples::new();
        for _ in 0..params.n {
            let t = Instant::now();
            let id = service.create()?;
            create_http.push(t.elapsed());
            probe(&service.vsock(&id)).context("a new sandbox's agent")?;
            create.push(t.elapsed());
            service.kill(&id)?;
        }
        // One sandbox woken n times: each wake is a restore of its latest pause.
        let id = service.create()?;
        probe(&service.vsock(&id)).context("the woken sandbox's agent")?;
        let mut wake = Samples::new();
        let mut wake_http = Samples::new();
        for _ in 0..params.n {
            service.pause(&id)?;
            let t = Instant::now();
            service.connect(&id)?;
            wake_http.push(t.elapsed());
            probe(&service.vsock(&id)).context("a woken sandbox's agent")?;
            wake.push(t.elapsed());
        }
        service.kill(&id)?;
        runs.push(ServeRun {
            background,
            create,
            create_http,
            wake,
            wake_http,
        });
    }
    let dataplane = dataplane(&service, params.n.max(200))?;
    drop(service);
    // A ratio of two p50s: 200 pairs at least (at n=50 it moved by ±0.05 between runs).
    let confinement = confinement(&params.clade, guest, params.n.max(200))?;
    let running = params
        .running
        .map(|n| density::running(&params.clade, guest, n, params.n, params.clients))
        .transpose()
        .context("the --running case")?;
    let sustain = params
        .sustain
        .map(|s| sustain::sustain(&params.clade, guest, s, params.clients))
        .transpose()
        .context("the --sustain case")?;
    let noise = crate::HostNoise::measure(crate::noise::NOISE_TRIES);
    Ok(ServeReport {
        runs,
        dataplane,
        confinement,
        running,
        sustain,
        noise,
    })
}

/// The cost of confinement: creates and wakes on a service as it runs by default (each VM
/// process jailed — a user of its own, its own namespaces — and in its cgroup) and on a
/// second one started with `--no-jail --no-limits`, interleaved one for one so that both
/// see the same host, which of the two goes first alternating. Both are started for it:
/// a service that ran the other cases first answered creates ~4 % slower than a new one
/// of the same flags (two confined services compared, n=200, three runs: 1.017x, 1.093x,
/// 1.041x), which would have been counted as the jail's cost.
#[derive(Debug)]
pub struct ConfinementRun {
    /// create → ping answered, confined.
    pub create: Samples,
    /// The same, unconfined.
    pub create_free: Samples,
    /// wake → ping answered, confined.
    pub wake: Samples,
    /// The same, unconfined.
    pub wake_free: Samples,
    /// Of `create`, until the HTTP answer (the rest is the first ping of the new VM).
    pub create_http: Samples,
    /// The same, unconfined.
    pub create_http_free: Samples,
}

/// The target of confinement's cost: create and wake p50, confined, at most this many
/// times the same unconfined.
pub const CONFINEMENT_TARGET_RATIO: f64 = 1.10;

impl ConfinementRun {
    /// p50 confined / p50 unconfined, for creates and wakes.
    pub fn ratios(&self) -> (Option<f64>, Option<f64>) {
        let r = |a: &Samples, b: &Samples| Some(a.percentile(50.0)? / b.percentile(50.0)?);
        (
            r(&self.create, &self.create_free),
            r(&self.wake, &self.wake_free),
        )
    }
}

fn confinement(clade: &Path, guest: &Guest, n: usize) -> Result<ConfinementRun> {
    let confined = &Service::start(clade, guest, &[], &[])?;
    let free = Service::start(clade, guest, &["--no-jail", "--no-limits"], &[])?;
    let mut run = ConfinementRun {
        create: Samples::new(),
        create_free: Samples::new(),
        wake: Samples::new(),
        wake_free: Samples::new(),
        create_http: Samples::new(),
        create_http_free: Samples::new(),
    };
    let create = |s: &Service, out: &mut Samples, http: &mut Samples| -> Result<()> {
        let t = Instant::now();
        let id = s.create()?;
        http.push(t.elapsed());
        probe(&s.vsock(&id)).context("a new sandbox's agent")?;
        out.push(t.elapsed());
        s.kill(&id)
    };
    // Which goes first alternates: the second of a pair runs while the first's standby
    // refill may start, and neither service should always be second.
    for i in 0..n {
        if i % 2 == 0 {
            create(confined, &mut run.create, &mut run.create_http)?;
            create(&free, &mut run.create_free, &mut run.create_http_free)?;
        } else {
            create(&free, &mut run.create_free, &mut run.create_http_free)?;
            create(confined, &mut run.create, &mut run.create_http)?;
        }
    }
    let woken: Vec<String> = [confined, &free]
        .iter()
        .map(|s| {
            let id = s.create()?;
            probe(&s.vsock(&id)).context("the woken sandbox's agent")?;
            Ok(id)
        })
        .collect::<Result<_>>()?;
    for i in 0..n {
        let mut pair: Vec<_> = [confined, &free]
            .into_iter()
            .zip(woken.iter().zip([&mut run.wake, &mut run.wake_free]))
            .collect();
        if i % 2 == 1 {
            pair.reverse();
        }
        for (s, (id, out)) in pair {
            s.pause(id)?;
            let t = Instant::now();
            s.connect(id)?;
            probe(&s.vsock(id)).context("a woken sandbox's agent")?;
            out.push(t.elapsed());
        }
    }
    for (s, id) in [confined, &free].into_iter().zip(&woken) {
        s.kill(id)?;
    }
    Ok(run)
}

/// The data-plane case: `n` interleaved pairs on one running sandbox, after a warm-up.
fn dataplane(service: &Service, n: usize) -> Result<DataPlaneRun> {
    let id = service.create()?;
    let sock = service.vsock(&id);
    let client = crate::guest::connect(&sock, Duration::from_secs(20))
        .context_with(|| format!("connecting to {}", sock.display()))?;
    let mut run = DataPlaneRun {
        direct: Samples::new(),
        through: Samples::new(),
    };
    for i in 0..n + 20 {
        let t = Instant::now();
        client.ping()?;
        let direct = t.elapsed();
        let t = Instant::now();
        service.health(&id)?;
        let through = t.elapsed();
        if i >= 20 {
            run.direct.push(direct);
            run.through.push(through);
        }
    }
    drop(client);
    service.kill(&id)?;
    Ok(run)
}

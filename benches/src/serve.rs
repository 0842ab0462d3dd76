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
//! *paused* (a paused sandbox holds no guest memory and no process): a running native test
//! guest busy-polls a CPU, so running ones would measure this 2-CPU host's contention, not
//! the service. HTTP is ureq (no TLS); the service is the real binary with its real
//! registry, processes and sockets.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::error::{Context, Error, Result};
use crate::guest::{probe, Guest, Scratch};
use crate::stats::Samples;

const KEY: &str = "clade-bench";

/// What to run.
#[derive(Debug, Clone)]
pub struct ServeParams {
    /// The `clade` executable (its `template build` and `serve`).
    pub clade: PathBuf,
    /// Measured creates and wakes per run.
    pub n: usize,
    /// Runs: how many paused sandboxes are on the host during each.
    pub background: Vec<usize>,
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
    /// The host's noise, measured after the runs (the service and its sandboxes idle).
    pub noise: crate::HostNoise,
}

/// The `clade serve` process and its scratch state directory, both removed when dropped
/// (the sandboxes first: their VM processes outlive the service by design).
pub(crate) struct Service {
    child: Child,
    /// The service's state directory, removed when dropped (also when the service could
    /// not be started).
    state: Scratch,
    url: String,
    agent: ureq::Agent,
}

impl Service {
    /// `clade serve` with `extra` arguments and `env`, of a state directory with template
    /// `bench` built from the native test guest.
    pub(crate) fn start(
        clade: &Path,
        guest: &Guest,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> Result<Service> {
        let state = Scratch::new("serve")?;
        let kernel = guest.path_for_other_processes();
        // The guest's `vsock` step serves any number of agent connections, without a
        // console line per connection (`conn_log=0`): like a Linux guest, a sandbox paused
        // right after a connection ended is not woken into writing the rest of that line
        // an exit per byte (see the native guest's `vsock::Tuning`).
        let cmdline = "steps=vsock conn_log=0";
        let o = Command::new(clade)
            .args(["template", "build", "bench", "--test-device", "--mem", "64"])
            .arg("--kernel")
            .arg(&kernel)
            .arg("--cmdline")
            .arg(cmdline)
            .arg("--state-dir")
            .arg(&state.0)
            .output()
            .map_err(|source| Error::Io {
                what: "running clade template build".into(),
                source,
            })?;
        if !o.status.success() {
            return Err(Error::Guest(format!(
                "clade template build: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )));
        }
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| Error::Io {
                what: "finding a free port".into(),
                source,
            })?;
            l.local_addr()
                .map_err(|source| Error::Io {
                    what: "finding a free port".into(),
                    source,
                })?
                .port()
        };
        let child = Command::new(clade)
            .arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--state-dir")
            .arg(&state.0)
            // The key in the environment: a command line is visible to every local user.
            .env("CLADE_API_KEY", KEY)
            .args(["--max-timeout", "86400"])
            .args(extra)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            // CLADE_BENCH_SERVE_LOG=FILE keeps the service's log (with CLADE_LOG=info: the
            // timings of each create and resume).
            .stderr(
                match std::env::var_os("CLADE_BENCH_SERVE_LOG")
                    .and_then(|f| File::options().create(true).append(true).open(f).ok())
                {
                    Some(f) => Stdio::from(f),
                    None => Stdio::null(),
                },
            )
            .spawn()
            .map_err(|source| Error::Io {
                what: "starting clade serve".into(),
                source,
            })?;
        let service = Service {
            child,
            state,
            url: format!("http://127.0.0.1:{port}"),
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(60))
                .build(),
        };
        let t = Instant::now();
        while service.call("GET", "/v2/sandboxes", None).is_err() {
            if t.elapsed() > Duration::from_secs(20) {
                return Err(Error::Guest(
                    "clade serve did not answer within 20 s".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(service)
    }

    /// One request; the answer's JSON body (Null when empty).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        let req = self
            .agent
            .request(method, &format!("{}{path}", self.url))
            .set("X-API-KEY", KEY);
        let resp = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let text = match resp {
            Ok(r) => r.into_string(),
            Err(ureq::Error::Status(code, r)) => {
                return Err(Error::Guest(format!(
                    "{method} {path}: HTTP {code}: {}",
                    r.into_string().unwrap_or_default()
                )))
            }
            Err(e) => return Err(Error::Guest(format!("{method} {path}: {e}"))),
        }
        .map_err(|source| Error::Io {
            what: "reading an HTTP answer".into(),
            source,
        })?;
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text)
            .map_err(|e| Error::Guest(format!("{method} {path}: not JSON ({e}): {text}")))
    }

    pub(crate) fn create(&self) -> Result<String> {
        let v = self.call(
            "POST",
            "/v2/sandboxes",
            Some(json!({"templateID": "bench", "timeout": 3600})),
        )?;
        v["sandboxID"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| Error::Guest(format!("create answered without sandboxID: {v}")))
    }

    /// envd's `GET /health` for sandbox `id`, through the data plane: 204 expected.
    pub(crate) fn health(&self, id: &str) -> Result<()> {
        let r = self
            .agent
            .get(&format!("{}/health", self.url))
            .set("E2b-Sandbox-Id", id)
            .set("E2b-Sandbox-Port", "49983")
            .call()
            .map_err(|e| Error::Guest(format!("GET /health of {id}: {e}")))?;
        if r.status() != 204 {
            return Err(Error::Guest(format!(
                "GET /health of {id}: HTTP {}",
                r.status()
            )));
        }
        Ok(())
    }

    pub(crate) fn vsock(&self, id: &str) -> PathBuf {
        self.state.0.join("sandboxes").join(id).join("vm.vsock")
    }

    pub(crate) fn kill(&self, id: &str) -> Result<()> {
        self.call("DELETE", &format!("/sandboxes/{id}"), None)
            .map(|_| ())
    }

    pub(crate) fn pause(&self, id: &str) -> Result<()> {
        self.call("POST", &format!("/sandboxes/{id}/pause"), None)
            .map(|_| ())
    }

    pub(crate) fn connect(&self, id: &str) -> Result<()> {
        self.call(
            "POST",
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({"timeout": 3600})),
        )
        .map(|_| ())
    }

    /// Every sandbox the service knows (both states).
    fn all(&self) -> Result<Vec<String>> {
        let v = self.call("GET", "/v2/sandboxes?state=running,paused&limit=1000", None)?;
        Ok(v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["sandboxID"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(ids) = self.all() {
            for id in ids {
                let _ = self.kill(&id);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The state directory goes with `state`, after the service and its VMs.
    }
}

/// Runs the benchmark (see the module documentation).
pub fn serve(guest: &Guest, params: &ServeParams) -> Result<ServeReport> {
    if params.n == 0 {
        return Err(Error::InvalidParams("--n must be at least 1".into()));
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
    let noise = crate::HostNoise::measure(crate::noise::NOISE_TRIES);
    Ok(ServeReport {
        runs,
        dataplane,
        confinement,
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

impl ServeReport {
    /// One JSON object: the first run's figures at the top (`create_p50_us`, ...,
    /// `sandboxes`), every run under `runs`.
    pub fn to_json(&self) -> String {
        let run = |r: &ServeRun| {
            let p = |s: &Samples, q| s.percentile(q).map(|v| (v * 10.0).round() / 10.0);
            json!({
                "sandboxes": r.background + 1,
                "background_paused": r.background,
                "n": r.create.len(),
                "create_p50_us": p(&r.create, 50.0),
                "create_p99_us": p(&r.create, 99.0),
                "wake_p50_us": p(&r.wake, 50.0),
                "wake_p99_us": p(&r.wake, 99.0),
                "create_http_p50_us": p(&r.create_http, 50.0),
                "wake_http_p50_us": p(&r.wake_http, 50.0),
            })
        };
        let mut top = self.runs.first().map(run).unwrap_or_else(|| json!({}));
        let d = &self.dataplane;
        let r1 = |v: Option<f64>| v.map(|v| (v * 10.0).round() / 10.0);
        top["dataplane_n"] = json!(d.through.len());
        top["dataplane_direct_p50_us"] = json!(r1(d.direct.percentile(50.0)));
        top["dataplane_p50_us"] = json!(r1(d.through.percentile(50.0)));
        top["dataplane_p99_us"] = json!(r1(d.through.percentile(99.0)));
        top["dataplane_added_p50_us"] = json!(r1(d.added_p50_us()));
        let c = &self.confinement;
        let (cr, wr) = c.ratios();
        let r2 = |v: Option<f64>| v.map(|v| (v * 1000.0).round() / 1000.0);
        top["confinement"] = json!({
            "n": c.create.len(),
            "create_p50_us": r1(c.create.percentile(50.0)),
            "create_unconfined_p50_us": r1(c.create_free.percentile(50.0)),
            "wake_p50_us": r1(c.wake.percentile(50.0)),
            "wake_unconfined_p50_us": r1(c.wake_free.percentile(50.0)),
            "create_http_p50_us": r1(c.create_http.percentile(50.0)),
            "create_http_unconfined_p50_us": r1(c.create_http_free.percentile(50.0)),
            "create_ratio_p50": r2(cr),
            "wake_ratio_p50": r2(wr),
        });
        top["host_noise"] = self.noise.to_json();
        top["bench"] = json!("serve");
        top["runs"] = Value::Array(self.runs.iter().map(run).collect());
        top.to_string()
    }
}

impl std::fmt::Display for ServeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "clade serve over HTTP (native test guest template): create = POST /v2/sandboxes -> agent ping answered; wake = connect of a paused sandbox -> agent ping answered"
        )?;
        for r in &self.runs {
            let p = |s: &Samples, q| s.percentile(q).unwrap_or(f64::NAN);
            writeln!(
                f,
                "  {:>4} paused sandboxes on the host: create p50 {:>8.1} us  p99 {:>8.1} us | wake p50 {:>8.1} us  p99 {:>8.1} us  (n={}; HTTP answered p50: create {:.1} us, wake {:.1} us)",
                r.background,
                p(&r.create, 50.0),
                p(&r.create, 99.0),
                p(&r.wake, 50.0),
                p(&r.wake, 99.0),
                r.create.len(),
                p(&r.create_http, 50.0),
                p(&r.wake_http, 50.0)
            )?;
        }
        let d = &self.dataplane;
        let p = |s: &Samples, q| s.percentile(q).unwrap_or(f64::NAN);
        writeln!(
            f,
            "  data plane (GET /health -> agent ping, 1 running sandbox): p50 {:.1} us  p99 {:.1} us | direct agent ping p50 {:.1} us | added p50 {:.1} us  (n={})",
            p(&d.through, 50.0),
            p(&d.through, 99.0),
            p(&d.direct, 50.0),
            d.added_p50_us().unwrap_or(f64::NAN),
            d.through.len()
        )?;
        let c = &self.confinement;
        let (cr, wr) = c.ratios();
        writeln!(
            f,
            "  confinement (jail + cgroup per VM process vs --no-jail --no-limits, interleaved): create p50 {:.1} us vs {:.1} us ({:.3}x) | wake p50 {:.1} us vs {:.1} us ({:.3}x)  (n={}; target <= {:.2}x; create's HTTP answered p50 {:.1} us vs {:.1} us)",
            p(&c.create, 50.0),
            p(&c.create_free, 50.0),
            cr.unwrap_or(f64::NAN),
            p(&c.wake, 50.0),
            p(&c.wake_free, 50.0),
            wr.unwrap_or(f64::NAN),
            c.create.len(),
            CONFINEMENT_TARGET_RATIO,
            p(&c.create_http, 50.0),
            p(&c.create_http_free, 50.0)
        )?;
        writeln!(f, "  {}", self.noise)
    }
}

impl crate::report::Reported for ServeReport {
    fn section(&self, scenario: &str) -> crate::report::Section {
        use crate::report::{Headline, Plot, Section, Series, Target};
        let by_run = |what: &str, pick: fn(&ServeRun) -> &Samples| {
            self.runs
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let label = format!("{what}, {} paused sandboxes on the host", r.background);
                    if i == 0 {
                        Series::measured(label, pick(r))
                    } else {
                        Series::baseline(label, pick(r))
                    }
                })
                .collect::<Vec<_>>()
        };
        let c = &self.confinement;
        let d = &self.dataplane;
        let target = Target::RatioAtMost {
            ratio: CONFINEMENT_TARGET_RATIO,
        };
        let mut headlines = vec![
            Headline::new(
                "create (POST /v2/sandboxes until the agent answered), p50, VM jailed and in its cgroup",
                c.create.percentile(50.0),
                "us",
            )
            .against("--no-jail --no-limits", c.create_free.percentile(50.0))
            .target(target),
            Headline::new(
                "wake (connect until the agent answered), p50, VM jailed and in its cgroup",
                c.wake.percentile(50.0),
                "us",
            )
            .against("--no-jail --no-limits", c.wake_free.percentile(50.0))
            .target(target),
        ];
        // Each run against the first (the fewest sandboxes on the host).
        let first = self.runs.first();
        for (what, pick) in [
            ("create", (|r| &r.create) as fn(&ServeRun) -> &Samples),
            ("wake", |r| &r.wake),
        ] {
            for (i, r) in self.runs.iter().enumerate() {
                let h = Headline::new(
                    format!("{what}, p50, {} paused sandboxes on the host", r.background),
                    pick(r).percentile(50.0),
                    "us",
                );
                headlines.push(match first {
                    Some(f) if i > 0 => h.against(
                        format!("{} paused sandboxes on the host", f.background),
                        pick(f).percentile(50.0),
                    ),
                    _ => h,
                });
            }
        }
        headlines.push(
            Headline::new(
                "data plane (GET /health through clade serve to the agent), p50",
                d.through.percentile(50.0),
                "us",
            )
            .against("the agent's ping direct", d.direct.percentile(50.0)),
        );
        Section::new(
            scenario,
            self.to_string(),
            &self.to_json(),
            vec![
                Plot::distribution(
                    "create",
                    "Create (POST /v2/sandboxes until the agent answered)",
                    by_run("create", |r| &r.create),
                ),
                Plot::distribution(
                    "wake",
                    "Wake of a paused sandbox (connect until the agent answered)",
                    by_run("wake", |r| &r.wake),
                ),
                Plot::distribution(
                    "confinement",
                    "Create and wake, each VM jailed and in its cgroup vs --no-jail --no-limits (interleaved)",
                    vec![
                        Series::measured("create, confined", &c.create),
                        Series::baseline("create, unconfined", &c.create_free),
                        Series::measured("wake, confined", &c.wake),
                        Series::baseline("wake, unconfined", &c.wake_free),
                    ],
                ),
                Plot::distribution(
                    "dataplane",
                    "Data plane: GET /health through the service vs the agent ping direct",
                    vec![
                        Series::measured("through clade serve", &d.through),
                        Series::baseline("direct agent ping", &d.direct),
                    ],
                ),
                self.noise.plot(),
            ],
        )
        .with_headlines(headlines)
    }
}

//! `fork-processes`: a fork as `clade fork` users see it. A `clade run` VM process (the
//! native test guest, its `vsock` step) is asked through its control API to fork into N
//! child processes; measured until the request is answered (what `clade fork` waits for:
//! every child runs and serves its API) and until every child's agent answered a ping over
//! its own vsock socket (all pinged at once). Two parents in the same run, forks alternated between them: one
//! whose children are started at the fork (the baseline) and one started with
//! `--fork-spares N` (children waiting with their VM shells built).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use vmm::api::{ApiClient, Request};

use crate::error::{Context, Error, Result};
use crate::guest::{ping_once, Guest, Machine, Scratch};
use crate::stats::{r1, Samples};

/// What to run.
#[derive(Debug, Clone)]
pub struct ForkProcessesParams {
    /// The `clade` executable (its `run`).
    pub clade: PathBuf,
    /// Children per fork.
    pub n: usize,
    /// Forks per parent.
    pub rounds: usize,
}

/// One parent's forks.
#[derive(Debug, Clone, Default)]
pub struct ForkProcessesRun {
    /// Fork children waiting before each fork.
    pub spares: usize,
    /// Request sent → answered (every child runs).
    pub answered: Samples,
    /// Request sent → every child's agent answered a ping.
    pub all: Samples,
    /// The parent's pause, as it reported it.
    pub pause: Samples,
}

/// What `fork-processes` reports.
#[derive(Debug, Clone)]
pub struct ForkProcessesReport {
    /// Children per fork.
    pub n: usize,
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// Children started at the fork (baseline).
    pub started: ForkProcessesRun,
    /// Children waiting (`--fork-spares n`).
    pub prestarted: ForkProcessesRun,
}

/// A `clade run` parent; killed when dropped.
struct Parent {
    process: Child,
    api: PathBuf,
    kids: PathBuf,
}

impl Drop for Parent {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl Parent {
    fn start(
        clade: &Path,
        guest: &Guest,
        machine: &Machine,
        dir: &Path,
        spares: usize,
    ) -> Result<Parent> {
        let name = format!("p{spares}");
        let api = dir.join(format!("{name}.api"));
        let vsock = dir.join(format!("{name}.vsock"));
        let process = Command::new(clade)
            .arg("run")
            .arg("--kernel")
            .arg(guest.path_for_other_processes())
            .args(["--test-device", "--cmdline"])
            .arg(format!("steps=vsock {}", crate::guest::NO_CONN_LOG))
            .arg("--vsock")
            .arg(&vsock)
            .arg("--api-sock")
            .arg(&api)
            .arg("--serial-file")
            .arg(dir.join(format!("{name}.serial")))
            .arg("--fork-spares")
            .arg(spares.to_string())
            .arg("--vcpus")
            .arg(machine.vcpus.to_string())
            .arg("--mem")
            .arg(machine.mem_mib.to_string())
            .arg("--kvm-device")
            .arg(&machine.kvm_device)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting clade run")?;
        let parent = Parent {
            process,
            api,
            kids: dir.join(format!("{name}-kids")),
        };
        let t = Instant::now();
        while !parent.api.exists() {
            if t.elapsed() > Duration::from_secs(20) {
                return Err(Error::Guest(
                    "the parent's API socket never appeared".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        ping_once(&vsock)?;
        Ok(parent)
    }

    fn call(&self, req: &Request) -> Result<serde_json::Value> {
        let r = ApiClient::connect(&self.api)
            .and_then(|mut c| c.call(req))
            .map_err(|e| Error::Guest(format!("{}: {e}", self.api.display())))?;
        if !r.ok {
            return Err(Error::Guest(format!("{req:?}: {:?}", r.error)));
        }
        Ok(serde_json::Value::Object(r.fields))
    }

    /// Waits until `spares` fork children wait (the owner starts one per idle turn).
    fn wait_spares(&self, spares: usize) -> Result<()> {
        let t = Instant::now();
        loop {
            let waiting = self.call(&Request::Status)?["fork_children_waiting"]
                .as_u64()
                .unwrap_or(0) as usize;
            if waiting >= spares {
                return Ok(());
            }
            if t.elapsed() > Duration::from_secs(30) {
                return Err(Error::Guest(format!(
                    "{waiting} of {spares} fork children waiting after 30 s"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One fork into `n`, measured into `run`; the children are stopped afterwards.
    fn fork(&self, n: usize, run: &mut ForkProcessesRun) -> Result<()> {
        self.wait_spares(run.spares)?;
        let t0 = Instant::now();
        let answer = self.call(&Request::Fork {
            count: n,
            prefix: Some(self.kids.clone()),
            agent_sync: false,
            nets: Vec::new(),
        })?;
        run.answered.push(t0.elapsed());
        let children = answer["children"].as_array().cloned().unwrap_or_default();
        let path = |c: &serde_json::Value, k: &str| PathBuf::from(c[k].as_str().unwrap_or(""));
        // Each child pinged at once, from its own thread, as a user of N children would.
        let pinged: Result<()> = std::thread::scope(|s| {
            let pings: Vec<_> = children
                .iter()
                .map(|c| {
                    let sock = path(c, "vsock");
                    s.spawn(move || ping_once(&sock))
                })
                .collect();
            pings.into_iter().try_for_each(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Guest("a ping thread panicked".into())))
            })
        });
        run.all.push(t0.elapsed());
        run.pause.push(Duration::from_micros(
            answer["pause_us"].as_u64().unwrap_or(0),
        ));
        for c in &children {
            let _ = ApiClient::connect(&path(c, "api_sock"))
                .and_then(|mut a| a.call(&Request::Shutdown));
        }
        // Gone before the next fork (their CPU would be the next fork's contention).
        for c in &children {
            let pid = c["pid"].as_u64().unwrap_or(0);
            let t = Instant::now();
            while Path::new(&format!("/proc/{pid}/exe")).exists()
                && t.elapsed() < Duration::from_secs(10)
            {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        pinged
    }
}

/// Starts both parents and alternates `rounds` forks between them.
pub fn fork_processes(
    guest: &Guest,
    machine: &Machine,
    params: &ForkProcessesParams,
) -> Result<ForkProcessesReport> {
    let dir = Scratch::new("fork-processes")?;
    let n = params.n;
    let mut started = ForkProcessesRun::default();
    let mut prestarted = ForkProcessesRun {
        spares: n,
        ..Default::default()
    };
    let base = Parent::start(&params.clade, guest, machine, &dir.0, 0)?;
    let spares = Parent::start(&params.clade, guest, machine, &dir.0, n)?;
    for _ in 0..params.rounds {
        base.fork(n, &mut started)?;
        spares.fork(n, &mut prestarted)?;
    }
    Ok(ForkProcessesReport {
        n,
        mem_mib: machine.mem_mib,
        started,
        prestarted,
    })
}

impl ForkProcessesReport {
    /// One JSON object.
    pub fn to_json(&self) -> String {
        let run = |r: &ForkProcessesRun| {
            let p = |s: &Samples, q| s.percentile(q).map(r1);
            json!({
                "fork_children_waiting": r.spares,
                "forks": r.all.len(),
                "answered_p50_us": p(&r.answered, 50.0),
                "answered_p99_us": p(&r.answered, 99.0),
                "all_answering_p50_us": p(&r.all, 50.0),
                "all_answering_p99_us": p(&r.all, 99.0),
                "pause_p50_us": p(&r.pause, 50.0),
            })
        };
        json!({
            "bench": "fork-processes",
            "n": self.n,
            "mem_mib": self.mem_mib,
            "started_at_fork": run(&self.started),
            "prestarted": run(&self.prestarted),
        })
        .to_string()
    }
}

impl fmt::Display for ForkProcessesReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "fork of a `clade run` process into {} child processes ({} MiB): request -> answered (children run) | request -> every child's agent answered a ping",
            self.n, self.mem_mib
        )?;
        for (what, r) in [
            ("started at the fork (baseline)", &self.started),
            ("waiting, shells built        ", &self.prestarted),
        ] {
            let p = |s: &Samples, q| s.percentile(q).unwrap_or(f64::NAN);
            writeln!(
                f,
                "  children {what}: answered p50 {:>8.1} us  p99 {:>8.1} us | all answering p50 {:>8.1} us  p99 {:>8.1} us | pause p50 {:>7.1} us  (n={})",
                p(&r.answered, 50.0),
                p(&r.answered, 99.0),
                p(&r.all, 50.0),
                p(&r.all, 99.0),
                p(&r.pause, 50.0),
                r.all.len()
            )?;
        }
        Ok(())
    }
}

impl crate::report::Reported for ForkProcessesReport {
    fn section(&self, scenario: &str) -> crate::report::Section {
        use crate::report::{Headline, Plot, Section, Series};
        let (pre, started) = (&self.prestarted, &self.started);
        let n = self.n;
        let headline = |what: &str, pick: fn(&ForkProcessesRun) -> &Samples| {
            Headline::new(
                format!("clade fork -n {n} {what}, p50, children waiting (--fork-spares)"),
                pick(pre).percentile(50.0),
                "us",
            )
            .against(
                "children started at the fork",
                pick(started).percentile(50.0),
            )
        };
        let headlines = vec![
            headline("until the API answered", |r| &r.answered),
            headline("until every child answered a ping", |r| &r.all),
        ];
        Section::new(
            scenario,
            self.to_string(),
            &self.to_json(),
            vec![
                Plot::distribution(
                    "answered",
                    "clade fork: until the API answered",
                    vec![
                        Series::measured("children waiting (--fork-spares)", &pre.answered),
                        Series::baseline("children started at the fork", &started.answered),
                    ],
                ),
                Plot::distribution(
                    "all",
                    "clade fork: until every child answered a ping",
                    vec![
                        Series::measured("children waiting (--fork-spares)", &pre.all),
                        Series::baseline("children started at the fork", &started.all),
                    ],
                ),
            ],
        )
        .with_headlines(headlines)
    }
}

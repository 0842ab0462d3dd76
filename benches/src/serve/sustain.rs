//! `--sustain SECONDS`: creates as fast as the host sustains them. A service of its own
//! is started; after one warm-up create, `clients` concurrent clients (each its own kept
//! HTTP connection, as as many SDK users would be) each loop for the given time: create
//! a sandbox (`POST /v2/sandboxes`), wait until its agent answered a ping over its vsock
//! socket, kill it. So at most `clients` of them run at once and the host never fills.
//! A create that fails (an HTTP error, or an agent that does not answer) counts as a
//! failure and the client goes on; a failed kill is counted apart.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::service::Service;
use crate::error::{Context, Result};
use crate::guest::{probe, Guest};
use crate::stats::Samples;

/// The target of sustained creates, per second.
pub const SUSTAIN_TARGET_PER_S: f64 = 300.0;

/// What `--sustain` measured.
#[derive(Debug, Clone)]
pub struct SustainRun {
    /// The time asked for.
    pub seconds: f64,
    /// Concurrent clients.
    pub clients: usize,
    /// From the clients' start until the last one ended (after its last create began
    /// before the time was up).
    pub elapsed: Duration,
    /// Each successful create until its agent answered.
    pub create: Samples,
    /// Of those, until the HTTP answer.
    pub create_http: Samples,
    /// Creates that failed.
    pub failures: usize,
    /// The first failure's message.
    pub first_failure: Option<String>,
    /// Kills that failed.
    pub kill_failures: usize,
}

impl SustainRun {
    /// Successful creates per second of `elapsed`.
    pub fn creates_per_s(&self) -> Option<f64> {
        let s = self.elapsed.as_secs_f64();
        (s > 0.0).then(|| self.create.len() as f64 / s)
    }
}

/// One client's part.
#[derive(Default)]
struct Tally {
    create: Samples,
    create_http: Samples,
    failures: usize,
    first_failure: Option<String>,
    kill_failures: usize,
}

/// Runs the case (see the module documentation).
pub(super) fn sustain(
    clade: &std::path::Path,
    guest: &Guest,
    seconds: f64,
    clients: usize,
) -> Result<SustainRun> {
    let service = Service::start(clade, guest, &[], &[])?;
    let id = service.create().context("the warm-up create")?;
    probe(&service.vsock(&id)).context("the warm-up sandbox's agent")?;
    service.kill(&id)?;
    let clients = clients.max(1);
    let tallies = Mutex::new(Vec::new());
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(seconds);
    let slots = vec![(); clients];
    service.in_parallel(clients, &slots, |c, ()| {
        let mut t = Tally::default();
        while Instant::now() < until {
            let began = Instant::now();
            let made = c.create().and_then(|id| {
                let http = began.elapsed();
                let answered = probe(&service.vsock(&id)).map(|()| (http, began.elapsed()));
                if c.kill(&id).is_err() {
                    t.kill_failures += 1;
                }
                answered
            });
            match made {
                Ok((http, answered)) => {
                    t.create_http.push(http);
                    t.create.push(answered);
                }
                Err(e) => {
                    t.failures += 1;
                    t.first_failure.get_or_insert_with(|| e.to_string());
                    // Not a busy loop against a service that refuses everything.
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        if let Ok(mut all) = tallies.lock() {
            all.push(t);
        }
    })?;
    let elapsed = start.elapsed();
    let tallies = tallies.into_inner().unwrap_or_default();
    let mut run = SustainRun {
        seconds,
        clients,
        elapsed,
        create: Samples::new(),
        create_http: Samples::new(),
        failures: 0,
        first_failure: None,
        kill_failures: 0,
    };
    let (mut create, mut http) = (Vec::new(), Vec::new());
    for t in tallies {
        create.extend_from_slice(t.create.values());
        http.extend_from_slice(t.create_http.values());
        run.failures += t.failures;
        run.kill_failures += t.kill_failures;
        if run.first_failure.is_none() {
            run.first_failure = t.first_failure;
        }
    }
    run.create = Samples::from_us(create);
    run.create_http = Samples::from_us(http);
    tracing::info!(
        creates = run.create.len(),
        failures = run.failures,
        elapsed_s = elapsed.as_secs_f64(),
        "bench serve --sustain: done"
    );
    Ok(run)
}

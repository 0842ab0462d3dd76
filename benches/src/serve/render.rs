//! The serve scenario's report: its JSON (`--json`), its text and its section of a bench
//! report, the `--running` and `--sustain` cases' figures each beside its target.

use serde_json::{json, Value};

use super::density::ANSWER_TRIES;
use super::{
    RunningRun, ServeReport, ServeRun, SustainRun, BEYOND_GUEST_TARGET_MIB,
    CONFINEMENT_TARGET_RATIO, PROCESSES_TARGET, RUNNING_TARGET_RATIO, SUSTAIN_TARGET_PER_S,
};
use crate::stats::Samples;

/// Rounded to `places` decimals; none stays none.
fn round(v: Option<f64>, places: i32) -> Option<f64> {
    let k = 10f64.powi(places);
    v.filter(|v| v.is_finite()).map(|v| (v * k).round() / k)
}

/// A p-th percentile in milliseconds, three decimals.
fn ms(s: &Samples, p: f64) -> Option<f64> {
    round(s.percentile(p).map(|us| us / 1000.0), 3)
}

/// The `running` object of the JSON.
fn running_json(r: &RunningRun) -> Value {
    let c = &r.census;
    let per = |v: f64| round(Some(v / r.running.max(1) as f64), 3);
    let p50 = |s: &Samples| round(s.percentile(50.0), 1);
    let mut v = json!({
        "n": r.n,
        "running": r.running,
        "answering": r.answering,
        "answering_first_ask": r.answering_first,
        "create_failures": r.create_failures,
        "first_failure": r.first_failure,
        "clients": r.clients,
        "fill_s": round(Some(r.fill.as_secs_f64()), 3),
        "processes_per_sandbox": round(r.processes_per_sandbox(), 3),
        "threads_per_sandbox": per(c.threads as f64),
        "fds_per_sandbox": per(c.fds as f64),
        "host_mib_per_sandbox": round(r.host_mib_per_sandbox(), 3),
        "guest_touched_mib_per_sandbox": round(r.guest_touched_mib_per_sandbox(), 3),
        "total_mib_per_sandbox": round(r.total_mib_per_sandbox(), 3),
        "pss_mib_per_sandbox": per(c.pss_kib as f64 / 1024.0),
        "kernel_mib_per_sandbox": c.kernel_kib.and_then(|k| per(k as f64 / 1024.0)),
        "mem_available_drop_mib_per_sandbox": round(r.mem_available_drop_mib_per_sandbox(), 3),
    });
    let more = json!({
        "idle_cpu_pct_per_sandbox": round(r.idle_cpu_pct_per_sandbox(), 4),
        "idle_runs_per_s_per_sandbox": round(r.idle_runs_per_s_per_sandbox(), 2),
        "idle_host_cpu_busy_pct": round(r.idle_host_busy_pct, 1),
        "idle_window_s": round(Some(r.idle_window.as_secs_f64()), 3),
        "create_p50_ratio": round(r.create_p50_ratio(), 3),
        "create_n": r.create_n.len(),
        "create_p50_us_1_running": p50(&r.create_1),
        "create_p50_us_n_running": p50(&r.create_n),
        "create_p99_us_n_running": round(r.create_n.percentile(99.0), 1),
        "create_p50_us_1_running_after": p50(&r.create_1_after),
        "census": {
            "settled": r.settled,
            "sandbox_processes": c.processes,
            "sandbox_threads": c.threads,
            "sandbox_fds": c.fds,
            "vm_trees": c.vm_trees,
            "sandboxes_with_processes": c.sandboxes,
            "other_processes": c.other_processes,
            "standbys": c.standbys,
            "standby_processes": c.standby_processes,
            "pss_kib": c.pss_kib,
            "guest_pss_kib": c.guest_pss_kib,
            "kernel_kib": c.kernel_kib,
            "cgroups": c.cgroups,
            "service_fds": c.service_fds,
            "service_threads": c.service_threads,
            "sandbox_processes_1_running": r.census_1.processes,
            "service_fds_1_running": r.census_1.service_fds,
            "mem_available_drop_kib": r.mem_available_drop_kib,
        },
        "left_after_kill": {
            "kill_failures": r.kill_failures,
            "sandbox_processes": r.left.processes,
            "standby_processes": r.left.standby_processes,
        },
    });
    if let (Some(v), Value::Object(more)) = (v.as_object_mut(), more) {
        v.extend(more);
    }
    v
}

/// The `sustain` object of the JSON.
fn sustain_json(s: &SustainRun) -> Value {
    json!({
        "seconds": s.seconds,
        "elapsed_s": round(Some(s.elapsed.as_secs_f64()), 3),
        "clients": s.clients,
        "creates": s.create.len(),
        "creates_per_s": round(s.creates_per_s(), 1),
        "p50_ms": ms(&s.create, 50.0),
        "p99_ms": ms(&s.create, 99.0),
        "http_p50_ms": ms(&s.create_http, 50.0),
        "http_p99_ms": ms(&s.create_http, 99.0),
        "failures": s.failures,
        "first_failure": s.first_failure,
        "kill_failures": s.kill_failures,
    })
}

/// The `--running` case's line of the text.
fn running_line(f: &mut std::fmt::Formatter<'_>, r: &RunningRun) -> std::fmt::Result {
    let c = &r.census;
    let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
    let per = |v: usize| v as f64 / r.running.max(1) as f64;
    let mib = |k: u64| k as f64 / 1024.0 / r.running.max(1) as f64;
    writeln!(
        f,
        "  {} running sandboxes (asked {}; own service; {} clients): filled in {:.1} s ({} create failures{}), {} answering GET /health through the service ({} at the first of up to {ANSWER_TRIES} asks)",
        r.running,
        r.n,
        r.clients,
        r.fill.as_secs_f64(),
        r.create_failures,
        r.first_failure
            .as_ref()
            .map(|e| format!(", first: {e}"))
            .unwrap_or_default(),
        r.answering,
        r.answering_first
    )?;
    writeln!(
        f,
        "    per running sandbox: {:.2} processes (target <= {PROCESSES_TARGET:.0}; standby pool left out: {} standbys, {} processes), {:.1} threads, {:.1} fds; service: {} fds, {} threads",
        nan(r.processes_per_sandbox()),
        c.standbys,
        c.standby_processes,
        per(c.threads),
        per(c.fds),
        c.service_fds,
        c.service_threads
    )?;
    writeln!(
        f,
        "    host memory per running sandbox: {:.3} MiB beyond what its guest touched (target <= {BEYOND_GUEST_TARGET_MIB:.1} MiB) = PSS {:.3} + kernel (its cgroup) {} - guest-touched {:.3}; MemAvailable drop {:.3} MiB per sandbox (host-wide){}",
        nan(r.host_mib_per_sandbox()),
        mib(c.pss_kib),
        c.kernel_kib
            .map_or_else(|| "not counted".into(), |k| format!("{:.3}", mib(k))),
        nan(r.guest_touched_mib_per_sandbox()),
        nan(r.mem_available_drop_mib_per_sandbox()),
        if r.settled { "" } else { "; counted before the service came to rest" }
    )?;
    writeln!(
        f,
        "    idle, over {:.1} s: {:.3} % of a CPU and {:.1} thread runs per second per sandbox; the host's CPUs {:.1} % busy (other work included)",
        r.idle_window.as_secs_f64(),
        nan(r.idle_cpu_pct_per_sandbox()),
        nan(r.idle_runs_per_s_per_sandbox()),
        nan(r.idle_host_busy_pct)
    )?;
    let p50 = |s: &Samples| s.percentile(50.0).unwrap_or(f64::NAN);
    writeln!(
        f,
        "    create p50 with {} running {:.1} us vs with 1 running {:.1} us: {:.3}x (target <= {RUNNING_TARGET_RATIO:.2}x; n={}; 1 running again after: {:.1} us); {} kills failed; left after killing them all: {} sandbox processes",
        r.running,
        p50(&r.create_n),
        p50(&r.create_1),
        nan(r.create_p50_ratio()),
        r.create_n.len(),
        p50(&r.create_1_after),
        r.kill_failures,
        r.left.processes
    )
}

/// The `--sustain` case's line of the text.
fn sustain_line(f: &mut std::fmt::Formatter<'_>, s: &SustainRun) -> std::fmt::Result {
    let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
    writeln!(
        f,
        "  sustained creates ({:.0} s asked, {:.1} s taken, {} clients, each create -> agent answered -> kill): {:.1} creates/s (target >= {SUSTAIN_TARGET_PER_S:.0}), p50 {:.2} ms, p99 {:.2} ms (HTTP answered p50 {:.2} ms), {} creates, {} failures{}, {} failed kills",
        s.seconds,
        s.elapsed.as_secs_f64(),
        s.clients,
        nan(s.creates_per_s()),
        nan(ms(&s.create, 50.0)),
        nan(ms(&s.create, 99.0)),
        nan(ms(&s.create_http, 50.0)),
        s.create.len(),
        s.failures,
        s.first_failure
            .as_ref()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default(),
        s.kill_failures
    )
}

/// The `--running` and `--sustain` cases' headline figures, each with its target.
fn added_headlines(r: &ServeReport) -> Vec<crate::report::Headline> {
    use crate::report::{Headline, Target};
    let mut h = Vec::new();
    if let Some(run) = &r.running {
        h.push(
            Headline::new(
                format!("create, p50, {} sandboxes running", run.running),
                run.create_n.percentile(50.0),
                "us",
            )
            .against("1 running, same run", run.create_1.percentile(50.0))
            .target(Target::RatioAtMost {
                ratio: RUNNING_TARGET_RATIO,
            }),
        );
        h.push(
            Headline::new(
                format!(
                    "sandboxes answering GET /health, of {} running",
                    run.running
                ),
                Some(run.answering as f64),
                "sandboxes",
            )
            .target(Target::AtLeast {
                value: run.n as f64,
            }),
        );
        h.push(
            Headline::new(
                format!("processes per running sandbox ({} running)", run.running),
                run.processes_per_sandbox(),
                "processes",
            )
            .target(Target::AtMost {
                value: PROCESSES_TARGET,
            }),
        );
        h.push(
            Headline::new(
                format!(
                    "host memory per running sandbox, PSS + kernel ({} running)",
                    run.running
                ),
                run.total_mib_per_sandbox(),
                "MiB",
            )
            .against(
                "what its guest touched (guest RAM PSS)",
                run.guest_touched_mib_per_sandbox(),
            )
            .target(Target::AddedAtMost {
                value: BEYOND_GUEST_TARGET_MIB,
            }),
        );
    }
    if let Some(s) = &r.sustain {
        h.push(
            Headline::new(
                format!(
                    "creates per second sustained ({:.0} s, {} clients)",
                    s.seconds, s.clients
                ),
                s.creates_per_s(),
                "creates/s",
            )
            .target(Target::AtLeast {
                value: SUSTAIN_TARGET_PER_S,
            }),
        );
        h.push(Headline::new(
            "sustained create (until the agent answered), p99",
            s.create.percentile(99.0).map(|us| us / 1000.0),
            "ms",
        ));
        h.push(
            Headline::new(
                "sustained creates failed",
                Some(s.failures as f64),
                "creates",
            )
            .target(Target::AtMost { value: 0.0 }),
        );
    }
    h
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
        if let Some(r) = &self.running {
            top["running"] = running_json(r);
        }
        if let Some(s) = &self.sustain {
            top["sustain"] = sustain_json(s);
        }
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
        if let Some(r) = &self.running {
            running_line(f, r)?;
        }
        if let Some(s) = &self.sustain {
            sustain_line(f, s)?;
        }
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
        headlines.extend(added_headlines(self));
        let mut added_plots = Vec::new();
        if let Some(r) = &self.running {
            added_plots.push(Plot::distribution(
                "running",
                &format!(
                    "Create with {} sandboxes running vs 1 running (same run)",
                    r.running
                ),
                vec![
                    Series::measured(format!("{} running", r.running), &r.create_n),
                    Series::baseline("1 running", &r.create_1),
                    Series::baseline("1 running again, after", &r.create_1_after),
                ],
            ));
        }
        if let Some(s) = &self.sustain {
            added_plots.push(Plot::distribution(
                "sustain",
                &format!(
                    "Sustained creates, {} concurrent clients (until the agent answered)",
                    s.clients
                ),
                vec![
                    Series::measured("create -> agent answered", &s.create),
                    Series::baseline("create -> HTTP answered", &s.create_http),
                ],
            ));
        }
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
            ]
            .into_iter()
            .chain(added_plots)
            .chain([self.noise.plot()])
            .collect(),
        )
        .with_headlines(headlines)
    }
}

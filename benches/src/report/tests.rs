use super::*;
use crate::stats::Samples;

fn samples(base: f64, n: usize) -> Samples {
    Samples::from_us(
        (0..n)
            .map(|i| base + (i % 17) as f64 * base / 50.0)
            .collect(),
    )
}

fn section(scale: f64) -> Section {
    let json = serde_json::json!({
        "p50_us": 101.5 * scale,
        "n": 50,
        "steps_p50_us": {"open": 12.5, "resume": 80.0},
        "note": "a <b>bold</b> & plain string",
        "list": [1, 2.5],
        "missing": null,
    })
    .to_string();
    Section::new(
        "restore",
        "restore <text> & more".into(),
        &json,
        vec![
            Plot::distribution(
                "restore",
                "Restore",
                vec![
                    Series::measured("uffd", &samples(100.0 * scale, 50)),
                    Series::baseline("copy", &samples(900.0, 50)),
                ],
            ),
            Plot::sequence(
                "children",
                "Children",
                "child",
                vec![
                    Series::measured("child", &samples(300.0, 10)),
                    Series::baseline("copy fork", &Samples::from_us(vec![2000.0])),
                ],
            ),
            Plot::steps(
                "steps",
                "Steps",
                vec![
                    (
                        "uffd".into(),
                        vec![("open".into(), 12.5), ("resume".into(), 80.0)],
                    ),
                    ("empty".into(), vec![]),
                ],
            ),
            Plot::distribution("empty", "Nothing", vec![]),
        ],
    )
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("clade-report-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn written_report_has_every_plot_and_figure() {
    if font_path().is_none() {
        eprintln!("no TrueType font here: skipped (CI installs fonts-dejavu-core)");
        return;
    }
    let dir = tmp("write");
    let mut r = Report::new();
    r.push(section(1.0));
    r.push(section(1.0));
    assert_eq!(
        r.sections[1].scenario, "restore-2",
        "a second run is numbered"
    );
    // The empty plot and the empty bar are left out.
    assert_eq!(r.sections[0].plots.len(), 3);
    let index = r.write(&dir).unwrap();
    let html = std::fs::read_to_string(&index).unwrap();
    for f in [
        "restore-restore-cdf",
        "restore-restore-hist",
        "restore-children",
        "restore-steps",
        "restore-2-restore-cdf",
    ] {
        let svg = std::fs::read_to_string(dir.join(format!("{f}.svg"))).unwrap();
        assert!(svg.contains("<svg") && svg.contains("</svg>"), "{f}.svg");
        let png = std::fs::read(dir.join(format!("{f}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{f}.png");
        assert!(
            html.contains(&format!("src=\"{f}.svg\"")),
            "{f} not in the HTML"
        );
    }
    // The legend carries the series' percentiles.
    let cdf = std::fs::read_to_string(dir.join("restore-restore-cdf.svg")).unwrap();
    assert!(cdf.contains("uffd (n=50"), "legend missing");
    // Every scalar of the JSON, and the text, escaped.
    for v in ["101.5", "12.5", "80.0", "2.5", "null"] {
        assert!(html.contains(&format!("<td class=\"v\">{v}</td>")), "{v}");
    }
    assert!(html.contains("a &lt;b&gt;bold&lt;/b&gt; &amp; plain string"));
    assert!(html.contains("restore &lt;text&gt; &amp; more"));
    assert!(!html.contains("<b>bold"));
    // Read back: the samples survive.
    let back = Report::load(&dir).unwrap();
    assert_eq!(back.sections.len(), 2);
    assert_eq!(back.sections[0].plots[0].series()[0].us.len(), 50);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compare_gives_ratios_and_draws_both() {
    if font_path().is_none() {
        return;
    }
    let (mut a, mut b) = (Report::new(), Report::new());
    a.push(section(1.0));
    b.push(section(2.0));
    let out = tmp("compare");
    let (ratios, index) = compare(&a, &b, &out).unwrap();
    let p50 = ratios
        .iter()
        .find(|r| r.figure == "restore.p50_us")
        .unwrap();
    assert_eq!((p50.a, p50.b), (101.5, 203.0));
    assert!((p50.ratio() - 2.0).abs() < 1e-9);
    let n = ratios.iter().find(|r| r.figure == "restore.n").unwrap();
    assert_eq!(n.ratio(), 1.0);
    assert!(ratios
        .iter()
        .any(|r| r.figure == "restore.steps_p50_us.open"));
    let html = std::fs::read_to_string(index).unwrap();
    assert!(html.contains("restore.p50_us: 101.5 -&gt; 203 (x2.00)"));
    let cdf = std::fs::read_to_string(out.join("restore-restore-cdf.svg")).unwrap();
    assert!(cdf.contains("A: uffd") && cdf.contains("B: uffd"));
    if std::env::var_os("CLADE_KEEP_REPORT").is_none() {
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn bad_reports_are_clear_errors() {
    let dir = tmp("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let e = Report::load(&dir).unwrap_err().to_string();
    assert!(e.contains("report.json"), "{e}");
    std::fs::write(dir.join("report.json"), b"{\"version\": 1, \"sections\": 3").unwrap();
    let e = Report::load(&dir).unwrap_err().to_string();
    assert!(e.contains("not a bench report"), "{e}");
    let mut r = Report::new();
    r.version = 99;
    std::fs::write(dir.join("report.json"), serde_json::to_vec(&r).unwrap()).unwrap();
    let e = Report::load(&dir).unwrap_err().to_string();
    assert!(e.contains("version 99"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn leaves_and_file_names() {
    let v = serde_json::json!({"a": {"b": 1, "c": [2, {"d": 3.5}]}, "s": "x", "n": null});
    let l = leaves(&v);
    assert_eq!(l.len(), 3);
    assert_eq!(l["a.c.1.d"], 3.5);
    assert_eq!(file_part("Fork Processes/../x"), "fork-processes----x");
}

#[test]
fn log_axis_ticks() {
    assert_eq!(
        plot::log_ticks(80.0, 1200.0),
        vec![100.0, 200.0, 500.0, 1000.0]
    );
    // A narrow range gets every digit.
    assert_eq!(
        plot::log_ticks(1900.0, 4100.0),
        vec![2000.0, 3000.0, 4000.0]
    );
}

#[test]
fn dates_are_utc_date_times() {
    for (s, date, rfc) in [
        (0, "1970-01-01 00:00:00 UTC", "1970-01-01T00:00:00Z"),
        (
            1796642405,
            "2026-12-07 11:20:05 UTC",
            "2026-12-07T11:20:05Z",
        ),
        // Leap days: 2000 (divisible by 400) and 2024 have one, 2100 has none.
        (951782400, "2000-02-29 00:00:00 UTC", "2000-02-29T00:00:00Z"),
        (
            1709210096,
            "2024-02-29 12:34:56 UTC",
            "2024-02-29T12:34:56Z",
        ),
        (
            4107542399,
            "2100-02-28 23:59:59 UTC",
            "2100-02-28T23:59:59Z",
        ),
        (
            4107542400,
            "2100-03-01 00:00:00 UTC",
            "2100-03-01T00:00:00Z",
        ),
    ] {
        assert_eq!(utc_date_time(s), date, "{s}");
        assert_eq!(rfc3339(s), rfc, "{s}");
    }
    // Beyond any date: the seconds as they are.
    assert_eq!(
        utc_date_time(u64::MAX),
        format!("{} s since 1970", u64::MAX)
    );
    assert_eq!(rfc3339(u64::MAX), "");
    let r = Report::new();
    assert_eq!(r.created_rfc3339, rfc3339(r.created_s));
}

#[test]
fn headlines_against_baseline_and_target() {
    let ratio = Target::RatioAtMost { ratio: 1.10 };
    let h = Headline::new("create", Some(105.0), "us").against("unconfined", Some(100.0));
    assert_eq!(h.met(), None, "no target");
    assert!((h.ratio().unwrap() - 1.05).abs() < 1e-9);
    assert_eq!(h.added(), Some(5.0));
    assert_eq!(h.clone().target(ratio).met(), Some(true));
    let slow = Headline::new("create", Some(111.0), "us").against("unconfined", Some(100.0));
    assert_eq!(slow.target(ratio).met(), Some(false));
    let hop = Headline::new("hop", Some(300.0), "us").against("direct", Some(100.0));
    assert_eq!(
        hop.clone()
            .target(Target::AddedAtMost { value: 200.0 })
            .met(),
        Some(true)
    );
    assert_eq!(
        hop.target(Target::AddedAtMost { value: 150.0 }).met(),
        Some(false)
    );
    // Nothing measured (NaN) is no value, and no verdict.
    let none = Headline::new("x", Some(f64::NAN), "us")
        .against("y", Some(1.0))
        .target(ratio);
    assert_eq!((none.value, none.ratio(), none.met()), (None, None, None));
    let no_base = Headline::new("x", Some(1.0), "us").target(ratio);
    assert_eq!(no_base.met(), None);
}

#[test]
fn absolute_targets_need_no_baseline() {
    let rate = |v| Headline::new("creates/s", v, "creates/s");
    let at_least = Target::AtLeast { value: 300.0 };
    assert_eq!(rate(Some(300.0)).target(at_least).met(), Some(true));
    assert_eq!(rate(Some(299.9)).target(at_least).met(), Some(false));
    assert_eq!(rate(None).target(at_least).met(), None);
    let at_most = Target::AtMost { value: 1.0 };
    let procs = |v| Headline::new("processes", Some(v), "processes").target(at_most);
    assert_eq!(
        (procs(1.0).met(), procs(3.0).met()),
        (Some(true), Some(false))
    );
    // In the summary: the target as a value of the figure's unit.
    let mut r = Report::new();
    r.push(section(1.0).with_headlines(vec![rate(Some(120.0)).target(at_least), procs(3.0)]));
    let html = html::render(&r, &BTreeMap::new());
    assert!(html.contains("&gt;= 300.0 creates/s"), "{html}");
    assert!(html.contains("&lt;= 1.0 processes"), "{html}");
    assert_eq!(html.matches("\u{2717} missed").count(), 2);
    // And through the JSON.
    let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(back.sections[0].headlines, r.sections[0].headlines);
}

/// A report of two sections with headline figures: one met, one missed, one without a
/// target.
fn summarised() -> Report {
    let mut r = Report::new();
    r.created_s = 1796642405;
    r.push(section(1.0).with_headlines(vec![
        Headline::new("uffd restore until the first answered ping, p50", Some(101.5), "us")
            .against("copy restore", Some(912.0)),
    ]));
    let mut serve = section(1.0).with_headlines(vec![
        Headline::new("create, p50, jailed", Some(2100.0), "us")
            .against("--no-jail --no-limits", Some(2000.0))
            .target(Target::RatioAtMost { ratio: 1.10 }),
        Headline::new("wake, p50, jailed", Some(2300.0), "us")
            .against("--no-jail --no-limits", Some(2000.0))
            .target(Target::RatioAtMost { ratio: 1.10 }),
    ]);
    serve.scenario = "serve".into();
    r.push(serve);
    r
}

#[test]
fn summary_comes_first_with_each_headline_baseline_and_target() {
    let html = html::render(&summarised(), &BTreeMap::new());
    let at = |s: &str| {
        html.find(s)
            .unwrap_or_else(|| panic!("{s} not in the page"))
    };
    let summary = at("<section id=\"summary\">");
    // Before the machine, the contents and every section.
    for later in [
        "<table id=\"machine\">",
        "<ul id=\"contents\">",
        "<section id=\"restore\">",
        "<section id=\"serve\">",
    ] {
        assert!(summary < at(later), "the summary is not before {later}");
    }
    assert!(summary < at("<h2>restore</h2>"));
    let end = summary + html[summary..].find("</section>").unwrap();
    let table = &html[summary..end];
    let rows: Vec<&str> = table.split("<tr").skip(2).collect();
    assert_eq!(rows.len(), 3, "{table}");
    // Each headline figure with its value, its same-run baseline, the ratio, its target
    // and the verdict.
    for (row, want) in rows.iter().zip([
        [
            "href=\"#restore\"",
            "uffd restore until the first answered ping, p50",
            "101.5 us",
            "copy restore: 912.0 us",
            "0.11x (-810.5 us)",
            "none set",
            "no target",
        ],
        [
            "href=\"#serve\"",
            "create, p50, jailed",
            "2100.0 us",
            "--no-jail --no-limits: 2000.0 us",
            "1.05x (+100.0 us)",
            "&lt;= 1.10x the baseline",
            "\u{2713} met",
        ],
        [
            "href=\"#serve\"",
            "wake, p50, jailed",
            "2300.0 us",
            "--no-jail --no-limits: 2000.0 us",
            "1.15x (+300.0 us)",
            "&lt;= 1.10x the baseline",
            "\u{2717} missed",
        ],
    ]) {
        for w in want {
            assert!(row.contains(w), "{w:?} not in {row}");
        }
    }
    assert!(rows[1].starts_with(" class=\"met\"") && rows[2].starts_with(" class=\"missed\""));
    // The date, readable, and machine-readable in the page.
    assert!(html.contains("<time datetime=\"2026-12-07T11:20:05Z\">2026-12-07 11:20:05 UTC</time>"));
    assert!(!html.contains("seconds since 1970"));
    // No headline figures (a comparison, a report written before them): no summary.
    let mut plain = summarised();
    plain.sections.iter_mut().for_each(|s| s.headlines.clear());
    assert!(!html::render(&plain, &BTreeMap::new()).contains("id=\"summary\""));
}

#[test]
fn headlines_survive_the_json_and_older_reports_load() {
    let r = summarised();
    let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(back.sections[1].headlines, r.sections[1].headlines);
    assert_eq!(back.created_rfc3339, r.created_rfc3339);
    // A report.json from before the summary and the RFC 3339 date.
    let mut v = serde_json::to_value(&r).unwrap();
    v.as_object_mut().unwrap().remove("created_rfc3339");
    for s in v["sections"].as_array_mut().unwrap() {
        s.as_object_mut().unwrap().remove("headlines");
    }
    let old: Report = serde_json::from_value(v).unwrap();
    assert!(old.sections.iter().all(|s| s.headlines.is_empty()));
    assert_eq!(old.created_s, 1796642405);
}

#[test]
fn scenarios_hold_their_headlines_to_their_own_targets() {
    let us = |v: &[f64]| Samples::from_us(v.to_vec());
    // The cluster's target: the data-plane hop adds at most HOP_TARGET_P50_US at p50.
    let hop = |direct: f64, via: f64| crate::cluster::Hop {
        direct: us(&[direct]),
        via_other_node: us(&[via]),
    };
    let cluster = crate::ClusterReport {
        dataplane: hop(100.0, 100.0 + crate::cluster::HOP_TARGET_P50_US + 1.0),
        create: hop(2000.0, 2100.0),
        wake: hop(1500.0, 1600.0),
    }
    .section("cluster");
    let h = &cluster.headlines;
    assert_eq!(h.len(), 3);
    assert_eq!(
        h[0].target,
        Some(Target::AddedAtMost {
            value: crate::cluster::HOP_TARGET_P50_US
        })
    );
    assert_eq!(h[0].met(), Some(false));
    assert_eq!((h[1].met(), h[1].added()), (None, Some(100.0)));
    // Serve's: confined creates and wakes at most CONFINEMENT_TARGET_RATIO times
    // unconfined ones; each run against the first.
    let ratio = crate::serve::CONFINEMENT_TARGET_RATIO;
    let run = |background, create: f64, wake: f64| crate::ServeRun {
        background,
        create: us(&[create]),
        create_http: us(&[create / 2.0]),
        wake: us(&[wake]),
        wake_http: us(&[wake / 2.0]),
    };
    let serve = crate::ServeReport {
        runs: vec![run(0, 2000.0, 1800.0), run(100, 2200.0, 1900.0)],
        dataplane: crate::serve::DataPlaneRun {
            direct: us(&[50.0]),
            through: us(&[150.0]),
        },
        confinement: crate::serve::ConfinementRun {
            create: us(&[2000.0 * (ratio - 0.01)]),
            create_free: us(&[2000.0]),
            wake: us(&[1800.0 * (ratio + 0.01)]),
            wake_free: us(&[1800.0]),
            create_http: us(&[1000.0]),
            create_http_free: us(&[1000.0]),
        },
        running: None,
        sustain: None,
        noise: crate::HostNoise::measure(3),
    }
    .section("serve");
    let h = &serve.headlines;
    let target = Some(Target::RatioAtMost { ratio });
    assert_eq!((h[0].target, h[0].met()), (target, Some(true)));
    assert_eq!((h[1].target, h[1].met()), (target, Some(false)));
    let with_100: Vec<_> = h
        .iter()
        .filter(|h| h.figure.contains("100 paused"))
        .collect();
    assert_eq!(with_100.len(), 2, "{h:?}");
    assert_eq!(with_100[0].added(), Some(200.0));
    assert_eq!(
        with_100[0].baseline.as_ref().unwrap().label,
        "0 paused sandboxes on the host"
    );
    assert_eq!(h.last().unwrap().added(), Some(100.0));
    // A plain summary (boot, ping): its p50, nothing to hold it against.
    let boot = us(&[10.0, 20.0, 30.0]).summary("boot").section("boot");
    assert_eq!(boot.headlines[0].value, Some(20.0));
    assert!(boot.headlines[0].baseline.is_none());
}

/// A serve report whose cases measured `create` and `wake` once each (no target met or
/// missed by them here), with `running` and `sustain`.
fn serve_with(
    running: Option<crate::RunningRun>,
    sustain: Option<crate::SustainRun>,
) -> crate::ServeReport {
    let us = |v: f64| Samples::from_us(vec![v]);
    crate::ServeReport {
        runs: vec![crate::ServeRun {
            background: 0,
            create: us(2000.0),
            create_http: us(1000.0),
            wake: us(1800.0),
            wake_http: us(900.0),
        }],
        dataplane: crate::serve::DataPlaneRun {
            direct: us(50.0),
            through: us(150.0),
        },
        confinement: crate::serve::ConfinementRun {
            create: us(2000.0),
            create_free: us(2000.0),
            wake: us(1800.0),
            wake_free: us(1800.0),
            create_http: us(1000.0),
            create_http_free: us(1000.0),
        },
        running,
        sustain,
        noise: crate::HostNoise::measure(3),
    }
}

#[test]
fn serve_running_and_sustain_are_measured_against_their_targets() {
    let census = crate::Census {
        processes: 3000,
        threads: 15000,
        fds: 40000,
        vm_trees: 1000,
        sandboxes: 1000,
        standbys: 2,
        standby_processes: 6,
        // 2.5 MiB of PSS per sandbox, 0.5 of it the guest's RAM; 2 MiB of kernel memory.
        pss_kib: 1000 * 2560,
        guest_pss_kib: 1000 * 512,
        kernel_kib: Some(1000 * 2048),
        cgroups: 1000,
        service_fds: 3000,
        service_threads: 6,
        ..Default::default()
    };
    let running = crate::RunningRun {
        n: 1000,
        clients: 8,
        running: 1000,
        create_failures: 0,
        first_failure: None,
        fill: std::time::Duration::from_secs(10),
        answering: 999,
        answering_first: 990,
        kill_failures: 0,
        census: census.clone(),
        census_1: crate::Census::default(),
        settled: true,
        idle_cpu_ns: 0,
        idle_runs: 0,
        idle_host_busy_pct: None,
        idle_window: std::time::Duration::from_secs(5),
        mem_available_drop_kib: Some(999 * 5 * 1024),
        create_1: Samples::from_us(vec![2000.0, 2100.0, 2200.0]),
        create_n: Samples::from_us(vec![4000.0, 4200.0, 4400.0]),
        create_1_after: Samples::from_us(vec![2100.0]),
        left: crate::Census::default(),
    };
    let sustain = crate::SustainRun {
        seconds: 20.0,
        clients: 8,
        elapsed: std::time::Duration::from_secs(20),
        create: Samples::from_us((1..=2000).map(|i| i as f64 * 10.0).collect()),
        create_http: Samples::from_us(vec![1000.0; 2000]),
        failures: 1,
        first_failure: Some("HTTP 500".into()),
        kill_failures: 0,
    };
    let r = serve_with(Some(running), Some(sustain));
    let j: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    let run = &j["running"];
    assert_eq!(
        (run["n"].as_u64(), run["answering"].as_u64()),
        (Some(1000), Some(999))
    );
    assert_eq!(run["processes_per_sandbox"].as_f64(), Some(3.0));
    // Beyond the guest's touched memory: 2.5 + 2 - 0.5.
    assert_eq!(run["host_mib_per_sandbox"].as_f64(), Some(4.0));
    assert_eq!(run["guest_touched_mib_per_sandbox"].as_f64(), Some(0.5));
    assert_eq!(
        run["mem_available_drop_mib_per_sandbox"].as_f64(),
        Some(5.0)
    );
    assert_eq!(run["create_p50_ratio"].as_f64(), Some(2.0));
    assert_eq!(run["create_p50_us_1_running"].as_f64(), Some(2100.0));
    assert_eq!(run["create_p50_us_n_running"].as_f64(), Some(4200.0));
    let s = &j["sustain"];
    assert_eq!(s["creates_per_s"].as_f64(), Some(100.0));
    assert_eq!(
        (s["p50_ms"].as_f64(), s["p99_ms"].as_f64()),
        (Some(10.0), Some(19.8))
    );
    assert_eq!(
        (s["failures"].as_u64(), s["seconds"].as_f64()),
        (Some(1), Some(20.0))
    );
    // The headlines: each figure as measured, against its target.
    let sec = r.section("serve");
    let find = |what: &str| {
        sec.headlines
            .iter()
            .find(|h| h.figure.contains(what))
            .unwrap_or_else(|| panic!("no headline {what}: {:?}", sec.headlines))
    };
    let ratio = find("sandboxes running");
    assert_eq!(ratio.ratio(), Some(2.0));
    assert_eq!(ratio.met(), Some(false));
    assert_eq!(find("answering").met(), Some(false));
    let procs = find("processes per running sandbox");
    assert_eq!((procs.value, procs.met()), (Some(3.0), Some(false)));
    let mem = find("host memory per running sandbox");
    assert_eq!((mem.value, mem.added()), (Some(4.5), Some(4.0)));
    assert_eq!(mem.target, Some(Target::AddedAtMost { value: 1.0 }));
    assert_eq!(mem.met(), Some(false));
    let rate = find("creates per second");
    assert_eq!((rate.value, rate.met()), (Some(100.0), Some(false)));
    assert_eq!(find("sustained creates failed").met(), Some(false));
    assert!(sec.plots.iter().any(|p| p.name == "running"));
    assert!(sec.plots.iter().any(|p| p.name == "sustain"));
    let text = r.to_string();
    assert!(text.contains("1000 running sandboxes"), "{text}");
    assert!(text.contains("100.0 creates/s (target >= 300)"), "{text}");
    // Without the cases: no such objects, no such headlines.
    let plain = serve_with(None, None);
    let j: serde_json::Value = serde_json::from_str(&plain.to_json()).unwrap();
    assert!(j.get("running").is_none() && j.get("sustain").is_none());
    assert!(!plain
        .section("serve")
        .headlines
        .iter()
        .any(|h| h.figure.contains("running sandbox")));
}

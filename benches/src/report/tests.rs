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

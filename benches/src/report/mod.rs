//! Bench reports: what a scenario measured, kept whole (every sample, not only its
//! percentiles) so that it can be drawn and compared later.
//!
//! A scenario's report type describes itself as a [`Section`]: its one-line text, its JSON
//! figures (what `--json` prints) and [`Plot`]s of the raw samples: latency distributions
//! against their same-run baselines, values in the order taken (fork children's first
//! replies), step breakdowns. A [`Report`] is the sections of one run plus the machine it
//! ran on; [`Report::write`] puts `report.json` (everything, the samples included),
//! `index.html` and each plot as SVG and PNG into a directory, and [`Report::load`] reads
//! one back for [`compare`]. The HTML is self-contained apart from the plot files beside
//! it and lists every figure of the JSON, so that nothing is only in one of them. It opens
//! with a summary: each section's [`Headline`] figures, each beside its same-run baseline
//! and the [`Target`] its scenario holds it to, met or missed.

mod html;
mod plot;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::stats::Samples;

pub use plot::font_path;

/// The version of `report.json` this code writes and reads.
pub const REPORT_VERSION: u32 = 1;

/// One series of samples, in microseconds, in the order taken.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Series {
    /// What it is ("uffd restore", "copy baseline").
    pub label: String,
    /// Whether it is a same-run baseline of the first series.
    pub baseline: bool,
    /// The samples, microseconds.
    pub us: Vec<f64>,
}

impl Series {
    /// The measured series `label`.
    pub fn measured(label: impl Into<String>, s: &Samples) -> Series {
        Series {
            label: label.into(),
            baseline: false,
            us: s.values().to_vec(),
        }
    }

    /// A baseline series `label`.
    pub fn baseline(label: impl Into<String>, s: &Samples) -> Series {
        Series {
            baseline: true,
            ..Series::measured(label, s)
        }
    }

    /// Nearest-rank percentile; NaN when empty.
    pub fn percentile(&self, p: f64) -> f64 {
        Samples::from_us(self.us.clone())
            .percentile(p)
            .unwrap_or(f64::NAN)
    }
}

/// What a plot shows.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PlotKind {
    /// Latency distributions: drawn as a CDF and as a histogram, each series on the same
    /// axes.
    Distribution {
        /// The series; baselines flagged.
        series: Vec<Series>,
    },
    /// Values in the order taken (x: their index, from 1); a series of one value (a
    /// baseline measured once) is drawn as a horizontal line.
    Sequence {
        /// What x counts ("child").
        x_label: String,
        /// The series.
        series: Vec<Series>,
    },
    /// Step breakdowns: one stacked bar per entry, each segment a step's p50.
    Steps {
        /// (bar label, [(step, p50 us)]).
        bars: Vec<(String, Vec<(String, f64)>)>,
    },
}

/// One plot of a section.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plot {
    /// File-name part, unique in its section (`[a-z0-9-]`).
    pub name: String,
    /// Its title.
    pub title: String,
    /// What it shows.
    #[serde(flatten)]
    pub kind: PlotKind,
}

impl Plot {
    /// A distribution plot.
    pub fn distribution(name: &str, title: &str, series: Vec<Series>) -> Plot {
        Plot {
            name: name.into(),
            title: title.into(),
            kind: PlotKind::Distribution { series },
        }
    }

    /// A sequence plot.
    pub fn sequence(name: &str, title: &str, x_label: &str, series: Vec<Series>) -> Plot {
        Plot {
            name: name.into(),
            title: title.into(),
            kind: PlotKind::Sequence {
                x_label: x_label.into(),
                series,
            },
        }
    }

    /// A step-breakdown plot; bars without steps are left out.
    pub fn steps(name: &str, title: &str, bars: Vec<(String, Vec<(String, f64)>)>) -> Plot {
        let bars = bars.into_iter().filter(|(_, s)| !s.is_empty()).collect();
        Plot {
            name: name.into(),
            title: title.into(),
            kind: PlotKind::Steps { bars },
        }
    }

    /// True when there is nothing to draw.
    fn is_empty(&self) -> bool {
        match &self.kind {
            PlotKind::Distribution { series } | PlotKind::Sequence { series, .. } => {
                series.iter().all(|s| s.us.is_empty())
            }
            PlotKind::Steps { bars } => bars.is_empty(),
        }
    }

    /// The plot's series (none for step breakdowns).
    pub fn series(&self) -> &[Series] {
        match &self.kind {
            PlotKind::Distribution { series } | PlotKind::Sequence { series, .. } => series,
            PlotKind::Steps { .. } => &[],
        }
    }
}

/// What a scenario holds a headline figure to: relative to the same run's baseline, or a
/// value of its own.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Target {
    /// At most this many times the baseline.
    RatioAtMost {
        /// The largest ratio figure / baseline that meets it.
        ratio: f64,
    },
    /// At most this much above the baseline.
    AddedAtMost {
        /// The most figure - baseline may be, in the figure's unit.
        value: f64,
    },
    /// At least this value, in the figure's unit (no baseline needed).
    AtLeast {
        /// The smallest value that meets it.
        value: f64,
    },
    /// At most this value, in the figure's unit (no baseline needed).
    AtMost {
        /// The largest value that meets it.
        value: f64,
    },
}

/// A headline figure's same-run baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// What it is ("copy restore").
    pub label: String,
    /// Its value, in the figure's unit; none when it was not measured.
    pub value: Option<f64>,
}

/// One of a section's headline figures: what the report's summary shows first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Headline {
    /// What it is ("uffd restore until the first ping, p50").
    pub figure: String,
    /// Its value; none when it was not measured.
    pub value: Option<f64>,
    /// Its unit ("us", "MiB/s").
    pub unit: String,
    /// The same run's baseline, if the scenario measures one.
    pub baseline: Option<Baseline>,
    /// The target the scenario holds it to, if it has one.
    pub target: Option<Target>,
}

/// A measured value: NaN and infinities (nothing measured) are none.
fn finite(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite())
}

impl Headline {
    /// Figure `figure`, `value` in `unit`, without baseline or target.
    pub fn new(figure: impl Into<String>, value: Option<f64>, unit: &str) -> Headline {
        Headline {
            figure: figure.into(),
            value: finite(value),
            unit: unit.into(),
            baseline: None,
            target: None,
        }
    }

    /// The same, against the same run's baseline `label` (`value` in the figure's unit).
    pub fn against(self, label: impl Into<String>, value: Option<f64>) -> Headline {
        Headline {
            baseline: Some(Baseline {
                label: label.into(),
                value: finite(value),
            }),
            ..self
        }
    }

    /// The same, held to `target`.
    pub fn target(self, target: Target) -> Headline {
        Headline {
            target: Some(target),
            ..self
        }
    }

    /// The figure over its baseline.
    pub fn ratio(&self) -> Option<f64> {
        let b = self.baseline.as_ref()?.value?;
        finite(Some(self.value? / b))
    }

    /// The figure minus its baseline.
    pub fn added(&self) -> Option<f64> {
        Some(self.value? - self.baseline.as_ref()?.value?)
    }

    /// Whether the figure meets its target; none without a target, or when the figure or
    /// the baseline its target needs was not measured.
    pub fn met(&self) -> Option<bool> {
        match self.target? {
            Target::RatioAtMost { ratio } => Some(self.ratio()? <= ratio),
            Target::AddedAtMost { value } => Some(self.added()? <= value),
            Target::AtLeast { value } => Some(self.value? >= value),
            Target::AtMost { value } => Some(self.value? <= value),
        }
    }
}

/// One scenario's part of a report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Section {
    /// The scenario (`restore`, `fork`, …), unique in a report.
    pub scenario: String,
    /// Its text rendering (what `clade bench` prints).
    pub text: String,
    /// Its JSON figures (what `--json` prints).
    pub figures: Value,
    /// Its headline figures, for the report's summary (none in reports written before
    /// there was one).
    #[serde(default)]
    pub headlines: Vec<Headline>,
    /// Its plots.
    pub plots: Vec<Plot>,
}

impl Section {
    /// A section from a scenario's text, its JSON text and plots; empty plots are dropped.
    pub fn new(scenario: &str, text: String, json: &str, plots: Vec<Plot>) -> Section {
        let figures = serde_json::from_str(json).unwrap_or(Value::String(json.to_string()));
        Section {
            scenario: scenario.into(),
            text,
            figures,
            headlines: Vec::new(),
            plots: plots.into_iter().filter(|p| !p.is_empty()).collect(),
        }
    }

    /// The same section with `headlines` as its headline figures.
    pub fn with_headlines(self, headlines: Vec<Headline>) -> Section {
        Section { headlines, ..self }
    }
}

/// Something a bench scenario returns that can be put in a report.
pub trait Reported {
    /// Its section, named `scenario`.
    fn section(&self, scenario: &str) -> Section;
}

/// A plain latency summary (boot, ping): its samples' distribution.
impl Reported for crate::stats::Summary {
    fn section(&self, scenario: &str) -> crate::report::Section {
        let plot = Plot::distribution(
            &self.name,
            &self.name,
            vec![Series::measured(&self.name, &self.samples)],
        );
        Section::new(scenario, self.to_string(), &self.to_json(), vec![plot]).with_headlines(vec![
            Headline::new(format!("{}, p50", self.name), Some(self.p50_us), "us"),
        ])
    }
}

/// What the report was measured on.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MachineInfo {
    /// CPU model (/proc/cpuinfo).
    pub cpu: String,
    /// Online CPUs.
    pub cpus: usize,
    /// Memory, MiB (/proc/meminfo).
    pub mem_mib: u64,
    /// Kernel release.
    pub kernel: String,
    /// Whether /dev/kvm is the software hypervisor of this project's machines (no VMX/SVM
    /// flag in /proc/cpuinfo).
    pub hardware_virt: bool,
}

impl MachineInfo {
    /// This machine.
    pub fn here() -> MachineInfo {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        let hardware_virt = cpuinfo
            .lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
        let mem_mib = std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib / 1024);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        MachineInfo {
            cpu,
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            mem_mib,
            kernel,
            hardware_virt,
        }
    }
}

/// A run's report: its sections and machine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// [`REPORT_VERSION`].
    pub version: u32,
    /// When it was made, seconds since the epoch.
    pub created_s: u64,
    /// The same, as an RFC 3339 UTC date and time ("2026-12-07T11:20:05Z"; empty in
    /// reports written before it was there).
    #[serde(default)]
    pub created_rfc3339: String,
    /// The machine.
    pub machine: MachineInfo,
    /// The sections, in the order run.
    pub sections: Vec<Section>,
}

impl Default for Report {
    fn default() -> Self {
        Self::new()
    }
}

impl Report {
    /// An empty report of this machine, now.
    pub fn new() -> Report {
        let created_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Report {
            version: REPORT_VERSION,
            created_s,
            created_rfc3339: rfc3339(created_s),
            machine: MachineInfo::here(),
            sections: Vec::new(),
        }
    }

    /// Adds a section; a second one of the same scenario gets a numbered name.
    pub fn push(&mut self, mut s: Section) {
        let base = s.scenario.clone();
        let mut i = 2;
        while self.sections.iter().any(|o| o.scenario == s.scenario) {
            s.scenario = format!("{base}-{i}");
            i += 1;
        }
        self.sections.push(s);
    }

    /// Writes `report.json`, `index.html` and the plots (SVG and PNG) into `dir` (created
    /// if missing; files of an earlier report there are replaced). Returns the HTML's path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).map_err(|e| io(format!("creating {}", dir.display()), e))?;
        let mut files = BTreeMap::new();
        for s in &self.sections {
            for p in &s.plots {
                let stem = format!("{}-{}", file_part(&s.scenario), file_part(&p.name));
                files.insert(
                    (s.scenario.clone(), p.name.clone()),
                    plot::draw(dir, &stem, p)?,
                );
            }
        }
        let json = serde_json::to_string(self)
            .map_err(|e| Error::Report(format!("serialising the report: {e}")))?;
        write_file(&dir.join("report.json"), json.as_bytes())?;
        let html = html::render(self, &files);
        let index = dir.join("index.html");
        write_file(&index, html.as_bytes())?;
        Ok(index)
    }

    /// Reads the report in `dir` (its `report.json`).
    pub fn load(dir: &Path) -> Result<Report> {
        let path = if dir.is_dir() {
            dir.join("report.json")
        } else {
            dir.to_path_buf()
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| io(format!("reading {}", path.display()), e))?;
        let r: Report = serde_json::from_str(&text)
            .map_err(|e| Error::Report(format!("{}: not a bench report: {e}", path.display())))?;
        if r.version != REPORT_VERSION {
            return Err(Error::Report(format!(
                "{}: report version {} (this clade reads {REPORT_VERSION})",
                path.display(),
                r.version
            )));
        }
        Ok(r)
    }
}

/// A figure of both reports: its path in the JSON and the two values.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ratio {
    /// `scenario.path.to.value`.
    pub figure: String,
    /// In the first report.
    pub a: f64,
    /// In the second.
    pub b: f64,
}

impl Ratio {
    /// b / a; NaN when a is 0.
    pub fn ratio(&self) -> f64 {
        if self.a == 0.0 {
            f64::NAN
        } else {
            self.b / self.a
        }
    }
}

/// Compares two reports: every numeric figure both have (scenario by scenario), and, for
/// each distribution both have, both reports' series on the same axes, written into
/// `out` (with an `index.html`). Returns the figures.
pub fn compare(a: &Report, b: &Report, out: &Path) -> Result<(Vec<Ratio>, PathBuf)> {
    let mut ratios = Vec::new();
    let mut merged = Report::new();
    for sa in &a.sections {
        let Some(sb) = b.sections.iter().find(|s| s.scenario == sa.scenario) else {
            continue;
        };
        let (fa, fb) = (leaves(&sa.figures), leaves(&sb.figures));
        for (path, va) in &fa {
            if let Some(vb) = fb.get(path) {
                ratios.push(Ratio {
                    figure: format!("{}.{path}", sa.scenario),
                    a: *va,
                    b: *vb,
                });
            }
        }
        let mut plots = Vec::new();
        for pa in &sa.plots {
            let Some(pb) = sb.plots.iter().find(|p| p.name == pa.name) else {
                continue;
            };
            let both = |sa: &[Series], sb: &[Series]| {
                let tag = |tag: &str, s: &Series, baseline| Series {
                    label: format!("{tag}: {}", s.label),
                    baseline,
                    us: s.us.clone(),
                };
                sa.iter()
                    .map(|s| tag("A", s, false))
                    .chain(sb.iter().map(|s| tag("B", s, true)))
                    .collect::<Vec<_>>()
            };
            let kind = match (&pa.kind, &pb.kind) {
                (PlotKind::Distribution { series: x }, PlotKind::Distribution { series: y }) => {
                    PlotKind::Distribution { series: both(x, y) }
                }
                (
                    PlotKind::Sequence { x_label, series: x },
                    PlotKind::Sequence { series: y, .. },
                ) => PlotKind::Sequence {
                    x_label: x_label.clone(),
                    series: both(x, y),
                },
                _ => continue,
            };
            plots.push(Plot {
                name: pa.name.clone(),
                title: format!("{} (A and B)", pa.title),
                kind,
            });
        }
        let text = ratios
            .iter()
            .filter(|r| r.figure.starts_with(&format!("{}.", sa.scenario)))
            .map(|r| format!("{}: {} -> {} (x{:.2})", r.figure, r.a, r.b, r.ratio()))
            .collect::<Vec<_>>()
            .join("\n");
        merged.push(Section {
            scenario: sa.scenario.clone(),
            text,
            figures: Value::Null,
            headlines: Vec::new(),
            plots,
        });
    }
    let index = merged.write(out)?;
    Ok((ratios, index))
}

/// Every numeric leaf of a JSON value, by dotted path (array items by index).
pub fn leaves(v: &Value) -> BTreeMap<String, f64> {
    fn walk(v: &Value, path: &str, out: &mut BTreeMap<String, f64>) {
        let join = |k: &str| {
            if path.is_empty() {
                k.to_string()
            } else {
                format!("{path}.{k}")
            }
        };
        match v {
            Value::Number(n) => {
                if let Some(f) = n.as_f64() {
                    out.insert(path.to_string(), f);
                }
            }
            Value::Object(m) => m.iter().for_each(|(k, v)| walk(v, &join(k), out)),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .for_each(|(i, v)| walk(v, &join(&i.to_string()), out)),
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    walk(v, "", &mut out);
    out
}

/// `secs` seconds since the epoch as a UTC date and time, "2026-12-07 11:20:05 UTC" (the
/// seconds themselves beyond what a date can say).
pub fn utc_date_time(secs: u64) -> String {
    date_time(secs).map_or_else(
        || format!("{secs} s since 1970"),
        |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
    )
}

/// `secs` seconds since the epoch in RFC 3339, UTC: "2026-12-07T11:20:05Z" (empty beyond
/// what a date can say).
pub fn rfc3339(secs: u64) -> String {
    date_time(secs).map_or_else(String::new, |t| {
        t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    })
}

fn date_time(secs: u64) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::from_timestamp(i64::try_from(secs).ok()?, 0)
}

/// A name reduced to `[a-z0-9-]` for a file name.
fn file_part(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

fn io(what: String, source: std::io::Error) -> Error {
    Error::Io { what, source }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| io(format!("writing {}", path.display()), e))
}

#[cfg(test)]
mod tests;

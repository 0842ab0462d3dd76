//! Drawing a [`Plot`] with plotters, once as SVG and once as PNG (the same drawing code on
//! both backends). Text needs a TrueType font: plotters' ab_glyph renderer has none of its
//! own, so a system font is registered once ([`font_path`]).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::{Plot, PlotKind, Series};
use crate::error::{Error, Result};

const SIZE: (u32, u32) = (960, 520);
const FONT: &str = "sans-serif";

/// Colours of the series, in order (measured ones first, as sections list them).
const PALETTE: [RGBColor; 12] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
    RGBColor(0x00, 0x00, 0x00),
    RGBColor(0xff, 0xbb, 0x78),
];

/// The TrueType font the plots' text is drawn with: `$CLADE_REPORT_FONT`, else the first
/// of DejaVu Sans, Liberation Sans and Noto Sans found (Debian's fonts-dejavu-core has the
/// first).
pub fn font_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CLADE_REPORT_FONT") {
        return Some(PathBuf::from(p));
    }
    [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

/// Registers the font once for the whole process.
fn ensure_font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let path = font_path().ok_or_else(|| {
            "no TrueType font for the plots: install fonts-dejavu-core or set CLADE_REPORT_FONT"
                .to_string()
        })?;
        let bytes = std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        // Registered fonts live as long as the process (plotters keeps `&'static` data).
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font(FONT, FontStyle::Normal, bytes)
            .map_err(|_| format!("{}: not a usable TrueType font", path.display()))
    })
    .clone()
    .map_err(Error::Report)
}

/// Draws `plot` into `dir` as `<stem>[-cdf|-hist].{svg,png}`; returns the SVG files' names.
pub(super) fn draw(dir: &Path, stem: &str, plot: &Plot) -> Result<Vec<String>> {
    ensure_font()?;
    let views: Vec<(String, View)> = match &plot.kind {
        PlotKind::Distribution { .. } => vec![
            (format!("{stem}-cdf"), View::Cdf),
            (format!("{stem}-hist"), View::Histogram),
        ],
        PlotKind::Sequence { .. } => vec![(stem.to_string(), View::Sequence)],
        PlotKind::Steps { .. } => vec![(stem.to_string(), View::Steps)],
    };
    let mut names = Vec::new();
    for (name, view) in views {
        let svg = dir.join(format!("{name}.svg"));
        let png = dir.join(format!("{name}.png"));
        let fail = |f: &Path, e: String| Error::Report(format!("drawing {}: {e}", f.display()));
        {
            let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
            draw_view(&root, plot, view).map_err(|e| fail(&svg, e))?;
            root.present().map_err(|e| fail(&svg, e.to_string()))?;
        }
        {
            let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
            draw_view(&root, plot, view).map_err(|e| fail(&png, e))?;
            root.present().map_err(|e| fail(&png, e.to_string()))?;
        }
        names.push(format!("{name}.svg"));
    }
    Ok(names)
}

#[derive(Clone, Copy)]
enum View {
    Cdf,
    Histogram,
    Sequence,
    Steps,
}

type DrawResult = std::result::Result<(), String>;

fn draw_view<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    plot: &Plot,
    view: View,
) -> DrawResult {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    match (&plot.kind, view) {
        (PlotKind::Distribution { series }, View::Cdf) => cdf(root, &plot.title, series),
        (PlotKind::Distribution { series }, _) => histogram(root, &plot.title, series),
        (PlotKind::Sequence { x_label, series }, _) => sequence(root, &plot.title, x_label, series),
        (PlotKind::Steps { bars }, _) => steps(root, &plot.title, bars),
    }
}

/// The x range of a log axis covering every sample of `series` (microseconds).
fn log_range(series: &[Series]) -> (f64, f64) {
    let all = series.iter().flat_map(|s| s.us.iter().copied());
    let (lo, hi) = all
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::MAX, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if hi <= 0.0 {
        return (1.0, 10.0);
    }
    (lo / 1.2, hi * 1.2)
}

/// Ticks of a log axis over `lo..hi`: 1-2-5 steps of each decade, or every digit where
/// that gives fewer than four.
pub(super) fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let ticks = |digits: &[f64]| {
        let mut v = Vec::new();
        let mut decade = 10f64.powf(lo.log10().floor());
        while decade <= hi {
            v.extend(
                digits
                    .iter()
                    .map(|d| d * decade)
                    .filter(|t| (lo..=hi).contains(t)),
            );
            decade *= 10.0;
        }
        v
    };
    let coarse = ticks(&[1.0, 2.0, 5.0]);
    if coarse.len() >= 4 {
        coarse
    } else {
        ticks(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// A label only on whole numbers (a sequence's x is an index).
fn whole(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-6 {
        format!("{v:.0}")
    } else {
        String::new()
    }
}

fn style(i: usize, s: &Series) -> ShapeStyle {
    let c = PALETTE[i % PALETTE.len()];
    c.stroke_width(if s.baseline { 2 } else { 3 })
}

fn sorted(us: &[f64]) -> Vec<f64> {
    let mut v: Vec<f64> = us.iter().copied().filter(|v| v.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

fn cdf<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    series: &[Series],
) -> DrawResult {
    let (lo, hi) = log_range(series);
    let mut chart = ChartBuilder::on(root)
        .caption(format!("{title}: CDF"), (FONT, 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(
            (lo..hi).log_scale().with_key_points(log_ticks(lo, hi)),
            0.0..1.0,
        )
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("latency (us, log scale)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("fraction of samples <= x")
        .label_style((FONT, 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, s) in series.iter().enumerate() {
        let v = sorted(&s.us);
        let n = v.len() as f64;
        let points: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .flat_map(|(k, &x)| [(x.max(lo), k as f64 / n), (x.max(lo), (k + 1) as f64 / n)])
            .collect();
        let st = style(i, s);
        chart
            .draw_series(LineSeries::new(points, st))
            .map_err(|e| e.to_string())?
            .label(legend(s))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], st));
    }
    finish(&mut chart)
}

fn legend(s: &Series) -> String {
    let p = |q| s.percentile(q);
    format!(
        "{} (n={}, p50 {:.0} us, p99 {:.0} us)",
        s.label,
        s.us.len(),
        p(50.0),
        p(99.0)
    )
}

fn finish<'a, DB: DrawingBackend + 'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
) -> DrawResult {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()
        .map_err(|e| e.to_string())
}

/// Histogram over 40 log-spaced bins, each series as the fraction of its samples per bin.
fn histogram<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    series: &[Series],
) -> DrawResult {
    const BINS: usize = 40;
    let (lo, hi) = log_range(series);
    let (llo, lhi) = (lo.ln(), hi.ln());
    let edge = |k: usize| (llo + (lhi - llo) * k as f64 / BINS as f64).exp();
    let mut fractions = Vec::new();
    let mut top = 0.0f64;
    for s in series {
        let mut counts = [0usize; BINS];
        for &v in s.us.iter().filter(|v| v.is_finite() && **v > 0.0) {
            let k = ((v.ln() - llo) / (lhi - llo) * BINS as f64).floor();
            counts[(k.max(0.0) as usize).min(BINS - 1)] += 1;
        }
        let n = s.us.len().max(1) as f64;
        let f: Vec<f64> = counts.iter().map(|&c| c as f64 / n).collect();
        top = f.iter().copied().fold(top, f64::max);
        fractions.push(f);
    }
    let mut chart = ChartBuilder::on(root)
        .caption(format!("{title}: histogram"), (FONT, 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(
            (lo..hi).log_scale().with_key_points(log_ticks(lo, hi)),
            0.0..(top * 1.1).max(0.01),
        )
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("latency (us, log scale)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("fraction of samples")
        .label_style((FONT, 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (s, f)) in series.iter().zip(&fractions).enumerate() {
        let points: Vec<(f64, f64)> = f
            .iter()
            .enumerate()
            .flat_map(|(k, &y)| [(edge(k), y), (edge(k + 1), y)])
            .collect();
        let st = style(i, s);
        chart
            .draw_series(AreaSeries::new(
                points.clone(),
                0.0,
                PALETTE[i % PALETTE.len()].mix(0.15),
            ))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(LineSeries::new(points, st))
            .map_err(|e| e.to_string())?
            .label(legend(s))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], st));
    }
    finish(&mut chart)
}

fn sequence<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    x_label: &str,
    series: &[Series],
) -> DrawResult {
    let n = series.iter().map(|s| s.us.len()).max().unwrap_or(1).max(2);
    let top = series
        .iter()
        .flat_map(|s| s.us.iter().copied())
        .filter(|v| v.is_finite())
        .fold(1.0f64, f64::max);
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FONT, 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.5..(n as f64 + 0.5), 0.0..top * 1.15)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .x_labels(n.min(25))
        .x_label_formatter(&whole)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("us")
        .label_style((FONT, 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, s) in series.iter().enumerate() {
        let st = style(i, s);
        let points: Vec<(f64, f64)> = if s.us.len() == 1 {
            vec![(0.5, s.us[0]), (n as f64 + 0.5, s.us[0])]
        } else {
            s.us.iter()
                .enumerate()
                .map(|(k, &y)| ((k + 1) as f64, y))
                .collect()
        };
        if s.us.len() > 1 {
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, st.filled())))
                .map_err(|e| e.to_string())?;
        }
        chart
            .draw_series(LineSeries::new(points, st))
            .map_err(|e| e.to_string())?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], st));
    }
    finish(&mut chart)
}

/// One horizontal stacked bar per entry; a step keeps its colour across bars.
fn steps<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    bars: &[(String, Vec<(String, f64)>)],
) -> DrawResult {
    let mut names: Vec<&str> = Vec::new();
    for (_, s) in bars {
        for (name, _) in s {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    let total = |s: &[(String, f64)]| s.iter().map(|(_, v)| v.max(0.0)).sum::<f64>();
    let top = bars.iter().map(|(_, s)| total(s)).fold(1.0f64, f64::max);
    let nb = bars.len().max(1) as f64;
    let mut chart = ChartBuilder::on(root)
        .caption(format!("{title} (p50 of each step, us)"), (FONT, 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(20)
        .build_cartesian_2d(0.0..top * 1.05, 0.0..nb)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .x_desc("us")
        .label_style((FONT, 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (k, name) in names.iter().enumerate() {
        let color = PALETTE[k % PALETTE.len()];
        let mut rects = Vec::new();
        for (b, (_, s)) in bars.iter().enumerate() {
            let mut x = 0.0;
            for (n, v) in s {
                let v = v.max(0.0);
                if n == name {
                    let y = nb - b as f64;
                    rects.push(Rectangle::new(
                        [(x, y - 0.75), (x + v, y - 0.35)],
                        color.filled(),
                    ));
                }
                x += v;
            }
        }
        chart
            .draw_series(rects)
            .map_err(|e| e.to_string())?
            .label(name.to_string())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    for (b, (label, s)) in bars.iter().enumerate() {
        let y = nb - b as f64 - 0.12;
        let text = format!("{label}: {:.0} us", total(s));
        chart
            .draw_series(std::iter::once(Text::new(
                text,
                (top * 0.005, y),
                (FONT, 15),
            )))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 13))
        .draw()
        .map_err(|e| e.to_string())
}

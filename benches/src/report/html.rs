//! The report's `index.html`: one page, no scripts, no outside resources; the plots are
//! the SVG files beside it (each linked to its PNG). It opens with the summary: every
//! section's headline figures, each beside its same-run baseline and its target, met or
//! missed; then the machine, and each section. Every scalar of each section's JSON is
//! listed in a table, written exactly as the JSON writes it.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

use super::{Headline, Report, Target};

/// Escapes text for HTML content and attribute values.
pub(super) fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Every scalar leaf of `v` by dotted path, as JSON writes it (strings unquoted).
fn scalars(v: &Value) -> Vec<(String, String)> {
    fn walk(v: &Value, path: String, out: &mut Vec<(String, String)>) {
        let join = |k: &str| {
            if path.is_empty() {
                k.to_string()
            } else {
                format!("{path}.{k}")
            }
        };
        match v {
            Value::Object(m) => m.iter().for_each(|(k, v)| walk(v, join(k), out)),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .for_each(|(i, v)| walk(v, join(&i.to_string()), out)),
            Value::String(s) => out.push((path, s.clone())),
            other => out.push((path, other.to_string())),
        }
    }
    let mut out = Vec::new();
    walk(v, String::new(), &mut out);
    out
}

const STYLE: &str = "body{font-family:sans-serif;margin:2em;max-width:1100px;color:#222}\
h1{font-size:1.6em}h2{margin-top:2em;border-bottom:1px solid #ccc}\
pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:.85em}\
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}\
td.v{font-family:monospace}img{max-width:100%;border:1px solid #eee;margin:.5em 0}\
details{margin:.5em 0}\
table.summary td.mark{font-weight:bold;white-space:nowrap}tr.met td.mark{color:#1a7f37}\
tr.missed td.mark{color:#c62828}tr.none td.mark{color:#777;font-weight:normal}";

/// A value with its unit, one decimal; "-" when not measured.
fn with_unit(v: Option<f64>, unit: &str) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1} {unit}"))
}

/// One row of the summary: scenario, figure, value, baseline, figure against baseline,
/// target, met or missed.
fn summary_row(h: &mut String, scenario: &str, l: &Headline) {
    let baseline = l.baseline.as_ref().map_or_else(
        || "none measured".into(),
        |b| format!("{}: {}", b.label, with_unit(b.value, &l.unit)),
    );
    let against = match (l.ratio(), l.added()) {
        (Some(r), Some(a)) => format!("{r:.2}x ({a:+.1} {})", l.unit),
        _ => "-".into(),
    };
    let target = match l.target {
        Some(Target::RatioAtMost { ratio }) => format!("&lt;= {ratio:.2}x the baseline"),
        Some(Target::AddedAtMost { value }) => {
            format!("&lt;= {value:+.1} {} over the baseline", esc(&l.unit))
        }
        Some(Target::AtLeast { value }) => format!("&gt;= {value:.1} {}", esc(&l.unit)),
        Some(Target::AtMost { value }) => format!("&lt;= {value:.1} {}", esc(&l.unit)),
        None => "none set".into(),
    };
    let (class, mark) = match (l.target, l.met()) {
        (_, Some(true)) => ("met", "\u{2713} met"),
        (_, Some(false)) => ("missed", "\u{2717} missed"),
        (Some(_), None) => ("none", "not measured"),
        (None, None) => ("none", "no target"),
    };
    let _ = write!(
        h,
        "<tr class=\"{class}\"><td><a href=\"#{0}\">{0}</a></td><td>{1}</td>\
         <td class=\"v\">{2}</td><td>{3}</td><td class=\"v\">{4}</td><td>{target}</td>\
         <td class=\"mark\">{mark}</td></tr>",
        esc(scenario),
        esc(&l.figure),
        esc(&with_unit(l.value, &l.unit)),
        esc(&baseline),
        esc(&against),
    );
}

/// The summary: every section's headline figures (nothing when no section has any).
fn summary(h: &mut String, r: &Report) {
    if r.sections.iter().all(|s| s.headlines.is_empty()) {
        return;
    }
    h.push_str(
        "<section id=\"summary\"><h2>Summary</h2>\n<table class=\"summary\"><tr>\
         <th>scenario</th><th>figure</th><th>value</th><th>same-run baseline</th>\
         <th>against it</th><th>target</th><th>result</th></tr>",
    );
    for s in &r.sections {
        for l in &s.headlines {
            summary_row(h, &s.scenario, l);
        }
    }
    h.push_str(
        "</table>\n<p>Targets are the ones the scenarios state; a figure without one is \
         shown against its baseline only. The details of each figure are in its section \
         below.</p></section>\n",
    );
}

pub(super) fn render(r: &Report, files: &BTreeMap<(String, String), Vec<String>>) -> String {
    let mut h = String::new();
    let m = &r.machine;
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>clade bench report</title><style>{STYLE}</style></head><body>\n\
         <h1>clade bench report</h1>\n"
    );
    summary(&mut h, r);
    let _ = writeln!(
        h,
        "<table id=\"machine\">\
         <tr><th>CPU</th><td>{}</td></tr><tr><th>CPUs</th><td>{}</td></tr>\
         <tr><th>memory</th><td>{} MiB</td></tr><tr><th>kernel</th><td>{}</td></tr>\
         <tr><th>hardware virtualization</th><td>{}</td></tr>\
         <tr><th>made</th><td><time datetime=\"{}\">{}</time></td></tr></table>",
        esc(&m.cpu),
        m.cpus,
        m.mem_mib,
        esc(&m.kernel),
        if m.hardware_virt {
            "yes"
        } else {
            "no (latencies on a software hypervisor)"
        },
        super::rfc3339(r.created_s),
        super::utc_date_time(r.created_s)
    );
    h.push_str("<ul id=\"contents\">");
    for s in &r.sections {
        let _ = write!(h, "<li><a href=\"#{0}\">{0}</a></li>", esc(&s.scenario));
    }
    h.push_str("</ul>\n");
    for s in &r.sections {
        let _ = write!(
            h,
            "<section id=\"{0}\"><h2>{0}</h2>\n<pre>{1}</pre>\n",
            esc(&s.scenario),
            esc(&s.text)
        );
        for p in &s.plots {
            for f in files
                .get(&(s.scenario.clone(), p.name.clone()))
                .into_iter()
                .flatten()
            {
                let png = f.trim_end_matches(".svg").to_string() + ".png";
                let _ = writeln!(
                    h,
                    "<figure><a href=\"{1}\"><img src=\"{0}\" alt=\"{2}\"></a></figure>",
                    esc(f),
                    esc(&png),
                    esc(&p.title)
                );
            }
        }
        let rows = scalars(&s.figures);
        if !rows.is_empty() {
            let _ = write!(
                h,
                "<details open><summary>figures ({} values, as in report.json)</summary>\
                 <table class=\"figures\"><tr><th>figure</th><th>value</th></tr>",
                rows.len()
            );
            for (k, v) in rows {
                let _ = write!(
                    h,
                    "<tr><td>{}</td><td class=\"v\">{}</td></tr>",
                    esc(&k),
                    esc(&v)
                );
            }
            h.push_str("</table></details>\n");
        }
        h.push_str("</section>\n");
    }
    h.push_str("<p>Everything above, with every sample, is in <a href=\"report.json\">report.json</a>.</p>\n</body></html>\n");
    h
}

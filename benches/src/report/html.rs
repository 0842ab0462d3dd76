//! The report's `index.html`: one page, no scripts, no outside resources; the plots are
//! the SVG files beside it (each linked to its PNG). Every scalar of each section's JSON is
//! listed in a table, written exactly as the JSON writes it.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

use super::Report;

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
details{margin:.5em 0}";

pub(super) fn render(r: &Report, files: &BTreeMap<(String, String), Vec<String>>) -> String {
    let mut h = String::new();
    let m = &r.machine;
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>clade bench report</title><style>{STYLE}</style></head><body>\n\
         <h1>clade bench report</h1>\n<table id=\"machine\">\
         <tr><th>CPU</th><td>{}</td></tr><tr><th>CPUs</th><td>{}</td></tr>\
         <tr><th>memory</th><td>{} MiB</td></tr><tr><th>kernel</th><td>{}</td></tr>\
         <tr><th>hardware virtualization</th><td>{}</td></tr>\
         <tr><th>made</th><td>{} (seconds since 1970)</td></tr></table>\n",
        esc(&m.cpu),
        m.cpus,
        m.mem_mib,
        esc(&m.kernel),
        if m.hardware_virt {
            "yes"
        } else {
            "no (latencies on a software hypervisor)"
        },
        r.created_s
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

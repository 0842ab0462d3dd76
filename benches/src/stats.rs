//! Statistics: samples, percentiles and the one-line latency summary.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

/// Durations collected by one benchmark, in microseconds.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    us: Vec<f64>,
}

impl Samples {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Samples already in microseconds.
    pub fn from_us(us: Vec<f64>) -> Self {
        Self { us }
    }

    /// Adds one measurement.
    pub fn push(&mut self, d: Duration) {
        self.us.push(d.as_secs_f64() * 1e6);
    }

    /// Number of measurements.
    pub fn len(&self) -> usize {
        self.us.len()
    }

    /// The measurements, in microseconds, in the order taken.
    pub fn values(&self) -> &[f64] {
        &self.us
    }

    /// True when nothing was measured.
    pub fn is_empty(&self) -> bool {
        self.us.is_empty()
    }

    /// The `p`-th percentile (0..=100), nearest-rank; `None` when empty.
    pub fn percentile(&self, p: f64) -> Option<f64> {
        if self.us.is_empty() {
            return None;
        }
        let mut v = self.us.clone();
        v.sort_by(f64::total_cmp);
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        Some(v[rank.clamp(1, v.len()) - 1])
    }

    /// p50/p99/min/max summary.
    pub fn summary(&self, name: &str) -> Summary {
        let pct = |p| self.percentile(p).unwrap_or(f64::NAN);
        Summary {
            name: name.to_string(),
            n: self.len(),
            p50_us: pct(50.0),
            p99_us: pct(99.0),
            min_us: pct(0.0),
            max_us: pct(100.0),
            samples: self.clone(),
        }
    }
}

/// A latency summary: what `clade bench boot` and `clade bench ping` report.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// What was measured.
    pub name: String,
    /// Number of samples.
    pub n: usize,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// Smallest sample.
    pub min_us: f64,
    /// Largest sample.
    pub max_us: f64,
    /// The samples themselves, in the order taken (for reports; not in the JSON).
    #[serde(skip)]
    pub samples: Samples,
}

impl Summary {
    /// One JSON object (keys in field order).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// One human-readable line.
impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: n={} p50={:.1} us p99={:.1} us (min {:.1}, max {:.1})",
            self.name, self.n, self.p50_us, self.p99_us, self.min_us, self.max_us
        )
    }
}

/// The `p`-th percentile (nearest rank) of counts; 0 when there are none.
pub fn pct_u64(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// A duration in microseconds.
pub(crate) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Rounded to one decimal, as the JSON reports give microseconds.
pub(crate) fn r1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// Per-step samples, reported as p50 in microseconds.
#[derive(Debug, Default, Clone)]
pub struct StepTimes(BTreeMap<&'static str, Samples>);

impl StepTimes {
    /// Adds one measurement of step `name`.
    pub fn add(&mut self, name: &'static str, d: Duration) {
        self.0.entry(name).or_default().push(d);
    }

    /// Each step's p50 in microseconds, in the order of [`Self::p50_json`].
    pub fn p50s(&self, order: &[&'static str]) -> Vec<(String, f64)> {
        let names = order
            .iter()
            .copied()
            .chain(self.0.keys().copied().filter(|k| !order.contains(k)));
        names
            .filter_map(|n| Some((n.to_string(), self.0.get(n)?.percentile(50.0)?)))
            .collect()
    }

    /// Each step's p50 (microseconds, one decimal); the steps named in `order` first, in
    /// that order, then the others by name. (Keys of a `serde_json` object are sorted when
    /// printed.)
    pub fn p50_json(&self, order: &[&'static str]) -> Value {
        let mut m = serde_json::Map::new();
        let names = order
            .iter()
            .copied()
            .chain(self.0.keys().copied().filter(|k| !order.contains(k)));
        for name in names {
            if let Some(s) = self.0.get(name) {
                let v = s.percentile(50.0).unwrap_or(f64::NAN);
                m.insert(name.to_string(), json!(r1(v)));
            }
        }
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut s = Samples::new();
        assert!(s.percentile(50.0).is_none());
        for i in 1..=100 {
            s.push(Duration::from_micros(i));
        }
        assert_eq!(s.percentile(50.0), Some(50.0));
        assert_eq!(s.percentile(99.0), Some(99.0));
        assert_eq!(s.percentile(0.0), Some(1.0));
        assert_eq!(s.percentile(100.0), Some(100.0));
        let j: serde_json::Value = serde_json::from_str(&s.summary("x").to_json()).unwrap();
        assert_eq!(j["n"], 100);
        assert_eq!(j["p50_us"], 50.0);
    }

    #[test]
    fn count_percentiles_and_summary_line() {
        assert_eq!(pct_u64(&[], 50.0), 0);
        assert_eq!(pct_u64(&[5, 1, 3], 50.0), 3);
        assert_eq!(pct_u64(&[5, 1, 3], 99.0), 5);
        let mut s = Samples::new();
        s.push(Duration::from_micros(10));
        assert_eq!(
            s.summary("x").to_string(),
            "x: n=1 p50=10.0 us p99=10.0 us (min 10.0, max 10.0)"
        );
    }
}

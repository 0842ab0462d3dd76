//! Statistics and report format shared by the `clade bench` subcommands.
//!
//! Benchmarks measure; they do not assert. Each scenario collects [`Samples`] and prints a
//! [`Summary`] as text or one JSON object.

use std::time::Duration;

use serde::Serialize;

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

    /// Adds one measurement.
    pub fn push(&mut self, d: Duration) {
        self.us.push(d.as_secs_f64() * 1e6);
    }

    /// Number of measurements.
    pub fn len(&self) -> usize {
        self.us.len()
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
        }
    }
}

/// What a benchmark prints.
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
}

impl Summary {
    /// One human-readable line.
    pub fn line(&self) -> String {
        format!(
            "{}: n={} p50={:.1} us p99={:.1} us (min {:.1}, max {:.1})",
            self.name, self.n, self.p50_us, self.p99_us, self.min_us, self.max_us
        )
    }

    /// One JSON object.
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
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
        let j: serde_json::Value = serde_json::from_str(&s.summary("x").json()).unwrap();
        assert_eq!(j["n"], 100);
        assert_eq!(j["p50_us"], 50.0);
    }
}

//! The host's own noise, measured in the same run as a benchmark: a fixed piece of CPU work
//! (no system calls, no memory traffic) timed many times with a short sleep before each,
//! as the benchmarks' steps run after their threads waited. On a host that is itself a VM
//! sharing its CPUs, a step is sometimes slowed several times over by something outside
//! this machine (the CPU given to another guest): this shows how often, so that a
//! benchmark's p99 can be read against it (a p99 far above p50 on a host whose fixed work
//! also slows that much is the host's, not the code path's).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::stats::Samples;

/// Iterations of the fixed work: about 0.2-0.4 ms on this project's hosts.
const CHUNK_ITERS: u64 = 300_000;

/// Tries a benchmark makes (~0.4 s).
pub const NOISE_TRIES: usize = 300;

/// The pause before each chunk (the CPU may idle meanwhile, as between restores).
const GAP: Duration = Duration::from_millis(1);

/// How `n` chunks of fixed CPU work went.
#[derive(Debug, Clone)]
pub struct HostNoise {
    chunks: Samples,
}

/// One chunk of fixed work; the result is used so that it is not optimised away.
fn chunk() -> u64 {
    let mut x = std::hint::black_box(0x9e37_79b9_7f4a_7c15u64);
    for i in 0..CHUNK_ITERS {
        x = x.rotate_left(7).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ i;
    }
    std::hint::black_box(x)
}

impl HostNoise {
    /// Times `n` chunks on the calling thread (its CPU pinning applies).
    pub fn measure(n: usize) -> HostNoise {
        let mut chunks = Samples::new();
        for _ in 0..n {
            std::thread::sleep(GAP);
            let t = Instant::now();
            chunk();
            chunks.push(t.elapsed());
        }
        HostNoise { chunks }
    }

    /// The chunks' times.
    pub fn chunks(&self) -> &Samples {
        &self.chunks
    }

    /// Its distribution, for a report: the same fixed CPU work, try after try.
    pub fn plot(&self) -> crate::report::Plot {
        crate::report::Plot::distribution(
            "host-noise",
            "Host noise: the same fixed CPU work after a 1 ms sleep",
            vec![crate::report::Series::measured(
                "fixed CPU work",
                &self.chunks,
            )],
        )
    }

    /// Percentage of chunks that took at least three times the median.
    pub fn slow_pct(&self) -> f64 {
        let p50 = self.chunks.percentile(50.0).unwrap_or(f64::NAN);
        let slow = self.chunks.values().iter().filter(|&&c| c >= 3.0 * p50);
        100.0 * slow.count() as f64 / self.chunks.len().max(1) as f64
    }

    /// `{"chunk_p50_us", "chunk_p99_us", "chunk_max_us", "slow_3x_pct", "n"}`.
    pub fn to_json(&self) -> Value {
        let s = self.chunks.summary("host_noise");
        json!({
            "n": s.n,
            "chunk_p50_us": (s.p50_us * 10.0).round() / 10.0,
            "chunk_p99_us": (s.p99_us * 10.0).round() / 10.0,
            "chunk_max_us": (s.max_us * 10.0).round() / 10.0,
            "slow_3x_pct": (self.slow_pct() * 10.0).round() / 10.0,
        })
    }
}

/// One line: `host noise: fixed CPU work p50 .. us, p99 .. us, ..% of tries >= 3x p50 (n=..)`.
impl std::fmt::Display for HostNoise {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.chunks.summary("host_noise");
        write!(
            f,
            "host noise (the same fixed CPU work, {} tries after a 1 ms sleep): p50 {:.0} us, \
             p99 {:.0} us, max {:.0} us; {:.1}% of tries took >= 3x p50",
            s.n,
            s.p50_us,
            s.p99_us,
            s.max_us,
            self.slow_pct()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_work_is_timed_each_try_and_summarised() {
        let n = HostNoise::measure(5);
        assert_eq!(n.chunks.len(), 5);
        let j = n.to_json();
        assert_eq!(j["n"], 5);
        assert!(j["chunk_p50_us"].as_f64().unwrap() > 0.0);
        assert!(j["chunk_p99_us"].as_f64().unwrap() >= j["chunk_p50_us"].as_f64().unwrap());
        let pct = j["slow_3x_pct"].as_f64().unwrap();
        assert!((0.0..=100.0).contains(&pct));
    }

    #[test]
    fn slow_tries_are_counted_against_three_times_the_median() {
        let mut chunks = Samples::new();
        for us in [100, 100, 100, 299, 300, 1000] {
            chunks.push(Duration::from_micros(us));
        }
        // Median (nearest rank) 100 us: 300 and 1000 are slow, 299 is not.
        let n = HostNoise { chunks };
        assert!((n.slow_pct() - 100.0 * 2.0 / 6.0).abs() < 1e-9);
    }
}

//! Metrics: each sandbox's CPU, memory and disk over time, sampled by a background tick
//! ([`Host::sample_metrics`]) and read by the API; the /proc and file measurements
//! themselves are in `usage`.

use super::*;

impl Host {
    /// A sandbox's metrics taken in `[from_ms, to_ms]`, oldest first: the samples taken
    /// every [`usage::SAMPLE_INTERVAL`] while it ran ([`Host::sample_metrics`]), and, when
    /// it runs and the range holds now, one taken now. That one's CPU figure covers the
    /// time since the previous sample of this VM (at least [`usage::MIN_INTERVAL`] ago),
    /// or else a short window measured now.
    pub fn metrics(&self, id: &str, from_ms: i64, to_ms: i64) -> Result<Vec<Metrics>> {
        if to_ms < from_ms {
            return Err(Error::BadRequest(format!(
                "the metrics range ends ({to_ms} ms) before it starts ({from_ms} ms)"
            )));
        }
        let rec = self.load_usable(id)?;
        let mut out = self.history.range(&rec.id, from_ms, to_ms);
        let now = ids::now_ms();
        if let (Some(pid), true) = (
            rec.pid.filter(|_| rec.state == State::Running),
            (from_ms..=to_ms).contains(&now),
        ) {
            let pid = self.driver.vm_process(pid);
            let cpu = usage::recent_cpu(&self.cpu_samples, pid).unwrap_or(0.0);
            out.push(self.measure(&rec, pid, cpu));
        }
        Ok(out)
    }

    /// The newest metrics of each of `ids` that exists (E2B's `GET /sandboxes/metrics`):
    /// its last sample, or one taken now for a running sandbox not sampled yet.
    pub fn latest_metrics(&self, ids: &[String]) -> Result<Vec<(String, Metrics)>> {
        let mut out = Vec::new();
        for id in ids {
            let rec = match self.load_usable(id) {
                Ok(r) => r,
                Err(Error::NotFound(_)) => continue,
                Err(e) => return Err(e),
            };
            let m = match (self.history.latest(&rec.id), rec.pid) {
                (Some(m), _) => Some(m),
                (None, Some(pid)) if rec.state == State::Running => {
                    let pid = self.driver.vm_process(pid);
                    let cpu = usage::recent_cpu(&self.cpu_samples, pid).unwrap_or(0.0);
                    Some(self.measure(&rec, pid, cpu))
                }
                _ => None,
            };
            if let Some(m) = m {
                out.push((rec.id, m));
            }
        }
        Ok(out)
    }

    /// Takes a sample of every running sandbox's metrics when one is due (every
    /// [`usage::SAMPLE_INTERVAL`]; the service's ticker calls this). A VM first seen now
    /// gets its CPU baseline and its first sample at the next round.
    pub fn sample_metrics(&self) -> Result<()> {
        if !self.history.due() {
            return Ok(());
        }
        let all = self.reg().all()?;
        let mut round = Vec::new();
        for rec in all.iter().filter(|r| r.state == State::Running) {
            let Some(pid) = rec.pid.map(|p| self.driver.vm_process(p)) else {
                continue;
            };
            if let Some(cpu) = usage::cpu_since(&self.cpu_samples, pid, false) {
                round.push((rec.id.clone(), self.measure(rec, pid, cpu)));
            }
        }
        let exists: std::collections::HashSet<&str> = all.iter().map(|r| r.id.as_str()).collect();
        self.history.record(round, |id| exists.contains(id));
        Ok(())
    }

    /// A metrics sample of a running sandbox now, `pid` the process that holds its VM
    /// ([`VmDriver::vm_process`]), with its CPU use (percent of one host CPU) measured by
    /// the caller.
    pub(super) fn measure(&self, rec: &Record, pid: i32, cpu: f64) -> Metrics {
        let (disk_used, disk_total) = usage::disk(&rec.dir);
        Metrics {
            at_ms: ids::now_ms(),
            cpu_count: rec.vcpus,
            cpu_used_pct: (cpu / rec.vcpus.max(1) as f64).min(100.0),
            mem_used: usage::memory(pid).unwrap_or(0),
            mem_total: rec.mem_mib * 1024 * 1024,
            disk_used,
            disk_total,
        }
    }
}

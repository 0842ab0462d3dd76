//! `snapshot`: full snapshots, then diff snapshots of a guest that keeps rewriting part of
//! its memory; how long the vCPUs were paused, and in all.

use std::fmt;
use std::time::Duration;

use serde_json::{json, Value};
use vmm::SnapshotKind;

use crate::error::{Error, Result};
use crate::guest::{boot_until, Guest, Machine, Scratch};
use crate::stats::{pct_u64, r1, Samples, StepTimes};
use crate::FILL_BASE_MIB;

/// What `snapshot` measures.
#[derive(Debug, Clone)]
pub struct SnapshotParams {
    /// Number of diff snapshots, each on top of the previous one (1..`vmm::MAX_DIFF_CHAIN`).
    pub n: usize,
    /// Number of full snapshots (at least one is taken).
    pub full_n: usize,
    /// Percentage of guest memory the guest rewrites between snapshots (0 < p <= 100).
    pub dirty_pct: f64,
    /// Percentage of the memory above 64 MiB filled before the first snapshot.
    pub fill_pct: u32,
}

/// One kind of snapshot's measurements.
#[derive(Debug, Clone, Default)]
pub struct SnapshotRuns {
    /// How long the vCPUs were paused.
    pub pause: Samples,
    /// The whole snapshot.
    pub total: Samples,
    /// Dirty pages found per snapshot.
    pub pages_considered: Vec<u64>,
    /// Pages written per snapshot.
    pub pages_written: Vec<u64>,
    /// Snapshot steps.
    pub steps: StepTimes,
}

impl SnapshotRuns {
    /// Adds one snapshot's figures.
    fn record(&mut self, info: &vmm::SnapshotInfo) {
        self.pause.push(info.pause_time);
        self.total.push(info.total_time);
        self.pages_considered.push(info.pages_considered);
        self.pages_written.push(info.pages_written);
        for (name, d) in &info.steps {
            self.steps.add(name, *d);
        }
    }
}

/// What `snapshot` reports.
#[derive(Debug, Clone)]
pub struct SnapshotReport {
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// MiB filled before the first snapshot.
    pub fill_mib: u64,
    /// MiB the guest rewrites between snapshots.
    pub dirty_mib: u64,
    /// The same, as a percentage of guest memory.
    pub dirty_pct: f64,
    /// Full snapshots.
    pub full: SnapshotRuns,
    /// Diff snapshots.
    pub diff: SnapshotRuns,
}

const FULL_STEP_ORDER: &[&str] = &[
    "pause",
    "save_vcpus",
    "save_vm_devices",
    "dirty_log",
    "copy_written",
    "map_memory",
    "vcpu_state",
    "move",
    "freeze_memory",
    "unpause",
    "write_memory",
];

const DIFF_STEP_ORDER: &[&str] = &[
    "pause",
    "save_vcpus",
    "save_vm_devices",
    "dirty_log",
    "write_memory",
    "unpause",
    "commit_memory",
    "write_state",
];

/// Boots the guest filling part of its memory then rewriting `dirty_pct` of it over and
/// over (`memfill`, `memchurn`), takes `full_n` full snapshots, then `n` diff snapshots.
pub fn snapshot(
    guest: &Guest,
    machine: &Machine,
    params: &SnapshotParams,
) -> Result<SnapshotReport> {
    let n = params.n;
    if n == 0 || n >= vmm::MAX_DIFF_CHAIN {
        return Err(Error::InvalidParams(format!(
            "-n must be in 1..{} (each diff is taken on top of the previous one)",
            vmm::MAX_DIFF_CHAIN
        )));
    }
    let dirty_pct = params.dirty_pct;
    if !(dirty_pct > 0.0 && dirty_pct <= 100.0) || params.fill_pct > 100 {
        return Err(Error::InvalidParams(
            "--dirty and --fill are percentages".into(),
        ));
    }
    let room = machine.mem_mib.saturating_sub(FILL_BASE_MIB);
    let dirty_mib = ((machine.mem_mib as f64 * dirty_pct / 100.0).round() as u64).max(1);
    let fill_mib = (room * u64::from(params.fill_pct) / 100).max(dirty_mib);
    if fill_mib > room {
        return Err(Error::InvalidParams(format!(
            "a {} MiB guest has {room} MiB above {FILL_BASE_MIB} MiB for the test",
            machine.mem_mib
        )));
    }
    let scratch = Scratch::new("snapshot")?;
    let steps = format!("memfill:3:{fill_mib},memchurn:{dirty_mib}");
    let ready = format!("step memfill:3:{fill_mib} ok");
    let mut vm = boot_until(guest, machine, &steps, None, &ready)?;
    std::thread::sleep(Duration::from_millis(100));

    let mut full = SnapshotRuns::default();
    for i in 0..params.full_n.max(1) {
        // A copy-on-write full snapshot moves the VM onto a spare shell, as a VM process
        // keeps one (built ahead: not measured).
        vm.give_shell(vmm::Shell::create(&vm.child_shell_spec())?)?;
        let info = vmm::snapshot(
            &mut vm,
            &scratch.0.join(format!("full{i}")),
            SnapshotKind::Full,
        )?;
        tracing::debug!(i, pause = ?info.pause_time, total = ?info.total_time, "full snapshot");
        full.record(&info);
    }
    let mut diff = SnapshotRuns::default();
    for i in 0..n {
        // The guest rewrites its range over and over; let it dirty every page again.
        std::thread::sleep(Duration::from_millis(100));
        let info = vmm::snapshot(
            &mut vm,
            &scratch.0.join(format!("diff{i}")),
            SnapshotKind::Diff,
        )?;
        tracing::debug!(i, pause = ?info.pause_time, total = ?info.total_time, "diff snapshot");
        diff.record(&info);
    }
    vm.shutdown();
    Ok(SnapshotReport {
        mem_mib: machine.mem_mib,
        fill_mib,
        dirty_mib,
        dirty_pct,
        full,
        diff,
    })
}

/// A percentile rounded to one decimal (NaN when empty).
fn p(s: &Samples, q: f64) -> f64 {
    r1(s.percentile(q).unwrap_or(f64::NAN))
}

impl SnapshotReport {
    /// The diff snapshots' step p50s (microseconds).
    fn diff_steps_json(&self) -> Value {
        self.diff.steps.p50_json(DIFF_STEP_ORDER)
    }

    /// The full snapshots' step p50s (microseconds): with memory that can be frozen the
    /// memory is written after `unpause` (copy-on-write).
    fn full_steps_json(&self) -> Value {
        self.full.steps.p50_json(FULL_STEP_ORDER)
    }

    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let (full, diff) = (&self.full, &self.diff);
        json!({
            "mem_mib": self.mem_mib,
            "fill_mib": self.fill_mib,
            "dirty_mib": self.dirty_mib,
            "dirty_pct": self.dirty_pct,
            "full": {
                "n": full.pause.len(),
                "pause_p50_us": p(&full.pause, 50.0),
                "pause_p99_us": p(&full.pause, 99.0),
                "total_p50_us": p(&full.total, 50.0),
                "total_p99_us": p(&full.total, 99.0),
                "pages_written_p50": pct_u64(&full.pages_written, 50.0),
                "steps_p50_us": self.full_steps_json(),
            },
            "diff": {
                "n": diff.pause.len(),
                "pause_p50_us": p(&diff.pause, 50.0),
                "pause_p99_us": p(&diff.pause, 99.0),
                "total_p50_us": p(&diff.total, 50.0),
                "total_p99_us": p(&diff.total, 99.0),
                "dirty_pages_p50": pct_u64(&diff.pages_considered, 50.0),
                "pages_written_p50": pct_u64(&diff.pages_written, 50.0),
                "steps_p50_us": self.diff_steps_json(),
            },
            "measured": "Vm::snapshot of the native guest rewriting dirty_mib MiB (memchurn); pause = vCPUs stopped",
        })
        .to_string()
    }
}

/// A few lines of text.
impl fmt::Display for SnapshotReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (full, diff) = (&self.full, &self.diff);
        write!(
            f,
            "snapshot {} MiB guest, {} MiB dirtied between diffs:\n  full: pause p50 {:.1} us, \
             total p50 {:.1} us ({} pages)\n  diff: pause p50 {:.1} us p99 {:.1} us, total \
             p50 {:.1} us ({} dirty pages)\n  full steps p50 (us): {}\n  diff steps p50 (us): {}",
            self.mem_mib,
            self.dirty_mib,
            p(&full.pause, 50.0),
            p(&full.total, 50.0),
            pct_u64(&full.pages_written, 50.0),
            p(&diff.pause, 50.0),
            p(&diff.pause, 99.0),
            p(&diff.total, 50.0),
            pct_u64(&diff.pages_considered, 50.0),
            self.full_steps_json(),
            self.diff_steps_json()
        )
    }
}

impl crate::report::Reported for SnapshotReport {
    fn section(&self, scenario: &str) -> crate::report::Section {
        use crate::report::{Headline, Plot, Section, Series};
        let (full, diff) = (&self.full, &self.diff);
        let headlines = vec![
            Headline::new(
                "diff snapshot: vCPUs paused, p50",
                diff.pause.percentile(50.0),
                "us",
            )
            .against("full snapshot", full.pause.percentile(50.0)),
            Headline::new(
                "diff snapshot: until written, p50",
                diff.total.percentile(50.0),
                "us",
            )
            .against("full snapshot", full.total.percentile(50.0)),
        ];
        Section::new(
            scenario,
            self.to_string(),
            &self.to_json(),
            vec![
                Plot::distribution(
                    "pause",
                    "Snapshot: how long the vCPUs were paused",
                    vec![
                        Series::measured("diff snapshot", &diff.pause),
                        Series::baseline("full snapshot", &full.pause),
                    ],
                ),
                Plot::distribution(
                    "total",
                    "Snapshot: until written",
                    vec![
                        Series::measured("diff snapshot", &diff.total),
                        Series::baseline("full snapshot", &full.total),
                    ],
                ),
                Plot::steps(
                    "steps",
                    "Snapshot steps",
                    vec![
                        ("diff".into(), diff.steps.p50s(DIFF_STEP_ORDER)),
                        ("full".into(), full.steps.p50s(FULL_STEP_ORDER)),
                    ],
                ),
            ],
        )
        .with_headlines(headlines)
    }
}

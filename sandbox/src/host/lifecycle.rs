//! The lifecycle as a state machine: the one place that says which phase a sandbox is in
//! ([`Phase::of`]), which operation may move it from which phase to which
//! ([`RULES`]), and what each must check before it acts ([`Check`]). The operations
//! themselves (`create`, `pause`, `resume`, `fork`, ...) live in the rooms beside this one
//! and ask [`permit`] first; a phase the table does not allow gets the error a client
//! sees (409 for "already paused", the crash for a crashed sandbox), before anything is
//! touched.
//!
//! `docs/lifecycle.md` draws the same table; a test below keeps the two equal
//! ([`table_markdown`]).
//!
//! Two facts cut across the phases and are not phases of their own: whether a paused
//! sandbox is durable (its latest pause is in the object store, so another host may resume
//! it: [`Record::durable`]), and whether this host still owns it in a cluster (the fence,
//! [`Check::Fence`]: one another host took over is forgotten here and is [`Phase::InStore`]
//! from then on).

use crate::error::{Error, Result};
use crate::registry::{Record, State};

/// Where a sandbox is in its life, as this host sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Not here, and not in the store: about to be created, or gone.
    Absent,
    /// Its VM process runs.
    Running,
    /// Paused with its memory: a pause snapshot on disk (or, taken over from another host,
    /// in the store). No process, no guest RAM.
    Paused,
    /// Paused filesystem-only: its memory was dropped, its disk kept; it wakes by booting
    /// its template's kernel from that disk.
    PausedDiskOnly,
    /// Its VM process ended without being asked to. Only a kill (or a lookup) is taken.
    Crashed,
    /// Not in this host's registry, but paused in the object store (another host's, or
    /// this host's before its state was lost): a resume adopts it, a kill removes it.
    InStore,
}

impl Phase {
    /// The phase of a sandbox this host has a record of.
    pub fn of(rec: &Record) -> Phase {
        match rec.state {
            State::Running => Phase::Running,
            State::Paused if rec.memory_dropped => Phase::PausedDiskOnly,
            State::Paused => Phase::Paused,
            State::Crashed => Phase::Crashed,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Phase::Absent => "absent",
            Phase::Running => "running",
            Phase::Paused => "paused",
            Phase::PausedDiskOnly => "paused (disk only)",
            Phase::Crashed => "crashed",
            Phase::InStore => "in the store",
        }
    }
}

/// What is asked of the lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A new sandbox from a template or a persistent snapshot.
    Create,
    /// A pause that keeps memory (a snapshot).
    Pause,
    /// A filesystem-only pause (E2B's `memory: false`).
    PauseDiskOnly,
    /// Resume a paused sandbox (restore its snapshot, or boot when its memory is gone).
    Resume,
    /// Resume by booting from its disk (`on_resume="reboot"`): its memory is dropped.
    Reboot,
    /// E2B `connect`: a running one gets more time, a paused one is resumed.
    Connect,
    /// Fork into new sandboxes (the parent runs on).
    Fork,
    /// A persistent snapshot (the sandbox stays as it is).
    Snapshot,
    /// A new end time, or more time (`set_timeout`, `refresh`).
    Extend,
    /// A new egress policy.
    SetEgress,
    /// The timeout's action: pause with auto-pause, else kill.
    TimeOut,
    /// The VM process ended on its own (seen by a lookup or the reaper).
    Crash,
    /// Kill: the process stops, the files go.
    Kill,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Pause => "pause",
            Op::PauseDiskOnly => "pause (disk only)",
            Op::Resume => "resume",
            Op::Reboot => "resume (reboot)",
            Op::Connect => "connect",
            Op::Fork => "fork",
            Op::Snapshot => "snapshot",
            Op::Extend => "set timeout / refresh",
            Op::SetEgress => "set egress",
            Op::TimeOut => "time out",
            Op::Crash => "crash",
            Op::Kill => "kill",
        }
    }
}

/// What an operation must check before it changes anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// The cluster's fence: this host still owns the sandbox (`Host::fence`); one another
    /// host took over is forgotten here and the operation refused.
    Fence,
    /// Room for the VMs it starts, when a cluster counts it (`Host::admit`).
    Room,
    /// A claim in the object store for a durable pause: one host only resumes (or
    /// removes) it (`Durable::claim`).
    Claim,
    /// The guest's agent answers (it flushes its disk before a filesystem-only pause;
    /// a timeout's pause wants a healthy guest).
    Guest,
}

impl Check {
    fn name(self) -> &'static str {
        match self {
            Check::Fence => "fence",
            Check::Room => "room",
            Check::Claim => "claim",
            Check::Guest => "guest",
        }
    }
}

/// One allowed move: `op` takes a sandbox in `from` to `to`, after `checks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub op: Op,
    pub from: Phase,
    pub to: Phase,
    pub checks: &'static [Check],
}

const fn rule(op: Op, from: Phase, to: Phase, checks: &'static [Check]) -> Rule {
    Rule {
        op,
        from,
        to,
        checks,
    }
}

use Check::{Claim, Fence, Guest, Room};
use Phase::{Absent, Crashed, InStore, Paused, PausedDiskOnly, Running};

/// Every move the lifecycle makes. Anything not here is refused by [`permit`].
pub const RULES: &[Rule] = &[
    rule(Op::Create, Absent, Running, &[Room]),
    rule(Op::Pause, Running, Paused, &[Fence]),
    rule(Op::PauseDiskOnly, Running, PausedDiskOnly, &[Fence, Guest]),
    rule(Op::Resume, Paused, Running, &[Fence, Room, Claim]),
    rule(Op::Resume, PausedDiskOnly, Running, &[Fence, Room]),
    rule(Op::Resume, InStore, Running, &[Claim, Room]),
    rule(Op::Reboot, Paused, Running, &[Fence, Room]),
    rule(Op::Reboot, PausedDiskOnly, Running, &[Fence, Room]),
    rule(Op::Connect, Running, Running, &[Fence]),
    rule(Op::Connect, Paused, Running, &[Fence, Room, Claim]),
    rule(Op::Connect, PausedDiskOnly, Running, &[Fence, Room]),
    rule(Op::Connect, InStore, Running, &[Claim, Room]),
    rule(Op::Fork, Running, Running, &[Fence, Room]),
    rule(Op::Snapshot, Running, Running, &[Fence]),
    rule(Op::Snapshot, Paused, Paused, &[Fence]),
    rule(Op::Extend, Running, Running, &[Fence]),
    rule(Op::Extend, Paused, Paused, &[Fence]),
    rule(Op::Extend, PausedDiskOnly, PausedDiskOnly, &[Fence]),
    rule(Op::SetEgress, Running, Running, &[Fence]),
    rule(Op::SetEgress, Paused, Paused, &[Fence]),
    rule(Op::SetEgress, PausedDiskOnly, PausedDiskOnly, &[Fence]),
    rule(Op::TimeOut, Running, Paused, &[Fence, Guest]),
    rule(Op::TimeOut, Running, Absent, &[Fence]),
    rule(Op::TimeOut, Paused, Paused, &[Fence]),
    rule(Op::TimeOut, PausedDiskOnly, PausedDiskOnly, &[Fence]),
    rule(Op::Crash, Running, Crashed, &[]),
    rule(Op::Kill, Running, Absent, &[Fence]),
    rule(Op::Kill, Paused, Absent, &[Fence]),
    rule(Op::Kill, PausedDiskOnly, Absent, &[Fence]),
    rule(Op::Kill, Crashed, Absent, &[Fence]),
    rule(Op::Kill, InStore, Absent, &[Claim]),
];

/// Whether `op` may act on `rec` as it is: the first rule that allows it (the caller
/// makes its checks next), or the error a client gets for it.
pub fn permit(op: Op, rec: &Record) -> Result<&'static Rule> {
    let phase = Phase::of(rec);
    if let Some(r) = RULES.iter().find(|r| r.op == op && r.from == phase) {
        return Ok(r);
    }
    let id = &rec.id;
    Err(match (op, phase) {
        (_, Crashed) => Error::Crashed {
            id: id.clone(),
            why: rec.crash.clone().unwrap_or_else(|| "unknown".into()),
        },
        (Op::Pause | Op::PauseDiskOnly, _) => {
            Error::Conflict(format!("sandbox {id} is already paused"))
        }
        (Op::Resume | Op::Reboot, _) => Error::Conflict(format!("sandbox {id} is already running")),
        (Op::Fork, _) => Error::Conflict(format!(
            "sandbox {id} is paused: connect to it before forking"
        )),
        (Op::Snapshot, PausedDiskOnly) => Error::Conflict(format!(
            "sandbox {id} was paused without its memory: connect to it (it boots from its \
             disk) before taking a snapshot"
        )),
        (op, phase) => Error::Conflict(format!(
            "sandbox {id} is {}: {} is not possible",
            phase.name(),
            op.name()
        )),
    })
}

/// [`RULES`] as the Markdown table `docs/lifecycle.md` shows.
pub fn table_markdown() -> String {
    let mut s = String::from("| operation | from | to | checks first |\n|---|---|---|---|\n");
    for r in RULES {
        let checks: Vec<&str> = r.checks.iter().map(|c| c.name()).collect();
        s.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            r.op.name(),
            r.from.name(),
            r.to.name(),
            if checks.is_empty() {
                "-".to_string()
            } else {
                checks.join(", ")
            }
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(state: State, memory_dropped: bool) -> Record {
        let mut r = crate::registry::tests::record("isb0000000000000000000a", state, 0);
        r.memory_dropped = memory_dropped;
        r.crash = Some("its process ended".into());
        r
    }

    #[test]
    fn the_docs_draw_the_table_the_code_enforces() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/lifecycle.md");
        let doc = std::fs::read_to_string(path).expect("docs/lifecycle.md");
        let table = table_markdown();
        assert!(
            doc.contains(&table),
            "docs/lifecycle.md does not hold the lifecycle's table as sandbox/src/host/lifecycle.rs \
             has it; put this table in it:\n\n{table}"
        );
    }

    #[test]
    fn each_phase_moves_only_as_the_table_says() {
        let running = record(State::Running, false);
        let paused = record(State::Paused, false);
        let dropped = record(State::Paused, true);
        let crashed = record(State::Crashed, false);
        assert_eq!(permit(Op::Pause, &running).unwrap().to, Paused);
        assert_eq!(
            permit(Op::PauseDiskOnly, &running).unwrap().to,
            PausedDiskOnly
        );
        assert!(
            matches!(permit(Op::Pause, &paused), Err(Error::Conflict(m)) if m.contains("already paused"))
        );
        assert!(
            matches!(permit(Op::Pause, &dropped), Err(Error::Conflict(m)) if m.contains("already paused"))
        );
        assert!(
            matches!(permit(Op::Resume, &running), Err(Error::Conflict(m)) if m.contains("already running"))
        );
        assert_eq!(permit(Op::Resume, &dropped).unwrap().checks, &[Fence, Room]);
        assert!(permit(Op::Resume, &paused).unwrap().checks.contains(&Claim));
        assert!(
            matches!(permit(Op::Fork, &paused), Err(Error::Conflict(m)) if m.contains("connect to it before forking"))
        );
        assert!(
            matches!(permit(Op::Snapshot, &dropped), Err(Error::Conflict(m)) if m.contains("without its memory"))
        );
        assert_eq!(permit(Op::Snapshot, &paused).unwrap().to, Paused);
        for op in [
            Op::Pause,
            Op::Resume,
            Op::Fork,
            Op::Snapshot,
            Op::Extend,
            Op::Connect,
        ] {
            assert!(
                matches!(permit(op, &crashed), Err(Error::Crashed { why, .. }) if why == "its process ended"),
                "{op:?} on a crashed sandbox"
            );
        }
        assert_eq!(permit(Op::Kill, &crashed).unwrap().to, Absent);
    }

    #[test]
    fn every_phase_can_be_left_and_every_rule_is_reachable() {
        // Each phase a sandbox can be in has a way out (a kill at least), and no two rules
        // say different things for one operation on one phase (but the timeout's two ends,
        // chosen by auto-pause).
        for phase in [Running, Paused, PausedDiskOnly, Crashed, InStore] {
            assert!(
                RULES.iter().any(|r| r.from == phase && r.op == Op::Kill),
                "{phase:?} cannot be killed"
            );
        }
        for (i, a) in RULES.iter().enumerate() {
            for b in &RULES[i + 1..] {
                if a.op == b.op && a.from == b.from {
                    assert_eq!((a.op, a.from), (Op::TimeOut, Running), "{a:?} and {b:?}");
                }
            }
        }
    }
}

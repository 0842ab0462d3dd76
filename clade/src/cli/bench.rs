//! `clade bench`: latency measurements on the native test guest. The scenarios live in the
//! `clade-bench` crate; this module defines the options, runs one and prints its report.

use std::fmt::Display;
use std::path::{Path, PathBuf};

use clade_bench::report::{self, Report, Reported, Section};

use clade_bench::{
    ForkParams, Guest, Machine, RestoreParams, SnapshotParams, StorePauseParams,
    StoreRestoreParams, StoreTarget,
};
use clap::Subcommand;

use super::MachineArgs;

/// The native test guest (tests/native-guest), built by build.rs: the default `--guest`.
static NATIVE_GUEST: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/native-guest"));

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Boot time: from the start of VM creation to the guest's first serial output.
    Boot {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// Number of boots.
        #[arg(short, long, default_value_t = 20)]
        n: usize,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// Agent round trip: `vmm::agent::Client::ping` over virtio-vsock to the native test
    /// guest's agent-protocol responder (its `vsock` step), through the VM's Unix socket.
    Ping {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// Number of measured pings.
        #[arg(short, long, default_value_t = 1000)]
        n: usize,
        /// Pings before measuring (connection warm-up), not counted.
        #[arg(long, default_value_t = 100)]
        warmup: usize,
        /// Wait this long before each measured ping. Above the host's halt-polling window
        /// (KVM's halt_poll_ns, 200 us by default) the vCPU's thread sleeps in between,
        /// and each round trip includes its wake-up by the device's interrupt (what the
        /// first request to an idle sandbox pays).
        #[arg(long, value_name = "US", default_value_t = 0)]
        gap_us: u64,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// Restore latency: from `PreparedSnapshot::restore` until the native guest (snapshotted while its
    /// `vsock` step waits for a connection) answered an agent ping over vsock; p50/p99 over
    /// -n restores, page faults, bytes read, and the `copy` backend as the baseline.
    #[command(alias = "resume")]
    Restore {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// Memory backend measured: uffd, file or copy.
        #[arg(long, default_value = "uffd", value_parser = clap::value_parser!(vmm::MemoryBackend))]
        backend: vmm::MemoryBackend,
        /// Number of measured restores.
        #[arg(short, long, default_value_t = 200)]
        n: usize,
        /// Pre-built VM shells kept ready, with each restore's vsock socket bound ahead as a
        /// service's standby binds it (0: build a shell and bind the socket at each restore).
        #[arg(long, default_value_t = 2)]
        pool: usize,
        /// With the pool (uffd): each shell is prepared for the restore before it is timed,
        /// as a standby VM process prepares its shell for the snapshot it opened ahead
        /// (memory mapped and registered, the working set installed:
        /// `PreparedSnapshot::prefill_shell`).
        #[arg(long)]
        prefill: bool,
        /// Percentage of the guest memory above 64 MiB that the guest fills (memfill step)
        /// before the snapshot: memory a sandbox has touched but does not need to answer.
        #[arg(long, default_value_t = 50)]
        fill: u32,
        /// Restores of the copy baseline (default: -n; 0: none).
        #[arg(long)]
        baseline_n: Option<usize>,
        /// Do not pin the VMM's threads to CPU 0 and the vCPUs to the other CPUs (the
        /// native guest busy-polls: unpinned, a VMM thread may wait behind it).
        #[arg(long)]
        no_pin: bool,
        /// The VM has a network device, its TAP in a network namespace made beforehand
        /// (as `clade serve`'s pool does); the same restores without one are measured in
        /// the same run, and making a namespace is timed apart. Root only.
        #[arg(long)]
        net: bool,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Measure restores from an object store instead: the snapshot (with its working
        /// set) published, then round by round a local restore, a remote one with a cold
        /// cache and one with a warm cache, each from opening to the first ping. `s3`:
        /// start the S3 server the tests use (s3s-fs on loopback); or a store URL.
        #[arg(long, value_name = "s3|URL")]
        store: Option<String>,
        /// With --store: chunk size of the published memory data (KiB).
        #[arg(long, value_name = "KIB", default_value_t = 128, requires = "store")]
        chunk_kib: u64,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// Pause until durable: snapshot and publish to an object store (--store), per MiB,
    /// against uploading as many bytes straight to the same store in the same run.
    Pause {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// `s3`: start the S3 server the tests use (s3s-fs on loopback); or a store URL.
        #[arg(long, value_name = "s3|URL", default_value = "s3")]
        store: String,
        /// Rounds.
        #[arg(short, long, default_value_t = 5)]
        n: usize,
        /// Percentage of the guest memory above 64 MiB that the guest fills.
        #[arg(long, default_value_t = 100)]
        fill: u32,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// Snapshot cost: full snapshots, then -n diff snapshots of a guest that keeps
    /// rewriting --dirty percent of its memory; how long the vCPUs were paused, and in all.
    Snapshot {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// Number of diff snapshots (each on top of the previous one).
        #[arg(short, long, default_value_t = 30)]
        n: usize,
        /// Number of full snapshots.
        #[arg(long, default_value_t = 3)]
        full_n: usize,
        /// Percentage of guest memory the guest rewrites between snapshots.
        #[arg(long, default_value_t = 1.0)]
        dirty: f64,
        /// Percentage of the memory above 64 MiB filled before the first snapshot.
        #[arg(long, default_value_t = 50)]
        fill: u32,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// Fork: a running native guest (its `vsock` step) into -n children; parent pause,
    /// each child's first answered ping, all of them, PSS per idle child, and a fork by
    /// full memory copy as baseline.
    Fork {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// Number of children.
        #[arg(short, long, default_value_t = 10)]
        n: usize,
        /// Percentage of the memory above 64 MiB the guest fills before the fork.
        #[arg(long, default_value_t = 50)]
        fill: u32,
        /// The parent has a network device and each child its own TAP, each in a network
        /// namespace made beforehand; the same fork without networking is measured in the
        /// same run first. Root only.
        #[arg(long)]
        net: bool,
        /// The parent is a restore of a snapshot of the booted guest, with this memory
        /// backend (uffd, file or copy), instead of the booted guest itself.
        #[arg(long, value_name = "BACKEND", value_parser = clap::value_parser!(vmm::MemoryBackend))]
        restored: Option<vmm::MemoryBackend>,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// Fork as `clade fork` users see it: a `clade run` process asked through its API to
    /// fork into -n child processes, until the request is answered and until every child's
    /// agent answered a ping; children started at the fork (baseline) against children
    /// waiting with their shells built (`clade run --fork-spares N`), alternated.
    ForkProcesses {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// Children per fork.
        #[arg(short, long, default_value_t = 3)]
        n: usize,
        /// Forks per parent.
        #[arg(long, default_value_t = 20)]
        rounds: usize,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// The sandbox host over HTTP: `clade serve` (started by the benchmark, this executable)
    /// with a template of the native test guest; create (POST /v2/sandboxes until the new
    /// sandbox's agent answered a ping) and wake (connect of a paused sandbox until its
    /// agent answered), p50/p99, with 1 and with --background paused sandboxes on the host;
    /// with --running, many sandboxes running at once; with --sustain, sustained creates.
    Serve {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// Measured creates and wakes per run.
        #[arg(short, long, default_value_t = 50)]
        n: usize,
        /// Paused sandboxes on the host in the second run (0: one run only).
        #[arg(long, default_value_t = 100)]
        background: usize,
        /// Also run N sandboxes at once on a service of their own, kept running: each
        /// checked to answer (GET /health through the service), the processes and host
        /// memory per running sandbox counted (the standby pool left out), and create p50
        /// with N running against one running, same run.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        running: Option<u64>,
        /// Also create sandboxes for SECONDS on a service of their own, as fast as the host
        /// sustains (--clients concurrent clients, each creating one, waiting for its agent
        /// and killing it): creates per second, p50/p99, failures.
        #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
        sustain: Option<u64>,
        /// Concurrent clients of --sustain and of the creates that fill --running.
        #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=256))]
        clients: u64,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// A cluster (started by the benchmark: PostgreSQL as user postgres, the tests' S3
    /// server, two `clade serve --cluster` nodes on loopback): the data plane's round trip,
    /// create and wake, asked of the owner node and of a gateway node that forwards to it,
    /// interleaved; p50/p99 and what the hop adds. Needs root and postgresql-15.
    Cluster {
        /// The native test guest ELF (default: the one built into clade; see tests/native-guest).
        #[arg(long, env = "CLADE_NATIVE_GUEST", value_name = "FILE")]
        guest: Option<PathBuf>,
        /// Samples per case and way.
        #[arg(short, long, default_value_t = 50)]
        n: usize,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The set of scenarios the README's main job runs, one after the other, with its
    /// parameters (listed by `clade bench all --list`); a scenario that fails is reported
    /// and the others still run (exit status 1).
    All {
        /// Print the scenarios' command lines and exit.
        #[arg(long)]
        list: bool,
        /// Leave out the object-store scenarios (they start the test S3 server; `cluster`
        /// also PostgreSQL, and needs root).
        #[arg(long)]
        no_store: bool,
        /// Print one JSON object per scenario instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Compare two reports (`--report` directories): every figure both have, with the
    /// ratio B/A, and both runs' distributions drawn on the same axes into --out.
    Compare {
        /// The first report's directory (A).
        a: PathBuf,
        /// The second report's directory (B).
        b: PathBuf,
        /// Where the comparison's plots and index.html go.
        #[arg(long, default_value = "bench-compare")]
        out: PathBuf,
        /// Print the figures as one JSON array instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// What `clade bench all` runs: the README's main job's latencies (scripts/demo.sh).
const ALL: &[&str] = &[
    "boot -n 20",
    "ping",
    "snapshot -n 20",
    "restore --backend uffd -n 100",
    "fork -n 10",
    "fork-processes -n 3 --rounds 20",
    "serve -n 30 --background 100",
    "restore --store s3 -n 20",
    "pause --store s3 -n 3",
    "cluster -n 30",
];

/// One scenario's command line, parsed as `clade bench` would.
#[derive(Debug, clap::Parser)]
struct OneScenario {
    #[command(subcommand)]
    cmd: BenchCommand,
}

/// Runs `cmd`; prints its text or JSON and, with `report`, adds it to the report in that
/// directory (a new report, or the sections of the scenarios run before by `all`).
pub fn bench(cmd: BenchCommand, report: Option<PathBuf>) -> anyhow::Result<u8> {
    match cmd {
        BenchCommand::All {
            list,
            no_store,
            json,
        } => return all(list, no_store, json, report),
        BenchCommand::Compare { a, b, out, json } => return compare(&a, &b, &out, json),
        cmd => {
            let (scenario, ran) = run_one(cmd)?;
            print(ran.json, &ran.json_text, &ran.section.text);
            if let Some(dir) = report {
                let mut r = Report::new();
                r.push(ran.section);
                let index = r.write(&dir)?;
                eprintln!("report ({scenario}): {}", index.display());
            }
        }
    }
    Ok(0)
}

/// A scenario's results: its section of a report, its JSON, whether JSON was asked for.
struct Ran {
    section: Section,
    json_text: String,
    json: bool,
}

impl Ran {
    fn new<R: Reported + Display>(scenario: &str, json: bool, json_text: String, r: R) -> Ran {
        Ran {
            section: r.section(scenario),
            json_text,
            json,
        }
    }
}

/// Runs one scenario; returns its name and results.
fn run_one(cmd: BenchCommand) -> anyhow::Result<(&'static str, Ran)> {
    Ok(match cmd {
        BenchCommand::Boot {
            guest,
            n,
            json,
            machine,
        } => {
            let s = clade_bench::boot(&load(guest)?, &machine.into(), n)?;
            ("boot", Ran::new("boot", json, s.to_json(), s))
        }
        BenchCommand::Ping {
            guest,
            n,
            warmup,
            gap_us,
            json,
            machine,
        } => {
            let gap = std::time::Duration::from_micros(gap_us);
            let s = clade_bench::ping(&load(guest)?, &machine.into(), n, warmup, gap)?;
            ("ping", Ran::new("ping", json, s.to_json(), s))
        }
        BenchCommand::Restore {
            guest,
            backend,
            n,
            pool,
            prefill,
            fill,
            baseline_n,
            no_pin,
            net,
            json,
            store,
            chunk_kib,
            machine,
        } => {
            if let Some(target) = store {
                let params = StoreRestoreParams {
                    target: StoreTarget::parse(&target),
                    n,
                    fill_pct: fill,
                    chunk_size: chunk_kib.saturating_mul(1024),
                };
                let r = clade_bench::restore_store(&load(guest)?, &machine.into(), &params)?;
                return Ok((
                    "restore-store",
                    Ran::new("restore-store", json, r.to_json(), r),
                ));
            }
            let params = RestoreParams {
                backend,
                n,
                pool,
                prefill,
                fill_pct: fill,
                baseline_n,
                pin: !no_pin,
                net,
            };
            let r = clade_bench::restore(&load(guest)?, &machine.into(), &params)?;
            ("restore", Ran::new("restore", json, r.to_json(), r))
        }
        BenchCommand::Pause {
            guest,
            store,
            n,
            fill,
            json,
            machine,
        } => {
            let params = StorePauseParams {
                target: StoreTarget::parse(&store),
                n,
                fill_pct: fill,
            };
            let r = clade_bench::pause_store(&load(guest)?, &machine.into(), &params)?;
            ("pause-store", Ran::new("pause-store", json, r.to_json(), r))
        }
        BenchCommand::Snapshot {
            guest,
            n,
            full_n,
            dirty,
            fill,
            json,
            machine,
        } => {
            let params = SnapshotParams {
                n,
                full_n,
                dirty_pct: dirty,
                fill_pct: fill,
            };
            let r = clade_bench::snapshot(&load(guest)?, &machine.into(), &params)?;
            ("snapshot", Ran::new("snapshot", json, r.to_json(), r))
        }
        BenchCommand::Serve {
            guest,
            n,
            background,
            running,
            sustain,
            clients,
            json,
        } => {
            let mut runs = vec![0];
            if background > 0 {
                runs.push(background);
            }
            let params = clade_bench::ServeParams {
                clade: std::env::current_exe()?,
                n,
                background: runs,
                running: running.map(usize::try_from).transpose()?,
                sustain: sustain.map(|s| s as f64),
                clients: usize::try_from(clients)?,
            };
            let r = clade_bench::serve(&load(guest)?, &params)?;
            ("serve", Ran::new("serve", json, r.to_json(), r))
        }
        BenchCommand::Cluster { guest, n, json } => {
            let params = clade_bench::ClusterParams {
                clade: std::env::current_exe()?,
                n,
            };
            let r = clade_bench::cluster(&load(guest)?, &params)?;
            ("cluster", Ran::new("cluster", json, r.to_json(), r))
        }
        BenchCommand::Fork {
            guest,
            n,
            fill,
            net,
            restored,
            json,
            machine,
        } => {
            let params = ForkParams {
                n,
                fill_pct: fill,
                net,
                restored,
            };
            let r = clade_bench::fork(&load(guest)?, &machine.into(), &params)?;
            ("fork", Ran::new("fork", json, r.to_json(), r))
        }
        BenchCommand::ForkProcesses {
            guest,
            n,
            rounds,
            json,
            machine,
        } => {
            let params = clade_bench::ForkProcessesParams {
                clade: std::env::current_exe()?,
                n,
                rounds,
            };
            let r = clade_bench::fork_processes(&load(guest)?, &machine.into(), &params)?;
            (
                "fork-processes",
                Ran::new("fork-processes", json, r.to_json(), r),
            )
        }
        BenchCommand::All { .. } | BenchCommand::Compare { .. } => {
            anyhow::bail!("`all` and `compare` are not scenarios")
        }
    })
}

/// `clade bench all`: each scenario of [`ALL`] in turn; with `report`, the report is
/// rewritten after each one (a later failure keeps what ran).
fn all(list: bool, no_store: bool, json: bool, report: Option<PathBuf>) -> anyhow::Result<u8> {
    let lines = ALL
        .iter()
        .filter(|l| !(no_store && (l.contains("--store") || l.starts_with("cluster"))));
    if list {
        for l in lines {
            println!("clade bench {l}");
        }
        return Ok(0);
    }
    let mut r = Report::new();
    let mut failed = Vec::new();
    for line in lines {
        let mut argv = vec!["bench"];
        argv.extend(line.split_whitespace());
        if json {
            argv.push("--json");
        }
        let one = <OneScenario as clap::Parser>::try_parse_from(&argv)?;
        eprintln!("== clade bench {line}");
        match run_one(one.cmd) {
            Ok((_, ran)) => {
                print(ran.json, &ran.json_text, &ran.section.text);
                r.push(ran.section);
                if let Some(dir) = &report {
                    r.write(dir)?;
                }
            }
            Err(e) => {
                eprintln!("clade bench {line}: {e:#}");
                failed.push(*line);
            }
        }
    }
    if let Some(dir) = &report {
        eprintln!("report: {}", dir.join("index.html").display());
    }
    if failed.is_empty() {
        Ok(0)
    } else {
        eprintln!("failed: {}", failed.join("; "));
        Ok(1)
    }
}

/// `clade bench compare A B`.
fn compare(a: &Path, b: &Path, out: &Path, json: bool) -> anyhow::Result<u8> {
    let (ra, rb) = (Report::load(a)?, Report::load(b)?);
    let (ratios, index) = report::compare(&ra, &rb, out)?;
    if ratios.is_empty() {
        anyhow::bail!(
            "{} and {} have no figure in common (no scenario run in both)",
            a.display(),
            b.display()
        );
    }
    if json {
        println!("{}", serde_json::to_string(&ratios)?);
    } else {
        println!(
            "figure: A -> B (B/A)   [A = {}, B = {}]",
            a.display(),
            b.display()
        );
        for r in &ratios {
            println!("{}: {} -> {} (x{:.3})", r.figure, r.a, r.b, r.ratio());
        }
    }
    eprintln!("plots of both: {}", index.display());
    Ok(0)
}

/// The guest ELF at `path`, or the one built into this binary (kept in a memory file for
/// as long as the returned value lives).
fn load(path: Option<PathBuf>) -> clade_bench::Result<Guest> {
    match path {
        Some(p) => Guest::from_path(p),
        None => Guest::from_image(NATIVE_GUEST),
    }
}

fn print(json: bool, json_text: &str, text: &str) {
    if json {
        println!("{json_text}");
    } else {
        println!("{text}");
    }
}

impl From<MachineArgs> for Machine {
    fn from(m: MachineArgs) -> Machine {
        Machine {
            vcpus: m.vcpus,
            mem_mib: m.mem_mib,
            kvm_device: m.kvm_device,
        }
    }
}

//! `clade bench`: latency measurements on the native test guest. The scenarios live in the
//! `clade-bench` crate; this module defines the options, runs one and prints its report.

use std::fmt::Display;
use std::path::PathBuf;

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
    /// agent answered), p50/p99, with 1 and with --background paused sandboxes on the host.
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
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

pub fn bench(cmd: BenchCommand) -> anyhow::Result<u8> {
    match cmd {
        BenchCommand::Boot {
            guest,
            n,
            json,
            machine,
        } => {
            let s = clade_bench::boot(&load(guest)?, &machine.into(), n)?;
            print(json, s.to_json(), s);
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
            print(json, s.to_json(), s);
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
                print(json, r.to_json(), r);
                return Ok(0);
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
            print(json, r.to_json(), r);
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
            print(json, r.to_json(), r);
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
            print(json, r.to_json(), r);
        }
        BenchCommand::Serve {
            guest,
            n,
            background,
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
            };
            let r = clade_bench::serve(&load(guest)?, &params)?;
            print(json, r.to_json(), r);
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
            print(json, r.to_json(), r);
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
            print(json, r.to_json(), r);
        }
    }
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

fn print(json: bool, json_text: String, text: impl Display) {
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

//! `clade bench`: latency measurements on the native test guest.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clade_bench::Samples;
use clap::Subcommand;
use vmm::agent::{Client, Transport, AGENT_VSOCK_PORT};
use vmm::{SerialOutput, Vm, VmConfig, VmExit, VsockConfig};

use super::{bench_snapshot, MachineArgs};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Boot time: from the start of VM creation to the guest's first serial output.
    Boot {
        /// The native test guest ELF (see tests/native-guest).
        #[arg(
            long,
            env = "CLADE_NATIVE_GUEST",
            default_value = "target/native-guest/release/native-guest"
        )]
        guest: PathBuf,
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
        /// The native test guest ELF (see tests/native-guest).
        #[arg(
            long,
            env = "CLADE_NATIVE_GUEST",
            default_value = "target/native-guest/release/native-guest"
        )]
        guest: PathBuf,
        /// Number of measured pings.
        #[arg(short, long, default_value_t = 1000)]
        n: usize,
        /// Pings before measuring (connection warm-up), not counted.
        #[arg(long, default_value_t = 100)]
        warmup: usize,
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
        /// The native test guest ELF (see tests/native-guest).
        #[arg(
            long,
            env = "CLADE_NATIVE_GUEST",
            default_value = "target/native-guest/release/native-guest"
        )]
        guest: PathBuf,
        /// Memory backend measured: uffd, file or copy.
        #[arg(long, default_value = "uffd", value_parser = clap::value_parser!(vmm::MemoryBackend))]
        backend: vmm::MemoryBackend,
        /// Number of measured restores.
        #[arg(short, long, default_value_t = 200)]
        n: usize,
        /// Pre-built VM shells kept ready (0: build one per restore).
        #[arg(long, default_value_t = 2)]
        pool: usize,
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
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// Snapshot cost: full snapshots, then -n diff snapshots of a guest that keeps
    /// rewriting --dirty percent of its memory; how long the vCPUs were paused, and in all.
    Snapshot {
        /// The native test guest ELF (see tests/native-guest).
        #[arg(
            long,
            env = "CLADE_NATIVE_GUEST",
            default_value = "target/native-guest/release/native-guest"
        )]
        guest: PathBuf,
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
        /// The native test guest ELF (see tests/native-guest).
        #[arg(
            long,
            env = "CLADE_NATIVE_GUEST",
            default_value = "target/native-guest/release/native-guest"
        )]
        guest: PathBuf,
        /// Number of children.
        #[arg(short, long, default_value_t = 10)]
        n: usize,
        /// Percentage of the memory above 64 MiB the guest fills before the fork.
        #[arg(long, default_value_t = 50)]
        fill: u32,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        machine: MachineArgs,
    },
}

pub fn bench(cmd: BenchCommand) -> anyhow::Result<u8> {
    match cmd {
        BenchCommand::Boot {
            guest,
            n,
            json,
            machine,
        } => boot(guest, n, json, machine),
        BenchCommand::Ping {
            guest,
            n,
            warmup,
            json,
            machine,
        } => ping(guest, n, warmup, json, machine),
        BenchCommand::Restore {
            guest,
            backend,
            n,
            pool,
            fill,
            baseline_n,
            no_pin,
            json,
            machine,
        } => bench_snapshot::resume(
            guest, backend, n, json, machine, pool, fill, baseline_n, !no_pin,
        ),
        BenchCommand::Snapshot {
            guest,
            n,
            full_n,
            dirty,
            fill,
            json,
            machine,
        } => bench_snapshot::snapshot(guest, n, json, machine, dirty, fill, full_n),
        BenchCommand::Fork {
            guest,
            n,
            fill,
            json,
            machine,
        } => super::bench_fork::fork(guest, n, json, machine, fill),
    }
}

pub(super) fn check_guest(guest: &Path) -> anyhow::Result<()> {
    if !guest.exists() {
        bail!(
            "native test guest {} not found: build it with \
             `cd tests/native-guest && CARGO_TARGET_DIR=../../target/native-guest cargo build --release`",
            guest.display()
        );
    }
    Ok(())
}

fn boot(guest: PathBuf, n: usize, json: bool, machine: MachineArgs) -> anyhow::Result<u8> {
    check_guest(&guest)?;
    let mut samples = Samples::new();
    for i in 0..n {
        let config = VmConfig {
            vcpus: machine.vcpus,
            mem_mib: machine.mem_mib,
            kernel: guest.clone(),
            initrd: None,
            cmdline: "steps=hello".into(),
            serial: SerialOutput::Memory,
            test_device: true,
            kvm_device: machine.kvm_device.clone(),
            vsock: None,
            disk: None,
        };
        let mut vm = vmm::boot(config)?;
        vm.start()?;
        let status = vm
            .wait_timeout(Duration::from_secs(10))?
            .with_context(|| format!("boot {i}: guest did not finish within 10 s"))?;
        if status != VmExit::TestExit(0) {
            bail!("boot {i}: guest ended with '{status}'");
        }
        let t = vm
            .time_to_first_output()
            .with_context(|| format!("boot {i}: guest wrote nothing"))?;
        samples.push(t);
    }
    let summary = samples.summary("boot_to_first_output");
    if json {
        println!("{}", summary.json());
    } else {
        println!("{}", summary.line());
    }
    Ok(0)
}

/// The guest's last line of serial output, quoted, for one-line error messages.
fn last_serial_line(vm: &Vm) -> String {
    let out = vm.serial_output().unwrap_or_default();
    let text = String::from_utf8_lossy(&out);
    format!("{:?}", text.trim_end().lines().last().unwrap_or(""))
}

fn ping(
    guest: PathBuf,
    n: usize,
    warmup: usize,
    json: bool,
    machine: MachineArgs,
) -> anyhow::Result<u8> {
    check_guest(&guest)?;
    if n == 0 {
        bail!("--n must be at least 1");
    }
    // Removed by the VM when it is dropped.
    let sock = std::env::temp_dir().join(format!("clade-bench-ping-{}.sock", std::process::id()));
    let config = VmConfig {
        vcpus: machine.vcpus,
        mem_mib: machine.mem_mib,
        kernel: guest,
        initrd: None,
        cmdline: "steps=vsock".into(),
        serial: SerialOutput::Memory,
        test_device: true,
        kvm_device: machine.kvm_device,
        vsock: Some(VsockConfig {
            uds_path: sock.clone(),
            guest_cid: 3,
        }),
        disk: None,
    };
    let mut vm = vmm::boot(config)?;
    vm.start()?;
    // The client blocks without a timeout; it runs on a thread of its own so that a stuck
    // device or guest ends the benchmark with an error instead of hanging it.
    let done = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let progress = Arc::clone(&done);
    let sock_path = sock.clone();
    std::thread::spawn(move || {
        let _ = tx.send(measure(&sock_path, warmup, n, &progress));
    });
    let mut seen = 0;
    let mut since = Instant::now();
    let samples = loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(samples)) => break samples,
            Ok(Err(e)) => {
                return Err(e.context(format!("guest's last output: {}", last_serial_line(&vm))))
            }
            Err(RecvTimeoutError::Disconnected) => bail!("the client thread panicked"),
            Err(RecvTimeoutError::Timeout) => {
                let now = done.load(Ordering::Relaxed);
                if now != seen {
                    seen = now;
                    since = Instant::now();
                } else if since.elapsed() > STALL {
                    bail!(
                        "no answer from the guest for {STALL:?} after {now} pings \
                         (guest's last output: {})",
                        last_serial_line(&vm)
                    );
                }
            }
        }
    };
    // The client closed the connection, which ends the guest's step and the guest.
    let status = vm.wait_timeout(Duration::from_secs(10))?.with_context(|| {
        format!(
            "guest still running after the host closed (last output: {})",
            last_serial_line(&vm)
        )
    })?;
    if status != VmExit::TestExit(0) {
        bail!(
            "guest ended with '{status}' (last output: {})",
            last_serial_line(&vm)
        );
    }
    // The guest's own count must match what was measured.
    let out = String::from_utf8_lossy(&vm.serial_output().unwrap_or_default()).into_owned();
    let expect = format!(" {} pings,", warmup + n);
    if !out.contains(&expect) {
        bail!(
            "the guest did not report{expect} its output ends with {}",
            last_serial_line(&vm)
        );
    }
    let summary = samples.summary("agent_ping_rtt");
    if json {
        println!("{}", summary.json());
    } else {
        println!("{}", summary.line());
    }
    Ok(0)
}

/// Longest the ping benchmark waits for any progress (connecting included: it retries for
/// 10 s, each try waiting up to 10 s for the guest).
const STALL: Duration = Duration::from_secs(25);

/// Connects to the guest's agent port through the VM's vsock socket, pings `warmup + n`
/// times and returns the round trips of the last `n`. Closes the connection when done.
fn measure(sock: &Path, warmup: usize, n: usize, done: &AtomicUsize) -> anyhow::Result<Samples> {
    let transport = Transport::Vsock {
        port: AGENT_VSOCK_PORT,
    };
    let client = Client::connect_timeout(sock, transport, Duration::from_secs(10))
        .context("connect to the guest's agent port")?;
    let mut samples = Samples::new();
    for i in 0..warmup + n {
        let t = Instant::now();
        client.ping().with_context(|| format!("ping {i}"))?;
        if i >= warmup {
            samples.push(t.elapsed());
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(samples)
}

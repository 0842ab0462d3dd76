//! Command-line definitions and dispatch.

mod bench;
mod cluster;
mod cp;
mod disk;
mod exec;
mod fork;
mod jail;
mod ownnet;
mod progress;
mod run;
mod serve;
mod snapshot;
mod store;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Clade: KVM sandboxes that persist, resume and fork.
#[derive(Debug, Parser)]
#[command(name = "clade", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a VM and wait until it ends.
    ///
    /// Exit status: 0 when the guest powers off, 2 when it resets (reboot or panic: Clade
    /// does not reboot), 1 on a crash or error, the test guest's result code with
    /// --test-device, 128+signal when stopped by SIGINT/SIGTERM.
    Run(run::RunArgs),
    /// Measure latencies on the native test guest (prints p50/p99; --json for JSON).
    Bench {
        /// Run the benchmark under the VMM's system-call filter, as `clade run` runs
        /// (installed on every thread of this process before the benchmark starts).
        #[arg(long, global = true)]
        seccomp: bool,
        /// Also write an HTML report with plots (SVG and PNG) and the JSON, every sample
        /// included, into this directory (`clade bench compare` reads two of them).
        #[arg(long, global = true, value_name = "DIR")]
        report: Option<std::path::PathBuf>,
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
    /// Run a command in a VM through its agent, streaming output and forwarding stdin.
    ///
    /// SOCKET is the VM's vsock Unix socket (`clade run --vsock PATH`; clade sends
    /// `CONNECT 52`) or the socket of `clade-agent --listen-unix` (detected, or --direct).
    /// Exit status: the command's, or 128+signal if a signal killed it; 1 on errors.
    Exec(exec::ExecArgs),
    /// Copy a file between the host and a VM: one side is SOCKET:GUEST_PATH.
    Cp(cp::CpArgs),
    /// Check that a VM's agent answers (version, uptime, round trip).
    Ping(exec::PingArgs),
    /// Ask a VM's agent to sync its filesystems and power the VM off.
    Poweroff(exec::PowerOffArgs),
    /// Layered disk images: create, info, flatten, freeze (see disk/FORMAT.md).
    Disk {
        #[command(subcommand)]
        which: disk::DiskCommand,
    },
    /// Snapshot a running VM through its API socket (`run --api-sock`): full, or --diff.
    Snapshot(snapshot::SnapshotArgs),
    /// Start a VM from a snapshot and run it like `clade run` (same exit statuses).
    #[command(alias = "resume")]
    Restore(snapshot::RestoreArgs),
    /// Fork a running VM (through its API socket) into N child VM processes.
    ///
    /// Each child is its own `clade` process with its own API socket and vsock socket
    /// (printed one child a line: API socket, vsock socket; --json for JSON), sharing the
    /// parent's memory copy-on-write. Children outlive the parent; stop them through their
    /// API (`shutdown`) or a signal.
    Fork(fork::ForkArgs),
    /// The sandbox host: an E2B-compatible control API (HTTP) over Clade sandboxes.
    ///
    /// Every sandbox is its own VM process restored from a template (`clade template
    /// build`); the registry (SQLite) lives in --state-dir, so a restarted `serve` finds
    /// running sandboxes again and paused ones stay resumable. Point the e2b SDK at it with
    /// E2B_API_URL=http://ADDR and E2B_API_KEY=KEY. Endpoints and differences from E2B:
    /// docs/e2b-compat.md.
    Serve(serve::ServeArgs),
    /// The nodes of a cluster (`clade serve --cluster`): list them, drain one.
    Node {
        #[command(subcommand)]
        which: cluster::NodeCommand,
    },
    /// Templates for `clade serve`: build (boot, setup commands, snapshot), ls, rm.
    Template {
        #[command(subcommand)]
        which: serve::TemplateCommand,
    },
    /// Snapshots in object storage: publish, list, and the fetcher that fills a host's
    /// chunk cache (`clade restore --store URL ID` resumes a published snapshot on any
    /// host; see snapshot/FORMAT.md).
    Store {
        #[command(subcommand)]
        which: store::StoreCommand,
    },
    /// Internal: one child of `clade fork` (started by the parent VM process).
    #[command(hide = true)]
    ForkChild(fork::ForkChildArgs),
}

/// Options describing the machine, shared by `run` and the benchmarks.
#[derive(Debug, Args, Clone)]
pub struct MachineArgs {
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
    /// Guest memory: MiB, or with a suffix (512M, 4G).
    #[arg(long = "mem", visible_alias = "mem-mib", default_value = "256", value_parser = parse_mem_mib)]
    mem_mib: u64,
    /// KVM device node.
    #[arg(long, default_value = "/dev/kvm")]
    kvm_device: PathBuf,
}

/// A secret kept in a file: its first line, trimmed.
fn secret_file(f: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    Ok(std::fs::read_to_string(f)
        .with_context(|| format!("reading {}", f.display()))?
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_string())
}

/// Parses "256", "256M", "256MiB", "4G" into MiB.
fn parse_mem_mib(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.to_ascii_uppercase() {
        u if u.ends_with("GIB") || u.ends_with('G') => {
            (t.trim_end_matches(|c: char| c.is_ascii_alphabetic()), 1024)
        }
        u if u.ends_with("MIB") || u.ends_with('M') => {
            (t.trim_end_matches(|c: char| c.is_ascii_alphabetic()), 1)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("'{s}' is not a memory size (examples: 256, 512M, 4G)"))
}

/// Runs the parsed command; returns the process exit code.
pub fn dispatch(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Command::Run(args) => run::run(args),
        Command::Bench {
            seccomp,
            report,
            which,
        } => {
            if seccomp {
                vmm::seccomp::install()?;
            }
            bench::bench(which, report)
        }
        Command::Exec(args) => exec::exec(args),
        Command::Cp(args) => cp::cp(args),
        Command::Ping(args) => exec::ping(args),
        Command::Poweroff(args) => exec::power_off(args),
        Command::Disk { which } => disk::disk(which),
        Command::Snapshot(args) => snapshot::snapshot(args),
        Command::Restore(args) => {
            // A VM process: guest memory it cannot serve ends it at once, with its error.
            vmm::end_process_on_failure();
            snapshot::restore(args)
        }
        Command::Fork(args) => fork::fork(args),
        Command::ForkChild(args) => fork::fork_child(args),
        Command::Serve(args) => serve::serve_cmd(args),
        Command::Node { which } => cluster::node(which),
        Command::Template { which } => serve::template(which),
        Command::Store { which } => store::store(which),
    }
}

/// Clade's own directory for what it keeps without a service (converted images, the
/// installed guest kernel): `$CLADE_HOME`, else `$XDG_DATA_HOME/clade`, else
/// `~/.local/share/clade`.
pub(crate) fn clade_home() -> anyhow::Result<PathBuf> {
    if let Some(h) = std::env::var_os("CLADE_HOME") {
        return Ok(PathBuf::from(h));
    }
    if let Some(x) = std::env::var_os("XDG_DATA_HOME") {
        return Ok(PathBuf::from(x).join("clade"));
    }
    match std::env::var_os("HOME") {
        Some(h) => Ok(PathBuf::from(h).join(".local/share/clade")),
        None => anyhow::bail!("no CLADE_HOME or HOME to keep Clade's files in"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes_parse() {
        assert_eq!(parse_mem_mib("256"), Ok(256));
        assert_eq!(parse_mem_mib("512M"), Ok(512));
        assert_eq!(parse_mem_mib("4G"), Ok(4096));
        assert_eq!(parse_mem_mib("1GiB"), Ok(1024));
        assert!(parse_mem_mib("lots").is_err());
        assert!(parse_mem_mib("99999999999999999G").is_err());
    }
}

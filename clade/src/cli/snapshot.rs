//! `clade snapshot` (through a running VM's API socket) and `clade restore`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use vmm::api::{ApiClient, ApiServer, Request};
use vmm::{MemoryBackend, NetConfig, RestoreOptions, SerialOutput};

use super::jail::JailArgs;
use super::run::{check_jailed_net, own_vm, owner_options, parse_net};

#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// The VM's API socket (`clade run --api-sock` / `clade restore --api-sock`).
    api_sock: PathBuf,
    /// Directory to write the snapshot into (created if needed).
    dir: PathBuf,
    /// Only the pages written since the VM's last snapshot (or the snapshot it was restored
    /// from), which must stay where it is.
    #[arg(long)]
    diff: bool,
    /// Print the VM's answer as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn snapshot(args: SnapshotArgs) -> anyhow::Result<u8> {
    let dir = std::path::absolute(&args.dir)
        .with_context(|| format!("{}: cannot make the path absolute", args.dir.display()))?;
    let mut client = ApiClient::connect(&args.api_sock)
        .with_context(|| format!("API socket {}", args.api_sock.display()))?;
    let r = client.call(&Request::Snapshot {
        dir,
        kind: if args.diff { "diff" } else { "full" }.into(),
    })?;
    if !r.ok {
        bail!(
            "snapshot failed: {}",
            r.error.unwrap_or_else(|| "no reason given".into())
        );
    }
    if args.json {
        println!("{}", serde_json::Value::Object(r.fields));
    } else {
        let f = |k: &str| r.fields.get(k).cloned().unwrap_or_default();
        println!(
            "{} snapshot {} in {}: {} pages written, VM paused {} us, {} us in all",
            f("kind").as_str().unwrap_or("?"),
            f("id").as_str().unwrap_or("?"),
            f("dir").as_str().unwrap_or("?"),
            f("pages_written"),
            f("pause_us"),
            f("total_us")
        );
    }
    Ok(0)
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// The snapshot directory (`clade snapshot`).
    dir: PathBuf,
    /// How guest memory is restored: uffd (on demand, with working-set prefetch), file
    /// (copy-on-write mapping of the memory file) or copy (read it all first).
    #[arg(long, default_value = "uffd", value_parser = clap::value_parser!(MemoryBackend))]
    backend: MemoryBackend,
    /// Serve the VM's control API on this Unix socket.
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// Snapshot and fork requests through the API may only name directories under DIR.
    #[arg(long, value_name = "DIR", requires = "api_sock")]
    files_root: Option<PathBuf>,
    /// Do not filter the VMM's system calls (seccomp is on by default: a call outside the
    /// VMM's allow-list ends the process with a line naming it).
    #[arg(long)]
    no_seccomp: bool,
    /// The vsock device's Unix socket (default: the snapshot's, which must be free).
    #[arg(long, value_name = "PATH")]
    vsock: Option<PathBuf>,
    /// Write the guest's serial console to this file instead of stdout.
    #[arg(long)]
    serial_file: Option<PathBuf>,
    /// Do not give the guest agent the current time and fresh entropy after the restore.
    #[arg(long)]
    no_agent_sync: bool,
    /// How long the agent sync may take (seconds; it is best effort).
    #[arg(long, default_value_t = 5.0)]
    agent_sync_timeout: f64,
    /// uffd: neither record nor prefetch a working set.
    #[arg(long)]
    no_working_set: bool,
    /// KVM device node.
    #[arg(long, default_value = "/dev/kvm")]
    kvm_device: PathBuf,
    /// A snapshot with a disk: create the VM's own overlay on the snapshot's frozen disk
    /// layer here (must not exist; default `<snapshot dir>/restore-<random>.cdsk`).
    #[arg(long, value_name = "PATH")]
    disk_overlay: Option<PathBuf>,
    /// A snapshot with a network device: the restored VM's TAP, as for `clade run --net`
    /// (`tap=NAME` or `fd=N`; a `mac=` must be the saved guest's).
    #[arg(long, value_name = "tap=NAME|fd=N[,mac=MAC]", value_parser = parse_net)]
    net: Option<NetConfig>,
    #[command(flatten)]
    jail: JailArgs,
}

pub fn restore(mut args: RestoreArgs) -> anyhow::Result<u8> {
    args.jail.absolute(
        [&mut args.dir]
            .into_iter()
            .chain(&mut args.api_sock)
            .chain(&mut args.files_root)
            .chain(&mut args.vsock)
            .chain(&mut args.serial_file)
            .chain(&mut args.disk_overlay),
    )?;
    if !(args.agent_sync_timeout.is_finite() && args.agent_sync_timeout > 0.0) {
        bail!("--agent-sync-timeout must be a positive number of seconds");
    }
    args.jail
        .require_files_root(args.api_sock.is_some(), args.files_root.is_some())?;
    check_jailed_net(args.jail.jailed(), args.net.as_ref())?;
    let jailed = args.jail.enter(&args.kvm_device, |p| {
        // The snapshot is read and checked here, before the jail, to know what it needs.
        let snap = vmm::PreparedSnapshot::open(&args.dir, vmm::CpuCheck::default())?;
        // Its directory takes the working set and, by default, the VM's disk overlay.
        p.write_dir(&args.dir)?;
        for dir in snap.chain_dirs() {
            p.read(dir)?;
        }
        let vsock = args
            .vsock
            .clone()
            .or_else(|| snap.machine().vsock.as_ref().map(|v| v.uds_path.clone()));
        for file in [
            &args.serial_file,
            &vsock,
            &args.api_sock,
            &args.disk_overlay,
        ]
        .into_iter()
        .flatten()
        {
            p.write_dir_of(file)?;
        }
        if let Some(root) = &args.files_root {
            p.write_dir(root)?;
        }
        if let Some(disk) = snap.disk() {
            p.disk(&disk.layer, false)?;
        }
        Ok(())
    })?;
    if let Some(code) = jailed {
        return Ok(code);
    }
    // The process filter before any VM thread exists, so each can narrow it to its kind.
    if !args.no_seccomp {
        vmm::seccomp::install()?;
    }
    let owner = owner_options(args.files_root, !args.no_seccomp)?;
    let api = args.api_sock.as_deref().map(ApiServer::bind).transpose()?;
    let options = RestoreOptions {
        serial: args
            .serial_file
            .map(SerialOutput::File)
            .unwrap_or(SerialOutput::Stdout),
        vsock_path: args.vsock,
        kvm_device: args.kvm_device,
        agent_sync: (!args.no_agent_sync).then(|| Duration::from_secs_f64(args.agent_sync_timeout)),
        working_set: !args.no_working_set,
        disk_overlay: args.disk_overlay,
        net: args.net,
        ..RestoreOptions::default()
    };
    let vm = vmm::restore(&args.dir, args.backend, options)?;
    if let Some(r) = vm.restore_report() {
        tracing::info!(
            "restored {} ({} backend) in {:?}: {:?}",
            args.dir.display(),
            r.backend,
            r.total,
            r.steps
        );
    }
    own_vm(vm, api, &owner)
}

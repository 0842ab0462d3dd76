//! `clade snapshot` (through a running VM's API socket) and `clade restore`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use vmm::api::{ApiClient, ApiListener, ApiServer, Request, RestoreRequest};
use vmm::host::StandbyEnd;
use vmm::{MemoryBackend, NetConfig, ShellSpec};

use super::jail::JailArgs;
use super::ownnet::{parse_net_arg, run_with_own_network, NetArg, OwnNetArgs};
use super::run::{check_jailed_net, own_vm, owner_options, parse_net};
use super::store::{default_cache_dir, open_published, FetcherChild, StoreArgs};

/// `--net` checked when parsed, kept as written: the restore request carries it as text.
fn parse_net_spec(spec: &str) -> Result<String, String> {
    parse_net(spec).map(|_| spec.to_string())
}

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
    #[arg(required_unless_present = "standby")]
    dir: Option<PathBuf>,
    /// Start as a standby process: confine the process, build a VM shell of --vcpus and
    /// --mem, serve --api-sock and wait for one `restore` request (the options below, as
    /// JSON: vmm::api::RestoreRequest), then run that VM as `clade restore DIR` would.
    #[arg(long, requires = "api_sock", conflicts_with_all = ["dir", "vsock", "serial_file", "disk_overlay", "no_agent_sync", "net", "working_set_to"])]
    standby: bool,
    /// Standby: the vCPUs of the VM shell (the snapshots it will take).
    #[arg(long, requires = "standby", default_value_t = 1)]
    vcpus: u32,
    /// Standby: the memory of the VM shell (MiB, or 512M, 4G).
    #[arg(long = "mem", requires = "standby", default_value = "256", value_parser = super::parse_mem_mib)]
    mem_mib: u64,
    /// Standby: open this snapshot directory ahead (checked, its working set read), the
    /// one the restore request will most likely name; a request for another, or for this
    /// one once its state file was replaced, opens it then.
    #[arg(long, value_name = "DIR", requires = "standby")]
    preload: Option<PathBuf>,
    /// How guest memory is restored: uffd (on demand, with working-set prefetch), file
    /// (copy-on-write mapping of the memory file) or copy (read it all first).
    #[arg(long, default_value = "uffd", value_parser = clap::value_parser!(MemoryBackend))]
    backend: MemoryBackend,
    /// Serve the VM's control API on this Unix socket.
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// Snapshot and fork requests through the API may only name directories under DIR
    /// (and a standby's restore request only files under it).
    #[arg(long, value_name = "DIR", requires = "api_sock")]
    files_root: Option<PathBuf>,
    /// Do not filter the VMM's system calls (seccomp is on by default: a call outside the
    /// VMM's allow-list ends the process with a line naming it).
    #[arg(long)]
    no_seccomp: bool,
    /// Keep N fork child processes started and waiting (see `clade run --fork-spares`).
    #[arg(long, value_name = "N", default_value_t = 0, requires = "api_sock",
          value_parser = clap::value_parser!(u16).range(0..=vmm::MAX_FORK_CHILDREN as i64))]
    fork_spares: u16,
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
    /// uffd, when the snapshot has no working set yet: write the one recorded here instead
    /// of into the snapshot's directory (one this VM may not write, e.g. jailed).
    #[arg(long, value_name = "PATH", conflicts_with = "no_working_set")]
    working_set_to: Option<PathBuf>,
    /// KVM device node.
    #[arg(long, default_value = "/dev/kvm")]
    kvm_device: PathBuf,
    /// A snapshot with a disk: create the VM's own overlay on the snapshot's frozen disk
    /// layer here (must not exist; default `<snapshot dir>/restore-<random>.cdsk`).
    #[arg(long, value_name = "PATH")]
    disk_overlay: Option<PathBuf>,
    /// A snapshot with a network device: the restored VM's TAP, as for `clade run --net`
    /// (`auto`, `tap=NAME` or `fd=N`; a `mac=` must be the saved guest's). `auto`: a new
    /// network of its own with the same inner addresses, so the guest needs no change.
    #[arg(long, value_name = "auto|tap=NAME[,netns=PATH]|fd=N[,mac=MAC]",
          value_parser = |s: &str| parse_net_arg(s, parse_net_spec))]
    net: Option<NetArg<String>>,
    #[command(flatten)]
    own_net: OwnNetArgs,
    #[command(flatten)]
    jail: JailArgs,
    /// Restore a snapshot published to this object store (the positional argument is
    /// then its id): its memory is fetched lazily, chunk by chunk, by a fetcher process
    /// into the local chunk cache (see `clade store`).
    #[command(flatten)]
    store: StoreArgs,
    /// With --store: the chunk cache's directory (default: $CLADE_CACHE_DIR,
    /// /var/cache/clade/store for root, ~/.cache/clade/store).
    #[arg(long, value_name = "DIR")]
    cache: Option<PathBuf>,
    /// With --store: use the fetcher serving this socket (`clade store fetcher`) rather
    /// than starting one.
    #[arg(long, value_name = "PATH")]
    fetcher: Option<PathBuf>,
    /// A local snapshot whose disk stands on layers read lazily from a store (a snapshot
    /// made on this host of a VM restored from one): the fetcher serving this socket
    /// fills them.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["fetcher", "store"])]
    layer_fetcher: Option<PathBuf>,
}

pub fn restore(mut args: RestoreArgs) -> anyhow::Result<u8> {
    if args.standby {
        return standby(args);
    }
    if args.store.store.is_some() || args.fetcher.is_some() {
        return restore_published(args);
    }
    args.jail.absolute(
        args.dir
            .iter_mut()
            .chain(&mut args.api_sock)
            .chain(&mut args.files_root)
            .chain(&mut args.vsock)
            .chain(&mut args.serial_file)
            .chain(&mut args.disk_overlay)
            .chain(&mut args.working_set_to),
    )?;
    let Some(dir) = args.dir.clone() else {
        bail!("give the snapshot directory (or --standby)");
    };
    if matches!(args.net, Some(NetArg::Auto)) {
        return run_with_own_network(&args.own_net, None);
    }
    let net_spec = args.net.take().and_then(NetArg::given);
    if !(args.agent_sync_timeout.is_finite() && args.agent_sync_timeout > 0.0) {
        bail!("--agent-sync-timeout must be a positive number of seconds");
    }
    args.jail
        .require_files_root(args.api_sock.is_some(), args.files_root.is_some())?;
    let net = net_spec.as_deref().map(NetConfig::parse).transpose()?;
    check_jailed_net(args.jail.jailed(), net.as_ref())?;
    // Its disk's lower layers filled by a fetcher: connected before the jail (the jailed
    // VM keeps the connection; it never opens a socket of its own).
    let layer_fetcher = args
        .layer_fetcher
        .as_deref()
        .map(|sock| store::fetcher::FetchClient::connect(sock, std::time::Duration::from_secs(120)))
        .transpose()?;
    let jailed = args.jail.enter(&args.kvm_device, |p| {
        // The snapshot is read and checked here, before the jail, to know what it needs.
        let snap = vmm::PreparedSnapshot::open(&dir, vmm::CpuCheck::default())?;
        // Its directory takes the working set and, by default, the VM's disk overlay.
        p.write_dir(&dir)?;
        restored_vm_paths(p, &args, &snap)
    })?;
    if let Some(code) = jailed {
        return Ok(code);
    }
    if let Some(client) = layer_fetcher {
        let mut prepared = vmm::PreparedSnapshot::open(&dir, vmm::CpuCheck::default())?;
        prepared.set_disk_sources(store::fetcher::FetcherLayers::sources(client));
        let ahead = vmm::host::Ahead::holding(vmm::host::Preloaded::from_prepared(&dir, prepared)?);
        return restore_and_own(args, dir, net_spec, &ahead);
    }
    restore_and_own(args, dir, net_spec, &vmm::host::Ahead::default())
}

/// What a jailed VM restored from `snap` needs besides the snapshot's own directory: the
/// snapshots below it (read), the directories of its sockets, serial file and disk
/// overlay and the files root (written), its disk's layers.
fn restored_vm_paths(
    p: &mut super::jail::JailPaths,
    args: &RestoreArgs,
    snap: &vmm::PreparedSnapshot,
) -> anyhow::Result<()> {
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
        &args.working_set_to,
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
}

/// Confines this process, restores the snapshot in `dir` (from `ahead` when it holds it)
/// with the request a standby process would get through its API, and runs the VM.
fn restore_and_own(
    args: RestoreArgs,
    dir: PathBuf,
    net_spec: Option<String>,
    ahead: &vmm::host::Ahead,
) -> anyhow::Result<u8> {
    // The process filter before any VM thread exists, so each can narrow it to its kind.
    if !args.no_seccomp {
        vmm::seccomp::install()?;
    }
    let owner = owner_options(args.files_root, !args.no_seccomp, args.fork_spares.into())?;
    let api = args.api_sock.as_deref().map(ApiServer::bind).transpose()?;
    let request = RestoreRequest {
        snapshot: dir,
        backend: Some(args.backend.name().into()),
        vsock: args.vsock,
        serial_file: args.serial_file,
        disk_overlay: args.disk_overlay,
        log: None,
        agent_sync: !args.no_agent_sync,
        agent_sync_timeout_ms: Some((args.agent_sync_timeout * 1000.0).ceil().max(1.0) as u64),
        working_set: !args.no_working_set,
        working_set_to: args.working_set_to,
        net: net_spec,
        tap_passed: false,
    };
    let restored = vmm::host::restore_request(
        &request,
        Vec::new(),
        &args.kvm_device,
        &mut None,
        None,
        ahead,
        &mut vmm::host::MadeAhead::default(),
    )?;
    restored.log();
    own_vm(restored.vm, api, &owner)
}

/// `clade restore --store URL ID`: a published snapshot restored here, its memory fetched
/// lazily by a fetcher process (started now, or the one at --fetcher).
///
/// Jailed, it needs a fetcher outside the jail (`--fetcher`): the snapshot is opened
/// through it before the jail is entered, so that the jailed VM keeps that connection and
/// sees, read-only, only this snapshot's files in the fetcher's cache.
fn restore_published(mut args: RestoreArgs) -> anyhow::Result<u8> {
    if args.jail.jailed() && args.fetcher.is_none() {
        bail!(
            "--jail with --store needs --fetcher (a fetcher outside the jail: a jailed VM \
             opens no network socket)"
        );
    }
    // A TAP given as it is (`fd=N`, `tap=NAME`) works as for a local snapshot; a network
    // of the VM's own would have to start the fetcher in the child it re-runs.
    if matches!(args.net, Some(NetArg::Auto)) {
        bail!("--net auto with --store is not supported yet: give a TAP (--net tap=NAME or fd=N)");
    }
    let net_spec = args.net.take().and_then(NetArg::given);
    if let Some(spec) = &net_spec {
        NetConfig::parse(spec)?;
    }
    let Some(id) = args.dir.take() else {
        bail!("give the published snapshot's id");
    };
    let id = id.to_string_lossy().into_owned();
    let _child;
    let socket = match &args.fetcher {
        Some(s) => s.clone(),
        None => {
            let cache = args.cache.clone().unwrap_or_else(default_cache_dir);
            _child = FetcherChild::start(&args.store, &cache)?;
            _child.socket().to_path_buf()
        }
    };
    args.jail.absolute(
        args.api_sock
            .iter_mut()
            .chain(&mut args.files_root)
            .chain(&mut args.vsock)
            .chain(&mut args.serial_file)
            .chain(&mut args.disk_overlay),
    )?;
    args.jail
        .require_files_root(args.api_sock.is_some(), args.files_root.is_some())?;
    let t = std::time::Instant::now();
    let (dir, prepared, _client) = open_published(&socket, &id)?;
    tracing::info!(id, dir = %dir.display(), open_us = t.elapsed().as_micros() as u64,
        "published snapshot opened");
    let jailed = args.jail.enter(&args.kvm_device, |p| {
        p.read(&dir)?;
        restored_vm_paths(p, &args, &prepared)
    })?;
    if let Some(code) = jailed {
        return Ok(code);
    }
    let ahead = vmm::host::Ahead::holding(vmm::host::Preloaded::from_prepared(&dir, prepared)?);
    restore_and_own(args, dir, net_spec, &ahead)
}

/// `clade restore --standby`: a confined process with a pre-built VM shell that waits for
/// its `restore` request (see `vmm::host::standby`).
fn standby(mut args: RestoreArgs) -> anyhow::Result<u8> {
    args.jail.absolute(
        args.api_sock
            .iter_mut()
            .chain(&mut args.files_root)
            .chain(&mut args.preload),
    )?;
    let Some(api_sock) = &args.api_sock else {
        bail!("--standby needs --api-sock");
    };
    args.jail
        .require_files_root(true, args.files_root.is_some())?;
    // Jailed, it sees what any restore request it may get names: its socket's and the
    // files root's directories read-write, the snapshot it opens ahead and the
    // directories given with --jail-read (a host's templates) read-only.
    let entered = args.jail.enter_linked(&args.kvm_device, |p| {
        p.write_dir_of(api_sock)?;
        if let Some(root) = &args.files_root {
            p.write_dir(root)?;
        }
        if let Some(dir) = &args.preload {
            p.read(dir)?;
        }
        Ok(())
    })?;
    let starter = match entered {
        super::jail::Entered::Run(link) => link,
        super::jail::Entered::Ended(code) => return Ok(code),
    };
    // The process filter before the shell's threads exist, so each narrows it to its kind.
    if !args.no_seccomp {
        vmm::seccomp::install()?;
    }
    let owner = owner_options(
        args.files_root.clone(),
        !args.no_seccomp,
        args.fork_spares.into(),
    )?;
    let api = ApiListener::bind(api_sock)?;
    let spec = ShellSpec {
        kvm_device: args.kvm_device.clone(),
        mem_bytes: args
            .mem_mib
            .checked_mul(1 << 20)
            .context("--mem is too large")?,
        vcpus: args.vcpus,
        dirty_log: true,
    };
    match vmm::host::standby(api, &spec, &owner, args.preload.as_deref(), starter)? {
        StandbyEnd::Restored(vm, api) => own_vm(*vm, Some(api), &owner),
        StandbyEnd::Shutdown => Ok(0),
        StandbyEnd::Signal(signal) => Ok(128u8.saturating_add(signal as u8)),
    }
}

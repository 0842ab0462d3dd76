//! `clade run`: boot a VM and own it until it ends (the owner loop is the library's,
//! [`vmm::host::own`]).

use std::path::PathBuf;

use clap::Args;
use vmm::api::ApiServer;
use vmm::host::{own, stop_on_signals, OwnerEnd, OwnerOptions};
use vmm::{BlockConfig, NetConfig, SerialOutput, Vm, VmConfig, VsockConfig};

use super::jail::JailArgs;
use super::ownnet::{parse_net_arg, run_with_own_network, NetArg, OwnNetArgs};
use super::MachineArgs;

mod image;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Kernel image: bzImage or ELF (vmlinux, or the project's native test guest). With
    /// --image: default `<state dir>/guest/vmlinuz`.
    #[arg(long, required_unless_present = "image")]
    kernel: Option<PathBuf>,
    /// Run a sandbox of a container image (an OCI layout directory, an OCI or `docker
    /// save` archive, or a registry reference): converted into a template once (kept in
    /// the state directory), each run restored from its snapshot; runs COMMAND (default:
    /// the image's entrypoint and command, else /bin/sh) as the image's user, then ends.
    #[arg(long, value_name = "REF")]
    image: Option<String>,
    /// With --image: where converted images live (default `$CLADE_HOME`, else
    /// `~/.local/share/clade`).
    #[arg(long, value_name = "DIR", requires = "image")]
    state_dir: Option<PathBuf>,
    /// With --image: the command to run (after `--`).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        requires = "image"
    )]
    command: Vec<std::ffi::OsString>,
    /// Initramfs to load.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, default_value = "console=ttyS0 panic=-1")]
    cmdline: String,
    /// Write the guest's serial console to this file instead of stdout.
    #[arg(long)]
    serial_file: Option<PathBuf>,
    /// Attach the test device (for the project's bare-metal test guest).
    #[arg(long)]
    test_device: bool,
    /// Attach a virtio-vsock device whose host side is this Unix socket (host programs
    /// connect and send "CONNECT <port>\n"; guest connections to host port P go to PATH_P).
    #[arg(long, value_name = "PATH")]
    vsock: Option<PathBuf>,
    /// The guest's vsock context id (with --vsock).
    #[arg(long, default_value_t = 3, requires = "vsock")]
    cid: u32,
    /// Attach a virtio-balloon with free page reporting: memory the guest frees (Linux's
    /// virtio_balloon driver reports it) goes back to the host, and snapshots skip it.
    #[arg(long)]
    balloon: bool,
    /// Attach a virtio-blk disk (the guest's /dev/vda): the top layer of a Clade disk
    /// image, written in place (`clade disk create --parent BASE OVERLAY` makes one).
    #[arg(long, value_name = "LAYER")]
    disk: Option<PathBuf>,
    /// Attach a virtio-net device (the guest's eth0) over a TAP: `tap=NAME` opens (or, with
    /// CAP_NET_ADMIN, creates) the TAP interface NAME, `fd=N` uses an inherited TAP
    /// descriptor (IFF_TAP|IFF_NO_PI|IFF_VNET_HDR; what a jailed VMM needs); `,mac=MAC` sets
    /// the guest's address (default 06:00:ac:10:00:02); `,netns=PATH` (with tap=NAME) opens
    /// the TAP inside that network namespace (e.g. /run/netns/NAME: a sandbox's own, as
    /// `clade serve` makes them), while the VMM itself stays in its own.
    /// `auto`: a network of its own (a namespace with NAT to the host's network, the TAP
    /// inside it, DNS on its gateway; the guest's addresses on the kernel command line as
    /// `clade.net=` and `clade.dns=`, which clade-agent applies), removed when the VM ends.
    #[arg(long, value_name = "auto|tap=NAME[,netns=PATH]|fd=N[,mac=MAC]",
          value_parser = |s: &str| parse_net_arg(s, parse_net))]
    net: Option<NetArg<NetConfig>>,
    #[command(flatten)]
    own_net: OwnNetArgs,
    /// Serve the VM's control API on this Unix socket (status, pause, unpause, shutdown,
    /// snapshot, fork; see `clade snapshot`, `clade fork`).
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// Snapshot and fork requests through the API may only name directories under DIR.
    #[arg(long, value_name = "DIR", requires = "api_sock")]
    files_root: Option<PathBuf>,
    /// Do not filter the VMM's system calls (seccomp is on by default: a call outside the
    /// VMM's allow-list ends the process with a line naming it).
    #[arg(long)]
    no_seccomp: bool,
    /// Keep N fork child processes started and waiting, each with a VM shell of this VM's
    /// shape built, so that a fork through the API (`clade fork`) hands its children to
    /// them instead of starting processes (a fork of more children starts the rest).
    /// Each waiting process holds a few MiB and no guest memory.
    #[arg(long, value_name = "N", default_value_t = 0, requires = "api_sock",
          value_parser = clap::value_parser!(u16).range(0..=vmm::MAX_FORK_CHILDREN as i64))]
    fork_spares: u16,
    #[command(flatten)]
    machine: MachineArgs,
    #[command(flatten)]
    jail: JailArgs,
}

pub fn run(mut args: RunArgs) -> anyhow::Result<u8> {
    if let Some(img) = args.image.take() {
        return image::run_image(img, args);
    }
    let Some(mut kernel) = args.kernel.take() else {
        anyhow::bail!("--kernel is required (or --image)");
    };
    if matches!(args.net, Some(NetArg::Auto)) {
        let cmdline = format!("{} {}", args.cmdline, sandbox::net::guest_cmdline());
        return run_with_own_network(&args.own_net, Some(cmdline));
    }
    let net = args.net.take().and_then(NetArg::given);
    args.jail.absolute(
        [&mut kernel]
            .into_iter()
            .chain(&mut args.initrd)
            .chain(&mut args.serial_file)
            .chain(&mut args.vsock)
            .chain(&mut args.disk)
            .chain(&mut args.api_sock)
            .chain(&mut args.files_root),
    )?;
    args.jail
        .require_files_root(args.api_sock.is_some(), args.files_root.is_some())?;
    check_jailed_net(args.jail.jailed(), net.as_ref())?;
    let jailed = args.jail.enter(&args.machine.kvm_device, |p| {
        p.read(&kernel)?;
        if let Some(initrd) = &args.initrd {
            p.read(initrd)?;
        }
        for file in [&args.serial_file, &args.vsock, &args.api_sock]
            .into_iter()
            .flatten()
        {
            p.write_dir_of(file)?;
        }
        if let Some(root) = &args.files_root {
            p.write_dir(root)?;
        }
        if let Some(disk) = &args.disk {
            p.disk(disk, true)?;
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
    let config = VmConfig {
        vcpus: args.machine.vcpus,
        mem_mib: args.machine.mem_mib,
        kernel,
        initrd: args.initrd,
        cmdline: args.cmdline,
        serial: args
            .serial_file
            .map(SerialOutput::File)
            .unwrap_or(SerialOutput::Stdout),
        test_device: args.test_device,
        kvm_device: args.machine.kvm_device,
        vsock: args.vsock.map(|uds_path| VsockConfig {
            uds_path,
            guest_cid: args.cid,
        }),
        disk: args.disk.map(|path| BlockConfig {
            path,
            read_only: false,
            serial: None,
            sources: None,
        }),
        net,
        balloon: args.balloon,
    };
    let options = owner_options(args.files_root, !args.no_seccomp, args.fork_spares.into())?;
    // The API socket first: a socket in use fails before a VM exists.
    let api = args.api_sock.as_deref().map(ApiServer::bind).transpose()?;
    let mut vm = vmm::boot(config)?;
    if !vm.pvm_native() {
        tracing::debug!("hardware KVM (no PVM VIF cell)");
    }
    vm.start()?;
    own_vm(vm, api, &options)
}

/// `--net`'s value (see [`NetConfig::parse`]).
pub(super) fn parse_net(spec: &str) -> Result<NetConfig, String> {
    NetConfig::parse(spec).map_err(|e| e.to_string())
}

/// A jailed VMM cannot open `/dev/net/tun` by itself: it must be handed a TAP descriptor.
pub(super) fn check_jailed_net(jailed: bool, net: Option<&NetConfig>) -> anyhow::Result<()> {
    if jailed
        && matches!(
            net,
            Some(NetConfig {
                tap: vmm::TapSource::Name(_),
                ..
            })
        )
    {
        anyhow::bail!(
            "a jailed VM cannot open a TAP by name: open it before the jail and pass --net fd=N"
        );
    }
    Ok(())
}

/// The owner loop's options for a `clade` process: stop on SIGINT/SIGTERM; fork children
/// are `clade fork-child` processes.
pub(super) fn owner_options(
    files_root: Option<PathBuf>,
    seccomp: bool,
    fork_spares: usize,
) -> anyhow::Result<OwnerOptions> {
    Ok(OwnerOptions {
        stop: Some(stop_on_signals()?),
        files_root,
        seccomp,
        fork_spares,
        ..OwnerOptions::default()
    })
}

/// Owns `vm` until it ends; returns the process exit code (and says why on stderr when it
/// is not 0).
pub(super) fn own_vm(vm: Vm, api: Option<ApiServer>, options: &OwnerOptions) -> anyhow::Result<u8> {
    let end = own(vm, api, options)?;
    report_end(&end);
    Ok(end.exit_code())
}

/// Says on stderr why a VM process ends with a non-zero code.
pub(super) fn report_end(end: &OwnerEnd) {
    match end {
        OwnerEnd::VmEnded(status) if status.exit_code() != 0 => eprintln!("clade: {status}"),
        OwnerEnd::Signal { signal, exit } => {
            eprintln!("clade: stopped by signal {signal} ({exit})")
        }
        _ => {}
    }
}

//! `clade run`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use clap::Args;
use vmm::{SerialOutput, Vm, VmConfig};

use super::MachineArgs;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Kernel image: bzImage or ELF (vmlinux, or the project's native test guest).
    #[arg(long)]
    kernel: PathBuf,
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
    /// Attach a virtio-blk disk (the guest's /dev/vda): the top layer of a Clade disk
    /// image, written in place (`clade disk create --parent BASE OVERLAY` makes one).
    #[arg(long, value_name = "LAYER")]
    disk: Option<PathBuf>,
    #[command(flatten)]
    machine: MachineArgs,
}

static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(num: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    STOP_SIGNAL.store(num, Ordering::SeqCst);
}

pub fn run(args: RunArgs) -> anyhow::Result<u8> {
    let config = VmConfig {
        vcpus: args.machine.vcpus,
        mem_mib: args.machine.mem_mib,
        kernel: args.kernel,
        initrd: args.initrd,
        cmdline: args.cmdline,
        serial: args
            .serial_file
            .map(SerialOutput::File)
            .unwrap_or(SerialOutput::Stdout),
        test_device: args.test_device,
        kvm_device: args.machine.kvm_device,
        vsock: args.vsock.map(|uds_path| vmm::config::VsockConfig {
            uds_path,
            guest_cid: args.cid,
        }),
        disk: args.disk.map(|path| vmm::config::BlockConfig {
            path,
            read_only: false,
            serial: None,
        }),
    };
    for sig in [libc::SIGINT, libc::SIGTERM] {
        vmm_sys_util::signal::register_signal_handler(sig, on_stop_signal)?;
    }
    let mut vm = Vm::new(config)?;
    if !vm.pvm_native() {
        tracing::debug!("hardware KVM (no PVM VIF cell)");
    }
    vm.start()?;
    loop {
        if let Some(status) = vm.wait_timeout(Duration::from_millis(100))? {
            tracing::info!("{status}");
            if status.exit_code() != 0 {
                eprintln!("clade: {status}");
            }
            return Ok(status.exit_code() as u8);
        }
        let sig = STOP_SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            let status = vm.shutdown();
            eprintln!("clade: stopped by signal {sig} ({status})");
            return Ok(128 + sig as u8);
        }
    }
}

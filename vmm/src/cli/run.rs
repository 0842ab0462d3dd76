//! `clade run`, and the loop that owns a running VM (shared with `clade resume`): waits for
//! the VM to end, for a stop signal, and serves the VM's API socket.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use clap::Args;
use serde_json::json;
use vmm::api::{ApiServer, PendingRequest, Request, Response};
use vmm::{SerialOutput, SnapshotKind, Vm, VmConfig};

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
    /// Serve the VM's control API on this Unix socket (status, pause, resume, shutdown,
    /// snapshot; see `clade snapshot`).
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    #[command(flatten)]
    machine: MachineArgs,
}

static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(num: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    STOP_SIGNAL.store(num, Ordering::SeqCst);
}

/// Installs the SIGINT/SIGTERM handlers the owner loop watches.
pub(super) fn handle_stop_signals() -> anyhow::Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        vmm_sys_util::signal::register_signal_handler(sig, on_stop_signal)?;
    }
    Ok(())
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
    handle_stop_signals()?;
    // The API socket first: a socket in use fails before a VM exists.
    let api = args.api_sock.as_deref().map(ApiServer::bind).transpose()?;
    let mut vm = Vm::new(config)?;
    if !vm.pvm_native() {
        tracing::debug!("hardware KVM (no PVM VIF cell)");
    }
    vm.start()?;
    own(vm, api)
}

/// Runs the owner loop until the VM ends; returns the process exit code.
pub(super) fn own(mut vm: Vm, api: Option<ApiServer>) -> anyhow::Result<u8> {
    let tick = if api.is_some() {
        Duration::from_millis(20)
    } else {
        Duration::from_millis(100)
    };
    loop {
        let status = match &api {
            Some(api) => {
                if let Some(req) = api.next_request(tick) {
                    if handle(&mut vm, api.path(), req) == Handled::Shutdown {
                        let status = vm.shutdown();
                        tracing::info!("{status}");
                        return Ok(status.exit_code() as u8);
                    }
                }
                vm.wait_timeout(Duration::ZERO)?
            }
            None => vm.wait_timeout(tick)?,
        };
        if let Some(status) = status {
            tracing::info!("{status}");
            if status.exit_code() != 0 {
                eprintln!("clade: {status}");
            }
            return Ok(status.exit_code() as u8);
        }
        if let Some(result) = vm.agent_sync_done() {
            // The agent answered its first requests after the resume: what the guest
            // touched so far is what it needs to serve one; later resumes prefetch it.
            if result.is_ok() {
                if let Err(e) = vm.save_working_set() {
                    tracing::warn!("{e}");
                }
            }
        }
        let sig = STOP_SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            let status = vm.shutdown();
            eprintln!("clade: stopped by signal {sig} ({status})");
            return Ok(128 + sig as u8);
        }
    }
}

#[derive(PartialEq, Eq)]
enum Handled {
    Continue,
    Shutdown,
}

fn handle(vm: &mut Vm, api_sock: &std::path::Path, req: PendingRequest) -> Handled {
    let state = |vm: &Vm| json!({ "state": vm.state_name() });
    let response = match &req.request {
        Request::Status => {
            let c = vm.config();
            let mut fields = json!({
                "state": vm.state_name(),
                "vcpus": c.vcpus,
                "mem_mib": c.mem_mib,
                "pvm_native": vm.pvm_native(),
            });
            if let Some(l) = vm.last_snapshot() {
                fields["last_snapshot"] = json!({
                    "id": l.id.to_string(),
                    "dir": l.dir,
                });
            }
            if let Some(r) = vm.resume_report() {
                fields["resumed"] = json!({
                    "backend": r.backend.name(),
                    "kind": r.kind.to_string(),
                    "us": r.total.as_micros() as u64,
                });
            }
            Response::ok(fields)
        }
        Request::Pause => match vm.pause() {
            Ok(()) => Response::ok(state(vm)),
            Err(e) => Response::err(e),
        },
        Request::Resume => match vm.unpause() {
            Ok(()) => Response::ok(state(vm)),
            Err(e) => Response::err(e),
        },
        Request::Shutdown => {
            req.respond(Response::ok(json!({ "state": "ended" })));
            return Handled::Shutdown;
        }
        Request::Snapshot { dir, kind } => {
            let kind = match kind.as_str() {
                "full" => Some(SnapshotKind::Full),
                "diff" => Some(SnapshotKind::Diff),
                _ => None,
            };
            match kind {
                None => Response::err("snapshot kind must be \"full\" or \"diff\""),
                Some(kind) => match vm.snapshot(dir, kind) {
                    Ok(info) => Response::ok(json!({
                        "id": info.id.to_string(),
                        "kind": info.kind.to_string(),
                        "dir": info.dir,
                        "pause_us": info.pause_time.as_micros() as u64,
                        "total_us": info.total_time.as_micros() as u64,
                        "pages_written": info.pages_written,
                        "pages_considered": info.pages_considered,
                    })),
                    Err(e) => Response::err(e),
                },
            }
        }
        Request::Fork {
            count,
            prefix,
            agent_sync,
        } => {
            match super::fork::fork_processes(vm, api_sock, *count, prefix.as_deref(), *agent_sync)
            {
                Ok(fields) => Response::ok(fields),
                Err(e) => Response::err(format!("{e:#}")),
            }
        }
    };
    req.respond(response);
    Handled::Continue
}

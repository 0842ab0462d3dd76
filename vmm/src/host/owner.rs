//! The owner loop of a running VM ([`own`]).

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use super::dispatch::{handle, Handled};
use super::options::OwnerOptions;
use super::prestarted::PrestartedChildren;
use crate::api::ApiServer;
use crate::error::{Error, Result};
use crate::exit::VmExit;
use crate::vm::Vm;

/// How the owner loop ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnerEnd {
    /// The VM ended by itself (the guest powered off, reset, crashed).
    VmEnded(VmExit),
    /// A `shutdown` request through the control API stopped it.
    ShutdownRequested(VmExit),
    /// A stop signal stopped it.
    Signal {
        /// The signal.
        signal: i32,
        /// How the VM ended.
        exit: VmExit,
    },
}

impl OwnerEnd {
    /// The exit code a VM process gives for this end: the VM's
    /// ([`VmExit::exit_code`]), or 128 + the signal.
    pub fn exit_code(&self) -> u8 {
        match self {
            OwnerEnd::VmEnded(e) | OwnerEnd::ShutdownRequested(e) => e.exit_code() as u8,
            OwnerEnd::Signal { signal, .. } => 128u8.saturating_add(*signal as u8),
        }
    }
}

static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(num: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    STOP_SIGNAL.store(num, Ordering::SeqCst);
}

/// Installs SIGINT and SIGTERM handlers that ask the owner loop to stop the VM; returns
/// the flag for [`OwnerOptions::stop`]. (A signal handler is process-wide, so the flag is.)
/// Also ignores SIGXFSZ: a write beyond RLIMIT_FSIZE (a snapshot's memory file, a disk
/// layer) then fails with EFBIG and that operation reports an error, instead of the
/// signal killing the VMM and its guest.
pub fn stop_on_signals() -> Result<&'static AtomicI32> {
    // SAFETY: SIG_IGN for SIGXFSZ installs no handler code; it only changes the
    // disposition of a signal nothing else here relies on.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    for sig in [libc::SIGINT, libc::SIGTERM] {
        vmm_sys_util::signal::register_signal_handler(sig, on_stop_signal).map_err(|e| {
            Error::Io {
                context: "installing the stop signal handlers",
                source: std::io::Error::from_raw_os_error(e.errno()),
            }
        })?;
    }
    Ok(&STOP_SIGNAL)
}

/// Owns `vm` until it ends: serves `api` (if any), watches the stop flag, saves the
/// working set once a restored guest's agent answered. Returns how it ended; the VM has
/// ended then.
pub fn own(mut vm: Vm, api: Option<ApiServer>, options: &OwnerOptions) -> Result<OwnerEnd> {
    if options.seccomp {
        crate::seccomp::install()?;
        crate::seccomp::probe(None);
    }
    let tick = if api.is_some() {
        Duration::from_millis(20)
    } else {
        Duration::from_millis(100)
    };
    // Fork children started ahead (only forks through the API use them); ended when the
    // loop returns.
    let mut prestarted = PrestartedChildren::new(match api {
        Some(_) => options.fork_spares,
        None => 0,
    });
    loop {
        let status = match &api {
            Some(api) => {
                if let Some(req) = api.next_request(tick) {
                    let handled = handle(&mut vm, api.path(), req, options, &mut prestarted);
                    if handled == Handled::Shutdown {
                        let status = vm.shutdown();
                        tracing::info!("{status}");
                        return Ok(OwnerEnd::ShutdownRequested(status));
                    }
                } else {
                    // Idle: one more waiting fork child, if any is missing.
                    prestarted.top_up(&vm, api.path(), options.launcher.as_ref());
                }
                vm.wait_timeout(Duration::ZERO)?
            }
            None => vm.wait_timeout(tick)?,
        };
        if let Some(status) = status {
            tracing::info!("{status}");
            return Ok(OwnerEnd::VmEnded(status));
        }
        if let Some(result) = vm.agent_sync_done() {
            // The working-set policy: the agent answered its first requests after the
            // restore, so what the guest touched so far is what it needs to serve one;
            // later restores prefetch it.
            if result.is_ok() {
                if let Err(e) = vm.save_working_set() {
                    tracing::warn!("{e}");
                }
            }
        }
        if let Some(flag) = options.stop {
            let signal = flag.load(Ordering::SeqCst);
            if signal != 0 {
                let exit = vm.shutdown();
                tracing::info!("stopped by signal {signal} ({exit})");
                return Ok(OwnerEnd::Signal { signal, exit });
            }
        }
    }
}

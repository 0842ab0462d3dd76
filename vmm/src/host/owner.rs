//! The owner loop of a running VM ([`own`]).

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

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
    let mut spare_shell = SpareShell::new(api.is_some() && options.spare_shell);
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
                    // Idle: one more waiting fork child, if any is missing; a spare shell.
                    prestarted.top_up(&vm, api.path(), options.launcher.as_ref());
                    spare_shell.top_up(&mut vm);
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

/// How long a VM that used up its spare shell waits before another is built: the build
/// (~2 ms of CPU) would compete with the fork's children for their first requests.
const SPARE_SHELL_DELAY: Duration = Duration::from_millis(250);

/// The owner's side of [`crate::Vm::give_shell`]: builds a spare shell for the VM in a
/// helper thread while idle, whenever it has none, and gives it to the VM.
struct SpareShell {
    enabled: bool,
    /// Since when the VM has had no spare shell (none being built).
    missing_since: Option<Instant>,
    /// A shell being built.
    building: Option<std::sync::mpsc::Receiver<Result<crate::Shell>>>,
}

impl SpareShell {
    fn new(enabled: bool) -> Self {
        SpareShell {
            enabled,
            missing_since: None,
            building: None,
        }
    }

    /// Takes a built shell to the VM, or starts building one (see [`SPARE_SHELL_DELAY`]).
    /// Gives up for good after a failed build (logged): the VM then freezes in place.
    fn top_up(&mut self, vm: &mut Vm) {
        if !self.enabled || !vm.dirty_tracking() {
            return;
        }
        if let Some(rx) = &self.building {
            match rx.try_recv() {
                Err(std::sync::mpsc::TryRecvError::Empty) => return,
                Ok(Ok(shell)) => {
                    if let Err(e) = vm.give_shell(shell) {
                        tracing::warn!("spare shell refused: {e}");
                        self.enabled = false;
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(
                        "building a spare shell failed ({e}): forks and snapshots freeze \
                         memory in place"
                    );
                    self.enabled = false;
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => self.enabled = false,
            }
            self.building = None;
            return;
        }
        if vm.has_spare_shell() || !vm.is_live() {
            self.missing_since = None;
            return;
        }
        let since = *self.missing_since.get_or_insert_with(Instant::now);
        if since.elapsed() < SPARE_SHELL_DELAY {
            return;
        }
        self.missing_since = None;
        let spec = vm.child_shell_spec();
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("clade-shell".into())
            .spawn(move || {
                crate::vstate::spare::run_at_idle_priority("building a spare shell");
                let _ = tx.send(crate::Shell::create(&spec));
            });
        match spawned {
            Ok(_) => self.building = Some(rx),
            Err(e) => {
                tracing::warn!("no thread to build a spare shell ({e})");
                self.enabled = false;
            }
        }
    }
}

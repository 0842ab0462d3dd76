//! How a VM's owner runs ([`OwnerOptions`]) and how it starts fork children
//! ([`ChildLauncher`]).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicI32;
use std::sync::Arc;

/// How the owner loop runs.
pub struct OwnerOptions {
    /// Starts the children of a process fork (a `fork` request).
    pub launcher: Arc<dyn ChildLauncher>,
    /// Set to a signal number to stop the VM (see [`stop_on_signals`]); None: no signals.
    pub stop: Option<&'static AtomicI32>,
    /// Directories that snapshot and fork requests name must lie under this one (None:
    /// anywhere). Paths must be absolute either way.
    pub files_root: Option<PathBuf>,
    /// Install the system-call filter ([`crate::seccomp`]) on every thread before the loop
    /// runs (default: true).
    pub seccomp: bool,
    /// Fork child processes kept started and waiting, each with a VM shell of this VM's
    /// shape built (see [`super::PrestartedChildren`]; default 0). Only with a control API.
    pub fork_spares: usize,
    /// Keep a spare VM shell of the VM's shape for its next fork or copy-on-write
    /// snapshot, built in the background while idle (see [`crate::Vm::give_shell`]): the
    /// VM then moves onto it instead of pausing while KVM drops its mappings of every page
    /// the guest touched (default: true). Costs one more KVM VM and its spare threads
    /// while idle, no guest memory. Only with a control API and dirty page tracking.
    pub spare_shell: bool,
}

impl Default for OwnerOptions {
    /// This executable's `fork-child` mode as the launcher; no stop signals.
    fn default() -> Self {
        OwnerOptions {
            launcher: Arc::new(SelfExec::default()),
            stop: None,
            files_root: None,
            seccomp: true,
            fork_spares: 0,
            spare_shell: true,
        }
    }
}

/// Starts the process of a fork child. The process must call
/// [`super::serve_fork_child`] (with its standard input and output as they are): the
/// parent's side sets stdin, stdout, stderr, the process group and the inherited
/// descriptors on the command returned.
pub trait ChildLauncher: Send + Sync {
    /// The command that starts the child whose control API socket will be `api_sock` (the
    /// child learns everything from its standard input; `api_sock` is for naming it, e.g.
    /// in process listings).
    fn command(&self, api_sock: &Path) -> Command;

    /// The command that starts a child process ahead of a fork, for the VM whose control
    /// API socket is `parent_api_sock`: it must call [`super::serve_prestarted_fork_child`]
    /// (standard input is its socket to the parent, standard output a pipe).
    fn prestarted_command(&self, parent_api_sock: &Path) -> Command;
}

/// The default [`ChildLauncher`]: this very executable (`/proc/self/exe`, even if its file
/// was replaced since it started) with `args` (`fork-child` for `clade`), then
/// `--api-sock <child's API socket>`, so a child can be found by its command line (a child
/// started ahead of the fork: `--prestarted-for <parent's API socket>`).
#[derive(Debug, Clone)]
pub struct SelfExec {
    /// The child's `argv[0]`.
    pub arg0: String,
    /// Arguments that make the executable call [`serve_fork_child`].
    pub args: Vec<String>,
}

impl Default for SelfExec {
    fn default() -> Self {
        SelfExec {
            arg0: "clade".into(),
            args: vec!["fork-child".into()],
        }
    }
}

impl SelfExec {
    /// This executable with `args`, then `flag` and `path`.
    fn with(&self, flag: &str, path: &Path) -> Command {
        let mut cmd = Command::new("/proc/self/exe");
        super::clean_child(&mut cmd);
        cmd.arg0(&self.arg0).args(&self.args).arg(flag).arg(path);
        cmd
    }
}

impl ChildLauncher for SelfExec {
    fn command(&self, api_sock: &Path) -> Command {
        self.with("--api-sock", api_sock)
    }

    /// `args`, then `--prestarted-for <parent's API socket>`.
    fn prestarted_command(&self, parent_api_sock: &Path) -> Command {
        self.with("--prestarted-for", parent_api_sock)
    }
}

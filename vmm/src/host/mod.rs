//! The host layer: what owns a running VM. `clade run`, `clade restore`, a fork child and
//! any program that embeds Clade use exactly this code.
//!
//! - [`own`]: the owner loop. It waits for the VM to end, for a stop signal
//!   ([`stop_on_signals`]), and executes the requests of the VM's control API
//!   ([`crate::api::ApiServer`]) one at a time, so the [`Vm`](crate::Vm) is never shared
//!   between threads. It also applies the working-set policy: once the agent sync after a
//!   restore succeeded, the pages the guest touched so far are what it needs to serve a
//!   request, and they are saved for later restores to prefetch.
//! - The control-API dispatcher (private): one [`crate::api::Request`] against the VM.
//! - [`fork_processes`]: process-per-child fork. The VM is frozen and each child is its own
//!   process, started by a [`ChildLauncher`] (by default this very executable with
//!   `fork-child`), which calls [`serve_fork_child`]; or one started ahead of the fork
//!   ([`PrestartedChildren`], [`serve_prestarted_fork_child`]), with its VM shell built.
//! - [`standby`]: a process that built its VM shell ahead of time and waits for one
//!   `restore` request; [`restore_request`] is the one restore path of `clade restore`
//!   and of that request.
//! - [`clean_child`]: what every process Clade starts inherits (an allow-listed
//!   environment and the standard streams: no secret or descriptor of its starter's).
//! - [`jail`]: namespaces, a pivoted root with only what the VM needs, cgroup limits and
//!   dropped privileges, entered before the VM is built.
//! - [`private_dir`]: the `0700` top directory under which tenants' bytes live on the host.

pub mod cgroup;
mod child;
mod dispatch;
mod fork;
mod inherit;
pub mod jail;
mod options;
mod owner;
mod prestarted;
mod private;
mod standby;

pub use child::{serve_fork_child, serve_prestarted_fork_child};
pub use fork::{fork_processes, ChildProcesses, ForkedChild, ForkedProcesses};
pub use inherit::{clean_child, PASSED as PASSED_ENV};
pub use options::{ChildLauncher, OwnerOptions, SelfExec};
pub use owner::{own, stop_on_signals, OwnerEnd};
pub use prestarted::PrestartedChildren;
pub use private::{private_dir, PRIVATE_DIR_MODE};
pub use standby::{
    restore_request, standby, Ahead, MadeAhead, Preloaded, Restored, StandbyEnd,
    DEFAULT_AGENT_SYNC_TIMEOUT, MAX_AGENT_SYNC_TIMEOUT, MAX_PRELOADED,
};

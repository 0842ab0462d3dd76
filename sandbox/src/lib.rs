//! The sandbox host: what `clade serve` is. It owns every sandbox on a machine — a
//! registry (SQLite) of sandboxes and the lifecycle that decides each one's fate (create
//! from a template, timeouts, pause/resume, fork, kill, recovery after a restart) — and
//! serves E2B's control API over HTTP so the `e2b` SDK can drive it.
//!
//! It sits at the top: it uses the VMM only through VM processes (`clade restore`, their
//! control API socket; [`vmproc`]), so a VM crash stays one sandbox's problem and nothing
//! below depends on this crate.
//!
//! | module | what |
//! |---|---|
//! | [`template`] | templates on disk (a snapshot plus its metadata) |
//! | [`registry`] | the SQLite registry of sandboxes |
//! | [`vmproc`] | starting, asking and stopping VM processes |
//! | [`durable`] | what an object store keeps of sandboxes (`--store`): uploads, claims |
//! | [`net`] | sandbox networks (namespaces, NAT, egress policy: the `hostnet` crate) |
//! | [`ownership`] | what a cluster says of who may act on a sandbox |
//! | [`host`] | the lifecycle |
//! | [`http`] | the E2B control API |
//! | [`envd`] | the E2B data plane (envd's protocol, translated to the agent's) |

pub mod build;
pub mod dashboard;
pub mod durable;
pub mod envd;
pub mod error;
pub mod host;
pub mod hostagent;
pub mod http;
pub mod ids;
pub mod net;
pub mod ownership;
pub mod registry;
pub mod template;
pub mod vmproc;

pub use error::{Error, Result};

/// Runs blocking work (a lifecycle call, an agent round trip) from an async handler: on
/// the handler's own worker thread when the runtime has others to take over its tasks
/// meanwhile (`block_in_place`), else on the blocking pool. Measured here, the hand-off to
/// the blocking pool and back costs ~100-190 us (two thread wake-ups on a 2-CPU host): more
/// than an agent ping's wait, and a tenth of a sandbox's wake.
pub(crate) async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> std::result::Result<T, tokio::task::JoinError> {
    if tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::MultiThread
    {
        Ok(tokio::task::block_in_place(f))
    } else {
        tokio::task::spawn_blocking(f).await
    }
}
pub use host::{CreateRequest, Host, HostConfig, PauseOptions};
pub use registry::{Record, State};
pub use template::{Template, TemplateStore};
pub use vmproc::{ProcessDriver, VmDriver};

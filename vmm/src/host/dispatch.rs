//! The control-API dispatcher: one [`Request`] executed against the VM its owner holds.

use std::path::Path;

use serde_json::json;
use snapshot::SnapshotKind;

use super::fork::{fork_processes, ChildLauncher};
use crate::api::{PendingRequest, Request, Response};
use crate::persist::take::snapshot;
use crate::vm::Vm;

/// What the owner does after a request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Handled {
    Continue,
    Shutdown,
}

/// Executes `req` against `vm` and answers it.
pub(crate) fn handle(
    vm: &mut Vm,
    api_sock: &Path,
    req: PendingRequest,
    launcher: &dyn ChildLauncher,
) -> Handled {
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
            if let Some(r) = vm.restore_report() {
                fields["restored"] = json!({
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
        Request::Unpause => match vm.unpause() {
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
                Some(kind) => match snapshot(vm, dir, kind) {
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
        } => match fork_processes(
            vm,
            api_sock,
            *count,
            prefix.as_deref(),
            *agent_sync,
            launcher,
        ) {
            Ok(forked) => Response::ok(forked.to_json()),
            Err(e) => Response::err(e),
        },
    };
    req.respond(response);
    Handled::Continue
}

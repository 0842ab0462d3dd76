//! The control-API dispatcher: one [`Request`] executed against the VM its owner holds.

use std::path::{Path, PathBuf};

use serde_json::json;
use snapshot::SnapshotKind;

use super::fork::{fork_processes, ChildProcesses};
use super::options::OwnerOptions;
use super::prestarted::PrestartedChildren;
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
    options: &OwnerOptions,
    prestarted: &mut PrestartedChildren,
) -> Handled {
    let root = options.files_root.as_deref();
    let state = |vm: &Vm| json!({ "state": vm.state_name() });
    let response = match &req.request {
        Request::Status => {
            let mut fields = status_fields(vm);
            fields["fork_children_waiting"] = json!(prestarted.waiting());
            fields["spare_shell"] = json!(vm.has_spare_shell());
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
                Some(kind) => match confine(dir, root)
                    .and_then(|dir| snapshot(vm, &dir, kind).map_err(|e| e.to_string()))
                {
                    Ok(info) => Response::ok(json!({
                        "id": info.id.to_string(),
                        "kind": info.kind.to_string(),
                        "dir": info.dir,
                        "pause_us": info.pause_time.as_micros() as u64,
                        "moved": crate::vm::moved(&info.steps),
                        "total_us": info.total_time.as_micros() as u64,
                        "pages_written": info.pages_written,
                        "pages_considered": info.pages_considered,
                    })),
                    Err(e) => Response::err(e),
                },
            }
        }
        Request::FreezeDisk => match vm.freeze_disk_now() {
            Ok((layer, top)) => Response::ok(json!({ "layer": layer, "top": top })),
            Err(e) => Response::err(e),
        },
        Request::Fork {
            count,
            prefix,
            agent_sync,
            nets,
        } => match prefix
            .as_deref()
            .map(|p| confine(p, root))
            .transpose()
            .and_then(|prefix| {
                let nets = nets
                    .iter()
                    .map(|n| crate::config::NetConfig::parse(n))
                    .collect::<crate::error::Result<Vec<_>>>()
                    .map_err(|e| e.to_string())?;
                let spec = ChildProcesses {
                    count: *count,
                    prefix: prefix.as_deref(),
                    agent_sync: *agent_sync,
                    nets: &nets,
                };
                fork_processes(vm, api_sock, spec, options, prestarted).map_err(|e| e.to_string())
            }) {
            Ok(forked) => Response::ok(forked.to_json()),
            Err(e) => Response::err(e),
        },
        // Only a standby process restores (once, into its pre-built shell).
        Request::Restore(_) => Response::err(
            "this process already runs a VM: a restore is only accepted by a standby process, once",
        ),
        Request::Preload { .. } => Response::err(
            "this process already runs a VM: only a standby process opens snapshots ahead",
        ),
    };
    req.respond(response);
    Handled::Continue
}

/// The fields of a `status` answer for `vm`.
pub(crate) fn status_fields(vm: &Vm) -> serde_json::Value {
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
            // Memory files a diff on it would add to (itself and its bases).
            "layers": l.chain.len() + 1,
        });
    }
    if let Some(r) = vm.restore_report() {
        fields["restored"] = json!({
            "backend": r.backend.name(),
            "kind": r.kind.to_string(),
            "us": r.total.as_micros() as u64,
        });
    }
    fields
}

/// A directory a request names, checked: absolute, no `..`, and under `root` (when given)
/// once symlinks in its existing part are resolved.
pub(crate) fn confine(path: &Path, root: Option<&Path>) -> Result<PathBuf, String> {
    Confiner::new(root).check(path)
}

/// Checks paths against one files root, as [`confine`] does, resolving the root and each
/// existing ancestor once: a restore request names four files in one directory, and each
/// resolution is a system call per path component (~0.01 ms a path here).
pub(crate) struct Confiner<'a> {
    root: Option<&'a Path>,
    /// The root, resolved at the first path checked.
    resolved_root: Option<PathBuf>,
    /// Existing ancestors resolved so far (a request's few: a list).
    resolved: Vec<(PathBuf, PathBuf)>,
}

impl<'a> Confiner<'a> {
    /// A checker for paths under `root` (`None`: any absolute path without `..`).
    pub(crate) fn new(root: Option<&'a Path>) -> Self {
        Self {
            root,
            resolved_root: None,
            resolved: Vec::new(),
        }
    }

    /// `path`, checked; resolved when there is a root.
    pub(crate) fn check(&mut self, path: &Path) -> Result<PathBuf, String> {
        if !path.is_absolute() {
            return Err(format!("{}: the path must be absolute", path.display()));
        }
        if path
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(format!(
                "{}: the path must not contain '..'",
                path.display()
            ));
        }
        let Some(root) = self.root else {
            return Ok(path.to_path_buf());
        };
        let root = match &self.resolved_root {
            Some(r) => r.clone(),
            None => {
                let r = root
                    .canonicalize()
                    .map_err(|e| format!("the files root {}: {e}", root.display()))?;
                self.resolved_root.insert(r).clone()
            }
        };
        // The longest existing ancestor, resolved; the rest cannot hold symlinks yet.
        let mut existing = path;
        let mut rest = Vec::new();
        while !existing.exists() {
            match (existing.parent(), existing.file_name()) {
                (Some(parent), Some(name)) => {
                    rest.push(name.to_os_string());
                    existing = parent;
                }
                _ => break,
            }
        }
        let mut resolved = match self.resolved.iter().find(|(p, _)| p == existing) {
            Some((_, r)) => r.clone(),
            None => {
                let r = existing
                    .canonicalize()
                    .map_err(|e| format!("{}: {e}", existing.display()))?;
                self.resolved.push((existing.to_path_buf(), r.clone()));
                r
            }
        };
        for name in rest.iter().rev() {
            resolved.push(name);
        }
        if !resolved.starts_with(&root) {
            return Err(format!(
                "{}: outside the directory this VM may write to ({})",
                path.display(),
                root.display()
            ));
        }
        Ok(resolved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_paths_are_absolute_and_confined() {
        let base = std::env::temp_dir().join(format!("clade-confine-{}", std::process::id()));
        let root = base.join("root");
        std::fs::create_dir_all(root.join("snaps")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("out")).unwrap();
        assert!(confine(Path::new("rel/dir"), None).is_err());
        assert!(confine(Path::new("/a/../b"), None).is_err());
        assert_eq!(
            confine(Path::new("/x/y"), None).unwrap(),
            PathBuf::from("/x/y")
        );
        let ok = confine(&root.join("snaps/new/s1"), Some(&root)).unwrap();
        assert!(ok.ends_with("snaps/new/s1"));
        let e = confine(&root.join("out/s1"), Some(&root)).unwrap_err();
        assert!(e.contains("outside"), "{e}");
        assert!(confine(Path::new("/tmp/elsewhere"), Some(&root)).is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// One checker for a request's several paths: a directory resolved for one path is
    /// not taken for a symlink in it, or for a symlinked directory beside it.
    #[test]
    fn a_confiner_checks_each_path_of_a_request_as_confine_does() {
        let base = std::env::temp_dir().join(format!("clade-confiner-{}", std::process::id()));
        let root = base.join("root");
        let dir = root.join("sandboxes/sb1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("vm.log"), b"").unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join("serial.log")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("sandboxes/out")).unwrap();
        let mut c = Confiner::new(Some(&root));
        for name in ["vm.vsock", "disk.cdsk", "vm.log", "new/deeper"] {
            let p = c.check(&dir.join(name)).unwrap();
            assert_eq!(p, confine(&dir.join(name), Some(&root)).unwrap());
            assert!(p.ends_with(name), "{}", p.display());
        }
        let e = c.check(&dir.join("serial.log")).unwrap_err();
        assert!(e.contains("outside"), "{e}");
        let e = c.check(&root.join("sandboxes/out/x")).unwrap_err();
        assert!(e.contains("outside"), "{e}");
        assert!(c.check(Path::new("/a/../b")).is_err());
        assert!(c.check(Path::new("relative")).is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }
}

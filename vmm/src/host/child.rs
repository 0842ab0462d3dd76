//! A fork child's start-up ([`serve_fork_child`]): the other end of
//! [`super::fork_processes`] (the hand-over is described there).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::fork::{io, ChildLaunch};
use super::options::OwnerOptions;
use super::owner::{own, OwnerEnd};
use crate::api::ApiServer;
use crate::config::SerialOutput;
use crate::error::{Error, Result};
use crate::fork::{ChildSpec, Frozen};
use crate::vm::Vm;

/// Longest launch record a child accepts.
const MAX_LAUNCH_RECORD: usize = 64 * 1024;
/// How long a child's agent sync may take (best effort).
const CHILD_AGENT_SYNC: Duration = Duration::from_secs(5);

/// A fork child's side: reads the launch record and the frozen instant from standard
/// input, builds the child VM, binds its API socket, tells the parent `ready` (or `error
/// <message>`) on standard output, then owns the VM like `clade run` until it ends.
///
/// `api_sock`: the API socket the launcher named on the command line (see
/// [`super::ChildLauncher::command`]); when given, it must be the launch record's.
pub fn serve_fork_child(options: &OwnerOptions, api_sock: Option<&Path>) -> Result<OwnerEnd> {
    let mut stdout = std::io::stdout();
    match build_child(api_sock) {
        Ok((vm, api, (files_root, seccomp))) => {
            writeln!(stdout, "ready")
                .and_then(|()| stdout.flush())
                .map_err(io("telling the parent"))?;
            // The parent's files root holds here too (unless this process was given one).
            let options = OwnerOptions {
                launcher: options.launcher.clone(),
                stop: options.stop,
                files_root: options.files_root.clone().or(files_root),
                seccomp: options.seccomp && seccomp,
            };
            own(vm, Some(api), &options)
        }
        Err(e) => {
            let msg = e.to_string().replace('\n', " ");
            let _ = writeln!(stdout, "error {msg}");
            Err(e)
        }
    }
}

#[allow(clippy::type_complexity)]
fn build_child(api_sock: Option<&Path>) -> Result<(Vm, ApiServer, (Option<PathBuf>, bool))> {
    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .map_err(io("reading the parent's state"))?;
    let bad = |why: &str| Error::Fork(format!("bad hand-over from the parent: {why}"));
    let len = input
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or_else(|| bad("too short"))?;
    if len > MAX_LAUNCH_RECORD || input.len() < 4 + len {
        return Err(bad("launch record length"));
    }
    let launch: ChildLaunch = postcard::from_bytes(&input[4..4 + len])
        .map_err(|e| bad(&format!("launch record: {e}")))?;
    if api_sock.is_some_and(|p| p != launch.api_sock) {
        return Err(bad(
            "the API socket on the command line is not the launch record's",
        ));
    }
    let mut files = Vec::with_capacity(launch.fds.len());
    let mut seen = std::collections::HashSet::new();
    for fd in &launch.fds {
        if !seen.insert(*fd) {
            return Err(bad("a descriptor listed twice"));
        }
        if *fd < 3 || !Path::new(&format!("/proc/self/fd/{fd}")).exists() {
            return Err(Error::Fork(format!(
                "memory layer descriptor {fd} was not inherited"
            )));
        }
        // SAFETY: the parent left this descriptor open for this process to own (see the
        // module documentation); nothing else here uses it.
        let owned = unsafe { OwnedFd::from_raw_fd(*fd) };
        files.push(File::from(owned));
    }
    let frozen = Frozen::from_handoff(&input[4 + len..], files)?;
    let api = ApiServer::bind(&launch.api_sock)?;
    let spec = ChildSpec {
        disk_path: launch.disk,
        vsock_path: launch.vsock,
        guest_cid: launch.cid,
        serial: SerialOutput::File(launch.serial),
        shell: None,
        agent_sync: launch.agent_sync.then_some(CHILD_AGENT_SYNC),
        hostname_suffix: launch.hostname_suffix,
        start: true,
        vcpu_cpus: Vec::new(),
        net: launch
            .net
            .as_deref()
            .map(crate::config::NetConfig::parse)
            .transpose()?,
    };
    let vm = frozen.child(spec)?;
    Ok((vm, api, (launch.files_root, launch.seccomp)))
}

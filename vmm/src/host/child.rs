//! A fork child's start-up: the other end of [`super::fork_processes`]. A child started at
//! the fork ([`serve_fork_child`]) reads its state from standard input (the hand-over is
//! described in [`super::fork`]); one started ahead of it
//! ([`serve_prestarted_fork_child`]) builds its VM shell first and then waits for the same
//! state on its socket (described in [`super::prestarted`]).

use std::fs::File;
use std::io::{IoSliceMut, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};

use super::fork::ChildLaunch;
use super::options::OwnerOptions;
use super::owner::{own, OwnerEnd};
use super::prestarted::{PrestartShape, MAX_HANDED_LAYERS};
use crate::api::ApiServer;
use crate::config::SerialOutput;
use crate::error::{Error, Result};
use crate::fork::{ChildSpec, Frozen};
use crate::vm::Vm;
use crate::vstate::shell::Shell;

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
    let built = read_stdin().and_then(|input| {
        let (launch, handoff) = parse_launch(&input)?;
        if api_sock.is_some_and(|p| p != launch.api_sock) {
            return Err(bad(
                "the API socket on the command line is not the launch record's",
            ));
        }
        let files = inherited_layers(&launch.fds)?;
        build_child(launch, handoff, files, None, SocketsAhead::default())
    });
    run_child(options, built)
}

/// A fork child started ahead of the fork (see [`super::prestarted`]): standard input is
/// its socket to the parent. Builds the VM shell it is told, waits for a fork's state,
/// then goes on like [`serve_fork_child`]. `None`: the parent went away before any fork
/// (the process ran nothing).
pub fn serve_prestarted_fork_child(options: &OwnerOptions) -> Result<Option<OwnerEnd>> {
    let sock = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map(UnixStream::from)
        .map_err(Error::io("the socket to the parent"))?;
    let shape = match read_shape(&sock) {
        Ok(None) => return Ok(None),
        Ok(Some(shape)) => shape,
        Err(e) => return Err(e),
    };
    let shell = match Shell::create(&shape.spec()) {
        Ok(shell) => Some(shell),
        // The child then builds one when the fork comes (and says so in its log).
        Err(e) => {
            tracing::warn!("waiting fork child: no shell built ahead: {e}");
            None
        }
    };
    let ahead = SocketsAhead::bind(&shape);
    // Ready for a fork (the parent counts this one as waiting from now on).
    if (&sock).write_all(b"w").is_err() {
        return Ok(None);
    }
    let Some(Handed { len, log, layers }) = wait_for_fork(&sock)? else {
        // The parent went away: what it made ahead for this process goes too (the sockets
        // bound ahead are removed with `ahead`).
        for p in &shape.files_ahead {
            let _ = std::fs::remove_file(p);
        }
        return Ok(None);
    };
    // From here on this process is the child: it logs where the parent said.
    nix::unistd::dup2(log.as_raw_fd(), libc::STDERR_FILENO)
        .map_err(|e| Error::Fork(format!("taking the child's log: {e}")))?;
    drop(log);
    let t0 = std::time::Instant::now();
    let built = read_rest(&sock, &len).and_then(|input| {
        let (launch, handoff) = parse_launch(&input)?;
        if launch.fds.len() != layers.len() {
            return Err(bad("the memory layers sent are not the launch record's"));
        }
        tracing::debug!("hand-over read in {:?}", t0.elapsed());
        build_child(launch, handoff, layers, shell, ahead)
    });
    tracing::debug!("hand-over to a built child: {:?}", t0.elapsed());
    run_child(options, built).map(Some)
}

/// Says `ready` (or `error <message>`) to the parent on standard output, then owns the VM.
fn run_child(
    options: &OwnerOptions,
    built: Result<(Vm, ApiServer, (Option<PathBuf>, bool))>,
) -> Result<OwnerEnd> {
    let mut stdout = std::io::stdout();
    match built {
        Ok((vm, api, (files_root, seccomp))) => {
            writeln!(stdout, "ready")
                .and_then(|()| stdout.flush())
                .map_err(Error::io("telling the parent"))?;
            // The parent's files root holds here too (unless this process was given one).
            let options = OwnerOptions {
                launcher: options.launcher.clone(),
                stop: options.stop,
                files_root: options.files_root.clone().or(files_root),
                seccomp: options.seccomp && seccomp,
                fork_spares: options.fork_spares,
                spare_shell: options.spare_shell,
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

fn bad(why: &str) -> Error {
    Error::Fork(format!("bad hand-over from the parent: {why}"))
}

fn read_stdin() -> Result<Vec<u8>> {
    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .map_err(Error::io("reading the parent's state"))?;
    Ok(input)
}

/// `start`, then the rest of the stream.
fn read_rest(mut sock: &UnixStream, start: &[u8]) -> Result<Vec<u8>> {
    let mut input = start.to_vec();
    sock.read_to_end(&mut input)
        .map_err(Error::io("reading the parent's state"))?;
    Ok(input)
}

/// The launch record (`u32` length, then the record) and the hand-over bytes after it.
fn parse_launch(input: &[u8]) -> Result<(ChildLaunch, &[u8])> {
    let len = input
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or_else(|| bad("too short"))?;
    if len > MAX_LAUNCH_RECORD || input.len() < 4 + len {
        return Err(bad("launch record length"));
    }
    let launch: ChildLaunch = postcard::from_bytes(&input[4..4 + len])
        .map_err(|e| bad(&format!("launch record: {e}")))?;
    Ok((launch, &input[4 + len..]))
}

/// The shell a waiting child is told to build (`None`: the parent went away first).
fn read_shape(mut sock: &UnixStream) -> Result<Option<PrestartShape>> {
    let mut len = [0u8; 4];
    match sock.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io("reading the shell's shape")(e)),
    }
    let len = u32::from_le_bytes(len) as usize;
    // Paths in it: as long as a launch record may be.
    if len > MAX_LAUNCH_RECORD {
        return Err(bad("shell shape length"));
    }
    let mut record = vec![0u8; len];
    sock.read_exact(&mut record)
        .map_err(Error::io("reading the shell's shape"))?;
    let shape: PrestartShape =
        postcard::from_bytes(&record).map_err(|e| bad(&format!("shell shape: {e}")))?;
    Ok(Some(shape))
}

/// A waiting child's API and vsock sockets, bound ahead where its starter said
/// ([`PrestartShape`]) and moved to the child's paths at the fork: a socket bound there
/// would allocate an inode on the fork's path (see [`super::prestarted::AheadFiles`]).
/// Best effort: what cannot be bound, or moved, is bound at the fork as before.
#[derive(Default)]
struct SocketsAhead {
    api: Option<crate::api::ApiListener>,
    vsock: Option<crate::device_manager::BoundAhead>,
}

impl SocketsAhead {
    fn bind(shape: &PrestartShape) -> SocketsAhead {
        let api = shape.api_ahead.as_deref().and_then(|p| {
            crate::api::ApiListener::bind(p)
                .map_err(|e| tracing::debug!("no API socket bound ahead: {e}"))
                .ok()
        });
        let vsock = shape.vsock_ahead.as_deref().and_then(|p| {
            devices::virtio::vsock::SocketFile::bind(p)
                .map_err(|e| tracing::debug!("no vsock socket bound ahead: {e}"))
                .ok()
        });
        SocketsAhead { api, vsock }
    }

    /// The child's API server at `path`: the socket bound ahead, moved there, or one
    /// bound there now.
    fn api_server(&mut self, path: &Path) -> Result<ApiServer> {
        if let Some(mut l) = self.api.take() {
            match l.move_to(path) {
                Ok(()) => return l.serve(),
                Err(e) => tracing::debug!("the API socket bound ahead not used: {e}"),
            }
        }
        ApiServer::bind(path)
    }
}

/// Waits for a fork: the descriptors (the log, then the memory layers) that come with the
/// launch record's length. `None`: the parent went away.
fn wait_for_fork(sock: &UnixStream) -> Result<Option<Handed>> {
    let mut first = [0u8; 4];
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_HANDED_LAYERS + 1]);
    let (n, fds) = {
        let mut iov = [IoSliceMut::new(&mut first)];
        let msg = recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| Error::Fork(format!("waiting for a fork: {e}")))?;
        let mut fds: Vec<File> = Vec::new();
        for c in msg.cmsgs() {
            if let ControlMessageOwned::ScmRights(list) = c {
                for fd in list {
                    // SAFETY: the kernel just installed this descriptor in this process
                    // for this message; nothing else refers to it.
                    fds.push(File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
                }
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(bad("more descriptors than a hand-over carries"));
        }
        (msg.bytes, fds)
    };
    if n == 0 {
        return Ok(None);
    }
    if n != first.len() {
        return Err(bad("the launch record's length came in pieces"));
    }
    let mut fds = fds.into_iter();
    let log = fds.next().ok_or_else(|| bad("no descriptors"))?;
    Ok(Some(Handed {
        len: first,
        log,
        layers: fds.collect(),
    }))
}

/// What [`wait_for_fork`] received.
struct Handed {
    /// The launch record's length, as sent (the start of what [`parse_launch`] reads).
    len: [u8; 4],
    log: File,
    layers: Vec<File>,
}

/// The memory layer descriptors a child started at the fork inherited.
fn inherited_layers(fds: &[RawFd]) -> Result<Vec<File>> {
    let mut files = Vec::with_capacity(fds.len());
    let mut seen = std::collections::HashSet::new();
    for fd in fds {
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
    Ok(files)
}

/// The child VM from its launch record, the frozen instant's bytes and memory layers, in
/// `shell` when one was built ahead; its API socket bound.
#[allow(clippy::type_complexity)]
fn build_child(
    launch: ChildLaunch,
    handoff: &[u8],
    layers: Vec<File>,
    shell: Option<Shell>,
    mut ahead: SocketsAhead,
) -> Result<(Vm, ApiServer, (Option<PathBuf>, bool))> {
    let frozen = Frozen::from_handoff(handoff, layers)?;
    let api = ahead.api_server(&launch.api_sock)?;
    let spec = ChildSpec {
        disk_path: launch.disk,
        vsock_path: launch.vsock,
        guest_cid: launch.cid,
        serial: SerialOutput::File(launch.serial),
        shell,
        agent_sync: launch.agent_sync.then_some(CHILD_AGENT_SYNC),
        hostname_suffix: launch.hostname_suffix,
        start: true,
        vcpu_cpus: Vec::new(),
        net: launch
            .net
            .as_deref()
            .map(crate::config::NetConfig::parse)
            .transpose()?,
        vsock_bound_ahead: ahead.vsock.take(),
    };
    let vm = frozen.child(spec)?;
    Ok((vm, api, (launch.files_root, launch.seccomp)))
}

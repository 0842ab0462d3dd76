//! Process-per-child fork, the parent's side ([`fork_processes`]; the child's side is
//! [`super::serve_fork_child`]).
//!
//! Hand-over: the frozen memory layers are memfds; the parent starts each child through a
//! [`ChildLauncher`] with those descriptors inherited (close-on-exec cleared in the child
//! between fork and exec), writes the child's launch record and the encoded frozen
//! instant ([`crate::Frozen::handoff`]) to its stdin, and reads one line from its stdout:
//! `ready` once the child's VM runs and its API socket listens, or `error <message>`. All
//! children are started before the first line is awaited: they build their VMs at once. The
//! child is in its own process group and maps the memfds `MAP_PRIVATE`, so it outlives the
//! parent and never sees its later writes. A VM process that keeps children started ahead
//! of forks ([`super::PrestartedChildren`]) hands the same state to those first, over a
//! socket instead of inheritance and a pipe.
//!
//! stdin of a child: a little-endian `u32` length, the launch record ([`ChildLaunch`],
//! postcard) of that length, then the hand-over bytes to the end.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::options::{ChildLauncher, OwnerOptions};
use super::prestarted::{new_private_file, Prestarted, PrestartedChildren};
use crate::config::NetConfig;
use crate::error::{Error, Result};
use crate::fork::{
    check_child_count, child_path, freeze, next_fork_seq, process_unique_cid, Frozen,
};
use crate::vm::Vm;

/// How long a child may take to report that it runs.
const CHILD_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// What a child process needs besides the frozen instant: its identity.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ChildLaunch {
    pub(super) api_sock: PathBuf,
    pub(super) vsock: Option<PathBuf>,
    pub(super) disk: Option<PathBuf>,
    pub(super) cid: u32,
    pub(super) serial: PathBuf,
    pub(super) hostname_suffix: String,
    /// Inherited memory layer descriptors, base first.
    pub(super) fds: Vec<RawFd>,
    pub(super) agent_sync: bool,
    /// The parent's files root (see [`super::OwnerOptions::files_root`]): the child keeps it.
    pub(super) files_root: Option<PathBuf>,
    /// Whether the parent filters system calls: the child does too (it has inherited the
    /// filter anyway when it does).
    pub(super) seccomp: bool,
    /// Its TAP, as `--net` takes it (when the parent has a network device).
    pub(super) net: Option<String>,
}

/// One child started by [`fork_processes`].
#[derive(Debug, Clone, Serialize)]
pub struct ForkedChild {
    /// Its process id.
    pub pid: u32,
    /// Its control API socket.
    pub api_sock: PathBuf,
    /// Its vsock socket (when the parent has a vsock device).
    pub vsock: Option<PathBuf>,
    /// Its guest CID (with `vsock`).
    pub cid: Option<u32>,
    /// Its serial console.
    pub serial: PathBuf,
    /// Its log (standard error).
    pub log: PathBuf,
    /// Its disk overlay (when the parent has a writable disk).
    pub disk: Option<PathBuf>,
}

/// What [`fork_processes`] did.
#[derive(Debug, Clone)]
pub struct ForkedProcesses {
    /// How long the parent's vCPUs were paused.
    pub pause: Duration,
    /// The parent moved onto its spare shell (see [`crate::Vm::give_shell`]).
    pub moved: bool,
    /// The whole call.
    pub total: Duration,
    /// The children, in order.
    pub children: Vec<ForkedChild>,
}

impl ForkedProcesses {
    /// The control API's answer fields: `pause_us`, `moved`, `total_us`, `children`.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "pause_us": self.pause.as_micros() as u64,
            "moved": self.moved,
            "total_us": self.total.as_micros() as u64,
            "children": self.children,
        })
    }
}

/// A started child and the files that are its own (removed if the fork fails).
struct Started {
    child: Child,
    files: Vec<PathBuf>,
}

impl Started {
    /// The child has its state: a thread reads its first line from `stdout`.
    fn launched(self, stdout: ChildStdout, mut child: ForkedChild) -> Launched {
        child.pid = self.child.id();
        let (tx, rx) = mpsc::channel();
        // On the fork's path: no filter of its own (installing one costs ~0.2 ms); it only
        // reads the child's ready line, under the process filter.
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        Launched {
            started: self,
            line: rx,
            child,
        }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// What a process fork makes.
#[derive(Debug, Clone, Copy)]
pub struct ChildProcesses<'a> {
    /// How many children (1 to [`crate::MAX_FORK_CHILDREN`]).
    pub count: usize,
    /// The directory of their files (default: the API socket's).
    pub prefix: Option<&'a Path>,
    /// Give each child's guest agent the time, entropy and a hostname suffix.
    pub agent_sync: bool,
    /// One TAP per child, when the VM has a network device.
    pub nets: &'a [NetConfig],
}

/// The parent's side: freezes `vm` and starts `spec.count` child processes. Each child's
/// files are [`child_path`]s of the API socket in `spec.prefix` (default: the API socket's
/// directory): `.api`, `.vsock`, `.serial`, `.log`, `.cdsk`. On an error no child is left
/// (the ones started are killed and their files removed; logs stay) and `vm` runs on.
/// Children are the processes waiting in `prestarted` first, then new ones started by
/// `owner.launcher`; they keep the owner's files root and system-call filter setting. A VM
/// with a network device needs one TAP per child in `spec.nets` (checked before the VM
/// pauses); a TAP by descriptor cannot go to a child.
pub fn fork_processes(
    vm: &mut Vm,
    api_sock: &Path,
    spec: ChildProcesses<'_>,
    owner: &OwnerOptions,
    prestarted: &mut PrestartedChildren,
) -> Result<ForkedProcesses> {
    let ChildProcesses {
        count,
        prefix,
        agent_sync,
        nets,
    } = spec;
    check_child_count(count)?;
    check_child_nets(vm.has_net_device(), count, nets)?;
    let dir = match prefix {
        Some(p) => p.to_path_buf(),
        None => api_sock
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        context: "creating the fork children's directory",
        source,
    })?;
    let t0 = Instant::now();
    let (frozen, report) = freeze(vm)?;
    let (bytes, files) = frozen.handoff()?;
    let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    let mut launched: Vec<Launched> = Vec::with_capacity(count);
    let mut started: Vec<Started> = Vec::with_capacity(count);
    let mut children = Vec::with_capacity(count);
    #[cfg(feature = "test-hooks")]
    let fail_after = std::env::var("CLADE_FORK_FAIL_AFTER")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    for i in 0..count {
        #[cfg(feature = "test-hooks")]
        if fail_after == Some(i) {
            tracing::warn!("fork: injected failure after {i} children");
            for l in launched {
                l.started.kill();
            }
            return Err(Error::Fork(format!(
                "fork child {i}: injected failure after {i} children (CLADE_FORK_FAIL_AFTER)"
            )));
        }
        let child = ChildPlan {
            dir: &dir,
            api_sock,
            agent_sync,
            files_root: owner.files_root.as_deref(),
            seccomp: owner.seccomp,
            net: nets.get(i),
        };
        // All children start at once: each builds its VM while the next is launched.
        let waiting = prestarted.take();
        match launch_child(
            &frozen,
            &bytes,
            &fds,
            &child,
            owner.launcher.as_ref(),
            waiting,
        ) {
            Ok(l) => launched.push(l),
            Err(e) => {
                tracing::warn!("fork: child {i} failed ({e}); removing {i} children");
                for l in launched {
                    l.started.kill();
                }
                return Err(Error::Fork(format!("fork child {i}: {e}")));
            }
        }
    }
    let handed_at = t0.elapsed();
    let mut failed = None;
    for (i, l) in launched.into_iter().enumerate() {
        if failed.is_some() {
            l.started.kill();
            continue;
        }
        match l.ready() {
            Ok((s, c)) => {
                started.push(s);
                children.push(c);
            }
            Err(e) => failed = Some(Error::Fork(format!("fork child {i}: {e}"))),
        }
    }
    if let Some(e) = failed {
        tracing::warn!("fork: {e}; removing the children started");
        for s in started {
            s.kill();
        }
        return Err(e);
    }
    drop(frozen);
    // Reap each child when it ends (they outlive this process if it ends first).
    for mut s in started {
        std::thread::spawn(move || {
            crate::seccomp::confine_current_thread(crate::seccomp::ThreadKind::Helper);
            let _ = s.child.wait();
        });
    }
    let total = t0.elapsed();
    tracing::info!(
        "forked {count} child processes: paused {:?}, every child had its state after \
         {handed_at:?}, total {total:?}",
        report.pause_time
    );
    Ok(ForkedProcesses {
        pause: report.pause_time,
        moved: crate::vm::moved(&report.steps),
        total,
        children,
    })
}

/// Where a child's files go and what it keeps of the parent's settings.
struct ChildPlan<'a> {
    dir: &'a Path,
    api_sock: &'a Path,
    agent_sync: bool,
    files_root: Option<&'a Path>,
    seccomp: bool,
    net: Option<&'a NetConfig>,
}

/// A parent with a network device needs exactly one TAP by name per child (a descriptor
/// cannot be handed to another process here); one without needs none.
fn check_child_nets(has_net: bool, count: usize, nets: &[NetConfig]) -> Result<()> {
    if !has_net {
        if nets.is_empty() {
            return Ok(());
        }
        return Err(Error::Fork(
            "TAPs were given for the children, but the VM has no network device".into(),
        ));
    }
    if nets.len() != count {
        return Err(Error::Fork(format!(
            "the VM has a network device: each of the {count} children needs its own TAP \
             ({} given)",
            nets.len()
        )));
    }
    if let Some(n) = nets
        .iter()
        .find(|n| !matches!(n.tap, crate::config::TapSource::Name(_)))
    {
        return Err(Error::Fork(format!(
            "child TAP '{n}': a child process needs a TAP by name (tap=NAME[,netns=PATH])"
        )));
    }
    Ok(())
}

/// A child process started and handed its state, not yet known to run.
struct Launched {
    started: Started,
    /// Its first line (`ready` or `error …`), read by a thread.
    line: mpsc::Receiver<String>,
    child: ForkedChild,
}

impl Launched {
    /// Waits until the child runs (or says why not: it is then killed and its files go).
    fn ready(self) -> Result<(Started, ForkedChild)> {
        let Ok(line) = self.line.recv_timeout(CHILD_READY_TIMEOUT) else {
            self.started.kill();
            return Err(Error::Fork(format!(
                "the child did not start in {CHILD_READY_TIMEOUT:?}"
            )));
        };
        let line = line.trim_end();
        if line == "ready" {
            return Ok((self.started, self.child));
        }
        let e = Error::Fork(match line.strip_prefix("error ") {
            Some(msg) => msg.to_string(),
            None => format!(
                "the child ended before it ran (see {})",
                self.child.log.display()
            ),
        });
        self.started.kill();
        Err(e)
    }
}

/// Starts one child (or takes `waiting`, one started ahead) and hands it its state;
/// [`Launched::ready`] waits until it runs.
fn launch_child(
    frozen: &Frozen,
    bytes: &[u8],
    fds: &[RawFd],
    plan: &ChildPlan<'_>,
    launcher: &dyn ChildLauncher,
    mut waiting: Option<Prestarted>,
) -> Result<Launched> {
    let (dir, api_sock) = (plan.dir, plan.api_sock);
    let seq = next_fork_seq();
    let file = |ext: &str| child_path(api_sock, Some(dir), seq, ext);
    let api = file("api");
    let parent_vsock = frozen.saved().machine.vsock.as_ref();
    let vsock = parent_vsock.map(|_| file("vsock"));
    let serial = file("serial");
    let log = file("log");
    let cid = process_unique_cid(parent_vsock.map_or(0, |v| v.guest_cid));
    for p in std::iter::once(&api).chain(vsock.as_ref()) {
        if std::fs::symlink_metadata(p).is_ok() {
            return Err(Error::Fork(format!("{} exists already", p.display())));
        }
    }
    // The child's own files are new, private, and never reached through a symlink someone
    // planted at their predictable names: made ahead by a waiting child's starter and
    // renamed here without replacing anything, or made here.
    let ahead = waiting
        .as_mut()
        .and_then(Prestarted::take_files)
        .and_then(|f| f.place(&log, &serial));
    let log_file = match ahead {
        Some(f) => f,
        None => {
            let created = |p: &Path| {
                new_private_file(p)
                    .map_err(|e| Error::Fork(format!("creating {}: {e}", p.display())))
            };
            let log_file = created(&log)?;
            if let Err(e) = created(&serial) {
                let _ = std::fs::remove_file(&log);
                return Err(e);
            }
            log_file
        }
    };
    let disk = match &frozen.saved().disk {
        Some(d) if !d.read_only => {
            let p = file("cdsk");
            if let Err(e) = frozen.child_overlay(&p) {
                let _ = std::fs::remove_file(&serial);
                return Err(e);
            }
            Some(p)
        }
        _ => None,
    };
    let launch = ChildLaunch {
        api_sock: api.clone(),
        vsock: vsock.clone(),
        disk: disk.clone(),
        cid,
        serial: serial.clone(),
        hostname_suffix: format!("-f{seq}"),
        fds: fds.to_vec(),
        agent_sync: plan.agent_sync,
        files_root: plan.files_root.map(Path::to_path_buf),
        seccomp: plan.seccomp,
        net: plan.net.map(ToString::to_string),
    };
    let record = postcard::to_allocvec(&launch)
        .map_err(|e| Error::Fork(format!("encoding the launch record: {e}")))?;
    let own_files: Vec<PathBuf> = [
        Some(api.clone()),
        vsock.clone(),
        Some(serial.clone()),
        disk.clone(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let forked = ForkedChild {
        pid: 0,
        api_sock: api.clone(),
        cid: vsock.as_ref().map(|_| cid),
        vsock: vsock.clone(),
        serial: serial.clone(),
        log: log.clone(),
        disk: disk.clone(),
    };
    if let Some(mut w) = waiting {
        match w.hand_over(log_file.as_raw_fd(), fds, &record, bytes) {
            Ok(()) => {
                let Prestarted { child, stdout, .. } = w;
                let started = Started {
                    child,
                    files: own_files,
                };
                return Ok(started.launched(stdout, forked));
            }
            // It ended or its socket broke: a new process instead.
            Err(e) => {
                tracing::warn!("a waiting fork child failed its hand-over ({e}): starting one");
                w.end();
            }
        }
    }
    let mut cmd = launcher.command(&api);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file))
        .process_group(0);
    let keep = fds.to_vec();
    // SAFETY: runs in the forked child before exec; only calls close_range and fcntl
    // (async-signal safe) on descriptors this process owns, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // Whatever a library left inheritable: the child gets its stdio and the memory
            // layers, nothing else of the parent's.
            const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC);
            for &fd in &keep {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            for p in disk.iter().chain([&serial]) {
                let _ = std::fs::remove_file(p);
            }
            return Err(Error::Io {
                context: "starting a fork child process",
                source: e,
            });
        }
    };
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    // The log stays on failure: it says why a child failed.
    let st = Started {
        child,
        files: own_files,
    };
    let handed = (|| -> Result<ChildStdout> {
        let mut stdin = stdin.ok_or_else(|| Error::Fork("no stdin pipe".into()))?;
        stdin
            .write_all(&(record.len() as u32).to_le_bytes())
            .and_then(|()| stdin.write_all(&record))
            .and_then(|()| stdin.write_all(bytes))
            .map_err(Error::io("handing the state to the child"))?;
        drop(stdin);
        stdout.ok_or_else(|| Error::Fork("no stdout pipe".into()))
    })();
    match handed {
        Ok(stdout) => Ok(st.launched(stdout, forked)),
        Err(e) => {
            st.kill();
            Err(e)
        }
    }
}

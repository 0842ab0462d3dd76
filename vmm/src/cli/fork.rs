//! `clade fork` (through a running VM's API socket), the parent's side of a process fork
//! (freeze, spawn one `clade fork-child` process per child, hand over state and memory),
//! and `clade fork-child`, the hidden child mode.
//!
//! Hand-over: the frozen memory layers are memfds; the parent spawns `clade fork-child`
//! with those descriptors inherited (close-on-exec cleared in the child between fork and
//! exec), writes the encoded state ([`vmm::fork::Frozen::handoff`]) to its stdin, and reads
//! one line from its stdout: `ready` once the child's VM runs and its API socket listens,
//! or `error <message>`. The child is in its own process group and maps the memfds
//! `MAP_PRIVATE`, so it outlives the parent and never sees its later writes.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::Args;
use serde_json::json;
use vmm::api::{ApiClient, ApiServer, Request};
use vmm::fork::{ChildSpec, Frozen};
use vmm::{SerialOutput, Vm};

use super::run::{handle_stop_signals, own};

/// How long a child may take to report that it runs.
const CHILD_READY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Args)]
pub struct ForkArgs {
    /// The VM's API socket (`clade run --api-sock`, `clade resume --api-sock`, or a child's).
    api_sock: PathBuf,
    /// Number of children.
    #[arg(short = 'n', long = "count", default_value_t = 1)]
    count: usize,
    /// Directory for the children's sockets, serial consoles and logs (default: the
    /// directory of the VM's API socket).
    #[arg(long, value_name = "DIR")]
    prefix: Option<PathBuf>,
    /// Do not give the children's guest agents the time, entropy and a hostname suffix.
    #[arg(long)]
    no_agent_sync: bool,
    /// Print the VM's answer as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn fork(args: ForkArgs) -> anyhow::Result<u8> {
    if args.count == 0 {
        bail!("-n must be at least 1");
    }
    let prefix = args
        .prefix
        .as_deref()
        .map(std::path::absolute)
        .transpose()
        .context("cannot make the --prefix path absolute")?;
    let mut client = ApiClient::connect(&args.api_sock)
        .with_context(|| format!("API socket {}", args.api_sock.display()))?;
    let r = client.call(&Request::Fork {
        count: args.count,
        prefix,
        agent_sync: !args.no_agent_sync,
    })?;
    if !r.ok {
        bail!(
            "fork failed: {}",
            r.error.unwrap_or_else(|| "no reason given".into())
        );
    }
    if args.json {
        println!("{}", serde_json::Value::Object(r.fields));
        return Ok(0);
    }
    let children = r
        .fields
        .get("children")
        .and_then(|c| c.as_array())
        .cloned()
        .unwrap_or_default();
    for c in &children {
        let s = |k: &str| c[k].as_str().unwrap_or("-").to_string();
        println!("{} {}", s("api_sock"), s("vsock"));
    }
    Ok(0)
}

/// One child process started by [`fork_processes`].
struct Started {
    child: Child,
    files: Vec<PathBuf>,
}

impl Started {
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// The parent's side: freezes `vm`, starts `count` child processes, returns the API
/// answer's fields. On an error no child is left and `vm` runs on.
pub(super) fn fork_processes(
    vm: &mut Vm,
    api_sock: &Path,
    count: usize,
    prefix: Option<&Path>,
    agent_sync: bool,
) -> anyhow::Result<serde_json::Value> {
    if count == 0 {
        bail!("count must be at least 1");
    }
    let dir = match prefix {
        Some(p) => p.to_path_buf(),
        None => api_sock
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let stem = api_sock
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "vm".into());
    // This very executable, even if its file was replaced since it started.
    let exe = PathBuf::from("/proc/self/exe");
    let t0 = Instant::now();
    let (frozen, pause, _) = vm.freeze_for_fork()?;
    let (bytes, files) = frozen.handoff()?;
    let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    let mut started: Vec<Started> = Vec::with_capacity(count);
    let mut out = Vec::with_capacity(count);
    let fail_after = std::env::var("CLADE_FORK_FAIL_AFTER")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    for i in 0..count {
        let r = (|| -> anyhow::Result<(Started, serde_json::Value)> {
            if fail_after == Some(i) {
                bail!("injected failure after {i} children (CLADE_FORK_FAIL_AFTER)");
            }
            let seq = vmm::fork::next_fork_seq();
            let name = format!("{stem}-f{seq}");
            let api = dir.join(format!("{name}.api"));
            let vsock = frozen
                .machine
                .vsock
                .as_ref()
                .map(|_| dir.join(format!("{name}.vsock")));
            let serial = dir.join(format!("{name}.serial"));
            let log = dir.join(format!("{name}.log"));
            let cid = vmm::fork::process_unique_cid(
                frozen.machine.vsock.as_ref().map_or(0, |v| v.guest_cid),
            );
            for p in std::iter::once(&api).chain(vsock.as_ref()) {
                if p.exists() {
                    bail!("{} exists already", p.display());
                }
            }
            let log_file =
                File::create(&log).with_context(|| format!("creating {}", log.display()))?;
            let disk = match &frozen.disk {
                Some(d) if !d.read_only => {
                    let p = dir.join(format!("{name}.cdsk"));
                    frozen.child_overlay(&p)?;
                    Some(p)
                }
                _ => None,
            };
            let mut cmd = Command::new(&exe);
            cmd.arg0("clade")
                .arg("fork-child")
                .arg("--api-sock")
                .arg(&api)
                .arg("--serial-file")
                .arg(&serial)
                .arg("--cid")
                .arg(cid.to_string())
                .arg(format!("--hostname-suffix=-f{seq}"))
                .arg("--fds")
                .arg(
                    fds.iter()
                        .map(|f| f.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                );
            if let Some(v) = &vsock {
                cmd.arg("--vsock").arg(v);
            }
            if let Some(p) = &disk {
                cmd.arg("--disk").arg(p);
            }
            if !agent_sync {
                cmd.arg("--no-agent-sync");
            }
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::from(log_file))
                .process_group(0);
            let keep = fds.clone();
            // SAFETY: runs in the forked child before exec; only calls fcntl (async-signal
            // safe) on descriptors this process owns, and allocates nothing.
            unsafe {
                cmd.pre_exec(move || {
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
                    if let Some(p) = &disk {
                        let _ = std::fs::remove_file(p);
                    }
                    return Err(anyhow::Error::new(e).context("starting a fork child process"));
                }
            };
            let pid = child.id();
            let stdin = child.stdin.take();
            let stdout = child.stdout.take();
            let st = Started {
                child,
                // The log stays: it says why a child failed.
                files: [
                    Some(api.clone()),
                    vsock.clone(),
                    Some(serial.clone()),
                    disk.clone(),
                ]
                .into_iter()
                .flatten()
                .collect(),
            };
            let ready = (|| -> anyhow::Result<()> {
                let mut stdin = stdin.ok_or_else(|| anyhow!("no stdin pipe"))?;
                stdin
                    .write_all(&bytes)
                    .context("handing the state to the child")?;
                drop(stdin);
                let stdout = stdout.ok_or_else(|| anyhow!("no stdout pipe"))?;
                let (tx, rx) = mpsc::channel();
                std::thread::spawn(move || {
                    let mut line = String::new();
                    let _ = BufReader::new(stdout).read_line(&mut line);
                    let _ = tx.send(line);
                });
                let line = rx
                    .recv_timeout(CHILD_READY_TIMEOUT)
                    .map_err(|_| anyhow!("the child did not start in {CHILD_READY_TIMEOUT:?}"))?;
                let line = line.trim_end();
                if line == "ready" {
                    return Ok(());
                }
                match line.strip_prefix("error ") {
                    Some(msg) => bail!("{msg}"),
                    None => bail!("the child ended before it ran (see {})", log.display()),
                }
            })();
            match ready {
                Ok(()) => Ok((
                    st,
                    json!({
                        "pid": pid,
                        "api_sock": api,
                        "vsock": vsock,
                        "cid": vsock.as_ref().map(|_| cid),
                        "serial": serial,
                        "log": log,
                        "disk": disk,
                    }),
                )),
                Err(e) => {
                    st.kill();
                    Err(e)
                }
            }
        })();
        match r {
            Ok((s, j)) => {
                started.push(s);
                out.push(j);
            }
            Err(e) => {
                tracing::warn!("fork: child {i} failed ({e:#}); removing {i} children");
                for s in started {
                    s.kill();
                }
                return Err(e.context(format!("fork child {i}")));
            }
        }
    }
    drop(frozen);
    // Reap each child when it ends (they outlive this process if it ends first).
    for mut s in started {
        std::thread::spawn(move || {
            let _ = s.child.wait();
        });
    }
    tracing::info!(
        "forked {count} child processes: paused {pause:?}, total {:?}",
        t0.elapsed()
    );
    Ok(json!({
        "pause_us": pause.as_micros() as u64,
        "total_us": t0.elapsed().as_micros() as u64,
        "children": out,
    }))
}

#[derive(Debug, Args)]
pub struct ForkChildArgs {
    /// The child's API socket.
    #[arg(long)]
    api_sock: PathBuf,
    /// The child's vsock socket (when the parent has a vsock device).
    #[arg(long)]
    vsock: Option<PathBuf>,
    /// The child's disk overlay (made by the parent on the frozen layer).
    #[arg(long)]
    disk: Option<PathBuf>,
    /// The child's guest CID.
    #[arg(long, default_value_t = 3)]
    cid: u32,
    /// The child's serial console.
    #[arg(long)]
    serial_file: Option<PathBuf>,
    /// Appended to the guest's hostname by the agent sync.
    #[arg(long, default_value = "")]
    hostname_suffix: String,
    /// Inherited memory layer descriptors, base first.
    #[arg(long, value_delimiter = ',')]
    fds: Vec<RawFd>,
    /// Skip the agent sync.
    #[arg(long)]
    no_agent_sync: bool,
}

/// `clade fork-child`: becomes one child of a fork, then runs like `clade run`.
pub fn fork_child(args: ForkChildArgs) -> anyhow::Result<u8> {
    let mut stdout = std::io::stdout();
    let built = build_child(args);
    match built {
        Ok((vm, api)) => {
            writeln!(stdout, "ready")
                .and_then(|()| stdout.flush())
                .context("telling the parent")?;
            own(vm, Some(api))
        }
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            let _ = writeln!(stdout, "error {msg}");
            Err(e)
        }
    }
}

fn build_child(args: ForkChildArgs) -> anyhow::Result<(Vm, ApiServer)> {
    handle_stop_signals()?;
    let mut files = Vec::with_capacity(args.fds.len());
    for fd in &args.fds {
        if !Path::new(&format!("/proc/self/fd/{fd}")).exists() {
            bail!("memory layer descriptor {fd} was not inherited");
        }
        // SAFETY: the parent left this descriptor open for this process to own (see the
        // module documentation); nothing else here uses it.
        let owned = unsafe { OwnedFd::from_raw_fd(*fd) };
        files.push(File::from(owned));
    }
    let mut bytes = Vec::new();
    std::io::stdin()
        .read_to_end(&mut bytes)
        .context("reading the parent's state")?;
    let frozen = Frozen::from_handoff(&bytes, files)?;
    let api = ApiServer::bind(&args.api_sock)?;
    let spec = ChildSpec {
        disk_path: args.disk,
        vsock_path: args.vsock,
        guest_cid: args.cid,
        serial: args
            .serial_file
            .map(SerialOutput::File)
            .unwrap_or(SerialOutput::Discard),
        shell: None,
        agent_sync: (!args.no_agent_sync).then_some(Duration::from_secs(5)),
        hostname_suffix: args.hostname_suffix,
        start: true,
        vcpu_cpus: Vec::new(),
    };
    let vm = Vm::from_frozen(&frozen, spec)?;
    Ok((vm, api))
}

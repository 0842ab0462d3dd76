//! The VM a build runs in: an ordinary `clade run` child with a control API socket and a
//! vsock socket in a directory of the build's, waited for until its agent answers, and
//! killed if the build ends without shutting it down.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm::agent::{Client, Transport};
use vmm::api::{ApiClient, Request, Response};

use crate::error::{Error, Result};

/// What confines a build VM's process (a service's jail and cgroups): given the command
/// before it starts and the directory the VM writes in (its sockets, console, disk
/// overlays, snapshot), it adds what jails the process and hands the directory over to it.
/// What it returns lives as long as the process and is dropped once the process has
/// ended: it takes the directory back (files the VM wrote become the caller's again).
pub trait Confine: Send + Sync + std::fmt::Debug {
    /// Confines the VM process `cmd` starts, of `vcpus` and `mem_mib`, writing in `dir`.
    fn confine(
        &self,
        cmd: &mut Command,
        dir: &Path,
        vcpus: u32,
        mem_mib: u64,
    ) -> std::result::Result<Box<dyn Send>, String>;
}

/// A network for build VMs that the VM cannot open by itself (a jailed VM is handed its
/// TAP): a service's sandbox networks. Attached per VM process, removed once it ended.
pub trait AttachNetwork: Send + Sync + std::fmt::Debug {
    /// Gives the VM process `cmd` starts a network of its own (its `--net` and the
    /// descriptor it inherits). What it returns lives as long as the process and removes
    /// the network when dropped.
    fn attach(&self, cmd: &mut Command) -> std::result::Result<Box<dyn Send>, String>;
    /// What the guest's kernel command line needs to use it (its address, gateway, DNS).
    fn guest_cmdline(&self) -> String;
}

/// How to boot a build VM.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// The `clade` executable.
    pub exe: PathBuf,
    /// Kernel image.
    pub kernel: PathBuf,
    /// Initramfs (with clade-agent).
    pub initrd: Option<PathBuf>,
    /// The whole kernel command line.
    pub cmdline: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// The KVM device node.
    pub kvm_device: PathBuf,
    /// The network device, as `clade run --net` takes it.
    pub net: Option<String>,
    /// The project's native test guest (it answers Hello and Ping only).
    pub test_device: bool,
    /// How long the agent may take to answer after the VM starts.
    pub agent_timeout: Duration,
    /// What confines the VM process (None: it runs as the caller, unjailed).
    pub confine: Option<Arc<dyn Confine>>,
    /// A network attached to each VM process (instead of `net`, which the VM opens by
    /// name).
    pub network: Option<Arc<dyn AttachNetwork>>,
}

/// A running build VM.
pub struct BuildVm {
    child: Child,
    api: PathBuf,
    serial: PathBuf,
    log: PathBuf,
    agent: Client,
    /// What confines the process and its network: dropped after it (fields drop in
    /// order, and `Drop` below waits for the process first).
    _confined: Option<Box<dyn Send>>,
    _network: Option<Box<dyn Send>>,
}

/// The last `n` bytes of `path` as text ("" if unreadable).
pub(crate) fn tail(path: &Path, n: usize) -> String {
    let b = std::fs::read(path).unwrap_or_default();
    String::from_utf8_lossy(&b[b.len().saturating_sub(n)..]).into_owned()
}

impl BuildVm {
    /// Boots `spec` with `disk` (a writable top layer) as its disk; its sockets, console
    /// (`build.serial`) and log (`build.log`) go in `dir`. Returns once the agent answers.
    pub fn start(spec: &VmSpec, dir: &Path, disk: Option<&Path>) -> Result<BuildVm> {
        let api = dir.join("build.api");
        let vsock = dir.join("build.vsock");
        let serial = dir.join("build.serial");
        let log = dir.join("build.log");
        let abs = |p: &Path| std::path::absolute(p).map_err(|e| Error::io("resolving", p, e));
        let mut args: Vec<OsString> = vec![
            "run".into(),
            "--kernel".into(),
            abs(&spec.kernel)?.into(),
            "--cmdline".into(),
            match &spec.network {
                Some(n) => format!("{} {}", spec.cmdline, n.guest_cmdline()),
                None => spec.cmdline.clone(),
            }
            .into(),
            "--vcpus".into(),
            spec.vcpus.to_string().into(),
            "--mem".into(),
            spec.mem_mib.to_string().into(),
            "--kvm-device".into(),
            spec.kvm_device.clone().into(),
            "--vsock".into(),
            vsock.clone().into(),
            "--api-sock".into(),
            api.clone().into(),
            "--files-root".into(),
            dir.into(),
            "--serial-file".into(),
            serial.clone().into(),
        ];
        if let Some(i) = &spec.initrd {
            args.extend(["--initrd".into(), abs(i)?.into()]);
        }
        if let Some(d) = disk {
            args.extend(["--disk".into(), abs(d)?.into()]);
        }
        if spec.test_device {
            args.push("--test-device".into());
        }
        if let Some(n) = &spec.net {
            args.extend(["--net".into(), n.into()]);
        }
        let log_file = std::fs::File::create(&log).map_err(|e| Error::io("creating", &log, e))?;
        let mut cmd = Command::new(&spec.exe);
        vmm::host::clean_child(&mut cmd)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file);
        // Declared before the process: dropped (the directory taken back) after it ended.
        let mut confined = match &spec.confine {
            Some(c) => Some(
                c.confine(&mut cmd, dir, spec.vcpus, spec.mem_mib)
                    .map_err(|e| Error::Vm(format!("confining it: {e}")))?,
            ),
            None => None,
        };
        let mut network = match &spec.network {
            Some(n) => Some(
                n.attach(&mut cmd)
                    .map_err(|e| Error::Vm(format!("its network: {e}")))?,
            ),
            None => None,
        };
        let child = cmd
            .spawn()
            .map_err(|e| Error::io("starting", &spec.exe, e))?;
        let mut pending = Pending(Some(child));
        let t = Instant::now();
        while !vsock.exists() || !api.exists() {
            if let Some(status) = pending.child().try_wait().ok().flatten() {
                return Err(Error::Vm(format!(
                    "it ended ({status}) before its sockets appeared: {}",
                    tail(&log, 4096)
                )));
            }
            if t.elapsed() > spec.agent_timeout {
                return Err(Error::Vm(format!(
                    "its sockets did not appear in {:?}",
                    spec.agent_timeout
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let left = spec.agent_timeout.saturating_sub(t.elapsed());
        let (agent, pong) = Client::connect_and_ping(&vsock, Transport::Vsock { port: 52 }, left)
            .map_err(|e| {
            Error::Vm(format!(
                "waiting for the guest agent: {e}; console: {}",
                tail(&serial, 2048)
            ))
        })?;
        tracing::info!(agent = %pong.agent_version, took = ?t.elapsed(), "build VM answers");
        Ok(BuildVm {
            child: pending.0.take().expect("kept until here"),
            api,
            serial,
            log,
            agent,
            _confined: confined.take(),
            _network: network.take(),
        })
    }

    /// The guest agent.
    pub fn agent(&self) -> &Client {
        &self.agent
    }

    /// The console file.
    pub fn serial(&self) -> &Path {
        &self.serial
    }

    /// Sends `req` to the VM's control API; an answer that is not ok is an error.
    pub fn call(&self, req: &Request) -> Result<Response> {
        let mut c = ApiClient::connect(&self.api).map_err(Error::vm)?;
        let r = c.call(req).map_err(Error::vm)?;
        if !r.ok {
            return Err(Error::Vm(r.error.unwrap_or_else(|| "failed".into())));
        }
        Ok(r)
    }

    /// Syncs the guest's filesystems and freezes the disk's top layer; the VM goes on on
    /// a new overlay. Returns the frozen layer.
    pub fn freeze_disk(&self) -> Result<PathBuf> {
        self.agent.sync().map_err(Error::vm)?;
        let r = self.call(&Request::FreezeDisk)?;
        r.fields
            .get("layer")
            .and_then(|v| v.as_str())
            .map(PathBuf::from)
            .ok_or_else(|| Error::Vm("freeze_disk answered no layer".into()))
    }

    /// Stops the VM (asked, then killed after 5 s) and waits for its process.
    pub fn shutdown(mut self) {
        self.agent.close();
        stop_vm_process(&mut self.child, &self.api);
    }

    /// The end of the VMM's log.
    pub fn log_tail(&self) -> String {
        tail(&self.log, 4096)
    }
}

/// Ends a `clade run`/`clade restore` process: a shutdown through its API socket `api`,
/// then SIGKILL if it has not ended within 5 s; waits for it.
pub fn stop_vm_process(child: &mut Child, api: &Path) {
    if let Ok(mut c) = ApiClient::connect(api) {
        let _ = c.call(&Request::Shutdown);
    }
    let t = Instant::now();
    while matches!(child.try_wait(), Ok(None)) {
        if t.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = child.wait();
}

impl Drop for BuildVm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A VM process not yet handed to a [`BuildVm`]: killed if the start fails.
struct Pending(Option<Child>);

impl Pending {
    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("set until taken")
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// How long the build VM's console must stay unchanged before its snapshot.
const SETTLE_QUIET: Duration = Duration::from_millis(20);
/// The longest wait for that.
const SETTLE_MAX: Duration = Duration::from_secs(2);

/// Waits until the console file `serial` has not grown for [`SETTLE_QUIET`], or
/// [`SETTLE_MAX`] passed. A template is the machine every sandbox of it starts as: a
/// snapshot taken while the guest was still writing to its console (the line a guest logs
/// when the build's agent connection ends; each byte is an exit to the VMM) would make
/// every sandbox finish that line first, ~5 ms of its vCPU on the path of its first
/// request. A guest that never goes quiet is snapshotted anyway.
fn settle(serial: &Path) {
    let size = || std::fs::metadata(serial).map(|m| m.len()).unwrap_or(0);
    let t = Instant::now();
    let (mut last, mut since) = (size(), Instant::now());
    while since.elapsed() < SETTLE_QUIET && t.elapsed() < SETTLE_MAX {
        std::thread::sleep(Duration::from_millis(2));
        let now = size();
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    tracing::debug!(waited = ?t.elapsed(), quiet = since.elapsed() >= SETTLE_QUIET, "build VM settled");
}

/// A process a template starts before its snapshot, so that every sandbox of it has it
/// running (E2B's start command), and the check that it is ready.
#[derive(Debug, Clone)]
pub struct StartCmd {
    /// Run with `/bin/sh -c`, kept running.
    pub cmd: String,
    /// Run with `/bin/sh -c` until it exits 0 (none: the start command is taken as ready).
    pub ready: Option<String>,
    /// Its environment.
    pub env: Vec<(String, String)>,
    /// Its working directory ("" : `/`).
    pub cwd: String,
    /// Its user ("" : root).
    pub user: String,
    /// The longest wait for the ready command.
    pub ready_timeout: Duration,
}

/// The template VM: boots `spec` on `disk`, runs each of `setup` with `sh -c` (any
/// failure fails the build), starts `start` and waits for it to be ready, then writes a
/// full snapshot into `snapshot` and stops the VM. Its files go in `dir`.
pub fn snapshot_template(
    spec: &VmSpec,
    dir: &Path,
    disk: Option<&Path>,
    setup: &[String],
    start: Option<&StartCmd>,
    snapshot: &Path,
) -> Result<()> {
    let vm = BuildVm::start(spec, dir, disk)?;
    let agent = vm.agent();
    let sh = |c: &str| vmm::agent::Command::new("/bin/sh").arg("-c").arg(c);
    for c in setup {
        let out = agent
            .spawn(&sh(c))
            .and_then(|e| e.wait_with_output())
            .map_err(|e| Error::Vm(format!("running the setup command '{c}': {e}")))?;
        if !out.status.success() {
            return Err(Error::Vm(format!(
                "the setup command '{c}' failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
    }
    if let Some(s) = start {
        let (uid, gid) = resolve_user(agent, 0, &s.user)?;
        let with = |mut c: vmm::agent::Command| {
            for (k, v) in &s.env {
                c = c.env(k, v);
            }
            if !s.cwd.is_empty() {
                c = c.cwd(&s.cwd);
            }
            if (uid, gid) != (0, 0) {
                c = c.uid(uid).gid(gid);
            }
            c
        };
        agent
            .spawn_kept(&with(sh(&s.cmd)), Some("start"), &[])
            .map_err(|e| Error::Vm(format!("starting the start command '{}': {e}", s.cmd)))?;
        if let Some(r) = &s.ready {
            let t = Instant::now();
            loop {
                let out = agent
                    .spawn(&with(sh(r)))
                    .and_then(|e| e.wait_with_output())
                    .map_err(|e| Error::Vm(format!("running the ready command '{r}': {e}")))?;
                if out.status.success() {
                    break;
                }
                if t.elapsed() > s.ready_timeout {
                    return Err(Error::Vm(format!(
                        "the ready command '{r}' did not succeed in {:?} (last: {}): {}{}",
                        s.ready_timeout,
                        out.status,
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    )));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    if !setup.is_empty() || start.is_some() {
        agent.sync().map_err(Error::vm)?;
    }
    agent.close();
    settle(vm.serial());
    vm.call(&Request::Snapshot {
        dir: snapshot.to_path_buf(),
        kind: "full".into(),
    })?;
    vm.shutdown();
    Ok(())
}

/// The user a step names, as uid and gid, from the guest's `/etc/passwd` and
/// `/etc/group` (`name`, `uid`, `name:group`, `uid:gid`); `line` is the step's, for the
/// error (0: none).
pub fn resolve_user(agent: &Client, line: usize, user: &str) -> Result<(u32, u32)> {
    if user.is_empty() || user == "root" {
        return Ok((0, 0));
    }
    let read = |p: &str| {
        agent
            .read_file(p)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    };
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = read("/etc/passwd");
    let entry = passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 4 && (f[0] == u || f[2] == u))
            .then(|| (f[2].parse::<u32>().ok(), f[3].parse::<u32>().ok()))
    });
    let uid = match (entry, u.parse::<u32>()) {
        (Some((Some(uid), _)), _) => uid,
        (_, Ok(n)) => n,
        _ => {
            return Err(Error::Dockerfile {
                line,
                msg: format!("the user '{u}' is not in the image's /etc/passwd"),
            })
        }
    };
    let gid = match g {
        None => entry.and_then(|(_, g)| g).unwrap_or(uid),
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => read("/etc/group")
                .lines()
                .find_map(|l| {
                    let f: Vec<&str> = l.split(':').collect();
                    (f.len() >= 3 && f[0] == g)
                        .then(|| f[2].parse::<u32>().ok())
                        .flatten()
                })
                .ok_or_else(|| Error::Dockerfile {
                    line,
                    msg: format!("the group '{g}' is not in the image's /etc/group"),
                })?,
        },
    };
    Ok((uid, gid))
}

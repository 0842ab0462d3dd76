//! **Test harness, never the default**: a [`VmDriver`] whose "VM" is a host-run
//! `clade-agent --listen-unix`, so the data plane and the e2b SDK can be exercised end to
//! end on machines that cannot boot a Linux guest (this project's development machines:
//! see ENVIRONMENT.md). The "guest" is the host: commands run as the service's user, on
//! the host's filesystem. `clade serve --test-host-agent` turns it on and says so loudly.
//!
//! Pause is made as faithful to a VM pause as a host process allows: a paused VM keeps its
//! processes (they are in its snapshot) and every vsock connection to it is lost. So the
//! agent listens on a private socket (`<vsock>.agent`) behind a small proxy at the
//! sandbox's vsock path; pause closes every proxied connection (the service sees its agent
//! connections drop, the agent sees them close) and then freezes the agent and all its
//! descendants with SIGSTOP; the "snapshot" is a marker file. Resume from that snapshot
//! sends SIGCONT and opens the proxy again. Kill (and dropping the driver) SIGKILLs the
//! agent's descendants and the agent. A sandbox killed while paused keeps its frozen agent
//! until the driver is dropped. Fork is refused.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::vmproc::{ForkedChild, StartSpec, Started, VmDriver};

/// The name of the template [`HostAgentDriver::install_template`] writes.
pub const TEMPLATE: &str = "host-agent";
/// The snapshot marker a pause writes.
const MARKER: &str = "HOST-AGENT-MARKER";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Forwards connections from the sandbox's vsock path to the agent's private socket, so
/// that a pause can drop them all.
struct Proxy {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    /// Live proxied pairs (client, agent); the pipe threads own them.
    conns: Arc<Mutex<Vec<Weak<Pair>>>>,
    thread: Option<JoinHandle<()>>,
}

type Pair = (UnixStream, UnixStream);

impl Proxy {
    fn start(path: &Path, agent_sock: PathBuf) -> Result<Proxy> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path).map_err(Error::io("binding", path))?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<Weak<Pair>>>> = Arc::new(Mutex::new(Vec::new()));
        let (s, c) = (stop.clone(), conns.clone());
        let thread = std::thread::Builder::new()
            .name("host-agent-proxy".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if s.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let Ok(agent) = UnixStream::connect(&agent_sock) else {
                        continue;
                    };
                    let pair = Arc::new((client, agent));
                    {
                        let mut list = lock(&c);
                        list.retain(|w| w.strong_count() > 0);
                        list.push(Arc::downgrade(&pair));
                    }
                    for to_agent in [true, false] {
                        let pair = pair.clone();
                        let _ = std::thread::Builder::new()
                            .name("host-agent-pipe".into())
                            .spawn(move || {
                                let (mut r, mut w) = if to_agent {
                                    (&pair.0, &pair.1)
                                } else {
                                    (&pair.1, &pair.0)
                                };
                                let _ = std::io::copy(&mut r, &mut w);
                                let _ = w.shutdown(std::net::Shutdown::Write);
                            });
                    }
                }
            })
            .map_err(|e| Error::Vm(format!("starting the host-agent proxy: {e}")))?;
        Ok(Proxy {
            path: path.to_path_buf(),
            stop,
            conns,
            thread: Some(thread),
        })
    }

    /// Stops accepting, closes every proxied connection, removes the socket.
    fn close(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for p in lock(&self.conns).drain(..).filter_map(|w| w.upgrade()) {
            let _ = p.0.shutdown(std::net::Shutdown::Both);
            let _ = p.1.shutdown(std::net::Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.close();
    }
}

/// One host-run agent.
struct Agent {
    child: Child,
    sock: PathBuf,
    proxy: Option<Proxy>,
}

impl Agent {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The agent's descendants (it is a child subreaper, so orphans stay in its tree).
    fn descendants(&self) -> Vec<i32> {
        let mut parent_of: Vec<(i32, i32)> = Vec::new();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                    continue;
                };
                // pid (comm) state ppid ...: comm may hold spaces and parentheses.
                let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                    continue;
                };
                if let Some(ppid) = after.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
                    parent_of.push((pid, ppid));
                }
            }
        }
        let mut out = vec![self.pid()];
        let mut i = 0;
        while i < out.len() {
            let p = out[i];
            out.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
            i += 1;
        }
        out.remove(0);
        out
    }

    fn signal(pid: i32, sig: libc::c_int) {
        // SAFETY: kill(2) on a pid from our own agent's process tree.
        unsafe { libc::kill(pid, sig) };
    }

    /// Signals the agent first (so it starts nothing more), then its tree until no new
    /// member appears.
    /// With SIGCONT the order is reversed: the tree first, the agent last.
    fn signal_tree(&self, sig: libc::c_int) {
        if sig != libc::SIGCONT {
            Self::signal(self.pid(), sig);
        }
        let mut done: Vec<i32> = Vec::new();
        for _ in 0..10 {
            let fresh: Vec<i32> = self
                .descendants()
                .into_iter()
                .filter(|p| !done.contains(p))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for p in &fresh {
                Self::signal(*p, sig);
            }
            done.extend(fresh);
        }
        if sig == libc::SIGCONT {
            Self::signal(self.pid(), sig);
        }
    }

    fn freeze(&mut self) {
        if let Some(mut p) = self.proxy.take() {
            p.close();
        }
        self.signal_tree(libc::SIGSTOP);
    }

    fn thaw(&mut self, vsock: &Path) -> Result<()> {
        self.signal_tree(libc::SIGCONT);
        self.proxy = Some(Proxy::start(vsock, self.sock.clone())?);
        Ok(())
    }

    fn kill(mut self) {
        if let Some(mut p) = self.proxy.take() {
            p.close();
        }
        // Stopped first, so that the tree cannot change while it is killed.
        self.signal_tree(libc::SIGSTOP);
        for p in self.descendants() {
            Self::signal(p, libc::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.sock);
    }
}

/// See the module documentation.
pub struct HostAgentDriver {
    agent: PathBuf,
    /// Running agents by pid.
    running: Mutex<HashMap<i32, Agent>>,
    /// Frozen agents by the snapshot (pause directory) that resumes them.
    frozen: Mutex<HashMap<PathBuf, Agent>>,
    /// A snapshot was taken of the agent behind this API socket: its next stop freezes.
    snapshots: Mutex<HashMap<PathBuf, PathBuf>>,
}

impl HostAgentDriver {
    /// A driver that starts `agent` (a `clade-agent` executable) per sandbox.
    pub fn new(agent: PathBuf) -> Self {
        Self {
            agent,
            running: Mutex::new(HashMap::new()),
            frozen: Mutex::new(HashMap::new()),
            snapshots: Mutex::new(HashMap::new()),
        }
    }

    /// Writes the template sandboxes of this driver are created from (`host-agent`).
    pub fn install_template(state_dir: &Path) -> Result<()> {
        let dir = state_dir.join("templates").join(TEMPLATE);
        let snap = dir.join(crate::template::SNAPSHOT_DIR);
        std::fs::create_dir_all(&snap).map_err(Error::io("creating", &snap))?;
        let t = crate::template::Template {
            name: TEMPLATE.into(),
            vcpus: 1,
            mem_mib: 0,
            disk: false,
            test_guest: true,
            created_ms: crate::ids::now_ms(),
            setup: vec!["(test harness: host-run clade-agent)".into()],
            net: false,
            image: None,
            boot: None,
            build_id: None,
        };
        let f = dir.join(crate::template::TEMPLATE_FILE);
        let text = serde_json::to_string_pretty(&t).map_err(|e| Error::Corrupt(e.to_string()))?;
        std::fs::write(&f, text).map_err(Error::io("writing", &f))
    }

    fn spawn_agent(&self, spec: &StartSpec) -> Result<Agent> {
        let mut sock = spec.vsock.clone().into_os_string();
        sock.push(".agent");
        let sock = PathBuf::from(sock);
        let _ = std::fs::remove_file(&sock);
        let log = std::fs::File::create(&spec.log).map_err(Error::io("creating", &spec.log))?;
        let mut child = vmm::host::clean_child(&mut Command::new(&self.agent))
            .arg("--listen-unix")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| Error::Vm(format!("starting {}: {e}", self.agent.display())))?;
        // It prints one line once the socket is bound.
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            let _ = BufReader::new(out).read_line(&mut line);
        }
        if !line.starts_with("CLADE-AGENT-LISTENING") {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Vm(format!("host agent did not start: {line:?}")));
        }
        let mut agent = Agent {
            child,
            sock,
            proxy: None,
        };
        match Proxy::start(&spec.vsock, agent.sock.clone()) {
            Ok(p) => agent.proxy = Some(p),
            Err(e) => {
                agent.kill();
                return Err(e);
            }
        }
        Ok(agent)
    }
}

/// The agents are this driver's children: they end with it, with everything they started
/// (a test harness leaves nothing running; `clade serve` keeps its driver until it exits).
impl Drop for HostAgentDriver {
    fn drop(&mut self) {
        let running: Vec<Agent> = lock(&self.running).drain().map(|(_, a)| a).collect();
        let frozen: Vec<Agent> = lock(&self.frozen).drain().map(|(_, a)| a).collect();
        for a in running.into_iter().chain(frozen) {
            a.kill();
        }
    }
}

impl VmDriver for HostAgentDriver {
    fn start(&self, spec: &StartSpec) -> Result<Started> {
        let thawed = lock(&self.frozen).remove(&spec.snapshot);
        let agent = match thawed {
            Some(mut a) => {
                tracing::debug!(pid = a.pid(), "host agent: resumed (SIGCONT)");
                if let Err(e) = a.thaw(&spec.vsock) {
                    a.kill();
                    return Err(e);
                }
                a
            }
            None => self.spawn_agent(spec)?,
        };
        let pid = agent.pid();
        lock(&self.running).insert(pid, agent);
        Ok(Started {
            pid,
            api_sock: spec.api_sock.clone(),
        })
    }

    fn snapshot(&self, api_sock: &Path, dir: &Path, _diff: bool) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(Error::io("creating", dir))?;
        let f = dir.join(MARKER);
        std::fs::write(
            &f,
            "no memory: host-agent test harness (the agent is frozen)\n",
        )
        .map_err(Error::io("writing", &f))?;
        lock(&self.snapshots).insert(api_sock.to_path_buf(), dir.to_path_buf());
        Ok(())
    }

    fn set_vcpus_running(&self, _api_sock: &Path, _running: bool) -> Result<()> {
        // The harness's "VM" has no vCPUs: a pause freezes its agent when the process is
        // stopped after the (memoryless) snapshot, which is all the harness can remember.
        Ok(())
    }

    fn stop(&self, pid: i32, api_sock: &Path) -> Result<()> {
        let snapshot = lock(&self.snapshots).remove(api_sock);
        let Some(mut agent) = lock(&self.running).remove(&pid) else {
            return Ok(());
        };
        match snapshot {
            // A pause: the "VM" keeps its processes until it is resumed from `dir`.
            Some(dir) => {
                agent.freeze();
                tracing::debug!(pid, "host agent: paused (SIGSTOP)");
                lock(&self.frozen).insert(dir, agent);
            }
            None => agent.kill(),
        }
        Ok(())
    }

    fn fork(
        &self,
        _api_sock: &Path,
        _count: usize,
        _prefix: &Path,
        _agent_sync: bool,
        _nets: &[String],
    ) -> Result<Vec<ForkedChild>> {
        Err(Error::Vm("the host-agent test harness cannot fork".into()))
    }

    fn exited(&self, pid: i32, _api_sock: &Path) -> Option<String> {
        let mut running = lock(&self.running);
        match running.get_mut(&pid) {
            None => Some(format!("host agent {pid} is gone")),
            Some(a) => match a.child.try_wait() {
                Ok(None) => None,
                Ok(Some(st)) => {
                    if let Some(a) = running.remove(&pid) {
                        a.kill();
                    }
                    Some(format!("host agent {pid} {st}"))
                }
                Err(e) => Some(format!("host agent {pid}: {e}")),
            },
        }
    }

    fn guest_is_host(&self) -> bool {
        true
    }
}

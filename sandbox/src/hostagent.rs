//! **Test harness, never the default**: a [`VmDriver`] whose "VM" is a host-run
//! `clade-agent --listen-unix <vsock path>`, so the data plane and the e2b SDK can be
//! exercised end to end on machines that cannot boot a Linux guest (this project's
//! development machines: see ENVIRONMENT.md). The "guest" is the host: commands run as
//! the service's user, on the host's filesystem. `clade serve --test-host-agent` turns it
//! on and says so loudly.
//!
//! Pause stops the agent (its processes die, as a pause-resume loses vsock connections in
//! a real VM too) and writes a marker as the "snapshot"; resume starts a new agent. Fork
//! is refused.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::vmproc::{ForkedChild, StartSpec, VmDriver};

/// The name of the template [`HostAgentDriver::install_template`] writes.
pub const TEMPLATE: &str = "host-agent";

/// See the module documentation.
pub struct HostAgentDriver {
    agent: PathBuf,
    children: Mutex<HashMap<i32, Child>>,
}

impl HostAgentDriver {
    /// A driver that starts `agent` (a `clade-agent` executable) per sandbox.
    pub fn new(agent: PathBuf) -> Self {
        Self {
            agent,
            children: Mutex::new(HashMap::new()),
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
        };
        let f = dir.join(crate::template::TEMPLATE_FILE);
        let text = serde_json::to_string_pretty(&t).map_err(|e| Error::Corrupt(e.to_string()))?;
        std::fs::write(&f, text).map_err(Error::io("writing", &f))
    }

    fn kids(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Child>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The agents are this driver's children: they end with it (a test harness leaves
/// nothing running; `clade serve` keeps its driver until it exits).
impl Drop for HostAgentDriver {
    fn drop(&mut self) {
        for (_, mut c) in self.kids().drain() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl VmDriver for HostAgentDriver {
    fn start(&self, spec: &StartSpec) -> Result<i32> {
        let _ = std::fs::remove_file(&spec.vsock);
        let log = std::fs::File::create(&spec.log).map_err(Error::io("creating", &spec.log))?;
        let mut child = Command::new(&self.agent)
            .arg("--listen-unix")
            .arg(&spec.vsock)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| Error::Vm(format!("starting {}: {e}", self.agent.display())))?;
        // It prints one line once the socket is bound.
        let mut line = String::new();
        let out = child.stdout.take();
        if let Some(out) = out {
            let _ = BufReader::new(out).read_line(&mut line);
        }
        if !line.starts_with("CLADE-AGENT-LISTENING") {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Vm(format!("host agent did not start: {line:?}")));
        }
        let pid = child.id() as i32;
        self.kids().insert(pid, child);
        Ok(pid)
    }

    fn snapshot(&self, _api_sock: &Path, dir: &Path, _diff: bool) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(Error::io("creating", dir))?;
        let f = dir.join("HOST-AGENT-MARKER");
        std::fs::write(&f, "no memory: host-agent test harness\n").map_err(Error::io("writing", &f))
    }

    fn stop(&self, pid: i32, _api_sock: &Path) -> Result<()> {
        if let Some(mut c) = self.kids().remove(&pid) {
            let _ = c.kill();
            let _ = c.wait();
        }
        Ok(())
    }

    fn fork(
        &self,
        _api_sock: &Path,
        _count: usize,
        _prefix: &Path,
        _agent_sync: bool,
    ) -> Result<Vec<ForkedChild>> {
        Err(Error::Vm("the host-agent test harness cannot fork".into()))
    }

    fn exited(&self, pid: i32, _api_sock: &Path) -> Option<String> {
        let mut kids = self.kids();
        match kids.get_mut(&pid) {
            None => Some(format!("host agent {pid} is gone")),
            Some(c) => match c.try_wait() {
                Ok(None) => None,
                Ok(Some(st)) => {
                    kids.remove(&pid);
                    Some(format!("host agent {pid} {st}"))
                }
                Err(e) => Some(format!("host agent {pid}: {e}")),
            },
        }
    }
}

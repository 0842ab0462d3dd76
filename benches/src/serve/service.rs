//! The `clade serve` process a serve scenario drives ([`Service`]) and its HTTP clients
//! ([`Client`]: one kept connection each, as an SDK client keeps one), with
//! [`Service::in_parallel`] for the cases that need several clients at once.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::guest::{Guest, Scratch};

const KEY: &str = "clade-bench";

/// The memory of the bench template's guest (`clade template build --mem`), MiB.
pub(crate) const TEMPLATE_MEM_MIB: u64 = 64;

/// The `clade serve` process and its scratch state directory, both removed when dropped
/// (the sandboxes first: their VM processes outlive the service by design).
pub(crate) struct Service {
    child: Child,
    /// The service's state directory, removed when dropped (also when the service could
    /// not be started).
    state: Scratch,
    client: Client,
}

/// One HTTP client of the service: its own kept HTTP/1.1 connection.
#[derive(Clone)]
pub(crate) struct Client {
    url: String,
    agent: ureq::Agent,
}

impl std::ops::Deref for Service {
    type Target = Client;

    /// The service's own client (what the sequential cases use).
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Service {
    /// `clade serve` with `extra` arguments and `env`, of a state directory with template
    /// `bench` built from the native test guest.
    pub(crate) fn start(
        clade: &Path,
        guest: &Guest,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> Result<Service> {
        let state = Scratch::new("serve")?;
        let kernel = guest.path_for_other_processes();
        // The guest's `vsock` step serves any number of agent connections, without a
        // console line per connection (`conn_log=0`): like a Linux guest, a sandbox paused
        // right after a connection ended is not woken into writing the rest of that line
        // an exit per byte (see the native guest's `vsock::Tuning`).
        let cmdline = "steps=vsock conn_log=0";
        let o = Command::new(clade)
            .args(["template", "build", "bench", "--test-device", "--mem"])
            .arg(TEMPLATE_MEM_MIB.to_string())
            .arg("--kernel")
            .arg(&kernel)
            .arg("--cmdline")
            .arg(cmdline)
            .arg("--state-dir")
            .arg(&state.0)
            .output()
            .map_err(|source| Error::Io {
                what: "running clade template build".into(),
                source,
            })?;
        if !o.status.success() {
            return Err(Error::Guest(format!(
                "clade template build: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )));
        }
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| Error::Io {
                what: "finding a free port".into(),
                source,
            })?;
            l.local_addr()
                .map_err(|source| Error::Io {
                    what: "finding a free port".into(),
                    source,
                })?
                .port()
        };
        let child = Command::new(clade)
            .arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--state-dir")
            .arg(&state.0)
            // The key in the environment: a command line is visible to every local user.
            .env("CLADE_API_KEY", KEY)
            .args(["--max-timeout", "86400"])
            .args(extra)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            // CLADE_BENCH_SERVE_LOG=FILE keeps the service's log (with CLADE_LOG=info: the
            // timings of each create and resume).
            .stderr(
                match std::env::var_os("CLADE_BENCH_SERVE_LOG")
                    .and_then(|f| File::options().create(true).append(true).open(f).ok())
                {
                    Some(f) => Stdio::from(f),
                    None => Stdio::null(),
                },
            )
            .spawn()
            .map_err(|source| Error::Io {
                what: "starting clade serve".into(),
                source,
            })?;
        let service = Service {
            child,
            state,
            client: Client::new(format!("http://127.0.0.1:{port}")),
        };
        let t = Instant::now();
        while service.call("GET", "/v2/sandboxes", None).is_err() {
            if t.elapsed() > Duration::from_secs(20) {
                return Err(Error::Guest(
                    "clade serve did not answer within 20 s".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(service)
    }

    /// The `clade serve` process's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A new client with a connection of its own.
    pub(crate) fn client(&self) -> Client {
        Client::new(self.client.url.clone())
    }

    /// The directory of the sandboxes' directories (`<state>/sandboxes`).
    pub(crate) fn sandboxes_dir(&self) -> PathBuf {
        self.state.0.join("sandboxes")
    }

    /// The vsock socket of sandbox `id`'s VM.
    pub(crate) fn vsock(&self, id: &str) -> PathBuf {
        self.state.0.join("sandboxes").join(id).join("vm.vsock")
    }

    /// `f` of each of `items`, by `clients` threads with a client each (items taken in
    /// order, as each thread becomes free); the results in the order of `items`.
    pub(crate) fn in_parallel<I: Sync, T: Send>(
        &self,
        clients: usize,
        items: &[I],
        f: impl Fn(&Client, &I) -> T + Sync,
    ) -> Result<Vec<T>> {
        let next = AtomicUsize::new(0);
        let done = std::thread::scope(|s| {
            let workers: Vec<_> = (0..clients.clamp(1, items.len().max(1)))
                .map(|_| {
                    s.spawn(|| {
                        let client = self.client();
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(item) = items.get(i) else { break };
                            out.push((i, f(&client, item)));
                        }
                        out
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().map_err(|_| Error::ThreadPanicked("client")))
                .collect::<Result<Vec<_>>>()
        })?;
        let mut all: Vec<(usize, T)> = done.into_iter().flatten().collect();
        all.sort_by_key(|(i, _)| *i);
        Ok(all.into_iter().map(|(_, t)| t).collect())
    }
}

impl Client {
    fn new(url: String) -> Client {
        Client {
            url,
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(60))
                .build(),
        }
    }

    /// One request; the answer's JSON body (Null when empty).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        let req = self
            .agent
            .request(method, &format!("{}{path}", self.url))
            .set("X-API-KEY", KEY);
        let resp = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let text = match resp {
            Ok(r) => r.into_string(),
            Err(ureq::Error::Status(code, r)) => {
                return Err(Error::Guest(format!(
                    "{method} {path}: HTTP {code}: {}",
                    r.into_string().unwrap_or_default()
                )))
            }
            Err(e) => return Err(Error::Guest(format!("{method} {path}: {e}"))),
        }
        .map_err(|source| Error::Io {
            what: "reading an HTTP answer".into(),
            source,
        })?;
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text)
            .map_err(|e| Error::Guest(format!("{method} {path}: not JSON ({e}): {text}")))
    }

    pub(crate) fn create(&self) -> Result<String> {
        let v = self.call(
            "POST",
            "/v2/sandboxes",
            Some(json!({"templateID": "bench", "timeout": 3600})),
        )?;
        v["sandboxID"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| Error::Guest(format!("create answered without sandboxID: {v}")))
    }

    /// envd's `GET /health` for sandbox `id`, through the data plane: 204 expected.
    pub(crate) fn health(&self, id: &str) -> Result<()> {
        let r = self
            .agent
            .get(&format!("{}/health", self.url))
            .set("E2b-Sandbox-Id", id)
            .set("E2b-Sandbox-Port", "49983")
            .call()
            .map_err(|e| Error::Guest(format!("GET /health of {id}: {e}")))?;
        if r.status() != 204 {
            return Err(Error::Guest(format!(
                "GET /health of {id}: HTTP {}",
                r.status()
            )));
        }
        Ok(())
    }

    pub(crate) fn kill(&self, id: &str) -> Result<()> {
        self.call("DELETE", &format!("/sandboxes/{id}"), None)
            .map(|_| ())
    }

    pub(crate) fn pause(&self, id: &str) -> Result<()> {
        self.call("POST", &format!("/sandboxes/{id}/pause"), None)
            .map(|_| ())
    }

    pub(crate) fn connect(&self, id: &str) -> Result<()> {
        self.call(
            "POST",
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({"timeout": 3600})),
        )
        .map(|_| ())
    }

    /// Every sandbox the service knows (both states), up to a page of 1,000.
    pub(crate) fn all(&self) -> Result<Vec<String>> {
        let v = self.call("GET", "/v2/sandboxes?state=running,paused&limit=1000", None)?;
        Ok(v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["sandboxID"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // Page after page (a list answers 1,000 at most), while kills make progress.
        for _ in 0..10 {
            let Ok(ids) = self.all() else { break };
            if ids.is_empty() {
                break;
            }
            let killed = self
                .in_parallel(8, &ids, |c, id| c.kill(id).is_ok())
                .unwrap_or_default();
            if !killed.contains(&true) {
                break;
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The state directory goes with `state`, after the service and its VMs.
    }
}

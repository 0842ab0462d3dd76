//! The E2B data plane: envd's protocol served by `clade serve` and translated into Clade's
//! agent protocol over each sandbox's vsock socket.
//!
//! Why here and not in the guest: E2B runs `envd` (HTTP + Connect RPC + protobuf) inside
//! every VM. Clade keeps the guest small — `clade-agent` speaks a compact framed protocol
//! (`guest-agent/PROTOCOL.md`) and knows nothing of HTTP — so the host does the HTTP,
//! Connect and protobuf work once, for every sandbox, and forwards operations.
//!
//! Routing: the SDK sends every data-plane request to `E2B_SANDBOX_URL` with the headers
//! `E2b-Sandbox-Id` and `E2b-Sandbox-Port` (49983, envd's port); clients that address
//! sandboxes by host name use `<port>-<id>.<domain>`. [`route`] recognizes both; the
//! control API shares the listener (its requests carry neither).
//!
//! State kept here, per sandbox ([`SandboxConn`]): one shared agent connection for short
//! operations (stat, list, mkdir…) and the user table; nothing else. Processes started
//! through `Start` are the agent's kept processes (`process`), so they outlive the HTTP
//! stream that started them, a pause and resume (vsock connections do not survive a
//! snapshot, but the guest's processes do) and a restart of this service. Directory
//! watchers (`files`) hold an agent connection each, with their events in a bounded
//! queue; they do not survive a pause or a restart. See docs/e2b-compat.md.
//!
//! A request for a paused sandbox resumes it first when it was created with auto-resume
//! (E2B's `lifecycle.auto_resume`); without, a paused sandbox is not running, and it gets
//! the answer an unknown, killed or crashed one gets: E2B's proxy answer, 502 "... was
//! not found", which the SDK turns into `SandboxNotRunningException` (and `is_running()`
//! into false).

pub mod access;
pub mod connect;
mod files;
pub mod pb;
mod ports;
mod process;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower::ServiceExt;
use vmm::agent::{Client, Transport};

use crate::error::Error;
use crate::host::Host;
use crate::registry::State as SbState;
use connect::{Code, RpcError};

/// The envd version reported for every sandbox (control plane `envdVersion`). The SDK
/// enables features by it: 0.6.3 means default user chosen by the server (>= 0.4.0),
/// stdin control and `CloseStdin` (>= 0.3.0, 0.5.2), octet-stream and gzip uploads
/// (>= 0.5.7), recursive watches (>= 0.1.4), file metadata (>= 0.6.2) and entries in watch
/// events (>= 0.6.3). Watches of network mounts (0.6.4) are not served, so the SDK
/// refuses them client-side.
pub const ENVD_VERSION: &str = "0.6.3";
/// envd's port: the only sandbox port served.
pub const ENVD_PORT: u16 = 49983;
/// How long connecting to a sandbox's agent may take.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Timeout of a sandbox resumed by a data-plane request (seconds; never shortens).
const AUTO_RESUME_TIMEOUT_S: u64 = 300;
/// How long a checked route to a sandbox is used without checking it again (when no
/// sandbox changed meanwhile).
const ROUTE_TTL: Duration = Duration::from_secs(1);

/// Which sandbox a data-plane request is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub sandbox: String,
    pub port: u16,
}

/// The sandbox a request addresses, by `E2b-Sandbox-Id` (+ `E2b-Sandbox-Port`, default
/// envd's) or by a `<port>-<id>.<domain>` host name; `None` for control-plane requests.
pub fn route(h: &HeaderMap) -> Option<Target> {
    if let Some(id) = h.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) {
        let port = h
            .get("e2b-sandbox-port")
            .and_then(|v| v.to_str().ok())
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(ENVD_PORT);
        return Some(Target {
            sandbox: id.trim().to_string(),
            port,
        });
    }
    let host = h.get(header::HOST)?.to_str().ok()?;
    let first = host.split('.').next()?;
    // A bare IP or `localhost:3000` has no `<port>-<id>` label.
    if !host.contains('.') || first.contains(':') {
        return None;
    }
    let (port, id) = first.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return None;
    }
    Some(Target {
        sandbox: id.to_string(),
        port,
    })
}

/// A sandbox user as envd resolves one (`/etc/passwd` in the guest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    /// Supplementary groups (`/etc/group` memberships; the primary group first).
    pub groups: Vec<u32>,
}

impl User {
    fn root() -> Self {
        User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
            groups: vec![0],
        }
    }

    /// `path` made absolute: relative paths are relative to the user's home.
    pub fn resolve(&self, path: &str) -> PathBuf {
        let p = Path::new(path);
        if p.is_absolute() {
            p.to_path_buf()
        } else if let Some(rest) = path.strip_prefix("~/") {
            self.home.join(rest)
        } else if path == "~" || path.is_empty() {
            self.home.clone()
        } else {
            self.home.join(p)
        }
    }
}

/// The guest's users (`/etc/passwd`) and group names by gid (`/etc/group`).
type Accounts = (Vec<User>, HashMap<u32, String>);

/// One sandbox as the data plane sees it.
pub(crate) struct SandboxConn {
    pub id: String,
    /// Its template's id (its name).
    pub template: String,
    pub vsock: PathBuf,
    /// Environment variables given at create time (every process gets them).
    pub env: BTreeMap<String, String>,
    /// Its envd access token ([`access`]); `None`: not secured.
    pub envd_token: Option<String>,
    /// Its traffic access token (exposed ports); `None`: public.
    pub traffic_token: Option<String>,
    /// The user requests that name none run as (its template's), `None`: root.
    default_user: Option<String>,
    /// Where a command that names no working directory starts: its template's (an image's
    /// `WorkingDir`, a Dockerfile's `WORKDIR`, an E2B build's `set_workdir`: envd's
    /// default workdir), `None`: the user's home.
    pub default_cwd: Option<String>,
    client: Mutex<Option<Client>>,
    /// File-operation connections of non-root users (AsUser), by uid.
    user_clients: Mutex<HashMap<u32, Client>>,
    users: Mutex<Option<Accounts>>,
    /// Polling watchers (`CreateWatcher`), by id.
    pub watchers: files::Watchers,
    /// When the route to it was last checked against the host: the host's
    /// [`Host::changes`] then, and the time.
    checked: Mutex<(u64, Instant)>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SandboxConn {
    /// A new connection of its own to the sandbox's agent.
    pub fn connect_new(&self) -> Result<Client, RpcError> {
        Client::connect_timeout(&self.vsock, Transport::Auto, AGENT_CONNECT_TIMEOUT).map_err(|e| {
            RpcError::new(
                Code::Unavailable,
                format!("sandbox {}: its agent cannot be reached: {e}", self.id),
            )
        })
    }

    /// A new connection of its own whose file operations run as `user` (the guest's
    /// kernel checks their permissions; what is created is theirs).
    pub fn connect_as(&self, user: &User) -> Result<Client, RpcError> {
        let c = self.connect_new()?;
        if user.uid != 0 {
            c.as_user(user.uid, user.gid, &user.groups)
                .map_err(RpcError::from)?;
        }
        Ok(c)
    }

    /// Runs the file operation `f` as `user`: with the shared connection for root, else
    /// with that user's own connection (made on first use), reconnecting once if it broke.
    pub fn with_user<T>(
        &self,
        user: &User,
        f: impl Fn(&Client) -> vmm::Result<T>,
    ) -> Result<T, RpcError> {
        if user.uid == 0 {
            return self.with_client(f);
        }
        for attempt in 0..2 {
            let cached = lock(&self.user_clients).get(&user.uid).cloned();
            let c = match cached {
                Some(c) => c,
                None => {
                    let c = self.connect_as(user)?;
                    lock(&self.user_clients).insert(user.uid, c.clone());
                    c
                }
            };
            match f(&c) {
                Err(vmm::Error::AgentDisconnected) if attempt == 0 => {
                    lock(&self.user_clients).remove(&user.uid);
                }
                r => return r.map_err(RpcError::from),
            }
        }
        Err(RpcError::new(Code::Unavailable, "agent connection lost"))
    }

    /// Runs `f` with the shared agent connection, reconnecting once if it broke.
    pub fn with_client<T>(&self, f: impl Fn(&Client) -> vmm::Result<T>) -> Result<T, RpcError> {
        for attempt in 0..2 {
            let c = {
                let mut g = lock(&self.client);
                match &*g {
                    Some(c) => c.clone(),
                    None => {
                        let c = self.connect_new()?;
                        *g = Some(c.clone());
                        c
                    }
                }
            };
            match f(&c) {
                Err(vmm::Error::AgentDisconnected) if attempt == 0 => {
                    *lock(&self.client) = None;
                }
                r => return r.map_err(RpcError::from),
            }
        }
        Err(RpcError::new(Code::Unavailable, "agent connection lost"))
    }

    fn load_users(&self) -> Result<(), RpcError> {
        if lock(&self.users).is_some() {
            return Ok(());
        }
        let read = |p: &str| {
            self.with_client(|c| c.read_file(p))
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default()
        };
        let passwd = read("/etc/passwd");
        let group = read("/etc/group");
        let users: Vec<User> = passwd
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                if f.len() < 6 {
                    return None;
                }
                Some(User {
                    name: f[0].to_string(),
                    uid: f[2].parse().ok()?,
                    gid: f[3].parse().ok()?,
                    home: PathBuf::from(f[5]),
                    groups: Vec::new(),
                })
            })
            .collect();
        let mut users = users;
        for u in &mut users {
            u.groups.push(u.gid);
        }
        for l in group.lines() {
            let f: Vec<&str> = l.split(':').collect();
            let Some(gid) = f.get(2).and_then(|g| g.parse::<u32>().ok()) else {
                continue;
            };
            for member in f.get(3).map(|m| m.split(',')).into_iter().flatten() {
                for u in users.iter_mut().filter(|u| u.name == member) {
                    if !u.groups.contains(&gid) && u.groups.len() < guest_agent::proto::MAX_GROUPS {
                        u.groups.push(gid);
                    }
                }
            }
        }
        let groups: HashMap<u32, String> = group
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                if f.len() < 3 {
                    return None;
                }
                Some((f[2].parse().ok()?, f[0].to_string()))
            })
            .collect();
        *lock(&self.users) = Some((users, groups));
        Ok(())
    }

    /// The user a request runs as: `name`, or when none is given the template's user (an
    /// image's or a Dockerfile's `USER`, an E2B build's `set_user`), else root (envd >=
    /// 0.4.0 lets the server pick).
    pub fn user(&self, name: Option<&str>) -> Result<User, RpcError> {
        let name = match (name, self.default_user.as_deref()) {
            (Some("root"), _) | (None | Some(""), None) => return Ok(self.user_by_uid(0)),
            (None | Some(""), Some(d)) => {
                // `user`, `uid`, `user:group`, `uid:gid`: the user part decides.
                let u = d.split(':').next().unwrap_or(d);
                return match u.parse::<u32>() {
                    Ok(uid) => Ok(self.user_by_uid_or_bare(uid)),
                    Err(_) if u == "root" || u.is_empty() => Ok(self.user_by_uid(0)),
                    Err(_) => self.user(Some(u)),
                };
            }
            (Some(n), _) => n,
        };
        self.load_users()?;
        let g = lock(&self.users);
        g.as_ref()
            .and_then(|(u, _)| u.iter().find(|u| u.name == name).cloned())
            .ok_or_else(|| {
                RpcError::new(
                    Code::InvalidArgument,
                    format!("user '{name}' does not exist in sandbox {}", self.id),
                )
            })
    }

    /// The user of `uid`, or one with no account (its uid as gid, `/` as home).
    fn user_by_uid_or_bare(&self, uid: u32) -> User {
        let u = self.user_by_uid(uid);
        if u.uid == uid {
            return u;
        }
        User {
            name: uid.to_string(),
            uid,
            gid: uid,
            home: "/".into(),
            groups: vec![uid],
        }
    }

    fn user_by_uid(&self, uid: u32) -> User {
        if self.load_users().is_ok() {
            if let Some((users, _)) = lock(&self.users).as_ref() {
                if let Some(u) = users.iter().find(|u| u.uid == uid) {
                    return u.clone();
                }
            }
        }
        User::root()
    }

    /// Owner and group names for `EntryInfo` (numbers when unknown).
    pub fn names(&self, uid: u32, gid: u32) -> (String, String) {
        let _ = self.load_users();
        let g = lock(&self.users);
        let (users, groups) = match g.as_ref() {
            Some(x) => (&x.0[..], Some(&x.1)),
            None => (&[][..], None),
        };
        let owner = users
            .iter()
            .find(|u| u.uid == uid)
            .map(|u| u.name.clone())
            .unwrap_or_else(|| uid.to_string());
        let group = groups
            .and_then(|g| g.get(&gid).cloned())
            .unwrap_or_else(|| gid.to_string());
        (owner, group)
    }
}

/// The data plane: sandboxes' connections and process tables.
pub struct DataPlane {
    host: Arc<Host>,
    sandboxes: Mutex<HashMap<String, Arc<SandboxConn>>>,
}

impl DataPlane {
    pub fn new(host: Arc<Host>) -> Arc<Self> {
        Arc::new(Self {
            host,
            sandboxes: Mutex::new(HashMap::new()),
        })
    }

    /// The access tokens of sandbox `t` (envd's, the traffic one), read without waking
    /// it: a request is checked before it may resume a paused sandbox. From the route
    /// cache when it is fresh, else one registry read.
    pub(crate) async fn tokens(
        &self,
        t: &Target,
    ) -> Result<(Option<String>, Option<String>), Response> {
        if let Some(c) = self.fresh_route(&t.sandbox) {
            return Ok((c.envd_token.clone(), c.traffic_token.clone()));
        }
        match get_record(&self.host, &t.sandbox).await {
            Ok(rec) => Ok((rec.envd_token, rec.traffic_token)),
            Err(Error::NotFound(id)) => Err(proxy_error(format!("The sandbox {id} was not found"))),
            Err(e) => Err(proxy_error(format!("sandbox {}: {e}", t.sandbox))),
        }
    }

    /// The cached route to sandbox `id`, if it was checked a moment ago and no sandbox
    /// changed since: still good. That skips the registry read and the VM process's
    /// liveness check (/proc reads) on most requests. A VM that died since shows as an
    /// agent error, and is seen by the full check at most ROUTE_TTL later.
    fn fresh_route(&self, id: &str) -> Option<Arc<SandboxConn>> {
        let changes = self.host.changes();
        let map = lock(&self.sandboxes);
        let c = map.get(id)?;
        let (seen, at) = *lock(&c.checked);
        (seen == changes && at.elapsed() < ROUTE_TTL).then(|| c.clone())
    }

    /// The sandbox `t` names, resumed if it was paused with auto-resume.
    pub(crate) async fn sandbox(
        self: &Arc<Self>,
        t: &Target,
    ) -> Result<Arc<SandboxConn>, Response> {
        if let Some(c) = self.fresh_route(&t.sandbox) {
            return Ok(c);
        }
        let changes = self.host.changes();
        let rec = self.record(&t.sandbox).await?;
        let Some(vsock) = rec.vsock.clone() else {
            return Err(proxy_error(format!(
                "The sandbox {} was not found (no agent socket)",
                t.sandbox
            )));
        };
        let map = lock(&self.sandboxes);
        if let Some(c) = map.get(&rec.id) {
            if c.vsock == vsock {
                *lock(&c.checked) = (changes, Instant::now());
                return Ok(c.clone());
            }
        }
        drop(map);
        // Its template's user and working directory (a file read, once per route).
        let image = self.host.template(&rec.template).ok().and_then(|t| t.image);
        let (default_user, default_cwd) = match image {
            Some(i) => (
                Some(i.user).filter(|u| !u.is_empty()),
                Some(i.cwd).filter(|c| !c.is_empty()),
            ),
            None => (None, None),
        };
        let mut map = lock(&self.sandboxes);
        // New, or resumed since (a new VM process: old connections and processes are gone).
        let c = Arc::new(SandboxConn {
            id: rec.id.clone(),
            template: rec.template.clone(),
            vsock,
            env: rec.env_vars.clone(),
            envd_token: rec.envd_token.clone(),
            traffic_token: rec.traffic_token.clone(),
            default_user,
            default_cwd,
            client: Mutex::new(None),
            user_clients: Mutex::new(HashMap::new()),
            users: Mutex::new(None),
            watchers: Default::default(),
            checked: Mutex::new((changes, Instant::now())),
        });
        map.insert(rec.id.clone(), c.clone());
        Ok(c)
    }

    /// The running sandbox `id` (resumed first if it was paused with auto-resume), or
    /// E2B's proxy answer for one that is not running.
    async fn record(self: &Arc<Self>, id: &str) -> Result<crate::registry::Record, Response> {
        let host = self.host.clone();
        let owned = id.to_string();
        // The lookup is one indexed registry read and a liveness check (no process
        // start): done inline, it saves a hop to the blocking pool on every request.
        // Only a resume goes there.
        let rec = match get_record(&host, id).await {
            // Paused is paused: only a sandbox created with auto-resume is woken by a
            // request. The rest get E2B's answer for a sandbox that is not running (the
            // SDK's `is_running()` is false, its calls raise "not running").
            // One paused without its memory is not either: it boots, which only an explicit
            // connect asks for (as E2B has it).
            Ok(rec) if rec.state == SbState::Paused && (!rec.auto_resume || rec.memory_dropped) => {
                return Err(proxy_error(format!(
                    "The sandbox {owned} was not found: it is paused (connect or resume wakes it)"
                )));
            }
            Ok(rec) if rec.state == SbState::Paused => crate::run_blocking(move || {
                tracing::info!(sandbox = %owned, "auto-resume for a data-plane request");
                host.connect(&owned, AUTO_RESUME_TIMEOUT_S, false)
                    .map(|(r, _)| r)
            })
            .await
            .map_err(|e| proxy_error(format!("worker: {e}")))?,
            Ok(rec) if rec.state == SbState::Crashed => Err(Error::NotFound(owned)),
            r => r,
        };
        match rec {
            Ok(r) => Ok(r),
            Err(Error::NotFound(id)) | Err(Error::Crashed { id, .. }) => {
                lock(&self.sandboxes).remove(&id);
                Err(proxy_error(format!("The sandbox {id} was not found")))
            }
            Err(e) => Err(proxy_error(format!("sandbox {id}: {e}"))),
        }
    }
}

/// Sandbox `id` as [`Host::get`] has it: this host's registry read inline (one indexed
/// read), the store (a network round trip) on the blocking pool only when the registry
/// does not have it.
async fn get_record(host: &Arc<Host>, id: &str) -> crate::Result<crate::registry::Record> {
    match host.get_local(id) {
        Err(Error::NotFound(_)) if host.durable().is_some() => {
            let (h, owned) = (host.clone(), id.to_string());
            crate::run_blocking(move || h.get(&owned))
                .await
                .map_err(|e| Error::Vm(format!("worker: {e}")))?
        }
        r => r,
    }
}

/// E2B's proxy answer for a sandbox that is not there: 502 with a JSON message.
fn proxy_error(message: String) -> Response {
    (
        StatusCode::BAD_GATEWAY,
        axum::Json(serde_json::json!({"code": 502, "message": message})),
    )
        .into_response()
}

/// The user named by `Authorization: Basic base64(user:)`, as the SDK sends it.
pub(crate) fn basic_user(h: &HeaderMap) -> Option<String> {
    use base64::Engine;
    let v = h.get(header::AUTHORIZATION)?.to_str().ok()?;
    let b = v.strip_prefix("Basic ")?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let user = s.split(':').next()?.to_string();
    (!user.is_empty()).then_some(user)
}

/// What [`dispatch`] hands sandbox requests to: envd's routes, and the data plane itself
/// for other ports ([`ports`]).
#[derive(Clone)]
pub struct Routes {
    envd: Router,
    dp: Arc<DataPlane>,
}

impl Routes {
    pub fn new(dp: Arc<DataPlane>) -> Self {
        Self {
            envd: router(dp.clone()),
            dp,
        }
    }
}

/// The data-plane router (requests already carry their [`Target`] as an extension).
pub fn router(dp: Arc<DataPlane>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route(
            "/files",
            get(files::download)
                .post(files::upload)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/process.Process/{method}", post(process::dispatch))
        .route("/filesystem.Filesystem/{method}", post(files::dispatch))
        .fallback(unknown)
        .with_state(dp)
}

async fn unknown(req: Request) -> Response {
    RpcError::new(
        Code::Unimplemented,
        format!("{} {} is not served", req.method(), req.uri().path()),
    )
    .unary_response()
}

/// `GET /health`: 204 once the sandbox's agent answers a ping.
async fn health(State(dp): State<Arc<DataPlane>>, req: Request) -> Response {
    let sb = match target_sandbox(&dp, req.extensions().get::<Target>().cloned()).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    match crate::run_blocking(move || sb.with_client(|c| c.ping())).await {
        Ok(Ok(_)) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => proxy_error(format!(
            "The sandbox is running but port {ENVD_PORT} is not open: {}",
            e.message
        )),
        Err(e) => proxy_error(format!("worker: {e}")),
    }
}

/// The sandbox of a request (its [`Target`], put there by [`dispatch`]).
pub(crate) async fn target_sandbox(
    dp: &Arc<DataPlane>,
    t: Option<Target>,
) -> Result<Arc<SandboxConn>, Response> {
    let t = t.ok_or_else(|| proxy_error("no sandbox named in the request".into()))?;
    dp.sandbox(&t).await
}

/// Middleware in front of the control API: requests addressed to a sandbox go to the
/// data plane.
pub async fn dispatch(State(data): State<Routes>, mut req: Request, next: Next) -> Response {
    match route(req.headers()) {
        Some(t) if t.port != ENVD_PORT => ports::forward(data.dp, t, req).await,
        Some(t) => {
            // A secured sandbox's token (or a signed URL) first (see `access`), before
            // anything may wake it.
            let (envd_token, _) = match data.dp.tokens(&t).await {
                Ok(x) => x,
                Err(r) => return r,
            };
            let grant = match &envd_token {
                Some(token) => {
                    let now_s = crate::ids::now_ms().div_euclid(1000);
                    let uri = req.uri();
                    match access::check_envd(
                        token,
                        req.method(),
                        uri.path(),
                        uri.query(),
                        req.headers(),
                        now_s,
                    ) {
                        Ok(g) => g,
                        Err(r) => return r.into_response(),
                    }
                }
                None => access::Grant::Full,
            };
            req.extensions_mut().insert(t);
            req.extensions_mut().insert(grant);
            match data.envd.oneshot(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            }
        }
        None => next.run(req).await,
    }
}

/// Reads a whole request body of at most `limit` bytes.
pub(crate) async fn read_body(req: Request, limit: usize) -> Result<axum::body::Bytes, RpcError> {
    axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|e| {
            RpcError::new(
                Code::ResourceExhausted,
                format!("request body over {limit} bytes or unreadable: {e}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_by_header_or_host() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "127.0.0.1:3000".parse().unwrap());
        assert_eq!(route(&h), None);
        h.insert(header::HOST, "localhost".parse().unwrap());
        assert_eq!(route(&h), None);
        h.insert(header::HOST, "49983-abc123.example.org".parse().unwrap());
        assert_eq!(
            route(&h),
            Some(Target {
                sandbox: "abc123".into(),
                port: 49983
            })
        );
        h.insert(header::HOST, "api.example.org".parse().unwrap());
        assert_eq!(route(&h), None);
        h.insert("e2b-sandbox-id", "zz9".parse().unwrap());
        h.insert("e2b-sandbox-port", "49983".parse().unwrap());
        assert_eq!(
            route(&h),
            Some(Target {
                sandbox: "zz9".into(),
                port: 49983
            })
        );
    }

    #[test]
    fn users_and_paths() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_user(&h), None);
        h.insert(header::AUTHORIZATION, "Basic dXNlcjo=".parse().unwrap());
        assert_eq!(basic_user(&h).as_deref(), Some("user"));
        h.insert(header::AUTHORIZATION, "Basic !!!".parse().unwrap());
        assert_eq!(basic_user(&h), None);
        let u = User::root();
        assert_eq!(u.resolve("a/b"), PathBuf::from("/root/a/b"));
        assert_eq!(u.resolve("~/x"), PathBuf::from("/root/x"));
        assert_eq!(u.resolve("/etc"), PathBuf::from("/etc"));
    }
}

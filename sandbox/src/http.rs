//! The E2B control API over HTTP (axum): paths, JSON shapes, status codes and error bodies
//! as the `e2b` Python SDK (pinned in `tests/e2b/requirements.txt`) calls and parses them.
//! See `docs/e2b-compat.md` for what differs from E2B's own service.
//!
//! Every request needs the `X-API-KEY` header; errors are `{"code": N, "message": "..."}`
//! like E2B's. Request bodies are parsed here (not by axum's extractors) so that malformed
//! JSON gets the same error body as any other bad input. The lifecycle calls block (they
//! start and stop processes), so they run on tokio's blocking pool.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, Request, State as AxState};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch, post, put};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::Error;
use crate::host::{CreateRequest, EgressPolicy, Host, LogLine, PauseOptions, DEFAULT_TAG};
use crate::ids;
use crate::registry::{Query, Record, SnapshotQuery, SnapshotRecord, State};
use crate::template::tags::template_of;

/// The envd version reported for every sandbox: what the data plane ([`crate::envd`])
/// serves. The SDK picks data-plane features by it.
pub const ENVD_VERSION: &str = crate::envd::ENVD_VERSION;
/// `clientID` in every answer (E2B's identifies the orchestrator node; one host here).
pub const CLIENT_ID: &str = "clade";
/// E2B's default sandbox timeout (seconds) when a request gives none.
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// E2B's default page size of `GET /v2/sandboxes`, and its largest.
pub const DEFAULT_PAGE: usize = 100;
/// Largest page.
pub const MAX_PAGE: usize = 1000;
/// E2B's default and largest number of log lines per request.
pub const LOG_PAGE: usize = 1000;
/// The `error_code` of a 503 that says this host has no room ([`Error::NoRoom`]): a
/// cluster's gateway then tries another node.
pub const NO_ROOM: &str = "no_room";

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    /// The sandbox host.
    pub host: Arc<Host>,
    /// The API key every request must carry.
    pub api_key: Arc<String>,
    /// The domain sandboxes are reached under (`clade serve --domain`): answered as each
    /// sandbox's `domain`, so that the SDK builds `<port>-<id>.<domain>` host names.
    pub domain: Option<Arc<String>>,
    /// The dashboard's login sessions ([`crate::dashboard`]).
    pub sessions: Arc<crate::dashboard::Sessions>,
    /// Template builds ([`crate::build`]).
    pub builds: Arc<crate::build::Builds>,
}

impl axum::extract::FromRef<AppState> for crate::dashboard::DashboardState {
    fn from_ref(st: &AppState) -> Self {
        crate::dashboard::DashboardState {
            api_key: st.api_key.clone(),
            sessions: st.sessions.clone(),
        }
    }
}

/// An error answer: status plus E2B's error body.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    error_code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            error_code: None,
        }
    }

    fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn with_code(mut self, code: &'static str) -> Self {
        self.error_code = Some(code);
        self
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::NotFound(_) | Error::SnapshotNotFound(_) => StatusCode::NOT_FOUND,
            Error::Crashed { .. } => StatusCode::NOT_FOUND,
            Error::BadRequest(_) | Error::TemplateNotFound(_) => StatusCode::BAD_REQUEST,
            Error::Conflict(_) | Error::Fenced { .. } => StatusCode::CONFLICT,
            Error::Cluster(_) | Error::NoRoom(_) => StatusCode::SERVICE_UNAVAILABLE,
            // E2B's answer: the SDK raises ServiceBusyException.
            Error::GuestUnresponsive { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("{e}");
        }
        Self {
            status,
            error_code: match e {
                Error::Crashed { .. } => Some("sandbox_crashed"),
                Error::NoRoom(_) => Some(NO_ROOM),
                _ => None,
            },
            message: e.to_string(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"code": self.status.as_u16(), "message": self.message});
        if let Some(c) = self.error_code {
            body["error_code"] = json!(c);
        }
        (self.status, Json(body)).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Runs a blocking lifecycle call ([`crate::run_blocking`]).
async fn blocking<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce(&Host) -> crate::Result<T> + Send + 'static,
) -> ApiResult<T> {
    let host = st.host.clone();
    crate::run_blocking(move || f(&host))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("worker: {e}")))?
        .map_err(ApiError::from)
}

/// Parses a JSON body; an empty body is `{}`.
fn body<T: DeserializeOwned>(bytes: &Bytes) -> ApiResult<T> {
    let bytes: &[u8] = if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        b"{}"
    } else {
        bytes
    };
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad(format!("invalid request body: {e}")))
}

/// A JSON object of strings (`metadata`, `envVars`), or absent/null.
fn string_map(v: Option<Value>, what: &str) -> ApiResult<BTreeMap<String, String>> {
    match v {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m
            .into_iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k, s)),
                other => Err(ApiError::bad(format!(
                    "{what}.{k}: expected a string, got {other}"
                ))),
            })
            .collect(),
        Some(other) => Err(ApiError::bad(format!(
            "{what}: expected an object, got {other}"
        ))),
    }
}

fn timeout_of(v: Option<i64>) -> ApiResult<u64> {
    match v {
        None => Ok(DEFAULT_TIMEOUT_S),
        Some(t) if t >= 0 => Ok(t as u64),
        Some(t) => Err(ApiError::bad(format!("timeout must not be negative: {t}"))),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<i64>,
    auto_pause: Option<bool>,
    /// What a timeout's pause keeps: `false` asks for a filesystem-only pause.
    auto_pause_memory: Option<bool>,
    auto_resume: Option<AutoResume>,
    metadata: Option<Value>,
    env_vars: Option<Value>,
    /// `false`: deny all egress (E2B's shorthand for `denyOut: ["0.0.0.0/0"]`).
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<NetworkBody>,
    /// E2B's old switch for an envd access token: on unless `false` (the SDK no longer
    /// sends it: every E2B sandbox is secured).
    secure: Option<bool>,
    // Accepted, not acted on (see docs/e2b-compat.md): mcp, iam, volumeMounts.
}

/// A create request (E2B's JSON) for a sandbox like `rec`, from `template`: its metadata,
/// env vars, lifecycle, access tokens (new ones) and egress policy. A cluster makes the
/// children of a fork that do not fit on their parent's node with it, from a snapshot of
/// the parent (whose memory gives them its running processes).
pub fn create_like(rec: &Record, template: &str) -> Value {
    let mut b = json!({
        "templateID": template,
        "metadata": rec.metadata,
        "envVars": rec.env_vars,
        "autoPause": rec.auto_pause,
        "secure": rec.envd_token.is_some(),
    });
    if rec.auto_pause {
        b["autoResume"] = json!({ "enabled": rec.auto_resume });
        if !rec.pause_keeps_memory {
            b["autoPauseMemory"] = json!(false);
        }
    }
    let mut network = json!({ "allowPublicTraffic": rec.traffic_token.is_none() });
    if let Some(m) = &rec.mask_host {
        network["maskRequestHost"] = json!(m);
    }
    if let Some(p) = rec
        .egress
        .as_deref()
        .and_then(|j| serde_json::from_str::<EgressPolicy>(j).ok())
    {
        let allow: Vec<String> = p
            .allow
            .iter()
            .map(ToString::to_string)
            .chain(p.allow_domains.iter().cloned())
            .collect();
        let deny: Vec<String> = p.deny.iter().map(ToString::to_string).collect();
        network["allowOut"] = json!(allow);
        network["denyOut"] = json!(deny);
        b["allow_internet_access"] = json!(p.default == hostnet::PolicyDefault::Allow);
    }
    b["network"] = network;
    b
}

/// E2B's `autoResume` of a create: `{"enabled": bool}`.
#[derive(Deserialize)]
struct AutoResume {
    enabled: bool,
}

/// The lifecycle a create asks for, checked as E2B checks it: (auto-pause, auto-resume,
/// whether the timeout's pause keeps memory).
fn lifecycle_of(b: &NewSandbox) -> ApiResult<(bool, bool, bool)> {
    let auto_pause = b.auto_pause.unwrap_or(false);
    let auto_resume = b.auto_resume.as_ref().is_some_and(|a| a.enabled);
    if b.auto_pause_memory.is_some() && !auto_pause {
        return Err(ApiError::bad(
            "autoPauseMemory applies only when the timeout pauses (autoPause: true)",
        ));
    }
    if auto_resume && !auto_pause {
        return Err(ApiError::bad(
            "autoResume can be enabled only when the timeout pauses (autoPause: true)",
        ));
    }
    // `null` is a full pause, as an absent field.
    let keeps_memory = b.auto_pause_memory != Some(false);
    if !keeps_memory && auto_resume {
        return Err(ApiError::bad(
            "autoResume cannot be combined with a filesystem-only pause \
             (autoPauseMemory: false): such a sandbox must be resumed with connect",
        ));
    }
    Ok((auto_pause, auto_resume, keeps_memory))
}

/// E2B's `network` of a create, and the body of `PUT /sandboxes/{id}/network` (which
/// carries `allow_internet_access` itself).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NetworkBody {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    dns_servers: Option<Vec<String>>,
    egress_proxy: Option<Value>,
    rules: Option<Value>,
    https_ports: Option<Vec<Value>>,
    /// `false`: its exposed ports need its traffic access token (creation only).
    allow_public_traffic: Option<bool>,
    /// The Host header its exposed ports see, `${PORT}` replaced (creation only).
    mask_request_host: Option<String>,
}

impl NetworkBody {
    /// The egress policy this asks for (with `allow_internet_access` from wherever the
    /// request carries it). What this host cannot do is refused, never dropped quietly.
    fn policy(self, allow_internet_access: Option<bool>) -> ApiResult<EgressPolicy> {
        let refuse = |what: &str| {
            Err(ApiError::bad(format!(
                "network.{what} is not supported by this host (see docs/e2b-compat.md)"
            )))
        };
        if self.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
            return refuse("dnsServers");
        }
        if self.egress_proxy.as_ref().is_some_and(|v| !v.is_null()) {
            return refuse("egressProxy");
        }
        if self
            .rules
            .as_ref()
            .is_some_and(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
        {
            return refuse("rules");
        }
        if self.https_ports.as_ref().is_some_and(|p| !p.is_empty()) {
            return refuse("httpsPorts");
        }
        EgressPolicy::from_e2b(
            allow_internet_access
                .or(self.allow_internet_access)
                .unwrap_or(true),
            self.allow_out.as_deref().unwrap_or_default(),
            self.deny_out.as_deref().unwrap_or_default(),
        )
        .map_err(|e| ApiError::bad(format!("network: {e}")))
    }
}

#[derive(Deserialize, Default)]
struct TimeoutBody {
    timeout: Option<i64>,
    /// Of a connect or resume: `false` asks to reboot from the disk, memory dropped.
    memory: Option<bool>,
}

/// The body of a pause: `memory: false` asks for a filesystem-only pause.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PauseBody {
    memory: Option<bool>,
    /// Refuse the pause when the guest agent does not answer (the SDK's `strict`).
    require_healthy_guest: Option<bool>,
}

#[derive(Deserialize, Default)]
struct RefreshBody {
    duration: Option<i64>,
}

#[derive(Deserialize, Default)]
struct SnapshotBody {
    name: Option<String>,
    memory: Option<bool>,
}

#[derive(Deserialize, Default)]
struct ForkBody {
    timeout: Option<i64>,
    count: Option<i64>,
}

/// `Sandbox` of the spec: what create, connect, resume and fork answer.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SandboxOut {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    alias: String,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    envd_version: &'static str,
    domain: Option<String>,
    /// What every data-plane request for it must carry (`X-Access-Token`); left out for
    /// a sandbox that is not secured.
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    /// What requests for its exposed ports must carry (`e2b-traffic-access-token`).
    traffic_access_token: Option<String>,
}

fn sandbox_out(st: &AppState, r: &Record) -> SandboxOut {
    SandboxOut {
        template_id: template_of(&r.template).to_string(),
        sandbox_id: r.id.clone(),
        alias: template_of(&r.template).to_string(),
        client_id: CLIENT_ID,
        envd_version: ENVD_VERSION,
        domain: st.domain.as_deref().cloned(),
        envd_access_token: r.envd_token.clone(),
        traffic_access_token: r.traffic_token.clone(),
    }
}

/// `ListedSandbox` / `SandboxDetail` of the spec.
fn listed(r: &Record, detail: bool) -> Value {
    let mut v = json!({
        "templateID": template_of(&r.template),
        "alias": template_of(&r.template),
        "sandboxID": r.id,
        "clientID": CLIENT_ID,
        "startedAt": ids::rfc3339(r.started_ms),
        "endAt": ids::rfc3339(r.end_ms),
        "cpuCount": r.vcpus,
        "memoryMB": r.mem_mib,
        "diskSizeMB": 0,
        "state": r.state.as_str(),
        "envdVersion": ENVD_VERSION,
        "metadata": r.metadata,
    });
    if detail {
        v["domain"] = Value::Null;
        v["lifecycle"] = json!({
            "autoResume": r.auto_resume,
            "onTimeout": if r.auto_pause { "pause" } else { "kill" },
        });
        if r.state == State::Paused {
            v["pauseMode"] = json!(if r.memory_dropped {
                "filesystem"
            } else {
                "full"
            });
        }
    }
    v
}

/// The router with every endpoint, behind the API-key check; requests addressed to a
/// sandbox (`E2b-Sandbox-Id`, or a `<port>-<id>.<domain>` host) go to the data plane
/// ([`crate::envd`]) instead, which needs no API key but the sandbox's own access token
/// ([`crate::envd::access`]).
pub fn router(state: AppState) -> Router {
    let data = crate::envd::Routes::new(crate::envd::DataPlane::new(state.host.clone()));
    Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/network", put(update_network))
        .route("/sandboxes/metrics", get(many_metrics))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/snapshots", get(list_snapshots))
        .route(
            "/templates/{id}",
            delete(delete_snapshot).patch(tags::update),
        )
        .route("/v2/templates/{id}", patch(tags::update))
        .route("/templates/tags", post(tags::assign).delete(tags::remove))
        .route("/templates/{id}/tags", get(tags::list))
        .route("/sandboxes/{id}/logs", get(logs_v1))
        .route("/v2/sandboxes/{id}/logs", get(logs_v2))
        .route("/templates", get(list_templates))
        .route("/nodes", get(list_nodes))
        .route("/v3/templates", post(builds::request))
        .route("/templates/{id}/files/{hash}", get(builds::files))
        .route("/v2/templates/{id}/builds/{build}", post(builds::start))
        .route("/templates/{id}/builds/{build}/status", get(builds::status))
        .route("/templates/aliases/{name}", get(builds::alias))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        // An upload link carries its own key (the SDK sends no API key with it).
        // Streamed to a file, its size checked as it arrives (`builds::upload`).
        .route("/build-files/{hash}/{expires}/{token}", put(builds::upload))
        // The dashboard's pages check its session themselves (the login page needs none).
        .merge(crate::dashboard::routes())
        .layer(axum::middleware::from_fn_with_state(
            data,
            crate::envd::dispatch,
        ))
        .layer(axum::middleware::from_fn(close_after_refused_upload))
        .with_state(state)
}

/// An error answered to a request with a body (an upload to a sandbox that is not running,
/// say) may go out before the body was read, and then the connection cannot carry another
/// request. A client that put it back in its pool would see it closed under its next
/// request (seen through a forwarded port, where the close arrives late): `Connection:
/// close` tells it not to. HTTP/1 only (HTTP/2 has no such header and resets the stream).
async fn close_after_refused_upload(req: Request, next: Next) -> Response {
    use axum::http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
    let h = req.headers();
    let with_body = h.contains_key(TRANSFER_ENCODING)
        || h.get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0);
    let http1 = req.version() <= axum::http::Version::HTTP_11;
    let mut resp = next.run(req).await;
    let refused = resp.status().is_client_error() || resp.status().is_server_error();
    if with_body && http1 && refused {
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

/// The key check in front of every API route: `X-API-KEY`, or (the dashboard's calls) a
/// live session cookie with `X-Clade-Dashboard: 1` ([`crate::dashboard`]).
async fn auth(AxState(st): AxState<AppState>, req: Request, next: Next) -> Response {
    match req.headers().get("x-api-key") {
        None if crate::dashboard::dashboard_request(
            &axum::extract::FromRef::from_ref(&st),
            req.headers(),
        ) =>
        {
            next.run(req).await
        }
        None => ApiError::new(StatusCode::UNAUTHORIZED, "Authorization header is missing")
            .into_response(),
        Some(k) if crate::envd::access::same_secret(k.as_bytes(), st.api_key.as_bytes()) => {
            next.run(req).await
        }
        Some(_) => ApiError::new(StatusCode::UNAUTHORIZED, "Invalid API key").into_response(),
    }
}

/// `PUT /sandboxes/{id}/network`: replaces the egress policy (fields left out are cleared,
/// as E2B documents); 204.
async fn update_network(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: NetworkBody = body(&bytes)?;
    if b.allow_public_traffic.is_some() || b.mask_request_host.is_some() {
        return Err(ApiError::bad(
            "allowPublicTraffic and maskRequestHost are set when a sandbox is created, not changed",
        ));
    }
    let policy = b.policy(None)?;
    blocking(&st, move |h| h.set_egress(&id, &policy)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn create(AxState(st): AxState<AppState>, bytes: Bytes) -> ApiResult<Response> {
    let b: NewSandbox = body(&bytes)?;
    let (auto_pause, auto_resume, pause_keeps_memory) = lifecycle_of(&b)?;
    let network = b.network.unwrap_or_default();
    if let Some(m) = &network.mask_request_host {
        if !crate::envd::access::valid_mask(m) {
            return Err(ApiError::bad(format!(
                "network.maskRequestHost: not a host name (with ${{PORT}} for the port): {m:?}"
            )));
        }
    }
    let req = CreateRequest {
        secure: b.secure.unwrap_or(true),
        private_traffic: network.allow_public_traffic == Some(false),
        mask_host: network.mask_request_host.clone(),
        template: b.template_id,
        timeout_s: timeout_of(b.timeout)?,
        auto_pause,
        auto_resume,
        pause_drops_memory: !pause_keeps_memory,
        metadata: string_map(b.metadata, "metadata")?,
        env_vars: string_map(b.env_vars, "envVars")?,
        egress: network.policy(b.allow_internet_access)?,
    };
    let rec = blocking(&st, move |h| h.create(req)).await?;
    Ok((StatusCode::CREATED, Json(sandbox_out(&st, &rec))).into_response())
}

/// The query string's pairs (one level of URL decoding).
fn query_pairs(q: &Option<String>) -> Vec<(String, String)> {
    q.as_deref()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

/// E2B's `metadata` filter: `k1=v1&k2=v2` (URL-encoded as a whole, each key and value
/// URL-encoded once more by the SDK).
fn metadata_filter(s: &str) -> BTreeMap<String, String> {
    let decode = |t: &str| {
        percent_encoding::percent_decode_str(t)
            .decode_utf8_lossy()
            .into_owned()
    };
    form_urlencoded::parse(s.as_bytes())
        .map(|(k, v)| (decode(&k), decode(&v)))
        .collect()
}

fn parse_query(q: &Option<String>, v2: bool) -> ApiResult<Query> {
    let mut out = Query {
        limit: if v2 { DEFAULT_PAGE } else { 0 },
        states: if v2 { vec![] } else { vec![State::Running] },
        // Newest first, as E2B lists (`order=asc` for oldest first).
        descending: true,
        ..Query::default()
    };
    for (k, v) in query_pairs(q) {
        match k.as_str() {
            "metadata" | "query" => out.metadata.extend(metadata_filter(&v)),
            "state" if v2 => {
                out.states = v
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| match s {
                        "running" => Ok(State::Running),
                        "paused" => Ok(State::Paused),
                        other => Err(ApiError::bad(format!("unknown state '{other}'"))),
                    })
                    .collect::<ApiResult<_>>()?
            }
            "template" if v2 => out.template = Some(v),
            "startedAfter" if v2 => {
                out.started_after = Some(
                    ids::parse_rfc3339(&v)
                        .ok_or_else(|| ApiError::bad(format!("startedAfter: not a time: {v}")))?,
                )
            }
            "order" if v2 => {
                out.descending = match v.as_str() {
                    "asc" => false,
                    "desc" => true,
                    other => return Err(ApiError::bad(format!("order: '{other}' (asc or desc)"))),
                }
            }
            "limit" if v2 => {
                out.limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| ApiError::bad(format!("limit must be 1 to {MAX_PAGE}")))?
            }
            "nextToken" if v2 => out.after = Some(parse_token(&v)?),
            _ => {}
        }
    }
    Ok(out)
}

/// A page token: the last row shown, as `<ms>_<id>` (its time and id). Tokens name a
/// position, not an offset, so rows created or removed between pages do not shift them.
fn page_token(ms: i64, id: &str) -> HeaderValue {
    // Ids are [a-z0-9-]: always a valid header value.
    HeaderValue::from_str(&format!("{ms}_{id}")).unwrap_or(HeaderValue::from_static("0_"))
}

fn parse_token(v: &str) -> ApiResult<(i64, String)> {
    v.split_once('_')
        .and_then(|(ms, id)| Some((ms.parse::<i64>().ok()?, id.to_string())))
        .filter(|(_, id)| {
            !id.is_empty()
                && id.len() <= 64
                && id
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
        .ok_or_else(|| ApiError::bad(format!("nextToken: not a token this host issued: {v}")))
}

async fn list_v1(AxState(st): AxState<AppState>, RawQuery(q): RawQuery) -> ApiResult<Response> {
    let query = parse_query(&q, false)?;
    let (recs, _) = blocking(&st, move |h| h.list(&query)).await?;
    let out: Vec<Value> = recs.iter().map(|r| listed(r, false)).collect();
    Ok(Json(out).into_response())
}

async fn list_v2(AxState(st): AxState<AppState>, RawQuery(q): RawQuery) -> ApiResult<Response> {
    let query = parse_query(&q, true)?;
    let (recs, more) = blocking(&st, move |h| h.list(&query)).await?;
    let out: Vec<Value> = recs.iter().map(|r| listed(r, false)).collect();
    let mut headers = HeaderMap::new();
    if let (true, Some(last)) = (more, recs.last()) {
        headers.insert("x-next-token", page_token(last.started_ms, &last.id));
    }
    Ok((headers, Json(out)).into_response())
}

async fn info(AxState(st): AxState<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    let (rec, upload_error, checkpoint) = blocking(&st, move |h| {
        h.get(&id).map(|r| {
            let e = h.durable().and_then(|d| d.failure(&r.id));
            let c = h.restored_checkpoint(&r);
            (r, e, c)
        })
    })
    .await?;
    if rec.state == State::Crashed {
        return Err(Error::Crashed {
            id: rec.id,
            why: rec.crash.unwrap_or_default(),
        }
        .into());
    }
    let mut v = listed(&rec, true);
    v["domain"] = json!(st.domain.as_deref());
    // Clade's own (with `clade serve --store`): when its pause reached the object store
    // (another host may then resume it), and why the upload is being retried.
    if rec.durable() {
        v["durableAt"] = json!(rec.published_ms.map(ids::rfc3339));
    }
    if let Some(e) = upload_error {
        v["uploadError"] = json!(e);
    }
    // Clade's own: its host was lost while it ran, and it came back from the checkpoint
    // taken then (`clade serve --checkpoint-every`): what it did after that is not there.
    if let Some(ms) = checkpoint {
        v["restoredFromCheckpoint"] = json!(ids::rfc3339(ms));
    }
    Ok(Json(v).into_response())
}

async fn kill(AxState(st): AxState<AppState>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    blocking(&st, move |h| h.kill(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_timeout(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    let b: TimeoutBody = body(&bytes)?;
    let t = b
        .timeout
        .ok_or_else(|| ApiError::bad("timeout is required"))
        .and_then(|t| timeout_of(Some(t)))?;
    blocking(&st, move |h| h.set_timeout(&id, t)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn refresh(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    let b: RefreshBody = body(&bytes)?;
    let d = timeout_of(Some(b.duration.unwrap_or(DEFAULT_TIMEOUT_S as i64)))?;
    blocking(&st, move |h| h.refresh(&id, d)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    // {"memory": bool, "requireHealthyGuest": bool}: `memory: false` is a filesystem-only
    // pause (which always needs a guest agent that answers).
    let b: PauseBody = body(&bytes)?;
    let how = PauseOptions {
        keep_memory: b.memory != Some(false),
        require_healthy_guest: b.require_healthy_guest == Some(true),
    };
    blocking(&st, move |h| h.pause(&id, how)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn resume(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    // `memory: false`: drop the memory and boot from the disk (E2B's on_resume="reboot").
    let b: TimeoutBody = body(&bytes)?;
    let reboot = b.memory == Some(false);
    let t = timeout_of(b.timeout)?;
    let rec = blocking(&st, move |h| h.resume(&id, t, reboot)).await?;
    Ok((StatusCode::CREATED, Json(sandbox_out(&st, &rec))).into_response())
}

async fn connect(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: TimeoutBody = body(&bytes)?;
    let reboot = b.memory == Some(false);
    let t = timeout_of(b.timeout)?;
    let (rec, resumed) = blocking(&st, move |h| h.connect(&id, t, reboot)).await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox_out(&st, &rec))).into_response())
}

async fn fork(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: ForkBody = body(&bytes)?;
    let t = timeout_of(b.timeout)?;
    let count = b.count.unwrap_or(1);
    let count = usize::try_from(count)
        .map_err(|_| ApiError::bad(format!("count must be positive, not {count}")))?;
    let recs = blocking(&st, move |h| h.fork(&id, count, t)).await?;
    let out: Vec<Value> = recs
        .iter()
        .map(|r| json!({"sandbox": sandbox_out(&st, r)}))
        .collect();
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

/// `SandboxMetric` of the spec.
fn metric_json(m: &crate::host::Metrics) -> Value {
    json!({
        "timestamp": ids::rfc3339(m.at_ms),
        "timestampUnix": m.at_ms / 1000,
        "cpuCount": m.cpu_count,
        "cpuUsedPct": m.cpu_used_pct,
        "memUsed": m.mem_used,
        "memTotal": m.mem_total,
        "memCache": 0,
        "diskUsed": m.disk_used,
        "diskTotal": m.disk_total,
    })
}

/// `GET /sandboxes/{id}/metrics?start=&end=`: the sandbox's samples in that range (unix
/// seconds, both ends included; either left out: unbounded), oldest first.
async fn metrics(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let (mut from_ms, mut to_ms) = (i64::MIN, i64::MAX);
    for (k, v) in query_pairs(&q) {
        let secs = || {
            v.parse::<i64>()
                .ok()
                .filter(|s| s.unsigned_abs() < 1 << 40)
                .ok_or_else(|| ApiError::bad(format!("{k}: not a time in unix seconds: {v}")))
        };
        match k.as_str() {
            "start" => from_ms = secs()? * 1000,
            "end" => to_ms = secs()? * 1000 + 999,
            _ => {}
        }
    }
    if to_ms < from_ms {
        return Err(ApiError::bad("end must not be before start"));
    }
    let ms = blocking(&st, move |h| h.metrics(&id, from_ms, to_ms)).await?;
    Ok(Json(ms.iter().map(metric_json).collect::<Vec<_>>()).into_response())
}

/// Sandboxes one `GET /sandboxes/metrics` may ask about.
const MAX_METRICS_IDS: usize = 100;

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the newest metrics of each sandbox named that
/// exists, as `{"sandboxes": {id: SandboxMetric}}`.
async fn many_metrics(
    AxState(st): AxState<AppState>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let mut wanted: Vec<String> = Vec::new();
    for (k, v) in query_pairs(&q) {
        if k == "sandbox_ids" {
            wanted.extend(v.split(',').filter(|s| !s.is_empty()).map(str::to_string));
        }
    }
    if wanted.is_empty() {
        return Err(ApiError::bad("sandbox_ids is required"));
    }
    if wanted.len() > MAX_METRICS_IDS {
        return Err(ApiError::bad(format!(
            "sandbox_ids: at most {MAX_METRICS_IDS} sandboxes"
        )));
    }
    wanted.sort();
    wanted.dedup();
    let ms = blocking(&st, move |h| h.latest_metrics(&wanted)).await?;
    let map: serde_json::Map<String, Value> = ms
        .iter()
        .map(|(id, m)| (id.clone(), metric_json(m)))
        .collect();
    Ok(Json(json!({ "sandboxes": map })).into_response())
}

/// `SnapshotInfo` of the spec: the id with its tag, and its names (this host has no team
/// namespace: a name is `name:default`).
fn snapshot_info(s: &SnapshotRecord) -> Value {
    let shown = s.name.as_deref().unwrap_or(&s.id);
    json!({
        "snapshotID": format!("{shown}:{DEFAULT_TAG}"),
        "names": [format!("{shown}:{DEFAULT_TAG}")],
        // Clade's own: when it was taken (lists are newest first by it).
        "createdAt": ids::rfc3339(s.created_ms),
    })
}

async fn snapshot(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: SnapshotBody = body(&bytes)?;
    if b.memory == Some(false) {
        // A filesystem-only snapshot would cold-boot its sandboxes: Clade sandboxes only
        // restore. E2B's answer where the feature is off.
        return Err(ApiError::bad(
            "filesystem-only snapshots are not supported on this host (memory: false)",
        )
        .with_code("snapshot_filesystem_only_disabled"));
    }
    let snap = blocking(&st, move |h| h.snapshot(&id, b.name.as_deref())).await?;
    Ok((StatusCode::CREATED, Json(snapshot_info(&snap))).into_response())
}

async fn list_snapshots(
    AxState(st): AxState<AppState>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let mut query = SnapshotQuery {
        limit: DEFAULT_PAGE,
        ..SnapshotQuery::default()
    };
    for (k, v) in query_pairs(&q) {
        match k.as_str() {
            "sandboxID" => query.sandbox = Some(v),
            "name" => {
                query.name = Some(
                    crate::host::strip_tag(&v)
                        .map_err(|e| ApiError::bad(e.to_string()))?
                        .to_string(),
                )
            }
            "limit" => {
                query.limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| ApiError::bad(format!("limit must be 1 to {MAX_PAGE}")))?
            }
            "nextToken" => query.after = Some(parse_token(&v)?),
            _ => {}
        }
    }
    let (snaps, more) = blocking(&st, move |h| h.list_snapshots(&query)).await?;
    let out: Vec<Value> = snaps.iter().map(snapshot_info).collect();
    let mut headers = HeaderMap::new();
    if let (true, Some(last)) = (more, snaps.last()) {
        headers.insert("x-next-token", page_token(last.created_ms, &last.id));
    }
    Ok((headers, Json(out)).into_response())
}

/// `GET /templates`: the built templates, one row per template in the shape of E2B's
/// `Template`: the build its `default` tag means (else its newest), with every tag in
/// `names` (what this host knows: no teams or spawn counts; every listed build is ready).
async fn list_templates(AxState(st): AxState<AppState>) -> ApiResult<Response> {
    let rows = blocking(&st, |h| {
        let store = h.template_store();
        let mut by_name: BTreeMap<String, Vec<crate::template::Template>> = BTreeMap::new();
        for t in h.list_templates()? {
            by_name
                .entry(template_of(&t.name).to_string())
                .or_default()
                .push(t);
        }
        let mut rows = Vec::new();
        for (name, mut builds) in by_name {
            let tags = store.tags(&name)?;
            let shown = tags
                .tags
                .get(crate::template::tags::DEFAULT_TAG)
                .and_then(|d| builds.iter().position(|b| b.name == d.build));
            builds.sort_by_key(|b| b.created_ms);
            let t = match shown {
                Some(i) => builds.swap_remove(i),
                None => builds.pop().expect("a group has a build"),
            };
            let names: Vec<String> = tags.tags.keys().map(|k| format!("{name}:{k}")).collect();
            rows.push((name, t, names, tags.public));
        }
        Ok(rows)
    })
    .await?;
    let out: Vec<Value> = rows
        .iter()
        .map(|(name, t, names, public)| {
            json!({
                "templateID": name,
                "buildID": t.build_id(),
                "aliases": [name],
                "names": names,
                "cpuCount": t.vcpus,
                "memoryMB": t.mem_mib,
                "diskSizeMB": 0,
                "public": public,
                "createdAt": ids::rfc3339(t.created_ms),
                "updatedAt": ids::rfc3339(t.created_ms),
                "envdVersion": ENVD_VERSION,
                "buildStatus": "ready",
            })
        })
        .collect();
    Ok(Json(out).into_response())
}

/// `GET /nodes` (Clade's, not E2B's): the hosts of the cluster this service is a node of;
/// 404 when it is in none.
async fn list_nodes(AxState(st): AxState<AppState>) -> ApiResult<Response> {
    match blocking(&st, |h| h.cluster_nodes()).await? {
        Some(nodes) => Ok(Json(nodes).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "this service is not a node of a cluster (clade serve --cluster)",
        )),
    }
}

/// `DELETE /templates/{id}`: what the SDK's `delete_snapshot` calls. Only snapshots are
/// deleted here (templates with `clade template rm`).
async fn delete_snapshot(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    blocking(&st, move |h| h.delete_snapshot(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn ms_param(k: &str, v: &str) -> ApiResult<i64> {
    v.parse::<i64>()
        .map_err(|_| ApiError::bad(format!("{k}: not a time in milliseconds: {v}")))
}

fn limit_param(v: &str) -> ApiResult<usize> {
    v.parse::<usize>()
        .ok()
        .filter(|n| *n <= LOG_PAGE)
        .ok_or_else(|| ApiError::bad(format!("limit must be 0 to {LOG_PAGE}")))
}

fn log_entry(l: &LogLine) -> Value {
    json!({
        "timestamp": ids::rfc3339(l.at_ms),
        "message": l.text,
        "level": l.level,
        "fields": {"source": l.source},
    })
}

/// `GET /sandboxes/{id}/logs?start=MS&limit=N`: the first `limit` lines at or after
/// `start`, oldest first.
async fn logs_v1(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let mut start = i64::MIN;
    let mut limit = LOG_PAGE;
    for (k, v) in query_pairs(&q) {
        match k.as_str() {
            "start" => start = ms_param(&k, &v)?,
            "limit" => limit = limit_param(&v)?,
            _ => {}
        }
    }
    let lines = blocking(&st, move |h| h.logs(&id)).await?;
    let picked: Vec<&LogLine> = lines
        .iter()
        .filter(|l| l.at_ms >= start)
        .take(limit)
        .collect();
    Ok(Json(json!({
        "logs": picked
            .iter()
            .map(|l| json!({"timestamp": ids::rfc3339(l.at_ms), "line": l.text}))
            .collect::<Vec<_>>(),
        "logEntries": picked.iter().map(|l| log_entry(l)).collect::<Vec<_>>(),
    }))
    .into_response())
}

fn level_rank(level: &str) -> Option<u8> {
    ["debug", "info", "warn", "error"]
        .iter()
        .position(|l| *l == level)
        .map(|i| i as u8)
}

/// `GET /v2/sandboxes/{id}/logs?cursor=MS&limit=N&direction=forward|backward&level=L&search=S`:
/// `forward` (the default) gives the lines at or after `cursor`, oldest first; `backward`
/// the lines at or before it, newest first. `level` is the lowest level shown, `search` a
/// substring.
async fn logs_v2(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let mut cursor = None;
    let mut limit = LOG_PAGE;
    let mut backward = false;
    let mut min_level = 0;
    let mut search = None;
    for (k, v) in query_pairs(&q) {
        match k.as_str() {
            "cursor" => cursor = Some(ms_param(&k, &v)?),
            "limit" => limit = limit_param(&v)?,
            "direction" => {
                backward = match v.as_str() {
                    "forward" => false,
                    "backward" => true,
                    other => {
                        return Err(ApiError::bad(format!(
                            "direction: '{other}' (forward or backward)"
                        )))
                    }
                }
            }
            "level" => {
                min_level = level_rank(&v)
                    .ok_or_else(|| ApiError::bad(format!("level: unknown level '{v}'")))?
            }
            "search" => search = Some(v),
            _ => {}
        }
    }
    let lines = blocking(&st, move |h| h.logs(&id)).await?;
    let keep = |l: &&LogLine| {
        level_rank(l.level).unwrap_or(0) >= min_level
            && search.as_ref().is_none_or(|s| l.text.contains(s.as_str()))
    };
    let out: Vec<Value> = if backward {
        let c = cursor.unwrap_or(i64::MAX);
        lines
            .iter()
            .rev()
            .filter(|l| l.at_ms <= c)
            .filter(keep)
            .take(limit)
            .map(log_entry)
            .collect()
    } else {
        let c = cursor.unwrap_or(i64::MIN);
        lines
            .iter()
            .filter(|l| l.at_ms >= c)
            .filter(keep)
            .take(limit)
            .map(log_entry)
            .collect()
    };
    Ok(Json(json!({ "logs": out })).into_response())
}

/// Serves the API on `listener` until `shutdown` resolves; applies timeouts and notices
/// crashed VMs every `tick`. `wrap` may put layers around the whole router (a cluster's
/// gateway: see the `cluster` crate).
pub async fn serve(
    listen: Listen,
    state: AppState,
    wrap: impl FnOnce(Router) -> Router,
    tick: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let host = state.host.clone();
    let ticker = tokio::spawn(async move {
        let mut iv = tokio::time::interval(tick);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            iv.tick().await;
            let h = host.clone();
            let r = tokio::task::spawn_blocking(move || {
                h.expire(ids::now_ms())?;
                h.reap()?;
                h.sample_metrics()
            })
            .await;
            match r {
                Ok(Err(e)) => tracing::warn!("timeout sweep: {e}"),
                Err(e) => tracing::warn!("timeout sweep: {e}"),
                Ok(Ok(())) => {}
            }
        }
    });
    // Requests in progress get SHUTDOWN_GRACE after the signal; a stream whose client
    // never goes away must not keep the service from stopping.
    let (fired_tx, fired_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown.await;
        let _ = fired_tx.send(());
    };
    let app = wrap(router(state));
    let r = match listen {
        // TCP_NODELAY on every connection: a streamed answer (a command's output, a PTY)
        // goes out chunk by chunk, not held back until the client acknowledges the
        // previous one (Nagle's algorithm, against a client's delayed acknowledgement: up
        // to 40 ms a chunk). The TLS listener sets it too.
        Listen::Http(l) => {
            let l = axum::serve::ListenerExt::tap_io(l, |tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!("TCP_NODELAY on a connection: {e}");
                }
            });
            run_until(l, app, shutdown, fired_rx).await
        }
        Listen::Https(l, cfg) => {
            run_until(tls::TlsListener::new(l, cfg)?, app, shutdown, fired_rx).await
        }
    };
    ticker.abort();
    r
}

/// Where the service listens: plain HTTP, or HTTPS with this TLS configuration
/// ([`tls::server_config`]).
pub enum Listen {
    Http(tokio::net::TcpListener),
    Https(tokio::net::TcpListener, Arc<tls::ServerConfig>),
}

/// Serves `app` on `listener` until `shutdown`, then at most [`SHUTDOWN_GRACE`] more
/// (`fired` says when the signal came).
async fn run_until<L>(
    listener: L,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    fired_rx: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown);
    let grace = async move {
        match fired_rx.await {
            Ok(()) => tokio::time::sleep(SHUTDOWN_GRACE).await,
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        r = std::future::IntoFuture::into_future(server) => r,
        _ = grace => {
            tracing::warn!("requests still open {SHUTDOWN_GRACE:?} after the stop signal: stopping anyway");
            Ok(())
        }
    }
}

/// How long requests in progress may run on after the service was told to stop.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

pub mod tls;

mod builds;
mod tags;
#[cfg(test)]
mod tests;

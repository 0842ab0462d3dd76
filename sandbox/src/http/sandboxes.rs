//! The sandbox routes of the control API: create (`POST /sandboxes`, `/v2/sandboxes`),
//! info, kill, timeout and refreshes, pause, resume, connect and fork, with the request
//! bodies they parse and the `Sandbox` / `SandboxDetail` shapes they answer. Listing is in
//! `listing`, the egress policy in `network`, metrics, logs and snapshots in their own
//! files.

use axum::body::Bytes;
use axum::extract::{Path, State as AxState};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::errors::{ApiError, ApiResult};
use super::network::NetworkBody;
use super::request::{blocking, body, string_map, timeout_of};
use super::{AppState, CLIENT_ID, DEFAULT_TIMEOUT_S, ENVD_VERSION};
use crate::error::Error;
use crate::host::{CreateRequest, EgressPolicy, PauseOptions};
use crate::ids;
use crate::registry::{Record, State};
use crate::template::tags::template_of;

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
pub(super) fn listed(r: &Record, detail: bool) -> Value {
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

pub(super) async fn create(AxState(st): AxState<AppState>, bytes: Bytes) -> ApiResult<Response> {
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

pub(super) async fn info(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
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

pub(super) async fn kill(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    blocking(&st, move |h| h.kill(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn set_timeout(
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

pub(super) async fn refresh(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    let b: RefreshBody = body(&bytes)?;
    let d = timeout_of(Some(b.duration.unwrap_or(DEFAULT_TIMEOUT_S as i64)))?;
    blocking(&st, move |h| h.refresh(&id, d)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn pause(
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

pub(super) async fn resume(
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

pub(super) async fn connect(
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

pub(super) async fn fork(
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

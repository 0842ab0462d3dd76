//! Sandbox metrics over the control API: `GET /sandboxes/{id}/metrics` (a time range of
//! one sandbox's samples) and `GET /sandboxes/metrics` (the newest of several), as E2B's
//! `SandboxMetric`.

use axum::extract::{Path, RawQuery, State as AxState};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::errors::{ApiError, ApiResult};
use super::request::{blocking, query_pairs};
use super::AppState;
use crate::ids;

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
pub(super) async fn metrics(
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
pub(super) async fn many_metrics(
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

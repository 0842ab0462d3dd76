//! A sandbox's logs over the control API: `GET /sandboxes/{id}/logs` (v1: from a time,
//! oldest first) and `GET /v2/sandboxes/{id}/logs` (a cursor, either direction, a lowest
//! level and a search), as E2B's log entries.

use axum::extract::{Path, RawQuery, State as AxState};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::errors::{ApiError, ApiResult};
use super::request::{blocking, query_pairs};
use super::{AppState, LOG_PAGE};
use crate::host::LogLine;
use crate::ids;

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
pub(super) async fn logs_v1(
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
pub(super) async fn logs_v2(
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

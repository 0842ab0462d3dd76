//! Persistent snapshots over the control API: take one (`POST
//! /sandboxes/{id}/snapshots`), list them (`GET /snapshots`, paged) and delete one
//! (`DELETE /templates/{id}`, what the SDK's `delete_snapshot` calls), as E2B's
//! `SnapshotInfo`.

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State as AxState};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::errors::{ApiError, ApiResult};
use super::request::{blocking, body, page_token, parse_token, query_pairs};
use super::{AppState, DEFAULT_PAGE, MAX_PAGE};
use crate::host::DEFAULT_TAG;
use crate::ids;
use crate::registry::{SnapshotQuery, SnapshotRecord};

#[derive(Deserialize, Default)]
struct SnapshotBody {
    name: Option<String>,
    memory: Option<bool>,
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

pub(super) async fn snapshot(
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

pub(super) async fn list_snapshots(
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

/// `DELETE /templates/{id}`: what the SDK's `delete_snapshot` calls. Only snapshots are
/// deleted here (templates with `clade template rm`).
pub(super) async fn delete_snapshot(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    blocking(&st, move |h| h.delete_snapshot(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

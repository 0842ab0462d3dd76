//! `GET /sandboxes` and `GET /v2/sandboxes`: the query's filters (metadata, state,
//! template, start time, order) and pages (`limit`, `nextToken`), and the listed rows.
//! Separate from the per-sandbox routes: its input is a query, not a sandbox.

use std::collections::BTreeMap;

use axum::extract::{RawQuery, State as AxState};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::errors::{ApiError, ApiResult};
use super::request::{blocking, page_token, parse_token, query_pairs};
use super::sandboxes::listed;
use super::{AppState, DEFAULT_PAGE, MAX_PAGE};
use crate::ids;
use crate::registry::{Query, State};

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

pub(super) async fn list_v1(
    AxState(st): AxState<AppState>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let query = parse_query(&q, false)?;
    let (recs, _) = blocking(&st, move |h| h.list(&query)).await?;
    let out: Vec<Value> = recs.iter().map(|r| listed(r, false)).collect();
    Ok(Json(out).into_response())
}

pub(super) async fn list_v2(
    AxState(st): AxState<AppState>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let query = parse_query(&q, true)?;
    let (recs, more) = blocking(&st, move |h| h.list(&query)).await?;
    let out: Vec<Value> = recs.iter().map(|r| listed(r, false)).collect();
    let mut headers = HeaderMap::new();
    if let (true, Some(last)) = (more, recs.last()) {
        headers.insert("x-next-token", page_token(last.started_ms, &last.id));
    }
    Ok((headers, Json(out)).into_response())
}

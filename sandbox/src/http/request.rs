//! What every route does with its request before and after the host acts: the JSON body
//! parsed (an empty one is `{}`; malformed JSON is an [`ApiError`] like any bad input), the
//! query string's pairs, the fields several routes share (string maps, timeouts, page
//! tokens), and the lifecycle call run on tokio's blocking pool. Separate so that each
//! route file holds only its own endpoints.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::errors::{ApiError, ApiResult};
use super::{AppState, DEFAULT_TIMEOUT_S};
use crate::host::Host;

/// Runs a blocking lifecycle call ([`crate::run_blocking`]).
pub(super) async fn blocking<T: Send + 'static>(
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
pub(super) fn body<T: DeserializeOwned>(bytes: &Bytes) -> ApiResult<T> {
    let bytes: &[u8] = if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        b"{}"
    } else {
        bytes
    };
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad(format!("invalid request body: {e}")))
}

/// A JSON object of strings (`metadata`, `envVars`), or absent/null.
pub(super) fn string_map(v: Option<Value>, what: &str) -> ApiResult<BTreeMap<String, String>> {
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

pub(super) fn timeout_of(v: Option<i64>) -> ApiResult<u64> {
    match v {
        None => Ok(DEFAULT_TIMEOUT_S),
        Some(t) if t >= 0 => Ok(t as u64),
        Some(t) => Err(ApiError::bad(format!("timeout must not be negative: {t}"))),
    }
}

/// The query string's pairs (one level of URL decoding).
pub(super) fn query_pairs(q: &Option<String>) -> Vec<(String, String)> {
    q.as_deref()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

/// A page token: the last row shown, as `<ms>_<id>` (its time and id). Tokens name a
/// position, not an offset, so rows created or removed between pages do not shift them.
pub(super) fn page_token(ms: i64, id: &str) -> HeaderValue {
    // Ids are [a-z0-9-]: always a valid header value.
    HeaderValue::from_str(&format!("{ms}_{id}")).unwrap_or(HeaderValue::from_static("0_"))
}

pub(super) fn parse_token(v: &str) -> ApiResult<(i64, String)> {
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

//! E2B's template build API ([`crate::build`]): request a build, upload a COPY step's
//! files by hash, start the build, poll its status and log.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State as AxState};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::errors::{ApiError, ApiResult};
use super::request::body;
use super::AppState;
use crate::build::StartRequest;
use crate::ids;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BuildRequest {
    name: String,
    #[serde(default)]
    tags: Vec<String>,
    #[serde(default)]
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB", default)]
    memory_mb: Option<u64>,
}

async fn run<T: Send + 'static>(
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
) -> ApiResult<T> {
    crate::run_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("worker: {e}")))?
        .map_err(ApiError::from)
}

/// `POST /v3/templates`: a build of template `name` is requested (202).
pub(super) async fn request(AxState(st): AxState<AppState>, b: Bytes) -> ApiResult<Response> {
    let r: BuildRequest = body(&b)?;
    let builds = st.builds.clone();
    let (tpl, bid, tags) =
        run(move || builds.request(&r.name, &r.tags, r.cpu_count, r.memory_mb)).await?;
    let names: Vec<String> = tags.iter().map(|t| format!("{tpl}:{t}")).collect();
    let v = json!({
        "templateID": tpl,
        "buildID": bid,
        "public": false,
        "names": names,
        "tags": tags,
        "aliases": [tpl],
    });
    Ok((StatusCode::ACCEPTED, Json(v)).into_response())
}

/// `GET /templates/{id}/files/{hash}`: whether a COPY step's files are here, and where to
/// upload them (201).
pub(super) async fn files(
    AxState(st): AxState<AppState>,
    Path((_tpl, hash)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let present = st.builds.files_present(&hash).map_err(ApiError::from)?;
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "no Host header to make an upload link with",
            )
        })?;
    let url = format!(
        "{}://{host}{}",
        st.builds.scheme(),
        st.builds
            .upload_link_path(&hash, ids::now_ms().div_euclid(1000))
    );
    Ok((
        StatusCode::CREATED,
        Json(json!({ "present": present, "url": url })),
    )
        .into_response())
}

/// `PUT /build-files/{hash}/{expires}/{token}`: the upload itself (no API key: the link,
/// good for [`crate::build::UPLOAD_LINK_LIFETIME_S`], is the key). The link is checked
/// before the body is read; the body goes to a file as it arrives (up to
/// [`crate::build::MAX_UPLOAD`] bytes), never whole in memory.
pub(super) async fn upload(
    AxState(st): AxState<AppState>,
    Path((hash, expires, token)): Path<(String, String, String)>,
    body: axum::body::Body,
) -> ApiResult<Response> {
    use futures_util::StreamExt;
    use tokio::io::AsyncWriteExt;
    let builds = st.builds.clone();
    let raw = {
        let b = builds.clone();
        let h = hash.clone();
        let now_s = ids::now_ms().div_euclid(1000);
        run(move || b.upload_scratch(&h, &expires, &token, now_s)).await?
    };
    let received = async {
        let mut file = tokio::fs::File::create(&raw).await.map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the upload: {e}"),
            )
        })?;
        let mut chunks = body.into_data_stream();
        let mut n = 0u64;
        while let Some(data) = chunks.next().await {
            let data = data.map_err(|e| {
                ApiError::new(StatusCode::BAD_REQUEST, format!("the upload's body: {e}"))
            })?;
            n += data.len() as u64;
            if n > crate::build::MAX_UPLOAD {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("an upload of more than {} bytes", crate::build::MAX_UPLOAD),
                ));
            }
            file.write_all(&data).await.map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the upload: {e}"),
                )
            })?;
        }
        file.flush().await.map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the upload: {e}"),
            )
        })
    }
    .await;
    if let Err(e) = received {
        let _ = tokio::fs::remove_file(&raw).await;
        return Err(e);
    }
    run(move || builds.keep_upload(&hash, &raw)).await?;
    Ok(StatusCode::CREATED.into_response())
}

/// `POST /v2/templates/{id}/builds/{buildID}`: the build starts (202).
pub(super) async fn start(
    AxState(st): AxState<AppState>,
    Path((tpl, bid)): Path<(String, String)>,
    b: Bytes,
) -> ApiResult<Response> {
    let req: StartRequest = body(&b)?;
    let builds = st.builds.clone();
    let host = st.host.clone();
    run(move || {
        let users = host.template_users(&tpl)?;
        let (h, name) = (host.clone(), tpl.clone());
        // A tag the build moved leaves a build that may now go.
        let done = Box::new(move || {
            if let Err(e) = h.sweep_builds(&name) {
                tracing::warn!(template = %name, "removing builds no tag means: {e}");
            }
        });
        builds.start(&tpl, &bid, req, users, done)
    })
    .await?;
    Ok((StatusCode::ACCEPTED, Json(json!({}))).into_response())
}

/// `GET /templates/{id}/builds/{buildID}/status?logsOffset=N&limit=M`.
pub(super) async fn status(
    AxState(st): AxState<AppState>,
    Path((tpl, bid)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let (mut offset, mut limit) = (0usize, 100usize);
    for (k, v) in form_urlencoded::parse(q.unwrap_or_default().as_bytes()) {
        let n = v
            .parse::<usize>()
            .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, format!("{k}={v}: not a number")));
        match k.as_ref() {
            "logsOffset" => offset = n?,
            "limit" => limit = n?.min(1000),
            _ => {}
        }
    }
    let b = st.builds.get(&tpl, &bid).map_err(ApiError::from)?;
    let g = b.lock().unwrap_or_else(|p| p.into_inner());
    let entries: Vec<Value> = g
        .logs
        .iter()
        .skip(offset)
        .take(limit)
        .map(|l| json!({"timestamp": ids::rfc3339(l.ms), "level": l.level, "message": l.message}))
        .collect();
    let mut v = json!({
        "templateID": tpl,
        "buildID": bid,
        "status": g.status.as_str(),
        "logs": [],
        "logEntries": entries,
    });
    if let Some(r) = &g.reason {
        v["reason"] = json!({ "message": r });
    }
    Ok(Json(v).into_response())
}

/// `GET /templates/aliases/{name}`: whether template `name` exists.
pub(super) async fn alias(
    AxState(st): AxState<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    let host: Arc<crate::Host> = st.host.clone();
    let n = name.clone();
    let found = move || {
        let store = host.template_store();
        store.resolve(&n).and_then(|b| store.get(&b))
    };
    match run(found).await {
        Ok(_) => Ok(Json(json!({"templateID": name, "public": false})).into_response()),
        Err(_) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("template {name} not found"),
        )),
    }
}

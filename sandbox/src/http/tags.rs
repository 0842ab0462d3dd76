//! E2B's template tags and template settings: `POST`/`DELETE /templates/tags`, `GET
//! /templates/{id}/tags`, `PATCH /templates/{id}` (and `/v2/`). What a tag means is kept
//! by [`crate::template::tags`]; a tag moved off a build leaves it to be removed once no
//! sandbox stands on it ([`crate::Host::sweep_builds`]).

use axum::body::Bytes;
use axum::extract::{Path, State as AxState};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::errors::ApiResult;
use super::request::{blocking, body};
use super::AppState;
use crate::ids;
use crate::template::tags::parse_reference;

#[derive(Deserialize)]
struct AssignRequest {
    /// `name:tag` (or `name`, its default): the build the tags go on.
    target: String,
    tags: Vec<String>,
}

#[derive(Deserialize)]
struct RemoveRequest {
    name: String,
    tags: Vec<String>,
}

#[derive(Deserialize)]
struct UpdateRequest {
    #[serde(default)]
    public: Option<bool>,
}

/// `POST /templates/tags`: puts tags on the build `target` means (201 with its build id).
pub(super) async fn assign(AxState(st): AxState<AppState>, b: Bytes) -> ApiResult<Response> {
    let r: AssignRequest = body(&b)?;
    let tags = r.tags.clone();
    let build_id = blocking(&st, move |h| {
        let id = h.template_store().assign_tags(&r.target, &r.tags)?;
        let (name, _) = parse_reference(&r.target)?;
        h.sweep_builds(name)?;
        Ok(id)
    })
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "tags": tags, "buildID": build_id })),
    )
        .into_response())
}

/// `DELETE /templates/tags`: takes tags off a template (204). A request with no body is
/// `DELETE /templates/{id}` of a snapshot named `tags`.
pub(super) async fn remove(AxState(st): AxState<AppState>, b: Bytes) -> ApiResult<Response> {
    if b.iter().all(|c| c.is_ascii_whitespace()) {
        blocking(&st, |h| h.delete_snapshot("tags")).await?;
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let r: RemoveRequest = body(&b)?;
    blocking(&st, move |h| {
        let (name, _) = parse_reference(&r.name)?;
        h.template_store().remove_tags(name, &r.tags)?;
        h.sweep_builds(name)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /templates/{id}/tags`: every tag of the template and the build it means.
pub(super) async fn list(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let tags = blocking(&st, move |h| h.template_store().list_tags(&id)).await?;
    let out: Vec<Value> = tags
        .iter()
        .map(|t| {
            json!({
                "tag": t.tag,
                "buildID": t.build_id,
                "createdAt": ids::rfc3339(t.created_ms),
            })
        })
        .collect();
    Ok(Json(out).into_response())
}

/// `PATCH /templates/{id}` and `/v2/templates/{id}`: E2B's template settings (`public`,
/// recorded and listed: this host serves one team). Answers with the template's names.
pub(super) async fn update(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    b: Bytes,
) -> ApiResult<Response> {
    let r: UpdateRequest = body(&b)?;
    let names = blocking(&st, move |h| {
        let (name, _) = parse_reference(&id)?;
        let store = h.template_store();
        match r.public {
            Some(p) => store.set_public(name, p),
            None => store.set_public(name, store.tags(name)?.public),
        }
    })
    .await?;
    Ok(Json(json!({ "names": names })).into_response())
}

//! `GET /nodes` (Clade's own, not E2B's): the hosts of the cluster this service is a node
//! of. Separate from the sandbox and template routes: it answers about the cluster.

use axum::extract::State as AxState;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::errors::{ApiError, ApiResult};
use super::request::blocking;
use super::AppState;

/// `GET /nodes` (Clade's, not E2B's): the hosts of the cluster this service is a node of;
/// 404 when it is in none.
pub(super) async fn list_nodes(AxState(st): AxState<AppState>) -> ApiResult<Response> {
    match blocking(&st, |h| h.cluster_nodes()).await? {
        Some(nodes) => Ok(Json(nodes).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "this service is not a node of a cluster (clade serve --cluster)",
        )),
    }
}

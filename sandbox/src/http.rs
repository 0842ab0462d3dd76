//! The E2B control API over HTTP (axum): paths, JSON shapes, status codes and error bodies
//! as the `e2b` Python SDK (pinned in `tests/e2b/requirements.txt`) calls and parses them.
//! See `docs/e2b-compat.md` for what differs from E2B's own service.
//!
//! Every request needs the `X-API-KEY` header; errors are `{"code": N, "message": "..."}`
//! like E2B's. Request bodies are parsed here (not by axum's extractors) so that malformed
//! JSON gets the same error body as any other bad input. The lifecycle calls block (they
//! start and stop processes), so they run on tokio's blocking pool.
//!
//! This file owns the shared state ([`AppState`]), the constants answers carry, and the
//! [`router`] that maps each path to its handler. The handlers live by area:
//!
//! - `sandboxes` (create, info, kill, timeouts, pause, resume, connect, fork), `listing`
//!   (`GET /sandboxes`, `/v2/sandboxes`), `network` (egress policies), `metrics`, `logs`;
//! - `snapshots` (persistent snapshots), `templates` (the template list), `tags`
//!   (template tags and settings), `builds` (E2B's template build API), `nodes` (the
//!   cluster's hosts);
//! - what every route shares: `errors` ([`ApiError`] and the status of each host error),
//!   `request` (bodies, queries, page tokens, the blocking pool), `middleware` (the
//!   API-key check, the 404, `Connection: close` after a refused upload);
//! - `server` ([`serve`]: the listener, the timeout sweep, the shutdown grace) and `tls`.

use std::sync::Arc;

use axum::routing::{delete, get, patch, post, put};
use axum::Router;

use crate::host::Host;

mod builds;
mod errors;
mod listing;
mod logs;
mod metrics;
mod middleware;
mod network;
mod nodes;
mod request;
mod sandboxes;
mod server;
mod snapshots;
mod tags;
mod templates;
pub mod tls;

pub use errors::ApiError;
pub use sandboxes::create_like;
pub use server::{serve, Listen, SHUTDOWN_GRACE};

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
/// The `error_code` of a 503 that says this host has no room
/// ([`Error::NoRoom`](crate::error::Error::NoRoom)): a cluster's gateway then tries
/// another node.
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

/// The router with every endpoint, behind the API-key check; requests addressed to a
/// sandbox (`E2b-Sandbox-Id`, or a `<port>-<id>.<domain>` host) go to the data plane
/// ([`crate::envd`]) instead, which needs no API key but the sandbox's own access token
/// ([`crate::envd::access`]).
pub fn router(state: AppState) -> Router {
    let data = crate::envd::Routes::new(crate::envd::DataPlane::new(state.host.clone()));
    Router::new()
        .route("/sandboxes", post(sandboxes::create).get(listing::list_v1))
        .route(
            "/v2/sandboxes",
            post(sandboxes::create).get(listing::list_v2),
        )
        .route(
            "/sandboxes/{id}",
            get(sandboxes::info).delete(sandboxes::kill),
        )
        .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/sandboxes/{id}/refreshes", post(sandboxes::refresh))
        .route("/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/sandboxes/{id}/network", put(network::update_network))
        .route("/sandboxes/metrics", get(metrics::many_metrics))
        .route("/sandboxes/{id}/metrics", get(metrics::metrics))
        .route("/sandboxes/{id}/snapshots", post(snapshots::snapshot))
        .route("/snapshots", get(snapshots::list_snapshots))
        .route(
            "/templates/{id}",
            delete(snapshots::delete_snapshot).patch(tags::update),
        )
        .route("/v2/templates/{id}", patch(tags::update))
        .route("/templates/tags", post(tags::assign).delete(tags::remove))
        .route("/templates/{id}/tags", get(tags::list))
        .route("/sandboxes/{id}/logs", get(logs::logs_v1))
        .route("/v2/sandboxes/{id}/logs", get(logs::logs_v2))
        .route("/templates", get(templates::list_templates))
        .route("/nodes", get(nodes::list_nodes))
        .route("/v3/templates", post(builds::request))
        .route("/templates/{id}/files/{hash}", get(builds::files))
        .route("/v2/templates/{id}/builds/{build}", post(builds::start))
        .route("/templates/{id}/builds/{build}/status", get(builds::status))
        .route("/templates/aliases/{name}", get(builds::alias))
        .fallback(middleware::not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::auth,
        ))
        // An upload link carries its own key (the SDK sends no API key with it).
        // Streamed to a file, its size checked as it arrives (`builds::upload`).
        .route("/build-files/{hash}/{expires}/{token}", put(builds::upload))
        // The dashboard's pages check its session themselves (the login page needs none).
        .merge(crate::dashboard::routes())
        .layer(axum::middleware::from_fn_with_state(
            data,
            crate::envd::dispatch,
        ))
        .layer(axum::middleware::from_fn(
            middleware::close_after_refused_upload,
        ))
        .with_state(state)
}

#[cfg(test)]
mod tests;

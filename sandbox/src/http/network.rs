//! A sandbox's egress policy over the control API: E2B's `network` object of a create and
//! the body of `PUT /sandboxes/{id}/network`, checked into an [`EgressPolicy`] (what this
//! host cannot do is refused, never dropped quietly). Separate because both a create and
//! the network update parse it.

use axum::body::Bytes;
use axum::extract::{Path, State as AxState};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::Value;

use super::errors::{ApiError, ApiResult};
use super::request::{blocking, body};
use super::AppState;
use crate::host::EgressPolicy;

/// E2B's `network` of a create, and the body of `PUT /sandboxes/{id}/network` (which
/// carries `allow_internet_access` itself).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(super) struct NetworkBody {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    dns_servers: Option<Vec<String>>,
    egress_proxy: Option<Value>,
    rules: Option<Value>,
    https_ports: Option<Vec<Value>>,
    /// `false`: its exposed ports need its traffic access token (creation only).
    pub(super) allow_public_traffic: Option<bool>,
    /// The Host header its exposed ports see, `${PORT}` replaced (creation only).
    pub(super) mask_request_host: Option<String>,
}

impl NetworkBody {
    /// The egress policy this asks for (with `allow_internet_access` from wherever the
    /// request carries it). What this host cannot do is refused, never dropped quietly.
    pub(super) fn policy(self, allow_internet_access: Option<bool>) -> ApiResult<EgressPolicy> {
        let refuse = |what: &str| {
            Err(ApiError::bad(format!(
                "network.{what} is not supported by this host (see docs/e2b-compat.md)"
            )))
        };
        if self.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
            return refuse("dnsServers");
        }
        if self.egress_proxy.as_ref().is_some_and(|v| !v.is_null()) {
            return refuse("egressProxy");
        }
        if self
            .rules
            .as_ref()
            .is_some_and(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
        {
            return refuse("rules");
        }
        if self.https_ports.as_ref().is_some_and(|p| !p.is_empty()) {
            return refuse("httpsPorts");
        }
        EgressPolicy::from_e2b(
            allow_internet_access
                .or(self.allow_internet_access)
                .unwrap_or(true),
            self.allow_out.as_deref().unwrap_or_default(),
            self.deny_out.as_deref().unwrap_or_default(),
        )
        .map_err(|e| ApiError::bad(format!("network: {e}")))
    }
}

/// `PUT /sandboxes/{id}/network`: replaces the egress policy (fields left out are cleared,
/// as E2B documents); 204.
pub(super) async fn update_network(
    AxState(st): AxState<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: NetworkBody = body(&bytes)?;
    if b.allow_public_traffic.is_some() || b.mask_request_host.is_some() {
        return Err(ApiError::bad(
            "allowPublicTraffic and maskRequestHost are set when a sandbox is created, not changed",
        ));
    }
    let policy = b.policy(None)?;
    blocking(&st, move |h| h.set_egress(&id, &policy)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

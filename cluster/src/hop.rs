//! A request forwarded to the node that owns its sandbox: method, path, headers and body
//! as they came (the Host header too: the data plane routes by it), plus the cluster
//! secret ([`crate::HOP_HEADER`]). Bodies stream both ways, so a command's output or a
//! file upload goes through as it is produced; an upgrade (a WebSocket to an exposed port)
//! is joined end to end once the owner agreed to it.
//!
//! Every hop carries the cluster secret (and a node's own calls the API key), so a hop
//! goes over TLS: `https://` node addresses, each node's certificate verified to the
//! cluster CA (`--cluster-ca`). Clear text (`http://`) is taken only to a loopback
//! address (nothing leaves the machine) or when the operator said so (`--cluster-plain-http`,
//! for a network that is private by other means): an address comes from the registry,
//! and a node must not send the secret in clear to wherever a row points.

use std::path::Path;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::{StatusCode, Uri, Version};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

use tokio_rustls::rustls::RootCertStore;

use crate::db::NodeRow;
use crate::error::{chain, Error, Result};
use crate::HOP_HEADER;

/// How long connecting to another node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a call a node makes of its own (a drain's resume) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

/// Headers of one connection, not of the request: not forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// The HTTP client of hops (connections to other nodes are pooled).
pub struct Hop {
    client: Client<HttpsConnector<HttpConnector>, Body>,
    /// Trusts a cluster CA (else no `https://` node can be verified).
    has_ca: bool,
    /// Clear text allowed off loopback.
    plain_http: bool,
}

impl Hop {
    /// A client verifying nodes' certificates to the CA certificates of PEM file `ca`;
    /// `plain_http`: `http://` addresses off loopback allowed.
    pub fn new(ca: Option<&Path>, plain_http: bool) -> Result<Self> {
        let roots = match ca {
            Some(p) => crate::tls::roots(p)?,
            None => RootCertStore::empty(),
        };
        let tls = crate::tls::verifying(roots)?;
        let mut c = HttpConnector::new();
        c.enforce_http(false);
        c.set_nodelay(true);
        c.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let c = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(c);
        Ok(Self {
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(c),
            has_ca: ca.is_some(),
            plain_http,
        })
    }

    /// Whether this client may send the secret to `address`.
    pub fn check(&self, address: &str) -> Result<()> {
        check_address(address, self.has_ca, self.plain_http)
    }

    /// Forwards `req` to node `node` at `address` and streams its answer back. A node
    /// that cannot be reached gets a 502 naming it.
    pub async fn forward(
        &self,
        node: &str,
        address: &str,
        secret: &str,
        mut req: Request,
    ) -> Response {
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        if let Err(e) = self.check(address) {
            return bad_gateway(node, &e.to_string());
        }
        let uri: Uri = match format!("{address}{pq}").parse() {
            Ok(u) => u,
            Err(e) => return bad_gateway(node, &format!("address {address:?}: {e}")),
        };
        let upgrade = req.headers().get(header::UPGRADE).cloned();
        let client_side = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        parts.uri = uri;
        parts.version = Version::HTTP_11;
        strip(&mut parts.headers);
        if let Some(u) = &upgrade {
            parts.headers.insert(header::UPGRADE, u.clone());
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        match HeaderValue::from_str(secret) {
            Ok(v) => {
                parts.headers.insert(HeaderName::from_static(HOP_HEADER), v);
            }
            Err(_) => return bad_gateway(node, "the cluster secret is not a header value"),
        }
        let mut resp = match self.client.request(Request::from_parts(parts, body)).await {
            Ok(r) => r,
            Err(e) => {
                return bad_gateway(node, &format!("{address} did not answer: {}", chain(&e)))
            }
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            if let Some(client_side) = client_side {
                let node_side = hyper::upgrade::on(&mut resp);
                tokio::spawn(async move {
                    match tokio::try_join!(client_side, node_side) {
                        Ok((a, b)) => {
                            let _ = tokio::io::copy_bidirectional(
                                &mut TokioIo::new(a),
                                &mut TokioIo::new(b),
                            )
                            .await;
                        }
                        Err(e) => tracing::debug!("upgrade through the cluster hop: {e}"),
                    }
                });
            }
            return resp.map(Body::new);
        }
        strip(resp.headers_mut());
        resp.map(Body::new)
    }

    /// A call this node makes of node `to` (not a client's request): the API key and the
    /// cluster secret, a JSON body. Its answer's body, if it was a success.
    pub async fn call(
        &self,
        to: &NodeRow,
        secret: &str,
        api_key: &str,
        method: &str,
        path_and_query: &str,
        body: String,
    ) -> Result<Bytes> {
        let (status, _, bytes) = self
            .request(
                to,
                secret,
                Some(api_key),
                method,
                path_and_query,
                &HeaderMap::new(),
                body,
            )
            .await?;
        if !status.is_success() {
            return Err(Error::Hop {
                node: to.name.clone(),
                why: format!(
                    "{method} {path_and_query}: {status}: {}",
                    String::from_utf8_lossy(&bytes)
                ),
            });
        }
        Ok(bytes)
    }

    /// A request to node `to` with `headers` (the client's, for a list fanned out), whole
    /// answers only.
    #[allow(clippy::too_many_arguments)]
    pub async fn request(
        &self,
        to: &NodeRow,
        secret: &str,
        api_key: Option<&str>,
        method: &str,
        path_and_query: &str,
        headers: &HeaderMap,
        body: String,
    ) -> Result<(StatusCode, HeaderMap, Bytes)> {
        let err = |why: String| Error::Hop {
            node: to.name.clone(),
            why,
        };
        self.check(&to.address).map_err(|e| err(e.to_string()))?;
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path_and_query}", to.address));
        for (k, v) in headers {
            if !HOP_BY_HOP.contains(&k.as_str()) && k != header::HOST && k != header::CONTENT_LENGTH
            {
                b = b.header(k, v);
            }
        }
        b = b.header(HOP_HEADER, secret);
        if let Some(k) = api_key {
            b = b.header("x-api-key", k);
        }
        if !body.is_empty() {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        let req = b.body(Body::from(body)).map_err(|e| err(e.to_string()))?;
        let fut = async {
            let resp = self.client.request(req).await.map_err(|e| err(chain(&e)))?;
            let (parts, body) = resp.into_parts();
            let bytes = body
                .collect()
                .await
                .map_err(|e| err(e.to_string()))?
                .to_bytes();
            Ok::<_, Error>((parts.status, parts.headers, bytes))
        };
        tokio::time::timeout(CALL_TIMEOUT, fut)
            .await
            .map_err(|_| err(format!("no answer in {CALL_TIMEOUT:?}")))?
    }
}

/// Whether the cluster secret may go to node address `address`: `https://HOST[:PORT]` if
/// there is a cluster CA to verify it by, `http://` to a loopback address or if
/// `plain_http`.
pub fn check_address(address: &str, has_ca: bool, plain_http: bool) -> Result<()> {
    let bad = |why: &str| Error::Config(format!("node address {address:?}: {why}"));
    let uri: Uri = address.parse().map_err(|e| bad(&format!("{e}")))?;
    let Some(host) = uri.host() else {
        return Err(bad("give https://HOST:PORT"));
    };
    match uri.scheme_str() {
        Some("https") if has_ca => Ok(()),
        Some("https") => Err(bad(
            "no cluster CA to verify it by (give --cluster-ca FILE)",
        )),
        Some("http") if plain_http || is_loopback(host) => Ok(()),
        Some("http") => Err(bad(
            "clear text off loopback would carry the cluster secret unencrypted: give \
             https:// (with --cluster-ca), or --cluster-plain-http on a network private by \
             other means",
        )),
        _ => Err(bad("give https://HOST:PORT")),
    }
}

fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn strip(h: &mut HeaderMap) {
    // Headers a `Connection` header names are of the connection too.
    let named: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    for n in HOP_BY_HOP.iter().map(|s| s.to_string()).chain(named) {
        h.remove(n.as_str());
    }
    h.remove(header::UPGRADE);
}

/// E2B's error body with status 502: node `node` could not be reached.
pub fn bad_gateway(node: &str, why: &str) -> Response {
    error_response(
        StatusCode::BAD_GATEWAY,
        format!("node {node} of the cluster: {why}"),
    )
}

/// E2B's error body.
pub fn error_response(status: StatusCode, message: String) -> Response {
    (
        status,
        axum::Json(serde_json::json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

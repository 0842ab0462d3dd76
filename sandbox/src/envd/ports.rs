//! Exposed ports: a request for a sandbox port other than envd's (`E2b-Sandbox-Port: P`, or
//! the host name `P-<id>.<domain>` that the SDK's `get_host(P)` gives) is forwarded over
//! HTTP/1.1 to port P of the guest, the way E2B's proxy reaches a server a process started
//! in the sandbox. A paused sandbox is resumed first when it was created with auto-resume
//! (wake on request); otherwise the request gets the answer for a sandbox not running.
//!
//! The guest is reached at its sandbox's outer address: each sandbox's network namespace
//! maps that address onto the guest (see the `hostnet` crate), so the forward is a plain
//! TCP connection from the service. One connection per request (no pooling: a dev server's
//! traffic is small, and a pooled connection would outlive a pause of its sandbox);
//! `Connection: upgrade` requests (WebSocket) are carried through both ways once the
//! guest answers 101.
//!
//! Hyper's client does the HTTP: only the hop-by-hop headers are dropped and the routing
//! headers removed; bodies stream both ways unbuffered.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{header, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use super::{access, proxy_error, DataPlane, Target};

/// How long connecting to the guest's port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Headers that belong to one hop (RFC 9110 7.6.1), and the routing headers of this
/// service: not forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
];

/// E2B's proxy answer for a port nobody listens on (502; the SDK's users see it as such).
fn port_closed(t: &Target, why: impl std::fmt::Display) -> Response {
    let mut r = (
        StatusCode::BAD_GATEWAY,
        axum::Json(serde_json::json!({
            "code": 502,
            "message": format!(
                "The sandbox is running but port {} is not open ({why})",
                t.port
            ),
            "sandboxId": t.sandbox,
            "port": t.port,
        })),
    )
        .into_response();
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

/// Forwards `req` to port `t.port` of `t.sandbox`.
pub(crate) async fn forward(dp: Arc<DataPlane>, t: Target, mut req: Request) -> Response {
    // The traffic token before anything may wake the sandbox.
    match dp.tokens(&t).await {
        Ok((_, Some(token))) => {
            if let Err(r) = access::check_traffic(&t.sandbox, &token, req.headers()) {
                return r.into_response();
            }
        }
        Ok((_, None)) => {}
        Err(r) => return r,
    }
    req.headers_mut().remove(access::TRAFFIC_TOKEN_HEADER);
    let (ip, rec) = match dp.guest_ip(&t).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    // E2B's maskRequestHost: the guest's server sees this Host, not the request's.
    if let Some(mask) = &rec.mask_host {
        if let Ok(v) = header::HeaderValue::from_str(&access::masked_host(mask, t.port)) {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    let addr = SocketAddr::new(ip, t.port);
    let stream =
        match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return port_closed(&t, e),
            Err(_) => return port_closed(&t, "no answer to a connection"),
        };
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
    {
        Ok(x) => x,
        Err(e) => return proxy_error(format!("sandbox {} port {}: {e}", t.sandbox, t.port)),
    };
    let upgrade = is_upgrade(&req);
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("forwarded connection ended: {e}");
        }
    });
    // The client's side of an upgrade, taken before the request is handed on.
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers, upgrade);
    // Only the path and query go on: the guest's server sees an origin-form target.
    parts.uri = match parts.uri.path_and_query() {
        Some(pq) => pq
            .as_str()
            .parse()
            .unwrap_or_else(|_| "/".parse().expect("/")),
        None => "/".parse().expect("/"),
    };
    parts.version = axum::http::Version::HTTP_11;
    let mut resp = match sender
        .send_request(axum::http::Request::from_parts(parts, body))
        .await
    {
        Ok(r) => r,
        Err(e) => return port_closed(&t, e),
    };
    if upgrade && resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client) = client_upgrade {
            let guest = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                match (client.await, guest.await) {
                    (Ok(c), Ok(g)) => {
                        let (mut c, mut g) = (TokioIo::new(c), TokioIo::new(g));
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut g).await;
                    }
                    (c, g) => tracing::debug!(
                        "upgrade not completed: client {:?}, guest {:?}",
                        c.err(),
                        g.err()
                    ),
                }
            });
        }
        let (parts, _) = resp.into_parts();
        return Response::from_parts(parts, axum::body::Body::empty());
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers, false);
    Response::from_parts(parts, axum::body::Body::new(body))
}

/// Whether `req` asks for a protocol upgrade (WebSocket).
fn is_upgrade(req: &Request) -> bool {
    req.headers().contains_key(header::UPGRADE)
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Drops hop-by-hop headers, and those the `Connection` header names; an upgrade keeps
/// `Connection: upgrade` and `Upgrade`.
fn strip_hop_by_hop(h: &mut axum::http::HeaderMap, upgrade: bool) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .filter(|n| !(upgrade && n == header::UPGRADE))
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(*n);
    }
    if upgrade {
        h.insert(
            header::CONNECTION,
            header::HeaderValue::from_static("upgrade"),
        );
    } else {
        h.remove(header::UPGRADE);
    }
}

impl DataPlane {
    /// The address the guest of `t`'s sandbox is reached at, resumed if it was paused.
    /// The guest's address for a forward to sandbox `t`, with its record.
    async fn guest_ip(
        self: &Arc<Self>,
        t: &Target,
    ) -> Result<(IpAddr, crate::registry::Record), Response> {
        let rec = self.record(&t.sandbox).await?;
        let ip = self.host.guest_ip(&rec).ok_or_else(|| {
            port_closed(
                t,
                "the sandbox has no network: its template was built without one",
            )
        })?;
        Ok((ip, rec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_routing_headers_are_dropped_and_an_upgrade_kept() {
        let mut h = axum::http::HeaderMap::new();
        h.insert("connection", "keep-alive, x-private".parse().unwrap());
        h.insert("x-private", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("e2b-sandbox-id", "abc".parse().unwrap());
        h.insert("e2b-sandbox-port", "3000".parse().unwrap());
        h.insert("upgrade", "websocket".parse().unwrap());
        h.insert("x-kept", "yes".parse().unwrap());
        let mut plain = h.clone();
        strip_hop_by_hop(&mut plain, false);
        let names: Vec<_> = plain.keys().map(|k| k.as_str().to_string()).collect();
        assert_eq!(names, ["x-kept"]);
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h["connection"], "upgrade");
        assert_eq!(h["upgrade"], "websocket");
        assert!(h.get("x-private").is_none() && h.get("e2b-sandbox-id").is_none());
    }
}

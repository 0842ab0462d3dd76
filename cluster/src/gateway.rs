//! In front of the E2B API of every node: which node answers a request.
//!
//! - A request another node forwarded (it carries the cluster secret) is answered here.
//! - A create is placed ([`choose`]) on a node with room, preferring one that has the
//!   template in its cache; a node with no room anywhere is answered 503, nothing created.
//! - A request for a sandbox (control plane `/sandboxes/{id}/…`, or the data plane: its
//!   `E2b-Sandbox-Id` header or `<port>-<id>.<domain>` host) goes to the node that owns it.
//!   If that node's lease ended: a paused, durable sandbox is resumed on a node with room
//!   (a request that wakes it), a running one is marked lost and answered so.
//! - Lists (sandboxes, snapshots, templates) are asked of every live node and merged.
//! - E2B's template build API goes to one node, the same from every node
//!   ([`crate::placement::builder`]).
//! - Anything else (the dashboard, a snapshot's delete when no node holds it) is answered
//!   here.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use sandbox::envd::access::same_secret;
use serde_json::Value;

use crate::db::{NodeRow, OwnerRow};
use crate::hop::error_response;
use crate::node::Node;
use crate::placement::choose;
use crate::HOP_HEADER;

/// Between nodes only: publish a snapshot as a template (body `{"snapshot": ID}`).
const PUBLISH_SNAPSHOT: &str = "/cluster/v1/publish-snapshot";

/// Largest create body read to place it.
const MAX_CREATE_BODY: usize = 1 << 20;
/// Shape assumed for a template no node recorded (the placed node then refuses it, or
/// finds it in the store).
const DEFAULT_SHAPE: (u32, u64) = (1, 512);

/// What a request is, for routing.
#[derive(Debug, PartialEq, Eq)]
enum Kind {
    /// Answered by this node.
    Here,
    /// A new sandbox.
    Create,
    /// A list of sandboxes (v2: paged).
    List { v2: bool },
    /// For one sandbox; `wakes`: it resumes a paused one.
    Sandbox { id: String, wakes: bool },
    /// Metrics of several sandboxes.
    Metrics,
    /// The list of persistent snapshots.
    Snapshots,
    /// One snapshot (a delete of it).
    Snapshot { reference: String },
    /// The list of templates.
    Templates,
    /// E2B's template build API: a build request, its files, its start, its status, an
    /// alias lookup, an upload (which carries its own token, not the API key).
    Build,
}

fn classify(req: &Request) -> Kind {
    if let Some(t) = sandbox::envd::route(req.headers()) {
        // The data plane: any request may wake a paused sandbox (auto-resume).
        return Kind::Sandbox {
            id: t.sandbox,
            wakes: true,
        };
    }
    let path = req.uri().path();
    let m = req.method();
    if path == "/snapshots" && *m == Method::GET {
        return Kind::Snapshots;
    }
    if path == "/templates" && *m == Method::GET {
        return Kind::Templates;
    }
    if is_build(m, path) {
        return Kind::Build;
    }
    if let Some(r) = path.strip_prefix("/templates/") {
        if *m == Method::DELETE && !r.is_empty() && !r.contains('/') {
            return Kind::Snapshot {
                reference: percent_encoding::percent_decode_str(r)
                    .decode_utf8_lossy()
                    .into_owned(),
            };
        }
    }
    if path == "/sandboxes/metrics" && *m == Method::GET {
        return Kind::Metrics;
    }
    let rest = path
        .strip_prefix("/v2/sandboxes")
        .or_else(|| path.strip_prefix("/sandboxes"));
    let Some(rest) = rest else {
        return Kind::Here;
    };
    let v2 = path.starts_with("/v2/");
    if rest.is_empty() || rest == "/" {
        return match *m {
            Method::POST => Kind::Create,
            Method::GET => Kind::List { v2 },
            _ => Kind::Here,
        };
    }
    let mut segs = rest.trim_start_matches('/').split('/');
    let id = segs.next().unwrap_or_default();
    if id.is_empty() || id == "metrics" {
        return Kind::Here;
    }
    let action = segs.next().unwrap_or_default();
    Kind::Sandbox {
        id: id.to_string(),
        wakes: *m == Method::POST && matches!(action, "resume" | "connect"),
    }
}

/// The middleware (`axum::middleware::from_fn_with_state` with the node).
pub async fn route(State(node): State<Arc<Node>>, mut req: Request, next: Next) -> Response {
    if let Some(v) = req.headers().get(HOP_HEADER) {
        if !node.secret_ok(v.as_bytes()) {
            return error_response(StatusCode::FORBIDDEN, "bad cluster secret".into());
        }
        req.headers_mut().remove(HOP_HEADER);
        if req.uri().path() == PUBLISH_SNAPSHOT && req.method() == Method::POST {
            return publish_snapshot(&node, req).await;
        }
        return next.run(req).await;
    }
    // The dashboard's page has a session, not the key: checked here, it goes on with the
    // key (nodes it is forwarded to know no session of this one).
    if !req.headers().contains_key("x-api-key") && node.dashboard_session(req.headers()) {
        if let Ok(k) = HeaderValue::from_str(&node.config().api_key) {
            req.headers_mut().insert("x-api-key", k);
        }
    }
    match classify(&req) {
        Kind::Here => next.run(req).await,
        // An upload carries its own token, which the builder checks.
        Kind::Build if req.uri().path().starts_with("/build-files/") => {
            build(&node, req, next).await
        }
        // Requests without the API key are refused where they are (the owner would too).
        _ if !node_key_ok(&node, req.headers()) => next.run(req).await,
        Kind::Create => create(&node, req, next).await,
        Kind::List { v2 } => list(&node, req, Listing::Sandboxes { v2 }).await,
        Kind::Snapshots => snapshots(&node, req, next).await,
        Kind::Metrics => metrics(&node, req).await,
        Kind::Templates => templates(&node, req).await,
        Kind::Build => build(&node, req, next).await,
        Kind::Snapshot { reference } => {
            let name = sandbox::host::strip_tag(&reference).unwrap_or(&reference);
            match node.db().snapshot_node(name).await {
                Ok(Some(to)) if to.live => send(&node, &to, req, next).await,
                Ok(_) => next.run(req).await,
                Err(e) => unavailable(e),
            }
        }
        Kind::Sandbox { id, wakes } => sandbox_request(&node, id, wakes, req, next).await,
    }
}

/// Whether `path` is of E2B's template build API (see [`Kind::Build`]).
fn is_build(m: &Method, path: &str) -> bool {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    matches!(
        (m.as_str(), segs.as_slice()),
        ("POST", ["v3", "templates"])
            | ("GET", ["templates", _, "files", _])
            | ("POST", ["v2", "templates", _, "builds", _])
            | ("GET", ["templates", _, "builds", _, "status"])
            | ("GET", ["templates", "aliases", _])
            | ("PUT", ["build-files", _, _, _])
            // Tags and settings are kept where templates are built.
            | ("POST" | "DELETE", ["templates", "tags"])
            | ("GET", ["templates", _, "tags"])
            | ("PATCH", ["templates", _] | ["v2", "templates", _])
    )
}

/// Template builds go to one node, the same whichever node is asked (a build's upload
/// and status polls find it there: [`crate::placement::builder`]). Its template is
/// published to the store when built, so every node can create sandboxes of it.
async fn build(node: &Node, req: Request, next: Next) -> Response {
    let nodes = match node.db().nodes().await {
        Ok(n) => n,
        Err(e) => return unavailable(e),
    };
    match crate::placement::builder(&nodes) {
        Some(to) => send(node, to, req, next).await,
        None => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "the cluster has no live node that takes sandboxes to build templates on".into(),
        ),
    }
}

/// The templates of every live node that takes sandboxes, one row per template: the
/// first node's by name, which is the builder unless it drains (tags and settings are
/// kept there, [`crate::placement::builder`]).
async fn templates(node: &Node, req: Request) -> Response {
    let answers = match fan_out(node, req).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let mut by_id: std::collections::BTreeMap<String, Value> = Default::default();
    for (_, body) in answers {
        match serde_json::from_slice::<Vec<Value>>(&body) {
            Ok(rows) => {
                for r in rows {
                    let id = r["templateID"].as_str().unwrap_or_default().to_string();
                    by_id.entry(id).or_insert(r);
                }
            }
            Err(e) => {
                return error_response(StatusCode::BAD_GATEWAY, format!("a node's templates: {e}"))
            }
        }
    }
    axum::Json(by_id.into_values().collect::<Vec<_>>()).into_response()
}

fn node_key_ok(node: &Node, h: &HeaderMap) -> bool {
    h.get("x-api-key")
        .is_some_and(|k| same_secret(k.as_bytes(), node.config().api_key.as_bytes()))
        || sandbox::envd::route(h).is_some()
}

fn unavailable(e: impl std::fmt::Display) -> Response {
    error_response(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
}

/// Why nothing could be placed.
fn no_room(nodes: &[NodeRow], vcpus: u32, mem_mib: u64) -> Response {
    let takers: Vec<String> = nodes
        .iter()
        .filter(|n| n.live && n.takes_sandboxes && !n.draining)
        .map(|n| {
            format!(
                "{}: {}/{} vCPUs, {}/{} MiB committed",
                n.name, n.used_vcpus, n.vcpus, n.used_mem_mib, n.mem_mib
            )
        })
        .collect();
    let msg = if takers.is_empty() {
        "the cluster has no live node that takes sandboxes".to_string()
    } else {
        format!(
            "the cluster is out of capacity: no node has room for {vcpus} vCPUs and {mem_mib} MiB ({})",
            takers.join("; ")
        )
    };
    error_response(StatusCode::SERVICE_UNAVAILABLE, msg)
}

/// Answers `req` here or on node `to`.
async fn send(node: &Node, to: &NodeRow, req: Request, next: Next) -> Response {
    if to.name == node.config().name {
        return next.run(req).await;
    }
    node.hop
        .forward(&to.name, &to.address, &node.config().secret, req)
        .await
}

async fn read_body(
    req: Request,
    max: usize,
) -> Result<(axum::http::request::Parts, Bytes), Response> {
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, max);
    match limited.collect().await {
        Ok(c) => Ok((parts, c.to_bytes())),
        Err(e) => Err(error_response(
            StatusCode::BAD_REQUEST,
            format!("request body: {e}"),
        )),
    }
}

async fn create(node: &Node, req: Request, next: Next) -> Response {
    let (parts, body) = match read_body(req, MAX_CREATE_BODY).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    // A body that is not JSON is the placed node's to refuse.
    let template = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| {
            v.get("templateID")
                .and_then(Value::as_str)
                .map(String::from)
        })
        .unwrap_or_default();
    // `name:tag` is a build of template `name` (snapshots have only `default`).
    let parsed = sandbox::template::tags::parse_reference(&template).ok();
    let name = parsed.map_or(template.as_str(), |(n, _)| n);
    // A persistent snapshot is on the node that took it: sandboxes of it start there.
    let snapshot = match sandbox::host::strip_tag(&template) {
        Ok(n) => node.db().snapshot_node(n).await,
        Err(_) => Ok(None),
    };
    match snapshot {
        Ok(Some(to)) if to.live => {
            return send(
                node,
                &to,
                Request::from_parts(parts, Body::from(body)),
                next,
            )
            .await
        }
        Ok(Some(to)) => {
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "snapshot {name} is on node {}, which is not answering",
                    to.name
                ),
            )
        }
        Ok(None) => {}
        Err(e) => return unavailable(e),
    }
    let shape = match node.db().template(name).await {
        Ok(s) => s.map(|s| (s.vcpus, s.mem_mib)).unwrap_or(DEFAULT_SHAPE),
        Err(e) => return unavailable(e),
    };
    let nodes = match node.db().nodes().await {
        Ok(n) => n,
        Err(e) => return unavailable(e),
    };
    // A tag other than `default` is known where templates are built (tags are kept
    // there): its sandboxes start there.
    let tagged =
        parsed.is_some_and(|(_, t)| t.is_some_and(|t| t != sandbox::template::tags::DEFAULT_TAG));
    let best = match crate::placement::builder(&nodes) {
        Some(b) if tagged => vec![b.clone()],
        _ => choose(
            &nodes,
            shape.0,
            shape.1,
            &template,
            Some(&node.config().name),
        ),
    };
    // The registry's figures lag: a node may find it has no room after all (creates placed
    // there at the same moment took it). It says so and starts nothing; the next one is
    // tried.
    let mut refused = None;
    for to in &best {
        let req = Request::from_parts(parts.clone(), Body::from(body.clone()));
        let resp = send(node, to, req, next.clone()).await;
        match no_room_after_all(resp).await {
            Ok(resp) => return resp,
            Err(resp) => {
                tracing::debug!(node = %to.name, "no room there after all: trying the next node");
                refused = Some(resp);
            }
        }
    }
    refused.unwrap_or_else(|| no_room(&nodes, shape.0, shape.1))
}

/// `Err` with the answer (read whole) if it is a node's 503 saying it has no room
/// ([`sandbox::http::NO_ROOM`]); `Ok` with it untouched otherwise.
async fn no_room_after_all(resp: Response) -> std::result::Result<Response, Response> {
    if resp.status() != StatusCode::SERVICE_UNAVAILABLE {
        return Ok(resp);
    }
    let (parts, body) = resp.into_parts();
    let bytes = match http_body_util::Limited::new(body, 64 * 1024)
        .collect()
        .await
    {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            return Ok(error_response(
                StatusCode::BAD_GATEWAY,
                format!("reading a node's answer: {e}"),
            ))
        }
    };
    let no_room = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .is_some_and(|v| v["error_code"] == sandbox::http::NO_ROOM);
    let resp = Response::from_parts(parts, Body::from(bytes));
    if no_room {
        Err(resp)
    } else {
        Ok(resp)
    }
}

async fn sandbox_request(
    node: &Node,
    id: String,
    wakes: bool,
    req: Request,
    next: Next,
) -> Response {
    // The data plane's many small requests use a route read a moment ago (a running
    // sandbox's owner); the control plane asks the registry every time.
    let data_plane = sandbox::envd::route(req.headers()).is_some();
    let row = match node.routes.get(&id).filter(|_| data_plane) {
        Some(r) => Ok(Some(r)),
        None => node.db().owner(&id).await.inspect(|r| {
            if let Some(r) = r {
                node.routes.put(r);
            }
        }),
    };
    let row = match row {
        Ok(r) => r,
        Err(e) => return unavailable(e),
    };
    let Some(row) = row else {
        // Not in the cluster's registry: this node answers (not found, or from the store).
        return next.run(req).await;
    };
    let me = node.config().name.as_str();
    if row.state == "lost" {
        return lost(node, &row, req).await;
    }
    if row.node.as_deref() == Some(me) {
        return next.run(req).await;
    }
    let owner = row.node.clone().unwrap_or_default();
    let elsewhere = row.state == "paused" && (!row.owner_live || row.owner_draining) && wakes;
    if row.owner_live && !elsewhere {
        let is_fork = req.method() == Method::POST && req.uri().path().ends_with("/fork");
        if is_fork && !data_plane {
            return fork(node, &row, req).await;
        }
        let address = row.owner_address.clone().unwrap_or_default();
        return node
            .hop
            .forward(&owner, &address, &node.config().secret, req)
            .await;
    }
    if row.state == "running" && row.checkpointed && !row.owner_live {
        // Its node was lost while it ran, and it has a checkpoint: it comes back from
        // there on a node with room, whatever the request.
        return from_checkpoint(node, &row, req, next).await;
    }
    if row.state == "running" {
        // Its node stopped renewing its lease while it ran.
        let why = format!("node {owner} stopped answering while it ran (its lease ended)");
        match node.db().mark_lost(&id, &why).await {
            Ok(_) => {}
            Err(e) => return unavailable(e),
        }
        return match node.db().owner(&id).await {
            Ok(Some(r)) if r.state == "lost" => lost(node, &r, req).await,
            // Its node came back meanwhile: ask again.
            Ok(_) => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("sandbox {id}: its node {owner} came back; try again"),
            ),
            Err(e) => unavailable(e),
        };
    }
    if !elsewhere {
        // Not waking it (its info, a kill): answered here from the store.
        return next.run(req).await;
    }
    if !row.durable {
        return error_response(
            StatusCode::NOT_FOUND,
            format!(
                "sandbox {id} is lost: it was paused on node {owner}, which stopped answering \
                 before the pause reached the object store"
            ),
        );
    }
    let nodes = match node.db().nodes().await {
        Ok(n) => n,
        Err(e) => return unavailable(e),
    };
    let (vcpus, mem) = shape_of(node, &id).await;
    let best = choose(&nodes, vcpus, mem, "", Some(me));
    match best.first() {
        Some(to) => send(node, to, req, next).await,
        None => no_room(&nodes, vcpus, mem),
    }
}

/// Resumes a sandbox whose node was lost from its last checkpoint on a node with room
/// (this one if it has room), then answers `req` there. Two nodes doing so at once: the
/// store's claim lets one resume it, the other forwards to it.
async fn from_checkpoint(node: &Node, row: &OwnerRow, req: Request, next: Next) -> Response {
    let id = row.id.clone();
    let nodes = match node.db().nodes().await {
        Ok(n) => n,
        Err(e) => return unavailable(e),
    };
    let (vcpus, mem) = shape_of(node, &id).await;
    let Some(to) = choose(&nodes, vcpus, mem, "", Some(&node.config().name))
        .into_iter()
        .next()
    else {
        return no_room(&nodes, vcpus, mem);
    };
    let body = serde_json::json!({ "timeout": sandbox::http::DEFAULT_TIMEOUT_S }).to_string();
    let cfg = node.config();
    let woke = node
        .hop
        .call(
            &to,
            &cfg.secret,
            &cfg.api_key,
            "POST",
            &format!("/sandboxes/{id}/connect"),
            body,
        )
        .await;
    if let Err(e) = &woke {
        tracing::warn!(sandbox = %id, "resuming it from its checkpoint: {e}");
    }
    // Whoever resumed it owns it now.
    match node.db().owner(&id).await {
        Ok(Some(r)) if r.owner_live && r.node.is_some() => {
            tracing::info!(sandbox = %id, node = ?r.node, "resumed from its checkpoint");
            let owner = nodes.into_iter().find(|n| Some(&n.name) == r.node.as_ref());
            match owner {
                Some(o) => send(node, &o, req, next).await,
                None => next.run(req).await,
            }
        }
        Ok(_) => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "sandbox {id}: its node was lost; resuming it from its checkpoint failed: {}",
                woke.err().map(|e| e.to_string()).unwrap_or_default()
            ),
        ),
        Err(e) => unavailable(e),
    }
}

/// `POST /sandboxes/{id}/fork` of a sandbox on a live node: children on its node as far as
/// its room goes (copy-on-write), the rest created on other nodes with room from a
/// snapshot of the parent published to the store. Children made before a failure are
/// killed: a fork is whole or nothing.
async fn fork(node: &Node, row: &OwnerRow, req: Request) -> Response {
    let (parts, body) = match read_body(req, MAX_CREATE_BODY).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let b: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let count = b.get("count").and_then(Value::as_u64).unwrap_or(1);
    let nodes = match node.db().nodes().await {
        Ok(n) => n,
        Err(e) => return unavailable(e),
    };
    let Some(owner) = nodes
        .iter()
        .find(|n| Some(&n.name) == row.node.as_ref())
        .cloned()
    else {
        return unavailable(format!("sandbox {}: its node left the registry", row.id));
    };
    let (vcpus, mem) = shape_of(node, &row.id).await;
    let room = |n: &NodeRow| -> u64 {
        let by_cpu = (n.vcpus as i64 - n.used_vcpus).max(0) as u64 / u64::from(vcpus.max(1));
        let by_mem = (n.mem_mib - n.used_mem_mib).max(0) as u64 / mem.max(1);
        by_cpu.min(by_mem)
    };
    let here = room(&owner).min(count);
    let cfg = node.config();
    let req_of = |body: Bytes| {
        let mut p = parts.clone();
        p.headers.remove(axum::http::header::CONTENT_LENGTH);
        Request::from_parts(p, Body::from(body))
    };
    if here == count
        || count == 0
        || nodes.iter().filter(|n| n.live && n.takes_sandboxes).count() < 2
    {
        // All on its node (or nowhere else to go): its answer as it is.
        return node
            .hop
            .forward(&owner.name, &owner.address, &cfg.secret, req_of(body))
            .await;
    }
    let key = parts
        .headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let mut children: Vec<Value> = Vec::new();
    let mut made: Vec<(NodeRow, String)> = Vec::new();
    let result = async {
        if here > 0 {
            let mut local = b.clone();
            local["count"] = Value::from(here);
            let out = node
                .hop
                .call(
                    &owner,
                    &cfg.secret,
                    &key,
                    "POST",
                    parts.uri.path(),
                    local.to_string(),
                )
                .await
                .map_err(|e| e.to_string())?;
            let v: Vec<Value> = serde_json::from_slice(&out).map_err(|e| e.to_string())?;
            for c in v {
                if let Some(id) = c["sandbox"]["sandboxID"].as_str() {
                    made.push((owner.clone(), id.to_string()));
                }
                children.push(c);
            }
        }
        // The rest from a snapshot of the parent, published for the other nodes.
        let snap = node
            .hop
            .call(
                &owner,
                &cfg.secret,
                &key,
                "POST",
                &format!("/sandboxes/{}/snapshots", row.id),
                "{}".into(),
            )
            .await
            .map_err(|e| e.to_string())?;
        let snap: Value = serde_json::from_slice(&snap).map_err(|e| e.to_string())?;
        let snap_id = snap["snapshotID"].as_str().unwrap_or_default().to_string();
        let published = node
            .hop
            .call(
                &owner,
                &cfg.secret,
                &key,
                "POST",
                PUBLISH_SNAPSHOT,
                serde_json::json!({ "snapshot": snap_id, "sandbox": row.id }).to_string(),
            )
            .await
            .map_err(|e| e.to_string())?;
        let published: Value = serde_json::from_slice(&published).map_err(|e| e.to_string())?;
        // Children like the parent: metadata, env vars, lifecycle, tokens, egress.
        let mut create = published["create"].clone();
        if !create.is_object() {
            return Err("the parent's node did not say how to make its children".into());
        }
        if let Some(t) = b.get("timeout") {
            create["timeout"] = t.clone();
        }
        for _ in here..count {
            let nodes = node.db().nodes().await.map_err(|e| e.to_string())?;
            let to = choose(&nodes, vcpus, mem, "", None)
                .into_iter()
                .find(|n| n.name != owner.name)
                .ok_or_else(|| "no other node has room for the rest of the children".to_string())?;
            let out = node
                .hop
                .call(
                    &to,
                    &cfg.secret,
                    &key,
                    "POST",
                    "/sandboxes",
                    create.to_string(),
                )
                .await
                .map_err(|e| e.to_string())?;
            let sb: Value = serde_json::from_slice(&out).map_err(|e| e.to_string())?;
            if let Some(id) = sb["sandboxID"].as_str() {
                made.push((to.clone(), id.to_string()));
            }
            children.push(serde_json::json!({ "sandbox": sb }));
        }
        Ok::<(), String>(())
    }
    .await;
    match result {
        Ok(()) => (StatusCode::CREATED, axum::Json(children)).into_response(),
        Err(why) => {
            for (n, id) in made {
                let _ = node
                    .hop
                    .call(
                        &n,
                        &cfg.secret,
                        &key,
                        "DELETE",
                        &format!("/sandboxes/{id}"),
                        String::new(),
                    )
                    .await;
            }
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "fork of {} across the cluster failed (no child kept): {why}",
                    row.id
                ),
            )
        }
    }
}

/// Between nodes: publishes one of this node's snapshots as a template in the store.
async fn publish_snapshot(node: &Node, req: Request) -> Response {
    let (_, body) = match read_body(req, 4096).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let v = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
    let Some(snap) = v["snapshot"].as_str().map(String::from) else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "give {\"snapshot\": ID, \"sandbox\": ID}".into(),
        );
    };
    // With the sandbox it was taken of: the create request that makes sandboxes like it.
    let like = v["sandbox"].as_str().map(String::from);
    let Some(host) = node.host() else {
        return unavailable("this node is shutting down");
    };
    let published = tokio::task::spawn_blocking(move || {
        let name = host.publish_snapshot(&snap)?;
        let create = match like {
            Some(id) => Some(sandbox::http::create_like(&host.get_local(&id)?, &name)),
            None => None,
        };
        Ok::<_, sandbox::Error>((name, create))
    })
    .await;
    match published {
        Ok(Ok((name, create))) => {
            axum::Json(serde_json::json!({ "template": name, "create": create })).into_response()
        }
        Ok(Err(e)) => error_response(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e) => unavailable(e),
    }
}

async fn shape_of(node: &Node, id: &str) -> (u32, u64) {
    let r = node
        .db()
        .run(|c| {
            let id = id.to_string();
            async move {
                c.query_opt(
                    "SELECT vcpus, mem_mib FROM clade_sandboxes WHERE id = $1",
                    &[&id],
                )
                .await
            }
        })
        .await;
    match r {
        Ok(Some(r)) => (
            r.get::<_, i32>(0).max(0) as u32,
            r.get::<_, i64>(1).max(0) as u64,
        ),
        _ => DEFAULT_SHAPE,
    }
}

/// A lost sandbox: a kill removes its row; anything else is told it was lost.
async fn lost(node: &Node, row: &OwnerRow, req: Request) -> Response {
    if req.method() == Method::DELETE && sandbox::envd::route(req.headers()).is_none() {
        return match node.db().forget_lost(&row.id).await {
            Ok(_) => StatusCode::NO_CONTENT.into_response(),
            Err(e) => unavailable(e),
        };
    }
    error_response(
        StatusCode::NOT_FOUND,
        format!(
            "sandbox {} was lost: {}; it had no durable checkpoint",
            row.id,
            row.lost_why
                .as_deref()
                .unwrap_or("its node stopped answering")
        ),
    )
}

/// A list: every live node's (the same query), merged. Rows the store shows on several
/// nodes appear once (a node's own row over a store copy: `running` wins).
/// What a merged list is of.
#[derive(Debug, Clone, Copy)]
enum Listing {
    /// Sandboxes (v2: paged).
    Sandboxes { v2: bool },
    /// Persistent snapshots (paged).
    Snapshots,
}

impl Listing {
    fn time_field(self) -> &'static str {
        match self {
            Listing::Sandboxes { .. } => "startedAt",
            Listing::Snapshots => "createdAt",
        }
    }
    fn id_field(self) -> &'static str {
        match self {
            Listing::Sandboxes { .. } => "sandboxID",
            Listing::Snapshots => "snapshotID",
        }
    }
    fn paged(self) -> bool {
        !matches!(self, Listing::Sandboxes { v2: false })
    }
}

/// `GET /snapshots`: those of one sandbox from the node that holds them, all of them
/// merged from every node.
async fn snapshots(node: &Node, req: Request, next: Next) -> Response {
    if let Some(sid) = query_value(req.uri().query(), "sandboxID") {
        let to = match node.db().snapshots_node(&sid).await {
            Ok(Some(n)) => Some(n),
            Ok(None) => match node.db().owner(&sid).await {
                Ok(Some(OwnerRow { node: Some(n), .. })) => node
                    .db()
                    .nodes()
                    .await
                    .ok()
                    .and_then(|all| all.into_iter().find(|x| x.name == n)),
                Ok(_) => None,
                Err(e) => return unavailable(e),
            },
            Err(e) => return unavailable(e),
        };
        return match to {
            Some(to) if to.live => send(node, &to, req, next).await,
            _ => next.run(req).await,
        };
    }
    list(node, req, Listing::Snapshots).await
}

/// `GET /sandboxes/metrics`: every live node's answer, merged.
async fn metrics(node: &Node, req: Request) -> Response {
    let answers = match fan_out(node, req).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let mut all = serde_json::Map::new();
    for (_, body) in answers {
        if let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(&body) {
            if let Some(Value::Object(m)) = o.remove("sandboxes") {
                all.extend(m);
            }
        }
    }
    axum::Json(serde_json::json!({ "sandboxes": all })).into_response()
}

/// `req` asked of every live node that takes sandboxes: each answer's headers and body.
/// The first refusal is answered as it is.
async fn fan_out(node: &Node, req: Request) -> Result<Vec<(HeaderMap, Bytes)>, Response> {
    // Only the head is kept across the waits (a body is not `Sync`).
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let headers = req.headers().clone();
    drop(req);
    let nodes = node.db().nodes().await.map_err(unavailable)?;
    let asks = nodes
        .iter()
        .filter(|n| n.live && n.takes_sandboxes)
        .map(|n| {
            let headers = headers.clone();
            let pq = pq.clone();
            async move {
                node.hop
                    .request(
                        n,
                        &node.config().secret,
                        None,
                        "GET",
                        &pq,
                        &headers,
                        String::new(),
                    )
                    .await
            }
        });
    let mut out = Vec::new();
    for a in futures::future::join_all(asks).await {
        let (status, h, body) =
            a.map_err(|e| error_response(StatusCode::BAD_GATEWAY, e.to_string()))?;
        if !status.is_success() {
            let mut r = Response::new(Body::from(body));
            *r.status_mut() = status;
            r.headers_mut()
                .insert("content-type", HeaderValue::from_static("application/json"));
            return Err(r);
        }
        out.push((h, body));
    }
    Ok(out)
}

async fn list(node: &Node, req: Request, what: Listing) -> Response {
    let limit = query_value(req.uri().query(), "limit")
        .and_then(|l| l.parse::<usize>().ok())
        .unwrap_or(sandbox::http::DEFAULT_PAGE)
        .clamp(1, sandbox::http::MAX_PAGE);
    let ascending = query_value(req.uri().query(), "order").as_deref() == Some("asc");
    let answers = match fan_out(node, req).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let mut rows: Vec<Value> = Vec::new();
    let mut more = false;
    for (h, body) in answers {
        more |= h.contains_key("x-next-token");
        match serde_json::from_slice::<Vec<Value>>(&body) {
            Ok(v) => rows.extend(v),
            Err(e) => {
                return error_response(StatusCode::BAD_GATEWAY, format!("a node's list: {e}"))
            }
        }
    }
    // One row per sandbox: a running one over a paused copy from the store.
    let mut by_id: std::collections::BTreeMap<String, Value> = Default::default();
    for r in rows {
        let id = r
            .get(what.id_field())
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let running = r.get("state").and_then(Value::as_str) == Some("running");
        match by_id.get(&id) {
            Some(_) if !running => {}
            _ => {
                by_id.insert(id, r);
            }
        }
    }
    let key = |r: &Value| {
        (
            r.get(what.time_field())
                .and_then(Value::as_str)
                .and_then(sandbox::ids::parse_rfc3339)
                .unwrap_or(0),
            r.get(what.id_field())
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
        )
    };
    let mut all: Vec<Value> = by_id.into_values().collect();
    all.sort_by_key(key);
    if !ascending {
        all.reverse();
    }
    let mut out = axum::http::HeaderMap::new();
    if what.paged() {
        more |= all.len() > limit;
        all.truncate(limit);
        if let (true, Some(last)) = (more, all.last()) {
            let (ms, id) = key(last);
            if let Ok(v) = HeaderValue::from_str(&format!("{ms}_{id}")) {
                out.insert("x-next-token", v);
            }
        }
    }
    (out, axum::Json(all)).into_response()
}

fn query_value(q: Option<&str>, name: &str) -> Option<String> {
    q?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| v.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(m: Method, uri: &str, headers: &[(&str, &str)]) -> Request {
        let mut b = Request::builder().method(m).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(Body::empty()).unwrap()
    }

    #[test]
    fn requests_are_classified_by_path_and_headers() {
        assert_eq!(
            classify(&req(Method::GET, "/templates", &[])),
            Kind::Templates
        );
        for (m, p) in [
            (Method::POST, "/v3/templates"),
            (Method::GET, "/templates/t/files/abc"),
            (Method::POST, "/v2/templates/t/builds/b1"),
            (Method::GET, "/templates/t/builds/b1/status"),
            (Method::GET, "/templates/aliases/t"),
            (Method::POST, "/templates/tags"),
            (Method::DELETE, "/templates/tags"),
            (Method::GET, "/templates/t/tags"),
            (Method::PATCH, "/templates/t"),
            (Method::PATCH, "/v2/templates/t"),
            (Method::PUT, "/build-files/abc/1700000000/token"),
        ] {
            assert_eq!(classify(&req(m.clone(), p, &[])), Kind::Build, "{m} {p}");
        }
        assert_eq!(
            classify(&req(Method::GET, "/build-files/abc/1700000000/token", &[])),
            Kind::Here
        );
        assert_eq!(
            classify(&req(Method::GET, "/v3/templates", &[])),
            Kind::Here
        );
        assert_eq!(
            classify(&req(Method::POST, "/sandboxes", &[])),
            Kind::Create
        );
        assert_eq!(
            classify(&req(Method::POST, "/v2/sandboxes", &[])),
            Kind::Create
        );
        assert_eq!(
            classify(&req(Method::GET, "/v2/sandboxes?limit=3", &[])),
            Kind::List { v2: true }
        );
        assert_eq!(
            classify(&req(Method::GET, "/sandboxes", &[])),
            Kind::List { v2: false }
        );
        assert_eq!(
            classify(&req(Method::GET, "/sandboxes/metrics", &[])),
            Kind::Metrics
        );
        assert_eq!(
            classify(&req(Method::GET, "/snapshots?limit=1", &[])),
            Kind::Snapshots
        );
        assert_eq!(
            classify(&req(Method::DELETE, "/templates/snap-1%3Adefault", &[])),
            Kind::Snapshot {
                reference: "snap-1:default".into()
            }
        );
        assert_eq!(classify(&req(Method::GET, "/templates/x", &[])), Kind::Here);
        assert_eq!(
            classify(&req(Method::POST, "/sandboxes/abc/connect", &[])),
            Kind::Sandbox {
                id: "abc".into(),
                wakes: true
            }
        );
        assert_eq!(
            classify(&req(Method::POST, "/v2/sandboxes/abc/connect", &[])),
            Kind::Sandbox {
                id: "abc".into(),
                wakes: true
            }
        );
        assert_eq!(
            classify(&req(Method::POST, "/sandboxes/abc/pause", &[])),
            Kind::Sandbox {
                id: "abc".into(),
                wakes: false
            }
        );
        assert_eq!(
            classify(&req(Method::DELETE, "/sandboxes/abc", &[])),
            Kind::Sandbox {
                id: "abc".into(),
                wakes: false
            }
        );
        assert_eq!(
            classify(&req(
                Method::POST,
                "/process.Process/Start",
                &[("e2b-sandbox-id", "xyz")]
            )),
            Kind::Sandbox {
                id: "xyz".into(),
                wakes: true
            }
        );
        assert_eq!(
            classify(&req(Method::GET, "/", &[("host", "8080-xyz.example.org")])),
            Kind::Sandbox {
                id: "xyz".into(),
                wakes: true
            }
        );
    }
}

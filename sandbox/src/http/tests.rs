//! The HTTP layer against the lifecycle with a table-driven VM driver (no KVM): status
//! codes, bodies and headers as the e2b SDK parses them.

use axum::body::Body;
use axum::http::{HeaderMap, Request as HttpRequest};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::*;
use crate::host::tests::host;
use crate::ids;

const KEY: &str = "e2b_test_key";

fn app(name: &str) -> (Router, std::path::PathBuf) {
    let (h, _drv, d) = host(name);
    (router(state_of(Arc::new(h))), d)
}

fn state_of(host: Arc<Host>) -> AppState {
    AppState {
        host,
        api_key: Arc::new(KEY.into()),
        domain: None,
        sessions: Default::default(),
        builds: Arc::new(crate::build::Builds::new(
            std::path::Path::new("/nonexistent"),
            None,
        )),
    }
}

async fn call(
    app: &Router,
    method: &str,
    uri: &str,
    body: Option<&str>,
) -> (u16, HeaderMap, Value) {
    call_key(app, method, uri, body, Some(KEY)).await
}

/// E2B's "files" call for template `t1`'s files of `hash`, asked of host `clade.test:3000`:
/// its status and its body (`present`, and the upload link `url` when not).
async fn upload_link(app: &Router, hash: &str) -> (u16, Value) {
    let req = HttpRequest::builder()
        .uri(format!("/templates/t1/files/{hash}"))
        .header("X-API-KEY", KEY)
        .header("host", "clade.test:3000")
        .body(Body::empty())
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap())
}

async fn call_key(
    app: &Router,
    method: &str,
    uri: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> (u16, HeaderMap, Value) {
    let mut b = HttpRequest::builder().method(method).uri(uri);
    if let Some(k) = key {
        b = b.header("X-API-KEY", k);
    }
    let req = b
        .header("content-type", "application/json")
        .body(Body::from(body.unwrap_or("").to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
    };
    (status, headers, v)
}

#[tokio::test]
async fn auth_is_required() {
    let (app, d) = app("auth");
    let (s, _, v) = call_key(&app, "GET", "/v2/sandboxes", None, None).await;
    assert_eq!(s, 401);
    assert_eq!(v["code"], 401);
    assert!(v["message"].as_str().unwrap().contains("missing"));
    let (s, _, v) = call_key(&app, "GET", "/v2/sandboxes", None, Some("wrong")).await;
    assert_eq!(s, 401);
    assert_eq!(v["message"], "Invalid API key");
    // Unknown paths need the key too, then are 404 with an error body.
    let (s, _, v) = call(&app, "GET", "/nope", None).await;
    assert_eq!((s, v["code"].clone()), (404, json!(404)));
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn sandbox_life_over_http() {
    let (app, d) = app("life");
    let (s, _, v) = call(
        &app,
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"t","timeout":60,"metadata":{"user":"ann"},"envVars":{"A":"1"},"autoPause":false,"secure":true,"allow_internet_access":true}"#),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 20);
    assert_eq!(v["templateID"], "t");
    assert_eq!(v["clientID"], CLIENT_ID);
    assert_eq!(v["envdVersion"], ENVD_VERSION);

    let (s, _, v) = call(&app, "GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, 200);
    assert_eq!(v["state"], "running");
    assert_eq!(v["cpuCount"], 2);
    assert_eq!(v["memoryMB"], 128);
    assert_eq!(v["metadata"]["user"], "ann");
    assert_eq!(v["lifecycle"]["onTimeout"], "kill");
    assert!(ids::parse_rfc3339(v["endAt"].as_str().unwrap()).is_some());

    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/timeout"),
        Some(r#"{"timeout":120}"#),
    )
    .await;
    assert_eq!(s, 204);
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/refreshes"),
        Some(r#"{"duration":10}"#),
    )
    .await;
    assert_eq!(s, 204);
    let (s, _, v) = call(&app, "GET", &format!("/sandboxes/{id}/metrics"), None).await;
    assert_eq!(s, 200);
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["memTotal"], 128 * 1024 * 1024);

    let (s, _, _) = call(&app, "POST", &format!("/sandboxes/{id}/pause"), Some("{}")).await;
    assert_eq!(s, 204);
    let (s, _, v) = call(&app, "POST", &format!("/sandboxes/{id}/pause"), None).await;
    assert_eq!(s, 409, "{v}");
    let (s, _, v) = call(&app, "GET", "/v2/sandboxes?state=paused", None).await;
    assert_eq!(s, 200);
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["state"], "paused");
    let (s, _, v) = call(&app, "GET", "/sandboxes", None).await;
    assert_eq!(
        (s, v.as_array().unwrap().len()),
        (200, 0),
        "v1 lists running ones"
    );

    let (s, _, v) = call(
        &app,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some(r#"{"timeout":30}"#),
    )
    .await;
    assert_eq!(s, 201, "resumed: {v}");
    assert_eq!(v["sandboxID"], id.as_str());
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(r#"{"timeout":30}"#),
    )
    .await;
    assert_eq!(s, 200, "already running");

    let (s, _, v) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(r#"{"count":2,"timeout":30}"#),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let kids: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["sandbox"]["sandboxID"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(kids.len(), 2);
    let (_, _, v) = call(&app, "GET", "/v2/sandboxes?state=running", None).await;
    assert_eq!(v.as_array().unwrap().len(), 3);

    for k in kids.iter().chain([&id]) {
        let (s, _, _) = call(&app, "DELETE", &format!("/sandboxes/{k}"), None).await;
        assert_eq!(s, 204);
    }
    let (s, _, v) = call(&app, "GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, 404);
    assert_eq!(v["code"], 404);
    let (s, _, _) = call(&app, "DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, 404);
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn a_refused_upload_closes_its_connection() {
    let (app, _d) = app("refused-upload");
    let send = |uri: &str, body: &'static str| {
        let req = HttpRequest::builder()
            .method("POST")
            .uri(uri)
            .header("X-API-KEY", KEY)
            .header("content-length", body.len().to_string())
            .body(Body::from(body))
            .unwrap();
        app.clone().oneshot(req)
    };
    // Refused with its body unread: the client must not send another request on it.
    let r = send(
        "/sandboxes/nosuchsandbox000000000/snapshots",
        "{\"name\": 1}",
    )
    .await
    .unwrap();
    assert!(r.status().is_client_error(), "{}", r.status());
    assert_eq!(
        r.headers().get("connection").map(|v| v.as_bytes()),
        Some(&b"close"[..])
    );
    // Without a body, or answered, the connection stays.
    let r = send("/sandboxes/nosuchsandbox000000000/snapshots", "")
        .await
        .unwrap();
    assert!(r.status().is_client_error(), "{}", r.status());
    assert!(r.headers().get("connection").is_none());
    let (s, h, _) = call(&app, "GET", "/sandboxes", None).await;
    assert_eq!(s, 200);
    assert!(h.get("connection").is_none());
}

#[tokio::test]
async fn bad_input_gets_400_with_a_message() {
    let (app, d) = app("badinput");
    for body in [
        "{not json",
        "[]",
        r#"{"timeout":5}"#,
        r#"{"templateID":"nope"}"#,
        r#"{"templateID":"t","timeout":-1}"#,
        r#"{"templateID":"t","timeout":99999999}"#,
        r#"{"templateID":"t","metadata":{"a":1}}"#,
        r#"{"templateID":"t","envVars":"x"}"#,
        r#"{"templateID":7}"#,
    ] {
        let (s, _, v) = call(&app, "POST", "/v2/sandboxes", Some(body)).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["code"], 400);
        assert!(!v["message"].as_str().unwrap().is_empty());
    }
    let (_, _, v) = call(&app, "POST", "/v2/sandboxes", Some(r#"{"templateID":"t"}"#)).await;
    let id = v["sandboxID"].as_str().unwrap().to_string();
    for (uri, body) in [
        (format!("/sandboxes/{id}/fork"), r#"{"count":1000}"#),
        (format!("/sandboxes/{id}/fork"), r#"{"count":-1}"#),
        (format!("/sandboxes/{id}/timeout"), r#"{}"#),
        (format!("/sandboxes/{id}/timeout"), r#"{"timeout":"soon"}"#),
    ] {
        let (s, _, v) = call(&app, "POST", &uri, Some(body)).await;
        assert_eq!(s, 400, "{uri} {body}: {v}");
    }
    for q in [
        "state=sleeping",
        "limit=0",
        "limit=x",
        "order=up",
        "nextToken=abc",
        "startedAfter=today",
    ] {
        let (s, _, v) = call(&app, "GET", &format!("/v2/sandboxes?{q}"), None).await;
        assert_eq!(s, 400, "{q}: {v}");
    }
    let (s, _, _) = call(&app, "POST", "/sandboxes/nosuch/pause", None).await;
    assert_eq!(s, 404);
    let (s, _, _) = call(&app, "GET", "/sandboxes/..%2F..%2Fetc", None).await;
    assert_eq!(s, 404);
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn lifecycle_as_e2b_has_it() {
    let (app, d) = app("lifecycle");
    // What E2B refuses: auto-resume without a pausing timeout, a filesystem-only pause
    // with auto-resume, autoPauseMemory with a killing timeout.
    for body in [
        r#"{"templateID":"t","autoResume":{"enabled":true}}"#,
        r#"{"templateID":"t","autoPause":false,"autoResume":{"enabled":true}}"#,
        r#"{"templateID":"t","autoPause":true,"autoPauseMemory":false,"autoResume":{"enabled":true}}"#,
        r#"{"templateID":"t","autoPause":false,"autoPauseMemory":true}"#,
        r#"{"templateID":"t","autoPause":true,"autoResume":true}"#,
    ] {
        let (s, _, v) = call(&app, "POST", "/v2/sandboxes", Some(body)).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert!(!v["message"].as_str().unwrap().is_empty());
    }
    let (s, _, v) = call(
        &app,
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"t","autoPause":true,"autoPauseMemory":true,"autoResume":{"enabled":true}}"#),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let (_, _, v) = call(&app, "GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(
        v["lifecycle"],
        json!({"autoResume": true, "onTimeout": "pause"})
    );
    // A pause that drops memory needs a template that records its boot ("t" was built
    // before builds did): refused, the sandbox untouched.
    let (s, _, v) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/pause"),
        Some(r#"{"memory":false}"#),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("records no boot"),
        "{v}"
    );
    let (_, _, v) = call(&app, "GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(v["state"], "running");
    // A timeout of 0 applies the timeout's action now: this one pauses.
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/timeout"),
        Some(r#"{"timeout":0}"#),
    )
    .await;
    assert_eq!(s, 204);
    let (_, _, v) = call(&app, "GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(v["state"], "paused");
    assert_eq!(v["pauseMode"], "full");
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(r#"{"timeout":30,"memory":false}"#),
    )
    .await;
    assert_eq!(s, 400, "a reboot of a template without a boot is refused");
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(r#"{"timeout":30,"memory":true}"#),
    )
    .await;
    assert_eq!(s, 201);
    // And a sandbox that is killed on timeout is gone.
    let (_, _, v) = call(&app, "POST", "/v2/sandboxes", Some(r#"{"templateID":"t"}"#)).await;
    let k = v["sandboxID"].as_str().unwrap().to_string();
    let (_, _, v) = call(&app, "GET", &format!("/sandboxes/{k}"), None).await;
    assert_eq!(
        v["lifecycle"],
        json!({"autoResume": false, "onTimeout": "kill"})
    );
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{k}/timeout"),
        Some(r#"{"timeout":0}"#),
    )
    .await;
    assert_eq!(s, 204);
    let (s, _, _) = call(&app, "GET", &format!("/sandboxes/{k}"), None).await;
    assert_eq!(s, 404);
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn sandboxes_are_secured_with_tokens_of_their_own() {
    let (app, d) = app("tokens");
    let (s, _, v) = call(&app, "POST", "/v2/sandboxes", Some(r#"{"templateID":"t"}"#)).await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let token = v["envdAccessToken"]
        .as_str()
        .expect("secured by default")
        .to_string();
    assert_eq!(token.len(), 64);
    assert_eq!(v["trafficAccessToken"], Value::Null, "public ports");
    // Connect and resume answer the same token; info does not show it.
    let (_, _, c) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(r#"{"timeout":30}"#),
    )
    .await;
    assert_eq!(c["envdAccessToken"], token.as_str());
    let (_, _, i) = call(&app, "GET", &format!("/sandboxes/{id}"), None).await;
    assert!(i.get("envdAccessToken").is_none(), "{i}");
    // Fork children: secured, each with its own.
    let (_, _, kids) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(r#"{"count":2}"#),
    )
    .await;
    let kid_tokens: Vec<&str> = kids
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["sandbox"]["envdAccessToken"].as_str().unwrap())
        .collect();
    assert_eq!(kid_tokens.len(), 2);
    assert!(kid_tokens.iter().all(|t| *t != token && t.len() == 64));
    assert_ne!(kid_tokens[0], kid_tokens[1]);
    // Opting out; private traffic; a Host mask.
    let (_, _, v) = call(
        &app,
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"t","secure":false}"#),
    )
    .await;
    assert!(v.get("envdAccessToken").is_none(), "{v}");
    let (s, _, v) = call(
        &app,
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"t","network":{"allowPublicTraffic":false,"maskRequestHost":"${PORT}-app.example.org"}}"#),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let private = v["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(v["trafficAccessToken"].as_str().unwrap().len(), 64);
    for bad in [
        r#"{"templateID":"t","network":{"maskRequestHost":"a b"}}"#,
        r#"{"templateID":"t","network":{"maskRequestHost":"x
Injected: 1"}}"#,
        r#"{"templateID":"t","secure":"yes"}"#,
    ] {
        let (s, _, v) = call(&app, "POST", "/v2/sandboxes", Some(bad)).await;
        assert_eq!(s, 400, "{bad}: {v}");
    }
    let (s, _, _) = call(
        &app,
        "PUT",
        &format!("/sandboxes/{private}/network"),
        Some(r#"{"allowPublicTraffic":true}"#),
    )
    .await;
    assert_eq!(s, 400, "set at creation only");
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn lists_are_newest_first_unless_asked() {
    let (app, d) = app("newest");
    let mut made = Vec::new();
    for _ in 0..4 {
        let (_, _, v) = call(&app, "POST", "/v2/sandboxes", Some(r#"{"templateID":"t"}"#)).await;
        made.push(v["sandboxID"].as_str().unwrap().to_string());
        // Creation times a few ms apart: the order is by time, not by id.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let ids = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x["sandboxID"].as_str().unwrap().to_string())
            .collect()
    };
    let newest_first: Vec<String> = made.iter().rev().cloned().collect();
    for uri in ["/v2/sandboxes", "/sandboxes", "/v2/sandboxes?order=desc"] {
        let (s, _, v) = call(&app, "GET", uri, None).await;
        assert_eq!(s, 200);
        assert_eq!(ids(&v), newest_first, "{uri}");
    }
    let (_, _, v) = call(&app, "GET", "/v2/sandboxes?order=asc", None).await;
    assert_eq!(ids(&v), made);
    // Pages keep that order.
    let (_, h, first) = call(&app, "GET", "/v2/sandboxes?limit=3", None).await;
    let token = h["x-next-token"].to_str().unwrap().to_string();
    let (_, _, second) = call(
        &app,
        "GET",
        &format!("/v2/sandboxes?limit=3&nextToken={token}"),
        None,
    )
    .await;
    let mut paged = ids(&first);
    paged.extend(ids(&second));
    assert_eq!(paged, newest_first);
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn lists_filter_by_metadata_and_page() {
    let (app, d) = app("pages");
    for i in 0..5 {
        let body = format!(r#"{{"templateID":"t","metadata":{{"n":"{i}","k y":"a&b"}}}}"#);
        let (s, _, _) = call(&app, "POST", "/v2/sandboxes", Some(&body)).await;
        assert_eq!(s, 201);
    }
    // As the SDK sends it: urlencode({quote(k): quote(v)}) as the value of `metadata`.
    let (s, _, v) = call(
        &app,
        "GET",
        "/v2/sandboxes?metadata=n%3D3%26k%252520y%3Da%252526b",
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["metadata"]["n"], "3");
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let uri = match &token {
            Some(t) => format!("/v2/sandboxes?limit=2&nextToken={t}"),
            None => "/v2/sandboxes?limit=2".to_string(),
        };
        let (s, h, v) = call(&app, "GET", &uri, None).await;
        assert_eq!(s, 200);
        seen.extend(v.as_array().unwrap().iter().map(|x| x["sandboxID"].clone()));
        token = h
            .get("x-next-token")
            .map(|t| t.to_str().unwrap().to_string());
        if token.is_none() {
            break;
        }
    }
    assert_eq!(seen.len(), 5);
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn pages_stay_stable_when_sandboxes_come_and_go() {
    let (app, d) = app("stablepages");
    let mut made = Vec::new();
    for _ in 0..4 {
        let (_, _, v) = call(&app, "POST", "/v2/sandboxes", Some(r#"{"templateID":"t"}"#)).await;
        made.push(v["sandboxID"].as_str().unwrap().to_string());
    }
    let (_, h, first) = call(&app, "GET", "/v2/sandboxes?order=asc&limit=2", None).await;
    let token = h["x-next-token"].to_str().unwrap().to_string();
    // Oldest first: a sandbox of the first page is killed, a new one is created: the
    // second page still starts after the first page's last row (and ends with the new one).
    let gone = first[0]["sandboxID"].as_str().unwrap().to_string();
    let (s, _, _) = call(&app, "DELETE", &format!("/sandboxes/{gone}"), None).await;
    assert_eq!(s, 204);
    let (_, _, v) = call(&app, "POST", "/v2/sandboxes", Some(r#"{"templateID":"t"}"#)).await;
    let newest = v["sandboxID"].as_str().unwrap().to_string();
    let (_, _, second) = call(
        &app,
        "GET",
        &format!("/v2/sandboxes?order=asc&limit=10&nextToken={token}"),
        None,
    )
    .await;
    let mut seen: Vec<String> = first
        .as_array()
        .unwrap()
        .iter()
        .chain(second.as_array().unwrap())
        .map(|x| x["sandboxID"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(seen.len(), 5, "no row twice, none skipped");
    seen.sort();
    let mut want = made.clone();
    want.push(newest);
    want.sort();
    assert_eq!(seen, want);
    for bad in ["abc", "12_", "x_abc", "12_../x"] {
        let (s, _, _) = call(&app, "GET", &format!("/v2/sandboxes?nextToken={bad}"), None).await;
        assert_eq!(s, 400, "{bad}");
    }
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn snapshots_over_http() {
    let (app, d) = app("snaps");
    let (_, _, v) = call(&app, "POST", "/v2/sandboxes", Some(r#"{"templateID":"t"}"#)).await;
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let (s, _, v) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some("{}"),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let snap = v["snapshotID"].as_str().unwrap().to_string();
    assert!(
        snap.starts_with("snap-") && snap.ends_with(":default"),
        "{snap}"
    );
    assert_eq!(v["names"], json!([snap]));
    let (s, _, v) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some(r#"{"name":"named"}"#),
    )
    .await;
    assert_eq!(s, 201);
    assert_eq!(v["snapshotID"], "named:default");

    // Listed newest first, filtered, paged.
    let (s, h, v) = call(&app, "GET", "/snapshots?limit=1", None).await;
    assert_eq!(s, 200);
    assert_eq!(v[0]["snapshotID"], "named:default");
    let t = h["x-next-token"].to_str().unwrap().to_string();
    let (_, h, v) = call(
        &app,
        "GET",
        &format!("/snapshots?limit=1&nextToken={t}"),
        None,
    )
    .await;
    assert_eq!(v[0]["snapshotID"], json!(snap));
    assert!(h.get("x-next-token").is_none());
    let (_, _, v) = call(&app, "GET", &format!("/snapshots?sandboxID={id}"), None).await;
    assert_eq!(v.as_array().unwrap().len(), 2);
    let (_, _, v) = call(&app, "GET", "/snapshots?sandboxID=other", None).await;
    assert_eq!(v, json!([]));
    let (_, _, v) = call(&app, "GET", "/snapshots?name=named", None).await;
    assert_eq!(v.as_array().unwrap().len(), 1);

    // A sandbox from each (the id as the SDK passes it, with its tag).
    for t in [snap.as_str(), "named"] {
        let (s, _, v) = call(
            &app,
            "POST",
            "/sandboxes",
            Some(&format!(r#"{{"templateID":"{t}"}}"#)),
        )
        .await;
        assert_eq!(s, 201, "{t}: {v}");
    }

    // Refusals: unknown sandbox 404, filesystem-only 400, bad name 400, template 409.
    let (s, _, _) = call(&app, "POST", "/sandboxes/nosuch/snapshots", Some("{}")).await;
    assert_eq!(s, 404);
    let (s, _, v) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some(r#"{"memory":false}"#),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(v["error_code"], "snapshot_filesystem_only_disabled");
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some(r#"{"name":"a/b"}"#),
    )
    .await;
    assert_eq!(s, 400);
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some(r#"{"name":"t"}"#),
    )
    .await;
    assert_eq!(s, 409);
    for q in ["limit=0", "nextToken=zz"] {
        let (s, _, _) = call(&app, "GET", &format!("/snapshots?{q}"), None).await;
        assert_eq!(s, 400, "{q}");
    }

    // Delete (as the SDK does: DELETE /templates/<id, path-encoded>): 204, then 404.
    let enc = snap.replace(':', "%3A");
    let (s, _, _) = call(&app, "DELETE", &format!("/templates/{enc}"), None).await;
    assert_eq!(s, 204);
    let (s, _, v) = call(&app, "DELETE", &format!("/templates/{enc}"), None).await;
    assert_eq!(s, 404, "{v}");
    let (s, _, _) = call(&app, "DELETE", "/templates/t", None).await;
    assert_eq!(s, 400, "a template is not deleted through the API");
    let (s, _, _) = call(
        &app,
        "POST",
        "/sandboxes",
        Some(&format!(r#"{{"templateID":"{snap}"}}"#)),
    )
    .await;
    assert_eq!(s, 400, "a deleted snapshot makes no sandboxes");
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn logs_and_metrics_over_http() {
    let (app, d) = app("logs");
    let (_, _, v) = call(&app, "POST", "/v2/sandboxes", Some(r#"{"templateID":"t"}"#)).await;
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let dir = d.join("sandboxes").join(&id);
    std::fs::write(
        dir.join("vm.log"),
        "2024-05-01T10:00:00.000Z  INFO vmm: one\n\
         2024-05-01T10:00:01.000Z ERROR vmm: two\n\
         2024-05-01T10:00:02.000Z DEBUG vmm: three\n",
    )
    .unwrap();
    let t1 = 1_714_557_601_000i64;
    let (s, _, v) = call(&app, "GET", &format!("/sandboxes/{id}/logs"), None).await;
    assert_eq!(s, 200);
    assert_eq!(v["logs"].as_array().unwrap().len(), 3);
    assert_eq!(v["logs"][0]["line"], "vmm: one");
    assert_eq!(v["logs"][0]["timestamp"], "2024-05-01T10:00:00.000Z");
    assert_eq!(v["logEntries"][1]["level"], "error");
    assert_eq!(v["logEntries"][1]["fields"]["source"], "vmm");
    let (_, _, v) = call(
        &app,
        "GET",
        &format!("/sandboxes/{id}/logs?start={t1}&limit=1"),
        None,
    )
    .await;
    assert_eq!(
        v["logs"],
        json!([{"timestamp": "2024-05-01T10:00:01.000Z", "line": "vmm: two"}])
    );
    let (s, _, v) = call(
        &app,
        "GET",
        &format!("/v2/sandboxes/{id}/logs?cursor={t1}&direction=backward"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    let msgs: Vec<_> = v["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["message"].clone())
        .collect();
    assert_eq!(msgs, [json!("vmm: two"), json!("vmm: one")]);
    let (_, _, v) = call(
        &app,
        "GET",
        &format!("/v2/sandboxes/{id}/logs?level=warn"),
        None,
    )
    .await;
    assert_eq!(v["logs"].as_array().unwrap().len(), 1);
    let (_, _, v) = call(
        &app,
        "GET",
        &format!("/v2/sandboxes/{id}/logs?search=thr"),
        None,
    )
    .await;
    assert_eq!(v["logs"][0]["message"], "vmm: three");
    for q in [
        "start=x",
        "limit=5000",
        "direction=up",
        "level=loud",
        "cursor=now",
    ] {
        let v1 = call(&app, "GET", &format!("/sandboxes/{id}/logs?{q}"), None)
            .await
            .0;
        let v2 = call(&app, "GET", &format!("/v2/sandboxes/{id}/logs?{q}"), None)
            .await
            .0;
        assert!(v1 == 400 || v2 == 400, "{q}");
    }
    let (s, _, _) = call(&app, "GET", "/sandboxes/nosuch/logs", None).await;
    assert_eq!(s, 404);
    let (s, _, _) = call(&app, "GET", "/v2/sandboxes/nosuch/logs", None).await;
    assert_eq!(s, 404);
    // Metrics of a fake VM (no such process): shape only.
    let (s, _, v) = call(&app, "GET", &format!("/sandboxes/{id}/metrics"), None).await;
    assert_eq!(s, 200);
    assert_eq!(v[0]["cpuCount"], 2);
    assert_eq!(v[0]["memTotal"], 128 * 1024 * 1024);
    drop(app); // its host stops making directories ahead in `d` first
    std::fs::remove_dir_all(d).unwrap();
}

/// A PUT of `body` to `path` on `app`: its status and message.
async fn put_files(app: &Router, path: &str, body: Vec<u8>) -> (u16, String) {
    let r = HttpRequest::builder()
        .method("PUT")
        .uri(path)
        .body(Body::from(body))
        .unwrap();
    let resp = app.clone().oneshot(r).await.unwrap();
    let s = resp.status().as_u16();
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
    (s, v["message"].as_str().unwrap_or_default().to_string())
}

fn one_file_tar(name: &str, content: &[u8]) -> Vec<u8> {
    let mut t = tar::Builder::new(Vec::new());
    let mut hd = tar::Header::new_gnu();
    hd.set_size(content.len() as u64);
    hd.set_mode(0o644);
    hd.set_cksum();
    t.append_data(&mut hd, name, content).unwrap();
    t.into_inner().unwrap()
}

/// The upload links the service gives expire (an hour after they were given, checked
/// here), are bound to their hash and expiry, and cannot replace the files of a hash
/// with other files (nothing of such an upload is kept).
#[tokio::test]
async fn upload_links_expire_and_never_replace_a_hashs_files() {
    let (h, _drv, d) = host("upload-links");
    let builds = Arc::new(crate::build::Builds::new(&d, None));
    let app = router(AppState {
        builds: builds.clone(),
        ..state_of(Arc::new(h))
    });
    let hash = "d".repeat(64);
    let (_, v) = upload_link(&app, &hash).await;
    let link = v["url"]
        .as_str()
        .unwrap()
        .strip_prefix("http://clade.test:3000")
        .unwrap()
        .to_string();
    let now = crate::ids::now_ms() / 1000;
    let expires: i64 = link.split('/').nth(3).unwrap().parse().unwrap();
    assert!(
        (now + 3500..=now + 3700).contains(&expires),
        "an hour: {link}"
    );
    let tar_a = one_file_tar("f.txt", b"first");
    let tar_b = one_file_tar("f.txt", b"other");
    // A link given an hour and a second ago (signed by this service: only its age is
    // wrong) is refused before anything is kept; so is a link whose expiry was moved.
    let past = now - 1;
    let old = format!(
        "/build-files/{hash}/{past}/{}",
        builds.upload_token(&hash, past)
    );
    let (s, m) = put_files(&app, &old, tar_a.clone()).await;
    assert_eq!((s, m.contains("expired")), (400, true), "{m}");
    let token = link.rsplit('/').next().unwrap();
    let moved = format!("/build-files/{hash}/{}/{token}", expires + 3600);
    let (s, m) = put_files(&app, &moved, tar_a.clone()).await;
    assert_eq!((s, m.contains("not valid")), (400, true), "{m}");
    let other_hash = format!("/build-files/{}/{expires}/{token}", "e".repeat(64));
    let (s, _) = put_files(&app, &other_hash, tar_a.clone()).await;
    assert_eq!(s, 400, "a link for another hash");
    assert!(!builds.files_present(&hash).unwrap());
    // The link works; the same files again are fine; other files for the hash are
    // refused and the first ones stay.
    assert_eq!(put_files(&app, &link, tar_a.clone()).await.0, 201);
    assert_eq!(put_files(&app, &link, tar_a.clone()).await.0, 201);
    let (s, m) = put_files(&app, &link, tar_b).await;
    assert_eq!(s, 409, "{m}");
    let kept = d.join("build-files").join(format!("{hash}.tar"));
    assert_eq!(std::fs::read(&kept).unwrap(), tar_a);
    let names: Vec<String> = std::fs::read_dir(d.join("build-files"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec![format!("{hash}.tar")], "no scratch left");
    drop(app);
    let _ = std::fs::remove_dir_all(d);
}

/// E2B's template build API up to the build itself (which needs a Linux guest: the nested
/// tier's `test_template_build_through_the_sdk`): request, upload link and upload without
/// the API key, start, status and log paging, a failed build's reason, refusals.
#[tokio::test]
async fn template_builds_as_the_sdk_drives_them() {
    let (h, _drv, d) = host("builds");
    let builds = crate::build::Builds::new(
        &d,
        Some(crate::build::BuildConfig {
            exe: "/nonexistent/clade".into(),
            kernel: "/nonexistent/vmlinuz".into(),
            initrd: None,
            cmdline: String::new(),
            kvm_device: "/dev/kvm".into(),
            disk_size: None,
            confine: None,
            network: None,
        }),
    );
    let app = router(AppState {
        host: Arc::new(h),
        api_key: Arc::new(KEY.into()),
        domain: None,
        sessions: Default::default(),
        builds: Arc::new(builds),
    });
    let body = r#"{"name":"t1:v2","tags":["v2"],"cpuCount":1,"memoryMB":256}"#;
    let (s, _, _) = call_key(&app, "POST", "/v3/templates", Some(body), None).await;
    assert_eq!(s, 401);
    let (s, _, v) = call(&app, "POST", "/v3/templates", Some(body)).await;
    assert_eq!(s, 202, "{v}");
    assert_eq!(v["templateID"], "t1");
    assert_eq!(v["tags"], json!(["v2"]));
    let bid = v["buildID"].as_str().unwrap().to_string();
    for bad in [r#"{"name":"../x"}"#, r#"{"name":"t","memoryMB":1}"#, "{}"] {
        let (s, _, v) = call(&app, "POST", "/v3/templates", Some(bad)).await;
        assert_eq!(s, 400, "{bad}: {v}");
    }
    // The upload link, and the upload through it (no API key).
    let hash = "b".repeat(64);
    let (status, v) = upload_link(&app, &hash).await;
    assert_eq!(status, 201);
    assert_eq!(v["present"], false);
    let url = v["url"].as_str().unwrap().to_string();
    let path = url
        .strip_prefix("http://clade.test:3000")
        .expect("an absolute link");
    let mut t = tar::Builder::new(Vec::new());
    let mut hd = tar::Header::new_gnu();
    hd.set_size(3);
    hd.set_mode(0o644);
    hd.set_cksum();
    t.append_data(&mut hd, "f.txt", &b"abc"[..]).unwrap();
    let tar = t.into_inner().unwrap();
    let put = |p: String| {
        HttpRequest::builder()
            .method("PUT")
            .uri(p)
            .body(Body::from(tar.clone()))
            .unwrap()
    };
    let wrong = format!("{}/{}", path.rsplit_once('/').unwrap().0, "0".repeat(64));
    assert_eq!(
        app.clone()
            .oneshot(put(wrong))
            .await
            .unwrap()
            .status()
            .as_u16(),
        400
    );
    assert_eq!(
        app.clone()
            .oneshot(put(path.to_string()))
            .await
            .unwrap()
            .status()
            .as_u16(),
        201
    );
    // Streamed in chunks and gzipped, as a client may send it; a body that is no tar is
    // refused; neither leaves anything but the kept tar in the build files' directory.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &tar).unwrap();
    let gz = gz.finish().unwrap();
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        gz.chunks(7).map(|c| Ok(c.to_vec())).collect();
    let streamed = HttpRequest::builder()
        .method("PUT")
        .uri(path)
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    assert_eq!(
        app.clone()
            .oneshot(streamed)
            .await
            .unwrap()
            .status()
            .as_u16(),
        201
    );
    let not_tar = HttpRequest::builder()
        .method("PUT")
        .uri(path)
        .body(Body::from(vec![1u8; 1000]))
        .unwrap();
    assert_eq!(
        app.clone()
            .oneshot(not_tar)
            .await
            .unwrap()
            .status()
            .as_u16(),
        400
    );
    let kept: Vec<String> = std::fs::read_dir(d.join("build-files"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept, vec![format!("{hash}.tar")]);
    let (_, v) = upload_link(&app, &hash).await;
    assert_eq!(v["present"], true, "{v}");
    // A build whose base does not exist fails, with its reason and log.
    let start = format!("/v2/templates/t1/builds/{bid}");
    let steps = format!(
        r#"{{"fromTemplate":"nope","force":false,"steps":[{{"type":"COPY","args":["f.txt","/x/","",""],"filesHash":"{hash}","force":false}}]}}"#
    );
    let (s, _, v) = call(&app, "POST", &start, Some(&steps)).await;
    assert_eq!(s, 202, "{v}");
    let (s, _, _) = call(&app, "POST", &start, Some(&steps)).await;
    assert_eq!(s, 409, "a build starts once");
    let status = format!("/templates/t1/builds/{bid}/status?logsOffset=0&limit=100");
    let t0 = std::time::Instant::now();
    let v = loop {
        let (s, _, v) = call(&app, "GET", &status, None).await;
        assert_eq!(s, 200, "{v}");
        if v["status"] == "error" {
            break v;
        }
        assert_eq!(v["status"], "building", "{v}");
        assert!(t0.elapsed().as_secs() < 30, "{v}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(
        v["reason"]["message"].as_str().unwrap().contains("nope"),
        "{v}"
    );
    let n = v["logEntries"].as_array().unwrap().len();
    assert!(n >= 1, "{v}");
    assert!(v["logEntries"][0]["timestamp"].is_string(), "{v}");
    let (_, _, v) = call(
        &app,
        "GET",
        &format!("/templates/t1/builds/{bid}/status?logsOffset={n}"),
        None,
    )
    .await;
    assert_eq!(v["logEntries"], json!([]), "past the end: nothing");
    assert_eq!(v["logs"], json!([]));
    // Unknown builds and templates; a step whose files were not uploaded.
    let (s, _, _) = call(&app, "GET", "/templates/t1/builds/ffff/status", None).await;
    assert_eq!(s, 404);
    let (s, _, _) = call(&app, "GET", "/templates/aliases/t1", None).await;
    assert_eq!(s, 404, "a failed build registers nothing");
    let (_, _, v) = call(&app, "POST", "/v3/templates", Some(r#"{"name":"t2"}"#)).await;
    let bid2 = v["buildID"].as_str().unwrap();
    let missing = format!(
        r#"{{"fromTemplate":"x","steps":[{{"type":"COPY","args":["a","/b"],"filesHash":"{}"}}]}}"#,
        "c".repeat(64)
    );
    let (s, _, v) = call(
        &app,
        "POST",
        &format!("/v2/templates/t2/builds/{bid2}"),
        Some(&missing),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("not uploaded"),
        "{v}"
    );
    let (s, _, _) = call(
        &app,
        "POST",
        &format!("/v2/templates/t1/builds/{bid2}"),
        Some("{}"),
    )
    .await;
    assert_eq!(s, 404, "a build id of another template");
    let (s, _, v) = call(
        &app,
        "POST",
        &format!("/v2/templates/t2/builds/{bid2}"),
        Some(r#"{"fromTemplate":"t2","steps":[]}"#),
    )
    .await;
    assert_eq!(s, 400, "a template built on itself: {v}");
    std::fs::remove_dir_all(&d).ok();
}

#[tokio::test]
async fn a_create_like_a_sandbox_makes_one_alike() {
    let (h, _drv, _d) = host("create-like");
    let host = Arc::new(h);
    let app = router(state_of(Arc::clone(&host)));
    let (s, _, v) = call(
        &app,
        "POST",
        "/sandboxes",
        Some(
            r#"{"templateID":"t","timeout":60,"metadata":{"user":"ann"},"envVars":{"A":"1","B":"two"},
                "autoPause":true,"autoResume":{"enabled":true},"secure":true,
                "allow_internet_access":false,
                "network":{"allowPublicTraffic":false,"maskRequestHost":"app-${PORT}.test",
                           "allowOut":["10.1.0.0/16","api.example.com"],"denyOut":["10.1.2.0/24"]}}"#,
        ),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let first = host.get_local(v["sandboxID"].as_str().unwrap()).unwrap();
    let like = create_like(&first, "t");
    let (s, _, v) = call(&app, "POST", "/sandboxes", Some(&like.to_string())).await;
    assert_eq!(s, 201, "{like} -> {v}");
    let second = host.get_local(v["sandboxID"].as_str().unwrap()).unwrap();
    assert_eq!(second.metadata, first.metadata);
    assert_eq!(second.env_vars, first.env_vars);
    assert_eq!(
        (
            second.auto_pause,
            second.auto_resume,
            second.pause_keeps_memory
        ),
        (true, true, true)
    );
    assert_eq!(second.mask_host, first.mask_host);
    // Secured alike, with tokens of its own.
    assert!(second.envd_token.is_some() && second.envd_token != first.envd_token);
    assert!(second.traffic_token.is_some() && second.traffic_token != first.traffic_token);
    assert!(first.egress.is_some());
    assert_eq!(second.egress, first.egress);
}

#[tokio::test]
async fn a_host_alone_has_no_nodes() {
    let (app, _d) = app("no-nodes");
    let (s, _, v) = call(&app, "GET", "/nodes", None).await;
    assert_eq!(s, 404, "{v}");
    assert!(v["message"].as_str().unwrap().contains("--cluster"), "{v}");
    // Behind the key, as the rest of the API.
    let (s, _, _) = call_key(&app, "GET", "/nodes", None, None).await;
    assert_eq!(s, 401);
}

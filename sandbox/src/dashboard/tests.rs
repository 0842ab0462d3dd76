//! The dashboard's auth through the whole router (no VMs): pages and assets need a session,
//! API calls need a session cookie *and* `X-Clade-Dashboard: 1`, bad input gets clean
//! answers.

use crate::http::AppState;
use std::sync::Arc;

use axum::body::Body;
use axum::http::Request;
use axum::Router;
use http_body_util::BodyExt;
use tower::ServiceExt;

use super::*;
use crate::host::tests::host;
use crate::http::router;

const KEY: &str = "dash-test-key";

fn app(name: &str) -> (Router, Arc<Sessions>, std::path::PathBuf) {
    let (h, _drv, d) = host(name);
    let sessions = Arc::new(Sessions::default());
    let st = AppState {
        host: Arc::new(h),
        api_key: Arc::new(KEY.into()),
        domain: None,
        sessions: sessions.clone(),
        builds: Arc::new(crate::build::Builds::new(
            std::path::Path::new("/nonexistent"),
            None,
        )),
    };
    (router(st), sessions, d)
}

struct Answer {
    status: u16,
    headers: HeaderMap,
    body: String,
}

async fn send(
    app: &Router,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut b = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = app
        .clone()
        .oneshot(b.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

async fn login(app: &Router, body: &str) -> Answer {
    send(
        app,
        "POST",
        "/dashboard/login",
        &[("content-type", "application/x-www-form-urlencoded")],
        body,
    )
    .await
}

/// The `name=value` of a login's `Set-Cookie`.
fn cookie_of(a: &Answer) -> String {
    let c = a
        .headers
        .get("set-cookie")
        .expect("a cookie")
        .to_str()
        .unwrap();
    c.split(';').next().unwrap().to_string()
}

fn done(app: Router, d: std::path::PathBuf) {
    drop(app);
    std::fs::remove_dir_all(d).unwrap();
}

#[tokio::test]
async fn nothing_without_a_session() {
    let (app, _, d) = app("dash-none");
    let a = send(&app, "GET", "/dashboard", &[], "").await;
    assert_eq!(a.status, 303);
    assert_eq!(a.headers["location"], "/dashboard/login");
    let a = send(&app, "GET", "/dashboard/", &[], "").await;
    assert_eq!(a.status, 303);
    for asset in ["/dashboard/app.js", "/dashboard/app.css"] {
        let a = send(&app, "GET", asset, &[], "").await;
        assert_eq!(a.status, 401, "{asset}");
        assert!(!a.body.contains("X-Clade-Dashboard"), "{asset} leaked");
    }
    // Any other dashboard path falls to the API's key check.
    assert_eq!(
        send(&app, "GET", "/dashboard/nope", &[], "").await.status,
        401
    );
    // The login page is there, with its form and no data.
    let a = send(&app, "GET", "/dashboard/login", &[], "").await;
    assert_eq!(a.status, 200);
    assert!(a.body.contains(r#"name="key""#));
    assert!(!a.body.contains("{{message}}"));
    assert_eq!(
        send(&app, "GET", "/dashboard/login.css", &[], "")
            .await
            .status,
        200
    );
    // The dashboard header alone opens no API route.
    let a = send(
        &app,
        "GET",
        "/v2/sandboxes",
        &[("x-clade-dashboard", "1")],
        "",
    )
    .await;
    assert_eq!(a.status, 401);
    let a = send(&app, "GET", "/templates", &[("x-clade-dashboard", "1")], "").await;
    assert_eq!(a.status, 401);
    done(app, d);
}

#[tokio::test]
async fn wrong_key_gets_no_cookie() {
    let (app, sessions, d) = app("dash-wrong");
    for body in [
        "key=wrong",
        "key=dash-test-ke",
        "key=dash-test-keyy",
        "key=DASH-TEST-KEY",
    ] {
        let a = login(&app, body).await;
        assert_eq!(a.status, 401, "{body}");
        assert!(a.headers.get("set-cookie").is_none(), "{body}");
        assert!(a.body.contains("Wrong key"), "{body}");
    }
    // Bad bodies: clean 400s, no cookie, no session.
    for body in [
        "",
        "key=",
        "nokey=dash-test-key",
        "%%%",
        "key",
        "\u{0}\u{1}",
    ] {
        let a = login(&app, body).await;
        assert_eq!(a.status, 400, "{body:?}");
        assert!(a.headers.get("set-cookie").is_none(), "{body:?}");
    }
    let raw = send(
        &app,
        "POST",
        "/dashboard/login",
        &[],
        &String::from_utf8_lossy(&[0xff, 0xfe, b'k', b'=']),
    )
    .await;
    assert_eq!(raw.status, 400);
    assert!(sessions.is_empty());
    done(app, d);
}

#[tokio::test]
async fn right_key_opens_the_dashboard_and_its_api_calls() {
    let (app, sessions, d) = app("dash-right");
    // The key URL-encoded as a browser sends it.
    let a = login(&app, "key=dash%2Dtest%2Dkey").await;
    assert_eq!(a.status, 303);
    assert_eq!(a.headers["location"], "/dashboard");
    let set = a.headers["set-cookie"].to_str().unwrap().to_string();
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set.contains(attr), "{set}");
    }
    assert!(!set.contains("Secure"), "plain HTTP: {set}");
    let cookie = cookie_of(&a);
    assert_eq!(sessions.len(), 1);

    let a = send(&app, "GET", "/dashboard", &[("cookie", &cookie)], "").await;
    assert_eq!(a.status, 200);
    assert!(a.body.contains("/dashboard/app.js"));
    assert!(a.headers["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("script-src 'self'"));
    let a = send(&app, "GET", "/dashboard/app.js", &[("cookie", &cookie)], "").await;
    assert_eq!(a.status, 200);
    assert!(a.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/javascript"));
    assert!(a.body.contains("X-Clade-Dashboard"));
    // Among other cookies.
    let mixed = format!("a=b; {cookie}; theme=dark");
    let a = send(&app, "GET", "/dashboard/app.css", &[("cookie", &mixed)], "").await;
    assert_eq!(a.status, 200);
    // Logged in, the login page sends to the dashboard.
    let a = send(&app, "GET", "/dashboard/login", &[("cookie", &cookie)], "").await;
    assert_eq!(a.status, 303);

    // API calls: cookie + header.
    let both = [("cookie", cookie.as_str()), ("x-clade-dashboard", "1")];
    let a = send(&app, "GET", "/v2/sandboxes?limit=50", &both, "").await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body, "[]");
    let a = send(&app, "GET", "/templates", &both, "").await;
    assert_eq!(a.status, 200, "{}", a.body);
    let ts: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert!(ts.as_array().is_some(), "{ts}");
    // The cookie without the header (what a cross-site form could send): refused.
    for headers in [
        vec![("cookie", cookie.as_str())],
        vec![("cookie", cookie.as_str()), ("x-clade-dashboard", "0")],
        vec![("cookie", cookie.as_str()), ("x-clade-dashboard", "true")],
    ] {
        let a = send(&app, "GET", "/v2/sandboxes", &headers, "").await;
        assert_eq!(a.status, 401, "{headers:?}");
        let a = send(&app, "DELETE", "/sandboxes/abc", &headers, "").await;
        assert_eq!(a.status, 401, "{headers:?}");
    }
    // A wrong API key is not rescued by a good session.
    let a = send(
        &app,
        "GET",
        "/v2/sandboxes",
        &[
            ("cookie", &cookie),
            ("x-clade-dashboard", "1"),
            ("x-api-key", "nope"),
        ],
        "",
    )
    .await;
    assert_eq!(a.status, 401);

    // Logout ends the session: the same cookie opens nothing any more.
    let a = send(
        &app,
        "POST",
        "/dashboard/logout",
        &[("cookie", &cookie)],
        "",
    )
    .await;
    assert_eq!(a.status, 303);
    assert!(a.headers["set-cookie"]
        .to_str()
        .unwrap()
        .contains("Max-Age=0"));
    assert!(sessions.is_empty());
    assert_eq!(
        send(&app, "GET", "/dashboard", &[("cookie", &cookie)], "")
            .await
            .status,
        303
    );
    assert_eq!(
        send(&app, "GET", "/v2/sandboxes", &both, "").await.status,
        401
    );
    done(app, d);
}

#[tokio::test]
async fn garbage_cookies_are_no_session() {
    let (app, _, d) = app("dash-garbage");
    let long = format!("clade_session={}", "a".repeat(10_000));
    let forged = format!("clade_session={}", "0".repeat(64));
    for c in [
        "clade_session=",
        "clade_session",
        "=;;;=",
        "clade_session=zz",
        long.as_str(),
        forged.as_str(),
        "clade_session=\"\"",
        "other=1",
    ] {
        let a = send(&app, "GET", "/dashboard", &[("cookie", c)], "").await;
        assert_eq!(a.status, 303, "{c:?}");
        let a = send(
            &app,
            "GET",
            "/v2/sandboxes",
            &[("cookie", c), ("x-clade-dashboard", "1")],
            "",
        )
        .await;
        assert_eq!(a.status, 401, "{c:?}");
    }
    // A cookie header that is not text.
    let req = Request::builder()
        .uri("/dashboard/app.js")
        .header(
            "cookie",
            axum::http::HeaderValue::from_bytes(&[0xff, b'=', 0xfe]).unwrap(),
        )
        .body(Body::empty())
        .unwrap();
    assert_eq!(app.clone().oneshot(req).await.unwrap().status(), 401);
    // Logout without a session is harmless.
    assert_eq!(
        send(
            &app,
            "POST",
            "/dashboard/logout",
            &[("cookie", &forged)],
            ""
        )
        .await
        .status,
        303
    );
    done(app, d);
}

#[test]
fn sessions_expire_and_are_bounded() {
    let s = Sessions::new(true);
    let first = s.create().unwrap();
    assert_eq!(first.len(), 64);
    assert!(s.valid(&first));
    let mut other = first.clone();
    let last = if other.pop() == Some('0') { '1' } else { '0' };
    other.push(last);
    assert!(!s.valid(&other));
    // Expired: gone at the next look.
    s.lock().insert(
        digest("f".repeat(64).as_str()),
        Instant::now() - Duration::from_secs(1),
    );
    assert!(!s.valid(&"f".repeat(64)));
    let tokens: Vec<String> = (0..MAX_SESSIONS + 10)
        .map(|_| s.create().unwrap())
        .collect();
    assert_eq!(s.len(), MAX_SESSIONS);
    // The oldest ones made room; the newest are live.
    assert!(!s.valid(&first));
    assert!(s.valid(tokens.last().unwrap()));
    assert!(s.secure);
}

/// The session's view of a host with 1000 sandboxes, as the page asks for it: pages of 50
/// through `nextToken`, metrics of one page's ids in one call; and the template list.
#[tokio::test]
async fn a_thousand_sandboxes_page_by_page() {
    let (h, _drv, d) = host("dash-1000");
    let h = Arc::new(h);
    let sessions = Arc::new(Sessions::default());
    let app = router(AppState {
        host: h.clone(),
        api_key: Arc::new(KEY.into()),
        domain: None,
        sessions: sessions.clone(),
        builds: Arc::new(crate::build::Builds::new(
            std::path::Path::new("/nonexistent"),
            None,
        )),
    });
    let made: std::collections::BTreeSet<String> = (0..1000)
        .map(|_| {
            h.create(crate::host::CreateRequest {
                template: "t".into(),
                timeout_s: 600,
                ..Default::default()
            })
            .unwrap()
            .id
        })
        .collect();
    let cookie = cookie_of(&login(&app, &format!("key={KEY}")).await);
    let both = [("cookie", cookie.as_str()), ("x-clade-dashboard", "1")];

    let mut seen = std::collections::BTreeSet::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    loop {
        let uri = match &token {
            Some(t) => format!("/v2/sandboxes?limit=50&nextToken={t}"),
            None => "/v2/sandboxes?limit=50".to_string(),
        };
        let a = send(&app, "GET", &uri, &both, "").await;
        assert_eq!(a.status, 200, "{}", a.body);
        let rows: Vec<serde_json::Value> = serde_json::from_str(&a.body).unwrap();
        assert!(rows.len() <= 50);
        pages += 1;
        let ids: Vec<&str> = rows
            .iter()
            .map(|r| r["sandboxID"].as_str().unwrap())
            .collect();
        if pages == 1 {
            let q = format!("/sandboxes/metrics?sandbox_ids={}", ids.join(","));
            let m = send(&app, "GET", &q, &both, "").await;
            assert_eq!(m.status, 200, "{}", m.body);
        }
        for id in ids {
            assert!(seen.insert(id.to_string()), "{id} on two pages");
        }
        match a.headers.get("x-next-token") {
            Some(t) => token = Some(t.to_str().unwrap().to_string()),
            None => break,
        }
        assert!(pages < 30, "paging does not end");
    }
    assert_eq!(pages, 20);
    assert_eq!(seen, made);

    let a = send(&app, "GET", "/templates", &both, "").await;
    let ts: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    let t = &ts.as_array().unwrap()[0];
    assert_eq!(
        (
            &t["templateID"],
            &t["cpuCount"],
            &t["memoryMB"],
            &t["buildStatus"]
        ),
        (
            &serde_json::json!("t"),
            &serde_json::json!(2),
            &serde_json::json!(128),
            &serde_json::json!("ready")
        ),
        "{ts}"
    );
    assert_eq!(t["names"], serde_json::json!(["t:default"]));
    drop(app);
    drop(h);
    std::fs::remove_dir_all(d).unwrap();
}

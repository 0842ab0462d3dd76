//! The web dashboard of `clade serve`, at `/dashboard`: sandboxes (state, template, age, CPU
//! and memory sparklines), their logs, templates and snapshots, and the pause, resume, fork
//! and kill actions.
//!
//! Why it is built this way:
//!
//! - **Behind the API key, with a session cookie.** A browser cannot add `X-API-KEY` to a
//!   page load, so `/dashboard/login` takes the key once (compared in constant time,
//!   [`crate::envd::access::same_secret`]) and answers a random session token (32 bytes of
//!   the OS random source) in an `HttpOnly; SameSite=Strict` cookie. The host keeps only the
//!   SHA-256 of each token, in a bounded in-memory map with an expiry ([`Sessions`]): a
//!   restart of the service logs everyone out, nothing is written to disk.
//! - **The API itself, not a second one.** The page's script calls the existing control API
//!   (`/v2/sandboxes`, `/sandboxes/{id}/pause`, ...). The API's `auth` middleware accepts a
//!   valid session cookie in place of the key only together with the header
//!   `X-Clade-Dashboard: 1`: a cross-site form or image cannot set a custom header, so the
//!   header is the CSRF guard (the cookie being `SameSite=Strict` is a second one). A cookie
//!   alone opens nothing but the dashboard's own pages.
//! - **Nothing readable without a session.** Every `/dashboard` path but the login page (and
//!   its style sheet) answers a redirect to it (the page) or 401 (its assets, any other path).
//! - **No build step.** The HTML, CSS and JavaScript are plain files in `assets/`, compiled
//!   into the binary with `include_str!`; no npm, nothing fetched at run time.
//! - **Paging.** A host may hold thousands of sandboxes: the list shows one page of the API's
//!   own paging (`limit` and `nextToken`, optionally one state) and asks for metrics of the
//!   visible rows only (at most one page of `GET /sandboxes/metrics?sandbox_ids=`), never of
//!   every sandbox.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, COOKIE, LOCATION, SET_COOKIE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The session cookie's name.
pub const COOKIE_NAME: &str = "clade_session";
/// The header that, with a valid session cookie, stands for the API key on API routes.
pub const DASHBOARD_HEADER: &str = "x-clade-dashboard";
/// How long a session lasts after its login.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// How long a login with a wrong key waits before its answer.
pub const WRONG_KEY_DELAY: Duration = Duration::from_millis(250);
/// Most sessions kept at once; a login past it ends the oldest.
pub const MAX_SESSIONS: usize = 256;

const INDEX_HTML: &str = include_str!("assets/index.html");
const LOGIN_HTML: &str = include_str!("assets/login.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

/// What the dashboard's pages need of the service: the key a login must give, and the
/// sessions. The service's own state provides it (`FromRef`), so that this module does
/// not depend on the HTTP module that mounts it.
#[derive(Clone)]
pub struct DashboardState {
    /// The API key.
    pub api_key: Arc<String>,
    /// The login sessions.
    pub sessions: Arc<Sessions>,
}

/// The dashboard's sessions: SHA-256 of each token → when it expires.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<[u8; 32], Instant>>,
    /// Whether the cookie is marked `Secure` (the service speaks HTTPS).
    secure: bool,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Sessions {
    /// No sessions yet; `secure`: the service is reached over HTTPS, so the cookie is
    /// marked `Secure` (a browser then never sends it over plain HTTP).
    pub fn new(secure: bool) -> Self {
        Self {
            map: Mutex::default(),
            secure,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Instant>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new session: its token (64 hex digits). Drops expired sessions, and the one
    /// closest to expiring when [`MAX_SESSIONS`] are live.
    pub fn create(&self) -> Result<String> {
        let token = crate::ids::new_token().map_err(Error::io(
            "making a session token from",
            "the OS random source",
        ))?;
        let now = Instant::now();
        let mut map = self.lock();
        map.retain(|_, exp| *exp > now);
        while map.len() >= MAX_SESSIONS {
            let oldest = map.iter().min_by_key(|(_, exp)| **exp).map(|(k, _)| *k);
            match oldest {
                Some(k) => map.remove(&k),
                None => break,
            };
        }
        map.insert(digest(&token), now + SESSION_TTL);
        Ok(token)
    }

    /// Whether `token` names a live session.
    pub fn valid(&self, token: &str) -> bool {
        // Tokens are 64 hex digits: anything else is not looked up at all.
        if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return false;
        }
        let now = Instant::now();
        let mut map = self.lock();
        match map.get(&digest(token)) {
            Some(exp) if *exp > now => true,
            Some(_) => {
                map.remove(&digest(token));
                false
            }
            None => false,
        }
    }

    /// Ends a session (nothing if there is none).
    pub fn end(&self, token: &str) {
        self.lock().remove(&digest(token));
    }

    /// Live sessions (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether there are no sessions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The session token in a request's `Cookie` headers, if any (unreadable headers and
/// malformed pairs are skipped).
pub fn session_cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| k.trim() == COOKIE_NAME)
        .map(|(_, v)| v.trim().trim_matches('"').to_string())
}

/// Whether the request carries a live session cookie.
pub fn has_session(st: &DashboardState, headers: &HeaderMap) -> bool {
    session_cookie(headers).is_some_and(|t| st.sessions.valid(&t))
}

/// Whether an API request is the dashboard's: a live session cookie and
/// `X-Clade-Dashboard: 1` (see the module doc for why both).
pub fn dashboard_request(st: &DashboardState, headers: &HeaderMap) -> bool {
    headers.get(DASHBOARD_HEADER).map(|v| v.as_bytes()) == Some(b"1") && has_session(st, headers)
}

/// The dashboard's routes (they check the session themselves; the API's key check is not
/// in front of them).
pub fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    DashboardState: axum::extract::FromRef<S>,
{
    Router::new()
        .route("/dashboard", get(index))
        .route("/dashboard/", get(index))
        .route("/dashboard/login", get(login_page).post(login))
        .route("/dashboard/logout", post(logout))
        .route("/dashboard/app.js", get(app_js))
        .route("/dashboard/app.css", get(app_css))
        .route("/dashboard/login.css", get(login_css))
}

fn page(status: StatusCode, content_type: &'static str, body: String) -> Response {
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert(
        "content-security-policy",
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
        ),
    );
    r
}

fn redirect(to: &'static str) -> Response {
    let mut r = StatusCode::SEE_OTHER.into_response();
    r.headers_mut()
        .insert(LOCATION, HeaderValue::from_static(to));
    r
}

fn unauthorized() -> Response {
    page(
        StatusCode::UNAUTHORIZED,
        "text/plain; charset=utf-8",
        "not logged in: open /dashboard/login\n".into(),
    )
}

fn login_html(message: &str) -> String {
    LOGIN_HTML.replace("{{message}}", message)
}

async fn index(AxState(st): AxState<DashboardState>, headers: HeaderMap) -> Response {
    if !has_session(&st, &headers) {
        return redirect("/dashboard/login");
    }
    page(
        StatusCode::OK,
        "text/html; charset=utf-8",
        INDEX_HTML.into(),
    )
}

async fn app_js(AxState(st): AxState<DashboardState>, headers: HeaderMap) -> Response {
    if !has_session(&st, &headers) {
        return unauthorized();
    }
    page(
        StatusCode::OK,
        "text/javascript; charset=utf-8",
        APP_JS.into(),
    )
}

async fn app_css(AxState(st): AxState<DashboardState>, headers: HeaderMap) -> Response {
    if !has_session(&st, &headers) {
        return unauthorized();
    }
    page(StatusCode::OK, "text/css; charset=utf-8", APP_CSS.into())
}

/// The login page's style: the same sheet, served without a session (it is part of the
/// login page and holds no data).
async fn login_css() -> Response {
    page(StatusCode::OK, "text/css; charset=utf-8", APP_CSS.into())
}

async fn login_page(AxState(st): AxState<DashboardState>, headers: HeaderMap) -> Response {
    if has_session(&st, &headers) {
        return redirect("/dashboard");
    }
    page(StatusCode::OK, "text/html; charset=utf-8", login_html(""))
}

/// `POST /dashboard/login` with a form body `key=...`: a session cookie and 303 to the
/// dashboard, or the login page again with 401.
async fn login(AxState(st): AxState<DashboardState>, body: Bytes) -> Response {
    let key = form_urlencoded::parse(&body)
        .find(|(k, _)| k == "key")
        .map(|(_, v)| v.into_owned());
    let Some(key) = key.filter(|k| !k.is_empty()) else {
        return page(
            StatusCode::BAD_REQUEST,
            "text/html; charset=utf-8",
            login_html("Enter the API key."),
        );
    };
    if !crate::envd::access::same_secret(key.as_bytes(), st.api_key.as_bytes()) {
        tracing::warn!("dashboard: login with a wrong key");
        // Slows guessing down (one connection at a time; the key itself must be long).
        tokio::time::sleep(WRONG_KEY_DELAY).await;
        return page(
            StatusCode::UNAUTHORIZED,
            "text/html; charset=utf-8",
            login_html("Wrong key."),
        );
    }
    let token = match st.sessions.create() {
        Ok(t) => t,
        Err(e) => {
            tracing::error!("dashboard: {e}");
            return page(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/html; charset=utf-8",
                login_html("The host could not make a session; see its log."),
            );
        }
    };
    tracing::info!("dashboard: new session");
    let cookie = format!(
        "{COOKIE_NAME}={token}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{}",
        SESSION_TTL.as_secs(),
        if st.sessions.secure { "; Secure" } else { "" }
    );
    let mut r = redirect("/dashboard");
    match HeaderValue::from_str(&cookie) {
        Ok(v) => {
            r.headers_mut().insert(SET_COOKIE, v);
            r
        }
        // Hex digits and fixed text: cannot happen; no session rather than a panic.
        Err(_) => unauthorized(),
    }
}

/// `POST /dashboard/logout`: ends the session, clears the cookie, back to the login page.
async fn logout(AxState(st): AxState<DashboardState>, headers: HeaderMap) -> Response {
    if let Some(t) = session_cookie(&headers) {
        st.sessions.end(&t);
    }
    let mut r = redirect("/dashboard/login");
    r.headers_mut().insert(
        SET_COOKIE,
        HeaderValue::from_static("clade_session=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"),
    );
    r
}

#[cfg(test)]
mod tests;

//! Who may reach a sandbox through the data plane: E2B's access tokens and signed URLs.
//!
//! A secured sandbox (every one created through the API, unless it asked `secure: false`)
//! has an *envd access token*: each request for envd's port must carry it in
//! `X-Access-Token`, except `GET /health` (the SDK's liveness probe) and a `/files` URL
//! signed with it (the SDK's `download_url`/`upload_url`: a `signature` of the path, the
//! operation, the user and the token, with an optional `signature_expiration`). Anything
//! else gets envd's 401. A sandbox created with `allowPublicTraffic: false` also has a
//! *traffic access token*: requests for its other ports must carry it in
//! `e2b-traffic-access-token` (E2B's proxy answers 403 without it).
//!
//! Tokens are compared in constant time; a signature is recomputed, never parsed.

use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sha2::{Digest, Sha256};

/// The header that carries the envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// The header that carries the traffic access token.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// Constant-time equality (the length is not secret).
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// E2B's v1 file-URL signature: `v1_` and the unpadded base64 of
/// SHA-256(`path:operation:user:token[:expiration]`), `user` empty for the default user.
pub fn signature(path: &str, operation: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    let raw = match exp {
        Some(e) => format!("{path}:{operation}:{user}:{token}:{e}"),
        None => format!("{path}:{operation}:{user}:{token}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// Why a request may not go on; its answer is E2B's ([`IntoResponse`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// envd's 401.
    Unauthorized(&'static str),
    /// E2B's proxy's 403 for an exposed port (the sandbox, the message).
    Forbidden(String, String),
}

impl Denied {
    /// Its HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Denied::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Denied::Forbidden(..) => StatusCode::FORBIDDEN,
        }
    }
}

impl IntoResponse for Denied {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = match self {
            Denied::Unauthorized(message) => serde_json::json!({"code": 401, "message": message}),
            Denied::Forbidden(id, message) => {
                serde_json::json!({"sandboxId": id, "message": message, "code": 403})
            }
        };
        (status, axum::Json(body)).into_response()
    }
}

fn unauthorized(message: &'static str) -> Denied {
    Denied::Unauthorized(message)
}

/// Whether a request for envd's port of a sandbox with envd access token `token` may go
/// on (`now_s`: unix seconds); envd's 401 if not.
pub fn check_envd(
    token: &str,
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    now_s: i64,
) -> Result<(), Denied> {
    if path == "/health" {
        return Ok(());
    }
    if let Some(given) = headers.get(ACCESS_TOKEN_HEADER) {
        return if same_secret(given.as_bytes(), token.as_bytes()) {
            Ok(())
        } else {
            Err(unauthorized("invalid access token"))
        };
    }
    let operation = match (path, method) {
        ("/files", &Method::GET) => "read",
        ("/files", &Method::POST) => "write",
        _ => {
            return Err(unauthorized(
                "unauthorized access, please provide a valid access token or method signing if supported",
            ))
        }
    };
    let (mut file, mut user, mut sig, mut exp) = (None, String::new(), None, None);
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "path" => file = Some(v.into_owned()),
            "username" => user = v.into_owned(),
            "signature" => sig = Some(v.into_owned()),
            "signature_expiration" => exp = Some(v.into_owned()),
            _ => {}
        }
    }
    let Some(sig) = sig else {
        return Err(unauthorized(
            "unauthorized access, please provide a valid access token or method signing if supported",
        ));
    };
    let exp = match exp.map(|e| e.parse::<i64>()) {
        None => None,
        Some(Ok(e)) => Some(e),
        Some(Err(_)) => return Err(unauthorized("invalid signature expiration")),
    };
    let want = signature(
        file.as_deref().unwrap_or_default(),
        operation,
        &user,
        token,
        exp,
    );
    if !same_secret(sig.as_bytes(), want.as_bytes()) {
        return Err(unauthorized("invalid signature"));
    }
    if exp.is_some_and(|e| e < now_s) {
        return Err(unauthorized("signature is already expired"));
    }
    Ok(())
}

/// Whether a request for an exposed port of sandbox `id`, whose traffic access token is
/// `token`, may go on; E2B's 403 if not.
pub fn check_traffic(id: &str, token: &str, headers: &HeaderMap) -> Result<(), Denied> {
    let refuse = |message: String| Denied::Forbidden(id.to_string(), message);
    match headers.get(TRAFFIC_TOKEN_HEADER) {
        None => Err(refuse(format!(
            "Sandbox is secured with traffic access token. Token header '{TRAFFIC_TOKEN_HEADER}' is missing"
        ))),
        Some(v) if same_secret(v.as_bytes(), token.as_bytes()) => Ok(()),
        Some(_) => Err(refuse(format!(
            "Sandbox is secured with traffic access token. Token in header '{TRAFFIC_TOKEN_HEADER}' is invalid"
        ))),
    }
}

/// The Host header a mask (`maskRequestHost`) gives port `port`.
pub fn masked_host(mask: &str, port: u16) -> String {
    mask.replace("${PORT}", &port.to_string())
}

/// Whether `mask` is a usable host mask: a host name (letters, digits, `-`, `.`, an
/// optional `:port`) in which `${PORT}` may stand for the port.
pub fn valid_mask(mask: &str) -> bool {
    let host = masked_host(mask, 1);
    !mask.is_empty()
        && mask.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b':')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_match_the_sdks() {
        // The pinned SDK's get_signature("/home/user/a.txt", "read", None, "tok", None),
        // computed with its own code: v1_ + base64(sha256("/home/user/a.txt:read::tok")).
        let s = signature("/home/user/a.txt", "read", "", "tok", None);
        assert_eq!(s, "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY");
        assert_ne!(s, signature("/home/user/a.txt", "write", "", "tok", None));
        assert_ne!(
            s,
            signature("/home/user/a.txt", "read", "root", "tok", None)
        );
        assert_ne!(s, signature("/home/user/a.txt", "read", "", "tok", Some(5)));
    }

    fn q(path: &str, user: &str, sig: &str, exp: Option<i64>) -> String {
        let mut s = form_urlencoded::Serializer::new(String::new());
        s.append_pair("path", path);
        if !user.is_empty() {
            s.append_pair("username", user);
        }
        s.append_pair("signature", sig);
        if let Some(e) = exp {
            s.append_pair("signature_expiration", &e.to_string());
        }
        s.finish()
    }

    #[test]
    fn envd_requests_need_the_token_or_a_good_signature() {
        let h = HeaderMap::new();
        let get = Method::GET;
        let post = Method::POST;
        // The health probe needs nothing; everything else does.
        assert!(check_envd("tok", &get, "/health", None, &h, 0).is_ok());
        for path in [
            "/files",
            "/process.Process/Start",
            "/filesystem.Filesystem/Stat",
        ] {
            let r = check_envd("tok", &post, path, None, &h, 0).unwrap_err();
            assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "{path}");
        }
        let mut good = HeaderMap::new();
        good.insert(ACCESS_TOKEN_HEADER, "tok".parse().unwrap());
        assert!(check_envd("tok", &post, "/process.Process/Start", None, &good, 0).is_ok());
        let mut bad = HeaderMap::new();
        bad.insert(ACCESS_TOKEN_HEADER, "tok2".parse().unwrap());
        assert!(check_envd("tok", &post, "/process.Process/Start", None, &bad, 0).is_err());
        // Signed URLs: for their operation, path, user and expiration only.
        let sig = signature("/a b", "read", "root", "tok", Some(100));
        let ok = q("/a b", "root", &sig, Some(100));
        assert!(check_envd("tok", &get, "/files", Some(&ok), &h, 99).is_ok());
        assert!(
            check_envd("tok", &get, "/files", Some(&ok), &h, 101).is_err(),
            "expired"
        );
        assert!(
            check_envd("tok", &post, "/files", Some(&ok), &h, 99).is_err(),
            "a read URL writes"
        );
        assert!(
            check_envd("other", &get, "/files", Some(&ok), &h, 99).is_err(),
            "another token"
        );
        for altered in [
            q("/a c", "root", &sig, Some(100)),
            q("/a b", "user", &sig, Some(100)),
            q("/a b", "root", &sig, Some(1000)),
            q("/a b", "root", &sig, None),
            q("/a b", "root", &sig.replace('v', "w"), Some(100)),
            q("/a b", "root", &format!("{sig}x"), Some(100)),
        ] {
            assert!(
                check_envd("tok", &get, "/files", Some(&altered), &h, 99).is_err(),
                "{altered}"
            );
        }
        let bad_exp = format!(
            "{}&signature_expiration=soon",
            q("/a b", "root", &sig, None)
        );
        assert!(check_envd("tok", &get, "/files", Some(&bad_exp), &h, 99).is_err());
        let forever = signature("/x", "write", "", "tok", None);
        assert!(check_envd(
            "tok",
            &post,
            "/files",
            Some(&q("/x", "", &forever, None)),
            &h,
            i64::MAX
        )
        .is_ok());
    }

    #[test]
    fn traffic_needs_its_token_and_masks_make_hosts() {
        let mut h = HeaderMap::new();
        assert_eq!(
            check_traffic("s", "t", &h).unwrap_err().status(),
            StatusCode::FORBIDDEN
        );
        h.insert(TRAFFIC_TOKEN_HEADER, "u".parse().unwrap());
        assert!(check_traffic("s", "t", &h).is_err());
        h.insert(TRAFFIC_TOKEN_HEADER, "t".parse().unwrap());
        assert!(check_traffic("s", "t", &h).is_ok());
        assert_eq!(
            masked_host("${PORT}-app.example.org", 8080),
            "8080-app.example.org"
        );
        assert!(valid_mask("${PORT}-app.example.org"));
        assert!(valid_mask("localhost:3000"));
        for bad in ["", "a b", "x\r\nInjected: 1", "${PORT}/path", "{PORT}"] {
            assert!(!valid_mask(bad), "{bad:?}");
        }
    }
}

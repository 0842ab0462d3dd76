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
//!
//! A signed URL grants exactly what was signed, nothing the rest of the request says:
//! [`check_envd`] answers a [`Grant`], and a [`Grant::Signed`] names the one path, the one
//! user (the sandbox's default one when the URL names none, never an `Authorization`
//! header's) and the one operation the handlers then use. The signed parameters may
//! appear once each, and the URL must name a path (envd lets a signature over an empty
//! path write wherever the multipart parts' names say; here that is refused).
//!
//! Why some signed URLs are refused although their signature is right: E2B's signature
//! hashes `path:operation:user:token[:expiration]` joined with `:`, a separator `path`
//! and `user` may themselves contain, so one string can be split into more than one
//! (path, user) pair — `("/a:write:b", user "u")` and `("/a", user "b:write:u")` hash the
//! same for a write. The format is the SDK's, so it cannot change; instead only strings
//! with a single split are accepted. Read from the right, the string is unambiguous when
//! neither the user nor the token contains `:` and the token is no decimal number (so an
//! expiration cannot be mistaken for it): the last field is the expiration (if the URL
//! has one), then the token, the user, the operation (`read` or `write`, fixed by the
//! method), and what is left is the path, which may then contain `:`. Hence: a signed
//! URL whose `username` contains `:` is refused (no sandbox user can have one: `/etc/passwd`
//! separates its fields with it), and so is any signature when the sandbox's token has
//! one (Clade's tokens are 64 hex digits: never).

use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sha2::{Digest, Sha256};

/// The header that carries the envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// The header that carries the traffic access token.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// Constant-time equality of two secrets (API keys, cluster secrets, tokens): their
/// SHA-256 digests are compared in full, so neither where they differ nor their lengths
/// show in the time taken. The one helper every such comparison uses (the cluster's
/// gateway too: it depends on this crate).
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let (da, db) = (Sha256::digest(a), Sha256::digest(b));
    same_digest(da.as_slice(), db.as_slice())
}

/// Constant-time equality of two digests of the same length (a length difference is
/// not secret: digests have a fixed one).
pub fn same_digest(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len()
        && std::hint::black_box(a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y))) == 0
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

/// What an envd operation a signed URL grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// `GET /files`.
    Read,
    /// `POST /files`.
    Write,
}

impl Operation {
    /// Its name in the signature.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// What a request [`check_envd`] let through may do; the data plane's handlers act on
/// it (it travels as a request extension).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// The access token, or a sandbox without one: whatever the request asks.
    Full,
    /// A signed `/files` URL: this operation, on this path, as this user (`None`: the
    /// sandbox's default user) and nothing else.
    Signed {
        operation: Operation,
        path: String,
        user: Option<String>,
    },
}

const NO_TOKEN: &str =
    "unauthorized access, please provide a valid access token or method signing if supported";

/// Whether a request for envd's port of a sandbox with envd access token `token` may go
/// on (`now_s`: unix seconds), and what it may do; envd's 401 if not.
pub fn check_envd(
    token: &str,
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    now_s: i64,
) -> Result<Grant, Denied> {
    if path == "/health" {
        return Ok(Grant::Full);
    }
    if let Some(given) = headers.get(ACCESS_TOKEN_HEADER) {
        return if same_secret(given.as_bytes(), token.as_bytes()) {
            Ok(Grant::Full)
        } else {
            Err(unauthorized("invalid access token"))
        };
    }
    let operation = match (path, method) {
        ("/files", &Method::GET) => Operation::Read,
        ("/files", &Method::POST) => Operation::Write,
        _ => return Err(unauthorized(NO_TOKEN)),
    };
    let (mut file, mut user, mut sig, mut exp) = (None, None, None, None);
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        let slot = match k.as_ref() {
            "path" => &mut file,
            "username" => &mut user,
            "signature" => &mut sig,
            "signature_expiration" => &mut exp,
            _ => continue,
        };
        // Which of two would count is a guess the handlers must not have to make.
        if slot.replace(v.into_owned()).is_some() {
            return Err(unauthorized("a signed parameter is given more than once"));
        }
    }
    let Some(sig) = sig else {
        return Err(unauthorized(NO_TOKEN));
    };
    let exp = match exp.map(|e| e.parse::<i64>()) {
        None => None,
        Some(Ok(e)) => Some(e),
        Some(Err(_)) => return Err(unauthorized("invalid signature expiration")),
    };
    let user = user.unwrap_or_default();
    // See the module's doc: only strings with one (path, user) split are signed ones.
    if user.contains(':') || token.contains(':') || token.parse::<i64>().is_ok() {
        return Err(unauthorized("invalid signature: ambiguous user"));
    }
    let file = file.unwrap_or_default();
    let want = signature(&file, operation.as_str(), &user, token, exp);
    if !same_secret(sig.as_bytes(), want.as_bytes()) {
        return Err(unauthorized("invalid signature"));
    }
    if exp.is_some_and(|e| e < now_s) {
        return Err(unauthorized("signature is already expired"));
    }
    if file.is_empty() {
        return Err(unauthorized("a signed URL must name its path"));
    }
    Ok(Grant::Signed {
        operation,
        path: file,
        user: (!user.is_empty()).then_some(user),
    })
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
    fn a_signed_url_grants_its_path_user_and_operation_only() {
        let h = HeaderMap::new();
        let sig = signature("/a", "write", "", "tok", None);
        assert_eq!(
            check_envd(
                "tok",
                &Method::POST,
                "/files",
                Some(&q("/a", "", &sig, None)),
                &h,
                0
            ),
            Ok(Grant::Signed {
                operation: Operation::Write,
                path: "/a".into(),
                user: None,
            })
        );
        let sig = signature("/a", "read", "u", "tok", None);
        assert_eq!(
            check_envd(
                "tok",
                &Method::GET,
                "/files",
                Some(&q("/a", "u", &sig, None)),
                &h,
                0
            ),
            Ok(Grant::Signed {
                operation: Operation::Read,
                path: "/a".into(),
                user: Some("u".into()),
            })
        );
        let mut t = HeaderMap::new();
        t.insert(ACCESS_TOKEN_HEADER, "tok".parse().unwrap());
        assert_eq!(
            check_envd("tok", &Method::POST, "/files", None, &t, 0),
            Ok(Grant::Full)
        );
        // A signed parameter given twice: refused, whichever one was signed.
        let sig = signature("/a", "write", "", "tok", None);
        for twice in [
            format!("{}&path=/b", q("/a", "", &sig, None)),
            format!("path=/b&{}", q("/a", "", &sig, None)),
            format!("{}&username=nobody", q("/a", "", &sig, None)),
            format!("{}&signature={sig}", q("/a", "", &sig, None)),
        ] {
            assert!(
                check_envd("tok", &Method::POST, "/files", Some(&twice), &h, 0).is_err(),
                "{twice}"
            );
        }
        // A signature over no path grants no path (envd's would let the parts choose).
        let none = signature("", "write", "", "tok", None);
        let r = check_envd(
            "tok",
            &Method::POST,
            "/files",
            Some(&format!("signature={none}")),
            &h,
            0,
        );
        assert!(r.is_err(), "{r:?}");
    }

    /// E2B's signature string has more than one (path, user) split when the user may
    /// contain `:`: a URL signed for `/a:write:b` as `u` must not be usable for `/a` as
    /// `b:write:u`.
    #[test]
    fn a_signature_with_two_splits_is_refused() {
        let h = HeaderMap::new();
        let sig = signature("/a:write:b", "write", "u", "tok", None);
        assert_eq!(
            sig,
            signature("/a", "write", "b:write:u", "tok", None),
            "the collision this guards against"
        );
        let signed = q("/a:write:b", "u", &sig, None);
        assert!(check_envd("tok", &Method::POST, "/files", Some(&signed), &h, 0).is_ok());
        let other_split = q("/a", "b:write:u", &sig, None);
        assert_eq!(
            check_envd("tok", &Method::POST, "/files", Some(&other_split), &h, 0),
            Err(Denied::Unauthorized("invalid signature: ambiguous user"))
        );
        // With an expiry, and with the default user, likewise.
        let sig = signature("/x:read:", "read", "", "tok", Some(7));
        assert_eq!(sig, signature("/x", "read", ":read:", "tok", Some(7)));
        let other_split = q("/x", ":read:", &sig, Some(7));
        assert!(check_envd("tok", &Method::GET, "/files", Some(&other_split), &h, 0).is_err());
        assert!(check_envd(
            "tok",
            &Method::GET,
            "/files",
            Some(&q("/x:read:", "", &sig, Some(7))),
            &h,
            0
        )
        .is_ok());
        // A token that would make the split ambiguous signs nothing.
        for token in ["t:k", "12345"] {
            let sig = signature("/a", "read", "", token, None);
            assert!(check_envd(
                token,
                &Method::GET,
                "/files",
                Some(&q("/a", "", &sig, None)),
                &h,
                0
            )
            .is_err());
        }
    }

    #[test]
    fn secrets_compare_by_digest() {
        assert!(same_secret(b"key", b"key"));
        assert!(!same_secret(b"key", b"kez"));
        assert!(!same_secret(b"key", b"key2"));
        assert!(!same_secret(b"", b"x"));
        assert!(same_digest(&[1, 2], &[1, 2]));
        assert!(!same_digest(&[1, 2], &[1, 3]));
        assert!(!same_digest(&[1, 2], &[1]));
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

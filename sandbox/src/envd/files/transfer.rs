//! What both `/files` transfers share: the path and user a request acts on, by its
//! [`Grant`] (full access: its query and `Authorization` header; a signed URL: exactly its
//! signed path and user; no grant: refused), and envd's HTTP error body. Separate so that
//! download and upload decide what they touch the same way.

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::envd::access::{Grant, Operation};
use crate::envd::connect::{Code, RpcError};

/// envd's `/files` error body.
pub(super) fn http_error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(serde_json::json!({"code": status.as_u16(), "message": message.into()})),
    )
        .into_response()
}

pub(super) fn rpc_to_http(e: RpcError) -> Response {
    let status = match e.code {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::AlreadyExists => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        Code::Unavailable => StatusCode::BAD_GATEWAY,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    http_error(status, e.message)
}

/// What a `/files` request acts on: the path and user its query (and, with full access,
/// its `Authorization` header) names, or exactly a signed URL's.
pub(super) struct FileTarget {
    pub(super) path: Option<String>,
    pub(super) user: Option<String>,
    /// Authorised by a signature: `path` and `user` are the signed ones.
    pub(super) signed: bool,
}

/// The [`FileTarget`] of a `/files` request for `op`, by its [`Grant`], or why it is
/// refused (401; no grant: a request that did not pass the access check never acts).
pub(super) fn file_target(req: &Request, op: Operation) -> Result<FileTarget, &'static str> {
    match req.extensions().get::<Grant>() {
        Some(Grant::Full) => {
            let (path, qs_user) = file_query(req);
            let user = qs_user.or_else(|| crate::envd::basic_user(req.headers()));
            Ok(FileTarget {
                path,
                user,
                signed: false,
            })
        }
        Some(Grant::Signed {
            operation,
            path,
            user,
        }) if *operation == op => Ok(FileTarget {
            path: Some(path.clone()),
            user: user.clone(),
            signed: true,
        }),
        Some(Grant::Signed { .. }) => Err("the URL is signed for another operation"),
        None => Err("the request was not authorised"),
    }
}

/// `path` and `username` of a `/files` query.
fn file_query(req: &Request) -> (Option<String>, Option<String>) {
    let (mut path, mut user) = (None, None);
    if let Some(q) = req.uri().query() {
        for (k, v) in form_urlencoded::parse(q.as_bytes()) {
            match &*k {
                "path" => path = Some(v.into_owned()),
                "username" => user = Some(v.into_owned()),
                _ => {}
            }
        }
    }
    (path, user)
}

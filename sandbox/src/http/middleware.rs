//! The layers around the control API's routes: the API-key check ([`auth`]), the 404 of
//! an unknown path ([`not_found`]), and `Connection: close` after an error answered to a
//! request whose body was not read ([`close_after_refused_upload`]). Separate from the
//! routes: these see every request, whatever its endpoint.

use axum::extract::{Request, State as AxState};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::ApiError;
use super::AppState;

/// An error answered to a request with a body (an upload to a sandbox that is not running,
/// say) may go out before the body was read, and then the connection cannot carry another
/// request. A client that put it back in its pool would see it closed under its next
/// request (seen through a forwarded port, where the close arrives late): `Connection:
/// close` tells it not to. HTTP/1 only (HTTP/2 has no such header and resets the stream).
pub(super) async fn close_after_refused_upload(req: Request, next: Next) -> Response {
    use axum::http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
    let h = req.headers();
    let with_body = h.contains_key(TRANSFER_ENCODING)
        || h.get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0);
    let http1 = req.version() <= axum::http::Version::HTTP_11;
    let mut resp = next.run(req).await;
    let refused = resp.status().is_client_error() || resp.status().is_server_error();
    if with_body && http1 && refused {
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

pub(super) async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

/// The key check in front of every API route: `X-API-KEY`, or (the dashboard's calls) a
/// live session cookie with `X-Clade-Dashboard: 1` ([`crate::dashboard`]).
pub(super) async fn auth(AxState(st): AxState<AppState>, req: Request, next: Next) -> Response {
    match req.headers().get("x-api-key") {
        None if crate::dashboard::dashboard_request(
            &axum::extract::FromRef::from_ref(&st),
            req.headers(),
        ) =>
        {
            next.run(req).await
        }
        None => ApiError::new(StatusCode::UNAUTHORIZED, "Authorization header is missing")
            .into_response(),
        Some(k) if crate::envd::access::same_secret(k.as_bytes(), st.api_key.as_bytes()) => {
            next.run(req).await
        }
        Some(_) => ApiError::new(StatusCode::UNAUTHORIZED, "Invalid API key").into_response(),
    }
}

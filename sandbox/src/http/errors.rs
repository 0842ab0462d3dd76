//! The error answer of every control-API route: [`ApiError`], its status and E2B's body
//! (`{"code": N, "message": "...", "error_code": ...}`), and how each [`Error`] of the host
//! maps to a status. Separate so that the routes share one mapping and no route builds an
//! error body of its own.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::NO_ROOM;
use crate::error::Error;

/// An error answer: status plus E2B's error body.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    error_code: Option<&'static str>,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            error_code: None,
        }
    }

    pub(super) fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub(super) fn with_code(mut self, code: &'static str) -> Self {
        self.error_code = Some(code);
        self
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::NotFound(_) | Error::SnapshotNotFound(_) => StatusCode::NOT_FOUND,
            Error::Crashed { .. } => StatusCode::NOT_FOUND,
            Error::BadRequest(_) | Error::TemplateNotFound(_) => StatusCode::BAD_REQUEST,
            Error::Conflict(_) | Error::Fenced { .. } => StatusCode::CONFLICT,
            Error::Cluster(_) | Error::NoRoom(_) => StatusCode::SERVICE_UNAVAILABLE,
            // E2B's answer: the SDK raises ServiceBusyException.
            Error::GuestUnresponsive { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("{e}");
        }
        Self {
            status,
            error_code: match e {
                Error::Crashed { .. } => Some("sandbox_crashed"),
                Error::NoRoom(_) => Some(NO_ROOM),
                _ => None,
            },
            message: e.to_string(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"code": self.status.as_u16(), "message": self.message});
        if let Some(c) = self.error_code {
            body["error_code"] = json!(c);
        }
        (self.status, Json(body)).into_response()
    }
}

pub(super) type ApiResult<T> = Result<T, ApiError>;

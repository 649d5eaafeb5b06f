//! Errors as HTTP answers, and extractors whose rejections use the same JSON shape.
//!
//! Every error answer is `{"code": "snake_case", "message": "sentence"}`. Bodies are
//! parsed here rather than by axum's `Json` so that a missing content type is not an
//! error, garbage is 400 `bad_json`, and JSON of the wrong shape (unknown field, wrong
//! type, negative number) is 422 `invalid_request` with serde's message.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use devlend_fabric::error::chain;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::api::{codes, ErrorBody};
use crate::error::Error;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let (status, code, message) = match &self {
            Error::Rejected {
                status,
                code,
                message,
            } => (
                StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_REQUEST),
                *code,
                message.clone(),
            ),
            other => {
                tracing::error!(error = %chain(other), "pool request failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    codes::INTERNAL,
                    format!("the pool failed: {}", chain(other)),
                )
            }
        };
        error_response(status, code, message)
    }
}

/// An error answer with the pool's JSON shape.
pub fn error_response(status: StatusCode, code: &str, message: String) -> Response {
    (
        status,
        Json(ErrorBody {
            code: code.to_string(),
            message,
        }),
    )
        .into_response()
}

/// A JSON body, parsed with the pool's error shape for its rejections.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// A JSON body that may also be empty (then `T::default()`).
#[derive(Debug)]
pub struct OptionalJson<T>(pub T);

async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, Error> {
    Bytes::from_request(req, state).await.map_err(|e| {
        let status = e.status();
        Error::Rejected {
            status: status.as_u16(),
            code: if status == StatusCode::PAYLOAD_TOO_LARGE {
                codes::TOO_LARGE
            } else {
                codes::BAD_JSON
            },
            message: e.body_text(),
        }
    })
}

fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(bytes).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => Error::Rejected {
                status: 422,
                code: codes::INVALID_REQUEST,
                message: format!("the request body does not fit: {e}"),
            },
            _ => Error::bad_request(
                codes::BAD_JSON,
                format!("the request body is not JSON: {e}"),
            ),
        }
    })
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = Error;

    async fn from_request(req: Request, state: &S) -> Result<Self, Error> {
        let bytes = body_bytes(req, state).await?;
        parse(&bytes).map(ApiJson)
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for OptionalJson<T> {
    type Rejection = Error;

    async fn from_request(req: Request, state: &S) -> Result<Self, Error> {
        let bytes = body_bytes(req, state).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJson(T::default()));
        }
        parse(&bytes).map(OptionalJson)
    }
}

/// Parses a path segment as a lease or device id.
pub fn parse_uuid(what: &str, s: &str) -> Result<Uuid, Error> {
    s.parse::<Uuid>()
        .map_err(|_| Error::bad_request(codes::BAD_PATH, format!("{what} {s:?} is not a UUID")))
}

/// 404 for routes that do not exist.
pub async fn not_found(req: Request) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        codes::NOT_FOUND,
        format!(
            "no route {} {} (see GET /openapi.json)",
            req.method(),
            req.uri().path()
        ),
    )
}

/// 405 for a route that exists with another method.
pub async fn method_not_allowed(req: Request) -> Response {
    error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        codes::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

//! The enrollment routes: enrolled keys, join tokens and their redemption. The checks
//! are in [`crate::auth`]; these handlers only move JSON.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};

use super::error::ApiJson;
use crate::api::{codes, EnrollRequest, Enrollment, ErrorBody, JoinRequest, Principal};
use crate::auth::Caller;
use crate::error::Error;
use crate::service::PoolService;

/// Every enrolled key (admin).
#[utoipa::path(get, path = "/v1/principals", tag = "enrollment",
    responses(
        (status = 200, body = Vec<Principal>),
        (status = 401, body = ErrorBody, description = "unauthenticated"),
        (status = 403, body = ErrorBody, description = "unknown_key, forbidden"),
    ))]
pub async fn principals(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Vec<Principal>>, Error> {
    caller.require_admin("list enrolled keys")?;
    Ok(Json(s.store().principals().await?))
}

/// Pins a key to a role and name, or issues a one-time join token (admin).
#[utoipa::path(post, path = "/v1/principals", tag = "enrollment",
    request_body = EnrollRequest,
    responses(
        (status = 201, body = Enrollment),
        (status = 401, body = ErrorBody, description = "unauthenticated"),
        (status = 403, body = ErrorBody, description = "unknown_key, forbidden"),
        (status = 422, body = ErrorBody, description = "Bad name, key or ttl_ms"),
    ))]
pub async fn enroll(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    ApiJson(body): ApiJson<EnrollRequest>,
) -> Result<(StatusCode, Json<Enrollment>), Error> {
    caller.require_admin("enroll keys")?;
    Ok((StatusCode::CREATED, Json(s.enroll(&body).await?)))
}

/// Revokes an enrolled key (admin): its requests are refused from now on.
#[utoipa::path(delete, path = "/v1/principals/{key}", tag = "enrollment",
    params(("key" = String, Path, description = "The public key, unpadded base64url")),
    responses(
        (status = 200, body = Principal),
        (status = 401, body = ErrorBody, description = "unauthenticated"),
        (status = 403, body = ErrorBody, description = "unknown_key, forbidden"),
        (status = 404, body = ErrorBody, description = "unknown_key: not enrolled"),
    ))]
pub async fn revoke(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    key: Result<Path<String>, PathRejection>,
) -> Result<Json<Principal>, Error> {
    caller.require_admin("revoke keys")?;
    let key = key
        .map(|Path(k)| k)
        .map_err(|e| Error::bad_request(codes::BAD_PATH, e.body_text()))?;
    let Some(p) = s.store().principal(&key).await? else {
        return Err(Error::not_found(
            codes::UNKNOWN_KEY,
            format!("key {key} is not enrolled"),
        ));
    };
    s.store().revoke(&key).await?;
    tracing::info!(role = %p.role, name = %p.name, key = %p.public_key, "key revoked");
    Ok(Json(p))
}

/// Redeems a join token: the request's signing key is enrolled with the token's role
/// and name.
#[utoipa::path(post, path = "/v1/join", tag = "enrollment",
    request_body = JoinRequest,
    responses(
        (status = 200, body = Principal),
        (status = 401, body = ErrorBody, description = "unauthenticated: the request is not signed"),
        (status = 403, body = ErrorBody, description = "bad_join_token"),
    ))]
pub async fn join(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    ApiJson(body): ApiJson<JoinRequest>,
) -> Result<Json<Principal>, Error> {
    Ok(Json(s.join(&caller, &body.token).await?))
}

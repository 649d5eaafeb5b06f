//! The HTTP API (axum): routes, JSON errors, the OpenAPI document.

pub mod authenticate;
pub mod error;
pub mod metrics;
pub mod openapi;
pub mod principals;
pub mod routes;

use axum::routing::{delete, get, post, put};
use axum::Router;

use crate::service::PoolService;

/// Largest request body accepted, in bytes (a registration of 4096 devices fits).
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// The pool's router over `service`.
pub fn router(service: PoolService) -> Router {
    Router::new()
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/metrics", get(metrics::metrics))
        .route("/v1/signing-key", get(routes::signing_key))
        .route("/v1/providers", get(routes::providers))
        .route("/v1/providers/{name}", put(routes::register_provider))
        .route(
            "/v1/providers/{name}/heartbeat",
            post(routes::provider_heartbeat),
        )
        .route("/v1/devices", get(routes::devices))
        .route("/v1/leases", get(routes::leases).post(routes::create_lease))
        .route("/v1/leases/{id}", get(routes::lease))
        .route("/v1/leases/{id}/bind", post(routes::bind))
        .route("/v1/leases/{id}/release", post(routes::release))
        .route("/v1/leases/{id}/heartbeat", post(routes::lease_heartbeat))
        .route("/v1/leases/{id}/handover", post(routes::handover))
        .route(
            "/v1/principals",
            get(principals::principals).post(principals::enroll),
        )
        .route("/v1/principals/{key}", delete(principals::revoke))
        .route("/v1/join", post(principals::join))
        .fallback(error::not_found)
        .method_not_allowed_fallback(error::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            service.clone(),
            authenticate::authenticate,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(service)
}

//! The OpenAPI 3 document, generated from the handlers' annotations (utoipa), and its
//! own route. This module looks at the handlers ([`super::routes`]); they do not look
//! back.

use axum::Json;
use utoipa::OpenApi;

use super::routes;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "devlend pool",
        description = "Inventory of lendable devices, leases, placement. See docs/pool.md."
    ),
    paths(
        openapi_json,
        routes::signing_key,
        routes::register_provider,
        routes::provider_heartbeat,
        routes::providers,
        routes::devices,
        routes::create_lease,
        routes::leases,
        routes::lease,
        routes::bind,
        routes::release,
        routes::lease_heartbeat,
    )
)]
struct ApiDoc;

/// The document served at `GET /openapi.json`.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The OpenAPI 3 document of this API.
#[utoipa::path(get, path = "/openapi.json", tag = "meta",
    responses((status = 200, description = "The OpenAPI 3 document", body = Object)))]
pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(document())
}

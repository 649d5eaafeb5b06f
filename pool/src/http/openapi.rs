//! The OpenAPI 3 document, generated from the handlers' annotations (utoipa).

use utoipa::OpenApi;

use super::routes;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "devlend pool",
        description = "Inventory of lendable devices, leases, placement. See docs/pool.md."
    ),
    paths(
        routes::openapi_json,
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

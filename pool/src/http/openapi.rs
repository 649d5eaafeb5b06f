//! The OpenAPI 3 document, generated from the handlers' annotations (utoipa), and its
//! own route. This module looks at the handlers ([`super::routes`]); they do not look
//! back.

use axum::Json;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{principals, routes};

/// Adds the request signature scheme (see `pool/src/auth/request.rs`).
struct SignedRequests;

impl Modify for SignedRequests {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "devlend_ed25519",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "Authorization",
                "`Devlend-Ed25519 key=K;ts=T;nonce=N;sig=S`: an Ed25519 signature by an \
                 enrolled key over the method, the path and query, the time (ms), a \
                 16-byte nonce and the body's SHA-256. See docs/security.md.",
            ))),
        );
    }
}

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
        routes::handover,
        principals::principals,
        principals::enroll,
        principals::revoke,
        principals::join,
    ),
    modifiers(&SignedRequests),
    security(("devlend_ed25519" = []))
)]
struct ApiDoc;

/// The document served at `GET /openapi.json`.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The OpenAPI 3 document of this API.
#[utoipa::path(get, path = "/openapi.json", tag = "meta", security(()),
    responses((status = 200, description = "The OpenAPI 3 document", body = Object)))]
pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(document())
}

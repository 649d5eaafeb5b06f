//! The handlers, one per route, each annotated for the OpenAPI document.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::{Extension, Json};

use super::error::{parse_uuid, ApiJson, OptionalJson};
use crate::api::{
    codes, Device, DeviceQuery, EmptyBody, ErrorBody, GenerationBody, HandoverRequest, Lease,
    LeaseFilter, LeaseGrant, LeaseRequest, Provider, ProviderHeartbeat, ProviderHeartbeatBody,
    RegisterProvider, SigningKey,
};
use crate::auth::Caller;
use crate::error::Error;
use crate::service::PoolService;

type Answer<T> = Result<Json<T>, Error>;

fn segment(p: Result<Path<String>, PathRejection>) -> Result<String, Error> {
    p.map(|Path(s)| s)
        .map_err(|e| Error::bad_request(codes::BAD_PATH, e.body_text()))
}

fn query_pairs(q: &Option<String>, allowed: &[&str]) -> Result<Vec<(String, String)>, Error> {
    let pairs: Vec<(String, String)> =
        form_urlencoded::parse(q.as_deref().unwrap_or("").as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
    if let Some((k, _)) = pairs.iter().find(|(k, _)| !allowed.contains(&k.as_str())) {
        return Err(Error::bad_request(
            codes::BAD_QUERY,
            format!(
                "unknown query parameter {k:?}; known: {}",
                allowed.join(", ")
            ),
        ));
    }
    Ok(pairs)
}

/// Refuses a caller that is not the lease's compute host (or an admin).
async fn own_lease(s: &PoolService, caller: &Caller, id: uuid::Uuid) -> Result<(), Error> {
    caller.require_enrolled()?;
    let lease = s.lease(id).await?;
    caller.require_compute_host(&lease.compute_host)
}

/// The key lease tokens are signed with.
#[utoipa::path(get, path = "/v1/signing-key", tag = "pool", security(()),
    responses((status = 200, body = SigningKey)))]
pub async fn signing_key(State(s): State<PoolService>) -> Json<SigningKey> {
    Json(s.signing_key())
}

/// Registers a lender (resource provider) and its devices; idempotent, counts as a
/// heartbeat.
#[utoipa::path(put, path = "/v1/providers/{name}", tag = "providers",
    params(("name" = String, Path, description = "Provider (lender) name")),
    request_body = RegisterProvider,
    responses(
        (status = 200, body = Provider),
        (status = 400, body = ErrorBody, description = "Not JSON"),
        (status = 422, body = ErrorBody, description = "Unknown field, bad name, class, trait or size"),
    ))]
pub async fn register_provider(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    name: Result<Path<String>, PathRejection>,
    ApiJson(body): ApiJson<RegisterProvider>,
) -> Answer<Provider> {
    let name = segment(name)?;
    let caller = s.trust_on_first_use(caller, &name).await?;
    caller.require_provider(&name)?;
    Ok(Json(s.register(&name, &body).await?))
}

/// A lender's heartbeat: keeps it available, renews the leases it serves, and returns
/// its live leases and its devices' fences.
#[utoipa::path(post, path = "/v1/providers/{name}/heartbeat", tag = "providers",
    params(("name" = String, Path, description = "Provider (lender) name")),
    request_body(content = ProviderHeartbeatBody, description = "Empty, {}, or the leases served now"),
    responses(
        (status = 200, body = ProviderHeartbeat),
        (status = 404, body = ErrorBody, description = "unknown_provider: register again"),
    ))]
pub async fn provider_heartbeat(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    name: Result<Path<String>, PathRejection>,
    OptionalJson(body): OptionalJson<ProviderHeartbeatBody>,
) -> Answer<ProviderHeartbeat> {
    let name = segment(name)?;
    caller.require_provider(&name)?;
    Ok(Json(s.provider_heartbeat(&name, &body).await?))
}

/// Every provider with its devices.
#[utoipa::path(get, path = "/v1/providers", tag = "providers",
    responses((status = 200, body = Vec<Provider>)))]
pub async fn providers(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
) -> Answer<Vec<Provider>> {
    caller.require_enrolled()?;
    Ok(Json(s.providers().await?))
}

/// Devices, filtered by class, traits (all of them) and minimum capacity.
#[utoipa::path(get, path = "/v1/devices", tag = "devices",
    params(
        ("class" = Option<String>, Query, description = "BLOCK, NIC or PCI_<vendor>_<device>"),
        ("trait" = Option<Vec<String>>, Query, description = "A trait the device must have (repeatable)"),
        ("min_capacity" = Option<u64>, Query, description = "Smallest capacity, bytes"),
    ),
    responses(
        (status = 200, body = Vec<Device>),
        (status = 400, body = ErrorBody, description = "Unknown or malformed parameter"),
        (status = 422, body = ErrorBody, description = "Bad class or trait syntax"),
    ))]
pub async fn devices(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> Answer<Vec<Device>> {
    caller.require_enrolled()?;
    let mut query = DeviceQuery::default();
    for (k, v) in query_pairs(&q, &["class", "trait", "min_capacity"])? {
        match k.as_str() {
            "class" => query.class = Some(v),
            "trait" => query.traits.push(v),
            _ => {
                query.min_capacity = Some(v.parse().map_err(|_| {
                    Error::bad_request(
                        codes::BAD_QUERY,
                        format!("min_capacity {v:?} is not a number of bytes"),
                    )
                })?)
            }
        }
    }
    Ok(Json(s.devices(&query).await?))
}

/// Leases a device, by placement or by id; answers the lease and its signed token.
#[utoipa::path(post, path = "/v1/leases", tag = "leases",
    request_body = LeaseRequest,
    responses(
        (status = 201, body = LeaseGrant),
        (status = 400, body = ErrorBody, description = "Not JSON"),
        (status = 404, body = ErrorBody, description = "unknown_device"),
        (status = 409, body = ErrorBody, description = "stale_generation, device_leased, \
            no_device_of_class, too_small, no_device_with_traits, all_leased, providers_unavailable"),
        (status = 422, body = ErrorBody, description = "Unknown field, bad value"),
    ))]
pub async fn create_lease(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    ApiJson(body): ApiJson<LeaseRequest>,
) -> Result<(StatusCode, Json<LeaseGrant>), Error> {
    caller.require_compute_host(&body.compute_host)?;
    Ok((StatusCode::CREATED, Json(s.create_lease(&body).await?)))
}

/// Leases: the live ones (default) or all.
#[utoipa::path(get, path = "/v1/leases", tag = "leases",
    params(("state" = Option<LeaseFilter>, Query, description = "active (default) or all")),
    responses(
        (status = 200, body = Vec<Lease>),
        (status = 400, body = ErrorBody, description = "Unknown or malformed parameter"),
    ))]
pub async fn leases(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> Answer<Vec<Lease>> {
    caller.require_enrolled()?;
    let mut filter = LeaseFilter::Active;
    for (_, v) in query_pairs(&q, &["state"])? {
        filter = match v.as_str() {
            "active" => LeaseFilter::Active,
            "all" => LeaseFilter::All,
            _ => {
                return Err(Error::bad_request(
                    codes::BAD_QUERY,
                    format!("state {v:?} is not active or all"),
                ))
            }
        };
    }
    let mut leases = s.leases(filter).await?;
    leases.retain(|l| caller.sees_lease(&l.compute_host, &l.provider));
    Ok(Json(leases))
}

/// One lease.
#[utoipa::path(get, path = "/v1/leases/{id}", tag = "leases",
    params(("id" = uuid::Uuid, Path, description = "Lease id")),
    responses(
        (status = 200, body = Lease),
        (status = 400, body = ErrorBody, description = "Not a UUID"),
        (status = 404, body = ErrorBody, description = "unknown_lease"),
    ))]
pub async fn lease(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Answer<Lease> {
    let id = parse_uuid("lease id", &segment(id)?)?;
    caller.require_enrolled()?;
    let lease = s.lease(id).await?;
    if !caller.sees_lease(&lease.compute_host, &lease.provider) {
        caller.require_compute_host(&lease.compute_host)?;
    }
    Ok(Json(lease))
}

/// claimed -> bound, at the generation read.
#[utoipa::path(post, path = "/v1/leases/{id}/bind", tag = "leases",
    params(("id" = uuid::Uuid, Path, description = "Lease id")),
    request_body = GenerationBody,
    responses(
        (status = 200, body = Lease),
        (status = 404, body = ErrorBody, description = "unknown_lease"),
        (status = 409, body = ErrorBody, description = "stale_generation, lease_ended, lease_already_bound"),
    ))]
pub async fn bind(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    ApiJson(body): ApiJson<GenerationBody>,
) -> Answer<Lease> {
    let id = parse_uuid("lease id", &segment(id)?)?;
    own_lease(&s, &caller, id).await?;
    Ok(Json(s.bind(id, body.generation).await?))
}

/// Ends a lease at the generation read; its device is free again.
#[utoipa::path(post, path = "/v1/leases/{id}/release", tag = "leases",
    params(("id" = uuid::Uuid, Path, description = "Lease id")),
    request_body = GenerationBody,
    responses(
        (status = 200, body = Lease),
        (status = 404, body = ErrorBody, description = "unknown_lease"),
        (status = 409, body = ErrorBody, description = "stale_generation, lease_ended"),
    ))]
pub async fn release(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    ApiJson(body): ApiJson<GenerationBody>,
) -> Answer<Lease> {
    let id = parse_uuid("lease id", &segment(id)?)?;
    own_lease(&s, &caller, id).await?;
    Ok(Json(s.release(id, body.generation).await?))
}

/// Renews a lease: expiry = now + ttl_ms. Not generation-checked (idempotent).
#[utoipa::path(post, path = "/v1/leases/{id}/heartbeat", tag = "leases",
    params(("id" = uuid::Uuid, Path, description = "Lease id")),
    request_body(content = EmptyBody, description = "Empty, or {}"),
    responses(
        (status = 200, body = Lease),
        (status = 404, body = ErrorBody, description = "unknown_lease"),
        (status = 409, body = ErrorBody, description = "lease_ended: stop using the device"),
    ))]
pub async fn lease_heartbeat(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    OptionalJson(_): OptionalJson<EmptyBody>,
) -> Answer<Lease> {
    let id = parse_uuid("lease id", &segment(id)?)?;
    own_lease(&s, &caller, id).await?;
    Ok(Json(s.renew(id).await?))
}

/// A live migration's handover: a new lease on the destination compute host that takes
/// the device over from this one (its token names this lease as predecessor; the
/// lender hands the device over when this lease's holder lets go). Only the lease's own
/// compute host may ask. This lease stays live until its holder releases it.
#[utoipa::path(post, path = "/v1/leases/{id}/handover", tag = "leases",
    params(("id" = uuid::Uuid, Path, description = "Lease id")),
    request_body = HandoverRequest,
    responses(
        (status = 201, body = LeaseGrant),
        (status = 404, body = ErrorBody, description = "unknown_lease"),
        (status = 409, body = ErrorBody, description = "lease_ended, handover_in_progress"),
    ))]
pub async fn handover(
    State(s): State<PoolService>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    ApiJson(body): ApiJson<HandoverRequest>,
) -> Result<(StatusCode, Json<LeaseGrant>), Error> {
    let id = parse_uuid("lease id", &segment(id)?)?;
    own_lease(&s, &caller, id).await?;
    Ok((StatusCode::CREATED, Json(s.handover(id, &body).await?)))
}

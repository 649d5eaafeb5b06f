//! The middleware in front of every route: it reads the request's signature, checks its
//! time, its nonce and its key, and puts the [`Caller`] in the request's extensions for
//! the route to check. Refusals (401, 403, 429) are logged with the peer's address, at
//! most a few lines a second whatever the rate of requests. The state and the rules it
//! applies are in [`crate::auth`].

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use devlend_fabric::ratelimit::RateLimit;

use super::error::error_response;
use crate::api::codes;
use crate::auth::gate::{unenrolled_may_call, NonceRefusal, MAX_NONCES_PER_KEY, PUBLIC};
use crate::auth::request::{SignedRequest, MAX_SKEW_MS};
use crate::auth::{AuthMode, Caller};
use crate::service::PoolService;
use crate::store::now_ms;

static REFUSED: RateLimit = RateLimit::new(20, Duration::from_secs(1));

fn refuse(status: StatusCode, code: &str, message: String) -> Response {
    error_response(status, code, message)
}

/// The middleware: see the module's documentation.
pub async fn authenticate(State(s): State<PoolService>, req: Request, next: Next) -> Response {
    let gate = s.gate();
    if gate.mode() == AuthMode::Open {
        let mut req = req;
        req.extensions_mut().insert(Caller::Open);
        return next.run(req).await;
    }
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.to_string())
        .unwrap_or_else(|| "-".into());
    let method = req.method().to_string();
    let target = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().map(str::to_string));
    let (caller, req) = match header {
        None => (Caller::Anonymous, req),
        Some(Err(_)) => {
            return log_refusal(
                refuse(
                    StatusCode::UNAUTHORIZED,
                    codes::UNAUTHENTICATED,
                    "the Authorization header is not text".into(),
                ),
                &peer,
                &method,
                &target,
                "-",
            )
        }
        Some(Ok(value)) => {
            let now = u64::try_from(now_ms()).unwrap_or(0);
            let unauthenticated = |message: String, who: &str| {
                log_refusal(
                    refuse(StatusCode::UNAUTHORIZED, codes::UNAUTHENTICATED, message),
                    &peer,
                    &method,
                    &target,
                    who,
                )
            };
            // Header, time and key first: nothing of the body is read for a request that
            // cannot be accepted whatever its body.
            let signed = match SignedRequest::parse(&value) {
                Ok(r) => r,
                Err(e) => return unauthenticated(e.to_string(), "-"),
            };
            let key = signed.key.to_text();
            let principal = match s.store().principal(&key).await {
                Ok(p) => p,
                Err(e) => return axum::response::IntoResponse::into_response(e),
            };
            let path = req.uri().path();
            let public = method == "GET" && PUBLIC.contains(&path);
            if principal.is_none() && !public && !unenrolled_may_call(gate.mode(), &method, path) {
                if let Err(e) = (Caller::Unenrolled { key: key.clone() }).require_enrolled() {
                    let resp = axum::response::IntoResponse::into_response(e);
                    let who = format!("unenrolled key {key}");
                    return log_refusal(resp, &peer, &method, &target, &who);
                }
            }
            let (parts, body) = req.into_parts();
            let bytes = match axum::body::to_bytes(body, crate::http::MAX_BODY_BYTES).await {
                Ok(b) => b,
                Err(_) => {
                    return refuse(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        codes::TOO_LARGE,
                        format!("the body is over {} bytes", crate::http::MAX_BODY_BYTES),
                    )
                }
            };
            if let Err(e) = signed.verify(&method, &target, &bytes, now) {
                return unauthenticated(e.to_string(), &key);
            }
            let caller = match principal {
                Some(p) => {
                    match gate.take_nonce(&key, signed.nonce, signed.ts_ms, now) {
                        Ok(()) => {}
                        Err(NonceRefusal::Seen) => {
                            return unauthenticated(
                                "this request was seen before (nonce reused)".into(),
                                &key,
                            )
                        }
                        Err(NonceRefusal::TooMany) => {
                            return log_refusal(
                                refuse(
                                    StatusCode::TOO_MANY_REQUESTS,
                                    codes::TOO_MANY_REQUESTS,
                                    format!(
                                        "this key sent more than {MAX_NONCES_PER_KEY} requests \
                                         in {} minutes; slow down",
                                        2 * MAX_SKEW_MS / 60_000
                                    ),
                                ),
                                &peer,
                                &method,
                                &target,
                                &key,
                            )
                        }
                    }
                    // A request that changes something is remembered in the database too,
                    // across restarts and pool instances.
                    if method != "GET" {
                        let expires = signed.ts_ms.saturating_add(MAX_SKEW_MS);
                        match s.store().record_nonce(&key, &signed.nonce, expires).await {
                            Ok(true) => {}
                            Ok(false) => {
                                return unauthenticated(
                                    "this request was seen before (nonce reused)".into(),
                                    &key,
                                )
                            }
                            Err(e) => return axum::response::IntoResponse::into_response(e),
                        }
                    }
                    Caller::Principal(p)
                }
                None => Caller::Unenrolled { key },
            };
            (caller, Request::from_parts(parts, Body::from(bytes)))
        }
    };
    // Refused here, before a route reads the body, so that an unsigned or unenrolled
    // caller learns nothing from the body's validation.
    let path = req.uri().path();
    let public = method == "GET" && PUBLIC.contains(&path);
    let early = match &caller {
        Caller::Anonymous if !public => caller.require_enrolled().err(),
        Caller::Unenrolled { .. }
            if !public && !unenrolled_may_call(gate.mode(), &method, path) =>
        {
            caller.require_enrolled().err()
        }
        _ => None,
    };
    let who = match &caller {
        Caller::Principal(p) => format!("{} {} ({})", p.role, p.name, p.public_key),
        Caller::Unenrolled { key } => format!("unenrolled key {key}"),
        _ => "unsigned".into(),
    };
    if let Some(e) = early {
        let resp = axum::response::IntoResponse::into_response(e);
        return log_refusal(resp, &peer, &method, &target, &who);
    }
    let mut req = req;
    req.extensions_mut().insert(caller);
    let resp = next.run(req).await;
    log_refusal(resp, &peer, &method, &target, &who)
}

fn log_refusal(resp: Response, peer: &str, method: &str, target: &str, who: &str) -> Response {
    let status = resp.status();
    if status == StatusCode::UNAUTHORIZED
        || status == StatusCode::FORBIDDEN
        || status == StatusCode::TOO_MANY_REQUESTS
    {
        if let Some(suppressed) = REFUSED.check() {
            tracing::warn!(
                status = status.as_u16(),
                peer = %peer,
                request = %format!("{method} {target}"),
                caller = %who,
                suppressed,
                "pool request refused"
            );
        }
    }
    resp
}

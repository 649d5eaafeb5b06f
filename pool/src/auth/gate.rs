//! The middleware in front of every route: it reads the request's signature, checks its
//! time, its nonce and its key, and puts the [`Caller`] in the request's extensions for
//! the route to check. Refusals (401, 403) are logged with the peer's address, at most
//! a few lines a second whatever the rate of requests.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use devlend_fabric::ratelimit::RateLimit;

use super::request::{SignedRequest, MAX_SKEW_MS};
use super::Caller;
use crate::api::codes;
use crate::http::error::error_response;
use crate::service::PoolService;
use crate::store::now_ms;

/// How the pool treats requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    /// Signed requests by enrolled keys (the default). With `trust_first_use`, a
    /// lender's first registration pins its key to a provider name nobody holds yet.
    Signed {
        /// Pin a new lender's key at its first registration.
        trust_first_use: bool,
    },
    /// `--insecure-open-api`: no authentication at all, as before enrollment existed.
    Open,
}

/// Most nonces remembered; past that, signed requests are refused (503) until old ones
/// expire. Only enrolled keys' requests are remembered.
const MAX_NONCES: usize = 200_000;

/// The gate's state: its mode and the nonces seen within the time window.
#[derive(Debug, Clone)]
pub struct Gate {
    mode: AuthMode,
    nonces: Arc<Mutex<HashMap<[u8; 16], u64>>>,
}

/// The routes anyone may `GET`: the API's description, the metrics, and the public key
/// lease tokens are signed with.
pub const PUBLIC: [&str; 3] = ["/openapi.json", "/metrics", "/v1/signing-key"];

static REFUSED: RateLimit = RateLimit::new(20, Duration::from_secs(1));

impl Gate {
    /// A gate in `mode`.
    pub fn new(mode: AuthMode) -> Gate {
        Gate {
            mode,
            nonces: Arc::default(),
        }
    }

    /// Its mode.
    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    /// Records `nonce` until it can no longer pass the time check; false if it was seen.
    fn fresh_nonce(&self, nonce: [u8; 16], now: u64) -> Result<bool, ()> {
        let mut seen = self.nonces.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.len() >= MAX_NONCES / 2 {
            seen.retain(|_, until| *until > now);
        }
        if seen.len() >= MAX_NONCES {
            return Err(());
        }
        Ok(seen.insert(nonce, now + 2 * MAX_SKEW_MS).is_none())
    }
}

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
            let now = u64::try_from(now_ms()).unwrap_or(0);
            let signed = SignedRequest::parse(&value)
                .and_then(|r| r.verify(&method, &target, &bytes, now).map(|()| r));
            let signed = match signed {
                Ok(r) => r,
                Err(e) => {
                    return log_refusal(
                        refuse(
                            StatusCode::UNAUTHORIZED,
                            codes::UNAUTHENTICATED,
                            e.to_string(),
                        ),
                        &peer,
                        &method,
                        &target,
                        "-",
                    )
                }
            };
            let key = signed.key.to_text();
            let caller = match s.store().principal(&key).await {
                Ok(Some(p)) => {
                    match gate.fresh_nonce(signed.nonce, now) {
                        Ok(true) => {}
                        Ok(false) => {
                            return log_refusal(
                                refuse(
                                    StatusCode::UNAUTHORIZED,
                                    codes::UNAUTHENTICATED,
                                    "this request was seen before (nonce reused)".into(),
                                ),
                                &peer,
                                &method,
                                &target,
                                &key,
                            )
                        }
                        Err(()) => {
                            return refuse(
                                StatusCode::SERVICE_UNAVAILABLE,
                                codes::INTERNAL,
                                "too many signed requests in the last minutes; retry".into(),
                            )
                        }
                    }
                    Caller::Principal(p)
                }
                Ok(None) => Caller::Unenrolled { key },
                Err(e) => return axum::response::IntoResponse::into_response(e),
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
            if !public
                && path != "/v1/join"
                && !(method == "PUT" && path.starts_with("/v1/providers/")) =>
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
    if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nonce_passes_once() {
        let g = Gate::new(AuthMode::Signed {
            trust_first_use: false,
        });
        assert_eq!(g.fresh_nonce([1; 16], 1000), Ok(true));
        assert_eq!(g.fresh_nonce([1; 16], 2000), Ok(false));
        assert_eq!(g.fresh_nonce([2; 16], 2000), Ok(true));
    }
}

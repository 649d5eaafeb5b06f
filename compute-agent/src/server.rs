//! The control API routes (axum) over a unix socket.

use std::path::Path;
use std::sync::Arc;

use std::time::Duration;

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::api::{ApiError, AttachRequest};
use crate::registry::{Registry, RegistryError, VmmError};
use crate::vmm::qemu::{HotplugError, RELEASE_TIMEOUT};

fn error(status: StatusCode, msg: String) -> Response {
    (status, Json(ApiError { error: msg })).into_response()
}

impl IntoResponse for RegistryError {
    fn into_response(self) -> Response {
        let status = match &self {
            RegistryError::BadRequest(_) => StatusCode::BAD_REQUEST,
            RegistryError::Conflict(_) => StatusCode::CONFLICT,
            RegistryError::NotFound(_) => StatusCode::NOT_FOUND,
            RegistryError::Start(devlend_backend::blk::AttachmentError::SocketPath { .. }) => {
                StatusCode::CONFLICT
            }
            RegistryError::Start(_) => StatusCode::BAD_GATEWAY,
            RegistryError::Vmm(VmmError::Qemu(
                HotplugError::IdInUse(_) | HotplugError::NoFreePort,
            )) => StatusCode::CONFLICT,
            RegistryError::Vmm(VmmError::Qemu(HotplugError::NotReleased { .. })) => {
                StatusCode::GATEWAY_TIMEOUT
            }
            RegistryError::Vmm(_) => StatusCode::BAD_GATEWAY,
            RegistryError::Lease(crate::lease::LeaseError::Bad(_)) => StatusCode::BAD_REQUEST,
            RegistryError::Lease(crate::lease::LeaseError::Ended { .. }) => StatusCode::CONFLICT,
            RegistryError::Lease(crate::lease::LeaseError::Pool(_)) => StatusCode::BAD_GATEWAY,
            RegistryError::State(_) => StatusCode::INTERNAL_SERVER_ERROR,
            RegistryError::Cancelled(_) | RegistryError::BadSaved(_) => StatusCode::CONFLICT,
        };
        error(status, self.to_string())
    }
}

/// The API's OpenAPI 3.1 document (`compute-agent/openapi.yaml`).
pub const OPENAPI_YAML: &str = include_str!("../openapi.yaml");

/// `GET /v1/openapi.yaml`: the API's OpenAPI document.
async fn openapi() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/yaml")],
        OPENAPI_YAML,
    )
        .into_response()
}

/// The API router over a registry.
pub fn router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route("/v1/openapi.yaml", get(openapi))
        .route("/v1/attachments", get(list).post(attach))
        .route("/v1/attachments/{id}", get(show).delete(detach))
        .route(
            "/v1/attachments/{id}/handover",
            post(handover).delete(cancel_handover),
        )
        .route("/v1/attachments/{id}/finish", post(finish_handover))
        .with_state(registry)
}

async fn list(State(r): State<Arc<Registry>>) -> Response {
    Json(r.list()).into_response()
}

async fn show(State(r): State<Arc<Registry>>, UrlPath(id): UrlPath<String>) -> Response {
    match r.get(&id) {
        Ok(i) => Json(i).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn attach(
    State(r): State<Arc<Registry>>,
    body: Result<Json<AttachRequest>, JsonRejection>,
) -> Response {
    let req = match body {
        Ok(Json(req)) => req,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    match tokio::task::spawn_blocking(move || r.attach(req)).await {
        Ok(Ok(info)) => (StatusCode::CREATED, Json(info)).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("attach task failed: {e}"),
        ),
    }
}

/// `POST /v1/attachments/{id}/handover`: a handover token for a live migration's
/// destination (`docs/migration.md`).
/// The body is empty, or `{"compute_host": "NAME"}` (under a pool lease).
async fn handover(
    State(r): State<Arc<Registry>>,
    UrlPath(id): UrlPath<String>,
    body: axum::body::Bytes,
) -> Response {
    let req: crate::api::HandoverRequest = if body.iter().all(u8::is_ascii_whitespace) {
        Default::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad handover body: {e}")),
        }
    };
    blocking("handover", move || {
        r.handover(&id, req.compute_host.as_deref(), req.to_key.as_deref())
    })
    .await
}

/// `DELETE /v1/attachments/{id}/handover`: the migration failed or was cancelled.
async fn cancel_handover(State(r): State<Arc<Registry>>, UrlPath(id): UrlPath<String>) -> Response {
    blocking("handover", move || r.cancel_handover(&id)).await
}

/// `POST /v1/attachments/{id}/finish`: the VM migrated away; removes the attachment
/// without unplugging it.
async fn finish_handover(State(r): State<Arc<Registry>>, UrlPath(id): UrlPath<String>) -> Response {
    blocking("handover", move || r.finish_handover(&id)).await
}

/// Runs a registry call that may block (it talks to a lender, a pool or a VMM) off the
/// async runtime, and answers its result as JSON (200) or its error.
async fn blocking<T: serde::Serialize + Send + 'static>(
    what: &str,
    f: impl FnOnce() -> Result<T, RegistryError> + Send + 'static,
) -> Response {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{what} task failed: {e}"),
        ),
    }
}

/// Query of `DELETE /v1/attachments/{id}`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DetachQuery {
    /// Seconds the guest gets to release a live-plugged device (default 30).
    release_timeout_s: Option<u64>,
}

async fn detach(
    State(r): State<Arc<Registry>>,
    UrlPath(id): UrlPath<String>,
    query: Result<Query<DetachQuery>, QueryRejection>,
) -> Response {
    let timeout = match query {
        Ok(Query(q)) => q
            .release_timeout_s
            .map(Duration::from_secs)
            .unwrap_or(RELEASE_TIMEOUT),
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    blocking("detach", move || r.detach(&id, timeout)).await
}

/// What a SIGHUP reloads: the config file is read again and the log level applied.
pub struct Reload {
    /// The command line, applied over the file again.
    pub cli: crate::config::Cli,
    /// The log filter's handle.
    pub log: devlend_daemon::logging::LogHandle,
}

/// Serves the API on `socket` until SIGINT or SIGTERM; then requests in flight complete
/// and, with a state file, the attachments stop but are kept for the next start (VM plugs
/// and leases untouched), or, without one, everything is detached. SIGHUP re-reads the config file and applies the
/// log level (the other keys need a restart). Tells systemd when it is ready, reloading
/// and stopping.
///
/// A stale socket at `socket` is replaced (a live one or any other file is refused);
/// the parent directory is created. The socket is made `0660`. `on_listening` runs once
/// the socket is bound.
///
/// # Errors
/// Binding the socket; the server failing.
pub async fn serve(
    socket: &Path,
    registry: Arc<Registry>,
    reload: Option<Reload>,
    on_listening: Option<Box<dyn FnOnce() + Send>>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::os::unix::fs::PermissionsExt;
    use tokio::signal::unix::{signal, SignalKind};
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    devlend_backend::attachment::prepare_socket_path(socket)
        .map_err(|e| anyhow::anyhow!("cannot use the API socket: {e}"))?;
    let listener = tokio::net::UnixListener::bind(socket)
        .with_context(|| format!("cannot listen on {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("cannot set permissions of {}", socket.display()))?;
    if let Some(f) = on_listening {
        f();
    }
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut hup = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;
    {
        let r = registry.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tick.tick().await;
                r.sample_rates();
            }
        });
    }
    let shutdown = async move {
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
                _ = hup.recv() => {
                    devlend_daemon::notify::reloading();
                    match &reload {
                        Some(r) => match crate::config::Config::load(&r.cli) {
                            Ok(c) => match r.log.set_level(&c.log_level) {
                                Ok(()) => tracing::info!(level = %c.log_level, "configuration reloaded"),
                                Err(e) => tracing::warn!(error = %e, "reload: log level not changed"),
                            },
                            Err(e) => tracing::warn!(error = %e, "reload failed; configuration unchanged"),
                        },
                        None => tracing::info!("nothing to reload"),
                    }
                    devlend_daemon::notify::ready("serving");
                }
            }
        }
        devlend_daemon::notify::stopping();
    };
    tracing::info!(api = %socket.display(), "compute agent ready");
    devlend_daemon::notify::ready(&format!("serving the API on {}", socket.display()));
    axum::serve(listener, router(registry.clone()))
        .with_graceful_shutdown(shutdown)
        .await
        .context("API server failed")?;
    if let Some(state) = registry.state_file() {
        if registry.state_saved() {
            tracing::info!(state = %state.display(), "shutting down: completing requests in flight; attachments are kept for the next start");
        } else {
            tracing::error!(state = %state.display(), "shutting down: the state file could not be written, so the attachments will NOT be served again at the next start");
        }
        tokio::task::spawn_blocking(move || registry.suspend_all())
            .await
            .ok();
    } else {
        tracing::info!("shutting down: detaching everything");
        tokio::task::spawn_blocking(move || registry.detach_all())
            .await
            .ok();
    }
    let _ = std::fs::remove_file(socket);
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The router against its OpenAPI document: every operation the document lists is
    //! routed (no 405, no route-less 404), and the document is served.

    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use tower_service::Service;

    use super::*;

    fn call(method: &Method, path: &str, body: &str) -> (StatusCode, String) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let mut app = router(Arc::new(Registry::default()));
            let req = Request::builder()
                .method(method)
                .uri(path)
                .header("content-type", "application/json")
                .body(Body::from(body.to_owned()))
                .expect("request");
            let resp = app.call(req).await.expect("infallible");
            let status = resp.status();
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .expect("body");
            (status, String::from_utf8_lossy(&bytes).into_owned())
        })
    }

    #[test]
    fn every_documented_operation_is_routed_and_the_document_is_served() {
        let doc: serde_json::Value = serde_norway::from_str(OPENAPI_YAML).expect("YAML");
        let paths = doc["paths"].as_object().expect("paths");
        let mut seen = 0;
        for (path, ops) in paths {
            let path = path.replace("{id}", "no-such-attachment");
            for method in ops.as_object().expect("operations").keys() {
                let m = match method.as_str() {
                    "get" => Method::GET,
                    "post" => Method::POST,
                    "put" => Method::PUT,
                    "delete" => Method::DELETE,
                    "patch" => Method::PATCH,
                    _ => continue, // `parameters`
                };
                let (status, body) = call(&m, &path, "");
                assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{m} {path}");
                // A route-less 404 has an empty body; a handler's is an ApiError.
                if status == StatusCode::NOT_FOUND {
                    let e: crate::api::ApiError = serde_json::from_str(&body)
                        .unwrap_or_else(|_| panic!("{m} {path}: not routed ({body:?})"));
                    assert!(e.error.contains("no-such-attachment"), "{e:?}");
                }
                seen += 1;
            }
        }
        assert_eq!(seen, 8, "the document lists eight operations");
        let (status, body) = call(&Method::GET, "/v1/openapi.yaml", "");
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, OPENAPI_YAML);
        // A path the document does not list is not routed.
        assert_eq!(
            call(&Method::GET, "/v1/nothing", "").0,
            StatusCode::NOT_FOUND
        );
    }
}

//! The pool's accept loop: plain HTTP, or HTTPS with rustls (TLS 1.3 and 1.2, the ring
//! provider), HTTP/1.1 on top by hyper, with limits so that a slow or flooding client
//! costs itself and not the pool.
//!
//! Limits ([`Limits`]):
//! - At most `max_connections` connections at once; one over that is closed at accept,
//!   before any read (the refusal is logged, rate-limited).
//! - At most `max_per_address` of them from one IP address; one over that is closed
//!   at accept the same way, so that one client cannot take every slot.
//! - The TLS handshake must complete within `header_timeout` of the accept, and each
//!   request's headers must arrive within `header_timeout` of the connection being
//!   ready for them (for a kept-alive connection: of the previous answer). A
//!   connection that misses either is closed.
//! - Each request, its body and its handling, must be done within `request_timeout`
//!   of its headers; otherwise it is answered 408 and its connection closed (a client
//!   that sends its body slowly holds a connection that long at most).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tower_service::Service;

use crate::error::Result;

/// How long a connection may take for its TLS handshake, and for each request's
/// headers, by default.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Connections served at once from one IP address by default.
pub const DEFAULT_MAX_PER_ADDRESS: usize = 64;
/// How long a request's body and handling may take by default.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stopping pool waits for requests in flight.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The certificate and key the pool serves HTTPS with (`--tls-cert`, `--tls-key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// What one client may hold of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Time for the TLS handshake, and for each request's headers.
    pub header_timeout: Duration,
    /// Connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// Connections served at once from one IP address; more are closed at accept.
    pub max_per_address: usize,
    /// Time for a request's body and its handling, from its headers; then 408.
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_address: DEFAULT_MAX_PER_ADDRESS,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// Connections open per IP address.
#[derive(Default)]
struct PerAddress(Mutex<HashMap<IpAddr, usize>>);

/// One connection counted against its address; uncounted on drop.
struct AddressSlot {
    table: Arc<PerAddress>,
    ip: IpAddr,
}

impl PerAddress {
    /// Counts a connection from `ip`, unless `max` are open already.
    fn take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<AddressSlot> {
        let mut t = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = t.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(AddressSlot {
            table: Arc::clone(self),
            ip,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut t = self
            .table
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = t.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                t.remove(&self.ip);
            }
        }
    }
}

/// Loads `files` into an acceptor: TLS 1.3 and 1.2, no client certificate, ALPN
/// `http/1.1`.
///
/// # Errors
/// [`Error::Tls`] naming the file and what is wrong with it, or the pair.
pub fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor> {
    use devlend_fabric::tls::{load_certs, load_key, TlsConfigError};
    let certs = load_certs(&files.cert, "certificates")?;
    let key = load_key(&files.key)?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
    .map_err(TlsConfigError::Protocol)?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|source| TlsConfigError::Identity {
        cert: files.cert.clone(),
        key: files.key.clone(),
        source,
    })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `router` on `listener` until `shutdown` resolves, then waits up to 10 s for
/// requests in flight.
///
/// # Errors
/// None so far: accept failures (e.g. out of file descriptors) are logged and retried.
pub async fn run(
    router: Router,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let per_address = Arc::new(PerAddress::default());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    devlend_fabric::limited!(warn, error = %e, "pool: accept failed");
                    // Out of descriptors, most likely: let connections end first.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            devlend_fabric::limited!(
                warn,
                %peer,
                max_connections = limits.max_connections,
                "pool: connection refused: too many connections"
            );
            drop(tcp);
            continue;
        };
        let Some(address_slot) = per_address.take(peer.ip(), limits.max_per_address) else {
            devlend_fabric::limited!(
                warn,
                %peer,
                max_per_address = limits.max_per_address,
                "pool: connection refused: too many connections from this address"
            );
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let router = router.clone();
        let tls = tls.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let _address_slot = address_slot;
            match tls {
                None => serve_connection(tcp, peer, router, limits, watcher).await,
                Some(acceptor) => {
                    match tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            serve_connection(stream, peer, router, limits, watcher).await;
                        }
                        Ok(Err(e)) => devlend_fabric::limited!(
                            info,
                            %peer,
                            error = %e,
                            "pool: TLS handshake failed"
                        ),
                        Err(_) => devlend_fabric::limited!(
                            info,
                            %peer,
                            timeout_s = limits.header_timeout.as_secs_f64(),
                            "pool: connection closed: no TLS handshake in time"
                        ),
                    }
                }
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("pool: requests still in flight after 10 s; stopping anyway");
    }
    Ok(())
}

/// HTTP/1.1 on one connection, with the peer's address for the handlers
/// ([`ConnectInfo`]) and the header timeout.
async fn serve_connection<S>(
    stream: S,
    peer: SocketAddr,
    router: Router,
    limits: Limits,
    watcher: hyper_util::server::graceful::Watcher,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        let mut router = router.clone();
        async move {
            // Both cheap to clone (reference-counted): kept for the timeout's log line.
            let (method, uri) = (req.method().clone(), req.uri().clone());
            match tokio::time::timeout(limits.request_timeout, router.call(req)).await {
                Ok(answer) => answer,
                Err(_) => {
                    devlend_fabric::limited!(
                        info,
                        %peer,
                        %method,
                        %uri,
                        timeout_s = limits.request_timeout.as_secs_f64(),
                        "pool: request not done in time (a slow body?); answered 408, connection closed"
                    );
                    Ok(request_timeout())
                }
            }
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(TokioIo::new(stream), svc);
    if let Err(e) = watcher.watch(conn).await {
        if e.is_timeout() {
            devlend_fabric::limited!(
                info,
                %peer,
                timeout_s = limits.header_timeout.as_secs_f64(),
                "pool: connection closed: no request headers in time"
            );
        } else {
            devlend_fabric::limited!(debug, %peer, error = %e, "pool: connection ended");
        }
    }
}

/// 408, closing the connection (what is left of the body is not read).
fn request_timeout() -> axum::response::Response {
    let body = serde_json::to_vec(&crate::api::ErrorBody {
        code: crate::api::codes::REQUEST_TIMEOUT.into(),
        message: "the request (its body and handling) was not done in time".into(),
    })
    .unwrap_or_default();
    let mut r = axum::response::Response::new(axum::body::Body::from(body));
    *r.status_mut() = hyper::StatusCode::REQUEST_TIMEOUT;
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    h.insert(
        hyper::header::CONNECTION,
        hyper::header::HeaderValue::from_static("close"),
    );
    r
}

/// `http` or `https`, for URLs in logs.
pub fn scheme(tls: bool) -> &'static str {
    if tls {
        "https"
    } else {
        "http"
    }
}

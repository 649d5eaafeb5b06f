//! A blocking HTTP client of the pool, one method per endpoint.
//!
//! `http://` and `https://` pools; for HTTPS the pool's certificate is verified against
//! a CA file ([`PoolClient::with_ca`]) or the system's trust store ([`crate::https`]).
//!
//! Built on `reqwest::blocking`: call it from plain threads, not from inside a tokio
//! runtime (use `spawn_blocking` there).
//!
//! A pool URL may name several servers of one pool, separated by commas; the client
//! fails over between them and corrects for a pool clock minutes away from ours
//! ([`endpoints`]).

mod endpoints;

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::blocking::{Client, RequestBuilder, Response};
use reqwest::{Method, StatusCode, Url};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use std::sync::Arc;

use devlend_fabric::lease_token::TokenSigner;

use crate::api::{
    Device, DeviceQuery, EmptyBody, EnrollRequest, Enrollment, ErrorBody, GenerationBody,
    HandoverRequest, JoinRequest, Lease, LeaseFilter, LeaseGrant, LeaseRequest, Principal,
    Provider, ProviderHeartbeat, ProviderHeartbeatBody, RegisterProvider, SigningKey,
};
use crate::auth::request::{self, SignatureError};
use endpoints::Endpoints;
pub use endpoints::MAX_SERVERS;

/// Seconds a request may take before it fails with [`ClientError::Transport`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long connecting to one pool server may take before the next is tried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long an idle connection to the pool is kept for reuse: under the pool's
/// header timeout (`listen::DEFAULT_HEADER_TIMEOUT`, 10 s), after which it closes it.
const IDLE_REUSE: Duration = Duration::from_secs(4);

/// Why a pool request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The base URL is not an `http://HOST:PORT` or `https://HOST:PORT` URL, or a list
    /// of them separated by commas, of one scheme, at most [`MAX_SERVERS`].
    #[error("bad pool URL {url:?}: expected http://HOST:PORT or https://HOST:PORT, or several of one scheme separated by commas")]
    BadUrl {
        /// The URL given.
        url: String,
    },
    /// A CA file was given for a pool at an `http://` URL, where it would protect
    /// nothing.
    #[error(
        "a pool CA file ({}) was given, but the pool URL {url:?} is not https://",
        ca_file.display()
    )]
    CaWithoutHttps {
        /// The URL given.
        url: String,
        /// The CA file given.
        ca_file: PathBuf,
    },
    /// The TLS configuration (CA file, system trust store) could not be made.
    #[error("cannot set up HTTPS to the pool at {url}")]
    Https {
        /// The URL given.
        url: String,
        /// What failed.
        #[source]
        source: Box<crate::https::HttpsConfigError>,
    },
    /// The TLS handshake with the pool failed: its certificate does not verify, or it
    /// does not speak TLS. Retrying does not help until a configuration changes.
    #[error("TLS with the pool at {url} failed: {reason}")]
    Tls {
        /// The request's URL.
        url: String,
        /// What rustls said, explained.
        reason: String,
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// The pool could not be reached, or did not answer in time.
    #[error("cannot reach the pool at {url}")]
    Transport {
        /// The request's URL.
        url: String,
        /// What failed.
        #[source]
        source: reqwest::Error,
    },
    /// The pool answered with an error (4xx or 5xx) and its JSON error body.
    #[error("pool: {message} ({status} {code})")]
    Api {
        /// The HTTP status.
        status: u16,
        /// The pool's error code (see [`crate::api::codes`]).
        code: String,
        /// The pool's message.
        message: String,
    },
    /// The request could not be signed (no randomness for its nonce).
    #[error("cannot sign the pool request")]
    Sign(#[source] SignatureError),
    /// The answer's body was not what the endpoint documents.
    #[error("pool answered {status} with an unexpected body: {detail}")]
    Decode {
        /// The HTTP status.
        status: u16,
        /// What did not parse.
        detail: String,
    },
}

impl ClientError {
    /// The pool's error code, for [`ClientError::Api`].
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The HTTP status, for [`ClientError::Api`] and [`ClientError::Decode`].
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } | ClientError::Decode { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A client of one pool (one server or several).
#[derive(Debug, Clone)]
pub struct PoolClient {
    servers: Arc<Endpoints>,
    http: Client,
    identity: Option<Arc<TokenSigner>>,
}

impl PoolClient {
    /// A client of the pool at `base_url` (for example `http://127.0.0.1:7400`), with
    /// [`DEFAULT_TIMEOUT`].
    ///
    /// An `https://` pool is verified against the system's trust store; see
    /// [`PoolClient::with_ca`] for a CA file of its own.
    ///
    /// # Errors
    /// [`ClientError::BadUrl`] when `base_url` is not an `http://` or `https://` URL;
    /// [`ClientError::Https`] when the system's trust store cannot be loaded;
    /// [`ClientError::Transport`] when the HTTP client cannot be built.
    pub fn new(base_url: &str) -> Result<Self, ClientError> {
        Self::connect(base_url, DEFAULT_TIMEOUT, None)
    }

    /// Like [`PoolClient::new`] with a request timeout.
    ///
    /// # Errors
    /// As [`PoolClient::new`].
    pub fn with_timeout(base_url: &str, timeout: Duration) -> Result<Self, ClientError> {
        Self::connect(base_url, timeout, None)
    }

    /// Like [`PoolClient::new`], trusting only the CA certificates in `ca_file` (PEM)
    /// for an `https://` pool; `None` is [`PoolClient::new`].
    ///
    /// # Errors
    /// As [`PoolClient::new`]; [`ClientError::Https`] when the CA file is unusable;
    /// [`ClientError::CaWithoutHttps`] for a CA file with an `http://` URL.
    pub fn with_ca(base_url: &str, ca_file: Option<&Path>) -> Result<Self, ClientError> {
        Self::connect(base_url, DEFAULT_TIMEOUT, ca_file)
    }

    /// The general form: a request timeout and an optional CA file.
    ///
    /// # Errors
    /// As [`PoolClient::with_ca`].
    pub fn connect(
        base_url: &str,
        timeout: Duration,
        ca_file: Option<&Path>,
    ) -> Result<Self, ClientError> {
        let (servers, https) =
            Endpoints::parse(base_url).map_err(|b| ClientError::BadUrl { url: b.0 })?;
        if let (false, Some(ca)) = (https, ca_file) {
            return Err(ClientError::CaWithoutHttps {
                url: base_url.to_string(),
                ca_file: ca.to_owned(),
            });
        }
        let tls = if https {
            crate::https::client_config(ca_file)
        } else {
            crate::https::http_only_config()
        }
        .map_err(|source| ClientError::Https {
            url: base_url.to_string(),
            source: Box::new(source),
        })?;
        let http = Client::builder()
            .tls_backend_preconfigured(tls)
            .https_only(https)
            // The pool closes a connection idle for its header timeout (10 s by
            // default): never reuse one that may be closing.
            .pool_idle_timeout(IDLE_REUSE)
            .connect_timeout(CONNECT_TIMEOUT.min(timeout))
            .timeout(timeout)
            .build()
            .map_err(|source| ClientError::Transport {
                url: base_url.to_string(),
                source,
            })?;
        Ok(PoolClient {
            servers,
            http,
            identity: None,
        })
    }

    /// The same client, signing every request with `key` (see
    /// [`crate::auth::request`]): what a pool that is not `--insecure-open-api` needs.
    pub fn with_identity(mut self, key: Arc<TokenSigner>) -> Self {
        self.identity = Some(key);
        self
    }

    /// The key requests are signed with, if any.
    pub fn identity(&self) -> Option<&TokenSigner> {
        self.identity.as_deref()
    }

    /// The base URL of the server asked first now.
    pub fn base_url(&self) -> &Url {
        self.servers.current()
    }

    /// Every server's base URL, in the order given.
    pub fn base_urls(&self) -> &[Url] {
        self.servers.all()
    }

    /// Every server, as a pool URL to give on (comma-separated, without trailing
    /// slashes): what a lease reference keeps, so that its renewals may go to any of
    /// them.
    pub fn pool_url(&self) -> String {
        self.servers
            .all()
            .iter()
            .map(|u| u.as_str().trim_end_matches('/'))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `GET /openapi.json`: the OpenAPI 3 document.
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn openapi(&self) -> Result<serde_json::Value, ClientError> {
        self.call(Method::GET, &["openapi.json"], &[], None::<&EmptyBody>)
    }

    /// `GET /v1/signing-key`: the key lease tokens are signed with.
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn signing_key(&self) -> Result<SigningKey, ClientError> {
        self.call(Method::GET, &["v1", "signing-key"], &[], None::<&EmptyBody>)
    }

    /// `PUT /v1/providers/{name}`: registers a lender and its devices (idempotent).
    ///
    /// # Errors
    /// [`ClientError::Api`] with 422 `invalid_value` for a bad name, class or trait.
    pub fn register_provider(
        &self,
        name: &str,
        body: &RegisterProvider,
    ) -> Result<Provider, ClientError> {
        self.call(Method::PUT, &["v1", "providers", name], &[], Some(body))
    }

    /// `POST /v1/providers/{name}/heartbeat`: keeps the provider available and returns
    /// its live leases.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 404 `unknown_provider` when it is not registered.
    pub fn provider_heartbeat(
        &self,
        name: &str,
        body: &ProviderHeartbeatBody,
    ) -> Result<ProviderHeartbeat, ClientError> {
        self.call(
            Method::POST,
            &["v1", "providers", name, "heartbeat"],
            &[],
            Some(body),
        )
    }

    /// `GET /v1/providers`: every provider with its devices.
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn providers(&self) -> Result<Vec<Provider>, ClientError> {
        self.call(Method::GET, &["v1", "providers"], &[], None::<&EmptyBody>)
    }

    /// `GET /v1/devices`: devices matching `query`.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 400 `bad_query` for a malformed filter.
    pub fn devices(&self, query: &DeviceQuery) -> Result<Vec<Device>, ClientError> {
        let mut q: Vec<(&str, String)> = Vec::new();
        if let Some(c) = &query.class {
            q.push(("class", c.clone()));
        }
        for t in &query.traits {
            q.push(("trait", t.clone()));
        }
        if let Some(m) = query.min_capacity {
            q.push(("min_capacity", m.to_string()));
        }
        self.call(Method::GET, &["v1", "devices"], &q, None::<&EmptyBody>)
    }

    /// `POST /v1/leases`: leases a device by placement or by id, and returns the lease
    /// with its token.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 and a placement code (`all_leased`, ...) when
    /// nothing can be placed, `stale_generation` / `device_leased` by id.
    pub fn create_lease(&self, body: &LeaseRequest) -> Result<LeaseGrant, ClientError> {
        self.call(Method::POST, &["v1", "leases"], &[], Some(body))
    }

    /// `GET /v1/leases`: live leases, or every lease with [`LeaseFilter::All`].
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn leases(&self, filter: LeaseFilter) -> Result<Vec<Lease>, ClientError> {
        let q = [("state", filter.as_str().to_string())];
        self.call(Method::GET, &["v1", "leases"], &q, None::<&EmptyBody>)
    }

    /// `GET /v1/leases/{id}`.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 404 `unknown_lease`.
    pub fn lease(&self, id: Uuid) -> Result<Lease, ClientError> {
        let id = id.to_string();
        self.call(Method::GET, &["v1", "leases", &id], &[], None::<&EmptyBody>)
    }

    /// `POST /v1/leases/{id}/bind`: claimed -> bound.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 `stale_generation`, `lease_ended` or
    /// `lease_already_bound`.
    pub fn bind_lease(&self, id: Uuid, generation: u64) -> Result<Lease, ClientError> {
        let id = id.to_string();
        self.call(
            Method::POST,
            &["v1", "leases", &id, "bind"],
            &[],
            Some(&GenerationBody { generation }),
        )
    }

    /// `POST /v1/leases/{id}/release`: ends the lease and frees its device.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 `stale_generation` or `lease_ended`.
    pub fn release_lease(&self, id: Uuid, generation: u64) -> Result<Lease, ClientError> {
        let id = id.to_string();
        self.call(
            Method::POST,
            &["v1", "leases", &id, "release"],
            &[],
            Some(&GenerationBody { generation }),
        )
    }

    /// Releases the lease at the generation it has now (read first): what a holder
    /// that gives its lease back means. A lease that has already ended is left as is.
    /// Returns the lease as it ends up.
    ///
    /// # Errors
    /// As [`PoolClient::lease`] and [`PoolClient::release_lease`] (a 409
    /// `stale_generation` when someone changed the lease in between).
    pub fn release_current(&self, id: Uuid) -> Result<Lease, ClientError> {
        let lease = self.lease(id)?;
        if !lease.state.is_live() {
            return Ok(lease);
        }
        self.release_lease(id, lease.generation)
    }

    /// `POST /v1/leases/{id}/handover`: a new lease on `compute_host` that takes the
    /// device of lease `id` over (a live migration), and its token.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 `lease_ended` or `handover_in_progress`.
    pub fn handover_lease(&self, id: Uuid, compute_host: &str) -> Result<LeaseGrant, ClientError> {
        let id = id.to_string();
        self.call(
            Method::POST,
            &["v1", "leases", &id, "handover"],
            &[],
            Some(&HandoverRequest {
                compute_host: compute_host.to_owned(),
            }),
        )
    }

    /// `POST /v1/leases/{id}/heartbeat`: renews the lease (expiry = now + ttl_ms).
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 `lease_ended` once released or expired: the
    /// borrower must stop using the device.
    pub fn lease_heartbeat(&self, id: Uuid) -> Result<Lease, ClientError> {
        let id = id.to_string();
        self.call(
            Method::POST,
            &["v1", "leases", &id, "heartbeat"],
            &[],
            Some(&EmptyBody {}),
        )
    }

    /// `POST /v1/join`: enrolls this client's key with a join token.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 403 `bad_join_token`, 401 without an identity.
    pub fn join(&self, token: &str) -> Result<Principal, ClientError> {
        self.call(
            Method::POST,
            &["v1", "join"],
            &[],
            Some(&JoinRequest {
                token: token.to_string(),
            }),
        )
    }

    /// `POST /v1/principals` (admin): pins a key, or issues a join token.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 403 for a caller that is not an admin.
    pub fn enroll(&self, body: &EnrollRequest) -> Result<Enrollment, ClientError> {
        self.call(Method::POST, &["v1", "principals"], &[], Some(body))
    }

    /// `GET /v1/principals` (admin): every enrolled key.
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn principals(&self) -> Result<Vec<Principal>, ClientError> {
        self.call(Method::GET, &["v1", "principals"], &[], None::<&EmptyBody>)
    }

    /// `DELETE /v1/principals/{key}` (admin): revokes a key.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 404 `unknown_key`.
    pub fn revoke(&self, public_key: &str) -> Result<Principal, ClientError> {
        self.call(
            Method::DELETE,
            &["v1", "principals", public_key],
            &[],
            None::<&EmptyBody>,
        )
    }

    fn url(base: &Url, segments: &[&str], query: &[(&str, String)]) -> Url {
        let mut url = base.clone();
        if let Ok(mut p) = url.path_segments_mut() {
            p.pop_if_empty().extend(segments);
        }
        if !query.is_empty() {
            let mut q = url.query_pairs_mut();
            for (k, v) in query {
                q.append_pair(k, v);
            }
        }
        url
    }

    fn call<B: serde::Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| ClientError::Decode {
                status: 0,
                detail: format!("cannot encode the request: {e}"),
            })?,
            None => Vec::new(),
        };
        let mut last = None;
        for (i, base) in self.servers.in_order() {
            let url = Self::url(base, segments, query);
            match self.send(&method, &url, body.is_some(), &bytes) {
                Ok(answer) => {
                    self.servers.answered(i);
                    return answer;
                }
                Err(Sent::Not(e)) => last = Some(e),
                Err(Sent::Maybe(e)) => {
                    self.servers.skip(i);
                    return Err(e);
                }
            }
        }
        Err(last.unwrap_or(ClientError::BadUrl { url: String::new() }))
    }

    /// One request to one server; signed requests refused for a clock the pool found
    /// too far from its own are signed again with the pool's time, once.
    fn send<T: DeserializeOwned>(
        &self,
        method: &Method,
        url: &Url,
        has_body: bool,
        bytes: &[u8],
    ) -> Result<Result<T, ClientError>, Sent> {
        let mut corrected = false;
        loop {
            let (status, date, answer) = self.send_once(method, url, has_body, bytes)?;
            let changed =
                date.is_some_and(|d| self.servers.saw_date(&d, std::time::SystemTime::now()));
            let refused_clock = status == StatusCode::UNAUTHORIZED && self.identity.is_some();
            if refused_clock && changed && !corrected {
                corrected = true;
                continue;
            }
            return Ok(decode(status, &answer));
        }
    }

    fn send_once(
        &self,
        method: &Method,
        url: &Url,
        has_body: bool,
        bytes: &[u8],
    ) -> Result<(StatusCode, Option<String>, Vec<u8>), Sent> {
        let mut req: RequestBuilder = self.http.request(method.clone(), url.clone());
        if let Some(key) = &self.identity {
            let target = match url.query() {
                Some(q) => format!("{}?{q}", url.path()),
                None => url.path().to_string(),
            };
            let value = request::sign(key, method.as_str(), &target, self.servers.now_ms(), bytes)
                .map_err(|e| Sent::Not(ClientError::Sign(e)))?;
            req = req.header(reqwest::header::AUTHORIZATION, value);
        }
        if has_body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(bytes.to_vec());
        }
        let transport = |source: reqwest::Error| match crate::https::tls_failure(&source) {
            Some(reason) => ClientError::Tls {
                url: url.to_string(),
                reason,
                source,
            },
            None => ClientError::Transport {
                url: url.to_string(),
                source,
            },
        };
        let resp: Response = req.send().map_err(|e| {
            // Not connected: the request was never sent, and the next server may take it.
            if e.is_connect() {
                Sent::Not(transport(e))
            } else {
                Sent::Maybe(transport(e))
            }
        })?;
        let status = resp.status();
        let date = resp
            .headers()
            .get(reqwest::header::DATE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = resp.bytes().map_err(|e| Sent::Maybe(transport(e)))?;
        Ok((status, date, body.to_vec()))
    }
}

/// A request that failed: whether the server may have carried it out.
enum Sent {
    /// It never reached the server: the next server may be asked.
    Not(ClientError),
    /// It may have: not sent again.
    Maybe(ClientError),
}

fn decode<T: DeserializeOwned>(status: StatusCode, bytes: &[u8]) -> Result<T, ClientError> {
    if status.is_success() {
        return serde_json::from_slice(bytes).map_err(|e| ClientError::Decode {
            status: status.as_u16(),
            detail: e.to_string(),
        });
    }
    match serde_json::from_slice::<ErrorBody>(bytes) {
        Ok(e) => Err(ClientError::Api {
            status: status.as_u16(),
            code: e.code,
            message: e.message,
        }),
        Err(_) => Err(ClientError::Api {
            status: status.as_u16(),
            code: "http_error".to_string(),
            message: format!(
                "{status}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            ),
        }),
    }
}

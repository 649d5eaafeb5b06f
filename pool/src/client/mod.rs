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
//!
//! Its parts: `calls` holds the method of each endpoint, `transport` how one call goes
//! to the servers (signing, failover, clock correction, decoding the answer).

mod calls;
mod endpoints;
mod transport;

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::blocking::Client;
use reqwest::Url;

use std::sync::Arc;

use devlend_fabric::lease_token::TokenSigner;

use crate::auth::request::SignatureError;
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
}

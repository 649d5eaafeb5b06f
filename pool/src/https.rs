//! The client side of the pool's HTTPS: the rustls configuration every
//! [`crate::PoolClient`] hands to reqwest, and the reading of TLS failures.
//!
//! One TLS stack: rustls with the ring provider, as the fabric. reqwest is built
//! without a provider of its own, so every client of it in devlend gets its
//! configuration from here ([`client_config`], [`http_only_config`]).
//!
//! Trust: with a CA file (`--pool-ca`), the pool's certificate must chain to one of its
//! certificates, and nothing else is trusted. Without one, an `https://` pool is
//! verified against the system's trust store (rustls-platform-verifier, which on Linux
//! reads it with rustls-native-certs: `/etc/ssl/certs` and the like, or `SSL_CERT_FILE`
//! / `SSL_CERT_DIR`). Either way the certificate must be valid now and carry the URL's
//! host (a DNS name, or an IP address as an IP SAN).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore};

/// Why the TLS configuration of a pool client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum HttpsConfigError {
    /// The CA file could not be read or holds no usable CA certificate.
    #[error("cannot use {path} as the pool's CA file")]
    CaFile {
        /// The file given (`--pool-ca`).
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: Box<devlend_fabric::tls::TlsConfigError>,
    },
    /// The system's trust store could not be loaded.
    #[error("cannot load the system's trust store (give --pool-ca instead)")]
    SystemRoots(#[source] rustls::Error),
    /// The provider refuses the protocol versions (never with ring).
    #[error("TLS 1.2 and 1.3 are not available")]
    Protocol(#[source] rustls::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn builder() -> Result<rustls::ConfigBuilder<ClientConfig, rustls::WantsVerifier>, HttpsConfigError>
{
    ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(HttpsConfigError::Protocol)
}

/// The configuration for a pool at an `https://` URL: the pool's certificate must chain
/// to `ca_file` when given, else to the system's trust store. HTTP/1.1 (ALPN).
///
/// # Errors
/// [`HttpsConfigError`] naming the CA file, or the system store.
pub fn client_config(ca_file: Option<&Path>) -> Result<ClientConfig, HttpsConfigError> {
    let mut config = match ca_file {
        Some(path) => {
            let roots = devlend_fabric::tls::load_roots(path).map_err(|source| {
                HttpsConfigError::CaFile {
                    path: path.to_owned(),
                    source: Box::new(source),
                }
            })?;
            builder()?.with_root_certificates(roots)
        }
        None => {
            let verifier = rustls_platform_verifier::Verifier::new(provider())
                .map_err(HttpsConfigError::SystemRoots)?;
            builder()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(verifier))
        }
    }
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// A configuration that trusts no certificate: for reqwest clients that only ever
/// speak plain HTTP (a pool at `http://`, unix sockets), so that building them needs
/// no process-wide crypto provider. An `https://` URL fails verification with it.
///
/// # Errors
/// [`HttpsConfigError::Protocol`] (never with ring).
pub fn http_only_config() -> Result<ClientConfig, HttpsConfigError> {
    Ok(builder()?
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth())
}

/// A blocking reqwest builder with [`http_only_config`]: the start of every reqwest
/// client in devlend that is not a [`crate::PoolClient`]. Should that configuration be
/// unavailable, its `build()` fails (reqwest refuses an unknown TLS backend) rather
/// than panicking.
pub fn http_only_builder() -> reqwest::blocking::ClientBuilder {
    let b = reqwest::blocking::Client::builder();
    match http_only_config() {
        Ok(config) => b.tls_backend_preconfigured(config),
        Err(_) => b.tls_backend_preconfigured(()),
    }
}

/// The TLS failure inside a reqwest error, if it is one, as a sentence: what a
/// certificate error from the pool looks like to the operator.
pub fn tls_failure(e: &reqwest::Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(explain(t));
        }
        // An io::Error's source() skips the error it wraps: step into it instead.
        cur = match err.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|i| i as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    None
}

fn explain(e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    use rustls::Error as E;
    let hint = match e {
        E::InvalidCertificate(C::UnknownIssuer) => {
            "the pool's certificate is not signed by a trusted CA (check --pool-ca)"
        }
        E::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => {
            "the pool's certificate does not name the host of the pool URL"
        }
        E::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
            "the pool's certificate has expired"
        }
        E::InvalidCertificate(_) => "the pool's certificate does not verify",
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => {
            "the pool does not speak TLS (is it served with --tls-cert?)"
        }
        _ => "the TLS handshake with the pool failed",
    };
    format!("{hint}: {e}")
}

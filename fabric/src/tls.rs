//! TLS 1.3 (RFC 8446) for the TCP transport, in userspace (rustls, ring provider),
//! bridged to the unchanged engines by a pump.
//!
//! # Shape
//!
//! ```text
//! engine ⇄ [UnixStream, plaintext] ⇄ pump thread ⇄ rustls ⇄ [TcpStream, TLS records] ⇄ peer
//! ```
//!
//! After the TCP connect (borrower) or accept (lender), the TLS handshake runs on the
//! TCP socket, blocking, under the caller's socket timeouts ([`client_handshake`],
//! [`server_handshake`]). Then [`spawn_pump`] creates a `socketpair(AF_UNIX,
//! SOCK_STREAM)`, hands one end to the caller as the connection (a plain
//! `UnixStream`, which the connection layer above wraps for the engines) and moves
//! bytes between the other end and the TLS
//! session on a thread of its own, for the connection's lifetime. The engines keep
//! doing their raw `writev`/`recvmsg`, io_uring and `sendfile` on a plaintext fd; the
//! devlend hello and everything after it ride inside TLS (`docs/protocol.md`).
//!
//! TCP options (`TCP_NODELAY`, keepalive, `TCP_USER_TIMEOUT`) stay on the TCP socket,
//! which the pump owns; the caller sets them before the handshake.
//!
//! # Ends
//!
//! A lost TLS or TCP connection looks to the engine like a lost TCP connection: the
//! pump closes its end of the pair, and the engine reads end of stream (writes fail
//! with `EPIPE`). A TLS `close_notify` from the peer becomes a shut write side of the
//! pair (the engine reads EOF, and may still answer); the engine shutting its write
//! side (or closing) becomes a `close_notify` and a TCP `FIN` to the peer. A TLS error
//! mid-session (a record that does not authenticate, a protocol violation) is logged at
//! warn and ends the connection the same way.
//!
//! # Cost
//!
//! Per direction: two extra copies (rustls's plaintext buffer ⇄ the pump's buffer, and
//! the pump's buffer ⇄ the socket pair), a thread hop (the engine and the pump wake each
//! other through the socket pair), plus AES-GCM or ChaCha20-Poly1305. One pump thread
//! per connection, so per virtqueue. `docs/performance.md` has the measured ratio.
//!
//! # Authentication
//!
//! The borrower verifies the lender's certificate chain against its trust anchors and
//! the name it expects ([`TlsTarget::server_name`], by default the host part of the
//! lender address; an IP address matches an IP SAN). A lender with a client CA
//! ([`ServerTls::load`]) requires and verifies a client certificate: mutual TLS. No
//! session resumption: every connection runs a full handshake and verifies again.

use std::io;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{AlertDescription, CertificateError, ClientConfig, RootCertStore, ServerConfig};

mod pump;
pub use pump::spawn_pump;

/// Why TLS configuration (certificates, keys, trust anchors) could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    /// A PEM file could not be read or parsed.
    #[error("cannot read {what} from {path}")]
    Pem {
        /// What the file should hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The reader's error.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A PEM file holds no item of the expected kind.
    #[error("{path} holds no {what}")]
    Empty {
        /// What the file should hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// A CA certificate was refused as a trust anchor.
    #[error("{path}: a certificate is not a usable trust anchor")]
    Anchor {
        /// The CA file.
        path: PathBuf,
        /// The verifier's reason.
        #[source]
        source: rustls::Error,
    },
    /// The client certificate verifier could not be built from the client CA.
    #[error("cannot verify client certificates with {path}")]
    ClientVerifier {
        /// The client CA file.
        path: PathBuf,
        /// The reason.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    /// The certificate and key do not make a usable identity (e.g. they do not match,
    /// or the key type is not supported).
    #[error("certificate {cert} and key {key} cannot be used")]
    Identity {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason.
        #[source]
        source: rustls::Error,
    },
    /// The crypto provider refuses TLS 1.3 (never with ring; kept for completeness).
    #[error("TLS 1.3 is not available")]
    Protocol(#[source] rustls::Error),
}

/// Why a TLS session could not be established on a connection.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The TLS handshake was refused by this side or by the peer: a certificate that
    /// does not verify, a name that does not match, a missing client certificate, a
    /// peer that does not speak TLS 1.3. Retrying does not help.
    #[error("{hint}")]
    Refused {
        /// What it means, in devlend's terms.
        hint: &'static str,
        /// rustls's error (for an alert from the peer: the alert).
        #[source]
        source: rustls::Error,
    },
    /// The connection failed during the handshake (closed, reset, timed out). May be
    /// transient.
    #[error("{hint}")]
    Io {
        /// What it means.
        hint: &'static str,
        /// The socket error.
        #[source]
        source: io::Error,
    },
    /// The name to verify the lender's certificate against is neither a DNS name nor an
    /// IP address.
    #[error("{0:?} is not a valid TLS server name (a DNS name or an IP address)")]
    ServerName(String),
    /// The peer closed the connection before sending a byte (lender side only; e.g. a
    /// port probe).
    #[error("the peer closed the connection before its TLS hello")]
    ClosedEarly,
    /// The peer sent a plaintext devlend hello where a TLS ClientHello was expected
    /// (lender side only): the borrower is not configured for TLS.
    #[error("the peer sent a plaintext devlend hello, but this lender requires TLS")]
    Plaintext,
}

impl TlsError {
    /// Whether retrying the same connection cannot succeed until a configuration
    /// changes (certificates, trust anchors, names); the other failures are those of the
    /// connection.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            TlsError::Refused { .. } | TlsError::ServerName(_) | TlsError::Plaintext
        )
    }

    fn from_io(e: io::Error, eof_hint: &'static str) -> TlsError {
        let inner = e
            .get_ref()
            .and_then(|i| i.downcast_ref::<rustls::Error>())
            .cloned();
        match inner {
            Some(source) => TlsError::Refused {
                hint: explain(&source),
                source,
            },
            None => TlsError::Io {
                hint: match e.kind() {
                    io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::BrokenPipe => eof_hint,
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        "the TLS handshake timed out"
                    }
                    _ => "the connection failed during the TLS handshake",
                },
                source: e,
            },
        }
    }
}

/// A short explanation of a handshake failure.
fn explain(e: &rustls::Error) -> &'static str {
    use rustls::Error as E;
    match e {
        E::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => {
                "the peer's certificate is not signed by a trusted CA (check --tls-ca / --tls-client-ca)"
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                "the lender's certificate is not valid for the expected server name (check --tls-server-name)"
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "the peer's certificate has expired"
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "the peer's certificate is not valid yet"
            }
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
                "the peer's certificate is not meant for this use (TLS server or client)"
            }
            _ => "the peer's certificate does not verify",
        },
        E::NoCertificatesPresented => "the peer presented no certificate (a client certificate is required)",
        E::AlertReceived(a) => match a {
            AlertDescription::UnknownCA | AlertDescription::BadCertificate => {
                "the peer does not trust this side's certificate"
            }
            AlertDescription::CertificateRequired => {
                "the lender requires a client certificate (give the compute agent --tls-cert and --tls-key)"
            }
            AlertDescription::ProtocolVersion => "the peer does not speak TLS 1.3",
            _ => "the peer aborted the TLS handshake",
        },
        E::InvalidMessage(_)
        | E::InappropriateMessage { .. }
        | E::InappropriateHandshakeMessage { .. } => {
            "the peer does not speak TLS (is TLS configured on both sides?)"
        }
        E::PeerIncompatible(_) => "the peer's TLS is incompatible (TLS 1.3 is required)",
        _ => "the TLS handshake failed",
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a PEM certificate chain (leaf first) or a bundle of CA certificates from
/// `path`; `what` names its content in errors. Also the loader of devlend-pool's HTTPS.
///
/// # Errors
/// [`TlsConfigError::Pem`] (unreadable, bad PEM), [`TlsConfigError::Empty`].
pub fn load_certs(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let pem = |source| TlsConfigError::Pem {
        what,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsConfigError::Empty {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// Reads a PEM private key (PKCS#8, PKCS#1 or SEC1) from `path`.
///
/// # Errors
/// [`TlsConfigError::Pem`], [`TlsConfigError::Empty`].
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| match source {
        rustls::pki_types::pem::Error::NoItemsFound => TlsConfigError::Empty {
            what: "private key",
            path: path.to_owned(),
        },
        source => TlsConfigError::Pem {
            what: "a private key",
            path: path.to_owned(),
            source,
        },
    })
}

/// Reads trust anchors (PEM, one or more CA certificates) from `path`.
///
/// # Errors
/// As [`load_certs`]; [`TlsConfigError::Anchor`] for a certificate that cannot anchor.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsConfigError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path, "CA certificates")? {
        roots.add(c).map_err(|source| TlsConfigError::Anchor {
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(roots)
}

/// A borrower's TLS configuration: the CAs it trusts for lenders, and optionally its
/// own certificate for lenders that require one. Cheap to clone (shared).
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientTls")
    }
}

impl ClientTls {
    /// Reads the trust anchors from `ca` (PEM, one or more certificates) and, with
    /// `identity = Some((cert, key))`, the client certificate chain (PEM, leaf first)
    /// and its private key (PEM: PKCS#8, PKCS#1 or SEC1). TLS 1.3 only.
    ///
    /// # Errors
    /// [`TlsConfigError`] naming the file and what is wrong with it.
    pub fn load(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<ClientTls, TlsConfigError> {
        let roots = load_roots(ca)?;
        let builder = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(TlsConfigError::Protocol)?
            .with_root_certificates(roots);
        let mut config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => builder
                .with_client_auth_cert(load_certs(cert, "certificates")?, load_key(key)?)
                .map_err(|source| TlsConfigError::Identity {
                    cert: cert.to_owned(),
                    key: key.to_owned(),
                    source,
                })?,
        };
        config.resumption = rustls::client::Resumption::disabled();
        Ok(ClientTls {
            config: Arc::new(config),
        })
    }
}

/// What a borrower needs to open TLS sessions to one lender: its configuration and the
/// name the lender's certificate must carry.
#[derive(Debug, Clone)]
pub struct TlsTarget {
    /// Trust anchors and client identity.
    pub client: ClientTls,
    /// DNS name or IP address to verify the lender's certificate against.
    pub server_name: String,
}

impl PartialEq for TlsTarget {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.client.config, &other.client.config)
            && self.server_name == other.server_name
    }
}

impl Eq for TlsTarget {}

impl TlsTarget {
    /// A target for the lender at `addr` (`HOST:PORT`), verified against `server_name`,
    /// or by default against the host part of `addr` (brackets of an IPv6 literal
    /// removed).
    ///
    /// # Errors
    /// [`TlsError::ServerName`] if the name is neither a DNS name nor an IP address.
    pub fn new(
        client: ClientTls,
        addr: &str,
        server_name: Option<&str>,
    ) -> Result<TlsTarget, TlsError> {
        let name = server_name.map_or_else(|| host_of(addr).to_owned(), str::to_owned);
        ServerName::try_from(name.clone()).map_err(|_| TlsError::ServerName(name.clone()))?;
        Ok(TlsTarget {
            client,
            server_name: name,
        })
    }
}

/// The host part of `HOST:PORT` (`[V6]:PORT` → `V6`; no port → all of it).
pub fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split_once(']').map_or(rest, |(h, _)| h);
    }
    match addr.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => addr,
    }
}

/// A lender's TLS configuration: its certificate and key, and optionally the CA its
/// borrowers' client certificates must be signed by. Cheap to clone (shared).
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    mutual: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mutual", &self.mutual)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads the certificate chain `cert` (PEM, leaf first) and its private key `key`
    /// (PEM); with `client_ca`, client certificates are required and verified against
    /// it (mutual TLS). TLS 1.3 only, no session tickets.
    ///
    /// # Errors
    /// [`TlsConfigError`] naming the file and what is wrong with it.
    pub fn load(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<ServerTls, TlsConfigError> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(TlsConfigError::Protocol)?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(load_roots(ca)?),
                    provider(),
                )
                .build()
                .map_err(|source| TlsConfigError::ClientVerifier {
                    path: ca.to_owned(),
                    source,
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(load_certs(cert, "certificates")?, load_key(key)?)
            .map_err(|source| TlsConfigError::Identity {
                cert: cert.to_owned(),
                key: key.to_owned(),
                source,
            })?;
        config.send_tls13_tickets = 0;
        Ok(ServerTls {
            config: Arc::new(config),
            mutual: client_ca.is_some(),
        })
    }

    /// Whether borrowers must present a client certificate.
    pub fn requires_client_cert(&self) -> bool {
        self.mutual
    }
}

/// Runs the borrower's side of the TLS handshake on `tcp` (blocking, under `tcp`'s read
/// and write timeouts). The connection is ready for the devlend hello when it returns.
///
/// In TLS 1.3 the client finishes its handshake before the server has checked the
/// client's certificate: a lender that refuses it is heard at the first read (an
/// alert), which `TlsError::from_io` turns into [`TlsError::Refused`] too.
///
/// # Errors
/// [`TlsError::Refused`] (verification, alert), [`TlsError::Io`] (the connection
/// failed), [`TlsError::ServerName`].
pub fn client_handshake(
    target: &TlsTarget,
    tcp: &mut TcpStream,
) -> Result<rustls::ClientConnection, TlsError> {
    let name = ServerName::try_from(target.server_name.clone())
        .map_err(|_| TlsError::ServerName(target.server_name.clone()))?;
    let mut conn = rustls::ClientConnection::new(Arc::clone(&target.client.config), name).map_err(
        |source| TlsError::Refused {
            hint: explain(&source),
            source,
        },
    )?;
    while conn.is_handshaking() {
        conn.complete_io(tcp).map_err(|e| {
            TlsError::from_io(
                e,
                "the lender closed the connection during the TLS handshake (is TLS configured on it?)",
            )
        })?;
    }
    Ok(conn)
}

/// Maps an error of reading or writing inside an established TLS session (e.g. the
/// devlend hello) to a [`TlsError`], if it comes from TLS (an alert, a bad record).
pub fn session_error(e: &io::Error) -> Option<TlsError> {
    let inner = e.get_ref()?.downcast_ref::<rustls::Error>()?.clone();
    Some(TlsError::Refused {
        hint: explain(&inner),
        source: inner,
    })
}

/// Runs the lender's side of the TLS handshake on `tcp` (blocking, under `tcp`'s read
/// and write timeouts), verifying the client certificate if the configuration asks for
/// one. A connection that starts with a plaintext devlend hello (`"DVLD"`) is told
/// apart: [`TlsError::Plaintext`], and nothing of it has been consumed, so the caller
/// can answer it in plaintext.
///
/// # Errors
/// [`TlsError::Plaintext`], [`TlsError::Refused`] (the client's certificate does not
/// verify, the client refused ours, not TLS), [`TlsError::Io`].
pub fn server_handshake(
    tls: &ServerTls,
    tcp: &mut TcpStream,
) -> Result<rustls::ServerConnection, TlsError> {
    let mut first = [0u8; 4];
    let n = loop {
        match tcp.peek(&mut first) {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(TlsError::from_io(
                    e,
                    "the peer closed the connection before its TLS hello",
                ))
            }
        }
    };
    if n == 0 {
        return Err(TlsError::ClosedEarly);
    }
    if first[..n] == crate::handshake::MAGIC[..n] {
        return Err(TlsError::Plaintext);
    }
    let mut conn = rustls::ServerConnection::new(Arc::clone(&tls.config)).map_err(|source| {
        TlsError::Refused {
            hint: explain(&source),
            source,
        }
    })?;
    while conn.is_handshaking() {
        conn.complete_io(tcp).map_err(|e| {
            TlsError::from_io(e, "the peer closed the connection during the TLS handshake")
        })?;
    }
    Ok(conn)
}

#[cfg(test)]
mod tests;

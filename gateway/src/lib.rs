//! `devlend-gateway`: a cluster's gateway for lending across clusters.
//!
//! A borrower whose lender is in another cluster opens each fabric session to its
//! cluster's gateway with a relay preamble ([`devlend_fabric::relay`]) naming the
//! destination cluster and lender. The gateway either connects the lender itself (its
//! own cluster, lenders named in its configuration) or forwards the session, as a
//! stream of the multiplexed TLS link ([`mux`]) to the destination cluster's gateway,
//! which does the same. After the preamble's reply the session is a byte pipe: the
//! devlend handshake and everything after it run end to end, unparsed by the gateways.
//!
//! - [`config`]: the TOML file;
//! - [`mux`]: the gateway-to-gateway link (framing, per-session credit, pings);
//! - [`peers`]: dialling peers with backoff, accepting them, TLS;
//! - [`relay`]: routing one session and splicing its two ends;
//! - [`status`]: the counters `devlend gateway status` shows;
//! - [`metrics`]: the same as Prometheus metrics.
//!
//! The design, the wire formats and the window arithmetic are in `docs/gateway.md`.

pub mod config;
pub mod metrics;
pub mod mux;
pub mod peers;
pub mod relay;
pub mod status;

use std::sync::atomic::{AtomicI64, AtomicU64};

/// Counters of the sessions borrowers of this cluster opened on the local listener.
#[derive(Debug, Default)]
pub struct LocalStats {
    /// Sessions accepted.
    pub sessions_total: AtomicU64,
    /// Sessions open now.
    pub sessions_active: AtomicI64,
    /// Sessions refused (unknown cluster or lender, unreachable, TTL, bad preamble).
    pub refused: AtomicU64,
    /// Bytes from borrowers.
    pub bytes_in: AtomicU64,
    /// Bytes to borrowers.
    pub bytes_out: AtomicU64,
}

/// What every part of a running gateway shares.
pub struct Gateway {
    /// The configuration.
    pub config: config::Config,
    /// TLS towards peer gateways (trust anchors and this gateway's certificate).
    pub client_tls: devlend_fabric::tls::ClientTls,
    /// TLS for peers that connect (certificate, and the CA their certificates need).
    pub server_tls: devlend_fabric::tls::ServerTls,
    /// The peer gateways of the routing table, and the links peers opened here.
    pub peers: peers::Peers,
    /// Sessions of this cluster's borrowers.
    pub local: LocalStats,
    /// When the gateway started.
    pub started: std::time::Instant,
}

impl Gateway {
    /// A gateway for `config`, loading its TLS files.
    ///
    /// # Errors
    /// A TLS file that cannot be loaded (named in the error).
    pub fn new(config: config::Config) -> Result<Gateway, devlend_fabric::tls::TlsConfigError> {
        let server_tls = devlend_fabric::tls::ServerTls::load(
            &config.tls_cert,
            &config.tls_key,
            Some(&config.tls_ca),
        )?;
        let client_tls = devlend_fabric::tls::ClientTls::load(
            &config.tls_ca,
            Some((&config.tls_cert, &config.tls_key)),
        )?;
        let peers = peers::Peers::new(&config);
        Ok(Gateway {
            config,
            client_tls,
            server_tls,
            peers,
            local: LocalStats::default(),
            started: std::time::Instant::now(),
        })
    }
}

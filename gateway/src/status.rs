//! What `devlend gateway status` shows: `GET /v1/status` on the control address, JSON.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::mux::Link;
use crate::Gateway;

/// The gateway's state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Status {
    /// Its cluster.
    pub cluster: String,
    /// Seconds since it started.
    pub uptime_s: u64,
    /// Sessions of this cluster's borrowers.
    pub local: LocalStatus,
    /// The peers of the routing table (links this gateway dials).
    pub peers: Vec<PeerStatus>,
    /// Links peer gateways opened to this one.
    pub inbound: Vec<InboundStatus>,
}

/// Sessions from this cluster's borrowers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LocalStatus {
    /// Sessions accepted.
    pub sessions_total: u64,
    /// Open now.
    pub sessions_active: u64,
    /// Refused (routing errors, malformed preambles).
    pub refused: u64,
    /// Bytes from borrowers.
    pub bytes_in: u64,
    /// Bytes to borrowers.
    pub bytes_out: u64,
}

/// A peer gateway of the routing table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PeerStatus {
    /// Clusters routed to it.
    pub clusters: Vec<String>,
    /// Its address.
    pub addr: String,
    /// Whether the link is up.
    pub connected: bool,
    /// Last round-trip time measured on the link (PING/PONG through the link's queue),
    /// microseconds; `None` when down or not measured yet.
    pub rtt_us: Option<u64>,
    /// Links established since start (1 + rejoins).
    pub connects: u64,
    /// Sessions relayed to it since start.
    pub sessions_total: u64,
    /// Sessions open on the link now.
    pub sessions_active: u64,
    /// Session bytes sent to it since start.
    pub bytes_sent: u64,
    /// Session bytes received from it since start.
    pub bytes_received: u64,
    /// Why the link is down, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A link a peer opened here.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct InboundStatus {
    /// The peer's cluster (from its link HELLO).
    pub cluster: String,
    /// Its address.
    pub remote: String,
    /// Sessions it relayed here over this link.
    pub sessions_total: u64,
    /// Open now.
    pub sessions_active: u64,
    /// Bytes sent to it.
    pub bytes_sent: u64,
    /// Bytes received from it.
    pub bytes_received: u64,
}

fn g(a: &std::sync::atomic::AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

fn active(l: &Link) -> u64 {
    l.stats.sessions_active.load(Ordering::Relaxed).max(0) as u64
}

/// A snapshot of `gw`.
pub fn snapshot(gw: &Arc<Gateway>) -> Status {
    let l = &gw.local;
    let peers = gw
        .peers
        .slots
        .iter()
        .map(|s| {
            let link = s.current();
            let cur = |f: fn(&Link) -> u64| link.as_deref().map_or(0, f);
            PeerStatus {
                clusters: s.clusters.clone(),
                addr: s.addr.clone(),
                connected: link.is_some(),
                rtt_us: link.as_ref().map(|l| g(&l.stats.rtt_us)).filter(|r| *r > 0),
                connects: g(&s.connects),
                sessions_total: g(&s.past[2]) + cur(|l| g(&l.stats.sessions_total)),
                sessions_active: cur(active),
                bytes_sent: g(&s.past[0]) + cur(|l| g(&l.stats.bytes_sent)),
                bytes_received: g(&s.past[1]) + cur(|l| g(&l.stats.bytes_received)),
                last_error: if link.is_some() {
                    None
                } else {
                    Some(s.last_error())
                },
            }
        })
        .collect();
    let inbound = gw
        .peers
        .inbound
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|i| InboundStatus {
            cluster: i.link.peer_cluster.clone(),
            remote: i.remote.to_string(),
            sessions_total: g(&i.link.stats.sessions_total),
            sessions_active: active(&i.link),
            bytes_sent: g(&i.link.stats.bytes_sent),
            bytes_received: g(&i.link.stats.bytes_received),
        })
        .collect();
    Status {
        cluster: gw.config.cluster.clone(),
        uptime_s: gw.started.elapsed().as_secs(),
        local: LocalStatus {
            sessions_total: g(&l.sessions_total),
            sessions_active: l.sessions_active.load(Ordering::Relaxed).max(0) as u64,
            refused: g(&l.refused),
            bytes_in: g(&l.bytes_in),
            bytes_out: g(&l.bytes_out),
        },
        peers,
        inbound,
    }
}

/// Serves `GET /v1/status` on `listener`. Runs until the listener fails.
///
/// # Errors
/// The server's I/O error.
pub async fn serve(gw: Arc<Gateway>, listener: tokio::net::TcpListener) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/v1/status",
        axum::routing::get(move || {
            let gw = gw.clone();
            async move { axum::Json(snapshot(&gw)) }
        }),
    );
    axum::serve(listener, app).await
}

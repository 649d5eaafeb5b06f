//! The gateway's Prometheus metrics (`metrics_listen`), read from
//! [`crate::status::snapshot`] at scrape time.
//!
//! Per peer of the routing table (label `peer`, its address):
//! `devlend_gateway_peer_up`, `devlend_gateway_peer_rtt_microseconds`,
//! `devlend_gateway_peer_sessions`, `devlend_gateway_peer_sessions_opened_total`,
//! `devlend_gateway_peer_bytes_total{direction="sent"|"received"}`,
//! `devlend_gateway_peer_connects_total`; per inbound link (labels `peer_cluster`,
//! `remote`): `devlend_gateway_inbound_sessions`,
//! `devlend_gateway_inbound_bytes_total{direction}`; and for this cluster's borrowers:
//! `devlend_gateway_local_sessions`, `devlend_gateway_local_sessions_opened_total`,
//! `devlend_gateway_local_refused_total`, `devlend_gateway_local_bytes_total{direction="in"|"out"}`.

use std::sync::Arc;

use devlend_daemon::metrics::{counter, gauge, Collector, DescriptorEncoder, Labels};

use crate::Gateway;

/// Reads a gateway at each scrape.
pub struct GatewayMetrics(pub Arc<Gateway>);

impl std::fmt::Debug for GatewayMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GatewayMetrics")
    }
}

fn l(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

impl Collector for GatewayMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = crate::status::snapshot(&self.0);
        let peer = |p: &crate::status::PeerStatus| p.addr.clone();
        let up: Vec<_> = s
            .peers
            .iter()
            .map(|p| (l(&[("peer", &peer(p))]), i64::from(p.connected)))
            .collect();
        gauge(
            &mut enc,
            "devlend_gateway_peer_up",
            "1 while the link to the peer gateway is up.",
            &up,
        )?;
        let rtt: Vec<_> = s
            .peers
            .iter()
            .filter_map(|p| p.rtt_us.map(|r| (l(&[("peer", &peer(p))]), r as i64)))
            .collect();
        gauge(
            &mut enc,
            "devlend_gateway_peer_rtt_microseconds",
            "Last round-trip time measured on the link (PING/PONG).",
            &rtt,
        )?;
        let active: Vec<_> = s
            .peers
            .iter()
            .map(|p| (l(&[("peer", &peer(p))]), p.sessions_active as i64))
            .collect();
        gauge(
            &mut enc,
            "devlend_gateway_peer_sessions",
            "Sessions open on the link.",
            &active,
        )?;
        let opened: Vec<_> = s
            .peers
            .iter()
            .map(|p| (l(&[("peer", &peer(p))]), p.sessions_total))
            .collect();
        counter(
            &mut enc,
            "devlend_gateway_peer_sessions_opened",
            "Sessions relayed to the peer.",
            &opened,
        )?;
        let mut bytes = Vec::new();
        for p in &s.peers {
            bytes.push((
                l(&[("peer", &peer(p)), ("direction", "sent")]),
                p.bytes_sent,
            ));
            bytes.push((
                l(&[("peer", &peer(p)), ("direction", "received")]),
                p.bytes_received,
            ));
        }
        counter(
            &mut enc,
            "devlend_gateway_peer_bytes",
            "Session bytes on the link.",
            &bytes,
        )?;
        let connects: Vec<_> = s
            .peers
            .iter()
            .map(|p| (l(&[("peer", &peer(p))]), p.connects))
            .collect();
        counter(
            &mut enc,
            "devlend_gateway_peer_connects",
            "Links to the peer established (1 + rejoins).",
            &connects,
        )?;
        let mut in_sessions = Vec::new();
        let mut in_bytes = Vec::new();
        for i in &s.inbound {
            let base = [
                ("peer_cluster", i.cluster.as_str()),
                ("remote", i.remote.as_str()),
            ];
            in_sessions.push((l(&base), i.sessions_active as i64));
            in_bytes.push((l(&[base[0], base[1], ("direction", "sent")]), i.bytes_sent));
            in_bytes.push((
                l(&[base[0], base[1], ("direction", "received")]),
                i.bytes_received,
            ));
        }
        gauge(
            &mut enc,
            "devlend_gateway_inbound_sessions",
            "Sessions open on links peers opened here.",
            &in_sessions,
        )?;
        counter(
            &mut enc,
            "devlend_gateway_inbound_bytes",
            "Session bytes on links peers opened here.",
            &in_bytes,
        )?;
        let lo = &s.local;
        gauge(
            &mut enc,
            "devlend_gateway_local_sessions",
            "Sessions of this cluster's borrowers open now.",
            &[(Vec::new(), lo.sessions_active as i64)],
        )?;
        counter(
            &mut enc,
            "devlend_gateway_local_sessions_opened",
            "Sessions of this cluster's borrowers accepted.",
            &[(Vec::new(), lo.sessions_total)],
        )?;
        counter(
            &mut enc,
            "devlend_gateway_local_refused",
            "Sessions refused (routing errors, malformed preambles).",
            &[(Vec::new(), lo.refused)],
        )?;
        counter(
            &mut enc,
            "devlend_gateway_local_bytes",
            "Bytes from (in) and to (out) this cluster's borrowers.",
            &[
                (l(&[("direction", "in")]), lo.bytes_in),
                (l(&[("direction", "out")]), lo.bytes_out),
            ],
        )
    }
}

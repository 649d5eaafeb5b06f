//! The compute agent's Prometheus metrics, read from the attachments at scrape time.
//!
//! Each attachment exports the counters its kind has (labels `attachment`, `device`,
//! `lender`):
//! - every kind: `devlend_attachment_frontend_connected`;
//! - a block device: `devlend_attachment_requests_total{op}`,
//!   `devlend_attachment_bytes_total{op}`,
//!   `devlend_attachment_request_duration_seconds` (histogram),
//!   `devlend_attachment_requests_in_flight`, `devlend_attachment_errors_total{cause}`
//!   (`invalid`, `lender`, `fabric`), `devlend_attachment_reconnects_total`,
//!   `devlend_attachment_resent_total`, `devlend_attachment_throttled_total` (requests
//!   the lender held back for the lease's limits); with several paths to the lender,
//!   `devlend_attachment_failovers_total`, `devlend_attachment_last_failover_seconds`,
//!   and by `path` (its address) `devlend_attachment_path_up` and
//!   `devlend_attachment_path_sessions`;
//! - a NIC: `devlend_attachment_nic_frames_total{dir}` and
//!   `devlend_attachment_nic_bytes_total{dir}` (`rx`: to the guest, `tx`: from it),
//!   `devlend_attachment_nic_drops_total{dir}`, `devlend_attachment_nic_errors_total`,
//!   `devlend_attachment_nic_reconnects_total`, `devlend_attachment_nic_link_up`; with
//!   several paths, the same path series as a block device (a path's sessions are
//!   queue pair sessions);
//! - a PCIe function: `devlend_attachment_pci_region_accesses_total{op}` (`read`,
//!   `write`), `devlend_attachment_pci_pages_total{dir}` (`push`, `pull`),
//!   `devlend_attachment_pci_irqs_total`, `devlend_attachment_pci_dma_mapped_bytes`,
//!   `devlend_attachment_pci_dma_bytes_total{path}` (what the lender reports moving for
//!   the function's DMA: `guest_read`, `guest_write`, `peer`).
//!
//! And `devlend_attachments`, by `kind` and `state` (`served`, `restoring`).

use std::sync::Arc;

use devlend_daemon::metrics::{
    counter, gauge, histogram, Collector, DescriptorEncoder, HistogramSeries, Labels,
};

use crate::api::{AttachmentInfo, BlockInfo, DeviceKind, KindInfo, NicInfo, PathState, PciInfo};
use crate::registry::Registry;

/// Reads a registry at each scrape.
pub struct AttachmentMetrics(pub Arc<Registry>);

impl std::fmt::Debug for AttachmentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AttachmentMetrics")
    }
}

fn labels(a: &AttachmentInfo, extra: &[(&str, &str)]) -> Labels {
    let mut l = vec![
        ("attachment".to_owned(), a.id.clone()),
        ("device".to_owned(), a.device.clone()),
        ("lender".to_owned(), a.lender.clone()),
    ];
    l.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    l
}

/// The series of one scrape, by metric.
#[derive(Default)]
struct Series {
    req: Vec<(Labels, u64)>,
    bytes: Vec<(Labels, u64)>,
    errs: Vec<(Labels, u64)>,
    inflight: Vec<(Labels, i64)>,
    reconnects: Vec<(Labels, u64)>,
    resent: Vec<(Labels, u64)>,
    throttled: Vec<(Labels, u64)>,
    failovers: Vec<(Labels, u64)>,
    last_failover: Vec<(Labels, f64)>,
    path_up: Vec<(Labels, i64)>,
    path_sessions: Vec<(Labels, i64)>,
    connected: Vec<(Labels, i64)>,
    lat: Vec<HistogramSeries>,
    nic_frames: Vec<(Labels, u64)>,
    nic_bytes: Vec<(Labels, u64)>,
    nic_drops: Vec<(Labels, u64)>,
    nic_errors: Vec<(Labels, u64)>,
    nic_reconnects: Vec<(Labels, u64)>,
    nic_link: Vec<(Labels, i64)>,
    pci_access: Vec<(Labels, u64)>,
    pci_pages: Vec<(Labels, u64)>,
    pci_irqs: Vec<(Labels, u64)>,
    pci_dma: Vec<(Labels, i64)>,
    pci_dma_bytes: Vec<(Labels, u64)>,
}

impl Series {
    fn block(&mut self, a: &AttachmentInfo, b: &BlockInfo) {
        let c = &b.counters;
        for (op, n) in [
            ("read", c.ops.reads),
            ("write", c.ops.writes),
            ("flush", c.ops.flushes),
            ("discard", c.ops.discards),
            ("write_zeroes", c.ops.write_zeroes),
        ] {
            self.req.push((labels(a, &[("op", op)]), n));
        }
        self.bytes
            .push((labels(a, &[("op", "read")]), c.ops.bytes_read));
        self.bytes
            .push((labels(a, &[("op", "write")]), c.ops.bytes_written));
        for (kind, n) in [
            ("invalid", c.errors_invalid),
            ("lender", c.errors_lender),
            ("fabric", c.errors_fabric),
        ] {
            self.errs.push((labels(a, &[("cause", kind)]), n));
        }
        self.inflight.push((labels(a, &[]), c.inflight as i64));
        self.reconnects.push((labels(a, &[]), c.reconnects));
        self.resent.push((labels(a, &[]), c.resent));
        self.throttled.push((labels(a, &[]), c.throttled));
        self.paths(a, &c.paths, c.failovers, c.last_failover_us);
        self.lat.push(HistogramSeries {
            labels: labels(a, &[]),
            sum: c.latency.sum_ns as f64 / 1e9,
            count: c.latency.count,
            bounds: c
                .latency
                .bounds_us
                .iter()
                .map(|&us| us as f64 / 1e6)
                .collect(),
            buckets: c.latency.buckets.clone(),
        });
    }

    /// The path series of an attachment with several paths (`last_failover_us`: µs).
    fn paths(
        &mut self,
        a: &AttachmentInfo,
        paths: &[PathState],
        failovers: u64,
        last_failover_us: u64,
    ) {
        if paths.is_empty() {
            return;
        }
        self.failovers.push((labels(a, &[]), failovers));
        self.last_failover
            .push((labels(a, &[]), last_failover_us as f64 / 1e6));
        for p in paths {
            let l = labels(a, &[("path", &p.addr)]);
            self.path_up.push((l.clone(), i64::from(p.up)));
            self.path_sessions.push((l, p.sessions as i64));
        }
    }

    fn nic(&mut self, a: &AttachmentInfo, n: &NicInfo) {
        self.paths(a, &n.paths, n.failovers, n.last_failover_us);
        let c = &n.counters;
        for (dir, frames, bytes, drops) in [
            ("rx", c.rx_packets, c.rx_bytes, c.rx_drops),
            ("tx", c.tx_packets, c.tx_bytes, c.tx_drops),
        ] {
            self.nic_frames.push((labels(a, &[("dir", dir)]), frames));
            self.nic_bytes.push((labels(a, &[("dir", dir)]), bytes));
            self.nic_drops.push((labels(a, &[("dir", dir)]), drops));
        }
        self.nic_errors.push((labels(a, &[]), c.errors));
        self.nic_reconnects.push((labels(a, &[]), n.reconnects));
        self.nic_link.push((labels(a, &[]), i64::from(n.link_up)));
    }

    fn pci(&mut self, a: &AttachmentInfo, p: &PciInfo) {
        let c = &p.counters;
        self.pci_access
            .push((labels(a, &[("op", "read")]), c.region_reads));
        self.pci_access
            .push((labels(a, &[("op", "write")]), c.region_writes));
        self.pci_pages
            .push((labels(a, &[("dir", "push")]), c.pages_pushed));
        self.pci_pages
            .push((labels(a, &[("dir", "pull")]), c.pages_pulled));
        self.pci_irqs.push((labels(a, &[]), c.irqs));
        for (path, n) in [
            ("guest_read", c.guest_read_bytes),
            ("guest_write", c.guest_written_bytes),
            ("peer", c.peer_bytes),
        ] {
            self.pci_dma_bytes.push((labels(a, &[("path", path)]), n));
        }
        self.pci_dma.push((
            labels(a, &[]),
            i64::try_from(p.dma_mapped_bytes).unwrap_or(i64::MAX),
        ));
    }
}

impl Collector for AttachmentMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let all = self.0.list();
        // A saved attachment waiting for its lender after a restart is not served: it is
        // counted apart.
        let by_kind: Vec<(Labels, i64)> = [DeviceKind::Block, DeviceKind::Nic, DeviceKind::Pci]
            .into_iter()
            .flat_map(|k| [(k, "served", false), (k, "restoring", true)])
            .map(|(k, state, restoring)| {
                (
                    vec![
                        ("kind".to_owned(), k.as_str().to_owned()),
                        ("state".to_owned(), state.to_owned()),
                    ],
                    all.iter()
                        .filter(|a| a.kind() == k && a.restoring.is_some() == restoring)
                        .count() as i64,
                )
            })
            .collect();
        gauge(
            &mut enc,
            "devlend_attachments",
            "Attachments, by kind and state: served, or restoring (saved, waiting to be served again after a restart).",
            &by_kind,
        )?;
        let mut s = Series::default();
        for a in &all {
            s.connected.push((labels(a, &[]), i64::from(a.connected)));
            match &a.part {
                KindInfo::Block(b) => s.block(a, b),
                KindInfo::Nic(n) => s.nic(a, n),
                KindInfo::Pci(p) => s.pci(a, p),
            }
        }
        block_metrics(&mut enc, &s)?;
        gauge(
            &mut enc,
            "devlend_attachment_frontend_connected",
            "1 while a VMM is connected to the socket.",
            &s.connected,
        )?;
        nic_metrics(&mut enc, &s)?;
        pci_metrics(&mut enc, &s)?;
        let (name, help) = devlend_daemon::pool_health::METRIC;
        gauge(
            &mut enc,
            name,
            help,
            &[(Labels::new(), self.0.pool_health().gauge_seconds())],
        )
    }
}

fn block_metrics(enc: &mut DescriptorEncoder, s: &Series) -> Result<(), std::fmt::Error> {
    counter(
        enc,
        "devlend_attachment_requests",
        "Requests completed, by operation.",
        &s.req,
    )?;
    counter(
        enc,
        "devlend_attachment_bytes",
        "Data bytes moved by completed requests, by operation.",
        &s.bytes,
    )?;
    counter(
        enc,
        "devlend_attachment_errors",
        "Requests completed with an error status, by cause.",
        &s.errs,
    )?;
    gauge(
        enc,
        "devlend_attachment_requests_in_flight",
        "Requests sent to the lender and not completed.",
        &s.inflight,
    )?;
    counter(
        enc,
        "devlend_attachment_reconnects",
        "Fabric sessions re-established after a loss.",
        &s.reconnects,
    )?;
    counter(
        enc,
        "devlend_attachment_resent",
        "Requests sent again on a new fabric session after theirs was lost.",
        &s.resent,
    )?;
    counter(
        enc,
        "devlend_attachment_throttled",
        "Requests the lender held back for the lease's limits.",
        &s.throttled,
    )?;
    counter(
        enc,
        "devlend_attachment_failovers",
        "Queue sessions moved to another path to the lender after theirs was lost.",
        &s.failovers,
    )?;
    gauge(
        enc,
        "devlend_attachment_last_failover_seconds",
        "How long the last failover took: from the session's loss to the session on the next path.",
        &s.last_failover,
    )?;
    gauge(
        enc,
        "devlend_attachment_path_up",
        "1 unless the last session on this path was lost or its last connect failed.",
        &s.path_up,
    )?;
    gauge(
        enc,
        "devlend_attachment_path_sessions",
        "Queue sessions open on this path now.",
        &s.path_sessions,
    )?;
    histogram(
        enc,
        "devlend_attachment_request_duration_seconds",
        "Time from sending a request to the lender to its completion to the guest.",
        &s.lat,
    )
}

fn nic_metrics(enc: &mut DescriptorEncoder, s: &Series) -> Result<(), std::fmt::Error> {
    counter(
        enc,
        "devlend_attachment_nic_frames",
        "Frames delivered to the guest (rx) or sent by it (tx).",
        &s.nic_frames,
    )?;
    counter(
        enc,
        "devlend_attachment_nic_bytes",
        "Bytes of those frames.",
        &s.nic_bytes,
    )?;
    counter(
        enc,
        "devlend_attachment_nic_drops",
        "Frames dropped: no guest buffer in time (rx), the lender away (tx).",
        &s.nic_drops,
    )?;
    counter(
        enc,
        "devlend_attachment_nic_errors",
        "Malformed chains, guest ring errors and fabric protocol errors.",
        &s.nic_errors,
    )?;
    counter(
        enc,
        "devlend_attachment_nic_reconnects",
        "Fabric sessions re-established after a loss.",
        &s.nic_reconnects,
    )?;
    gauge(
        enc,
        "devlend_attachment_nic_link_up",
        "1 while the lender's link is up and every queue pair connected.",
        &s.nic_link,
    )
}

fn pci_metrics(enc: &mut DescriptorEncoder, s: &Series) -> Result<(), std::fmt::Error> {
    counter(
        enc,
        "devlend_attachment_pci_region_accesses",
        "Region (BAR, config space) accesses forwarded to the lender, by operation.",
        &s.pci_access,
    )?;
    counter(
        enc,
        "devlend_attachment_pci_pages",
        "Pages pushed to or pulled from the lender's mirror.",
        &s.pci_pages,
    )?;
    counter(
        enc,
        "devlend_attachment_pci_irqs",
        "Interrupts delivered to the VMM.",
        &s.pci_irqs,
    )?;
    gauge(
        enc,
        "devlend_attachment_pci_dma_mapped_bytes",
        "Bytes of the VMM's memory mapped for the function's DMA.",
        &s.pci_dma,
    )?;
    counter(
        enc,
        "devlend_attachment_pci_dma_bytes",
        "Bytes the lender reports moving for the function's DMA, by path: guest memory read (guest_read) or written (guest_write), or straight to or from another function of the VM (peer).",
        &s.pci_dma_bytes,
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::AttachmentMetrics;
    use crate::api::DeviceKind;
    use crate::registry::Registry;
    use crate::state::{to_hex, SavedAttachment};

    fn saved(id: &str, kind: DeviceKind) -> SavedAttachment {
        SavedAttachment {
            id: id.into(),
            request: serde_json::from_value(serde_json::json!({
                "lender": "127.0.0.1:1", "device": id, "socket": format!("/nonexistent/{id}.sock"),
            }))
            .expect("request"),
            borrower: to_hex(&[7; 16]),
            token: String::new(),
            plug: None,
            kind: Some(kind),
        }
    }

    /// The metric names (without `_total`) whose series carry `attachment="id"`.
    fn names_of(text: &str, id: &str) -> Vec<String> {
        let label = format!("attachment=\"{id}\"");
        let mut names: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with('#') && l.contains(&label))
            .filter_map(|l| l.split('{').next())
            .map(|n| n.trim_end_matches("_total").to_owned())
            .collect();
        names.dedup();
        names
    }

    #[test]
    fn each_kind_exports_its_own_counters_only() {
        let r = Registry::default();
        r.set_restoring(vec![
            saved("disk0", DeviceKind::Block),
            saved("nic0", DeviceKind::Nic),
            saved("fpga0", DeviceKind::Pci),
        ]);
        let text = devlend_daemon::metrics::render(AttachmentMetrics(Arc::new(r))).expect("render");
        // Restoring attachments are counted as such, not as served ones.
        for kind in ["block", "nic", "pci"] {
            assert!(
                text.contains(&format!(
                    "devlend_attachments{{kind=\"{kind}\",state=\"restoring\"}} 1"
                )),
                "{text}"
            );
            assert!(
                text.contains(&format!(
                    "devlend_attachments{{kind=\"{kind}\",state=\"served\"}} 0"
                )),
                "{text}"
            );
        }
        let disk = names_of(&text, "disk0");
        assert!(
            disk.iter().any(|n| n == "devlend_attachment_requests"),
            "{disk:?}"
        );
        let nic = names_of(&text, "nic0");
        assert!(
            nic.iter().any(|n| n == "devlend_attachment_nic_frames"),
            "{nic:?}"
        );
        let pci = names_of(&text, "fpga0");
        assert!(
            pci.iter()
                .any(|n| n == "devlend_attachment_pci_dma_mapped_bytes"),
            "{pci:?}"
        );
        assert!(
            pci.iter().any(|n| n == "devlend_attachment_pci_dma_bytes"),
            "{pci:?}"
        );
        for path in ["guest_read", "guest_write", "peer"] {
            let series = text
                .lines()
                .find(|l| {
                    l.starts_with("devlend_attachment_pci_dma_bytes_total{")
                        && l.contains("attachment=\"fpga0\"")
                        && l.contains(&format!("path=\"{path}\""))
                })
                .unwrap_or_else(|| panic!("no {path} series:\n{text}"));
            assert!(series.ends_with(" 0"), "{series}");
        }
        for (id, names, own) in [
            ("disk0", &disk, None),
            ("nic0", &nic, Some("devlend_attachment_nic_")),
            ("fpga0", &pci, Some("devlend_attachment_pci_")),
        ] {
            for n in names.iter() {
                let shared = n == "devlend_attachment_frontend_connected";
                let ok = match own {
                    // A disk: none of the other kinds' metrics.
                    None => {
                        !n.starts_with("devlend_attachment_nic_")
                            && !n.starts_with("devlend_attachment_pci_")
                    }
                    Some(prefix) => n.starts_with(prefix),
                };
                assert!(shared || ok, "{id} exports {n}:\n{text}");
            }
        }
    }
}

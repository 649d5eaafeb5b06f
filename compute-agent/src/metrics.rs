//! The compute agent's Prometheus metrics, read from the attachments at scrape time.
//!
//! Per attachment (labels `attachment`, `device`, `lender`):
//! `devlend_attachment_requests_total{op}`, `devlend_attachment_bytes_total{op}`,
//! `devlend_attachment_request_duration_seconds` (histogram),
//! `devlend_attachment_requests_in_flight`, `devlend_attachment_errors_total{kind}`
//! (`invalid`, `lender`, `fabric`), `devlend_attachment_reconnects_total`,
//! `devlend_attachment_resent_total`, `devlend_attachment_throttled_total` (requests
//! the lender held back for the lease's limits),
//! `devlend_attachment_frontend_connected`; and `devlend_attachments`.

use std::sync::Arc;

use devlend_daemon::metrics::{
    counter, gauge, histogram, Collector, DescriptorEncoder, HistogramSeries, Labels,
};

use crate::api::AttachmentInfo;
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

impl Collector for AttachmentMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let all = self.0.list();
        gauge(
            &mut enc,
            "devlend_attachments",
            "Attachments served.",
            &[(Vec::new(), all.len() as i64)],
        )?;
        let mut req = Vec::new();
        let mut bytes = Vec::new();
        let mut errs = Vec::new();
        let mut inflight = Vec::new();
        let mut reconnects = Vec::new();
        let mut resent = Vec::new();
        let mut throttled = Vec::new();
        let mut connected = Vec::new();
        let mut lat = Vec::new();
        for a in &all {
            let c = &a.counters;
            for (op, n) in [
                ("read", c.reads),
                ("write", c.writes),
                ("flush", c.flushes),
                ("discard", c.discards),
                ("write_zeroes", c.write_zeroes),
            ] {
                req.push((labels(a, &[("op", op)]), n));
            }
            bytes.push((labels(a, &[("op", "read")]), c.bytes_read));
            bytes.push((labels(a, &[("op", "write")]), c.bytes_written));
            for (kind, n) in [
                ("invalid", c.errors_invalid),
                ("lender", c.errors_lender),
                ("fabric", c.errors_fabric),
            ] {
                errs.push((labels(a, &[("kind", kind)]), n));
            }
            inflight.push((labels(a, &[]), c.inflight as i64));
            reconnects.push((labels(a, &[]), c.reconnects));
            resent.push((labels(a, &[]), c.resent));
            throttled.push((labels(a, &[]), c.throttled));
            connected.push((labels(a, &[]), i64::from(a.connected)));
            lat.push(HistogramSeries {
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
        counter(
            &mut enc,
            "devlend_attachment_requests",
            "Requests completed, by operation.",
            &req,
        )?;
        counter(
            &mut enc,
            "devlend_attachment_bytes",
            "Data bytes moved by completed requests, by operation.",
            &bytes,
        )?;
        counter(
            &mut enc,
            "devlend_attachment_errors",
            "Requests completed with an error status, by cause.",
            &errs,
        )?;
        gauge(
            &mut enc,
            "devlend_attachment_requests_in_flight",
            "Requests sent to the lender and not completed.",
            &inflight,
        )?;
        counter(
            &mut enc,
            "devlend_attachment_reconnects",
            "Fabric sessions re-established after a loss.",
            &reconnects,
        )?;
        counter(
            &mut enc,
            "devlend_attachment_resent",
            "Requests sent again on a new fabric session after theirs was lost.",
            &resent,
        )?;
        counter(
            &mut enc,
            "devlend_attachment_throttled",
            "Requests the lender held back for the lease's limits.",
            &throttled,
        )?;
        gauge(
            &mut enc,
            "devlend_attachment_frontend_connected",
            "1 while a VMM is connected to the socket.",
            &connected,
        )?;
        histogram(
            &mut enc,
            "devlend_attachment_request_duration_seconds",
            "Time from sending a request to the lender to its completion to the guest.",
            &lat,
        )?;
        Ok(())
    }
}

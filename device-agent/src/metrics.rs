//! The lender's Prometheus metrics, read from the device counters at scrape time.
//!
//! Per device of every kind (label `device`): `devlend_device_sessions` (open now),
//! `devlend_device_sessions_opened_total`, `devlend_device_errors_total{cause="protocol"}`
//! (sessions closed for a protocol error).
//! Per block device only (a NIC or a PCIe function has no block requests, and exports
//! none of these): `devlend_device_requests_total{op}`,
//! `devlend_device_bytes_total{op}`, `devlend_device_errors_total{cause="request"}`
//! (answered IOERR/UNSUPP), `devlend_device_operations_total` (operations issued to the
//! backing file), `devlend_device_requests_in_flight`,
//! `devlend_device_request_duration_seconds`.
//! Per lent network interface: `devlend_nic_packets_total{dir}` and
//! `devlend_nic_bytes_total{dir}` (`rx`: from the interface to the borrower, `tx`: the
//! other way), `devlend_nic_drops_total`.
//! Limits (`docs/qos.md`; block devices and NICs, not PCIe functions):
//! `devlend_device_qos_limit{lane}` (the rate in force, per second: the holder's while
//! held, else the device's own), `devlend_device_throttled_total` (requests or frames
//! held back),
//! `devlend_device_throttle_wait_seconds_total`, `devlend_device_throttle_queued` (held
//! now), `devlend_device_store_share{store}` (the holder's share of its store, 0..=1).

use devlend_daemon::metrics::{
    counter, gauge, histogram, Collector, DescriptorEncoder, HistogramSeries, Labels,
};
use devlend_fabric::latency::BOUNDS_US;

use devlend_daemon::pool_health::PoolHealth;

use crate::StatsView;

/// Reads the lender's counters, and whether it reaches its pool, at each scrape.
#[derive(Debug)]
pub struct DeviceMetrics {
    stats: StatsView,
    pool: PoolHealth,
}

impl DeviceMetrics {
    /// The metrics of the lender whose counters `stats` reads; `pool` is its pool's
    /// reachability (never failing without a pool).
    pub fn new(stats: StatsView, pool: PoolHealth) -> Self {
        DeviceMetrics { stats, pool }
    }
}

fn l(device: &str, extra: &[(&str, &str)]) -> Labels {
    let mut v = vec![("device".to_owned(), device.to_owned())];
    v.extend(
        extra
            .iter()
            .map(|(k, x)| ((*k).to_owned(), (*x).to_owned())),
    );
    v
}

#[derive(Default)]
struct Families {
    req: Vec<(Labels, u64)>,
    bytes: Vec<(Labels, u64)>,
    errs: Vec<(Labels, u64)>,
    sessions: Vec<(Labels, i64)>,
    opened: Vec<(Labels, u64)>,
    ops: Vec<(Labels, u64)>,
    inflight: Vec<(Labels, i64)>,
    latency: Vec<HistogramSeries>,
    nic_packets: Vec<(Labels, u64)>,
    nic_bytes: Vec<(Labels, u64)>,
    nic_drops: Vec<(Labels, u64)>,
    qos_limit: Vec<(Labels, i64)>,
    throttled: Vec<(Labels, u64)>,
    throttle_wait: Vec<(Labels, f64)>,
    throttle_queued: Vec<(Labels, i64)>,
    store_share: Vec<(Labels, f64)>,
}

impl Collector for DeviceMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut f = Families::default();
        for c in self.stats.all_by_kind() {
            let (name, s, lat) = (&c.name, &c.stats, &c.latency);
            // Every kind: its sessions and the protocol errors that ended them.
            f.errs
                .push((l(name, &[("cause", "protocol")]), s.protocol_errors));
            f.sessions.push((l(name, &[]), s.sessions_active as i64));
            f.opened.push((l(name, &[]), s.sessions_opened));
            if c.limited {
                f.throttled.push((l(name, &[]), s.throttled));
                f.throttle_wait
                    .push((l(name, &[]), s.throttle_wait_us as f64 / 1e6));
                f.throttle_queued
                    .push((l(name, &[]), s.throttle_queued as i64));
            }
            // Block requests: block devices only (a NIC counts frames, below).
            if !c.block_requests {
                continue;
            }
            for (op, n) in [
                ("read", s.ops.reads),
                ("write", s.ops.writes),
                ("flush", s.ops.flushes),
                ("discard", s.ops.discards),
                ("write_zeroes", s.ops.write_zeroes),
            ] {
                f.req.push((l(name, &[("op", op)]), n));
            }
            f.bytes.push((l(name, &[("op", "read")]), s.ops.bytes_read));
            f.bytes
                .push((l(name, &[("op", "write")]), s.ops.bytes_written));
            f.errs
                .push((l(name, &[("cause", "request")]), s.request_errors));
            f.ops.push((l(name, &[]), s.device_ops));
            f.inflight.push((l(name, &[]), s.in_flight as i64));
            f.latency.push(HistogramSeries {
                labels: l(name, &[]),
                sum: lat.sum_ns as f64 / 1e9,
                count: lat.count,
                bounds: BOUNDS_US.iter().map(|&us| us as f64 / 1e6).collect(),
                buckets: lat.buckets.clone(),
            });
        }
        for (name, n) in self.stats.nics() {
            f.nic_packets
                .push((l(&name, &[("dir", "rx")]), n.rx_packets));
            f.nic_packets
                .push((l(&name, &[("dir", "tx")]), n.tx_packets));
            f.nic_bytes.push((l(&name, &[("dir", "rx")]), n.rx_bytes));
            f.nic_bytes.push((l(&name, &[("dir", "tx")]), n.tx_bytes));
            f.nic_drops.push((l(&name, &[]), n.drops));
        }
        for (name, q) in self.stats.qos() {
            for (lane, lane_name) in devlend_fabric::qos::LANES {
                if let Some(limit) = q.limits.get(lane) {
                    f.qos_limit.push((
                        l(&name, &[("lane", lane_name)]),
                        i64::try_from(limit.per_sec).unwrap_or(i64::MAX),
                    ));
                }
            }
            if let (Some(store), Some(share)) = (&q.store, q.share) {
                f.store_share.push((l(&name, &[("store", store)]), share));
            }
        }
        let e = &mut enc;
        counter(
            e,
            "devlend_device_requests",
            "Requests received, by operation.",
            &f.req,
        )?;
        counter(
            e,
            "devlend_device_bytes",
            "Data bytes of successful requests, by operation.",
            &f.bytes,
        )?;
        counter(e, "devlend_device_errors", "Errors, by cause: request (answered IOERR or UNSUPP), protocol (sessions closed for a protocol error).", &f.errs)?;
        gauge(
            e,
            "devlend_device_sessions",
            "Fabric sessions open now.",
            &f.sessions,
        )?;
        counter(
            e,
            "devlend_device_sessions_opened",
            "Fabric sessions opened.",
            &f.opened,
        )?;
        counter(
            e,
            "devlend_device_operations",
            "Operations issued to the backing file or device.",
            &f.ops,
        )?;
        gauge(
            e,
            "devlend_device_requests_in_flight",
            "Requests received and not yet answered.",
            &f.inflight,
        )?;
        histogram(
            e,
            "devlend_device_request_duration_seconds",
            "Time from receiving a request to queueing its response.",
            &f.latency,
        )?;
        counter(
            e,
            "devlend_nic_packets",
            "Frames moved by a lent interface (rx: to the borrower, tx: from it).",
            &f.nic_packets,
        )?;
        counter(
            e,
            "devlend_nic_bytes",
            "Bytes of the frames moved by a lent interface.",
            &f.nic_bytes,
        )?;
        counter(
            e,
            "devlend_nic_drops",
            "Frames a lent interface dropped, either way.",
            &f.nic_drops,
        )?;
        gauge(
            e,
            "devlend_device_qos_limit",
            "Rate limit in force, per second, by lane (iops_*: operations, bps_*: bytes, tx_/rx_pps: frames, tx_/rx_bps: bytes).",
            &f.qos_limit,
        )?;
        counter(
            e,
            "devlend_device_throttled",
            "Requests or frames held back by the holder's limits.",
            &f.throttled,
        )?;
        counter(
            e,
            "devlend_device_throttle_wait_seconds",
            "Time throttled requests waited, all together.",
            &f.throttle_wait,
        )?;
        gauge(
            e,
            "devlend_device_throttle_queued",
            "Requests held back by the holder's limits now.",
            &f.throttle_queued,
        )?;
        gauge(
            e,
            "devlend_device_store_share",
            "The holder's share of its backing store's capacity (weight over the busy borrowers' weights).",
            &f.store_share,
        )?;
        let (name, help) = devlend_daemon::pool_health::METRIC;
        gauge(e, name, help, &[(Labels::new(), self.pool.gauge_seconds())])?;
        Ok(())
    }
}

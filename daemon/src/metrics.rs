//! The metrics endpoint: `GET /metrics` in the OpenMetrics text format (which Prometheus
//! scrapes), served on its own thread.
//!
//! A daemon hands over a [`Collector`] that reads its counters at scrape time; nothing is
//! recorded twice. Names follow Prometheus conventions: a `devlend_` prefix, the unit in
//! the name (`_bytes`, `_seconds`), `_total` on counters (added by the encoder).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
pub use prometheus_client::collector::Collector;
pub use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeMetric,
};
pub use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be bound.
    #[error("cannot listen for metrics on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The server thread could not start.
    #[error("cannot start the metrics thread")]
    Thread(#[source] std::io::Error),
}

/// The content type of what [`render`] writes.
pub const CONTENT_TYPE_OPENMETRICS: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The OpenMetrics text of one collector, read now: for a daemon that serves
/// `/metrics` on a router of its own instead of [`serve`]'s thread.
///
/// # Errors
/// Encoding errors (a collector whose `encode` fails).
pub fn render(collector: impl Collector) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(collector));
    let mut body = String::new();
    prometheus_client::encoding::text::encode(&mut body, &registry)?;
    Ok(body)
}

/// A running endpoint; it stops when the process exits.
pub struct MetricsServer {
    addr: SocketAddr,
}

impl MetricsServer {
    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Binds `addr` and serves `GET /metrics` from `collector`.
///
/// # Errors
/// [`MetricsError`].
pub fn serve(addr: SocketAddr, collector: impl Collector) -> Result<MetricsServer, MetricsError> {
    let listener =
        std::net::TcpListener::bind(addr).map_err(|source| MetricsError::Bind { addr, source })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let mut registry = Registry::default();
    registry.register_collector(Box::new(collector));
    let registry = Arc::new(registry);
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "metrics endpoint cannot start");
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "metrics endpoint cannot start");
                        return;
                    }
                };
                let app = Router::new().route(
                    "/metrics",
                    get(move || {
                        let registry = registry.clone();
                        async move {
                            let mut body = String::new();
                            match prometheus_client::encoding::text::encode(&mut body, &registry) {
                                Ok(()) => ([(CONTENT_TYPE, CONTENT_TYPE_OPENMETRICS)], body)
                                    .into_response(),
                                Err(_) => {
                                    axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response()
                                }
                            }
                        }
                    }),
                );
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(error = %e, "metrics endpoint failed");
                }
            });
        })
        .map_err(MetricsError::Thread)?;
    tracing::info!(addr = %local, "metrics endpoint ready at /metrics");
    Ok(MetricsServer { addr: local })
}

/// Labels of one series.
pub type Labels = Vec<(String, String)>;

/// Encodes a counter family (`u64` counts, or `f64` for seconds and the like): `name`
/// gets `_total` appended by the encoder.
///
/// # Errors
/// Encoding errors (a broken writer).
pub fn counter<V: EncodeCounterValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(Labels, V)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in series {
        m.encode_family(labels)?
            .encode_counter::<Labels, V, f64>(v, None)?;
    }
    Ok(())
}

/// Encodes a gauge family (`i64`, or `f64` for fractions).
///
/// # Errors
/// Encoding errors.
pub fn gauge<V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(Labels, V)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in series {
        m.encode_family(labels)?.encode_gauge(v)?;
    }
    Ok(())
}

/// A histogram series: sum, count and per-bucket (not cumulative) counts with their
/// upper bounds; the last count is the +Inf bucket.
#[derive(Debug, Clone)]
pub struct HistogramSeries {
    /// Labels.
    pub labels: Labels,
    /// Sum of samples, in the histogram's unit.
    pub sum: f64,
    /// Number of samples.
    pub count: u64,
    /// Upper bounds, in the histogram's unit.
    pub bounds: Vec<f64>,
    /// Samples per bucket, one more than `bounds`.
    pub buckets: Vec<u64>,
}

/// Encodes a histogram family.
///
/// # Errors
/// Encoding errors.
pub fn histogram(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[HistogramSeries],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for s in series {
        // Per-bucket counts: the text encoder accumulates them itself (giving them
        // cumulative counted every sample many times over).
        let buckets: Vec<(f64, u64)> = s
            .buckets
            .iter()
            .enumerate()
            .map(|(i, n)| (s.bounds.get(i).copied().unwrap_or(f64::INFINITY), *n))
            .collect();
        m.encode_family(&s.labels)?
            .encode_histogram::<Labels>(s.sum, s.count, &buckets, None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct One;

    impl Collector for One {
        fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            histogram(
                &mut enc,
                "t_seconds",
                "test",
                &[HistogramSeries {
                    labels: vec![],
                    sum: 1.0,
                    count: 6,
                    bounds: vec![0.1, 0.2],
                    buckets: vec![1, 2, 3],
                }],
            )
        }
    }

    /// Buckets come out cumulative once: 1, 1 + 2, and +Inf equal to the count.
    #[test]
    fn histogram_buckets_are_cumulative_and_end_at_the_count() {
        let text = render(One).unwrap();
        let bucket = |le: &str| {
            text.lines()
                .find(|l| l.starts_with("t_seconds_bucket") && l.contains(&format!("le=\"{le}\"")))
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_owned)
        };
        assert_eq!(bucket("0.1").as_deref(), Some("1"), "{text}");
        assert_eq!(bucket("0.2").as_deref(), Some("3"), "{text}");
        assert_eq!(bucket("+Inf").as_deref(), Some("6"), "{text}");
    }
}

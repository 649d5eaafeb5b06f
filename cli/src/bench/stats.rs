//! Completion latencies (hdrhistogram) and the figures of one measured window.

use std::time::Duration;

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use serde::Serialize;

/// Highest latency recorded exactly, in nanoseconds (60 s); longer ones are clamped.
const MAX_NS: u64 = 60_000_000_000;

/// Completion latencies of one thread, in nanoseconds, 3 significant digits.
pub struct Latencies(Histogram<u64>);

impl Latencies {
    /// An empty histogram.
    ///
    /// # Errors
    /// Never in practice (the bounds are constant and valid).
    pub fn new() -> Result<Self> {
        Ok(Latencies(
            Histogram::new_with_bounds(1, MAX_NS, 3).context("latency histogram")?,
        ))
    }

    /// Records one completion latency.
    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos())
            .unwrap_or(MAX_NS)
            .clamp(1, MAX_NS);
        self.0.saturating_record(ns);
    }

    /// Adds another thread's samples.
    ///
    /// # Errors
    /// Never in practice (same bounds on both sides).
    pub fn merge(&mut self, other: &Latencies) -> Result<()> {
        self.0.add(&other.0).context("merging latency histograms")
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.0.len()
    }

    /// The summary in microseconds.
    pub fn summary(&self) -> LatencySummary {
        let us = |ns: u64| ns as f64 / 1000.0;
        if self.0.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            mean_us: self.0.mean() / 1000.0,
            p50_us: us(self.0.value_at_quantile(0.5)),
            p99_us: us(self.0.value_at_quantile(0.99)),
            p999_us: us(self.0.value_at_quantile(0.999)),
            max_us: us(self.0.max()),
        }
    }
}

/// Completion latency figures, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Largest.
    pub max_us: f64,
}

/// What one run measured over its window.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Figures {
    /// Requests completed in the window.
    pub ios: u64,
    /// Of which reads.
    pub reads: u64,
    /// Of which writes.
    pub writes: u64,
    /// Requests that completed with an error (any, in the window).
    pub errors: u64,
    /// Length of the window in seconds, as measured.
    pub seconds: f64,
    /// Requests per second.
    pub iops: f64,
    /// Data rate in MB/s (10^6 bytes per second).
    pub mb_per_s: f64,
    /// Completion latency (submission to completion, as seen by the client).
    pub latency: LatencySummary,
}

impl Figures {
    /// Figures from counts over `seconds` with `bs`-byte requests.
    pub fn new(
        ios: u64,
        reads: u64,
        writes: u64,
        errors: u64,
        seconds: f64,
        bs: usize,
        lat: &Latencies,
    ) -> Self {
        let s = seconds.max(1e-9);
        Figures {
            ios,
            reads,
            writes,
            errors,
            seconds,
            iops: ios as f64 / s,
            mb_per_s: ios as f64 * bs as f64 / s / 1e6,
            latency: lat.summary(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_ordered_and_in_microseconds() {
        let mut a = Latencies::new().unwrap();
        let mut b = Latencies::new().unwrap();
        for i in 1..=1000u64 {
            a.record(Duration::from_micros(i));
        }
        b.record(Duration::from_secs(3600));
        a.merge(&b).unwrap();
        assert_eq!(a.count(), 1001);
        let s = a.summary();
        assert!((s.p50_us - 500.0).abs() < 2.5, "{s:?}");
        assert!(s.p50_us <= s.p99_us && s.p99_us <= s.p999_us && s.p999_us <= s.max_us);
        assert!(s.max_us >= 59_000_000.0);
        let f = Figures::new(2000, 2000, 0, 0, 2.0, 4096, &a);
        assert_eq!(f.iops, 1000.0);
        assert!((f.mb_per_s - 4.096).abs() < 1e-9);
    }
}

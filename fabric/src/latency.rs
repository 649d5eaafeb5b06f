//! A lock-free latency histogram with fixed buckets, kept by both ends of a session for
//! metrics and `devlend status`.
//!
//! Recording is one relaxed atomic add per bucket, sum and count; the bucket bounds are
//! the Prometheus histogram `le` bounds the agents export.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in microseconds (the last bucket, +Inf, is implicit).
pub const BOUNDS_US: [u64; 19] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// Request latencies: on the borrower from sending to completion into the used ring, on
/// the lender from receiving the request to queueing its response.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; BOUNDS_US.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

/// A copy of a [`LatencyHistogram`]; `buckets[i]` counts samples ≤ `BOUNDS_US[i]` that
/// are above the previous bound (not cumulative); the last entry is above every bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencySnapshot {
    /// Per-bucket counts.
    pub buckets: Vec<u64>,
    /// Sum of all samples, in nanoseconds.
    pub sum_ns: u64,
    /// Number of samples.
    pub count: u64,
}

impl LatencyHistogram {
    /// Records one sample.
    pub fn record(&self, d: Duration) {
        let us = d.as_micros() as u64;
        let i = BOUNDS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(BOUNDS_US.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads the histogram.
    pub fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

impl LatencySnapshot {
    /// The samples recorded since `earlier` (a snapshot of the same histogram).
    pub fn since(&self, earlier: &LatencySnapshot) -> LatencySnapshot {
        LatencySnapshot {
            buckets: self
                .buckets
                .iter()
                .zip(earlier.buckets.iter().chain(std::iter::repeat(&0)))
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
            sum_ns: self.sum_ns.saturating_sub(earlier.sum_ns),
            count: self.count.saturating_sub(earlier.count),
        }
    }

    /// The upper bound, in microseconds, of the bucket holding quantile `q` (0..=1);
    /// `None` with no samples. Samples above the last bound report that bound.
    pub fn quantile_upper_us(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(
                    BOUNDS_US
                        .get(i)
                        .copied()
                        .unwrap_or(BOUNDS_US[BOUNDS_US.len() - 1]),
                );
            }
        }
        BOUNDS_US.last().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_and_quantiles() {
        let h = LatencyHistogram::default();
        for _ in 0..98 {
            h.record(Duration::from_micros(40));
        }
        h.record(Duration::from_micros(900));
        h.record(Duration::from_secs(60));
        let s = h.snapshot();
        assert_eq!(s.count, 100);
        assert_eq!(s.buckets[2], 98);
        assert_eq!(s.buckets[6], 1);
        assert_eq!(*s.buckets.last().unwrap(), 1);
        assert_eq!(s.quantile_upper_us(0.5), Some(50));
        assert_eq!(s.quantile_upper_us(0.99), Some(1_000));
        assert_eq!(s.quantile_upper_us(1.0), Some(10_000_000));
        let later = {
            h.record(Duration::from_micros(5));
            h.snapshot()
        };
        let d = later.since(&s);
        assert_eq!((d.count, d.buckets[0]), (1, 1));
        assert_eq!(LatencySnapshot::default().quantile_upper_us(0.5), None);
    }
}

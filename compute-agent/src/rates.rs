//! Recent I/O rates of each attachment, for `devlend status`: the counters are sampled
//! every second and rates are taken over the last few seconds.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use devlend_backend::blk::latency::LatencySnapshot;

use crate::api::{IoCounters, Rates};

/// How far back rates look.
pub const WINDOW: Duration = Duration::from_secs(5);

#[derive(Default)]
struct History {
    samples: VecDeque<(Instant, IoCounters)>,
}

/// Counter samples per attachment.
#[derive(Default)]
pub struct RateTracker {
    by_id: Mutex<BTreeMap<String, History>>,
}

fn latency(c: &IoCounters) -> LatencySnapshot {
    LatencySnapshot::from(&c.latency)
}

impl RateTracker {
    /// Records a sample of each attachment now; forgets attachments not listed.
    pub fn sample(&self, now: Instant, current: impl IntoIterator<Item = (String, IoCounters)>) {
        let mut by_id = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
        let mut seen = BTreeMap::new();
        for (id, c) in current {
            let h = by_id.remove(&id).unwrap_or_default();
            seen.insert(id, (h, c));
        }
        *by_id = seen
            .into_iter()
            .map(|(id, (mut h, c))| {
                h.samples.push_back((now, c));
                while h.samples.len() > 2
                    && h.samples
                        .front()
                        .is_some_and(|(t, _)| now.duration_since(*t) > WINDOW)
                {
                    h.samples.pop_front();
                }
                (id, h)
            })
            .collect();
    }

    /// Starts the history of a new attachment with all-zero counters, so that I/O done
    /// before its first periodic sample still shows in its rates.
    pub fn start(&self, id: &str, now: Instant) {
        let mut by_id = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
        let h = by_id.entry(id.to_owned()).or_default();
        h.samples.clear();
        h.samples.push_back((now, IoCounters::default()));
    }

    /// Rates of attachment `id` over the samples kept (None before two samples).
    pub fn rates(&self, id: &str) -> Option<Rates> {
        let by_id = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
        let h = by_id.get(id)?;
        let ((t0, a), (t1, b)) = (h.samples.front()?, h.samples.back()?);
        let secs = t1.duration_since(*t0).as_secs_f64();
        if secs <= 0.0 {
            return None;
        }
        let ops = |c: &IoCounters| c.ops.requests();
        let lat = latency(b).since(&latency(a));
        Some(Rates {
            window_s: secs,
            iops: ops(b).saturating_sub(ops(a)) as f64 / secs,
            read_mb_s: b.ops.bytes_read.saturating_sub(a.ops.bytes_read) as f64 / secs / 1e6,
            write_mb_s: b.ops.bytes_written.saturating_sub(a.ops.bytes_written) as f64 / secs / 1e6,
            p99_us: lat.quantile_upper_us(0.99),
            throttled_per_s: b.throttled.saturating_sub(a.throttled) as f64 / secs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_over_the_window() {
        let t = RateTracker::default();
        let now = Instant::now();
        let mut c = IoCounters {
            latency: crate::api::Latency {
                buckets: vec![0; 20],
                ..Default::default()
            },
            ..Default::default()
        };
        t.sample(now, [("a".to_owned(), c.clone())]);
        assert!(t.rates("a").is_none());
        c.ops.reads = 1000;
        c.ops.bytes_read = 4_096_000;
        c.latency.buckets[3] = 1000;
        c.latency.count = 1000;
        t.sample(now + Duration::from_secs(2), [("a".to_owned(), c.clone())]);
        let r = t.rates("a").unwrap();
        assert!((r.iops - 500.0).abs() < 1e-6);
        assert!((r.read_mb_s - 2.048).abs() < 1e-6);
        assert_eq!(r.p99_us, Some(100));
        t.sample(now + Duration::from_secs(3), []);
        assert!(t.rates("a").is_none(), "a detached attachment is forgotten");
    }
}

//! Token buckets, one per limited [`Lane`], and what a request draws from them.

use std::time::{Duration, Instant};

use devlend_fabric::qos::{Lane, Qos, LANES, LANE_COUNT};
use devlend_fabric::Op;

/// The shortest wait a bucket in debt asks for: a throttled session wakes at most
/// about a thousand times a second and starts what accrued meanwhile, rather than
/// waking for each request (the rate is the same: the tokens accrue either way).
const MIN_WAIT: Duration = Duration::from_millis(1);

/// What one request or frame draws from each lane (0: that lane is not drawn from).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cost([u64; LANE_COUNT]);

impl Cost {
    /// A block request of operation `op` moving `bytes` of data: one operation on
    /// `iops_total` and on `iops_read` (a read) or `iops_write` (a write, discard or
    /// write zeroes; a flush counts on `iops_total` only), its data bytes on `bps_total`
    /// and `bps_read` or `bps_write`.
    pub(crate) fn block(op: Op, bytes: u64) -> Cost {
        let mut c = [0; LANE_COUNT];
        c[Lane::IopsTotal.index()] = 1;
        match op {
            Op::Read => {
                c[Lane::IopsRead.index()] = 1;
                c[Lane::BpsRead.index()] = bytes;
                c[Lane::BpsTotal.index()] = bytes;
            }
            Op::Write => {
                c[Lane::IopsWrite.index()] = 1;
                c[Lane::BpsWrite.index()] = bytes;
                c[Lane::BpsTotal.index()] = bytes;
            }
            Op::Discard | Op::WriteZeroes => c[Lane::IopsWrite.index()] = 1,
            Op::Flush => {}
        }
        Cost(c)
    }

    /// A frame of `bytes` the guest sends (`tx`) or receives.
    pub(crate) fn frame(tx: bool, bytes: u64) -> Cost {
        let mut c = [0; LANE_COUNT];
        let (pps, bps) = if tx {
            (Lane::TxPps, Lane::TxBps)
        } else {
            (Lane::RxPps, Lane::RxBps)
        };
        c[pps.index()] = 1;
        c[bps.index()] = bytes;
        Cost(c)
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Units a second.
    rate: f64,
    /// The most it holds.
    size: f64,
    /// What it holds now; below 0 it is in debt.
    level: f64,
}

/// The buckets of a [`Qos`]'s limits.
#[derive(Debug)]
pub(crate) struct Buckets {
    lanes: [Option<Bucket>; LANE_COUNT],
    at: Instant,
}

impl Buckets {
    /// Full buckets for the limits of `q`, scaled by `scale` (1.0: as given).
    pub(crate) fn new(q: &Qos, scale: f64, now: Instant) -> Buckets {
        let mut b = Buckets {
            lanes: [None; LANE_COUNT],
            at: now,
        };
        b.set_rates(q, scale);
        for l in b.lanes.iter_mut().flatten() {
            l.level = l.size;
        }
        b
    }

    /// Moves to the limits of `q` scaled by `scale`, keeping what each bucket holds
    /// (at most its new size).
    pub(crate) fn set_rates(&mut self, q: &Qos, scale: f64) {
        for (lane, _) in LANES {
            let slot = &mut self.lanes[lane.index()];
            *slot = q.get(lane).map(|l| {
                let rate = (l.per_sec as f64 * scale).max(f64::MIN_POSITIVE);
                let size = (l.bucket() as f64 * scale).max(1.0);
                let level = slot.map_or(size, |old| old.level.min(size));
                Bucket { rate, size, level }
            });
        }
    }

    /// Whether no lane is limited.
    pub(crate) fn is_empty(&self) -> bool {
        self.lanes.iter().all(Option::is_none)
    }

    /// Adds what the time since the last call earned.
    pub(crate) fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now.max(self.at);
        for b in self.lanes.iter_mut().flatten() {
            b.level = (b.level + b.rate * dt).min(b.size);
        }
    }

    /// How long until no lane that `cost` draws from is in debt (zero: now).
    pub(crate) fn wait(&self, cost: &Cost) -> Duration {
        let mut secs: f64 = 0.0;
        for (b, &c) in self.lanes.iter().zip(cost.0.iter()) {
            if let Some(b) = b {
                if c > 0 && b.level < 0.0 {
                    secs = secs.max(-b.level / b.rate);
                }
            }
        }
        if secs > 0.0 {
            Duration::from_secs_f64(secs.min(3600.0)).max(MIN_WAIT)
        } else {
            Duration::ZERO
        }
    }

    /// Takes `cost` from every lane it draws from (which may go into debt).
    pub(crate) fn charge(&mut self, cost: &Cost) {
        for (b, &c) in self.lanes.iter_mut().zip(cost.0.iter()) {
            if let Some(b) = b {
                b.level -= c as f64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs back-to-back requests of `cost` for `secs` of simulated time, each as soon
    /// as the buckets let it; the requests that went.
    fn run(q: &Qos, cost: Cost, secs: f64) -> u64 {
        let t0 = Instant::now();
        let mut b = Buckets::new(q, 1.0, t0);
        let mut now = t0;
        let end = t0 + Duration::from_secs_f64(secs);
        let mut n = 0;
        while now < end {
            b.refill(now);
            let w = b.wait(&cost);
            if w.is_zero() {
                b.charge(&cost);
                n += 1;
            } else {
                now += w;
            }
        }
        n
    }

    #[test]
    fn the_rate_holds_over_time_within_one_burst() {
        let q = Qos::default().with(Lane::IopsRead, 2000, 0);
        let n = run(&q, Cost::block(Op::Read, 4096), 10.0);
        // 10 s at 2000/s, plus the first bucket (200) and the request that overdraws.
        assert!((20_000..=20_202).contains(&n), "{n}");
        // Writes do not draw from the read lane.
        assert!(Buckets::new(&q, 1.0, Instant::now())
            .wait(&Cost::block(Op::Write, 4096))
            .is_zero());
    }

    #[test]
    fn a_request_larger_than_the_burst_goes_and_the_next_repays_its_debt() {
        let q = Qos::default().with(Lane::BpsRead, 50 << 20, 64 << 10);
        let one_mib = Cost::block(Op::Read, 1 << 20);
        let n = run(&q, one_mib, 4.0);
        assert!((200..=202).contains(&n), "{n}");
        let mut b = Buckets::new(&q, 1.0, Instant::now());
        b.charge(&one_mib);
        let w = b.wait(&one_mib);
        // (1 MiB - 64 KiB) at 50 MiB/s.
        assert!((18..=19).contains(&w.as_millis()), "{w:?}");
    }

    #[test]
    fn scaling_and_new_rates_keep_the_level() {
        let q = Qos::default().with(Lane::IopsTotal, 1000, 100);
        let t0 = Instant::now();
        let mut b = Buckets::new(&q, 0.25, t0);
        let c = Cost::block(Op::Flush, 0);
        for _ in 0..25 {
            assert!(b.wait(&c).is_zero());
            b.charge(&c);
        }
        b.charge(&c);
        // In debt by 1 at 250/s: 4 ms.
        assert_eq!(b.wait(&c).as_millis(), 4);
        b.set_rates(&q, 1.0);
        assert_eq!(b.wait(&c).as_millis(), 1);
        assert!(!b.is_empty());
        assert!(Buckets::new(&Qos::default(), 1.0, t0).is_empty());
    }
}

// devlend patch: a budget of front-end messages per second for a daemon.

//! A token bucket that the daemon's connection thread draws from before it reads each
//! front-end message. A front-end that sends valid messages as fast as it can (stopping
//! and restarting a queue in a loop, say) then costs the back-end a bounded share of a
//! core: past the burst, the thread sleeps until the next message is allowed, instead of
//! handling it at once. The socket's own buffer makes the front-end wait in turn.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// A budget of front-end messages: `burst` at once, then `per_second` on average. It is
/// a handle: clones share one budget, so that a back-end can give the same one to the
/// daemon of each connection it serves (a front-end that reconnects gets no fresh
/// burst) and draw from it for work of its own, such as accepting a connection.
#[derive(Debug, Clone)]
pub struct MessageBudget {
    bucket: Arc<Mutex<Bucket>>,
}

impl MessageBudget {
    /// A budget full to its burst.
    pub fn new(burst: u32, per_second: u32) -> Self {
        MessageBudget {
            bucket: Arc::new(Mutex::new(Bucket::new(burst, per_second))),
        }
    }

    /// Takes `cost` messages' worth, sleeping until the budget has them; returns early
    /// once `stop` is set (checked every 20 ms).
    pub fn wait(&self, cost: u32, stop: &AtomicBool) {
        let wait = match self.bucket.lock() {
            Ok(mut b) => b.take(cost, Instant::now()),
            Err(_) => None,
        };
        let Some(wait) = wait else { return };
        let end = Instant::now() + wait;
        while !stop.load(Ordering::Acquire) {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            thread::sleep(left.min(Duration::from_millis(20)));
        }
    }

    /// Waits until the budget holds `cost` (without running into debt), then takes it
    /// if `still_wanted()` says so and returns true; returns false, having taken
    /// nothing, if it does not or once `stop` is set. For work that may no longer be
    /// needed once its turn comes (a connection whose peer left while it waited).
    pub fn admit(&self, cost: u32, stop: &AtomicBool, still_wanted: impl Fn() -> bool) -> bool {
        let cost = f64::from(cost);
        let mut waited = false;
        loop {
            if stop.load(Ordering::Acquire) {
                return false;
            }
            let wait = match self.bucket.lock() {
                Ok(mut b) => {
                    b.refill(Instant::now());
                    if b.tokens >= cost.min(b.burst) {
                        if !still_wanted() {
                            return false;
                        }
                        b.tokens -= cost;
                        if waited {
                            b.throttled += 1;
                        }
                        return true;
                    }
                    (cost.min(b.burst) - b.tokens) / b.rate
                }
                Err(_) => return still_wanted(),
            };
            waited = true;
            thread::sleep(Duration::from_secs_f64(wait).min(Duration::from_millis(20)));
        }
    }

    /// How many draws had to wait, since the budget was made.
    pub fn throttled(&self) -> u64 {
        self.bucket.lock().map_or(0, |b| b.throttled)
    }
}

/// The budget's state: tokens left (negative: owed by draws already let through), and
/// when they were last counted.
#[derive(Debug)]
struct Bucket {
    burst: f64,
    rate: f64,
    tokens: f64,
    last: Instant,
    throttled: u64,
}

impl Bucket {
    fn new(burst: u32, per_second: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Bucket {
            burst,
            rate: f64::from(per_second.max(1)),
            tokens: burst,
            last: Instant::now(),
            throttled: 0,
        }
    }

    /// Takes `cost` tokens: `None` if they were there, else how long until they are.
    /// Adds what the time since the last count earned, up to the burst.
    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
    }

    fn take(&mut self, cost: u32, now: Instant) -> Option<Duration> {
        self.refill(now);
        let cost = f64::from(cost);
        self.tokens -= cost;
        if self.tokens >= 0.0 {
            return None;
        }
        self.throttled += 1;
        Some(Duration::from_secs_f64(-self.tokens / self.rate))
    }

}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_rate() {
        let mut b = Bucket::new(4, 100);
        let t0 = b.last;
        for _ in 0..4 {
            assert_eq!(b.take(1, t0), None);
        }
        // The fifth waits a hundredth of a second, the sixth two.
        let w = b.take(1, t0).unwrap();
        assert!((w.as_secs_f64() - 0.01).abs() < 1e-9, "{w:?}");
        let w = b.take(1, t0).unwrap();
        assert!((w.as_secs_f64() - 0.02).abs() < 1e-9, "{w:?}");
        assert_eq!(b.throttled, 2);
        // After the waits, and a second more, the burst is back (not more).
        let later = t0 + Duration::from_secs(2);
        for _ in 0..4 {
            assert_eq!(b.take(1, later), None);
        }
        assert!(b.take(1, later).is_some());
        // A draw of several waits for all of them.
        let w = b.take(10, later).unwrap();
        assert!((w.as_secs_f64() - 0.11).abs() < 1e-9, "{w:?}");
    }

    #[test]
    fn admit_takes_nothing_for_work_no_longer_wanted() {
        let budget = MessageBudget::new(100, 1000);
        let stop = AtomicBool::new(false);
        // Unwanted work costs nothing, however much of it there is.
        for _ in 0..10_000 {
            assert!(!budget.admit(64, &stop, || false));
        }
        let t = Instant::now();
        assert!(budget.admit(64, &stop, || true));
        assert!(t.elapsed() < Duration::from_millis(20), "{:?}", t.elapsed());
        // The next one waits for its tokens (28 more, at 1000 a second), no debt.
        assert!(budget.admit(64, &stop, || true));
        assert!(t.elapsed() >= Duration::from_millis(25), "{:?}", t.elapsed());
        assert_eq!(budget.throttled(), 1);
        stop.store(true, Ordering::Release);
        assert!(!budget.admit(64, &stop, || true));
    }

    #[test]
    fn wait_returns_at_once_when_stopped() {
        let budget = MessageBudget::new(1, 1);
        let stop = AtomicBool::new(false);
        budget.wait(1, &stop);
        stop.store(true, Ordering::Release);
        let t = Instant::now();
        budget.wait(100, &stop);
        assert!(t.elapsed() < Duration::from_millis(100));
        assert_eq!(budget.throttled(), 1);
    }
}

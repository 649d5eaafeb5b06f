//! Whether an agent reaches its device pool, for its status, metrics and logs.
//!
//! An agent's running devices do not depend on the pool (docs/pool.md, "When a lease
//! ends"), so an unreachable pool is a warning, not an error: the operator sees since
//! when, in `devlend status` (the compute agent) and in the metric
//! `devlend_pool_unreachable_since_seconds` (both agents).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The pool's reachability as one agent sees it. Cheap to clone; clones share it.
#[derive(Debug, Clone, Default)]
pub struct PoolHealth(Arc<Mutex<Option<SystemTime>>>);

/// A change worth a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// The first failure after the pool was reached.
    Lost,
    /// The first success after failures, that began this long ago.
    Back(Duration),
    /// Nothing changed.
    Same,
}

impl PoolHealth {
    fn since(&self) -> std::sync::MutexGuard<'_, Option<SystemTime>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A request to the pool failed at `now`.
    pub fn failed_at(&self, now: SystemTime) -> Change {
        let mut s = self.since();
        if s.is_some() {
            return Change::Same;
        }
        *s = Some(now);
        Change::Lost
    }

    /// A request to the pool failed now.
    pub fn failed(&self) -> Change {
        self.failed_at(SystemTime::now())
    }

    /// A request to the pool was answered.
    pub fn reached(&self) -> Change {
        match self.since().take() {
            Some(t) => Change::Back(t.elapsed().unwrap_or_default()),
            None => Change::Same,
        }
    }

    /// Since when the pool has not answered (`None`: it answered last time).
    pub fn unreachable_since(&self) -> Option<SystemTime> {
        *self.since()
    }

    /// As [`PoolHealth::unreachable_since`], in ms since the Unix epoch.
    pub fn unreachable_since_ms(&self) -> Option<u64> {
        self.unreachable_since().map(|t| {
            t.duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)
        })
    }

    /// The gauge's value: seconds since the Unix epoch since when the pool has not
    /// answered, 0 while it answers.
    pub fn gauge_seconds(&self) -> f64 {
        self.unreachable_since_ms()
            .map_or(0.0, |ms| ms as f64 / 1e3)
    }
}

/// The metric's name and help, the same on both agents.
pub const METRIC: (&str, &str) = (
    "devlend_pool_unreachable_since_seconds",
    "Since when (Unix time, seconds) the device pool has not answered this agent; 0 while it answers. Running devices keep working meanwhile.",
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_remembered_from_its_first_time_until_an_answer() {
        let h = PoolHealth::default();
        assert_eq!(h.gauge_seconds(), 0.0);
        let t = UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(h.failed_at(t), Change::Lost);
        assert_eq!(h.failed_at(t + Duration::from_secs(5)), Change::Same);
        assert_eq!(h.unreachable_since(), Some(t));
        assert_eq!(h.gauge_seconds(), 1_000.0);
        assert!(matches!(h.reached(), Change::Back(_)));
        assert_eq!(h.reached(), Change::Same);
        assert_eq!(h.unreachable_since(), None);
    }
}

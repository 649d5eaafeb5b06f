//! The I/O counters of one block attachment, shared by its queues' engines.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use devlend_fabric::io_counters::{IoCounters, OpCounters, PathState};
use devlend_fabric::latency::LatencyHistogram;
use devlend_fabric::Op;

use crate::blk::spec::S_OK;

/// I/O counters of one attachment, shared by its queues. All counts are since the
/// attachment was created; bytes are data bytes (headers excluded).
#[derive(Debug, Default)]
pub struct QueueStats {
    /// Requests completed OK by operation, and their data bytes.
    pub(crate) ops: OpCounters,
    pub(crate) errors_invalid: AtomicU64,
    pub(crate) errors_lender: AtomicU64,
    pub(crate) errors_fabric: AtomicU64,
    pub(crate) local: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) resent: AtomicU64,
    pub(crate) resubmitted: AtomicU64,
    pub(crate) throttled: AtomicU64,
    pub(crate) inflight: AtomicI64,
    pub(crate) per_queue: Vec<AtomicU64>,
    pub(crate) latency: LatencyHistogram,
    pub(crate) failovers: AtomicU64,
    pub(crate) last_failover_us: AtomicU64,
    /// One per path to the lender, when there are several.
    pub(crate) paths: Vec<PathCell>,
}

/// The live state of one path to the lender, shared by the queues' engines.
#[derive(Debug, Default)]
pub(crate) struct PathCell {
    addr: String,
    /// Queue sessions open on it now.
    sessions: AtomicI64,
    /// Its last session was lost, or its last connect failed, and since then no
    /// session opened on it and no probe reached it.
    down: AtomicBool,
    /// Sessions lost on it and connects that failed on it.
    failures: AtomicU64,
    /// When the lender there last refused a session for good, in ms since
    /// [`epoch`] plus one (0: never): the probe leaves it down for
    /// [`REFUSED_PATH_RESTS`] after that.
    refused_at: AtomicU64,
}

/// How long a path whose lender refused a session for good (a wrong address: another
/// lender, or one without this device) stays marked down: the probe, which only
/// connects, cannot tell it from a good path, and queues would try it at every
/// failback.
pub const REFUSED_PATH_RESTS: Duration = Duration::from_secs(30);

/// The instant path refusals are counted from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn since_epoch_ms(t: Instant) -> u64 {
    t.saturating_duration_since(epoch()).as_millis() as u64
}

impl PathCell {
    /// A session opened on this path.
    pub(crate) fn opened(&self) {
        self.sessions.fetch_add(1, Ordering::Relaxed);
        self.refused_at.store(0, Ordering::Relaxed);
        self.down.store(false, Ordering::Relaxed);
    }

    /// A session on this path ended; `failed`: it was lost (not closed by us).
    pub(crate) fn closed(&self, failed: bool) {
        self.sessions.fetch_sub(1, Ordering::Relaxed);
        if failed {
            self.failed();
        }
    }

    /// Its address.
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// Not marked down: a session opened on it, or a probe reached it, since the last
    /// failure on it.
    pub(crate) fn is_up(&self) -> bool {
        !self.down.load(Ordering::Relaxed)
    }

    /// A probe reached it ([`crate::blk::probe`]): up again, unless its lender
    /// refused a session for good less than [`REFUSED_PATH_RESTS`] ago.
    pub(crate) fn reachable(&self) {
        let refused = self.refused_at.load(Ordering::Relaxed);
        if refused == 0
            || since_epoch_ms(Instant::now()).saturating_sub(refused - 1)
                >= REFUSED_PATH_RESTS.as_millis() as u64
        {
            self.down.store(false, Ordering::Relaxed);
        }
    }

    /// The lender on this path refused a session for good: it is marked down (counted
    /// as a failure) and stays so for [`REFUSED_PATH_RESTS`], unless a session opens
    /// on it.
    pub(crate) fn refused(&self) {
        self.refused_at
            .store(since_epoch_ms(Instant::now()) + 1, Ordering::Relaxed);
        self.failed();
    }

    /// A connect on this path failed, or its session was lost.
    pub(crate) fn failed(&self) {
        self.down.store(true, Ordering::Relaxed);
        self.failures.fetch_add(1, Ordering::Relaxed);
    }
}

/// A copy of [`QueueStats`] at one instant: the counter set the compute agent's API
/// reports, declared once in the fabric crate.
pub type StatsSnapshot = IoCounters;

impl QueueStats {
    /// Counters for a device of `num_queues` virtqueues.
    pub fn new(num_queues: u16) -> Self {
        QueueStats {
            per_queue: (0..num_queues).map(|_| AtomicU64::new(0)).collect(),
            ..Default::default()
        }
    }

    /// Counters for a device reached on several paths, `addrs` in path order (one
    /// address: no path states are kept).
    pub fn with_paths(mut self, addrs: impl IntoIterator<Item = String>) -> Self {
        let paths: Vec<PathCell> = addrs
            .into_iter()
            .map(|addr| PathCell {
                addr,
                ..PathCell::default()
            })
            .collect();
        if paths.len() > 1 {
            self.paths = paths;
        }
        self
    }

    /// The state of path `i`, if several paths are kept.
    pub(crate) fn path(&self, i: usize) -> Option<&PathCell> {
        self.paths.get(i)
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            errors: g(&self.errors_invalid) + g(&self.errors_lender) + g(&self.errors_fabric),
            errors_invalid: g(&self.errors_invalid),
            errors_lender: g(&self.errors_lender),
            errors_fabric: g(&self.errors_fabric),
            local: g(&self.local),
            reconnects: g(&self.reconnects),
            resent: g(&self.resent),
            resubmitted: g(&self.resubmitted),
            throttled: g(&self.throttled),
            inflight: self.inflight.load(Ordering::Relaxed).max(0) as u64,
            per_queue: self.per_queue.iter().map(g).collect(),
            latency: self.latency.snapshot().into(),
            failovers: g(&self.failovers),
            last_failover_us: g(&self.last_failover_us),
            paths: self
                .paths
                .iter()
                .map(|p| PathState {
                    addr: p.addr.clone(),
                    sessions: p.sessions.load(Ordering::Relaxed).max(0) as u64,
                    up: !p.down.load(Ordering::Relaxed),
                    failures: g(&p.failures),
                })
                .collect(),
            ..StatsSnapshot::from(self.ops.snapshot())
        }
    }

    /// Counts a completion; a failure is the lender's, or the fabric's when `fabric`.
    pub(crate) fn count(&self, op: Op, len: u32, status: u8, fabric: bool) {
        if status != S_OK {
            let errors = if fabric {
                &self.errors_fabric
            } else {
                &self.errors_lender
            };
            errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.ops.count(op, u64::from(len));
    }
}

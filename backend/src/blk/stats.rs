//! The I/O counters of one block attachment, shared by its queues' engines.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use devlend_fabric::io_counters::{IoCounters, OpCounters};
use devlend_fabric::latency::LatencyHistogram;
use devlend_fabric::Op;

use crate::blk::spec::S_OK;
pub(crate) use crate::lender::path_cell::{Failovers, PathCell};

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
    pub(crate) failovers: Failovers,
    /// One per path to the lender, when there are several.
    pub(crate) paths: Vec<PathCell>,
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
        self.paths = PathCell::for_addrs(addrs);
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
            failovers: self.failovers.count(),
            last_failover_us: self.failovers.last_us(),
            paths: self.paths.iter().map(PathCell::snapshot).collect(),
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

impl crate::lender::path_probe::WithPaths for QueueStats {
    fn paths(&self) -> &[PathCell] {
        &self.paths
    }
}

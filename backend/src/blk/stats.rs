//! The I/O counters of one block attachment, shared by its queues' engines.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use devlend_fabric::io_counters::IoCounters;
use devlend_fabric::latency::LatencyHistogram;
use devlend_fabric::Op;

use crate::blk::spec::S_OK;

/// I/O counters of one attachment, shared by its queues. All counts are since the
/// attachment was created; bytes are data bytes (headers excluded).
#[derive(Debug, Default)]
pub struct QueueStats {
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) discards: AtomicU64,
    pub(crate) write_zeroes: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
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

    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            reads: g(&self.reads),
            writes: g(&self.writes),
            flushes: g(&self.flushes),
            discards: g(&self.discards),
            write_zeroes: g(&self.write_zeroes),
            bytes_read: g(&self.bytes_read),
            bytes_written: g(&self.bytes_written),
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
        }
    }

    /// Counts a completion; a failure is the lender's, or the fabric's when `fabric`.
    pub(crate) fn count(&self, op: Op, len: u32, status: u8, fabric: bool) {
        let add = |a: &AtomicU64, v: u64| {
            a.fetch_add(v, Ordering::Relaxed);
        };
        if status != S_OK {
            add(
                if fabric {
                    &self.errors_fabric
                } else {
                    &self.errors_lender
                },
                1,
            );
            return;
        }
        match op {
            Op::Read => {
                add(&self.reads, 1);
                add(&self.bytes_read, u64::from(len));
            }
            Op::Write => {
                add(&self.writes, 1);
                add(&self.bytes_written, u64::from(len));
            }
            Op::Flush => add(&self.flushes, 1),
            Op::Discard => add(&self.discards, 1),
            Op::WriteZeroes => add(&self.write_zeroes, 1),
        }
    }
}

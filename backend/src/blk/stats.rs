//! The I/O counters of one block attachment, shared by its queues' engines.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use devlend_fabric::latency::{LatencyHistogram, LatencySnapshot};
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

/// A copy of [`QueueStats`] at one instant.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Completed IN requests.
    pub reads: u64,
    /// Completed OUT requests.
    pub writes: u64,
    /// Completed FLUSH requests.
    pub flushes: u64,
    /// Completed DISCARD requests.
    pub discards: u64,
    /// Completed WRITE_ZEROES requests.
    pub write_zeroes: u64,
    /// Bytes read by completed IN requests.
    pub bytes_read: u64,
    /// Bytes written by completed OUT requests.
    pub bytes_written: u64,
    /// Requests completed with a status other than OK (IOERR or UNSUPP): the sum of
    /// the three kinds below.
    pub errors: u64,
    /// Refused by the backend itself: invalid guest requests (bad chain, range, type).
    pub errors_invalid: u64,
    /// Answered IOERR or UNSUPP by the lender.
    pub errors_lender: u64,
    /// Failed because the fabric session was lost or could not be opened.
    pub errors_fabric: u64,
    /// Requests answered by the backend itself (GET_ID, invalid requests).
    pub local: u64,
    /// Fabric connections re-established after a loss.
    pub reconnects: u64,
    /// Requests sent again on a new session after theirs was lost.
    pub resent: u64,
    /// Requests resubmitted from the inflight buffer, left in flight by an earlier
    /// backend (a compute agent restart).
    pub resubmitted: u64,
    /// Requests the lender held back for the lease's limits before it ran them
    /// (`docs/qos.md`).
    pub throttled: u64,
    /// Requests in flight to the lender now.
    pub inflight: u64,
    /// Requests completed by the lender, per virtqueue.
    pub per_queue: Vec<u64>,
    /// Completion latency of the requests the lender completed.
    pub latency: LatencySnapshot,
}

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
            latency: self.latency.snapshot(),
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

//! The I/O counters of one block attachment, and of one queue pair of a lent NIC, as
//! plain values: what the borrower's backend reads from its queues' counters and what
//! the compute agent's API reports (each set declared once; the JSON field names are
//! the API's). And the one live, atomic count of block requests by operation
//! ([`OpCounters`]), that the borrower's backend and the lender both keep.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

use crate::latency::{LatencySnapshot, BOUNDS_US};
use crate::Op;

/// I/O counters of a block attachment, since it was created; bytes are data bytes
/// (headers excluded).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct IoCounters {
    /// Requests completed by operation, and their data bytes (JSON: the fields
    /// `reads`, `writes`, `flushes`, `discards`, `write_zeroes`, `bytes_read`,
    /// `bytes_written`, beside the others).
    #[serde(flatten)]
    pub ops: OpCounts,
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
    #[serde(default)]
    pub resent: u64,
    /// Requests resubmitted from the vhost-user inflight buffer, left in flight by an
    /// earlier backend (a compute agent restart).
    #[serde(default)]
    pub resubmitted: u64,
    /// Requests the lender held back for the lease's limits before it ran them
    /// (`docs/qos.md`).
    #[serde(default)]
    pub throttled: u64,
    /// Requests in flight to the lender now.
    pub inflight: u64,
    /// Requests completed by the lender, per virtqueue.
    pub per_queue: Vec<u64>,
    /// Completion latency histogram of the requests the lender completed.
    pub latency: Latency,
    /// Queue sessions that moved to another path after theirs was lost (an attachment
    /// with several paths to its lender).
    #[serde(default)]
    pub failovers: u64,
    /// How long the last failover took, in µs: from the loss of the session (the
    /// socket's error, or its end) to the session on the next path, open with its
    /// requests resent. 0 before the first.
    #[serde(default)]
    pub last_failover_us: u64,
    /// The paths to the lender, in order (empty with one path).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PathState>,
}

/// One path to the lender, as an attachment with several sees it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PathState {
    /// Its address, `HOST:PORT`.
    pub addr: String,
    /// Queue sessions open on it now.
    pub sessions: u64,
    /// False once a session on it was lost or a connect on it failed, until one opens.
    pub up: bool,
    /// Sessions lost on it, and connects that failed on it.
    pub failures: u64,
}

/// A latency histogram: `buckets[i]` counts the samples at most `bounds_us[i]`
/// microseconds and above the previous bound; the last bucket has no upper bound.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Latency {
    /// Bucket upper bounds in microseconds.
    pub bounds_us: Vec<u64>,
    /// Samples per bucket (one more than `bounds_us`).
    pub buckets: Vec<u64>,
    /// Sum of the samples in nanoseconds.
    pub sum_ns: u64,
    /// Number of samples.
    pub count: u64,
}

impl From<LatencySnapshot> for Latency {
    /// The snapshot with the histogram's bounds ([`BOUNDS_US`]).
    fn from(s: LatencySnapshot) -> Self {
        Latency {
            bounds_us: BOUNDS_US.to_vec(),
            buckets: s.buckets,
            sum_ns: s.sum_ns,
            count: s.count,
        }
    }
}

impl From<&Latency> for LatencySnapshot {
    fn from(l: &Latency) -> Self {
        LatencySnapshot {
            buckets: l.buckets.clone(),
            sum_ns: l.sum_ns,
            count: l.count,
        }
    }
}

/// Counters of one queue pair of a lent NIC, or of all of them summed.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetCounters {
    /// Frames delivered to the guest.
    pub rx_packets: u64,
    /// Their bytes (Ethernet frames, without the virtio header).
    pub rx_bytes: u64,
    /// Frames the guest transmitted and sent to the lender.
    pub tx_packets: u64,
    /// Their bytes.
    pub tx_bytes: u64,
    /// Received frames dropped: no guest buffer in time, or too large for the buffers.
    pub rx_drops: u64,
    /// Transmitted frames dropped: the lender away, or a malformed chain.
    pub tx_drops: u64,
    /// Malformed transmit chains, guest ring errors and fabric protocol errors.
    pub errors: u64,
    /// Frames delivered that spanned several receive buffers (MRG_RXBUF).
    #[serde(default)]
    pub rx_merged: u64,
    /// Frames delivered larger than the MTU, for the guest's TCP (GUEST_TSO4/6).
    #[serde(default)]
    pub rx_gso: u64,
    /// Frames the guest left to segment (HOST_TSO4/6), sent whole to the lender.
    #[serde(default)]
    pub tx_gso: u64,
}

/// Block requests by operation, and the data bytes the reads and writes moved: the
/// counters of the I/O path, relaxed atomics. What counts (a completion, a request
/// received) is the counting side's to say.
#[derive(Debug, Default)]
pub struct OpCounters {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    write_zeroes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

impl OpCounters {
    /// Counts one `op` request and its `len` data bytes ([`Self::bytes`]).
    pub fn count(&self, op: Op, len: u64) {
        self.request(op);
        self.bytes(op, len);
    }

    /// Counts one `op` request, without its bytes.
    pub fn request(&self, op: Op) {
        let c = match op {
            Op::Read => &self.reads,
            Op::Write => &self.writes,
            Op::Flush => &self.flushes,
            Op::Discard => &self.discards,
            Op::WriteZeroes => &self.write_zeroes,
        };
        c.fetch_add(1, Relaxed);
    }

    /// Counts `len` data bytes of an `op` request: read or written. The other
    /// operations move no data (a discard's or a write-zeroes' length is a range).
    pub fn bytes(&self, op: Op, len: u64) {
        let c = match op {
            Op::Read => &self.bytes_read,
            Op::Write => &self.bytes_written,
            Op::Flush | Op::Discard | Op::WriteZeroes => return,
        };
        c.fetch_add(len, Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> OpCounts {
        OpCounts {
            reads: self.reads.load(Relaxed),
            writes: self.writes.load(Relaxed),
            flushes: self.flushes.load(Relaxed),
            discards: self.discards.load(Relaxed),
            write_zeroes: self.write_zeroes.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
        }
    }
}

/// Block requests by operation and their data bytes: a copy of [`OpCounters`] at one
/// instant, and the per-operation part of [`IoCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCounts {
    /// READ (virtio IN) requests.
    pub reads: u64,
    /// WRITE (virtio OUT) requests.
    pub writes: u64,
    /// FLUSH requests.
    pub flushes: u64,
    /// DISCARD requests.
    pub discards: u64,
    /// WRITE_ZEROES requests.
    pub write_zeroes: u64,
    /// Bytes read by successful READ requests.
    pub bytes_read: u64,
    /// Bytes written by successful WRITE requests.
    pub bytes_written: u64,
}

impl OpCounts {
    /// Requests, all operations together.
    pub fn requests(&self) -> u64 {
        self.reads + self.writes + self.flushes + self.discards + self.write_zeroes
    }
}

impl From<OpCounts> for IoCounters {
    /// An attachment's counters with the per-operation ones from `ops`, the others 0.
    fn from(ops: OpCounts) -> Self {
        IoCounters {
            ops,
            ..IoCounters::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_operation_counts_apart_and_only_reads_and_writes_move_bytes() {
        let c = OpCounters::default();
        c.count(Op::Read, 4096);
        c.count(Op::Read, 512);
        c.count(Op::Write, 8192);
        c.count(Op::Flush, 0);
        // A discard's and a write-zeroes' length is a range of the disk, not data.
        c.count(Op::Discard, 1 << 20);
        c.count(Op::WriteZeroes, 1 << 20);
        c.count(Op::WriteZeroes, 4096);
        let s = c.snapshot();
        assert_eq!(
            s,
            OpCounts {
                reads: 2,
                writes: 1,
                flushes: 1,
                discards: 1,
                write_zeroes: 2,
                bytes_read: 4608,
                bytes_written: 8192,
            }
        );
        assert_eq!(s.requests(), 7);
    }

    #[test]
    fn a_request_and_its_bytes_can_be_counted_apart() {
        // The lender counts a request when it arrives and its bytes once it succeeded.
        let c = OpCounters::default();
        c.request(Op::Write);
        c.request(Op::Read);
        assert_eq!(
            (c.snapshot().bytes_read, c.snapshot().bytes_written),
            (0, 0)
        );
        c.bytes(Op::Write, 512);
        let s = c.snapshot();
        assert_eq!(
            (s.reads, s.writes, s.bytes_read, s.bytes_written),
            (1, 1, 0, 512)
        );
    }

    #[test]
    fn the_snapshot_fills_the_attachments_per_operation_counters_only() {
        let c = OpCounters::default();
        c.count(Op::Write, 512);
        c.count(Op::Discard, 8);
        let io = IoCounters::from(c.snapshot());
        assert_eq!(
            (io.ops.writes, io.ops.bytes_written, io.ops.discards),
            (1, 512, 1)
        );
        assert_eq!(
            IoCounters {
                ops: OpCounts::default(),
                ..io
            },
            IoCounters::default()
        );
    }
}

//! The I/O counters of one block attachment, and of one queue pair of a lent NIC, as
//! plain values: what the borrower's backend reads from its queues' counters and what
//! the compute agent's API reports (each set declared once; the JSON field names are
//! the API's).

use serde::{Deserialize, Serialize};

use crate::latency::{LatencySnapshot, BOUNDS_US};

/// I/O counters of a block attachment, since it was created; bytes are data bytes
/// (headers excluded).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct IoCounters {
    /// Completed IN requests (reads).
    pub reads: u64,
    /// Completed OUT requests (writes).
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

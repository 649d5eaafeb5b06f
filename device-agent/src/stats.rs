//! Per-device counters, updated with relaxed atomics on the I/O path.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use devlend_fabric::io_counters::{OpCounters, OpCounts};
use devlend_fabric::latency::{LatencyHistogram, LatencySnapshot};
use devlend_fabric::Op;

/// A copy of one device's counters at one moment. Every field counts since the lender
/// started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStatsSnapshot {
    /// Sessions whose handshake for this device succeeded.
    pub sessions_opened: u64,
    /// Sessions of this device open now.
    pub sessions_active: u64,
    /// Well-formed requests received by operation (including those answered with an
    /// error), and the bytes of the successful reads and writes.
    pub ops: OpCounts,
    /// Operations issued to the backing file or device (read, write, fdatasync,
    /// fallocate, including the continuations of short transfers and the zero-filling
    /// writes of a write-zeroes fallback). 0 means no I/O reached the device.
    pub device_ops: u64,
    /// Requests answered with a status other than OK (I/O error or unsupported).
    pub request_errors: u64,
    /// Sessions closed because the peer broke the protocol (malformed or truncated
    /// frame, a length beyond the limits, a stall in the middle of a frame).
    pub protocol_errors: u64,
    /// Requests received and not yet answered.
    pub in_flight: u64,
    /// Requests (or NIC frames) held back by the holder's limits before they ran
    /// (`docs/qos.md`).
    pub throttled: u64,
    /// Microseconds the throttled requests waited, all together.
    pub throttle_wait_us: u64,
    /// Requests held back now.
    pub throttle_queued: u64,
}

/// The live counters of one device.
#[derive(Debug, Default)]
pub(crate) struct DeviceStats {
    sessions_opened: AtomicU64,
    sessions_active: AtomicU64,
    /// Well-formed requests received by operation; the bytes of the successful reads
    /// and writes.
    ops: OpCounters,
    device_ops: AtomicU64,
    request_errors: AtomicU64,
    protocol_errors: AtomicU64,
    answered: AtomicU64,
    throttled: AtomicU64,
    throttle_wait_us: AtomicU64,
    throttle_released: AtomicU64,
    latency: LatencyHistogram,
}

impl DeviceStats {
    /// Counts a request answered, `received` being when it arrived.
    pub(crate) fn answered(&self, received: Option<std::time::Instant>) {
        self.answered.fetch_add(1, Relaxed);
        if let Some(t) = received {
            self.latency.record(t.elapsed());
        }
    }

    /// The latency histogram: from receiving a request to queueing its response.
    pub(crate) fn latency(&self) -> LatencySnapshot {
        self.latency.snapshot()
    }

    pub(crate) fn session_opened(&self) {
        self.sessions_opened.fetch_add(1, Relaxed);
        self.sessions_active.fetch_add(1, Relaxed);
    }

    pub(crate) fn session_closed(&self) {
        self.sessions_active.fetch_sub(1, Relaxed);
    }

    pub(crate) fn request(&self, op: Op) {
        self.ops.request(op);
    }

    /// Counts the `n` data bytes a successful `op` request moved (none but reads and
    /// writes move any).
    pub(crate) fn data_bytes(&self, op: Op, n: u64) {
        self.ops.bytes(op, n);
    }

    pub(crate) fn device_op(&self) {
        self.device_ops.fetch_add(1, Relaxed);
    }

    pub(crate) fn request_error(&self) {
        self.request_errors.fetch_add(1, Relaxed);
    }

    pub(crate) fn protocol_error(&self) {
        self.protocol_errors.fetch_add(1, Relaxed);
    }

    /// Counts a request held back by its holder's limits.
    pub(crate) fn throttle_held(&self) {
        self.throttled.fetch_add(1, Relaxed);
    }

    /// Counts a held request released after `waited`.
    pub(crate) fn throttle_released(&self, waited: std::time::Duration) {
        self.throttle_wait_us
            .fetch_add(waited.as_micros() as u64, Relaxed);
        self.throttle_released.fetch_add(1, Relaxed);
    }

    /// Counts a NIC frame dropped by its holder's limits.
    pub(crate) fn throttle_dropped(&self) {
        self.throttle_released.fetch_add(1, Relaxed);
    }

    /// Counts a held request given up with its session: never started, never
    /// answered (no longer in flight).
    pub(crate) fn throttle_cancelled(&self) {
        self.throttle_released.fetch_add(1, Relaxed);
        self.answered.fetch_add(1, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> DeviceStatsSnapshot {
        let ops = self.ops.snapshot();
        DeviceStatsSnapshot {
            sessions_opened: self.sessions_opened.load(Relaxed),
            sessions_active: self.sessions_active.load(Relaxed),
            ops,
            device_ops: self.device_ops.load(Relaxed),
            request_errors: self.request_errors.load(Relaxed),
            protocol_errors: self.protocol_errors.load(Relaxed),
            in_flight: ops.requests().saturating_sub(self.answered.load(Relaxed)),
            throttled: self.throttled.load(Relaxed),
            throttle_wait_us: self.throttle_wait_us.load(Relaxed),
            throttle_queued: self
                .throttled
                .load(Relaxed)
                .saturating_sub(self.throttle_released.load(Relaxed)),
        }
    }
}

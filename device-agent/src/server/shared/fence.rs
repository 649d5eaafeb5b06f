//! The fence of a borrower's queue (`docs/protocol.md`, "Fencing a queue's earlier
//! session"): the registry's sessions of one borrower, device and queue, and the wait
//! for the earlier ones to end.

use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use super::{Conn, LenderState};

/// A borrower's queue of a device: the sessions that fence each other
/// (`docs/protocol.md`, "Fencing a queue's earlier session").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QueueKey {
    pub(crate) device: String,
    /// Not all zero: anonymous sessions are never fenced.
    pub(crate) borrower: [u8; 16],
    pub(crate) queue: u16,
}

impl LenderState {
    /// The flag that tells session `id` it was fenced (a TCP session's engine reads it;
    /// an RDMA session's is its stop flag).
    pub(crate) fn fence_flag(&self, id: u64) -> Option<Arc<AtomicBool>> {
        self.registry()
            .streams
            .get(&id)
            .map(|t| Arc::clone(&t.fence))
    }

    /// Fences the earlier sessions of `key` for session `id`, which serves it from now
    /// on: each is told to start nothing more and its connection is shut down; then
    /// waits up to `wait` until all have ended (`docs/protocol.md`, "Fencing a queue's
    /// earlier session"). Returns how many were fenced, or how many had not ended in
    /// time. The registry's lock is not held while waiting.
    pub(crate) fn fence_earlier(
        &self,
        id: u64,
        key: QueueKey,
        wait: Duration,
    ) -> Result<usize, usize> {
        let mut reg = self.registry();
        let earlier: Vec<u64> = reg
            .streams
            .iter()
            .filter(|(i, t)| **i != id && t.queue.as_ref() == Some(&key))
            .map(|(i, _)| *i)
            .collect();
        for t in earlier.iter().filter_map(|i| reg.streams.get(i)) {
            t.fence.store(true, Ordering::Release);
            if let Conn::Tcp(s) = &t.conn {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        if let Some(t) = reg.streams.get_mut(&id) {
            t.queue = Some(key);
        }
        let deadline = Instant::now() + wait;
        loop {
            let left = earlier
                .iter()
                .filter(|i| reg.streams.contains_key(i))
                .count();
            if left == 0 {
                return Ok(earlier.len());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(left);
            }
            reg = self
                .unregistered
                .wait_timeout(reg, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

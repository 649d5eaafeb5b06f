//! Returning a chain to the guest: its status byte, the attachment's counters, the used
//! ring, and the inflight buffer kept in step with it.
//!
//! A [`Completer`] is made for one batch of work on a queue (a receive, a send, a drain)
//! and handed to the queue's link, which completes requests through it as their
//! responses arrive; the engine reads [`Completer::used`] afterwards to know whether to
//! notify the guest.

use std::sync::atomic::Ordering;
use std::time::Duration;

use virtio_queue::{Queue, QueueT};

use crate::blk::stats::QueueStats;
use crate::blk::table::RequestTable;
use crate::guest::{GuestMemory, GuestMemoryRef};
use devlend_fabric::ratelimit::RateLimit;

/// Completes one queue's requests into its used ring.
pub(crate) struct Completer<'a> {
    queue: &'a mut Queue,
    mem: &'a GuestMemoryRef,
    stats: &'a QueueStats,
    index: u16,
    /// Failures are the fabric's (the session was lost or refused), for the counters.
    fabric: bool,
    used: bool,
}

impl<'a> Completer<'a> {
    /// A completer for virtqueue `index` (`queue`, in guest memory `mem`), counting into
    /// `stats`.
    pub(crate) fn new(
        queue: &'a mut Queue,
        mem: &'a GuestMemoryRef,
        stats: &'a QueueStats,
        index: u16,
    ) -> Self {
        Completer {
            queue,
            mem,
            stats,
            index,
            fabric: false,
            used: false,
        }
    }

    /// The same completer, counting the failures it completes as the fabric's.
    pub(crate) fn fabric_failures(mut self) -> Self {
        self.fabric = true;
        self
    }

    /// The guest memory map current now.
    pub(crate) fn mem(&self) -> &GuestMemoryRef {
        self.mem
    }

    /// Whether used-ring entries were added.
    pub(crate) fn used(&self) -> bool {
        self.used
    }

    /// Counts a response the lender marked throttled (it waited for the lease's
    /// limits).
    pub(crate) fn throttled(&self) {
        self.stats.throttled.fetch_add(1, Ordering::Relaxed);
    }

    /// The request in slot `head` is answered with virtio `status` (a read's data, if
    /// any, is in its guest buffers already): frees the slot (giving its credit back),
    /// finishes the request ([`crate::blk::pending::PendingRequest::finish`]: a read's
    /// buffers marked in the dirty log, whatever the status, and the status byte
    /// stored), counts it and returns the chain to the used ring. The status byte and the used ring go through vm-memory,
    /// which marks them itself (vhost-user "Migration").
    ///
    /// # Errors
    /// The used ring is not in guest memory.
    pub(crate) fn complete(
        &mut self,
        table: &mut RequestTable,
        head: u16,
        status: u8,
    ) -> Result<(), virtio_queue::Error> {
        let Some(done) = table.finish(head, status) else {
            // Nothing in flight in that slot (completed already): the used ring and the
            // counts are left alone.
            static STALE: RateLimit = RateLimit::new(5, Duration::from_secs(10));
            if let Some(suppressed) = STALE.check() {
                tracing::warn!(
                    queue = self.index,
                    head,
                    stale = table.stale_removes(),
                    suppressed,
                    "completion for a head with no request in flight ignored (logged at most every 10 s)",
                );
            }
            return Ok(());
        };
        self.stats.count(done.op, done.len, status, self.fabric);
        if let Some(q) = self.stats.per_queue.get(usize::from(self.index)) {
            q.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(t) = done.sent {
            self.stats.latency.record(t.elapsed());
        }
        self.stats.inflight.fetch_sub(1, Ordering::Relaxed);
        self.put_used(table, head, done.written)
    }

    /// Returns `head` to the used ring with `len` bytes written, keeping the inflight
    /// buffer in step (virtio 1.2 §2.7.8; [`RequestTable::returning`]).
    ///
    /// # Errors
    /// The used ring is not in guest memory.
    pub(crate) fn put_used(
        &mut self,
        table: &mut RequestTable,
        head: u16,
        len: u32,
    ) -> Result<(), virtio_queue::Error> {
        let mem: &GuestMemory = self.mem;
        table.returning(head);
        self.queue.add_used(mem, head, len)?;
        table.returned(head, self.queue.next_used());
        self.used = true;
        Ok(())
    }
}

//! Checks of a virtqueue that the driver may have corrupted, shared by the block and
//! network backends, and the state of a queue that such a driver broke.
//!
//! A driver that corrupts its ring breaks the device (virtio 1.2 §2.1.2: the device
//! "needs reset"); the rule in devlend is that this costs that virtqueue and nothing
//! else: it stops, once, with one warning naming the reason and the vring's error
//! eventfd signalled, and is served again only after the frontend stops and
//! re-initializes it (GET_VRING_BASE, then SET_VRING_*). A request that is malformed
//! but sits in a well-formed chain is not a corruption: the device model answers it
//! (an error status, a dropped frame) and the queue goes on.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::ratelimit::RateLimit;

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::guest::GuestMemory;

/// Checks the avail ring's index against the last one taken: a driver may make at most
/// a queue's size of chains available at once (virtio 1.2 §2.7.6). Returns the
/// violation, for the log.
///
/// Without this check, `virtio-queue` refuses to iterate such a ring, logs an error,
/// and `enable_notification` keeps saying there is more: a worker spins on it.
///
/// # Errors
/// The avail ring is not in guest memory.
pub fn avail_violation(
    queue: &Queue,
    mem: &GuestMemory,
) -> Result<Option<String>, virtio_queue::Error> {
    let idx = queue.avail_idx(mem, Ordering::Acquire)?;
    let pending = idx.0.wrapping_sub(queue.next_avail());
    Ok((pending > queue.size()).then(|| {
        format!(
            "avail.idx {} is {pending} chains past the last index taken ({}), more than the queue size {}",
            idx.0,
            queue.next_avail(),
            queue.size()
        )
    }))
}

/// The violation, if `head` (a head index the avail ring named) is not a descriptor of
/// `queue` (virtio 1.2 §2.7.6: "the head of a descriptor chain", an index into the
/// descriptor table of queue-size entries). `virtio-queue` hands such a head out as an
/// empty chain.
pub fn head_violation(queue: &Queue, head: u16) -> Option<String> {
    (head >= queue.size()).then(|| {
        format!(
            "head index {head} in the avail ring, past the queue size {}",
            queue.size()
        )
    })
}

/// Walks the descriptor chain at `head` of `queue` as the driver laid it out and
/// returns what makes it malformed, if anything: a `next` past the table (the queue's,
/// or an indirect table's), a loop (more descriptors than the table holds), a
/// descriptor table or buffer outside guest memory (or whose end overflows), a chain
/// longer than 2^32 bytes (§2.7.5.2), an indirect descriptor inside an indirect table or
/// with NEXT also set, an indirect table whose length is not a whole number of
/// descriptors (§2.7.5.3.1), or a device-readable descriptor after a device-writable
/// one (§2.7.4.2).
///
/// `virtio-queue`'s chain iterator stops silently at each of these, so that a reader or
/// writer over such a chain sees a truncated chain instead of an error. The caller
/// checks each chain before it uses it; `head` must be inside the queue
/// ([`head_violation`]).
pub fn chain_violation(queue: &Queue, mem: &GuestMemory, head: u16) -> Option<String> {
    let mut table = queue.desc_table();
    let mut table_len = queue.size();
    let mut index = head;
    let mut indirect = false;
    let mut walked = 0u32;
    let mut total = 0u32;
    let mut writable = false;
    loop {
        let which = if indirect { "indirect table" } else { "queue" };
        if index >= table_len {
            return Some(format!(
                "descriptor {index} in the chain at head {head} is past the {which}'s {table_len} entries"
            ));
        }
        walked += 1;
        if walked > u32::from(table_len) {
            return Some(format!(
                "the chain at head {head} loops (more than the {which}'s {table_len} descriptors)"
            ));
        }
        let at = table.checked_add(u64::from(index) * 16);
        let Some(d) = at.and_then(|a| mem.read_obj::<Descriptor>(GuestAddress(a)).ok()) else {
            return Some(format!(
                "descriptor {index} of the chain at head {head} is not in guest memory"
            ));
        };
        if d.refers_to_indirect_table() {
            if indirect {
                return Some(format!(
                    "an indirect descriptor inside the indirect table of the chain at head {head}"
                ));
            }
            if d.has_next() {
                return Some(format!(
                    "descriptor {index} of the chain at head {head} has both INDIRECT and NEXT set"
                ));
            }
            let len = d.len();
            if len == 0 || len % 16 != 0 || len / 16 > u32::from(u16::MAX) {
                return Some(format!(
                    "the indirect table of the chain at head {head} is {len} bytes, not a whole number of descriptors"
                ));
            }
            if !in_memory(mem, d.addr().0, len) {
                return Some(format!(
                    "the indirect table of the chain at head {head} ({len} bytes at {:#x}) is not in guest memory",
                    d.addr().0
                ));
            }
            table = d.addr().0;
            table_len = (len / 16) as u16;
            index = 0;
            walked = 0;
            indirect = true;
            continue;
        }
        let Some(t) = total.checked_add(d.len()) else {
            return Some(format!("the chain at head {head} is longer than 4 GiB"));
        };
        total = t;
        if !in_memory(mem, d.addr().0, d.len()) {
            return Some(format!(
                "a buffer of the chain at head {head} ({} bytes at {:#x}) is not in guest memory",
                d.len(),
                d.addr().0
            ));
        }
        if d.is_write_only() {
            writable = true;
        } else if writable {
            return Some(format!(
                "a device-readable descriptor after a device-writable one in the chain at head {head}"
            ));
        }
        if !d.has_next() {
            return None;
        }
        index = d.next();
    }
}

/// Whether `len` bytes at guest address `addr` are all in guest memory (an empty buffer
/// always is; an end past 2^64 never).
fn in_memory(mem: &GuestMemory, addr: u64, len: u32) -> bool {
    len == 0
        || (addr.checked_add(u64::from(len)).is_some()
            && GuestMemoryBackend::check_range(mem, GuestAddress(addr), len as usize))
}

/// Whether a virtqueue is stopped because its driver broke it, and whether the
/// frontend has been told. One per virtqueue; the NIC's queues use it (the block
/// engine keeps the same state in its own fields).
#[derive(Debug)]
pub struct BrokenQueue {
    attachment: Arc<str>,
    queue: u16,
    reason: Option<String>,
    newly: bool,
}

impl BrokenQueue {
    /// The state of virtqueue `queue` of `attachment` (for the log): not broken.
    pub fn new(attachment: Arc<str>, queue: u16) -> Self {
        BrokenQueue {
            attachment,
            queue,
            reason: None,
            newly: false,
        }
    }

    /// The driver broke the queue (`reason`): logs it once (one rate-limited warning)
    /// and marks the frontend to be told ([`Self::take_newly_broken`]). A queue already
    /// broken stays as it is, silently.
    pub fn break_queue(&mut self, reason: String) {
        if self.reason.is_some() {
            return;
        }
        // A frontend that re-initializes the queue and lets it break again, in a loop,
        // reaches this as often as it likes: 5 lines, then one per 10 s.
        static BROKE: RateLimit = RateLimit::new(5, Duration::from_secs(10));
        if let Some(suppressed) = BROKE.check() {
            tracing::warn!(
                attachment = %self.attachment,
                queue = self.queue,
                %reason,
                suppressed,
                "the driver broke this virtqueue; it is stopped until the frontend re-initializes it (logged at most 5 times every 10 s)",
            );
        }
        self.reason = Some(reason);
        self.newly = true;
    }

    /// Whether the queue is stopped.
    pub fn is_broken(&self) -> bool {
        self.reason.is_some()
    }

    /// Why, while it is.
    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// Whether the queue broke since the last call (the caller then signals the vring's
    /// error eventfd).
    pub fn take_newly_broken(&mut self) -> bool {
        std::mem::take(&mut self.newly)
    }

    /// The frontend stopped the queue (GET_VRING_BASE) or reset the device: whatever
    /// broke it is gone with its next initialization.
    pub fn reset(&mut self) {
        if let Some(was) = self.reason.take() {
            static RESET: RateLimit = RateLimit::new(5, Duration::from_secs(10));
            if let Some(suppressed) = RESET.check() {
                tracing::info!(
                    attachment = %self.attachment,
                    queue = self.queue,
                    %was,
                    suppressed,
                    "virtqueue stopped by the frontend; it is served again once re-initialized (logged at most 5 times every 10 s)",
                );
            }
        }
        self.newly = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;

    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    const INDIRECT: u16 = 4;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    /// A queue of 16 whose descriptor table holds `descs` from index 0.
    fn queue_with(mem: &GuestMemory, descs: &[(u64, u32, u16, u16)]) -> Queue {
        let vq = MockSplitQueue::new(mem, 16);
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let d = RawDescriptor::from(Descriptor::new(addr, len, flags, next));
            vq.desc_table().store(i as u16, d).unwrap();
        }
        vq.create_queue().unwrap()
    }

    fn write_desc(mem: &GuestMemory, at: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let mut b = Vec::new();
        b.extend_from_slice(&addr.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&flags.to_le_bytes());
        b.extend_from_slice(&next.to_le_bytes());
        mem.write_slice(&b, GuestAddress(at)).unwrap();
    }

    #[test]
    fn well_formed_chains_pass() {
        let m = mem();
        let q = queue_with(
            &m,
            &[
                (0x8000, 12, NEXT, 1),
                (0x9000, 1500, NEXT, 2),
                (0xa000, 4096, WRITE, 0),
                (0xb000, 0, 0, 0),
            ],
        );
        assert_eq!(chain_violation(&q, &m, 0), None);
        assert_eq!(chain_violation(&q, &m, 3), None, "an empty buffer is fine");
        // An indirect table of two descriptors at 0x4000.
        write_desc(&m, 0x4000, 0x8000, 12, NEXT, 1);
        write_desc(&m, 0x4010, 0x9000, 100, WRITE, 0);
        let q = queue_with(&m, &[(0x4000, 32, INDIRECT, 0)]);
        assert_eq!(chain_violation(&q, &m, 0), None);
    }

    #[test]
    fn malformed_chains_are_named() {
        let m = mem();
        // (what the reason says, the chain from descriptor 0: address, length, flags, next)
        type Case = (&'static str, Vec<(u64, u32, u16, u16)>);
        let cases: [Case; 6] = [
            ("loops", vec![(0x8000, 12, NEXT, 1), (0x9000, 12, NEXT, 0)]),
            ("past the queue", vec![(0x8000, 12, NEXT, 40)]),
            ("not in guest memory", vec![(0x20_0000, 12, 0, 0)]),
            ("not in guest memory", vec![(u64::MAX - 4, 12, 0, 0)]),
            (
                "after a device-writable",
                vec![(0x8000, 12, WRITE | NEXT, 1), (0x9000, 12, 0, 0)],
            ),
            ("INDIRECT and NEXT", vec![(0x4000, 32, INDIRECT | NEXT, 1)]),
        ];
        for (what, descs) in cases {
            let q = queue_with(&m, &descs);
            let v = chain_violation(&q, &m, 0);
            assert!(
                v.as_deref().is_some_and(|v| v.contains(what)),
                "{what}: {v:?}"
            );
        }
        // 4 GiB - 1 bytes, then 2 more: a second region, mapped lazily, holds the first.
        let big = GuestMemory::from_ranges(&[
            (GuestAddress(0), 0x10_0000),
            (GuestAddress(1 << 32), u32::MAX as usize),
        ])
        .unwrap();
        let q = queue_with(&big, &[(1 << 32, u32::MAX, NEXT, 1), (0x9000, 2, 0, 0)]);
        assert!(chain_violation(&q, &big, 0)
            .unwrap()
            .contains("longer than 4 GiB"));
        // Indirect: a table of 20 bytes, one outside memory, one nested.
        let q = queue_with(&m, &[(0x4000, 20, INDIRECT, 0)]);
        assert!(chain_violation(&q, &m, 0).unwrap().contains("whole number"));
        let q = queue_with(&m, &[(0xff_fff0, 32, INDIRECT, 0)]);
        assert!(chain_violation(&q, &m, 0)
            .unwrap()
            .contains("not in guest memory"));
        write_desc(&m, 0x4000, 0x5000, 16, INDIRECT, 0);
        let q = queue_with(&m, &[(0x4000, 16, INDIRECT, 0)]);
        assert!(chain_violation(&q, &m, 0)
            .unwrap()
            .contains("inside the indirect"));
        // A loop inside an indirect table.
        write_desc(&m, 0x4000, 0x8000, 12, NEXT, 1);
        write_desc(&m, 0x4010, 0x9000, 12, NEXT, 0);
        let q = queue_with(&m, &[(0x4000, 32, INDIRECT, 0)]);
        assert!(chain_violation(&q, &m, 0).unwrap().contains("loops"));
    }

    #[test]
    fn a_head_past_the_queue_is_named() {
        let m = mem();
        let q = queue_with(&m, &[]);
        assert_eq!(head_violation(&q, 15), None);
        assert!(head_violation(&q, 16)
            .unwrap()
            .contains("past the queue size 16"));
    }

    #[test]
    fn a_broken_queue_is_told_once_and_reset_by_the_frontend() {
        let mut b = BrokenQueue::new(Arc::from("nic"), 1);
        assert!(!b.is_broken());
        b.break_queue("first".into());
        b.break_queue("second".into());
        assert_eq!(b.reason(), Some("first"));
        assert!(b.take_newly_broken());
        assert!(!b.take_newly_broken());
        b.reset();
        assert!(!b.is_broken());
        assert!(!b.take_newly_broken());
    }
}

//! Checks of a virtqueue that the driver may have corrupted, shared by the block and
//! network backends.

use std::sync::atomic::Ordering;

use virtio_queue::{Queue, QueueT};

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

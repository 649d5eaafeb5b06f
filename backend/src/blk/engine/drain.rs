//! A queue's drain: waiting for its requests in flight before the frontend takes the
//! virtqueue back (GET_VRING_BASE) or the attachment goes (detach), and what becomes of
//! those that do not complete in time.

use std::time::{Duration, Instant};

use virtio_queue::Queue;

use super::QueueEngine;
use crate::guest::GuestMemoryRef;

impl QueueEngine {
    /// Waits up to `timeout` for every request in flight to complete (GET_VRING_BASE,
    /// detach); whatever is still in flight then completes with IOERR. Returns whether
    /// used-ring entries were added.
    ///
    /// # Errors
    /// A guest memory error on the used ring.
    pub fn drain(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        timeout: Duration,
    ) -> Result<bool, virtio_queue::Error> {
        self.draining = true;
        let r = self.drain_until(queue, mem, timeout);
        self.draining = false;
        r
    }

    fn drain_until(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        timeout: Duration,
    ) -> Result<bool, virtio_queue::Error> {
        let deadline = Instant::now() + timeout;
        let mut used = false;
        let leave = self.handoff && self.table.has_log();
        while self.table.inflight() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let Some(fd) = self.conn.as_ref().map(|l| l.fd()) else {
                if leave {
                    break;
                }
                used |= self.recover(queue, mem)?;
                if self.conn.is_none() && self.table.inflight() > 0 {
                    std::thread::sleep(left.min(Duration::from_millis(50)));
                }
                continue;
            };
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN | if self.wants_write() { libc::POLLOUT } else { 0 },
                revents: 0,
            };
            let ms = left.as_millis().min(100) as libc::c_int;
            // SAFETY: pfd is a valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, ms) };
            used |= self.process_responses(queue, mem)?;
        }
        if self.table.inflight() > 0 && leave {
            tracing::info!(
                attachment = %self.name,
                queue = self.index,
                inflight = self.table.inflight(),
                "leaving the requests that cannot complete now to the next compute agent (they stay in the inflight buffer)",
            );
        } else if self.table.inflight() > 0 {
            tracing::warn!(
                attachment = %self.name,
                queue = self.index,
                inflight = self.table.inflight(),
                "requests still in flight at drain deadline; failing them",
            );
            // Their responses may still come, and a write may be half sent: the
            // session cannot go on after them.
            self.drop_session();
            used |= self.fail_all(queue, mem)?;
        }
        Ok(used)
    }
}

//! Losing and regaining a queue's session: the requests in flight wait in their slots,
//! the reconnector ([`devlend_fabric::reconnect`]) says when to try again, and on the
//! new session they are resent, oldest first. The deadline, a permanent refusal or too
//! many resends of one request fail them (IOERR).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_queue::Queue;

use super::{QueueEngine, MAX_RESENDS};
use crate::blk::complete::Completer;
use crate::blk::link::FabricFault;
use crate::blk::spec::S_IOERR;
use crate::guest::GuestMemoryRef;
use crate::lender::DisplayChain;

/// Reconnect failures are logged at most this often per queue.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(10);

/// What a reconnect attempt came to.
enum Reconnect {
    Connected,
    /// Not now (backoff) or failed for now: try again later.
    Later,
    /// The lender refuses this borrower for good (denied, no such device, ...).
    Refused,
}

impl QueueEngine {
    /// Completes every request in flight with IOERR, as the fabric's failure.
    pub(super) fn fail_all(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        let mut done = Completer::new(queue, mem, &self.stats, self.index).fabric_failures();
        for head in self.table.busy_heads() {
            done.complete(&mut self.table, head, S_IOERR)?;
        }
        Ok(done.used())
    }

    /// Drops the connection; the requests in flight wait for a new one (see
    /// [`Self::recover`]).
    pub(super) fn fail_connection(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        fault: FabricFault,
    ) -> Result<bool, virtio_queue::Error> {
        devlend_fabric::limited!(
            warn,
            attachment = %self.name,
            queue = self.index,
            lender = %self.target.path_addr(self.path),
            device = %self.target.device,
            inflight = self.table.inflight(),
            error = %DisplayChain(&fault),
            "fabric session lost; requests in flight wait for a new one and are resent",
        );
        self.drop_session();
        if self.table.inflight() == 0 {
            return Ok(false);
        }
        self.retry.waiting(Instant::now());
        self.recover(queue, mem)
    }

    /// Forgets the session: what was sent on it is outstanding nowhere now (every
    /// request still in flight is resent on the next one, [`Self::queue_resend`]).
    pub(super) fn drop_session(&mut self) {
        self.end_session(true);
    }

    /// Ends the session (`failed`: it was lost) and forgets what was sent on it; the
    /// reconnector counts from now.
    pub(super) fn end_session(&mut self, failed: bool) {
        self.close_session(failed);
        self.table.forget_session();
        self.retry.lost(Instant::now());
    }

    /// Tries to reopen the fabric session when the reconnector lets it (100 ms,
    /// doubling to 2 s while the lender stays away); logs a failure at most every 10 s.
    fn reconnect(&mut self) -> Reconnect {
        let now = Instant::now();
        if !self.retry.due(now) {
            return Reconnect::Later;
        }
        match self.connect() {
            Ok(()) => {
                self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                self.failure_logged = None;
                devlend_fabric::limited!(
                    info,
                    attachment = %self.name,
                    queue = self.index,
                    lender = %self.target.path_addr(self.path),
                    "fabric session re-established",
                );
                Reconnect::Connected
            }
            Err(e) => {
                // The attempt may have taken a connect timeout per path tried: the
                // backoff and the log's rate limit count from its end.
                let now = Instant::now();
                self.retry.failed(now);
                // With several paths, one path's refusal (a wrong address, a lender
                // there that is not this one) is not the lender's: the others are tried
                // first, and the requests fail only once every path refused in a row
                // ([`Self::connect`] counts them).
                let permanent = self.refused_in_row >= self.target.path_count();
                if permanent
                    || self
                        .failure_logged
                        .is_none_or(|t| now.duration_since(t) >= FAILURE_LOG_EVERY)
                {
                    self.failure_logged = Some(now);
                    tracing::warn!(
                        attachment = %self.name,
                        queue = self.index,
                        error = %DisplayChain(&e),
                        inflight = self.table.inflight(),
                        "cannot open a fabric session{}",
                        if permanent { "; the lender refuses it: requests fail with IOERR" } else { "; requests wait for it" },
                    );
                }
                if permanent {
                    Reconnect::Refused
                } else {
                    Reconnect::Later
                }
            }
        }
    }

    /// With the session lost and requests waiting: reconnects (when the backoff allows)
    /// and resends them all, or fails them once the deadline has passed or the lender
    /// refuses the session; otherwise arms the timer for the next attempt. Returns
    /// whether used-ring entries were added.
    pub(super) fn recover(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        if self.conn.is_some() || self.table.inflight() == 0 {
            self.retry.idle();
            if let Some(t) = self.timer.as_mut() {
                t.disarm();
            }
            return Ok(false);
        }
        let now = Instant::now();
        self.retry.waiting(now);
        let mut outcome = self.reconnect();
        if matches!(outcome, Reconnect::Later)
            && self.retry.expired(Instant::now())
            && self.another_path_up()
        {
            // At the deadline, a path that came back while this queue was trying
            // others (the probe found it) is tried before any request fails.
            if self.connect().is_ok() {
                self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                outcome = Reconnect::Connected;
            }
        }
        match outcome {
            Reconnect::Connected => {
                if let Some(t) = self.timer.as_mut() {
                    t.disarm();
                }
                let used = self.fail_poison(queue, mem)?;
                self.queue_resend();
                Ok(self.flush_tx(queue, mem)? | used)
            }
            Reconnect::Refused => self.give_up(queue, mem),
            // The clock is read again: the attempt may have blocked in connects (up to
            // a connect timeout per path tried), and the deadline is the guest's.
            Reconnect::Later if self.retry.expired(Instant::now()) => {
                let now = Instant::now();
                if self
                    .give_up_logged
                    .is_none_or(|t| now.duration_since(t) >= FAILURE_LOG_EVERY)
                {
                    self.give_up_logged = Some(now);
                    tracing::error!(
                        attachment = %self.name,
                        queue = self.index,
                        lender = %self.target.addr,
                        inflight = self.table.inflight(),
                        deadline_s = self.retry.policy().deadline.unwrap_or_default().as_secs_f64(),
                        "fabric session not back within the deadline; failing the waiting requests with IOERR (logged at most every 10 s)",
                    );
                }
                self.give_up(queue, mem)
            }
            Reconnect::Later => {
                let now = Instant::now();
                let next = self
                    .retry
                    .next_event()
                    .unwrap_or(now + self.retry.policy().first);
                if let Some(t) = self.timer.as_mut() {
                    t.arm(next.saturating_duration_since(now));
                }
                Ok(false)
            }
        }
    }

    fn give_up(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        self.retry.idle();
        if let Some(t) = self.timer.as_mut() {
            t.disarm();
        }
        self.fail_all(queue, mem)
    }

    /// Completes with IOERR the requests already resent [`MAX_RESENDS`] times: a
    /// request that ends every session it is sent on (e.g. one the lender cannot serve
    /// over RDMA) must not be retried for ever, since each reconnect succeeds and the
    /// deadline never runs out. Returns whether used-ring entries were added.
    fn fail_poison(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        let mut done = Completer::new(queue, mem, &self.stats, self.index).fabric_failures();
        for head in self.table.count_resends(MAX_RESENDS) {
            devlend_fabric::limited!(
                error,
                attachment = %self.name,
                queue = self.index,
                head,
                resends = MAX_RESENDS,
                "request resent on new sessions {MAX_RESENDS} times, each lost; failing it with IOERR",
            );
            done.complete(&mut self.table, head, S_IOERR)?;
        }
        Ok(done.used())
    }

    /// Queues every request in flight for sending on the new session, oldest first
    /// (the credit then lets them go in that order).
    fn queue_resend(&mut self) {
        let n = self.table.requeue_all() as u64;
        self.stats.resent.fetch_add(n, Ordering::Relaxed);
        if n > 0 {
            devlend_fabric::limited!(
                info,
                attachment = %self.name,
                queue = self.index,
                requests = n,
                "resending the requests in flight on the new session",
            );
        }
    }

    /// Reads the reconnect timer's expiry without acting on it (the queue does not run
    /// now; the engine recovers at its next event once it does).
    pub fn clear_timer(&mut self) {
        if let Some(t) = self.timer.as_mut() {
            t.clear();
        }
        // A heartbeat it was armed for is not sent: the next request arms another.
        self.heartbeat_armed = false;
    }

    /// The reconnect timer fired: drains it and tries to recover. Returns whether
    /// used-ring entries were added.
    ///
    /// # Errors
    /// A guest memory error on the used ring.
    pub fn on_timer(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        if let Some(t) = self.timer.as_mut() {
            t.clear();
        }
        let mut used = false;
        if self.conn.is_none() && self.table.inflight() > 0 {
            used |= self.recover(queue, mem)?;
        } else if std::mem::take(&mut self.heartbeat_armed) && self.table.inflight() > 0 {
            // A heartbeat: what the lender's TCP must acknowledge within the path's user
            // timeout, or the socket fails and the queue moves to the next path.
            used |= self.with_link(queue, mem, |link, _, _| link.heartbeat())?;
        }
        // A failback's hold ends when the session it waited on is lost.
        used |= self.fail_back(queue, mem)?;
        self.arm_heartbeat();
        Ok(used)
    }
}

//! A queue's paths to the lender, when it has several: which path its session is on,
//! moving on to the next when the session is lost (a failover, counted), back to its
//! own when that is up again, once what is in flight completes (a failback), and the
//! heartbeats that turn a silent cut into a socket error (`docs/faults.md`, "Paths").

use std::time::{Duration, Instant};

use virtio_queue::Queue;

use super::QueueEngine;
use crate::guest::GuestMemoryRef;
use crate::lender::DisplayChain;

pub use crate::lender::target::{FAILBACK_AFTER, HEARTBEAT_EVERY};

/// How long a busy queue that is due to move back to its own path holds new requests
/// back while those in flight complete (50 ms): the longest pause a failback may cost
/// its guest, besides the new session's open.
pub const FAILBACK_HOLD: Duration = Duration::from_millis(50);

impl QueueEngine {
    /// A session opened on `self.path`; `heartbeat`: it carries heartbeats. Counts a
    /// failover when the session lost before was on another path.
    pub(super) fn opened_on_path(&mut self, heartbeat: bool) {
        self.heartbeat = heartbeat;
        self.heartbeat_armed = false;
        if let Some(p) = self.stats.path(self.path) {
            p.opened();
        }
        self.away_since = (self.path != self.home).then(Instant::now);
        if let Some((since, from)) = self.lost.take() {
            if from != self.path {
                let us = self.stats.failovers.record(since);
                devlend_fabric::limited!(
                    info,
                    attachment = %self.name,
                    queue = self.index,
                    from = %self.target.path_addr(from),
                    to = %self.target.path_addr(self.path),
                    took_us = us,
                    "queue failed over to another path",
                );
            }
        }
    }

    /// The session ends; `failed`: it was lost. With several paths, a lost session's
    /// queue moves on to the next path.
    pub(super) fn close_session(&mut self, failed: bool) {
        if self.conn.take().is_none() {
            return;
        }
        self.conn_gen += 1;
        self.heartbeat_armed = false;
        if let Some(t) = self.timer.as_mut() {
            t.disarm();
        }
        if let Some(p) = self.stats.path(self.path) {
            p.closed(failed);
        }
        if failed && self.target.path_count() > 1 {
            // A failover only when requests wait for it (an idle session's loss is
            // not one the guest could see).
            if self.table.inflight() > 0 {
                self.lost = Some((Instant::now(), self.path));
            }
            self.path = self.next_path(self.path);
        }
    }

    /// Moves the queue back to its own path when it is away from it, has been away
    /// [`FAILBACK_AFTER`] (or that long since a failed try), and its path is up again (a
    /// session of another queue opened on it, or the probe reached it). A session moves
    /// only with nothing in flight: the new session fences this one on the lender, which
    /// then has nothing of it to finish. A busy queue **holds**: it takes no new chain
    /// from the avail ring until what is in flight completes, then moves; if that takes
    /// longer than [`FAILBACK_HOLD`] it stops holding and tries again [`FAILBACK_AFTER`]
    /// later. Returns whether used-ring entries were added (chains held back are taken
    /// once the hold ends).
    ///
    /// # Errors
    /// A guest memory error on the rings.
    pub(super) fn fail_back(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        if self.hold_for_failback() {
            return Ok(false);
        }
        if self.holding.take().is_none() || self.draining {
            // Nothing held back; or a drain, which takes no new chain (they stay on
            // the avail ring for whoever runs the queue next).
            return Ok(false);
        }
        self.process_avail(queue, mem)
    }

    /// Whether the queue holds new chains back for a failback now; moves it back when
    /// it is due and idle.
    fn hold_for_failback(&mut self) -> bool {
        let due = self
            .away_since
            .is_some_and(|t| t.elapsed() >= FAILBACK_AFTER);
        if !due || self.draining || self.stopping || self.conn.is_none() || !self.path_up(self.home)
        {
            return false;
        }
        if self.table.inflight() > 0 {
            let since = *self.holding.get_or_insert_with(Instant::now);
            if since.elapsed() < FAILBACK_HOLD {
                return true;
            }
            // What is in flight takes too long to wait for: tried again later.
            self.away_since = Some(Instant::now());
            devlend_fabric::limited!(
                debug,
                attachment = %self.name,
                queue = self.index,
                inflight = self.table.inflight(),
                "the queue stays away from its own path: its requests in flight did not complete within the failback hold",
            );
            return false;
        }
        // The new session is opened before the one it replaces is closed: a home path
        // that does not take it costs the queue nothing but the attempt.
        match self.open_on(self.home) {
            Ok((link, reply)) => {
                self.close_session(false);
                self.path = self.home;
                self.install(link, reply);
                devlend_fabric::limited!(
                    info,
                    attachment = %self.name,
                    queue = self.index,
                    path = %self.target.path_addr(self.home),
                    "queue moved back to its own path",
                );
            }
            Err(e) => {
                // Tried again a while later.
                self.away_since = Some(Instant::now());
                devlend_fabric::limited!(
                    warn,
                    attachment = %self.name,
                    queue = self.index,
                    path = %self.target.path_addr(self.home),
                    error = %DisplayChain(&e),
                    "cannot move the queue back to its own path; it stays where it is",
                );
            }
        }
        false
    }

    /// Whether new chains stay on the avail ring for now: a failback holds them while
    /// the requests in flight on the session it leaves complete.
    pub(super) fn held(&self) -> bool {
        self.holding.is_some() && self.conn.is_some() && self.table.inflight() > 0
    }

    /// Leaves the path before sending anything on it when another queue found it down
    /// and this one is idle: its own session there would take the user timeout to
    /// fail. The next session opens on the next path (a failover, counted).
    pub(super) fn leave_down_path(&mut self) {
        if self.target.path_count() == 1
            || self.draining
            || self.conn.is_none()
            || self.table.inflight() > 0
            || self.path_up(self.path)
        {
            return;
        }
        let from = self.path;
        self.end_session(false);
        self.path = self.next_path(from);
        self.lost = Some((Instant::now(), from));
    }

    /// The path after `from` to open the next session on: the first after it not
    /// marked down, else simply the next.
    pub(super) fn next_path(&self, from: usize) -> usize {
        self.first_up(from, 1)
            .unwrap_or((from + 1) % self.target.path_count())
    }

    /// The first path not marked down among `from + skip`, `from + skip + 1`, ... up to
    /// the path before `from` (modulo the path count).
    pub(super) fn first_up(&self, from: usize, skip: usize) -> Option<usize> {
        let n = self.target.path_count();
        (skip..n).map(|k| (from + k) % n).find(|&p| self.path_up(p))
    }

    /// Whether path `path` is not marked down (always, with one path).
    pub(super) fn path_up(&self, path: usize) -> bool {
        self.stats.path(path).is_none_or(|p| p.is_up())
    }

    /// With several paths, whether one is not marked down.
    pub(super) fn another_path_up(&self) -> bool {
        self.target.path_count() > 1 && self.stats.paths.iter().any(|p| p.is_up())
    }

    /// Arms the heartbeat when the session has requests in flight and heartbeats.
    pub(super) fn arm_heartbeat(&mut self) {
        if self.heartbeat
            && !self.heartbeat_armed
            && self.conn.is_some()
            && self.table.inflight() > 0
        {
            if let Some(t) = self.timer.as_mut() {
                t.arm(HEARTBEAT_EVERY);
                self.heartbeat_armed = true;
            }
        }
    }
}

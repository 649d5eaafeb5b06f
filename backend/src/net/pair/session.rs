//! A queue pair's fabric session: opening it (on which path, with heartbeats or not),
//! losing it, when to try again, and the heartbeats that check its path.

use std::sync::atomic::Ordering;
use std::time::Instant;

use devlend_fabric::net::{self, FEATURE_NET, FEATURE_NET_OFFLOAD};

use super::recv::count_frames;
use super::{PairEngine, FAILBACK_AFTER, FAILBACK_MAX, HEARTBEAT_EVERY, HOLD};
use crate::lender::DisplayChain;

impl PairEngine {
    /// Opens the fabric session.
    ///
    /// # Errors
    /// The connection or handshake failed, or the lender's device is not a NIC.
    pub fn connect(&mut self) -> Result<(), devlend_fabric::tcp::ConnectError> {
        let r = self.open(true);
        if r.is_err() {
            // The next attempt goes to the next path.
            self.next_path();
        }
        r
    }

    /// Opens the fabric session on [`Self::path`](PairEngine), and keeps the path's
    /// state (several paths): a failure marks it down (a refusal for good, for a
    /// while: [`REFUSED_PATH_RESTS`]; a busy answer says nothing against it); a
    /// session opened after a loss on another path is a failover.
    ///
    /// [`REFUSED_PATH_RESTS`]: crate::lender::path_cell::REFUSED_PATH_RESTS
    ///
    /// `reconnect`: a session after the first counts in `reconnects` (not a move back
    /// to the pair's own path).
    pub(super) fn open(
        &mut self,
        reconnect: bool,
    ) -> Result<(), devlend_fabric::tcp::ConnectError> {
        let opened = self.open_session(reconnect);
        let Some(p) = self.stats.path(self.path) else {
            return opened;
        };
        match &opened {
            Ok(()) => {
                p.opened();
                self.away_since = (self.path != self.home()).then(Instant::now);
                if let Some((since, from)) = self.lost.take() {
                    if from != self.path {
                        self.count_failover(since, from);
                    }
                }
            }
            Err(e) => p.open_failed(e),
        }
        opened
    }

    fn count_failover(&self, since: Instant, from: usize) {
        let us = self.stats.failovers.record(since);
        devlend_fabric::limited!(
            info,
            attachment = %self.name,
            pair = self.index,
            from = %self.target.path_addr(from),
            to = %self.target.path_addr(self.path),
            took_us = us,
            "queue pair failed over to another path",
        );
    }

    fn open_session(&mut self, reconnect: bool) -> Result<(), devlend_fabric::tcp::ConnectError> {
        let mut hello = self.target.hello(self.index);
        hello.features |= FEATURE_NET;
        let (stream, reply) = if self.target.path_count() == 1 {
            (self.opener)(&self.target, &hello)?
        } else {
            (self.opener)(&self.target.on_path(self.path), &hello)?
        };
        let Some(nic) = reply.nic().filter(|_| reply.features & FEATURE_NET != 0) else {
            return Err(devlend_fabric::tcp::ConnectError::Refused {
                addr: self.target.addr.clone(),
                device: self.target.device.clone(),
                status: devlend_fabric::HelloStatus::BadRequest,
                message: "the lender's device is not a network interface".into(),
            });
        };
        let link = nic.link();
        if let Err(e) = stream.set_nonblocking(true) {
            return Err(devlend_fabric::tcp::ConnectError::Connect {
                addr: self.target.addr.clone(),
                source: e,
            });
        }
        if let Err(why) = crate::net::spec::check_link(&link) {
            return Err(devlend_fabric::tcp::ConnectError::Refused {
                addr: self.target.addr.clone(),
                device: self.target.device.clone(),
                status: devlend_fabric::HelloStatus::BadRequest,
                message: format!("the lender's network interface is unusable: {why}"),
            });
        }
        self.offload = reply.features & FEATURE_NET_OFFLOAD != 0;
        self.heartbeat_at = (self.target.path_count() > 1
            && reply.features & devlend_fabric::FEATURE_HEARTBEAT != 0)
            .then(|| Instant::now() + HEARTBEAT_EVERY);
        self.stats.link_up.store(link.up, Ordering::Relaxed);
        self.stats.mtu.store(link.mtu, Ordering::Relaxed);
        if reconnect && self.generation > 0 {
            self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.connected.fetch_add(1, Ordering::Relaxed);
        self.conn = Some(stream);
        self.generation += 1;
        self.have = 0;
        if self.offload {
            // First on the session: what the guest takes (none until it acks any).
            net::encode_offloads(self.accept, &mut self.out);
        }
        // The backoff is reset only once the session has lived (see `lose`): a lender
        // that takes the hello and then fails at once is retried with backoff too.
        self.retry.connected(Instant::now());
        devlend_fabric::limited!(info, attachment = %self.name, pair = self.index, path = %self.target.path_addr(self.path), "fabric session open");
        // The first heartbeat's wake-up.
        self.arm_timer();
        Ok(())
    }

    /// The pair's own path: pairs are spread over the paths, *index mod n*.
    fn home(&self) -> usize {
        usize::from(self.index) % self.target.path_count()
    }

    /// Moves the pair back to its own path when its session has been on another for
    /// [`FAILBACK_AFTER`] (after a failed try, twice as long as before, up to
    /// [`FAILBACK_MAX`]) and its own is up again (a
    /// session of another pair opened on it, or the probe reached it). The new session
    /// opens before the one it replaces is closed (the lender fences that one when the
    /// hello arrives): a home path that does not take it costs the pair the attempt,
    /// nothing more. Frames the lender sent on the old session and the pair had not
    /// read yet are lost, as in a failover.
    pub(super) fn fail_back(&mut self) {
        let home = self.home();
        let due = self
            .away_since
            .is_some_and(|t| t.elapsed() >= self.failback_wait);
        // Not while frames wait to be written: the old session keeps them, whole.
        if !due
            || self.paused
            || self.conn.is_none()
            || !self.out.is_empty()
            || self.path == home
            || !self.stats.path(home).is_some_and(|p| p.is_up())
        {
            return;
        }
        let from = self.path;
        let old = self.conn.take();
        self.path = home;
        match self.open(false) {
            Ok(()) => {
                self.close_replaced(old, from);
                self.failback_wait = FAILBACK_AFTER;
                devlend_fabric::limited!(
                    info,
                    attachment = %self.name,
                    pair = self.index,
                    path = %self.target.path_addr(home),
                    "queue pair moved back to its own path",
                );
            }
            Err(e) => {
                // Tried again a while later, each time later.
                self.away_since = Some(Instant::now());
                self.failback_wait = (self.failback_wait * 2).min(FAILBACK_MAX);
                self.path = from;
                devlend_fabric::limited!(
                    warn,
                    attachment = %self.name,
                    pair = self.index,
                    path = %self.target.path_addr(home),
                    error = %DisplayChain(&e),
                    "cannot move the queue pair back to its own path; it stays where it is",
                );
                if before_hello(&e) {
                    self.conn = old;
                } else {
                    // The lender may have taken the hello, and fenced the old session,
                    // before it refused or the answer was lost: reopened on the path it
                    // was on, as after a loss but without counting one.
                    self.close_replaced(old, from);
                    self.heartbeat_at = None;
                    self.have = 0;
                    self.retry.lost(Instant::now());
                }
            }
        }
    }

    /// Closes `old`, the session on path `from` that a move back replaced (or may
    /// have: [`Self::fail_back`]), as the pair's own doing: no failure counted.
    fn close_replaced(&mut self, old: Option<devlend_fabric::conn::Stream>, from: usize) {
        if old.is_some() {
            drop(old);
            self.stats.disconnected();
            if let Some(p) = self.stats.path(from) {
                p.closed(false);
            }
        }
    }

    /// Moves to the next path (with one, stays).
    fn next_path(&mut self) {
        self.path = (self.path + 1) % self.target.path_count();
    }

    pub(super) fn lose(&mut self, why: &str) {
        if self.conn.take().is_none() {
            return;
        }
        self.heartbeat_at = None;
        if let Some(p) = self.stats.path(self.path) {
            p.closed(true);
        }
        // A new cut: a move back is tried FAILBACK_AFTER after the next session opens.
        self.failback_wait = FAILBACK_AFTER;
        // The first loss, until a session opens again.
        self.lost.get_or_insert((Instant::now(), self.path));
        // With several paths the next session opens on the next one (the lender fences
        // this one when it does).
        self.next_path();
        self.stats.disconnected();
        self.retry.lost(Instant::now());
        tracing::warn!(attachment = %self.name, pair = self.index, reason = why, "fabric session lost; frames are dropped until it is back");
        // Frames queued for the lender are lost with it.
        let dropped = count_frames(&self.out);
        self.pstats().tx_drops.fetch_add(dropped, Ordering::Relaxed);
        self.out.clear();
        self.have = 0;
        self.arm_timer();
    }

    pub(super) fn schedule_retry(&mut self) {
        self.retry.failed(Instant::now());
        self.arm_timer();
    }

    pub(super) fn arm_timer(&mut self) {
        let now = Instant::now();
        let mut next = self.retry.retry_at();
        if let Some(at) = self.heartbeat_at.filter(|_| self.conn.is_some()) {
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        if let Some((t, _, _)) = self.held.front() {
            let expiry = *t + HOLD;
            next = Some(next.map_or(expiry, |n| n.min(expiry)));
        }
        match next {
            Some(at) => self.timer.arm(at.saturating_duration_since(now)),
            None => self.timer.disarm(),
        }
    }

    /// Sends a heartbeat when one is due (several paths): what the lender's TCP must
    /// acknowledge within the path's user timeout, or the session fails and the pair
    /// moves to the next path. Not while frames wait to be written: they are checked
    /// the same way.
    pub(super) fn send_heartbeat(&mut self) {
        let now = Instant::now();
        if self.conn.is_none() {
            self.heartbeat_at = None;
            return;
        }
        if self.heartbeat_at.is_none_or(|at| now < at) {
            return;
        }
        self.heartbeat_at = Some(now + HEARTBEAT_EVERY);
        if self.out.is_empty() {
            net::encode_heartbeat(&mut self.out);
            self.flush();
        }
    }
}

/// Whether the open failed before the hello could reach the lender (so that it cannot
/// have fenced the pair's session on another path): no address, no connection, no TLS
/// session, no relay.
fn before_hello(e: &devlend_fabric::tcp::ConnectError) -> bool {
    use devlend_fabric::tcp::ConnectError as E;
    matches!(
        e,
        E::Resolve { .. } | E::Connect { .. } | E::Tls { .. } | E::Relay { .. }
    )
}

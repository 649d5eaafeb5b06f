//! One virtqueue's requests in flight over one fabric session.
//!
//! The engine is driven by the queue's worker thread: [`QueueEngine::process_avail`] on a
//! guest kick, [`QueueEngine::process_responses`] when the session's fd is readable (or
//! writable, while a send is unfinished), [`QueueEngine::on_timer`] when the reconnect
//! timer fires. It is made of:
//! - the **table** of requests in flight (`table.rs`): slots by head, ids, the order
//!   requests go out in, the session's credit, the inflight-buffer marks;
//! - the **link** (`link.rs`): the open session, a byte stream (`stream.rs`: TCP, TLS)
//!   or RDMA (`rdma.rs`). The engine hands it the table to send what the credit lets go
//!   and to receive responses, which it completes through a [`Completer`]
//!   (`complete.rs`: status byte, counters, used ring);
//! - the **reconnector** ([`devlend_fabric::reconnect`]): when to try a lost session
//!   again, and when the requests waiting for it are given up.
//!
//! This file holds the engine's state, its public calls and the paths to the link;
//! `engine/chain.rs` turns popped chains into requests (and resubmits what an earlier
//! backend left in flight); `engine/recover.rs` loses and regains the session;
//! `engine/paths.rs` moves it between the lender's paths when it has several, and paces
//! their heartbeats; `engine/drain.rs` waits for what is in flight before the frontend
//! takes the virtqueue back; `engine/tests.rs` drives it through a fake lender
//! (`fake_link.rs`).
//!
//! **A lost session costs the guest a delay, not an error.** When the connection fails
//! (the lender restarts, the network drops it), the requests in flight stay in their
//! slots; the engine reconnects with backoff (100 ms doubling to 2 s, driven by the
//! queue's [`RetryTimer`]) and resends every one of them, in submission order, on the
//! new session. Requests the guest submits meanwhile wait with them. Replaying is safe:
//! a request is completed to the guest only once the lender has answered it, so no
//! acknowledged write depends on a resend, and writing the same data again at the same
//! sectors leaves the device as the guest expects (virtio-blk orders nothing between
//! requests in flight at once). Only when the session is not back within the deadline
//! ([`DEFAULT_RECONNECT_DEADLINE`], configurable) do the waiting requests complete with
//! IOERR. A lender that refuses the session for good (denied, no such device) fails
//! them at once.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::ratelimit::RateLimit;
use devlend_fabric::reconnect::{Policy, Reconnector};
use devlend_fabric::tcp::ConnectError;
use devlend_fabric::{Credit, HelloReply};
use virtio_queue::{Queue, QueueT};

use crate::blk::complete::Completer;
use crate::blk::inflight::InflightQueue;
use crate::blk::link::{FabricFault, QueueLink};
use crate::blk::request::{DeviceLimits, Scratch};
use crate::blk::stream::StreamLink;
use crate::blk::table::RequestTable;
use crate::guest::{GuestMemoryRef, HostIov};
use crate::lender::{DisplayChain, LenderTarget, RetryTimer, Transport};

pub use crate::blk::stats::{QueueStats, StatsSnapshot};
pub use paths::{FAILBACK_AFTER, FAILBACK_HOLD, HEARTBEAT_EVERY};

/// The state of one virtqueue of one attachment.
pub struct QueueEngine {
    /// The attachment's id, for logs.
    name: Arc<str>,
    index: u16,
    target: LenderTarget,
    limits: Arc<DeviceLimits>,
    stats: Arc<QueueStats>,
    /// Opens a session ([`open_link`]; a fake lender's in unit tests).
    opener: LinkOpener,
    /// The open session, if any.
    conn: Option<Box<dyn QueueLink>>,
    conn_gen: u64,
    /// The requests in flight, their order, the session's credit, the inflight log.
    table: RequestTable,
    scratch: Scratch,
    iov_tmp: Vec<HostIov>,
    stopping: bool,
    /// When to reconnect, and when waiting requests are given up.
    retry: Reconnector,
    /// When a reconnect failure was last logged.
    failure_logged: Option<Instant>,
    /// When requests were last failed at the deadline (for the log's rate limit).
    give_up_logged: Option<Instant>,
    /// Wakes the worker for the next reconnect attempt.
    timer: Option<RetryTimer>,
    /// The agent stops to be restarted: a drain leaves what cannot complete in time to
    /// the next backend (see [`Self::set_handoff`]).
    handoff: bool,
    /// Why the driver broke this virtqueue, once it did: nothing more is taken from its
    /// avail ring until the frontend re-initializes it ([`Self::reset_broken`]).
    broken: Option<String>,
    /// The queue broke since the last [`Self::take_newly_broken`].
    newly_broken: bool,
    /// The path the session is on, or the next is opened on (of
    /// [`LenderTarget::path_count`]).
    path: usize,
    /// The path this queue belongs on while it is up: queues spread over the paths.
    home: usize,
    /// Connects refused for good in a row (with several paths, on as many paths).
    refused_in_row: usize,
    /// A drain runs: the queue does not change paths.
    draining: bool,
    /// When the session last opened away from `home`.
    away_since: Option<Instant>,
    /// Since when a failback waits for the requests in flight to complete: no chain is
    /// taken from the avail ring meanwhile, for at most [`FAILBACK_HOLD`]
    /// (`engine/paths.rs`).
    holding: Option<Instant>,
    /// With several paths: when the session was lost, and on which path, until a new
    /// one opens (a failover, when on another path).
    lost: Option<(Instant, usize)>,
    /// The session was granted heartbeats: while requests are in flight, one goes out
    /// every [`HEARTBEAT_EVERY`] (the reconnect timer, unused while connected, paces
    /// them).
    heartbeat: bool,
    /// The timer is armed for the next heartbeat.
    heartbeat_armed: bool,
}

/// How long requests wait for a lost fabric session to come back before they complete
/// with IOERR (30 s).
pub const DEFAULT_RECONNECT_DEADLINE: Duration = Duration::from_secs(30);

/// Most times a request is resent on a new session; at the next loss it fails.
pub const MAX_RESENDS: u32 = 8;

/// Reconnects: 100 ms doubling to 2 s; every session that opened resets the backoff,
/// no attempt sooner than 100 ms after the last session opened.
const RETRY: Policy = Policy::backoff(Duration::from_millis(100), Duration::from_secs(2))
    .deadline(DEFAULT_RECONNECT_DEADLINE);

mod chain;
mod drain;
mod paths;
mod recover;
#[cfg(test)]
mod tests;

/// How an engine opens its queue's session: the seam where unit tests put a fake link.
type LinkOpener = Box<
    dyn FnMut(&LenderTarget, u16) -> Result<(Box<dyn QueueLink>, HelloReply), ConnectError> + Send,
>;

// SAFETY: the raw pointers inside (iovec bases, in the table's slots and the link's
// receive state) point into guest memory mappings kept alive by the `Arc`s in the
// slots, or into buffers owned by the engine and its link; the link's handles (a
// socket, an RDMA queue pair and its registrations, a unit test's fake) are not tied
// to a thread. The engine
// is used by one thread at a time (it lives behind a Mutex).
unsafe impl Send for QueueEngine {}

impl Drop for QueueEngine {
    fn drop(&mut self) {
        // Its session leaves its path's count (a new backend per frontend connection
        // starts its own).
        self.close_session(false);
    }
}

/// Opens a session for virtqueue `index` of `target` on its transport.
fn open_link(
    target: &LenderTarget,
    index: u16,
) -> Result<(Box<dyn QueueLink>, HelloReply), ConnectError> {
    match target.transport {
        Transport::Tcp { .. } => {
            let (link, reply) = StreamLink::open(target, index)?;
            Ok((Box::new(link), reply))
        }
        #[cfg(feature = "rdma")]
        Transport::Rdma { exposure } => {
            let (link, reply) = crate::blk::rdma::RdmaLink::connect(target, index, exposure)?;
            Ok((Box::new(link), reply))
        }
        #[cfg(not(feature = "rdma"))]
        Transport::Rdma { .. } => Err(ConnectError::Rdma {
            addr: target.addr.clone(),
            source: devlend_fabric::rdma::RdmaError::NotCompiled,
        }),
    }
}

/// Checks that the target's transport can open a queue session: for RDMA, opens one
/// for queue 0 and closes it; for TCP, nothing (the holding session proved it).
///
/// # Errors
/// Why a session cannot be opened (RDMA not compiled in, no device, no route, ...).
pub fn probe_transport(target: &LenderTarget) -> Result<(), ConnectError> {
    match target.transport {
        Transport::Tcp { .. } => Ok(()),
        Transport::Rdma { .. } => open_link(target, 0).map(drop),
    }
}

impl QueueEngine {
    /// A disconnected engine for virtqueue `index`; [`Self::connect`] opens the session.
    pub fn new(
        index: u16,
        target: LenderTarget,
        limits: Arc<DeviceLimits>,
        stats: Arc<QueueStats>,
    ) -> Self {
        QueueEngine {
            name: Arc::from(""),
            index,
            limits,
            stats,
            opener: Box::new(open_link),
            conn: None,
            conn_gen: 0,
            table: RequestTable::default(),
            scratch: Scratch::default(),
            iov_tmp: Vec::new(),
            stopping: false,
            retry: Reconnector::new(RETRY),
            failure_logged: None,
            give_up_logged: None,
            timer: match RetryTimer::new() {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!(queue = index, error = %e, "no reconnect timer: a lost session is retried only when the guest submits");
                    None
                }
            },
            handoff: false,
            broken: None,
            newly_broken: false,
            // Queues start spread over the paths (all of them used while all are up).
            path: usize::from(index) % target.path_count(),
            home: usize::from(index) % target.path_count(),
            away_since: None,
            holding: None,
            refused_in_row: 0,
            draining: false,
            lost: None,
            heartbeat: false,
            heartbeat_armed: false,
            target,
        }
    }

    /// Sets how long requests wait for a lost session (default
    /// [`DEFAULT_RECONNECT_DEADLINE`]); zero fails them as soon as it is lost.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.retry.set_deadline(Some(deadline));
        self
    }

    /// The reconnect timer's fd, to watch for readability in the worker's epoll set
    /// (then call [`Self::on_timer`]).
    pub fn timer_fd(&self) -> Option<RawFd> {
        self.timer.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Names the attachment this queue belongs to, for logs.
    pub fn named(mut self, name: Arc<str>) -> Self {
        self.name = name;
        self
    }

    /// Opens the fabric session to the lender for this queue (TCP connect, TLS if the
    /// target asks for it, handshake; or RDMA).
    ///
    /// With several paths it starts at the queue's path, or at the first path after it
    /// not marked down when its own is, and tries each path not marked down once, in
    /// order, until one takes the session: a path that fails (and is marked down) costs
    /// one connect timeout, never one per queue. When every path is marked down it tries
    /// the one path it is at. Permanent refusals are counted in
    /// [`Self::refused_in_row`](QueueEngine) across calls.
    ///
    /// # Errors
    /// The connect error of the last path tried, or a device whose capacity changed
    /// since attach.
    pub fn connect(&mut self) -> Result<(), ConnectError> {
        let n = self.target.path_count();
        if let Some(up) = self.first_up(self.path, 0) {
            self.path = up;
        }
        let mut tried = 0;
        loop {
            tried += 1;
            match self.open_on(self.path) {
                Ok((link, reply)) => {
                    self.refused_in_row = 0;
                    self.install(link, reply);
                    return Ok(());
                }
                Err(e) => {
                    self.refused_in_row = if e.is_permanent() {
                        self.refused_in_row + 1
                    } else {
                        0
                    };
                    // The next attempt goes to the next path.
                    self.path = self.next_path(self.path);
                    if tried >= n || !self.path_up(self.path) {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Opens a session for this queue on path `path` (marked down if that fails).
    fn open_on(&mut self, path: usize) -> Result<(Box<dyn QueueLink>, HelloReply), ConnectError> {
        let opened = if self.target.path_count() == 1 {
            (self.opener)(&self.target, self.index)
        } else {
            (self.opener)(&self.target.on_path(path), self.index)
        };
        if let (Err(e), Some(p)) = (&opened, self.stats.path(path)) {
            p.open_failed(e);
        }
        opened
    }

    /// Makes `link`, just opened on `self.path`, the queue's session.
    fn install(&mut self, link: Box<dyn QueueLink>, reply: HelloReply) {
        // A lender of before credit states none: the link knows what it can take.
        let credit = reply.credit.unwrap_or_else(|| link.default_credit());
        self.table.new_session(credit);
        let now = reply.block().map_or(0, |g| g.capacity_sectors);
        if now != self.limits.capacity_sectors {
            tracing::warn!(
                attachment = %self.name,
                queue = self.index,
                was = self.limits.capacity_sectors,
                now,
                "lent device changed capacity; requests are still checked against the old one",
            );
        }
        self.conn = Some(link);
        self.conn_gen += 1;
        self.retry.connected(Instant::now());
        let multipath = self.target.path_count() > 1;
        self.opened_on_path(multipath && reply.features & devlend_fabric::FEATURE_HEARTBEAT != 0);
    }

    /// Closes the queue's session if no request is in flight (a live migration's
    /// handover, [`crate::handover`]): the next request opens a new one.
    pub fn let_go(&mut self) {
        if self.table.inflight() == 0 {
            self.close_session(false);
        }
    }

    /// The fabric socket to watch for readability, and a generation number that changes
    /// whenever the connection is replaced (the socket number alone may be reused).
    pub fn fabric_fd(&self) -> (Option<RawFd>, u64) {
        (self.conn.as_ref().map(|l| l.fd()), self.conn_gen)
    }

    /// Requests taken from the guest and not yet completed (sent to the lender, or
    /// waiting for the session or its credit).
    pub fn inflight(&self) -> usize {
        self.table.inflight()
    }

    /// Whether the session's socket is full with requests still to write: the worker
    /// then watches it for writability too, and calls [`Self::process_responses`] when
    /// it is.
    pub fn wants_write(&self) -> bool {
        self.conn.as_ref().is_some_and(|l| l.wants_write())
    }

    /// The session's credit (what the lender stated, or the default for one that did
    /// not).
    pub fn credit(&self) -> Credit {
        self.table.credit()
    }

    /// Tracks this queue's chains in `log` from now on (SET_INFLIGHT_FD). Before the
    /// next chain is popped, the chains it lists as left in flight by an earlier backend
    /// are resubmitted ([`InflightQueue::recover`]).
    pub fn set_inflight_log(&mut self, log: Option<InflightQueue>) {
        if self.table.inflight() > 0 && log.is_some() {
            tracing::warn!(
                attachment = %self.name,
                queue = self.index,
                inflight = self.table.inflight(),
                "inflight buffer replaced while requests are in flight; they are not tracked in the new one",
            );
        }
        self.table.set_log(log);
    }

    /// The compute agent stops to be restarted: from now on a drain does not fail the
    /// requests that cannot complete (their session is lost, or the drain's time is up)
    /// but leaves them marked in the inflight buffer, for the next backend to resubmit
    /// (SIGKILL leaves them the same way). Without an inflight buffer (the frontend does
    /// not track inflight I/O) they still fail, since nobody would resubmit them.
    pub fn set_handoff(&mut self) {
        self.handoff = true;
    }

    /// vhost-user handed over a new memory map (SET_MEM_TABLE, ADD_MEM_REG,
    /// REM_MEM_REG): over RDMA, registers its new regions on the session at once and
    /// drops the registrations of regions that neither it nor a request in flight uses
    /// (`docs/protocol.md`, memory-region lifetime). Nothing to do over TCP. A failed
    /// registration is logged; the next request then retries it, and drops the session
    /// if it fails again.
    pub fn memory_changed(&mut self, mem: &GuestMemoryRef) {
        if let Some(link) = self.conn.as_mut() {
            if let Err(e) = link.memory_changed(mem, &self.table) {
                tracing::warn!(
                    attachment = %self.name,
                    queue = self.index,
                    error = %DisplayChain(&e),
                    "cannot register the new guest memory for RDMA",
                );
            }
        }
    }

    /// Stops taking new chains from the avail ring (detach in progress); chains already
    /// in flight still complete.
    pub fn set_stopping(&mut self) {
        self.stopping = true;
    }

    /// The driver broke the virtqueue (`reason`): stop taking chains from it, and log
    /// it once. Requests already in flight still complete. The caller tells the frontend
    /// ([`Self::take_newly_broken`]); the queue is used again only after the frontend
    /// re-initializes it (GET_VRING_BASE, [`Self::reset_broken`]), as virtio 1.2 §2.1.2
    /// has a device that needs a reset wait for one.
    pub fn break_queue(&mut self, reason: String) {
        if self.broken.is_some() {
            return;
        }
        // A frontend that re-initializes the queue and lets it break again, in a loop,
        // reaches this as often as it likes: rate-limited, with what was left out.
        static BROKE: RateLimit = RateLimit::new(5, Duration::from_secs(10));
        if let Some(suppressed) = BROKE.check() {
            tracing::warn!(
                attachment = %self.name,
                queue = self.index,
                %reason,
                inflight = self.table.inflight(),
                suppressed,
                "the driver broke this virtqueue; it is stopped until the frontend re-initializes it (logged at most 5 times every 10 s)",
            );
        }
        self.broken = Some(reason);
        self.newly_broken = true;
    }

    /// Whether the queue is stopped because the driver broke it.
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// Whether the queue broke since the last call (the frontend is then to be told).
    pub fn take_newly_broken(&mut self) -> bool {
        std::mem::take(&mut self.newly_broken)
    }

    /// The frontend stopped the queue (GET_VRING_BASE): whatever broke it is gone with
    /// its next initialization.
    pub fn reset_broken(&mut self) {
        if let Some(reason) = self.broken.take() {
            static RESET: RateLimit = RateLimit::new(5, Duration::from_secs(10));
            if let Some(suppressed) = RESET.check() {
                tracing::info!(
                    attachment = %self.name,
                    queue = self.index,
                    was = %reason,
                    suppressed,
                    "virtqueue stopped by the frontend; it is served again once re-initialized (logged at most 5 times every 10 s)",
                );
            }
        }
        self.newly_broken = false;
    }

    /// Pops every available chain, completes the invalid ones and sends the rest to the
    /// lender in one batch. Loops with notifications re-enabled so that no kick is lost
    /// (EVENT_IDX). Returns whether used-ring entries were added (the caller then checks
    /// `needs_notification` and signals the guest).
    ///
    /// # Errors
    /// A guest memory error on the rings themselves (the queue is then unusable).
    pub fn process_avail(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = false;
        if self.stopping || self.broken.is_some() || self.held() {
            return Ok(false);
        }
        self.table.fit(queue.size());
        self.leave_down_path();
        if self.table.log_unread() {
            used |= self.resubmit(queue, mem)?;
        }
        loop {
            queue.disable_notification(mem.as_ref())?;
            if let Some(reason) = crate::virtq::avail_violation(queue, mem.as_ref())? {
                self.break_queue(reason);
                return Ok(used | self.flush_tx(queue, mem)?);
            }
            while let Some(chain) = queue.pop_descriptor_chain(mem.as_ref()) {
                let head = chain.head_index();
                // A chain that virtio-queue would walk truncated (a loop, a `next` or a
                // buffer outside the table or memory, a bad indirect table) is a
                // corrupt queue, as in the NIC's queues, not a malformed request.
                if let Some(reason) = crate::virtq::head_violation(queue, head)
                    .or_else(|| crate::virtq::chain_violation(queue, mem.as_ref(), head))
                {
                    // Not taken: GET_VRING_BASE names this chain as the next.
                    queue.set_next_avail(queue.next_avail().wrapping_sub(1));
                    self.break_queue(reason);
                    return Ok(used | self.flush_tx(queue, mem)?);
                }
                used |= self.take_chain(queue, mem, chain)?;
            }
            used |= self.flush_tx(queue, mem)?;
            if !queue.enable_notification(mem.as_ref())? {
                break;
            }
        }
        if self.conn.is_none() && self.table.inflight() > 0 {
            used |= self.recover(queue, mem)?;
        }
        self.arm_heartbeat();
        Ok(used)
    }

    /// Runs `op` on the open link with the table and a completer; a fault drops the
    /// session ([`Self::fail_connection`]). Returns whether used-ring entries were
    /// added.
    fn with_link(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        op: impl FnOnce(
            &mut dyn QueueLink,
            &mut RequestTable,
            &mut Completer<'_>,
        ) -> Result<(), FabricFault>,
    ) -> Result<bool, virtio_queue::Error> {
        let Some(link) = self.conn.as_deref_mut() else {
            return Ok(false);
        };
        let mut done = Completer::new(queue, mem, &self.stats, self.index);
        let result = op(link, &mut self.table, &mut done);
        let used = done.used();
        match result {
            Ok(()) => Ok(used),
            Err(FabricFault::Ring(e)) => Err(e),
            Err(fault) => Ok(self.fail_connection(queue, mem, fault)? | used),
        }
    }

    /// Sends what the credit lets go, and what the link could not send before
    /// ([`QueueLink::send`]; the rest goes when the socket is writable:
    /// [`Self::wants_write`]).
    fn flush_tx(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        self.with_link(queue, mem, |link, table, done| link.send(table, done))
    }

    /// The session is readable or writable: receives every response that has arrived,
    /// completing requests into the used ring, then sends what the credit they returned
    /// lets go and what the socket did not take before. Returns whether used-ring
    /// entries were added.
    ///
    /// # Errors
    /// A guest memory error on the used ring.
    pub fn process_responses(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = self.with_link(queue, mem, |link, table, done| link.receive(table, done))?;
        if self
            .conn
            .as_ref()
            .is_some_and(|l| self.table.has_waiting() || l.unsent())
        {
            used |= self.flush_tx(queue, mem)?;
        }
        used |= self.fail_back(queue, mem)?;
        self.arm_heartbeat();
        Ok(used)
    }
}

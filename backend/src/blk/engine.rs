//! One virtqueue's requests in flight over one fabric connection.
//!
//! The engine is driven by the queue's worker thread: [`QueueEngine::process_avail`] on a
//! guest kick, [`QueueEngine::process_responses`] when the fabric socket is readable. A
//! batch of chains popped from the avail ring goes out in one vectored write (headers and
//! guest data buffers, no copy); responses are received with vectored reads straight into
//! the guest buffers of the request they complete. Request ids carry the chain's head
//! index in their low 16 bits, so the table of requests in flight is indexed by head and
//! needs no allocation per request.
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

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::ratelimit::RateLimit;
use devlend_fabric::wire::{
    RequestHeader, ResponseHeader, FLAG_UNMAP, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN,
};
use devlend_fabric::{Credit, HelloStatus, Op, Status};
use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;

use crate::blk::inflight::InflightQueue;
use crate::blk::request::{parse, DeviceLimits, Disposition, Request, Scratch};
use crate::blk::resubmit::ResubmitRing;
use crate::blk::spec::{S_IOERR, S_OK, S_UNSUPP};
pub use crate::blk::stats::{QueueStats, StatsSnapshot};
use crate::blk::table::{NewRequest, RequestTable};
pub use crate::blk::target::{
    new_borrower_id, probe_transport, LenderTarget, Transport, CONNECT_TIMEOUT,
};
use crate::blk::tcp::recv_vectored_nonblocking;
use crate::blk::timer::RetryTimer;
use crate::blk::tx::TxQueue;
use crate::guest::{GuestMemory, GuestMemoryRef, HostIov};

/// Receive progress on the fabric connection.
#[derive(Debug, Clone, Copy)]
enum Rx {
    /// `got` bytes of the next response headers are in `rx_hdr`.
    Header { got: usize },
    /// `got` payload bytes of the read in slot `head` have landed in guest memory.
    Payload { head: u16, got: usize },
}

/// Most response headers received in one call (when no read is in flight, responses
/// carry no data, so the stream is headers only).
const RX_HEADERS: usize = 64;

/// Where the bytes of the last receive went, beyond what [`Rx`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxLayout {
    /// Into `rx_hdr` only.
    Headers,
    /// A header into `rx_hdr`, then the data of the read in this slot, the only request
    /// in flight (nothing else can follow its response).
    HeaderThenData(u16),
    /// The rest of a read's data, then the next header into `rx_hdr`.
    DataThenHeader,
}

/// Why the fabric connection was dropped.
#[derive(Debug, thiserror::Error)]
enum FabricFault {
    #[error("lender closed the connection")]
    Closed,
    #[error("fabric I/O failed")]
    Io(#[source] io::Error),
    #[error("malformed response")]
    Wire(#[source] devlend_fabric::WireError),
    #[error("response for request {0:#x}, which is not in flight")]
    UnknownId(u64),
    #[error("response length {got} where {want} was expected")]
    BadLength { got: u32, want: u32 },
    #[error("bytes after a response that has no data, where no response was due")]
    Misframed,
    #[error("RDMA transport")]
    Rdma(#[source] devlend_fabric::rdma::RdmaError),
    /// Not a fabric fault: the guest's used ring is not in guest memory.
    #[error("used ring inaccessible")]
    Ring(#[source] virtio_queue::Error),
}

/// The state of one virtqueue of one attachment.
pub struct QueueEngine {
    /// The attachment's id, for logs.
    name: Arc<str>,
    index: u16,
    target: LenderTarget,
    limits: Arc<DeviceLimits>,
    stats: Arc<QueueStats>,
    conn: Option<Link>,
    conn_gen: u64,
    /// The requests in flight, their order and the session's credit.
    table: RequestTable,
    scratch: Scratch,
    iov_tmp: Vec<HostIov>,
    tx_headers: Vec<[u8; REQUEST_HEADER_LEN]>,
    tx_heads: Vec<(u16, bool)>,
    /// Requests written or waiting to be written on a stream session.
    tx: TxQueue,
    rx: Rx,
    rx_layout: RxLayout,
    rx_hdr: Box<[u8; RESPONSE_HEADER_LEN * RX_HEADERS]>,
    rx_iovs: Vec<libc::iovec>,
    /// Response headers taken from RDMA receives, reused between calls.
    #[cfg(feature = "rdma")]
    rdma_rx: Vec<[u8; RESPONSE_HEADER_LEN]>,
    stopping: bool,
    /// Set while requests fail because of the fabric (for the error counters).
    failing: bool,
    /// No reconnect attempt before this instant.
    retry_at: Option<Instant>,
    /// Current reconnect backoff.
    backoff: Duration,
    /// When a reconnect failure was last logged.
    failure_logged: Option<Instant>,
    /// When the session was lost with requests waiting for it; `None` while connected
    /// or idle.
    lost_at: Option<Instant>,
    /// How long requests wait for a lost session before they fail.
    deadline: Duration,
    /// When requests were last failed at the deadline (for the log's rate limit).
    give_up_logged: Option<Instant>,
    /// Wakes the worker for the next reconnect attempt.
    timer: Option<RetryTimer>,
    /// This queue's part of the inflight buffer (INFLIGHT_SHMFD), when the frontend
    /// gave one: chains are marked there from pop to used-ring return.
    log: Option<InflightQueue>,
    /// The agent stops to be restarted: a drain leaves what cannot complete in time to
    /// the next backend (see [`Self::set_handoff`]).
    handoff: bool,
    /// Why the driver broke this virtqueue, once it did: nothing more is taken from its
    /// avail ring until the frontend re-initializes it ([`Self::reset_broken`]).
    broken: Option<String>,
    /// The queue broke since the last [`Self::take_newly_broken`].
    newly_broken: bool,
}

/// A queue's open fabric session.
enum Link {
    /// A byte stream (TCP, or the plaintext end of a TLS pump).
    Stream(devlend_fabric::conn::Stream),
    /// An RDMA queue pair with the guest memory registered on it.
    #[cfg(feature = "rdma")]
    Rdma(Box<crate::blk::rdma::RdmaLink>),
}

impl Link {
    fn fd(&self) -> RawFd {
        match self {
            Link::Stream(s) => s.as_raw_fd(),
            #[cfg(feature = "rdma")]
            Link::Rdma(r) => r.fd(),
        }
    }
}

/// How long requests wait for a lost fabric session to come back before they complete
/// with IOERR (30 s).
pub const DEFAULT_RECONNECT_DEADLINE: Duration = Duration::from_secs(30);

/// What a reconnect attempt came to.
enum Reconnect {
    Connected,
    /// Not now (backoff) or failed for now: try again later.
    Later,
    /// The lender refuses this borrower for good (denied, no such device, ...).
    Refused,
}

/// Most times a request is resent on a new session; at the next loss it fails.
pub const MAX_RESENDS: u32 = 8;

/// First reconnect backoff.
const RETRY_MIN: Duration = Duration::from_millis(100);
/// Longest reconnect backoff.
const RETRY_MAX: Duration = Duration::from_secs(2);
/// Reconnect failures are logged at most this often per queue.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(10);

// SAFETY: the raw pointers inside (iovec bases) point into guest memory mappings kept
// alive by the `Arc`s in the slots, or into buffers owned by the engine itself; the
// engine is used by one thread at a time (it lives behind a Mutex).
unsafe impl Send for QueueEngine {}

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
            target,
            limits,
            stats,
            conn: None,
            conn_gen: 0,
            table: RequestTable::default(),
            scratch: Scratch::default(),
            iov_tmp: Vec::new(),
            tx_headers: Vec::new(),
            tx_heads: Vec::new(),
            tx: TxQueue::default(),
            rx: Rx::Header { got: 0 },
            rx_layout: RxLayout::Headers,
            rx_hdr: Box::new([0; RESPONSE_HEADER_LEN * RX_HEADERS]),
            rx_iovs: Vec::new(),
            #[cfg(feature = "rdma")]
            rdma_rx: Vec::new(),
            stopping: false,
            failing: false,
            retry_at: None,
            backoff: RETRY_MIN,
            failure_logged: None,
            lost_at: None,
            deadline: DEFAULT_RECONNECT_DEADLINE,
            give_up_logged: None,
            timer: match RetryTimer::new() {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!(queue = index, error = %e, "no reconnect timer: a lost session is retried only when the guest submits");
                    None
                }
            },
            log: None,
            handoff: false,
            broken: None,
            newly_broken: false,
        }
    }

    /// Sets how long requests wait for a lost session (default
    /// [`DEFAULT_RECONNECT_DEADLINE`]); zero fails them as soon as it is lost.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
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
    /// target asks for it, handshake).
    ///
    /// # Errors
    /// The connect error, or a device whose capacity changed since attach.
    pub fn connect(&mut self) -> Result<(), devlend_fabric::tcp::ConnectError> {
        let (link, reply) = match self.target.transport {
            Transport::Tcp => {
                let (stream, reply) = self.target.open(&self.target.hello(self.index))?;
                (Link::Stream(stream), reply)
            }
            Transport::Rdma => self.connect_rdma()?,
        };
        let credit = match (&link, reply.credit) {
            (_, Some(c)) => c,
            // A lender of before credit stops reading beyond this: staying within it
            // keeps that lender reading too.
            (Link::Stream(_), None) => Credit::V1_DEFAULT,
            // Over RDMA the lender has a receive buffer posted for every request a
            // virtqueue can have outstanding.
            #[cfg(feature = "rdma")]
            (Link::Rdma(_), None) => Credit {
                requests: devlend_fabric::rdma::RECV_DEPTH as u32,
                bytes: u32::MAX,
            },
        };
        self.table.new_session(credit);
        self.tx.clear();
        if reply.device.capacity_sectors != self.limits.capacity_sectors {
            tracing::warn!(
                attachment = %self.name,
                queue = self.index,
                was = self.limits.capacity_sectors,
                now = reply.device.capacity_sectors,
                "lent device changed capacity; requests are still checked against the old one",
            );
        }
        self.conn = Some(link);
        self.conn_gen += 1;
        self.rx = Rx::Header { got: 0 };
        Ok(())
    }

    #[cfg(feature = "rdma")]
    fn connect_rdma(
        &mut self,
    ) -> Result<(Link, devlend_fabric::HelloReply), devlend_fabric::tcp::ConnectError> {
        let (link, reply) = crate::blk::rdma::RdmaLink::connect(&self.target, self.index)?;
        Ok((Link::Rdma(Box::new(link)), reply))
    }

    #[cfg(not(feature = "rdma"))]
    fn connect_rdma(
        &mut self,
    ) -> Result<(Link, devlend_fabric::HelloReply), devlend_fabric::tcp::ConnectError> {
        Err(devlend_fabric::tcp::ConnectError::Rdma {
            addr: self.target.addr.clone(),
            source: devlend_fabric::rdma::RdmaError::NotCompiled,
        })
    }

    /// The fabric socket to watch for readability, and a generation number that changes
    /// whenever the connection is replaced (the socket number alone may be reused).
    pub fn fabric_fd(&self) -> (Option<RawFd>, u64) {
        (self.conn.as_ref().map(Link::fd), self.conn_gen)
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
        self.conn.is_some() && self.tx.blocked()
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
        self.log = log;
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
        #[cfg(feature = "rdma")]
        if let Some(Link::Rdma(link)) = self.conn.as_mut() {
            if let Err(e) = link.memory_changed(mem, self.table.busy_mems()) {
                tracing::warn!(
                    attachment = %self.name,
                    queue = self.index,
                    error = %DisplayChain(&e),
                    "cannot register the new guest memory for RDMA",
                );
            }
        }
        #[cfg(not(feature = "rdma"))]
        let _ = mem;
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
        tracing::warn!(
            attachment = %self.name,
            queue = self.index,
            %reason,
            inflight = self.table.inflight(),
            "the driver broke this virtqueue; it is stopped until the frontend re-initializes it",
        );
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
            tracing::info!(
                attachment = %self.name,
                queue = self.index,
                was = %reason,
                "virtqueue stopped by the frontend; it is served again once re-initialized",
            );
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
        if self.stopping || self.broken.is_some() {
            return Ok(false);
        }
        self.table.fit(queue.size());
        if self.log.as_ref().is_some_and(|l| !l.checked()) {
            used |= self.resubmit(queue, mem)?;
        }
        loop {
            queue.disable_notification(mem.as_ref())?;
            if let Some(reason) = crate::virtq::avail_violation(queue, mem.as_ref())? {
                self.break_queue(reason);
                return Ok(used | self.flush_tx(queue, mem)?);
            }
            while let Some(chain) = queue.pop_descriptor_chain(mem.as_ref()) {
                if chain.head_index() >= queue.size() {
                    self.break_queue(format!(
                        "head index {} in the avail ring, past the queue size {}",
                        chain.head_index(),
                        queue.size()
                    ));
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
        Ok(used)
    }

    /// Resubmits the chains an earlier backend left in flight, as the inflight buffer
    /// lists them, in the order they were popped; the avail ring then goes on after
    /// them (its index restarts at the used index plus their number). Returns whether
    /// used-ring entries were added.
    fn resubmit(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        let guest_used = queue
            .used_idx(mem.as_ref(), std::sync::atomic::Ordering::Acquire)?
            .0;
        let Some(log) = self.log.as_mut() else {
            return Ok(false);
        };
        let heads = log.recover(guest_used, queue.size());
        if heads.is_empty() {
            return Ok(false);
        }
        queue.set_next_avail(guest_used.wrapping_add(heads.len() as u16));
        queue.set_next_used(guest_used);
        let Some(mut ring) = ResubmitRing::new(mem, queue, &heads) else {
            tracing::error!(
                attachment = %self.name,
                queue = self.index,
                requests = heads.len(),
                "cannot rebuild the chains left in flight; the guest's requests on them stay pending",
            );
            return Ok(false);
        };
        tracing::info!(
            attachment = %self.name,
            queue = self.index,
            requests = heads.len(),
            "resubmitting the requests an earlier backend left in flight",
        );
        self.stats
            .resubmitted
            .fetch_add(heads.len() as u64, Ordering::Relaxed);
        let mut used = false;
        while let Some(chain) = ring.queue.pop_descriptor_chain(&ring.mem) {
            used |= self.take_chain(queue, mem, chain)?;
        }
        used |= self.flush_tx(queue, mem)?;
        Ok(used)
    }

    /// Returns `head` to the used ring with `len` bytes written, keeping the inflight
    /// buffer in step (virtio 1.2 §2.7.8).
    fn put_used(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemory,
        head: u16,
        len: u32,
    ) -> Result<(), virtio_queue::Error> {
        if let Some(l) = self.log.as_mut() {
            l.before_used(head);
        }
        queue.add_used(mem, head, len)?;
        if let Some(l) = self.log.as_mut() {
            l.after_used(head, queue.next_used());
        }
        Ok(())
    }

    fn take_chain(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        chain: virtio_queue::DescriptorChain<&GuestMemory>,
    ) -> Result<bool, virtio_queue::Error> {
        if let Some(l) = self.log.as_mut() {
            l.mark(chain.head_index());
        }
        let parsed = parse(
            chain,
            mem,
            &self.limits,
            &mut self.scratch,
            &mut self.iov_tmp,
        );
        let head = parsed.head;
        match parsed.disposition {
            Disposition::NoStatus => {
                self.put_used(queue, mem, head, 0)?;
                self.stats.local.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Disposition::Complete { status, written } => {
                // The status address was checked to be in guest memory by `parse`.
                let _ = mem.write_obj(status, parsed.status_addr);
                self.put_used(queue, mem, head, written + 1)?;
                self.stats.local.fetch_add(1, Ordering::Relaxed);
                if status != S_OK {
                    self.stats.errors_invalid.fetch_add(1, Ordering::Relaxed);
                }
                Ok(true)
            }
            Disposition::Submit(req) => {
                if !self.table.is_free(head) {
                    static REUSED_HEAD: RateLimit = RateLimit::new(5, Duration::from_secs(10));
                    if let Some(suppressed) = REUSED_HEAD.check() {
                        tracing::warn!(
                            attachment = %self.name,
                            queue = self.index,
                            head,
                            suppressed,
                            "guest reused a descriptor head still in flight; chain ignored (logged at most every 10 s)",
                        );
                    }
                    return Ok(false);
                }
                let (op, len, sector, flags) = match req {
                    Request::Read { sector, len } => (Op::Read, len, sector, 0),
                    Request::Write { sector, len } => (Op::Write, len, sector, 0),
                    Request::Flush => (Op::Flush, 0, 0, 0),
                    Request::Discard { sector, sectors } => (Op::Discard, sectors, sector, 0),
                    Request::WriteZeroes {
                        sector,
                        sectors,
                        unmap,
                    } => (
                        Op::WriteZeroes,
                        sectors,
                        sector,
                        if unmap { FLAG_UNMAP } else { 0 },
                    ),
                };
                let new = NewRequest {
                    op,
                    len,
                    sector,
                    flags,
                    status_addr: parsed.status_addr,
                };
                self.table
                    .insert(head, new, &mut self.iov_tmp, Arc::clone(mem));
                self.stats.inflight.fetch_add(1, Ordering::Relaxed);
                // Waits in its slot until the session and its credit let it go
                // (`dispatch`), in submission order.
                if self.conn.is_none() {
                    self.lost_at.get_or_insert_with(Instant::now);
                }
                Ok(false)
            }
        }
    }

    /// Tries to reopen the fabric session, at most once per backoff period (100 ms,
    /// doubling to 2 s while the lender stays away); logs a failure at most every 10 s.
    fn reconnect(&mut self) -> Reconnect {
        let now = Instant::now();
        if self.retry_at.is_some_and(|t| now < t) {
            return Reconnect::Later;
        }
        match self.connect() {
            Ok(()) => {
                self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                // The next attempt, if this session fails at once, waits a little.
                self.retry_at = Some(now + RETRY_MIN);
                self.backoff = RETRY_MIN;
                self.failure_logged = None;
                tracing::info!(
                    attachment = %self.name,
                    queue = self.index,
                    lender = %self.target.addr,
                    "fabric session re-established",
                );
                Reconnect::Connected
            }
            Err(e) => {
                self.retry_at = Some(now + self.backoff);
                self.backoff = (self.backoff * 2).min(RETRY_MAX);
                // A TLS refusal (untrusted or misnamed certificate, client certificate
                // refused) is permanent too: it lasts until a configuration changes.
                let permanent = matches!(
                    e,
                    devlend_fabric::tcp::ConnectError::Refused {
                        status: HelloStatus::Denied
                            | HelloStatus::NoSuchDevice
                            | HelloStatus::BadRequest
                            | HelloStatus::UnsupportedVersion,
                        ..
                    }
                ) || matches!(&e, devlend_fabric::tcp::ConnectError::Tls { source, .. } if source.is_permanent());
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
    fn recover(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        if self.conn.is_some() || self.table.inflight() == 0 {
            self.lost_at = None;
            if let Some(t) = self.timer.as_mut() {
                t.disarm();
            }
            return Ok(false);
        }
        let now = Instant::now();
        let lost = *self.lost_at.get_or_insert(now);
        let give_up = lost + self.deadline;
        match self.reconnect() {
            Reconnect::Connected => {
                self.lost_at = None;
                if let Some(t) = self.timer.as_mut() {
                    t.disarm();
                }
                let used = self.fail_poison(queue, mem)?;
                self.queue_resend();
                Ok(self.flush_tx(queue, mem)? | used)
            }
            Reconnect::Refused => self.give_up(queue, mem),
            Reconnect::Later if now >= give_up => {
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
                        deadline_s = self.deadline.as_secs_f64(),
                        "fabric session not back within the deadline; failing the waiting requests with IOERR (logged at most every 10 s)",
                    );
                }
                self.give_up(queue, mem)
            }
            Reconnect::Later => {
                let next = self.retry_at.unwrap_or(now + RETRY_MIN).min(give_up);
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
        self.lost_at = None;
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
        let mut used = false;
        for head in self.table.count_resends(MAX_RESENDS) {
            {
                tracing::error!(
                    attachment = %self.name,
                    queue = self.index,
                    head,
                    resends = MAX_RESENDS,
                    "request resent on new sessions {MAX_RESENDS} times, each lost; failing it with IOERR",
                );
                self.failing = true;
                let r = self.complete(queue, mem, head, S_IOERR);
                self.failing = false;
                used |= r?;
            }
        }
        Ok(used)
    }

    /// Queues every request in flight for sending on the new session, oldest first
    /// (the credit then lets them go in that order).
    fn queue_resend(&mut self) {
        self.tx_headers.clear();
        self.tx_heads.clear();
        let n = self.table.requeue_all() as u64;
        self.stats.resent.fetch_add(n, Ordering::Relaxed);
        if n > 0 {
            tracing::info!(
                attachment = %self.name,
                queue = self.index,
                requests = n,
                "resending the requests in flight on the new session",
            );
        }
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
        if self.conn.is_none() && self.table.inflight() > 0 {
            self.recover(queue, mem)
        } else {
            Ok(false)
        }
    }

    /// Moves waiting requests onto the session, oldest first, while its credit allows:
    /// into the batch that [`Self::flush_tx`] sends.
    fn dispatch(&mut self) {
        if self.conn.is_none() {
            return;
        }
        let now = Instant::now();
        while let Some(head) = self.table.next_to_send(now) {
            let slot = self.table.slot(head);
            let op = slot.op.unwrap_or(Op::Flush);
            self.tx_headers.push(
                RequestHeader {
                    op,
                    flags: slot.flags,
                    len: slot.len,
                    id: slot.id,
                    sector: slot.sector,
                }
                .encode(),
            );
            self.tx_heads.push((head, op == Op::Write));
        }
    }

    /// Sends what the credit lets go: over RDMA one SEND per request; on a stream, the
    /// requests join the send queue, which takes what the socket accepts without
    /// blocking (the rest goes when it is writable: [`Self::wants_write`]).
    fn flush_tx(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        self.dispatch();
        #[cfg(feature = "rdma")]
        if let Some(Link::Rdma(link)) = self.conn.as_mut() {
            if self.tx_heads.is_empty() {
                return Ok(false);
            }
            let result = link.send(&self.tx_headers, &self.tx_heads, self.table.slots());
            self.tx_headers.clear();
            self.tx_heads.clear();
            return match result {
                Ok(refused) => {
                    let mut used = false;
                    for head in refused {
                        used |= self.complete(queue, mem, head, S_IOERR)?;
                    }
                    Ok(used)
                }
                Err(e) => self.fail_connection(queue, mem, FabricFault::Rdma(e)),
            };
        }
        for (h, &(head, data)) in self.tx_headers.iter().zip(&self.tx_heads) {
            // A write's data is its request's length (the chain's buffers, as parsed).
            let len = if data {
                self.table.slot(head).len as usize
            } else {
                0
            };
            self.tx.push(*h, head, len);
        }
        self.tx_headers.clear();
        self.tx_heads.clear();
        if self.tx.is_empty() {
            return Ok(false);
        }
        let Some(fd) = self.conn.as_ref().map(Link::fd) else {
            return Ok(false);
        };
        let table = &self.table;
        match self.tx.write(fd, |h| table.slot(h).iovs.as_slice()) {
            Ok(()) => Ok(false),
            Err(e) => self.fail_connection(queue, mem, FabricFault::Io(e)),
        }
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
        let mut used = self.receive_responses(queue, mem)?;
        if self.conn.is_some() && (self.table.has_waiting() || !self.tx.is_empty()) {
            used |= self.flush_tx(queue, mem)?;
        }
        Ok(used)
    }

    fn receive_responses(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = false;
        #[cfg(feature = "rdma")]
        if let Some(Link::Rdma(link)) = self.conn.as_mut() {
            let mut responses = std::mem::take(&mut self.rdma_rx);
            let polled = link.receive(&mut responses);
            let mut outcome = Ok(());
            for raw in &responses {
                match self.on_header(queue, mem, raw, true) {
                    Ok(u) => used |= u,
                    Err(fault) => {
                        outcome = Err(fault);
                        break;
                    }
                }
            }
            responses.clear();
            self.rdma_rx = responses;
            // Registrations of regions only completed requests used go now.
            if let Some(Link::Rdma(link)) = self.conn.as_mut() {
                if link.has_stale() {
                    link.prune(mem, self.table.busy_mems());
                }
            }
            match outcome {
                Ok(()) => {}
                Err(FabricFault::Ring(e)) => return Err(e),
                Err(fault) => return Ok(self.fail_connection(queue, mem, fault)? | used),
            }
            if let Err(e) = polled {
                return Ok(self.fail_connection(queue, mem, FabricFault::Rdma(e))? | used);
            }
            return Ok(used);
        }
        loop {
            let Some(fd) = self.conn.as_ref().map(Link::fd) else {
                return Ok(used);
            };
            let asked = self.build_rx_iovs();
            let n = match recv_vectored_nonblocking(fd, &mut self.rx_iovs) {
                Ok(None) => return Ok(used),
                Ok(Some(0)) => {
                    return Ok(self.fail_connection(queue, mem, FabricFault::Closed)? | used)
                }
                Ok(Some(n)) => n,
                Err(e) => return Ok(self.fail_connection(queue, mem, FabricFault::Io(e))? | used),
            };
            match self.advance_rx(queue, mem, n) {
                Ok(u) => used |= u,
                Err(FabricFault::Ring(e)) => return Err(e),
                Err(fault) => return Ok(self.fail_connection(queue, mem, fault)? | used),
            }
            if n < asked {
                // A short receive emptied the socket: save the call that would say so
                // (the socket's readiness wakes the worker again when more arrives).
                return Ok(used);
            }
        }
    }

    /// Points the receive iovecs at where the next bytes of the stream belong; returns
    /// how many bytes they take.
    ///
    /// A read's data goes straight into its guest buffers, so a receive never reads past
    /// a header whose data could follow, with two exceptions that know where the data
    /// goes: the rest of a read's data and the next header; and, when the only request
    /// in flight is a read, its header and its data.
    fn build_rx_iovs(&mut self) -> usize {
        self.rx_iovs.clear();
        let hdr = self.rx_hdr.as_mut_ptr();
        let mut total = 0;
        match self.rx {
            Rx::Header { got } => {
                let single_read = self.table.inflight() == 1 && self.table.reads() == 1;
                let want = if got == 0 && single_read {
                    RESPONSE_HEADER_LEN
                } else if self.table.reads() == 0 {
                    // Headers only, one per request in flight (at least one header, to
                    // see a close or a stray response).
                    RESPONSE_HEADER_LEN * self.table.inflight().clamp(1, RX_HEADERS)
                } else {
                    RESPONSE_HEADER_LEN
                };
                let want = want.max(got + 1);
                // SAFETY: got < want ≤ the size of rx_hdr, so the range stays inside it.
                let base = unsafe { hdr.add(got) };
                self.rx_iovs.push(libc::iovec {
                    iov_base: base.cast(),
                    iov_len: want - got,
                });
                total += want - got;
                self.rx_layout = RxLayout::Headers;
                if got == 0 && single_read {
                    if let Some(slot) = self
                        .table
                        .only_head()
                        .map(|h| (h, self.table.slot(h)))
                        .filter(|(_, s)| s.busy)
                    {
                        let (head, slot) = slot;
                        for iov in &slot.iovs {
                            self.rx_iovs.push(iov.as_iovec());
                            total += iov.len;
                        }
                        self.rx_layout = RxLayout::HeaderThenData(head);
                    }
                }
            }
            Rx::Payload { head, got } => {
                let mut skip = got;
                for iov in &self.table.slot(head).iovs {
                    if skip >= iov.len {
                        skip -= iov.len;
                        continue;
                    }
                    // SAFETY: skip < iov.len, so the pointer stays inside this guest buffer.
                    let base = unsafe { iov.ptr.add(skip) };
                    self.rx_iovs.push(libc::iovec {
                        iov_base: base.cast(),
                        iov_len: iov.len - skip,
                    });
                    total += iov.len - skip;
                    skip = 0;
                }
                // Read the next response header in the same call.
                self.rx_iovs.push(libc::iovec {
                    iov_base: hdr.cast(),
                    iov_len: RESPONSE_HEADER_LEN,
                });
                total += RESPONSE_HEADER_LEN;
                self.rx_layout = RxLayout::DataThenHeader;
            }
        }
        total
    }

    fn advance_rx(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        mut n: usize,
    ) -> Result<bool, FabricFault> {
        let mut used = false;
        loop {
            match self.rx {
                Rx::Header { got } => {
                    let layout = std::mem::replace(&mut self.rx_layout, RxLayout::Headers);
                    if let RxLayout::HeaderThenData(head) = layout {
                        return self.advance_single(queue, mem, head, got + n);
                    }
                    let have = got + n;
                    let mut at = 0;
                    while have - at >= RESPONSE_HEADER_LEN {
                        let mut h = [0u8; RESPONSE_HEADER_LEN];
                        h.copy_from_slice(&self.rx_hdr[at..at + RESPONSE_HEADER_LEN]);
                        at += RESPONSE_HEADER_LEN;
                        self.rx = Rx::Header { got: 0 };
                        used |= self.on_header(queue, mem, &h, false)?;
                        if let Rx::Payload { .. } = self.rx {
                            if at != have {
                                // Never asked for: only one header is read while a read
                                // is in flight.
                                return Err(FabricFault::Misframed);
                            }
                            return Ok(used);
                        }
                    }
                    let left = have - at;
                    self.rx_hdr.copy_within(at..have, 0);
                    self.rx = Rx::Header { got: left };
                    return Ok(used);
                }
                Rx::Payload { head, got } => {
                    let want = self.table.slot(head).len as usize;
                    let take = n.min(want - got);
                    let got = got + take;
                    n -= take;
                    if got < want {
                        self.rx = Rx::Payload { head, got };
                        return Ok(used);
                    }
                    used |= self
                        .complete(queue, mem, head, S_OK)
                        .map_err(FabricFault::Ring)?;
                    self.rx = Rx::Header { got: 0 };
                    if n == 0 {
                        return Ok(used);
                    }
                    // The rest of this receive is the start of the next header, which
                    // landed at the start of rx_hdr.
                }
            }
        }
    }

    /// A receive of `have` bytes laid out as [`RxLayout::HeaderThenData`] for the read in
    /// slot `head`, the only request in flight.
    fn advance_single(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        head: u16,
        have: usize,
    ) -> Result<bool, FabricFault> {
        if have < RESPONSE_HEADER_LEN {
            self.rx = Rx::Header { got: have };
            return Ok(false);
        }
        let mut h = [0u8; RESPONSE_HEADER_LEN];
        h.copy_from_slice(&self.rx_hdr[..RESPONSE_HEADER_LEN]);
        let data = have - RESPONSE_HEADER_LEN;
        let used = self.on_header(queue, mem, &h, false)?;
        match self.rx {
            Rx::Payload { head: h2, .. } if h2 == head => {
                let want = self.table.slot(head).len as usize;
                if data < want {
                    self.rx = Rx::Payload { head, got: data };
                    return Ok(used);
                }
                self.rx = Rx::Header { got: 0 };
                Ok(used
                    | self
                        .complete(queue, mem, head, S_OK)
                        .map_err(FabricFault::Ring)?)
            }
            // Completed without data (an error status): nothing may follow it, since
            // nothing else was in flight.
            _ if data > 0 => Err(FabricFault::Misframed),
            _ => Ok(used),
        }
    }

    fn on_header(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        raw: &[u8; RESPONSE_HEADER_LEN],
        placed: bool,
    ) -> Result<bool, FabricFault> {
        let h = ResponseHeader::decode(raw).map_err(FabricFault::Wire)?;
        let head = (h.id & 0xffff) as u16;
        let slot = self
            .table
            .lookup(h.id)
            .ok_or(FabricFault::UnknownId(h.id))?;
        let want = if h.status == Status::Ok && slot.op == Some(Op::Read) {
            slot.len
        } else {
            0
        };
        if h.len != want {
            return Err(FabricFault::BadLength { got: h.len, want });
        }
        if want > 0 && !placed {
            self.rx = Rx::Payload { head, got: 0 };
            return Ok(false);
        }
        let status = match h.status {
            Status::Ok => S_OK,
            Status::IoErr => S_IOERR,
            Status::Unsupp => S_UNSUPP,
        };
        self.complete(queue, mem, head, status)
            .map_err(FabricFault::Ring)
    }

    /// Stores the status byte, returns the chain to the used ring and frees the slot.
    fn complete(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        head: u16,
        status: u8,
    ) -> Result<bool, virtio_queue::Error> {
        let done = self.table.remove(head);
        let data = if status == S_OK && done.op == Op::Read {
            done.len
        } else {
            0
        };
        if let Some(m) = &done.mem {
            // The status address was validated against this memory map by `parse`.
            let _ = m.write_obj(status, done.status_addr);
        }
        self.stats.count(done.op, done.len, status, self.failing);
        if let Some(q) = self.stats.per_queue.get(usize::from(self.index)) {
            q.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(t) = done.sent {
            self.stats.latency.record(t.elapsed());
        }
        self.stats.inflight.fetch_sub(1, Ordering::Relaxed);
        self.put_used(queue, mem, head, data + 1)?;
        Ok(true)
    }

    /// Drops the connection; the requests in flight wait for a new one (see
    /// [`Self::recover`]).
    fn fail_connection(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        fault: FabricFault,
    ) -> Result<bool, virtio_queue::Error> {
        tracing::warn!(
            attachment = %self.name,
            queue = self.index,
            lender = %self.target.addr,
            device = %self.target.device,
            inflight = self.table.inflight(),
            error = %DisplayChain(&fault),
            "fabric session lost; requests in flight wait for a new one and are resent",
        );
        self.drop_session();
        if self.table.inflight() == 0 {
            return Ok(false);
        }
        self.lost_at.get_or_insert_with(Instant::now);
        self.recover(queue, mem)
    }

    /// Forgets the session: what was sent on it is outstanding nowhere now (every
    /// request still in flight is resent on the next one, [`Self::queue_resend`]).
    fn drop_session(&mut self) {
        self.conn = None;
        self.rx = Rx::Header { got: 0 };
        self.rx_layout = RxLayout::Headers;
        self.tx_headers.clear();
        self.tx_heads.clear();
        self.tx.clear();
        self.table.forget_session();
    }

    fn fail_all(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = false;
        self.failing = true;
        for head in self.table.busy_heads() {
            match self.complete(queue, mem, head, S_IOERR) {
                Ok(u) => used |= u,
                Err(e) => {
                    self.failing = false;
                    return Err(e);
                }
            }
        }
        self.failing = false;
        Ok(used)
    }

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
        let deadline = Instant::now() + timeout;
        let mut used = false;
        let leave = self.handoff && self.log.is_some();
        while self.table.inflight() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let Some(fd) = self.conn.as_ref().map(Link::fd) else {
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

/// Formats an error with its chain of sources, for logs.
pub struct DisplayChain<'a, E: std::error::Error>(pub &'a E);

impl<E: std::error::Error> std::fmt::Display for DisplayChain<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut src = self.0.source();
        while let Some(s) = src {
            write!(f, ": {s}")?;
            src = s.source();
        }
        Ok(())
    }
}

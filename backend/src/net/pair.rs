//! One queue pair over one fabric connection.
//!
//! Transmit: chains popped from the transmitq lose their `virtio_net_hdr` and go to the
//! lender as frame messages, queued in one buffer and written without blocking. While
//! that buffer is over [`OUT_LIMIT`] the transmitq is left alone (the guest's queue
//! fills: backpressure) until the socket drains. While the lender is away, transmitted
//! frames are consumed and dropped (counted), so the guest never stalls.
//!
//! Receive: frames from the lender are written into the receiveq at once; when the
//! guest has posted no buffer they wait, at most [`HOLD`] and [`HOLD_FRAMES`], then are
//! dropped and counted. The socket is always read, so the lender never waits on us.
//!
//! A lost connection is retried at once, then every 100 ms doubling to 2 s, from the
//! worker's timer; the lender's link messages set the link state seen by the agent.
//! With several paths to the lender, pair *i* starts on path *i mod n*, sends a
//! heartbeat every 100 ms (the session's 300 ms `TCP_USER_TIMEOUT` turns a silent cut
//! into an error), and a lost session reopens on the next path (`docs/faults.md`,
//! "Paths").
//!
//! The transmit side is in `tx`; a frame into the guest's receive buffers (or held for
//! them) in `recv`; the counters in [`crate::net::stats`].

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::conn::Stream;
use devlend_fabric::net::{self, NetMessage, Offload};
use devlend_fabric::reconnect::{Policy, Reconnector};
use virtio_queue::{Queue, QueueT};

use crate::guest::GuestMemory;
use crate::lender::target::{FAILBACK_AFTER, HEARTBEAT_EVERY};
use crate::lender::{DisplayChain, LenderTarget, RetryTimer};
use crate::net::rx::{deliver, Delivery};
use crate::net::spec::NET_HDR_LEN;
use crate::virtq::BrokenQueue;

mod recv;
mod session;
#[cfg(test)]
mod tests;
mod tx;

use crate::net::stats::{NetStats, PairStats};
use recv::{count_delivered, count_frames, receive, Rx};

/// Most bytes of frames queued for the lender before the transmitq is left alone.
pub const OUT_LIMIT: usize = 2 << 20;
/// Longest a received frame waits for a guest buffer.
pub const HOLD: Duration = Duration::from_millis(100);
/// Most received frames waiting for guest buffers.
pub const HOLD_FRAMES: usize = 512;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// A session that lived this long was healthy: losing it retries at once again.
const STABLE: Duration = Duration::from_secs(2);
/// Reconnects ([`devlend_fabric::reconnect`]): no deadline, frames are dropped meanwhile.
const RETRY: Policy = Policy::backoff(FIRST_BACKOFF, MAX_BACKOFF).stable_after(STABLE);

/// How a pair opens its fabric session: the lender target's [`LenderTarget::open`]
/// (TCP or TLS), or a fake lender in the unit tests.
pub(crate) type PairOpener = Box<
    dyn FnMut(
            &LenderTarget,
            &devlend_fabric::Hello,
        )
            -> Result<(Stream, devlend_fabric::HelloReply), devlend_fabric::tcp::ConnectError>
        + Send,
>;

/// One of a queue pair's two virtqueues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairQueue {
    /// The receiveq (virtqueue 2 × pair).
    Rx,
    /// The transmitq (virtqueue 2 × pair + 1).
    Tx,
}

/// One queue pair's fabric connection and frames on their way.
pub struct PairEngine {
    index: u16,
    name: Arc<str>,
    target: LenderTarget,
    opener: PairOpener,
    stats: Arc<NetStats>,
    conn: Option<Stream>,
    generation: u64,
    inbuf: Vec<u8>,
    have: usize,
    out: Vec<u8>,
    held: Held,
    timer: RetryTimer,
    /// When to reconnect (the backoff, and when the current session opened).
    retry: Reconnector,
    mergeable: bool,
    /// The current session's lender takes offload frames.
    offload: bool,
    /// The offloaded frames the guest takes (`net::RX_*`, from its acked features).
    accept: u32,
    /// Whether the driver broke the receiveq: frames for it are then dropped.
    rx_broken: BrokenQueue,
    /// Whether the driver broke the transmitq: nothing is taken from it then.
    tx_broken: BrokenQueue,
    /// No session is opened (the guest does not run the pair yet, or a live
    /// migration's source let the NIC go): [`Self::resume`] ends it.
    paused: bool,
    /// The path the session is on, or the next opens on (of
    /// [`LenderTarget::path_count`]); pairs start spread over the paths.
    path: usize,
    /// The session was granted heartbeats (several paths): one goes out every
    /// [`HEARTBEAT_EVERY`], at this instant next.
    heartbeat_at: Option<Instant>,
    /// When the session was lost, and on which path, until one opens again (several
    /// paths: a session that then opens on another path is a failover).
    lost: Option<(Instant, usize)>,
    /// Since when the session is on another path than the pair's own (*index mod n*):
    /// it moves back once that is up and this is [`FAILBACK_AFTER`] old.
    away_since: Option<Instant>,
    /// How long the pair stays away before it tries to move back: [`FAILBACK_AFTER`],
    /// doubled after each failed try up to [`FAILBACK_MAX`].
    failback_wait: Duration,
}

/// The longest wait between two tries to move a pair back to its own path.
pub const FAILBACK_MAX: Duration = Duration::from_secs(30);

impl Drop for PairEngine {
    /// A new backend per frontend connection starts its own pair engines: this one's
    /// session no longer counts on its path (`connected` was reset by
    /// [`NetStats::new_backend`]).
    fn drop(&mut self) {
        if self.conn.take().is_some() {
            if let Some(p) = self.stats.path(self.path) {
                p.closed(false);
            }
        }
    }
}

impl PairEngine {
    /// An engine for queue pair `index`, not yet connected.
    ///
    /// # Errors
    /// The timerfd could not be created.
    pub fn new(
        index: u16,
        name: Arc<str>,
        target: LenderTarget,
        stats: Arc<NetStats>,
    ) -> io::Result<Self> {
        let vq = index.saturating_mul(2);
        let target_paths = target.path_count();
        Ok(PairEngine {
            rx_broken: BrokenQueue::new(name.clone(), vq),
            tx_broken: BrokenQueue::new(name.clone(), vq.saturating_add(1)),
            index,
            name,
            target,
            opener: Box::new(|t, h| t.open(h)),
            stats,
            conn: None,
            generation: 0,
            inbuf: vec![0u8; 1 << 18],
            have: 0,
            out: Vec::new(),
            held: VecDeque::new(),
            timer: RetryTimer::new()?,
            retry: Reconnector::new(RETRY),
            mergeable: true,
            offload: false,
            accept: 0,
            paused: false,
            path: usize::from(index) % target_paths,
            heartbeat_at: None,
            lost: None,
            away_since: None,
            failback_wait: FAILBACK_AFTER,
        })
    }

    /// Opens no session until [`Self::resume`], closing the current one: until the
    /// guest first runs the pair (a migration's destination too), and at the end of a
    /// live migration on its source ([`crate::handover`]). Frames in either direction
    /// are dropped meanwhile.
    pub fn pause(&mut self) {
        if !self.paused {
            self.stats.paused.fetch_add(1, Ordering::Relaxed);
        }
        self.paused = true;
        // No session, no heartbeat (the timer would fire for it at once, again and
        // again).
        self.heartbeat_at = None;
        // Closed by us: no failover to count when it opens again.
        self.lost = None;
        if let Some(c) = self.conn.take() {
            drop(c);
            self.stats.disconnected();
            if let Some(p) = self.stats.path(self.path) {
                p.closed(false);
            }
            let dropped = count_frames(&self.out);
            self.pstats().tx_drops.fetch_add(dropped, Ordering::Relaxed);
            self.out.clear();
            self.have = 0;
            devlend_fabric::limited!(info, attachment = %self.name, pair = self.index, "fabric session closed until the guest runs the pair");
        }
        self.retry = Reconnector::new(RETRY);
        self.arm_timer();
    }

    /// Whether [`Self::pause`] is in force.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Ends [`Self::pause`]: connects now (retrying as after a loss if that fails).
    pub fn resume(&mut self) {
        if !self.paused {
            return;
        }
        self.paused = false;
        // Counted out once the session is open (or failed to open): the pair does not
        // look missing to the link meanwhile.
        self.start();
        self.stats.unpause();
        self.arm_timer();
    }

    fn pstats(&self) -> &PairStats {
        &self.stats.pairs[usize::from(self.index)]
    }

    /// Counts an error of the guest's rings.
    pub fn count_error(&self) {
        self.pstats().errors.fetch_add(1, Ordering::Relaxed);
    }

    fn broken_mut(&mut self, q: PairQueue) -> &mut BrokenQueue {
        match q {
            PairQueue::Rx => &mut self.rx_broken,
            PairQueue::Tx => &mut self.tx_broken,
        }
    }

    /// The driver broke virtqueue `q` (`reason`): it stops, with one warning, until the
    /// frontend re-initializes it ([`Self::reset_broken`]); the other queue of the pair
    /// goes on. Counted as an error.
    pub fn break_queue(&mut self, q: PairQueue, reason: String) {
        let b = self.broken_mut(q);
        if b.is_broken() {
            return;
        }
        b.break_queue(reason);
        self.count_error();
        if q == PairQueue::Rx {
            self.drop_held();
        }
    }

    /// Whether virtqueue `q` is stopped because the driver broke it.
    pub fn is_broken(&self, q: PairQueue) -> bool {
        match q {
            PairQueue::Rx => self.rx_broken.is_broken(),
            PairQueue::Tx => self.tx_broken.is_broken(),
        }
    }

    /// Whether `q` broke since the last call (the worker then signals its vring's error
    /// eventfd).
    pub fn take_newly_broken(&mut self, q: PairQueue) -> bool {
        self.broken_mut(q).take_newly_broken()
    }

    /// The frontend stopped `q` (GET_VRING_BASE) or reset the device: it is served again
    /// once re-initialized.
    pub fn reset_broken(&mut self, q: PairQueue) {
        self.broken_mut(q).reset();
    }

    /// What a call on virtqueue `q` returned: its value, or for a guest memory error
    /// on the rings, `false` and `q` broken.
    pub fn ring_result(&mut self, q: PairQueue, r: Result<bool, virtio_queue::Error>) -> bool {
        r.unwrap_or_else(|e| {
            self.break_queue(q, format!("a ring is not in guest memory: {e}"));
            false
        })
    }

    /// Drops (and counts) the frames waiting for receive buffers.
    fn drop_held(&mut self) {
        let n = self.held.len() as u64;
        self.held.clear();
        self.pstats().rx_drops.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether the guest acked mergeable receive buffers.
    pub fn set_mergeable(&mut self, on: bool) {
        self.mergeable = on;
    }

    /// The offloaded frames the guest takes (`net::RX_*`, from its acked GUEST_*
    /// features): told to the lender now if connected, and at each connection.
    pub fn set_guest_offloads(&mut self, accept: u32) {
        if accept == self.accept {
            return;
        }
        self.accept = accept;
        if self.conn.is_some() && self.offload {
            net::encode_offloads(accept, &mut self.out);
            self.flush();
        }
    }

    /// The fabric socket (and a generation that changes with each connection), and
    /// whether it should be watched for writability.
    pub fn fabric_fd(&self) -> (Option<RawFd>, u64, bool) {
        (
            self.conn.as_ref().map(AsRawFd::as_raw_fd),
            self.generation,
            !self.out.is_empty(),
        )
    }

    /// The timer the worker waits on (reconnects, held frames).
    pub fn timer_fd(&self) -> RawFd {
        self.timer.as_raw_fd()
    }

    /// Tries to connect now if not connected and no retry is scheduled (the first
    /// attempt, when the queues start).
    pub fn start(&mut self) {
        if !self.paused && self.conn.is_none() && self.retry.retry_at().is_none() {
            if let Err(e) = self.connect() {
                tracing::warn!(attachment = %self.name, pair = self.index, error = %DisplayChain(&e), "cannot open fabric session yet");
                self.schedule_retry();
            }
        }
    }

    /// The timer fired: reconnect if due, drop frames held too long, deliver the rest.
    /// Returns whether the receiveq got used entries.
    ///
    /// # Errors
    /// A guest memory error on the rings.
    /// `rxq` is `None` while the receiveq is not ready: frames wait (and expire) then.
    pub fn on_timer(
        &mut self,
        rxq: Option<&mut Queue>,
        mem: &GuestMemory,
    ) -> Result<bool, virtio_queue::Error> {
        self.timer.clear();
        if !self.paused
            && self.conn.is_none()
            && self.retry.retry_at().is_some_and(|t| Instant::now() >= t)
        {
            if let Err(e) = self.connect() {
                tracing::debug!(attachment = %self.name, pair = self.index, error = %DisplayChain(&e), "lender still away");
                self.schedule_retry();
            }
        }
        self.fail_back();
        self.send_heartbeat();
        let used = match rxq {
            Some(q) => self.deliver_held(q, mem)?,
            None => false,
        };
        self.expire_held();
        self.arm_timer();
        Ok(used)
    }

    fn expire_held(&mut self) {
        let now = Instant::now();
        while self
            .held
            .front()
            .is_some_and(|(t, _, _)| now.duration_since(*t) >= HOLD)
        {
            self.held.pop_front();
            self.pstats().rx_drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The guest posted receive buffers: deliver what waits. Returns whether used
    /// entries were added. A ring the driver corrupted (its avail index is checked even
    /// when nothing waits: this is also the receiveq's kick) breaks the receiveq.
    ///
    /// # Errors
    /// None: a guest memory error on the rings breaks the receiveq.
    pub fn deliver_held(
        &mut self,
        rxq: &mut Queue,
        mem: &GuestMemory,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = false;
        if self.rx_broken.is_broken() {
            self.drop_held();
            return Ok(false);
        }
        match crate::virtq::avail_violation(rxq, mem) {
            Ok(None) => {}
            Ok(Some(why)) => {
                self.break_queue(PairQueue::Rx, why);
                return Ok(false);
            }
            Err(e) => {
                let why = format!("a ring is not in guest memory: {e}");
                self.break_queue(PairQueue::Rx, why);
                return Ok(false);
            }
        }
        while let Some((_, offload, frame)) = self.held.front() {
            let d =
                deliver(rxq, mem, frame, offload.as_ref(), self.mergeable).unwrap_or_else(|e| {
                    Delivery::Broken(format!("a ring is not in guest memory: {e}"))
                });
            match d {
                Delivery::Broken(why) => {
                    self.break_queue(PairQueue::Rx, why);
                    break;
                }
                Delivery::Done(chains) => {
                    count_delivered(self.pstats(), chains, frame.len());
                    used = true;
                    self.held.pop_front();
                }
                Delivery::Unfit => {
                    self.pstats().rx_drops.fetch_add(1, Ordering::Relaxed);
                    self.held.pop_front();
                }
                Delivery::NoBuffers => {
                    // Ask the guest to kick when it posts buffers (EVENT_IDX); if it did
                    // meanwhile, go on.
                    match rxq.enable_notification(mem) {
                        Ok(true) => continue,
                        Ok(false) => break,
                        Err(e) => {
                            let why = format!("a ring is not in guest memory: {e}");
                            self.break_queue(PairQueue::Rx, why);
                            break;
                        }
                    }
                }
            }
        }
        Ok(used)
    }

    /// Reads what the lender sent; frames go into the receiveq or wait. Returns whether
    /// used entries were added.
    ///
    /// # Errors
    /// A guest memory error on the rings.
    ///
    /// `rxq` is `None` while the receiveq is not ready: frames wait (and expire) then;
    /// a ring that is not ready must not be touched (its addresses are not set).
    pub fn on_fabric(
        &mut self,
        mut rxq: Option<&mut Queue>,
        mem: &GuestMemory,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = false;
        loop {
            let Some(conn) = self.conn.as_ref() else {
                return Ok(used);
            };
            let n = match (&mut &*conn).read(&mut self.inbuf[self.have..]) {
                Ok(0) => {
                    self.lose("the lender closed the session");
                    return Ok(used);
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.lose(&e.to_string());
                    return Ok(used);
                }
            };
            self.have += n;
            let mut at = 0;
            loop {
                match net::decode(&self.inbuf[at..self.have]) {
                    Ok(Some((NetMessage::Frame(f), len))) => {
                        at += len;
                        let q = rxq.as_deref_mut();
                        let rx = Rx {
                            held: &mut self.held,
                            broken: &mut self.rx_broken,
                            stats: &self.stats.pairs[usize::from(self.index)],
                            mergeable: self.mergeable,
                        };
                        used |= receive(rx, q, mem, None, f);
                    }
                    Ok(Some((NetMessage::OffloadFrame(o, f), len))) => {
                        at += len;
                        if !o.taken_by(self.accept) {
                            // Not what the guest takes (its features changed while this
                            // frame was on its way): dropped, counted.
                            let stats = &self.stats.pairs[usize::from(self.index)];
                            stats.errors.fetch_add(1, Ordering::Relaxed);
                            stats.rx_drops.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        let q = rxq.as_deref_mut();
                        let rx = Rx {
                            held: &mut self.held,
                            broken: &mut self.rx_broken,
                            stats: &self.stats.pairs[usize::from(self.index)],
                            mergeable: self.mergeable,
                        };
                        used |= receive(rx, q, mem, Some(o), f);
                    }
                    Ok(Some((NetMessage::Offloads(_), _))) => {
                        self.pstats().errors.fetch_add(1, Ordering::Relaxed);
                        self.lose("protocol error: an offloads message from the lender");
                        return Ok(used);
                    }
                    Ok(Some((NetMessage::Heartbeat, _))) => {
                        self.pstats().errors.fetch_add(1, Ordering::Relaxed);
                        self.lose("protocol error: a heartbeat from the lender");
                        return Ok(used);
                    }
                    Ok(Some((NetMessage::Link(l), len))) => {
                        if !crate::net::spec::MTU_RANGE.contains(&l.mtu) {
                            self.pstats().errors.fetch_add(1, Ordering::Relaxed);
                            self.lose(&format!(
                                "protocol error: a link message with MTU {}",
                                l.mtu
                            ));
                            return Ok(used);
                        }
                        if l.up != self.stats.link_up.load(Ordering::Relaxed) {
                            tracing::info!(attachment = %self.name, up = l.up, mtu = l.mtu, "lender's link changed");
                        }
                        self.stats.link_up.store(l.up, Ordering::Relaxed);
                        self.stats.mtu.store(l.mtu, Ordering::Relaxed);
                        at += len;
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.pstats().errors.fetch_add(1, Ordering::Relaxed);
                        self.lose(&format!("protocol error: {e}"));
                        return Ok(used);
                    }
                }
            }
            self.inbuf.copy_within(at..self.have, 0);
            self.have -= at;
            if let Some(q) = rxq.as_deref_mut().filter(|_| !self.held.is_empty()) {
                used |= self.deliver_held(q, mem)?;
            }
        }
        self.arm_timer();
        Ok(used)
    }
}

/// Frames held for guest receive buffers: when, what the guest is left to do, the frame.
type Held = VecDeque<(Instant, Option<Offload>, Vec<u8>)>;

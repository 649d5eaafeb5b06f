//! The block engine of one RDMA session: requests from RECVs, their data moved
//! one-sided, their device I/O through the session's [`DeviceIo`] (io_uring, or plain
//! system calls for a file in memory: the same as a TCP session's).
//!
//! A request arrives as a RECV (header + the borrower's segments) and waits in arrival
//! order for one of the session's [`IO_SLOTS`] registered I/O buffers. Then:
//! - a write: RDMA READ of its data out of guest memory into the buffer; when the
//!   READs completed, its device I/O starts;
//! - any other request: its device I/O starts at once;
//! - when the device I/O is done ([`Event::Done`], counted by the I/O layer: latency,
//!   bytes, errors), a read's data is RDMA-WRITTEN into guest memory, then the response
//!   is SENT (an RC queue pair delivers them in that order); the SEND's completion frees
//!   the slot.
//!
//! The thread sleeps in [`DeviceIo::wait`], the connection's completion fd watched in
//! the same ring as the device's completions, at most [`STOP_CHECK`] at a time.
//! Anything malformed — a bad segment list, a failed RDMA READ/WRITE (bad rkey or
//! range) — ends the session with a logged reason, once the device I/O in flight has
//! come back.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use devlend_fabric::rdma::verbs::{Completion, Connection, Mr, RECV_BIT};
use devlend_fabric::rdma::{decode_request, RdmaError, Segment};
use devlend_fabric::wire::RequestHeader;
use devlend_fabric::{BlockRequest, Op};

use crate::block::io::request::refuse_reason;
use crate::block::io::{DeviceIo, Event, Request};
use crate::block::wire::{check_framing, ResponseData};
use crate::block::BlockDevice;
use crate::device_counters::DeviceCounters;

/// Requests a session serves at once (each with its own registered I/O buffer of
/// `max_transfer` bytes); more wait in arrival order.
pub(crate) const IO_SLOTS: usize = 16;

/// Submission entries of an RDMA session's ring: one operation per slot at most, plus
/// the connection's watch.
pub(crate) const RING_ENTRIES: u32 = 64;

/// How often a session checks whether it was told to stop (the longest sleep).
pub(crate) const STOP_CHECK: Duration = Duration::from_millis(200);

/// `wr_id` tag of a response SEND and of the RDMA WRITEs before it (slot in the low
/// bits).
pub(crate) const TAG_SEND: u64 = 1 << 40;
/// `wr_id` tag of the RDMA READs of a write's data.
const TAG_READ: u64 = 2 << 40;
const TAG_MASK: u64 = 0xff << 40;

/// Token of the watch on the connection's completion fd.
const WATCH_CONN: u64 = 0;

/// What the engine asks of its RDMA connection: the verbs [`Connection`], or a fake
/// borrower in the unit tests (`rdma/tests.rs`). The methods are `Connection`'s.
pub(crate) trait QueuePair {
    /// Appends the completions ready; [`RdmaError::Disconnected`] once the peer left.
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), RdmaError>;
    /// A descriptor readable when [`QueuePair::poll`] has something.
    fn fd(&self) -> RawFd;
    /// The first `len` bytes of receive buffer `i`.
    fn recv_msg(&self, i: usize, len: usize) -> &[u8];
    /// Posts receive buffer `i` again.
    fn post_recv(&mut self, i: usize) -> Result<(), RdmaError>;
    /// An RDMA READ (`read`) or WRITE of `len` bytes between `local` (of `lkey`) and
    /// the peer's `remote` (of `rkey`).
    #[allow(clippy::too_many_arguments)]
    fn post_rdma(
        &mut self,
        read: bool,
        wr_id: u64,
        local: u64,
        lkey: u32,
        len: u32,
        remote: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), RdmaError>;
    /// SENDs `msg` from send buffer `i`, signaled with `wr_id`.
    fn send_msg(&mut self, i: usize, msg: &[u8], wr_id: u64) -> Result<(), RdmaError>;
}

impl QueuePair for Connection {
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        Connection::poll(self, out)
    }

    fn fd(&self) -> RawFd {
        Connection::fd(self)
    }

    fn recv_msg(&self, i: usize, len: usize) -> &[u8] {
        Connection::recv_msg(self, i, len)
    }

    fn post_recv(&mut self, i: usize) -> Result<(), RdmaError> {
        Connection::post_recv(self, i)
    }

    fn post_rdma(
        &mut self,
        read: bool,
        wr_id: u64,
        local: u64,
        lkey: u32,
        len: u32,
        remote: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), RdmaError> {
        Connection::post_rdma(self, read, wr_id, local, lkey, len, remote, rkey, signaled)
    }

    fn send_msg(&mut self, i: usize, msg: &[u8], wr_id: u64) -> Result<(), RdmaError> {
        Connection::send_msg(self, i, msg, wr_id)
    }
}

/// One I/O buffer and the request using it. `_mr` is declared first so that it is
/// deregistered before `req` frees the buffer.
pub(crate) struct Slot {
    /// The buffer's registration, kept until the slot drops (`None` only for a fake
    /// connection's slots, in tests).
    _mr: Option<Mr>,
    /// The buffer's address and local key, as registered.
    addr: u64,
    lkey: u32,
    /// `None` while the request is with the device I/O.
    req: Option<Box<Request>>,
    header: RequestHeader,
    segs: Vec<Segment>,
    busy: bool,
}

impl Slot {
    /// Slot `index` with a buffer of `max` bytes registered on `conn`.
    ///
    /// # Errors
    /// The registration's.
    pub(crate) fn new(conn: &Connection, index: usize, max: usize) -> Result<Slot, RdmaError> {
        let mut req = Box::new(Request::new());
        req.tag = index;
        let buf = req.buffer(max);
        // SAFETY: the buffer is owned by `req`, sized once here and never grown
        // (requests are framed to ≤ max_transfer), never moved (the box moves, its
        // buffer's heap allocation does not), and freed after the MR (field order of
        // `Slot`; a request the device I/O never gave back is leaked, not freed).
        let mr = unsafe { Mr::register(conn.pd(), buf.as_mut_ptr(), buf.len(), false) }?;
        Ok(Slot {
            addr: mr.addr(),
            lkey: mr.lkey(),
            _mr: Some(mr),
            req: Some(req),
            header: RequestHeader {
                id: 0,
                request: BlockRequest::Flush,
            },
            segs: Vec::new(),
            busy: false,
        })
    }
}

impl Slot {
    /// Slot `index` with an unregistered buffer of `max` bytes, for a fake connection
    /// that copies to and from its address.
    #[cfg(test)]
    pub(crate) fn unregistered(index: usize, max: usize) -> Slot {
        let mut req = Box::new(Request::new());
        req.tag = index;
        let addr = req.buffer(max).as_mut_ptr() as u64;
        Slot {
            _mr: None,
            addr,
            lkey: 0,
            req: Some(req),
            header: RequestHeader {
                id: 0,
                request: BlockRequest::Flush,
            },
            segs: Vec::new(),
            busy: false,
        }
    }
}

/// How a block session over RDMA ended.
pub(crate) enum End {
    /// The borrower disconnected.
    Closed,
    /// Told to stop (lease ended, lender shutting down); everything received answered.
    Stopped,
    /// The borrower broke the protocol.
    Protocol(String),
    /// The connection failed.
    Transport(RdmaError),
    /// The device I/O (io_uring) failed.
    Ring(std::io::Error),
}

/// The state of one session.
struct RdmaEngine<'a, I: DeviceIo, Q: QueuePair> {
    dev: &'a DeviceCounters,
    block: &'a BlockDevice,
    conn: &'a mut Q,
    slots: &'a mut [Slot],
    io: I,
    /// Requests received, waiting for a slot.
    backlog: VecDeque<(RequestHeader, Vec<Segment>)>,
    events: Vec<Event>,
    /// The connection's fd is watched.
    watching: bool,
}

/// Serves requests until the borrower leaves, breaks the protocol, or `stop` is set
/// (then: every request received answered); returns once the device I/O has nothing in
/// flight.
pub(crate) fn run<I: DeviceIo, Q: QueuePair>(
    io: I,
    dev: &DeviceCounters,
    block: &BlockDevice,
    conn: &mut Q,
    slots: &mut [Slot],
    stop: &AtomicBool,
) -> End {
    let mut s = RdmaEngine {
        dev,
        block,
        conn,
        slots,
        io,
        backlog: VecDeque::new(),
        events: Vec::with_capacity(IO_SLOTS),
        watching: false,
    };
    let end = s.run_loop(stop);
    s.drain();
    end
}

impl<I: DeviceIo, Q: QueuePair> RdmaEngine<'_, I, Q> {
    fn run_loop(&mut self, stop: &AtomicBool) -> End {
        let mut stopping = false;
        let mut done: Vec<Completion> = Vec::new();
        let mut segs = Vec::new();
        loop {
            let mut progress = false;
            done.clear();
            let polled = self.conn.poll(&mut done);
            for c in done.drain(..) {
                progress = true;
                if let Some(e) = c.error {
                    let what = match c.wr_id & TAG_MASK {
                        TAG_READ => "an RDMA READ of guest memory (bad rkey, address or length from the borrower?)",
                        TAG_SEND => "a response SEND or an RDMA WRITE into guest memory (bad rkey, address or length?)",
                        _ if c.recv => return End::Closed,
                        _ => "a work request",
                    };
                    return End::Protocol(format!("{what} failed: {e}"));
                }
                if c.recv {
                    if stopping {
                        // Not taken: the borrower resends it on its next session.
                        continue;
                    }
                    if let Err(end) = self.received(&c, &mut segs) {
                        return end;
                    }
                    continue;
                }
                let s = (c.wr_id & 0xffff) as usize;
                match c.wr_id & TAG_MASK {
                    TAG_SEND if s < self.slots.len() => self.slots[s].busy = false,
                    // The write's data is in the buffer: to the device.
                    TAG_READ if s < self.slots.len() => self.start_io(s),
                    _ => {}
                }
            }
            // Start what the free I/O buffers allow, in arrival order.
            while let Some(s) = self.slots.iter().position(|s| !s.busy) {
                let Some((h, segs)) = self.backlog.pop_front() else {
                    break;
                };
                progress = true;
                if let Err(e) = self.start(s, h, segs) {
                    return End::Transport(e);
                }
            }
            if let Err(e) = self.io.submit() {
                return End::Ring(e);
            }
            self.io.reap(&mut self.events);
            match self.answer() {
                Ok(true) => progress = true,
                Ok(false) => {}
                Err(end) => return end,
            }
            match polled {
                Ok(()) => {}
                Err(RdmaError::Disconnected) => return End::Closed,
                Err(e) => return End::Transport(e),
            }
            if !stopping && stop.load(Ordering::Acquire) {
                stopping = true;
                // Requests held for the limits are not run: the borrower sends them
                // again on its next session.
                self.cancel_held();
            }
            if stopping
                && self.backlog.is_empty()
                && self.slots.iter().all(|s| !s.busy)
                && self.io.in_flight() == 0
            {
                return End::Stopped;
            }
            if progress {
                continue;
            }
            if !self.watching {
                if let Err(e) = self.io.watch(self.conn.fd(), libc::POLLIN, WATCH_CONN) {
                    return End::Ring(e);
                }
                self.watching = true;
            }
            if let Err(e) = self.io.wait(Some(STOP_CHECK)) {
                return End::Ring(e);
            }
        }
    }

    /// Takes a received request into the backlog and posts its receive buffer again.
    fn received(&mut self, c: &Completion, segs: &mut Vec<Segment>) -> Result<(), End> {
        let i = (c.wr_id & !RECV_BIT) as usize;
        let h = decode_request(self.conn.recv_msg(i, c.byte_len as usize), segs).map_err(|e| {
            End::Protocol(format!(
                "bad request message: {}",
                devlend_fabric::error::chain(&e)
            ))
        })?;
        check_framing(&h.request).map_err(|e| End::Protocol(e.to_string()))?;
        self.conn.post_recv(i).map_err(End::Transport)?;
        // A borrower has at most one request per receive buffer outstanding (its
        // virtqueue is at most that large): more is a borrower that ignores its
        // credit, and must not grow the backlog without bound.
        if self.backlog.len() >= devlend_fabric::rdma::RECV_DEPTH {
            return Err(End::Protocol(format!(
                "more than {} requests outstanding (the receive buffers posted)",
                devlend_fabric::rdma::RECV_DEPTH
            )));
        }
        self.dev.stats.request(h.op());
        self.backlog.push_back((h, std::mem::take(segs)));
        Ok(())
    }

    /// Puts a request in slot `s`: a write first pulls its data out of guest memory
    /// (the last READ signaled: RC completes them in order), anything else goes to the
    /// device at once.
    fn start(&mut self, s: usize, h: RequestHeader, segs: Vec<Segment>) -> Result<(), RdmaError> {
        let slot = &mut self.slots[s];
        slot.busy = true;
        slot.header = h;
        slot.segs = segs;
        if h.op() == Op::Write && refuse_reason(&h.request, self.block).is_none() {
            let base = slot.addr;
            let mut at = 0u64;
            let n = slot.segs.len();
            for (k, seg) in slot.segs.iter().enumerate() {
                self.conn.post_rdma(
                    true,
                    TAG_READ | s as u64,
                    base + at,
                    slot.lkey,
                    seg.len,
                    seg.addr,
                    seg.rkey,
                    k + 1 == n,
                )?;
                at += u64::from(seg.len);
            }
            return Ok(());
        }
        self.start_io(s);
        Ok(())
    }

    /// Hands slot `s`'s request to the device I/O.
    fn start_io(&mut self, s: usize) {
        let slot = &mut self.slots[s];
        if let Some(mut req) = slot.req.take() {
            req.id = slot.header.id;
            self.io.start(req, &slot.header.request, &mut self.events);
        }
    }

    /// Answers the requests the device I/O is done with ([`Self::respond`]). Returns
    /// whether one was.
    fn answer(&mut self) -> Result<bool, End> {
        let mut result = Ok(false);
        let mut events = std::mem::take(&mut self.events);
        for ev in events.drain(..) {
            match ev {
                Event::Ready(_) => self.watching = false,
                Event::Done(req) | Event::Lost(req, _) if result.is_err() => {
                    // The session is ending: back to its slot, unanswered.
                    let s = req.tag;
                    self.slots[s].req = Some(req);
                }
                Event::Lost(req, e) => {
                    let s = req.tag;
                    self.slots[s].req = Some(req);
                    result = Err(End::Ring(e));
                }
                Event::Done(req) => match self.respond(req) {
                    Ok(()) => result = Ok(true),
                    Err(e) => result = Err(End::Transport(e)),
                },
            }
        }
        self.events = events;
        result
    }

    /// Answers one request, back in its slot: a read's data RDMA-WRITTEN into guest
    /// memory, then the response SENT (signaled: its completion frees the slot).
    fn respond(&mut self, req: Box<Request>) -> Result<(), RdmaError> {
        let s = req.tag;
        let slot = &mut self.slots[s];
        let req = slot.req.insert(req);
        req.encode_response();
        let (resp, data) = req.response();
        let resp = *resp;
        if matches!(data, ResponseData::Buf(b) if !b.is_empty()) {
            let base = slot.addr;
            let mut at = 0u64;
            for seg in &slot.segs {
                self.conn.post_rdma(
                    false,
                    TAG_SEND | s as u64,
                    base + at,
                    slot.lkey,
                    seg.len,
                    seg.addr,
                    seg.rkey,
                    false,
                )?;
                at += u64::from(seg.len);
            }
        }
        self.conn.send_msg(s, &resp, TAG_SEND | s as u64)
    }

    /// Gives the requests held for the limits back to their slots, unanswered.
    fn cancel_held(&mut self) {
        let mut held = Vec::new();
        self.io.cancel_held(&mut held);
        for req in held {
            let s = req.tag;
            if let Some(slot) = self.slots.get_mut(s) {
                slot.req = Some(req);
                slot.busy = false;
            }
        }
    }

    /// Waits for the device I/O in flight to come back (its buffers are the slots'),
    /// unanswered: the session is ending. Gives up on a failing ring (those requests
    /// stay leaked with the kernel).
    fn drain(&mut self) {
        self.cancel_held();
        let mut events = std::mem::take(&mut self.events);
        loop {
            for ev in events.drain(..) {
                if let Event::Done(req) | Event::Lost(req, _) = ev {
                    let s = req.tag;
                    self.slots[s].req = Some(req);
                }
            }
            if self.io.in_flight() == 0 {
                return;
            }
            if let Err(e) = self
                .io
                .submit()
                .and_then(|()| self.io.wait(Some(STOP_CHECK)))
            {
                tracing::error!(device = %self.dev.name, error = %e, in_flight = self.io.in_flight(),
                    "io_uring failed while the session ended; its requests are abandoned");
                return;
            }
            self.io.reap(&mut events);
        }
    }
}

#[cfg(test)]
mod tests;

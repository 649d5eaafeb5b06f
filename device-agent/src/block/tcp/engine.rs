//! The block engine of one TCP session: one thread, a non-blocking socket, and the
//! session's [`DeviceIo`] (io_uring, or plain system calls for a file in memory).
//!
//! The thread loops over four steps, and sleeps only when none of them can progress:
//!
//! 1. **receive** ([`TcpEngine::receive`]): read request frames (several per `recv`,
//!    [`super::rx`]), validate them, take a request from the session's [`RequestBudget`] and
//!    start their I/O ([`DeviceIo::start`]). A borrower granted the budget as its
//!    credit (`FEATURE_CREDIT`) never goes beyond it, so the reading never stops (a
//!    request beyond it ends the session); for one without credit a spent budget stops
//!    the reading, which is TCP backpressure;
//! 2. **submit** the queued operations ([`DeviceIo::submit`], one `io_uring_enter`);
//! 3. **reap** ([`TcpEngine::reap`]) finished requests and queue their responses (the
//!    I/O layer has counted them);
//! 4. **send** ([`TcpEngine::send`], [`super::tx`]) the queued responses, many per
//!    `sendmsg`; a read left in a memory file sends its data with `sendfile`.
//!
//! It sleeps in [`DeviceIo::wait`], waiting for a device completion or for the socket,
//! watched by one-shot polls in the same ring, so that a request costs no thread
//! hand-off. With polling on (`--poll-us`, the default), it first goes on looping
//! without progress for an adaptive window after its last work ([`PollWindow`]), so
//! that a request that follows soon finds it awake, unless the CPUs are contended.
//! When the reading ends (EOF, protocol error, shutdown) the session finishes every
//! request in flight, answers them if the socket still takes writes, and returns. A
//! session fenced by a newer one of its queue (checked once per round) starts nothing
//! more, answers nothing more, and returns once the device is done with what it runs.

use std::io;
use std::net::{Shutdown, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use devlend_fabric::conn::Stream;
use devlend_fabric::wire::{HEARTBEAT_FRAME, OP_HEARTBEAT, REQUEST_HEADER_LEN};
use devlend_fabric::{BlockRequest, Op, RequestHeader};

use super::budget::RequestBudget;
use super::rx::{recv, Recv, RxBuf, READ_BUF};
use super::tx::Tx;
use devlend_fabric::poll_window::PollWindow;

use crate::block::io::{DeviceIo, Event, Request};
use crate::block::wire::check_framing;
use crate::device_counters::DeviceCounters;
use crate::session::end::End;
use crate::{MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES};

/// Token of the watch for the socket becoming readable.
const WATCH_IN: u64 = 0;
/// Token of the watch for the socket becoming writable.
const WATCH_OUT: u64 = 1;

/// Receive progress between frames.
enum Rx {
    /// Waiting for (the rest of) a request header in the receive buffer.
    Header,
    /// Receiving a write's data into its request.
    Data {
        req: Box<Request>,
        op: BlockRequest,
        got: usize,
    },
}

/// The state of one session.
struct TcpEngine<'a, I: DeviceIo> {
    dev: &'a DeviceCounters,
    peer: SocketAddr,
    sock: &'a Stream,
    sock_fd: RawFd,
    io: I,
    budget: RequestBudget,
    rx: RxBuf,
    state: Rx,
    /// When the frame being received started (its first byte arrived).
    frame_since: Option<Instant>,
    frame_timeout: Duration,
    /// Frames are still read (false after EOF, a protocol error, a socket error).
    reading: bool,
    /// Reading stopped at a whole frame because the budget is spent.
    budget_blocked: bool,
    /// The borrower was granted the budget as its credit ([`devlend_fabric::Credit`]):
    /// a request beyond it breaks the protocol and ends the session, where a borrower
    /// without credit is only not read until the budget allows.
    credit: bool,
    /// Once reading has ended: when to give up sending the last responses to a peer
    /// that does not read them.
    drain_deadline: Option<Instant>,
    end: Option<End>,
    /// Responses to send.
    tx: Tx,
    /// The socket still takes writes.
    writable: bool,
    /// What the device I/O had, reused.
    events: Vec<Event>,
    poll_in: bool,
    poll_out: bool,
    /// How long the thread polls after its last work before it sleeps.
    poll: PollWindow,
    /// When the thread last made progress.
    last_work: Instant,
    /// Set by a newer session of the same queue: start nothing more, send nothing more,
    /// end once what runs on the device is done (`docs/protocol.md`, "Fencing a queue's
    /// earlier session").
    fence: &'a AtomicBool,
    /// The fence was seen.
    fenced: bool,
    /// The borrower was granted heartbeats: [`HEARTBEAT_FRAME`]s are read and dropped.
    heartbeat: bool,
}

/// What a session runs under, beside its device I/O and socket.
pub(crate) struct Terms<'a> {
    /// How long the rest of a frame may take once its first byte arrived.
    pub(crate) frame_timeout: Duration,
    /// The borrower was granted the session's budget as its credit.
    pub(crate) credit: bool,
    /// The most the thread polls after its last work ([`PollWindow`]).
    pub(crate) poll: Duration,
    /// Set when a newer session of the same queue fences this one.
    pub(crate) fence: &'a AtomicBool,
    /// The borrower was granted heartbeats ([`devlend_fabric::FEATURE_HEARTBEAT`]).
    pub(crate) heartbeat: bool,
}

/// Serves requests on an open session until the peer leaves or breaks the protocol;
/// returns once nothing is in flight.
pub(crate) fn run<I: DeviceIo>(
    io: I,
    dev: &DeviceCounters,
    sock: &Stream,
    peer: SocketAddr,
    terms: Terms<'_>,
) -> End {
    let Terms {
        frame_timeout,
        credit,
        poll,
        fence,
        heartbeat,
    } = terms;
    if let Err(e) = sock.set_nonblocking(true) {
        return End::Socket(e);
    }
    let mut s = TcpEngine {
        dev,
        peer,
        sock,
        sock_fd: sock.as_raw_fd(),
        io,
        budget: RequestBudget::new(MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES),
        rx: RxBuf::new(),
        state: Rx::Header,
        frame_since: None,
        frame_timeout,
        reading: true,
        budget_blocked: false,
        credit,
        drain_deadline: None,
        end: None,
        tx: Tx::new(),
        writable: true,
        events: Vec::with_capacity(256),
        poll_in: false,
        poll_out: false,
        poll: PollWindow::new(poll),
        last_work: Instant::now(),
        fence,
        fenced: false,
        heartbeat,
    };
    s.run_loop()
}

impl<I: DeviceIo> TcpEngine<'_, I> {
    fn run_loop(&mut self) -> End {
        loop {
            let mut progress = false;
            if !self.fenced && self.fence.load(Ordering::Acquire) {
                self.be_fenced();
            }
            if self.reading {
                progress |= self.receive();
            }
            if let Err(e) = self.submit() {
                return self.abandon(e);
            }
            progress |= self.reap();
            progress |= self.send();
            if self.finished() {
                break;
            }
            if progress {
                if self.poll.enabled() {
                    self.poll.end_spell();
                    let now = Instant::now();
                    self.poll.waited(now - self.last_work);
                    self.last_work = now;
                }
                continue;
            }
            let window = self.poll.window();
            if !window.is_zero() && self.last_work.elapsed() < window {
                // Checks the CPUs once per spell; a contended one reads 0 next round.
                self.poll.begin_spell();
                std::hint::spin_loop();
                continue;
            }
            self.poll.end_spell();
            if let Err(e) = self.sleep() {
                return self.abandon(e);
            }
        }
        let _ = self.sock.shutdown(Shutdown::Both);
        self.end.take().unwrap_or(End::PeerClosed)
    }

    /// Nothing left to do: reading ended, nothing in the kernel, nothing to send.
    fn finished(&self) -> bool {
        !self.reading && self.io.in_flight() == 0 && (self.tx.is_empty() || !self.writable)
    }

    /// io_uring itself failed: requests still in flight stay owned by the kernel and
    /// are leaked (never freed, so never reused under it); the session ends.
    fn abandon(&mut self, e: io::Error) -> End {
        tracing::error!(peer = %self.peer, device = %self.dev.name, error = %e,
            in_flight = self.io.in_flight(), "io_uring failed; abandoning the session");
        let _ = self.sock.shutdown(Shutdown::Both);
        End::Ring(e)
    }

    /// A newer session of this queue took over: what was received and not started is
    /// dropped, and so are the responses (the borrower resends those requests there);
    /// what runs on the device finishes before the session ends.
    fn be_fenced(&mut self) {
        self.fenced = true;
        if self.reading {
            self.stop_reading(End::Fenced);
        }
        self.end = Some(End::Fenced);
        self.writable = false;
        self.tx.clear(&mut self.budget);
    }

    /// Stops reading frames, recording why (the first reason wins).
    fn stop_reading(&mut self, end: End) {
        self.reading = false;
        self.frame_since = None;
        self.drain_deadline = Some(Instant::now() + self.frame_timeout);
        if let Rx::Data { req, .. } = std::mem::replace(&mut self.state, Rx::Header) {
            self.budget.release(req);
        }
        // Requests still held for the limits are not run for a borrower that is gone
        // or being stopped: it sends them again on its next session.
        let mut held = Vec::new();
        self.io.cancel_held(&mut held);
        for req in held {
            self.budget.release(req);
        }
        if self.end.is_none() {
            self.end = Some(end);
        }
    }

    /// Step 1: parses buffered frames and receives more, until the socket is empty or
    /// the budget is spent. Returns whether anything moved.
    fn receive(&mut self) -> bool {
        let mut progress = false;
        self.budget_blocked = false;
        loop {
            let step = match &mut self.state {
                Rx::Header => self.parse_header(),
                Rx::Data { .. } => self.receive_data(),
            };
            match step {
                Ok(Some(true)) => progress = true,
                Ok(Some(false)) => {}
                Ok(None) => return progress,
                Err(end) => {
                    self.stop_reading(end);
                    return true;
                }
            }
        }
    }

    /// Starts the request whose header is buffered, or receives more. `Some(moved)` to
    /// go on, `None` to stop for now.
    fn parse_header(&mut self) -> Result<Option<bool>, End> {
        let data = self.rx.data();
        if data.len() < REQUEST_HEADER_LEN {
            if !data.is_empty() && self.frame_since.is_none() {
                self.frame_since = Some(Instant::now());
            }
            return self.fill(REQUEST_HEADER_LEN);
        }
        let mut hb = [0u8; REQUEST_HEADER_LEN];
        hb.copy_from_slice(&data[..REQUEST_HEADER_LEN]);
        if self.heartbeat && hb[0] == OP_HEARTBEAT {
            // Its TCP acknowledgement was all it asked for.
            if hb != HEARTBEAT_FRAME {
                return Err(End::Protocol("malformed heartbeat frame".to_owned()));
            }
            self.rx.consume(REQUEST_HEADER_LEN);
            self.frame_since = None;
            return Ok(Some(true));
        }
        let h = RequestHeader::decode(&hb).map_err(|e| End::Protocol(e.to_string()))?;
        let need = check_framing(&h.request).map_err(|e| End::Protocol(e.to_string()))?;
        let Some(mut req) = self.budget.acquire(need) else {
            if self.credit {
                return Err(End::Protocol(format!(
                    "request {:#x} goes beyond the credit granted ({MAX_IN_FLIGHT} requests, {MAX_IN_FLIGHT_BYTES} bytes)",
                    h.id
                )));
            }
            self.budget_blocked = true;
            return Ok(None);
        };
        self.rx.consume(REQUEST_HEADER_LEN);
        self.dev.stats.request(h.op());
        req.id = h.id;
        req.buffer(need);
        if h.op() == Op::Write && need > 0 {
            self.frame_since.get_or_insert_with(Instant::now);
            self.state = Rx::Data {
                req,
                op: h.request,
                got: 0,
            };
        } else {
            self.frame_since = None;
            self.start(req, &h.request)?;
        }
        Ok(Some(true))
    }

    /// Moves a write's data into its request, from the buffer or straight from the
    /// socket; starts the write once whole.
    fn receive_data(&mut self) -> Result<Option<bool>, End> {
        let Rx::Data { req, got, .. } = &mut self.state else {
            return Ok(Some(false));
        };
        let need = req.charge;
        let moved = self.rx.take_into(&mut req.buf[*got..need]);
        *got += moved;
        let (have, direct) = (*got, need - *got >= READ_BUF);
        if have < need && !direct {
            return self.fill(0).map(|o| o.map(|m| m || moved > 0));
        }
        if have < need {
            let got_now = match recv(self.sock_fd, &mut req.buf[have..need]).map_err(End::Socket)? {
                Recv::Got(n) => n,
                Recv::WouldBlock => return Ok((moved > 0).then_some(true)),
                Recv::Closed => {
                    return Err(self.truncated(REQUEST_HEADER_LEN + have, REQUEST_HEADER_LEN + need))
                }
            };
            *got += got_now;
            if *got < need {
                return Ok(Some(true));
            }
        }
        let Rx::Data { req, op, .. } = std::mem::replace(&mut self.state, Rx::Header) else {
            return Ok(Some(true));
        };
        self.frame_since = None;
        self.start(req, &op)?;
        Ok(Some(true))
    }

    /// Receives into the buffer. `frame_len` is the length of the frame being completed
    /// (for the error when the peer closes), 0 inside a write's data.
    fn fill(&mut self, frame_len: usize) -> Result<Option<bool>, End> {
        match self.rx.fill(self.sock_fd).map_err(End::Socket)? {
            Recv::Got(_) => Ok(Some(true)),
            Recv::WouldBlock => Ok(None),
            Recv::Closed => {
                let buffered = self.rx.data().len();
                match &self.state {
                    Rx::Header if buffered == 0 => Err(End::PeerClosed),
                    Rx::Header => Err(self.truncated(buffered, frame_len)),
                    Rx::Data { req, got, .. } => Err(self.truncated(
                        REQUEST_HEADER_LEN + got + buffered,
                        REQUEST_HEADER_LEN + req.charge,
                    )),
                }
            }
        }
    }

    fn truncated(&self, got: usize, want: usize) -> End {
        End::Protocol(format!(
            "peer closed the connection mid-frame ({got} of {want} bytes)"
        ))
    }

    /// Starts a request's device I/O; what finished at once is queued for sending.
    fn start(&mut self, req: Box<Request>, op: &BlockRequest) -> Result<(), End> {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        self.io.start(req, op, &mut events);
        let lost = self.handle(&mut events);
        self.events = events;
        match lost {
            Some(e) => Err(End::Ring(e)),
            None => Ok(()),
        }
    }

    /// Step 2.
    fn submit(&mut self) -> io::Result<()> {
        self.io.submit()
    }

    /// Step 3: what the device I/O has. Returns whether a request finished.
    fn reap(&mut self) -> bool {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        self.io.reap(&mut events);
        let progress = events
            .iter()
            .any(|e| matches!(e, Event::Done(_) | Event::Lost(..)));
        if let Some(e) = self.handle(&mut events) {
            if self.reading {
                self.stop_reading(End::Ring(e));
            }
        }
        self.events = events;
        progress
    }

    /// Takes the events of the device I/O: finished requests' responses queued, the
    /// socket's watches noted. Returns the error of a lost request, if one was.
    fn handle(&mut self, events: &mut Vec<Event>) -> Option<io::Error> {
        let mut lost = None;
        for ev in events.drain(..) {
            match ev {
                Event::Done(req) => self.finish(req),
                Event::Lost(req, e) => {
                    tracing::error!(peer = %self.peer, device = %self.dev.name, error = %e,
                        "cannot run a request; closing the session");
                    self.budget.release(req);
                    lost.get_or_insert(e);
                }
                Event::Ready(WATCH_IN) => self.poll_in = false,
                Event::Ready(_) => self.poll_out = false,
            }
        }
        lost
    }

    /// A request is done (and counted): queue its response.
    fn finish(&mut self, req: Box<Request>) {
        if self.writable {
            self.tx.push(req);
        } else {
            self.budget.release(req);
        }
    }

    /// The socket cannot take the responses: drop them, stop reading, finish the I/O
    /// in flight.
    fn fail_socket(&mut self, e: io::Error) {
        if self.writable {
            tracing::info!(peer = %self.peer, device = %self.dev.name, error = %e,
                "cannot send responses; closing the session");
        }
        self.writable = false;
        let _ = self.sock.shutdown(Shutdown::Both);
        self.tx.clear(&mut self.budget);
        if self.reading {
            self.stop_reading(End::Socket(e));
        }
    }

    /// Step 4: sends queued responses until done or the socket is full. Returns whether
    /// a response left entirely.
    fn send(&mut self) -> bool {
        let mut progress = false;
        while self.writable && !self.tx.is_empty() {
            match self
                .tx
                .send_some(self.sock_fd, &mut self.io, &mut self.budget)
            {
                Ok(Some(done)) => progress |= done,
                Ok(None) => break,
                Err(e) => {
                    self.fail_socket(e);
                    return true;
                }
            }
        }
        progress
    }

    /// Sleeps until the socket or the device has something, or a mid-frame timeout.
    fn sleep(&mut self) -> io::Result<()> {
        let want_in = self.reading && !self.budget_blocked;
        let want_out = self.writable && !self.tx.is_empty();
        if want_in && !self.poll_in {
            self.io.watch(self.sock_fd, libc::POLLIN, WATCH_IN)?;
            self.poll_in = true;
        }
        if want_out && !self.poll_out {
            self.io.watch(self.sock_fd, libc::POLLOUT, WATCH_OUT)?;
            self.poll_out = true;
        }
        let timeout = match self.frame_since {
            Some(t) if self.reading => {
                let left = self.frame_timeout.saturating_sub(t.elapsed());
                if left.is_zero() {
                    let (got, want) = self.frame_progress();
                    self.stop_reading(End::Protocol(format!(
                        "peer stalled mid-frame for {:?} ({got} of {want} bytes)",
                        self.frame_timeout
                    )));
                    return Ok(());
                }
                Some(left)
            }
            _ if self.reading => None,
            _ => match self.drain_deadline {
                Some(d) if want_out => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        self.fail_socket(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the peer does not read its last responses",
                        ));
                        return Ok(());
                    }
                    Some(left)
                }
                _ => None,
            },
        };
        self.io.wait(timeout)
    }

    fn frame_progress(&self) -> (usize, usize) {
        match &self.state {
            Rx::Header => (self.rx.data().len(), REQUEST_HEADER_LEN),
            Rx::Data { req, got, .. } => (
                REQUEST_HEADER_LEN + got + self.rx.data().len(),
                REQUEST_HEADER_LEN + req.charge,
            ),
        }
    }
}

//! The I/O engine of one session: one thread, one io_uring, a non-blocking socket.
//!
//! The thread loops over four steps, and sleeps only when none of them can progress:
//!
//! 1. **receive**: read request frames (several per `recv`), validate them, take a
//!    request from the session's [`Pool`] and start their I/O. A borrower granted the
//!    budget as its credit (`FEATURE_CREDIT`) never goes beyond it, so the reading never
//!    stops (a request beyond it ends the session); for one without credit a spent
//!    budget stops the reading, which is TCP backpressure;
//! 2. **submit** the queued io_uring operations in one `io_uring_enter`;
//! 3. **reap** completions: continue short transfers and write-zeroes fallbacks, queue
//!    the responses of finished requests;
//! 4. **send** the queued responses, many per `sendmsg`; a read served from a memory file
//!    sends its data with `sendfile` (no copy into a buffer of ours).
//!
//! It sleeps in `io_uring_enter`, waiting for a device completion or for the socket,
//! watched by one-shot poll operations in the same ring, so that a request costs no
//! thread hand-off. Files in memory (tmpfs) are read and written with plain system
//! calls on this thread ([`IoMode`]): io_uring would hand each operation to a kernel
//! worker thread, since such files cannot be accessed without blocking semantics.
//!
//! A request is a `Box<Request>` whose raw pointer is the operation's `user_data`: the
//! kernel owns it from submission until its completion is reaped, so its buffer cannot
//! be freed or reused while I/O on it is in flight. When the reading ends (EOF, protocol
//! error, shutdown) the session finishes every request in flight, answers them if the
//! socket still takes writes, and returns.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr};

use devlend_fabric::conn::Stream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use devlend_fabric::wire::{REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use devlend_fabric::{Op, RequestHeader, Status};
use io_uring::{opcode, types};

use crate::device::Device;
use crate::frame::{recv, Recv, RxBuf, READ_BUF};
use crate::pool::Pool;
use crate::request::{check_framing, Next, Request, ResponseData};
use crate::uring::Ring;
use crate::{MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES};

/// `user_data` of the poll for the socket becoming readable (a request pointer is
/// never this).
const POLL_IN: u64 = u64::MAX;
/// `user_data` of the poll for the socket becoming writable.
const POLL_OUT: u64 = u64::MAX - 1;
/// Operations queued before they are submitted even if more frames are buffered.
const SUBMIT_BATCH: usize = 32;
/// Most iovecs per `sendmsg` (Linux UIO_MAXIOV).
const MAX_IOV: usize = 1024;
/// Reads at least this long, from a memory file, are sent with `sendfile`.
const SENDFILE_MIN: usize = 64 << 10;

/// How a session does device I/O.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IoMode {
    /// Plain system calls for files in memory (tmpfs, ramfs), io_uring otherwise.
    #[default]
    Auto,
    /// io_uring for every device.
    Uring,
    /// Plain system calls on the session's thread for every device (a slow device then
    /// serialises the session's requests).
    Sync,
}

/// How a session ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum End {
    /// The peer closed the connection between two requests (or the lender shut down).
    #[error("peer closed the connection")]
    PeerClosed,
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The socket failed.
    #[error("socket failed")]
    Socket(#[source] io::Error),
    /// io_uring failed.
    #[error("io_uring failed")]
    Ring(#[source] io::Error),
}

/// Receive progress between frames.
enum Rx {
    /// Waiting for (the rest of) a request header in the receive buffer.
    Header,
    /// Receiving a write's data into its request.
    Data {
        req: Box<Request>,
        header: RequestHeader,
        got: usize,
    },
}

/// The state of one session.
struct Session<'a> {
    dev: &'a Device,
    peer: SocketAddr,
    sock: &'a Stream,
    sock_fd: RawFd,
    dev_fd: RawFd,
    inline: bool,
    ring: &'a mut Ring,
    pool: Pool,
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
    /// Finished requests whose responses are not fully sent, in order.
    out: VecDeque<Box<Request>>,
    /// Bytes of `out[0]`'s response (header, then data) already sent.
    out_sent: usize,
    /// The socket still takes writes.
    writable: bool,
    /// Requests owned by the kernel (operations in the ring).
    in_ring: usize,
    /// Operations queued and not yet submitted.
    queued: usize,
    poll_in: bool,
    poll_out: bool,
    cqes: Vec<(u64, i32)>,
    iovs: Vec<libc::iovec>,
}

/// Serves requests on an open session until the peer leaves or breaks the protocol;
/// returns once nothing is in flight.
pub(crate) fn run(
    dev: &Device,
    sock: &Stream,
    peer: SocketAddr,
    ring: &mut Ring,
    frame_timeout: Duration,
    mode: IoMode,
    credit: bool,
) -> End {
    if let Err(e) = sock.set_nonblocking(true) {
        return End::Socket(e);
    }
    let mut s = Session {
        dev,
        peer,
        sock,
        sock_fd: sock.as_raw_fd(),
        dev_fd: dev.file.as_raw_fd(),
        inline: match mode {
            IoMode::Auto => dev.memory_backed,
            IoMode::Uring => false,
            IoMode::Sync => true,
        },
        ring,
        pool: Pool::new(MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES),
        rx: RxBuf::new(),
        state: Rx::Header,
        frame_since: None,
        frame_timeout,
        reading: true,
        budget_blocked: false,
        credit,
        drain_deadline: None,
        end: None,
        out: VecDeque::new(),
        out_sent: 0,
        writable: true,
        in_ring: 0,
        queued: 0,
        poll_in: false,
        poll_out: false,
        cqes: Vec::with_capacity(256),
        iovs: Vec::with_capacity(64),
    };
    s.run_loop()
}

impl Session<'_> {
    fn run_loop(&mut self) -> End {
        loop {
            let mut progress = false;
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
                continue;
            }
            if let Err(e) = self.sleep() {
                return self.abandon(e);
            }
        }
        let _ = self.sock.shutdown(Shutdown::Both);
        self.end.take().unwrap_or(End::PeerClosed)
    }

    /// Nothing left to do: reading ended, nothing in the kernel, nothing to send.
    fn finished(&self) -> bool {
        !self.reading && self.in_ring == 0 && (self.out.is_empty() || !self.writable)
    }

    /// io_uring itself failed: requests still in flight stay owned by the kernel and
    /// are leaked (never freed, so never reused under it); the session ends.
    fn abandon(&mut self, e: io::Error) -> End {
        tracing::error!(peer = %self.peer, device = %self.dev.name, error = %e,
            in_flight = self.in_ring, "io_uring failed; abandoning the session");
        let _ = self.sock.shutdown(Shutdown::Both);
        End::Ring(e)
    }

    /// Stops reading frames, recording why (the first reason wins).
    fn stop_reading(&mut self, end: End) {
        self.reading = false;
        self.frame_since = None;
        self.drain_deadline = Some(Instant::now() + self.frame_timeout);
        if let Rx::Data { req, .. } = std::mem::replace(&mut self.state, Rx::Header) {
            self.pool.release(req);
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
        let h = RequestHeader::decode(&hb).map_err(|e| End::Protocol(e.to_string()))?;
        let need = check_framing(&h).map_err(|e| End::Protocol(e.to_string()))?;
        let Some(mut req) = self.pool.acquire(need) else {
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
        self.dev.stats.request(h.op);
        req.buffer(need);
        if h.op == Op::Write && need > 0 {
            self.frame_since.get_or_insert_with(Instant::now);
            self.state = Rx::Data {
                req,
                header: h,
                got: 0,
            };
        } else {
            self.frame_since = None;
            self.start(req, &h).map_err(End::Ring)?;
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
        let Rx::Data { req, header, .. } = std::mem::replace(&mut self.state, Rx::Header) else {
            return Ok(Some(true));
        };
        self.frame_since = None;
        self.start(req, &header).map_err(End::Ring)?;
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

    /// Starts a request's I/O: on this thread for a memory file, else through the ring.
    fn start(&mut self, mut req: Box<Request>, h: &RequestHeader) -> io::Result<()> {
        if let Some(reason) = req.start(h, self.dev) {
            tracing::debug!(
                peer = %self.peer, device = %self.dev.name, id = h.id, op = ?h.op,
                sector = h.sector, len = h.len, reason, "request refused"
            );
        }
        if !req.touches_device() {
            req.complete(0);
            self.finish(req);
            return Ok(());
        }
        if self.inline {
            if req.is_pending_read() && req.charge >= SENDFILE_MIN {
                // The data leaves with the response, straight from the file.
                self.dev.stats.device_op();
                req.send_from_file();
            } else {
                loop {
                    self.dev.stats.device_op();
                    let res = req.run_sync(self.dev_fd);
                    if req.complete(res) == Next::Done {
                        break;
                    }
                }
            }
            self.finish(req);
            return Ok(());
        }
        self.push(req)
    }

    /// Queues the request's next operation, handing the request to the kernel. On
    /// failure the request goes back to the pool, unanswered.
    fn push(&mut self, req: Box<Request>) -> io::Result<()> {
        let ptr = Box::into_raw(req);
        // SAFETY: `ptr` comes from `Box::into_raw` just above and nothing else refers to
        // the request yet.
        let entry = unsafe { &mut *ptr }.entry(types::Fd(self.dev_fd), ptr as u64);
        // SAFETY: the entry points into the request's buffer (or the static zero buffer);
        // the request is owned by its `user_data` until `reap` takes it back with
        // `Box::from_raw`; nothing touches it before.
        match unsafe { self.ring.push(&entry) } {
            Ok(()) => {
                self.dev.stats.device_op();
                self.in_ring += 1;
                self.queued += 1;
                if self.queued >= SUBMIT_BATCH {
                    self.submit()?;
                }
                Ok(())
            }
            Err(e) => {
                // SAFETY: the entry was not queued, so the kernel never saw `ptr`; this
                // takes back the ownership given away above, once.
                let req = unsafe { Box::from_raw(ptr) };
                self.pool.release(req);
                Err(e)
            }
        }
    }

    /// Step 2.
    fn submit(&mut self) -> io::Result<()> {
        if self.queued > 0 {
            self.ring.submit()?;
            self.queued = 0;
        }
        Ok(())
    }

    /// Step 3: completions in. Returns whether a request finished or continued.
    fn reap(&mut self) -> bool {
        if self.in_ring == 0 && !self.poll_in && !self.poll_out {
            return false;
        }
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        self.ring.reap(&mut cqes);
        let mut progress = false;
        for &(user_data, res) in &cqes {
            match user_data {
                POLL_IN => self.poll_in = false,
                POLL_OUT => self.poll_out = false,
                _ => {
                    // SAFETY: every other user_data is a pointer from `Box::into_raw` in
                    // `push`; each queued entry yields exactly one completion, which
                    // gives the request back here, once.
                    let mut req = unsafe { Box::from_raw(user_data as *mut Request) };
                    self.in_ring -= 1;
                    progress = true;
                    match req.complete(res) {
                        Next::Again => {
                            if let Err(e) = self.push(req) {
                                tracing::error!(peer = %self.peer, device = %self.dev.name,
                                    error = %e, "cannot continue a request; closing the session");
                                self.fail_socket(e);
                            }
                        }
                        Next::Done => self.finish(req),
                    }
                }
            }
        }
        self.cqes = cqes;
        progress
    }

    /// A request is done: count it and queue its response.
    fn finish(&mut self, mut req: Box<Request>) {
        self.account(&req);
        if self.writable {
            req.encode_response();
            self.out.push_back(req);
        } else {
            self.pool.release(req);
        }
    }

    /// Counts a finished request.
    fn account(&self, req: &Request) {
        let stats = &self.dev.stats;
        stats.answered(req.received);
        match (req.status, req.op) {
            (Status::Ok, Op::Read) => stats.read_bytes(req.data_bytes()),
            (Status::Ok, Op::Write) => stats.wrote_bytes(req.data_bytes()),
            (Status::Ok, _) => {}
            (status, op) => {
                stats.request_error();
                if req.errno != 0 {
                    tracing::warn!(device = %self.dev.name, path = %self.dev.path.display(),
                        ?op, ?status, id = req.id,
                        error = %io::Error::from_raw_os_error(req.errno), "device I/O failed");
                }
            }
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
        while let Some(r) = self.out.pop_front() {
            self.pool.release(r);
        }
        self.out_sent = 0;
        if self.reading {
            self.stop_reading(End::Socket(e));
        }
    }

    /// Step 4: sends queued responses until done or the socket is full. Returns whether
    /// a response left entirely.
    fn send(&mut self) -> bool {
        let mut progress = false;
        while self.writable && !self.out.is_empty() {
            match self.send_some() {
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

    /// One `sendmsg` of as many responses as fit, or one `sendfile` of a response's
    /// data. `Some(whether a response completed)`, or `None` when the socket is full.
    fn send_some(&mut self) -> io::Result<Option<bool>> {
        // A response whose header is out and whose data comes from the file.
        if let Some(first) = self.out.front() {
            if let (_, ResponseData::File { offset, len }) = first.response() {
                if self.out_sent >= RESPONSE_HEADER_LEN {
                    let done = self.out_sent - RESPONSE_HEADER_LEN;
                    let mut off = (offset + done as u64) as libc::off_t;
                    // SAFETY: both are open descriptors; `off` is a live off_t.
                    let n =
                        unsafe { libc::sendfile(self.sock_fd, self.dev_fd, &mut off, len - done) };
                    return match n {
                        0 => Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the device ended before the data of a read",
                        )),
                        n if n > 0 => Ok(Some(self.advance(n as usize))),
                        _ => would_block(io::Error::last_os_error()),
                    };
                }
            }
        }
        self.iovs.clear();
        let mut skip = self.out_sent;
        let mut more = false;
        for r in &self.out {
            if self.iovs.len() + 2 > MAX_IOV {
                break;
            }
            let (head, data) = r.response();
            if skip < head.len() {
                self.iovs.push(libc::iovec {
                    // SAFETY: skip < head.len(), inside the header.
                    iov_base: unsafe { head.as_ptr().add(skip) } as *mut libc::c_void,
                    iov_len: head.len() - skip,
                });
                skip = 0;
            } else {
                skip -= head.len();
            }
            match data {
                ResponseData::Buf(d) => {
                    if skip < d.len() {
                        self.iovs.push(libc::iovec {
                            // SAFETY: skip < d.len(), inside the data.
                            iov_base: unsafe { d.as_ptr().add(skip) } as *mut libc::c_void,
                            iov_len: d.len() - skip,
                        });
                    }
                    skip = 0;
                }
                ResponseData::File { .. } => {
                    // Its data follows with sendfile; hold the header back to go with it.
                    more = true;
                    break;
                }
            }
        }
        if self.iovs.is_empty() {
            return Ok(Some(false));
        }
        // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = self.iovs.as_mut_ptr();
        msg.msg_iovlen = self.iovs.len();
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
        loop {
            // SAFETY: each iovec points into a response header or data buffer owned by a
            // request in `out`, alive and untouched during the call.
            let n = unsafe { libc::sendmsg(self.sock_fd, &msg, flags) };
            if n >= 0 {
                return Ok(Some(self.advance(n as usize)));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return would_block(e);
            }
        }
    }

    /// Accounts `n` bytes sent: releases the responses that left entirely. Returns
    /// whether one did.
    fn advance(&mut self, mut n: usize) -> bool {
        let mut done = false;
        while let Some(r) = self.out.front() {
            let total = RESPONSE_HEADER_LEN
                + match r.response().1 {
                    ResponseData::Buf(d) => d.len(),
                    ResponseData::File { len, .. } => len,
                };
            let left = total - self.out_sent;
            if n < left {
                self.out_sent += n;
                break;
            }
            n -= left;
            self.out_sent = 0;
            if let Some(r) = self.out.pop_front() {
                self.pool.release(r);
            }
            done = true;
        }
        done
    }

    /// Sleeps until the socket or the device has something, or a mid-frame timeout.
    fn sleep(&mut self) -> io::Result<()> {
        let want_in = self.reading && !self.budget_blocked;
        let want_out = self.writable && !self.out.is_empty();
        if want_in && !self.poll_in {
            self.arm(libc::POLLIN, POLL_IN)?;
            self.poll_in = true;
        }
        if want_out && !self.poll_out {
            self.arm(libc::POLLOUT, POLL_OUT)?;
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
        self.queued = 0;
        self.ring.wait(timeout)
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

    fn arm(&mut self, events: libc::c_short, token: u64) -> io::Result<()> {
        let entry = opcode::PollAdd::new(types::Fd(self.sock_fd), events as u32)
            .build()
            .user_data(token);
        // SAFETY: a poll refers to no memory; its user_data is a token, not a request.
        unsafe { self.ring.push(&entry) }
    }
}

/// `Ok(None)` for EAGAIN (the socket is full), else the error.
fn would_block<T>(e: io::Error) -> io::Result<Option<T>> {
    if e.kind() == io::ErrorKind::WouldBlock {
        Ok(None)
    } else {
        Err(e)
    }
}

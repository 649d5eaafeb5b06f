//! The I/O engine of one session: two threads sharing the session's io_uring.
//!
//! - The **reader** (the session's own thread) reads request frames from the socket,
//!   validates them, takes a buffer from the session's [`Pool`] (waiting, and so not
//!   reading the socket, while the in-flight budget is spent), reads a write's data
//!   into it, and queues the operation; it submits in batches, and always before it
//!   could block.
//! - The **completer** waits for completions (`io_uring_enter` with GETEVENTS),
//!   continues short transfers and write-zeroes fallbacks, and writes the finished
//!   responses with one vectored write per batch, then returns the buffers to the pool.
//!
//! A request is a `Box<Request>` whose raw pointer is the operation's `user_data`: the
//! kernel owns it from submission until its completion is reaped, so its buffer cannot
//! be freed or reused while I/O on it is in flight. Requests refused without device I/O
//! ride a NOP so that every response leaves through the completer. When the reader ends
//! (EOF, protocol error, shutdown) it queues a NOP with [`SENTINEL`] as `user_data`; the
//! completer finishes every request in flight, answering them if the socket still
//! takes writes, and ends when the sentinel has come back and nothing is in flight.

use std::io::{self, ErrorKind, IoSlice, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Duration;

use devlend_fabric::wire::REQUEST_HEADER_LEN;
use devlend_fabric::{Op, RequestHeader, Status};
use io_uring::{opcode, types};

use crate::device::Device;
use crate::frame::{FrameError, FrameReader};
use crate::pool::{Acquire, Pool};
use crate::request::{check_framing, Next, Request};
use crate::uring::Ring;
use crate::{MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES};

/// `user_data` of the reader's last NOP (a request pointer is never null).
const SENTINEL: u64 = 0;
/// Operations queued before the reader submits even if more frames are buffered.
const SUBMIT_BATCH: usize = 32;
/// Responses per vectored write (two slices each, within IOV_MAX).
const WRITE_BATCH: usize = 256;

/// How the reader's side of a session ended.
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
    /// The completion side ended first (the socket could not be written).
    #[error("responses could not be delivered")]
    Completer,
    /// A thread could not be started.
    #[error("cannot start the completion thread")]
    Thread(#[source] io::Error),
}

impl From<FrameError> for End {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Closed => End::PeerClosed,
            FrameError::Io(e) => End::Socket(e),
            e @ (FrameError::Truncated { .. } | FrameError::Stalled(..)) => {
                End::Protocol(e.to_string())
            }
        }
    }
}

/// What both threads of a session share.
struct Session<'a> {
    dev: &'a Device,
    peer: SocketAddr,
    sock: &'a TcpStream,
    ring: &'a Ring,
    pool: Pool,
    fd: types::Fd,
}

/// Serves requests on an open session until the peer leaves or breaks the protocol;
/// returns once nothing is in flight.
pub(crate) fn run(
    dev: &Device,
    sock: &TcpStream,
    peer: SocketAddr,
    ring: &Ring,
    mid_frame_timeout: Duration,
    name: String,
) -> End {
    let s = Session {
        dev,
        peer,
        sock,
        ring,
        pool: Pool::new(MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES),
        fd: types::Fd(dev.file.as_raw_fd()),
    };
    std::thread::scope(|scope| {
        let completer = std::thread::Builder::new()
            .name(name)
            .spawn_scoped(scope, || {
                let _stop = StopOnExit(&s);
                s.complete_loop();
            });
        let completer = match completer {
            Ok(c) => c,
            Err(e) => return End::Thread(e),
        };
        let end = s.read_loop(mid_frame_timeout);
        s.end_reading();
        // A completer that panicked leaks the requests still in flight (never freed,
        // so never reused under the kernel); the session ends all the same.
        let _ = completer.join();
        end
    })
}

/// Wakes the reader when the completer ends: no more budget, no more socket.
struct StopOnExit<'s, 'a>(&'s Session<'a>);

impl Drop for StopOnExit<'_, '_> {
    fn drop(&mut self) {
        self.0.pool.close();
        let _ = self.0.sock.shutdown(Shutdown::Both);
    }
}

impl Session<'_> {
    /// The reader: frames in, operations queued.
    fn read_loop(&self, mid_frame_timeout: Duration) -> End {
        let mut fr = FrameReader::new(self.sock, mid_frame_timeout);
        let mut queued = 0usize;
        let flush = |queued: &mut usize| -> Result<(), End> {
            if *queued > 0 {
                self.ring.submit().map_err(End::Ring)?;
                *queued = 0;
            }
            Ok(())
        };
        loop {
            let mut hb = [0u8; REQUEST_HEADER_LEN];
            if fr.buffered() < REQUEST_HEADER_LEN {
                if let Err(e) = flush(&mut queued) {
                    return e;
                }
            }
            if let Err(e) = fr.read_exact(&mut hb, 0, REQUEST_HEADER_LEN) {
                return e.into();
            }
            let h = match RequestHeader::decode(&hb) {
                Ok(h) => h,
                Err(e) => return End::Protocol(e.to_string()),
            };
            self.dev.stats.request(h.op);
            let need = match check_framing(&h) {
                Ok(n) => n,
                Err(e) => return End::Protocol(e.to_string()),
            };
            let mut req = match self.pool.try_acquire(need) {
                Acquire::Got(r) => r,
                Acquire::Closed => return End::Completer,
                Acquire::Full => {
                    // Completions can only free the budget once queued work is submitted.
                    if let Err(e) = flush(&mut queued) {
                        return e;
                    }
                    match self.pool.acquire(need) {
                        Some(r) => r,
                        None => return End::Completer,
                    }
                }
            };
            let data = req.buffer(need);
            if h.op == Op::Write {
                if fr.buffered() < need {
                    if let Err(e) = flush(&mut queued) {
                        self.pool.release([req]);
                        return e;
                    }
                }
                if let Err(e) = fr.read_exact(data, REQUEST_HEADER_LEN, REQUEST_HEADER_LEN + need) {
                    self.pool.release([req]);
                    return e.into();
                }
            }
            if let Some(reason) = req.start(&h, self.dev) {
                tracing::debug!(
                    peer = %self.peer, device = %self.dev.name, id = h.id, op = ?h.op,
                    sector = h.sector, len = h.len, reason, "request refused"
                );
            }
            if let Err(e) = self.submit(req) {
                return End::Ring(e);
            }
            queued += 1;
            if queued >= SUBMIT_BATCH {
                if let Err(e) = flush(&mut queued) {
                    return e;
                }
            }
        }
    }

    /// Queues the request's next operation, handing the request to the kernel. On
    /// failure the request goes back to the pool, unanswered.
    fn submit(&self, req: Box<Request>) -> io::Result<()> {
        let touches_device = req.touches_device();
        let ptr = Box::into_raw(req);
        // SAFETY: `ptr` comes from `Box::into_raw` just above and nothing else refers to
        // the request yet.
        let entry = unsafe { &mut *ptr }.entry(self.fd, ptr as u64);
        // SAFETY: the entry points into the request's buffer (or the static zero buffer);
        // the request is owned by its `user_data` until the completer reaps the
        // completion and takes it back with `Box::from_raw`; nothing touches it before.
        match unsafe { self.ring.push(&entry) } {
            Ok(()) => {
                if touches_device {
                    self.dev.stats.device_op();
                }
                Ok(())
            }
            Err(e) => {
                // SAFETY: the entry was not queued, so the kernel never saw `ptr`; this
                // takes back the ownership given away above, once.
                let req = unsafe { Box::from_raw(ptr) };
                self.pool.release([req]);
                Err(e)
            }
        }
    }

    /// Tells the completer that nothing more will be queued.
    fn end_reading(&self) {
        let nop = opcode::Nop::new().build().user_data(SENTINEL);
        // SAFETY: a NOP refers to no memory, and SENTINEL is not a request pointer.
        let res = unsafe { self.ring.push(&nop) }.and_then(|()| self.ring.submit());
        if let Err(e) = res {
            // The completer cannot learn that reading ended: the ring is unusable.
            tracing::error!(peer = %self.peer, device = %self.dev.name, error = %e,
                "cannot end the session's I/O; its resources are leaked");
        }
    }

    /// The completer: completions in, responses out.
    fn complete_loop(&self) {
        let mut cqes: Vec<(u64, i32)> = Vec::with_capacity(256);
        let mut done: Vec<Box<Request>> = Vec::with_capacity(256);
        let mut reader_done = false;
        let mut writable = true;
        loop {
            if let Err(e) = self.ring.submit_and_wait() {
                // Requests still in flight stay owned by the kernel and are leaked.
                tracing::error!(peer = %self.peer, device = %self.dev.name, error = %e,
                    "io_uring wait failed; abandoning the session");
                return;
            }
            cqes.clear();
            self.ring.reap(&mut cqes);
            for &(user_data, res) in &cqes {
                if user_data == SENTINEL {
                    reader_done = true;
                    continue;
                }
                // SAFETY: every other user_data is a pointer from `Box::into_raw` in
                // `submit`; each queued entry yields exactly one completion, which gives
                // the request back here, once.
                let mut req = unsafe { Box::from_raw(user_data as *mut Request) };
                match req.complete(res) {
                    Next::Again => {
                        if let Err(e) = self.submit(req) {
                            tracing::error!(peer = %self.peer, device = %self.dev.name,
                                error = %e, "cannot continue a request; closing the session");
                            writable = false;
                            let _ = self.sock.shutdown(Shutdown::Both);
                        }
                    }
                    Next::Done => {
                        self.account(&req);
                        done.push(req);
                    }
                }
            }
            if !done.is_empty() {
                if writable {
                    if let Err(e) = self.write_responses(&mut done) {
                        tracing::info!(peer = %self.peer, device = %self.dev.name, error = %e,
                            "cannot send responses; closing the session");
                        writable = false;
                        let _ = self.sock.shutdown(Shutdown::Both);
                    }
                }
                self.pool.release(done.drain(..));
            }
            if reader_done && self.pool.in_flight() == 0 {
                return;
            }
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

    /// Sends the responses of `done`, a vectored write per batch.
    fn write_responses(&self, done: &mut [Box<Request>]) -> io::Result<()> {
        for r in done.iter_mut() {
            r.encode_response();
        }
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(2 * WRITE_BATCH.min(done.len()));
        for batch in done.chunks(WRITE_BATCH) {
            iov.clear();
            for r in batch {
                let (head, data) = r.response();
                iov.push(IoSlice::new(head));
                if !data.is_empty() {
                    iov.push(IoSlice::new(data));
                }
            }
            write_all_vectored(self.sock, &mut iov)?;
        }
        Ok(())
    }
}

/// Writes every byte of `bufs`, continuing after short writes.
fn write_all_vectored(mut w: &TcpStream, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

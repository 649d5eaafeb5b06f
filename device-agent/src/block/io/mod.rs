//! The device-I/O layer: block requests run on a lent device's backing file, the same
//! way for every session whatever its transport (TCP, TLS, RDMA).
//!
//! A session receives a request, takes a [`Request`] for it (with its buffer, a write's
//! data already in it) and hands it to its [`DeviceIo`] with [`DeviceIo::start`]. What
//! comes back are [`Event`]s: a request done (answer it), a request lost (the ring is
//! broken), a watched file descriptor ready (the session's socket or RDMA completion
//! channel). The session sleeps in [`DeviceIo::wait`] until one of them can happen.
//!
//! Two implementations, chosen per session by [`IoMode`] ([`SessionIo::new`]):
//! - [`Uring`]: every device operation through the session's io_uring;
//! - [`Inline`]: plain system calls on the session's thread, for files in memory
//!   (tmpfs, ramfs), which io_uring would hand to a kernel worker thread each; reads of
//!   [`inline::SENDFILE_MIN`] bytes or more may be left to [`DeviceIo::send_file`]
//!   (`sendfile` straight from the file to a socket) when the transport can take them.
//!
//! Both wait in `io_uring_enter`, the watched descriptors polled by one-shot poll
//! operations in the same ring, so that a completion and the socket wake the same
//! sleep. Both count every operation issued to the device and, when a request is done,
//! its latency, bytes and error in the device's counters ([`finished`]): a TCP session
//! and an RDMA session record the same things the same way.
//!
//! Below this layer: [`request`] (one request's operations and what each completion
//! means) and [`ring`] (the io_uring itself). Above it: the block engines of the
//! sessions (`block/tcp/engine.rs`, `block/rdma.rs`), which decode the wire's request
//! headers and encode its responses (`block/wire.rs`).

pub(crate) mod inline;
pub(crate) mod request;
pub(crate) mod ring;
pub(crate) mod throttled;
pub(crate) mod uring;

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::{BlockRequest, Status};

use crate::block::BlockDevice;
use crate::config::IoMode;
use crate::device_counters::DeviceCounters;

pub(crate) use self::inline::Inline;
pub(crate) use self::request::Request;
pub(crate) use self::throttled::Throttled;
pub(crate) use self::uring::Uring;

/// What a [`DeviceIo`] has for its session.
#[derive(Debug)]
pub(crate) enum Event {
    /// A request is done: its status is final, its counters are recorded; answer it.
    Done(Box<Request>),
    /// The ring refused a request's next operation: the request is back, unanswered,
    /// and the ring is broken (the session must end).
    Lost(Box<Request>, io::Error),
    /// A descriptor watched with [`DeviceIo::watch`] is ready: its token.
    Ready(u64),
}

/// A session's device I/O, and its one place to sleep.
///
/// Owned by the session's thread. Requests handed to [`DeviceIo::start`] come back as
/// [`Event::Done`] (or [`Event::Lost`]), at once or from a later [`DeviceIo::reap`];
/// while they are away the session must not touch them (the kernel may be writing
/// into their buffers).
pub(crate) trait DeviceIo {
    /// Sets `req` up for the block operation `op` ([`Request::start`]: what the device
    /// cannot serve is refused with an I/O error, no device I/O) and starts its device
    /// I/O. Its buffer holds at least the operation's data length (a write's data
    /// already in it); its `id` is the session's (the borrower's, over the wire): the
    /// device I/O never sees a wire header.
    fn start(&mut self, req: Box<Request>, op: &BlockRequest, out: &mut Vec<Event>);

    /// Hands the queued operations to the kernel.
    ///
    /// # Errors
    /// The ring failed: requests in flight are lost to the kernel, the session must end.
    fn submit(&mut self) -> io::Result<()>;

    /// Appends what happened since the last call: requests done, descriptors ready.
    fn reap(&mut self, out: &mut Vec<Event>);

    /// Asks for one [`Event::Ready`]`(token)` when `fd` has one of `events` (poll
    /// flags). One-shot: watch again after it fired.
    ///
    /// # Errors
    /// The ring failed.
    fn watch(&mut self, fd: RawFd, events: libc::c_short, token: u64) -> io::Result<()>;

    /// Submits, then sleeps until a request completes, a watched descriptor is ready,
    /// or `timeout` passes (when the kernel supports timed waits; else without limit).
    /// May return early; the caller reaps and decides.
    ///
    /// # Errors
    /// The ring failed.
    fn wait(&mut self, timeout: Option<Duration>) -> io::Result<()>;

    /// Requests handed to the kernel and not yet reaped (and, under limits, those held
    /// back: [`Throttled`]).
    fn in_flight(&self) -> usize;

    /// Whether [`DeviceIo::wait`] honours its timeout (`IORING_FEAT_EXT_ARG`, Linux
    /// 5.11).
    fn timed_waits(&self) -> bool;

    /// Gives back the requests held for the holder's limits and not started
    /// ([`Throttled`]): the session is ending and will not answer them. They never
    /// reached the device, so the borrower may send them again elsewhere without a
    /// second write landing. Nothing for an I/O without limits.
    // The boxes are the session's own allocations, reused from request to request.
    #[allow(clippy::vec_box)]
    fn cancel_held(&mut self, out: &mut Vec<Box<Request>>) {
        let _ = out;
    }

    /// Sends `len` bytes of the device at byte `offset` to the socket `to` without
    /// blocking (`sendfile`): the data of a read that [`DeviceIo::start`] finished
    /// without reading (`ResponseData::File`, `block/wire.rs`). Returns the bytes sent.
    ///
    /// # Errors
    /// The socket's, `WouldBlock` when it is full; `UnexpectedEof` when the device
    /// ends before.
    fn send_file(&mut self, to: RawFd, offset: u64, len: usize) -> io::Result<usize>;
}

/// A session's [`DeviceIo`], as [`IoMode`] chose it for the session's device.
pub(crate) enum SessionIo<'a> {
    /// Through io_uring.
    Uring(Uring<'a>),
    /// On the session's thread.
    Inline(Inline<'a>),
}

impl<'a> SessionIo<'a> {
    /// The device I/O of one session on `block`, the block device of `dev` (its name
    /// and counters): [`Inline`] for a file in memory (or
    /// every device with [`IoMode::Sync`]), else [`Uring`] with a ring of `entries`
    /// submission entries. `send_from_file`: the session's transport sends a read's
    /// data with [`DeviceIo::send_file`] (a socket), so large reads from a memory file
    /// need not be read into a buffer first.
    ///
    /// # Errors
    /// `io_uring_setup` failures (ENOMEM, io_uring disabled by the system).
    pub(crate) fn new(
        dev: Arc<DeviceCounters>,
        block: &'a BlockDevice,
        mode: IoMode,
        entries: u32,
        send_from_file: bool,
    ) -> io::Result<SessionIo<'a>> {
        let inline = match mode {
            IoMode::Auto => block.memory_backed,
            IoMode::Uring => false,
            IoMode::Sync => true,
        };
        Ok(if inline {
            SessionIo::Inline(Inline::new(dev, block, send_from_file)?)
        } else {
            SessionIo::Uring(Uring::new(dev, block, entries)?)
        })
    }
}

/// The first `user_data` of a watch: tokens count down from it, request pointers (heap
/// addresses) never come near it.
const WATCH_BASE: u64 = u64::MAX;

/// The ring's `user_data` for a watch's token.
fn watch_data(token: u64) -> u64 {
    WATCH_BASE - token
}

/// The token of a watch's `user_data`, or `None` for a request's.
fn watch_token(user_data: u64) -> Option<u64> {
    // Tokens are small: a session watches a descriptor or two.
    (user_data >= WATCH_BASE - 0xffff).then(|| WATCH_BASE - user_data)
}

/// Sets `req` up for `op`, logging a refusal; whether it needs device I/O (if not, it
/// is complete: answered with its immediate status).
fn prepare(
    dev: &DeviceCounters,
    block: &BlockDevice,
    req: &mut Request,
    op: &BlockRequest,
) -> bool {
    if let Some(reason) = req.start(op, block) {
        tracing::debug!(device = %dev.name, id = req.id, request = ?op, reason,
            "request refused");
    }
    if req.touches_device() {
        return true;
    }
    req.complete(0);
    finished(dev, block, req);
    false
}

/// The backing file of `block`.
fn block_fd(block: &BlockDevice) -> RawFd {
    std::os::fd::AsRawFd::as_raw_fd(&block.file)
}

/// Records a done request in the device's counters: answered (and its latency, from
/// [`Request::start`] to now), its bytes when it succeeded, an error (logged with the
/// errno when the device failed) when it did not.
pub(crate) fn finished(dev: &DeviceCounters, block: &BlockDevice, req: &Request) {
    let stats = &dev.stats;
    stats.answered(req.received);
    match (req.status, req.op) {
        (Status::Ok, op) => stats.data_bytes(op, req.data_bytes()),
        (status, op) => {
            stats.request_error();
            if req.errno != 0 {
                let path = Some(block.path.display());
                tracing::warn!(device = %dev.name, path = ?path,
                    ?op, ?status, id = req.id,
                    error = %io::Error::from_raw_os_error(req.errno), "device I/O failed");
            }
        }
    }
}

/// `sendfile` of `len` bytes of `from` at `offset` to `to`, without blocking.
fn send_file(to: RawFd, from: RawFd, offset: u64, len: usize) -> io::Result<usize> {
    let mut off = offset as libc::off_t;
    loop {
        // SAFETY: both are open descriptors; `off` is a live off_t.
        let n = unsafe { libc::sendfile(to, from, &mut off, len) };
        match n {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the device ended before the data of a read",
                ))
            }
            n if n > 0 => return Ok(n as usize),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;

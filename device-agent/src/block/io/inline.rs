//! [`DeviceIo`] by plain system calls on the session's thread, for files in memory
//! (tmpfs, ramfs): their I/O is a memory copy that never waits for a device, and
//! io_uring would hand each of their operations to a kernel worker thread (such files
//! cannot be accessed without blocking semantics), a thread hand-off per request.
//!
//! Every request is done when [`DeviceIo::start`] returns. A read of
//! [`SENDFILE_MIN`] bytes or more, on a session that sends with `sendfile`, is not even
//! read: its response carries its range of the file (`ResponseData::File`, `block/wire.rs`), sent by
//! [`DeviceIo::send_file`] with no copy into a buffer of ours.
//!
//! The session still sleeps in `io_uring_enter` (its watches are polls in a small
//! ring), as with [`super::Uring`].

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::BlockRequest;

use super::request::{Next, Request};
use super::ring::Ring;
use super::{block_fd, finished, prepare, watch_data, watch_token, DeviceIo, Event};
use crate::block::BlockDevice;
use crate::device_counters::DeviceCounters;

/// Reads at least this long, from a memory file, are sent with `sendfile`.
pub(crate) const SENDFILE_MIN: usize = 64 << 10;

/// Submission entries of the ring that only holds watches.
const WATCH_ENTRIES: u32 = 16;

/// A session's device I/O on its own thread.
pub(crate) struct Inline<'a> {
    dev: Arc<DeviceCounters>,
    /// The block device: its file, its limits.
    block: &'a BlockDevice,
    fd: RawFd,
    /// Large reads are left to [`DeviceIo::send_file`].
    send_from_file: bool,
    ring: Ring,
    /// Watches armed and not yet fired.
    watching: usize,
    cqes: Vec<(u64, i32)>,
}

impl<'a> Inline<'a> {
    /// Device I/O on `block`, the block device of `dev`; `send_from_file` as for
    /// [`super::SessionIo::new`].
    ///
    /// # Errors
    /// `io_uring_setup` failures (the ring of the watches).
    pub(crate) fn new(
        dev: Arc<DeviceCounters>,
        block: &'a BlockDevice,
        send_from_file: bool,
    ) -> io::Result<Inline<'a>> {
        Ok(Inline {
            fd: block_fd(block),
            dev,
            block,
            send_from_file,
            ring: Ring::new(WATCH_ENTRIES)?,
            watching: 0,
            cqes: Vec::with_capacity(8),
        })
    }
}

impl DeviceIo for Inline<'_> {
    fn start(&mut self, mut req: Box<Request>, op: &BlockRequest, out: &mut Vec<Event>) {
        if prepare(&self.dev, self.block, &mut req, op) {
            if self.send_from_file
                && req.is_pending_read()
                && req.range_len() >= SENDFILE_MIN as u64
            {
                // The data leaves with the response, straight from the file.
                self.dev.stats.device_op();
                req.send_from_file();
            } else {
                loop {
                    self.dev.stats.device_op();
                    let res = req.run_sync(self.fd);
                    if req.complete(res) == Next::Done {
                        break;
                    }
                }
            }
            finished(&self.dev, self.block, &req);
        }
        out.push(Event::Done(req));
    }

    fn submit(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Event>) {
        if self.watching == 0 {
            return;
        }
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        self.ring.reap(&mut cqes);
        for &(user_data, _) in &cqes {
            if let Some(token) = watch_token(user_data) {
                self.watching = self.watching.saturating_sub(1);
                out.push(Event::Ready(token));
            }
        }
        self.cqes = cqes;
    }

    fn watch(&mut self, fd: RawFd, events: libc::c_short, token: u64) -> io::Result<()> {
        self.ring.poll(fd, events, watch_data(token))?;
        self.watching += 1;
        Ok(())
    }

    fn wait(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.ring.wait(timeout)
    }

    fn in_flight(&self) -> usize {
        0
    }

    fn send_file(&mut self, to: RawFd, offset: u64, len: usize) -> io::Result<usize> {
        super::send_file(to, self.fd, offset, len)
    }

    fn timed_waits(&self) -> bool {
        self.ring.timed_waits()
    }
}

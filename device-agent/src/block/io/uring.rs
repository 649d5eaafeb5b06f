//! [`DeviceIo`] through io_uring: each request's operation is queued on the session's
//! ring, submitted in batches, and its completion continues the request (the rest of a
//! short transfer, a write-zeroes fallback) or finishes it.
//!
//! A request in flight is a `Box<Request>` whose raw pointer is the operation's
//! `user_data`: the kernel owns it from submission until its completion is reaped, so
//! its buffer cannot be freed or reused while I/O on it is in flight. If the ring itself
//! fails, requests still in it are leaked (never freed, so never reused under it).

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::BlockRequest;
use io_uring::types;

use super::request::{Next, Request};
use super::ring::Ring;
use super::{block_fd, finished, prepare, watch_data, watch_token, DeviceIo, Event};
use crate::block::BlockDevice;
use crate::device_counters::DeviceCounters;

/// Operations queued before they are submitted even if the session has more to start.
const SUBMIT_BATCH: usize = 32;

/// A session's device I/O through its io_uring.
pub(crate) struct Uring<'a> {
    dev: Arc<DeviceCounters>,
    /// The block device: its file, its limits.
    block: &'a BlockDevice,
    fd: RawFd,
    ring: Ring,
    /// Requests owned by the kernel (operations in the ring).
    in_ring: usize,
    /// Operations queued and not yet submitted.
    queued: usize,
    /// Watches armed and not yet fired.
    watching: usize,
    cqes: Vec<(u64, i32)>,
}

impl<'a> Uring<'a> {
    /// A ring of `entries` submission entries for `block`, the block device of `dev`.
    ///
    /// # Errors
    /// `io_uring_setup` failures.
    pub(crate) fn new(
        dev: Arc<DeviceCounters>,
        block: &'a BlockDevice,
        entries: u32,
    ) -> io::Result<Uring<'a>> {
        Ok(Uring {
            fd: block_fd(block),
            dev,
            block,
            ring: Ring::new(entries)?,
            in_ring: 0,
            queued: 0,
            watching: 0,
            cqes: Vec::with_capacity(256),
        })
    }

    /// Queues the request's next operation, handing the request to the kernel; a
    /// refusal gives it back as [`Event::Lost`].
    fn push(&mut self, req: Box<Request>, out: &mut Vec<Event>) {
        let ptr = Box::into_raw(req);
        // SAFETY: `ptr` comes from `Box::into_raw` just above and nothing else refers to
        // the request yet.
        let entry = unsafe { &mut *ptr }.entry(types::Fd(self.fd), ptr as u64);
        // SAFETY: the entry points into the request's buffer (or the static zero buffer);
        // the request is owned by its `user_data` until `reap` takes it back with
        // `Box::from_raw`; nothing touches it before.
        match unsafe { self.ring.push(&entry) } {
            Ok(()) => {
                self.dev.stats.device_op();
                self.in_ring += 1;
                self.queued += 1;
                if self.queued >= SUBMIT_BATCH {
                    if let Err(e) = self.submit() {
                        tracing::error!(device = %self.dev.name, error = %e, "io_uring submit failed");
                    }
                }
            }
            Err(e) => {
                // SAFETY: the entry was not queued, so the kernel never saw `ptr`; this
                // takes back the ownership given away above, once.
                let req = unsafe { Box::from_raw(ptr) };
                tracing::error!(device = %self.dev.name, error = %e, "cannot queue a request's operation");
                out.push(Event::Lost(req, e));
            }
        }
    }
}

impl DeviceIo for Uring<'_> {
    fn start(&mut self, mut req: Box<Request>, op: &BlockRequest, out: &mut Vec<Event>) {
        if prepare(&self.dev, self.block, &mut req, op) {
            self.push(req, out);
        } else {
            out.push(Event::Done(req));
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.queued > 0 {
            self.ring.submit()?;
            self.queued = 0;
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Event>) {
        if self.in_ring == 0 && self.watching == 0 {
            return;
        }
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        self.ring.reap(&mut cqes);
        for &(user_data, res) in &cqes {
            if let Some(token) = watch_token(user_data) {
                self.watching = self.watching.saturating_sub(1);
                out.push(Event::Ready(token));
                continue;
            }
            // SAFETY: every other user_data is a pointer from `Box::into_raw` in `push`;
            // each queued entry yields exactly one completion, which gives the request
            // back here, once.
            let mut req = unsafe { Box::from_raw(user_data as *mut Request) };
            self.in_ring -= 1;
            match req.complete(res) {
                Next::Again => self.push(req, out),
                Next::Done => {
                    finished(&self.dev, self.block, &req);
                    out.push(Event::Done(req));
                }
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
        // The wait submits what is queued.
        self.queued = 0;
        self.ring.wait(timeout)
    }

    fn in_flight(&self) -> usize {
        self.in_ring
    }

    fn send_file(&mut self, to: RawFd, offset: u64, len: usize) -> io::Result<usize> {
        super::send_file(to, self.fd, offset, len)
    }

    fn timed_waits(&self) -> bool {
        self.ring.timed_waits()
    }
}

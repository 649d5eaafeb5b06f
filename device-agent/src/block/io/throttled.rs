//! A session's device I/O under its holder's limits: a [`DeviceIo`] that holds back the
//! requests its [`Group`]'s buckets cannot pay for yet, in arrival order, and starts
//! them when they can. A held request is never failed; it counts as in flight, so the
//! session neither ends nor reads beyond its credit while it waits.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::{BlockRequest, Op};

use super::{DeviceIo, Event, Request};
use crate::device_counters::DeviceCounters;
use crate::options::HoldFirstWrite;
use crate::qos::{Cost, Group};

/// A request waiting for its holder's buckets.
struct Held {
    req: Box<Request>,
    op: BlockRequest,
    since: Instant,
}

/// `I` under the limits of a [`Group`] (or as it is, without one).
pub(crate) struct Throttled<I> {
    inner: I,
    group: Option<Arc<Group>>,
    dev: Arc<DeviceCounters>,
    held: VecDeque<Held>,
    /// The borrower reads `RESPONSE_THROTTLED` (it was granted
    /// `FEATURE_THROTTLE_NOTE`): mark the responses of held requests.
    note: bool,
    /// The test hook of [`crate::options::Options::hold_first_write`].
    hold: Option<HoldFirstWrite>,
}

/// What a request draws from its holder's buckets.
fn cost(op: &BlockRequest) -> Cost {
    let bytes = match *op {
        BlockRequest::Read { len, .. } | BlockRequest::Write { len, .. } => u64::from(len.0),
        _ => 0,
    };
    Cost::block(op.op(), bytes)
}

impl<I: DeviceIo> Throttled<I> {
    /// `inner` under `group`'s limits (`None`, or a group that limits nothing: as it
    /// is). `note`: mark the responses of the requests held back.
    pub(crate) fn new(
        inner: I,
        group: Option<Arc<Group>>,
        dev: Arc<DeviceCounters>,
        note: bool,
        hold: Option<HoldFirstWrite>,
    ) -> Self {
        Throttled {
            inner,
            group: group.filter(|g| !g.is_unlimited()),
            dev,
            held: VecDeque::new(),
            note,
            hold,
        }
    }

    /// Starts the held requests the buckets now pay for, oldest first; how long until
    /// the next one can go, if one is left.
    fn release(&mut self, out: &mut Vec<Event>) -> Option<Duration> {
        let group = self.group.as_ref()?;
        let now = Instant::now();
        while let Some(front) = self.held.front() {
            if let Err(wait) = group.take(&cost(&front.op), now) {
                return Some(wait);
            }
            if let Some(h) = self.held.pop_front() {
                self.dev
                    .stats
                    .throttle_released(now.saturating_duration_since(h.since));
                self.inner.start(h.req, &h.op, out);
            }
        }
        None
    }
}

impl<I: DeviceIo> DeviceIo for Throttled<I> {
    fn start(&mut self, mut req: Box<Request>, op: &BlockRequest, out: &mut Vec<Event>) {
        req.throttled = false;
        if let Some(hold) = self.hold.as_ref().filter(|_| op.op() == Op::Write) {
            if let Some(d) = hold.take() {
                // The test hook: this session's thread is the slow device.
                std::thread::sleep(d);
            }
        }
        let Some(group) = &self.group else {
            return self.inner.start(req, op, out);
        };
        let now = Instant::now();
        if self.held.is_empty() && group.take(&cost(op), now).is_ok() {
            return self.inner.start(req, op, out);
        }
        req.throttled = self.note;
        self.dev.stats.throttle_held();
        self.held.push_back(Held {
            req,
            op: *op,
            since: now,
        });
    }

    fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    fn reap(&mut self, out: &mut Vec<Event>) {
        self.inner.reap(out);
        if !self.held.is_empty() {
            self.release(out);
        }
    }

    fn watch(&mut self, fd: RawFd, events: libc::c_short, token: u64) -> io::Result<()> {
        self.inner.watch(fd, events, token)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        let due = match (&self.group, self.held.front()) {
            (Some(g), Some(front)) => match g.take_probe(&cost(&front.op)) {
                Duration::ZERO => return Ok(()),
                d => Some(d),
            },
            _ => None,
        };
        let timeout = match (timeout, due) {
            (Some(t), Some(d)) => Some(t.min(d)),
            (t, d) => t.or(d),
        };
        match (due, self.inner.timed_waits()) {
            // Without timed waits the ring would sleep past the release time.
            (Some(d), false) if self.inner.in_flight() == 0 => {
                std::thread::sleep(d.min(timeout.unwrap_or(d)));
                Ok(())
            }
            _ => self.inner.wait(timeout),
        }
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len()
    }

    fn send_file(&mut self, to: RawFd, offset: u64, len: usize) -> io::Result<usize> {
        self.inner.send_file(to, offset, len)
    }

    fn timed_waits(&self) -> bool {
        self.inner.timed_waits()
    }

    #[allow(clippy::vec_box)]
    fn cancel_held(&mut self, out: &mut Vec<Box<Request>>) {
        for h in self.held.drain(..) {
            self.dev.stats.throttle_cancelled();
            out.push(h.req);
        }
    }
}

impl<I> Drop for Throttled<I> {
    fn drop(&mut self) {
        // A session that ends with requests held (its ring broke) leaves them
        // unanswered: they no longer wait.
        for _ in self.held.drain(..) {
            self.dev.stats.throttle_cancelled();
        }
    }
}

//! Fakes the block engines' unit tests share (`tcp/tests.rs`, `rdma/tests.rs`): a
//! [`DeviceIo`] that hands finished requests back out of order, and a lent 1 MiB image.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::BlockRequest;

use crate::block::io::{DeviceIo, Event, Request};
use crate::block::BlockDevice;
use crate::device::{Backing, Device};
use crate::DeviceSpec;

/// A [`DeviceIo`] that does the real I/O (`inner`) but holds every finished request
/// until the next reap (or, with `until_sleep`, until the engine has nothing else to do
/// and waits), then hands them back newest first.
pub(crate) struct Reordered<I> {
    inner: I,
    /// Finished requests ([`Event::Done`]) not yet handed back.
    held: Vec<Event>,
    until_sleep: bool,
    /// The engine waited while requests were held.
    slept: bool,
    /// Requests handed back out of their start order.
    reordered: Arc<AtomicUsize>,
}

impl<I: DeviceIo> DeviceIo for Reordered<I> {
    fn start(&mut self, req: Box<Request>, op: &BlockRequest, out: &mut Vec<Event>) {
        let mut done = Vec::new();
        self.inner.start(req, op, &mut done);
        for e in done {
            match e {
                done @ Event::Done(_) => self.held.push(done),
                other => out.push(other),
            }
        }
    }

    fn submit(&mut self) -> std::io::Result<()> {
        self.inner.submit()
    }

    fn reap(&mut self, out: &mut Vec<Event>) {
        self.inner.reap(out);
        if self.until_sleep && !self.slept {
            return;
        }
        self.slept = false;
        if self.held.len() > 1 {
            self.reordered.fetch_add(self.held.len(), Ordering::Relaxed);
        }
        out.extend(self.held.drain(..).rev());
    }

    fn watch(&mut self, fd: RawFd, events: libc::c_short, token: u64) -> std::io::Result<()> {
        self.inner.watch(fd, events, token)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> std::io::Result<()> {
        if self.held.is_empty() {
            self.inner.wait(timeout)
        } else {
            self.slept = true;
            Ok(())
        }
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len()
    }

    fn timed_waits(&self) -> bool {
        self.inner.timed_waits()
    }

    fn send_file(&mut self, to: RawFd, offset: u64, len: usize) -> std::io::Result<usize> {
        self.inner.send_file(to, offset, len)
    }
}

pub(crate) fn device(dir: &tempfile::TempDir) -> Arc<Device> {
    let img = dir.path().join("d.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).expect("image");
    let spec: DeviceSpec = format!("d={}", img.display()).parse().expect("spec");
    Arc::new(Device::open(&spec).expect("open"))
}

pub(crate) fn block(dev: &Device) -> &BlockDevice {
    match &dev.backing {
        Backing::Block(b) => b,
        _ => panic!("a block device"),
    }
}

pub(crate) fn reordered_io<I>(
    inner: I,
    until_sleep: bool,
    count: &Arc<AtomicUsize>,
) -> Reordered<I> {
    Reordered {
        inner,
        held: Vec::new(),
        until_sleep,
        slept: false,
        reordered: Arc::clone(count),
    }
}

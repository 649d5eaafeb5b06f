//! The closed loop: each queue's thread keeps `iodepth` requests in flight, resubmits
//! each one as it completes, and records its completion latency; the calling thread
//! measures the server processes over the same window and draws the progress line.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

use super::options::{Rw, Workload};
use super::procstat::{ProcFigures, Watched, Window};
use super::stats::{Figures, Latencies};
use super::Progress;
use crate::blk_client::{BlkClient, BlkOp, QueueIo};

/// How long a queue waits for one completion before giving up on the device.
const STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Measured {
    /// Client-side figures.
    pub figures: Figures,
    /// Server processes over the same window.
    pub procs: Vec<ProcFigures>,
}

/// The phases of a run, shared by its threads.
struct Clock {
    ramp_end: Instant,
    end: Instant,
}

/// What one queue's thread counted in the window.
struct QueueTally {
    lat: Latencies,
    ios: u64,
    reads: u64,
    writes: u64,
    errors: u64,
}

/// Runs `w` on the vhost-user-blk socket `socket`, measuring `procs` over the window.
///
/// # Errors
/// The socket cannot be opened, a queue stalls for 10 s, a process vanishes.
pub fn run(
    socket: &Path,
    w: &Workload,
    procs: &[Watched],
    progress: &Progress,
    what: &str,
) -> Result<Measured> {
    w.validate()?;
    let share = (w.bs * w.iodepth).div_ceil(4096) * 4096;
    let mut client = BlkClient::connect(socket, w.queues, share * w.queues)?;
    if client.num_queues() < w.queues {
        return Err(anyhow!(
            "{} offers {} queues, {} asked",
            socket.display(),
            client.num_queues(),
            w.queues
        ));
    }
    let capacity = client.capacity();
    if capacity < w.bs as u64 {
        return Err(anyhow!(
            "device of {capacity} bytes is smaller than one request"
        ));
    }
    let mut ios = client.queue_ios();
    for (i, q) in ios.iter_mut().enumerate() {
        q.fill(i as u8 ^ 0x5a);
    }
    let start = Instant::now();
    let clock = Clock {
        ramp_end: start + w.ramp,
        end: start + w.ramp + w.runtime,
    };
    let done: Vec<AtomicU64> = (0..w.queues).map(|_| AtomicU64::new(0)).collect();
    let (tallies, procs) = std::thread::scope(|s| -> Result<_> {
        let handles: Vec<_> = ios
            .into_iter()
            .enumerate()
            .map(|(qi, mut q)| {
                let (clock, done) = (&clock, &done[qi]);
                s.spawn(move || closed_loop(&mut q, w, qi, capacity, clock, done))
            })
            .collect();
        let procs = watch(w, procs, &clock, &done, progress, what);
        let tallies = handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a bench thread panicked"))?)
            .collect::<Result<Vec<_>>>()?;
        Ok((tallies, procs?))
    })?;
    let mut lat = Latencies::new()?;
    let (mut n, mut r, mut wr, mut e) = (0, 0, 0, 0);
    for t in &tallies {
        lat.merge(&t.lat)?;
        n += t.ios;
        r += t.reads;
        wr += t.writes;
        e += t.errors;
    }
    let figures = Figures::new(n, r, wr, e, w.runtime.as_secs_f64(), w.bs, &lat);
    Ok(Measured { figures, procs })
}

/// The calling thread's part: progress until the ramp ends, the process window over
/// the measured one, progress until it ends.
fn watch(
    w: &Workload,
    procs: &[Watched],
    clock: &Clock,
    done: &[AtomicU64],
    progress: &Progress,
    what: &str,
) -> Result<Vec<ProcFigures>> {
    let total = w.ramp + w.runtime;
    let count = || done.iter().map(|d| d.load(Ordering::Relaxed)).sum::<u64>();
    let mut last = (Instant::now(), count());
    let mut iops = 0.0;
    let mut tick = |until: Instant, phase: &str| loop {
        let now = Instant::now();
        if now >= until {
            break;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(250)));
        let (t, c) = (Instant::now(), count());
        let dt = t.duration_since(last.0).as_secs_f64();
        if dt >= 0.2 {
            iops = (c - last.1) as f64 / dt;
            last = (t, c);
        }
        let el = t.saturating_duration_since(clock.ramp_end - w.ramp);
        progress.set(format!(
            "{what}: {phase} {:.1}/{:.1} s  {:>9.0} IOPS  {:>8.1} MB/s",
            el.as_secs_f64().min(total.as_secs_f64()),
            total.as_secs_f64(),
            iops,
            iops * w.bs as f64 / 1e6
        ));
    };
    tick(clock.ramp_end, "ramp");
    let window = Window::start(procs);
    tick(clock.end, "run");
    window?.end()
}

/// A small, fast pseudo-random generator (xorshift64*), seeded per queue.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// One queue's closed loop.
fn closed_loop(
    q: &mut QueueIo<'_>,
    w: &Workload,
    qi: usize,
    capacity: u64,
    clock: &Clock,
    done: &AtomicU64,
) -> Result<QueueTally> {
    let bs = w.bs as u64;
    let blocks = capacity / bs;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (qi as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
    // Sequential streams start at an even split of the device, one per queue.
    let mut cursor = blocks * qi as u64 / w.queues as u64;
    let mut next = |slot: usize| -> BlkOp {
        let block = if w.rw.random() {
            rng.next() % blocks
        } else {
            let b = cursor;
            cursor = (cursor + 1) % blocks;
            b
        };
        let write = match w.rw {
            Rw::Randread | Rw::Read => false,
            Rw::Randwrite | Rw::Write => true,
            Rw::Randrw => rng.next() & 1 == 1,
        };
        let (offset, buf, len) = (block * bs, slot * w.bs, w.bs);
        if write {
            BlkOp::Write { offset, buf, len }
        } else {
            BlkOp::Read { offset, buf, len }
        }
    };
    let mut t = QueueTally {
        lat: Latencies::new()?,
        ios: 0,
        reads: 0,
        writes: 0,
        errors: 0,
    };
    let mut sent = vec![(Instant::now(), false); w.iodepth];
    let now = Instant::now();
    for (slot, s) in sent.iter_mut().enumerate() {
        let op = next(slot);
        q.submit(&op, slot)?;
        *s = (now, matches!(op, BlkOp::Write { .. }));
    }
    let mut inflight = w.iodepth;
    let mut out = Vec::with_capacity(w.iodepth);
    while inflight > 0 {
        out.clear();
        q.complete(1, STALL_TIMEOUT, &mut out).with_context(|| {
            format!(
                "queue {qi}: no completion in {} s; is the vhost-user server (the compute \
                 agent) still running? this frontend (libblkio) does not reconnect",
                STALL_TIMEOUT.as_secs()
            )
        })?;
        let now = Instant::now();
        let measured = now >= clock.ramp_end && now < clock.end;
        for &(slot, ret) in &out {
            let Some(&(at, write)) = sent.get(slot) else {
                return Err(anyhow!("completion for unknown request {slot}"));
            };
            inflight -= 1;
            if ret != 0 {
                t.errors += 1;
            }
            if measured {
                t.lat.record(now.duration_since(at));
                t.ios += 1;
                if write {
                    t.writes += 1;
                } else {
                    t.reads += 1;
                }
            }
            if now < clock.end {
                let op = next(slot);
                q.submit(&op, slot)?;
                sent[slot] = (now, matches!(op, BlkOp::Write { .. }));
                inflight += 1;
            }
        }
        done.fetch_add(out.len() as u64, Ordering::Relaxed);
    }
    Ok(t)
}

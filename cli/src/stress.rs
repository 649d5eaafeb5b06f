//! `devlend stress`: a matrix of deep closed-loop workloads through a vhost-user-blk
//! socket (libblkio), for tests: each cell keeps `depth` requests in flight on each of
//! its queues for a while, fails if a queue goes [`Matrix::stall`] without a completion
//! or a request fails, and is followed by a verified pass (distinct patterns written on
//! every queue, read back on another, compared). Each cell is a new frontend connection,
//! so that a frontend's teardown with requests just completed is part of it.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::blk_client::{BlkClient, BlkOp, QueueIo};

/// What a cell's requests are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mix {
    /// Random reads.
    Read,
    /// Random writes.
    Write,
    /// Random reads and writes, half each.
    Mixed,
}

/// The cells to run: every combination of the lists.
#[derive(Debug, Clone)]
pub struct Matrix {
    /// Queue counts.
    pub queues: Vec<usize>,
    /// Request sizes in bytes (multiples of 4 KiB).
    pub sizes: Vec<usize>,
    /// Request mixes.
    pub mixes: Vec<Mix>,
    /// Requests in flight per queue.
    pub depths: Vec<usize>,
    /// Entries per virtqueue the frontend asks for.
    pub queue_size: usize,
    /// How long each cell's workload runs.
    pub cell: Duration,
    /// Longest a queue may go without a completion.
    pub stall: Duration,
}

/// What one cell measured.
#[derive(Debug, Clone)]
pub struct Cell {
    /// Queues.
    pub queues: usize,
    /// Request size in bytes.
    pub size: usize,
    /// Mix.
    pub mix: Mix,
    /// Requests in flight per queue.
    pub depth: usize,
    /// Requests completed.
    pub ios: u64,
    /// Longest time a queue went without a completion.
    pub longest_gap: Duration,
    /// Data bytes per second.
    pub bytes_per_s: f64,
}

impl std::fmt::Display for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "q={} bs={}K {:?} qd={}: {} ios, {:.1} MB/s, longest gap {} ms, 0 errors, verify ok",
            self.queues,
            self.size >> 10,
            self.mix,
            self.depth,
            self.ios,
            self.bytes_per_s / 1e6,
            self.longest_gap.as_millis()
        )
    }
}

/// Buffers per queue for the workload: requests beyond it share them (their data is
/// not checked; the verified pass has its own).
const BUFFERS: usize = 32;
/// The verified pass: this many 64 KiB extents per queue.
const VERIFY_EXTENTS: usize = 4;
const VERIFY_LEN: usize = 64 << 10;

/// Runs every cell of `m` on `socket`, calling `report` after each; stops at the first
/// cell that stalls, fails a request or does not verify.
///
/// # Errors
/// That cell, named, and why.
pub fn run(socket: &std::path::Path, m: &Matrix, mut report: impl FnMut(&Cell)) -> Result<()> {
    for &queues in &m.queues {
        for &size in &m.sizes {
            for &mix in &m.mixes {
                for &depth in &m.depths {
                    let what = format!("cell q={queues} bs={}K {mix:?} qd={depth}", size >> 10);
                    let c = cell(socket, m, queues, size, mix, depth).context(what)?;
                    report(&c);
                }
            }
        }
    }
    Ok(())
}

fn cell(
    socket: &std::path::Path,
    m: &Matrix,
    queues: usize,
    size: usize,
    mix: Mix,
    depth: usize,
) -> Result<Cell> {
    if size == 0 || !size.is_multiple_of(4096) || depth == 0 || depth > m.queue_size {
        bail!(
            "bad cell: size {size}, depth {depth}, queue size {}",
            m.queue_size
        );
    }
    let share = size * depth.min(BUFFERS) + 2 * VERIFY_EXTENTS * VERIFY_LEN;
    let mut client = BlkClient::connect_sized(socket, queues, share * queues, m.queue_size)?;
    if client.num_queues() < queues {
        bail!("the device offers {} queues", client.num_queues());
    }
    let capacity = client.capacity();
    let blocks = capacity / size as u64;
    if blocks < 2 || capacity < (queues * VERIFY_EXTENTS * VERIFY_LEN * 2) as u64 {
        bail!("device of {capacity} bytes too small");
    }
    let started = Instant::now();
    let mut ios = client.queue_ios();
    let tallies = std::thread::scope(|s| {
        let handles: Vec<_> = ios
            .iter_mut()
            .enumerate()
            .map(|(qi, q)| s.spawn(move || closed_loop(q, m, qi, size, mix, depth, blocks)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a stress thread panicked"))?)
            .collect::<Result<Vec<_>>>()
    })?;
    let elapsed = started.elapsed().as_secs_f64();
    verify(&mut ios, m.stall, capacity)?;
    let ios_done: u64 = tallies.iter().map(|t| t.0).sum();
    Ok(Cell {
        queues,
        size,
        mix,
        depth,
        ios: ios_done,
        longest_gap: tallies.iter().map(|t| t.1).max().unwrap_or_default(),
        bytes_per_s: (ios_done * size as u64) as f64 / elapsed.max(1e-9),
    })
}

/// A small, fast pseudo-random generator (xorshift64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One queue's closed loop: `depth` requests in flight for the cell's time, each
/// resubmitted as it completes; then the last ones are waited for. Returns the
/// completions and the longest gap between two of them.
fn closed_loop(
    q: &mut QueueIo<'_>,
    m: &Matrix,
    qi: usize,
    size: usize,
    mix: Mix,
    depth: usize,
    blocks: u64,
) -> Result<(u64, Duration)> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (qi as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
    let mut next = |slot: usize| {
        let offset = (rng.next() % blocks) * size as u64;
        let buf = (slot % BUFFERS) * size;
        let write = match mix {
            Mix::Read => false,
            Mix::Write => true,
            Mix::Mixed => rng.next() & 1 == 1,
        };
        if write {
            BlkOp::Write {
                offset,
                buf,
                len: size,
            }
        } else {
            BlkOp::Read {
                offset,
                buf,
                len: size,
            }
        }
    };
    q.fill(qi as u8);
    for slot in 0..depth {
        q.submit(&next(slot), slot)?;
    }
    let end = Instant::now() + m.cell;
    let mut inflight = depth;
    let mut done = 0u64;
    let mut last = Instant::now();
    let mut longest = Duration::ZERO;
    let mut out = Vec::with_capacity(depth);
    while inflight > 0 {
        out.clear();
        q.complete(1, m.stall, &mut out).with_context(|| {
            format!(
                "queue {qi}: no completion for {:?} with {inflight} requests in flight ({done} completed)",
                m.stall
            )
        })?;
        let now = Instant::now();
        longest = longest.max(now.duration_since(last));
        last = now;
        for &(slot, ret) in &out {
            if ret != 0 {
                bail!("queue {qi}: a request failed ({ret}) after {done} completions");
            }
            done += 1;
            inflight -= 1;
            if now < end {
                q.submit(&next(slot), slot)?;
                inflight += 1;
            }
        }
    }
    Ok((done, longest))
}

/// The verified pass: each queue writes distinct patterns to its own extents near the
/// device's end, then reads another queue's back and compares.
fn verify(ios: &mut [QueueIo<'_>], stall: Duration, capacity: u64) -> Result<()> {
    let n = ios.len();
    let extent = |q: usize, k: usize| capacity - ((q * VERIFY_EXTENTS + k + 1) * VERIFY_LEN) as u64;
    let pattern = |q: usize, k: usize, i: usize| (q * 31 + k * 7 + i + (i >> 9)) as u8 ^ 0xc3;
    for (q, io) in ios.iter_mut().enumerate() {
        let base = io.buffer_len() - 2 * VERIFY_EXTENTS * VERIFY_LEN;
        let buf = io.buffer();
        for k in 0..VERIFY_EXTENTS {
            for (i, b) in buf[base + k * VERIFY_LEN..base + (k + 1) * VERIFY_LEN]
                .iter_mut()
                .enumerate()
            {
                *b = pattern(q, k, i);
            }
        }
        for k in 0..VERIFY_EXTENTS {
            let op = BlkOp::Write {
                offset: extent(q, k),
                buf: base + k * VERIFY_LEN,
                len: VERIFY_LEN,
            };
            io.submit(&op, k)?;
        }
        wait_all(io, VERIFY_EXTENTS, stall, "verify write")?;
    }
    for (r, io) in ios.iter_mut().enumerate() {
        let q = (r + 1) % n;
        let base = io.buffer_len() - VERIFY_EXTENTS * VERIFY_LEN;
        io.buffer()[base..].fill(0);
        for k in 0..VERIFY_EXTENTS {
            let op = BlkOp::Read {
                offset: extent(q, k),
                buf: base + k * VERIFY_LEN,
                len: VERIFY_LEN,
            };
            io.submit(&op, k)?;
        }
        wait_all(io, VERIFY_EXTENTS, stall, "verify read")?;
        let buf = io.buffer();
        for k in 0..VERIFY_EXTENTS {
            let got = &buf[base + k * VERIFY_LEN..base + (k + 1) * VERIFY_LEN];
            if got.iter().enumerate().any(|(i, &b)| b != pattern(q, k, i)) {
                bail!("verify: extent {k} of queue {q}, read back on queue {r}, differs from what was written");
            }
        }
    }
    Ok(())
}

fn wait_all(io: &mut QueueIo<'_>, n: usize, stall: Duration, what: &str) -> Result<()> {
    let mut out = Vec::new();
    while out.len() < n {
        io.complete(1, stall, &mut out).context(what.to_owned())?;
    }
    if let Some(&(_, ret)) = out.iter().find(|(_, r)| *r != 0) {
        bail!("{what} failed ({ret})");
    }
    Ok(())
}

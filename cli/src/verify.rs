//! `devlend verify`: a verified workload through a vhost-user-blk socket (libblkio),
//! for tests where only the binary can go (e.g. inside a guest): random writes on every
//! queue at once, each read back and compared; FLUSH; DISCARD and WRITE_ZEROES read
//! back as zeroes. With `split`, the client's buffer is two guest memory regions back
//! to back and one write and one read have their buffer across the boundary (so each
//! spans two regions). It writes what the first `span` bytes of the device must now hold
//! to `out`, so the caller can compare it with the lender's file.

use std::path::Path;

use anyhow::{bail, Result};

use crate::blk_client::{BlkClient, BlkOp};

const CHUNK: usize = 64 * 1024;

/// How long the verified workload goes on.
#[derive(Debug, Clone, Copy)]
pub struct Rounds {
    /// Rounds run in any case.
    pub at_least: usize,
    /// More rounds run until this much time has passed since the connect.
    pub min_duration: std::time::Duration,
}

/// Runs `rounds.at_least` rounds of `queues × 8` random writes (4–64 KiB) inside the first
/// `span` bytes, and more rounds until `rounds.min_duration` has passed since the connect (so
/// that a fault a test injects "during" the workload lands in it on a fast machine as
/// on a slow one), verifying each round by reading everything written; then flush,
/// discard and write-zeroes. With `split`, the buffer is two memory regions split at
/// 64 KiB, and a 64 KiB write and read whose buffer crosses that boundary run too.
/// Returns the number of requests.
///
/// # Errors
/// A mismatch, a failed request, or a libblkio error.
pub fn run(
    socket: &Path,
    queues: usize,
    span: u64,
    rounds: Rounds,
    seed: u64,
    split: bool,
    out: &Path,
) -> Result<usize> {
    let started = std::time::Instant::now();
    let per_queue = 8;
    let buf_len = queues * per_queue * CHUNK * 2;
    let mut c = if split {
        BlkClient::connect_split(socket, queues, buf_len, CHUNK)?
    } else {
        BlkClient::connect(socket, queues, buf_len)?
    };
    let span = span.min(c.capacity()) as usize / CHUNK * CHUNK;
    if span < CHUNK * 4 {
        bail!("device too small for the workload");
    }
    let mut shadow = vec![0u8; span];
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut requests = 0;
    let half = queues * per_queue * CHUNK;
    let mut round = 0usize;
    while round < rounds.at_least || started.elapsed() < rounds.min_duration {
        // Disjoint extents per round, so requests in flight together never overlap.
        let slots = span / CHUNK;
        let mut used = vec![false; slots];
        let mut batches: Vec<Vec<BlkOp>> = vec![Vec::new(); queues];
        let mut extents = Vec::new();
        for (q, batch) in batches.iter_mut().enumerate() {
            for k in 0..per_queue {
                let mut slot = (next() as usize) % slots;
                while used[slot] {
                    slot = (slot + 1) % slots;
                }
                used[slot] = true;
                let len = 4096 * (1 + (next() as usize) % (CHUNK / 4096));
                let off = slot * CHUNK;
                let buf = (q * per_queue + k) * CHUNK;
                let b = c.buffer();
                for (i, byte) in b[buf..buf + len].iter_mut().enumerate() {
                    *byte = (round as u8)
                        ^ (q as u8).wrapping_mul(31)
                        ^ (k as u8).wrapping_mul(7)
                        ^ (i as u8)
                        ^ ((i >> 8) as u8);
                }
                shadow[off..off + len].copy_from_slice(&c.buffer()[buf..buf + len]);
                batch.push(BlkOp::Write {
                    offset: off as u64,
                    buf,
                    len,
                });
                extents.push((q, off, len, half + buf));
            }
        }
        let refs: Vec<(usize, &[BlkOp])> = batches
            .iter()
            .enumerate()
            .map(|(q, b)| (q, b.as_slice()))
            .collect();
        check(&c.run_multi(&refs)?, "write")?;
        requests += extents.len();
        // Read each extent back on another queue than wrote it, into the other half.
        let mut reads: Vec<Vec<BlkOp>> = vec![Vec::new(); queues];
        for &(q, off, len, buf) in &extents {
            reads[(q + 1) % queues].push(BlkOp::Read {
                offset: off as u64,
                buf,
                len,
            });
        }
        let refs: Vec<(usize, &[BlkOp])> = reads
            .iter()
            .enumerate()
            .map(|(q, b)| (q, b.as_slice()))
            .collect();
        check(&c.run_multi(&refs)?, "read")?;
        requests += extents.len();
        for &(_, off, len, buf) in &extents {
            if c.buffer()[buf..buf + len] != shadow[off..off + len] {
                bail!(
                    "round {round}: data read at {off} ({len} bytes) differs from what was written"
                );
            }
        }
        round += 1;
    }
    check(&[c.run(0, &[BlkOp::Flush])?], "flush")?;
    let (d_off, z_off) = (CHUNK as u64, 3 * CHUNK as u64);
    check(
        &[c.run(
            0,
            &[BlkOp::Discard {
                offset: d_off,
                len: CHUNK as u64,
            }],
        )?],
        "discard",
    )?;
    check(
        &[c.run(
            queues - 1,
            &[BlkOp::WriteZeroes {
                offset: z_off,
                len: CHUNK as u64,
                unmap: false,
            }],
        )?],
        "write-zeroes",
    )?;
    shadow[d_off as usize..d_off as usize + CHUNK].fill(0);
    shadow[z_off as usize..z_off as usize + CHUNK].fill(0);
    for off in [d_off, z_off] {
        c.buffer()[..CHUNK].fill(0xaa);
        check(
            &[c.run(
                0,
                &[BlkOp::Read {
                    offset: off,
                    buf: 0,
                    len: CHUNK,
                }],
            )?],
            "read",
        )?;
        if c.buffer()[..CHUNK].iter().any(|&b| b != 0) {
            bail!("range at {off} does not read as zeroes after discard/write-zeroes");
        }
    }
    check(&[c.run(0, &[BlkOp::Flush])?], "flush")?;
    requests += 6;
    if split && span >= 6 * CHUNK {
        requests += across_regions(&mut c, &mut shadow, 5 * CHUNK, queues - 1)?;
    }
    std::fs::write(out, &shadow)?;
    Ok(requests)
}

/// One 64 KiB write whose buffer crosses the boundary of the two buffer regions (at
/// [`CHUNK`]), to device offset `off` on queue `q`; the buffer is cleared and the same
/// range read back into the same crossing buffer, and compared. Returns the requests.
fn across_regions(c: &mut BlkClient, shadow: &mut [u8], off: usize, q: usize) -> Result<usize> {
    let buf = CHUNK / 2;
    for (i, b) in c.buffer()[buf..buf + CHUNK].iter_mut().enumerate() {
        *b = 0x5a ^ (i as u8) ^ ((i >> 9) as u8);
    }
    let want = c.buffer()[buf..buf + CHUNK].to_vec();
    let write = BlkOp::Write {
        offset: off as u64,
        buf,
        len: CHUNK,
    };
    check(&[c.run(q, &[write])?], "write across two memory regions")?;
    shadow[off..off + CHUNK].copy_from_slice(&want);
    c.buffer()[buf..buf + CHUNK].fill(0);
    let read = BlkOp::Read {
        offset: off as u64,
        buf,
        len: CHUNK,
    };
    check(&[c.run(q, &[read])?], "read across two memory regions")?;
    if c.buffer()[buf..buf + CHUNK] != want[..] {
        bail!("a read across two memory regions differs from the write across them");
    }
    Ok(2)
}

fn check(results: &[Vec<i32>], what: &str) -> Result<()> {
    for r in results.iter().flatten() {
        if *r != 0 {
            bail!("a {what} failed: {r}");
        }
    }
    Ok(())
}

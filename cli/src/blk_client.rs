//! A vhost-user-blk frontend without a VM, on the `blkio` crate.
//!
//! It connects to a vhost-user-blk socket, maps one buffer as a memory region shared with
//! the backend (or, with [`BlkClient::connect_split`], as two regions adjacent in the
//! backend's guest-physical space, so that one request can span both), and runs
//! requests on its queues, one at a time or a batch at a time; or,
//! through [`BlkClient::queue_ios`], hands each queue with its own share of the buffer to
//! a thread that keeps requests in flight itself (the bench's closed loop).

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

/// One request of a batch. Offsets and lengths are in bytes; `buf` is an offset into
/// [`BlkClient::buffer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlkOp {
    /// Read `len` bytes at `offset` into the buffer at `buf`.
    Read {
        /// Device offset.
        offset: u64,
        /// Buffer offset.
        buf: usize,
        /// Length.
        len: usize,
    },
    /// Write `len` bytes from the buffer at `buf` to `offset`.
    Write {
        /// Device offset.
        offset: u64,
        /// Buffer offset.
        buf: usize,
        /// Length.
        len: usize,
    },
    /// Flush.
    Flush,
    /// Discard `len` bytes at `offset`.
    Discard {
        /// Device offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Zero `len` bytes at `offset`; `unmap` lets the device deallocate them.
    WriteZeroes {
        /// Device offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Allow deallocation.
        unmap: bool,
    },
}

/// A connected frontend.
pub struct BlkClient {
    queues: Vec<Blkioq>,
    buf: Buffer,
    capacity: u64,
    read_only: bool,
    // Dropped last: it owns the connection and the memory region.
    blkio: Blkio,
}

/// The shared buffer: one region libblkio allocated, or two regions of our own mapped
/// back to back (libblkio's vhost-user driver hands the backend each region with its
/// process address as the guest-physical address, so adjacent mappings are adjacent
/// guest memory regions).
enum Buffer {
    Alloc(MemoryRegion),
    Split {
        /// Start of the whole reservation (`len` bytes), the first region's address.
        base: usize,
        len: usize,
        parts: [MemoryRegion; 2],
    },
}

impl Buffer {
    fn base(&self) -> usize {
        match self {
            Buffer::Alloc(r) => r.addr,
            Buffer::Split { base, .. } => *base,
        }
    }

    fn len(&self) -> usize {
        match self {
            Buffer::Alloc(r) => r.len,
            Buffer::Split { len, .. } => *len,
        }
    }
}

/// Maps `len` bytes as two memfd-backed shared mappings back to back, the first of
/// `split` bytes (both page multiples, `0 < split < len`).
fn map_split(len: usize, split: usize) -> Result<Buffer> {
    if split == 0 || split >= len || !split.is_multiple_of(4096) || !len.is_multiple_of(4096) {
        bail!("cannot split a {len}-byte buffer at {split}");
    }
    // SAFETY: a fresh anonymous reservation; nothing else is mapped there.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error()).context("reserving the buffer");
    }
    let base = base as usize;
    let mut parts = Vec::with_capacity(2);
    for (addr, part_len) in [(base, split), (base + split, len - split)] {
        // SAFETY: a plain memfd_create with a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"devlend-verify-buf".as_ptr(), 0) };
        // SAFETY: `fd` is ours (checked below before use); ftruncate sizes it.
        if fd < 0 || unsafe { libc::ftruncate(fd, part_len as libc::off_t) } != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: the reservation is ours and unused.
            unsafe { libc::munmap(base as *mut libc::c_void, len) };
            return Err(e).context("creating a buffer memfd");
        }
        // SAFETY: MAP_FIXED over our own reservation (addr..addr+part_len is inside it).
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                part_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: the reservation and the fd are ours.
            unsafe {
                libc::munmap(base as *mut libc::c_void, len);
                libc::close(fd);
            }
            return Err(e).context("mapping a buffer memfd");
        }
        parts.push(MemoryRegion {
            addr,
            iova: 0,
            len: part_len,
            fd,
            fd_offset: 0,
            flags: 0,
        });
    }
    Ok(Buffer::Split {
        base,
        len,
        parts: [parts[0], parts[1]],
    })
}

impl BlkClient {
    /// Connects to `socket` with `num_queues` queues and a shared buffer of `buf_len`
    /// bytes (rounded up to the driver's alignment).
    ///
    /// # Errors
    /// Any libblkio error, with the socket named.
    pub fn connect(socket: &Path, num_queues: usize, buf_len: usize) -> Result<Self> {
        Self::connect_with(socket, num_queues, buf_len, false)
    }

    /// As [`Self::connect`], read-only when `read_only` (libblkio refuses to start on a
    /// read-only device otherwise).
    ///
    /// # Errors
    /// Any libblkio error, with the socket named.
    pub fn connect_with(
        socket: &Path,
        num_queues: usize,
        buf_len: usize,
        read_only: bool,
    ) -> Result<Self> {
        Self::open(socket, num_queues, buf_len, read_only, None, None)
    }

    /// As [`Self::connect`], with `queue_size` entries per virtqueue (libblkio's default
    /// is 256; deep clients ask for up to 1024).
    ///
    /// # Errors
    /// Any libblkio error, with the socket named.
    pub fn connect_sized(
        socket: &Path,
        num_queues: usize,
        buf_len: usize,
        queue_size: usize,
    ) -> Result<Self> {
        Self::open(socket, num_queues, buf_len, false, None, Some(queue_size))
    }

    /// As [`Self::connect`], with the buffer mapped as two memory regions back to back,
    /// the first `split` bytes long (a multiple of 4 KiB): the backend gets them with two
    /// ADD_MEM_REG, adjacent in guest-physical space, so a request whose buffer crosses
    /// offset `split` spans two guest memory regions.
    ///
    /// # Errors
    /// A bad split, mmap/memfd failures, or any libblkio error.
    pub fn connect_split(
        socket: &Path,
        num_queues: usize,
        buf_len: usize,
        split: usize,
    ) -> Result<Self> {
        Self::open(socket, num_queues, buf_len, false, Some(split), None)
    }

    fn open(
        socket: &Path,
        num_queues: usize,
        buf_len: usize,
        read_only: bool,
        split: Option<usize>,
        queue_size: Option<usize>,
    ) -> Result<Self> {
        let ctx = || format!("vhost-user-blk socket {}", socket.display());
        let mut b = Blkio::new("virtio-blk-vhost-user")
            .map_err(err)
            .with_context(ctx)?;
        let path = socket
            .to_str()
            .ok_or_else(|| anyhow!("socket path is not UTF-8"))?;
        b.set_str("path", path).map_err(err).with_context(ctx)?;
        b.set_bool("read-only", read_only)
            .map_err(err)
            .with_context(ctx)?;
        b.connect().map_err(err).with_context(ctx)?;
        b.set_i32("num-queues", num_queues as i32)
            .map_err(err)
            .with_context(ctx)?;
        if let Some(size) = queue_size {
            b.set_i32("queue-size", size as i32)
                .map_err(err)
                .with_context(ctx)?;
        }
        let started = b.start().map_err(err).with_context(ctx)?;
        let capacity = b.get_u64("capacity").map_err(err)?;
        let read_only = b.get_bool("read-only").map_err(err)?;
        let align = b.get_u64("mem-region-alignment").map_err(err)?.max(4096) as usize;
        let len = buf_len.max(1).div_ceil(align) * align;
        let buf = match split {
            None => {
                let region = b.alloc_mem_region(len).map_err(err)?;
                b.map_mem_region(&region).map_err(err)?;
                Buffer::Alloc(region)
            }
            Some(at) => {
                let buf = map_split(len, at)?;
                if let Buffer::Split { parts, .. } = &buf {
                    for r in parts {
                        if let Err(e) = b.map_mem_region(r) {
                            release(&mut b, &buf);
                            return Err(err(e)).context("mapping a buffer region");
                        }
                    }
                }
                buf
            }
        };
        Ok(BlkClient {
            queues: started.queues,
            buf,
            capacity,
            read_only,
            blkio: b,
        })
    }

    /// Device capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether the device is read-only (VIRTIO_BLK_F_RO offered).
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Number of queues.
    pub fn num_queues(&self) -> usize {
        self.queues.len()
    }

    /// A libblkio property of the device (e.g. `max-transfer`).
    ///
    /// # Errors
    /// Unknown property.
    pub fn property_u64(&self, name: &str) -> Result<u64> {
        self.blkio.get_u64(name).map_err(err)
    }

    /// The shared buffer.
    pub fn buffer(&mut self) -> &mut [u8] {
        // SAFETY: the region is `len` bytes mapped by libblkio for as long as `self`
        // lives, and only this client (through `&mut self`) touches it while no request
        // is in flight: requests are always waited for before the methods return.
        unsafe { std::slice::from_raw_parts_mut(self.buf.base() as *mut u8, self.buf.len()) }
    }

    /// Runs `ops` on queue `q` with all of them in flight at once; returns each one's
    /// result (0, or a negative errno such as -EIO for IOERR, -ENOTSUP for UNSUPP).
    ///
    /// # Errors
    /// A buffer range outside the shared buffer, or a libblkio failure.
    pub fn run(&mut self, q: usize, ops: &[BlkOp]) -> Result<Vec<i32>> {
        Ok(self.run_multi(&[(q, ops)])?.remove(0))
    }

    /// Submits every batch on its queue first, so that all queues have requests in
    /// flight at the same time, then waits for all; returns the results per batch.
    ///
    /// # Errors
    /// As [`Self::run`].
    pub fn run_multi(&mut self, batches: &[(usize, &[BlkOp])]) -> Result<Vec<Vec<i32>>> {
        let base = self.buf.base() as *mut u8;
        let buf_len = self.buf.len();
        for &(q, ops) in batches {
            let queue = self
                .queues
                .get_mut(q)
                .ok_or_else(|| anyhow!("no queue {q}"))?;
            for (i, op) in ops.iter().enumerate() {
                submit(queue, base, buf_len, i, op)?;
            }
        }
        let mut all = Vec::with_capacity(batches.len());
        for &(q, ops) in batches {
            let queue = self
                .queues
                .get_mut(q)
                .ok_or_else(|| anyhow!("no queue {q}"))?;
            let mut results = vec![i32::MIN; ops.len()];
            let mut done = 0;
            let mut comps: Vec<MaybeUninit<Completion>> =
                (0..ops.len()).map(|_| MaybeUninit::uninit()).collect();
            while done < ops.len() {
                let n = queue.do_io(&mut comps, 1, None, None).map_err(err)?;
                for c in &comps[..n] {
                    // SAFETY: do_io initialised the first n completions.
                    let c = unsafe { c.assume_init_ref() };
                    if let Some(r) = results.get_mut(c.user_data) {
                        *r = c.ret;
                        done += 1;
                    }
                }
            }
            all.push(results);
        }
        Ok(all)
    }

    /// Runs one request on queue `q` and returns its result (see [`Self::run`]).
    ///
    /// # Errors
    /// As [`Self::run`].
    pub fn run_one(&mut self, q: usize, op: BlkOp) -> Result<i32> {
        Ok(self.run(q, &[op])?[0])
    }
}

impl BlkClient {
    /// Splits the client into one [`QueueIo`] per queue, each with an equal, disjoint,
    /// 4 KiB-aligned share of the shared buffer, for one thread each. The handles borrow
    /// the client, so it outlives every request they start.
    pub fn queue_ios(&mut self) -> Vec<QueueIo<'_>> {
        let n = self.queues.len().max(1);
        let share = (self.buf.len() / n) & !4095;
        let base = self.buf.base() as *mut u8;
        self.queues
            .iter_mut()
            .enumerate()
            .map(|(i, queue)| QueueIo {
                queue,
                // SAFETY: i < n, so i * share + share <= the buffer's length: the share
                // is inside the mapped buffer.
                base: unsafe { base.add(i * share) },
                len: share,
                comps: Vec::new(),
                _buf: PhantomData,
            })
            .collect()
    }
}

/// One queue of a [`BlkClient`] and its share of the shared buffer: submit requests,
/// reap completions, with as many in flight as the caller likes (up to the queue size;
/// libblkio holds back the excess).
pub struct QueueIo<'a> {
    queue: &'a mut Blkioq,
    base: *mut u8,
    len: usize,
    comps: Vec<MaybeUninit<Completion>>,
    _buf: PhantomData<&'a mut [u8]>,
}

// SAFETY: `base..base+len` is this handle's own share of the client's buffer (the shares
// are disjoint), and the borrowed queue is only used through `&mut self`; libblkio's
// queue type is Send.
unsafe impl Send for QueueIo<'_> {}

impl QueueIo<'_> {
    /// Bytes of buffer this queue owns; `buf` offsets of its requests are within it.
    pub fn buffer_len(&self) -> usize {
        self.len
    }

    /// This queue's share of the buffer, to fill or check while nothing is in flight on
    /// it.
    pub fn buffer(&mut self) -> &mut [u8] {
        // SAFETY: `base..base+len` is this handle's own share of the mapped buffer, alive
        // for the handle's lifetime; `&mut self` keeps anyone else from using it here,
        // and the caller has nothing in flight on it (see above).
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }

    /// Fills this queue's buffer with a byte pattern derived from `seed` (data for
    /// writes). Call it with nothing in flight.
    pub fn fill(&mut self, seed: u8) {
        for i in 0..self.len {
            // SAFETY: i < len, inside this queue's share of the mapped region; nothing
            // is in flight on it (see above), so nobody else touches it.
            unsafe {
                self.base
                    .add(i)
                    .write_volatile(seed.wrapping_add((i % 251) as u8))
            };
        }
    }

    /// Queues `op` with `user_data` (returned in its completion). Buffer offsets are
    /// relative to this queue's share. Requests go to the device at the next
    /// [`Self::complete`].
    ///
    /// # Errors
    /// A buffer range outside this queue's share.
    pub fn submit(&mut self, op: &BlkOp, user_data: usize) -> Result<()> {
        submit(self.queue, self.base, self.len, user_data, op)
    }

    /// Sends the queued requests, then waits up to `timeout` until at least `min`
    /// completions are there, and appends every completion available as
    /// `(user_data, result)` (result 0, or a negative errno).
    ///
    /// # Errors
    /// A libblkio failure, or no completion within `timeout` while `min` > 0.
    pub fn complete(
        &mut self,
        min: usize,
        timeout: Duration,
        out: &mut Vec<(usize, i32)>,
    ) -> Result<()> {
        if self.comps.len() < 1024 {
            self.comps = (0..1024).map(|_| MaybeUninit::uninit()).collect();
        }
        let mut t = timeout;
        let n = self
            .queue
            .do_io(&mut self.comps, min, Some(&mut t), None)
            .map_err(err)?;
        if n < min {
            bail!("no completion within {timeout:?}");
        }
        for c in &self.comps[..n] {
            // SAFETY: do_io initialised the first n completions.
            let c = unsafe { c.assume_init_ref() };
            out.push((c.user_data, c.ret));
        }
        Ok(())
    }
}

impl Drop for BlkClient {
    fn drop(&mut self) {
        self.queues.clear();
        release(&mut self.blkio, &self.buf);
    }
}

/// Unmaps the buffer from libblkio and frees it.
fn release(b: &mut Blkio, buf: &Buffer) {
    match buf {
        Buffer::Alloc(r) => {
            b.unmap_mem_region(r);
            b.free_mem_region(r);
        }
        Buffer::Split { base, len, parts } => {
            for r in parts {
                b.unmap_mem_region(r);
            }
            // SAFETY: the reservation and the memfds are ours (`map_split`), and
            // libblkio no longer uses them.
            unsafe {
                libc::munmap(*base as *mut libc::c_void, *len);
                for r in parts {
                    libc::close(r.fd);
                }
            }
        }
    }
}

fn submit(queue: &mut Blkioq, base: *mut u8, buf_len: usize, i: usize, op: &BlkOp) -> Result<()> {
    match *op {
        BlkOp::Read { offset, buf, len } | BlkOp::Write { offset, buf, len } => {
            if buf.checked_add(len).is_none_or(|end| end > buf_len) {
                bail!("buffer range {buf}+{len} is outside the {buf_len}-byte buffer");
            }
            // SAFETY: buf + len <= buf_len, checked above, so p stays in the region.
            let p = unsafe { base.add(buf) };
            if matches!(op, BlkOp::Read { .. }) {
                queue.read(offset, p, len, i, ReqFlags::empty());
            } else {
                queue.write(offset, p, len, i, ReqFlags::empty());
            }
        }
        BlkOp::Flush => queue.flush(i, ReqFlags::empty()),
        BlkOp::Discard { offset, len } => queue.discard(offset, len, i, ReqFlags::empty()),
        BlkOp::WriteZeroes { offset, len, unmap } => {
            let f = if unmap {
                ReqFlags::empty()
            } else {
                ReqFlags::NO_UNMAP
            };
            queue.write_zeroes(offset, len, i, f)
        }
    }
    Ok(())
}

fn err(e: blkio::Error) -> anyhow::Error {
    anyhow!("libblkio: {} ({:?})", e.message(), e.errno())
}

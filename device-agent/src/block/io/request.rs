//! One block request as it moves through the device-I/O layer: which operation to issue
//! next (an io_uring entry, or the same as a plain system call), and what a completion
//! means (continue a short transfer, fall back, or finish with a status). What the wire
//! adds around it (a header's framing, the encoded response) is `block/wire.rs`.

use std::os::fd::RawFd;
use std::sync::OnceLock;

use devlend_fabric::wire::RESPONSE_HEADER_LEN;
use devlend_fabric::{BlockRequest, Op, Status};
use io_uring::{opcode, squeue, types};

use crate::block::BlockDevice;
use crate::{MAX_DISCARD_SECTORS, MAX_WRITE_ZEROES_SECTORS};

/// Size in bytes of the zeroed buffer that the write-zeroes fallback writes from, one
/// chunk at a time.
const ZERO_CHUNK: usize = 1 << 20;

/// A shared, never-written buffer of zeroes for the write-zeroes fallback.
fn zeroes() -> &'static [u8] {
    static ZEROES: OnceLock<Box<[u8]>> = OnceLock::new();
    ZEROES.get_or_init(|| vec![0u8; ZERO_CHUNK].into_boxed_slice())
}

/// What the request has in flight (or, for [`Stage::Immediate`], its final status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// No device I/O: answered with this status.
    Immediate(Status),
    /// `read` into the buffer.
    Read,
    /// `write` from the buffer.
    Write,
    /// `fdatasync`.
    Flush,
    /// `fallocate(PUNCH_HOLE | KEEP_SIZE)` for a discard.
    Discard,
    /// `fallocate(PUNCH_HOLE | KEEP_SIZE)` for a write-zeroes with UNMAP.
    ZeroPunch,
    /// `fallocate(ZERO_RANGE | KEEP_SIZE)` for a write-zeroes.
    ZeroRange,
    /// `write`s from the zero buffer, one chunk at a time: the fallback of write-zeroes.
    ZeroWrite,
}

/// Why a well-framed request is refused (answered with I/O error, no device I/O).
pub(crate) fn refuse_reason(r: &BlockRequest, block: &BlockDevice) -> Option<&'static str> {
    let limit = match *r {
        BlockRequest::Flush => return None,
        BlockRequest::Read { .. } | BlockRequest::Write { .. } => None,
        BlockRequest::Discard { sectors, .. } => Some((sectors, MAX_DISCARD_SECTORS)),
        BlockRequest::WriteZeroes { sectors, .. } => Some((sectors, MAX_WRITE_ZEROES_SECTORS)),
    };
    if r.op() != Op::Read && block.read_only {
        return Some("device is read-only");
    }
    if r.range_len() == 0 {
        return Some("zero length");
    }
    if limit.is_some_and(|(sectors, max)| sectors.0 > max) {
        return Some("length beyond the advertised limit");
    }
    match r.byte_range() {
        Ok(range) if range.end <= block.capacity_bytes => None,
        _ => Some("range beyond the capacity"),
    }
}

/// How a completion leaves the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Issue [`Request::entry`] again (the next part of a transfer, or a fallback).
    Again,
    /// Answer with the status in [`Request::status`].
    Done,
}

/// A request and its data buffer. Boxed, and owned by the kernel (through `user_data`)
/// while an operation is in flight; reused afterwards (a TCP session's pool, an RDMA
/// session's I/O slots).
#[derive(Debug)]
pub(crate) struct Request {
    /// The session's own mark, untouched here (an RDMA session's slot index).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) tag: usize,
    /// The borrower's id.
    pub(crate) id: u64,
    /// The operation.
    pub(crate) op: Op,
    stage: Stage,
    /// Byte offset of the range on the device.
    pub(in crate::block) offset: u64,
    /// Bytes of the range (the data length for read and write).
    pub(in crate::block) len: u64,
    /// Bytes of the range done so far (reads, writes, zero-filling writes).
    done: u64,
    /// Data buffer; its first `len` bytes hold a read's or a write's data.
    pub(crate) buf: Vec<u8>,
    /// Bytes charged against the session's in-flight budget.
    pub(crate) charge: usize,
    /// Final status, once [`Next::Done`].
    pub(crate) status: Status,
    /// Last errno reported by the device, for the log.
    pub(crate) errno: i32,
    /// The encoded response header, once finished.
    pub(in crate::block) resp: [u8; RESPONSE_HEADER_LEN],
    /// When the request was received (for the latency histogram).
    pub(crate) received: Option<std::time::Instant>,
    /// A read whose data is sent straight from the file (`sendfile`) rather than read
    /// into `buf` first.
    pub(in crate::block) from_file: bool,
    /// It waited for its holder's limits, and its borrower reads that
    /// (`RESPONSE_THROTTLED`); set by [`super::Throttled`] for every request.
    pub(crate) throttled: bool,
}

impl Request {
    /// An empty request with no buffer.
    pub(crate) fn new() -> Request {
        Request {
            tag: 0,
            id: 0,
            op: Op::Flush,
            stage: Stage::Immediate(Status::IoErr),
            offset: 0,
            len: 0,
            done: 0,
            buf: Vec::new(),
            charge: 0,
            status: Status::IoErr,
            errno: 0,
            resp: [0; RESPONSE_HEADER_LEN],
            received: None,
            from_file: false,
            throttled: false,
        }
    }

    /// Makes the buffer hold at least `n` bytes; returns the slice of the first `n`.
    pub(crate) fn buffer(&mut self, n: usize) -> &mut [u8] {
        if self.buf.len() < n {
            self.buf.reserve_exact(n - self.buf.len());
            self.buf.resize(n, 0);
        }
        &mut self.buf[..n]
    }

    /// Sets the request up for `r`, which passed `check_framing` (`block/wire.rs`), with its buffer
    /// already sized (and, for a write, filled); `id` is left as the session set it.
    /// Requests the device cannot serve (read-only, zero length, beyond a limit or the
    /// capacity) become immediate I/O errors; returns the reason for those.
    pub(crate) fn start(&mut self, r: &BlockRequest, block: &BlockDevice) -> Option<&'static str> {
        self.op = r.op();
        self.received = Some(std::time::Instant::now());
        self.from_file = false;
        self.done = 0;
        self.errno = 0;
        self.status = Status::Ok;
        let mut reason = refuse_reason(r, block);
        // A range that overflows is refused above: it does no I/O.
        let range = r.byte_range().unwrap_or(0..0);
        self.offset = range.start;
        self.len = range.end - range.start;
        if reason.is_none() && self.buf.len() < r.data_len().usize() {
            // The session sizes the buffer before; never index past it.
            reason = Some("internal: data buffer too small");
        }
        self.stage = match (reason, *r) {
            (Some(_), _) => Stage::Immediate(Status::IoErr),
            (None, BlockRequest::Read { .. }) => Stage::Read,
            (None, BlockRequest::Write { .. }) => Stage::Write,
            (None, BlockRequest::Flush) => Stage::Flush,
            (None, BlockRequest::Discard { .. }) => Stage::Discard,
            (None, BlockRequest::WriteZeroes { unmap: true, .. }) => Stage::ZeroPunch,
            (None, BlockRequest::WriteZeroes { unmap: false, .. }) => Stage::ZeroRange,
        };
        reason
    }

    /// Whether the next entry does device I/O (as opposed to a NOP).
    pub(crate) fn touches_device(&self) -> bool {
        !matches!(self.stage, Stage::Immediate(_))
    }

    /// The submission entry for the current stage, with `user_data` as given.
    ///
    /// The entry points into `self.buf` (read, write) or the static zero buffer; the
    /// caller keeps the request alive and untouched until the completion.
    pub(crate) fn entry(&mut self, fd: types::Fd, user_data: u64) -> squeue::Entry {
        // Invariants kept by `start` and `complete`: done < len ≤ buf.len() for the
        // transfer stages, and every range lies within u32 for one operation.
        let rest = self.len.saturating_sub(self.done);
        let at = self.offset + self.done;
        let entry = match self.stage {
            Stage::Immediate(_) => opcode::Nop::new().build(),
            Stage::Read => {
                let part = &mut self.buf[self.done as usize..self.len as usize];
                opcode::Read::new(fd, part.as_mut_ptr(), part.len() as u32)
                    .offset(at)
                    .build()
            }
            Stage::Write => {
                let part = &self.buf[self.done as usize..self.len as usize];
                opcode::Write::new(fd, part.as_ptr(), part.len() as u32)
                    .offset(at)
                    .build()
            }
            Stage::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Stage::Discard | Stage::ZeroPunch => opcode::Fallocate::new(fd, self.len)
                .offset(self.offset)
                .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            Stage::ZeroRange => opcode::Fallocate::new(fd, self.len)
                .offset(self.offset)
                .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            Stage::ZeroWrite => {
                let chunk = rest.min(ZERO_CHUNK as u64) as u32;
                opcode::Write::new(fd, zeroes().as_ptr(), chunk)
                    .offset(at)
                    .build()
            }
        };
        entry.user_data(user_data)
    }

    /// Runs the current stage's operation with a blocking system call on `fd`, and
    /// returns its result as io_uring would (bytes transferred, or `-errno`). For files
    /// whose I/O is a memory copy (tmpfs), where handing it to io_uring only adds a
    /// kernel worker thread hop.
    pub(crate) fn run_sync(&mut self, fd: RawFd) -> i32 {
        let rest = self.len.saturating_sub(self.done);
        let at = (self.offset + self.done) as libc::off_t;
        let ret = |r: isize| -> i32 {
            if r < 0 {
                -std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO)
            } else {
                i32::try_from(r).unwrap_or(i32::MAX)
            }
        };
        // Invariants kept by `start` and `complete`: done < len ≤ buf.len() for the
        // transfer stages.
        match self.stage {
            Stage::Immediate(_) => 0,
            Stage::Read => {
                let part = &mut self.buf[self.done as usize..self.len as usize];
                // SAFETY: `part` is a live, writable buffer of `part.len()` bytes.
                ret(unsafe { libc::pread(fd, part.as_mut_ptr().cast(), part.len(), at) })
            }
            Stage::Write => {
                let part = &self.buf[self.done as usize..self.len as usize];
                // SAFETY: `part` is a live buffer of `part.len()` bytes, only read.
                ret(unsafe { libc::pwrite(fd, part.as_ptr().cast(), part.len(), at) })
            }
            // SAFETY: plain system calls on an open file descriptor, no memory passed.
            Stage::Flush => ret(unsafe { libc::fdatasync(fd) } as isize),
            Stage::Discard | Stage::ZeroPunch | Stage::ZeroRange => {
                let mode = if self.stage == Stage::ZeroRange {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                };
                let (off, len) = (self.offset as libc::off_t, self.len as libc::off_t);
                // SAFETY: a plain system call on an open file descriptor.
                ret(unsafe { libc::fallocate(fd, mode, off, len) } as isize)
            }
            Stage::ZeroWrite => {
                let chunk = rest.min(ZERO_CHUNK as u64) as usize;
                // SAFETY: the zero buffer is static and at least `chunk` bytes long.
                ret(unsafe { libc::pwrite(fd, zeroes().as_ptr().cast(), chunk, at) })
            }
        }
    }

    /// Bytes of the request's range on the device (the data length of a read or write).
    pub(crate) fn range_len(&self) -> u64 {
        self.len
    }

    /// Whether this is a read that is about to read its data from the device.
    pub(crate) fn is_pending_read(&self) -> bool {
        self.stage == Stage::Read && self.done == 0
    }

    /// Finishes a pending read without reading: its response will carry its range of
    /// the device straight from the file (`ResponseData::File`, `block/wire.rs`).
    pub(crate) fn send_from_file(&mut self) {
        self.from_file = true;
        self.done = self.len;
        self.status = Status::Ok;
    }

    /// Applies a completion result (bytes transferred, or `-errno`).
    pub(crate) fn complete(&mut self, res: i32) -> Next {
        let fail = |r: &mut Request, status| {
            r.errno = -res;
            r.status = status;
            Next::Done
        };
        match self.stage {
            Stage::Immediate(status) => {
                self.status = status;
                Next::Done
            }
            Stage::Read | Stage::Write | Stage::ZeroWrite => {
                // A 0-byte transfer would loop forever: report it.
                if res <= 0 {
                    return fail(self, Status::IoErr);
                }
                self.done += res as u64;
                if self.done < self.len {
                    Next::Again
                } else {
                    self.status = Status::Ok;
                    Next::Done
                }
            }
            Stage::Flush if res < 0 => fail(self, Status::IoErr),
            Stage::Discard if res == -libc::EOPNOTSUPP => fail(self, Status::Unsupp),
            Stage::Discard if res < 0 => fail(self, Status::IoErr),
            Stage::ZeroPunch | Stage::ZeroRange
                if res == -libc::EOPNOTSUPP || res == -libc::EINVAL =>
            {
                self.stage = if self.stage == Stage::ZeroPunch {
                    Stage::ZeroRange
                } else {
                    Stage::ZeroWrite
                };
                Next::Again
            }
            Stage::ZeroPunch | Stage::ZeroRange if res < 0 => fail(self, Status::IoErr),
            Stage::Flush | Stage::Discard | Stage::ZeroPunch | Stage::ZeroRange => {
                self.status = Status::Ok;
                Next::Done
            }
        }
    }

    /// Bytes of request data moved to or from the device (for the counters).
    pub(crate) fn data_bytes(&self) -> u64 {
        if self.status == Status::Ok && matches!(self.op, Op::Read | Op::Write) {
            self.len
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_transfers_continue_and_zero_bytes_fail() {
        let mut r = Request::new();
        r.stage = Stage::Read;
        r.op = Op::Read;
        r.len = 4096;
        r.buffer(4096);
        assert_eq!(r.complete(1000), Next::Again);
        assert_eq!(r.done, 1000);
        assert_eq!(r.complete(3096), Next::Done);
        assert_eq!(r.status, Status::Ok);

        r.done = 0;
        assert_eq!(r.complete(0), Next::Done);
        assert_eq!(r.status, Status::IoErr);
    }

    #[test]
    fn write_zeroes_falls_back_to_zero_range_then_writes() {
        let mut r = Request::new();
        r.stage = Stage::ZeroPunch;
        r.op = Op::WriteZeroes;
        r.len = 3 << 20;
        assert_eq!(r.complete(-libc::EOPNOTSUPP), Next::Again);
        assert_eq!(r.stage, Stage::ZeroRange);
        assert_eq!(r.complete(-libc::EINVAL), Next::Again);
        assert_eq!(r.stage, Stage::ZeroWrite);
        for _ in 0..2 {
            assert_eq!(r.complete(ZERO_CHUNK as i32), Next::Again);
        }
        assert_eq!(r.complete(ZERO_CHUNK as i32), Next::Done);
        assert_eq!(r.status, Status::Ok);

        let mut d = Request::new();
        d.stage = Stage::Discard;
        assert_eq!(d.complete(-libc::EOPNOTSUPP), Next::Done);
        assert_eq!(d.status, Status::Unsupp);
    }
}

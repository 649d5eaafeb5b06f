//! From a descriptor chain to a validated block request (virtio 1.2 §5.2.6).
//!
//! A chain is read as a byte stream: its device-readable part holds the 16-byte header
//! (`virtio_blk_outhdr`: type, reserved, sector) and then the data of an OUT request or the
//! segments of a DISCARD/WRITE_ZEROES request; its device-writable part holds the data
//! of an IN or GET_ID request and ends with the status byte. Descriptor boundaries do not
//! matter (§2.7.4): a header split 8+8, a header sharing a descriptor with data, and data
//! sharing a descriptor with the status byte all parse the same.
//!
//! Everything here is guest input. A chain that cannot carry a status byte completes with
//! used length 0; any other defect completes with `VIRTIO_BLK_S_IOERR` or `_UNSUPP` and
//! never reaches the lender.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

pub use crate::blk::spec::DeviceLimits;
use crate::blk::spec::*;
use crate::guest::{gather, GuestMemory, HostIov};

/// A request to send to the lender: the fabric's typed block request (lengths in
/// [`devlend_fabric::Bytes`] for reads and writes, [`devlend_fabric::Sectors`] for
/// discards and write-zeroes).
pub use devlend_fabric::BlockRequest as Request;
use devlend_fabric::{Sector, Sectors};

/// What to do with a parsed chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Send to the lender; the data iovecs were appended to the caller's vector.
    Submit(Request),
    /// Complete now with `status`, having written `written` bytes of data into the
    /// chain's writable buffers (GET_ID); nothing goes to the lender.
    Complete {
        /// Status byte to store.
        status: u8,
        /// Data bytes written before the status byte.
        written: u32,
    },
    /// The chain has no writable byte for a status: return it to the used ring with
    /// length 0 (virtio 1.2 §2.7.8) and do nothing else.
    NoStatus,
}

/// A parsed chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parsed {
    /// Head descriptor index: the id returned to the used ring.
    pub head: u16,
    /// Guest address of the status byte (valid unless [`Disposition::NoStatus`]).
    pub status_addr: GuestAddress,
    /// The outcome.
    pub disposition: Disposition,
}

/// One descriptor's buffer.
#[derive(Debug, Clone, Copy)]
struct Seg {
    addr: GuestAddress,
    len: u32,
}

/// Reusable scratch space for [`parse`], so that parsing allocates nothing per request.
#[derive(Debug, Default)]
pub struct Scratch {
    readable: Vec<Seg>,
    writable: Vec<Seg>,
}

/// Parses and validates one descriptor chain.
///
/// `iovs` is cleared; for [`Disposition::Submit`] of a read or write it then holds the
/// host iovecs of the data buffers (in order, one per guest memory region touched).
/// GET_ID is answered here from `limits.serial`.
pub fn parse<M>(
    chain: DescriptorChain<M>,
    mem: &GuestMemory,
    limits: &DeviceLimits,
    scratch: &mut Scratch,
    iovs: &mut Vec<HostIov>,
) -> Parsed
where
    M: Deref<Target = GuestMemory>,
{
    iovs.clear();
    let head = chain.head_index();
    let shape = collect(chain, scratch);
    let (r, w) = (&scratch.readable, &scratch.writable);
    let Some(last) = w.last().filter(|s| s.len > 0) else {
        return Parsed {
            head,
            status_addr: GuestAddress(0),
            disposition: Disposition::NoStatus,
        };
    };
    let status_addr = GuestAddress(last.addr.0.wrapping_add(u64::from(last.len) - 1));
    if status_addr.0 < last.addr.0 || GuestMemoryBackend::get_slice(mem, status_addr, 1).is_err() {
        return Parsed {
            head,
            status_addr,
            disposition: Disposition::NoStatus,
        };
    }
    let disposition = if shape.is_err() {
        ioerr()
    } else {
        classify(mem, limits, r, w, iovs)
    };
    if !matches!(
        disposition,
        Disposition::Submit(Request::Read { .. } | Request::Write { .. })
    ) {
        iovs.clear();
    }
    Parsed {
        head,
        status_addr,
        disposition,
    }
}

fn ioerr() -> Disposition {
    Disposition::Complete {
        status: S_IOERR,
        written: 0,
    }
}

fn unsupp() -> Disposition {
    Disposition::Complete {
        status: S_UNSUPP,
        written: 0,
    }
}

/// Splits the chain into readable and writable buffers. Err when the chain is not
/// well formed: a readable descriptor after a writable one, or a chain the iterator
/// stopped early (a `next` out of the table, a bad indirect table, a loop).
fn collect<M>(chain: DescriptorChain<M>, scratch: &mut Scratch) -> Result<(), ()>
where
    M: Deref<Target = GuestMemory>,
{
    scratch.readable.clear();
    scratch.writable.clear();
    let mut ok = true;
    let mut last_has_next = false;
    for d in chain {
        let seg = Seg {
            addr: d.addr(),
            len: d.len(),
        };
        if d.is_write_only() {
            scratch.writable.push(seg);
        } else if scratch.writable.is_empty() {
            scratch.readable.push(seg);
        } else {
            ok = false;
        }
        last_has_next = d.has_next();
    }
    if last_has_next {
        ok = false;
    }
    if ok {
        Ok(())
    } else {
        Err(())
    }
}

fn total(segs: &[Seg]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// Copies `buf.len()` bytes starting `offset` bytes into the stream `segs`.
fn read_stream(mem: &GuestMemory, segs: &[Seg], mut offset: u64, buf: &mut [u8]) -> bool {
    let mut done = 0usize;
    for s in segs {
        if done == buf.len() {
            break;
        }
        let len = u64::from(s.len);
        if offset >= len {
            offset -= len;
            continue;
        }
        let n = ((len - offset) as usize).min(buf.len() - done);
        let Some(addr) = s.addr.0.checked_add(offset) else {
            return false;
        };
        if mem
            .read_slice(&mut buf[done..done + n], GuestAddress(addr))
            .is_err()
        {
            return false;
        }
        done += n;
        offset = 0;
    }
    done == buf.len()
}

/// Writes `data` at the start of the stream `segs`; returns bytes written or None if the
/// memory is not accessible.
fn write_stream(mem: &GuestMemory, segs: &[Seg], data: &[u8]) -> Option<usize> {
    let mut done = 0usize;
    for s in segs {
        if done == data.len() {
            break;
        }
        let n = (s.len as usize).min(data.len() - done);
        mem.write_slice(&data[done..done + n], s.addr).ok()?;
        done += n;
    }
    Some(done)
}

/// Appends the iovecs of `len` bytes of the stream `segs` starting at `offset`.
fn gather_stream(
    mem: &GuestMemory,
    segs: &[Seg],
    mut offset: u64,
    mut len: u64,
    iovs: &mut Vec<HostIov>,
) -> bool {
    for s in segs {
        if len == 0 {
            break;
        }
        let slen = u64::from(s.len);
        if offset >= slen {
            offset -= slen;
            continue;
        }
        let n = (slen - offset).min(len);
        let Some(addr) = s.addr.0.checked_add(offset) else {
            return false;
        };
        if !gather(mem, GuestAddress(addr), n as usize, iovs) {
            return false;
        }
        len -= n;
        offset = 0;
    }
    len == 0
}

fn classify(
    mem: &GuestMemory,
    limits: &DeviceLimits,
    r: &[Seg],
    w: &[Seg],
    iovs: &mut Vec<HostIov>,
) -> Disposition {
    let mut hdr = [0u8; OUTHDR_LEN];
    if !read_stream(mem, r, 0, &mut hdr) {
        return ioerr();
    }
    let req_type = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes([
        hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
    ]);
    // Readable bytes after the header; writable bytes before the status byte.
    let out_len = total(r) - OUTHDR_LEN as u64;
    let in_len = total(w) - 1;
    match req_type {
        T_IN => {
            let Some(len) = data_len(limits, sector, in_len) else {
                return ioerr();
            };
            if len == 0 {
                return Disposition::Complete {
                    status: S_OK,
                    written: 0,
                };
            }
            if !gather_stream(mem, w, 0, in_len, iovs) {
                return ioerr();
            }
            Disposition::Submit(Request::Read {
                sector: Sector(sector),
                len: devlend_fabric::Bytes(len),
            })
        }
        T_OUT => {
            if limits.read_only {
                return ioerr();
            }
            let Some(len) = data_len(limits, sector, out_len) else {
                return ioerr();
            };
            if len == 0 {
                return Disposition::Complete {
                    status: S_OK,
                    written: 0,
                };
            }
            if !gather_stream(mem, r, OUTHDR_LEN as u64, out_len, iovs) {
                return ioerr();
            }
            Disposition::Submit(Request::Write {
                sector: Sector(sector),
                len: devlend_fabric::Bytes(len),
            })
        }
        T_FLUSH => Disposition::Submit(Request::Flush),
        T_GET_ID => {
            let n = (in_len as usize).min(limits.serial.len());
            match write_stream(mem, w, &limits.serial[..n]) {
                Some(written) => Disposition::Complete {
                    status: S_OK,
                    written: written as u32,
                },
                None => ioerr(),
            }
        }
        T_DISCARD | T_WRITE_ZEROES => {
            if limits.read_only {
                return ioerr();
            }
            let discard = req_type == T_DISCARD;
            let max = if discard {
                limits.max_discard_sectors
            } else {
                limits.max_write_zeroes_sectors
            };
            if max == 0 {
                return unsupp();
            }
            segment(mem, limits, r, out_len, discard, max)
        }
        _ => unsupp(),
    }
}

/// Validates an IN/OUT data length against the device: a multiple of 512 bytes
/// (§5.2.6.1), at most `max_transfer`, inside the capacity. A zero-length request
/// inside the capacity is valid and completes without I/O.
fn data_len(limits: &DeviceLimits, sector: u64, len: u64) -> Option<u32> {
    if !len.is_multiple_of(512) || len > u64::from(limits.max_transfer) {
        return None;
    }
    limits.in_range(sector, len / 512).then_some(len as u32)
}

fn segment(
    mem: &GuestMemory,
    limits: &DeviceLimits,
    r: &[Seg],
    payload: u64,
    discard: bool,
    max_sectors: u32,
) -> Disposition {
    let seg_len = SEGMENT_LEN as u64;
    if payload == 0 || !payload.is_multiple_of(seg_len) {
        return ioerr();
    }
    if payload / seg_len > u64::from(MAX_SEGMENTS) {
        return ioerr();
    }
    let mut s = [0u8; SEGMENT_LEN];
    if !read_stream(mem, r, OUTHDR_LEN as u64, &mut s) {
        return ioerr();
    }
    let sector = u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]);
    let sectors = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    let flags = u32::from_le_bytes([s[12], s[13], s[14], s[15]]);
    let known = if discard { 0 } else { FLAG_UNMAP };
    if flags & !known != 0 {
        return unsupp();
    }
    if sectors > max_sectors || !limits.in_range(sector, u64::from(sectors)) {
        return ioerr();
    }
    if sectors == 0 {
        return Disposition::Complete {
            status: S_OK,
            written: 0,
        };
    }
    Disposition::Submit(if discard {
        Request::Discard {
            sector: Sector(sector),
            sectors: Sectors(sectors),
        }
    } else {
        Request::WriteZeroes {
            sector: Sector(sector),
            sectors: Sectors(sectors),
            unmap: flags & FLAG_UNMAP != 0,
        }
    })
}

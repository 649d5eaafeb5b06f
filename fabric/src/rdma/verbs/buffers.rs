//! A connection's registered message buffers ([`MsgPool`]): equal buffers indexed
//! `0..count`, registered in at most two parts, so that a lender can register a
//! handshake's few buffers when it accepts a connection and the rest only once the
//! hello is admitted ([`super::Connection::grow`]).

use std::sync::Arc;

use rdma_sys::ibv_sge;

use super::{Mr, Pd};
use crate::rdma::RdmaError;

/// Buffers a lender registers for a connection's handshake, each way: the hello, the
/// possession message and the replies (a borrower has at most two in flight).
pub const HANDSHAKE_BUFFERS: usize = 4;

/// One registered allocation of `count` buffers.
struct Part {
    mr: Mr,
    buf: Box<[u8]>,
    count: usize,
}

/// Equal registered message buffers, `size` bytes each.
pub(super) struct MsgPool {
    parts: Vec<Part>,
    size: usize,
}

impl MsgPool {
    /// `count` buffers of `size` bytes, registered on `pd`.
    pub(super) fn new(pd: &Arc<Pd>, count: usize, size: usize) -> Result<Self, RdmaError> {
        let mut pool = MsgPool {
            parts: Vec::with_capacity(2),
            size,
        };
        pool.grow(pd, count)?;
        Ok(pool)
    }

    /// Registers buffers up to `count` in all (none if there are that many already);
    /// the new ones are indexed after the old.
    pub(super) fn grow(&mut self, pd: &Arc<Pd>, count: usize) -> Result<(), RdmaError> {
        let more = count.saturating_sub(self.count());
        if more == 0 {
            return Ok(());
        }
        let mut buf = vec![0u8; more * self.size].into_boxed_slice();
        // SAFETY: `buf` lives in its part beside the MR and is dropped after it (field
        // order: mr first).
        let mr = unsafe { Mr::register(pd, buf.as_mut_ptr(), buf.len(), false)? };
        self.parts.push(Part {
            mr,
            buf,
            count: more,
        });
        Ok(())
    }

    /// Number of buffers.
    pub(super) fn count(&self) -> usize {
        self.parts.iter().map(|p| p.count).sum()
    }

    /// Bytes of each buffer.
    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// The part holding buffer `i`, and the buffer's byte offset in it.
    ///
    /// # Panics
    /// If `i` is not below [`Self::count`] (an index this connection never handed out).
    fn locate(&self, mut i: usize) -> (&Part, usize) {
        for p in &self.parts {
            if i < p.count {
                return (p, i * self.size);
            }
            i -= p.count;
        }
        panic!("message buffer index out of range");
    }

    pub(super) fn sge(&self, i: usize, len: usize) -> ibv_sge {
        let (p, at) = self.locate(i);
        ibv_sge {
            addr: p.buf.as_ptr() as u64 + at as u64,
            length: len.min(self.size) as u32,
            lkey: p.mr.lkey(),
        }
    }

    pub(super) fn get(&self, i: usize, len: usize) -> &[u8] {
        let (p, at) = self.locate(i);
        &p.buf[at..at + len.min(self.size)]
    }

    pub(super) fn get_mut(&mut self, i: usize) -> &mut [u8] {
        let size = self.size;
        let mut i = i;
        for p in &mut self.parts {
            if i < p.count {
                return &mut p.buf[i * size..(i + 1) * size];
            }
            i -= p.count;
        }
        panic!("message buffer index out of range");
    }
}

//! A request's life from pop to used ring: a [`PendingRequest`] is one chain the guest
//! submitted, taken in by the queue's table, until [`PendingRequest::finish`] consumes
//! it with the status the guest is to see.

use std::time::Instant;

use devlend_fabric::wire::{RequestHeader, REQUEST_HEADER_LEN};
use devlend_fabric::{BlockRequest, Op};
use vm_memory::{Bytes, GuestAddress};

use crate::blk::spec::S_OK;
use crate::guest::{mark_iovs_dirty, GuestMemoryRef, HostIov};

/// A request in flight: what goes on the wire, where its data and its status byte are
/// in guest memory, and its progress on the sessions it is sent on.
#[derive(Debug)]
pub(crate) struct PendingRequest {
    /// Its id on the wire ([`crate::blk::request_id`]: `(sequence << 16) | head`).
    id: u64,
    /// The request as it goes on the wire.
    req: BlockRequest,
    status_addr: GuestAddress,
    /// The request's guest buffers, one per host mapping they span.
    iovs: Vec<HostIov>,
    /// The memory map they were parsed with (kept alive, with its RDMA registrations,
    /// until the request completes).
    mem: GuestMemoryRef,
    /// When it last went out (on the current session, or on a lost one).
    pub(crate) sent: Option<Instant>,
    /// Times this request was resent on a new session.
    pub(crate) resends: u32,
    /// Sent (or queued to be sent) on the current session: it counts against the
    /// session's credit until its response is in.
    pub(crate) outstanding: bool,
}

/// What a finished request leaves for the used ring and the counters.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) op: Op,
    /// Data bytes of a READ or a WRITE; 0 for the other operations.
    pub(crate) len: u32,
    /// Bytes written into the chain: a successful read's data, and the status byte.
    pub(crate) written: u32,
    /// When it last went out.
    pub(crate) sent: Option<Instant>,
}

impl PendingRequest {
    /// A request taken in with id `id`, its buffers `iovs` parsed against `mem`.
    pub(crate) fn new(
        id: u64,
        req: BlockRequest,
        status_addr: GuestAddress,
        iovs: Vec<HostIov>,
        mem: GuestMemoryRef,
    ) -> Self {
        PendingRequest {
            id,
            req,
            status_addr,
            iovs,
            mem,
            sent: None,
            resends: 0,
            outstanding: false,
        }
    }

    /// Its id on the wire.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The operation.
    pub(crate) fn op(&self) -> Op {
        self.req.op()
    }

    /// Data bytes of a READ or a WRITE; 0 for the other operations.
    pub(crate) fn len(&self) -> u32 {
        self.req.data_len().0
    }

    /// What the request counts against the byte credit: its data length (a read's or
    /// a write's, 0 otherwise, as the lender charges it).
    pub(crate) fn charge(&self) -> usize {
        self.len() as usize
    }

    /// Its encoded request header.
    pub(crate) fn header(&self) -> [u8; REQUEST_HEADER_LEN] {
        RequestHeader {
            id: self.id,
            request: self.req,
        }
        .encode()
    }

    /// Its guest buffers.
    pub(crate) fn iovs(&self) -> &[HostIov] {
        &self.iovs
    }

    /// The memory map its buffers were parsed with.
    pub(crate) fn mem(&self) -> &GuestMemoryRef {
        &self.mem
    }

    /// Ends the request with virtio `status`: marks a read's buffers in the dirty log
    /// (whatever the status: a failed read may have written part of them; the data came
    /// past vm-memory, a socket read or the lender's RDMA WRITE, and is all in now) and
    /// stores the status byte (through vm-memory, which marks it itself). Returns what
    /// the used ring and the counters need, and the buffer list for the slot's next
    /// request.
    pub(crate) fn finish(self, status: u8) -> (Finished, Vec<HostIov>) {
        let op = self.op();
        let len = self.len();
        if op == Op::Read {
            mark_iovs_dirty(&self.mem, &self.iovs);
        }
        // The status address was validated against this memory map by `parse`.
        let _ = self.mem.write_obj(status, self.status_addr);
        let data = if status == S_OK && op == Op::Read {
            len
        } else {
            0
        };
        let done = Finished {
            op,
            len,
            written: data + 1,
            sent: self.sent,
        };
        (done, self.iovs)
    }
}

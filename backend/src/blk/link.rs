//! A queue's open session to the lender, as its engine sees it: the [`QueueLink`] trait, and
//! what its implementations share.
//!
//! The engine talks to a link, not to a transport. Two links implement it:
//! - the **stream link** (`stream.rs`): TCP, or the plaintext end of a TLS pump; it owns
//!   the send queue (`tx.rs`) and the receive framing, which lands a read's data
//!   straight in its guest buffers;
//! - the **RDMA link** (`rdma.rs`, cargo feature `rdma`): one SEND per request naming
//!   the guest buffers, the lender moving the data one-sided.
//!
//! A link never blocks: [`QueueLink::send`] takes what the transport accepts now and keeps
//! the rest ([`QueueLink::wants_write`]); [`QueueLink::receive`] takes what has arrived. Both work
//! on the queue's [`RequestTable`] (which requests go out, what a response completes)
//! and complete requests through a [`Completer`]. A link that fails returns a
//! [`FabricFault`]; the engine then drops it and recovers on a new one.

use std::io;
use std::os::fd::RawFd;
use std::time::Instant;

use devlend_fabric::wire::{ResponseHeader, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use devlend_fabric::{Credit, Op, Status};

use crate::blk::complete::Completer;
use crate::blk::request_id::head_of;
use crate::blk::spec::{S_IOERR, S_OK, S_UNSUPP};
use crate::blk::table::RequestTable;
use crate::guest::GuestMemoryRef;

/// One queue's session to the lender.
pub(crate) trait QueueLink {
    /// The fd the worker watches: readable when responses (or the session's end)
    /// arrived; writable, while [`Self::wants_write`], when more can be sent.
    fn fd(&self) -> RawFd;

    /// The credit to keep to when the lender stated none in its hello reply.
    fn default_credit(&self) -> Credit;

    /// Sends the waiting requests the session's credit lets go (oldest first,
    /// [`RequestTable::next_to_send`]), after whatever an earlier call could not send
    /// yet, without blocking. A request this link cannot carry completes with IOERR
    /// through `done`.
    ///
    /// # Errors
    /// The session failed.
    fn send(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
    ) -> Result<(), FabricFault>;

    /// Requests were handed to [`Self::send`] and are not written whole yet.
    fn unsent(&self) -> bool {
        false
    }

    /// The transport is full with requests still to send: watch [`Self::fd`] for
    /// writability, then call [`Self::send`].
    fn wants_write(&self) -> bool {
        false
    }

    /// Takes every response that has arrived, without blocking, completing their
    /// requests through `done`.
    ///
    /// # Errors
    /// The session failed, or the lender broke the protocol; the responses taken before
    /// are completed.
    fn receive(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
    ) -> Result<(), FabricFault>;

    /// Sends a heartbeat ([`devlend_fabric::HEARTBEAT_FRAME`]) unless requests still
    /// wait to be written (their bytes do its job), without blocking. A link that
    /// carries none does nothing.
    ///
    /// # Errors
    /// The session failed.
    fn heartbeat(&mut self) -> Result<(), FabricFault> {
        Ok(())
    }

    /// vhost-user handed over a new memory map, `current` (the requests in `table`
    /// may still use older ones).
    ///
    /// # Errors
    /// The link cannot use the new map (the next request retries, then drops the
    /// session).
    fn memory_changed(
        &mut self,
        current: &GuestMemoryRef,
        table: &RequestTable,
    ) -> Result<(), FabricFault> {
        let _ = (current, table);
        Ok(())
    }
}

/// Why a queue's session was dropped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FabricFault {
    #[error("lender closed the connection")]
    Closed,
    #[error("fabric I/O failed")]
    Io(#[source] io::Error),
    #[error("malformed response")]
    Wire(#[source] devlend_fabric::WireError),
    #[error("response for request {0:#x}, which is not in flight")]
    UnknownId(u64),
    #[error("response length {got} where {want} was expected")]
    BadLength { got: u32, want: u32 },
    #[error("bytes after a response that has no data, where no response was due")]
    Misframed,
    #[error("RDMA transport")]
    Rdma(#[source] devlend_fabric::rdma::RdmaError),
    /// Not a fabric fault: the guest's used ring is not in guest memory.
    #[error("used ring inaccessible")]
    Ring(#[source] virtio_queue::Error),
}

impl From<virtio_queue::Error> for FabricFault {
    fn from(e: virtio_queue::Error) -> Self {
        FabricFault::Ring(e)
    }
}

/// The next request the credit lets go ([`RequestTable::next_to_send`], now
/// outstanding): its head, its encoded header, and the bytes of guest data that follow
/// the header on a stream (a write's).
pub(crate) fn next_request(
    table: &mut RequestTable,
    now: Instant,
) -> Option<(u16, [u8; REQUEST_HEADER_LEN], usize)> {
    let (head, pending) = table.next_request(now)?;
    let data = if pending.op() == Op::Write {
        pending.len() as usize
    } else {
        0
    };
    Some((head, pending.header(), data))
}

/// A response header, checked against the requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Response {
    /// The head of the request it answers.
    pub(crate) head: u16,
    /// Its virtio status byte.
    pub(crate) status: u8,
    /// Bytes of read data that come with it (on a stream, after the header).
    pub(crate) data: u32,
    /// It waited on the lender for the lease's limits.
    pub(crate) throttled: bool,
}

/// Decodes a response header and checks it: a request in flight with that id, and the
/// length its status and operation call for.
///
/// # Errors
/// The lender broke the protocol.
pub(crate) fn check_response(
    table: &RequestTable,
    raw: &[u8; RESPONSE_HEADER_LEN],
) -> Result<Response, FabricFault> {
    let h = ResponseHeader::decode(raw).map_err(FabricFault::Wire)?;
    let pending = table.lookup(h.id).ok_or(FabricFault::UnknownId(h.id))?;
    let want = if h.status == Status::Ok && pending.op() == Op::Read {
        pending.len()
    } else {
        0
    };
    if h.len.0 != want {
        return Err(FabricFault::BadLength { got: h.len.0, want });
    }
    Ok(Response {
        head: head_of(h.id),
        status: match h.status {
            Status::Ok => S_OK,
            Status::IoErr => S_IOERR,
            Status::Unsupp => S_UNSUPP,
        },
        data: want,
        throttled: h.throttled,
    })
}

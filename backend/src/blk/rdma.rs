//! A queue's RDMA session, the RDMA [`QueueLink`]: the queue pair, and guest memory
//! registered on it.
//!
//! Each request goes as one SEND naming its guest buffers (address, rkey, length); the
//! lender moves the data one-sided and SENDs the response header, so a receive is
//! headers only, each completing its request at once.
//!
//! **What the lender can reach** is the attachment's [`RdmaExposure`]. By default
//! ([`RdmaExposure::Request`]) each buffer of a request is registered when the request
//! is sent, for the lender alone and in the request's direction (it may write a read's
//! buffers, read a write's), and deregistered when the response arrives, or when the
//! head is sent again or the session goes: its rkey reaches that buffer and nothing
//! else, and dies with the request.
//!
//! **Memory-region lifetime with [`RdmaExposure::GuestMemory`]** (the rule is in
//! [`crate::blk::mr_cache`]): each guest
//! memory region is one MR (local write, remote read, remote write) in this session's
//! protection domain, registered when vhost-user hands over a map containing it
//! ([`QueueLink::memory_changed`], from `update_memory`) or, on a new session, when the
//! first request parsed against that map is sent; kept while the current map or a
//! request in flight holds the region; dropped after (pruned once no request in flight holds it). A lost
//! session drops the queue pair and every registration with it (the requests are resent
//! on the next session, registered again on its protection domain); so does detach,
//! which drops the engine.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Instant;

use crate::blk::complete::Completer;
use crate::blk::link::{check_response, FabricFault, QueueLink};
use crate::blk::mr_cache::RegionCache;
use crate::blk::pending::PendingRequest;
use crate::blk::spec::S_IOERR;
use crate::blk::table::RequestTable;
use crate::guest::{GuestMemoryRef, HostIov};
use crate::lender::target::{LenderTarget, RdmaExposure, CONNECT_TIMEOUT};
use devlend_fabric::rdma::verbs::{self, Completion, Connection, Mr, PeerAccess, RECV_BIT};
use devlend_fabric::rdma::{encode_request, RdmaError, Segment, MAX_REQUEST_MSG, MAX_SEGMENTS};
use devlend_fabric::tcp::ConnectError;
use devlend_fabric::wire::{REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use devlend_fabric::{Credit, HelloReply, HelloStatus, Op};

/// Registers `len` bytes at `ptr` of guest memory on `pd`.
fn register(pd: &Arc<verbs::Pd>, ptr: *mut u8, len: usize) -> Result<Mr, RdmaError> {
    // SAFETY: `ptr..ptr+len` is one mapped guest memory region; the cache entry that
    // keeps this MR also keeps a map holding the region, dropped after the MR (field
    // order of its entry), so the range stays mapped while registered.
    unsafe { Mr::register(pd, ptr, len, true) }
}

/// The registrations of one head's request ([`RdmaExposure::Request`]); empty between
/// requests, its vector kept so that a request costs no allocation.
#[derive(Default)]
struct RequestRegs {
    /// One per buffer (dropped before `keep`: field order).
    mrs: Vec<Mr>,
    /// The map the buffers were parsed with, so that they stay mapped while registered.
    keep: Option<GuestMemoryRef>,
}

impl RequestRegs {
    /// Deregisters the buffers, then lets the map go.
    fn clear(&mut self) {
        self.mrs.clear();
        self.keep = None;
    }
}

/// One queue's RDMA connection. The connection (its QP) is dropped before the MRs.
pub(crate) struct RdmaLink {
    conn: Connection,
    exposure: RdmaExposure,
    /// [`RdmaExposure::GuestMemory`]: the guest memory regions' registrations.
    regs: RegionCache<Mr>,
    /// [`RdmaExposure::Request`]: the registrations of each head's request on this
    /// session, indexed by head (at most the queue size).
    per_request: Vec<RequestRegs>,
    segs: Vec<Segment>,
    done: Vec<Completion>,
    /// Response headers taken from receives, reused between calls.
    responses: Vec<[u8; RESPONSE_HEADER_LEN]>,
}

impl RdmaLink {
    /// Opens the session for virtqueue `index` and runs the handshake.
    pub(crate) fn connect(
        target: &LenderTarget,
        index: u16,
        exposure: RdmaExposure,
    ) -> Result<(RdmaLink, HelloReply), ConnectError> {
        let hello = target.hello(index);
        let (conn, reply) =
            verbs::connect(&target.addr, &hello, CONNECT_TIMEOUT).map_err(|source| {
                ConnectError::Rdma {
                    addr: target.addr.clone(),
                    source,
                }
            })?;
        if reply.status != HelloStatus::Ok {
            return Err(ConnectError::Refused {
                addr: target.addr.clone(),
                device: hello.device,
                status: reply.status,
                message: reply.message,
            });
        }
        target.check_lender(&hello, &reply)?;
        Ok((
            RdmaLink {
                conn,
                exposure,
                regs: RegionCache::new(),
                per_request: Vec::new(),
                segs: Vec::with_capacity(MAX_SEGMENTS),
                done: Vec::new(),
                responses: Vec::new(),
            },
            reply,
        ))
    }

    /// Registers the regions of `mem` not registered yet.
    fn ensure(&mut self, mem: &GuestMemoryRef) -> Result<(), RdmaError> {
        let before = self.regs.len();
        let pd = self.conn.pd();
        self.regs.ensure(mem, |ptr, len| register(pd, ptr, len))?;
        if self.regs.len() != before {
            tracing::debug!(
                added = self.regs.len() - before,
                registered = self.regs.len(),
                "guest memory regions registered for RDMA"
            );
        }
        Ok(())
    }

    /// vhost-user handed over a new memory map (`current`): registers its new regions
    /// and drops the registrations of regions that neither it nor a request in flight
    /// (whose maps are `in_flight`) uses.
    ///
    /// # Errors
    /// A registration failed (out of RDMA resources); the session is then dropped.
    fn register_new<'a>(
        &mut self,
        current: &'a GuestMemoryRef,
        in_flight: impl Iterator<Item = &'a GuestMemoryRef>,
    ) -> Result<(), RdmaError> {
        if self.exposure == RdmaExposure::GuestMemory {
            self.ensure(current)?;
            self.prune(current, in_flight);
        }
        Ok(())
    }

    /// Drops the registrations of regions that neither `current` nor the maps of the
    /// requests in flight hold.
    fn prune<'a>(
        &mut self,
        current: &'a GuestMemoryRef,
        in_flight: impl Iterator<Item = &'a GuestMemoryRef>,
    ) {
        let dropped = self.regs.prune(std::iter::once(current).chain(in_flight));
        if dropped > 0 {
            tracing::debug!(
                dropped,
                registered = self.regs.len(),
                "RDMA registrations of guest memory regions no longer in use dropped"
            );
        }
    }

    /// Sends one request as one SEND from the send buffer of its head, with one
    /// segment per guest buffer iovec for a read or a write. Returns `false` when it
    /// cannot be sent (more segments than allowed, or memory outside the registered
    /// map): the caller completes it with IOERR.
    fn send_one(
        &mut self,
        header: &[u8; REQUEST_HEADER_LEN],
        head: u16,
        request: &PendingRequest,
    ) -> Result<bool, RdmaError> {
        self.segs.clear();
        if let op @ (Op::Read | Op::Write) = request.op() {
            let mem = request.mem();
            let ok = request.iovs().len() <= MAX_SEGMENTS
                && match self.exposure {
                    RdmaExposure::Request => {
                        self.register_request(head, op, request.iovs(), mem)?;
                        true
                    }
                    RdmaExposure::GuestMemory => self.guest_memory_segments(request.iovs(), mem)?,
                };
            if !ok {
                tracing::warn!(
                    head,
                    segments = request.iovs().len(),
                    "request cannot be described to the lender over RDMA; failing it"
                );
                return Ok(false);
            }
        }
        let i = usize::from(head);
        let buf = self.conn.send_buf(i);
        let n = encode_request(header, &self.segs, &mut buf[..MAX_REQUEST_MSG]);
        self.conn.post_send(i, n, u64::from(head))?;
        Ok(true)
    }

    /// [`RdmaExposure::Request`]: registers each buffer of the request at `head` for
    /// the lender alone, in the request's direction, and describes them in `segs`. The
    /// registrations of the head's previous request on this session go (its response
    /// came, or it is sent again).
    fn register_request(
        &mut self,
        head: u16,
        op: Op,
        iovs: &[HostIov],
        mem: &GuestMemoryRef,
    ) -> Result<(), RdmaError> {
        let i = usize::from(head);
        if self.per_request.len() <= i {
            self.per_request.resize_with(i + 1, RequestRegs::default);
        }
        let regs = &mut self.per_request[i];
        regs.clear();
        regs.keep = Some(mem.clone());
        // The lender writes a read's buffers, and reads a write's data.
        let peer = if op == Op::Read {
            PeerAccess::Write
        } else {
            PeerAccess::Read
        };
        let pd = self.conn.pd();
        for iov in iovs {
            // SAFETY: the iovec is a guest buffer inside a region of `mem` (the chain
            // was parsed against it); `regs.keep` holds `mem` until the MRs are dropped
            // (`RequestRegs::clear`, and field order), so the range stays mapped while
            // registered.
            let mr = unsafe { Mr::register_for_peer(pd, iov.ptr, iov.len, peer) }?;
            self.segs.push(Segment {
                addr: iov.ptr as u64,
                rkey: mr.rkey(),
                len: iov.len as u32,
            });
            regs.mrs.push(mr);
        }
        Ok(())
    }

    /// [`RdmaExposure::GuestMemory`]: describes the request's buffers by the rkeys of
    /// their guest memory regions (registered now if they are not yet). `false` when a
    /// buffer is outside the registered regions.
    fn guest_memory_segments(
        &mut self,
        iovs: &[HostIov],
        mem: &GuestMemoryRef,
    ) -> Result<bool, RdmaError> {
        self.ensure(mem)?;
        let mut ok = true;
        for iov in iovs {
            match self.regs.lookup(iov.ptr as u64, iov.len as u64, Mr::rkey) {
                Some(rkey) => self.segs.push(Segment {
                    addr: iov.ptr as u64,
                    rkey,
                    len: iov.len as u32,
                }),
                None => ok = false,
            }
        }
        Ok(ok)
    }

    /// The response for `head` arrived: the lender is done with its buffers, whose
    /// registrations go ([`RdmaExposure::Request`]).
    fn release_request(&mut self, head: u16) {
        if let Some(r) = self.per_request.get_mut(usize::from(head)) {
            r.clear();
        }
    }

    /// Takes the response headers that arrived (their data is already in guest memory),
    /// reposting their receive buffers.
    ///
    /// # Errors
    /// A failed work request, a response of the wrong size, or a disconnect; the
    /// responses taken before it are in `out`.
    fn poll(&mut self, out: &mut Vec<[u8; RESPONSE_HEADER_LEN]>) -> Result<(), RdmaError> {
        self.done.clear();
        let polled = self.conn.poll(&mut self.done);
        for k in 0..self.done.len() {
            let c = self.done[k];
            if let Some(e) = c.error {
                return Err(RdmaError::WorkRequest(format!(
                    "{} failed: {e}",
                    if c.recv {
                        "a receive"
                    } else {
                        "a request SEND"
                    }
                )));
            }
            if !c.recv {
                continue;
            }
            let i = (c.wr_id & !RECV_BIT) as usize;
            if c.byte_len as usize != RESPONSE_HEADER_LEN {
                return Err(RdmaError::WorkRequest(format!(
                    "response message of {} bytes, not {RESPONSE_HEADER_LEN}",
                    c.byte_len
                )));
            }
            let mut h = [0u8; RESPONSE_HEADER_LEN];
            h.copy_from_slice(self.conn.recv_msg(i, RESPONSE_HEADER_LEN));
            out.push(h);
            self.conn.post_recv(i)?;
        }
        polled
    }
}

impl QueueLink for RdmaLink {
    fn fd(&self) -> RawFd {
        self.conn.fd()
    }

    /// The lender has a receive buffer posted for every request a virtqueue can have
    /// outstanding.
    fn default_credit(&self) -> Credit {
        Credit {
            requests: devlend_fabric::rdma::RECV_DEPTH as u32,
            bytes: u32::MAX,
        }
    }

    fn send(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
    ) -> Result<(), FabricFault> {
        let now = Instant::now();
        while let Some((head, request)) = table.next_request(now) {
            let header = request.header();
            if !self
                .send_one(&header, head, request)
                .map_err(FabricFault::Rdma)?
            {
                done.complete(table, head, S_IOERR)?;
            }
        }
        Ok(())
    }

    fn receive(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
    ) -> Result<(), FabricFault> {
        let mut responses = std::mem::take(&mut self.responses);
        let polled = self.poll(&mut responses);
        let mut outcome = Ok(());
        for raw in &responses {
            if let Err(fault) = check_response(table, raw).and_then(|r| {
                if r.throttled {
                    done.throttled();
                }
                self.release_request(r.head);
                Ok(done.complete(table, r.head, r.status)?)
            }) {
                outcome = Err(fault);
                break;
            }
        }
        responses.clear();
        self.responses = responses;
        // Registrations of regions only completed requests used go now.
        if self.exposure == RdmaExposure::GuestMemory && self.regs.has_stale() {
            self.prune(done.mem(), table.busy_mems());
        }
        outcome?;
        polled.map_err(FabricFault::Rdma)
    }

    fn memory_changed(
        &mut self,
        current: &GuestMemoryRef,
        table: &RequestTable,
    ) -> Result<(), FabricFault> {
        self.register_new(current, table.busy_mems())
            .map_err(FabricFault::Rdma)
    }
}

//! A queue's RDMA session: the queue pair, and guest memory registered on it.
//!
//! **Memory-region lifetime.** Guest memory is registered per memory-map snapshot
//! (the `Arc` that vhost-user's SET_MEM_TABLE / ADD_MEM_REG produce): every region of
//! the map becomes one MR with remote read and write, the first time a request parsed
//! against that map is sent. A request in flight holds its map's `Arc`
//! (`Slot::mem`); a registration is kept while anybody but this cache holds its map,
//! i.e. while the map is current or a request parsed against it is in flight, and is
//! dropped after. A lost session drops the queue pair and every registration with it
//! (the requests are resent on the next session, registered again on its protection
//! domain); so does detach, which drops the engine.

use std::sync::Arc;

use devlend_fabric::rdma::verbs::{self, Completion, Connection, Mr, RECV_BIT};
use devlend_fabric::rdma::{encode_request, RdmaError, Segment, MAX_REQUEST_MSG, MAX_SEGMENTS};
use devlend_fabric::tcp::ConnectError;
use devlend_fabric::wire::{REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use devlend_fabric::{HelloReply, HelloStatus, Op};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::blk::engine::{LenderTarget, Slot, CONNECT_TIMEOUT};
use crate::guest::GuestMemoryRef;

/// The MRs of one memory-map snapshot.
struct Registration {
    /// (host start, length, MR) per region.
    mrs: Vec<(u64, u64, Mr)>,
    mem: GuestMemoryRef,
}

impl Registration {
    fn new(pd: &Arc<verbs::Pd>, mem: &GuestMemoryRef) -> Result<Self, RdmaError> {
        let mut mrs = Vec::new();
        for region in mem.iter() {
            let len = region.len() as usize;
            let Ok(ptr) = region.get_host_address(MemoryRegionAddress(0)) else {
                continue;
            };
            // SAFETY: the region stays mapped while `mem` (kept in this registration,
            // dropped after the MRs: field order) is alive.
            let mr = unsafe { Mr::register(pd, ptr, len, true)? };
            mrs.push((ptr as u64, len as u64, mr));
        }
        Ok(Registration {
            mrs,
            mem: Arc::clone(mem),
        })
    }

    fn rkey(&self, addr: u64, len: u64) -> Option<u32> {
        self.mrs
            .iter()
            .find(|(start, l, _)| addr >= *start && addr + len <= start + l)
            .map(|(_, _, mr)| mr.rkey())
    }
}

/// One queue's RDMA connection. The connection (its QP) is dropped before the MRs.
pub(crate) struct RdmaLink {
    conn: Connection,
    regs: Vec<Registration>,
    segs: Vec<Segment>,
    done: Vec<Completion>,
}

impl RdmaLink {
    /// Opens the session for virtqueue `index` and runs the handshake.
    pub(crate) fn connect(
        target: &LenderTarget,
        index: u16,
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
        Ok((
            RdmaLink {
                conn,
                regs: Vec::new(),
                segs: Vec::with_capacity(MAX_SEGMENTS),
                done: Vec::new(),
            },
            reply,
        ))
    }

    /// The fd to watch (completions and rdma_cm events).
    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        self.conn.fd()
    }

    fn registration(&mut self, mem: &GuestMemoryRef) -> Result<usize, RdmaError> {
        if let Some(i) = self.regs.iter().position(|r| Arc::ptr_eq(&r.mem, mem)) {
            return Ok(i);
        }
        // A new map: drop the registrations nobody uses any more, register this one.
        self.regs.retain(|r| Arc::strong_count(&r.mem) > 1);
        let r = Registration::new(self.conn.pd(), mem)?;
        tracing::debug!(regions = r.mrs.len(), "guest memory registered for RDMA");
        self.regs.push(r);
        Ok(self.regs.len() - 1)
    }

    /// Sends a batch: each request as one SEND from the send buffer of its head, with
    /// one segment per guest buffer iovec for reads and writes. Returns the heads that
    /// cannot be sent (more segments than allowed, or memory outside the registered
    /// map): the caller completes them with IOERR.
    pub(crate) fn send(
        &mut self,
        headers: &[[u8; REQUEST_HEADER_LEN]],
        heads: &[(u16, bool)],
        slots: &[Slot],
    ) -> Result<Vec<u16>, RdmaError> {
        let mut refused = Vec::new();
        for (hdr, &(head, _)) in headers.iter().zip(heads) {
            let slot = &slots[usize::from(head)];
            self.segs.clear();
            if matches!(slot.op, Some(Op::Read | Op::Write)) {
                let Some(mem) = slot.mem.as_ref() else {
                    refused.push(head);
                    continue;
                };
                let r = self.registration(mem)?;
                let reg = &self.regs[r];
                let mut ok = slot.iovs.len() <= MAX_SEGMENTS;
                for iov in slot.iovs.iter().take(MAX_SEGMENTS) {
                    match reg.rkey(iov.ptr as u64, iov.len as u64) {
                        Some(rkey) => self.segs.push(Segment {
                            addr: iov.ptr as u64,
                            rkey,
                            len: iov.len as u32,
                        }),
                        None => ok = false,
                    }
                }
                if !ok {
                    tracing::warn!(
                        head,
                        segments = slot.iovs.len(),
                        "request cannot be described to the lender over RDMA; failing it"
                    );
                    refused.push(head);
                    continue;
                }
            }
            let i = usize::from(head);
            let buf = self.conn.send_buf(i);
            let n = encode_request(hdr, &self.segs, &mut buf[..MAX_REQUEST_MSG]);
            self.conn.post_send(i, n, u64::from(head))?;
        }
        Ok(refused)
    }

    /// Takes the responses that arrived (their data is already in guest memory),
    /// reposting their receive buffers.
    ///
    /// # Errors
    /// A failed work request, a response of the wrong size, or a disconnect; the
    /// responses taken before it are in `out`.
    pub(crate) fn receive(
        &mut self,
        out: &mut Vec<[u8; RESPONSE_HEADER_LEN]>,
    ) -> Result<(), RdmaError> {
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

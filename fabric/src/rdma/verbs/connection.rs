//! One connected RC queue pair ([`Connection`]): its resources' shape, its sends,
//! receives and RDMA READ/WRITE work requests, and its completions.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use rdma_sys::*;

use super::buffers::MsgPool;
use super::{os_err, wait_readable, CmId, CompChannel, Cq, EventChannel, Pd};
use crate::rdma::{RdmaError, MAX_HANDSHAKE_MSG, MAX_REQUEST_MSG, RECV_DEPTH};

/// A work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// `None` on success, else the status text.
    pub error: Option<&'static str>,
    /// Whether it completes a receive.
    pub recv: bool,
    /// Bytes received (receives).
    pub byte_len: u32,
}

/// Receive work-request ids carry this bit (the rest is the buffer index).
pub const RECV_BIT: u64 = 1 << 63;

/// Sizes of a connection's resources.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Send buffers and their size.
    pub send: (usize, usize),
    /// Receive buffers and their size.
    pub recv: (usize, usize),
    /// Send queue depth (messages plus RDMA READ/WRITE work requests).
    pub send_wr: usize,
}

/// The borrower's shape: requests out, responses (and the hello reply) in.
pub const BORROWER: Shape = Shape {
    send: (RECV_DEPTH, MAX_REQUEST_MSG),
    recv: (RECV_DEPTH, MAX_HANDSHAKE_MSG),
    send_wr: RECV_DEPTH + 16,
};

/// One connected RC queue pair. Fields drop in order: QP (in the id), buffers, CQ,
/// channels, PD.
pub struct Connection {
    pub(super) id: CmId,
    pub(super) send: MsgPool,
    pub(super) recv: MsgPool,
    pub(super) cq: Cq,
    pub(super) comp: Arc<CompChannel>,
    pub(super) pd: Arc<Pd>,
    pub(super) events: EventChannel,
    pub(super) epoll: OwnedFd,
    pub(super) peer: String,
    pub(super) wc: Vec<ibv_wc>,
    pub(super) disconnected: bool,
    /// Completions taken during the handshake but not returned yet.
    pub(super) early: Vec<Completion>,
    /// The buffers and depths it was built for ([`Self::grow`] registers the rest).
    pub(super) shape: Shape,
}

// SAFETY: every handle inside is used by one thread at a time (the owner's).
unsafe impl Send for Connection {}

impl Connection {
    /// The fd to wait on (readable: a completion or an rdma_cm event is ready); then
    /// call [`Self::poll`].
    pub fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// The peer's address, for logs.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The protection domain, to register memory the peer may reach.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    pub(super) fn arm(&mut self) -> Result<(), RdmaError> {
        // SAFETY: live CQ.
        if unsafe { ibv_req_notify_cq(self.cq.cq, 0) } != 0 {
            return Err(RdmaError::WorkRequest(format!(
                "arming the CQ: {}",
                os_err()
            )));
        }
        Ok(())
    }

    /// Posts receive buffer `i` again.
    ///
    /// # Errors
    /// The verbs error.
    pub fn post_recv(&mut self, i: usize) -> Result<(), RdmaError> {
        let mut sge = self.recv.sge(i, self.recv.size());
        // SAFETY: all-zero is a valid ibv_recv_wr.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = RECV_BIT | i as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live; the buffer is registered and owned by self.
        if unsafe { ibv_post_recv(self.id.qp(), &mut wr, &mut bad) } != 0 {
            return Err(RdmaError::WorkRequest(format!(
                "posting a receive: {}",
                os_err()
            )));
        }
        Ok(())
    }

    /// Registers the rest of the buffers of the connection's shape and posts the new
    /// receive buffers. An accepted connection ([`super::Incoming::establish`]) has only
    /// [`super::HANDSHAKE_BUFFERS`] each way until then (16 KiB against about 6 MiB
    /// for a lender's session): a lender calls it once the hello is admitted, before
    /// its reply, so that a connection that never proves anything holds little. A
    /// no-op when they are all there.
    ///
    /// # Errors
    /// The verbs error (registering or posting).
    pub fn grow(&mut self) -> Result<(), RdmaError> {
        let old = self.recv.count();
        self.send.grow(&self.pd, self.shape.send.0)?;
        self.recv.grow(&self.pd, self.shape.recv.0)?;
        for i in old..self.recv.count() {
            self.post_recv(i)?;
        }
        Ok(())
    }

    /// The first `len` bytes of receive buffer `i`.
    pub fn recv_msg(&self, i: usize, len: usize) -> &[u8] {
        self.recv.get(i, len)
    }

    /// Send buffer `i`, to fill before [`Self::post_send`].
    pub fn send_buf(&mut self, i: usize) -> &mut [u8] {
        self.send.get_mut(i)
    }

    /// Number of send buffers.
    pub fn send_slots(&self) -> usize {
        self.send.count()
    }

    /// Copies `msg` into send buffer `i` and sends it (signaled, id `wr_id`).
    ///
    /// # Errors
    /// The verbs error.
    pub fn send_msg(&mut self, i: usize, msg: &[u8], wr_id: u64) -> Result<(), RdmaError> {
        let n = msg.len().min(self.send.size());
        self.send.get_mut(i)[..n].copy_from_slice(&msg[..n]);
        self.post_send(i, n, wr_id)
    }

    /// Sends the first `len` bytes of send buffer `i` (signaled, id `wr_id`).
    ///
    /// # Errors
    /// The verbs error.
    pub fn post_send(&mut self, i: usize, len: usize, wr_id: u64) -> Result<(), RdmaError> {
        let mut sge = self.send.sge(i, len);
        self.post(ibv_wr_opcode::IBV_WR_SEND, wr_id, &mut sge, 0, 0, true)
    }

    /// Posts an RDMA READ (`read`) or WRITE between local registered memory and a
    /// remote range.
    ///
    /// # Errors
    /// The verbs error.
    #[allow(clippy::too_many_arguments)]
    pub fn post_rdma(
        &mut self,
        read: bool,
        wr_id: u64,
        local: u64,
        lkey: u32,
        len: u32,
        remote: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), RdmaError> {
        let mut sge = ibv_sge {
            addr: local,
            length: len,
            lkey,
        };
        let op = if read {
            ibv_wr_opcode::IBV_WR_RDMA_READ
        } else {
            ibv_wr_opcode::IBV_WR_RDMA_WRITE
        };
        self.post(op, wr_id, &mut sge, remote, rkey, signaled)
    }

    fn post(
        &mut self,
        op: ibv_wr_opcode::Type,
        wr_id: u64,
        sge: &mut ibv_sge,
        remote: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), RdmaError> {
        // SAFETY: all-zero is a valid ibv_send_wr.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = sge;
        wr.num_sge = 1;
        wr.opcode = op;
        wr.send_flags = if signaled {
            ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        wr.wr.rdma = rdma_t {
            remote_addr: remote,
            rkey,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live; the sge points into memory registered in this
        // connection's PD and kept alive by its owner until the completion.
        let rc = unsafe { ibv_post_send(self.id.qp(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(RdmaError::WorkRequest(format!(
                "posting a send: {}",
                io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    /// Takes what is ready: channel events (re-arming the CQ), rdma_cm events, and the
    /// completions, appended to `out`.
    ///
    /// # Errors
    /// [`RdmaError::Disconnected`] when the peer disconnected (after the completions
    /// already queued were appended).
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        out.append(&mut self.early);
        let mut events = 0u32;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking.
            if unsafe { ibv_get_cq_event(self.comp.0, &mut cq, &mut ctx) } != 0 {
                break;
            }
            events += 1;
        }
        if events > 0 {
            // SAFETY: acks exactly the events taken above on this CQ.
            unsafe { ibv_ack_cq_events(self.cq.cq, events) };
        }
        self.arm()?;
        loop {
            // SAFETY: self.wc has room for its length of entries.
            let n = unsafe { ibv_poll_cq(self.cq.cq, self.wc.len() as i32, self.wc.as_mut_ptr()) };
            if n < 0 {
                return Err(RdmaError::WorkRequest("polling the CQ failed".into()));
            }
            for wc in &self.wc[..n as usize] {
                let error = (wc.status != ibv_wc_status::IBV_WC_SUCCESS).then(|| {
                    // SAFETY: returns a static string for any status.
                    unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }
                        .to_str()
                        .unwrap_or("unknown work completion error")
                });
                out.push(Completion {
                    wr_id: wc.wr_id,
                    error,
                    recv: wc.wr_id & RECV_BIT != 0,
                    byte_len: wc.byte_len,
                });
            }
            if (n as usize) < self.wc.len() {
                break;
            }
        }
        while let Some((ev, _, _)) = self.events.try_next() {
            if matches!(
                ev,
                rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                    | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL
                    | rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT
            ) {
                self.disconnected = true;
            }
        }
        if self.disconnected {
            return Err(RdmaError::Disconnected);
        }
        Ok(())
    }

    /// Waits until `deadline` for one completion (handshake only: later completions are
    /// taken with [`Self::poll`]).
    pub(super) fn wait(
        &mut self,
        deadline: Instant,
        what: &'static str,
    ) -> Result<Completion, RdmaError> {
        loop {
            // One poll may take several completions (the hello's SEND and the reply's
            // RECV together): the ones not returned yet wait in `early`.
            if self.early.is_empty() {
                let mut out = std::mem::take(&mut self.early);
                let polled = self.poll(&mut out);
                self.early = out;
                polled?;
            }
            if !self.early.is_empty() {
                return Ok(self.early.remove(0));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RdmaError::Timeout { what });
            }
            wait_readable(self.fd(), left);
        }
    }

    /// Waits for the next receive completion until `deadline`, skipping send ones
    /// (the lender's handshake). Returns the buffer index and length.
    ///
    /// # Errors
    /// Timeout, disconnect or a failed completion.
    pub fn wait_recv(
        &mut self,
        deadline: Instant,
        what: &'static str,
    ) -> Result<(usize, usize), RdmaError> {
        loop {
            let c = self.wait(deadline, what)?;
            if let Some(e) = c.error {
                return Err(RdmaError::WorkRequest(e.to_string()));
            }
            if c.recv {
                return Ok(((c.wr_id & !RECV_BIT) as usize, c.byte_len as usize));
            }
        }
    }

    /// Tells the peer the connection is over (it sees a disconnect event).
    pub fn disconnect(&mut self) {
        // SAFETY: live id.
        unsafe { rdma_disconnect(self.id.0) };
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if !self.disconnected {
            self.disconnect();
        }
    }
}

/// The lender's shape: requests (and the hello) in; responses (and the reply) out, plus
/// RDMA READ/WRITE work requests for `io_slots` requests at a time.
pub fn lender_shape(io_slots: usize) -> Shape {
    Shape {
        send: (RECV_DEPTH, MAX_HANDSHAKE_MSG),
        recv: (RECV_DEPTH, MAX_REQUEST_MSG),
        send_wr: RECV_DEPTH + io_slots * (crate::rdma::MAX_SEGMENTS + 1) + 16,
    }
}

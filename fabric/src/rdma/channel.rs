//! The messages of a PCI session ([`crate::pci::Message`]) on an RDMA connection: each
//! message is one SEND into one of the peer's posted receive buffers (at most
//! [`RDMA_MAX_MESSAGE`] bytes), and the DMA mirror's data moves one-sided, by RDMA READ
//! and WRITE on memory the peer registered ([`MsgChannel::rdma`]).
//!
//! A channel is used by one thread at a time (the owner wraps it in a mutex when two
//! threads share it). Sends are signaled; a send buffer is reused only after its
//! completion, so that at most as many sends are in flight as there are buffers.
//! Received messages are decoded and queued ([`MsgChannel::take`]); a malformed one is
//! a [`ChannelError::Message`], after which the owner closes the session.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::verbs::{Completion, Connection, Pd};
use super::RdmaError;
use crate::pci::{Message, RDMA_MAX_MESSAGE};
use crate::WireError;

/// Work-request ids of sends: this tag and the send buffer's index.
const TAG_SEND: u64 = 1 << 40;
/// Work-request ids of RDMA READ/WRITE: this tag and a sequence number.
const TAG_RDMA: u64 = 2 << 40;
const TAG_MASK: u64 = 0xff << 40;
/// RDMA READ/WRITE work requests posted before waiting for the last of them.
const RDMA_BATCH: usize = 64;
/// Largest RDMA READ or WRITE, in bytes (runs longer than this are split).
pub const MAX_RDMA_OP: u32 = 1 << 20;
/// How long a send waits for a free buffer or an RDMA batch for its completion.
const WAIT: Duration = Duration::from_secs(10);

/// Why a channel operation failed; either way the session is over.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The transport failed: a work request completed in error (a bad rkey or range
    /// from the peer included), the peer disconnected, or a wait timed out.
    #[error("RDMA transport")]
    Rdma(#[source] RdmaError),
    /// The peer sent a malformed message.
    #[error("malformed message from the peer")]
    Message(#[source] WireError),
}

impl From<RdmaError> for ChannelError {
    fn from(e: RdmaError) -> Self {
        ChannelError::Rdma(e)
    }
}

/// One RDMA READ (guest memory into local memory) or WRITE (local memory into guest
/// memory).
#[derive(Debug, Clone, Copy)]
pub struct RdmaOp {
    /// READ when true, else WRITE.
    pub read: bool,
    /// Local address, inside a memory region of key `lkey` of this connection's PD.
    pub local: u64,
    /// The local memory region's key.
    pub lkey: u32,
    /// Bytes (at most [`MAX_RDMA_OP`]).
    pub len: u32,
    /// The peer's address.
    pub remote: u64,
    /// The peer's memory region key.
    pub rkey: u32,
}

/// A PCI session's messages on one RDMA connection.
pub struct MsgChannel {
    conn: Connection,
    next: usize,
    in_flight: usize,
    inbox: VecDeque<Message>,
    done: Vec<Completion>,
    rdma_seq: u64,
    /// Sequence number of the last RDMA work request known complete.
    rdma_done: u64,
}

impl MsgChannel {
    /// A channel on an established connection (handshake done).
    pub fn new(conn: Connection) -> MsgChannel {
        MsgChannel {
            conn,
            next: 0,
            in_flight: 0,
            inbox: VecDeque::new(),
            done: Vec::new(),
            rdma_seq: 0,
            rdma_done: 0,
        }
    }

    /// The fd that is readable when [`Self::poll`] has something to take.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.conn.fd()
    }

    /// The protection domain, to register memory the peer may reach or that RDMA
    /// READ/WRITE use locally.
    pub fn pd(&self) -> &Arc<Pd> {
        self.conn.pd()
    }

    /// Tells the peer the connection is over.
    pub fn disconnect(&mut self) {
        self.conn.disconnect();
    }

    /// The next received message, if one is queued.
    pub fn take(&mut self) -> Option<Message> {
        self.inbox.pop_front()
    }

    /// Takes the completions that are ready: received messages are decoded and queued,
    /// their buffers posted again; send buffers are freed.
    ///
    /// # Errors
    /// [`ChannelError`]; the messages decoded before it stay queued.
    pub fn poll(&mut self) -> Result<(), ChannelError> {
        self.done.clear();
        let polled = self.conn.poll(&mut self.done);
        for k in 0..self.done.len() {
            let c = self.done[k];
            if let Some(e) = c.error {
                let what = if c.recv {
                    "a receive"
                } else if c.wr_id & TAG_MASK == TAG_RDMA {
                    "an RDMA READ or WRITE of the peer's memory (bad rkey, address or length?)"
                } else {
                    "a message SEND"
                };
                return Err(RdmaError::WorkRequest(format!("{what} failed: {e}")).into());
            }
            if c.recv {
                let i = (c.wr_id & !super::verbs::RECV_BIT) as usize;
                let bytes = self.conn.recv_msg(i, c.byte_len as usize);
                let mut rest = bytes;
                let m = Message::read_from(&mut rest).map_err(ChannelError::Message)?;
                if !rest.is_empty() {
                    return Err(ChannelError::Message(WireError::Invalid(
                        "bytes after a PCI message in one RDMA SEND",
                    )));
                }
                self.inbox.push_back(m);
                self.conn.post_recv(i)?;
                continue;
            }
            match c.wr_id & TAG_MASK {
                TAG_SEND => self.in_flight = self.in_flight.saturating_sub(1),
                TAG_RDMA => self.rdma_done = self.rdma_done.max(c.wr_id & !TAG_MASK),
                _ => {}
            }
        }
        polled.map_err(ChannelError::Rdma)
    }

    fn wait_until(
        &mut self,
        what: &'static str,
        mut ready: impl FnMut(&Self) -> bool,
    ) -> Result<(), ChannelError> {
        let deadline = Instant::now() + WAIT;
        loop {
            self.poll()?;
            if ready(self) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RdmaError::Timeout { what }.into());
            }
            super::verbs::wait_fd(self.fd(), left.min(Duration::from_millis(100)));
        }
    }

    /// Sends one message (waiting for a free send buffer if all are in flight).
    ///
    /// # Errors
    /// [`ChannelError::Message`] for a message longer than [`RDMA_MAX_MESSAGE`] (a bug of
    /// the caller, which splits what it sends); [`ChannelError::Rdma`].
    pub fn send(&mut self, m: &Message) -> Result<(), ChannelError> {
        let too_long = || {
            ChannelError::Message(WireError::TooLong {
                what: "PCI message over RDMA",
                len: m.encoded_len() as u64,
                limit: RDMA_MAX_MESSAGE as u64,
            })
        };
        if m.encoded_len() > RDMA_MAX_MESSAGE {
            return Err(too_long());
        }
        let slots = self.conn.send_slots();
        if self.in_flight >= slots {
            self.wait_until("waiting for a free send buffer", |c| c.in_flight < slots)?;
        }
        let i = self.next;
        // Encoded in place, in the registered send buffer: no copy of its own.
        let n = m.encode_into(self.conn.send_buf(i)).ok_or_else(too_long)?;
        self.next = (self.next + 1) % slots;
        self.conn.post_send(i, n, TAG_SEND | i as u64)?;
        self.in_flight += 1;
        Ok(())
    }

    /// Runs `ops` and returns when all are complete: posted in batches of at most
    /// [`RDMA_BATCH`], the last of each signaled (an RC queue pair completes them in
    /// order). Messages received meanwhile are queued.
    ///
    /// # Errors
    /// [`ChannelError::Rdma`]: a failed READ/WRITE (the peer's rkey, address or length),
    /// a disconnect, a timeout.
    pub fn rdma(&mut self, ops: &[RdmaOp]) -> Result<(), ChannelError> {
        for batch in ops.chunks(RDMA_BATCH) {
            let n = batch.len();
            for (k, op) in batch.iter().enumerate() {
                self.rdma_seq += 1;
                self.conn.post_rdma(
                    op.read,
                    TAG_RDMA | self.rdma_seq,
                    op.local,
                    op.lkey,
                    op.len,
                    op.remote,
                    op.rkey,
                    k + 1 == n,
                )?;
            }
            let want = self.rdma_seq;
            self.wait_until("waiting for RDMA READ/WRITE", |c| c.rdma_done >= want)?;
        }
        Ok(())
    }
}

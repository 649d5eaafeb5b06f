//! The frontend's model of the session and its queues, which every reply is checked
//! against, and one iteration's state (`Run`).

use super::*;

/// What the backend made of a message.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// No reply, the session goes on (for a request without a reply of its own: done).
    Done,
    /// A REPLY_ACK status.
    Ack(u64),
    /// A reply with a body of its own.
    Reply(Reply, Vec<OwnedFd>),
    /// The backend closed the connection.
    Closed,
}

impl Outcome {
    /// Whether a request without a reply of its own took effect.
    pub(crate) fn accepted(&self) -> bool {
        matches!(self, Outcome::Done | Outcome::Ack(0))
    }
}

/// The frontend's view of one queue. The "epoch" starts at the last SET_VRING_BASE the
/// backend took.
#[derive(Debug, Clone, Default)]
pub(crate) struct QModel {
    /// The size the guest lays the rings out for (a power of two up to 256).
    pub(crate) size: u16,
    pub(crate) base: u16,
    /// used.idx in guest memory when the epoch started (until the device writes it).
    pub(crate) used_at_base: u16,
    /// How far past `base` the avail index has been (forward, within half the range).
    pub(crate) offered: u16,
    /// Something other than the model may have written the used ring (a ring or buffer
    /// laid out where the model did not put it, an inflight buffer, a memory table that
    /// does not map RAM 1:1): the used-index check is off.
    pub(crate) tainted: bool,
    pub(crate) next_desc: u16,
    pub(crate) slot: u16,
    /// SET_VRING_KICK was taken since the last GET_VRING_BASE.
    pub(crate) started: bool,
}

pub(crate) fn dist(a: u16, b: u16) -> u16 {
    a.wrapping_sub(b)
}

pub(crate) fn ring(q: usize, size: u16) -> SplitRing {
    SplitRing::at(q as u64 * 0x4000, size)
}

pub(crate) struct Inflight {
    pub(crate) fd: OwnedFd,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) mmap_size: u64,
}

impl Drop for Inflight {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: the mapping made when the memfd came, unmapped once.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

pub(crate) struct Session {
    pub(crate) backend: Arc<BlkBackend>,
    pub(crate) daemon: VhostUserDaemon<Arc<BlkBackend>>,
    pub(crate) fe: Option<RawFrontend>,
    /// The backend has served GET_FEATURES (which offers PROTOCOL_FEATURES).
    pub(crate) features_seen: bool,
    /// The protocol features the backend took last.
    pub(crate) proto_acked: u64,
    pub(crate) offered_features: u64,
    pub(crate) offered_proto: u64,
}

impl Session {
    pub(crate) fn reply_ack(&self) -> bool {
        self.features_seen && self.proto_acked & proto::REPLY_ACK != 0
    }
}

/// One iteration's state.
pub(crate) struct Run<'w> {
    pub(crate) w: &'w World,
    pub(crate) s: Option<Session>,
    pub(crate) q: Vec<QModel>,
    pub(crate) inflight: Option<Inflight>,
    pub(crate) messages: usize,
    pub(crate) sessions: usize,
}

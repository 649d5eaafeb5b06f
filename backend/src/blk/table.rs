//! The table of one virtqueue's requests in flight: a slot per head descriptor index,
//! the ids that tell a live response from a stale one, the order requests go out in,
//! the session's credit, and the marks of the queue's chains in the inflight buffer.
//! A slot is free, or holds one [`PendingRequest`] (`pending.rs`) from pop until it
//! is finished ([`RequestTable::finish`]).
//!
//! - A request's id ([`crate::blk::request_id`]) names its head: the table is indexed
//!   by head, and ids sort in submission order.
//! - Every request waits in submission order ([`RequestTable::next_to_send`]) until the
//!   session's [`Credit`] lets it go; it is then *outstanding* until it is removed.
//! - When the session is lost, [`RequestTable::forget_session`] makes nothing
//!   outstanding and [`RequestTable::requeue_all`] lines every request still in its
//!   slot up again, oldest first, for the next session.
//! - With an inflight buffer (INFLIGHT_SHMFD, [`InflightQueue`]), every chain is marked
//!   there from the moment it is popped ([`RequestTable::popped`]) until it is back in
//!   the used ring ([`RequestTable::returned`]). A request is marked for as long as it
//!   has a slot, across lost sessions too; a restarted backend finds the marks in pop
//!   order, the order the table resends in.
//!
//! Its unit tests are in `table/tests.rs`.

use std::collections::VecDeque;
use std::time::Instant;

use devlend_fabric::{BlockRequest, Credit, Op};
use vm_memory::GuestAddress;

use crate::blk::inflight::InflightQueue;
use crate::blk::pending::{Finished, PendingRequest};
use crate::blk::request_id::{head_of, request_id};
use crate::guest::{GuestMemoryRef, HostIov};

/// The slot of one head descriptor index.
#[derive(Debug)]
enum Slot {
    /// No request in flight. `iovs` is the buffer list of the slot's last request, kept
    /// so that the next one reuses its allocation ([`RequestTable::insert`]); a stream's
    /// send queue may still read a finished write's entries
    /// ([`RequestTable::iovs`]).
    Free { iovs: Vec<HostIov> },
    /// A request from pop to used ring.
    InFlight(PendingRequest),
}

impl Default for Slot {
    fn default() -> Self {
        Slot::Free { iovs: Vec::new() }
    }
}

impl Slot {
    fn pending(&self) -> Option<&PendingRequest> {
        match self {
            Slot::InFlight(p) => Some(p),
            Slot::Free { .. } => None,
        }
    }
}

/// What a new request is, as the fabric carries it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewRequest {
    pub(crate) req: BlockRequest,
    pub(crate) status_addr: GuestAddress,
}

/// One virtqueue's requests in flight.
#[derive(Debug)]
pub(crate) struct RequestTable {
    slots: Vec<Slot>,
    inflight: usize,
    reads: usize,
    /// XOR of the heads in flight: the head of the only request in flight when
    /// `inflight` is 1.
    heads_xor: u16,
    seq: u64,
    /// Requests waiting to go out, in submission order (head, id); an entry whose slot
    /// no longer holds that id, or whose request is outstanding already, is stale.
    waiting: VecDeque<(u16, u64)>,
    credit: Credit,
    out_requests: usize,
    out_bytes: usize,
    /// This queue's part of the inflight buffer, when the frontend gave one.
    log: Option<InflightQueue>,
    /// Removes of a head with no request in flight, ignored ([`Self::remove`]).
    stale: u64,
}

impl Default for RequestTable {
    fn default() -> Self {
        RequestTable {
            slots: Vec::new(),
            inflight: 0,
            reads: 0,
            heads_xor: 0,
            seq: 0,
            waiting: VecDeque::new(),
            credit: Credit::V1_DEFAULT,
            out_requests: 0,
            out_bytes: 0,
            log: None,
            stale: 0,
        }
    }
}

impl RequestTable {
    /// Makes room for heads below `size` (the queue's size). Slots are never dropped:
    /// a smaller size (the frontend resized a stopped ring) leaves every slot, and the
    /// request in flight in it, where it is.
    pub(crate) fn fit(&mut self, size: u16) {
        if self.slots.len() < usize::from(size) {
            self.slots.resize_with(usize::from(size), Slot::default);
        }
    }

    /// Whether `head` can take a new request (it has a slot and nothing in flight).
    pub(crate) fn is_free(&self, head: u16) -> bool {
        self.slots
            .get(usize::from(head))
            .is_some_and(|s| matches!(s, Slot::Free { .. }))
    }

    /// Puts a request in the free slot of `head` ([`Self::is_free`]), taking its guest
    /// buffers out of `iovs` (which gets the slot's spare list back), and lines it up
    /// to go out. Returns its id.
    pub(crate) fn insert(
        &mut self,
        head: u16,
        req: NewRequest,
        iovs: &mut Vec<HostIov>,
        mem: GuestMemoryRef,
    ) -> u64 {
        self.seq = self.seq.wrapping_add(1);
        let id = request_id(self.seq, head);
        let op = req.req.op();
        let pending = PendingRequest::new(id, req.req, req.status_addr, std::mem::take(iovs), mem);
        let slot = &mut self.slots[usize::from(head)];
        if let Slot::Free { iovs: spare } = std::mem::replace(slot, Slot::InFlight(pending)) {
            *iovs = spare;
        }
        self.inflight += 1;
        self.heads_xor ^= head;
        if op == Op::Read {
            self.reads += 1;
        }
        self.waiting.push_back((head, id));
        id
    }

    /// The request in flight with this id, if any (a response's id is checked here).
    pub(crate) fn lookup(&self, id: u64) -> Option<&PendingRequest> {
        self.pending(head_of(id)).filter(|p| p.id() == id)
    }

    /// The request in flight in the slot of `head`, if any.
    pub(crate) fn pending(&self, head: u16) -> Option<&PendingRequest> {
        self.slots.get(usize::from(head)).and_then(Slot::pending)
    }

    /// The guest buffers of the request in the slot of `head`; for a free slot, those
    /// of its last request (what a stream's send queue still holds of a write answered
    /// before all of it was sent).
    pub(crate) fn iovs(&self, head: u16) -> &[HostIov] {
        match self.slots.get(usize::from(head)) {
            Some(Slot::InFlight(p)) => p.iovs(),
            Some(Slot::Free { iovs }) => iovs,
            None => &[],
        }
    }

    /// Data bytes of the read or write in flight in the slot of `head` (0: none).
    pub(crate) fn data_len(&self, head: u16) -> usize {
        self.pending(head).map_or(0, PendingRequest::charge)
    }

    /// The next waiting request that the credit lets go now, oldest first; it is then
    /// outstanding, sent at `now`.
    pub(crate) fn next_to_send(&mut self, now: Instant) -> Option<u16> {
        while let Some(&(head, id)) = self.waiting.front() {
            let Some(Slot::InFlight(p)) = self.slots.get_mut(usize::from(head)) else {
                self.waiting.pop_front();
                continue;
            };
            if p.id() != id || p.outstanding {
                self.waiting.pop_front();
                continue;
            }
            let charge = p.charge();
            if !self
                .credit
                .admits(self.out_requests, self.out_bytes, charge)
            {
                return None;
            }
            self.waiting.pop_front();
            p.outstanding = true;
            p.sent = Some(now);
            self.out_requests += 1;
            self.out_bytes += charge;
            return Some(head);
        }
        None
    }

    /// As [`Self::next_to_send`], with the request that goes.
    pub(crate) fn next_request(&mut self, now: Instant) -> Option<(u16, &PendingRequest)> {
        let head = self.next_to_send(now)?;
        // `next_to_send` returns only heads with a request in flight.
        Some((head, self.pending(head)?))
    }

    /// Whether requests wait to go out (the credit, or the session, holds them).
    pub(crate) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Frees the slot of `head`, giving its credit back; returns its request. A head
    /// with no request in flight (no slot, or a free one: removed already) is left
    /// alone and `None` returned, so that the counts cannot be taken down twice.
    pub(crate) fn remove(&mut self, head: u16) -> Option<PendingRequest> {
        let Some(slot) = self.slots.get_mut(usize::from(head)) else {
            self.stale += 1;
            return None;
        };
        let p = match std::mem::take(slot) {
            Slot::InFlight(p) => p,
            free => {
                *slot = free;
                self.stale += 1;
                return None;
            }
        };
        if p.outstanding {
            self.out_requests -= 1;
            self.out_bytes -= p.charge();
        }
        self.inflight -= 1;
        self.heads_xor ^= head;
        if p.op() == Op::Read {
            self.reads -= 1;
        }
        Some(p)
    }

    /// Ends the request in the slot of `head` with virtio `status`
    /// ([`Self::remove`], then [`PendingRequest::finish`]); the slot keeps its buffer
    /// list for the next request. `None`: no request in flight there.
    pub(crate) fn finish(&mut self, head: u16, status: u8) -> Option<Finished> {
        let (done, iovs) = self.remove(head)?.finish(status);
        if let Some(slot) = self.slots.get_mut(usize::from(head)) {
            *slot = Slot::Free { iovs };
        }
        Some(done)
    }

    /// A new session, with its credit: nothing is outstanding on it yet.
    pub(crate) fn new_session(&mut self, credit: Credit) {
        self.forget_session();
        self.credit = credit;
    }

    /// The session is gone: nothing is outstanding any more.
    pub(crate) fn forget_session(&mut self) {
        self.out_requests = 0;
        self.out_bytes = 0;
        for slot in &mut self.slots {
            if let Slot::InFlight(p) = slot {
                p.outstanding = false;
            }
        }
    }

    /// The requests in flight, by head.
    fn in_flight(&self) -> impl Iterator<Item = (u16, &PendingRequest)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(h, s)| Some((h as u16, s.pending()?)))
    }

    /// Lines every request in flight up to go out again, oldest first (the order the
    /// guest submitted them). Returns how many.
    pub(crate) fn requeue_all(&mut self) -> usize {
        let mut heads: Vec<(u16, u64)> = self.in_flight().map(|(h, p)| (h, p.id())).collect();
        heads.sort_by_key(|&(_, id)| id);
        self.waiting.clear();
        self.waiting.extend(heads.iter().copied());
        heads.len()
    }

    /// Counts one more resend for every request in flight; returns the heads that have
    /// been resent more than `max` times.
    pub(crate) fn count_resends(&mut self, max: u32) -> Vec<u16> {
        let mut over = Vec::new();
        for (head, slot) in self.slots.iter_mut().enumerate() {
            if let Slot::InFlight(p) = slot {
                p.resends += 1;
                if p.resends > max {
                    over.push(head as u16);
                }
            }
        }
        over
    }

    /// The heads in flight.
    pub(crate) fn busy_heads(&self) -> Vec<u16> {
        self.in_flight().map(|(h, _)| h).collect()
    }

    /// The memory maps that requests in flight hold.
    pub(crate) fn busy_mems(&self) -> impl Iterator<Item = &GuestMemoryRef> {
        self.in_flight().map(|(_, p)| p.mem())
    }

    /// Removes ignored so far because their head had no request in flight.
    pub(crate) fn stale_removes(&self) -> u64 {
        self.stale
    }

    /// Requests in flight (waiting or outstanding).
    pub(crate) fn inflight(&self) -> usize {
        self.inflight
    }

    /// Reads in flight.
    pub(crate) fn reads(&self) -> usize {
        self.reads
    }

    /// The head of the only request in flight, when there is exactly one.
    pub(crate) fn only_head(&self) -> Option<u16> {
        (self.inflight == 1).then_some(self.heads_xor)
    }

    /// The session's credit.
    pub(crate) fn credit(&self) -> Credit {
        self.credit
    }

    /// Marks chains in `log` from now on (`None`: no inflight buffer).
    pub(crate) fn set_log(&mut self, log: Option<InflightQueue>) {
        self.log = log;
    }

    /// Whether chains are marked in an inflight buffer.
    pub(crate) fn has_log(&self) -> bool {
        self.log.is_some()
    }

    /// Whether the inflight buffer has not been read yet for what an earlier backend
    /// left in it ([`Self::recover_log`]).
    pub(crate) fn log_unread(&self) -> bool {
        self.log.as_ref().is_some_and(|l| !l.checked())
    }

    /// The heads an earlier backend left marked in the inflight buffer, in the order it
    /// popped them (see [`InflightQueue::recover`]); none without a buffer.
    pub(crate) fn recover_log(&mut self, guest_used_idx: u16, queue_size: u16) -> Vec<u16> {
        self.log
            .as_mut()
            .map_or_else(Vec::new, |l| l.recover(guest_used_idx, queue_size))
    }

    /// The chain of `head` was popped from the avail ring: marks it in flight, before
    /// anything else is done with it (so that a crash from here on leaves it marked).
    pub(crate) fn popped(&mut self, head: u16) {
        if let Some(l) = self.log.as_mut() {
            l.mark(head);
        }
    }

    /// `head` is about to be added to the used ring.
    pub(crate) fn returning(&mut self, head: u16) {
        if let Some(l) = self.log.as_mut() {
            l.before_used(head);
        }
    }

    /// `head` was added to the used ring, whose index is now `used_idx`: its mark goes.
    pub(crate) fn returned(&mut self, head: u16, used_idx: u16) {
        if let Some(l) = self.log.as_mut() {
            l.after_used(head, used_idx);
        }
    }
}

#[cfg(test)]
mod tests;

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
//! Why this file is over 600 lines: about 270 of its lines (from `#[cfg(test)]` on) are
//! unit tests of the table's ids, its credit order, its resends after a lost session and
//! its inflight marks; the table itself, one type, is under 420 lines.

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
mod tests {
    use super::*;
    use crate::blk::inflight::InflightRegion;
    use std::sync::Arc;
    use vhost::vhost_user::message::VhostUserInflight;

    fn mem() -> GuestMemoryRef {
        Arc::new(crate::guest::GuestMemory::new())
    }

    fn req(op: Op, len: u32, sector: u64) -> NewRequest {
        let (sector, len) = (devlend_fabric::Sector(sector), devlend_fabric::Bytes(len));
        let req = match op {
            Op::Read => BlockRequest::Read { sector, len },
            Op::Write => BlockRequest::Write { sector, len },
            _ => BlockRequest::Flush,
        };
        NewRequest {
            req,
            status_addr: GuestAddress(0),
        }
    }

    fn add(t: &mut RequestTable, head: u16, op: Op, len: u32) -> u64 {
        assert!(t.is_free(head));
        t.insert(head, req(op, len, u64::from(head)), &mut Vec::new(), mem())
    }

    #[test]
    fn ids_name_the_head_and_tell_live_from_stale() {
        let mut t = RequestTable::default();
        t.fit(8);
        let a = add(&mut t, 3, Op::Read, 4096);
        assert_eq!(a & 0xffff, 3);
        assert!(!t.is_free(3));
        assert!(t.lookup(a).is_some());
        assert!(
            t.lookup(a + (1 << 16)).is_none(),
            "same head, other sequence"
        );
        assert!(!t.is_free(100), "no slot past the queue size");
        t.remove(3);
        assert!(
            t.lookup(a).is_none(),
            "a response for a finished request is stale"
        );
        let b = add(&mut t, 3, Op::Write, 512);
        assert!(b > a, "ids grow: they sort in submission order");
        assert_eq!(t.inflight(), 1);
        assert_eq!(t.only_head(), Some(3));
    }

    #[test]
    fn the_credit_lets_requests_go_in_order_and_returns_as_they_complete() {
        let mut t = RequestTable::default();
        t.fit(16);
        t.new_session(Credit {
            requests: 2,
            bytes: 8192,
        });
        for (h, len) in [(5, 4096), (1, 4096), (9, 4096), (2, 0)] {
            add(&mut t, h, if len > 0 { Op::Write } else { Op::Flush }, len);
        }
        let now = Instant::now();
        assert_eq!(t.next_to_send(now), Some(5));
        assert_eq!(t.next_to_send(now), Some(1));
        assert_eq!(
            t.next_to_send(now),
            None,
            "two outstanding: the credit is spent"
        );
        assert!(t.has_waiting());
        t.remove(5);
        assert_eq!(t.next_to_send(now), Some(9));
        assert_eq!(t.next_to_send(now), None);
        t.remove(1);
        assert_eq!(t.next_to_send(now), Some(2), "a flush charges no bytes");
        assert_eq!(t.next_to_send(now), None);
        // A request larger than the byte credit goes when alone.
        t.remove(9);
        t.remove(2);
        add(&mut t, 4, Op::Read, 1 << 20);
        assert_eq!(t.next_to_send(now), Some(4));
        assert_eq!(t.reads(), 1);
    }

    #[test]
    fn a_lost_session_resends_everything_oldest_first_under_the_new_credit() {
        let mut t = RequestTable::default();
        t.fit(16);
        t.new_session(Credit {
            requests: 8,
            bytes: 1 << 20,
        });
        for h in [7, 3, 11, 0] {
            add(&mut t, h, Op::Write, 512);
        }
        let now = Instant::now();
        while t.next_to_send(now).is_some() {}
        t.remove(3);
        t.forget_session();
        assert_eq!(t.requeue_all(), 3);
        t.new_session(Credit {
            requests: 1,
            bytes: 1 << 20,
        });
        assert_eq!(t.next_to_send(now), Some(7));
        assert_eq!(t.next_to_send(now), None);
        t.remove(7);
        assert_eq!(t.next_to_send(now), Some(11));
        t.remove(11);
        assert_eq!(t.next_to_send(now), Some(0));
        assert_eq!(t.count_resends(0), vec![0]);
    }

    fn logged(t: &mut RequestTable, size: u16) -> (VhostUserInflight, std::fs::File) {
        let (region, msg, file) = InflightRegion::create(1, size).expect("memfd");
        t.set_log(region.queue(0));
        assert!(t.log_unread());
        assert!(t.recover_log(0, size).is_empty(), "a fresh buffer");
        assert!(!t.log_unread());
        (msg, file)
    }

    /// What a backend started on the same buffer would resubmit, with the guest's used
    /// index at `used`.
    fn after_restart(msg: &VhostUserInflight, file: &std::fs::File, used: u16) -> Vec<u16> {
        let region = InflightRegion::open(msg, file).expect("reopen");
        let mut t = RequestTable::default();
        t.set_log(region.queue(0));
        t.recover_log(used, msg.queue_size)
    }

    /// Pops `head` and, as the engine does for a chain that is a request, takes it in.
    fn pop(t: &mut RequestTable, head: u16) -> u64 {
        t.popped(head);
        add(t, head, Op::Write, 512)
    }

    /// Completes `head` as the engine does: slot freed, then the used ring (index now
    /// `used`), with the inflight buffer around it.
    fn complete(t: &mut RequestTable, head: u16, used: u16) {
        t.remove(head);
        t.returning(head);
        t.returned(head, used);
    }

    #[test]
    fn a_chain_is_marked_from_pop_to_used_ring_and_a_restart_resubmits_in_resend_order() {
        let mut t = RequestTable::default();
        t.fit(16);
        let (msg, file) = logged(&mut t, 16);
        for h in [7, 3, 11] {
            pop(&mut t, h);
        }
        // A chain completed at once (an invalid request) is marked and cleared too.
        t.popped(5);
        t.returning(5);
        t.returned(5, 1);
        pop(&mut t, 0);
        let now = Instant::now();
        while t.next_to_send(now).is_some() {}
        complete(&mut t, 3, 2);
        assert_eq!(after_restart(&msg, &file, 2), [7, 11, 0]);
        // The session is lost: the marks stay, and the table resends in their order.
        t.forget_session();
        assert_eq!(t.requeue_all(), 3);
        let resend: Vec<u16> = std::iter::from_fn(|| t.next_to_send(now)).collect();
        assert_eq!(resend, [7, 11, 0]);
        assert_eq!(after_restart(&msg, &file, 2), resend);
        complete(&mut t, 11, 3);
        assert_eq!(after_restart(&msg, &file, 3), [7, 0]);
    }

    #[test]
    fn a_restarted_table_takes_the_marked_chains_back_in_the_same_order() {
        let mut t = RequestTable::default();
        t.fit(8);
        let (msg, file) = logged(&mut t, 8);
        for h in [4, 1, 6] {
            pop(&mut t, h);
        }
        drop(t); // the backend is killed
        let region = InflightRegion::open(&msg, &file).expect("reopen");
        let mut t = RequestTable::default();
        t.fit(8);
        t.set_log(region.queue(0));
        let heads = t.recover_log(0, 8);
        assert_eq!(heads, [4, 1, 6]);
        // Resubmitted: popped again (from a private ring) in that order, after which
        // new chains follow.
        for &h in &heads {
            pop(&mut t, h);
        }
        pop(&mut t, 2);
        let ids: Vec<u64> = [4, 1, 6, 2]
            .iter()
            .map(|&h| t.pending(h).expect("in flight").id())
            .collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids follow pop order");
        assert_eq!(after_restart(&msg, &file, 0), [4, 1, 6, 2]);
    }

    #[test]
    fn a_mark_goes_only_once_the_used_ring_has_the_chain() {
        let mut t = RequestTable::default();
        t.fit(8);
        let (msg, file) = logged(&mut t, 8);
        pop(&mut t, 2);
        pop(&mut t, 5);
        // Freed in the table, not yet in the used ring: a restart still resubmits it.
        t.remove(2);
        assert_eq!(after_restart(&msg, &file, 0), [2, 5]);
        // In the used ring (guest used index 1), the buffer not yet updated: a restart
        // sees the used index moved and drops it.
        t.returning(2);
        assert_eq!(after_restart(&msg, &file, 1), [5]);
    }

    #[test]
    fn removing_a_free_or_missing_slot_is_ignored_and_counted() {
        let mut t = RequestTable::default();
        t.fit(16);
        t.new_session(Credit {
            requests: 8,
            bytes: 1 << 20,
        });
        add(&mut t, 2, Op::Read, 4096);
        add(&mut t, 5, Op::Write, 512);
        let now = Instant::now();
        while t.next_to_send(now).is_some() {}
        assert!(t.remove(2).is_some());
        assert!(t.remove(2).is_none(), "removed already");
        assert!(t.remove(3).is_none(), "never in flight");
        assert!(t.remove(200).is_none(), "no such slot");
        assert_eq!(t.stale_removes(), 3);
        assert_eq!(t.inflight(), 1);
        assert_eq!(t.reads(), 0);
        assert_eq!(t.only_head(), Some(5));
        // The credit came back once: seven more requests may go, not eight.
        for h in [0, 1, 2, 3, 4, 6, 7, 8, 9] {
            add(&mut t, h, Op::Flush, 0);
        }
        let sent = std::iter::from_fn(|| t.next_to_send(now)).count();
        assert_eq!(sent, 7);
        assert!(t.remove(5).is_some());
        assert!(t.remove(5).is_none());
        assert_eq!(t.inflight(), 9);
    }

    #[test]
    fn a_smaller_size_keeps_every_slot_in_flight() {
        let mut t = RequestTable::default();
        t.fit(64);
        let id = add(&mut t, 60, Op::Read, 4096);
        t.fit(2);
        assert!(
            t.lookup(id).is_some(),
            "the request in flight keeps its slot"
        );
        assert!(!t.is_free(60));
        assert_eq!(t.busy_heads(), [60]);
        assert!(t.remove(60).is_some());
        assert_eq!(t.inflight(), 0);
    }

    #[test]
    fn without_an_inflight_buffer_nothing_is_marked() {
        let mut t = RequestTable::default();
        t.fit(4);
        assert!(!t.has_log() && !t.log_unread());
        pop(&mut t, 1);
        complete(&mut t, 1, 1);
        assert!(t.recover_log(1, 4).is_empty());
    }
}

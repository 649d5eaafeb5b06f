//! The holder's limits on a mediated function's I/O commands (`docs/qos.md`): before an
//! I/O command is fetched from the guest's submission queue it draws its cost from the
//! holder's buckets ([`Group`]: the function's own limits and the lease's, and a
//! share of the store its PF's limits make); a command they cannot pay for yet stays
//! in the guest's queue, unfetched, and so do the entries behind it: the SQ head the
//! guest reads stops before it, as a busy controller's would. Nothing is failed and
//! nothing is held on the lender. The session's loop fetches again when the buckets
//! can pay ([`Throttle::due`]), or at the guest's next doorbell.
//!
//! Costs, as a virtio-blk request's (`Cost::block`): Read and Compare are reads of
//! (NLB + 1) logical blocks; Write a write of them; Write Zeroes and Dataset
//! Management a write of no data bytes; Flush counts on `iops_total` only. Admin
//! commands cost nothing; a command the mediator refuses on what it checks without
//! guest memory costs nothing either (it is completed at once with its status, never
//! reaching the controller).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use devlend_fabric::Op;

use super::cmd;
use super::spec::{io, le64, PAGE, SQE};
use crate::device_counters::DeviceCounters;
use crate::qos::{Cost, Group};

/// The holder's limits on one mediated session, and the commands they hold back.
pub(crate) struct Throttle {
    group: Arc<Group>,
    dev: Arc<DeviceCounters>,
    /// Per queue: the command its fetch stopped at for the limits.
    held: HashMap<u16, Held>,
}

/// A command left in its queue for the limits.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// Its entry in the queue.
    at: u16,
    /// When it was first held.
    since: Instant,
    /// When the buckets can pay for it.
    due: Instant,
}

impl Throttle {
    /// The limits of `group` on a session of device `dev`; `None` when it limits
    /// nothing (no limit, no store).
    pub(crate) fn new(group: &Arc<Group>, dev: &Arc<DeviceCounters>) -> Option<Throttle> {
        (!group.is_unlimited()).then(|| Throttle {
            group: Arc::clone(group),
            dev: Arc::clone(dev),
            held: HashMap::new(),
        })
    }

    /// Whether I/O command `sqe`, entry `at` of SQ `qid`, may be fetched now: its cost
    /// is taken if so. `lba_bytes` gives a namespace's logical block size, `mapped`
    /// whether the page at an IOVA is inside the guest's DMA maps.
    pub(super) fn admit(
        &mut self,
        qid: u16,
        at: u16,
        sqe: &[u8; SQE],
        lba_bytes: impl Fn(u32) -> Option<usize>,
        mapped: impl Fn(u64) -> bool,
        now: Instant,
    ) -> bool {
        let Some(cost) = cost(sqe, lba_bytes, mapped) else {
            return true;
        };
        match self.group.take(&cost, now) {
            Ok(()) => {
                if let Some(h) = self.held.remove(&qid) {
                    self.dev
                        .stats
                        .throttle_released(now.saturating_duration_since(h.since));
                }
                true
            }
            Err(wait) => {
                let due = now + wait;
                match self.held.get_mut(&qid) {
                    Some(h) if h.at == at => h.due = due,
                    other => {
                        if other.is_some() {
                            // Another entry was held (a queue made anew): given up.
                            self.dev.stats.throttle_dropped();
                        }
                        self.dev.stats.throttle_held();
                        self.held.insert(
                            qid,
                            Held {
                                at,
                                since: now,
                                due,
                            },
                        );
                    }
                }
                false
            }
        }
    }

    /// When the buckets can pay for the first of the commands they hold back; `None`
    /// if none is.
    pub(crate) fn due(&self) -> Option<Instant> {
        self.held.values().map(|h| h.due).min()
    }

    /// Whether SQ `qid`'s first entry is held and not yet due at `now`: its queue is
    /// not read again before then.
    pub(super) fn waits(&self, qid: u16, now: Instant) -> bool {
        self.held.get(&qid).is_some_and(|h| h.due > now)
    }

    /// SQ `qid` is gone (deleted, or the controller reset): its held command with it.
    pub(super) fn forget(&mut self, qid: u16) {
        if self.held.remove(&qid).is_some() {
            self.dev.stats.throttle_dropped();
        }
    }

    /// Every SQ is gone.
    pub(super) fn forget_all(&mut self) {
        for _ in self.held.drain() {
            self.dev.stats.throttle_dropped();
        }
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        // The session ends: what it held was never fetched, never run.
        self.forget_all();
    }
}

/// What I/O command `sqe` draws from the buckets; `None` for one the mediator will
/// refuse on what it can check without guest memory: its common fields, an unknown
/// opcode, a namespace whose format it has not seen, PRP 1 outside the DMA maps
/// (`mapped`). One refused later, for its PRP list's entries, has paid.
fn cost(
    sqe: &[u8; SQE],
    lba_bytes: impl Fn(u32) -> Option<usize>,
    mapped: impl Fn(u64) -> bool,
) -> Option<Cost> {
    cmd::check_common(sqe, true).ok()?;
    let t = cmd::io_transfer(sqe, lba_bytes).ok()?;
    if t.len > 0 && !mapped(le64(sqe, 24) & !(PAGE as u64 - 1)) {
        return None;
    }
    let op = match sqe[0] {
        io::READ | io::COMPARE => Op::Read,
        io::WRITE => Op::Write,
        io::WRITE_ZEROES => Op::WriteZeroes,
        io::DSM => Op::Discard,
        _ => Op::Flush,
    };
    let bytes = match op {
        Op::Read | Op::Write => t.len as u64,
        _ => 0,
    };
    Some(Cost::block(op, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use devlend_fabric::qos::{Lane, Qos};
    use std::time::Duration;

    fn sqe(opcode: u8, nsid: u32, nlb: u16) -> [u8; SQE] {
        let mut e = [0u8; SQE];
        e[0] = opcode;
        e[4..8].copy_from_slice(&nsid.to_le_bytes());
        e[48..50].copy_from_slice(&nlb.to_le_bytes());
        e
    }

    fn lba(ns: u32) -> Option<usize> {
        (ns == 1).then_some(4096)
    }

    /// The guest's DMA maps: its first 1 MiB.
    fn mapped(iova: u64) -> bool {
        iova < 1 << 20
    }

    fn throttle(q: Qos) -> (Throttle, Arc<DeviceCounters>) {
        let dev = Arc::new(DeviceCounters {
            name: "vf".into(),
            stats: Default::default(),
        });
        let g = Arc::new(Group::new(q, None, Instant::now()));
        (Throttle::new(&g, &dev).expect("limited"), dev)
    }

    #[test]
    fn commands_cost_what_their_blocks_move() {
        let c = |e| cost(&e, lba, mapped).expect("a cost");
        assert_eq!(c(sqe(io::READ, 1, 7)), Cost::block(Op::Read, 8 * 4096));
        assert_eq!(c(sqe(io::WRITE, 1, 0)), Cost::block(Op::Write, 4096));
        assert_eq!(
            c(sqe(io::WRITE_ZEROES, 1, 99)),
            Cost::block(Op::WriteZeroes, 0)
        );
        assert_eq!(c(sqe(io::FLUSH, 1, 0)), Cost::block(Op::Flush, 0));
        // Refused by the mediator anyway: no cost.
        assert_eq!(cost(&sqe(io::READ, 2, 0), lba, mapped), None);
        assert_eq!(cost(&sqe(0x7f, 1, 0), lba, mapped), None);
        let mut outside = sqe(io::READ, 1, 0);
        outside[24..32].copy_from_slice(&0x9000_0123u64.to_le_bytes());
        assert_eq!(cost(&outside, lba, mapped), None, "PRP 1 outside the maps");
        assert_eq!(
            cost(&outside, lba, |_| true),
            Some(Cost::block(Op::Read, 4096))
        );
    }

    #[test]
    fn no_limit_no_throttle() {
        let dev = Arc::new(DeviceCounters {
            name: "vf".into(),
            stats: Default::default(),
        });
        let g = Arc::new(Group::new(Qos::default(), None, Instant::now()));
        assert!(Throttle::new(&g, &dev).is_none());
    }

    #[test]
    fn holds_a_command_the_buckets_cannot_pay_for_and_counts_it_once() {
        // 10 reads a second, a burst of 2.
        let (mut t, dev) = throttle(Qos::default().with(Lane::IopsRead, 10, 2));
        let now = Instant::now();
        let read = sqe(io::READ, 1, 0);
        // A command goes while no bucket it draws from is in debt (it may put one in).
        for at in 0..2 {
            assert!(t.admit(1, at, &read, lba, mapped, now));
        }
        assert!(t.admit(1, 2, &read, lba, mapped, now));
        assert!(
            !t.admit(1, 3, &read, lba, mapped, now),
            "the burst is spent"
        );
        let due = t.due().expect("a wake-up");
        assert!(
            due > now && due <= now + Duration::from_millis(110),
            "{:?}",
            due - now
        );
        assert!(t.waits(1, now) && !t.waits(2, now) && !t.waits(1, due));
        // Asked again before it is due: still held, counted once.
        assert!(!t.admit(1, 3, &read, lba, mapped, now + Duration::from_millis(10)));
        assert_eq!(dev.stats.snapshot().throttled, 1);
        assert_eq!(dev.stats.snapshot().throttle_queued, 1);
        // Writes draw from no read lane: not held.
        assert!(t.admit(2, 0, &sqe(io::WRITE, 1, 0), lba, mapped, now));
        assert!(t.admit(1, 3, &read, lba, mapped, due + Duration::from_millis(1)));
        assert_eq!(t.due(), None);
        let s = dev.stats.snapshot();
        assert_eq!((s.throttled, s.throttle_queued), (1, 0));
        assert!(s.throttle_wait_us >= 90_000, "{}", s.throttle_wait_us);
    }

    #[test]
    fn a_held_command_of_a_queue_that_goes_is_given_up() {
        let (mut t, dev) = throttle(Qos::default().with(Lane::IopsTotal, 1, 1));
        let now = Instant::now();
        let flush = sqe(io::FLUSH, 1, 0);
        assert!(t.admit(3, 0, &flush, lba, mapped, now));
        assert!(t.admit(3, 1, &flush, lba, mapped, now));
        assert!(!t.admit(3, 2, &flush, lba, mapped, now));
        assert!(!t.admit(4, 7, &flush, lba, mapped, now));
        assert_eq!(dev.stats.snapshot().throttle_queued, 2);
        t.forget(3);
        assert_eq!(dev.stats.snapshot().throttle_queued, 1);
        drop(t);
        assert_eq!(dev.stats.snapshot().throttle_queued, 0, "the session's end");
    }
}

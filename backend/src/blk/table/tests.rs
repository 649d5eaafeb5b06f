//! The table's unit tests: its ids, its credit order, its resends after a lost
//! session and its inflight marks.

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

//! The engine driven through a fake lender (`blk/fake_link.rs`) on a mock virtqueue:
//! responses out of order, the lender's credit, a socket that takes part of what is
//! queued, a lost session with its requests resent in order on the next one, and what
//! fails with IOERR (the reconnect deadline, too many resends, a drain's deadline).
//! The tests over two paths are in `tests/paths.rs`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devlend_fabric::reconnect::{Policy, Reconnector};
use devlend_fabric::{BlockRequest, Credit, Status};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::blk::fake_link::{self, Lender, SharedLender};
use crate::blk::spec::{S_IOERR, S_OK, T_FLUSH, T_OUT};
use crate::guest::GuestMemory;

mod paths;

const QSIZE: u16 = 32;
/// Every write's data (4 KiB; shared: only what goes on the wire matters).
const DATA: u64 = 0x10_0000;
const DATA_LEN: u32 = 4096;
/// Request headers, 16 bytes apart, and status bytes, one per chain.
const HEADERS: u64 = 0x4_0000;
const STATUS: u64 = 0x6_0000;

/// What a chain asks for.
#[derive(Clone, Copy)]
enum Kind {
    Write,
    Flush,
}

/// A connected engine for queue 0 whose sessions go to `lender`, reconnecting without
/// backoff.
fn engine(lender: &SharedLender) -> QueueEngine {
    let limits = Arc::new(DeviceLimits::from_device_info(&fake_link::geometry()));
    let mut e = QueueEngine::new(
        0,
        LenderTarget::direct("fake:1", "disk", [1; 16]),
        limits,
        Arc::new(QueueStats::new(1)),
    );
    e.opener = Box::new(fake_link::opener(Arc::clone(lender)));
    e.retry = Reconnector::new(
        Policy::backoff(Duration::ZERO, Duration::ZERO).deadline(Duration::from_secs(30)),
    );
    e.connect().expect("the fake lender is up");
    e
}

fn lender(l: Lender) -> SharedLender {
    Arc::new(Mutex::new(l))
}

/// Guest memory with one chain per kind on the avail ring (chain `i` at head `i`).
fn guest(kinds: &[Kind]) -> (GuestMemoryRef, Queue) {
    let mem: GuestMemoryRef =
        Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), 2 << 20)]).expect("memory"));
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
    let mut descs = Vec::new();
    let next = VRING_DESC_F_NEXT as u16;
    for (i, kind) in kinds.iter().enumerate() {
        let i = i as u16;
        let hdr = HEADERS + u64::from(i) * 16;
        let mut h = [0u8; 16];
        let t = match kind {
            Kind::Write => T_OUT,
            Kind::Flush => T_FLUSH,
        };
        h[..4].copy_from_slice(&t.to_le_bytes());
        if let Kind::Write = kind {
            h[8..].copy_from_slice(&(u64::from(i) * 8).to_le_bytes());
        }
        mem.write_slice(&h, GuestAddress(hdr)).expect("header");
        mem.write_obj(0xffu8, GuestAddress(STATUS + u64::from(i)))
            .expect("status");
        let base = descs.len() as u16;
        descs.push(RawDescriptor::from(Descriptor::new(
            hdr,
            16,
            next,
            base + 1,
        )));
        if let Kind::Write = kind {
            descs.push(RawDescriptor::from(Descriptor::new(
                DATA,
                DATA_LEN,
                next,
                base + 2,
            )));
        }
        descs.push(RawDescriptor::from(Descriptor::new(
            STATUS + u64::from(i),
            1,
            VRING_DESC_F_WRITE as u16,
            0,
        )));
    }
    mock.add_desc_chains(&descs, 0).expect("chains");
    let queue: Queue = mock.create_queue().expect("queue");
    (mem, queue)
}

/// The head of chain `i` of `kinds` (chains are laid out one after the other).
fn head_of(kinds: &[Kind], i: usize) -> u16 {
    kinds[..i]
        .iter()
        .map(|k| match k {
            Kind::Write => 3,
            Kind::Flush => 2,
        })
        .sum()
}

fn status(mem: &GuestMemory, i: usize) -> u8 {
    mem.read_obj(GuestAddress(STATUS + i as u64))
        .expect("status")
}

/// The heads in the used ring, in the order they were returned.
fn used_heads(mem: &GuestMemory, queue: &Queue) -> Vec<u16> {
    let used = queue.used_ring();
    (0..queue.next_used())
        .map(|k| {
            let id: u32 = mem
                .read_obj(GuestAddress(used + 4 + 8 * u64::from(k)))
                .expect("used element");
            id as u16
        })
        .collect()
}

fn lock(l: &SharedLender) -> std::sync::MutexGuard<'_, Lender> {
    l.lock().expect("lender")
}

#[test]
fn responses_out_of_order_complete_their_own_requests() {
    let kinds = [Kind::Write, Kind::Flush, Kind::Write, Kind::Write];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let l = lender(Lender::default());
    let mut e = engine(&l);
    let (mem, mut queue) = guest(&kinds);
    assert!(!e.process_avail(&mut queue, &mem).expect("avail"));
    assert_eq!(lock(&l).heads_on(1), heads, "sent in submission order");
    assert_eq!(e.inflight(), 4);
    {
        let mut l = lock(&l);
        l.answer(heads[3], Status::Ok);
        l.answer(heads[1], Status::Ok);
        l.answer(heads[0], Status::IoErr);
    }
    assert!(e.process_responses(&mut queue, &mem).expect("responses"));
    assert_eq!(used_heads(&mem, &queue), [heads[3], heads[1], heads[0]]);
    assert_eq!(e.inflight(), 1);
    assert_eq!(
        [status(&mem, 0), status(&mem, 1), status(&mem, 3)],
        [S_IOERR, S_OK, S_OK]
    );
    assert_eq!(status(&mem, 2), 0xff, "not answered yet");
    lock(&l).answer(heads[2], Status::Ok);
    assert!(e.process_responses(&mut queue, &mem).expect("responses"));
    assert_eq!(status(&mem, 2), S_OK);
    assert_eq!(e.inflight(), 0);
    assert_eq!(e.stats.inflight.load(Ordering::Relaxed), 0);
}

#[test]
fn no_more_goes_out_than_the_lender_granted() {
    let kinds = [Kind::Write; 6];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    // Two requests at once, then two writes' worth of bytes at once.
    for credit in [
        Credit {
            requests: 2,
            bytes: 1 << 20,
        },
        Credit {
            requests: 64,
            bytes: 2 * DATA_LEN,
        },
    ] {
        let l = lender(Lender {
            credit: Some(credit),
            ..Lender::default()
        });
        let mut e = engine(&l);
        assert_eq!(e.credit(), credit);
        let (mem, mut queue) = guest(&kinds);
        e.process_avail(&mut queue, &mem).expect("avail");
        assert_eq!(lock(&l).heads_on(1), heads[..2], "the credit is spent");
        // The lender answers the oldest each time; the credit it returns lets the next
        // one go.
        for &head in &heads {
            let oldest = lock(&l).unanswered[0].head();
            assert_eq!(oldest, head);
            lock(&l).answer(oldest, Status::Ok);
            e.process_responses(&mut queue, &mem).expect("responses");
        }
        let l = lock(&l);
        assert_eq!(l.heads_on(1), heads, "each sent once, in order");
        assert_eq!(l.max_unanswered, 2);
        assert_eq!(e.inflight(), 0);
        assert!((0..kinds.len()).all(|i| status(&mem, i) == S_OK));
    }
}

#[test]
fn a_socket_that_takes_part_of_the_queue_gets_the_rest_when_writable() {
    let kinds = [Kind::Write, Kind::Flush, Kind::Write, Kind::Write];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let l = lender(Lender {
        per_send: Some(1),
        ..Lender::default()
    });
    let mut e = engine(&l);
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    assert_eq!(lock(&l).heads_on(1), heads[..1]);
    assert!(e.wants_write(), "the worker is to watch for writability");
    // Writable: each call writes what the socket takes.
    for n in 2..=kinds.len() {
        e.process_responses(&mut queue, &mem).expect("writable");
        assert_eq!(lock(&l).heads_on(1), heads[..n]);
    }
    assert!(!e.wants_write());
    for &h in &heads {
        lock(&l).answer(h, Status::Ok);
    }
    e.process_responses(&mut queue, &mem).expect("responses");
    assert_eq!(used_heads(&mem, &queue), heads);
    assert_eq!(e.inflight(), 0);
}

#[test]
fn a_lost_session_resends_the_unanswered_in_order_and_keeps_the_answered() {
    let kinds = [Kind::Write; 5];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let l = lender(Lender::default());
    let mut e = engine(&l);
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    {
        let mut l = lock(&l);
        l.answer(heads[3], Status::Ok);
        l.answer(heads[1], Status::Ok);
    }
    e.process_responses(&mut queue, &mem).expect("responses");
    assert_eq!(used_heads(&mem, &queue), [heads[3], heads[1]]);
    let ids: Vec<u64> = lock(&l).received.iter().map(|r| r.id).collect();
    // The session is cut, and the lender is away for a while.
    {
        let mut l = lock(&l);
        l.cut = true;
        l.down = true;
    }
    assert!(!e.process_responses(&mut queue, &mem).expect("lost"));
    assert_eq!(e.fabric_fd().0, None, "no session");
    assert_eq!(e.inflight(), 3, "the unanswered wait");
    assert_eq!(status(&mem, 0), 0xff);
    // Back: the reconnect timer's next attempt opens a session and resends.
    lock(&l).down = false;
    e.on_timer(&mut queue, &mem).expect("timer");
    {
        let l = lock(&l);
        assert_eq!(l.sessions, 2);
        let resent = [heads[0], heads[2], heads[4]];
        assert_eq!(
            l.heads_on(2),
            resent,
            "oldest first; the answered are not resent"
        );
        let again: Vec<u64> = l
            .received
            .iter()
            .filter(|r| r.session == 2)
            .map(|r| r.id)
            .collect();
        assert_eq!(again, [ids[0], ids[2], ids[4]], "resent with their ids");
        assert!(l
            .received
            .iter()
            .all(|r| matches!(r.request, BlockRequest::Write { .. })));
    }
    assert_eq!(e.stats.resent.load(Ordering::Relaxed), 3);
    assert_eq!(e.stats.reconnects.load(Ordering::Relaxed), 1);
    for h in [heads[4], heads[0], heads[2]] {
        lock(&l).answer(h, Status::Ok);
    }
    e.process_responses(&mut queue, &mem).expect("responses");
    assert_eq!(
        used_heads(&mem, &queue),
        [heads[3], heads[1], heads[4], heads[0], heads[2]],
        "each returned once"
    );
    assert!((0..kinds.len()).all(|i| status(&mem, i) == S_OK));
    assert_eq!(e.inflight(), 0);
}

#[test]
fn requests_fail_with_ioerr_when_the_session_is_not_back_by_the_deadline() {
    let kinds = [Kind::Write, Kind::Flush];
    let l = lender(Lender::default());
    let mut e = engine(&l);
    e.retry.set_deadline(Some(Duration::ZERO));
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    {
        let mut l = lock(&l);
        l.cut = true;
        l.down = true;
    }
    assert!(e.process_responses(&mut queue, &mem).expect("lost"));
    assert_eq!(e.inflight(), 0);
    assert_eq!([status(&mem, 0), status(&mem, 1)], [S_IOERR, S_IOERR]);
    assert_eq!(lock(&l).sessions, 1);
}

#[test]
fn a_request_that_ends_every_session_fails_after_its_last_resend() {
    let kinds = [Kind::Write, Kind::Write];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let l = lender(Lender::default());
    let mut e = engine(&l);
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    lock(&l).answer(heads[1], Status::Ok);
    e.process_responses(&mut queue, &mem).expect("responses");
    // Each session is cut while the first request is on it: it is resent every time,
    // up to MAX_RESENDS times; at the next loss it fails.
    for n in 1..=MAX_RESENDS {
        lock(&l).cut = true;
        e.process_responses(&mut queue, &mem).expect("lost");
        assert_eq!(e.inflight(), 1, "resend {n}");
        assert_eq!(lock(&l).heads_on(n + 1), [heads[0]]);
    }
    lock(&l).cut = true;
    assert!(e.process_responses(&mut queue, &mem).expect("lost"));
    assert_eq!(e.inflight(), 0);
    assert_eq!([status(&mem, 0), status(&mem, 1)], [S_IOERR, S_OK]);
    assert!(
        lock(&l).heads_on(MAX_RESENDS + 2).is_empty(),
        "not sent again"
    );
}

#[test]
fn a_drain_fails_what_the_lender_does_not_answer_by_its_deadline() {
    let kinds = [Kind::Write, Kind::Flush, Kind::Write];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let l = lender(Lender::default());
    let mut e = engine(&l);
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    lock(&l).answer(heads[1], Status::Ok);
    assert!(e
        .drain(&mut queue, &mem, Duration::from_millis(50))
        .expect("drain"));
    assert_eq!(e.inflight(), 0);
    assert_eq!(
        [status(&mem, 0), status(&mem, 1), status(&mem, 2)],
        [S_IOERR, S_OK, S_IOERR]
    );
    assert_eq!(e.fabric_fd().0, None, "the session cannot go on after them");
}

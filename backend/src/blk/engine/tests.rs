//! The engine driven through a fake lender (`blk/fake_link.rs`) on a mock virtqueue:
//! responses out of order, the lender's credit, a socket that takes part of what is
//! queued, a lost session with its requests resent in order on the next one, and what
//! fails with IOERR (the reconnect deadline, too many resends, a drain's deadline).

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

#[test]
fn a_lost_session_moves_to_the_next_path_and_comes_back_when_its_own_is_up() {
    let kinds = [Kind::Write; 3];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let l = lender(Lender::default());
    let (mut e, stats, opened) = two_path_engine(&l);
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    let paths = |s: &QueueStats| {
        let p = s.snapshot().paths;
        p.iter().map(|p| (p.up, p.sessions)).collect::<Vec<_>>()
    };
    assert_eq!(paths(&stats), [(true, 1), (true, 0)]);
    // Path 1 drops the session: the queue opens the next one on path 2 and resends.
    lock(&l).cut = true;
    e.process_responses(&mut queue, &mem).expect("lost");
    e.on_timer(&mut queue, &mem).expect("timer");
    assert_eq!(*opened.lock().unwrap(), ["fake:1", "fake:2"]);
    assert_eq!(
        lock(&l).heads_on(2),
        heads,
        "every request resent on path 2"
    );
    assert_eq!(paths(&stats), [(false, 0), (true, 1)]);
    let snap = stats.snapshot();
    assert_eq!((snap.failovers, snap.paths[0].failures), (1, 1));
    assert!(snap.last_failover_us > 0);
    // Path 1 answers again (the probe's finding) and the queue falls idle past
    // FAILBACK_AFTER: it moves back to its own path.
    stats.paths[0].reachable();
    e.away_since = Some(Instant::now() - FAILBACK_AFTER);
    for h in &heads {
        lock(&l).answer(*h, Status::Ok);
    }
    // The first try finds path 1 refusing after all: the queue keeps its session.
    lock(&l).down = true;
    e.process_responses(&mut queue, &mem).expect("responses");
    assert_eq!(e.inflight(), 0);
    assert!(e.fabric_fd().0.is_some(), "still on path 2");
    assert_eq!(paths(&stats), [(false, 0), (true, 1)]);
    // The next, a while later, moves it.
    lock(&l).down = false;
    stats.paths[0].reachable();
    e.away_since = Some(Instant::now() - FAILBACK_AFTER);
    e.process_responses(&mut queue, &mem).expect("idle");
    assert_eq!(
        *opened.lock().unwrap(),
        ["fake:1", "fake:2", "fake:1", "fake:1"]
    );
    assert_eq!(paths(&stats), [(true, 1), (true, 0)]);
    assert_eq!(
        stats.snapshot().failovers,
        1,
        "a failback is not a failover"
    );
}

#[test]
fn an_idle_queue_leaves_a_path_another_queue_found_down_before_sending() {
    let l = lender(Lender::default());
    let (mut e, stats, opened) = two_path_engine(&l);
    // Another queue's session on path 1 was lost.
    stats.paths[0].failed();
    let kinds = [Kind::Write];
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    assert_eq!(*opened.lock().unwrap(), ["fake:1", "fake:2"]);
    assert_eq!(
        lock(&l).heads_on(2),
        [head_of(&kinds, 0)],
        "sent on path 2 only"
    );
    assert!(lock(&l).heads_on(1).is_empty());
    assert_eq!(stats.snapshot().failovers, 1);
}

/// A connected engine for queue 0 of a lender with two paths (`fake:1`, `fake:2`),
/// its sessions going to `lender`; with its path counters and the address of every
/// session it opened, in order.
fn two_path_engine(
    lender: &SharedLender,
) -> (QueueEngine, Arc<QueueStats>, Arc<Mutex<Vec<String>>>) {
    two_path_engine_refusing(lender, None)
}

/// As [`two_path_engine`]; a session opened on `refusing` is refused for good (the
/// lender there denies this borrower).
fn two_path_engine_refusing(
    lender: &SharedLender,
    refusing: Option<&'static str>,
) -> (QueueEngine, Arc<QueueStats>, Arc<Mutex<Vec<String>>>) {
    let stats = Arc::new(QueueStats::new(1).with_paths(["fake:1".into(), "fake:2".into()]));
    let (mut e, opened) = path_engine(0, lender, &stats, move |addr| {
        (refusing == Some(addr)).then(|| ConnectError::Refused {
            addr: addr.into(),
            device: "disk".into(),
            status: devlend_fabric::HelloStatus::Denied,
            message: "not this borrower".into(),
        })
    });
    e.connect().expect("the fake lender is up");
    (e, stats, opened)
}

/// A disconnected engine for queue `index` of a lender with two paths (`fake:1`,
/// `fake:2`) counted in `stats`, its sessions going to `lender` unless `rule` fails
/// one (given the path's address); with the address of every session it opened, in
/// order.
fn path_engine(
    index: u16,
    lender: &SharedLender,
    stats: &Arc<QueueStats>,
    rule: impl Fn(&str) -> Option<ConnectError> + Send + 'static,
) -> (QueueEngine, Arc<Mutex<Vec<String>>>) {
    let limits = Arc::new(DeviceLimits::from_device_info(&fake_link::geometry()));
    let mut target = LenderTarget::direct("fake:1", "disk", [1; 16]);
    target.alt_addrs = vec!["fake:2".into()];
    let mut e = QueueEngine::new(index, target, limits, Arc::clone(stats));
    let opened = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut inner = fake_link::opener(Arc::clone(lender));
    let log = Arc::clone(&opened);
    e.opener = Box::new(move |t, q| {
        log.lock().unwrap().push(t.addr.clone());
        if let Some(e) = rule(&t.addr) {
            return Err(e);
        }
        inner(t, q)
    });
    e.retry = Reconnector::new(
        Policy::backoff(Duration::ZERO, Duration::ZERO).deadline(Duration::from_secs(30)),
    );
    (e, opened)
}

/// What a silently cut path answers a connect with, after `wait`.
fn cut_path(addr: &str, wait: Duration) -> ConnectError {
    std::thread::sleep(wait);
    ConnectError::Connect {
        addr: addr.into(),
        source: std::io::Error::from(std::io::ErrorKind::TimedOut),
    }
}

#[test]
fn a_queue_whose_path_is_cut_opens_on_the_next_and_later_queues_skip_it() {
    let l = lender(Lender::default());
    let stats = Arc::new(QueueStats::new(3).with_paths(["fake:1".into(), "fake:2".into()]));
    let rule = |a: &str| (a == "fake:1").then(|| cut_path(a, Duration::ZERO));
    // Queue 0 belongs on path 1, which is cut: its first open takes path 2 at once.
    let (mut q0, opened0) = path_engine(0, &l, &stats, rule);
    q0.connect().expect("path 2 takes it");
    assert_eq!(*opened0.lock().unwrap(), ["fake:1", "fake:2"]);
    // Queue 2 belongs on path 1 too: it does not try the path found down.
    let (mut q2, opened2) = path_engine(2, &l, &stats, rule);
    q2.connect().expect("path 2 takes it");
    assert_eq!(*opened2.lock().unwrap(), ["fake:2"]);
    let snap = stats.snapshot();
    assert_eq!(
        snap.paths
            .iter()
            .map(|p| (p.up, p.sessions))
            .collect::<Vec<_>>(),
        [(false, 0), (true, 2)]
    );
}

#[test]
fn the_deadline_counts_the_time_a_reconnect_blocked() {
    let kinds = [Kind::Write, Kind::Flush];
    let l = lender(Lender::default());
    let mut e = engine(&l);
    e.retry.set_deadline(Some(Duration::from_millis(100)));
    // Every connect hangs 300 ms before it fails, as on a path cut silently.
    let mut inner = fake_link::opener(Arc::clone(&l));
    let gate = Arc::clone(&l);
    e.opener = Box::new(move |t, q| {
        if lock(&gate).down {
            return Err(cut_path(&t.addr, Duration::from_millis(300)));
        }
        inner(t, q)
    });
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    {
        let mut l = lock(&l);
        l.cut = true;
        l.down = true;
    }
    // The one attempt ends past the deadline: the requests fail then, not one
    // attempt later.
    assert!(e.process_responses(&mut queue, &mem).expect("lost"));
    assert_eq!(e.inflight(), 0);
    assert_eq!([status(&mem, 0), status(&mem, 1)], [S_IOERR, S_IOERR]);
}

#[test]
fn a_path_back_while_a_connect_hangs_on_another_takes_the_requests_before_the_deadline() {
    let kinds = [Kind::Write; 2];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let l = lender(Lender::default());
    let stats = Arc::new(QueueStats::new(1).with_paths(["fake:1".into(), "fake:2".into()]));
    // Path 1 is cut for good; path 2 is cut until the probe finds it back, which it
    // does while a connect on path 1 hangs.
    let cut2 = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rule = {
        let cut2 = Arc::clone(&cut2);
        let stats = Arc::clone(&stats);
        move |a: &str| match a {
            "fake:1" if cut2.load(Ordering::Relaxed) => {
                let e = cut_path(a, Duration::from_millis(300));
                cut2.store(false, Ordering::Relaxed);
                stats.paths[1].reachable();
                Some(e)
            }
            "fake:2" if cut2.load(Ordering::Relaxed) => Some(cut_path(a, Duration::ZERO)),
            _ => None,
        }
    };
    let (mut e, opened) = path_engine(0, &l, &stats, rule);
    e.connect().expect("path 1 is up");
    e.retry.set_deadline(Some(Duration::from_millis(100)));
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    // Both paths drop: path 2 is found down first (another queue's session there).
    cut2.store(true, Ordering::Relaxed);
    stats.paths[1].failed();
    lock(&l).cut = true;
    e.process_responses(&mut queue, &mem).expect("lost");
    // The queue's next path is 2, down: it tries path 1 (every path down), which hangs
    // past the deadline while path 2 comes back; path 2 takes the requests.
    e.on_timer(&mut queue, &mem).expect("timer");
    assert_eq!(e.inflight(), 2, "nothing failed");
    assert_eq!(stats.snapshot().errors_fabric, 0);
    assert_eq!(lock(&l).heads_on(2), heads, "resent on path 2");
    assert_eq!(
        opened.lock().unwrap().last().map(String::as_str),
        Some("fake:2")
    );
}

#[test]
fn one_path_refusing_for_good_does_not_fail_the_requests_while_another_takes_them() {
    let kinds = [Kind::Write; 2];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let l = lender(Lender::default());
    // Path 2 leads to a lender that denies this borrower (a wrong address).
    let (mut e, stats, opened) = two_path_engine_refusing(&l, Some("fake:2"));
    let (mem, mut queue) = guest(&kinds);
    e.process_avail(&mut queue, &mem).expect("avail");
    lock(&l).cut = true;
    e.process_responses(&mut queue, &mem).expect("lost");
    e.on_timer(&mut queue, &mem).expect("path 2 refuses");
    assert_eq!(e.inflight(), 2, "nothing failed: {:?}", status(&mem, 0));
    e.on_timer(&mut queue, &mem).expect("path 1 takes them");
    assert_eq!(*opened.lock().unwrap(), ["fake:1", "fake:2", "fake:1"]);
    assert_eq!(
        lock(&l).heads_on(2),
        heads,
        "resent on path 1's new session"
    );
    assert_eq!(stats.snapshot().errors_fabric, 0);
    // The path that refused is marked down, and the probe, which only connects, does
    // not mark it up again for a while: queues do not try it at every failback.
    assert!(!stats.snapshot().paths[1].up);
    stats.paths[1].reachable();
    assert!(!stats.snapshot().paths[1].up, "rests after a refusal");
    assert_eq!(stats.snapshot().paths[1].failures, 1);
}

//! The engine over a lender with two paths: failover to the next path, failback to its
//! own (held while a busy queue's requests in flight complete), paths marked down and
//! refusing, and the reconnect deadline across them.

use super::*;

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

/// Lets the driver have made only the first `n` chains available (the avail ring's
/// index), as if it submitted the rest later.
fn avail_up_to(mem: &GuestMemory, queue: &Queue, n: u16) {
    mem.write_obj(n, GuestAddress(queue.avail_ring() + 2))
        .expect("avail index");
}

/// A queue away from its own path and due back, holding: the first chain of `kinds` in
/// flight on path 2 (session 2), path 1 reachable again, the failback found due at a
/// wake-up without completions, then the driver made every chain available: the rest
/// are held on the avail ring.
fn holding(
    kinds: &[Kind],
) -> (
    SharedLender,
    QueueEngine,
    Arc<QueueStats>,
    (GuestMemoryRef, Queue),
) {
    let l = lender(Lender::default());
    let (mut e, stats, _) = two_path_engine(&l);
    let (mem, mut queue) = guest(kinds);
    avail_up_to(&mem, &queue, 1);
    e.process_avail(&mut queue, &mem).expect("avail");
    lock(&l).cut = true;
    e.process_responses(&mut queue, &mem).expect("lost");
    e.on_timer(&mut queue, &mem).expect("timer");
    let first = head_of(kinds, 0);
    assert_eq!(lock(&l).heads_on(2), [first], "resent on path 2");
    stats.paths[0].reachable();
    e.away_since = Some(Instant::now() - FAILBACK_AFTER);
    e.process_responses(&mut queue, &mem).expect("responses");
    avail_up_to(&mem, &queue, kinds.len() as u16);
    e.process_avail(&mut queue, &mem).expect("avail");
    assert_eq!(lock(&l).heads_on(2), [first], "nothing new on path 2");
    assert_eq!(e.inflight(), 1);
    (l, e, stats, (mem, queue))
}

#[test]
fn a_busy_queue_holds_new_requests_while_its_own_complete_then_moves_back() {
    let kinds = [Kind::Write; 3];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let (l, mut e, stats, (mem, mut queue)) = holding(&kinds);
    // The request in flight completes: the queue moves back to path 1 (session 3),
    // and the held requests go there.
    lock(&l).answer(heads[0], Status::Ok);
    assert!(e.process_responses(&mut queue, &mem).expect("responses"));
    assert_eq!(status(&mem, 0), S_OK);
    assert_eq!(lock(&l).sessions, 3);
    assert_eq!(
        lock(&l).heads_on(3),
        heads[1..],
        "held requests sent on path 1"
    );
    let p = stats.snapshot().paths;
    assert_eq!(
        p.iter().map(|p| (p.up, p.sessions)).collect::<Vec<_>>(),
        [(true, 1), (true, 0)]
    );
    assert_eq!(
        stats.snapshot().failovers,
        1,
        "a failback is not a failover"
    );
}

#[test]
fn a_hold_that_outlasts_its_bound_ends_and_the_queue_stays_where_it_is() {
    let kinds = [Kind::Write; 2];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let (l, mut e, _stats, (mem, mut queue)) = holding(&kinds);
    // The request in flight takes longer than the hold: the next wake-up ends it and
    // sends the held request on the path the queue is on.
    std::thread::sleep(FAILBACK_HOLD);
    e.process_responses(&mut queue, &mem).expect("responses");
    assert_eq!(lock(&l).heads_on(2), heads, "sent on path 2 after the hold");
    assert_eq!(lock(&l).sessions, 2, "no move while busy");
    // The next failback is FAILBACK_AFTER away: no hold meanwhile.
    lock(&l).answer(heads[0], Status::Ok);
    e.process_responses(&mut queue, &mem).expect("responses");
    assert_eq!(lock(&l).sessions, 2);
}

#[test]
fn a_hold_ends_when_the_session_it_waits_on_is_lost() {
    let kinds = [Kind::Write; 2];
    let heads: Vec<u16> = (0..kinds.len()).map(|i| head_of(&kinds, i)).collect();
    let (l, mut e, _stats, (mem, mut queue)) = holding(&kinds);
    // Path 2 drops the session: the queue reopens on its own path with the request in
    // flight, and the held one follows it without another kick.
    lock(&l).cut = true;
    e.process_responses(&mut queue, &mem).expect("lost");
    e.on_timer(&mut queue, &mem).expect("timer");
    assert_eq!(lock(&l).sessions, 3);
    assert_eq!(lock(&l).heads_on(3), heads, "resent, then the held one");
}

//! Rings a hostile or buggy driver lays out or drives: a ring rebuilt at the same
//! address, an avail index jump, malformed descriptor chains, a call fd that would
//! block, SET_VRING_NUM on a started ring.

use super::*;

/// Part of vhost-user-backend's handler patch (next_used from SET_VRING_BASE): SeaBIOS
/// hands the ring over to Linux, which rebuilds it at the same address with a fresh
/// avail ring while a stale used.idx is still in memory. The first completion must land
/// in used slot 0 with used.idx 1.
#[test]
fn a_ring_rebuilt_at_the_same_address_completes_in_slot_0() {
    const STALE: u16 = 57;
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let log = rig.log_len();
    let mut q = Queue::new(0);
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    assert_eq!(q.ring.used_elem(&ram, 0).0, 0);
    assert_eq!(fe.get_vring_base(0).unwrap(), 1);

    // The new driver: same rings, a zeroed avail ring, a stale used index, garbage in
    // used slot 0 (so that a write there shows).
    q.ring.clear_avail(&ram);
    q.ring.set_used_idx(&ram, STALE);
    q.ring.set_used_elem(&ram, 0, 0xdead, 0xdead);
    q.next = 0;
    assert_eq!(fe.set_vring_num(0, u32::from(QUEUE_SIZE)).unwrap(), 0);
    assert_eq!(fe.set_vring_base(0, 0).unwrap(), 0);
    q.set_addr(&mut fe, &ram);
    let head = q.offer_read(&ram);
    q.set_fds(&mut fe);
    q.kick.write(1).unwrap();
    let now = q
        .ring
        .wait_used_change(&ram, STALE, Duration::from_secs(5))
        .expect("the READ on the rebuilt ring did not complete");
    assert_eq!(
        (now, q.ring.used_elem(&ram, 0).0),
        (1, u32::from(head)),
        "the completion went to slot {} (used.idx {now})",
        now.wrapping_sub(1) % QUEUE_SIZE,
    );
    assert_eq!(q.status_of(&ram, head), S_OK);
    q.read_ok(&ram);
    rig.check_cost(log, "ring rebuilt");
}

/// A driver that moves avail.idx more than the queue size past the last index the
/// device saw: the borrower stops that queue once, logs one warning, signals the
/// ring's error eventfd, and its worker does not spin; the other queue and the other
/// attachment keep working.
#[test]
fn an_avail_index_jump_stops_only_that_queue() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let mut q0 = Queue::new(0);
    let mut q1 = Queue::new(1);
    q0.start(&mut fe, &ram);
    q1.start(&mut fe, &ram);
    q0.read_ok(&ram);
    q1.read_ok(&ram);
    let log = rig.log_len();

    let idx = q0.ring.avail_idx(&ram);
    q0.ring.set_avail_idx(&ram, idx.wrapping_add(40000));
    q0.kick.write(1).unwrap();
    let mut pfd = libc::pollfd {
        fd: q0.err.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, 2000) };
    assert_eq!(n, 1, "the error eventfd was not signalled within 2 s");
    assert_eq!(q0.err.read().unwrap(), 1);
    // More kicks on the stopped queue change nothing.
    for _ in 0..20 {
        q0.kick.write(1).unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        q0.ring.used_idx(&ram),
        1,
        "the stopped queue completed something"
    );
    rig.check_cost(log, "avail index jump");
    alive(&mut fe);
    q1.read_ok(&ram);
}

/// How a hostile driver corrupts the chain it offers next.
#[derive(Clone, Copy, Debug)]
enum BadChain {
    /// The data descriptor's `next` is itself.
    Loop,
    /// The data descriptor's `next` is past the descriptor table.
    NextPastTable,
    /// The data buffer is far outside guest memory.
    BufferOutsideMemory,
    /// The avail ring names a head past the queue size.
    HeadPastQueue,
}

/// A malformed descriptor chain (one that virtio-queue would walk truncated) is a
/// corrupt queue, as on a lent NIC: the queue stops once with its error eventfd
/// signalled, completes nothing more, costs no CPU and a bounded log, and the other
/// queue goes on; GET_VRING_BASE names the bad chain as the next (not taken), and a
/// re-initialized queue serves again. Before, a block queue answered a truncated chain
/// as a request (or not at all) and kept going.
#[test]
fn a_malformed_chain_stops_only_that_queue() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let mut q0 = Queue::new(0);
    let mut q1 = Queue::new(1);
    q0.start(&mut fe, &ram);
    q1.start(&mut fe, &ram);
    for bad in [
        BadChain::Loop,
        BadChain::NextPastTable,
        BadChain::BufferOutsideMemory,
        BadChain::HeadPastQueue,
    ] {
        q0.read_ok(&ram);
        q1.read_ok(&ram);
        let log = rig.log_len();
        let taken = q0.ring.avail_idx(&ram);
        let used = q0.ring.used_idx(&ram);
        // Corrupted before it is offered: the worker may take an offered chain at once.
        let head = q0.lay_out_read(&ram);
        let base = (1 + u64::from(q0.index)) * MIB + u64::from(head / 3) * 0x2000;
        let r = q0.ring;
        match bad {
            BadChain::Loop => r.set_desc(
                &ram,
                head + 1,
                base + 0x1000,
                4096,
                DESC_NEXT | DESC_WRITE,
                head + 1,
            ),
            BadChain::NextPastTable => r.set_desc(
                &ram,
                head + 1,
                base + 0x1000,
                4096,
                DESC_NEXT | DESC_WRITE,
                QUEUE_SIZE + 7,
            ),
            BadChain::BufferOutsideMemory => r.set_desc(
                &ram,
                head + 1,
                1 << 40,
                4096,
                DESC_NEXT | DESC_WRITE,
                head + 2,
            ),
            BadChain::HeadPastQueue => {}
        }
        r.offer(
            &ram,
            match bad {
                BadChain::HeadPastQueue => QUEUE_SIZE + 1,
                _ => head,
            },
        );
        q0.kick.write(1).unwrap();
        let mut pfd = libc::pollfd {
            fd: q0.err.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 2000) };
        assert_eq!(
            n, 1,
            "{bad:?}: the error eventfd was not signalled within 2 s"
        );
        assert_eq!(q0.err.read().unwrap(), 1, "{bad:?}");
        for _ in 0..20 {
            q0.kick.write(1).unwrap();
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            q0.ring.used_idx(&ram),
            used,
            "{bad:?}: the stopped queue completed something"
        );
        rig.check_cost(log, &format!("{bad:?}"));
        q1.read_ok(&ram);
        alive(&mut fe);
        // Not taken: the next chain is the bad one. Then the driver rebuilds the ring.
        assert_eq!(fe.get_vring_base(0).unwrap(), u32::from(taken), "{bad:?}");
        q0.ring.clear_avail(&ram);
        q0.ring.set_used_idx(&ram, 0);
        q0.next = 0;
        q0.start(&mut fe, &ram);
    }
    q0.read_ok(&ram);
}

/// A call fd the agent cannot write to without blocking (a blocking pipe filled to
/// capacity, a blocking eventfd at its maximum count) wedged the queue worker in
/// write(): GET_VRING_BASE was never answered and detach waited on the VMM. Signalling
/// fds are now non-blocking on receipt and a signal that cannot be written is dropped:
/// the READs complete, GET_VRING_BASE is answered within the drain deadline, and the
/// other attachment serves.
#[test]
fn a_call_fd_that_would_block_does_not_wedge_the_queue() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let log = rig.log_len();
    // Queue 0: a blocking pipe, full.
    let mut pipe = [0; 2];
    // SAFETY: pipe2 into a 2-int array.
    let made = unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(made, 0);
    // SAFETY: fresh fds that nothing else owns.
    let (_rd, wr) = unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(pipe[0]),
            std::os::fd::OwnedFd::from_raw_fd(pipe[1]),
        )
    };
    let w = wr.as_raw_fd();
    // SAFETY: fcntl with integer arguments and writes from a live buffer, on our fds.
    unsafe {
        libc::fcntl(w, libc::F_SETFL, libc::O_NONBLOCK);
        let chunk = [0u8; 4096];
        while libc::write(w, chunk.as_ptr().cast(), chunk.len()) > 0 {}
        // Writes of up to PIPE_BUF bytes are all or nothing: fill the last bytes one by one.
        while libc::write(w, chunk.as_ptr().cast(), 1) > 0 {}
        libc::fcntl(w, libc::F_SETFL, 0);
    }
    // Queue 1: a blocking eventfd one below its maximum count.
    let full = EventFd::new(0).unwrap();
    full.write(0xffff_ffff_ffff_fffe).unwrap();

    let mut q0 = Queue::new(0);
    let mut q1 = Queue::new(1);
    q0.start(&mut fe, &ram);
    q1.start(&mut fe, &ram);
    assert_eq!(fe.set_vring_fd(req::SET_VRING_CALL, 0, Some(w)).unwrap(), 0);
    assert_eq!(
        fe.set_vring_fd(req::SET_VRING_CALL, 1, Some(full.as_raw_fd()))
            .unwrap(),
        0
    );
    q0.read_ok(&ram);
    q1.read_ok(&ram);
    q0.read_ok(&ram);
    fe.set_timeout(Duration::from_secs(5)).unwrap();
    let start = Instant::now();
    for (i, done) in [(0, 2), (1, 1)] {
        let base = fe
            .get_vring_base(i)
            .unwrap_or_else(|e| panic!("GET_VRING_BASE {i} unanswered: {e:#}"));
        assert_eq!(base, done);
    }
    eprintln!("GET_VRING_BASE answered in {:?}", start.elapsed());
    fe.set_timeout(Duration::from_secs(10)).unwrap();
    alive(&mut fe);
    rig.check_cost(log, "call fds that would block");
}

/// SET_VRING_NUM on a started ring with requests in flight: the spec has it for a
/// stopped ring only, and a smaller size would send the chains in flight to used-ring
/// slots and heads that no longer exist. It is refused (an error ack, the session
/// kept); every request in flight completes OK into the used ring, the fabric stream
/// stays in step, and the other attachment serves. Before, SET_VRING_NUM 2 was acked
/// 0, completions failed against the smaller ring, the in-flight count wrapped and the
/// lender's stream was misread ("malformed response").
#[test]
fn set_vring_num_on_a_started_ring_is_refused_and_requests_in_flight_complete() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let mut q0 = Queue::new(0);
    let mut q1 = Queue::new(1);
    q0.start(&mut fe, &ram);
    q1.start(&mut fe, &ram);
    q0.read_ok(&ram);
    let log = rig.log_len();

    let before = q0.ring.used_idx(&ram);
    let heads: Vec<u16> = (0..63).map(|_| q0.offer_read(&ram)).collect();
    q0.kick.write(1).unwrap();
    assert_ne!(
        fe.set_vring_num(0, 2).unwrap(),
        0,
        "SET_VRING_NUM on a started ring was acked"
    );
    alive(&mut fe);
    let deadline = Instant::now() + Duration::from_secs(10);
    let want = before.wrapping_add(heads.len() as u16);
    while q0.ring.used_idx(&ram) != want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(q0.ring.used_idx(&ram), want, "not every READ completed");
    let mut done: Vec<u16> = (0..heads.len() as u16)
        .map(|i| q0.ring.used_elem(&ram, before.wrapping_add(i)).0 as u16)
        .collect();
    done.sort_unstable();
    let mut sorted = heads.clone();
    sorted.sort_unstable();
    assert_eq!(done, sorted, "the used ring names other heads");
    for &h in &heads {
        assert_eq!(q0.status_of(&ram, h), S_OK, "head {h}");
    }
    let text = rig.borrower.proc.log();
    assert!(
        !text[log.min(text.len())..].contains("malformed response"),
        "the lender's stream was misread:\n{}",
        &text[log.min(text.len())..]
    );
    rig.check_cost(log, "SET_VRING_NUM on a started ring");
    q0.read_ok(&ram);
    q1.read_ok(&ram);
    // Stopped, the ring may be resized.
    fe.get_vring_base(0).unwrap();
    assert_eq!(fe.set_vring_num(0, 128).unwrap(), 0);
    alive(&mut fe);
}

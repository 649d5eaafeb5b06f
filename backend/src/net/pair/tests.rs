//! A queue pair driven through a fake lender on mock virtqueues: the fake's sessions
//! are unix socket pairs whose far end the test reads and writes as the lender would.
//! Frames split across reads, frames that wait for receive buffers and expire, a
//! protocol error that loses the session and the reconnect after it, transmitted frames
//! stripped of their virtio header, drops while the lender is away, and the transmitq
//! left alone while the socket is full.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devlend_fabric::handshake::NicLink;
use devlend_fabric::net::{LinkState, FEATURE_NET};
use devlend_fabric::tcp::ConnectError;
use devlend_fabric::HelloReply;
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};

use super::*;

/// virtio's VIRTQ_DESC_F_WRITE: a buffer the device writes (a receive buffer).
const F_WRITE: u16 = 2;
const QSIZE: u16 = 64;
/// Where the receiveq and the transmitq live, and their buffers (64 KiB apart).
const RXQ: u64 = 0;
const TXQ: u64 = 0x8000;
const RX_BUFS: u64 = 0x10_0000;
const TX_BUFS: u64 = 0x50_0000;
const BUF_GAP: u64 = 0x1_0000;

/// The fake lender: how many sessions it opened, whether it refuses new ones, and the
/// lender's end of each session.
#[derive(Default)]
struct Lender {
    sessions: u32,
    down: bool,
    /// Takes the hello, then answers busy (as a lender whose fence wait ran out).
    busy: bool,
    ends: Vec<UnixStream>,
    /// The address each session was opened on, in order.
    addrs: Vec<String>,
}

type Shared = Arc<Mutex<Lender>>;

fn lock(l: &Shared) -> std::sync::MutexGuard<'_, Lender> {
    l.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Sessions to `lender`: a unix socket pair, the pair's end in a `Stream`, the reply a
/// lender of a 1500-byte link that is up gives.
fn opener(lender: Shared) -> PairOpener {
    Box::new(move |target, hello| {
        let mut l = lock(&lender);
        if l.down {
            return Err(ConnectError::Connect {
                addr: target.addr.clone(),
                source: io::Error::from(io::ErrorKind::ConnectionRefused),
            });
        }
        if l.busy {
            return Err(ConnectError::Refused {
                addr: target.addr.clone(),
                device: target.device.clone(),
                status: devlend_fabric::HelloStatus::Busy,
                message: "busy".into(),
            });
        }
        let (near, far) = UnixStream::pair().expect("socketpair");
        far.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        l.sessions += 1;
        l.ends.push(far);
        l.addrs.push(target.addr.clone());
        let link = LinkState {
            up: true,
            mtu: 1500,
            mac: [2, 0, 0, 0, 0, 1],
        };
        let mut reply = HelloReply::ok(NicLink::new(&link, 0));
        // Heartbeats, when asked for (a target with several paths).
        reply.features = FEATURE_NET | (hello.features & devlend_fabric::FEATURE_HEARTBEAT);
        Ok((Stream::Tls(near), reply))
    })
}

/// The lender's end of the current session.
fn far(l: &Shared) -> UnixStream {
    lock(l)
        .ends
        .last()
        .expect("a session")
        .try_clone()
        .expect("clone")
}

/// A connected pair 0 whose sessions go to `lender`, reconnecting without backoff.
fn pair(lender: &Shared) -> (PairEngine, Arc<NetStats>) {
    let stats = Arc::new(NetStats::new(1, true, 1500));
    let mut e = PairEngine::new(
        0,
        "nic".into(),
        LenderTarget::direct("fake:1", "nic", [1; 16]),
        Arc::clone(&stats),
    )
    .expect("timerfd");
    e.opener = opener(Arc::clone(lender));
    e.retry = Reconnector::new(Policy::backoff(Duration::ZERO, Duration::ZERO));
    e.connect().expect("the fake lender is up");
    (e, stats)
}

fn memory() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), 16 << 20)]).expect("memory")
}

/// A queue at `base` whose avail ring holds `n` one-descriptor chains of `len` bytes
/// each, chain `i`'s buffer at `bufs + i * BUF_GAP` (the device writes it when
/// `flags` is [`F_WRITE`]). Returns the mock (to read the used ring) and the queue.
fn queue(
    mem: &GuestMemory,
    base: u64,
    bufs: u64,
    n: u16,
    len: u32,
    flags: u16,
) -> (MockSplitQueue<'_, GuestMemory>, Queue) {
    let vq = MockSplitQueue::create(mem, GuestAddress(base), QSIZE);
    for i in 0..n {
        let d = Descriptor::new(bufs + u64::from(i) * BUF_GAP, len, flags, 0);
        vq.desc_table()
            .store(i, RawDescriptor::from(d))
            .expect("descriptor");
        vq.avail()
            .ring()
            .ref_at(usize::from(i))
            .expect("avail slot")
            .store(u16::to_le(i));
    }
    vq.avail().idx().store(u16::to_le(n));
    let q: Queue = vq.create_queue().expect("queue");
    (vq, q)
}

/// A frame of `len` bytes whose bytes count from `seed`.
fn frame(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add(i as u8)).collect()
}

/// What the guest finds in receive buffer `i`: the frame after the 12-byte
/// `virtio_net_hdr_v1`, whose `num_buffers` must be 1.
fn received(mem: &GuestMemory, i: u64, len: usize) -> Vec<u8> {
    let at = RX_BUFS + i * BUF_GAP;
    let hdr: [u8; NET_HDR_LEN] = mem.read_obj(GuestAddress(at)).expect("header");
    assert_eq!(u16::from_le_bytes([hdr[10], hdr[11]]), 1, "num_buffers");
    let mut f = vec![0u8; len];
    mem.read_slice(&mut f, GuestAddress(at + NET_HDR_LEN as u64))
        .expect("frame");
    f
}

/// Reads the lender's end until `n` frame messages came; returns their frames.
fn frames_at_lender(far: &mut UnixStream, n: usize) -> Vec<Vec<u8>> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut chunk = [0u8; 1 << 16];
    while out.len() < n {
        let got = far.read(&mut chunk).expect("the pair's frames");
        assert!(got > 0, "the pair closed the session");
        buf.extend_from_slice(&chunk[..got]);
        let mut at = 0;
        while let Some((m, len)) = net::decode(&buf[at..]).expect("well-formed") {
            if let NetMessage::Frame(f) = m {
                out.push(f.to_vec());
            }
            at += len;
        }
        buf.drain(..at);
    }
    out
}

fn snapshot(stats: &NetStats) -> devlend_fabric::io_counters::NetCounters {
    stats.snapshot().pairs[0]
}

#[test]
fn frames_split_across_reads_reach_the_receiveq_whole_and_in_order() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let (mut e, stats) = pair(&lender);
    let mem = memory();
    let (vq, mut rxq) = queue(&mem, RXQ, RX_BUFS, 4, 1536, F_WRITE);
    let (a, b) = (frame(60, 1), frame(1514, 7));
    let mut wire = Vec::new();
    net::encode_frame(&a, &mut wire);
    net::encode_frame(&b, &mut wire);
    let mut lender_end = far(&lender);
    // The first frame and 5 bytes of the second's header; then the rest.
    let cut = net::NET_HEADER_LEN + a.len() + 5;
    lender_end.write_all(&wire[..cut]).expect("write");
    assert!(e.on_fabric(Some(&mut rxq), &mem).expect("rings"));
    assert_eq!(vq.used().idx().load(), 1, "only the whole frame");
    lender_end.write_all(&wire[cut..]).expect("write");
    assert!(e.on_fabric(Some(&mut rxq), &mem).expect("rings"));
    assert_eq!(vq.used().idx().load(), 2);
    assert_eq!(received(&mem, 0, a.len()), a);
    assert_eq!(received(&mem, 1, b.len()), b);
    let s = snapshot(&stats);
    assert_eq!((s.rx_packets, s.rx_bytes, s.errors), (2, 1574, 0));
}

#[test]
fn frames_wait_for_receive_buffers_then_expire_counted() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let (mut e, stats) = pair(&lender);
    let mem = memory();
    let mut wire = Vec::new();
    let frames: Vec<Vec<u8>> = (0..3).map(|i| frame(100, i * 50)).collect();
    for f in &frames {
        net::encode_frame(f, &mut wire);
    }
    far(&lender).write_all(&wire).expect("write");
    // The receiveq is not ready: the frames wait.
    assert!(!e.on_fabric(None, &mem).expect("rings"));
    assert_eq!(e.held.len(), 3);
    // The guest posts one buffer: the oldest frame takes it, the others still wait.
    let (vq, mut rxq) = queue(&mem, RXQ, RX_BUFS, 1, 1536, F_WRITE);
    assert!(e.deliver_held(&mut rxq, &mem).expect("rings"));
    assert_eq!(vq.used().idx().load(), 1);
    assert_eq!(received(&mem, 0, 100), frames[0]);
    assert_eq!(e.held.len(), 2);
    // No more buffers come: past HOLD they are dropped and counted.
    std::thread::sleep(HOLD + Duration::from_millis(20));
    assert!(!e.on_timer(Some(&mut rxq), &mem).expect("rings"));
    assert!(e.held.is_empty());
    let s = snapshot(&stats);
    assert_eq!((s.rx_packets, s.rx_drops), (1, 2));
}

#[test]
fn a_protocol_error_loses_the_session_and_the_pair_reconnects() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let (mut e, stats) = pair(&lender);
    let mem = memory();
    let (first, generation) = (e.fabric_fd(), e.generation);
    assert!(first.0.is_some());
    // A link message with an MTU no guest can use.
    let mut wire = Vec::new();
    LinkState {
        up: true,
        mtu: 3,
        mac: [0; 6],
    }
    .encode(&mut wire);
    far(&lender).write_all(&wire).expect("write");
    assert!(!e.on_fabric(None, &mem).expect("rings"));
    assert!(e.fabric_fd().0.is_none(), "the session is dropped");
    assert_eq!(snapshot(&stats).errors, 1);
    // While the lender refuses, the timer keeps retrying; once it is back, a new
    // session opens.
    lock(&lender).down = true;
    e.on_timer(None, &mem).expect("rings");
    assert!(e.fabric_fd().0.is_none());
    lock(&lender).down = false;
    e.on_timer(None, &mem).expect("rings");
    assert!(e.fabric_fd().0.is_some(), "reconnected");
    assert_eq!(e.generation, generation + 1);
    assert_eq!(lock(&lender).sessions, 2);
    assert_eq!(stats.snapshot().reconnects, 1);
    // The new session carries frames again.
    let (vq, mut rxq) = queue(&mem, RXQ, RX_BUFS, 1, 1536, F_WRITE);
    let f = frame(64, 9);
    let mut wire = Vec::new();
    net::encode_frame(&f, &mut wire);
    far(&lender).write_all(&wire).expect("write");
    assert!(e.on_fabric(Some(&mut rxq), &mem).expect("rings"));
    assert_eq!(vq.used().idx().load(), 1);
    assert_eq!(received(&mem, 0, 64), f);
}

/// Writes chain `i`'s transmit buffer: a zeroed virtio_net_hdr_v1 (no offload), then
/// `f`.
fn transmit(mem: &GuestMemory, i: u64, f: &[u8]) {
    let at = TX_BUFS + i * BUF_GAP;
    mem.write_slice(&[0u8; NET_HDR_LEN], GuestAddress(at))
        .expect("header");
    mem.write_slice(f, GuestAddress(at + NET_HDR_LEN as u64))
        .expect("frame");
}

#[test]
fn transmitted_frames_lose_their_virtio_header_and_drop_while_the_lender_is_away() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let (mut e, stats) = pair(&lender);
    let mem = memory();
    let frames: Vec<Vec<u8>> = (0..4).map(|i| frame(60 + 10 * i, i as u8)).collect();
    for (i, f) in frames.iter().enumerate() {
        transmit(&mem, i as u64, f);
    }
    let len = |i: usize| (NET_HDR_LEN + frames[i].len()) as u32;
    // Two chains first (the descriptors of all four are laid out with their lengths).
    let vq = MockSplitQueue::create(&mem, GuestAddress(TXQ), QSIZE);
    for i in 0..4u16 {
        let d = Descriptor::new(TX_BUFS + u64::from(i) * BUF_GAP, len(usize::from(i)), 0, 0);
        vq.desc_table().store(i, RawDescriptor::from(d)).expect("d");
        vq.avail()
            .ring()
            .ref_at(usize::from(i))
            .expect("slot")
            .store(u16::to_le(i));
    }
    vq.avail().idx().store(u16::to_le(2));
    let mut txq: Queue = vq.create_queue().expect("queue");
    assert!(e.on_tx(&mut txq, &mem).expect("rings"));
    assert_eq!(vq.used().idx().load(), 2);
    let mut lender_end = far(&lender);
    assert_eq!(frames_at_lender(&mut lender_end, 2), frames[..2].to_vec());
    // The lender goes away: the next two chains are still used (the guest never
    // stalls), their frames dropped and counted.
    drop(lender_end);
    lock(&lender).ends.clear();
    lock(&lender).down = true;
    assert!(!e.on_fabric(None, &mem).expect("rings"));
    assert!(e.fabric_fd().0.is_none());
    vq.avail().idx().store(u16::to_le(4));
    assert!(e.on_tx(&mut txq, &mem).expect("rings"));
    assert_eq!(vq.used().idx().load(), 4);
    let s = snapshot(&stats);
    assert_eq!((s.tx_packets, s.tx_drops, s.errors), (2, 2, 0));
}

#[test]
fn a_full_socket_leaves_the_transmitq_alone_until_it_drains() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let (mut e, stats) = pair(&lender);
    let mem = memory();
    // 60 frames of 60,000 bytes: 3.6 MB, beyond OUT_LIMIT (2 MiB) plus what a unix
    // socket buffers.
    let n = 60u16;
    let f = frame(60_000, 3);
    for i in 0..u64::from(n) {
        transmit(&mem, i, &f);
    }
    let (vq, mut txq) = queue(&mem, TXQ, TX_BUFS, n, (NET_HDR_LEN + f.len()) as u32, 0);
    e.on_tx(&mut txq, &mem).expect("rings");
    let taken = vq.used().idx().load();
    assert!(
        taken < n,
        "the transmitq was left alone: {taken} of {n} taken"
    );
    assert!(e.out.len() >= OUT_LIMIT);
    // The lender reads everything queued so far; the next flush and on_tx go on.
    let mut lender_end = far(&lender);
    let reader = std::thread::spawn(move || frames_at_lender(&mut lender_end, usize::from(n)));
    let deadline = Instant::now() + Duration::from_secs(10);
    while vq.used().idx().load() < n || !e.out.is_empty() {
        assert!(Instant::now() < deadline, "the transmitq was not resumed");
        e.flush();
        e.on_tx(&mut txq, &mem).expect("rings");
        std::thread::sleep(Duration::from_millis(1));
    }
    let got = reader.join().expect("reader");
    assert_eq!(got.len(), usize::from(n));
    assert!(got.iter().all(|g| *g == f), "every frame whole");
    let s = snapshot(&stats);
    assert_eq!((s.tx_packets, s.tx_drops), (u64::from(n), 0));
}

#[test]
fn with_two_paths_a_pair_sends_heartbeats_and_reopens_on_the_next_path() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let mut target = LenderTarget::direct("fake:1", "nic", [1; 16]);
    target.alt_addrs = vec!["fake:2".into()];
    let stats = Arc::new(NetStats::new(2, true, 1500).with_paths(target.path_addrs()));
    // Pair 1 starts on path 2: pairs spread over the paths.
    let mut e = PairEngine::new(1, "nic".into(), target, Arc::clone(&stats)).expect("timerfd");
    e.opener = opener(Arc::clone(&lender));
    e.retry = Reconnector::new(Policy::backoff(Duration::ZERO, Duration::ZERO));
    e.connect().expect("the fake lender is up");
    assert_eq!(lock(&lender).addrs, ["fake:2"]);
    let paths = |s: &NetStats| {
        s.snapshot()
            .paths
            .iter()
            .map(|p| (p.addr.clone(), p.up, p.sessions, p.failures))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        paths(&stats),
        [("fake:1".into(), true, 0, 0), ("fake:2".into(), true, 1, 0)]
    );
    let mem = memory();
    // A heartbeat message is due every HEARTBEAT_EVERY, on an idle session too.
    std::thread::sleep(HEARTBEAT_EVERY);
    e.on_timer(None, &mem).expect("rings");
    let mut end = far(&lender);
    let mut got = [0u8; net::NET_HEADER_LEN];
    end.read_exact(&mut got).expect("a heartbeat");
    assert_eq!(
        net::decode(&got).expect("well-formed"),
        Some((NetMessage::Heartbeat, net::NET_HEADER_LEN))
    );
    // The session drops: the next opens on the other path.
    drop(end);
    lock(&lender).ends.clear();
    assert!(!e.on_fabric(None, &mem).expect("rings"));
    assert!(e.fabric_fd().0.is_none());
    e.on_timer(None, &mem).expect("rings");
    assert!(e.fabric_fd().0.is_some(), "reconnected");
    assert_eq!(lock(&lender).addrs, ["fake:2", "fake:1"]);
    // The lost path is down until a session opens on it or a probe reaches it; the
    // move to the other one is a failover.
    assert_eq!(
        paths(&stats),
        [
            ("fake:1".into(), true, 1, 0),
            ("fake:2".into(), false, 0, 1)
        ]
    );
    let snap = stats.snapshot();
    assert_eq!(snap.failovers, 1);
    assert!(snap.last_failover_us > 0, "{snap:?}");
    // The lender refuses: the connect fails on path 1, which is marked down too.
    drop(far(&lender));
    lock(&lender).ends.clear();
    lock(&lender).down = true;
    assert!(!e.on_fabric(None, &mem).expect("rings"));
    e.on_timer(None, &mem).expect("rings");
    assert!(e.fabric_fd().0.is_none());
    assert_eq!(
        paths(&stats),
        [
            ("fake:1".into(), false, 0, 1),
            ("fake:2".into(), false, 0, 2)
        ]
    );
    // It is back: the pair reopens, which was lost on path 1, on path 1 again (after
    // path 2 failed): no failover. A pause closes the session without a failure.
    lock(&lender).down = false;
    e.on_timer(None, &mem).expect("rings");
    assert!(e.fabric_fd().0.is_some(), "reconnected");
    assert_eq!(lock(&lender).addrs, ["fake:2", "fake:1", "fake:1"]);
    e.pause();
    assert_eq!(
        paths(&stats),
        [
            ("fake:1".into(), true, 0, 1),
            ("fake:2".into(), false, 0, 2)
        ]
    );
    assert_eq!(stats.snapshot().failovers, 1);
}

#[test]
fn with_one_path_a_pair_sends_no_heartbeat() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let (mut e, _) = pair(&lender);
    let mem = memory();
    std::thread::sleep(HEARTBEAT_EVERY);
    e.on_timer(None, &mem).expect("rings");
    let mut end = far(&lender);
    end.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let mut got = [0u8; 1];
    assert!(end.read(&mut got).is_err(), "nothing sent");
}

#[test]
fn a_paused_pair_with_two_paths_leaves_its_timer_alone() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let stats = Arc::new(NetStats::new(1, true, 1500));
    let mut target = LenderTarget::direct("fake:1", "nic", [1; 16]);
    target.alt_addrs = vec!["fake:2".into()];
    let mut e = PairEngine::new(0, "nic".into(), target, Arc::clone(&stats)).expect("timerfd");
    e.opener = opener(Arc::clone(&lender));
    e.connect().expect("the fake lender is up");
    let mem = memory();
    // A migration's source lets the NIC go: no session, so no heartbeat is due.
    e.pause();
    std::thread::sleep(HEARTBEAT_EVERY);
    e.on_timer(None, &mem).expect("rings");
    let mut pfd = libc::pollfd {
        fd: e.timer_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: pfd is a valid pollfd for the duration of the call.
    let ready = unsafe { libc::poll(&mut pfd, 1, 300) };
    assert_eq!(ready, 0, "the timer fires while the pair is paused");
}

/// Pair 0 with two paths whose session was lost on its own path (1) and reopened on
/// path 2, reconnecting without backoff.
fn failed_over(lender: &Shared) -> (PairEngine, Arc<NetStats>, GuestMemory) {
    let mut target = LenderTarget::direct("fake:1", "nic", [1; 16]);
    target.alt_addrs = vec!["fake:2".into()];
    let stats = Arc::new(NetStats::new(1, true, 1500).with_paths(target.path_addrs()));
    let mut e = PairEngine::new(0, "nic".into(), target, Arc::clone(&stats)).expect("timerfd");
    e.opener = opener(Arc::clone(lender));
    e.retry = Reconnector::new(Policy::backoff(Duration::ZERO, Duration::ZERO));
    e.connect().expect("the fake lender is up");
    let mem = memory();
    drop(far(lender));
    lock(lender).ends.clear();
    assert!(!e.on_fabric(None, &mem).expect("rings"));
    e.on_timer(None, &mem).expect("rings");
    assert_eq!(lock(lender).addrs, ["fake:1", "fake:2"]);
    (e, stats, mem)
}

#[test]
fn a_pair_moves_back_to_its_own_path_once_it_is_up_again() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let (mut e, stats, mem) = failed_over(&lender);
    // Path 1 is still down: the pair stays, however long.
    std::thread::sleep(FAILBACK_AFTER);
    e.on_timer(None, &mem).expect("rings");
    assert_eq!(lock(&lender).addrs.len(), 2, "moved to a path marked down");
    // It answers again but does not take the session: the pair keeps the one it has.
    stats.paths[0].reachable();
    lock(&lender).down = true;
    e.on_timer(None, &mem).expect("rings");
    assert!(e.fabric_fd().0.is_some(), "the old session was kept");
    let mut end = far(&lender);
    lock(&lender).down = false;
    // A failed try waits twice as long before the next.
    stats.paths[0].reachable();
    std::thread::sleep(FAILBACK_AFTER);
    e.on_timer(None, &mem).expect("rings");
    assert_eq!(
        lock(&lender).addrs.len(),
        2,
        "tried again after FAILBACK_AFTER"
    );
    std::thread::sleep(FAILBACK_AFTER);
    e.on_timer(None, &mem).expect("rings");
    assert_eq!(lock(&lender).addrs, ["fake:1", "fake:2", "fake:1"]);
    // The old session is closed, the new one is on path 1; a move back is no failover.
    end.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    // Heartbeats it sent, then its end.
    let mut sent = Vec::new();
    end.read_to_end(&mut sent).expect("the old session's end");
    let snap = stats.snapshot();
    let on: Vec<u64> = snap.paths.iter().map(|p| p.sessions).collect();
    assert_eq!(on, [1, 0]);
    assert!(snap.paths.iter().all(|p| p.up), "{snap:?}");
    assert_eq!(snap.failovers, 1);
    // A move back is no reconnect: only the failover's counts.
    assert_eq!(stats.snapshot().reconnects, 1);
    // The engine goes (a new frontend connection makes new ones): its session no
    // longer counts on its path.
    drop(e);
    let on: Vec<u64> = stats.snapshot().paths.iter().map(|p| p.sessions).collect();
    assert_eq!(on, [0, 0]);
}

#[test]
fn a_move_back_refused_after_the_hello_reopens_where_the_pair_was() {
    let lender = Arc::new(Mutex::new(Lender::default()));
    let (mut e, stats, mem) = failed_over(&lender);
    // Path 1 answers again; the lender takes the hello there (and so may have fenced
    // the session on path 2) but answers busy: that session is not trusted any more.
    stats.paths[0].reachable();
    lock(&lender).busy = true;
    std::thread::sleep(FAILBACK_AFTER);
    e.on_timer(None, &mem).expect("rings");
    assert!(
        e.fabric_fd().0.is_none(),
        "kept a session the lender may have fenced"
    );
    lock(&lender).busy = false;
    e.on_timer(None, &mem).expect("rings");
    assert!(e.fabric_fd().0.is_some(), "reopened");
    assert_eq!(lock(&lender).addrs, ["fake:1", "fake:2", "fake:2"]);
    // Neither a failure of path 2 nor a failover: the pair closed that session itself.
    let snap = stats.snapshot();
    let state: Vec<(bool, u64, u64)> = snap
        .paths
        .iter()
        .map(|p| (p.up, p.sessions, p.failures))
        .collect();
    assert_eq!(state, [(true, 0, 1), (true, 1, 0)]);
    assert_eq!(snap.failovers, 1);
}

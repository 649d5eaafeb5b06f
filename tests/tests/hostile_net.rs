//! A hostile or buggy VMM on a lent NIC: the test speaks vhost-user itself
//! (`devlend_tests::vhost_raw`) over the socket of a real compute agent's 2-pair NIC
//! attachment, lent by a real lender from one end of a veth pair whose other end is a
//! peer host in its own namespace (as `nic_peers.rs`). It lays out the four virtqueues
//! (receiveq 0, transmitq 0, receiveq 1, transmitq 1) in guest memory it maps, and
//! corrupts one of them.
//!
//! A queue the driver corrupts (an avail index more than the queue size ahead, a chain
//! that loops) must stop, once: its error eventfd signalled, nothing more taken from
//! it, the agent idle and its log a few lines longer; the other queue of its pair and
//! the other pair keep passing frames both ways; after GET_VRING_BASE and a
//! re-initialization the queue works again. A bad frame in a well-formed chain is
//! dropped and returned, and the queue goes on.

use std::time::{Duration, Instant};

use devlend_tests::agents::{free_port, Borrower, Lender};
use devlend_tests::lan::PeerLan;
use devlend_tests::netns::Netns;
use devlend_tests::vhost_raw::{
    cpu_share, proto, req, GuestRam, RawFrontend, RawQueue, DESC_NEXT, DESC_WRITE,
};

const MIB: u64 = 1 << 20;
const QUEUE_SIZE: u16 = 256;
/// Guest RAM: rings at 0 (vring q at q × 64 KiB), buffers from 1 MiB (vring q's at
/// 1 MiB + q × 512 KiB, 4 KiB each).
const RAM_LEN: usize = 4 << 20;
/// Receive buffers posted per receiveq (and transmit slots per transmitq).
const SLOTS: u16 = 64;
/// Bytes of a receive buffer.
const RX_BUF: u32 = 2048;
/// virtio_net_hdr_v1.
const HDR: usize = 12;
/// How much the agent's log may grow over one test's hostile messages.
const LOG_BUDGET: usize = 4096;
/// The CPU share of one core the agent may use while idle after them.
const CPU_BUDGET: f64 = 0.05;
/// The MAC the peer sends its flows to (a static neighbour entry on its side).
const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
/// What the peer's datagrams carry, to tell them from the wire's own traffic.
const MARK: &[u8] = b"devlend-hostile-net";

struct Rig {
    lan: PeerLan,
    _lender: Lender,
    borrower: Borrower,
    _fabric: Netns,
    _dir: tempfile::TempDir,
    ram: GuestRam,
    fe: RawFrontend,
    /// Vrings 0..4: rx0, tx0, rx1, tx1.
    q: Vec<Queue>,
}

/// A vring and the next buffer slot to use.
struct Queue {
    raw: RawQueue,
    next: u16,
}

fn buf_addr(index: u32, slot: u16) -> u64 {
    MIB + u64::from(index) * (512 << 10) + u64::from(slot % SLOTS) * 0x1000
}

impl Queue {
    fn index(&self) -> u32 {
        self.raw.index
    }

    /// Posts `n` receive buffers and kicks.
    fn post_rx(&mut self, ram: &GuestRam, n: u16) {
        let r = self.raw.ring;
        for _ in 0..n {
            let d = self.next % QUEUE_SIZE;
            r.set_desc(
                ram,
                d,
                buf_addr(self.index(), self.next),
                RX_BUF,
                DESC_WRITE,
                0,
            );
            r.offer(ram, d);
            self.next = self.next.wrapping_add(1);
        }
        self.raw.kick();
    }

    /// Transmits `frame` (after a zero virtio_net_hdr) in one descriptor and kicks;
    /// returns the head.
    fn send(&mut self, ram: &GuestRam, frame: &[u8]) -> u16 {
        let d = self.next % QUEUE_SIZE;
        let at = buf_addr(self.index(), self.next);
        let mut b = vec![0u8; HDR];
        b.extend_from_slice(frame);
        ram.write(at, &b);
        self.raw.ring.set_desc(ram, d, at, b.len() as u32, 0, 0);
        self.raw.ring.offer(ram, d);
        self.next = self.next.wrapping_add(1);
        self.raw.kick();
        d
    }

    /// Transmits `n` frames and waits until the backend returned them all (and what
    /// was offered before them).
    fn send_ok(&mut self, ram: &GuestRam, n: usize) {
        let before = self.raw.ring.used_idx(ram);
        for _ in 0..n {
            self.send(ram, &frame());
        }
        let end = Instant::now() + Duration::from_secs(5);
        while usize::from(self.raw.ring.used_idx(ram).wrapping_sub(before)) < n {
            assert!(
                Instant::now() < end,
                "vring {}: {} of {n} frames returned",
                self.index(),
                self.raw.ring.used_idx(ram).wrapping_sub(before)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// How many of the frames in the used ring since slot `from` carry [`MARK`].
    fn marked_since(&self, ram: &GuestRam, from: u16) -> usize {
        let now = self.raw.ring.used_idx(ram);
        (from..now)
            .filter(|&slot| {
                let (id, len) = self.raw.ring.used_elem(ram, slot);
                let len = (len as usize).min(RX_BUF as usize);
                let data = ram.read(self.raw.ring.desc_addr(ram, id as u16), len);
                data.windows(MARK.len()).any(|w| w == MARK)
            })
            .count()
    }
}

/// A broadcast frame from a made-up MAC (an Ethernet header and 46 bytes).
fn frame() -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0x00, 0x00, 0x00, 0x00, 0x42]);
    f.extend_from_slice(&[0x88, 0xb5]);
    f.extend_from_slice(&[0x5a; 46]);
    f
}

/// A lender lending one end of a veth pair (the other a peer at 10.79.0.2), a borrower
/// attaching it with 2 queue pairs, a raw frontend with its four vrings started and
/// receive buffers posted on both receiveqs. Namespace `n`, veth tag `tag`.
fn rig(n: u8, tag: &str) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let fabric = Netns::new(n).unwrap();
    let tag = format!("{tag}{}", std::process::id() % 10_000);
    let lan = PeerLan::new(&tag, &fabric.name, "10.79.0.2/24", 1500).unwrap();
    let mac = GUEST_MAC.map(|b| format!("{b:02x}")).join(":");
    lan.exec(&[
        "ip",
        "neigh",
        "replace",
        "10.79.0.1",
        "lladdr",
        &mac,
        "dev",
        &lan.peer_if,
    ])
    .unwrap();
    let addr = format!("{}:{}", fabric.ns_ip, free_port().unwrap());
    let device = format!("nic0=net:{},mac={mac}", lan.lent_if);
    let lender = Lender::start_in(
        dir.path(),
        Some(&fabric.name),
        &addr,
        &[device],
        &["--insecure".to_owned()],
    )
    .unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("nic0.sock");
    let info = borrower.attach(&addr, "nic0", &sock, 2).unwrap();
    assert_eq!(info["kind"], "nic", "{info}");
    let ram = GuestRam::new(0, RAM_LEN).unwrap();
    let mut fe = RawFrontend::connect(&sock).unwrap();
    fe.negotiate(0, proto::MQ | proto::CONFIG).unwrap();
    assert_eq!(fe.set_mem_table(&[ram.region()], &[ram.fd()]).unwrap(), 0);
    assert_eq!(fe.get_u64(req::GET_QUEUE_NUM).unwrap(), 4);
    let mut q: Vec<Queue> = (0..4)
        .map(|i| Queue {
            raw: RawQueue::new(i, u64::from(i) * 0x10000, QUEUE_SIZE),
            next: 0,
        })
        .collect();
    for v in &q {
        v.raw.start(&mut fe, &ram, 0).unwrap();
    }
    for i in [0, 2] {
        q[i].post_rx(&ram, SLOTS);
    }
    let mut rig = Rig {
        lan,
        _lender: lender,
        borrower,
        _fabric: fabric,
        _dir: dir,
        ram,
        fe,
        q,
    };
    // Both pairs pass frames before anything goes wrong.
    rig.tx_ok(1);
    rig.tx_ok(3);
    let got = rig.rx_flows();
    assert!(got[0] > 0 && got[1] > 0, "both pairs receive: {got:?}");
    rig
}

impl Rig {
    fn log_len(&self) -> usize {
        self.borrower.proc.log().len()
    }

    /// The peer interface's received packets.
    fn peer_rx_packets(&self) -> u64 {
        let path = format!("/sys/class/net/{}/statistics/rx_packets", self.lan.peer_if);
        self.lan
            .exec(&["cat", &path])
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Frames transmitted on vring `v` (a transmitq) reach the peer.
    fn tx_ok(&mut self, v: usize) {
        let before = self.peer_rx_packets();
        self.q[v].send_ok(&self.ram, 5);
        let end = Instant::now() + Duration::from_secs(10);
        while self.peer_rx_packets() < before + 5 {
            assert!(
                Instant::now() < end,
                "vring {v}: the peer received {} of 5 frames",
                self.peer_rx_packets() - before
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The peer sends 64 UDP flows (distinct source ports: the lender's fanout spreads
    /// them over the pairs) to the guest; returns how many marked frames each receiveq
    /// (vrings 0 and 2) got, its buffers posted again.
    fn rx_flows(&mut self) -> [usize; 2] {
        let from = [0, 2].map(|v| self.q[v].raw.ring.used_idx(&self.ram));
        let script = format!(
            "import socket\nfor p in range(64):\n s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n s.sendto(b'{}', ('10.79.0.1', 7000 + p))\n s.close()\n",
            std::str::from_utf8(MARK).unwrap()
        );
        self.lan.exec(&["python3", "-c", &script]).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let got = [0, 1].map(|k| self.q[2 * k].marked_since(&self.ram, from[k]));
        for (k, v) in [0usize, 2].into_iter().enumerate() {
            let used = self.q[v].raw.ring.used_idx(&self.ram).wrapping_sub(from[k]);
            if used > 0 {
                self.q[v].post_rx(&self.ram, used);
            }
        }
        got
    }

    /// Corrupts vring `v`'s avail index (40000 past the last one offered), kicks it, and
    /// checks that its error eventfd is signalled and that more kicks take nothing.
    fn jump(&mut self, v: usize) {
        let used = self.q[v].raw.ring.used_idx(&self.ram);
        let ring = self.q[v].raw.ring;
        let idx = ring.avail_idx(&self.ram);
        ring.set_avail_idx(&self.ram, idx.wrapping_add(40000));
        self.q[v].raw.kick();
        assert!(
            self.q[v].raw.err_signalled(Duration::from_secs(2)),
            "vring {v}: the error eventfd was not signalled within 2 s"
        );
        for _ in 0..20 {
            self.q[v].raw.kick();
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            ring.used_idx(&self.ram),
            used,
            "vring {v}: the stopped queue completed something"
        );
        assert!(
            !self.q[v].raw.err_signalled(Duration::ZERO),
            "vring {v}: the error eventfd is signalled once"
        );
        ring.set_avail_idx(&self.ram, idx);
    }

    /// What the hostile messages since `log_before` cost: the agent idles, its log grew
    /// at most [`LOG_BUDGET`], and it is alive.
    fn check_cost(&mut self, log_before: usize, what: &str) {
        let share = cpu_share(self.borrower.proc.pid(), Duration::from_secs(2));
        assert!(
            share < CPU_BUDGET,
            "{what}: the compute agent used {:.0}% of a core while idle",
            share * 100.0
        );
        let log = self.borrower.proc.log();
        let grown = log.len().saturating_sub(log_before);
        eprintln!(
            "{what}: agent CPU {:.1}% of a core over 2 s, log +{grown} bytes",
            share * 100.0
        );
        assert!(
            grown <= LOG_BUDGET,
            "{what}: the agent's log grew by {grown} bytes:\n{}",
            &log[log_before.min(log.len())..]
        );
        self.borrower.proc.check_alive().unwrap();
    }

    /// GET_VRING_BASE then a fresh start of vring `v` at that base.
    fn reinit(&mut self, v: usize) {
        let base = self.fe.get_vring_base(v as u32).unwrap();
        self.q[v].raw.start(&mut self.fe, &self.ram, base).unwrap();
    }
}

#[test]
fn an_avail_index_jump_on_a_transmitq_stops_only_that_queue() {
    let mut rig = rig(0, "hx");
    let log = rig.log_len();
    rig.jump(1);
    // Frames keep coming from the wire meanwhile (the flows below).
    let got = rig.rx_flows();
    rig.check_cost(log, "transmitq avail index jump");
    // The pair's receiveq and the other pair go on.
    assert!(
        got[0] > 0 && got[1] > 0,
        "both receiveqs still receive: {got:?}"
    );
    rig.tx_ok(3);
    // Re-initialized by the frontend, the transmitq works again.
    rig.reinit(1);
    rig.tx_ok(1);
}

#[test]
fn an_avail_index_jump_on_a_receiveq_stops_only_that_queue() {
    let mut rig = rig(1, "hr");
    let log = rig.log_len();
    rig.jump(0);
    let before = rig.q[0].raw.ring.used_idx(&rig.ram);
    // The lender keeps sending frames of the flows that hash to pair 0: dropped.
    let got = rig.rx_flows();
    assert_eq!(got[0], 0, "the broken receiveq got frames");
    assert_eq!(rig.q[0].raw.ring.used_idx(&rig.ram), before);
    assert!(got[1] > 0, "the other pair's receiveq still receives");
    rig.check_cost(log, "receiveq avail index jump");
    // The pair's transmitq and the other pair go on.
    rig.tx_ok(1);
    rig.tx_ok(3);
    // Re-initialized, the receiveq receives again into the buffers still posted.
    rig.reinit(0);
    let got = rig.rx_flows();
    assert!(got[0] > 0, "the re-initialized receiveq receives: {got:?}");
}

#[test]
fn a_looping_chain_stops_the_queue_and_a_bad_frame_does_not() {
    let mut rig = rig(2, "hl");
    let log = rig.log_len();
    // Bad frames in well-formed chains: a 4-byte frame, a chain with only a writable
    // buffer. Returned, counted, and the queue goes on.
    let ram = &rig.ram;
    let q = &mut rig.q[1];
    let before = q.raw.ring.used_idx(ram);
    q.send(ram, &[1, 2, 3, 4]);
    let d = q.next % QUEUE_SIZE;
    q.raw
        .ring
        .set_desc(ram, d, buf_addr(1, q.next), 100, DESC_WRITE, 0);
    q.raw.ring.offer(ram, d);
    q.next = q.next.wrapping_add(1);
    q.raw.kick();
    let now = q
        .raw
        .ring
        .wait_used_change(ram, before, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(100));
    assert!(now.is_some(), "the bad frames were not returned");
    assert_eq!(q.raw.ring.used_idx(ram), before.wrapping_add(2));
    assert!(
        !q.raw.err_signalled(Duration::ZERO),
        "a bad frame broke the queue"
    );
    rig.tx_ok(1);
    // A chain whose second descriptor points back at the first.
    let ram = &rig.ram;
    let q = &mut rig.q[1];
    let used = q.raw.ring.used_idx(ram);
    let (a, b) = (q.next % QUEUE_SIZE, (q.next + 1) % QUEUE_SIZE);
    q.raw
        .ring
        .set_desc(ram, a, buf_addr(1, q.next), 12, DESC_NEXT, b);
    q.raw
        .ring
        .set_desc(ram, b, buf_addr(1, q.next + 1), 60, DESC_NEXT, a);
    q.raw.ring.offer(ram, a);
    q.next = q.next.wrapping_add(2);
    q.raw.kick();
    assert!(
        q.raw.err_signalled(Duration::from_secs(2)),
        "a looping chain did not signal the error eventfd"
    );
    assert_eq!(q.raw.ring.used_idx(ram), used);
    let got = rig.rx_flows();
    assert!(
        got[0] > 0 && got[1] > 0,
        "both receiveqs still receive: {got:?}"
    );
    rig.tx_ok(3);
    rig.check_cost(log, "looping chain");
    // GET_VRING_BASE names the looping chain as the next; the driver mends it and the
    // frontend starts the ring again there: it is sent, and what follows.
    let base = rig.fe.get_vring_base(1).unwrap();
    assert_eq!(
        base as u16,
        rig.q[1].raw.ring.avail_idx(&rig.ram).wrapping_sub(1)
    );
    let q = &rig.q[1];
    q.raw
        .ring
        .set_desc(&rig.ram, b, buf_addr(1, q.next - 1), 60, 0, 0);
    rig.q[1].raw.start(&mut rig.fe, &rig.ram, base).unwrap();
    rig.tx_ok(1);
}

/// A frontend that breaks a transmitq (avail index jump), stops it (GET_VRING_BASE)
/// and re-initializes it, five hundred times: the agent's log grows by a few KiB at most
/// (the broken-queue warning and the reset line are rate-limited per call site), and
/// the queue then works again.
#[test]
fn a_break_and_reset_loop_does_not_flood_the_log() {
    let mut rig = rig(3, "hf");
    let log = rig.log_len();
    for cycle in 0..500 {
        let ring = rig.q[1].raw.ring;
        let idx = ring.avail_idx(&rig.ram);
        ring.set_avail_idx(&rig.ram, idx.wrapping_add(40000));
        rig.q[1].raw.kick();
        assert!(
            rig.q[1].raw.err_signalled(Duration::from_secs(2)),
            "cycle {cycle}: the error eventfd was not signalled within 2 s"
        );
        ring.set_avail_idx(&rig.ram, idx);
        rig.reinit(1);
    }
    let text = rig.borrower.proc.log();
    let grown = text.len().saturating_sub(log);
    eprintln!("500 break/reset cycles: log +{grown} bytes");
    assert!(
        grown <= 2 * LOG_BUDGET,
        "the break/reset loop grew the log by {grown} bytes"
    );
    let after = rig.log_len();
    rig.check_cost(after, "break/reset loop");
    rig.tx_ok(1);
}

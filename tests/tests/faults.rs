//! Faults with real processes: the lender killed with SIGKILL and restarted in the middle
//! of a verified random-write workload, and the network between lender and borrower
//! cut (the lender in its own network namespace). The `blkio` crate's vhost-user-blk
//! frontend plays the guest: it checks every request's status and keeps a model of
//! every acknowledged write.

use std::path::Path;
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_tests::agents::{free_port, sparse_file, Borrower, Lender};
use devlend_tests::netns::Netns;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MIB: u64 = 1 << 20;
const DISK: u64 = 32 * MIB;
const BUF: usize = 4 * MIB as usize;

/// The frontend and the model of what the disk must hold.
struct Workload {
    c: BlkClient,
    model: Vec<u8>,
    /// Sectors whose content is undefined: a write to them failed (virtio leaves the
    /// data of a failed write undefined) and none succeeded since.
    unknown: Vec<bool>,
    rng: StdRng,
    acked_writes: u64,
}

impl Workload {
    fn new(sock: &Path, seed: u64) -> Self {
        Workload {
            c: BlkClient::connect(sock, 1, BUF).unwrap(),
            model: vec![0u8; DISK as usize],
            unknown: vec![false; (DISK / 512) as usize],
            rng: StdRng::seed_from_u64(seed),
            acked_writes: 0,
        }
    }

    /// One batch of up to 8 non-overlapping random writes in flight at once, then a
    /// flush now and then; returns the statuses.
    fn batch(&mut self) -> Vec<i32> {
        let n = self.rng.random_range(1..=8);
        let mut ops = Vec::new();
        let mut used: Vec<(u64, u64)> = Vec::new();
        let mut buf_off = 0usize;
        let mut pending = Vec::new();
        while ops.len() < n {
            let len = 512 * self.rng.random_range(1..=128u64);
            let off = 512 * self.rng.random_range(0..(DISK - len) / 512);
            if used.iter().any(|&(o, l)| off < o + l && o < off + len) {
                continue;
            }
            used.push((off, len));
            let range = buf_off..buf_off + len as usize;
            let rng = &mut self.rng;
            rng.fill(&mut self.c.buffer()[range.clone()]);
            pending.push((off as usize, range));
            ops.push(BlkOp::Write {
                offset: off,
                buf: buf_off,
                len: len as usize,
            });
            buf_off += len as usize;
        }
        if self.rng.random_range(0..4) == 0 {
            ops.push(BlkOp::Flush);
        }
        let results = self.c.run(0, &ops).unwrap();
        // Only what the device acknowledged goes into the model.
        for ((off, range), r) in pending.into_iter().zip(&results) {
            let len = range.len();
            let sectors = off / 512..(off + len) / 512;
            if *r == 0 {
                let data = self.c.buffer()[range].to_vec();
                self.model[off..off + len].copy_from_slice(&data);
                self.unknown[sectors].fill(false);
                self.acked_writes += 1;
            } else {
                self.unknown[sectors].fill(true);
            }
        }
        results
    }

    /// Reads the whole disk back and compares it with the model.
    fn verify(&mut self) {
        let chunk = MIB as usize;
        for i in 0..(DISK as usize / chunk) {
            let r = self
                .c
                .run_one(
                    0,
                    BlkOp::Read {
                        offset: (i * chunk) as u64,
                        buf: 0,
                        len: chunk,
                    },
                )
                .unwrap();
            assert_eq!(r, 0, "read of MiB {i} failed");
            for s in 0..chunk / 512 {
                let at = i * chunk + s * 512;
                if self.unknown[at / 512] {
                    continue;
                }
                assert!(
                    self.c.buffer()[s * 512..(s + 1) * 512] == self.model[at..at + 512],
                    "sector {} differs from the acknowledged writes",
                    at / 512
                );
            }
        }
    }
}

use devlend_tests::test_seed as seed;

fn counters(b: &Borrower) -> serde_json::Value {
    let list = b.cli_json(&["status"]).unwrap();
    list[0]["counters"].clone()
}

#[test]
fn lender_killed_and_restarted_five_times_mid_workload_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let spec = format!("disk0={}", img.display());
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let mut lender = Lender::start_on(dir.path(), &addr, std::slice::from_ref(&spec)).unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    borrower.attach(&addr, "disk0", &sock, 1).unwrap();
    let seed = seed();
    let mut w = Workload::new(&sock, seed);

    // The killer picks random moments; the workload runs meanwhile.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let killer_dir = dir.path().to_owned();
    let killer_addr = addr.clone();
    let killer = std::thread::spawn(move || {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(rng.random_range(200..900)));
            lender.proc.kill_hard();
            // Down for a moment: requests wait, then go to the new lender.
            std::thread::sleep(Duration::from_millis(rng.random_range(0..700)));
            lender =
                Lender::start_on(&killer_dir, &killer_addr, std::slice::from_ref(&spec)).unwrap();
        }
        let _ = tx.send(());
        lender
    });
    let t0 = Instant::now();
    let mut done = false;
    while !done {
        done = rx.try_recv().is_ok();
        let r = w.batch();
        assert!(
            r.iter().all(|&x| x == 0),
            "a request failed across a lender restart: {r:?} (after {:?})",
            t0.elapsed()
        );
    }
    let _lender = killer.join().unwrap();
    // A few more batches on the last lender, then everything must read back.
    for _ in 0..5 {
        assert!(w.batch().iter().all(|&x| x == 0));
    }
    w.verify();
    assert!(w.acked_writes > 50, "only {} writes", w.acked_writes);
    let c = counters(&borrower);
    assert_eq!(c["errors"], 0, "{c}");
    // Each kill is seen by the next request; two kills inside one reconnect backoff
    // are seen as one, so count at least one re-established session.
    assert!(c["reconnects"].as_u64().unwrap() >= 1, "{c}");
    // The lender's file holds the same bytes (SIGKILL loses no written page).
    drop(w);
    borrower
        .cli_json(&["detach", &sock.display().to_string()])
        .unwrap();
}

/// The lender in its own network namespace (number `n`, distinct per test), the
/// borrower here, attached with `deadline_s`; returns what the test needs.
fn remote_rig(
    n: u8,
    deadline_s: u32,
) -> (
    tempfile::TempDir,
    Netns,
    Lender,
    Borrower,
    std::path::PathBuf,
) {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let ns = Netns::new(n).unwrap();
    let addr = format!("{}:7700", ns.ns_ip);
    let lender = Lender::start_in(
        dir.path(),
        Some(&ns.name),
        &addr,
        &[format!("disk0={}", img.display())],
        &["--insecure".to_owned()],
    )
    .unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    let s = sock.display().to_string();
    let d = deadline_s.to_string();
    borrower
        .cli_json(&[
            "attach",
            "--lender",
            &addr,
            "--device",
            "disk0",
            "--socket",
            &s,
            "--reconnect-deadline",
            &d,
        ])
        .unwrap();
    (dir, ns, lender, borrower, sock)
}

#[test]
fn a_five_second_network_cut_is_a_delay_not_an_error() {
    let (_dir, ns, _lender, borrower, sock) = remote_rig(0, 30);
    let mut w = Workload::new(&sock, seed());
    for _ in 0..10 {
        assert!(w.batch().iter().all(|&x| x == 0));
    }
    ns.set_link(false).unwrap();
    let cut = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(5));
        ns.set_link(true).unwrap();
        ns
    });
    let t = Instant::now();
    // These batches are in flight while the link is down.
    while t.elapsed() < Duration::from_secs(7) {
        let r = w.batch();
        assert!(
            r.iter().all(|&x| x == 0),
            "I/O failed during a 5 s cut: {r:?}"
        );
    }
    let _ns = cut.join().unwrap();
    for _ in 0..10 {
        assert!(w.batch().iter().all(|&x| x == 0));
    }
    w.verify();
    assert_eq!(counters(&borrower)["errors"], 0);
}

#[test]
fn a_cut_longer_than_the_deadline_fails_with_ioerr_then_recovers() {
    let (_dir, ns, _lender, borrower, sock) = remote_rig(1, 2);
    let mut w = Workload::new(&sock, seed());
    for _ in 0..5 {
        assert!(w.batch().iter().all(|&x| x == 0));
    }
    ns.set_link(false).unwrap();
    let t = Instant::now();
    let r = w.batch();
    let failed_after = t.elapsed();
    assert!(
        r.iter().any(|&x| x != 0),
        "requests did not fail across a cut longer than the deadline"
    );
    // Detection (keepalive / TCP_USER_TIMEOUT, at most 15 s), the 2 s deadline, and a
    // reconnect attempt (up to its 3 s connect timeout), with room for a loaded machine.
    assert!(
        failed_after < Duration::from_secs(35),
        "IOERR came after {failed_after:?}"
    );
    ns.set_link(true).unwrap();
    // The agent recovers: new requests succeed once the link is back.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = w.batch();
        if r.iter().all(|&x| x == 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no recovery after the link came back"
        );
    }
    w.verify();
    let c = counters(&borrower);
    assert!(c["errors_fabric"].as_u64().unwrap() > 0, "{c}");
}

#[test]
fn detach_returns_within_seconds_while_the_lender_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let lender = Lender::start(dir.path(), &[format!("disk0={}", img.display())]).unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    borrower.attach(&lender.addr, "disk0", &sock, 1).unwrap();
    lender.proc.signal(libc::SIGSTOP);
    let t = Instant::now();
    let out = borrower.cli(&["detach", &sock.display().to_string()]);
    let took = t.elapsed();
    lender.proc.signal(libc::SIGCONT);
    assert!(out.unwrap().status.success());
    assert!(took < Duration::from_secs(10), "detach took {took:?}");
    assert!(!sock.exists());
}

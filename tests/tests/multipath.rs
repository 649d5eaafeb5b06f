//! Two paths to one lender: the lender in its own network namespace, reached over two
//! veth links (two addresses), the attachment given both. The `blkio` crate's
//! vhost-user-blk frontend rewrites the same blocks with increasing generations on two
//! virtqueues (one per path) while each link is cut in turn (the host's end set down:
//! no reset, a silent cut) and brought back, three rounds: no request fails, no batch
//! waits a second, each queue goes back to its own path once both are up, and the
//! lender's file holds every block at its last generation.
//! A queue kept busy all along still goes back to its own path; a path cut while idle
//! shows down. Under TLS every path is verified as the first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_tests::agents::{free_port, sparse_file, Borrower};
use devlend_tests::certs::Certs;
use devlend_tests::two_paths::TwoPathLender;
use devlend_tests::{metric_value, scrape_metrics};

const MIB: u64 = 1 << 20;
const DISK: u64 = 16 * MIB;
/// Blocks rewritten, each this long.
const BLOCKS: u64 = 8;
const BLOCK: usize = 64 << 10;

/// The lender on both of the namespace's addresses, and a borrower attached with both.
struct Rig {
    dir: tempfile::TempDir,
    lender: TwoPathLender,
    borrower: Borrower,
    paths: [String; 2],
    /// The compute agent's metrics address.
    metrics: String,
}

fn rig(n: u8) -> Rig {
    rig_with(n, &[])
}

/// As [`rig`], with `extra` arguments to `devlend attach`.
fn rig_with(n: u8, extra: &[&str]) -> Rig {
    rig_lending(n, "", extra)
}

/// As [`rig_with`], the lender's device given `options` after its path.
fn rig_lending(n: u8, options: &str, extra: &[&str]) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let lender = TwoPathLender::start_limited(n, dir.path(), &img, options).unwrap();
    let paths = lender.paths.clone();
    let metrics = format!("127.0.0.1:{}", free_port().unwrap());
    let borrower =
        Borrower::start_with(dir.path(), &["--metrics-listen".into(), metrics.clone()]).unwrap();
    let sock = dir.path().join("disk0.sock").display().to_string();
    let mut args = vec![
        "attach", "--lender", &paths[0], "--lender", &paths[1], "--device", "disk0", "--socket",
        &sock, "--queues", "2",
    ];
    args.extend_from_slice(extra);
    borrower.cli_json(&args).unwrap();
    Rig {
        dir,
        lender,
        borrower,
        paths,
        metrics,
    }
}

fn counters(b: &Borrower) -> serde_json::Value {
    b.cli_json(&["status"]).unwrap()[0]["counters"].clone()
}

/// Rewrites the blocks with generation 1, 2, ... (each batch on the other queue, all
/// blocks in flight at once; every 4th batch reads them back and checks them) until
/// `stop`; returns the last generation acknowledged and the longest batch.
fn rewrite(c: &mut BlkClient, stop: &AtomicBool) -> (u64, Duration) {
    let mut gen = 0u64;
    let mut longest = Duration::ZERO;
    while !stop.load(Ordering::Relaxed) {
        gen += 1;
        let q = (gen % 2) as usize;
        let mut ops = Vec::new();
        for b in 0..BLOCKS {
            let at = b as usize * BLOCK;
            let fill = block_bytes(b, gen);
            c.buffer()[at..at + BLOCK].copy_from_slice(&fill);
            ops.push(BlkOp::Write {
                offset: b * BLOCK as u64,
                buf: at,
                len: BLOCK,
            });
        }
        let t = Instant::now();
        let r = c.run(q, &ops).unwrap();
        longest = longest.max(t.elapsed());
        assert!(
            r.iter().all(|&s| s == 0),
            "generation {gen}: statuses {r:?}"
        );
        if gen.is_multiple_of(4) {
            let reads: Vec<BlkOp> = (0..BLOCKS)
                .map(|b| BlkOp::Read {
                    offset: b * BLOCK as u64,
                    buf: b as usize * BLOCK,
                    len: BLOCK,
                })
                .collect();
            let t = Instant::now();
            let r = c.run(1 - q, &reads).unwrap();
            longest = longest.max(t.elapsed());
            assert!(r.iter().all(|&s| s == 0), "read-back of {gen}: {r:?}");
            for b in 0..BLOCKS {
                let at = b as usize * BLOCK;
                assert!(
                    c.buffer()[at..at + BLOCK] == block_bytes(b, gen)[..],
                    "block {b} is not at generation {gen}"
                );
            }
        }
    }
    (gen, longest)
}

/// Checks that every block on the lender's file `img` is at generation `gen`.
fn assert_blocks_at(img: &std::path::Path, gen: u64) {
    let file = std::fs::read(img).unwrap();
    for b in 0..BLOCKS {
        let at = b as usize * BLOCK;
        assert!(
            file[at..at + BLOCK] == block_bytes(b, gen)[..],
            "block {b} on the lender's file is not at generation {gen}"
        );
    }
}

/// The content of block `b` at generation `gen`.
fn block_bytes(b: u64, gen: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    for (i, w) in v.chunks_mut(16).enumerate() {
        w[..8].copy_from_slice(&gen.to_le_bytes());
        w[8..].copy_from_slice(&(b << 32 | i as u64).to_le_bytes());
    }
    v
}

#[test]
fn silent_cuts_of_either_path_cost_under_a_second_and_no_error() {
    let r = rig(40);
    let sock = r.dir.path().join("disk0.sock");
    let mut c = BlkClient::connect(&sock, 2, BLOCKS as usize * BLOCK).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let out = rewrite(&mut c, &stop);
            (out, c)
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    let s = counters(&r.borrower);
    let paths = s["paths"].as_array().expect("two paths shown").clone();
    assert_eq!(paths.len(), 2, "{s}");
    for (p, want) in paths.iter().zip(&r.paths) {
        assert_eq!(p["addr"], want.as_str());
        assert_eq!(p["up"], true, "{s}");
        // One queue on each: both paths carry I/O while both are up.
        assert_eq!(p["sessions"], 1, "{s}");
    }
    for round in 0..3 {
        for link in 0..2 {
            let cut = |up| r.lender.set_link(link, up);
            cut(false).unwrap();
            std::thread::sleep(Duration::from_secs(2));
            let during = counters(&r.borrower);
            assert_eq!(
                during["paths"][link]["sessions"], 0,
                "round {round}: every queue left cut path {link}: {during}"
            );
            cut(true).unwrap();
            std::thread::sleep(Duration::from_millis(800));
        }
    }
    // Failback: both links up again, each queue goes back to its own path (the probe
    // finds the path reachable; the queue moves at an idle moment, a second or more
    // after it left).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = counters(&r.borrower);
        let back = (0..2).all(|i| s["paths"][i]["up"] == true && s["paths"][i]["sessions"] == 1);
        if back {
            break;
        }
        assert!(Instant::now() < deadline, "no failback: {s}");
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    let ((gen, longest), _c) = writer.join().expect("no request failed");
    eprintln!("{gen} generations; the longest batch took {longest:?}");
    let s = counters(&r.borrower);
    eprintln!("{s}");
    assert!(
        longest < Duration::from_secs(1),
        "a batch waited {longest:?} across a cut"
    );
    assert_eq!(s["errors"], 0, "{s}");
    assert!(
        s["failovers"].as_u64().unwrap() >= 6,
        "each of the six cuts moved a busy queue: {s}"
    );
    assert!(s["last_failover_us"].as_u64().unwrap() > 0, "{s}");
    let text = scrape_metrics(&r.metrics).unwrap();
    let failovers = metric_value(&text, "devlend_attachment_failovers_total{");
    assert_eq!(failovers, s["failovers"].as_f64(), "{text}");
    for p in &r.paths {
        let up = text.lines().find(|l| {
            l.starts_with("devlend_attachment_path_up{") && l.contains(&format!("path=\"{p}\""))
        });
        assert!(up.is_some_and(|l| l.ends_with(" 1")), "{p}: {text}");
    }
    // A live migration's handover names every path, and tells the destination to
    // attach with them all.
    let out = r.borrower.cli(&["migrate", "handover", "disk0"]).unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let both = format!("--lender {} --lender {} ", r.paths[0], r.paths[1]);
    assert!(text.contains(&both), "{text}");
    r.borrower
        .cli_json(&["migrate", "cancel", "disk0"])
        .unwrap();
    assert_blocks_at(&r.dir.path().join("disk0.img"), gen);
}

/// A path cut before the frontend connects costs its start one path connect timeout
/// (1 s), not one per queue; with every path cut, requests fail at the reconnect
/// deadline, not a connect timeout per path tried later; and they flow again once a
/// path is back.
#[test]
fn a_cut_path_delays_neither_the_frontend_start_nor_the_deadline() {
    let r = rig_with(42, &["--reconnect-deadline", "2"]);
    let sock = r.dir.path().join("disk0.sock");
    // Link 0 is cut before the frontend connects: the backend opens queue 0 (whose
    // path it is) on path 1 after one attempt, and queue 1 on path 1 at once.
    r.lender.set_link(0, false).unwrap();
    let t = Instant::now();
    let mut c = BlkClient::connect(&sock, 2, BLOCKS as usize * BLOCK).unwrap();
    let start = t.elapsed();
    eprintln!("the frontend started in {start:?} with path 0 cut");
    assert!(
        start < Duration::from_millis(2_500),
        "the frontend waited {start:?} for a cut path"
    );
    let write = |c: &mut BlkClient, q: usize| {
        c.buffer()[..BLOCK].fill(q as u8 + 1);
        c.run(
            q,
            &[BlkOp::Write {
                offset: 0,
                buf: 0,
                len: BLOCK,
            }],
        )
        .unwrap()[0]
    };
    for q in 0..2 {
        assert_eq!(write(&mut c, q), 0, "queue {q} over path 1");
    }
    let s = counters(&r.borrower);
    assert_eq!(s["paths"][0]["up"], false, "{s}");
    assert_eq!(s["paths"][1]["sessions"], 2, "{s}");
    // Both links cut: a write waits for the 2 s deadline, then fails.
    r.lender.set_link(1, false).unwrap();
    let t = Instant::now();
    let status = write(&mut c, 1);
    let waited = t.elapsed();
    eprintln!("with every path cut, the write failed after {waited:?}");
    assert_ne!(status, 0, "no path, yet the write succeeded");
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_millis(3_600),
        "IOERR after {waited:?} with a 2 s deadline"
    );
    // A path back: the writes flow again.
    r.lender.set_link(1, true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while write(&mut c, 1) != 0 {
        assert!(Instant::now() < deadline, "no path came back");
        std::thread::sleep(Duration::from_millis(100));
    }
    r.lender.set_link(0, true).unwrap();
}

/// Requests of queue 0 kept in flight at once by [`busy`].
const BUSY_DEPTH: usize = 4;
/// Each of them: a read this long.
const BUSY_READ: usize = 64 << 10;
/// The lender's limit on reads a second: each read waits its turn there (5 ms apart),
/// so the queue's requests complete one by one and it never falls idle by chance.
const BUSY_IOPS: u32 = 200;

/// Keeps [`BUSY_DEPTH`] reads in flight on queue 0 of `c`, each completion replaced at
/// once, until `stop`: the queue is never idle. Returns the reads completed; records
/// the longest wait for a completion in `longest` (which the caller may reset).
fn busy(c: &mut BlkClient, stop: &AtomicBool, longest: &std::sync::Mutex<Duration>) -> u64 {
    let mut qs = c.queue_ios();
    let q = &mut qs[0];
    let slots = (q.buffer_len() / BUSY_READ).min(BUSY_DEPTH);
    assert_eq!(slots, BUSY_DEPTH, "buffer too small");
    let read = |i: usize, n: u64| BlkOp::Read {
        offset: (n * BUSY_READ as u64) % DISK,
        buf: i * BUSY_READ,
        len: BUSY_READ,
    };
    let mut sent = 0u64;
    for i in 0..BUSY_DEPTH {
        q.submit(&read(i, sent), i).unwrap();
        sent += 1;
    }
    let mut done = 0u64;
    let mut comps = Vec::new();
    let mut last = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        comps.clear();
        q.complete(1, Duration::from_secs(30), &mut comps).unwrap();
        let gap = last.elapsed();
        last = Instant::now();
        {
            let mut l = longest.lock().unwrap();
            *l = (*l).max(gap);
        }
        for &(slot, ret) in &comps {
            assert_eq!(ret, 0, "read {done} failed");
            done += 1;
            q.submit(&read(slot, sent), slot).unwrap();
            sent += 1;
        }
    }
    // What is still in flight completes before the client goes.
    let mut left = BUSY_DEPTH;
    while left > 0 {
        comps.clear();
        q.complete(1, Duration::from_secs(30), &mut comps).unwrap();
        left -= comps.len();
    }
    done
}

/// A queue that never falls idle still goes back to its own path once that is up again:
/// it holds new requests back while those in flight complete (at most 50 ms), then
/// moves; the guest's requests wait for that and the new session, not for a second.
/// Then a path cut while idle shows down (the probe tries the paths that are up too),
/// and the idle queue on it leaves it before it sends there.
#[test]
fn a_busy_queue_moves_back_to_its_own_path_without_a_pause() {
    let r = rig_lending(44, &format!(",iops_read={BUSY_IOPS}"), &[]);
    let sock = r.dir.path().join("disk0.sock");
    let mut c = BlkClient::connect(&sock, 2, 2 * BUSY_DEPTH * BUSY_READ).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let longest = Arc::new(std::sync::Mutex::new(Duration::ZERO));
    let reader = {
        let (stop, longest) = (stop.clone(), longest.clone());
        std::thread::spawn(move || {
            let done = busy(&mut c, &stop, &longest);
            (done, c)
        })
    };
    let sessions = |s: &serde_json::Value| [0, 1].map(|i| s["paths"][i]["sessions"].clone());
    std::thread::sleep(Duration::from_millis(500));
    // Queue 0 lives on path 0; its link cut, it fails over to path 1.
    r.lender.set_link(0, false).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let s = counters(&r.borrower);
    assert_eq!(sessions(&s), [0, 2], "queue 0 failed over: {s}");
    r.lender.set_link(0, true).unwrap();
    *longest.lock().unwrap() = Duration::ZERO;
    let back = Instant::now();
    let deadline = back + Duration::from_secs(8);
    loop {
        let s = counters(&r.borrower);
        if sessions(&s) == [1, 1] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the busy queue did not move back to its own path: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "queue 0 moved back {:?} after its link came back",
        back.elapsed()
    );
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (done, mut c) = reader.join().expect("no read failed");
    let pause = *longest.lock().unwrap();
    let s = counters(&r.borrower);
    eprintln!(
        "{done} reads; the longest wait for a completion across the failback: {pause:?}; {s}"
    );
    assert!(
        pause < Duration::from_millis(300),
        "the failback paused the queue {pause:?}"
    );
    assert_eq!(s["errors"], 0, "{s}");
    assert_eq!(s["failovers"], 1, "a failback is not a failover: {s}");

    // Link 1 cut while nothing is in flight on it (queue 1 idle there): the probe shows
    // it down, within 5 s and a 1 s connect timeout, without counting a failure.
    let failures = s["paths"][1]["failures"].clone();
    r.lender.set_link(1, false).unwrap();
    let cut = Instant::now();
    let shown = loop {
        let s = counters(&r.borrower);
        if s["paths"][1]["up"] == false {
            break s;
        }
        assert!(
            cut.elapsed() < Duration::from_secs(8),
            "a path cut while idle still shows up: {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("idle path 1 shown down {:?} after its cut", cut.elapsed());
    assert_eq!(shown["paths"][1]["failures"], failures, "{shown}");
    // Queue 1 leaves it before sending its next request there: no session lost.
    c.buffer()[..4096].fill(7);
    let t = Instant::now();
    let st = c.run(
        1,
        &[BlkOp::Write {
            offset: 0,
            buf: 0,
            len: 4096,
        }],
    );
    assert_eq!(st.unwrap(), [0]);
    let s = counters(&r.borrower);
    eprintln!("queue 1's write took {:?} with its path cut", t.elapsed());
    assert_eq!(sessions(&s), [2, 0], "{s}");
    assert_eq!(
        s["paths"][1]["failures"], failures,
        "left before sending: {s}"
    );
    // Back: the probe shows it up again.
    r.lender.set_link(1, true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while counters(&r.borrower)["paths"][1]["up"] != true {
        assert!(Instant::now() < deadline, "path 1 not shown up again");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Queue 1 stays on path 0 (an idle queue gets no completion to move back at): no
    // session is on path 1 now, so only the probe can see it cut again.
    let s = counters(&r.borrower);
    assert_eq!(sessions(&s), [2, 0], "{s}");
    r.lender.set_link(1, false).unwrap();
    let cut = Instant::now();
    while counters(&r.borrower)["paths"][1]["up"] != false {
        assert!(
            cut.elapsed() < Duration::from_secs(8),
            "a path without sessions, cut, still shows up"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "path 1, without sessions, shown down {:?} after its cut",
        cut.elapsed()
    );
    r.lender.set_link(1, true).unwrap();
}

/// Under TLS every path is verified as the first: with link 0 cut, an attach whose
/// server name the lender's certificate does not carry is refused on path 1 too; with
/// the right name the rewrite runs over TLS sessions only (the lender refuses
/// plaintext) across a silent cut of each link, without an error or a pause of a
/// second, and every block ends at its last generation.
#[test]
fn under_tls_every_path_is_verified_and_a_cut_of_either_is_ridden_out() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(&dir.path().join("certs")).unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let lender =
        TwoPathLender::start_with_args(46, dir.path(), &img, &certs.lender_args(false)).unwrap();
    let paths = lender.paths.clone();
    let borrower = Borrower::start_with(dir.path(), &certs.borrower_args("ca.crt", None)).unwrap();
    let attach = |name: &str, sock: &str| {
        borrower
            .cli(&[
                "attach",
                "--lender",
                &paths[0],
                "--lender",
                &paths[1],
                "--device",
                "disk0",
                "--socket",
                sock,
                "--queues",
                "2",
                "--tls",
                "--tls-server-name",
                name,
                "--json",
            ])
            .unwrap()
    };
    lender.set_link(0, false).unwrap();
    let wrong = dir.path().join("wrong.sock").display().to_string();
    let out = attach("not-the-lender", &wrong);
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("attach with a wrong server name over path 1: {err}");
    assert!(
        !out.status.success(),
        "path 1 took a certificate without the name"
    );
    assert!(err.contains("certificate"), "{err}");
    lender.set_link(0, true).unwrap();

    let sock = dir.path().join("disk0.sock");
    let out = attach("localhost", &sock.display().to_string());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = borrower.cli_json(&["status"]).unwrap();
    assert_eq!(listed[0]["transport"], "tcp+tls", "{listed}");
    let mut c = BlkClient::connect(&sock, 2, BLOCKS as usize * BLOCK).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let out = rewrite(&mut c, &stop);
            (out, c)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    for link in 0..2 {
        lender.set_link(link, false).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        let during = counters(&borrower);
        lender.set_link(link, true).unwrap();
        assert_eq!(
            during["paths"][link]["sessions"], 0,
            "every queue left cut path {link}: {during}"
        );
        assert_eq!(during["paths"][1 - link]["sessions"], 2, "{during}");
        std::thread::sleep(Duration::from_millis(1500));
    }
    stop.store(true, Ordering::Relaxed);
    let ((gen, longest), _c) = writer.join().expect("no request failed");
    let s = counters(&borrower);
    eprintln!("under TLS: {gen} generations; the longest batch took {longest:?}; {s}");
    assert!(
        longest < Duration::from_secs(1),
        "a batch waited {longest:?} across a cut"
    );
    assert_eq!(s["errors"], 0, "{s}");
    assert!(s["failovers"].as_u64().unwrap() >= 2, "{s}");
    let log = lender.lender.log();
    assert!(!log.contains("plaintext connection refused"), "{log}");
    assert_blocks_at(&img, gen);
}

/// A borrower that vanishes without a word (its host cut off: no FIN, no RST) holds the
/// device on the lender only until the lender's keepalive finds it gone (probes after
/// 5 s of silence, 3 unanswered 2 s apart: about 11 s); then another borrower, reaching
/// the lender over the other link, gets it. (It took about 2 minutes with the lender's
/// keepalive of before: 60 s idle, 6 probes 10 s apart.)
#[test]
fn a_device_held_by_a_vanished_borrower_is_free_again_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let lender = TwoPathLender::start(48, dir.path(), &img).unwrap();
    let paths = lender.paths.clone();
    let start = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        Borrower::start(&d).unwrap()
    };
    let (a, b) = (start("a"), start("b"));
    let attach = |who: &Borrower, path: &str, name: &str| {
        let sock = dir
            .path()
            .join(format!("{name}.sock"))
            .display()
            .to_string();
        who.cli(&[
            "attach", "--lender", path, "--device", "disk0", "--socket", &sock, "--json",
        ])
        .unwrap()
    };
    let out = attach(&a, &paths[0], "a");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = attach(&b, &paths[1], "b");
    let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        !out.status.success() && err.contains("busy"),
        "b attached beside a: {err}"
    );
    // A's host vanishes from the lender's sight: link 0 cut for good.
    lender.set_link(0, false).unwrap();
    let cut = Instant::now();
    loop {
        let out = attach(&b, &paths[1], "b");
        if out.status.success() {
            break;
        }
        let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
        assert!(err.contains("busy"), "{err}");
        assert!(
            cut.elapsed() < Duration::from_secs(25),
            "the lender still holds the device for a borrower gone {:?}: {err}",
            cut.elapsed()
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    eprintln!(
        "another borrower got the device {:?} after its holder vanished",
        cut.elapsed()
    );
}

/// A path given by mistake that leads to another lender (another machine's key, a
/// device of the same name and size there) takes none of the guest's I/O, with no lender
/// key given: the holding session pins the key of the lender it reached, every other
/// session must prove it, and the queue whose own path that is works over the good one.
/// The wrong path stays marked down (30 s) instead of being tried at every failback.
#[test]
fn a_path_to_another_lender_takes_none_of_the_io() {
    const ONE: usize = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let lender = TwoPathLender::start(50, dir.path(), &img).unwrap();
    let other_img = dir.path().join("other.img");
    sparse_file(&other_img, DISK).unwrap();
    let (_other, other_addr) = lender
        .start_other(dir.path(), 7800, &format!("disk0={}", other_img.display()))
        .unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    let sock_s = sock.display().to_string();
    borrower
        .cli_json(&[
            "attach",
            "--lender",
            &lender.paths[0],
            "--lender",
            &other_addr,
            "--device",
            "disk0",
            "--socket",
            &sock_s,
            "--queues",
            "2",
        ])
        .unwrap();
    let mut c = BlkClient::connect(&sock, 2, ONE).unwrap();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        for q in 0..2usize {
            let at = q as u64 * ONE as u64;
            c.buffer().fill(q as u8 + 1);
            let st = c.run(
                q,
                &[BlkOp::Write {
                    offset: at,
                    buf: 0,
                    len: ONE,
                }],
            );
            assert_eq!(st.unwrap(), [0], "queue {q}");
        }
    }
    let s = counters(&borrower);
    eprintln!("{s}");
    assert_eq!(s["paths"][1]["up"], false, "{s}");
    assert_eq!(
        s["paths"][0]["sessions"], 2,
        "both queues on the good path: {s}"
    );
    assert_eq!(s["paths"][1]["failures"], 1, "tried once, then rested: {s}");
    assert!(
        std::fs::read(&other_img).unwrap().iter().all(|&b| b == 0),
        "the other lender's disk was written"
    );
    let file = std::fs::read(&img).unwrap();
    for q in 0..2usize {
        let at = q * ONE;
        assert!(
            file[at..at + ONE].iter().all(|&b| b == q as u8 + 1),
            "queue {q}'s write is not on the lender's file"
        );
    }
}

//! TLS between real agents: a lender with `--tls-cert/--tls-key` (and
//! `--tls-client-ca`), compute agents with `--tls-ca` (and a client certificate),
//! attachments made with `devlend attach --tls`, I/O through the `blkio` frontend.
//! Certificates are made fresh for each test (`devlend_tests::certs`).

use std::path::Path;
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_tests::agents::{free_port, sparse_file, Borrower, Lender};
use devlend_tests::certs::Certs;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MIB: u64 = 1 << 20;
const DISK: u64 = 16 * MIB;

struct Rig {
    dir: tempfile::TempDir,
    certs: Certs,
    img: std::path::PathBuf,
    addr: String,
}

impl Rig {
    fn new() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let certs = Certs::make(&dir.path().join("certs")).unwrap();
        let img = dir.path().join("disk0.img");
        sparse_file(&img, DISK).unwrap();
        let addr = format!("127.0.0.1:{}", free_port().unwrap());
        Rig {
            dir,
            certs,
            img,
            addr,
        }
    }

    fn spec(&self) -> String {
        format!("disk0={}", self.img.display())
    }

    fn lender(&self, client_ca: bool) -> Lender {
        Lender::start_with(
            self.dir.path(),
            &self.addr,
            &[self.spec()],
            &self.certs.lender_args(client_ca),
        )
        .unwrap()
    }

    fn borrower(&self, name: &str, extra: &[String]) -> Borrower {
        let d = self.dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        Borrower::start_with(&d, extra).unwrap()
    }

    fn sock(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(format!("{name}.sock"))
    }
}

/// `devlend attach` of disk0, with `--tls` when `tls`.
fn attach(b: &Borrower, lender: &str, sock: &Path, queues: u16, tls: bool) -> std::process::Output {
    let s = sock.display().to_string();
    let q = queues.to_string();
    let mut args = vec![
        "attach", "--lender", lender, "--device", "disk0", "--socket", &s, "--queues", &q, "--json",
    ];
    if tls {
        args.push("--tls");
    }
    b.cli(&args).unwrap()
}

fn attach_ok(b: &Borrower, lender: &str, sock: &Path, queues: u16) {
    let out = attach(b, lender, sock, queues, true);
    assert!(
        out.status.success(),
        "attach failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits until `log()` contains `what` (the lender logs a refusal after the borrower
/// already got it).
fn wait_log(log: impl Fn() -> String, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let l = log();
        if l.contains(what) || Instant::now() > deadline {
            return l;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes a distinct pattern through each queue, reads each back through another
/// queue, compares; returns the patterns by offset.
fn verified_io(c: &mut BlkClient, queues: usize) {
    let chunk = 256 * 1024;
    for round in 0..4u8 {
        for q in 0..queues {
            let off = (round as u64 * queues as u64 + q as u64) * chunk as u64;
            let seed = round.wrapping_mul(31).wrapping_add(q as u8);
            for (i, b) in c.buffer()[..chunk].iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(7) ^ seed;
            }
            let r = c
                .run(
                    q,
                    &[
                        BlkOp::Write {
                            offset: off,
                            buf: 0,
                            len: chunk,
                        },
                        BlkOp::Flush,
                    ],
                )
                .unwrap();
            assert_eq!(r, vec![0, 0], "write on queue {q}");
            c.buffer()[..chunk].fill(0);
            let r = c
                .run_one(
                    (q + 1) % queues,
                    BlkOp::Read {
                        offset: off,
                        buf: 0,
                        len: chunk,
                    },
                )
                .unwrap();
            assert_eq!(r, 0, "read on queue {}", (q + 1) % queues);
            for (i, b) in c.buffer()[..chunk].iter().enumerate() {
                assert_eq!(*b, (i as u8).wrapping_mul(7) ^ seed, "byte {i} at {off}");
            }
        }
    }
}

#[test]
fn verified_io_through_blkio_over_tls_on_several_queues() {
    let rig = Rig::new();
    let lender = rig.lender(false);
    let b = rig.borrower("b", &rig.certs.borrower_args("ca.crt", None));
    let sock = rig.sock("disk0");
    attach_ok(&b, &lender.addr, &sock, 3);
    let mut c = BlkClient::connect(&sock, 3, MIB as usize).unwrap();
    verified_io(&mut c, 3);
    drop(c);
    let st = b.cli_json(&["status"]).unwrap();
    assert_eq!(st[0]["counters"]["errors"], 0, "{st}");
    // What the guest wrote is on the lender's file.
    let f = std::fs::read(&rig.img).unwrap();
    assert_eq!(f[1], 7, "first written chunk");
    b.cli_json(&["detach", &sock.display().to_string()])
        .unwrap();
    let log = lender.proc.log();
    assert!(log.contains("TLS 1.3 only"), "{log}");
    assert!(log.contains("session opened"), "{log}");
    assert!(!log.contains("TLS handshake failed"), "{log}");
}

#[test]
fn a_borrower_trusting_another_ca_is_refused_and_the_lender_logs_it() {
    let rig = Rig::new();
    let lender = rig.lender(false);
    let b = rig.borrower("b", &rig.certs.borrower_args("other-ca.crt", None));
    let sock = rig.sock("disk0");
    let out = attach(&b, &lender.addr, &sock, 1, true);
    assert!(
        !out.status.success(),
        "attached through an untrusted lender"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("devlend attach: {err}");
    assert!(
        err.contains(&format!("TLS with lender at {}", lender.addr))
            && err.contains("not signed by a trusted CA"),
        "{err}"
    );
    assert!(!sock.exists());
    let log = wait_log(|| lender.proc.log(), "TLS handshake failed");
    assert!(
        log.contains("TLS handshake failed") && log.contains("does not trust"),
        "{log}"
    );
    assert!(!log.contains("session opened"), "{log}");
}

#[test]
fn a_plaintext_borrower_is_refused_logged_and_never_reaches_the_device() {
    let rig = Rig::new();
    let lender = rig.lender(false);
    // A compute agent that could do TLS, and one that could not: both attach in plaintext.
    for (name, extra) in [
        ("tls-capable", rig.certs.borrower_args("ca.crt", None)),
        ("plain", Vec::new()),
    ] {
        let b = rig.borrower(name, &extra);
        let sock = rig.sock(name);
        let out = attach(&b, &lender.addr, &sock, 1, false);
        assert!(!out.status.success(), "{name}: attached in plaintext");
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!("{name}: devlend attach: {err}");
        assert!(err.contains("requires TLS"), "{name}: {err}");
        assert!(!sock.exists());
    }
    // And a plaintext attach asking for TLS on an agent without trust anchors: refused
    // by the compute agent itself.
    let b = rig.borrower("no-ca", &[]);
    let out = attach(&b, &lender.addr, &rig.sock("no-ca"), 1, true);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--tls-ca"), "{err}");
    let log = wait_log(|| lender.proc.log(), "plaintext connection refused");
    assert!(log.contains("plaintext connection refused"), "{log}");
    assert!(!log.contains("session opened"), "{log}");
    assert!(std::fs::read(&rig.img).unwrap().iter().all(|&b| b == 0));
}

#[test]
fn mutual_tls_refuses_a_borrower_without_a_client_certificate() {
    let rig = Rig::new();
    let lender = rig.lender(true);
    for (name, identity, why) in [
        ("anonymous", None, "requires a client certificate"),
        ("stranger", Some("stranger"), "does not trust"),
    ] {
        let b = rig.borrower(name, &rig.certs.borrower_args("ca.crt", identity));
        let sock = rig.sock(name);
        let out = attach(&b, &lender.addr, &sock, 1, true);
        assert!(!out.status.success(), "{name}: attached");
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!("{name}: devlend attach: {err}");
        assert!(err.contains(why), "{name}: {err}");
        assert!(!sock.exists());
    }
    let log = wait_log(|| lender.proc.log(), "not signed by a trusted CA");
    assert!(
        log.contains("no certificate") && log.contains("not signed by a trusted CA"),
        "{log}"
    );
    assert!(!log.contains("session opened"), "{log}");
    // With the client certificate: attached, and I/O works.
    let b = rig.borrower("good", &rig.certs.borrower_args("ca.crt", Some("borrower")));
    let sock = rig.sock("good");
    attach_ok(&b, &lender.addr, &sock, 2);
    let mut c = BlkClient::connect(&sock, 2, MIB as usize).unwrap();
    verified_io(&mut c, 2);
}

#[test]
fn a_lender_killed_and_restarted_under_tls_is_ridden_out() {
    let rig = Rig::new();
    let lender = rig.lender(false);
    let b = rig.borrower("b", &rig.certs.borrower_args("ca.crt", None));
    let sock = rig.sock("disk0");
    attach_ok(&b, &lender.addr, &sock, 2);
    let mut c = BlkClient::connect(&sock, 2, 4 * MIB as usize).unwrap();
    let seed = devlend_tests::test_seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model = vec![0u8; DISK as usize];

    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (dir, addr, spec, args) = (
        rig.dir.path().to_owned(),
        rig.addr.clone(),
        rig.spec(),
        rig.certs.lender_args(false),
    );
    let killer = std::thread::spawn(move || {
        let mut lender = lender;
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(rng.random_range(200..800)));
            lender.proc.kill_hard();
            std::thread::sleep(Duration::from_millis(rng.random_range(0..500)));
            lender = Lender::start_with(&dir, &addr, std::slice::from_ref(&spec), &args).unwrap();
        }
        let _ = tx.send(());
        lender
    });
    let mut writes = 0u64;
    let mut done = false;
    while !done {
        done = rx.try_recv().is_ok();
        // Up to 8 writes in flight on a random queue, at distinct random offsets.
        let q = rng.random_range(0..2usize);
        let mut ops = Vec::new();
        let mut spans: Vec<(usize, usize, usize)> = Vec::new();
        let mut buf = 0usize;
        for _ in 0..rng.random_range(1..=8) {
            let len = 512 * rng.random_range(1..=128usize);
            let off = 512 * rng.random_range(0..(DISK as usize - len) / 512);
            if spans.iter().any(|&(o, l, _)| off < o + l && o < off + len) {
                continue;
            }
            rng.fill(&mut c.buffer()[buf..buf + len]);
            ops.push(BlkOp::Write {
                offset: off as u64,
                buf,
                len,
            });
            spans.push((off, len, buf));
            buf += len;
        }
        let r = c.run(q, &ops).unwrap();
        assert!(
            r.iter().all(|&x| x == 0),
            "a request failed across a TLS lender restart: {r:?}"
        );
        for (off, len, buf) in spans {
            model[off..off + len].copy_from_slice(&c.buffer()[buf..buf + len]);
            writes += 1;
        }
    }
    let lender = killer.join().unwrap();
    for i in 0..(DISK / MIB) as usize {
        let r = c
            .run_one(
                i % 2,
                BlkOp::Read {
                    offset: (i as u64) * MIB,
                    buf: 0,
                    len: MIB as usize,
                },
            )
            .unwrap();
        assert_eq!(r, 0);
        assert!(
            c.buffer()[..MIB as usize] == model[i * MIB as usize..(i + 1) * MIB as usize],
            "MiB {i} differs from the acknowledged writes"
        );
    }
    assert!(writes > 30, "only {writes} writes");
    let st = b.cli_json(&["status"]).unwrap();
    let counters = &st[0]["counters"];
    assert_eq!(counters["errors"], 0, "{st}");
    assert!(counters["reconnects"].as_u64().unwrap() >= 1, "{st}");
    drop(c);
    b.cli_json(&["detach", &sock.display().to_string()])
        .unwrap();
    assert!(lender.proc.log().contains("session opened"));
}

#[test]
fn a_tls_attachment_is_served_again_over_tls_after_a_compute_agent_restart() {
    let rig = Rig::new();
    let lender = rig.lender(true);
    let args = rig.certs.borrower_args("ca.crt", Some("borrower"));
    let mut b = rig.borrower("b", &args);
    let sock = rig.sock("disk0");
    attach_ok(&b, &lender.addr, &sock, 2);
    b.proc.kill_hard();
    // The saved attachment asked for TLS: the restarted agent opens its sessions inside
    // TLS again, with its client certificate (the lender requires one).
    let d = rig.dir.path().join("b");
    let b = Borrower::start_named(&d, "compute-agent-2", &args).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while b
        .cli_json(&["status"])
        .unwrap()
        .as_array()
        .is_none_or(|a| a.is_empty())
    {
        assert!(Instant::now() < deadline, "not restored:\n{}", b.proc.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut c = BlkClient::connect(&sock, 2, MIB as usize).unwrap();
    verified_io(&mut c, 2);
    drop(c);
    let st = b.cli_json(&["status"]).unwrap();
    assert_eq!(st[0]["counters"]["errors"], 0, "{st}");
    assert!(
        !lender.proc.log().contains("TLS handshake failed"),
        "{}",
        lender.proc.log()
    );
}

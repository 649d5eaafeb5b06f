//! The block data path under deep load never stalls: one attachment with 2 queues,
//! driven by libblkio with queue size 1024 (`devlend stress`), through a matrix of 54
//! cells: 1 and 2 queues; 4 KiB, 64 KiB and 1 MiB requests; reads, writes and a 50/50
//! mix; 32, 128 and 256 in flight per queue. Every cell must keep completing (no queue
//! 5 s without a completion), fail no request, and verify after it; the borrower must
//! not have lost a session on the way. Over TCP and over TLS here; over RDMA in the
//! Soft-RoCE guest (`guest_rdma.rs`).
//!
//! Before the credit flow control, the mixed 1 MiB cells with 128 and 256 in flight
//! stopped completing: the borrower's worker blocked in a socket write while holding its
//! queue, and the lender, its request budget spent, stopped reading (a circular wait).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use devlend_tests::agents::{bin, free_port, sparse_file, Borrower, Lender};
use devlend_tests::certs::Certs;

const DISK: u64 = 256 << 20;
/// The whole matrix takes about a minute; far longer means it stalled somewhere.
const MATRIX_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs the full matrix on `sock`; returns its output, or panics with it.
fn stress(sock: &Path) -> String {
    let mut child = Command::new(bin("devlend").unwrap())
        .args(["stress", "--socket"])
        .arg(sock)
        .args([
            "--queue-size",
            "1024",
            "--cell-ms",
            "1000",
            "--stall-ms",
            "5000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t.elapsed() > MATRIX_TIMEOUT {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    match status {
        None => panic!("the matrix hung for {MATRIX_TIMEOUT:?}:\n{text}"),
        Some(s) => assert!(s.success(), "a cell failed:\n{text}"),
    }
    assert!(text.contains("stress: 54 cells passed"), "{text}");
    eprintln!("matrix took {:.1} s", t.elapsed().as_secs_f64());
    text
}

fn check_counters(b: &Borrower, lender: &Lender) {
    let status = b.cli_json(&["status"]).unwrap();
    let c = &status[0]["counters"];
    assert_eq!(c["errors"], 0, "{status}");
    assert_eq!(
        c["reconnects"],
        0,
        "a fabric session was lost under load: {status}\n{}",
        b.proc.log()
    );
    let log = lender.proc.log();
    assert!(!log.contains("protocol error"), "{log}");
}

#[test]
fn deep_mixed_load_keeps_completing_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let lender = Lender::start(dir.path(), &[format!("disk0={}", img.display())]).unwrap();
    let b = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    b.attach(&lender.addr, "disk0", &sock, 2).unwrap();
    stress(&sock);
    check_counters(&b, &lender);
}

#[test]
fn deep_mixed_load_keeps_completing_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(&dir.path().join("certs")).unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK).unwrap();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let lender = Lender::start_with(
        dir.path(),
        &addr,
        &[format!("disk0={}", img.display())],
        &certs.lender_args(false),
    )
    .unwrap();
    let bdir = dir.path().join("b");
    std::fs::create_dir_all(&bdir).unwrap();
    let b = Borrower::start_with(&bdir, &certs.borrower_args("ca.crt", None)).unwrap();
    let sock = dir.path().join("disk0.sock");
    let s = sock.display().to_string();
    let out = b
        .cli(&[
            "attach", "--lender", &addr, "--device", "disk0", "--socket", &s, "--queues", "2",
            "--tls", "--json",
        ])
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stress(&sock);
    check_counters(&b, &lender);
}

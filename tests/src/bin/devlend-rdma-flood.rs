//! `devlend-rdma-flood --lender IP:PORT --from IP --count N --hold-secs S`: opens N
//! rdma_cm connections to a lender from the local address `--from`, one after the
//! other, and never sends a hello on any of them (half-open sessions, as a flood would
//! leave them); keeps those the lender accepted for `--hold-secs`, then exits. Prints
//! `DEVLEND-RESULT flood_established=E`, `flood_rejected=R` (rejected or failed) and
//! `flood_secs=S` (how long the N attempts took, rounded up),
//! for the test of the lender's handshake caps over RDMA (`tests/tests/guest_rdma.rs`).
//! It is a test tool, not part of devlend.
//!
//! Its connections are shaped for a handshake only (4 buffers of 2 KiB each way, 16 KiB
//! registered), not as a borrower's session (about 6 MiB): it holds every connection
//! the lender took until it exits, and a few hundred sessions' buffers were enough to
//! have it killed for memory in the test's guest before it printed anything.

use std::time::Duration;

use devlend_fabric::rdma::verbs::{open_connection, Shape};
use devlend_fabric::rdma::MAX_HANDSHAKE_MSG;

/// Enough for a hello and its replies; the flood never sends one.
const HANDSHAKE_ONLY: Shape = Shape {
    send: (4, MAX_HANDSHAKE_MSG),
    recv: (4, MAX_HANDSHAKE_MSG),
    send_wr: 8,
};

fn main() {
    let (mut lender, mut from, mut count, mut hold) = (String::new(), None, 1000u32, 5u64);
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_default();
        match k.as_str() {
            "--lender" => lender = v,
            "--from" => from = Some(v),
            "--count" => count = v.parse().unwrap_or(count),
            "--hold-secs" => hold = v.parse().unwrap_or(hold),
            _ => {
                eprintln!("usage: devlend-rdma-flood --lender IP:PORT [--from IP] [--count N] [--hold-secs S]");
                std::process::exit(2);
            }
        }
    }
    let started = std::time::Instant::now();
    let mut open = Vec::new();
    let mut rejected = 0u32;
    let mut last_error = String::new();
    for _ in 0..count {
        match open_connection(
            from.as_deref(),
            &lender,
            HANDSHAKE_ONLY,
            Duration::from_secs(2),
        ) {
            Ok(c) => open.push(c),
            Err(e) => {
                rejected += 1;
                last_error = e.to_string();
            }
        }
    }
    println!("DEVLEND-RESULT flood_established={}", open.len());
    println!("DEVLEND-RESULT flood_rejected={rejected}");
    println!(
        "DEVLEND-RESULT flood_secs={}",
        started.elapsed().as_secs_f64().ceil() as u64
    );
    if !last_error.is_empty() {
        eprintln!("flood: last refusal: {last_error}");
    }
    std::thread::sleep(Duration::from_secs(hold));
}

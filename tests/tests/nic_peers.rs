//! A lent NIC facing bad borrowers, without a guest: the lender lends one end of a veth
//! pair (the other end a peer host in its own namespace) and the test speaks the frame
//! protocol to it directly.
//!
//! - A good session gets the interface's LINK message first, and a frame it sends
//!   reaches the peer's interface (its receive counter grows).
//! - Malformed messages close that session, with the reason logged, and the lender
//!   serves the next one: a frame longer than the limit, an unknown kind, non-zero
//!   reserved bytes, a frame shorter than an Ethernet header, an offloaded frame
//!   without the offload feature granted.
//! - A borrower that stops in the middle of a message is closed after the frame
//!   timeout (30 s) rather than holding its queue pair for ever.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::Result;
use devlend_fabric::net::{
    decode, encode_frame, header, NetMessage, FEATURE_NET, KIND_FRAME, KIND_FRAME_OFFLOAD,
    MAX_FRAME_LEN, NET_HEADER_LEN,
};
use devlend_fabric::{Hello, HelloStatus};
use devlend_tests::agents::{free_port, Lender};
use devlend_tests::lan::PeerLan;
use devlend_tests::netns::Netns;

/// Opens a queue-pair session (pair 0) as borrower `id`.
fn session(addr: &str, id: u8) -> TcpStream {
    let mut hello = Hello::new("nic0", 0);
    hello.features = FEATURE_NET;
    hello.borrower = [id; 16];
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        match devlend_fabric::tcp::connect_as(addr, &hello, Duration::from_secs(5)) {
            Ok((s, r)) if r.status == HelloStatus::Ok => return s,
            Ok((_, r)) if Instant::now() < until => {
                eprintln!("session refused: {:?} {}", r.status, r.message);
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(e) if Instant::now() < until => {
                eprintln!("connect: {e}");
                std::thread::sleep(Duration::from_millis(300));
            }
            other => panic!("session: {other:?}"),
        }
    }
}

/// Reads until the lender closes the connection (or `limit` passes); the time it took.
fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    let mut buf = [0u8; 65536];
    while start.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(start.elapsed()),
        }
    }
    None
}

/// The peer interface's received packets.
fn peer_rx_packets(lan: &PeerLan) -> u64 {
    let path = format!("/sys/class/net/{}/statistics/rx_packets", lan.peer_if);
    lan.exec(&["cat", &path])
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// A broadcast frame from a made-up MAC (an Ethernet header and 46 bytes).
fn frame() -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0x00, 0x00, 0x00, 0x00, 0x42]);
    f.extend_from_slice(&[0x88, 0xb5]); // local experimental EtherType
    f.extend_from_slice(&[0x5a; 46]);
    f
}

/// A lender in fabric namespace `n` lending `nic0`, one end of a veth pair whose other
/// end is a peer host (10.78.n.2/24) in its own namespace; `options` follow the
/// interface in the device flag (e.g. `,tx_pps=200`).
fn lent_nic(dir: &std::path::Path, n: u8, options: &str) -> Result<(Netns, PeerLan, Lender)> {
    let fabric = Netns::new(n)?;
    let tag = format!("n{n}{}", std::process::id() % 100_000);
    let lan = PeerLan::new(&tag, &fabric.name, &format!("10.78.{n}.2/24"), 1500)?;
    let addr = format!("{}:{}", fabric.ns_ip, free_port()?);
    let device = format!("nic0=net:{}{options}", lan.lent_if);
    let lender = Lender::start_in(
        dir,
        Some(&fabric.name),
        &addr,
        std::slice::from_ref(&device),
        &["--insecure".to_owned()],
    )?;
    Ok((fabric, lan, lender))
}

#[test]
fn a_lent_nic_closes_bad_sessions_and_serves_the_next() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (_fabric, lan, mut lender) = lent_nic(dir.path(), 1, "")?;
    let addr = lender.addr.clone();

    // A good session: the LINK message first, then a frame out to the peer.
    let mut good = session(&addr, 1);
    good.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut buf = vec![0u8; 64];
    let mut got = 0;
    while got < NET_HEADER_LEN + 16 {
        let n = good.read(&mut buf[got..])?;
        assert!(n > 0, "the lender closed a good session");
        got += n;
    }
    match decode(&buf[..got])? {
        Some((NetMessage::Link(l), _)) => {
            assert_eq!(l.mtu, 1500, "the lent interface's MTU")
        }
        other => panic!("first message {other:?}, not LINK"),
    }
    let before = peer_rx_packets(&lan);
    let mut out = Vec::new();
    for _ in 0..5 {
        encode_frame(&frame(), &mut out);
    }
    good.write_all(&out)?;
    let until = Instant::now() + Duration::from_secs(10);
    while peer_rx_packets(&lan) < before + 5 {
        assert!(
            Instant::now() < until,
            "the peer received {} of the 5 frames",
            peer_rx_packets(&lan) - before
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(good);
    // The peer's counter may also count the kernel's own packets; the lender's says
    // exactly what it sent for borrowers.
    let until = Instant::now() + Duration::from_secs(10);
    while !lender.proc.log().contains("tx_packets=5") {
        assert!(
            Instant::now() < until,
            "the lender counts the 5 frames sent:\n{}",
            lender.proc.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Malformed messages: each closes its session.
    let too_long = header(KIND_FRAME, (MAX_FRAME_LEN + 1) as u32).to_vec();
    let unknown = header(0x7f, 4).iter().chain(&[0u8; 4]).copied().collect();
    let mut reserved = header(KIND_FRAME, 60).to_vec();
    reserved[2] = 1;
    reserved.extend_from_slice(&[0; 60]);
    let short = header(KIND_FRAME, 4)
        .iter()
        .chain(&[0u8; 4])
        .copied()
        .collect();
    let mut offload = header(KIND_FRAME_OFFLOAD, 10 + 60).to_vec();
    offload.extend_from_slice(&[0; 70]);
    let cases: [(&str, Vec<u8>); 5] = [
        ("a frame over the length limit", too_long),
        ("an unknown kind", unknown),
        ("non-zero reserved bytes", reserved),
        ("a frame shorter than an Ethernet header", short),
        ("an offloaded frame without the offload feature", offload),
    ];
    for (k, (what, bytes)) in cases.into_iter().enumerate() {
        let mut s = session(&addr, 10 + k as u8);
        s.write_all(&bytes)?;
        assert!(
            closed_within(&mut s, Duration::from_secs(10)).is_some(),
            "{what}: the session stays open"
        );
    }
    let log = lender.proc.log();
    let errors = log.matches("protocol error").count();
    assert!(
        errors >= 5,
        "every malformed session is closed with a reason logged ({errors}):\n{log}"
    );

    // A borrower stalled mid-message: closed after the frame timeout.
    let mut stalled = session(&addr, 30);
    let mut partial = header(KIND_FRAME, 100).to_vec();
    partial.extend_from_slice(&[0; 4]);
    stalled.write_all(&partial)?;
    let waited = closed_within(&mut stalled, Duration::from_secs(90));
    assert!(
        waited.is_some_and(|w| w >= Duration::from_secs(20)),
        "a stalled session is closed after the frame timeout (30 s): {waited:?}"
    );

    // And the lender still lends the NIC.
    let mut again = session(&addr, 1);
    again.set_read_timeout(Some(Duration::from_secs(10)))?;
    let n = again.read(&mut buf)?;
    assert!(n > 0, "a new session after all that gets its LINK message");
    lender.proc.check_alive()?;
    Ok(())
}

/// The interface counter `key=N` of the lender's last "frames stopped" line.
fn last_count(log: &str, key: &str) -> Option<u64> {
    let line = log.lines().rev().find(|l| l.contains("frames stopped"))?;
    let at = line.find(&format!("{key}="))? + key.len() + 1;
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// A lender's own NIC limit (`tx_pps=200,tx_pps_burst=20`): a borrower that sends 1000
/// frames a second for 2 s gets about 20 + 2 × 200 of them onto the wire; the rest
/// are dropped and counted, and the session stays up (a policer, docs/qos.md).
#[test]
fn a_lent_nic_polices_the_frames_a_borrower_sends_beyond_its_limit() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (_fabric, _lan, lender) = lent_nic(dir.path(), 2, ",tx_pps=200,tx_pps_burst=20")?;
    let addr = lender.addr.clone();
    let mut s = session(&addr, 1);
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        // 10 frames every 10 ms.
        let mut out = Vec::new();
        for _ in 0..10 {
            encode_frame(&frame(), &mut out);
        }
        s.write_all(&out)?;
        sent += 10;
        std::thread::sleep(Duration::from_millis(10));
    }
    let secs = start.elapsed().as_secs_f64();
    drop(s);
    let until = Instant::now() + Duration::from_secs(10);
    let (passed, drops) = loop {
        let log = lender.proc.log();
        if let (Some(p), Some(d)) = (last_count(&log, "tx_packets"), last_count(&log, "drops")) {
            break (p, d);
        }
        assert!(Instant::now() < until, "no counters logged:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let want = 20.0 + 200.0 * secs;
    eprintln!("sent {sent} in {secs:.2} s, {passed} passed (about {want:.0}), {drops} dropped");
    assert!(
        (passed as f64 - want).abs() <= want * 0.15,
        "{passed} frames passed, the limit allows about {want:.0}"
    );
    assert_eq!(
        passed + drops,
        sent,
        "every frame either passed or was dropped"
    );
    Ok(())
}

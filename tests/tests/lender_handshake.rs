//! A peer that stalls in a lender's handshake costs itself, not the lender (issue 23's
//! trial): a hello sent a byte at a time is closed at the handshake timeout (10 s from
//! the connect, whatever it keeps sending), at most 64 connections from one address are
//! in their handshake at once (one more is closed at accept, while another address is
//! served), and once the stalled ones are gone their address is served again. Before,
//! each read had its own 10 s, so a byte every few seconds kept a connection, and its
//! thread and descriptors, for ever, and any number of them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::FromRawFd;
use std::time::{Duration, Instant};

use devlend_fabric::{Hello, HelloReply, HelloStatus};
use devlend_tests::agents::{sparse_file, Lender};

/// The lender's cap on connections in their handshake from one address.
const PER_ADDRESS: usize = 64;

/// A TCP connection to `addr` from the local address `from` (e.g. 127.0.0.2).
fn connect_from(from: [u8; 4], addr: std::net::SocketAddr) -> TcpStream {
    let port = addr.port();
    let ip = match addr.ip() {
        std::net::IpAddr::V4(v4) => v4.octets(),
        std::net::IpAddr::V6(_) => panic!("IPv4 only"),
    };
    let sin = |a: [u8; 4], p: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: p.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor owned here, with valid addresses; the
    // descriptor is handed to the TcpStream, which closes it.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket");
        let local = sin(from, 0);
        assert_eq!(
            libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len),
            0,
            "bind {from:?}"
        );
        let remote = sin(ip, port);
        assert_eq!(
            libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len),
            0,
            "connect"
        );
        TcpStream::from_raw_fd(fd)
    }
}

/// Sends a whole hello for `disk0` on `s` and reads the reply's status.
fn hello(s: &mut TcpStream) -> Result<HelloStatus, String> {
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    Hello::new("disk0", 0)
        .write_to(s)
        .map_err(|e| e.to_string())?;
    HelloReply::read_from(s)
        .map(|r| r.status)
        .map_err(|e| e.to_string())
}

/// Whether the lender closed `s` (EOF or reset) within `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn stalled_handshakes_are_closed_in_time_and_capped_per_address() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    sparse_file(&d.join("disk0.img"), 16 << 20).unwrap();
    let lender = Lender::start(d, &[format!("disk0={}", d.join("disk0.img").display())]).unwrap();
    let addr: std::net::SocketAddr = lender.addr.parse().unwrap();
    // The connections `Lender::start` probed the port with count as handshakes from
    // 127.0.0.1 until their session threads see them closed: let them go first.
    std::thread::sleep(Duration::from_millis(1000));

    // A hello's bytes, sent one at a time by the stalling peers.
    let mut bytes = Vec::new();
    Hello::new("disk0", 0).write_to(&mut bytes).unwrap();
    let t0 = Instant::now();
    let mut drips: Vec<TcpStream> = (0..PER_ADDRESS)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&bytes[..1]).unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    for (i, s) in drips.iter_mut().enumerate() {
        assert!(
            !closed_within(s, Duration::from_millis(1)),
            "stalled connection {i} of {PER_ADDRESS} was closed at once"
        );
    }

    // One more from the same address is closed at once...
    let mut extra = TcpStream::connect(addr).unwrap();
    assert!(
        closed_within(&mut extra, Duration::from_secs(2)),
        "one more connection in its handshake from one address was kept"
    );
    // ...while another address is served.
    let mut other = connect_from([127, 0, 0, 2], addr);
    assert_eq!(
        hello(&mut other),
        Ok(HelloStatus::Ok),
        "127.0.0.2 is served"
    );
    drop(other);

    // The stalling peers keep sending a byte a second; each is closed 10 s after its
    // connect all the same (before, each byte bought another 10 s).
    let mut next = 1;
    let mut open: Vec<bool> = vec![true; drips.len()];
    while open.iter().any(|&o| o) && t0.elapsed() < Duration::from_secs(20) {
        for (s, o) in drips.iter_mut().zip(open.iter_mut()) {
            if *o && s.write_all(&bytes[next..next + 1]).is_err() {
                *o = false;
            }
        }
        next = (next + 1).min(bytes.len() - 2);
        std::thread::sleep(Duration::from_millis(1000));
        for (s, o) in drips.iter_mut().zip(open.iter_mut()) {
            if *o && closed_within(s, Duration::from_millis(1)) {
                *o = false;
            }
        }
    }
    let took = t0.elapsed();
    assert!(
        open.iter().all(|&o| !o),
        "hellos sent a byte a second were still open after {took:?}"
    );
    assert!(
        took < Duration::from_secs(14),
        "the stalled handshakes were closed only after {took:?}"
    );

    // Their address is served again.
    let mut again = TcpStream::connect(addr).unwrap();
    assert_eq!(hello(&mut again), Ok(HelloStatus::Ok));
    drop(again);
    let log = lender.proc.log();
    assert!(
        log.contains("connection closed at accept"),
        "the refusal is logged:\n{log}"
    );
}

/// Every connection closed for a hello not done in time is logged, once: by its own
/// session thread when its read timed out first, or in the sweeper's count. (A trial
/// saw silent connections closed with nothing logged above debug: the session thread
/// took its own timeout for the sweeper's close.)
#[test]
fn every_silent_connection_closed_in_its_handshake_is_logged() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    sparse_file(&d.join("disk0.img"), 16 << 20).unwrap();
    let lender = Lender::start(d, &[format!("disk0={}", d.join("disk0.img").display())]).unwrap();
    let addr: std::net::SocketAddr = lender.addr.parse().unwrap();
    // Let the connections `Lender::start` probed the port with go first.
    std::thread::sleep(Duration::from_millis(1000));
    const SILENT: usize = 6;
    let mut silent: Vec<TcpStream> = (0..SILENT)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    let t0 = Instant::now();
    for (i, s) in silent.iter_mut().enumerate() {
        let left = Duration::from_secs(15).saturating_sub(t0.elapsed());
        assert!(closed_within(s, left), "silent connection {i} was kept");
    }
    // The sweeper runs every 250 ms and the lender logs as it closes.
    std::thread::sleep(Duration::from_millis(500));
    let log = lender.proc.log();
    let own = log
        .lines()
        .filter(|l| l.contains("hello not done in time; connection closed"))
        .count();
    let swept: usize = log
        .lines()
        .filter(|l| l.contains("connections closed: handshake not done in time"))
        .filter_map(|l| {
            let at = l.find("closed=")? + "closed=".len();
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<usize>()
                .ok()
        })
        .sum();
    assert_eq!(
        own + swept,
        SILENT,
        "{own} logged by their session, {swept} by the sweeper:\n{log}"
    );
}

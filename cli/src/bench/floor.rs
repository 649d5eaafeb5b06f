//! The floor under devlend's figures on this machine, measured in the same `--peers` run:
//! one loopback TCP round trip the size of a 4K read (48 bytes out, 4 KiB back, blocking
//! sockets, `TCP_NODELAY`) and the bytes a second that one and two loopback TCP streams
//! carry. devlend's QD1 latency cannot beat qsd-local's plus one round trip, and one
//! queue's throughput cannot beat one stream's (a queue is one fabric connection).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use super::options::Rw;
use super::report::{check, find, Cell, Check, LOCAL};
use super::stats::{Latencies, LatencySummary};

/// Bytes of a round trip's request: a block request header.
const REQUEST: usize = 48;
/// Bytes of a round trip's response: one 4 KiB read's data.
const RESPONSE: usize = 4096;
/// Bytes of each `write` of a stream.
const CHUNK: usize = 1 << 20;

/// What this machine's loopback carries.
#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    /// One round trip of 48 bytes out and 4 KiB back.
    pub round_trip: LatencySummary,
    /// One stream, in MB/s (10^6 bytes).
    pub one_stream_mb_per_s: f64,
    /// Two streams at once, together, in MB/s.
    pub two_streams_mb_per_s: f64,
}

/// Measures the floor, `window` for each of its three parts.
///
/// # Errors
/// A loopback socket cannot be opened or fails.
pub fn measure(window: Duration) -> Result<Floor> {
    Ok(Floor {
        round_trip: round_trips(window)?,
        one_stream_mb_per_s: streams(1, window)?,
        two_streams_mb_per_s: streams(2, window)?,
    })
}

/// A connected pair of loopback TCP sockets, both with `TCP_NODELAY`.
fn pair() -> Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind("127.0.0.1:0").context("loopback listen")?;
    let client = TcpStream::connect(l.local_addr()?).context("loopback connect")?;
    let (server, _) = l.accept().context("loopback accept")?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    Ok((client, server))
}

fn round_trips(window: Duration) -> Result<LatencySummary> {
    let (mut client, mut server) = pair()?;
    let echo = thread::spawn(move || {
        let mut req = [0u8; REQUEST];
        let resp = [0x5au8; RESPONSE];
        while server.read_exact(&mut req).is_ok() {
            if server.write_all(&resp).is_err() {
                break;
            }
        }
    });
    let mut lat = Latencies::new()?;
    let req = [0xa5u8; REQUEST];
    let mut resp = [0u8; RESPONSE];
    let end = Instant::now() + window;
    while Instant::now() < end {
        let t = Instant::now();
        client.write_all(&req).context("round trip: send")?;
        client
            .read_exact(&mut resp)
            .context("round trip: receive")?;
        lat.record(t.elapsed());
    }
    drop(client);
    let _ = echo.join();
    Ok(lat.summary())
}

/// `n` streams at once for `window`: the bytes all receivers took, in MB/s.
fn streams(n: usize, window: Duration) -> Result<f64> {
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    let start = Instant::now();
    for _ in 0..n {
        let (mut tx, mut rx) = pair()?;
        senders.push(thread::spawn(move || {
            let buf = vec![0x33u8; CHUNK];
            while start.elapsed() < window {
                if tx.write_all(&buf).is_err() {
                    break;
                }
            }
        }));
        receivers.push(thread::spawn(move || {
            let mut buf = vec![0u8; CHUNK];
            let mut got = 0u64;
            while let Ok(k) = rx.read(&mut buf) {
                if k == 0 {
                    break;
                }
                got += k as u64;
            }
            got
        }));
    }
    for t in senders {
        let _ = t.join();
    }
    let bytes: u64 = receivers.into_iter().map(|t| t.join().unwrap_or(0)).sum();
    Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// The targets of issue 37 that need the floor: devlend's QD1 p50 at most qsd-local's
/// + 10 µs; one queue's 128K reads at least 0.9 of one stream, two queues' 1.6.
pub fn checks(cells: &[Cell], floor: &Floor) -> Vec<Check> {
    let mut out = Vec::new();
    let p50 = |c: &Cell, who: &str| c.run(who).map(|r| r.figures.latency.p50_us);
    if let Some(c) = find(cells, Rw::Randread, 4096, 1, 1) {
        let gap = p50(c, "devlend").zip(p50(c, LOCAL)).map(|(d, q)| d - q);
        out.push(check(
            format!("4K randread QD1 p50, devlend - {LOCAL}, µs"),
            gap,
            "<=",
            10.0,
        ));
    }
    for (queues, bound) in [(1, 0.9), (2, 1.6)] {
        if let Some(c) = find(cells, Rw::Read, 128 << 10, 8, queues) {
            let what = if queues == 1 { "1 queue" } else { "2 queues" };
            out.push(check(
                format!("128K read QD8 MB/s, devlend ({what}) / one loopback TCP stream"),
                c.run("devlend")
                    .map(|r| r.figures.mb_per_s / floor.one_stream_mb_per_s),
                ">=",
                bound,
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_carries_round_trips_and_streams() {
        let f = measure(Duration::from_millis(200)).unwrap();
        assert!(f.round_trip.p50_us > 0.0);
        assert!(f.round_trip.p50_us <= f.round_trip.p99_us);
        assert!(f.one_stream_mb_per_s > 1.0, "{f:?}");
        assert!(f.two_streams_mb_per_s > 1.0, "{f:?}");
    }
}

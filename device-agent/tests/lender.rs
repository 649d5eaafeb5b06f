//! A spawned lender driven over real TCP connections with the fabric codecs, lending
//! real files in a temporary directory.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::net::Shutdown;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::{allocated_blocks, raw_header, recv_from, Client, Fixture, Rng};
use devlend_device_agent::{
    Options, MAX_DISCARD_SECTORS, MAX_TRANSFER_BYTES, MAX_WRITE_ZEROES_SECTORS,
};
use devlend_fabric::handshake::{DEV_DISCARD, DEV_READ_ONLY, DEV_WRITE_ZEROES};
use devlend_fabric::tcp::{self, ConnectError};
use devlend_fabric::wire::FLAG_UNMAP;
use devlend_fabric::{
    BlockRequest, Bytes, Hello, HelloReply, HelloStatus, Op, RequestHeader, Sector, Status,
};

const MIB: u64 = 1 << 20;

#[test]
fn handshake_advertises_the_device() {
    let fx = Fixture::new(&[("disk0", 16 * MIB, false), ("odd", 1000, true)]);
    let c = fx.connect("disk0");
    assert_eq!(c.info.capacity_sectors, 16 * MIB / 512);
    assert_eq!(c.info.block_size, 512);
    assert_eq!(c.info.max_transfer, MAX_TRANSFER_BYTES);
    assert_eq!(c.info.max_discard_sectors, MAX_DISCARD_SECTORS);
    assert_eq!(c.info.max_write_zeroes_sectors, MAX_WRITE_ZEROES_SECTORS);
    assert_eq!(c.info.flags, DEV_DISCARD | DEV_WRITE_ZEROES);
    assert_eq!(&c.info.serial[..6], b"disk0\0");

    // A 1000-byte file lends one sector; the tail is unreachable.
    let mut odd = fx.connect("odd");
    assert_eq!(odd.info.capacity_sectors, 1);
    assert_eq!(
        odd.info.flags,
        DEV_DISCARD | DEV_WRITE_ZEROES | DEV_READ_ONLY
    );
    assert_eq!(odd.read(0, 512).0, Status::Ok);
    assert_eq!(odd.read(1, 512).0, Status::IoErr);
    assert_eq!(fx.stats("disk0").sessions_active, 1);
    assert_eq!(fx.stats("odd").sessions_opened, 1);
}

#[test]
fn unknown_device_and_version_are_refused() {
    let fx = Fixture::new(&[("disk0", MIB, false)]);
    match tcp::connect(&fx.addr().to_string(), "nope", 0, Duration::from_secs(5)) {
        Err(ConnectError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, HelloStatus::NoSuchDevice);
            assert!(message.contains("nope"), "{message}");
        }
        other => panic!("expected NoSuchDevice, got {other:?}"),
    }

    let mut s = std::net::TcpStream::connect(fx.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = Hello::new("disk0", 0);
    hello.version = 99;
    hello.write_to(&mut s).unwrap();
    let reply = HelloReply::read_from(&mut s).unwrap();
    assert_eq!(reply.status, HelloStatus::UnsupportedVersion);
    assert!(reply.message.contains("99"), "{}", reply.message);
    assert_eq!(fx.stats("disk0").sessions_opened, 0);
}

#[test]
fn random_writes_read_back_and_land_in_the_file() {
    let size = 8 * MIB;
    let fx = Fixture::new(&[("disk0", size, false)]);
    let mut c = fx.connect("disk0");
    let mut model = vec![0u8; size as usize];
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut written = 0u64;
    for _ in 0..300 {
        let sectors = 1 + rng.below(256);
        let sector = rng.below(size / 512 - sectors + 1);
        let mut data = vec![0u8; (sectors * 512) as usize];
        rng.fill(&mut data);
        assert_eq!(c.write(sector, &data), Status::Ok);
        let off = (sector * 512) as usize;
        model[off..off + data.len()].copy_from_slice(&data);
        written += data.len() as u64;
    }
    assert_eq!(c.flush(), Status::Ok);

    // Through the lender, in max_transfer pieces.
    let chunk = MAX_TRANSFER_BYTES as u64;
    for off in (0..size).step_by(chunk as usize) {
        let (st, data) = c.read(off / 512, chunk.min(size - off) as u32);
        assert_eq!(st, Status::Ok);
        assert!(
            data == model[off as usize..(off + chunk.min(size - off)) as usize],
            "read back differs at {off}"
        );
    }
    // And in the file itself.
    assert!(
        std::fs::read(fx.path("disk0")).unwrap() == model,
        "file content differs"
    );

    let st = fx.stats("disk0");
    assert_eq!(st.ops.writes, 300);
    assert_eq!(st.ops.bytes_written, written);
    assert_eq!(st.ops.bytes_read, size);
    assert_eq!(st.ops.flushes, 1);
    assert_eq!(st.request_errors, 0);
}

#[test]
fn many_requests_in_flight_on_one_connection() {
    // More requests than the per-session in-flight limit, sent by one thread while
    // another collects the responses, matched by id (completion order is free).
    const N: u64 = 3000;
    let fx = Fixture::new(&[("disk0", 16 * MIB, false)]);
    let mut c = fx.connect("disk0");
    let pattern = |i: u64| {
        let mut b = vec![0u8; 4096];
        Rng(i + 1).fill(&mut b);
        b
    };
    let slot = |i: u64| (i % 4096) * 8; // 4 KiB slots, the first 1000+ distinct

    let mut reader = c.sock.try_clone().unwrap();
    let collector = std::thread::spawn(move || {
        let mut seen = HashMap::new();
        for _ in 0..N {
            let (h, data) = recv_from(&mut reader);
            assert!(
                seen.insert(h.id, (h.status, data)).is_none(),
                "duplicate response {}",
                h.id
            );
        }
        seen
    });
    let mut frames = Vec::new();
    for i in 0..N {
        let h = RequestHeader {
            id: i,
            request: BlockRequest::Write {
                sector: Sector(slot(i)),
                len: Bytes(4096),
            },
        };
        frames.extend_from_slice(&h.encode());
        frames.extend_from_slice(&pattern(i));
    }
    c.sock.write_all(&frames).unwrap();
    let seen = collector.join().unwrap();
    assert_eq!(seen.len() as u64, N);
    assert!(seen.values().all(|(s, d)| *s == Status::Ok && d.is_empty()));

    // Now read every slot back, pipelined the same way.
    let mut reader = c.sock.try_clone().unwrap();
    let collector = std::thread::spawn(move || {
        (0..N)
            .map(|_| recv_from(&mut reader))
            .map(|(h, d)| (h.id, (h.status, d)))
            .collect::<HashMap<_, _>>()
    });
    let mut frames = Vec::new();
    for i in 0..N {
        let h = RequestHeader {
            id: 1_000_000 + i,
            request: BlockRequest::Read {
                sector: Sector(slot(i)),
                len: Bytes(4096),
            },
        };
        frames.extend_from_slice(&h.encode());
    }
    c.sock.write_all(&frames).unwrap();
    let seen = collector.join().unwrap();
    for i in 0..N {
        let (st, data) = &seen[&(1_000_000 + i)];
        assert_eq!(*st, Status::Ok);
        // The last write to a slot wins: ids i and i+4096 share one (N < 2*4096).
        let last = if i + 4096 < N { i + 4096 } else { i };
        assert!(
            *data == pattern(last),
            "slot of request {i} holds the wrong data"
        );
    }
    let st = fx.stats("disk0");
    assert_eq!((st.ops.writes, st.ops.reads), (N, N));
    assert_eq!(st.ops.bytes_read, N * 4096);
}

#[test]
fn flush_succeeds_and_is_counted() {
    let fx = Fixture::new(&[("disk0", MIB, false)]);
    let mut c = fx.connect("disk0");
    assert_eq!(c.write(3, &[0xabu8; 1024]), Status::Ok);
    assert_eq!(c.flush(), Status::Ok);
    let st = fx.stats("disk0");
    assert_eq!(st.ops.flushes, 1);
    assert_eq!(st.device_ops, 2);
    let mut b = [0u8; 1024];
    std::fs::File::open(fx.path("disk0"))
        .unwrap()
        .read_exact_at(&mut b, 3 * 512)
        .unwrap();
    assert_eq!(b, [0xabu8; 1024]);
}

/// Writes 2 MiB of non-zero data at 1 MiB and syncs it to disk.
fn fill(c: &mut Client) {
    assert_eq!(c.write(2048, &vec![0x5au8; 2 * MIB as usize]), Status::Ok);
    assert_eq!(c.flush(), Status::Ok);
}

fn assert_zeroes(c: &mut Client, sector: u64, len: u32) {
    let (st, data) = c.read(sector, len);
    assert_eq!(st, Status::Ok);
    assert!(
        data.iter().all(|&b| b == 0),
        "range at sector {sector} is not zeroed"
    );
}

#[test]
fn discard_punches_a_hole() {
    let fx = Fixture::new(&[("disk0", 8 * MIB, false)]);
    let mut c = fx.connect("disk0");
    fill(&mut c);
    let before = allocated_blocks(&fx.path("disk0"));
    assert!(
        before >= 4096,
        "2 MiB written but only {before} blocks allocated"
    );
    // Discard the first MiB of the data.
    assert_eq!(c.call(Op::Discard, 0, 2048, 2048, &[]).0, Status::Ok);
    let after = allocated_blocks(&fx.path("disk0"));
    assert!(
        after + 2048 <= before,
        "st_blocks {before} -> {after}: no hole punched"
    );
    assert_zeroes(&mut c, 2048, MIB as u32);
    // The rest is untouched.
    let (_, rest) = c.read(4096, MIB as u32);
    assert!(rest.iter().all(|&b| b == 0x5a));
    // The file keeps its size.
    assert_eq!(std::fs::metadata(fx.path("disk0")).unwrap().len(), 8 * MIB);
}

#[test]
fn write_zeroes_with_and_without_unmap() {
    let fx = Fixture::new(&[("disk0", 8 * MIB, false)]);
    let mut c = fx.connect("disk0");
    fill(&mut c);
    // Without UNMAP: zero 100 sectors at 2100.
    assert_eq!(c.call(Op::WriteZeroes, 0, 2100, 100, &[]).0, Status::Ok);
    // With UNMAP: zero 1000 sectors at 3000.
    assert_eq!(
        c.call(Op::WriteZeroes, FLAG_UNMAP, 3000, 1000, &[]).0,
        Status::Ok
    );
    let (st, data) = c.read(2048, 2 * MIB as u32);
    assert_eq!(st, Status::Ok);
    for (i, chunk) in data.chunks(512).enumerate() {
        let sector = 2048 + i as u64;
        let zeroed = (2100..2200).contains(&sector) || (3000..4000).contains(&sector);
        let want = if zeroed { 0 } else { 0x5a };
        assert!(
            chunk.iter().all(|&b| b == want),
            "sector {sector} should hold {want:#x}"
        );
    }
    let st = fx.stats("disk0");
    assert_eq!(st.ops.write_zeroes, 2);
    assert_eq!(st.request_errors, 0);
}

#[test]
fn write_zeroes_falls_back_to_writing_zeroes() {
    // tmpfs has no FALLOC_FL_ZERO_RANGE: write-zeroes without UNMAP must write zeroes.
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("skipped: no /dev/shm");
        return;
    };
    let fx = Fixture::in_dir(dir, &[("disk0", 8 * MIB, false)], Options::default());
    let mut c = fx.connect("disk0");
    fill(&mut c);
    let ops = fx.stats("disk0").device_ops;
    // 3 MiB + 512: several zero chunks, from sector 2047 to past the written data.
    let sectors = 3 * 2048 + 1;
    assert_eq!(c.call(Op::WriteZeroes, 0, 2047, sectors, &[]).0, Status::Ok);
    assert_zeroes(&mut c, 2047, sectors * 512);
    let (_, after) = c.read(2047 + u64::from(sectors), 512);
    assert!(
        after.iter().all(|&b| b == 0),
        "past the range: never written, still zero"
    );
    let st = fx.stats("disk0");
    // fallocate(ZERO_RANGE) refused, then at least 4 chunked writes, then the reads.
    assert!(
        st.device_ops >= ops + 5 + 2,
        "{} -> {}: no fallback writes",
        ops,
        st.device_ops
    );
    assert_eq!(st.request_errors, 0);
}

#[test]
fn read_only_device_refuses_writes_and_keeps_the_file() {
    let fx = Fixture::new(&[("ro", MIB, true)]);
    let original: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
    std::fs::write(fx.path("ro"), &original).unwrap();
    let mut c = fx.connect("ro");
    assert!(c.info.read_only());
    assert_eq!(c.write(0, &[1u8; 4096]), Status::IoErr);
    assert_eq!(c.call(Op::Discard, 0, 0, 8, &[]).0, Status::IoErr);
    assert_eq!(c.call(Op::WriteZeroes, 0, 0, 8, &[]).0, Status::IoErr);
    assert_eq!(
        c.call(Op::WriteZeroes, FLAG_UNMAP, 0, 8, &[]).0,
        Status::IoErr
    );
    let st = fx.stats("ro");
    assert_eq!(st.device_ops, 0, "a refused request reached the device");
    assert_eq!(st.request_errors, 4);
    // The session is still in frame and reads work.
    let (s, data) = c.read(0, 8192);
    assert_eq!(s, Status::Ok);
    assert!(data == original[..8192]);
    assert!(
        std::fs::read(fx.path("ro")).unwrap() == original,
        "file changed"
    );
}

#[test]
fn out_of_range_requests_fail_without_io() {
    let fx = Fixture::new(&[("disk0", MIB, false)]);
    let cap = MIB / 512;
    let mut c = fx.connect("disk0");
    let cases: &[(Op, u8, u64, u32)] = &[
        (Op::Read, 0, cap, 512),
        (Op::Read, 0, cap - 1, 1024),
        (Op::Read, 0, u64::MAX, 512),
        (Op::Read, 0, u64::MAX / 512, 4096),
        (Op::Read, 0, 0, 0),
        (Op::Write, 0, cap - 1, 1024),
        (Op::Write, 0, u64::MAX / 256, 512),
        (Op::Write, 0, 0, 0),
        (Op::Discard, 0, 0, 0),
        (Op::Discard, 0, cap - 1, 2),
        (Op::Discard, 0, 0, MAX_DISCARD_SECTORS + 1),
        (Op::Discard, 0, u64::MAX, 1),
        (Op::WriteZeroes, 0, 0, 0),
        (Op::WriteZeroes, FLAG_UNMAP, cap, 1),
        (Op::WriteZeroes, 0, 0, MAX_WRITE_ZEROES_SECTORS + 1),
        (Op::WriteZeroes, 0, 0, u32::MAX),
    ];
    for &(op, flags, sector, len) in cases {
        let data = if op == Op::Write {
            vec![7u8; len as usize]
        } else {
            Vec::new()
        };
        let (st, d) = c.call(op, flags, sector, len, &data);
        assert_eq!(st, Status::IoErr, "{op:?} sector {sector} len {len}");
        assert!(d.is_empty());
    }
    let st = fx.stats("disk0");
    assert_eq!(
        st.device_ops, 0,
        "an out-of-range request reached the device"
    );
    assert_eq!((st.ops.bytes_read, st.ops.bytes_written), (0, 0));
    assert_eq!(st.request_errors, cases.len() as u64);
    assert_eq!(st.ops.requests(), cases.len() as u64);
    assert_eq!(st.protocol_errors, 0);
    // The last sector itself is in range.
    assert_eq!(c.read(cap - 1, 512).0, Status::Ok);
    assert!(std::fs::read(fx.path("disk0"))
        .unwrap()
        .iter()
        .all(|&b| b == 0));
}

#[test]
fn duplicate_ids_in_flight_are_answered() {
    let fx = Fixture::new(&[("disk0", MIB, false)]);
    let mut c = fx.connect("disk0");
    for _ in 0..64 {
        c.send(
            &RequestHeader {
                id: 7,
                request: BlockRequest::Read {
                    sector: Sector(0),
                    len: Bytes(4096),
                },
            },
            &[],
        );
    }
    for _ in 0..64 {
        let (h, _) = c.recv();
        assert_eq!((h.id, h.status), (7, Status::Ok));
    }
}

/// Sends `bad` on a fresh session and checks that the lender closes it while another
/// session keeps working.
fn closes_only_that_session(
    fx: &Fixture,
    healthy: &mut Client,
    what: &str,
    bad: &[u8],
    half_close: bool,
) {
    let before = fx.stats("disk0").protocol_errors;
    let mut victim = fx.connect("disk0");
    // Some valid traffic first, so the session is known to be in frame.
    assert_eq!(victim.write(10, &[1u8; 512]), Status::Ok);
    victim.sock.write_all(bad).unwrap();
    if half_close {
        victim.sock.shutdown(Shutdown::Write).unwrap();
    }
    let t0 = Instant::now();
    assert!(victim.is_closed_by_peer(), "{what}: session not closed");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "{what}: closed too late"
    );
    assert_eq!(
        healthy.write(20, &[2u8; 4096]),
        Status::Ok,
        "{what}: other session broken"
    );
    assert_eq!(healthy.read(20, 4096), (Status::Ok, vec![2u8; 4096]));
    // The counter moves once the session has ended; give it a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while fx.stats("disk0").protocol_errors == before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        fx.stats("disk0").protocol_errors,
        before + 1,
        "{what}: not counted"
    );
}

#[test]
fn malformed_input_closes_only_that_session() {
    let options = Options {
        frame_timeout: Duration::from_millis(500),
        ..Options::default()
    };
    let fx = Fixture::with_options(&[("disk0", MIB, false)], options);
    let mut healthy = fx.connect("disk0");

    let unknown_op = raw_header(9, 0, 512, 1, 0);
    closes_only_that_session(&fx, &mut healthy, "unknown opcode", &unknown_op, false);

    let mut reserved = raw_header(Op::Read as u8, 0, 512, 1, 0);
    reserved[2] = 1;
    closes_only_that_session(&fx, &mut healthy, "reserved bits", &reserved, false);

    let bad_flag = raw_header(Op::Read as u8, FLAG_UNMAP, 512, 1, 0);
    closes_only_that_session(&fx, &mut healthy, "flag on a read", &bad_flag, false);

    // A flush has no range: a length or a sector in it breaks the protocol.
    let flush_len = raw_header(Op::Flush as u8, 0, 512, 1, 0);
    closes_only_that_session(&fx, &mut healthy, "flush with a length", &flush_len, false);
    let flush_sector = raw_header(Op::Flush as u8, 0, 0, 1, 8);
    closes_only_that_session(
        &fx,
        &mut healthy,
        "flush with a sector",
        &flush_sector,
        false,
    );

    let too_long = raw_header(Op::Read as u8, 0, MAX_TRANSFER_BYTES + 512, 1, 0);
    closes_only_that_session(
        &fx,
        &mut healthy,
        "len beyond max_transfer",
        &too_long,
        false,
    );

    let unaligned = raw_header(Op::Write as u8, 0, 700, 1, 0);
    closes_only_that_session(&fx, &mut healthy, "unaligned len", &unaligned, false);

    let header = raw_header(Op::Read as u8, 0, 512, 1, 0);
    closes_only_that_session(&fx, &mut healthy, "truncated header", &header[..10], true);

    let mut write = raw_header(Op::Write as u8, 0, 4096, 1, 0).to_vec();
    write.extend_from_slice(&[3u8; 1000]);
    closes_only_that_session(&fx, &mut healthy, "truncated write data", &write, true);

    // Stops mid-frame without closing: the frame timeout (500 ms) ends it.
    closes_only_that_session(&fx, &mut healthy, "stall mid-header", &header[..10], false);
    closes_only_that_session(&fx, &mut healthy, "stall mid-data", &write, false);

    // The truncated write never reached the file.
    let mut b = [0u8; 512];
    std::fs::File::open(fx.path("disk0"))
        .unwrap()
        .read_exact_at(&mut b, 0)
        .unwrap();
    assert_eq!(b, [0u8; 512]);
    assert_eq!(fx.stats("disk0").sessions_active, 1);
}

#[test]
fn idle_session_between_frames_is_not_timed_out() {
    let options = Options {
        frame_timeout: Duration::from_millis(200),
        ..Options::default()
    };
    let fx = Fixture::with_options(&[("disk0", MIB, false)], options);
    let mut c = fx.connect("disk0");
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(c.read(0, 512).0, Status::Ok);
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(c.write(0, &[9u8; 512]), Status::Ok);
    assert_eq!(fx.stats("disk0").protocol_errors, 0);
}

#[test]
fn peer_closing_cleanly_is_not_a_protocol_error() {
    let fx = Fixture::new(&[("disk0", MIB, false)]);
    {
        let mut c = fx.connect("disk0");
        // Requests in flight when the borrower half-closes are still answered.
        for i in 0..16 {
            c.send(
                &RequestHeader {
                    id: i,
                    request: BlockRequest::Read {
                        sector: Sector(0),
                        len: Bytes(65536),
                    },
                },
                &[],
            );
        }
        c.sock.shutdown(Shutdown::Write).unwrap();
        for _ in 0..16 {
            assert_eq!(c.recv().0.status, Status::Ok);
        }
        assert!(c.is_closed_by_peer());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while fx.stats("disk0").sessions_active > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let st = fx.stats("disk0");
    assert_eq!(
        (st.sessions_active, st.sessions_opened, st.protocol_errors),
        (0, 1, 0)
    );
}

#[test]
fn shutdown_closes_sessions_and_stops_accepting() {
    let mut fx = Fixture::new(&[("disk0", MIB, false)]);
    let mut c = fx.connect("disk0");
    assert_eq!(c.read(0, 512).0, Status::Ok);
    let addr = fx.addr();
    let handle = fx.lender.take().unwrap();
    let t0 = Instant::now();
    handle.shutdown();
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(c.is_closed_by_peer());
    assert!(tcp::connect(&addr.to_string(), "disk0", 0, Duration::from_secs(2)).is_err());
}

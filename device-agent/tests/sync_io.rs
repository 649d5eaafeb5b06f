//! The lender with device I/O done by plain system calls on the session's thread
//! (`IoMode::Sync`, what it does for files on tmpfs), including reads sent with
//! `sendfile`: the same answers as through io_uring.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::net::Shutdown;

use common::{recv_from, Fixture, Rng};
use devlend_device_agent::{IoMode, Options, MAX_TRANSFER_BYTES};
use devlend_fabric::wire::FLAG_UNMAP;
use devlend_fabric::{BlockRequest, Bytes, Op, RequestHeader, Sector, Status};

const MIB: u64 = 1 << 20;

fn sync_fixture(images: &[(&str, u64, bool)]) -> Fixture {
    Fixture::with_options(
        images,
        Options {
            io: IoMode::Sync,
            ..Options::default()
        },
    )
}

#[test]
fn writes_and_reads_of_every_size_match_the_file() {
    let size = 16 * MIB;
    let fx = sync_fixture(&[("disk0", size, false)]);
    let mut c = fx.connect("disk0");
    let mut model = vec![0u8; size as usize];
    let mut rng = Rng(0x5eed_5e1d_0000_0001);
    // Small and large requests: the large reads leave with sendfile.
    for sectors in [1u64, 8, 127, 128, 129, 256, 2048, 8192] {
        let sector = rng.below(size / 512 - sectors + 1);
        let mut data = vec![0u8; (sectors * 512) as usize];
        rng.fill(&mut data);
        assert_eq!(c.write(sector, &data), Status::Ok);
        let off = (sector * 512) as usize;
        model[off..off + data.len()].copy_from_slice(&data);
        let (st, back) = c.read(sector, data.len() as u32);
        assert_eq!(st, Status::Ok);
        assert!(back == data, "{sectors} sectors read back differ");
    }
    assert_eq!(c.flush(), Status::Ok);
    let chunk = MAX_TRANSFER_BYTES as usize;
    for off in (0..size as usize).step_by(chunk) {
        let (st, data) = c.read((off / 512) as u64, chunk as u32);
        assert_eq!(st, Status::Ok);
        assert!(data == model[off..off + chunk], "differs at {off}");
    }
    assert!(std::fs::read(fx.path("disk0")).unwrap() == model);
    // Out of range: refused without I/O, the session stays in frame.
    assert_eq!(c.read(size / 512, 512).0, Status::IoErr);
    assert_eq!(c.read(0, 512).0, Status::Ok);
    let st = fx.stats("disk0");
    assert_eq!(st.request_errors, 1);
    assert_eq!(st.protocol_errors, 0);
}

#[test]
fn pipelined_requests_beyond_the_budget_are_all_answered() {
    const N: u64 = 3000;
    let fx = sync_fixture(&[("disk0", 16 * MIB, false)]);
    let mut c = fx.connect("disk0");
    let mut reader = c.sock.try_clone().unwrap();
    let collector = std::thread::spawn(move || {
        (0..2 * N)
            .map(|_| recv_from(&mut reader))
            .map(|(h, d)| (h.id, (h.status, d)))
            .collect::<HashMap<_, _>>()
    });
    let pattern = |i: u64| {
        let mut b = vec![0u8; 4096];
        Rng(i + 7).fill(&mut b);
        b
    };
    let mut frames = Vec::new();
    for i in 0..N {
        let h = RequestHeader {
            id: i,
            request: BlockRequest::Write {
                sector: Sector(i * 8),
                len: Bytes(4096),
            },
        };
        frames.extend_from_slice(&h.encode());
        frames.extend_from_slice(&pattern(i));
    }
    for i in 0..N {
        // Reads of 64 KiB and more are sent from the file; smaller ones from a buffer.
        let len = if i % 2 == 0 { 4096 } else { 65536 };
        let h = RequestHeader {
            id: N + i,
            request: BlockRequest::Read {
                sector: Sector(i * 8),
                len: Bytes(len),
            },
        };
        frames.extend_from_slice(&h.encode());
    }
    c.sock.write_all(&frames).unwrap();
    let seen = collector.join().unwrap();
    assert_eq!(seen.len() as u64, 2 * N);
    for i in 0..N {
        assert_eq!(seen[&i], (Status::Ok, Vec::new()));
        let (st, data) = &seen[&(N + i)];
        assert_eq!(*st, Status::Ok);
        // Requests complete in order here: each read sees the writes before it.
        assert!(data[..4096] == pattern(i), "read {i} differs");
    }
}

#[test]
fn flush_discard_and_write_zeroes() {
    let fx = sync_fixture(&[("disk0", 8 * MIB, false)]);
    let mut c = fx.connect("disk0");
    assert_eq!(c.write(2048, &vec![0x5au8; 2 * MIB as usize]), Status::Ok);
    assert_eq!(c.flush(), Status::Ok);
    assert_eq!(c.call(Op::Discard, 0, 2048, 1024, &[]).0, Status::Ok);
    assert_eq!(c.call(Op::WriteZeroes, 0, 3100, 100, &[]).0, Status::Ok);
    assert_eq!(
        c.call(Op::WriteZeroes, FLAG_UNMAP, 3500, 500, &[]).0,
        Status::Ok
    );
    let (st, data) = c.read(2048, 2 * MIB as u32);
    assert_eq!(st, Status::Ok);
    for (i, s) in data.chunks(512).enumerate() {
        let sector = 2048 + i as u64;
        let zero =
            sector < 3072 || (3100..3200).contains(&sector) || (3500..4000).contains(&sector);
        let want = if zero { 0 } else { 0x5a };
        assert!(s.iter().all(|&b| b == want), "sector {sector}");
    }
    let st = fx.stats("disk0");
    assert_eq!(
        (st.ops.flushes, st.ops.discards, st.ops.write_zeroes),
        (1, 1, 2)
    );
    assert_eq!(st.request_errors, 0);
}

#[test]
fn a_half_closed_session_gets_its_large_reads_then_closes() {
    let fx = sync_fixture(&[("disk0", 4 * MIB, false)]);
    let mut c = fx.connect("disk0");
    assert_eq!(c.write(0, &vec![0x33u8; 1 << 20]), Status::Ok);
    for i in 0..16 {
        c.send(
            &RequestHeader {
                id: 100 + i,
                request: BlockRequest::Read {
                    sector: Sector(0),
                    len: Bytes(1 << 20),
                },
            },
            &[],
        );
    }
    c.sock.shutdown(Shutdown::Write).unwrap();
    for _ in 0..16 {
        let (h, data) = c.recv();
        assert_eq!(h.status, Status::Ok);
        assert!(data.iter().all(|&b| b == 0x33));
    }
    assert!(c.is_closed_by_peer());
}

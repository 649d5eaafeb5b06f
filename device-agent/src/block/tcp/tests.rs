//! The TCP block engine driven through a fake [`DeviceIo`] that hands completions back
//! in the reverse of their start order, or only once the engine sleeps: every response
//! still answers its own request, and the request budget holds (a borrower with credit
//! that goes beyond it breaks the protocol; one without is not read beyond it).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::wire::RESPONSE_HEADER_LEN;
use devlend_fabric::{BlockRequest, Bytes, RequestHeader, ResponseHeader, Sector, Status};

use crate::block::fake_io::{block, device, reordered_io};
use crate::block::io::Inline;
use crate::session::end::End;

fn frame(id: u64, request: BlockRequest, data: &[u8]) -> Vec<u8> {
    let mut f = RequestHeader { id, request }.encode().to_vec();
    f.extend_from_slice(data);
    f
}

/// Reads one response: its header and its data.
fn response(c: &mut TcpStream) -> (ResponseHeader, Vec<u8>) {
    let mut h = [0u8; RESPONSE_HEADER_LEN];
    c.read_exact(&mut h).expect("response header");
    let h = ResponseHeader::decode(&h).expect("decode");
    let mut data = vec![0u8; h.len.usize()];
    c.read_exact(&mut data).expect("response data");
    (h, data)
}

#[test]
fn reordered_completions_answer_their_own_requests() {
    const N: u64 = 8;
    const LEN: u32 = 4096;
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
    let (server, peer) = listener.accept().expect("accept");
    let server = Stream::Tcp(server);
    let inner = Inline::new(Arc::clone(&dev.counters), block(&dev), false).expect("inline");
    let reordered = Arc::new(AtomicUsize::new(0));
    let io = reordered_io(inner, false, &reordered);
    let (dev_ref, server_ref) = (&*dev.counters, &server);
    std::thread::scope(|s| {
        let engine = s.spawn(move || {
            // Polling on: the same answers from a thread that spins before it sleeps.
            let poll = Duration::from_micros(50);
            let heartbeat = false;
            super::engine::run(
                io,
                dev_ref,
                server_ref,
                peer,
                super::engine::Terms {
                    frame_timeout: Duration::from_secs(5),
                    credit: false,
                    poll,
                    fence: &AtomicBool::new(false),
                    heartbeat,
                },
            )
        });
        // Every write in one go, so that several start before a reap.
        let mut writes = Vec::new();
        for id in 0..N {
            let request = BlockRequest::Write {
                sector: Sector(id * 8),
                len: Bytes(LEN),
            };
            writes.extend(frame(id, request, &vec![id as u8 + 1; LEN as usize]));
        }
        client.write_all(&writes).expect("writes");
        let mut ids: Vec<u64> = (0..N)
            .map(|_| {
                let (h, data) = response(&mut client);
                assert_eq!(h.status, Status::Ok);
                assert!(data.is_empty());
                h.id
            })
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..N).collect::<Vec<_>>());
        // Reads back: each answer carries its own sector's data.
        let mut reads = Vec::new();
        for id in 0..N {
            let request = BlockRequest::Read {
                sector: Sector(id * 8),
                len: Bytes(LEN),
            };
            reads.extend(frame(100 + id, request, &[]));
        }
        client.write_all(&reads).expect("reads");
        for _ in 0..N {
            let (h, data) = response(&mut client);
            assert_eq!(h.status, Status::Ok);
            let id = h.id - 100;
            assert_eq!(data, vec![id as u8 + 1; LEN as usize], "read {id}");
        }
        client.shutdown(Shutdown::Write).expect("shutdown");
        let end = engine.join().expect("engine");
        assert!(matches!(end, End::PeerClosed), "{end}");
    });
    assert!(
        reordered.load(Ordering::Relaxed) > 0,
        "no completions were reordered"
    );
}

/// `n` flushes, ids from 0, in one buffer.
fn flushes(n: usize) -> Vec<u8> {
    (0..n as u64)
        .flat_map(|id| frame(id, BlockRequest::Flush, &[]))
        .collect()
}

/// Runs the engine (`credit` and `heartbeat` as granted) on a session whose borrower
/// sent `frames` before the engine started, its device I/O finishing only when the
/// engine waits; `answered` responses are read, then the borrower stops writing.
fn session_with(credit: bool, heartbeat: bool, frames: &[u8], answered: usize) -> End {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
    let (server, peer) = listener.accept().expect("accept");
    let server = Stream::Tcp(server);
    client.write_all(frames).expect("frames");
    let inner = Inline::new(Arc::clone(&dev.counters), block(&dev), false).expect("inline");
    let io = reordered_io(inner, true, &Arc::new(AtomicUsize::new(0)));
    let (dev_ref, server_ref) = (&*dev.counters, &server);
    std::thread::scope(|s| {
        let engine = s.spawn(move || {
            super::engine::run(
                io,
                dev_ref,
                server_ref,
                peer,
                super::engine::Terms {
                    frame_timeout: Duration::from_secs(5),
                    credit,
                    poll: Duration::ZERO,
                    fence: &AtomicBool::new(false),
                    heartbeat,
                },
            )
        });
        let mut ids: Vec<u64> = (0..answered)
            .map(|_| {
                let (h, _) = response(&mut client);
                assert_eq!(h.status, Status::Ok);
                h.id
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), answered);
        client.shutdown(Shutdown::Write).expect("shutdown");
        engine.join().expect("engine")
    })
}

fn budget_session(credit: bool, frames: &[u8], answered: usize) -> End {
    session_with(credit, false, frames, answered)
}

#[test]
fn a_borrower_with_credit_beyond_the_budget_breaks_the_protocol() {
    let end = budget_session(
        true,
        &flushes(crate::MAX_IN_FLIGHT + 1),
        crate::MAX_IN_FLIGHT,
    );
    assert!(matches!(end, End::Protocol(_)), "{end}");
}

#[test]
fn a_borrower_without_credit_is_read_as_the_budget_frees() {
    let n = crate::MAX_IN_FLIGHT + 5;
    let end = budget_session(false, &flushes(n), n);
    assert!(matches!(end, End::PeerClosed), "{end}");
}

#[test]
fn heartbeats_take_no_credit_and_get_no_response() {
    use devlend_fabric::HEARTBEAT_FRAME;
    // A heartbeat before every flush, and more after the budget's worth of them: a
    // borrower with credit stays within it, and no heartbeat is answered (the session
    // ends at the borrower's close, after exactly the flushes' responses).
    let n = crate::MAX_IN_FLIGHT;
    let mut frames = Vec::new();
    for id in 0..n as u64 {
        frames.extend_from_slice(&HEARTBEAT_FRAME);
        frames.extend(frame(id, BlockRequest::Flush, &[]));
    }
    for _ in 0..5 {
        frames.extend_from_slice(&HEARTBEAT_FRAME);
    }
    let end = session_with(true, true, &frames, n);
    assert!(matches!(end, End::PeerClosed), "{end}");
    // Not granted: an unknown operation, which ends the session.
    let end = session_with(true, false, &HEARTBEAT_FRAME, 0);
    assert!(matches!(end, End::Protocol(_)), "{end}");
    // Granted, but not the frame: a protocol error too.
    let mut bad = HEARTBEAT_FRAME;
    bad[8] = 1;
    let end = session_with(true, true, &bad, 0);
    assert!(matches!(end, End::Protocol(_)), "{end}");
}

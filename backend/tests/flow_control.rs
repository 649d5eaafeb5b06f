//! Flow control between a virtqueue's engine and its lender, driven through the real
//! queue engine on `virtio_queue::mock::MockSplitQueue`, against lenders written here
//! that misbehave on purpose (a stand-in for the device agent, whose own tests show it
//! keeps reading a borrower that stays within its credit):
//!
//! - a lender that stops reading its socket (a stalled process, a full disk) must not
//!   block the queue's worker in a socket write: the worker returns, wants to be woken
//!   for writability, and a drain (GET_VRING_BASE, detach) answers at its deadline;
//! - a lender that grants a small credit never sees more outstanding than it granted,
//!   and every request still completes, in order of submission.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_backend::blk::engine::{QueueEngine, QueueStats};
use devlend_backend::blk::spec::{S_IOERR, S_OK, T_OUT};
use devlend_backend::blk::DeviceLimits;
use devlend_backend::guest::GuestMemory;
use devlend_backend::lender::LenderTarget;
use devlend_fabric::wire::REQUEST_HEADER_LEN;
use devlend_fabric::{
    BlockGeometry, Credit, Hello, HelloReply, Op, RequestHeader, ResponseHeader, Status,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const MIB: u64 = 1 << 20;
const QSIZE: u16 = 256;
/// Where each chain's data buffer is (all chains share it: only the bytes on the wire
/// matter here).
const DATA: u64 = MIB;
const DATA_LEN: u32 = 512 << 10;
/// Request headers, 16 bytes apart, and status bytes, one per chain.
const HEADERS: u64 = 0x40000;
const STATUS: u64 = 0x60000;

fn device() -> BlockGeometry {
    BlockGeometry {
        capacity_sectors: 1 << 21,
        block_size: 512,
        max_transfer: 1 << 20,
        ..BlockGeometry::default()
    }
}

/// A lender on loopback that answers one hello with `credit` (none: a lender of
/// before credit), then hands the connection to `serve`.
fn fake_lender(
    credit: Option<Credit>,
    serve: impl FnOnce(TcpStream) + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let hello = Hello::read_from(&mut s).unwrap();
        assert_ne!(
            hello.features & devlend_fabric::FEATURE_CREDIT,
            0,
            "the borrower asks for a credit"
        );
        let mut reply = HelloReply::ok(device());
        reply.credit = credit;
        reply.write_to(&mut s).unwrap();
        serve(s);
    });
    (addr, t)
}

fn engine(addr: &str) -> QueueEngine {
    let target = LenderTarget::direct(addr, "disk", [1; 16]);
    let limits = Arc::new(DeviceLimits::from_device_info(&device()));
    let mut e = QueueEngine::new(0, target, limits, Arc::new(QueueStats::default()))
        .with_deadline(Duration::from_secs(2));
    e.connect().unwrap();
    e
}

/// Guest memory with `n` write chains of [`DATA_LEN`] bytes on the avail ring; returns
/// the memory and the queue.
fn queue_with_writes(n: u16) -> (Arc<GuestMemory>, Queue) {
    let mem = Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), 4 * MIB as usize)]).unwrap());
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
    let mut descs = Vec::new();
    for i in 0..n {
        let hdr = HEADERS + u64::from(i) * 16;
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&T_OUT.to_le_bytes());
        h[8..].copy_from_slice(&(u64::from(i) * 1024).to_le_bytes());
        mem.write_slice(&h, GuestAddress(hdr)).unwrap();
        mem.write_obj(0xffu8, GuestAddress(STATUS + u64::from(i)))
            .unwrap();
        let base = i * 3;
        let next = VRING_DESC_F_NEXT as u16;
        descs.push(RawDescriptor::from(Descriptor::new(
            hdr,
            16,
            next,
            base + 1,
        )));
        descs.push(RawDescriptor::from(Descriptor::new(
            DATA,
            DATA_LEN,
            next,
            base + 2,
        )));
        descs.push(RawDescriptor::from(Descriptor::new(
            STATUS + u64::from(i),
            1,
            VRING_DESC_F_WRITE as u16,
            0,
        )));
    }
    mock.add_desc_chains(&descs, 0).unwrap();
    let queue: Queue = mock.create_queue().unwrap();
    (mem, queue)
}

fn status(mem: &GuestMemory, i: u16) -> u8 {
    mem.read_obj(GuestAddress(STATUS + u64::from(i))).unwrap()
}

#[test]
fn a_lender_that_stops_reading_blocks_no_thread_and_a_drain_answers_at_its_deadline() {
    const N: u16 = 64; // 32 MiB of writes: far more than loopback's socket buffers.
    let (done_tx, done_rx) = mpsc::channel::<()>();
    // It reads nothing after the hello, and keeps the connection open until the end.
    let (addr, lender) = fake_lender(None, move |s| {
        let _ = done_rx.recv();
        drop(s);
    });
    let mut e = engine(&addr);
    let (mem, mut queue) = queue_with_writes(N);
    let (tx, rx) = mpsc::channel();
    // The queue's worker, as the vhost-user backend runs it.
    std::thread::spawn(move || {
        let t = Instant::now();
        e.process_avail(&mut queue, &mem).unwrap();
        let submit = t.elapsed();
        let wants_write = e.wants_write();
        let waiting = e.inflight();
        let t = Instant::now();
        e.drain(&mut queue, &mem, Duration::from_secs(1)).unwrap();
        let drain = t.elapsed();
        let statuses: Vec<u8> = (0..N).map(|i| status(&mem, i)).collect();
        let used = queue.used_idx(&*mem, std::sync::atomic::Ordering::Acquire);
        tx.send((
            submit,
            wants_write,
            waiting,
            drain,
            e.inflight(),
            statuses,
            used,
        ))
        .unwrap();
    });
    let (submit, wants_write, waiting, drain, left, statuses, used) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the queue's worker blocked on the socket of a lender that does not read");
    assert!(
        submit < Duration::from_secs(1),
        "submitting took {submit:?}"
    );
    assert!(
        wants_write,
        "the socket is full: the worker must watch it for writability"
    );
    assert_eq!(waiting, usize::from(N));
    assert!(
        drain >= Duration::from_millis(900) && drain < Duration::from_secs(3),
        "the drain answered after {drain:?}, not at its 1 s deadline"
    );
    assert_eq!(left, 0);
    assert_eq!(used.unwrap().0, N, "every chain back in the used ring");
    assert!(
        statuses.iter().all(|&s| s == S_IOERR),
        "requests that could not complete fail with IOERR: {statuses:?}"
    );
    let _ = done_tx.send(());
    lender.join().unwrap();
}

/// Answers every held write, oldest first.
fn answer(s: &mut TcpStream, held: &mut Vec<RequestHeader>) {
    for h in held.drain(..) {
        let r = ResponseHeader {
            status: Status::Ok,
            len: devlend_fabric::Bytes(0),
            id: h.id,
            throttled: false,
        };
        s.write_all(&r.encode()).unwrap();
    }
}

/// What the credit-checking lender saw.
#[derive(Debug, Default)]
struct Seen {
    requests: usize,
    most_outstanding: usize,
    most_bytes: usize,
    sectors: Vec<u64>,
}

#[test]
fn a_borrower_never_has_more_outstanding_than_the_credit_and_everything_completes_in_order() {
    const N: u16 = 40;
    let credit = Credit {
        requests: 4,
        bytes: 2 * DATA_LEN,
    };
    let (seen_tx, seen_rx) = mpsc::channel();
    let (addr, lender) = fake_lender(Some(credit), move |mut s| {
        let mut seen = Seen::default();
        let mut held: Vec<RequestHeader> = Vec::new();
        let mut bytes = 0usize;
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        while seen.requests < usize::from(N) {
            let mut hb = [0u8; REQUEST_HEADER_LEN];
            match s.read_exact(&mut hb) {
                Ok(()) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    // The borrower stopped sending: answer what is held, oldest first.
                    answer(&mut s, &mut held);
                    bytes = 0;
                    continue;
                }
                Err(e) => panic!("lender read: {e}"),
            }
            let h = RequestHeader::decode(&hb).unwrap();
            assert_eq!(h.op(), Op::Write);
            let mut data = vec![0u8; h.request.data_len().usize()];
            s.set_read_timeout(None).unwrap();
            s.read_exact(&mut data).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            seen.requests += 1;
            seen.sectors.push(h.request.sector().0);
            bytes += h.request.data_len().usize();
            held.push(h);
            seen.most_outstanding = seen.most_outstanding.max(held.len());
            seen.most_bytes = seen.most_bytes.max(bytes);
        }
        answer(&mut s, &mut held);
        seen_tx.send(seen).unwrap();
        // Hold the connection until the borrower has taken the last answers.
        std::thread::sleep(Duration::from_millis(500));
    });
    let mut e = engine(&addr);
    assert_eq!(e.credit(), credit, "the credit the lender stated");
    let (mem, mut queue) = queue_with_writes(N);
    e.process_avail(&mut queue, &mem).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while queue
        .used_idx(&*mem, std::sync::atomic::Ordering::Acquire)
        .unwrap()
        .0
        < N
    {
        assert!(Instant::now() < deadline, "requests stopped completing");
        std::thread::sleep(Duration::from_millis(2));
        e.process_responses(&mut queue, &mem).unwrap();
    }
    let seen = seen_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    lender.join().unwrap();
    assert_eq!(seen.requests, usize::from(N));
    assert!(
        seen.most_outstanding <= credit.requests as usize,
        "{} requests outstanding at once, credit {}",
        seen.most_outstanding,
        credit.requests
    );
    assert!(
        seen.most_bytes <= credit.bytes as usize,
        "{} bytes outstanding at once, credit {}",
        seen.most_bytes,
        credit.bytes
    );
    let want: Vec<u64> = (0..u64::from(N)).map(|i| i * 1024).collect();
    assert_eq!(seen.sectors, want, "sent in submission order");
    assert!((0..N).all(|i| status(&mem, i) == S_OK));
}

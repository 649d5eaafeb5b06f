//! Wire input from a misbehaving lender: every malformed response closes that session
//! with a logged reason, nothing panics, and the requests in flight are resent on a new
//! session (which here answers properly), so the guest sees them complete.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devlend_backend::blk::engine::{QueueEngine, QueueStats};
use devlend_backend::blk::spec::*;
use devlend_backend::blk::DeviceLimits;
use devlend_backend::guest::GuestMemory;
use devlend_backend::lender::{LenderTarget, Transport};
use devlend_fabric::handshake::{Hello, DEV_DISCARD};
use devlend_fabric::wire::{RequestHeader, ResponseHeader, REQUEST_HEADER_LEN};
use devlend_fabric::{BlockGeometry, HelloReply, Status};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress};

const STATUS: u64 = 0x8000;

fn info() -> BlockGeometry {
    BlockGeometry {
        capacity_sectors: 2048,
        block_size: 512,
        max_transfer: 1 << 20,
        max_discard_sectors: 1024,
        max_write_zeroes_sectors: 0,
        flags: DEV_DISCARD,
        serial: [0; 20],
    }
}

/// A lender that answers the handshake, reads one request, then does `misbehave`.
/// Every later connection is answered properly (handshake, then a correct response),
/// so that the borrower's reconnect can be checked.
fn rogue(misbehave: fn(&mut TcpStream, RequestHeader)) -> (String, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        for (n, s) in l.incoming().take(2).enumerate() {
            let mut s = s.unwrap();
            Hello::read_from(&mut s).unwrap();
            HelloReply::ok(info()).write_to(&mut s).unwrap();
            let mut h = [0u8; REQUEST_HEADER_LEN];
            if s.read_exact(&mut h).is_err() {
                continue;
            }
            let req = RequestHeader::decode(&h).unwrap();
            if n == 0 {
                misbehave(&mut s, req);
            } else {
                let mut b = ResponseHeader {
                    status: Status::Ok,
                    len: req.request.data_len(),
                    id: req.id,
                    throttled: false,
                }
                .encode()
                .to_vec();
                b.extend(std::iter::repeat_n(0x77u8, req.request.data_len().usize()));
                s.write_all(&b).unwrap();
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
    (addr, t)
}

/// Runs one 512-byte read through an engine against `addr`; returns the status byte.
fn read_one(
    engine: &mut QueueEngine,
    mem: &Arc<GuestMemory>,
    mock: &MockSplitQueue<GuestMemory>,
    queue: &mut Queue,
    n: u16,
) -> u8 {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&T_IN.to_le_bytes());
    mem.write_slice(&h, GuestAddress(0x10000)).unwrap();
    mem.write_slice(&[0xff], GuestAddress(STATUS)).unwrap();
    let base = n * 3;
    let descs = [
        Descriptor::new(0x10000, 16, VRING_DESC_F_NEXT as u16, base + 1),
        Descriptor::new(
            0x20000,
            512,
            (VRING_DESC_F_NEXT | VRING_DESC_F_WRITE) as u16,
            base + 2,
        ),
        Descriptor::new(STATUS, 1, VRING_DESC_F_WRITE as u16, 0),
    ];
    let raw: Vec<RawDescriptor> = descs.iter().map(|d| RawDescriptor::from(*d)).collect();
    mock.add_desc_chains(&raw, base).unwrap();
    engine.process_avail(queue, mem).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while mock.used().idx().load() == n {
        assert!(Instant::now() < deadline, "request never completed");
        std::thread::sleep(Duration::from_millis(2));
        engine.process_responses(queue, mem).unwrap();
        engine.on_timer(queue, mem).unwrap();
    }
    let mut s = [0u8; 1];
    mem.read_slice(&mut s, GuestAddress(STATUS)).unwrap();
    s[0]
}

fn check(misbehave: fn(&mut TcpStream, RequestHeader)) {
    let (addr, t) = rogue(misbehave);
    let mem = Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap());
    let limits = Arc::new(DeviceLimits::from_device_info(&info()));
    let stats = Arc::new(QueueStats::default());
    let mut engine = QueueEngine::new(
        0,
        LenderTarget {
            addr,
            alt_addrs: Vec::new(),
            device: "d".into(),
            borrower: [1; 16],
            token: Vec::new(),
            tls: None,
            transport: Transport::Tcp { relay: None },
            lender_key: None,
            holder: None,
            mint: None,
        },
        limits,
        stats.clone(),
    );
    engine.connect().unwrap();
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), 64);
    let mut queue: Queue = mock.create_queue().unwrap();
    // The first session breaks the protocol; the read is resent on a second one, whose
    // answer completes it.
    assert_eq!(read_one(&mut engine, &mem, &mock, &mut queue, 0), S_OK);
    assert_eq!(engine.inflight(), 0);
    let mut data = [0u8; 512];
    mem.read_slice(&mut data, GuestAddress(0x20000)).unwrap();
    assert_eq!(data, [0x77; 512]);
    let s = stats.snapshot();
    assert_eq!((s.reconnects, s.resent, s.errors), (1, 1, 0));
    t.join().unwrap();
}

#[test]
fn unknown_response_opcode() {
    check(|s, req| {
        let mut b = ResponseHeader {
            status: Status::Ok,
            len: devlend_fabric::Bytes(0),
            id: req.id,
            throttled: false,
        }
        .encode();
        b[0] = 0x42;
        s.write_all(&b).unwrap();
    });
}

#[test]
fn unknown_status() {
    check(|s, req| {
        let mut b = ResponseHeader {
            status: Status::Ok,
            len: devlend_fabric::Bytes(0),
            id: req.id,
            throttled: false,
        }
        .encode();
        b[1] = 9;
        s.write_all(&b).unwrap();
    });
}

#[test]
fn response_for_an_id_not_in_flight() {
    check(|s, req| {
        let b = ResponseHeader {
            status: Status::Ok,
            len: req.request.data_len(),
            id: req.id ^ (1 << 40),
            throttled: false,
        }
        .encode();
        s.write_all(&b).unwrap();
    });
}

#[test]
fn read_response_of_the_wrong_length() {
    check(|s, req| {
        let b = ResponseHeader {
            status: Status::Ok,
            len: devlend_fabric::Bytes(req.request.data_len().0 * 2),
            id: req.id,
            throttled: false,
        }
        .encode();
        s.write_all(&b).unwrap();
        s.write_all(&vec![0u8; 2 * req.request.data_len().usize()])
            .unwrap();
    });
}

#[test]
fn lender_closes_mid_payload() {
    check(|s, req| {
        let b = ResponseHeader {
            status: Status::Ok,
            len: req.request.data_len(),
            id: req.id,
            throttled: false,
        }
        .encode();
        s.write_all(&b).unwrap();
        s.write_all(&[1u8; 100]).unwrap();
    });
}

#[test]
fn truncated_header_then_close() {
    check(|s, _req| {
        s.write_all(&[0x80, 0, 0]).unwrap();
    });
}

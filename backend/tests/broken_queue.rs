//! A driver that corrupts its virtqueue stops that queue once (virtio 1.2 §2.1.2,
//! §2.7.6), driven through the real queue engine on `virtio_queue::mock::MockSplitQueue`:
//! an available index far past the queue size, or a head index out of range, breaks the
//! queue; further kicks cost nothing and take nothing; the frontend's re-initialization
//! (GET_VRING_BASE: `reset_broken`) makes it usable again. No lender is needed: nothing
//! of a broken queue reaches one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_backend::blk::engine::{QueueEngine, QueueStats};
use devlend_backend::blk::DeviceLimits;
use devlend_backend::guest::GuestMemory;
use devlend_backend::lender::LenderTarget;
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const QSIZE: u16 = 256;

fn engine() -> QueueEngine {
    // Nothing listens: nothing may be sent.
    let target = LenderTarget::direct("127.0.0.1:9", "disk", [1; 16]);
    let limits = Arc::new(DeviceLimits::from_device_info(
        &devlend_fabric::BlockGeometry {
            capacity_sectors: 2048,
            block_size: 512,
            max_transfer: 1 << 20,
            ..Default::default()
        },
    ));
    QueueEngine::new(0, target, limits, Arc::new(QueueStats::default()))
}

fn memory() -> Arc<GuestMemory> {
    Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap())
}

/// The avail ring's index field (offset 2 of the avail ring).
fn set_avail_idx(mem: &GuestMemory, queue: &Queue, idx: u16) {
    mem.write_obj(idx, GuestAddress(queue.avail_ring() + 2))
        .unwrap();
}

#[test]
fn an_avail_index_past_the_queue_size_breaks_the_queue_once_and_costs_nothing_after() {
    let mem = memory();
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
    let mut queue: Queue = mock.create_queue().unwrap();
    let mut e = engine();
    set_avail_idx(&mem, &queue, 40000);
    assert!(!e.process_avail(&mut queue, &mem).unwrap());
    assert!(e.is_broken(), "40000 chains available on a queue of 256");
    assert!(e.take_newly_broken(), "the frontend is to be told, once");
    assert!(!e.take_newly_broken());
    assert_eq!(queue.next_avail(), 0, "nothing taken from the ring");
    // A guest that keeps kicking costs no work and no log: 100000 kicks well under a
    // second (each one was a spin through the ring and a log line).
    let t = Instant::now();
    for _ in 0..100_000 {
        assert!(!e.process_avail(&mut queue, &mem).unwrap());
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(!e.take_newly_broken(), "told once only");
    assert_eq!(e.inflight(), 0);
    // The frontend stops the queue and the driver re-initializes it: served again.
    e.reset_broken();
    assert!(!e.is_broken());
    queue.set_next_avail(0);
    set_avail_idx(&mem, &queue, 0);
    assert!(!e.process_avail(&mut queue, &mem).unwrap());
    assert!(!e.is_broken(), "an empty, consistent ring is fine");
}

#[test]
fn a_head_index_out_of_range_breaks_the_queue() {
    let mem = memory();
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
    let mut queue: Queue = mock.create_queue().unwrap();
    let mut e = engine();
    // One chain whose head, as the avail ring names it, is 300 on a queue of 256.
    let d = RawDescriptor::from(Descriptor::new(0x8000, 16, 0, 0));
    mock.add_desc_chains(&[d], 0).unwrap();
    mem.write_obj(300u16, GuestAddress(queue.avail_ring() + 4))
        .unwrap();
    assert!(!e.process_avail(&mut queue, &mem).unwrap());
    assert!(e.is_broken());
    assert!(e.take_newly_broken());
    assert_eq!(e.inflight(), 0, "nothing went to the lender");
    assert_eq!(
        queue
            .used_idx(&*mem, std::sync::atomic::Ordering::Acquire)
            .unwrap()
            .0,
        0,
        "nothing was put in the used ring for a head that does not exist"
    );
}

#[test]
fn an_avail_index_at_most_the_queue_size_ahead_is_not_a_violation() {
    let mem = memory();
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
    let mut queue: Queue = mock.create_queue().unwrap();
    let mut e = engine();
    // Wrapping: last seen 65530, now 65530 + 256 (mod 2^16) is a full ring, legal.
    queue.set_next_avail(65530);
    queue.set_next_used(65530);
    set_avail_idx(&mem, &queue, 65530u16.wrapping_add(QSIZE));
    // The chains themselves are garbage (all-zero descriptors): they fail on their
    // own, but the queue is not broken by the index.
    let _ = e.process_avail(&mut queue, &mem);
    assert!(!e.is_broken());
}

fn nic() -> devlend_backend::net::pair::PairEngine {
    use devlend_backend::net::{pair::PairEngine, NetStats};
    let stats = Arc::new(NetStats::new(1, true, 1500));
    // Nothing listens: frames transmitted are dropped (counted) and returned.
    let target = LenderTarget::direct("127.0.0.1:9", "nic", [1; 16]);
    PairEngine::new(0, Arc::from("nic"), target, stats).unwrap()
}

/// Offers one transmit chain of `descs` (address, length, flags, next) from index
/// `first` of the descriptor table.
fn offer_chain(mock: &MockSplitQueue<GuestMemory>, first: u16, descs: &[(u64, u32, u16, u16)]) {
    for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
        let d = RawDescriptor::from(Descriptor::new(addr, len, flags, next));
        mock.desc_table().store(first + i as u16, d).unwrap();
    }
    let idx = mock.avail().idx().load();
    mock.avail()
        .ring()
        .ref_at(usize::from(idx % QSIZE))
        .unwrap()
        .store(u16::to_le(first));
    mock.avail().idx().store(idx.wrapping_add(1));
}

const NEXT: u16 = 1;

#[test]
fn a_nic_transmit_queue_with_a_corrupt_avail_index_breaks_once_not_a_spin() {
    use devlend_backend::net::pair::PairQueue;
    let mem = memory();
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
    let mut queue: Queue = mock.create_queue().unwrap();
    let mut e = nic();
    set_avail_idx(&mem, &queue, 40000);
    let (tx, rx) = std::sync::mpsc::channel();
    let m = mem.clone();
    std::thread::spawn(move || {
        let r = e.on_tx(&mut queue, &m);
        let _ = tx.send((r.is_ok(), e, queue));
    });
    // Without the check, on_tx never returns: virtio-queue takes no chain and
    // enable_notification keeps saying there are more.
    let (ok, mut e, mut queue) = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the transmit path spins on a corrupt avail index");
    assert!(ok);
    assert!(e.is_broken(PairQueue::Tx), "the transmitq is broken");
    assert!(!e.is_broken(PairQueue::Rx), "the receiveq is not");
    assert!(
        e.take_newly_broken(PairQueue::Tx),
        "the frontend is to be told"
    );
    assert!(!e.take_newly_broken(PairQueue::Tx), "once");
    // Kicks on the broken queue cost nothing and take nothing.
    let t = Instant::now();
    for _ in 0..100_000 {
        assert!(!e.on_tx(&mut queue, &mem).unwrap());
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(!e.take_newly_broken(PairQueue::Tx));
    assert_eq!(queue.next_avail(), 0);
    // Re-initialized by the frontend: frames are taken again.
    e.reset_broken(PairQueue::Tx);
    set_avail_idx(&mem, &queue, 0);
    offer_chain(&mock, 0, &[(0x8000, 12 + 60, 0, 0)]);
    assert!(
        e.on_tx(&mut queue, &mem).unwrap(),
        "a frame is taken and returned"
    );
    assert!(!e.is_broken(PairQueue::Tx));
}

#[test]
fn a_malformed_transmit_chain_breaks_the_queue_and_a_bad_frame_does_not() {
    use devlend_backend::net::pair::PairQueue;
    let mem = memory();
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
    let mut queue: Queue = mock.create_queue().unwrap();
    let mut e = nic();
    // Bad frames in well-formed chains: shorter than a header, longer than any frame,
    // with no readable byte at all. Dropped and returned; the queue goes on.
    offer_chain(&mock, 0, &[(0x8000, 4, 0, 0)]);
    offer_chain(&mock, 1, &[(0x8000, 200_000, 0, 0)]);
    offer_chain(&mock, 2, &[(0x8000, 100, 2, 0)]);
    assert!(e.on_tx(&mut queue, &mem).unwrap());
    assert!(!e.is_broken(PairQueue::Tx));
    assert_eq!(queue.next_used(), 3, "the three chains are returned");
    // A chain that loops: the queue stops, that chain is not taken.
    offer_chain(&mock, 3, &[(0x8000, 12, NEXT, 4), (0x9000, 60, NEXT, 3)]);
    assert!(!e.on_tx(&mut queue, &mem).unwrap());
    assert!(
        e.is_broken(PairQueue::Tx),
        "a looping chain breaks the transmitq"
    );
    assert_eq!(
        queue.next_avail(),
        3,
        "GET_VRING_BASE names the looping chain"
    );
    assert_eq!(queue.next_used(), 3);
    for (what, descs) in [
        (
            "a buffer outside guest memory",
            vec![(0x10_0000_0000, 72, 0, 0)],
        ),
        (
            "a next past the queue",
            vec![(0x8000, 12, NEXT, 300), (0, 0, 0, 0)],
        ),
    ] {
        let mem = memory();
        let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
        let mut queue: Queue = mock.create_queue().unwrap();
        let mut e = nic();
        offer_chain(&mock, 0, &descs);
        e.on_tx(&mut queue, &mem).unwrap();
        assert!(e.is_broken(PairQueue::Tx), "{what}");
        assert_eq!(queue.next_used(), 0, "{what}: nothing returned");
    }
}

#[test]
fn a_nic_receive_queue_with_a_corrupt_avail_index_breaks_on_its_kick() {
    use devlend_backend::net::pair::PairQueue;
    let mem = memory();
    let mock = MockSplitQueue::create(&*mem, GuestAddress(0), QSIZE);
    let mut queue: Queue = mock.create_queue().unwrap();
    let mut e = nic();
    // A kick with nothing waiting: nothing to do, and a consistent ring is fine.
    assert!(!e.deliver_held(&mut queue, &mem).unwrap());
    assert!(!e.is_broken(PairQueue::Rx));
    set_avail_idx(&mem, &queue, 40000);
    assert!(!e.deliver_held(&mut queue, &mem).unwrap());
    assert!(e.is_broken(PairQueue::Rx));
    assert!(!e.is_broken(PairQueue::Tx));
    assert!(e.take_newly_broken(PairQueue::Rx));
    for _ in 0..1000 {
        assert!(!e.deliver_held(&mut queue, &mem).unwrap());
    }
    assert!(!e.take_newly_broken(PairQueue::Rx));
    e.reset_broken(PairQueue::Rx);
    set_avail_idx(&mem, &queue, 0);
    assert!(!e.deliver_held(&mut queue, &mem).unwrap());
    assert!(!e.is_broken(PairQueue::Rx));
}

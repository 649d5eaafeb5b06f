//! The RDMA block engine driven through a fake borrower ([`Borrower`], a
//! [`QueuePair`] that moves bytes between the slots' buffers and its own "guest
//! memory" as RDMA READs and WRITEs would) and a [`DeviceIo`] that hands completions
//! back out of order: reads and writes land where their segments say, in any order;
//! more requests than I/O slots wait in arrival order; a bad rkey ends the session
//! with its reason after the device I/O in flight came back; a borrower that ignores
//! its receive buffers is cut off.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use devlend_fabric::rdma::verbs::{Completion, RECV_BIT};
use devlend_fabric::rdma::{encode_request, RdmaError, Segment, RECV_DEPTH};
use devlend_fabric::wire::{RequestHeader, ResponseHeader, RESPONSE_HEADER_LEN};
use devlend_fabric::{BlockRequest, Bytes, Sector, Status};

use super::*;
use crate::block::fake_io::{block, device, reordered_io};
use crate::block::io::Inline;
use crate::device::Device;

/// The rkey of the fake borrower's guest memory; any other is refused.
const RKEY: u32 = 0x5eed;
/// Bytes of the fake guest memory.
const GUEST: usize = 1 << 20;
/// Bytes of a slot's buffer (the engine's `max_transfer`).
const SLOT_BYTES: usize = 64 << 10;

/// A borrower on the far side of the queue pair: it posts requests as RECV
/// completions, serves RDMA READs and WRITEs from and into `guest`, and records the
/// responses it is SENT. `stop` is set once `stop_after` responses came.
struct Borrower {
    recv: Vec<Vec<u8>>,
    ready: VecDeque<Completion>,
    guest: Vec<u8>,
    responses: Vec<ResponseHeader>,
    /// The guest addresses of the writes' first segments, in the order their RDMA
    /// READs came (each request's data has its own place: this is the request order).
    read_order: Vec<u64>,
    /// Receive buffers posted again.
    reposted: usize,
    /// Readable while completions are ready.
    event: OwnedFd,
    stop: Arc<AtomicBool>,
    stop_after: usize,
    /// Requests sent and not answered, and the most seen at once with the device.
    outstanding: usize,
}

impl Borrower {
    fn new(stop_after: usize) -> Borrower {
        // SAFETY: a plain system call; the descriptor is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(fd >= 0, "eventfd");
        Borrower {
            recv: vec![Vec::new(); RECV_DEPTH],
            ready: VecDeque::new(),
            guest: vec![0; GUEST],
            responses: Vec::new(),
            read_order: Vec::new(),
            reposted: 0,
            // SAFETY: `fd` is a new descriptor nothing else owns.
            event: unsafe { OwnedFd::from_raw_fd(fd) },
            stop: Arc::new(AtomicBool::new(false)),
            stop_after,
            outstanding: 0,
        }
    }

    fn complete(&mut self, c: Completion) {
        self.ready.push_back(c);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd.
        unsafe { libc::write(self.event.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// A send-side work request done (`error`: how it failed).
    fn completed(&mut self, wr_id: u64, error: Option<&'static str>) {
        self.complete(Completion {
            wr_id,
            error,
            recv: false,
            byte_len: 0,
        });
    }

    /// Sends request `id` (`request`, its data at `segs` of the guest memory) in
    /// receive buffer `buf`.
    fn send(&mut self, buf: usize, id: u64, request: BlockRequest, segs: &[Segment]) {
        let header = RequestHeader { id, request }.encode();
        let mut msg = vec![0u8; 4096];
        let n = encode_request(&header, segs, &mut msg);
        msg.truncate(n);
        self.recv[buf % RECV_DEPTH] = msg;
        self.outstanding += 1;
        self.complete(Completion {
            wr_id: RECV_BIT | (buf % RECV_DEPTH) as u64,
            error: None,
            recv: true,
            byte_len: n as u32,
        });
    }

    /// The guest memory `seg` names, if its rkey and range are good.
    fn range(&self, seg_addr: u64, len: u32, rkey: u32) -> Option<std::ops::Range<usize>> {
        let start = usize::try_from(seg_addr).ok()?;
        let end = start.checked_add(len as usize)?;
        (rkey == RKEY && end <= self.guest.len()).then_some(start..end)
    }
}

impl QueuePair for Borrower {
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        let mut sink = [0u8; 8];
        // SAFETY: reads 8 bytes into a live buffer from a non-blocking eventfd.
        unsafe { libc::read(self.event.as_raw_fd(), sink.as_mut_ptr().cast(), 8) };
        out.extend(self.ready.drain(..));
        Ok(())
    }

    fn fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn recv_msg(&self, i: usize, len: usize) -> &[u8] {
        &self.recv[i][..len]
    }

    fn post_recv(&mut self, _i: usize) -> Result<(), RdmaError> {
        self.reposted += 1;
        Ok(())
    }

    fn post_rdma(
        &mut self,
        read: bool,
        wr_id: u64,
        local: u64,
        _lkey: u32,
        len: u32,
        remote: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), RdmaError> {
        let Some(range) = self.range(remote, len, rkey) else {
            self.completed(wr_id, Some("remote access error"));
            return Ok(());
        };
        let local = local as *mut u8;
        if read && remote.is_multiple_of(4096) {
            self.read_order.push(remote);
        }
        if read {
            // SAFETY: `local` lies in a slot's live buffer (the engine posts its own
            // slots' addresses, `len` bytes within them); `range` is within `guest`.
            unsafe {
                std::ptr::copy_nonoverlapping(self.guest[range].as_ptr(), local, len as usize)
            };
        } else {
            // SAFETY: as above, copying the other way.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    local.cast_const(),
                    self.guest[range].as_mut_ptr(),
                    len as usize,
                )
            };
        }
        if signaled {
            self.completed(wr_id, None);
        }
        Ok(())
    }

    fn send_msg(&mut self, i: usize, msg: &[u8], wr_id: u64) -> Result<(), RdmaError> {
        assert!(i < IO_SLOTS, "a response from slot {i}");
        let mut h = [0u8; RESPONSE_HEADER_LEN];
        h.copy_from_slice(&msg[..RESPONSE_HEADER_LEN]);
        let r = ResponseHeader::decode(&h).expect("a well-formed response");
        self.responses.push(r);
        self.outstanding -= 1;
        if self.responses.len() >= self.stop_after {
            self.stop.store(true, Ordering::Release);
        }
        self.completed(wr_id, None);
        Ok(())
    }
}

fn slots() -> Vec<Slot> {
    (0..IO_SLOTS)
        .map(|i| Slot::unregistered(i, SLOT_BYTES))
        .collect()
}

/// 4 KiB of guest memory at `at`, in two 2 KiB segments.
fn segs(at: u64, rkey: u32) -> [Segment; 2] {
    [
        Segment {
            addr: at,
            rkey,
            len: 2048,
        },
        Segment {
            addr: at + 2048,
            rkey,
            len: 2048,
        },
    ]
}

fn write(sector: u64) -> BlockRequest {
    BlockRequest::Write {
        sector: Sector(sector),
        len: Bytes(4096),
    }
}

fn read(sector: u64) -> BlockRequest {
    BlockRequest::Read {
        sector: Sector(sector),
        len: Bytes(4096),
    }
}

/// Runs the engine on `b` over `dev`'s image, its device I/O (plain system calls)
/// handing the requests it finished back newest first. Returns how it ended, the slots, and how many completions were
/// reordered.
fn run_engine(b: &mut Borrower, dev: &Device) -> (End, Vec<Slot>, usize) {
    let count = Arc::new(AtomicUsize::new(0));
    let inner = Inline::new(Arc::clone(&dev.counters), block(dev), false).expect("inline");
    let io = reordered_io(inner, false, &count);
    let mut slots = slots();
    let stop = Arc::clone(&b.stop);
    let end = run(io, &dev.counters, block(dev), b, &mut slots, &stop);
    (end, slots, count.load(Ordering::Relaxed))
}

#[test]
fn reads_and_writes_move_through_guest_memory_in_any_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir);
    // Eight writes, each 4 KiB of its own pattern at its own guest address.
    let mut b = Borrower::new(8);
    for i in 0..8u64 {
        let at = i * 4096;
        for (k, byte) in b.guest[at as usize..at as usize + 4096]
            .iter_mut()
            .enumerate()
        {
            *byte = (i as u8).wrapping_mul(31).wrapping_add(k as u8);
        }
        b.send(i as usize, 100 + i, write(i * 8), &segs(at, RKEY));
    }
    let (end, _, reordered) = run_engine(&mut b, &dev);
    assert!(matches!(end, End::Stopped), "ended {}", describe(&end));
    assert!(reordered > 0, "no completions were reordered");
    let mut ids: Vec<u64> = b.responses.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, (100..108).collect::<Vec<_>>());
    assert!(b.responses.iter().all(|r| r.status == Status::Ok));
    let image = std::fs::read(&block(&dev).path).expect("image");
    assert_eq!(
        &image[..8 * 4096],
        &b.guest[..8 * 4096],
        "the writes landed"
    );
    // Read them back into other guest memory, in reverse order.
    let mut r = Borrower::new(8);
    for i in 0..8u64 {
        r.send(
            i as usize,
            200 + i,
            read((7 - i) * 8),
            &segs(0x8_0000 + i * 4096, RKEY),
        );
    }
    let (end, _, _) = run_engine(&mut r, &dev);
    assert!(matches!(end, End::Stopped), "ended {}", describe(&end));
    for i in 0..8usize {
        let got = &r.guest[0x8_0000 + i * 4096..0x8_0000 + (i + 1) * 4096];
        let want = &image[(7 - i) * 4096..(8 - i) * 4096];
        assert_eq!(got, want, "read {i} landed in its own segments");
    }
    assert!(r
        .responses
        .iter()
        .all(|h| h.status == Status::Ok && h.len == Bytes(4096)));
}

#[test]
fn more_requests_than_io_slots_wait_in_arrival_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir);
    let n = 3 * IO_SLOTS as u64;
    let mut b = Borrower::new(n as usize);
    for i in 0..n {
        b.send(i as usize, i, write(i * 8), &segs(i * 4096, RKEY));
    }
    let (end, slots, _) = run_engine(&mut b, &dev);
    assert!(matches!(end, End::Stopped), "ended {}", describe(&end));
    assert_eq!(b.responses.len(), n as usize);
    assert_eq!(
        b.read_order,
        (0..n).map(|i| i * 4096).collect::<Vec<_>>(),
        "the writes' data was fetched in arrival order"
    );
    assert_eq!(b.reposted, n as usize, "every receive buffer posted again");
    assert!(slots.iter().all(|s| s.req.is_some() && !s.busy));
}

#[test]
fn a_bad_rkey_ends_the_session_after_the_io_in_flight_came_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir);
    let mut b = Borrower::new(usize::MAX);
    for i in 0..4u64 {
        b.send(i as usize, i, read(i * 8), &segs(i * 4096, RKEY));
    }
    b.send(4, 4, write(64), &segs(0x10_0000 - 4096, RKEY ^ 1));
    let (end, slots, _) = run_engine(&mut b, &dev);
    match &end {
        End::Protocol(why) => assert!(why.contains("RDMA READ of guest memory"), "{why}"),
        other => panic!("ended {}", describe(other)),
    }
    assert!(
        slots.iter().all(|s| s.req.is_some()),
        "every request is back in its slot: none left with the device"
    );
    let image = std::fs::read(&block(&dev).path).expect("image");
    assert!(
        image[64 * 512..64 * 512 + 4096].iter().all(|&x| x == 0),
        "the write never ran"
    );
}

#[test]
fn a_borrower_beyond_its_receive_buffers_is_cut_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir);
    let mut b = Borrower::new(usize::MAX);
    for i in 0..=RECV_DEPTH as u64 {
        b.send(i as usize, i, BlockRequest::Flush, &[]);
    }
    let (end, _, _) = run_engine(&mut b, &dev);
    match &end {
        End::Protocol(why) => assert!(why.contains("requests outstanding"), "{why}"),
        other => panic!("ended {}", describe(other)),
    }
}

fn describe(end: &End) -> String {
    match end {
        End::Closed => "closed".into(),
        End::Stopped => "stopped".into(),
        End::Protocol(why) => format!("protocol: {why}"),
        End::Transport(e) => format!("transport: {e}"),
        End::Ring(e) => format!("ring: {e}"),
    }
}

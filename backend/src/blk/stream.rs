//! A queue's session on a byte stream (TCP, or the plaintext end of a TLS pump): the
//! stream [`QueueLink`].
//!
//! Send: requests join the send queue ([`TxQueue`]: headers, and a write's guest buffers,
//! no copy), which writes what the socket takes now and keeps the rest until it is
//! writable.
//!
//! Receive, the framing: the stream is response headers, each read's data right after
//! its header. Receives are vectored and non-blocking (`MSG_DONTWAIT`), straight into
//! the guest buffers of the read they complete, so a receive never reads past a header
//! whose data could follow, with two exceptions that know where the data goes: the rest
//! of a read's data and the next header; and, when the only request in flight is a
//! read, its header and its data. When no read is in flight the stream is headers only,
//! and one receive takes up to [`RX_HEADERS`] of them.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use devlend_fabric::conn::Stream;
use devlend_fabric::wire::RESPONSE_HEADER_LEN;
use devlend_fabric::{Credit, HelloReply};

use crate::blk::complete::Completer;
use crate::blk::link::{check_response, next_request, FabricFault, QueueLink};
use crate::blk::spec::S_OK;
use crate::blk::table::RequestTable;
use crate::blk::tx::TxQueue;
use crate::lender::LenderTarget;

/// Most response headers received in one call (when no read is in flight, responses
/// carry no data, so the stream is headers only).
const RX_HEADERS: usize = 64;

/// Largest iovec count per syscall (Linux UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// Receive progress on the stream.
#[derive(Debug, Clone, Copy)]
enum Rx {
    /// `got` bytes of the next response headers are in `rx_hdr`.
    Header { got: usize },
    /// `got` payload bytes of the read in slot `head` have landed in guest memory.
    Payload { head: u16, got: usize },
}

/// Where the bytes of the last receive went, beyond what [`Rx`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxLayout {
    /// Into `rx_hdr` only.
    Headers,
    /// A header into `rx_hdr`, then the data of the read in this slot, the only request
    /// in flight (nothing else can follow its response).
    HeaderThenData(u16),
    /// The rest of a read's data, then the next header into `rx_hdr`.
    DataThenHeader,
}

/// One queue's session on a stream.
pub(crate) struct StreamLink {
    stream: Stream,
    /// Requests written or waiting to be written.
    tx: TxQueue,
    rx: Rx,
    rx_layout: RxLayout,
    rx_hdr: Box<[u8; RESPONSE_HEADER_LEN * RX_HEADERS]>,
    rx_iovs: Vec<libc::iovec>,
}

impl StreamLink {
    /// Opens the session for virtqueue `index` (TCP connect, TLS if the target asks for
    /// it, through the gateway if routed; handshake).
    ///
    /// # Errors
    /// The connect, relay, TLS or handshake failure.
    pub(crate) fn open(
        target: &LenderTarget,
        index: u16,
    ) -> Result<(StreamLink, HelloReply), devlend_fabric::tcp::ConnectError> {
        let (stream, reply) = target.open(&target.hello(index))?;
        Ok((StreamLink::new(stream), reply))
    }

    /// A link on an open session.
    pub(crate) fn new(stream: Stream) -> Self {
        StreamLink {
            stream,
            tx: TxQueue::default(),
            rx: Rx::Header { got: 0 },
            rx_layout: RxLayout::Headers,
            rx_hdr: Box::new([0; RESPONSE_HEADER_LEN * RX_HEADERS]),
            rx_iovs: Vec::new(),
        }
    }
}

impl QueueLink for StreamLink {
    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// A lender of before credit stops reading beyond this: staying within it keeps
    /// that lender reading too.
    fn default_credit(&self) -> Credit {
        Credit::V1_DEFAULT
    }

    fn send(&mut self, table: &mut RequestTable, _: &mut Completer<'_>) -> Result<(), FabricFault> {
        let now = Instant::now();
        while let Some((head, header, data)) = next_request(table, now) {
            self.tx.push(header, head, data);
        }
        if self.tx.is_empty() {
            return Ok(());
        }
        let fd = self.stream.as_raw_fd();
        self.tx
            .write(fd, |h| table.iovs(h))
            .map_err(FabricFault::Io)
    }

    fn unsent(&self) -> bool {
        !self.tx.is_empty()
    }

    fn heartbeat(&mut self) -> Result<(), FabricFault> {
        if !self.tx.is_empty() {
            return Ok(());
        }
        self.tx.push(devlend_fabric::HEARTBEAT_FRAME, 0, 0);
        let fd = self.stream.as_raw_fd();
        self.tx.write(fd, |_| &[]).map_err(FabricFault::Io)
    }

    fn wants_write(&self) -> bool {
        self.tx.blocked()
    }

    fn receive(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
    ) -> Result<(), FabricFault> {
        let fd = self.stream.as_raw_fd();
        loop {
            let asked = self.build_rx_iovs(table);
            let n = match recv_vectored_nonblocking(fd, &mut self.rx_iovs) {
                Ok(None) => return Ok(()),
                Ok(Some(0)) => return Err(FabricFault::Closed),
                Ok(Some(n)) => n,
                Err(e) => return Err(FabricFault::Io(e)),
            };
            self.advance_rx(table, done, n)?;
            if n < asked {
                // A short receive emptied the socket: save the call that would say so
                // (the socket's readiness wakes the worker again when more arrives).
                return Ok(());
            }
        }
    }
}

impl StreamLink {
    /// Points the receive iovecs at where the next bytes of the stream belong; returns
    /// how many bytes they take (see the module doc).
    fn build_rx_iovs(&mut self, table: &RequestTable) -> usize {
        self.rx_iovs.clear();
        let hdr = self.rx_hdr.as_mut_ptr();
        let mut total = 0;
        match self.rx {
            Rx::Header { got } => {
                let single_read = table.inflight() == 1 && table.reads() == 1;
                let want = if got == 0 && single_read {
                    RESPONSE_HEADER_LEN
                } else if table.reads() == 0 {
                    // Headers only, one per request in flight (at least one header, to
                    // see a close or a stray response).
                    RESPONSE_HEADER_LEN * table.inflight().clamp(1, RX_HEADERS)
                } else {
                    RESPONSE_HEADER_LEN
                };
                let want = want.max(got + 1);
                // SAFETY: got < want ≤ the size of rx_hdr, so the range stays inside it.
                let base = unsafe { hdr.add(got) };
                self.rx_iovs.push(libc::iovec {
                    iov_base: base.cast(),
                    iov_len: want - got,
                });
                total += want - got;
                self.rx_layout = RxLayout::Headers;
                if got == 0 && single_read {
                    if let Some((head, pending)) =
                        table.only_head().and_then(|h| Some((h, table.pending(h)?)))
                    {
                        for iov in pending.iovs() {
                            self.rx_iovs.push(iov.as_iovec());
                            total += iov.len;
                        }
                        self.rx_layout = RxLayout::HeaderThenData(head);
                    }
                }
            }
            Rx::Payload { head, got } => {
                let mut skip = got;
                for iov in table.iovs(head) {
                    if skip >= iov.len {
                        skip -= iov.len;
                        continue;
                    }
                    // SAFETY: skip < iov.len, so the pointer stays inside this guest buffer.
                    let base = unsafe { iov.ptr.add(skip) };
                    self.rx_iovs.push(libc::iovec {
                        iov_base: base.cast(),
                        iov_len: iov.len - skip,
                    });
                    total += iov.len - skip;
                    skip = 0;
                }
                // Read the next response header in the same call.
                self.rx_iovs.push(libc::iovec {
                    iov_base: hdr.cast(),
                    iov_len: RESPONSE_HEADER_LEN,
                });
                total += RESPONSE_HEADER_LEN;
                self.rx_layout = RxLayout::DataThenHeader;
            }
        }
        total
    }

    /// `n` bytes were received as [`Self::build_rx_iovs`] laid them out: completes what
    /// they finish.
    fn advance_rx(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
        mut n: usize,
    ) -> Result<(), FabricFault> {
        loop {
            match self.rx {
                Rx::Header { got } => {
                    let layout = std::mem::replace(&mut self.rx_layout, RxLayout::Headers);
                    if let RxLayout::HeaderThenData(head) = layout {
                        return self.advance_single(table, done, head, got + n);
                    }
                    let have = got + n;
                    let mut at = 0;
                    while have - at >= RESPONSE_HEADER_LEN {
                        let mut h = [0u8; RESPONSE_HEADER_LEN];
                        h.copy_from_slice(&self.rx_hdr[at..at + RESPONSE_HEADER_LEN]);
                        at += RESPONSE_HEADER_LEN;
                        self.rx = Rx::Header { got: 0 };
                        self.on_header(table, done, &h)?;
                        if let Rx::Payload { .. } = self.rx {
                            if at != have {
                                // Never asked for: only one header is read while a read
                                // is in flight.
                                return Err(FabricFault::Misframed);
                            }
                            return Ok(());
                        }
                    }
                    let left = have - at;
                    self.rx_hdr.copy_within(at..have, 0);
                    self.rx = Rx::Header { got: left };
                    return Ok(());
                }
                Rx::Payload { head, got } => {
                    let want = table.data_len(head);
                    let take = n.min(want - got);
                    let got = got + take;
                    n -= take;
                    if got < want {
                        self.rx = Rx::Payload { head, got };
                        return Ok(());
                    }
                    // Back to headers first: a failed completion must not leave this
                    // response to be completed again by the next receive.
                    self.rx = Rx::Header { got: 0 };
                    done.complete(table, head, S_OK)?;
                    if n == 0 {
                        return Ok(());
                    }
                    // The rest of this receive is the start of the next header, which
                    // landed at the start of rx_hdr.
                }
            }
        }
    }

    /// A receive of `have` bytes laid out as [`RxLayout::HeaderThenData`] for the read in
    /// slot `head`, the only request in flight.
    fn advance_single(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
        head: u16,
        have: usize,
    ) -> Result<(), FabricFault> {
        if have < RESPONSE_HEADER_LEN {
            self.rx = Rx::Header { got: have };
            return Ok(());
        }
        let mut h = [0u8; RESPONSE_HEADER_LEN];
        h.copy_from_slice(&self.rx_hdr[..RESPONSE_HEADER_LEN]);
        let data = have - RESPONSE_HEADER_LEN;
        self.on_header(table, done, &h)?;
        match self.rx {
            Rx::Payload { head: h2, .. } if h2 == head => {
                let want = table.data_len(head);
                if data < want {
                    self.rx = Rx::Payload { head, got: data };
                    return Ok(());
                }
                self.rx = Rx::Header { got: 0 };
                Ok(done.complete(table, head, S_OK)?)
            }
            // Completed without data (an error status): nothing may follow it, since
            // nothing else was in flight.
            _ if data > 0 => Err(FabricFault::Misframed),
            _ => Ok(()),
        }
    }

    /// A whole response header: completes its request, or, for a read's data still to
    /// come, makes that the next thing received.
    fn on_header(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
        raw: &[u8; RESPONSE_HEADER_LEN],
    ) -> Result<(), FabricFault> {
        let r = check_response(table, raw)?;
        if r.throttled {
            done.throttled();
        }
        if r.data > 0 {
            self.rx = Rx::Payload {
                head: r.head,
                got: 0,
            };
            return Ok(());
        }
        Ok(done.complete(table, r.head, r.status)?)
    }
}

/// Receives into `iovs` without blocking. Returns Ok(None) when no data is ready,
/// Ok(Some(0)) on end of stream.
fn recv_vectored_nonblocking(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<Option<usize>> {
    let cnt = iovs.len().min(IOV_MAX);
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iovs.as_mut_ptr();
    msg.msg_iovlen = cnt;
    // SAFETY: msg describes `cnt` iovecs, each pointing at writable memory that is
    // alive for the call (the receive header buffer or guest memory kept alive by the
    // request in flight).
    super::nonblock::retry(|| unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blk::stats::QueueStats;
    use crate::blk::table::NewRequest;
    use crate::guest::{gather, GuestMemory, GuestMemoryRef};
    use devlend_fabric::wire::{RequestHeader, ResponseHeader, REQUEST_HEADER_LEN};
    use devlend_fabric::{BlockRequest, Bytes, Op, Sector, Status};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueT};
    use vm_memory::{Bytes as _, GuestAddress};

    /// Guest buffer of the request in slot `head` (its data, then its status byte).
    fn buf(head: u16) -> GuestAddress {
        GuestAddress(0x10_0000 + u64::from(head) * 0x1_0000)
    }

    fn status_of(head: u16) -> GuestAddress {
        GuestAddress(buf(head).0 + 0x8000)
    }

    /// Puts a request in slot `head` whose `len` data bytes are the guest buffer at
    /// `buf(head)`, in two iovecs (as if the chain had two data descriptors).
    fn insert(t: &mut RequestTable, mem: &GuestMemoryRef, head: u16, op: Op, len: u32) {
        let mut iovs = Vec::new();
        let half = len as usize / 2;
        assert!(gather(mem, buf(head), half, &mut iovs));
        assert!(gather(
            mem,
            GuestAddress(buf(head).0 + half as u64),
            len as usize - half,
            &mut iovs
        ));
        let (sector, bytes) = (Sector(u64::from(head)), Bytes(len));
        let req = match op {
            Op::Read => BlockRequest::Read { sector, len: bytes },
            Op::Write => BlockRequest::Write { sector, len: bytes },
            _ => BlockRequest::Flush,
        };
        let req = NewRequest {
            req,
            status_addr: status_of(head),
        };
        t.insert(head, req, &mut iovs, Arc::clone(mem));
    }

    fn response(t: &RequestTable, head: u16, status: Status) -> Vec<u8> {
        let pending = t.pending(head).unwrap();
        let len = if status == Status::Ok && pending.op() == Op::Read {
            pending.len()
        } else {
            0
        };
        let mut b = ResponseHeader {
            status,
            len: Bytes(len),
            id: pending.id(),
            throttled: false,
        }
        .encode()
        .to_vec();
        b.extend(std::iter::repeat_n(head as u8 ^ 0x5a, len as usize));
        b
    }

    #[test]
    fn responses_cut_anywhere_land_in_the_guest_buffers_of_their_requests() {
        let mem: GuestMemoryRef =
            Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 21)]).unwrap());
        let stats = QueueStats::new(1);
        // Each pass cuts the same responses at other places, down to single bytes.
        for cut in [1usize, 3, 16, 17, 700, 5000, 1 << 20] {
            let mock = MockSplitQueue::create(&*mem, GuestAddress(0), 16);
            let mut queue: Queue = mock.create_queue().unwrap();
            let (ours, mut lender) = UnixStream::pair().unwrap();
            lender.set_nonblocking(true).unwrap();
            let mut link = StreamLink::new(Stream::Tls(ours));
            let mut table = RequestTable::default();
            table.fit(16);
            let reqs = [
                (3, Op::Read, 4096),
                (7, Op::Write, 1024),
                (1, Op::Read, 512),
                (9, Op::Flush, 0),
                (4, Op::Read, 8192),
            ];
            for &(head, op, len) in &reqs {
                insert(&mut table, &mem, head, op, len);
                mem.write_obj(0xffu8, status_of(head)).unwrap();
            }
            mem.write_slice(&[0xabu8; 1024], buf(7)).unwrap();
            let mut done = Completer::new(&mut queue, &mem, &stats, 0);
            link.send(&mut table, &mut done).unwrap();
            assert!(!link.unsent());
            // The lender sees each header, and the write's data right after its own.
            let mut wire = vec![0u8; 5 * REQUEST_HEADER_LEN + 1024];
            lender.set_nonblocking(false).unwrap();
            lender.read_exact(&mut wire).unwrap();
            let mut at = 0;
            for &(head, op, len) in &reqs {
                let h =
                    RequestHeader::decode(wire[at..at + REQUEST_HEADER_LEN].try_into().unwrap())
                        .unwrap();
                let got = (h.op(), h.request.data_len(), h.id & 0xffff);
                assert_eq!(got, (op, Bytes(len), u64::from(head)));
                at += REQUEST_HEADER_LEN;
                if op == Op::Write {
                    assert!(wire[at..at + len as usize].iter().all(|&b| b == 0xab));
                    at += len as usize;
                }
            }
            // Answered out of order, one with an error (no data follows it), and
            // delivered `cut` bytes at a time with a receive after each piece.
            let mut answers = Vec::new();
            for (head, status) in [
                (4, Status::Ok),
                (9, Status::Ok),
                (1, Status::IoErr),
                (7, Status::Ok),
                (3, Status::Ok),
            ] {
                answers.extend(response(&table, head, status));
            }
            for piece in answers.chunks(cut) {
                lender.write_all(piece).unwrap();
                link.receive(&mut table, &mut done).unwrap();
            }
            assert!(done.used());
            assert_eq!(table.inflight(), 0, "cut {cut}: every request completed");
            assert_eq!(queue.next_used(), 5);
            for &(head, op, len) in &reqs {
                let mut s = [0u8];
                mem.read_slice(&mut s, status_of(head)).unwrap();
                let want = if head == 1 { 1 } else { 0 }; // IOERR, OK
                assert_eq!(s[0], want, "status of head {head}");
                if op == Op::Read && head != 1 {
                    let mut d = vec![0u8; len as usize];
                    mem.read_slice(&mut d, buf(head)).unwrap();
                    assert!(
                        d.iter().all(|&b| b == head as u8 ^ 0x5a),
                        "cut {cut}: data of head {head}"
                    );
                }
            }
        }
    }

    #[test]
    fn protocol_breaks_and_a_close_are_faults() {
        let mem: GuestMemoryRef =
            Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 21)]).unwrap());
        let stats = QueueStats::new(1);
        let run = |bytes: &dyn Fn(&RequestTable) -> Vec<u8>, close: bool| {
            let mock = MockSplitQueue::create(&*mem, GuestAddress(0), 16);
            let mut queue: Queue = mock.create_queue().unwrap();
            let (ours, mut lender) = UnixStream::pair().unwrap();
            let mut link = StreamLink::new(Stream::Tls(ours));
            let mut table = RequestTable::default();
            table.fit(16);
            insert(&mut table, &mem, 2, Op::Read, 512);
            insert(&mut table, &mem, 5, Op::Flush, 0);
            let mut done = Completer::new(&mut queue, &mem, &stats, 0);
            link.send(&mut table, &mut done).unwrap();
            // Taken by the lender (unread bytes would make its close a reset).
            lender
                .read_exact(&mut [0u8; 2 * REQUEST_HEADER_LEN])
                .unwrap();
            lender.write_all(&bytes(&table)).unwrap();
            if close {
                drop(lender);
            }
            // A receive that comes short returns; the close is seen by the next one.
            link.receive(&mut table, &mut done)?;
            if close {
                link.receive(&mut table, &mut done)?;
            }
            Ok::<_, FabricFault>(table.inflight())
        };
        let unknown = |t: &RequestTable| {
            let mut r = response(t, 5, Status::Ok);
            r[8] ^= 0x40; // another id
            r
        };
        assert!(matches!(
            run(&unknown, false),
            Err(FabricFault::UnknownId(_))
        ));
        let long = |t: &RequestTable| {
            let mut r = ResponseHeader {
                status: Status::Ok,
                len: Bytes(1024),
                id: t.pending(2).unwrap().id(),
                throttled: false,
            }
            .encode()
            .to_vec();
            r.extend([0u8; 1024]);
            r
        };
        assert!(matches!(
            run(&long, false),
            Err(FabricFault::BadLength {
                got: 1024,
                want: 512
            })
        ));
        let half = |t: &RequestTable| response(t, 2, Status::Ok)[..100].to_vec();
        assert_eq!(
            run(&half, false).unwrap(),
            2,
            "half a read: it waits for the rest"
        );
        assert!(matches!(run(&half, true), Err(FabricFault::Closed)));
        let flush_ok = |t: &RequestTable| response(t, 5, Status::Ok);
        assert_eq!(run(&flush_ok, false).unwrap(), 1);
    }
}

//! The lender's RDMA sessions: an rdma_cm listener, and per connection one thread
//! that answers the hello and serves requests. A PCIe function's session is handed to
//! [`crate::pci::rdma`] after the hello; what follows is the block path.
//!
//! A request arrives as a RECV (header + the borrower's segments). For a write the
//! session RDMA-READs the data out of guest memory into one of its own registered I/O
//! buffers, writes it to the device, then SENDs the response; for a read it reads the
//! device into the buffer, RDMA-WRITEs the data into guest memory, then SENDs the
//! response (an RC queue pair delivers them in that order). Device I/O uses plain
//! system calls on the session thread. Requests beyond the I/O buffers wait in order.
//! Anything malformed — a bad segment list, a failed RDMA READ/WRITE (bad rkey or
//! range) — closes that session with a logged reason.
//!
//! Each session is in the lender's registry beside the TCP ones: when its lease ends
//! (pool mode) or the lender shuts down, it is told to stop; it then takes no new
//! request, answers every request it had received, and closes (within [`STOP_CHECK`]
//! plus the time those take).

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::rdma::verbs::{lender_shape, Completion, Incoming, Listener, Mr, RECV_BIT};
use devlend_fabric::rdma::{decode_request, RdmaError, Segment};
use devlend_fabric::wire::RequestHeader;
use devlend_fabric::{Hello, HelloReply, Op};

use crate::device::Device;
use crate::request::{check_framing, Next, Request};
use crate::server::Shared;

/// Requests a session serves at once (each with its own registered I/O buffer of
/// `max_transfer` bytes); more wait in arrival order.
const IO_SLOTS: usize = 16;

/// How often a session checks whether it was told to stop (the poll timeout).
pub(crate) const STOP_CHECK: Duration = Duration::from_millis(200);

const TAG_SEND: u64 = 1 << 40;
const TAG_READ: u64 = 2 << 40;
const TAG_MASK: u64 = 0xff << 40;

/// Runs the rdma_cm accept loop until `shared` closes.
pub(crate) fn accept_loop(shared: Arc<Shared>, listener: Listener) {
    let mut next_id: u64 = 1 << 48;
    while !shared.is_closed() {
        let mut p = libc::pollfd {
            fd: listener.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the call.
        unsafe { libc::poll(&mut p, 1, 200) };
        while let Some(inc) = listener.accept() {
            let id = next_id;
            next_id += 1;
            let shared = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("dl-rdma-{id}"))
                .spawn(move || serve(&shared, inc, id));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start an RDMA session thread");
            }
        }
    }
}

/// One I/O buffer and the request using it. `mr` is declared first so that it is
/// deregistered before `req` frees the buffer.
struct Slot {
    mr: Mr,
    req: Request,
    segs: Vec<Segment>,
    busy: bool,
}

enum End {
    Closed,
    /// Told to stop (lease ended, lender shutting down); everything received answered.
    Stopped,
    Protocol(String),
    Transport(RdmaError),
}

/// Removes a session from the registry when it ends.
struct Registered<'a>(&'a Shared, u64);

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.0.unregister(self.1);
    }
}

fn serve(shared: &Shared, inc: Incoming, id: u64) {
    let peer = inc.peer();
    let _span = tracing::info_span!("rdma_session", id, %peer).entered();
    let Some(stop) = shared.register_rdma(id) else {
        devlend_fabric::limited!(info, %peer, "lender shutting down; RDMA connection not accepted");
        return;
    };
    let _registered = Registered(shared, id);
    let (mut conn, i, n) = match inc
        .establish(lender_shape(IO_SLOTS), shared.options.handshake_timeout)
    {
        Ok(x) => x,
        Err(e) => {
            devlend_fabric::limited!(warn, %peer, error = %devlend_fabric::error::chain(&e), "RDMA connection setup failed");
            return;
        }
    };
    let hello = match Hello::read_from(&mut conn.recv_msg(i, n)) {
        Ok(h) => h,
        Err(e) => {
            devlend_fabric::limited!(warn, %peer, error = %devlend_fabric::error::chain(&e), "bad hello over RDMA; closing");
            return;
        }
    };
    if let Err(e) = conn.post_recv(i) {
        devlend_fabric::limited!(warn, %peer, error = %e, "closing");
        return;
    }
    // A lender that requires TLS lends over RDMA only to a borrower that already holds
    // the device through a TLS session (its holding session); a PCIe function has no
    // holding session: it is lent over TCP+TLS only.
    let tls_refusal = shared.tls.get().is_some().then(|| match shared.device(&hello.device) {
        Some(d) if d.pci.is_some() => Some(format!(
            "this lender requires TLS: PCIe function {:?} is lent over TCP with TLS only (attach without --transport rdma)",
            hello.device
        )),
        Some(d) if !d.held_by(hello.borrower) => Some(format!(
            "this lender requires TLS: open the holding session of {:?} over TLS first (attach with --tls)",
            hello.device
        )),
        _ => None,
    });
    let admitted = match tls_refusal.flatten() {
        Some(reason) => Err((devlend_fabric::HelloStatus::Denied, reason)),
        None => crate::session::admit(shared, &hello, &peer, id),
    }
    .and_then(|(dev, a, c)| {
        // One borrower at a time: the session that gets here first holds the function.
        let lent = match &dev.pci {
            Some(pci) => Some(pci.try_lend().ok_or_else(|| {
                (
                    devlend_fabric::HelloStatus::Busy,
                    format!(
                        "PCIe function {:?} is lent to another session (one at a time)",
                        hello.device
                    ),
                )
            })?),
            None => None,
        };
        Ok((dev, a, c, lent))
    });
    let (dev, _active, _claim, lent) = match admitted {
        Ok(x) => x,
        Err((status, message)) => {
            devlend_fabric::limited!(info, %peer, device = %hello.device, ?status, reason = %message, "session refused");
            let mut msg = Vec::new();
            if HelloReply::refuse(status, &message)
                .write_to(&mut msg)
                .is_ok()
            {
                let _ = conn.send_msg(0, &msg, TAG_SEND | 0xffff);
                // Let the refusal leave before the QP goes.
                let mut out = Vec::new();
                let until = Instant::now() + Duration::from_millis(500);
                while out.is_empty() && Instant::now() < until {
                    if conn.poll(&mut out).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            return;
        }
    };
    if let (Some(pci), Some(_lent)) = (&dev.pci, lent) {
        let mut reply = HelloReply::ok(dev.info.clone());
        reply.features = devlend_fabric::pci::FEATURE_PCI;
        let mut msg = Vec::new();
        // The last send buffer: the session's messages start at the first.
        let slot = conn.send_slots() - 1;
        if reply.write_to(&mut msg).is_err()
            || conn.send_msg(slot, &msg, TAG_SEND | 0xffff).is_err()
        {
            devlend_fabric::limited!(warn, %peer, "cannot send the hello reply; closing");
            return;
        }
        devlend_fabric::limited!(info, %peer, device = %dev.name, "PCI session opened over RDMA");
        dev.stats.session_opened();
        let end = crate::pci::rdma::serve(pci, conn, &stop);
        dev.stats.session_closed();
        match end {
            crate::engine::End::PeerClosed => {
                devlend_fabric::limited!(info, %peer, device = %dev.name, "PCI session over RDMA closed")
            }
            crate::engine::End::Protocol(reason) => {
                dev.stats.protocol_error();
                devlend_fabric::limited!(warn, %peer, device = %dev.name, %reason, "protocol error; PCI session over RDMA closed");
            }
            e => {
                devlend_fabric::limited!(warn, %peer, device = %dev.name, error = %devlend_fabric::error::chain(&e), "PCI session over RDMA closed")
            }
        }
        return;
    }
    let max = dev.info.max_transfer as usize;
    let mut slots = Vec::with_capacity(IO_SLOTS);
    for _ in 0..IO_SLOTS {
        let mut req = Request::new();
        let buf = req.buffer(max);
        // SAFETY: the buffer is owned by `req`, sized once here and never grown
        // (requests are framed to ≤ max_transfer), and freed after the MR (field
        // order of `Slot`).
        let mr = match unsafe { Mr::register(conn.pd(), buf.as_mut_ptr(), buf.len(), false) } {
            Ok(m) => m,
            Err(e) => {
                devlend_fabric::limited!(warn, %peer, error = %devlend_fabric::error::chain(&e), "cannot register I/O buffers; closing");
                return;
            }
        };
        slots.push(Slot {
            mr,
            req,
            segs: Vec::new(),
            busy: false,
        });
    }
    let mut reply = Vec::new();
    if HelloReply::ok(dev.info.clone())
        .write_to(&mut reply)
        .is_err()
        || conn.send_msg(IO_SLOTS, &reply, TAG_SEND | 0xffff).is_err()
    {
        devlend_fabric::limited!(warn, %peer, "cannot send the hello reply; closing");
        return;
    }
    devlend_fabric::limited!(info, %peer, device = %dev.name, queue = hello.queue_index, "RDMA session opened");
    dev.stats.session_opened();
    let end = run(&dev, &mut conn, &mut slots, &stop);
    dev.stats.session_closed();
    match end {
        End::Closed => {
            devlend_fabric::limited!(info, %peer, device = %dev.name, "RDMA session closed")
        }
        End::Stopped => {
            devlend_fabric::limited!(info, %peer, device = %dev.name, "RDMA session stopped (lease ended or lender shutting down): requests answered, session closed")
        }
        End::Protocol(reason) => {
            dev.stats.protocol_error();
            devlend_fabric::limited!(warn, %peer, device = %dev.name, %reason, "protocol error; RDMA session closed");
        }
        End::Transport(e) => {
            devlend_fabric::limited!(warn, %peer, device = %dev.name, error = %devlend_fabric::error::chain(&e), "RDMA session closed")
        }
    }
    // The QP goes first (no RDMA into the buffers after), then the buffers' MRs.
    drop(conn);
    drop(slots);
}

fn run(
    dev: &Arc<Device>,
    conn: &mut devlend_fabric::rdma::verbs::Connection,
    slots: &mut [Slot],
    stop: &AtomicBool,
) -> End {
    let fd = dev.file.as_raw_fd();
    let mut stopping = false;
    let mut backlog: VecDeque<(RequestHeader, Vec<Segment>)> = VecDeque::new();
    let mut done: Vec<Completion> = Vec::new();
    let mut segs = Vec::new();
    loop {
        done.clear();
        let polled = conn.poll(&mut done);
        for c in done.drain(..) {
            if let Some(e) = c.error {
                let what = match c.wr_id & TAG_MASK {
                    TAG_READ => "an RDMA READ of guest memory (bad rkey, address or length from the borrower?)",
                    TAG_SEND => "a response SEND or an RDMA WRITE into guest memory (bad rkey, address or length?)",
                    _ if c.recv => return End::Closed,
                    _ => "a work request",
                };
                return End::Protocol(format!("{what} failed: {e}"));
            }
            if c.recv {
                if stopping {
                    // Not taken: the borrower resends it on its next session.
                    continue;
                }
                let i = (c.wr_id & !RECV_BIT) as usize;
                let h = match decode_request(conn.recv_msg(i, c.byte_len as usize), &mut segs) {
                    Ok(h) => h,
                    Err(e) => {
                        return End::Protocol(format!(
                            "bad request message: {}",
                            devlend_fabric::error::chain(&e)
                        ))
                    }
                };
                if let Err(e) = check_framing(&h) {
                    return End::Protocol(e.to_string());
                }
                if let Err(e) = conn.post_recv(i) {
                    return End::Transport(e);
                }
                // A borrower has at most one request per receive buffer outstanding
                // (its virtqueue is at most that large): more is a borrower that
                // ignores its credit, and must not grow the backlog without bound.
                if backlog.len() >= devlend_fabric::rdma::RECV_DEPTH {
                    return End::Protocol(format!(
                        "more than {} requests outstanding (the receive buffers posted)",
                        devlend_fabric::rdma::RECV_DEPTH
                    ));
                }
                dev.stats.request(h.op);
                backlog.push_back((h, std::mem::take(&mut segs)));
                continue;
            }
            let s = (c.wr_id & 0xffff) as usize;
            match c.wr_id & TAG_MASK {
                TAG_SEND if s < slots.len() => slots[s].busy = false,
                TAG_READ if s < slots.len() => {
                    // The write's data is in the buffer: to the device, then answer.
                    if let Err(e) = finish(dev, fd, conn, slots, s) {
                        return End::Transport(e);
                    }
                }
                _ => {}
            }
        }
        // Start what the free I/O buffers allow, in arrival order.
        while let Some(s) = slots.iter().position(|s| !s.busy) {
            let Some((h, segs)) = backlog.pop_front() else {
                break;
            };
            if let Err(e) = start(dev, fd, conn, slots, s, &h, segs) {
                return End::Transport(e);
            }
        }
        match polled {
            Ok(()) => {}
            Err(RdmaError::Disconnected) => return End::Closed,
            Err(e) => return End::Transport(e),
        }
        if !stopping && stop.load(Ordering::Acquire) {
            stopping = true;
        }
        if stopping && backlog.is_empty() && slots.iter().all(|s| !s.busy) {
            return End::Stopped;
        }
        let mut p = libc::pollfd {
            fd: conn.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the call.
        unsafe { libc::poll(&mut p, 1, STOP_CHECK.as_millis() as i32) };
    }
}

fn run_to_end(dev: &Device, fd: i32, req: &mut Request) {
    if req.touches_device() {
        dev.stats.device_op();
    }
    loop {
        let res = req.run_sync(fd);
        if let Next::Done = req.complete(res) {
            break;
        }
    }
}

fn start(
    dev: &Device,
    fd: i32,
    conn: &mut devlend_fabric::rdma::verbs::Connection,
    slots: &mut [Slot],
    s: usize,
    h: &RequestHeader,
    segs: Vec<Segment>,
) -> Result<(), RdmaError> {
    let slot = &mut slots[s];
    slot.busy = true;
    slot.segs = segs;
    let refused = slot.req.start(h, dev);
    if refused.is_none() && h.op == Op::Write {
        // Pull the data out of guest memory; the last READ is signaled (RC completes
        // them in order).
        let base = slot.mr.addr();
        let mut at = 0u64;
        let n = slot.segs.len();
        for (k, seg) in slot.segs.iter().enumerate() {
            conn.post_rdma(
                true,
                TAG_READ | s as u64,
                base + at,
                slot.mr.lkey(),
                seg.len,
                seg.addr,
                seg.rkey,
                k + 1 == n,
            )?;
            at += u64::from(seg.len);
        }
        return Ok(());
    }
    finish(dev, fd, conn, slots, s)
}

/// Runs the request's device I/O, pushes a read's data into guest memory, and sends
/// the response (signaled: its completion frees the slot).
fn finish(
    dev: &Device,
    fd: i32,
    conn: &mut devlend_fabric::rdma::verbs::Connection,
    slots: &mut [Slot],
    s: usize,
) -> Result<(), RdmaError> {
    let slot = &mut slots[s];
    run_to_end(dev, fd, &mut slot.req);
    slot.req.encode_response();
    let stats = &dev.stats;
    stats.answered(None);
    let (resp, data) = slot.req.response();
    let resp = *resp;
    let has_data = matches!(data, crate::request::ResponseData::Buf(b) if !b.is_empty());
    match (slot.req.data_bytes(), has_data) {
        (n, true) => {
            stats.read_bytes(n);
            let base = slot.mr.addr();
            let mut at = 0u64;
            for seg in &slot.segs {
                conn.post_rdma(
                    false,
                    TAG_SEND | s as u64,
                    base + at,
                    slot.mr.lkey(),
                    seg.len,
                    seg.addr,
                    seg.rkey,
                    false,
                )?;
                at += u64::from(seg.len);
            }
        }
        (n, false) if n > 0 => stats.wrote_bytes(n),
        _ => {}
    }
    conn.send_msg(s, &resp, TAG_SEND | s as u64)
}

//! The lender's RDMA sessions: an rdma_cm listener, and per connection one thread
//! that answers the hello (with the admission checks of [`crate::session::admit`]),
//! then serves the device: a block device's engine ([`block`], its device I/O through
//! [`crate::block::io`] as over TCP), or a PCIe function's session
//! ([`crate::pci::session::rdma`]).
//!
//! Each session is in the lender's registry beside the TCP ones: when its lease ends
//! (pool mode) or the lender shuts down, it is told to stop; it then takes no new
//! request, answers every request it had received, and closes (within
//! [`block::STOP_CHECK`] plus the time those take).

pub(crate) mod block;

use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::rdma::verbs::{lender_shape, Incoming, Listener};
use devlend_fabric::{Hello, HelloReply};

use self::block::{End, Slot, IO_SLOTS, RING_ENTRIES, TAG_SEND};
use crate::block::io::{SessionIo, Throttled};
use crate::device::Backing;
use crate::server::shared::Shared;
use crate::session::admit::admit;

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
        Some(d) if matches!(d.backing, Backing::Pci(_)) => Some(format!(
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
        None => admit(shared, &hello, &peer, id),
    }
    .and_then(|(dev, a, c)| {
        if c.is_standby() {
            return Err((
                devlend_fabric::HelloStatus::Busy,
                format!(
                    "device {:?} is handed over to this borrower when its holder lets go; a holding session goes over TCP",
                    hello.device
                ),
            ));
        }
        // One borrower at a time: the session that gets here first holds the function.
        let lent = match &dev.backing {
            Backing::Pci(pci) => Some(pci.try_lend().ok_or_else(|| {
                (
                    devlend_fabric::HelloStatus::Busy,
                    format!(
                        "PCIe function {:?} is lent to another session (one at a time)",
                        hello.device
                    ),
                )
            })?),
            Backing::Block(_) | Backing::Nic(_) => None,
        };
        Ok((dev, a, c, lent))
    });
    let (dev, _active, claim, lent) = match admitted {
        Ok(x) => x,
        Err((status, message)) => {
            devlend_fabric::limited!(info, %peer, device = %hello.device, ?status, reason = %message, "session refused");
            let mut msg = Vec::new();
            if HelloReply::refuse(status, &message)
                .for_version(hello.version)
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
    if let (Backing::Pci(pci), Some(_lent)) = (&dev.backing, lent) {
        let mut reply = HelloReply::ok(dev.info()).for_version(hello.version);
        reply.features = devlend_fabric::pci::FEATURE_PCI;
        reply.proof = shared.proof(&hello);
        let mut msg = Vec::new();
        // The last send buffer: the session's messages start at the first.
        let slot = conn.send_slots() - 1;
        // Counted before the reply leaves (a borrower with its reply sees the session).
        dev.stats.session_opened();
        if reply.write_to(&mut msg).is_err()
            || conn.send_msg(slot, &msg, TAG_SEND | 0xffff).is_err()
        {
            dev.stats.session_closed();
            devlend_fabric::limited!(warn, %peer, "cannot send the hello reply; closing");
            return;
        }
        devlend_fabric::limited!(info, %peer, device = %dev.name, "PCI session opened over RDMA");
        let end = crate::pci::session::rdma::serve(pci, conn, &stop);
        dev.stats.session_closed();
        match end {
            crate::session::end::End::PeerClosed => {
                devlend_fabric::limited!(info, %peer, device = %dev.name, "PCI session over RDMA closed")
            }
            crate::session::end::End::Protocol(reason) => {
                dev.stats.protocol_error();
                devlend_fabric::limited!(warn, %peer, device = %dev.name, %reason, "protocol error; PCI session over RDMA closed");
            }
            e => {
                devlend_fabric::limited!(warn, %peer, device = %dev.name, error = %devlend_fabric::error::chain(&e), "PCI session over RDMA closed")
            }
        }
        return;
    }
    let max = dev.info().as_block().map_or(0, |g| g.max_transfer) as usize;
    let mut slots = Vec::with_capacity(IO_SLOTS);
    for i in 0..IO_SLOTS {
        match Slot::new(&conn, i, max) {
            Ok(s) => slots.push(s),
            Err(e) => {
                devlend_fabric::limited!(warn, %peer, error = %devlend_fabric::error::chain(&e), "cannot register I/O buffers; closing");
                return;
            }
        }
    }
    let io = match SessionIo::new(Arc::clone(&dev), shared.options.io, RING_ENTRIES, false) {
        Ok(io) => io,
        Err(e) => {
            devlend_fabric::limited!(warn, %peer, error = %e, "cannot set up I/O for the session; closing");
            return;
        }
    };
    let mut reply = Vec::new();
    // Counted before the reply leaves (a borrower with its reply sees the session).
    dev.stats.session_opened();
    let mut answer = HelloReply::ok(dev.info()).for_version(hello.version);
    answer.proof = shared.proof(&hello);
    // A borrower that reads the throttle flag of responses gets it.
    answer.features = hello.features & devlend_fabric::FEATURE_THROTTLE_NOTE;
    let note = answer.features != 0;
    if answer.write_to(&mut reply).is_err()
        || conn.send_msg(IO_SLOTS, &reply, TAG_SEND | 0xffff).is_err()
    {
        dev.stats.session_closed();
        devlend_fabric::limited!(warn, %peer, "cannot send the hello reply; closing");
        return;
    }
    devlend_fabric::limited!(info, %peer, device = %dev.name, queue = hello.queue_index, "RDMA session opened");
    let group = Some(Arc::clone(claim.group()));
    let end = match io {
        SessionIo::Uring(io) => {
            let io = Throttled::new(io, group, Arc::clone(&dev), note);
            block::run(io, &dev, &mut conn, &mut slots, &stop)
        }
        SessionIo::Inline(io) => {
            let io = Throttled::new(io, group, Arc::clone(&dev), note);
            block::run(io, &dev, &mut conn, &mut slots, &stop)
        }
    };
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
        End::Ring(e) => {
            devlend_fabric::limited!(warn, %peer, device = %dev.name, error = %e, "io_uring failed; RDMA session closed")
        }
    }
    // The QP goes first (no RDMA into the buffers after), then the buffers' MRs.
    drop(conn);
    drop(slots);
}

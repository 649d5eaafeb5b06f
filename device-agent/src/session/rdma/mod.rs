//! The lender's RDMA sessions: an rdma_cm listener, and per connection one thread
//! that answers the hello (with the admission checks of [`crate::session::admit`]),
//! then serves the session its kind opens
//! ([`crate::kind::LentKind::open_rdma`]): a block device's engine
//! ([`crate::block::rdma`], its device I/O through [`crate::block::io`] as over TCP),
//! or a PCIe function's session
//! ([`crate::pci::session::rdma`]); a NIC is lent over TCP only.
//!
//! Each session is in the lender's registry beside the TCP ones: when its lease ends
//! (pool mode) or the lender shuts down, it is told to stop; it then takes no new
//! request, answers every request it had received, and closes (within
//! [`crate::block::rdma::STOP_CHECK`] plus the time those take).

use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::rdma::verbs::{lender_shape, Connection, Incoming, Listener};
use devlend_fabric::{Hello, HelloReply, HelloStatus};

use crate::block::rdma::{IO_SLOTS, TAG_SEND};
use crate::server::shared::{LenderState, Registered, Unregister};
use crate::session::admit::admit;
use crate::session::open::Opening;

/// Runs the rdma_cm accept loop until `shared` closes.
pub(crate) fn accept_loop(shared: Arc<LenderState>, listener: Listener) {
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
            // The handshake's deadline counts from the connection request; the caps are
            // TCP's, counted together with its connections.
            let deadline = Instant::now() + shared.options.handshake_timeout;
            let peer = inc
                .peer_ip()
                .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
            let stop = match shared.register_rdma(id, peer, deadline) {
                Ok(stop) => stop,
                Err(Registered::Refused(why)) => {
                    devlend_fabric::limited!(warn, %peer, reason = why, "RDMA connection request rejected");
                    inc.reject();
                    continue;
                }
                Err(_) => {
                    devlend_fabric::limited!(info, %peer, "lender shutting down; RDMA connection request rejected");
                    inc.reject();
                    continue;
                }
            };
            let registered = Unregister(Arc::clone(&shared), id);
            let shared = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("dl-rdma-{id}"))
                .spawn(move || serve(&shared, inc, id, &stop, deadline, registered));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start an RDMA session thread");
            }
        }
    }
}

fn serve(
    shared: &LenderState,
    inc: Incoming,
    id: u64,
    stop: &Arc<std::sync::atomic::AtomicBool>,
    deadline: Instant,
    _registered: Unregister,
) {
    let peer = inc.peer();
    let _span = tracing::info_span!("rdma_session", id, %peer).entered();
    let (mut conn, i, n) = match inc.establish(lender_shape(IO_SLOTS), deadline) {
        Ok(x) => x,
        Err(e) => {
            devlend_fabric::limited!(warn, %peer, error = %devlend_fabric::error::chain(&e), "RDMA connection setup failed");
            return;
        }
    };
    let mut hello = match Hello::read_from(&mut conn.recv_msg(i, n)) {
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
    if hello.proves_possession() && !take_possession(shared, &mut conn, &peer, &mut hello, deadline)
    {
        return;
    }
    // A lender that requires TLS lends over RDMA only to a borrower that already holds
    // the device through a TLS session (its holding session); what a kind without one
    // answers is the kind's.
    let tls_refusal = shared
        .tls
        .get()
        .and_then(|_| shared.device(&hello.device))
        .and_then(|d| {
            d.kind()
                .check_rdma_under_tls(&hello.device, d.held_by(hello.borrower))
                .err()
        });
    let admitted = match tls_refusal {
        Some(reason) => Err((HelloStatus::Denied, reason)),
        None => admit(shared, &hello, &peer, id),
    }
    .and_then(|(dev, a, c)| {
        if c.is_standby() {
            return Err((
                HelloStatus::Busy,
                format!(
                    "device {:?} is handed over to this borrower when its holder lets go; a holding session goes over TCP",
                    hello.device
                ),
            ));
        }
        Ok((dev, a, c))
    });
    let (dev, _active, claim) = match admitted {
        Ok(x) => x,
        Err((status, message)) => return refuse(&mut conn, &peer, &hello, status, &message),
    };
    // Only an admitted hello gets the session's buffers (about 6 MiB registered); until
    // here the connection holds a handshake's few.
    if let Err(e) = conn.grow() {
        let message = format!("cannot register the session's buffers: {e}");
        return refuse(&mut conn, &peer, &hello, HelloStatus::Busy, &message);
    }
    let at = Opening {
        dev: &dev.counters,
        hello: &hello,
        claim: &claim,
        options: &shared.options,
        // The session's stop flag is its fence.
        fence: None,
    };
    let opened = match dev.kind().open_rdma(&at, &conn) {
        Ok(o) => o,
        Err((status, message)) => return refuse(&mut conn, &peer, &hello, status, &message),
    };
    let answer = opened.reply(dev.info(), &hello, shared.proof(&hello));
    let mut msg = Vec::new();
    // Counted before the reply leaves (a borrower with its reply sees the session); the
    // session counts its end.
    dev.counters.stats.session_opened();
    let slot = opened.session.reply_slot(&conn);
    if answer.write_to(&mut msg).is_err() || conn.send_msg(slot, &msg, TAG_SEND | 0xffff).is_err() {
        dev.counters.stats.session_closed();
        devlend_fabric::limited!(warn, %peer, "cannot send the hello reply; closing");
        return;
    }
    shared.handshake_done(id);
    devlend_fabric::limited!(info, %peer, device = %dev.counters.name, kind = %dev.kind_name(), queue = hello.queue_index, "RDMA session opened");
    opened.session.serve(conn, stop, &peer);
}

/// Answers `hello` with a refusal (in the hello's version), and waits a little for it
/// to leave before the queue pair goes.
fn refuse(conn: &mut Connection, peer: &str, hello: &Hello, status: HelloStatus, message: &str) {
    devlend_fabric::limited!(info, %peer, device = %hello.device, ?status, reason = %message, "session refused");
    let mut msg = Vec::new();
    if HelloReply::refuse(status, message)
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
}

/// The interim reply (this lender's proof and a nonce) and the borrower's possession
/// message, within the handshake timeout; whether the handshake goes on (a failure is
/// logged, rate-limited, and ends it).
fn take_possession(
    shared: &LenderState,
    conn: &mut Connection,
    peer: &str,
    hello: &mut Hello,
    deadline: Instant,
) -> bool {
    let Some((reply, nonce)) = crate::session::possession::interim(shared, hello) else {
        devlend_fabric::limited!(warn, %peer, "no randomness for a handshake nonce; closing");
        return false;
    };
    let mut msg = Vec::new();
    if reply.write_to(&mut msg).is_err() || conn.send_msg(0, &msg, TAG_SEND | 0xffff).is_err() {
        devlend_fabric::limited!(warn, %peer, "cannot send the interim hello reply; closing");
        return false;
    }
    let (i, n) = match conn.wait_recv(deadline, "waiting for the possession message") {
        Ok(x) => x,
        Err(e) => {
            devlend_fabric::limited!(info, %peer, device = %hello.device, error = %devlend_fabric::error::chain(&e), "no possession message after this lender's proof; closing");
            return false;
        }
    };
    let possession = devlend_fabric::holder_proof::Possession::read_from(&mut conn.recv_msg(i, n));
    if let Err(e) = conn.post_recv(i) {
        devlend_fabric::limited!(warn, %peer, error = %e, "closing");
        return false;
    }
    match possession {
        Ok(p) => {
            crate::session::possession::take(hello, nonce, p);
            true
        }
        Err(e) => {
            devlend_fabric::limited!(warn, %peer, device = %hello.device, error = %e, "bad possession message over RDMA; closing");
            false
        }
    }
}

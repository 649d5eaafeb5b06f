//! One borrower connection: the handshake, then the I/O engine, then the bookkeeping.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use devlend_fabric::conn::Stream;
use devlend_fabric::error::chain;
use devlend_fabric::net::{FEATURE_NET, FEATURE_NET_OFFLOAD};
use devlend_fabric::pci::FEATURE_PCI;
use devlend_fabric::tls::{self, TlsError};
use devlend_fabric::{
    Credit, Hello, HelloReply, HelloStatus, WireError, FEATURE_CREDIT, PROTOCOL_VERSION,
};

use crate::device::{Claim, Device};
use crate::engine::{self, End};
use crate::server::{ActiveSession, Shared};
use crate::uring::Ring;
use crate::{MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES};

/// Submission entries of a session's ring (completions: twice as many). Every request in
/// flight has at most one operation queued (plus two socket polls), and the ring is
/// submitted as entries are queued, so this never limits the requests in flight.
const RING_ENTRIES: u32 = 1024;

/// The credit a block session grants: its whole request budget.
fn session_credit() -> Credit {
    Credit {
        requests: MAX_IN_FLIGHT as u32,
        bytes: MAX_IN_FLIGHT_BYTES as u32,
    }
}

/// Queue index of a borrower's holding session.
const CONTROL_QUEUE: u16 = u16::MAX;

/// Serves one accepted connection to its end.
pub(crate) fn serve(shared: &Shared, sock: TcpStream, peer: SocketAddr, id: u64) {
    // Every line this session logs carries its id and peer.
    let _span = tracing::info_span!("session", id, %peer).entered();
    if let Err(e) = sock.set_nodelay(true).and_then(|()| set_keepalive(&sock)) {
        devlend_fabric::limited!(warn, %peer, error = %e, "cannot set socket options; closing");
        return;
    }
    let sock = match shared.tls.get() {
        None => Stream::Tcp(sock),
        Some(config) => match accept_tls(shared, config, sock, peer) {
            Some(s) => s,
            None => return,
        },
    };
    let Some((dev, mut ring, _active, _claim, queue, lent, granted)) =
        handshake(shared, &sock, peer, id)
    else {
        return;
    };
    if let (Some(pci), Some(_lent)) = (&dev.pci, lent) {
        dev.stats.session_opened();
        let end = crate::pci::session::serve(pci, &sock, peer, shared.options.frame_timeout);
        dev.stats.session_closed();
        log_end(&dev, peer, &end);
        return;
    }
    dev.stats.session_opened();
    tracing::debug!(%peer, id, "session serving");
    let end = match (&dev.nic, queue) {
        (Some(_), CONTROL_QUEUE) => crate::nic::hold(&sock),
        (Some(nic), q) => {
            let offload = granted & FEATURE_NET_OFFLOAD != 0;
            crate::nic::serve(nic, &sock, peer, q, offload, shared.options.frame_timeout)
        }
        (None, _) => engine::run(
            &dev,
            &sock,
            peer,
            &mut ring,
            shared.options.frame_timeout,
            shared.options.io,
            granted & FEATURE_CREDIT != 0,
        ),
    };
    dev.stats.session_closed();
    log_end(&dev, peer, &end);
}

fn log_end(dev: &Device, peer: SocketAddr, end: &End) {
    match end {
        End::PeerClosed => {
            devlend_fabric::limited!(info, %peer, device = %dev.name, "session closed")
        }
        End::Protocol(reason) => {
            dev.stats.protocol_error();
            devlend_fabric::limited!(warn, %peer, device = %dev.name, %reason, "protocol error; session closed");
        }
        End::Socket(e) | End::Ring(e) => {
            devlend_fabric::limited!(warn, %peer, device = %dev.name, error = %e, "session closed: {end}");
        }
    }
}

/// What a successful handshake gives a session: the device, its ring, its slot among
/// the active sessions, the borrower's claim, the queue index, for a PCIe function the
/// function itself, taken for this session, and the features granted in the reply.
type Admitted<'s> = (
    Arc<Device>,
    Ring,
    ActiveSession<'s>,
    Claim,
    u16,
    Option<crate::pci::Lent>,
    u64,
);

/// Reads the hello and answers it. On success, returns the device, the session's ring,
/// and its slot among the lender's active sessions.
fn handshake<'s>(
    shared: &'s Shared,
    sock: &Stream,
    peer: SocketAddr,
    id: u64,
) -> Option<Admitted<'s>> {
    let timeout = Some(shared.options.handshake_timeout);
    if let Err(e) = sock
        .set_read_timeout(timeout)
        .and_then(|()| sock.set_write_timeout(timeout))
    {
        devlend_fabric::limited!(warn, %peer, error = %e, "cannot set the handshake timeout; closing");
        return None;
    }
    let hello = match Hello::read_from(&mut &*sock) {
        Ok(h) => h,
        Err(WireError::Closed) => {
            tracing::debug!(%peer, "peer closed the connection before its hello");
            return None;
        }
        Err(e) => {
            let cause = std::error::Error::source(&e)
                .map(|c| format!(": {c}"))
                .unwrap_or_default();
            devlend_fabric::limited!(warn, %peer, error = %format!("{e}{cause}"), "handshake failed");
            return None;
        }
    };
    let refuse = |status: HelloStatus, message: String| {
        devlend_fabric::limited!(info, %peer, device = %hello.device, ?status, reason = %message, "session refused");
        if let Err(e) = HelloReply::refuse(status, &message).write_to(&mut &*sock) {
            tracing::debug!(%peer, error = %e, "cannot send the refusal");
        }
        None
    };
    let (dev, active, claim) = match admit(shared, &hello, &peer, id) {
        Ok(x) => x,
        Err((status, message)) => return refuse(status, message),
    };
    let ring = match Ring::new(RING_ENTRIES) {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                HelloStatus::Busy,
                format!("cannot set up I/O for the session: {e}"),
            )
        }
    };
    // One borrower at a time: the session that gets here first holds the function.
    let lent = match &dev.pci {
        Some(pci) => match pci.try_lend() {
            Some(l) => Some(l),
            None => {
                return refuse(
                    HelloStatus::Busy,
                    format!(
                        "PCIe function {:?} is lent to another session (one at a time)",
                        hello.device
                    ),
                )
            }
        },
        None => None,
    };
    let reply = match &dev.nic {
        None if dev.pci.is_some() => {
            let mut r = HelloReply::ok(dev.info.clone());
            r.features = FEATURE_PCI;
            r
        }
        Some(nic) => {
            let mut r = HelloReply::ok(devlend_fabric::DeviceInfo::net(&nic.link()));
            // Offloads asked for are granted: the packet socket's vnet header has the
            // kernel complete checksums and segment in software where the interface
            // cannot.
            r.features = FEATURE_NET | (hello.features & FEATURE_NET_OFFLOAD);
            r
        }
        None => {
            let mut r = HelloReply::ok(dev.info.clone());
            // A borrower that keeps within a stated credit gets it: the session's whole
            // request budget, so that the session never has to stop reading it.
            if hello.features & FEATURE_CREDIT != 0 {
                r.credit = Some(session_credit());
            }
            r
        }
    };
    if let Err(e) = reply.write_to(&mut &*sock) {
        devlend_fabric::limited!(warn, %peer, device = %dev.name, error = %e, "cannot send the hello reply");
        return None;
    }
    if let Err(e) = sock
        .set_read_timeout(None)
        .and_then(|()| sock.set_write_timeout(None))
    {
        devlend_fabric::limited!(warn, %peer, error = %e, "cannot clear the handshake timeout; closing");
        return None;
    }
    devlend_fabric::limited!(info, %peer, device = %dev.name, queue = hello.queue_index, "session opened");
    let granted = match reply.credit {
        Some(_) => reply.features | FEATURE_CREDIT,
        None => reply.features,
    };
    Some((dev, ring, active, claim, hello.queue_index, lent, granted))
}

/// Runs the TLS handshake on an accepted connection (under the handshake timeout) and
/// starts its pump. A refused or failed handshake is logged at warn with the peer and
/// the reason; a plaintext devlend hello is answered, in plaintext, with status denied
/// and a message saying that TLS is required. Either way no device is touched.
fn accept_tls(
    shared: &Shared,
    config: &tls::ServerTls,
    mut sock: TcpStream,
    peer: SocketAddr,
) -> Option<Stream> {
    let timeout = Some(shared.options.handshake_timeout);
    if let Err(e) = sock
        .set_read_timeout(timeout)
        .and_then(|()| sock.set_write_timeout(timeout))
    {
        devlend_fabric::limited!(warn, %peer, error = %e, "cannot set the handshake timeout; closing");
        return None;
    }
    match tls::server_handshake(config, &mut sock) {
        Ok(conn) => match tls::spawn_pump(conn, sock, &peer.to_string()) {
            Ok(s) => Some(Stream::Tls(s)),
            Err(e) => {
                devlend_fabric::limited!(warn, %peer, error = %e, "cannot start the TLS pump; closing");
                None
            }
        },
        Err(TlsError::Plaintext) => {
            let device = Hello::read_from(&mut sock)
                .map(|h| h.device)
                .unwrap_or_default();
            let reason =
                "this lender requires TLS: attach with --tls (and give the compute agent --tls-ca)";
            devlend_fabric::limited!(warn, %peer, device = %device, reason = %TlsError::Plaintext, "plaintext connection refused");
            let _ = HelloReply::refuse(HelloStatus::Denied, reason).write_to(&mut sock);
            None
        }
        Err(TlsError::ClosedEarly) => {
            tracing::debug!(%peer, "peer closed the connection before its TLS hello");
            None
        }
        Err(e) => {
            devlend_fabric::limited!(warn, %peer, error = %chain(&e), "TLS handshake failed; connection refused");
            None
        }
    }
}

/// Turns on TCP keepalive (idle 60 s, then 6 probes 10 s apart), so that a session whose
/// borrower vanished without a FIN or RST ends within about two minutes instead of
/// waiting for a request forever.
fn set_keepalive(sock: &TcpStream) -> io::Result<()> {
    devlend_fabric::tcp::set_int_options(
        sock,
        &[
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 60),
            (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
            (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6),
        ],
    )
}

/// The admission checks of a hello, shared by every transport: version, device, lease
/// or key, one borrower per device, the session limit. Returns the device, the
/// borrower's claim on it and the session's slot, or the refusal to answer.
pub(crate) fn admit<'s>(
    shared: &'s Shared,
    hello: &Hello,
    peer: &dyn std::fmt::Display,
    id: u64,
) -> Result<(Arc<Device>, ActiveSession<'s>, Claim), (HelloStatus, String)> {
    if hello.version != PROTOCOL_VERSION {
        return Err((
            HelloStatus::UnsupportedVersion,
            format!(
                "protocol version {} is not supported; this lender speaks version {PROTOCOL_VERSION}",
                hello.version
            ),
        ));
    }
    let Some(dev) = shared.device(&hello.device) else {
        return Err((
            HelloStatus::NoSuchDevice,
            format!("no device {:?} is lent here", hello.device),
        ));
    };
    if dev.nic.is_some() && hello.features & FEATURE_NET == 0 {
        return Err((
            HelloStatus::BadRequest,
            format!(
                "device {:?} is a network interface, and this borrower does not speak frames",
                hello.device
            ),
        ));
    }
    if dev.pci.is_some() && (hello.features & FEATURE_PCI == 0 || hello.queue_index != 0) {
        return Err((
            HelloStatus::BadRequest,
            format!(
                "device {:?} is a PCIe function: a borrower must ask for feature PCI on queue 0 (devlend attach --kind pci)",
                hello.device
            ),
        ));
    }
    if let Some(guard) = shared.leases.get() {
        match guard.admit(hello, crate::leases::now_ms()) {
            Ok(lease) => shared.set_session_lease(id, lease),
            Err((status, reason)) => {
                devlend_fabric::limited!(warn, %peer, device = %hello.device, %reason, "lease check failed");
                return Err((status, reason));
            }
        }
    }
    let claim = match dev.claim(hello.borrower) {
        Ok(c) => c,
        Err(holder) => {
            return Err((
                HelloStatus::Busy,
                format!(
                    "device {:?} is attached by another borrower ({})",
                    hello.device,
                    holder
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>()
                ),
            ))
        }
    };
    let Some(active) = shared.try_activate() else {
        return Err((
            HelloStatus::Busy,
            format!(
                "the lender serves its maximum of {} sessions",
                shared.options.max_sessions
            ),
        ));
    };
    Ok((dev, active, claim))
}

//! The hello of a TCP session: TLS first when the lender requires it, then the hello
//! read and answered under the handshake timeout, with the admission checks of
//! [`crate::session::admit`], the session's device I/O set up before the reply (a
//! failure is answered `Busy`), and for a block device the credit granted.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use devlend_fabric::conn::Stream;
use devlend_fabric::error::chain;
use devlend_fabric::net::{FEATURE_NET, FEATURE_NET_OFFLOAD};
use devlend_fabric::pci::FEATURE_PCI;
use devlend_fabric::tls::{self, TlsError};
use devlend_fabric::{Credit, Hello, HelloReply, HelloStatus, WireError, FEATURE_CREDIT};

use crate::block::io::SessionIo;
use crate::device::{Backing, Device};
use crate::holding::Claim;
use crate::server::shared::{ActiveSession, Shared};
use crate::session::admit::admit;
use crate::{MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES};

/// Submission entries of a block session's ring (completions: twice as many). Every
/// request in flight has at most one operation queued (plus two socket polls), and the
/// ring is submitted as entries are queued, so this never limits the requests in flight.
const RING_ENTRIES: u32 = 1024;

/// The credit a block session grants: its whole request budget.
fn session_credit() -> Credit {
    Credit {
        requests: MAX_IN_FLIGHT as u32,
        bytes: MAX_IN_FLIGHT_BYTES as u32,
    }
}

pub(super) use crate::holding::CONTROL_QUEUE;

/// What a successful handshake gives a session: the device, for a block device its
/// device I/O, its slot among the active sessions, the borrower's claim, the queue
/// index, for a PCIe function the function itself, taken for this session, and the
/// features granted in the reply.
type Admitted<'s> = (
    Arc<Device>,
    Option<SessionIo>,
    ActiveSession<'s>,
    Claim,
    u16,
    Option<crate::pci::Lent>,
    u64,
);

/// Reads the hello and answers it. On success, returns what the session needs
/// ([`Admitted`]).
pub(super) fn handshake<'s>(
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
        if let Err(e) = HelloReply::refuse(status, &message)
            .for_version(hello.version)
            .write_to(&mut &*sock)
        {
            tracing::debug!(%peer, error = %e, "cannot send the refusal");
        }
        None
    };
    let (dev, active, claim) = match admit(shared, &hello, &peer, id) {
        Ok(x) => x,
        Err((status, message)) => return refuse(status, message),
    };
    let io = if dev.block().is_some() {
        match SessionIo::new(Arc::clone(&dev), shared.options.io, RING_ENTRIES, true) {
            Ok(io) => Some(io),
            Err(e) => {
                return refuse(
                    HelloStatus::Busy,
                    format!("cannot set up I/O for the session: {e}"),
                )
            }
        }
    } else {
        None
    };
    // One borrower at a time: the session that gets here first holds the function.
    let lent = match &dev.backing {
        Backing::Pci(pci) => match pci.try_lend() {
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
        Backing::Block(_) | Backing::Nic(_) => None,
    };
    let mut reply = HelloReply::ok(dev.info());
    match &dev.backing {
        Backing::Pci(_) => reply.features = FEATURE_PCI,
        Backing::Nic(_) => {
            // Offloads asked for are granted: the packet socket's vnet header has the
            // kernel complete checksums and segment in software where the interface
            // cannot.
            reply.features = FEATURE_NET | (hello.features & FEATURE_NET_OFFLOAD);
        }
        Backing::Block(_) => {
            // A borrower that keeps within a stated credit gets it: the session's whole
            // request budget, so that the session never has to stop reading it.
            if hello.features & FEATURE_CREDIT != 0 {
                reply.credit = Some(session_credit());
            }
            // A borrower that reads the throttle flag of responses gets it.
            reply.features = hello.features & devlend_fabric::FEATURE_THROTTLE_NOTE;
        }
    }
    reply.proof = shared.proof(&hello);
    // A version 1 borrower reads a version 1 reply.
    let reply = reply.for_version(hello.version);
    // Counted before the reply leaves, so that a borrower that has its reply sees the
    // session in the lender's statistics (`serve` counts its end).
    dev.stats.session_opened();
    if let Err(e) = reply.write_to(&mut &*sock) {
        dev.stats.session_closed();
        devlend_fabric::limited!(warn, %peer, device = %dev.name, error = %e, "cannot send the hello reply");
        return None;
    }
    if let Err(e) = sock
        .set_read_timeout(None)
        .and_then(|()| sock.set_write_timeout(None))
    {
        dev.stats.session_closed();
        devlend_fabric::limited!(warn, %peer, error = %e, "cannot clear the handshake timeout; closing");
        return None;
    }
    devlend_fabric::limited!(info, %peer, device = %dev.name, queue = hello.queue_index, "session opened");
    let granted = match reply.credit {
        Some(_) => reply.features | FEATURE_CREDIT,
        None => reply.features,
    };
    Some((dev, io, active, claim, hello.queue_index, lent, granted))
}

/// Runs the TLS handshake on an accepted connection (under the handshake timeout) and
/// starts its pump. A refused or failed handshake is logged at warn with the peer and
/// the reason; a plaintext devlend hello is answered, in plaintext, with status denied
/// and a message saying that TLS is required. Either way no device is touched.
pub(super) fn accept_tls(
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

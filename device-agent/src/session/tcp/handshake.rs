//! The hello of a TCP session: TLS first when the lender requires it, then the hello
//! read under the handshake timeout and admitted ([`crate::session::admit`]), and
//! answered with what the kind's opening grants ([`crate::session::open`]).

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use devlend_fabric::conn::Stream;
use devlend_fabric::error::chain;
use devlend_fabric::holder_proof::Possession;
use devlend_fabric::tls::{self, TlsError};
use devlend_fabric::{Hello, HelloReply, HelloStatus, WireError};

use crate::device::Device;
use crate::holding::Claim;
use crate::server::shared::{ActiveSession, LenderState};
use crate::session::admit::admit;
use crate::session::open::Opened;

/// An admitted hello: the device, the session's slot among the active sessions, the
/// borrower's claim on the device, and the hello itself.
pub(super) struct Admitted<'s> {
    pub(super) dev: Arc<Device>,
    pub(super) _active: ActiveSession<'s>,
    pub(super) claim: Claim,
    pub(super) hello: Hello,
}

/// Reads the hello and runs the admission checks; a refusal is answered.
pub(super) fn admit_hello<'s>(
    shared: &'s LenderState,
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
    let mut hello = match Hello::read_from(&mut &*sock) {
        Ok(h) => h,
        Err(WireError::Closed) => {
            tracing::debug!(%peer, "peer closed the connection before its hello");
            return None;
        }
        // Past its deadline: either this read's own timeout fired first (this thread
        // ends the connection, and says so), or the lender's sweeper closed it (and
        // counted it in its own line).
        Err(e) if shared.handshake_overdue(id, std::time::Instant::now()) => {
            let timed_out = matches!(&e, WireError::Io(io) if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ));
            if timed_out {
                devlend_fabric::limited!(info, %peer, "hello not done in time; connection closed");
            } else {
                tracing::debug!(%peer, "hello not done in time; closed by the sweeper");
            }
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
    if hello.proves_possession() && !take_possession(shared, sock, peer, &mut hello) {
        return None;
    }
    match admit(shared, &hello, &peer, id) {
        Ok((dev, _active, claim)) => Some(Admitted {
            dev,
            _active,
            claim,
            hello,
        }),
        Err((status, message)) => {
            refuse(sock, peer, &hello, status, &message);
            None
        }
    }
}

/// The interim reply (this lender's proof and a nonce) and the borrower's possession
/// message, still under the handshake timeout; whether the handshake goes on (a
/// failure is logged, rate-limited, and ends it).
fn take_possession(
    shared: &LenderState,
    sock: &Stream,
    peer: SocketAddr,
    hello: &mut Hello,
) -> bool {
    let Some((reply, nonce)) = super::super::possession::interim(shared, hello) else {
        devlend_fabric::limited!(warn, %peer, "no randomness for a handshake nonce; closing");
        return false;
    };
    if let Err(e) = reply.write_to(&mut &*sock) {
        tracing::debug!(%peer, error = %e, "cannot send the interim hello reply");
        return false;
    }
    match Possession::read_from(&mut &*sock) {
        Ok(p) => {
            super::super::possession::take(hello, nonce, p);
            true
        }
        Err(WireError::Closed) => {
            // The borrower did not like the lender's proof (or had none to check).
            devlend_fabric::limited!(info, %peer, device = %hello.device, "borrower closed the handshake after this lender's proof");
            false
        }
        Err(e) => {
            devlend_fabric::limited!(warn, %peer, device = %hello.device, error = %e, "bad possession message; closing");
            false
        }
    }
}

/// Answers `hello` with a refusal (in the hello's version).
pub(super) fn refuse(
    sock: &Stream,
    peer: SocketAddr,
    hello: &Hello,
    status: HelloStatus,
    message: &str,
) {
    devlend_fabric::limited!(info, %peer, device = %hello.device, ?status, reason = %message, "session refused");
    if let Err(e) = HelloReply::refuse(status, message)
        .for_version(hello.version)
        .write_to(&mut &*sock)
    {
        tracing::debug!(%peer, error = %e, "cannot send the refusal");
    }
}

/// Answers an admitted hello with what its kind's opening grants, and clears the
/// handshake timeout. Whether the session goes on.
pub(super) fn answer<S>(
    shared: &LenderState,
    sock: &Stream,
    peer: SocketAddr,
    a: &Admitted<'_>,
    opened: &Opened<S>,
) -> bool {
    let (dev, hello) = (&a.dev, &a.hello);
    let reply = opened.reply(dev.info(), hello, shared.proof(hello));
    // Counted before the reply leaves, so that a borrower that has its reply sees the
    // session in the lender's statistics (`serve` counts its end).
    dev.counters.stats.session_opened();
    if let Err(e) = reply.write_to(&mut &*sock) {
        dev.counters.stats.session_closed();
        devlend_fabric::limited!(warn, %peer, device = %dev.counters.name, error = %e, "cannot send the hello reply");
        return false;
    }
    if let Err(e) = sock
        .set_read_timeout(None)
        .and_then(|()| sock.set_write_timeout(None))
    {
        dev.counters.stats.session_closed();
        devlend_fabric::limited!(warn, %peer, error = %e, "cannot clear the handshake timeout; closing");
        return false;
    }
    devlend_fabric::limited!(info, %peer, device = %dev.counters.name, kind = %dev.kind_name(), queue = hello.queue_index, "session opened");
    true
}

/// Runs the TLS handshake on an accepted connection (under the handshake timeout) and
/// starts its pump. A refused or failed handshake is logged at warn with the peer and
/// the reason; a plaintext devlend hello is answered, in plaintext, with status denied
/// and a message saying that TLS is required. Either way no device is touched.
pub(super) fn accept_tls(
    shared: &LenderState,
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

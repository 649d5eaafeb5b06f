//! One borrower connection over TCP (or TLS): the handshake ([`handshake`]: read the
//! hello, admit it, answer it), then the session its kind opens
//! ([`crate::kind::LentKind::open_tcp`]: a block device's engine (`block/tcp/`),
//! a NIC queue pair ([`crate::nic::pump`]) or a PCI session
//! ([`crate::pci::session::tcp`])); then the bookkeeping.

mod handshake;

use std::io;
use std::net::{SocketAddr, TcpStream};

use devlend_fabric::conn::Stream;

use self::handshake::accept_tls;
use crate::device::Device;
use crate::server::shared::LenderState;
use crate::session::end::End;
use crate::session::open::{Holding, Opening, TcpSession};

/// Serves one accepted connection to its end.
pub(crate) fn serve(shared: &LenderState, sock: TcpStream, peer: SocketAddr, id: u64) {
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
    let Some(a) = handshake::admit_hello(shared, &sock, peer, id) else {
        return;
    };
    let at = Opening {
        dev: &a.dev.counters,
        hello: &a.hello,
        claim: &a.claim,
        options: &shared.options,
        fence: shared.fence_flag(id),
    };
    let opened = match a.dev.kind().open_tcp(&at) {
        Ok(o) => o,
        Err((status, message)) => {
            handshake::refuse(&sock, peer, &a.hello, status, &message);
            return;
        }
    };
    if !handshake::answer(shared, &sock, peer, &a, &opened) {
        return;
    }
    shared.handshake_done(id);
    // `answer` counted the session open.
    let end = if a.claim.is_standby() {
        // A successor's holding session during a handover carries nothing.
        Box::new(Holding).serve(&sock, peer)
    } else {
        opened.session.serve(&sock, peer)
    };
    a.dev.counters.stats.session_closed();
    log_end(&a.dev, peer, &end);
}

fn log_end(dev: &Device, peer: SocketAddr, end: &End) {
    match end {
        End::PeerClosed => {
            devlend_fabric::limited!(info, %peer, device = %dev.counters.name, "session closed")
        }
        End::Fenced => {
            devlend_fabric::limited!(info, %peer, device = %dev.counters.name, "session fenced: a newer session of its queue took over; requests not started were dropped, the borrower resends them")
        }
        End::Protocol(reason) => {
            dev.counters.stats.protocol_error();
            devlend_fabric::limited!(warn, %peer, device = %dev.counters.name, %reason, "protocol error; session closed");
        }
        End::Socket(e) | End::Ring(e) => {
            devlend_fabric::limited!(warn, %peer, device = %dev.counters.name, error = %e, "session closed: {end}");
        }
    }
}

/// Turns on TCP keepalive as the borrower has it ([`devlend_fabric::tcp::KEEPALIVE`]:
/// probes after 5 s of silence, 2 s apart, 3 unanswered), so that a session whose
/// borrower vanished without a FIN or RST (its host down or cut off) ends within about
/// 11 s instead of waiting for a request forever, and the device it held is free for
/// another borrower then. An idle session costs a probe and its answer every 5 s.
fn set_keepalive(sock: &TcpStream) -> io::Result<()> {
    let (idle, intvl, cnt) = devlend_fabric::tcp::KEEPALIVE;
    devlend_fabric::tcp::set_int_options(
        sock,
        &[
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle as libc::c_int),
            (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, intvl as libc::c_int),
            (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, cnt as libc::c_int),
        ],
    )
}

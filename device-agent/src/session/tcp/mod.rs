//! One borrower connection over TCP (or TLS): the handshake ([`handshake`]), then what
//! the device is: a block device's engine ([`engine`]), a NIC queue pair
//! ([`crate::nic::pump`]) or a PCI session ([`crate::pci::session::tcp`]); then the
//! bookkeeping.

mod budget;
pub(crate) mod engine;
mod handshake;
mod rx;
mod tx;

use std::io;
use std::net::{SocketAddr, TcpStream};

use devlend_fabric::conn::Stream;
use devlend_fabric::net::FEATURE_NET_OFFLOAD;
use devlend_fabric::{FEATURE_CREDIT, FEATURE_THROTTLE_NOTE};

use self::handshake::{accept_tls, handshake, CONTROL_QUEUE};
use crate::block::io::{SessionIo, Throttled};
use crate::device::{Backing, Device};
use crate::server::shared::Shared;
use crate::session::end::End;

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
    let Some((dev, io, _active, claim, queue, lent, granted)) = handshake(shared, &sock, peer, id)
    else {
        return;
    };
    shared.handshake_done(id);
    // `handshake` counted the session open.
    let frame_timeout = shared.options.frame_timeout;
    let end = match (&dev.backing, lent, io) {
        // A successor's holding session during a handover carries nothing.
        _ if claim.is_standby() => crate::nic::pump::hold(&sock),
        (Backing::Pci(pci), Some(_lent), _) => {
            crate::pci::session::tcp::serve(pci, &sock, peer, frame_timeout)
        }
        (Backing::Nic(_), _, _) if queue == CONTROL_QUEUE => crate::nic::pump::hold(&sock),
        (Backing::Nic(nic), _, _) => {
            let offload = granted & FEATURE_NET_OFFLOAD != 0;
            let police = crate::nic::pump::Police {
                group: Some(std::sync::Arc::clone(claim.group())),
                stats: &dev.stats,
            };
            crate::nic::pump::serve(nic, &sock, peer, queue, offload, frame_timeout, police)
        }
        (Backing::Block(_), _, Some(io)) => {
            let credit = granted & FEATURE_CREDIT != 0;
            tracing::debug!(%peer, id, "session serving");
            let group = Some(std::sync::Arc::clone(claim.group()));
            let note = granted & FEATURE_THROTTLE_NOTE != 0;
            match io {
                SessionIo::Uring(io) => {
                    let io = Throttled::new(io, group, std::sync::Arc::clone(&dev), note);
                    engine::run(io, &dev, &sock, peer, frame_timeout, credit)
                }
                SessionIo::Inline(io) => {
                    let io = Throttled::new(io, group, std::sync::Arc::clone(&dev), note);
                    engine::run(io, &dev, &sock, peer, frame_timeout, credit)
                }
            }
        }
        // The handshake sets up a block device's I/O and takes a PCIe function: not
        // reached.
        _ => End::PeerClosed,
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

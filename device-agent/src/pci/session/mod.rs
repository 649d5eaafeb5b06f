//! A PCI session per transport: the message loop around a [`crate::pci::lending`].
//!
//! - [`tcp`]: over TCP (or TLS): requests read from the stream, interrupts sent by a
//!   second thread; pushes carry the pages' data, a pull answers with them;
//! - [`rdma`] (feature `rdma`): over RDMA: one thread for messages and interrupts,
//!   the mirrors kept in sync one-sided.

//!
//! Either way one borrower at a time: the session that opens first holds the function
//! ([`PciFunction::try_lend`]) until it ends.

#[cfg(feature = "rdma")]
pub(crate) mod rdma;
pub(crate) mod tcp;

use std::net::SocketAddr;
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::pci::{FEATURE_PCI, FEATURE_PCI_COUNTERS};
use devlend_fabric::HelloStatus;

use crate::config::Coherence;
use crate::pci::nvme::throttle::Throttle;
use crate::pci::{Lent, PciFunction};
use crate::session::end::End;
use crate::session::open::{Opened, Opening, Refused, TcpSession};

/// Takes `f` for the session being opened, with the holder's limits: the mediator's
/// to enforce; a mirrored function under limits is refused, since the lender sees
/// none of its commands.
fn lend<'a>(f: &'a PciFunction, at: &Opening<'_>) -> Result<(Lent<'a>, Option<Throttle>), Refused> {
    let throttle = Throttle::new(at.claim.group(), at.dev);
    if throttle.is_some() && f.coherence == Coherence::Mirror {
        return Err((
            HelloStatus::BadRequest,
            format!(
                "PCIe function {:?} is lent in coherence mirror, where the lender cannot enforce limits: lease it without limits, or lend it in coherence nvme",
                at.hello.device
            ),
        ));
    }
    let lent = f.try_lend().ok_or_else(|| {
        (
            HelloStatus::Busy,
            format!(
                "PCIe function {:?} is lent to another session (one at a time)",
                at.hello.device
            ),
        )
    })?;
    Ok((lent, throttle))
}

/// A PCI session over TCP, the function taken for it.
struct Tcp<'a> {
    f: &'a PciFunction,
    _lent: Lent<'a>,
    throttle: Option<Throttle>,
    frame_timeout: Duration,
    /// The borrower reads DMA counter notes.
    notes: bool,
}

/// Opens a PCI session over TCP: takes the function, grants feature PCI.
pub(super) fn open_tcp<'a>(
    f: &'a PciFunction,
    at: &Opening<'a>,
) -> Result<Opened<Box<dyn TcpSession + 'a>>, Refused> {
    let (lent, throttle) = lend(f, at)?;
    let notes = at.hello.features & FEATURE_PCI_COUNTERS;
    Ok(Opened {
        features: FEATURE_PCI | notes,
        credit: None,
        session: Box::new(Tcp {
            f,
            _lent: lent,
            throttle,
            frame_timeout: at.options.frame_timeout,
            notes: notes != 0,
        }),
    })
}

impl TcpSession for Tcp<'_> {
    fn serve(self: Box<Self>, sock: &Stream, peer: SocketAddr) -> End {
        tcp::serve(
            self.f,
            sock,
            peer,
            self.throttle,
            self.frame_timeout,
            self.notes,
        )
    }
}

#[cfg(feature = "rdma")]
pub(super) use self::over_rdma::open_rdma;

#[cfg(feature = "rdma")]
mod over_rdma {
    use std::sync::atomic::AtomicBool;

    use devlend_fabric::pci::{FEATURE_PCI, FEATURE_PCI_COUNTERS};
    use devlend_fabric::rdma::verbs::Connection;

    use super::{lend, rdma};
    use crate::pci::nvme::throttle::Throttle;
    use crate::pci::{Lent, PciFunction};
    use crate::session::end::End;
    use crate::session::open::{Opened, Opening, RdmaSession, Refused};

    /// A PCI session over RDMA, the function taken for it.
    struct Rdma<'a> {
        f: &'a PciFunction,
        dev: &'a crate::device_counters::DeviceCounters,
        _lent: Lent<'a>,
        throttle: Option<Throttle>,
        notes: bool,
    }

    /// Opens a PCI session over RDMA: takes the function, grants feature PCI.
    pub(in crate::pci) fn open_rdma<'a>(
        f: &'a PciFunction,
        at: &Opening<'a>,
    ) -> Result<Opened<Box<dyn RdmaSession + 'a>>, Refused> {
        let (lent, throttle) = lend(f, at)?;
        let notes = at.hello.features & FEATURE_PCI_COUNTERS;
        Ok(Opened {
            features: FEATURE_PCI | notes,
            credit: None,
            session: Box::new(Rdma {
                f,
                dev: at.dev,
                _lent: lent,
                throttle,
                notes: notes != 0,
            }),
        })
    }

    impl RdmaSession for Rdma<'_> {
        fn reply_slot(&self, conn: &Connection) -> usize {
            // The last send buffer: the session's messages start at the first.
            conn.send_slots() - 1
        }

        fn serve(self: Box<Self>, conn: Connection, stop: &AtomicBool, peer: &str) {
            let dev = self.dev;
            let device = &dev.name;
            let end = rdma::serve(self.f, conn, self.throttle, stop, self.notes);
            dev.stats.session_closed();
            match end {
                End::PeerClosed => {
                    devlend_fabric::limited!(info, %peer, %device, "PCI session over RDMA closed")
                }
                End::Protocol(reason) => {
                    dev.stats.protocol_error();
                    devlend_fabric::limited!(warn, %peer, %device, %reason, "protocol error; PCI session over RDMA closed");
                }
                e => {
                    devlend_fabric::limited!(warn, %peer, %device, error = %devlend_fabric::error::chain(&e), "PCI session over RDMA closed")
                }
            }
        }
    }
}

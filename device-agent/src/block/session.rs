//! A block device's sessions: the device I/O set up before the hello reply (a failure
//! is answered `Busy`), the credit and the throttle note granted to a borrower that
//! asks, then the block engine over TCP ([`super::tcp::engine`]) or RDMA
//! (`super::rdma`), its device I/O under the holder's limits
//! ([`crate::block::io::Throttled`]).

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::{
    Credit, HelloStatus, FEATURE_CREDIT, FEATURE_HEARTBEAT, FEATURE_THROTTLE_NOTE,
};

use crate::block::io::{DeviceIo, SessionIo, Throttled};
use crate::block::tcp::engine::Terms;
use crate::block::BlockDevice;
use crate::device_counters::DeviceCounters;
use crate::options::HoldFirstWrite;
use crate::qos::Group;
use crate::session::end::End;
use crate::session::open::{Opened, Opening, Refused, TcpSession};
use crate::{MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES};

/// Submission entries of a block session's ring over TCP (completions: twice as many).
/// Every request in flight has at most one operation queued (plus two socket polls),
/// and the ring is submitted as entries are queued, so this never limits the requests
/// in flight.
const TCP_RING_ENTRIES: u32 = 1024;

/// The credit a block session grants: its whole request budget.
fn session_credit() -> Credit {
    Credit {
        requests: MAX_IN_FLIGHT as u32,
        bytes: MAX_IN_FLIGHT_BYTES as u32,
    }
}

/// What both transports' block sessions run with.
struct BlockIo<'a> {
    dev: Arc<DeviceCounters>,
    /// The block device the session serves (the kind's own, handed in).
    block: &'a BlockDevice,
    io: SessionIo<'a>,
    /// The holder's limits.
    group: Arc<Group>,
    /// Mark the responses of requests held back by the limits.
    note: bool,
    /// [`crate::options::Options::hold_first_write`].
    hold: Option<HoldFirstWrite>,
}

impl<'a> BlockIo<'a> {
    /// The session's device I/O on `block` (`send_from_file`: a read's data may go from
    /// the file straight to the socket, over TCP).
    fn open(
        block: &'a BlockDevice,
        at: &Opening<'_>,
        entries: u32,
        send_from_file: bool,
    ) -> Result<BlockIo<'a>, Refused> {
        let io = SessionIo::new(
            Arc::clone(at.dev),
            block,
            at.options.io,
            entries,
            send_from_file,
        )
        .map_err(|e| {
            (
                HelloStatus::Busy,
                format!("cannot set up I/O for the session: {e}"),
            )
        })?;
        Ok(BlockIo {
            dev: Arc::clone(at.dev),
            block,
            io,
            group: Arc::clone(at.claim.group()),
            // A borrower that reads the throttle flag of responses gets it.
            note: at.hello.features & FEATURE_THROTTLE_NOTE != 0,
            hold: at.options.hold_first_write.clone(),
        })
    }

    fn features(&self) -> u64 {
        if self.note {
            FEATURE_THROTTLE_NOTE
        } else {
            0
        }
    }

    /// Runs `engine` on the session's device I/O under the holder's limits: the one
    /// place that dispatches on the [`SessionIo`] the session got.
    fn run<E: Engine>(self, engine: E) -> E::End {
        let BlockIo {
            dev,
            block,
            io,
            group,
            note,
            hold,
        } = self;
        let group = Some(group);
        match io {
            SessionIo::Uring(io) => engine.run(
                Throttled::new(io, group, Arc::clone(&dev), note, hold),
                &dev,
                block,
            ),
            SessionIo::Inline(io) => engine.run(
                Throttled::new(io, group, Arc::clone(&dev), note, hold),
                &dev,
                block,
            ),
        }
    }
}

/// A transport's block engine, run by [`BlockIo::run`] on whichever [`DeviceIo`] the
/// session got.
trait Engine {
    /// How the engine's session ended.
    type End;

    /// Serves the session to its end on `io`, the device I/O of `block` (the block
    /// device of `dev`).
    fn run<I: DeviceIo>(self, io: I, dev: &Arc<DeviceCounters>, block: &BlockDevice) -> Self::End;
}

/// A block session over TCP.
struct Tcp<'a> {
    io: BlockIo<'a>,
    frame_timeout: Duration,
    /// The most the session polls before sleeping ([`crate::options::Options::poll`]).
    poll: Duration,
    /// The borrower keeps within the credit it was granted.
    credit: bool,
    /// Set when a newer session of its queue fences it.
    fence: Arc<AtomicBool>,
    /// The borrower was granted heartbeats.
    heartbeat: bool,
}

/// Opens a block session over TCP: its device I/O, the throttle note and, to a
/// borrower that keeps within a stated credit, the session's whole request budget (so
/// that the session never has to stop reading it).
pub(super) fn open_tcp<'a>(
    block: &'a BlockDevice,
    at: &Opening<'a>,
) -> Result<Opened<Box<dyn TcpSession + 'a>>, Refused> {
    let io = BlockIo::open(block, at, TCP_RING_ENTRIES, true)?;
    let credit = (at.hello.features & FEATURE_CREDIT != 0).then(session_credit);
    // A borrower with several paths sends heartbeats on each; this engine reads them.
    let heartbeat = at.hello.features & FEATURE_HEARTBEAT != 0;
    Ok(Opened {
        features: io.features() | if heartbeat { FEATURE_HEARTBEAT } else { 0 },
        credit,
        session: Box::new(Tcp {
            frame_timeout: at.options.frame_timeout,
            poll: at.options.poll,
            credit: credit.is_some(),
            fence: at.fence.clone().unwrap_or_default(),
            heartbeat,
            io,
        }),
    })
}

impl TcpSession for Tcp<'_> {
    fn serve(self: Box<Self>, sock: &Stream, peer: SocketAddr) -> End {
        let Tcp {
            io,
            frame_timeout,
            poll,
            credit,
            fence,
            heartbeat,
        } = *self;
        tracing::debug!(%peer, "session serving");
        io.run(TcpRun {
            sock,
            peer,
            terms: Terms {
                frame_timeout,
                credit,
                poll,
                fence: &fence,
                heartbeat,
            },
        })
    }
}

/// The TCP engine's arguments beside its device I/O.
struct TcpRun<'s> {
    sock: &'s Stream,
    peer: SocketAddr,
    terms: Terms<'s>,
}

impl Engine for TcpRun<'_> {
    type End = End;

    fn run<I: DeviceIo>(self, io: I, dev: &Arc<DeviceCounters>, _block: &BlockDevice) -> End {
        super::tcp::engine::run(io, dev, self.sock, self.peer, self.terms)
    }
}

#[cfg(feature = "rdma")]
pub(super) use self::rdma::open_rdma;

#[cfg(feature = "rdma")]
mod rdma {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    use devlend_fabric::rdma::verbs::Connection;
    use devlend_fabric::HelloStatus;

    use super::{BlockIo, Engine};
    use crate::block::io::DeviceIo;
    use crate::block::rdma::{run, End, Slot, IO_SLOTS, RING_ENTRIES};
    use crate::block::BlockDevice;
    use crate::device_counters::DeviceCounters;
    use crate::session::open::{Opened, Opening, RdmaSession, Refused};
    use crate::MAX_TRANSFER_BYTES;

    /// A block session over RDMA: its registered I/O buffers and its device I/O.
    struct Rdma<'a> {
        io: BlockIo<'a>,
        slots: Vec<Slot>,
    }

    /// Opens a block session over RDMA: [`IO_SLOTS`] I/O buffers of the largest
    /// transfer registered on `conn`, its device I/O, and the throttle note.
    pub(in crate::block) fn open_rdma<'a>(
        block: &'a BlockDevice,
        at: &Opening<'a>,
        conn: &Connection,
    ) -> Result<Opened<Box<dyn RdmaSession + 'a>>, Refused> {
        let mut slots = Vec::with_capacity(IO_SLOTS);
        for i in 0..IO_SLOTS {
            let slot = Slot::new(conn, i, MAX_TRANSFER_BYTES as usize).map_err(|e| {
                (
                    HelloStatus::Busy,
                    format!(
                        "cannot register I/O buffers: {}",
                        devlend_fabric::error::chain(&e)
                    ),
                )
            })?;
            slots.push(slot);
        }
        let io = BlockIo::open(block, at, RING_ENTRIES, false)?;
        Ok(Opened {
            features: io.features(),
            credit: None,
            session: Box::new(Rdma { io, slots }),
        })
    }

    impl RdmaSession for Rdma<'_> {
        fn reply_slot(&self, _conn: &Connection) -> usize {
            // The first send buffer after the I/O slots' own.
            IO_SLOTS
        }

        fn serve(self: Box<Self>, mut conn: Connection, stop: &AtomicBool, peer: &str) {
            let Rdma { io, mut slots } = *self;
            let dev = Arc::clone(&io.dev);
            let end = io.run(RdmaRun {
                conn: &mut conn,
                slots: &mut slots,
                stop,
            });
            // The QP goes first (no RDMA into the buffers after), then the buffers' MRs.
            drop(conn);
            drop(slots);
            dev.stats.session_closed();
            log_end(&dev, peer, end);
        }
    }

    /// The RDMA engine's arguments beside its device I/O.
    struct RdmaRun<'s> {
        conn: &'s mut Connection,
        slots: &'s mut [Slot],
        stop: &'s AtomicBool,
    }

    impl Engine for RdmaRun<'_> {
        type End = End;

        fn run<I: DeviceIo>(self, io: I, dev: &Arc<DeviceCounters>, block: &BlockDevice) -> End {
            run(io, dev, block, self.conn, self.slots, self.stop)
        }
    }

    fn log_end(dev: &DeviceCounters, peer: &str, end: End) {
        let device = &dev.name;
        match end {
            End::Closed => {
                devlend_fabric::limited!(info, %peer, %device, "RDMA session closed")
            }
            End::Stopped => {
                devlend_fabric::limited!(info, %peer, %device, "RDMA session stopped (lease ended, lender shutting down, or fenced by a newer session of its queue): requests started were answered, session closed")
            }
            End::Protocol(reason) => {
                dev.stats.protocol_error();
                devlend_fabric::limited!(warn, %peer, %device, %reason, "protocol error; RDMA session closed");
            }
            End::Transport(e) => {
                devlend_fabric::limited!(warn, %peer, %device, error = %devlend_fabric::error::chain(&e), "RDMA session closed")
            }
            End::Ring(e) => {
                devlend_fabric::limited!(warn, %peer, %device, error = %e, "io_uring failed; RDMA session closed")
            }
        }
    }
}

//! How an admitted session becomes the kind's session, whatever the kind:
//! the kind's `LentKind::open_tcp` (and `open_rdma`) takes what the session needs
//! before the hello reply (a block device's I/O ring, a PCIe function's lend), says what
//! the reply grants ([`Opened`]), and returns what then serves the session to its end
//! ([`TcpSession`], [`RdmaSession`]). The transports (`tcp/`, `rdma/`) only read the
//! hello, admit it, answer it and run what the kind returned.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use devlend_fabric::conn::Stream;
use devlend_fabric::{Credit, DeviceDescription, Hello, HelloReply, HelloStatus};

use crate::device_counters::DeviceCounters;
use crate::holding::Claim;
use crate::options::Options;
use crate::session::end::End;

/// What a kind's session is opened with: the admitted hello and its context.
pub(crate) struct Opening<'a> {
    /// The device's name and counters, shared with the device.
    pub(crate) dev: &'a Arc<DeviceCounters>,
    /// The borrower's hello (queue index, features asked for).
    pub(crate) hello: &'a Hello,
    /// The borrower's claim on the device (its limits group).
    pub(crate) claim: &'a Claim,
    /// The lender's options (I/O mode, frame timeout).
    pub(crate) options: &'a Options,
    /// Set when a newer session of the same queue fences this one (TCP; an RDMA
    /// session's stop flag serves as its fence).
    pub(crate) fence: Option<Arc<AtomicBool>>,
}

/// A refused opening: the status and the message the borrower reads.
pub(crate) type Refused = (HelloStatus, String);

/// An opened session: what the hello reply grants, and what serves the session.
pub(crate) struct Opened<S> {
    /// The features the reply grants (a subset of those asked for, or the kind's own).
    pub(crate) features: u64,
    /// The request credit the reply states (a block device, to a borrower that asked).
    pub(crate) credit: Option<Credit>,
    /// What serves the session once the reply is out.
    pub(crate) session: S,
}

impl<S> Opened<S> {
    /// The hello reply that opens the session: the device described (`info`), what the opening
    /// grants, the lender's `proof` of its key, in the version of the borrower's `hello`
    /// (both transports answer with it).
    pub(crate) fn reply(
        &self,
        info: DeviceDescription,
        hello: &Hello,
        proof: Option<devlend_fabric::lender_proof::LenderProof>,
    ) -> HelloReply {
        let mut reply = HelloReply::ok(info);
        reply.features = self.features;
        reply.credit = self.credit;
        reply.proof = proof;
        reply.for_version(hello.version)
    }
}

/// A kind's session over TCP (or TLS), after its hello reply.
pub(crate) trait TcpSession {
    /// Serves the session on `sock` (from `peer`) to its end.
    fn serve(self: Box<Self>, sock: &Stream, peer: SocketAddr) -> End;
}

/// A session that carries nothing: a NIC's control queue, or a successor's holding
/// session during a handover. It ends when the borrower closes it.
pub(crate) struct Holding;

impl TcpSession for Holding {
    fn serve(self: Box<Self>, sock: &Stream, _peer: SocketAddr) -> End {
        let mut b = [0u8; 64];
        loop {
            match (&mut &*sock).read(&mut b) {
                Ok(0) => return End::PeerClosed,
                Ok(_) => return End::Protocol("data on a holding session".into()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return End::Socket(e),
            }
        }
    }
}

/// A kind's session over RDMA, after its hello reply (feature `rdma`).
#[cfg(feature = "rdma")]
pub(crate) trait RdmaSession {
    /// The send buffer the hello reply goes out of (the session's own messages use the
    /// others).
    fn reply_slot(&self, conn: &devlend_fabric::rdma::verbs::Connection) -> usize;

    /// Serves the session on `conn` until the borrower leaves or `stop` is set; counts
    /// its end in the device's statistics (and a protocol error), then logs how it
    /// ended.
    fn serve(
        self: Box<Self>,
        conn: devlend_fabric::rdma::verbs::Connection,
        stop: &std::sync::atomic::AtomicBool,
        peer: &str,
    );
}

/// The refusal of a kind that is not lent over RDMA.
#[cfg(feature = "rdma")]
pub(crate) fn tcp_only(at: &Opening<'_>, what: &str) -> Refused {
    (
        HelloStatus::BadRequest,
        format!(
            "device {:?} is {what}: it is lent over TCP only (attach without --transport rdma)",
            at.hello.device
        ),
    )
}

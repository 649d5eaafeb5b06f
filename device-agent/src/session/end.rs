//! How a session ended: what its engine returns (block over TCP, a NIC queue pair, a
//! PCI session), for the log line and the device's protocol-error counter.

use std::io;

/// How a session ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum End {
    /// The peer closed the connection between two requests (or the lender shut down).
    #[error("peer closed the connection")]
    PeerClosed,
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The socket failed.
    #[error("socket failed")]
    Socket(#[source] io::Error),
    /// io_uring failed.
    #[error("io_uring failed")]
    Ring(#[source] io::Error),
    /// A newer session of the same borrower and queue fenced this one
    /// (`docs/protocol.md`, "Fencing a queue's earlier session").
    #[error("fenced by a newer session of its queue")]
    Fenced,
}

//! The multiplexer between two gateways: many relayed sessions (streams) on one
//! connection, each with its own credit window, so that a session whose far end is slow
//! holds only its own window of bytes and never stalls the others.
//!
//! # Frames
//!
//! Every frame is a 12-byte header `kind: u8, flags: u8 = 0, reserved: u16 = 0,
//! stream: u32, len: u32` (little-endian) and, for some kinds, `len` bytes of payload:
//!
//! | kind | name | stream | len | payload |
//! | --- | --- | --- | --- | --- |
//! | 1 | HELLO | 0 | payload bytes (12..=76) | `"DLMX"`, version u8 = 1, cluster_len u8, reserved u16 = 0, window u32, cluster |
//! | 2 | OPEN | new odd id | payload bytes (12..=140) | the relay request ([`devlend_fabric::relay`]) |
//! | 3 | DATA | id | payload bytes (1..=[`MAX_DATA`]) | session bytes |
//! | 4 | WINDOW | id | credit granted, bytes (≥ 1) | none |
//! | 5 | FIN | id | 0 | none: the sender sends no more on this stream |
//! | 6 | RESET | id | payload bytes (0..=1024) | UTF-8 reason: the stream is aborted both ways |
//! | 7 | PING | 0 | 8 | opaque u64, echoed |
//! | 8 | PONG | 0 | 8 | the PING's u64 |
//!
//! Each side opens with a HELLO naming its cluster and the window it grants every
//! stream: the bytes of DATA the other side may send on a stream before a WINDOW frame
//! gives more. A receiver grants a WINDOW once the bytes it has passed on reach a quarter
//! of its window. DATA beyond the window, an unknown kind, a reserved bit, a length out
//! of range or an OPEN from the side that accepted the connection is a protocol
//! violation: the connection is closed with a logged reason, which resets every stream
//! on it. Only the side that dialled opens streams (ids 1, 3, 5, ...); a pair of
//! gateways that relay both ways holds one connection each way.
//!
//! Its parts: `frame` encodes the frames, `link` is one connection and its streams'
//! table, `io_tasks` its reader and writer tasks, `stream` the two halves of a stream;
//! they all work on the per-stream state (`StreamState`) and its credit windows, kept
//! here.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::time::Duration;

use tokio::sync::{mpsc, Semaphore};

mod frame;
mod io_tasks;
mod link;
mod stream;
#[cfg(test)]
mod tests;

pub use frame::{LinkHello, DEFAULT_WINDOW, FRAME_HEADER_LEN, MAX_DATA, MAX_RESET_MSG, MIN_WINDOW};
pub use link::Link;
pub use stream::{MuxReader, MuxStream, MuxWriter};

/// Why a link or one of its streams failed.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    /// Reading or writing the connection failed.
    #[error("link I/O failed")]
    Io(#[source] io::Error),
    /// The peer broke the framing rules; the connection is closed.
    #[error("peer protocol violation: {0}")]
    Protocol(String),
    /// The link is gone (closed by either side, or lost).
    #[error("the link to the peer gateway is closed")]
    Closed,
    /// The stream was aborted, by the peer or because its link was lost.
    #[error("session reset: {0}")]
    Reset(String),
    /// The peer did not complete the HELLO exchange in time.
    #[error("the peer gateway did not answer the link HELLO within {0:?}")]
    Timeout(Duration),
}

/// Counters of one link; bytes are session payload bytes (frame headers excluded).
#[derive(Debug, Default)]
pub struct LinkStats {
    /// Bytes sent in DATA frames.
    pub bytes_sent: AtomicU64,
    /// Bytes received in DATA frames.
    pub bytes_received: AtomicU64,
    /// Streams opened (either side) since the link came up.
    pub sessions_total: AtomicU64,
    /// Streams open now.
    pub sessions_active: AtomicI64,
    /// Last round-trip time measured with PING, in microseconds (0: none yet).
    pub rtt_us: AtomicU64,
    /// When the last frame arrived, in ms since the link started.
    pub last_heard_ms: AtomicU64,
}

/// What a stream's reader is handed.
#[derive(Debug)]
enum Inbound {
    Data(Vec<u8>),
    Fin,
    Reset(String),
}

/// One frame queued for the writer.
struct Out {
    header: [u8; FRAME_HEADER_LEN],
    payload: Vec<u8>,
}

/// The state of one stream shared by the link and the stream's two halves.
struct StreamState {
    inbox: mpsc::UnboundedSender<Inbound>,
    /// Bytes this side may still send (the peer's credit).
    credit: Semaphore,
    /// Bytes the peer may still send before our next WINDOW.
    allowance: AtomicI64,
    fin_sent: AtomicBool,
    fin_received: AtomicBool,
}

/// Which end of the connection this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Dialled the connection; opens streams.
    Dialer,
    /// Accepted it; is offered streams.
    Acceptor,
}

/// A stream the peer opened, with its OPEN payload (the relay request, not yet parsed).
pub type Incoming = (MuxStream, Vec<u8>);

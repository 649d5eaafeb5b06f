//! Errors of decoding or exchanging wire messages.

use std::io;

/// A malformed or unexpected message from the peer, or an I/O failure on the connection.
///
/// Any of these ends the session it happened on; it never concerns another session.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Reading or writing the connection failed.
    #[error("connection I/O failed")]
    Io(#[source] io::Error),
    /// The peer closed the connection cleanly between two messages.
    #[error("peer closed the connection")]
    Closed,
    /// The peer closed the connection in the middle of a message.
    #[error("peer closed the connection mid-message ({got} of {want} bytes)")]
    Truncated {
        /// Bytes of the message received.
        got: usize,
        /// Bytes the message should have had.
        want: usize,
    },
    /// The handshake did not start with the protocol's magic bytes.
    #[error("bad magic {0:#04x?}: not a devlend peer")]
    BadMagic([u8; 4]),
    /// The peer speaks a protocol version this build does not.
    #[error("unsupported protocol version {0}")]
    UnsupportedVersion(u16),
    /// An opcode this protocol version does not define.
    #[error("unknown opcode {0:#04x}")]
    UnknownOp(u8),
    /// A status code this protocol version does not define.
    #[error("unknown status {0}")]
    UnknownStatus(u8),
    /// A length field beyond the limits agreed in the handshake.
    #[error("{what} of {len} bytes exceeds the limit of {limit}")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// The value received.
        len: u64,
        /// The largest value allowed.
        limit: u64,
    },
    /// A field that must be zero (reserved) or must hold one of few values did not.
    #[error("invalid field: {0}")]
    Invalid(&'static str),
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> Self {
        WireError::Io(e)
    }
}

/// An error and its chain of sources on one line, `outer: inner: innermost`, for logs
/// and messages.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

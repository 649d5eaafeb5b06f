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
    #[error("bad magic {0:02x?}: not a devlend peer")]
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
    DisplayChain(e).to_string()
}

/// Formats an error with its chain of sources, `outer: inner: innermost`, without
/// allocating: for log lines (`tracing::warn!("{}", DisplayChain(&e))`). The one
/// error-chain formatter of the workspace; [`chain`] is its `String` form.
pub struct DisplayChain<'a, E: std::error::Error + ?Sized>(pub &'a E);

impl<E: std::error::Error + ?Sized> std::fmt::Display for DisplayChain<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut src = self.0.source();
        while let Some(s) = src {
            write!(f, ": {s}")?;
            src = s.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{chain, DisplayChain};

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open session")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_chain_names_every_source_once_in_order() {
        let inner = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Outer(inner);
        assert_eq!(chain(&e), "cannot open session: refused");
        assert_eq!(DisplayChain(&e).to_string(), chain(&e));
        let plain = std::io::Error::other("alone");
        assert_eq!(chain(&plain), "alone");
    }

    /// A peer's garbage is logged on one line (a trial saw the magic pretty-printed
    /// over six lines).
    #[test]
    fn a_bad_magic_reads_on_one_line() {
        let e = super::WireError::BadMagic([0x41, 0xed, 0x00, 0x01]);
        assert_eq!(
            e.to_string(),
            "bad magic [41, ed, 00, 01]: not a devlend peer"
        );
    }
}

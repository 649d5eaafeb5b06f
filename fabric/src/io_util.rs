//! Small I/O helpers shared by the codecs.

use std::io::{ErrorKind, Read};

use crate::WireError;

/// Fills `buf` from `r`, telling a clean close before the first byte
/// ([`WireError::Closed`]) from one in the middle ([`WireError::Truncated`]).
///
/// # Errors
/// Those two, or [`WireError::Io`] for any other failure (including timeouts).
pub fn read_exact_or_eof(r: &mut impl Read, buf: &mut [u8]) -> Result<(), WireError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Err(WireError::Closed),
            Ok(0) => {
                return Err(WireError::Truncated {
                    got,
                    want: buf.len(),
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

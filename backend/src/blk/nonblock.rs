//! The retry loop around one non-blocking socket call (`recvmsg`, `sendmsg`, ...).

use std::io;

/// Runs `call` (a syscall made with `MSG_DONTWAIT`, returning its count or -1 with
/// `errno` set) until it is not interrupted. `Ok(Some(n))` for `n` bytes moved (0 at
/// the end of a stream), `Ok(None)` when the socket would block, the error otherwise.
///
/// # Errors
/// The call's error, other than `EINTR` (retried) and `EAGAIN` (`Ok(None)`).
pub(super) fn retry(mut call: impl FnMut() -> isize) -> io::Result<Option<usize>> {
    loop {
        let n = call();
        if let Ok(n) = usize::try_from(n) {
            return Ok(Some(n));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fail(errno: i32) -> isize {
        // SAFETY: errno_location points at this thread's errno.
        unsafe { *libc::__errno_location() = errno };
        -1
    }

    #[test]
    fn retries_eintr_stops_on_eagain_and_returns_other_errors() {
        assert_eq!(retry(|| 7).unwrap(), Some(7));
        assert_eq!(retry(|| 0).unwrap(), Some(0));
        let mut calls = 0;
        let r = retry(|| {
            calls += 1;
            if calls < 3 {
                fail(libc::EINTR)
            } else {
                5
            }
        });
        assert_eq!((r.unwrap(), calls), (Some(5), 3));
        assert_eq!(retry(|| fail(libc::EAGAIN)).unwrap(), None);
        let e = retry(|| fail(libc::ECONNRESET)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ECONNRESET));
    }
}

//! Vectored socket receive straight from the fabric connection into guest memory (the
//! send side is [`crate::blk::tx`]).

use std::io;
use std::os::fd::RawFd;

/// Largest iovec count per syscall (Linux UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// Receives into `iovs` without blocking. Returns Ok(None) when no data is ready,
/// Ok(Some(0)) on end of stream.
///
/// # Errors
/// The socket error.
pub fn recv_vectored_nonblocking(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<Option<usize>> {
    let cnt = iovs.len().min(IOV_MAX);
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iovs.as_mut_ptr();
    msg.msg_iovlen = cnt;
    loop {
        // SAFETY: msg describes `cnt` iovecs, each pointing at writable memory that is
        // alive for the call (the receive header buffer or guest memory kept alive by
        // the request in flight).
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

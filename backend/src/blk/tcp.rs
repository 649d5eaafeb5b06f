//! Vectored socket I/O straight between the fabric connection and guest memory.

use std::io;
use std::os::fd::RawFd;

/// Largest iovec count per syscall (Linux UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// Writes every byte described by `iovs` to the blocking socket `fd`, continuing after
/// partial writes. `iovs` is consumed (advanced in place).
///
/// # Errors
/// The socket error; `WriteZero` if the socket accepts no byte.
pub fn write_all_vectored(fd: RawFd, mut iovs: &mut [libc::iovec]) -> io::Result<()> {
    while !iovs.is_empty() {
        let cnt = iovs.len().min(IOV_MAX);
        // SAFETY: each iovec points at memory that is mapped and alive for the duration
        // of this call (a header buffer owned by the caller or a guest memory region
        // kept alive by the request); writev only reads from it.
        let n = unsafe { libc::writev(fd, iovs.as_ptr(), cnt as libc::c_int) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        iovs = advance(iovs, n as usize);
    }
    Ok(())
}

/// Drops `n` bytes from the front of `iovs`.
pub fn advance(iovs: &mut [libc::iovec], mut n: usize) -> &mut [libc::iovec] {
    let mut skip = 0;
    for iov in iovs.iter_mut() {
        if n < iov.iov_len {
            // SAFETY: n < iov_len, so the new base stays inside the same buffer.
            iov.iov_base = unsafe { iov.iov_base.cast::<u8>().add(n) }.cast();
            iov.iov_len -= n;
            break;
        }
        n -= iov.iov_len;
        skip += 1;
    }
    &mut iovs[skip..]
}

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

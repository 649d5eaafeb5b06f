//! A TCP session's receive buffer: request frames read from the non-blocking socket,
//! several headers (and small writes' data) per `recv`.

use std::io;
use std::os::fd::RawFd;

/// Bytes read from the socket at a time (several request headers per `recv`). Write
/// data at least this long is received straight into the request's buffer instead.
pub(crate) const READ_BUF: usize = 64 << 10;

/// What a receive found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recv {
    /// This many bytes arrived.
    Got(usize),
    /// Nothing to read now.
    WouldBlock,
    /// The peer closed its side.
    Closed,
}

/// Receives into `buf` without blocking.
///
/// # Errors
/// The socket failed.
pub(crate) fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<Recv> {
    loop {
        // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n > 0 {
            return Ok(Recv::Got(n as usize));
        }
        if n == 0 {
            return Ok(Recv::Closed);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock => return Ok(Recv::WouldBlock),
            _ => return Err(e),
        }
    }
}

/// Bytes received and not yet parsed.
pub(crate) struct RxBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl RxBuf {
    /// An empty buffer of [`READ_BUF`] bytes.
    pub(crate) fn new() -> Self {
        RxBuf {
            buf: vec![0u8; READ_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// The bytes buffered.
    pub(crate) fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Drops `n` parsed bytes from the front.
    pub(crate) fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Moves up to `dst.len()` buffered bytes into `dst`; returns how many.
    pub(crate) fn take_into(&mut self, dst: &mut [u8]) -> usize {
        let n = (self.end - self.start).min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.consume(n);
        n
    }

    /// Receives into the free space, after moving what is buffered to the front.
    ///
    /// # Errors
    /// The socket failed.
    pub(crate) fn fill(&mut self, fd: RawFd) -> io::Result<Recv> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            // Full of unparsed bytes: nothing can be received (the session only fills
            // the buffer when it needs more bytes than it holds, which never happens).
            return Ok(Recv::WouldBlock);
        }
        let r = recv(fd, &mut self.buf[self.end..])?;
        if let Recv::Got(n) = r {
            self.end += n;
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn buffers_and_hands_out_bytes() {
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut rx = RxBuf::new();
        assert_eq!(rx.fill(b.as_raw_fd()).unwrap(), Recv::WouldBlock);
        a.write_all(b"hello world").unwrap();
        assert_eq!(rx.fill(b.as_raw_fd()).unwrap(), Recv::Got(11));
        rx.consume(6);
        let mut dst = [0u8; 3];
        assert_eq!(rx.take_into(&mut dst), 3);
        assert_eq!(&dst, b"wor");
        assert_eq!(rx.data(), b"ld");
        drop(a);
        assert_eq!(rx.fill(b.as_raw_fd()).unwrap(), Recv::Closed);
        assert_eq!(rx.data(), b"ld");
    }
}

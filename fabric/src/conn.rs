//! A fabric connection as the engines see it: one file descriptor carrying the lend
//! protocol in plaintext.
//!
//! Over plain TCP that is the TCP socket itself. Over TLS it is one end of a
//! `socketpair(AF_UNIX, SOCK_STREAM)` whose other end a pump thread bridges to the TLS
//! session ([`crate::tls`]). Either way the engines do their raw `writev`/`recvmsg`,
//! io_uring and `sendfile` on [`Stream::as_raw_fd`], and a lost connection shows as end
//! of stream or an error on it.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// One fabric connection, plaintext side.
#[derive(Debug)]
pub enum Stream {
    /// A plain TCP connection.
    Tcp(TcpStream),
    /// The plaintext end of a TLS pump; the TCP socket belongs to the pump.
    Tls(UnixStream),
}

impl Stream {
    /// Whether the connection is encrypted (TLS).
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// A second handle on the same connection (`dup(2)`).
    ///
    /// # Errors
    /// The kernel's, e.g. out of file descriptors.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Tls(s) => Stream::Tls(s.try_clone()?),
        })
    }

    /// Shuts down one or both directions (`shutdown(2)`). On a TLS connection the pump
    /// passes it on: a shut write side becomes a TLS `close_notify`, a shut read side
    /// stops delivery.
    ///
    /// # Errors
    /// The kernel's, e.g. `ENOTCONN`.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Tls(s) => s.shutdown(how),
        }
    }

    /// Switches `O_NONBLOCK`.
    ///
    /// # Errors
    /// The kernel's.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(on),
            Stream::Tls(s) => s.set_nonblocking(on),
        }
    }

    /// Bounds each blocking read (`SO_RCVTIMEO`); `None`: no bound.
    ///
    /// # Errors
    /// The kernel's; a zero duration is refused.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Tls(s) => s.set_read_timeout(t),
        }
    }

    /// Bounds each blocking write (`SO_SNDTIMEO`); `None`: no bound.
    ///
    /// # Errors
    /// The kernel's; a zero duration is refused.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Tls(s) => s.set_write_timeout(t),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Tls(s) => s.as_raw_fd(),
        }
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Tls(s) => s.as_fd(),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Tls(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Tls(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

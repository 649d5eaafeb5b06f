//! The TCP transport: connection setup for both ends.
//!
//! Data rides in the stream after each header. Nagle's algorithm is off on every
//! connection (requests are small and latency-bound); each end writes a whole batch of
//! frames with one vectored write.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::{handshake::Hello, HelloReply, HelloStatus, WireError};

/// Why a borrower could not open a session.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The address did not resolve.
    #[error("cannot resolve lender address {addr}")]
    Resolve {
        /// The address as given.
        addr: String,
        /// The resolver's error.
        #[source]
        source: io::Error,
    },
    /// The TCP connection could not be made.
    #[error("cannot connect to lender at {addr}")]
    Connect {
        /// The address as given.
        addr: String,
        /// The socket error.
        #[source]
        source: io::Error,
    },
    /// The handshake failed on the wire.
    #[error("handshake with lender at {addr} failed")]
    Handshake {
        /// The address as given.
        addr: String,
        /// What went wrong.
        #[source]
        source: WireError,
    },
    /// The lender refused the session.
    #[error("lender at {addr} refused device {device:?}: {status:?}: {message}")]
    Refused {
        /// The address as given.
        addr: String,
        /// The device asked for.
        device: String,
        /// The lender's status.
        status: HelloStatus,
        /// The lender's message.
        message: String,
    },
}

/// Opens a TCP connection to a lender and performs the handshake for `device`,
/// virtqueue `queue_index`.
///
/// `timeout` bounds the connect and the handshake each. The returned stream is in
/// blocking mode, with `TCP_NODELAY` set and no read or write timeout.
///
/// # Errors
/// [`ConnectError`] for each failure, naming the address and the device.
pub fn connect(
    addr: &str,
    device: &str,
    queue_index: u16,
    timeout: Duration,
) -> Result<(TcpStream, HelloReply), ConnectError> {
    connect_as(addr, &Hello::new(device, queue_index), timeout)
}

/// As [`connect`], with a prepared [`Hello`] (e.g. carrying the borrower's identity).
///
/// # Errors
/// [`ConnectError`] for each failure, naming the address and the device.
pub fn connect_as(
    addr: &str,
    hello: &Hello,
    timeout: Duration,
) -> Result<(TcpStream, HelloReply), ConnectError> {
    let device = hello.device.as_str();
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|source| ConnectError::Resolve {
            addr: addr.to_owned(),
            source,
        })?
        .collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    let mut stream = None;
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let mut stream = stream.ok_or_else(|| ConnectError::Connect {
        addr: addr.to_owned(),
        source: last,
    })?;
    let hs = |source| ConnectError::Handshake {
        addr: addr.to_owned(),
        source,
    };
    stream.set_nodelay(true).map_err(|e| hs(WireError::Io(e)))?;
    set_liveness(&stream).map_err(|e| hs(WireError::Io(e)))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| hs(WireError::Io(e)))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(|e| hs(WireError::Io(e)))?;
    hello.write_to(&mut stream).map_err(hs)?;
    let reply = HelloReply::read_from(&mut stream).map_err(hs)?;
    if reply.status != HelloStatus::Ok {
        return Err(ConnectError::Refused {
            addr: addr.to_owned(),
            device: device.to_owned(),
            status: reply.status,
            message: reply.message,
        });
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| hs(WireError::Io(e)))?;
    stream
        .set_write_timeout(None)
        .map_err(|e| hs(WireError::Io(e)))?;
    Ok((stream, reply))
}

/// Seconds of silence before the borrower probes a session (TCP keepalive), then
/// seconds between probes, and unanswered probes before the session is declared lost.
pub const KEEPALIVE: (u32, u32, u32) = (5, 2, 3);

/// Milliseconds sent data may stay unacknowledged before the session is declared lost
/// (`TCP_USER_TIMEOUT`).
pub const USER_TIMEOUT_MS: u32 = 15_000;

/// Makes a dead lender or a cut network show as an error on the socket within about
/// 11 s when idle ([`KEEPALIVE`]) or 15 s with data outstanding ([`USER_TIMEOUT_MS`]),
/// instead of TCP's default of minutes; a shorter outage is ridden out by TCP's own
/// retransmissions.
fn set_liveness(sock: &TcpStream) -> io::Result<()> {
    let (idle, intvl, cnt) = KEEPALIVE;
    set_int_options(
        sock,
        &[
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle as libc::c_int),
            (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, intvl as libc::c_int),
            (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, cnt as libc::c_int),
            (
                libc::IPPROTO_TCP,
                libc::TCP_USER_TIMEOUT,
                USER_TIMEOUT_MS as libc::c_int,
            ),
        ],
    )
}

/// Sets integer socket options, `(level, name, value)` each (`setsockopt(2)`), in order.
///
/// # Errors
/// The first option the kernel refuses.
pub fn set_int_options(
    sock: &TcpStream,
    options: &[(libc::c_int, libc::c_int, libc::c_int)],
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    for &(level, name, value) in options {
        // SAFETY: `fd` is an open socket for the duration of the call, and the option
        // value points to a live c_int whose size is passed along.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

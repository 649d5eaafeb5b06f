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

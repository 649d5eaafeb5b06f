//! The TCP transport: connection setup for both ends, plain or inside TLS
//! ([`open`], [`crate::tls`]).
//!
//! Data rides in the stream after each header. Nagle's algorithm is off on every
//! connection (requests are small and latency-bound); each end writes a whole batch of
//! frames with one vectored write.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::conn::Stream;
use crate::tls::{TlsError, TlsTarget};
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
    /// The machine that answered at `addr` did not prove the lender's key: another
    /// lender, or one that cannot prove (`crate::lender_proof`). Not permanent: the real
    /// lender may come back at that address, so a borrower keeps trying until its
    /// deadline.
    #[error("the lender at {addr} is not the one expected")]
    WrongLender {
        /// The address as given.
        addr: String,
        /// Why.
        #[source]
        source: crate::lender_proof::ProofError,
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
    /// TLS could not be established with the lender, or the lender refused this
    /// borrower's certificate.
    #[error("TLS with lender at {addr} failed")]
    Tls {
        /// The address as given.
        addr: String,
        /// Why.
        #[source]
        source: TlsError,
    },
    /// The RDMA transport could not open the session (no device, no route, no
    /// resources, not compiled in).
    #[error("RDMA session to lender at {addr} failed")]
    Rdma {
        /// The address as given.
        addr: String,
        /// Why.
        #[source]
        source: crate::rdma::RdmaError,
    },
    /// The gateway at `addr` could not relay the session to the lender
    /// ([`crate::relay`]): unknown cluster or lender, unreachable, hop budget exceeded.
    #[error("gateway at {addr} cannot relay to lender {lender:?} in cluster {cluster:?}: {status:?}: {message}")]
    Relay {
        /// The gateway's address.
        addr: String,
        /// The destination cluster.
        cluster: String,
        /// The destination lender.
        lender: String,
        /// The gateway's status.
        status: crate::relay::RelayStatus,
        /// The gateway's message.
        message: String,
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

impl ConnectError {
    /// Whether the lender refuses this borrower for good: denied, no such device, a
    /// request or protocol version it does not take, or a TLS refusal (an untrusted or
    /// misnamed certificate, a client certificate refused). Retrying cannot succeed
    /// until a configuration changes; the other failures (busy, unreachable, a lost
    /// connection) are those of the moment.
    pub fn is_permanent(&self) -> bool {
        match self {
            ConnectError::Refused { status, .. } => matches!(
                status,
                HelloStatus::Denied
                    | HelloStatus::NoSuchDevice
                    | HelloStatus::BadRequest
                    | HelloStatus::UnsupportedVersion
            ),
            ConnectError::Tls { source, .. } => source.is_permanent(),
            _ => false,
        }
    }
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
/// A lender of protocol version 1 refuses a version 2 hello for its version: it is then
/// asked again on a new connection, with the same hello in version 1, and its version 1
/// reply is returned (`docs/protocol.md`, "Versions").
///
/// # Errors
/// [`ConnectError`] for each failure, naming the address and the device.
pub fn connect_as(
    addr: &str,
    hello: &Hello,
    timeout: Duration,
) -> Result<(TcpStream, HelloReply), ConnectError> {
    match connect_once(addr, hello, timeout) {
        Err(e) if falls_back(hello, &e) => connect_once(addr, &v1_hello(hello), timeout),
        r => r,
    }
}

/// Whether a refusal of `hello` is that of a lender of protocol version 1, which the
/// borrower asks again in version 1 (`docs/protocol.md`, versions). Only a version 1
/// lender refuses a version 2 hello for its version; a later lender that stopped speaking
/// version 1 refuses that one too, and that refusal is returned.
fn falls_back(hello: &Hello, e: &ConnectError) -> bool {
    hello.version == crate::PROTOCOL_VERSION
        && matches!(
            e,
            ConnectError::Refused {
                status: HelloStatus::UnsupportedVersion,
                ..
            }
        )
}

/// `hello` in protocol version 1.
fn v1_hello(hello: &Hello) -> Hello {
    Hello {
        version: 1,
        ..hello.clone()
    }
}

fn connect_once(
    addr: &str,
    hello: &Hello,
    timeout: Duration,
) -> Result<(TcpStream, HelloReply), ConnectError> {
    let mut stream = connect_tcp(addr, timeout, timeout)?;
    let reply = exchange_hello(addr, hello, &mut stream, |e| e)?;
    clear_timeouts(addr, &stream)?;
    Ok((stream, reply))
}

/// Opens a session to a lender for `hello`, over plain TCP or, with `tls`, inside TLS
/// 1.3: the TCP connect, then the TLS handshake (verifying the lender's certificate
/// against `tls`), then the devlend hello inside TLS, then a pump
/// ([`crate::tls::spawn_pump`]) that bridges the session to the returned
/// [`Stream::Tls`].
///
/// `timeout` bounds the connect, the TLS handshake and the hello each. A lender of
/// protocol version 1 is asked again in version 1, as by [`connect_as`]. The returned
/// stream is in blocking mode with no read or write timeout; the TCP socket has
/// `TCP_NODELAY`, keepalive and `TCP_USER_TIMEOUT` set (see [`KEEPALIVE`]).
///
/// # Errors
/// [`ConnectError`] for each failure, naming the address and the device;
/// [`ConnectError::Tls`] for a TLS failure, with the reason
/// ([`crate::tls::TlsError::is_permanent`] tells a refusal from a lost connection).
pub fn open(
    addr: &str,
    hello: &Hello,
    timeout: Duration,
    tls: Option<&TlsTarget>,
) -> Result<(Stream, HelloReply), ConnectError> {
    open_via(addr, None, hello, timeout, tls)
}

/// As [`open`], with `relay`: `addr` is then the local cluster gateway, asked first
/// (the relay preamble, [`crate::relay`]) to carry the connection to `relay`'s lender;
/// the TLS handshake (with `tls`) and the devlend hello then run end to end with the
/// lender through the gateways. `timeout` also bounds the preamble's reply, which
/// covers the gateways' own connects.
///
/// # Errors
/// As [`open`]; [`ConnectError::Relay`] when a gateway refuses the route (the message
/// names the cluster, the lender, and why).
pub fn open_via(
    addr: &str,
    relay: Option<&crate::relay::Route>,
    hello: &Hello,
    timeout: Duration,
    tls: Option<&TlsTarget>,
) -> Result<(Stream, HelloReply), ConnectError> {
    open_with(addr, relay, hello, (timeout, timeout), tls, None)
}

/// As [`open_via`], for one of several paths to the lender: the TCP connect is bounded
/// by `connect_timeout` (a silently cut path costs only that), each later step (relay,
/// TLS, hello) by `timeout` (a lender that fences an earlier session answers the hello
/// only once that ended). Once the session is open,
/// data it sent may stay unacknowledged for `user_timeout` only (`TCP_USER_TIMEOUT`,
/// instead of [`USER_TIMEOUT_MS`]) before the socket fails, so that a path that dropped
/// silently is left for another within that bound (with heartbeats,
/// [`crate::wire::HEARTBEAT_FRAME`]).
///
/// # Errors
/// As [`open_via`].
pub fn open_path(
    addr: &str,
    relay: Option<&crate::relay::Route>,
    hello: &Hello,
    (connect_timeout, timeout): (Duration, Duration),
    tls: Option<&TlsTarget>,
    user_timeout: Duration,
) -> Result<(Stream, HelloReply), ConnectError> {
    open_with(
        addr,
        relay,
        hello,
        (connect_timeout, timeout),
        tls,
        Some(user_timeout),
    )
}

/// `timeouts`: of the TCP connect, and of every later step.
fn open_with(
    addr: &str,
    relay: Option<&crate::relay::Route>,
    hello: &Hello,
    timeouts: (Duration, Duration),
    tls: Option<&TlsTarget>,
    user_timeout: Option<Duration>,
) -> Result<(Stream, HelloReply), ConnectError> {
    match open_once(addr, relay, hello, timeouts, tls, user_timeout) {
        Err(e) if falls_back(hello, &e) => {
            open_once(addr, relay, &v1_hello(hello), timeouts, tls, user_timeout)
        }
        r => r,
    }
}

fn open_once(
    addr: &str,
    relay: Option<&crate::relay::Route>,
    hello: &Hello,
    (connect, timeout): (Duration, Duration),
    tls: Option<&TlsTarget>,
    user_timeout: Option<Duration>,
) -> Result<(Stream, HelloReply), ConnectError> {
    let mut tcp = connect_tcp(addr, connect, timeout)?;
    if let Some(route) = relay {
        request_relay(addr, route, &mut tcp)?;
    }
    let shorten = |tcp: &TcpStream| match user_timeout {
        Some(t) => set_int_options(
            tcp,
            &[(
                libc::IPPROTO_TCP,
                libc::TCP_USER_TIMEOUT,
                t.as_millis().clamp(1, i32::MAX as u128) as libc::c_int,
            )],
        )
        .map_err(|e| ConnectError::Handshake {
            addr: addr.to_owned(),
            source: WireError::Io(e),
        }),
        None => Ok(()),
    };
    let Some(target) = tls else {
        let reply = exchange_hello(addr, hello, &mut tcp, |e| e)?;
        clear_timeouts(addr, &tcp)?;
        shorten(&tcp)?;
        return Ok((Stream::Tcp(tcp), reply));
    };
    let tls_err = |source| ConnectError::Tls {
        addr: addr.to_owned(),
        source,
    };
    let mut conn = crate::tls::client_handshake(target, &mut tcp).map_err(tls_err)?;
    let reply = {
        let mut s = rustls::Stream::new(&mut conn, &mut tcp);
        exchange_hello(addr, hello, &mut s, |e| match &e {
            ConnectError::Handshake {
                source: WireError::Io(io),
                ..
            } => crate::tls::session_error(io).map_or(e, tls_err),
            _ => e,
        })?
    };
    shorten(&tcp)?;
    let stream = crate::tls::spawn_pump(conn, tcp, addr).map_err(|e| ConnectError::Handshake {
        addr: addr.to_owned(),
        source: WireError::Io(e),
    })?;
    Ok((Stream::Tls(stream), reply))
}

/// Sends the relay preamble for `route` on `tcp` and reads the gateway's reply.
fn request_relay(
    addr: &str,
    route: &crate::relay::Route,
    tcp: &mut TcpStream,
) -> Result<(), ConnectError> {
    use crate::relay::{RelayReply, RelayRequest, RelayStatus};
    let hs = |source| ConnectError::Handshake {
        addr: addr.to_owned(),
        source,
    };
    let req = RelayRequest::new(&route.cluster, &route.lender)
        .encode()
        .map_err(hs)?;
    io::Write::write_all(tcp, &req).map_err(|e| hs(WireError::Io(e)))?;
    let reply = RelayReply::read_from(tcp).map_err(hs)?;
    if reply.status != RelayStatus::Ok {
        return Err(ConnectError::Relay {
            addr: addr.to_owned(),
            cluster: route.cluster.clone(),
            lender: route.lender.clone(),
            status: reply.status,
            message: reply.message,
        });
    }
    Ok(())
}

/// Resolves `addr` and connects to the first address that answers, each try bounded
/// by `connect`; sets `TCP_NODELAY`, the liveness options, and `timeout` as read and
/// write timeout.
fn connect_tcp(
    addr: &str,
    connect: Duration,
    timeout: Duration,
) -> Result<TcpStream, ConnectError> {
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
        match TcpStream::connect_timeout(&a, connect) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let stream = stream.ok_or_else(|| ConnectError::Connect {
        addr: addr.to_owned(),
        source: last,
    })?;
    let hs = |e| ConnectError::Handshake {
        addr: addr.to_owned(),
        source: WireError::Io(e),
    };
    stream.set_nodelay(true).map_err(hs)?;
    set_liveness(&stream).map_err(hs)?;
    stream.set_read_timeout(Some(timeout)).map_err(hs)?;
    stream.set_write_timeout(Some(timeout)).map_err(hs)?;
    Ok(stream)
}

/// Sends `hello` on `io` and reads the reply; a refusal is [`ConnectError::Refused`].
/// `map` may turn a wire failure into a more telling error (a TLS alert).
fn exchange_hello(
    addr: &str,
    hello: &Hello,
    io: &mut (impl io::Read + io::Write),
    map: impl Fn(ConnectError) -> ConnectError,
) -> Result<HelloReply, ConnectError> {
    let hs = |source| {
        map(ConnectError::Handshake {
            addr: addr.to_owned(),
            source,
        })
    };
    hello.write_to(io).map_err(hs)?;
    io.flush().map_err(|e| hs(WireError::Io(e)))?;
    let mut reply = HelloReply::read_from(io).map_err(hs)?;
    if reply.status == HelloStatus::Prove {
        // The lender proved itself: now the token, and the proof of holding its key.
        let Some(holder) = hello.holder.as_ref() else {
            return Err(hs(WireError::Invalid(
                "an interim reply to a hello that proves nothing",
            )));
        };
        let possession = crate::holder_proof::answer(hello, holder, &reply).map_err(|source| {
            ConnectError::WrongLender {
                addr: addr.to_owned(),
                source,
            }
        })?;
        possession.write_to(io).map_err(hs)?;
        io.flush().map_err(|e| hs(WireError::Io(e)))?;
        reply = HelloReply::read_from(io).map_err(hs)?;
        if reply.status == HelloStatus::Prove {
            return Err(hs(WireError::Invalid("a second interim reply")));
        }
    }
    if reply.status != HelloStatus::Ok {
        return Err(ConnectError::Refused {
            addr: addr.to_owned(),
            device: hello.device.clone(),
            status: reply.status,
            message: reply.message,
        });
    }
    Ok(reply)
}

/// Checks that the lender at `addr` that answered `hello` with `reply` proved the key
/// `expected`; without one, that a proof it gave anyway verifies with the key it names
/// (nothing to check without either): the borrower's side of [`crate::lender_proof`],
/// for every kind of session.
///
/// # Errors
/// [`ConnectError::WrongLender`].
pub fn check_lender(
    addr: &str,
    expected: Option<&crate::lease_token::PublicKey>,
    hello: &Hello,
    reply: &HelloReply,
) -> Result<(), ConnectError> {
    // A proof given without one expected must still verify with the key it names: that
    // key may be pinned for the sessions that follow (several paths).
    let Some(key) = expected.or(reply.proof.as_ref().map(|p| &p.key)) else {
        return Ok(());
    };
    hello
        .check_proof(reply.proof.as_ref(), key)
        .map_err(|source| ConnectError::WrongLender {
            addr: addr.to_owned(),
            source,
        })
}

fn clear_timeouts(addr: &str, stream: &TcpStream) -> Result<(), ConnectError> {
    let hs = |e| ConnectError::Handshake {
        addr: addr.to_owned(),
        source: WireError::Io(e),
    };
    stream.set_read_timeout(None).map_err(hs)?;
    stream.set_write_timeout(None).map_err(hs)
}

/// Seconds of silence before either end probes a session (TCP keepalive: the borrower,
/// and the lender on the sessions it accepts), then seconds between probes, and
/// unanswered probes before the session is declared lost.
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

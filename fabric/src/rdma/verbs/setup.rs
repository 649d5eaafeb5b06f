//! Connection setup over rdma_cm: the active side ([`connect`]), the passive side
//! ([`Listener`], [`Incoming`]), and the resources both build on the id (`build`).

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::buffers::MsgPool;
use super::{
    check_devices, event_name, os_err, resources, set_nonblocking, CmId, CompChannel, Connection,
    Cq, EventChannel, Pd, Shape, BORROWER, HANDSHAKE_BUFFERS, RECV_BIT,
};
use crate::rdma::RdmaError;
use crate::{Hello, HelloReply};

/// Resources built on an id whose device is known (after route resolution or on a
/// connect request), before the connection is established.
/// Registers up to `registered` buffers each way at first (queues and the CQ are sized
/// for the whole `shape`; [`Connection::grow`] registers the rest).
fn build(
    id: CmId,
    events: EventChannel,
    shape: Shape,
    registered: usize,
    peer: String,
) -> Result<Connection, RdmaError> {
    let ctx = id.verbs();
    if ctx.is_null() {
        return Err(RdmaError::NoDevice);
    }
    // SAFETY: ctx is the id's live device context.
    let pd = unsafe { ibv_alloc_pd(ctx) };
    if pd.is_null() {
        return Err(resources("a protection domain"));
    }
    let pd = Arc::new(Pd(pd));
    // SAFETY: as above.
    let ch = unsafe { ibv_create_comp_channel(ctx) };
    if ch.is_null() {
        return Err(resources("a completion channel"));
    }
    let comp = Arc::new(CompChannel(ch));
    // SAFETY: ch is live.
    let comp_fd = unsafe { (*ch).fd };
    set_nonblocking(comp_fd).map_err(|source| RdmaError::Resources {
        what: "a non-blocking completion channel",
        source,
    })?;
    let cqe = shape.send_wr + shape.recv.0 + 16;
    // SAFETY: ctx and ch are live.
    let cq = unsafe { ibv_create_cq(ctx, cqe as i32, std::ptr::null_mut(), ch, 0) };
    if cq.is_null() {
        return Err(resources("a completion queue"));
    }
    let cq = Cq {
        cq,
        _ch: comp.clone(),
    };
    // SAFETY: all-zero is a valid ibv_qp_init_attr to fill in.
    let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    attr.send_cq = cq.cq;
    attr.recv_cq = cq.cq;
    attr.qp_type = ibv_qp_type::IBV_QPT_RC;
    attr.cap.max_send_wr = shape.send_wr as u32;
    attr.cap.max_recv_wr = shape.recv.0 as u32;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    // SAFETY: id, pd and the CQ are live; attr is initialised.
    if unsafe { rdma_create_qp(id.0, pd.0, &mut attr) } != 0 {
        return Err(resources("a queue pair"));
    }
    let send = MsgPool::new(&pd, shape.send.0.min(registered), shape.send.1)?;
    let recv = MsgPool::new(&pd, shape.recv.0.min(registered), shape.recv.1)?;
    // SAFETY: plain syscall.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(resources("an epoll fd"));
    }
    // SAFETY: ep is a fresh fd that we own from here.
    let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
    for fd in [comp_fd, events.fd()] {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: both fds are live and stay so while `epoll` lives (same owner).
        if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
            return Err(resources("an epoll registration"));
        }
    }
    let mut c = Connection {
        id,
        send,
        recv,
        cq,
        comp,
        pd,
        events,
        epoll,
        peer,
        // SAFETY: ibv_wc is plain data; zeroes are valid.
        wc: (0..64).map(|_| unsafe { std::mem::zeroed() }).collect(),
        disconnected: false,
        early: Vec::new(),
        shape,
    };
    for i in 0..c.recv.count() {
        c.post_recv(i)?;
    }
    c.arm()?;
    Ok(c)
}

pub(super) fn to_sockaddr(addr: &str) -> Result<(SocketAddr, libc::sockaddr_storage), RdmaError> {
    let bad = || RdmaError::BadAddress {
        addr: addr.to_string(),
    };
    let sa = addr
        .to_socket_addrs()
        .map_err(|_| bad())?
        .next()
        .ok_or_else(bad)?;
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match sa {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as u16;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as u16;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
        }
    }
    Ok((sa, ss))
}

fn conn_param(ctx: *mut ibv_context) -> rdma_conn_param {
    // SAFETY: all-zero is a valid ibv_device_attr to be filled by the query.
    let mut da: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is a live device context; da is writable.
    let (rd, init) = if unsafe { ibv_query_device(ctx, &mut da) } == 0 {
        (
            da.max_qp_rd_atom.clamp(1, 16),
            da.max_qp_init_rd_atom.clamp(1, 16),
        )
    } else {
        (1, 1)
    };
    // SAFETY: all-zero is a valid rdma_conn_param.
    let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
    p.responder_resources = rd as u8;
    p.initiator_depth = init as u8;
    p.retry_count = 7;
    p.rnr_retry_count = 7; // retry forever while the peer has no receive posted
    p
}

/// Opens an RDMA connection to `addr` (`IP:PORT`, rdma_cm) and runs the handshake. A
/// lender of protocol version 1 that refuses the hello's version 2 is asked again, on a
/// new connection, with the same hello in version 1 (as `tcp::connect_as` does).
///
/// # Errors
/// [`RdmaError`] for the transport (no device, no route, no resources, refused,
/// timeout); a hello reply is returned whatever its status.
pub fn connect(
    addr: &str,
    hello: &Hello,
    timeout: Duration,
) -> Result<(Connection, HelloReply), RdmaError> {
    let (c, reply) = connect_once(addr, hello, timeout)?;
    if reply.status == crate::HelloStatus::UnsupportedVersion
        && reply.version == 1
        && hello.version == crate::PROTOCOL_VERSION
    {
        drop(c);
        let v1 = Hello {
            version: 1,
            ..hello.clone()
        };
        return connect_once(addr, &v1, timeout);
    }
    Ok((c, reply))
}

fn connect_once(
    addr: &str,
    hello: &Hello,
    timeout: Duration,
) -> Result<(Connection, HelloReply), RdmaError> {
    let mut c = open_connection(None, addr, BORROWER, timeout)?;
    let mut msg = Vec::new();
    hello
        .write_to(&mut msg)
        .map_err(|e| RdmaError::WorkRequest(format!("encoding the hello: {e}")))?;
    c.send_msg(0, &msg, 0)?;
    let deadline = Instant::now() + timeout;
    let reply = read_reply(&mut c, deadline, addr)?;
    if reply.status != crate::HelloStatus::Prove {
        return Ok((c, reply));
    }
    // The lender proved itself: now the token, and the proof of holding its key.
    let Some(holder) = hello.holder.as_ref() else {
        return Err(RdmaError::Connect {
            addr: addr.to_string(),
            reason: "an interim reply to a hello that proves nothing".into(),
        });
    };
    let possession =
        crate::holder_proof::answer(hello, holder, &reply).map_err(RdmaError::WrongLender)?;
    let msg = possession
        .to_bytes()
        .map_err(|e| RdmaError::WorkRequest(format!("encoding the possession message: {e}")))?;
    c.send_msg(0, &msg, 0)?;
    let reply = read_reply(&mut c, deadline, addr)?;
    if reply.status == crate::HelloStatus::Prove {
        return Err(RdmaError::Connect {
            addr: addr.to_string(),
            reason: "a second interim reply".into(),
        });
    }
    Ok((c, reply))
}

/// Opens an RDMA connection to `addr` (`IP:PORT`, rdma_cm) from the local address `src`
/// (`IP`; `None`: the one the route picks), with the buffers and queue depths of
/// `shape` ([`BORROWER`] for a borrower's session, about 6 MiB registered), up to the
/// connection's establishment; no handshake message is sent.
///
/// # Errors
/// [`RdmaError`] for the transport (no device, no route, no resources, rejected,
/// timeout).
pub fn open_connection(
    src: Option<&str>,
    addr: &str,
    shape: Shape,
    timeout: Duration,
) -> Result<Connection, RdmaError> {
    check_devices()?;
    let (_, mut ss) = to_sockaddr(addr)?;
    let mut src_ss = match src {
        Some(ip) => Some(to_sockaddr(&format!("{ip}:0"))?.1),
        None => None,
    };
    let events = EventChannel::new()?;
    let id = CmId::new(&events)?;
    let ms = timeout.as_millis().clamp(1, 60_000) as i32;
    let route = |stage: &'static str| RdmaError::Route {
        addr: addr.to_string(),
        stage,
        source: os_err(),
    };
    // SAFETY: id is live; ss (and src_ss when given) are valid socket addresses for
    // the call.
    if unsafe {
        rdma_resolve_addr(
            id.0,
            src_ss.as_mut().map_or(std::ptr::null_mut(), |s| {
                (s as *mut libc::sockaddr_storage).cast()
            }),
            (&mut ss as *mut libc::sockaddr_storage).cast(),
            ms,
        )
    } != 0
    {
        return Err(route("resolving the address"));
    }
    expect(
        &events,
        rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
        timeout,
        addr,
        "resolving the RDMA address",
    )?;
    // SAFETY: id is live and its address resolved.
    if unsafe { rdma_resolve_route(id.0, ms) } != 0 {
        return Err(route("resolving the route"));
    }
    expect(
        &events,
        rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
        timeout,
        addr,
        "resolving the RDMA route",
    )?;
    let ctx = id.verbs();
    let c = build(id, events, shape, usize::MAX, addr.to_string())?;
    let mut p = conn_param(ctx);
    // SAFETY: the id has a QP; p is valid for the call.
    if unsafe { rdma_connect(c.id.0, &mut p) } != 0 {
        return Err(RdmaError::Connect {
            addr: addr.to_string(),
            reason: format!("rdma_connect: {}", os_err()),
        });
    }
    expect(
        &c.events,
        rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
        timeout,
        addr,
        "connecting",
    )?;
    Ok(c)
}

/// Waits for the lender's next handshake message (skipping send completions) and reads
/// it as a hello reply.
fn read_reply(c: &mut Connection, deadline: Instant, addr: &str) -> Result<HelloReply, RdmaError> {
    loop {
        let wc = c.wait(deadline, "waiting for the hello reply")?;
        if let Some(e) = wc.error {
            return Err(RdmaError::WorkRequest(format!("handshake: {e}")));
        }
        if wc.recv {
            let i = (wc.wr_id & !RECV_BIT) as usize;
            let reply =
                HelloReply::read_from(&mut c.recv_msg(i, wc.byte_len as usize)).map_err(|e| {
                    RdmaError::Connect {
                        addr: addr.to_string(),
                        reason: format!("bad hello reply: {e}"),
                    }
                })?;
            c.post_recv(i)?;
            return Ok(reply);
        }
    }
}

fn expect(
    ch: &EventChannel,
    want: rdma_cm_event_type::Type,
    timeout: Duration,
    addr: &str,
    what: &'static str,
) -> Result<(), RdmaError> {
    let (ev, status, _) = ch.next(timeout, what)?;
    if ev == want {
        return Ok(());
    }
    let mut reason = format!("{} (status {status}) while {what}", event_name(ev));
    if ev == rdma_cm_event_type::RDMA_CM_EVENT_REJECTED {
        reason
            .push_str(": nothing serves RDMA there (is the lender started with --transport rdma?), or the lender turned the request away (too many connections in their handshake)");
    }
    if matches!(
        ev,
        rdma_cm_event_type::RDMA_CM_EVENT_ADDR_ERROR
            | rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_ERROR
    ) {
        return Err(RdmaError::Route {
            addr: addr.to_string(),
            stage: what,
            source: io::Error::from_raw_os_error(status.unsigned_abs() as i32),
        });
    }
    Err(RdmaError::Connect {
        addr: addr.to_string(),
        reason,
    })
}

/// A lender's rdma_cm listener.
pub struct Listener {
    id: CmId,
    events: EventChannel,
}

/// A connection request taken from a listener, to be set up on its own thread.
pub struct Incoming(CmId);

impl Listener {
    /// Listens with rdma_cm on `addr` (`IP:PORT`).
    ///
    /// # Errors
    /// No RDMA device, no rdma_cm, an address that no RDMA device has.
    pub fn bind(addr: &str) -> Result<Listener, RdmaError> {
        check_devices()?;
        let (_, mut ss) = to_sockaddr(addr)?;
        let events = EventChannel::new()?;
        let id = CmId::new(&events)?;
        let listen = |source| RdmaError::Listen {
            addr: addr.to_string(),
            source,
        };
        // SAFETY: id is live; ss is a valid socket address.
        if unsafe { rdma_bind_addr(id.0, (&mut ss as *mut libc::sockaddr_storage).cast()) } != 0 {
            return Err(listen(os_err()));
        }
        // SAFETY: id is bound.
        if unsafe { rdma_listen(id.0, 64) } != 0 {
            return Err(listen(os_err()));
        }
        Ok(Listener { id, events })
    }

    /// The fd that is readable when a connection request may be waiting.
    pub fn fd(&self) -> RawFd {
        self.events.fd()
    }

    /// The next connection request, if any (non-blocking). Other events are ignored.
    pub fn accept(&self) -> Option<Incoming> {
        while let Some((ev, _, id)) = self.events.try_next() {
            if ev == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST
                && !id.is_null()
                && id != self.id.0
            {
                return Some(Incoming(CmId(id)));
            }
        }
        None
    }
}

impl Incoming {
    /// The peer's address.
    pub fn peer(&self) -> String {
        // SAFETY: the id is live; its route holds the peer's address.
        let sa = unsafe { rdma_get_peer_addr(&*self.0 .0) } as *const libc::sockaddr;
        // SAFETY: sa points at a sockaddr of the family it names.
        unsafe {
            match i32::from((*sa).sa_family) {
                libc::AF_INET => {
                    let sin = &*(sa as *const libc::sockaddr_in);
                    format!(
                        "{}:{}",
                        std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                        u16::from_be(sin.sin_port)
                    )
                }
                libc::AF_INET6 => {
                    let sin6 = &*(sa as *const libc::sockaddr_in6);
                    format!(
                        "[{}]:{}",
                        std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                        u16::from_be(sin6.sin6_port)
                    )
                }
                _ => "rdma peer".to_string(),
            }
        }
    }

    /// The peer's IP address (`None` for an address of another family).
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        self.peer().parse::<SocketAddr>().ok().map(|a| a.ip())
    }

    /// Refuses the connection request (the peer sees it rejected at once) and frees it.
    pub fn reject(self) {
        // SAFETY: the id is live and has a pending connection request; no private data.
        unsafe { rdma_reject(self.0 .0, std::ptr::null(), 0) };
    }

    /// Moves the id to its own event channel, builds the QP, accepts, and waits for the
    /// hello (first message) until `deadline` (the whole of it: the handshake's
    /// deadline, counted from the connection request). Returns the connection and the
    /// hello's bytes' location. The queues are sized for `shape`, but only
    /// [`HANDSHAKE_BUFFERS`] message buffers are registered each way: call
    /// [`Connection::grow`] once the hello is admitted, before using more.
    ///
    /// # Errors
    /// Resources, a peer that goes away, or a timeout.
    pub fn establish(
        self,
        shape: Shape,
        deadline: Instant,
    ) -> Result<(Connection, usize, usize), RdmaError> {
        let peer = self.peer();
        let events = EventChannel::new()?;
        // SAFETY: both are live; the id's earlier event was acked by the listener.
        if unsafe { rdma_migrate_id(self.0 .0, events.0) } != 0 {
            return Err(resources("an event channel for the connection"));
        }
        let ctx = self.0.verbs();
        let mut c = build(self.0, events, shape, HANDSHAKE_BUFFERS, peer.clone())?;
        let mut p = conn_param(ctx);
        // SAFETY: the id has a QP; p is valid.
        if unsafe { rdma_accept(c.id.0, &mut p) } != 0 {
            return Err(RdmaError::Connect {
                addr: peer,
                reason: format!("rdma_accept: {}", os_err()),
            });
        }
        expect(
            &c.events,
            rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            deadline.saturating_duration_since(Instant::now()),
            &peer,
            "accepting",
        )?;
        let (i, n) = c.wait_recv(deadline, "waiting for the hello")?;
        Ok((c, i, n))
    }
}

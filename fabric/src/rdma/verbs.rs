//! A small safe layer over libibverbs and librdmacm (`rdma-sys`): each object owns
//! its handle and frees it on drop, in an order enforced by `Arc`s (an MR holds its PD,
//! a CQ its completion channel; a [`Connection`] drops its QP before its buffers).
//!
//! One [`Connection`] is one RC queue pair set up by rdma_cm, with one CQ for sends and
//! receives, armed on a completion channel, and two pools of registered message buffers.
//! Its [`Connection::fd`] is an epoll fd watching the completion channel and the
//! connection's rdma_cm event channel, so a worker waits on one fd for completions and
//! disconnects alike.
//!
//! Why this file is over 600 lines: it wraps every libibverbs and librdmacm object devlend
//! uses, each with its raw handle and drop order, and the one `Connection` built on them.
//! The connection setup (`build`, `connect`, `expect`, and the passive side, `Listener` and
//! `Incoming`) could move to its own module, and is left here for now.

use std::ffi::CStr;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::{RdmaError, MAX_HANDSHAKE_MSG, MAX_REQUEST_MSG, RECV_DEPTH};
use crate::{Hello, HelloReply};

fn os_err() -> io::Error {
    io::Error::last_os_error()
}

fn resources(what: &'static str) -> RdmaError {
    RdmaError::Resources {
        what,
        source: os_err(),
    }
}

/// Fails with [`RdmaError::NoDevice`] when the machine has no RDMA device.
///
/// # Errors
/// [`RdmaError::NoDevice`].
pub fn check_devices() -> Result<usize, RdmaError> {
    let mut n: i32 = 0;
    // SAFETY: ibv_get_device_list writes the count and returns a list (or NULL) that
    // we free at once; no pointer from it is kept.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if !list.is_null() {
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(list) };
    }
    if list.is_null() || n <= 0 {
        return Err(RdmaError::NoDevice);
    }
    Ok(n as usize)
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd owned by a live verbs object; no memory passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os_err());
    }
    Ok(())
}

/// Waits up to `timeout` for `fd` to be readable.
/// Waits up to `timeout` for `fd` to be readable (e.g. [`Connection::fd`]); whether it
/// is.
pub fn wait_fd(fd: RawFd, timeout: Duration) -> bool {
    wait_readable(fd, timeout)
}

fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

/// An rdma_cm event channel.
pub struct EventChannel(*mut rdma_event_channel);

// SAFETY: the channel is a kernel fd wrapper; librdmacm allows its use from any thread,
// and devlend uses each from one thread at a time.
unsafe impl Send for EventChannel {}

impl EventChannel {
    /// Opens a channel (non-blocking).
    ///
    /// # Errors
    /// [`RdmaError::NoCm`] when rdma_cm is unavailable.
    pub fn new() -> Result<Self, RdmaError> {
        // SAFETY: no arguments; returns NULL on failure.
        let ch = unsafe { rdma_create_event_channel() };
        if ch.is_null() {
            return Err(RdmaError::NoCm(os_err()));
        }
        let me = EventChannel(ch);
        set_nonblocking(me.fd()).map_err(|source| RdmaError::Resources {
            what: "a non-blocking rdma_cm event channel",
            source,
        })?;
        Ok(me)
    }

    /// The channel's fd.
    pub fn fd(&self) -> RawFd {
        // SAFETY: self.0 is a live channel.
        unsafe { (*self.0).fd }
    }

    /// The next event, if one is ready: its type, status, and the id it concerns.
    fn try_next(&self) -> Option<(rdma_cm_event_type::Type, i32, *mut rdma_cm_id)> {
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is live and non-blocking; `ev` receives an event we ack
        // below after copying its fields.
        if unsafe { rdma_get_cm_event(self.0, &mut ev) } != 0 || ev.is_null() {
            return None;
        }
        // SAFETY: `ev` is a valid event until acked.
        let out = unsafe { ((*ev).event, (*ev).status, (*ev).id) };
        // SAFETY: acked once; a CONNECT_REQUEST's id stays valid (we own it from now).
        unsafe { rdma_ack_cm_event(ev) };
        Some(out)
    }

    /// Waits up to `timeout` for the next event.
    fn next(
        &self,
        timeout: Duration,
        what: &'static str,
    ) -> Result<(rdma_cm_event_type::Type, i32, *mut rdma_cm_id), RdmaError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.try_next() {
                return Ok(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RdmaError::Timeout { what });
            }
            wait_readable(self.fd(), left);
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel was destroyed before (owners drop first).
        unsafe { rdma_destroy_event_channel(self.0) };
    }
}

/// The name of an rdma_cm event.
fn event_name(e: rdma_cm_event_type::Type) -> String {
    // SAFETY: rdma_event_str returns a static string for any value.
    unsafe { CStr::from_ptr(rdma_event_str(e)) }
        .to_string_lossy()
        .into_owned()
}

/// An rdma_cm id, with its QP once created.
pub struct CmId(*mut rdma_cm_id);

// SAFETY: used from one thread at a time; librdmacm ids are not thread-bound.
unsafe impl Send for CmId {}

impl CmId {
    fn new(ch: &EventChannel) -> Result<Self, RdmaError> {
        let mut id = std::ptr::null_mut();
        // SAFETY: `ch` is live; `id` receives the new id.
        if unsafe {
            rdma_create_id(
                ch.0,
                &mut id,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            return Err(resources("an rdma_cm id"));
        }
        Ok(CmId(id))
    }

    fn verbs(&self) -> *mut ibv_context {
        // SAFETY: self.0 is live.
        unsafe { (*self.0).verbs }
    }

    fn qp(&self) -> *mut ibv_qp {
        // SAFETY: self.0 is live.
        unsafe { (*self.0).qp }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: the id is live; its QP (if any) is destroyed before the id.
        unsafe {
            if !(*self.0).qp.is_null() {
                rdma_destroy_qp(self.0);
            }
            rdma_destroy_id(self.0);
        }
    }
}

/// A protection domain.
pub struct Pd(*mut ibv_pd);
// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Pd {}
// SAFETY: the PD is only read (used as a handle) after creation.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of the PD holds an Arc to it, so none is left.
        unsafe { ibv_dealloc_pd(self.0) };
    }
}

/// What a peer may do to a range registered with [`Mr::register_for_peer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerAccess {
    /// RDMA READ it.
    Read,
    /// RDMA WRITE it.
    Write,
}

/// A registered memory region; deregistered on drop.
pub struct Mr {
    mr: *mut ibv_mr,
    _pd: Arc<Pd>,
}
// SAFETY: an MR handle is plain data for the verbs library.
unsafe impl Send for Mr {}
// SAFETY: only read after creation.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `addr` in `pd`; `remote` adds remote read and write.
    ///
    /// # Safety
    /// The range must stay mapped for as long as the MR lives (the caller keeps its
    /// owner alive beside it).
    pub unsafe fn register(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        remote: bool,
    ) -> Result<Mr, RdmaError> {
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if remote {
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        // SAFETY: the caller's contract.
        unsafe { Self::register_access(pd, addr, len, access, "a memory region") }
    }

    /// `ibv_reg_mr` with `access`; `what` names the region in the error.
    ///
    /// # Safety
    /// As [`Mr::register`].
    unsafe fn register_access(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        access: u32,
        what: &'static str,
    ) -> Result<Mr, RdmaError> {
        // SAFETY: the range is mapped (caller's contract); pd is live.
        let mr = unsafe { ibv_reg_mr(pd.0, addr.cast(), len, access as i32) };
        if mr.is_null() {
            return Err(resources(what));
        }
        Ok(Mr {
            mr,
            _pd: pd.clone(),
        })
    }

    /// Registers `len` bytes at `addr` in `pd` for the peer alone, in one direction:
    /// [`PeerAccess::Read`] lets it RDMA READ the range (the data of a write request),
    /// [`PeerAccess::Write`] lets it RDMA WRITE it (the buffers of a read request; the
    /// verbs require local write beside remote write). Nothing outside the range is
    /// reachable with its rkey, and the rkey dies when the MR is dropped.
    ///
    /// # Safety
    /// As [`Mr::register`].
    pub unsafe fn register_for_peer(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        peer: PeerAccess,
    ) -> Result<Mr, RdmaError> {
        let access = match peer {
            PeerAccess::Read => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            PeerAccess::Write => {
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
                    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            }
        };
        // SAFETY: the caller's contract.
        unsafe { Self::register_access(pd, addr, len, access, "a memory region for one request") }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        // SAFETY: live MR.
        unsafe { (*self.mr).addr as u64 }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        // SAFETY: live MR.
        unsafe { (*self.mr).length }
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).lkey }
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: the MR is live; nothing posted uses it any more (its owner's QP is
        // destroyed or idle).
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

struct CompChannel(*mut ibv_comp_channel);
// SAFETY: a kernel fd wrapper.
unsafe impl Send for CompChannel {}
// SAFETY: only read after creation.
unsafe impl Sync for CompChannel {}
impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: its CQ (which holds an Arc to it) is destroyed before.
        unsafe { ibv_destroy_comp_channel(self.0) };
    }
}

struct Cq {
    cq: *mut ibv_cq,
    _ch: Arc<CompChannel>,
}
// SAFETY: used by one thread at a time.
unsafe impl Send for Cq {}
impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: the QP using it is destroyed before (Connection's field order).
        unsafe { ibv_destroy_cq(self.cq) };
    }
}

/// A pool of equal registered message buffers.
struct MsgPool {
    mr: Mr,
    buf: Box<[u8]>,
    size: usize,
}

impl MsgPool {
    fn new(pd: &Arc<Pd>, count: usize, size: usize) -> Result<Self, RdmaError> {
        let mut buf = vec![0u8; count * size].into_boxed_slice();
        // SAFETY: `buf` lives in the pool beside the MR and is dropped after it
        // (field order: mr first).
        let mr = unsafe { Mr::register(pd, buf.as_mut_ptr(), buf.len(), false)? };
        Ok(MsgPool { mr, buf, size })
    }

    fn sge(&self, i: usize, len: usize) -> ibv_sge {
        ibv_sge {
            addr: self.buf.as_ptr() as u64 + (i * self.size) as u64,
            length: len.min(self.size) as u32,
            lkey: self.mr.lkey(),
        }
    }

    fn get(&self, i: usize, len: usize) -> &[u8] {
        let at = i * self.size;
        &self.buf[at..at + len.min(self.size)]
    }

    fn get_mut(&mut self, i: usize) -> &mut [u8] {
        let at = i * self.size;
        &mut self.buf[at..at + self.size]
    }
}

/// A work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// `None` on success, else the status text.
    pub error: Option<&'static str>,
    /// Whether it completes a receive.
    pub recv: bool,
    /// Bytes received (receives).
    pub byte_len: u32,
}

/// Receive work-request ids carry this bit (the rest is the buffer index).
pub const RECV_BIT: u64 = 1 << 63;

/// Sizes of a connection's resources.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Send buffers and their size.
    pub send: (usize, usize),
    /// Receive buffers and their size.
    pub recv: (usize, usize),
    /// Send queue depth (messages plus RDMA READ/WRITE work requests).
    pub send_wr: usize,
}

/// The borrower's shape: requests out, responses (and the hello reply) in.
pub const BORROWER: Shape = Shape {
    send: (RECV_DEPTH, MAX_REQUEST_MSG),
    recv: (RECV_DEPTH, MAX_HANDSHAKE_MSG),
    send_wr: RECV_DEPTH + 16,
};

/// One connected RC queue pair. Fields drop in order: QP (in the id), buffers, CQ,
/// channels, PD.
pub struct Connection {
    id: CmId,
    send: MsgPool,
    recv: MsgPool,
    cq: Cq,
    comp: Arc<CompChannel>,
    pd: Arc<Pd>,
    events: EventChannel,
    epoll: OwnedFd,
    peer: String,
    wc: Vec<ibv_wc>,
    disconnected: bool,
    /// Completions taken during the handshake but not returned yet.
    early: Vec<Completion>,
}

// SAFETY: every handle inside is used by one thread at a time (the owner's).
unsafe impl Send for Connection {}

/// Resources built on an id whose device is known (after route resolution or on a
/// connect request), before the connection is established.
fn build(
    id: CmId,
    events: EventChannel,
    shape: Shape,
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
    let send = MsgPool::new(&pd, shape.send.0, shape.send.1)?;
    let recv = MsgPool::new(&pd, shape.recv.0, shape.recv.1)?;
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
    };
    for i in 0..shape.recv.0 {
        c.post_recv(i)?;
    }
    c.arm()?;
    Ok(c)
}

fn to_sockaddr(addr: &str) -> Result<(SocketAddr, libc::sockaddr_storage), RdmaError> {
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
    check_devices()?;
    let (_, mut ss) = to_sockaddr(addr)?;
    let events = EventChannel::new()?;
    let id = CmId::new(&events)?;
    let ms = timeout.as_millis().clamp(1, 60_000) as i32;
    let route = |stage: &'static str| RdmaError::Route {
        addr: addr.to_string(),
        stage,
        source: os_err(),
    };
    // SAFETY: id is live; ss is a valid socket address for the call.
    if unsafe {
        rdma_resolve_addr(
            id.0,
            std::ptr::null_mut(),
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
    let mut c = build(id, events, BORROWER, addr.to_string())?;
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
    let mut msg = Vec::new();
    hello
        .write_to(&mut msg)
        .map_err(|e| RdmaError::WorkRequest(format!("encoding the hello: {e}")))?;
    c.send_msg(0, &msg, 0)?;
    let deadline = Instant::now() + timeout;
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
            return Ok((c, reply));
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
            .push_str(": nothing serves RDMA there (is the lender started with --transport rdma?)");
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

impl Connection {
    /// The fd to wait on (readable: a completion or an rdma_cm event is ready); then
    /// call [`Self::poll`].
    pub fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// The peer's address, for logs.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The protection domain, to register memory the peer may reach.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    fn arm(&mut self) -> Result<(), RdmaError> {
        // SAFETY: live CQ.
        if unsafe { ibv_req_notify_cq(self.cq.cq, 0) } != 0 {
            return Err(RdmaError::WorkRequest(format!(
                "arming the CQ: {}",
                os_err()
            )));
        }
        Ok(())
    }

    /// Posts receive buffer `i` again.
    ///
    /// # Errors
    /// The verbs error.
    pub fn post_recv(&mut self, i: usize) -> Result<(), RdmaError> {
        let mut sge = self.recv.sge(i, self.recv.size);
        // SAFETY: all-zero is a valid ibv_recv_wr.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = RECV_BIT | i as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live; the buffer is registered and owned by self.
        if unsafe { ibv_post_recv(self.id.qp(), &mut wr, &mut bad) } != 0 {
            return Err(RdmaError::WorkRequest(format!(
                "posting a receive: {}",
                os_err()
            )));
        }
        Ok(())
    }

    /// The first `len` bytes of receive buffer `i`.
    pub fn recv_msg(&self, i: usize, len: usize) -> &[u8] {
        self.recv.get(i, len)
    }

    /// Send buffer `i`, to fill before [`Self::post_send`].
    pub fn send_buf(&mut self, i: usize) -> &mut [u8] {
        self.send.get_mut(i)
    }

    /// Number of send buffers.
    pub fn send_slots(&self) -> usize {
        self.send.buf.len() / self.send.size
    }

    /// Copies `msg` into send buffer `i` and sends it (signaled, id `wr_id`).
    ///
    /// # Errors
    /// The verbs error.
    pub fn send_msg(&mut self, i: usize, msg: &[u8], wr_id: u64) -> Result<(), RdmaError> {
        let n = msg.len().min(self.send.size);
        self.send.get_mut(i)[..n].copy_from_slice(&msg[..n]);
        self.post_send(i, n, wr_id)
    }

    /// Sends the first `len` bytes of send buffer `i` (signaled, id `wr_id`).
    ///
    /// # Errors
    /// The verbs error.
    pub fn post_send(&mut self, i: usize, len: usize, wr_id: u64) -> Result<(), RdmaError> {
        let mut sge = self.send.sge(i, len);
        self.post(ibv_wr_opcode::IBV_WR_SEND, wr_id, &mut sge, 0, 0, true)
    }

    /// Posts an RDMA READ (`read`) or WRITE between local registered memory and a
    /// remote range.
    ///
    /// # Errors
    /// The verbs error.
    #[allow(clippy::too_many_arguments)]
    pub fn post_rdma(
        &mut self,
        read: bool,
        wr_id: u64,
        local: u64,
        lkey: u32,
        len: u32,
        remote: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), RdmaError> {
        let mut sge = ibv_sge {
            addr: local,
            length: len,
            lkey,
        };
        let op = if read {
            ibv_wr_opcode::IBV_WR_RDMA_READ
        } else {
            ibv_wr_opcode::IBV_WR_RDMA_WRITE
        };
        self.post(op, wr_id, &mut sge, remote, rkey, signaled)
    }

    fn post(
        &mut self,
        op: ibv_wr_opcode::Type,
        wr_id: u64,
        sge: &mut ibv_sge,
        remote: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), RdmaError> {
        // SAFETY: all-zero is a valid ibv_send_wr.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = sge;
        wr.num_sge = 1;
        wr.opcode = op;
        wr.send_flags = if signaled {
            ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        wr.wr.rdma = rdma_t {
            remote_addr: remote,
            rkey,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live; the sge points into memory registered in this
        // connection's PD and kept alive by its owner until the completion.
        let rc = unsafe { ibv_post_send(self.id.qp(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(RdmaError::WorkRequest(format!(
                "posting a send: {}",
                io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    /// Takes what is ready: channel events (re-arming the CQ), rdma_cm events, and the
    /// completions, appended to `out`.
    ///
    /// # Errors
    /// [`RdmaError::Disconnected`] when the peer disconnected (after the completions
    /// already queued were appended).
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        out.append(&mut self.early);
        let mut events = 0u32;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking.
            if unsafe { ibv_get_cq_event(self.comp.0, &mut cq, &mut ctx) } != 0 {
                break;
            }
            events += 1;
        }
        if events > 0 {
            // SAFETY: acks exactly the events taken above on this CQ.
            unsafe { ibv_ack_cq_events(self.cq.cq, events) };
        }
        self.arm()?;
        loop {
            // SAFETY: self.wc has room for its length of entries.
            let n = unsafe { ibv_poll_cq(self.cq.cq, self.wc.len() as i32, self.wc.as_mut_ptr()) };
            if n < 0 {
                return Err(RdmaError::WorkRequest("polling the CQ failed".into()));
            }
            for wc in &self.wc[..n as usize] {
                let error = (wc.status != ibv_wc_status::IBV_WC_SUCCESS).then(|| {
                    // SAFETY: returns a static string for any status.
                    unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }
                        .to_str()
                        .unwrap_or("unknown work completion error")
                });
                out.push(Completion {
                    wr_id: wc.wr_id,
                    error,
                    recv: wc.wr_id & RECV_BIT != 0,
                    byte_len: wc.byte_len,
                });
            }
            if (n as usize) < self.wc.len() {
                break;
            }
        }
        while let Some((ev, _, _)) = self.events.try_next() {
            if matches!(
                ev,
                rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                    | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL
                    | rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT
            ) {
                self.disconnected = true;
            }
        }
        if self.disconnected {
            return Err(RdmaError::Disconnected);
        }
        Ok(())
    }

    /// Waits until `deadline` for one completion (handshake only: later completions are
    /// taken with [`Self::poll`]).
    fn wait(&mut self, deadline: Instant, what: &'static str) -> Result<Completion, RdmaError> {
        loop {
            // One poll may take several completions (the hello's SEND and the reply's
            // RECV together): the ones not returned yet wait in `early`.
            if self.early.is_empty() {
                let mut out = std::mem::take(&mut self.early);
                let polled = self.poll(&mut out);
                self.early = out;
                polled?;
            }
            if !self.early.is_empty() {
                return Ok(self.early.remove(0));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RdmaError::Timeout { what });
            }
            wait_readable(self.fd(), left);
        }
    }

    /// Waits for the next receive completion until `deadline`, skipping send ones
    /// (the lender's handshake). Returns the buffer index and length.
    ///
    /// # Errors
    /// Timeout, disconnect or a failed completion.
    pub fn wait_recv(
        &mut self,
        deadline: Instant,
        what: &'static str,
    ) -> Result<(usize, usize), RdmaError> {
        loop {
            let c = self.wait(deadline, what)?;
            if let Some(e) = c.error {
                return Err(RdmaError::WorkRequest(e.to_string()));
            }
            if c.recv {
                return Ok(((c.wr_id & !RECV_BIT) as usize, c.byte_len as usize));
            }
        }
    }

    /// Tells the peer the connection is over (it sees a disconnect event).
    pub fn disconnect(&mut self) {
        // SAFETY: live id.
        unsafe { rdma_disconnect(self.id.0) };
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if !self.disconnected {
            self.disconnect();
        }
    }
}

/// The lender's shape: requests (and the hello) in; responses (and the reply) out, plus
/// RDMA READ/WRITE work requests for `io_slots` requests at a time.
pub fn lender_shape(io_slots: usize) -> Shape {
    Shape {
        send: (RECV_DEPTH, MAX_HANDSHAKE_MSG),
        recv: (RECV_DEPTH, MAX_REQUEST_MSG),
        send_wr: RECV_DEPTH + io_slots * (super::MAX_SEGMENTS + 1) + 16,
    }
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

    /// Moves the id to its own event channel, builds the QP, accepts, and waits for the
    /// hello (first message). Returns the connection and the hello's bytes' location.
    ///
    /// # Errors
    /// Resources, a peer that goes away, or a timeout.
    pub fn establish(
        self,
        shape: Shape,
        timeout: Duration,
    ) -> Result<(Connection, usize, usize), RdmaError> {
        let peer = self.peer();
        let events = EventChannel::new()?;
        // SAFETY: both are live; the id's earlier event was acked by the listener.
        if unsafe { rdma_migrate_id(self.0 .0, events.0) } != 0 {
            return Err(resources("an event channel for the connection"));
        }
        let ctx = self.0.verbs();
        let mut c = build(self.0, events, shape, peer.clone())?;
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
            timeout,
            &peer,
            "accepting",
        )?;
        let (i, n) = c.wait_recv(Instant::now() + timeout, "waiting for the hello")?;
        Ok((c, i, n))
    }
}

//! The borrower's fabric session to the lender of a PCIe function: requests answered in
//! order, and interrupts delivered on a channel as they arrive.
//!
//! One reader thread reads every message: replies go to the caller waiting in
//! [`PciLink::call`] (one call at a time), [`KIND_IRQ`] messages to the interrupt channel
//! returned by [`PciLink::connect`]. When the connection ends, both channels close: calls
//! fail with [`LinkError::Closed`] and the interrupt channel's receiver ends.
//!
//! Transports: a TCP (or TLS) stream, or an RDMA connection (rdma_cm; each message one
//! SEND, at most [`devlend_fabric::pci::RDMA_MAX_MESSAGE`] bytes). Over RDMA the
//! borrower registers the guest memory it maps for DMA ([`PciLink::register`]) so that
//! the lender moves mirror pages one-sided.
//!
//! A mediated function (coherence mode `nvme`) has the lender read and write guest
//! memory on its own initiative. Over TCP the reader thread answers [`KIND_MEM_READ`]
//! and applies [`KIND_MEM_WRITE`] through the [`GuestMemory`] given to
//! [`PciLink::connect`], in stream order (a write that comes before an interrupt is in
//! guest memory before the interrupt is queued); over RDMA the lender does both
//! one-sided on the registered DMA maps, and such messages are a protocol error.
//!
//! Why this file is over 600 lines: one `PciLink` carries both transports: the TCP reader,
//! which also serves the lender's guest memory accesses, and the RDMA connection with its
//! reader (`rdma_connect`, `rdma_read_loop`, `close_rdma`, about 100 lines). The RDMA part
//! could move to its own module and is left here for now; the planned reshaping of device
//! kinds into types (issue 21) will split this file.

use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::pci::{
    Irq, MemRead, Message, PciInfo, PciStatus, FEATURE_PCI, FLAG_MORE, KIND_INFO, KIND_IRQ,
    KIND_MEM_READ, KIND_MEM_WRITE, PCI_HEADER_LEN, REPLY,
};
use devlend_fabric::tcp::{self, ConnectError};
use devlend_fabric::tls::TlsTarget;
use devlend_fabric::{Hello, WireError};

/// Why a request to the lender failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The lender refused the request; the session goes on.
    #[error("the lender refused: {status:?}: {reason}")]
    Refused {
        /// The reply's status.
        status: PciStatus,
        /// The lender's reason.
        reason: String,
    },
    /// The connection is gone (closed by either side, or broken).
    #[error("the fabric session is closed")]
    Closed,
    /// Sending failed.
    #[error("sending to the lender")]
    Send(#[source] WireError),
    /// The lender answered with something else than the reply expected.
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// Guest memory as the lender of a mediated function reaches it (see the module doc).
/// Both calls come from the reader thread; each must check that the whole range lies
/// inside the DMA maps.
pub trait GuestMemory: Send + Sync {
    /// Whether the lender may read and write guest memory at all (the function is
    /// mediated); when not, a [`KIND_MEM_READ`] or [`KIND_MEM_WRITE`] ends the session.
    fn mediated(&self) -> bool;
    /// Reads `buf.len()` bytes at `iova`.
    ///
    /// # Errors
    /// The reason, when the range is not inside the DMA maps.
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), String>;
    /// Writes `data` at `iova`.
    ///
    /// # Errors
    /// The reason, when the range is not inside the DMA maps.
    fn write(&self, iova: u64, data: &[u8]) -> Result<(), String>;
}

/// The [`GuestMemory`] of a link with no DMA maps to serve (a function that is not
/// mediated, a test): every lender access to guest memory ends the session.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoGuestMemory;

impl GuestMemory for NoGuestMemory {
    fn mediated(&self) -> bool {
        false
    }

    fn read(&self, iova: u64, _buf: &mut [u8]) -> Result<(), String> {
        Err(format!("no guest memory at {iova:#x}"))
    }

    fn write(&self, iova: u64, _data: &[u8]) -> Result<(), String> {
        Err(format!("no guest memory at {iova:#x}"))
    }
}

/// Fabric traffic of one link, both ways, headers included (bytes).
#[derive(Debug, Default)]
pub struct LinkCounters {
    /// Messages sent to the lender.
    pub msgs_sent: AtomicU64,
    /// Bytes sent to the lender.
    pub bytes_sent: AtomicU64,
    /// Messages received from the lender.
    pub msgs_received: AtomicU64,
    /// Bytes received from the lender.
    pub bytes_received: AtomicU64,
}

impl LinkCounters {
    fn count(n: &AtomicU64, b: &AtomicU64, m: &Message) {
        n.fetch_add(1, Ordering::Relaxed);
        b.fetch_add((PCI_HEADER_LEN + m.payload.len()) as u64, Ordering::Relaxed);
    }
}

/// Where and how to reach the lender.
#[derive(Debug, Clone)]
pub struct LinkTarget {
    /// `HOST:PORT` of the lender.
    pub lender: String,
    /// The device name on the lender.
    pub device: String,
    /// The borrower's identity (random, non-zero): the lender lends the function to one
    /// identity at a time.
    pub borrower: [u8; 16],
    /// The pool's lease token (binary form); empty in direct mode.
    pub token: Vec<u8>,
    /// TLS, or `None` for plain TCP.
    pub tls: Option<TlsTarget>,
    /// Bound on the connect and the handshake.
    pub timeout: Duration,
    /// TCP (with `tls`), or RDMA (rdma_cm to `lender`; `tls` must be `None`).
    pub transport: devlend_fabric::transport::Transport,
    /// The lender's public key, proven in every handshake; `None`: not verified
    /// (as the block target's `lender_key`).
    pub lender_key: Option<devlend_fabric::lease_token::PublicKey>,
}

/// The session's connection.
enum Wire {
    Stream(Stream),
    #[cfg(feature = "rdma")]
    Rdma(Arc<RdmaWire>),
}

/// An RDMA connection shared by the callers and the reader thread.
#[cfg(feature = "rdma")]
struct RdmaWire {
    ch: Mutex<devlend_fabric::rdma::channel::MsgChannel>,
    closed: std::sync::atomic::AtomicBool,
}

/// Guest memory registered for the lender's one-sided access (over RDMA): the memory
/// region is deregistered on drop. Over TCP there is none.
pub struct Registration {
    #[cfg(feature = "rdma")]
    mr: devlend_fabric::rdma::verbs::Mr,
}

impl Registration {
    /// Start address (this process's virtual address) and remote key.
    pub fn remote(&self) -> (u64, u32) {
        #[cfg(feature = "rdma")]
        return (self.mr.addr(), self.mr.rkey());
        #[cfg(not(feature = "rdma"))]
        (0, 0)
    }
}

/// An open PCI session.
pub struct PciLink {
    /// The function as the lender described it in the handshake.
    lent: devlend_fabric::handshake::PciIdentity,
    wire: Wire,
    /// Set when the reader thread ends (the session is over).
    closed: Arc<std::sync::atomic::AtomicBool>,
    write: Arc<Mutex<()>>,
    replies: Mutex<Receiver<Message>>,
    counters: Arc<LinkCounters>,
}

impl std::fmt::Debug for PciLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciLink")
            .field("rdma", &self.is_rdma())
            .finish_non_exhaustive()
    }
}

impl PciLink {
    /// Connects, performs the handshake asking for [`FEATURE_PCI`], starts the reader
    /// (which serves the lender's guest memory accesses from `memory`, over TCP) and
    /// fetches the function's [`PciInfo`].
    ///
    /// # Errors
    /// [`ConnectError`] (including the lender's refusal: `Busy` while another borrower
    /// holds the function), or a failed info request as [`ConnectError::Handshake`].
    pub fn connect(
        t: &LinkTarget,
        memory: Arc<dyn GuestMemory>,
    ) -> Result<(PciLink, PciInfo, Receiver<Irq>), ConnectError> {
        let mut hello = Hello::new(&t.device, 0);
        hello.features = FEATURE_PCI;
        hello.borrower = t.borrower;
        hello.token = t.token.clone();
        if t.lender_key.is_some() {
            hello.ask_proof();
        }
        let bad = |what: &'static str| ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Invalid(what),
        };
        let io = |e: std::io::Error| ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Io(e),
        };
        let (reply_tx, reply_rx) = mpsc::channel();
        let (irq_tx, irq_rx) = mpsc::channel();
        let write = Arc::new(Mutex::new(()));
        let counters = Arc::new(LinkCounters::default());
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // With the lender's description of the function (its address), from the
        // handshake.
        let (wire, lent) = match t.transport {
            devlend_fabric::transport::Transport::Tcp => {
                let (stream, reply) = tcp::open(&t.lender, &hello, t.timeout, t.tls.as_ref())?;
                tcp::check_lender(&t.lender, t.lender_key.as_ref(), &hello, &reply)?;
                let lent = match reply.pci() {
                    Some(pci) if reply.features & FEATURE_PCI != 0 => pci.clone(),
                    _ => return Err(bad("the lender's device is not a PCIe function")),
                };
                let rx = Reader {
                    stream: stream.try_clone().map_err(io)?,
                    write: Arc::clone(&write),
                    memory,
                    counters: Arc::clone(&counters),
                };
                let done = Arc::clone(&closed);
                std::thread::Builder::new()
                    .name("devlend-pci-rx".into())
                    .spawn(move || {
                        read_loop(&rx, reply_tx, irq_tx);
                        done.store(true, Ordering::Release);
                    })
                    .map_err(io)?;
                (Wire::Stream(stream), lent)
            }
            #[cfg(feature = "rdma")]
            devlend_fabric::transport::Transport::Rdma => {
                drop(memory);
                let (wire, device) = rdma_connect(t, &hello)?;
                let reader = Arc::clone(&wire);
                let c = Arc::clone(&counters);
                let done = Arc::clone(&closed);
                std::thread::Builder::new()
                    .name("devlend-pci-rx".into())
                    .spawn(move || {
                        rdma_read_loop(&reader, &reply_tx, &irq_tx, &c);
                        done.store(true, Ordering::Release);
                    })
                    .map_err(io)?;
                (Wire::Rdma(wire), device)
            }
            #[cfg(not(feature = "rdma"))]
            devlend_fabric::transport::Transport::Rdma => {
                drop(memory);
                return Err(ConnectError::Rdma {
                    addr: t.lender.clone(),
                    source: devlend_fabric::rdma::RdmaError::NotCompiled,
                });
            }
        };
        let link = PciLink {
            lent,
            wire,
            closed,
            write,
            replies: Mutex::new(reply_rx),
            counters,
        };
        let info = link
            .call(Message::new(KIND_INFO, Vec::new()))
            .map_err(|e| {
                tracing::warn!(error = %e, "info request failed");
                bad("the lender did not answer the info request")
            })
            .and_then(|r| {
                PciInfo::decode(&r[0].payload).map_err(|source| ConnectError::Handshake {
                    addr: t.lender.clone(),
                    source,
                })
            })?;
        Ok((link, info, irq_rx))
    }

    /// Sends `m` and waits for its answer: one reply, or for a pull the replies up to
    /// the one without [`FLAG_MORE`]. Calls are serialized.
    ///
    /// # Errors
    /// [`LinkError`].
    pub fn call(&self, m: Message) -> Result<Vec<Message>, LinkError> {
        let replies = self.replies.lock().unwrap_or_else(PoisonError::into_inner);
        self.send(&m)?;
        let mut out = Vec::new();
        loop {
            let r = replies.recv().map_err(|_| LinkError::Closed)?;
            if r.kind != m.kind | REPLY {
                return Err(LinkError::Protocol(format!(
                    "reply {:#04x} to request {:#04x}",
                    r.kind, m.kind
                )));
            }
            if r.status != PciStatus::Ok {
                return Err(LinkError::Refused {
                    status: r.status,
                    reason: String::from_utf8_lossy(&r.payload).into_owned(),
                });
            }
            let more = r.flags & FLAG_MORE != 0;
            out.push(r);
            if !more {
                return Ok(out);
            }
        }
    }

    /// Sends `m` expecting no reply (a push message with [`FLAG_MORE`]).
    ///
    /// # Errors
    /// [`LinkError::Send`].
    pub fn send(&self, m: &Message) -> Result<(), LinkError> {
        LinkCounters::count(&self.counters.msgs_sent, &self.counters.bytes_sent, m);
        match &self.wire {
            Wire::Stream(s) => {
                let _g = self.write.lock().unwrap_or_else(PoisonError::into_inner);
                m.write_to(&mut &*s).map_err(LinkError::Send)
            }
            #[cfg(feature = "rdma")]
            Wire::Rdma(w) => {
                if w.closed.load(std::sync::atomic::Ordering::Acquire) {
                    return Err(LinkError::Closed);
                }
                let mut ch = w.ch.lock().unwrap_or_else(PoisonError::into_inner);
                ch.send(m).map_err(|e| rdma_send_err(&e))
            }
        }
    }

    /// The function as the lender described it in the handshake (its address, IDs,
    /// regions and coherence mode; from a version 1 lender, only its address).
    pub fn lent(&self) -> &devlend_fabric::handshake::PciIdentity {
        &self.lent
    }

    /// Whether the session is over (the reader thread ended: closed by either side, or
    /// lost).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The link's traffic so far.
    pub fn counters(&self) -> &LinkCounters {
        &self.counters
    }

    /// Whether the session runs over RDMA (pushes and pulls then carry ranges only).
    pub fn is_rdma(&self) -> bool {
        match &self.wire {
            Wire::Stream(_) => false,
            #[cfg(feature = "rdma")]
            Wire::Rdma(_) => true,
        }
    }

    /// Largest region access in one message, in bytes.
    pub fn max_access(&self) -> u32 {
        if self.is_rdma() {
            devlend_fabric::pci::RDMA_MAX_ACCESS
        } else {
            devlend_fabric::pci::MAX_ACCESS
        }
    }

    /// Over RDMA, registers `len` bytes at `ptr` for the lender's remote READ and WRITE;
    /// over TCP, `None`.
    ///
    /// # Safety
    /// The range must stay mapped for as long as the returned registration lives.
    ///
    /// # Errors
    /// [`LinkError::Send`] when the registration fails (out of RDMA resources).
    pub unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Option<Registration>, LinkError> {
        match &self.wire {
            Wire::Stream(_) => {
                let _ = (ptr, len);
                Ok(None)
            }
            #[cfg(feature = "rdma")]
            Wire::Rdma(w) => {
                let ch = w.ch.lock().unwrap_or_else(PoisonError::into_inner);
                // SAFETY: the caller keeps the range mapped while the registration lives.
                unsafe { devlend_fabric::rdma::verbs::Mr::register(ch.pd(), ptr, len, true) }
                    .map(|mr| Some(Registration { mr }))
                    .map_err(|e| rdma_send_err(&e))
            }
        }
    }

    /// Shuts the connection down both ways: the lender's session ends (and it quiesces
    /// the function), pending and later calls fail.
    pub fn shutdown(&self) {
        match &self.wire {
            Wire::Stream(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            #[cfg(feature = "rdma")]
            Wire::Rdma(w) => close_rdma(w),
        }
    }
}

impl Drop for PciLink {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Opens the RDMA connection and checks the lender's answer.
#[cfg(feature = "rdma")]
fn rdma_connect(
    t: &LinkTarget,
    hello: &Hello,
) -> Result<(Arc<RdmaWire>, devlend_fabric::handshake::PciIdentity), ConnectError> {
    let (conn, reply) =
        devlend_fabric::rdma::verbs::connect(&t.lender, hello, t.timeout).map_err(|source| {
            ConnectError::Rdma {
                addr: t.lender.clone(),
                source,
            }
        })?;
    if reply.status != devlend_fabric::HelloStatus::Ok {
        return Err(ConnectError::Refused {
            addr: t.lender.clone(),
            device: hello.device.clone(),
            status: reply.status,
            message: reply.message,
        });
    }
    tcp::check_lender(&t.lender, t.lender_key.as_ref(), hello, &reply)?;
    let lent = match reply.pci() {
        Some(pci) if reply.features & FEATURE_PCI != 0 => pci.clone(),
        _ => {
            return Err(ConnectError::Handshake {
                addr: t.lender.clone(),
                source: WireError::Invalid("the lender's device is not a PCIe function"),
            })
        }
    };
    Ok((
        Arc::new(RdmaWire {
            ch: Mutex::new(devlend_fabric::rdma::channel::MsgChannel::new(conn)),
            closed: std::sync::atomic::AtomicBool::new(false),
        }),
        lent,
    ))
}

/// The RDMA reader: waits on the connection, takes what arrived, hands it on.
#[cfg(feature = "rdma")]
fn rdma_read_loop(
    w: &RdmaWire,
    replies: &Sender<Message>,
    irqs: &Sender<Irq>,
    counters: &LinkCounters,
) {
    let fd = w.ch.lock().unwrap_or_else(PoisonError::into_inner).fd();
    loop {
        if w.closed.load(Ordering::Acquire) {
            tracing::info!("the PCI session over RDMA is closed");
            return;
        }
        devlend_fabric::rdma::verbs::wait_fd(fd, Duration::from_millis(200));
        let mut got = Vec::new();
        let polled = {
            let mut ch = w.ch.lock().unwrap_or_else(PoisonError::into_inner);
            let r = ch.poll();
            while let Some(m) = ch.take() {
                got.push(m);
            }
            r
        };
        for m in got {
            LinkCounters::count(&counters.msgs_received, &counters.bytes_received, &m);
            if m.kind == KIND_MEM_READ || m.kind == KIND_MEM_WRITE {
                tracing::warn!(
                    kind = m.kind,
                    "guest memory message over RDMA (the lender moves guest memory one-sided); closing the session"
                );
                close_rdma(w);
                return;
            }
            if !dispatch(m, replies, irqs) {
                close_rdma(w);
                return;
            }
        }
        if let Err(e) = polled {
            match e {
                // Our own shutdown flushes the posted receives.
                _ if w.closed.load(Ordering::Acquire) => {
                    tracing::info!("the PCI session over RDMA is closed")
                }
                devlend_fabric::rdma::channel::ChannelError::Rdma(
                    devlend_fabric::rdma::RdmaError::Disconnected,
                ) => tracing::info!("the lender closed the PCI session"),
                e => {
                    tracing::warn!(error = %devlend_fabric::error::chain(&e), "PCI session lost")
                }
            }
            close_rdma(w);
            return;
        }
    }
}

/// An RDMA failure of a send or a registration, as [`LinkError::Send`].
#[cfg(feature = "rdma")]
fn rdma_send_err(e: &dyn std::error::Error) -> LinkError {
    LinkError::Send(WireError::Io(std::io::Error::other(
        devlend_fabric::error::chain(e),
    )))
}

/// Marks the connection closed and disconnects it, once.
#[cfg(feature = "rdma")]
fn close_rdma(w: &RdmaWire) {
    if !w.closed.swap(true, std::sync::atomic::Ordering::AcqRel) {
        w.ch.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .disconnect();
    }
}

/// Hands one message from the lender on; `false` when the session must close.
fn dispatch(m: Message, replies: &Sender<Message>, irqs: &Sender<Irq>) -> bool {
    if m.kind == KIND_IRQ {
        match Irq::decode(&m.payload) {
            Ok(irq) => {
                let _ = irqs.send(irq);
                true
            }
            Err(e) => {
                devlend_fabric::limited!(warn, error = %e, "malformed interrupt message; closing the session");
                false
            }
        }
    } else if m.kind & REPLY == 0 {
        tracing::warn!(
            kind = m.kind,
            "request from the lender; closing the session"
        );
        false
    } else {
        replies.send(m).is_ok()
    }
}

/// What the reader thread holds.
struct Reader {
    stream: Stream,
    /// The link's write lock: a reply to [`KIND_MEM_READ`] is sent under it.
    write: Arc<Mutex<()>>,
    memory: Arc<dyn GuestMemory>,
    counters: Arc<LinkCounters>,
}

impl Reader {
    /// Serves one guest memory access of the lender; `Err` (the reason) ends the
    /// session.
    fn memory(&self, m: &Message) -> Result<(), String> {
        if !self.memory.mediated() {
            return Err(format!(
                "guest memory access {:#04x} from the lender of a function that is not mediated",
                m.kind
            ));
        }
        if m.flags != 0 {
            return Err("flags on a guest memory access".into());
        }
        if m.kind == KIND_MEM_WRITE {
            let pages = devlend_fabric::pci::decode_pages(&m.payload).map_err(|e| e.to_string())?;
            for p in pages {
                self.memory.write(p.iova, p.data)?;
            }
            return Ok(());
        }
        let r = MemRead::decode(&m.payload).map_err(|e| e.to_string())?;
        let mut buf = vec![0u8; r.len as usize];
        let reply = match self.memory.read(r.iova, &mut buf) {
            Ok(()) => Message::new(KIND_MEM_READ | REPLY, buf),
            Err(reason) => {
                devlend_fabric::limited!(warn, %reason, "guest memory read by the lender refused");
                Message::refusal(KIND_MEM_READ, PciStatus::Invalid, &reason)
            }
        };
        let _g = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        LinkCounters::count(&self.counters.msgs_sent, &self.counters.bytes_sent, &reply);
        reply
            .write_to(&mut &self.stream)
            .map_err(|e| format!("sending guest memory: {e}"))
    }
}

fn read_loop(rx: &Reader, replies: Sender<Message>, irqs: Sender<Irq>) {
    let stream = &rx.stream;
    loop {
        let m = match Message::read_from(&mut &*stream) {
            Ok(m) => m,
            Err(WireError::Closed) => {
                tracing::info!("the lender closed the PCI session");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %devlend_fabric::error::chain(&e), "PCI session lost");
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
        };
        LinkCounters::count(&rx.counters.msgs_received, &rx.counters.bytes_received, &m);
        if m.kind == KIND_MEM_READ || m.kind == KIND_MEM_WRITE {
            if let Err(reason) = rx.memory(&m) {
                devlend_fabric::limited!(warn, %reason, "bad guest memory access by the lender; closing the session");
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
            continue;
        }
        if !dispatch(m, &replies, &irqs) {
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    }
}

//! The borrower's fabric session to the lender of a PCIe function: requests answered in
//! order, and interrupts delivered on a channel as they arrive.
//!
//! One reader thread reads every message: replies go to the caller waiting in
//! [`PciLink::call`] (one call at a time), [`KIND_IRQ`] messages to the interrupt channel
//! returned by [`PciLink::connect`], and the lender's DMA counters ([`KIND_COUNTERS`],
//! asked for with [`FEATURE_PCI_COUNTERS`]) into the link's [`PciStats`] (`notes`).
//! When the connection ends, both channels close: calls fail with [`LinkError::Closed`]
//! and the interrupt channel's receiver ends.
//!
//! Transports: a TCP (or TLS) stream, or an RDMA connection (rdma_cm; each message one
//! SEND, at most [`devlend_fabric::pci::RDMA_MAX_MESSAGE`] bytes). Over RDMA the
//! borrower registers the guest memory it maps for DMA ([`PciLink::register`]) so that
//! the lender moves mirror pages one-sided.
//!
//! A mediated function (coherence mode `nvme`) has the lender read and write guest
//! memory on its own initiative. Over TCP the reader thread answers
//! [`devlend_fabric::pci::KIND_MEM_READ`] and applies
//! [`devlend_fabric::pci::KIND_MEM_WRITE`] through the [`GuestMemory`] given to
//! [`PciLink::connect`], in stream order (a write that comes before an interrupt is in
//! guest memory before the interrupt is queued); over RDMA the lender does both
//! one-sided on the registered DMA maps, and such messages are a protocol error.
//!
//! Each transport is a [`PciWire`]: `tcp` (the stream and its reader) and `rdma`
//! (the connection and its reader); tests use an in-memory one.

mod notes;
#[cfg(feature = "rdma")]
mod rdma;
mod tcp;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use devlend_fabric::pci::{
    DmaCounters, Irq, Message, PciInfo, PciStatus, FEATURE_PCI, FEATURE_PCI_COUNTERS, FLAG_MORE,
    KIND_COUNTERS, KIND_INFO, KIND_IRQ, PCI_HEADER_LEN, REPLY,
};
use devlend_fabric::tcp::ConnectError;
use devlend_fabric::tls::TlsTarget;
use devlend_fabric::{Hello, WireError};

pub(crate) use notes::CounterNotes;

use super::PciStats;

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
    /// mediated); when not, a `KIND_MEM_READ` or `KIND_MEM_WRITE` ends the session.
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
    /// The key the token names as its holder (as the block target's `holder`).
    pub holder: Option<devlend_fabric::holder_proof::HolderKey>,
}

/// How the pages of a mirror cross a transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageMoves {
    /// In the messages, with their bytes (TCP).
    Bytes,
    /// One-sided by the lender on registered memory; the messages name IOVA ranges
    /// (RDMA).
    Ranges,
}

/// One transport of a PCI session: how messages go to the lender. What comes back is
/// read by the transport's own reader thread, which hands replies and interrupts on
/// (`dispatch`) and marks the session closed when it ends.
pub trait PciWire: Send + Sync {
    /// Sends one message.
    ///
    /// # Errors
    /// [`LinkError::Send`], or [`LinkError::Closed`] once the session is over.
    fn send(&self, m: &Message) -> Result<(), LinkError>;
    /// Shuts the connection down both ways (the reader then ends).
    fn shutdown(&self);
    /// Largest region access in one message, in bytes.
    fn max_access(&self) -> u32;
    /// How mirror pages cross this transport: as bytes in messages unless it says
    /// otherwise.
    fn page_moves(&self) -> PageMoves {
        PageMoves::Bytes
    }
    /// Registers `len` bytes at `ptr` for the lender's one-sided access, when the
    /// transport has any; `None` otherwise (the default: a transport without one-sided
    /// access).
    ///
    /// # Safety
    /// The range must stay mapped for as long as the returned registration lives.
    ///
    /// # Errors
    /// [`LinkError::Send`] when the registration fails.
    unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Option<Registration>, LinkError> {
        let _ = (ptr, len);
        Ok(None)
    }
    /// The transport's name, for debugging.
    fn name(&self) -> &'static str;
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
    wire: Box<dyn PciWire>,
    /// Set when the reader thread ends (the session is over).
    closed: Arc<AtomicBool>,
    replies: Mutex<Receiver<Message>>,
    counters: Arc<LinkCounters>,
    /// The function's counters: the reader adds the lender's DMA counters to them.
    stats: Arc<PciStats>,
}

impl std::fmt::Debug for PciLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciLink")
            .field("wire", &self.wire.name())
            .finish_non_exhaustive()
    }
}

impl PciLink {
    /// Connects, performs the handshake asking for [`FEATURE_PCI`] and
    /// [`FEATURE_PCI_COUNTERS`], starts the reader (which serves the lender's guest memory
    /// accesses from `memory`, over TCP, and adds its DMA counters to [`Self::stats`])
    /// and fetches the function's [`PciInfo`].
    ///
    /// # Errors
    /// [`ConnectError`] (including the lender's refusal: `Busy` while another borrower
    /// holds the function), or a failed info request as [`ConnectError::Handshake`].
    pub fn connect(
        t: &LinkTarget,
        memory: Arc<dyn GuestMemory>,
    ) -> Result<(PciLink, PciInfo, Receiver<Irq>), ConnectError> {
        let mut hello = Hello::new(&t.device, 0);
        hello.features = FEATURE_PCI | FEATURE_PCI_COUNTERS;
        hello.borrower = t.borrower;
        hello.token = t.token.clone();
        if let Some(k) = &t.lender_key {
            hello.ask_proof_of(k);
        }
        hello.holder = crate::lender::target::holder(&t.token, t.holder.as_ref(), t.lender_key);
        let bad = |what: &'static str| ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Invalid(what),
        };
        let (reply_tx, reply_rx) = mpsc::channel();
        let (irq_tx, irq_rx) = mpsc::channel();
        let counters = Arc::new(LinkCounters::default());
        let closed = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(PciStats::default());
        // With the lender's description of the function (its address), from the
        // handshake.
        let (wire, lent) = match t.transport {
            devlend_fabric::transport::Transport::Tcp => tcp::open(
                t, &hello, memory, reply_tx, irq_tx, &counters, &stats, &closed,
            )?,
            #[cfg(feature = "rdma")]
            devlend_fabric::transport::Transport::Rdma => {
                drop(memory);
                rdma::open(t, &hello, reply_tx, irq_tx, &counters, &stats, &closed)?
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
        let link = PciLink::over(wire, lent, reply_rx, closed, counters, stats);
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

    /// A session over `wire`, whose reader hands replies on to `replies`, adds the
    /// lender's DMA counters to `stats` and sets `closed` when it ends.
    pub(crate) fn over(
        wire: Box<dyn PciWire>,
        lent: devlend_fabric::handshake::PciIdentity,
        replies: Receiver<Message>,
        closed: Arc<AtomicBool>,
        counters: Arc<LinkCounters>,
        stats: Arc<PciStats>,
    ) -> PciLink {
        PciLink {
            lent,
            wire,
            closed,
            replies: Mutex::new(replies),
            counters,
            stats,
        }
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
        self.wire.send(m)
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

    /// The function's counters. The link itself adds what the lender's DMA counters
    /// notes say ([`PciStats::lender_guest_read_bytes`],
    /// [`PciStats::lender_guest_written_bytes`], [`PciStats::peer_bytes`]); a
    /// [`super::PciBorrower`] served over the link counts the rest in them.
    pub fn stats(&self) -> &PciStats {
        &self.stats
    }

    /// The counters, shared (with the borrower served over the link).
    pub(crate) fn shared_stats(&self) -> Arc<PciStats> {
        Arc::clone(&self.stats)
    }

    /// How mirror pages cross the session: with their bytes (TCP), or as ranges the
    /// lender moves one-sided (RDMA).
    pub fn page_moves(&self) -> PageMoves {
        self.wire.page_moves()
    }

    /// Largest region access in one message, in bytes.
    pub fn max_access(&self) -> u32 {
        self.wire.max_access()
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
        // SAFETY: the caller keeps the range mapped while the registration lives.
        unsafe { self.wire.register(ptr, len) }
    }

    /// Shuts the connection down both ways: the lender's session ends (and it quiesces
    /// the function), pending and later calls fail.
    pub fn shutdown(&self) {
        self.wire.shutdown();
    }
}

impl Drop for PciLink {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The function the lender describes in its answer to `hello`, after checking the
/// lender's proof; an answer without a PCIe function fails the handshake.
pub(crate) fn lent_function(
    t: &LinkTarget,
    hello: &Hello,
    reply: &devlend_fabric::HelloReply,
) -> Result<devlend_fabric::handshake::PciIdentity, ConnectError> {
    devlend_fabric::tcp::check_lender(&t.lender, t.lender_key.as_ref(), hello, reply)?;
    match reply.pci() {
        Some(pci) if reply.features & devlend_fabric::pci::FEATURE_PCI != 0 => Ok(pci.clone()),
        _ => Err(ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Invalid("the lender's device is not a PCIe function"),
        }),
    }
}

/// The DMA counters notes of the session the lender answered `hello` with `reply`: it
/// sends them only when both asked for and granted [`FEATURE_PCI_COUNTERS`].
pub(crate) fn counter_notes(
    hello: &Hello,
    reply: &devlend_fabric::HelloReply,
    stats: &Arc<PciStats>,
) -> CounterNotes {
    let granted = hello.features & reply.features & FEATURE_PCI_COUNTERS != 0;
    CounterNotes::new(granted, Arc::clone(stats))
}

/// Hands one message from the lender on; `false` when the session must close.
pub(crate) fn dispatch(
    m: Message,
    replies: &Sender<Message>,
    irqs: &Sender<Irq>,
    notes: &CounterNotes,
) -> bool {
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
    } else if m.kind == KIND_COUNTERS && notes.granted() {
        match DmaCounters::decode(&m.payload) {
            Ok(c) => {
                notes.add(c);
                true
            }
            Err(e) => {
                devlend_fabric::limited!(warn, error = %e, "malformed DMA counters note; closing the session");
                false
            }
        }
    } else if m.kind & REPLY == 0 {
        // A counters note the handshake did not grant is one of these too.
        devlend_fabric::limited!(
            warn,
            kind = m.kind,
            "request from the lender; closing the session"
        );
        false
    } else {
        replies.send(m).is_ok()
    }
}

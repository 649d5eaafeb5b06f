//! The borrower's fabric session to the lender of a PCIe function: requests answered in
//! order, and interrupts delivered on a channel as they arrive.
//!
//! One reader thread reads every message: replies go to the caller waiting in
//! [`Link::call`] (one call at a time), [`KIND_IRQ`] messages to the interrupt channel
//! returned by [`Link::connect`]. When the connection ends, both channels close: calls
//! fail with [`LinkError::Closed`] and the interrupt channel's receiver ends.
//!
//! A mediated function (coherence mode `nvme`) has the lender read and write guest
//! memory on its own initiative: the reader thread answers [`KIND_MEM_READ`] and applies
//! [`KIND_MEM_WRITE`] through the [`GuestMemory`] given to [`Link::connect`], in stream
//! order (a write that comes before an interrupt is in guest memory before the
//! interrupt is queued).

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
}

/// An open PCI session.
#[derive(Debug)]
pub struct Link {
    stream: Stream,
    write: Arc<Mutex<()>>,
    replies: Mutex<Receiver<Message>>,
    counters: Arc<LinkCounters>,
}

impl Link {
    /// Connects, performs the handshake asking for [`FEATURE_PCI`], starts the reader
    /// (which serves the lender's guest memory accesses from `memory`) and fetches the
    /// function's [`PciInfo`].
    ///
    /// # Errors
    /// [`ConnectError`] (including the lender's refusal: `Busy` while another borrower
    /// holds the function), or a failed info request as [`ConnectError::Handshake`].
    pub fn connect(
        t: &LinkTarget,
        memory: Arc<dyn GuestMemory>,
    ) -> Result<(Link, PciInfo, Receiver<Irq>), ConnectError> {
        let mut hello = Hello::new(&t.device, 0);
        hello.features = FEATURE_PCI;
        hello.borrower = t.borrower;
        hello.token = t.token.clone();
        let (stream, reply) = tcp::open(&t.lender, &hello, t.timeout, t.tls.as_ref())?;
        let bad = |what: &'static str| ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Invalid(what),
        };
        if !reply.device.is_pci() || reply.features & FEATURE_PCI == 0 {
            return Err(bad("the lender's device is not a PCIe function"));
        }
        let io = |e: std::io::Error| ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Io(e),
        };
        let reader = stream.try_clone().map_err(io)?;
        let (reply_tx, reply_rx) = mpsc::channel();
        let (irq_tx, irq_rx) = mpsc::channel();
        let write = Arc::new(Mutex::new(()));
        let counters = Arc::new(LinkCounters::default());
        let rx = Reader {
            stream: reader,
            write: Arc::clone(&write),
            memory,
            counters: Arc::clone(&counters),
        };
        std::thread::Builder::new()
            .name("devlend-pci-rx".into())
            .spawn(move || read_loop(&rx, reply_tx, irq_tx))
            .map_err(io)?;
        let link = Link {
            stream,
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
        let _g = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        LinkCounters::count(&self.counters.msgs_sent, &self.counters.bytes_sent, m);
        m.write_to(&mut &self.stream).map_err(LinkError::Send)
    }

    /// The link's traffic so far.
    pub fn counters(&self) -> &LinkCounters {
        &self.counters
    }

    /// Shuts the connection down both ways: the lender's session ends (and it quiesces
    /// the function), pending and later calls fail.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.shutdown();
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
                tracing::warn!(%reason, "guest memory read by the lender refused");
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
                tracing::warn!(%reason, "bad guest memory access by the lender; closing the session");
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
        } else if m.kind == KIND_IRQ {
            match Irq::decode(&m.payload) {
                Ok(irq) => {
                    let _ = irqs.send(irq);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "malformed interrupt message; closing the session");
                    let _ = stream.shutdown(Shutdown::Both);
                    return;
                }
            }
        } else if m.kind & REPLY == 0 {
            tracing::warn!(
                kind = m.kind,
                "request from the lender; closing the session"
            );
            let _ = stream.shutdown(Shutdown::Both);
            return;
        } else if replies.send(m).is_err() {
            return;
        }
    }
}

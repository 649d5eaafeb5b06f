//! The PCI session over RDMA (rdma_cm; each message one SEND): the [`PciWire`] that
//! sends on the connection and registers guest memory for the lender's one-sided
//! access, and the reader thread (which adds up the lender's DMA counters notes).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use devlend_fabric::pci::{Irq, Message, KIND_MEM_READ, KIND_MEM_WRITE};
use devlend_fabric::tcp::ConnectError;
use devlend_fabric::{Hello, WireError};

use super::{
    counter_notes, dispatch, CounterNotes, LinkCounters, LinkError, LinkTarget, PageMoves,
    PciStats, PciWire, Registration,
};

/// An RDMA connection shared by the callers and the reader thread.
struct RdmaWire {
    ch: Mutex<devlend_fabric::rdma::channel::MsgChannel>,
    closed: AtomicBool,
}

impl PciWire for Arc<RdmaWire> {
    fn send(&self, m: &Message) -> Result<(), LinkError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(LinkError::Closed);
        }
        let mut ch = self.ch.lock().unwrap_or_else(PoisonError::into_inner);
        ch.send(m).map_err(|e| rdma_send_err(&e))
    }

    fn shutdown(&self) {
        close_rdma(self);
    }

    fn max_access(&self) -> u32 {
        devlend_fabric::pci::RDMA_MAX_ACCESS
    }

    fn page_moves(&self) -> PageMoves {
        PageMoves::Ranges
    }

    unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Option<Registration>, LinkError> {
        let ch = self.ch.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the caller keeps the range mapped while the registration lives.
        unsafe { devlend_fabric::rdma::verbs::Mr::register(ch.pd(), ptr, len, true) }
            .map(|mr| Some(Registration { mr }))
            .map_err(|e| rdma_send_err(&e))
    }

    fn name(&self) -> &'static str {
        "rdma"
    }
}

/// Opens the RDMA connection, checks the lender's answer and starts the reader thread,
/// which hands replies and interrupts on, adds the lender's DMA counters to `stats` and
/// sets `closed` when it ends.
pub(super) fn open(
    t: &LinkTarget,
    hello: &Hello,
    replies: Sender<Message>,
    irqs: Sender<Irq>,
    counters: &Arc<LinkCounters>,
    stats: &Arc<PciStats>,
    closed: &Arc<AtomicBool>,
) -> Result<(Box<dyn PciWire>, devlend_fabric::handshake::PciIdentity), ConnectError> {
    let (wire, lent, notes) = rdma_connect(t, hello, stats)?;
    let reader = Arc::clone(&wire);
    let c = Arc::clone(counters);
    let done = Arc::clone(closed);
    std::thread::Builder::new()
        .name("devlend-pci-rx".into())
        .spawn(move || {
            rdma_read_loop(&reader, &replies, &irqs, &c, &notes);
            done.store(true, Ordering::Release);
        })
        .map_err(|e| ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Io(e),
        })?;
    Ok((Box::new(wire), lent))
}

/// What [`rdma_connect`] opens: the connection, the function the lender describes, and
/// the session's DMA counters notes.
type Opened = (
    Arc<RdmaWire>,
    devlend_fabric::handshake::PciIdentity,
    CounterNotes,
);

/// Opens the RDMA connection and checks the lender's answer.
fn rdma_connect(
    t: &LinkTarget,
    hello: &Hello,
    stats: &Arc<PciStats>,
) -> Result<Opened, ConnectError> {
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
    let lent = super::lent_function(t, hello, &reply)?;
    let notes = counter_notes(hello, &reply, stats);
    Ok((
        Arc::new(RdmaWire {
            ch: Mutex::new(devlend_fabric::rdma::channel::MsgChannel::new(conn)),
            closed: AtomicBool::new(false),
        }),
        lent,
        notes,
    ))
}

/// The RDMA reader: waits on the connection, takes what arrived, hands it on.
fn rdma_read_loop(
    w: &RdmaWire,
    replies: &Sender<Message>,
    irqs: &Sender<Irq>,
    counters: &LinkCounters,
    notes: &CounterNotes,
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
            if !dispatch(m, replies, irqs, notes) {
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
fn rdma_send_err(e: &dyn std::error::Error) -> LinkError {
    LinkError::Send(WireError::Io(std::io::Error::other(
        devlend_fabric::error::chain(e),
    )))
}

/// Marks the connection closed and disconnects it, once.
fn close_rdma(w: &RdmaWire) {
    if !w.closed.swap(true, Ordering::AcqRel) {
        w.ch.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .disconnect();
    }
}

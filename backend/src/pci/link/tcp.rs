//! The PCI session over a TCP (or TLS) stream: the [`PciWire`] that writes messages on
//! the stream, and the reader thread, which also serves a mediated function's lender
//! its guest memory accesses and adds up its DMA counters notes.

use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};

use devlend_fabric::conn::Stream;
use devlend_fabric::pci::{Irq, MemRead, Message, PciStatus, KIND_MEM_READ, KIND_MEM_WRITE, REPLY};
use devlend_fabric::tcp::{self, ConnectError};
use devlend_fabric::{Hello, WireError};

use super::{
    counter_notes, dispatch, CounterNotes, GuestMemory, LinkCounters, LinkError, LinkTarget,
    PciStats, PciWire,
};

/// The stream, and the lock its writers take.
struct TcpWire {
    stream: Stream,
    write: Arc<Mutex<()>>,
}

impl PciWire for TcpWire {
    fn send(&self, m: &Message) -> Result<(), LinkError> {
        let _g = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        m.write_to(&mut &self.stream).map_err(LinkError::Send)
    }

    fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn max_access(&self) -> u32 {
        devlend_fabric::pci::MAX_ACCESS
    }

    fn name(&self) -> &'static str {
        "tcp"
    }
}

/// Opens the stream, checks the lender's answer and starts the reader thread, which
/// hands replies and interrupts on, adds the lender's DMA counters to `stats` and sets
/// `closed` when it ends.
#[allow(clippy::too_many_arguments)] // What the reader thread is given, one by one.
pub(super) fn open(
    t: &LinkTarget,
    hello: &Hello,
    memory: Arc<dyn GuestMemory>,
    replies: Sender<Message>,
    irqs: Sender<Irq>,
    counters: &Arc<LinkCounters>,
    stats: &Arc<PciStats>,
    closed: &Arc<AtomicBool>,
) -> Result<(Box<dyn PciWire>, devlend_fabric::handshake::PciIdentity), ConnectError> {
    let io = |e: std::io::Error| ConnectError::Handshake {
        addr: t.lender.clone(),
        source: WireError::Io(e),
    };
    let (stream, reply) = tcp::open(&t.lender, hello, t.timeout, t.tls.as_ref())?;
    let lent = super::lent_function(t, hello, &reply)?;
    let write = Arc::new(Mutex::new(()));
    let rx = Reader {
        stream: stream.try_clone().map_err(io)?,
        write: Arc::clone(&write),
        memory,
        counters: Arc::clone(counters),
        notes: counter_notes(hello, &reply, stats),
    };
    let done = Arc::clone(closed);
    std::thread::Builder::new()
        .name("devlend-pci-rx".into())
        .spawn(move || {
            read_loop(&rx, replies, irqs);
            done.store(true, Ordering::Release);
        })
        .map_err(io)?;
    Ok((Box::new(TcpWire { stream, write }), lent))
}

/// What the reader thread holds.
struct Reader {
    stream: Stream,
    /// The link's write lock: a reply to [`KIND_MEM_READ`] is sent under it.
    write: Arc<Mutex<()>>,
    memory: Arc<dyn GuestMemory>,
    counters: Arc<LinkCounters>,
    /// The session's DMA counters notes.
    notes: CounterNotes,
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
        if !dispatch(m, &replies, &irqs, &rx.notes) {
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    }
}

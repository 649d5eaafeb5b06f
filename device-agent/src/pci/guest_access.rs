//! The lender's own access to the borrower's guest memory, for a mediated function
//! (coherence mode `nvme`): reads that the borrower answers from its DMA maps, writes
//! it applies in stream order, and interrupts sent after them.
//!
//! [`GuestAccess`] is what a mediator uses; [`TcpGuest`] implements it over the PCI
//! session's TCP stream ([`KIND_MEM_READ`], [`KIND_MEM_WRITE`], [`KIND_IRQ`]). An RDMA
//! implementation (one-sided READ and WRITE on the memory regions the borrower
//! registers with its DMA maps) plugs in behind the same trait.

use std::io::Read;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::pci::{
    encode_page, page_cost, Irq, MemRead, Message, PciStatus, KIND_IRQ, KIND_MEM_READ,
    KIND_MEM_WRITE, MAX_ACCESS, PCI_HEADER_LEN, REPLY,
};
use devlend_fabric::WireError;

/// Why a guest memory access failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GuestError {
    /// The borrower refused the read (the range is not inside its DMA maps).
    #[error("the borrower refused the guest memory read: {0}")]
    Refused(String),
    /// This access cannot read (the interrupt thread only writes).
    #[error("guest memory cannot be read from this thread")]
    NoRead,
    /// The fabric failed.
    #[error("fabric")]
    Wire(#[source] WireError),
    /// The borrower answered with something else than the reply expected.
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// Guest memory as the lender reaches it; IOVAs are the borrower's DMA addresses.
pub(crate) trait GuestAccess {
    /// Reads `buf.len()` bytes at `iova`.
    ///
    /// # Errors
    /// [`GuestError`].
    fn read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), GuestError>;

    /// Writes each `(iova, bytes)` in order.
    ///
    /// # Errors
    /// [`GuestError`].
    fn write(&mut self, pages: &[(u64, &[u8])]) -> Result<(), GuestError>;

    /// Raises the guest's interrupt `vector` (of whichever index the borrower enabled),
    /// after every write made before it.
    ///
    /// # Errors
    /// [`GuestError`].
    fn interrupt(&mut self, vector: u32) -> Result<(), GuestError>;
}

/// Fabric traffic of the lender's guest memory accesses (messages and bytes, headers
/// included), for `docs/performance.md`.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct AccessCounters {
    /// Read requests sent and replies received.
    pub(crate) reads: u64,
    /// Bytes of read requests and replies.
    pub(crate) read_bytes: u64,
    /// Write messages sent.
    pub(crate) writes: u64,
    /// Bytes of write messages.
    pub(crate) write_bytes: u64,
    /// Interrupt messages sent.
    pub(crate) irqs: u64,
}

/// [`GuestAccess`] over the PCI session's TCP stream.
pub(crate) struct TcpGuest<'a> {
    /// The session's stream.
    pub(crate) sock: &'a Stream,
    /// The session's write lock (messages never interleave).
    pub(crate) writer: &'a Mutex<()>,
    /// How long a read's reply may take.
    pub(crate) timeout: Duration,
    /// Whether this thread reads the stream (the session's request loop) and may
    /// therefore read guest memory.
    pub(crate) can_read: bool,
    /// The interrupt index the borrower enabled for a vector, if any.
    pub(crate) index_of: &'a dyn Fn(u32) -> Option<u32>,
    /// Traffic, added to.
    pub(crate) counters: &'a Mutex<AccessCounters>,
    /// Set to the reason when the borrower broke the protocol (an unexpected message
    /// while waiting for guest memory): the session must end.
    pub(crate) broken: &'a Mutex<Option<String>>,
}

impl TcpGuest<'_> {
    fn send(&self, m: &Message) -> Result<(), GuestError> {
        let _g = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        m.write_to(&mut &*self.sock).map_err(GuestError::Wire)
    }

    fn protocol(&self, reason: String) -> GuestError {
        let mut b = self.broken.lock().unwrap_or_else(PoisonError::into_inner);
        if b.is_none() {
            *b = Some(reason.clone());
        }
        GuestError::Protocol(reason)
    }

    fn count(&self, f: impl FnOnce(&mut AccessCounters)) {
        f(&mut self.counters.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

impl GuestAccess for TcpGuest<'_> {
    fn read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), GuestError> {
        if !self.can_read {
            return Err(GuestError::NoRead);
        }
        for (i, chunk) in buf.chunks_mut(MAX_ACCESS as usize).enumerate() {
            let r = MemRead {
                iova: iova + (i * MAX_ACCESS as usize) as u64,
                len: chunk.len() as u32,
            };
            self.send(&Message::new(KIND_MEM_READ, r.encode()))?;
            self.sock
                .set_read_timeout(Some(self.timeout))
                .map_err(|e| GuestError::Wire(WireError::Io(e)))?;
            let m = Message::read_from(&mut (&*self.sock).by_ref());
            let _ = self.sock.set_read_timeout(None);
            let m = m.map_err(|e| self.protocol(format!("reading guest memory: {e}")))?;
            self.count(|c| {
                c.reads += 1;
                c.read_bytes += (2 * PCI_HEADER_LEN + 16 + m.payload.len()) as u64;
            });
            if m.kind != KIND_MEM_READ | REPLY {
                return Err(self.protocol(format!(
                    "message {:#04x} while waiting for guest memory",
                    m.kind
                )));
            }
            if m.status != PciStatus::Ok {
                return Err(GuestError::Refused(
                    String::from_utf8_lossy(&m.payload).into_owned(),
                ));
            }
            if m.payload.len() != chunk.len() || m.flags != 0 {
                return Err(self.protocol(format!(
                    "{} bytes of guest memory for {} asked",
                    m.payload.len(),
                    chunk.len()
                )));
            }
            chunk.copy_from_slice(&m.payload);
        }
        Ok(())
    }

    fn write(&mut self, pages: &[(u64, &[u8])]) -> Result<(), GuestError> {
        let mut payload = Vec::new();
        let flush = |payload: &mut Vec<u8>| -> Result<(), GuestError> {
            if payload.is_empty() {
                return Ok(());
            }
            let m = Message::new(KIND_MEM_WRITE, std::mem::take(payload));
            self.count(|c| {
                c.writes += 1;
                c.write_bytes += (PCI_HEADER_LEN + m.payload.len()) as u64;
            });
            self.send(&m)
        };
        for (iova, data) in pages {
            for (i, chunk) in data.chunks(MAX_ACCESS as usize).enumerate() {
                if payload.len() + page_cost(chunk.len()) > MAX_ACCESS as usize {
                    flush(&mut payload)?;
                }
                encode_page(iova + (i * MAX_ACCESS as usize) as u64, chunk, &mut payload);
            }
        }
        flush(&mut payload)
    }

    fn interrupt(&mut self, vector: u32) -> Result<(), GuestError> {
        let Some(index) = (self.index_of)(vector) else {
            tracing::debug!(vector, "no interrupt enabled for the vector; not raised");
            return Ok(());
        };
        self.count(|c| c.irqs += 1);
        self.send(&Message::new(KIND_IRQ, Irq { index, vector }.encode()))
    }
}

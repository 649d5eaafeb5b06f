//! Guest memory over the PCI session's TCP stream: [`TcpGuest`] (reads answered by the
//! borrower from its DMA maps, writes it applies in stream order, interrupts after
//! them), and [`TcpMediated`], the NVMe mediator of a TCP session with what it needs to
//! build one.

use std::io::Read;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::pci::{
    encode_page, page_cost, DmaCounters, Irq, MemRead, Message, PciStatus, KIND_COUNTERS, KIND_IRQ,
    KIND_MEM_READ, KIND_MEM_WRITE, MAX_ACCESS, PCI_HEADER_LEN, REPLY,
};
use devlend_fabric::WireError;

use super::{AccessCounters, GuestAccess, GuestError};
use crate::pci::irq::IrqTable;
use crate::pci::nvme::Mediator;

/// The mediator of a session in coherence mode `nvme`, and what it needs to reach guest
/// memory over the session's stream.
pub(crate) struct TcpMediated<'a> {
    pub(crate) mediator: Mutex<Mediator>,
    pub(crate) counters: Mutex<AccessCounters>,
    /// Why the borrower broke the protocol during a guest memory read, if it did.
    pub(crate) broken: Mutex<Option<String>>,
    pub(crate) sock: &'a Stream,
    pub(crate) writer: &'a Mutex<()>,
    pub(crate) timeout: Duration,
    /// Whether the holder's limits apply (the request loop then asks the mediator when
    /// to fetch what they held back; otherwise it never needs to).
    pub(crate) throttled: bool,
}

impl TcpMediated<'_> {
    /// Runs `op` on the mediator with guest access from the request loop (`can_read`)
    /// or the interrupt thread, which raises interrupts of the vectors in `table`.
    pub(crate) fn with<T>(
        &self,
        table: &IrqTable,
        can_read: bool,
        op: impl FnOnce(&mut Mediator, &mut TcpGuest<'_>) -> T,
    ) -> T {
        let index_of = |v: u32| table.index_of(v);
        let mut g = TcpGuest {
            sock: self.sock,
            writer: self.writer,
            timeout: self.timeout,
            can_read,
            index_of: &index_of,
            counters: &self.counters,
            broken: &self.broken,
        };
        let mut m = self.mediator.lock().unwrap_or_else(PoisonError::into_inner);
        op(&mut m, &mut g)
    }
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

    fn counters(&mut self, c: &DmaCounters) -> Result<(), GuestError> {
        self.send(&Message::new(KIND_COUNTERS, c.encode()))
    }
}

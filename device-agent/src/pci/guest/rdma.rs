//! [`GuestAccess`] over RDMA, for a mediated function (coherence mode `nvme`) lent on
//! an RDMA session: the mediator's reads of guest memory (submission entries, PRP
//! lists, data the controller will read) are one-sided RDMA READs, its writes (data the
//! controller wrote, completion entries) RDMA WRITEs, each on the memory region the
//! borrower registered with the DMA map that holds the range ([`RemoteMap`]); the
//! guest's interrupt is a [`KIND_IRQ`] message sent after them (an RC queue pair places
//! the WRITEs before it, and they have completed anyway).
//!
//! Data passes through one registered bounce buffer of the session ([`Bounce`]), so a
//! read or write is split at its size and at map boundaries.

use devlend_fabric::pci::{Irq, Message, KIND_IRQ};
use devlend_fabric::rdma::channel::{ChannelError, MsgChannel, RdmaOp};
use devlend_fabric::rdma::verbs::Mr;

use super::{AccessCounters, GuestAccess, GuestError};

/// Bytes of the bounce buffer (1 MiB: a command moves at most 128 KiB).
pub(crate) const BOUNCE_BYTES: usize = 1 << 20;

/// One DMA map of the borrower over RDMA: the IOVA range and the guest memory behind
/// it (the borrower's address and rkey).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteMap {
    /// First IOVA.
    pub(crate) iova: u64,
    /// Bytes.
    pub(crate) size: u64,
    /// Borrower virtual address of the first byte.
    pub(crate) addr: u64,
    /// The borrower's memory region key.
    pub(crate) rkey: u32,
}

/// The session's registered bounce buffer. `mr` is declared first: deregistered before
/// the memory is freed.
pub(crate) struct Bounce {
    mr: Mr,
    buf: Box<[u8]>,
}

impl Bounce {
    /// A buffer of [`BOUNCE_BYTES`] registered on the channel's protection domain.
    ///
    /// # Errors
    /// The registration failed.
    pub(crate) fn new(ch: &MsgChannel) -> Result<Bounce, devlend_fabric::rdma::RdmaError> {
        let mut buf = vec![0u8; BOUNCE_BYTES].into_boxed_slice();
        // SAFETY: the buffer is owned by the Bounce, never resized, and freed after the
        // MR (field order).
        let mr = unsafe { Mr::register(ch.pd(), buf.as_mut_ptr(), buf.len(), false) }?;
        Ok(Bounce { mr, buf })
    }
}

/// Guest memory as the mediator reaches it on an RDMA session.
pub(crate) struct RdmaGuest<'a> {
    /// The session's channel.
    pub(crate) ch: &'a mut MsgChannel,
    /// The borrower's DMA maps.
    pub(crate) maps: &'a [RemoteMap],
    /// The bounce buffer.
    pub(crate) bounce: &'a mut Bounce,
    /// The interrupt index the borrower enabled for a vector, if any.
    pub(crate) index_of: &'a dyn Fn(u32) -> Option<u32>,
    /// Traffic, added to (reads and writes count RDMA work requests and their bytes).
    pub(crate) counters: &'a mut AccessCounters,
    /// The work requests being built, kept by the session across accesses.
    pub(crate) ops: &'a mut Vec<RdmaOp>,
}

fn wire(e: ChannelError) -> GuestError {
    GuestError::Protocol(format!(
        "RDMA access to guest memory: {}",
        devlend_fabric::error::chain(&e)
    ))
}

impl RdmaGuest<'_> {
    /// The remote address and rkey of `iova`, and how many bytes from it (at most
    /// `len`) lie in the same map.
    fn locate(&self, iova: u64, len: usize) -> Result<(u64, u32, usize), GuestError> {
        let m = self
            .maps
            .iter()
            .find(|m| iova >= m.iova && iova - m.iova < m.size)
            .ok_or_else(|| {
                GuestError::Refused(format!("IOVA {iova:#x} is outside every DMA map"))
            })?;
        let off = iova - m.iova;
        let n = (m.size - off).min(len as u64) as usize;
        Ok((m.addr + off, m.rkey, n))
    }

    fn op(&self, read: bool, at: usize, len: usize, remote: u64, rkey: u32) -> RdmaOp {
        RdmaOp {
            read,
            local: self.bounce.mr.addr() + at as u64,
            lkey: self.bounce.mr.lkey(),
            len: len as u32,
            remote,
            rkey,
        }
    }
}

impl GuestAccess for RdmaGuest<'_> {
    fn read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), GuestError> {
        let mut done = 0;
        while done < buf.len() {
            // One bounce-full of READs, split at map boundaries.
            let want = (buf.len() - done).min(BOUNCE_BYTES);
            self.ops.clear();
            let mut at = 0;
            while at < want {
                let (remote, rkey, n) = self.locate(iova + (done + at) as u64, want - at)?;
                let op = self.op(true, at, n, remote, rkey);
                self.ops.push(op);
                at += n;
            }
            self.ch.rdma(self.ops).map_err(wire)?;
            buf[done..done + want].copy_from_slice(&self.bounce.buf[..want]);
            self.counters.reads += self.ops.len() as u64;
            self.counters.read_bytes += want as u64;
            done += want;
        }
        Ok(())
    }

    fn write(&mut self, pages: &[(u64, &[u8])]) -> Result<(), GuestError> {
        self.ops.clear();
        let mut used = 0;
        for (iova, data) in pages {
            let mut done = 0;
            while done < data.len() {
                if used == BOUNCE_BYTES {
                    self.ch.rdma(self.ops).map_err(wire)?;
                    self.ops.clear();
                    used = 0;
                }
                let room = (data.len() - done).min(BOUNCE_BYTES - used);
                let (remote, rkey, n) = self.locate(iova + done as u64, room)?;
                self.bounce.buf[used..used + n].copy_from_slice(&data[done..done + n]);
                let op = self.op(false, used, n, remote, rkey);
                self.ops.push(op);
                self.counters.writes += 1;
                self.counters.write_bytes += n as u64;
                used += n;
                done += n;
            }
        }
        self.ch.rdma(self.ops).map_err(wire)
    }

    fn interrupt(&mut self, vector: u32) -> Result<(), GuestError> {
        let Some(index) = (self.index_of)(vector) else {
            tracing::debug!(vector, "no interrupt enabled for the vector; not raised");
            return Ok(());
        };
        self.counters.irqs += 1;
        self.ch
            .send(&Message::new(KIND_IRQ, Irq { index, vector }.encode()))
            .map_err(wire)
    }

    fn counters(&mut self, c: &devlend_fabric::pci::DmaCounters) -> Result<(), GuestError> {
        self.ch
            .send(&Message::new(
                devlend_fabric::pci::KIND_COUNTERS,
                c.encode(),
            ))
            .map_err(wire)
    }
}

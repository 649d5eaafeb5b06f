//! The lender's own access to the borrower's guest memory, for a mediated function
//! (coherence mode `nvme`): reads that the borrower answers from its DMA maps, writes
//! it applies in stream order, and interrupts sent after them.
//!
//! [`GuestAccess`] is what a mediator uses; [`tcp::TcpGuest`] implements it over the
//! PCI session's TCP stream (MEM_READ, MEM_WRITE and IRQ messages),
//! [`rdma::RdmaGuest`] (feature `rdma`) over RDMA (one-sided READ and WRITE on the
//! memory regions the borrower registers with its DMA maps).

#[cfg(feature = "rdma")]
pub(crate) mod rdma;
pub(crate) mod tcp;

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

    /// Sends the borrower the mediator's DMA counters (a
    /// [`devlend_fabric::pci::KIND_COUNTERS`] note; the mediator sends one only to a
    /// borrower that reads them).
    ///
    /// # Errors
    /// [`GuestError`].
    fn counters(&mut self, c: &devlend_fabric::pci::DmaCounters) -> Result<(), GuestError>;
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

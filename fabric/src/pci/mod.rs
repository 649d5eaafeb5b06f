//! Messages of a lent PCIe function (feature [`FEATURE_PCI`]), after the handshake of a
//! PCI session: region access (BARs and config space), reset, interrupts, DMA map and
//! unmap, and the DMA mirror's pushes and pulls.
//!
//! Every message is an 8-byte header `kind: u8, status: u8, flags: u8, reserved: u8 = 0,
//! len: u32` followed by `len` bytes of payload (at most [`MAX_PAYLOAD`]). The borrower
//! sends requests one at a time; the lender answers each with the request's kind ORed
//! with [`REPLY`], `status` 0 on success or a [`PciStatus`] with a UTF-8 reason as
//! payload. A push may span several messages: each but the last carries [`FLAG_MORE`]
//! and is not answered. A pull is answered by zero or more messages with [`FLAG_MORE`]
//! and a last one without. The lender also sends [`KIND_IRQ`] at any time, between
//! replies. Integers are little-endian; layouts are in `docs/protocol.md`.
//!
//! Region indexes are VFIO's for a PCI device (`VFIO_PCI_BAR0_REGION_INDEX` 0 ..
//! `VFIO_PCI_ROM_REGION_INDEX` 6, `VFIO_PCI_CONFIG_REGION_INDEX` 7, VGA 8); interrupt
//! indexes too (INTx 0, MSI 1, MSI-X 2, ERR 3, REQ 4).
//!
//! Modules, one job each: `message` (the header and [`Message`]), `info` ([`PciInfo`]),
//! `requests` (region access, interrupts, DMA maps), `mirror` (pushes and pulls) and
//! `from_lender` (guest memory reads, interrupts), `peer` (peer groups, DMA counters).

mod from_lender;
mod info;
mod message;
mod mirror;
mod peer;
mod requests;
#[cfg(test)]
mod tests;

use crate::codec::{self, Field};
use crate::WireError;

/// [`crate::Hello::features`] bit: the borrower can be lent a PCIe function. A lender
/// grants it only for a function, and refuses a function to a hello without it.
pub const FEATURE_PCI: u64 = 1 << 2;

/// Most bytes of DMA maps (mirrors) one borrower may have at once (4 GiB). The lender
/// keeps a mirror and a copy of each; the borrower a shadow copy: both refuse a map
/// past it before allocating anything.
pub const MAX_MIRROR_BYTES: u64 = 4 << 30;

/// Header length of every message.
pub const PCI_HEADER_LEN: usize = 8;
/// Largest payload of one message, in bytes (1 MiB of data plus its framing).
pub const MAX_PAYLOAD: usize = (1 << 20) + 64;
/// Largest region read or write, in bytes.
pub const MAX_ACCESS: u32 = 1 << 20;
/// Page size of the DMA mirror: pushes and pulls move whole pages of this size.
pub const MIRROR_PAGE: u64 = 4096;
/// Largest number of regions a function may report.
pub const MAX_REGIONS: u32 = 16;
/// Largest number of interrupt indexes a function may report.
pub const MAX_IRQS: u32 = 16;

/// Header flag: more messages of the same push or pull follow.
pub const FLAG_MORE: u8 = 1 << 0;
/// Added to a request's kind to make its reply's.
pub const REPLY: u8 = 0x80;

/// Request: the function's regions and interrupts ([`PciInfo`]); no payload.
pub const KIND_INFO: u8 = 0x40;
/// Request: read `len` bytes of region `region` at `offset` ([`Access`]); the reply
/// carries the bytes.
pub const KIND_READ: u8 = 0x41;
/// Request: write the bytes that follow the [`Access`] to region `region` at `offset`.
pub const KIND_WRITE: u8 = 0x42;
/// Request: reset the function (VFIO_DEVICE_RESET); no payload.
pub const KIND_RESET: u8 = 0x43;
/// Request: enable, disable or unmask an interrupt index ([`IrqSet`]).
pub const KIND_SET_IRQS: u8 = 0x44;
/// Request: map `size` bytes at IOVA `iova` into the function's DMA space ([`DmaRange`]).
pub const KIND_DMA_MAP: u8 = 0x45;
/// Request: unmap a range mapped before, exactly as mapped ([`DmaRange`]).
pub const KIND_DMA_UNMAP: u8 = 0x46;
/// Request: guest memory pages for the mirror ([`Page`]s); see [`FLAG_MORE`].
pub const KIND_PUSH: u8 = 0x47;
/// Request: the mirror pages the function changed since they were last pushed or
/// pulled; answered by [`Page`]s (see [`FLAG_MORE`]); no payload.
pub const KIND_PULL: u8 = 0x48;
/// Lender to borrower, a request the borrower answers in turn (coherence mode `nvme`):
/// read `len` bytes of guest memory at `iova` ([`MemRead`]). The reply carries the
/// bytes, or a refusal when the range is not inside the borrower's DMA maps. The lender
/// sends it only while the borrower waits for the reply to one of its own requests (a
/// doorbell write), so the two never cross.
pub const KIND_MEM_READ: u8 = 0x49;
/// Lender to borrower, one-way (coherence mode `nvme`): write guest memory ([`Page`]s,
/// each inside the borrower's DMA maps). The borrower applies it in stream order, so a
/// write sent before a [`KIND_IRQ`] is in guest memory before that interrupt reaches
/// the VMM. Not answered; a page outside the maps ends the session.
pub const KIND_MEM_WRITE: u8 = 0x4a;
/// Request, at most once per session, before the borrower's first DMA map: the VM the
/// function is lent to ([`PeerGroup`]). The lender maps the BARs of the other functions
/// it lends to the same VM into this function's DMA space at the addresses the guest
/// gave them, and this function's BARs into theirs (peer-to-peer, `docs/pci.md`); no
/// payload in the reply.
pub const KIND_PEER_GROUP: u8 = 0x4b;
/// Lender to borrower, unsolicited: the function raised an interrupt ([`Irq`]).
pub const KIND_IRQ: u8 = 0x50;
/// Lender to borrower, one-way, to a borrower granted [`FEATURE_PCI_COUNTERS`]: what
/// the lender moved for the function's DMA so far ([`DmaCounters`]), sent when it
/// changed, after the completions that changed it.
pub const KIND_COUNTERS: u8 = 0x51;

/// [`crate::Hello::features`] bit, with [`FEATURE_PCI`]: the borrower reads
/// [`KIND_COUNTERS`] notes. A lender sends them only to a borrower it granted this.
pub const FEATURE_PCI_COUNTERS: u64 = 1 << 6;

pub use from_lender::{Irq, MemRead};
pub use info::{IrqInfo, PciInfo, RegionInfo, INFO_MEDIATED, INFO_RESET};
pub use message::{Message, PciStatus};
pub use mirror::{
    changed_runs, decode_pages, decode_ranges, encode_page, encode_range, page_cost, Page, Range,
    RDMA_MAX_ACCESS, RDMA_MAX_MESSAGE, RDMA_MAX_RANGES,
};
pub use peer::{DmaCounters, PeerGroup, VM_ID_LEN};
pub use requests::{Access, DmaRange, IrqAction, IrqSet, RemoteDmaRange};

/// A payload that must be exactly one `T`; `what` names it in the error.
fn exact<T: Field>(p: &[u8], what: &'static str) -> Result<T, WireError> {
    codec::exact(p).map_err(|_| WireError::Invalid(what))
}

crate::layout! {
    /// An IOVA and a length: a [`Range`], the head of a [`Page`], a [`MemRead`].
    struct RangeEntry [16] {
        iova: u64,
        len: u32,
        reserved: [u8; 4],
    }
}

impl RangeEntry {
    fn new(iova: u64, len: u32) -> Self {
        RangeEntry {
            iova,
            len,
            reserved: [0; 4],
        }
    }
}

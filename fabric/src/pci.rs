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
//! Why this file is over 600 lines: it is the wire format of the whole PCI session, the
//! header and the payload of each message kind with its encoding and decoding; the last 183
//! lines (from `#[cfg(test)]` on) are round-trip and refusal tests of them, and a quarter
//! of the rest is doc comments.

use std::io::{Read, Write};

use crate::codec::{self, Field, Reader, Writer};
use crate::io_util::read_exact_or_eof;
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
/// Lender to borrower, unsolicited: the function raised an interrupt ([`Irq`]).
pub const KIND_IRQ: u8 = 0x50;

crate::layout! {
    /// The header of every message.
    struct Header [PCI_HEADER_LEN] {
        kind: u8,
        status: u8,
        flags: u8,
        reserved: [u8; 1],
        len: u32,
    }
}

/// Why the lender refused a request (the reply's `status`); the payload says more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PciStatus {
    /// The request was answered.
    Ok = 0,
    /// The request asked for something out of range or not allowed (a region index, an
    /// offset past a BAR, a DMA range that overlaps a mapped one).
    Invalid = 1,
    /// The function or the lender's kernel failed the operation.
    Io = 2,
    /// The function does not support the operation.
    Unsupported = 3,
}

impl PciStatus {
    /// Decodes a status byte.
    ///
    /// # Errors
    /// [`WireError::UnknownStatus`].
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0 => PciStatus::Ok,
            1 => PciStatus::Invalid,
            2 => PciStatus::Io,
            3 => PciStatus::Unsupported,
            other => return Err(WireError::UnknownStatus(other)),
        })
    }
}

/// One message as read off the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The kind (`KIND_*`, ORed with [`REPLY`] for a reply).
    pub kind: u8,
    /// 0 in requests; the outcome in replies.
    pub status: PciStatus,
    /// [`FLAG_MORE`] or 0.
    pub flags: u8,
    /// The payload.
    pub payload: Vec<u8>,
}

impl Message {
    /// A message of `kind` with `payload`, status OK, no flags.
    pub fn new(kind: u8, payload: Vec<u8>) -> Self {
        Message {
            kind,
            status: PciStatus::Ok,
            flags: 0,
            payload,
        }
    }

    /// A refusal of a request of `kind`, with `reason` as payload (cut to 1024 bytes).
    pub fn refusal(kind: u8, status: PciStatus, reason: &str) -> Self {
        let mut end = reason.len().min(1024);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        Message {
            kind: kind | REPLY,
            status,
            flags: 0,
            payload: reason.as_bytes()[..end].to_vec(),
        }
    }

    /// Bytes of the encoded message (header and payload).
    pub fn encoded_len(&self) -> usize {
        PCI_HEADER_LEN + self.payload.len()
    }

    /// Encodes header and payload into the first [`Self::encoded_len`] bytes of `out`
    /// (e.g. a registered RDMA send buffer); `None` when `out` is shorter.
    pub fn encode_into(&self, out: &mut [u8]) -> Option<usize> {
        let n = self.encoded_len();
        let mut w = Writer::new(out.get_mut(..n)?);
        Header {
            kind: self.kind,
            status: self.status as u8,
            flags: self.flags,
            reserved: [0],
            len: self.payload.len() as u32,
        }
        .write(&mut w)
        .ok()?;
        w.put_bytes(&self.payload).ok()?;
        Some(n)
    }

    /// Encodes header and payload into one buffer (one `write_all`, so that two threads
    /// sharing a connection under a lock never interleave a message).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.encoded_len()];
        self.encode_into(&mut b);
        b
    }

    /// Writes the message.
    ///
    /// # Errors
    /// [`WireError::TooLong`] for a payload over [`MAX_PAYLOAD`]; [`WireError::Io`].
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), WireError> {
        if self.payload.len() > MAX_PAYLOAD {
            return Err(WireError::TooLong {
                what: "PCI message payload",
                len: self.payload.len() as u64,
                limit: MAX_PAYLOAD as u64,
            });
        }
        w.write_all(&self.encode())?;
        Ok(())
    }

    /// Reads one message, checking the header before reading the payload.
    ///
    /// # Errors
    /// [`WireError::Closed`] between messages, [`WireError::Truncated`] inside one,
    /// [`WireError::Invalid`] (unknown kind, flags, reserved byte),
    /// [`WireError::UnknownStatus`], [`WireError::TooLong`], [`WireError::Io`].
    pub fn read_from(r: &mut impl Read) -> Result<Self, WireError> {
        let mut b = [0u8; PCI_HEADER_LEN];
        read_exact_or_eof(r, &mut b)?;
        let h = Header::decode(&b);
        let kind = h.kind;
        if !matches!(kind & !REPLY, KIND_INFO..=KIND_MEM_WRITE) && kind != KIND_IRQ {
            return Err(WireError::Invalid("PCI message kind"));
        }
        let status = PciStatus::from_u8(h.status)?;
        const WHAT: &str = "PCI message flags or reserved byte";
        if h.flags & !FLAG_MORE != 0 {
            return Err(WireError::Invalid(WHAT));
        }
        codec::reserved(&h.reserved, WHAT)?;
        if kind & REPLY == 0 && status != PciStatus::Ok {
            return Err(WireError::Invalid("status in a PCI request"));
        }
        let len = h.len as usize;
        if len > MAX_PAYLOAD {
            return Err(WireError::TooLong {
                what: "PCI message payload",
                len: len as u64,
                limit: MAX_PAYLOAD as u64,
            });
        }
        let mut payload = vec![0u8; len];
        read_exact_or_eof(r, &mut payload).map_err(|e| match e {
            WireError::Closed => WireError::Truncated {
                got: PCI_HEADER_LEN,
                want: PCI_HEADER_LEN + len,
            },
            e => e,
        })?;
        Ok(Message {
            kind,
            status,
            flags: h.flags,
            payload,
        })
    }
}

/// A payload that must be exactly one `T`; `what` names it in the error.
fn exact<T: Field>(p: &[u8], what: &'static str) -> Result<T, WireError> {
    codec::exact(p).map_err(|_| WireError::Invalid(what))
}

crate::layout! {
    /// The fixed part of a [`PciInfo`].
    struct InfoHead [16] {
        num_regions: u32,
        num_irqs: u32,
        flags: u32,
        reserved: [u8; 4],
    }
}

crate::layout! {
    /// One region of a [`PciInfo`].
    struct RegionEntry [16] {
        size: u64,
        flags: u32,
        reserved: [u8; 4],
    }
}

crate::layout! {
    /// An IOVA and a length: a [`Range`], the head of a [`Page`], a [`MemRead`].
    struct RangeEntry [16] {
        iova: u64,
        len: u32,
        reserved: [u8; 4],
    }
}

/// A region as the lender reports it (VFIO_DEVICE_GET_REGION_INFO).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegionInfo {
    /// Size in bytes (0: the region does not exist).
    pub size: u64,
    /// VFIO_REGION_INFO_FLAG_READ (1) and _WRITE (2); other bits are 0.
    pub flags: u32,
}

crate::layout! {
    /// An interrupt index as the lender reports it (VFIO_DEVICE_GET_IRQ_INFO); 8 bytes
    /// in a [`PciInfo`].
    #[derive(Default)]
    pub struct IrqInfo [8] {
        /// Number of vectors (0: not supported).
        pub count: u32,
        /// VFIO_IRQ_INFO_* flags (EVENTFD 1, MASKABLE 2, AUTOMASKED 4, NORESIZE 8).
        pub flags: u32,
    }
}

/// The reply to [`KIND_INFO`].
///
/// Layout: `num_regions: u32, num_irqs: u32, flags: u32, reserved: u32 = 0`, then per
/// region `size: u64, flags: u32, reserved: u32 = 0`, then per interrupt index
/// `count: u32, flags: u32`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PciInfo {
    /// Regions by VFIO index (at most [`MAX_REGIONS`]).
    pub regions: Vec<RegionInfo>,
    /// Interrupt indexes by VFIO index (at most [`MAX_IRQS`]).
    pub irqs: Vec<IrqInfo>,
    /// [`INFO_RESET`] when the function can be reset.
    pub flags: u32,
}

/// [`PciInfo::flags`] bit: the function supports reset.
pub const INFO_RESET: u32 = 1 << 0;
/// [`PciInfo::flags`] bit: the lender mediates the function (coherence mode `nvme`): it
/// keeps no mirror, reads and writes guest memory itself with [`KIND_MEM_READ`] and
/// [`KIND_MEM_WRITE`], and the borrower neither pushes nor pulls.
pub const INFO_MEDIATED: u32 = 1 << 1;

impl PciInfo {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            InfoHead::LEN + self.regions.len() * RegionEntry::LEN + self.irqs.len() * IrqInfo::LEN,
        );
        InfoHead {
            num_regions: self.regions.len() as u32,
            num_irqs: self.irqs.len() as u32,
            flags: self.flags,
            reserved: [0; 4],
        }
        .push(&mut b);
        for r in &self.regions {
            RegionEntry {
                size: r.size,
                flags: r.flags,
                reserved: [0; 4],
            }
            .push(&mut b);
        }
        for i in &self.irqs {
            i.push(&mut b);
        }
        b
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for counts over the limits, a length that does not match
    /// them, unknown flags or reserved fields that are not zero.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(p);
        let head: InfoHead = r.get().map_err(|_| WireError::Invalid("PCI info length"))?;
        let (nr, ni) = (head.num_regions, head.num_irqs);
        if nr > MAX_REGIONS || ni > MAX_IRQS {
            return Err(WireError::Invalid("PCI info counts"));
        }
        const FLAGS: &str = "PCI info flags";
        if head.flags & !(INFO_RESET | INFO_MEDIATED) != 0 {
            return Err(WireError::Invalid(FLAGS));
        }
        codec::reserved(&head.reserved, FLAGS)?;
        if r.remaining() != nr as usize * RegionEntry::LEN + ni as usize * IrqInfo::LEN {
            return Err(WireError::Invalid("PCI info length"));
        }
        let mut regions = Vec::with_capacity(nr as usize);
        for _ in 0..nr {
            let e: RegionEntry = r.get()?;
            const REGION: &str = "PCI region flags";
            if e.flags & !3 != 0 {
                return Err(WireError::Invalid(REGION));
            }
            codec::reserved(&e.reserved, REGION)?;
            regions.push(RegionInfo {
                size: e.size,
                flags: e.flags,
            });
        }
        let irqs = (0..ni).map(|_| r.get()).collect::<Result<_, _>>()?;
        Ok(PciInfo {
            regions,
            irqs,
            flags: head.flags,
        })
    }
}

/// A region access ([`KIND_READ`], [`KIND_WRITE`]).
///
/// Layout (16 bytes): `region: u32, len: u32, offset: u64`; a write's data follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// VFIO region index.
    pub region: u32,
    /// Bytes to read or write (1..=[`MAX_ACCESS`]).
    pub len: u32,
    /// Offset in the region, in bytes.
    pub offset: u64,
}

crate::layout! {
    /// The head of an [`Access`] payload.
    struct AccessHead [16] {
        region: u32,
        len: u32,
        offset: u64,
    }
}

impl Access {
    /// Encodes the 16-byte head (append a write's data after it).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(AccessHead::LEN + self.len as usize);
        AccessHead {
            region: self.region,
            len: self.len,
            offset: self.offset,
        }
        .push(&mut b);
        b
    }

    /// Decodes a read's payload (exactly the head) or a write's (the head and `len`
    /// bytes, returned as the second value).
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a payload of the wrong length or a `len` of 0 or over
    /// [`MAX_ACCESS`].
    pub fn decode(p: &[u8], write: bool) -> Result<(Self, &[u8]), WireError> {
        const LENGTH: &str = "region access length";
        let mut r = Reader::new(p);
        let h: AccessHead = r.get().map_err(|_| WireError::Invalid(LENGTH))?;
        if h.len == 0 || h.len > MAX_ACCESS {
            return Err(WireError::Invalid("region access size"));
        }
        let data_len = if write { h.len as usize } else { 0 };
        if r.remaining() != data_len {
            return Err(WireError::Invalid(LENGTH));
        }
        let a = Access {
            region: h.region,
            len: h.len,
            offset: h.offset,
        };
        Ok((a, r.rest()))
    }
}

/// What [`KIND_SET_IRQS`] does to an interrupt index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum IrqAction {
    /// Stop signalling every vector of the index.
    Disable = 0,
    /// Signal `count` vectors from 0 with [`KIND_IRQ`] messages.
    Enable = 1,
    /// Unmask the (level-triggered, automasked) INTx interrupt.
    Unmask = 2,
}

/// The payload of [`KIND_SET_IRQS`].
///
/// Layout (12 bytes): `index: u32, action: u32, count: u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IrqSet {
    /// VFIO interrupt index.
    pub index: u32,
    /// What to do.
    pub action: IrqAction,
    /// For [`IrqAction::Enable`]: vectors to signal (≥ 1); else 0.
    pub count: u32,
}

crate::layout! {
    /// An [`IrqSet`] payload.
    struct IrqSetRaw [12] {
        index: u32,
        action: u32,
        count: u32,
    }
}

impl IrqSet {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        IrqSetRaw {
            index: self.index,
            action: self.action as u32,
            count: self.count,
        }
        .encode()
        .to_vec()
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a wrong length, an unknown action, or a count that
    /// does not fit the action.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let raw: IrqSetRaw = exact(p, "interrupt set length")?;
        let action = match raw.action {
            0 => IrqAction::Disable,
            1 => IrqAction::Enable,
            2 => IrqAction::Unmask,
            _ => return Err(WireError::Invalid("interrupt action")),
        };
        let count = raw.count;
        if (action == IrqAction::Enable) != (count > 0) {
            return Err(WireError::Invalid("interrupt vector count"));
        }
        Ok(IrqSet {
            index: raw.index,
            action,
            count,
        })
    }
}

/// An IOVA range ([`KIND_DMA_MAP`], [`KIND_DMA_UNMAP`]).
///
/// Layout (16 bytes): `iova: u64, size: u64`, both multiples of [`MIRROR_PAGE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaRange {
    /// First IO virtual address (bytes).
    pub iova: u64,
    /// Length in bytes (> 0).
    pub size: u64,
}

crate::layout! {
    /// A [`DmaRange`] payload.
    struct DmaRangeRaw [16] {
        iova: u64,
        size: u64,
    }
}

crate::layout! {
    /// A [`RemoteDmaRange`] payload.
    struct RemoteDmaRaw [32] {
        range: DmaRangeRaw,
        addr: u64,
        rkey: u32,
        reserved: [u8; 4],
    }
}

impl DmaRange {
    fn raw(&self) -> DmaRangeRaw {
        DmaRangeRaw {
            iova: self.iova,
            size: self.size,
        }
    }

    fn check(raw: DmaRangeRaw) -> Result<Self, WireError> {
        let r = DmaRange {
            iova: raw.iova,
            size: raw.size,
        };
        if r.size == 0
            || !r.iova.is_multiple_of(MIRROR_PAGE)
            || !r.size.is_multiple_of(MIRROR_PAGE)
            || r.iova.checked_add(r.size).is_none()
        {
            return Err(WireError::Invalid("DMA range"));
        }
        Ok(r)
    }

    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        self.raw().encode().to_vec()
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a wrong length, a size of 0, a range that is not
    /// page-aligned or that wraps around.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        Self::check(exact(p, "DMA range length")?)
    }
}

/// Over RDMA, the payload of [`KIND_DMA_MAP`]: the IOVA range and where the borrower
/// registered the guest memory behind it, for the lender's one-sided RDMA READ (push)
/// and WRITE (pull).
///
/// Layout (32 bytes): `iova: u64, size: u64, addr: u64, rkey: u32, reserved: u32 = 0`;
/// `iova` and `size` as in [`DmaRange`]; `addr` is the borrower's virtual address of the
/// range's first byte in its memory region of key `rkey`, which covers `size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteDmaRange {
    /// The IOVA range.
    pub range: DmaRange,
    /// Borrower virtual address of the first byte.
    pub addr: u64,
    /// The memory region's remote key.
    pub rkey: u32,
}

impl RemoteDmaRange {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        RemoteDmaRaw {
            range: self.range.raw(),
            addr: self.addr,
            rkey: self.rkey,
            reserved: [0; 4],
        }
        .encode()
        .to_vec()
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a wrong length, a bad [`DmaRange`], a reserved field
    /// that is not zero, or an address range that wraps around.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let raw: RemoteDmaRaw = exact(p, "RDMA DMA range length")?;
        let range = DmaRange::check(raw.range)?;
        const WHAT: &str = "RDMA DMA range";
        codec::reserved(&raw.reserved, WHAT)?;
        if raw.addr.checked_add(range.size).is_none() {
            return Err(WireError::Invalid(WHAT));
        }
        Ok(RemoteDmaRange {
            range,
            addr: raw.addr,
            rkey: raw.rkey,
        })
    }
}

/// Over RDMA, [`KIND_PUSH`] requests and [`KIND_PULL`] replies carry no page data, only
/// the IOVA ranges the lender moved (pull) or is to move (push) with one-sided RDMA:
/// entries of 16 bytes, `iova: u64, len: u32, reserved: u32 = 0`, at most
/// [`RDMA_MAX_RANGES`] per message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// IOVA of the first byte.
    pub iova: u64,
    /// Length in bytes (> 0).
    pub len: u32,
}

/// Largest encoded message of a PCI session over RDMA, header included (the size of
/// each end's message buffers for the handshake, which PCI sessions keep).
pub const RDMA_MAX_MESSAGE: usize = crate::rdma::MAX_HANDSHAKE_MSG;
/// Largest region read or write in one message over RDMA, in bytes: larger accesses are
/// split by the borrower (a BAR is accessed a register at a time; config space in
/// 4-byte words), and refused by the lender.
pub const RDMA_MAX_ACCESS: u32 = 1024;
/// Most [`Range`]s in one message over RDMA.
pub const RDMA_MAX_RANGES: usize = (RDMA_MAX_MESSAGE - PCI_HEADER_LEN) / 16;

// The largest range list, and the largest access with its header, fit one message.
const _: () = assert!(PCI_HEADER_LEN + RDMA_MAX_RANGES * RangeEntry::LEN <= RDMA_MAX_MESSAGE);
const _: () =
    assert!(PCI_HEADER_LEN + AccessHead::LEN + RDMA_MAX_ACCESS as usize <= RDMA_MAX_MESSAGE);

impl RangeEntry {
    fn new(iova: u64, len: u32) -> Self {
        RangeEntry {
            iova,
            len,
            reserved: [0; 4],
        }
    }
}

/// Appends one [`Range`] to a payload.
pub fn encode_range(r: Range, out: &mut Vec<u8>) {
    RangeEntry::new(r.iova, r.len).push(out);
}

/// Splits a payload into its [`Range`]s.
///
/// # Errors
/// [`WireError::Invalid`] for a length that is not a multiple of 16, more than
/// [`RDMA_MAX_RANGES`] entries, an empty range, a reserved field that is not zero, or a
/// range that wraps the IOVA space.
pub fn decode_ranges(p: &[u8]) -> Result<Vec<Range>, WireError> {
    if !p.len().is_multiple_of(RangeEntry::LEN) || p.len() / RangeEntry::LEN > RDMA_MAX_RANGES {
        return Err(WireError::Invalid("range list length"));
    }
    let mut r = Reader::new(p);
    let mut ranges = Vec::with_capacity(p.len() / RangeEntry::LEN);
    while !r.is_empty() {
        let e: RangeEntry = r.get()?;
        if e.len == 0
            || codec::reserved(&e.reserved, "range").is_err()
            || e.iova.checked_add(u64::from(e.len)).is_none()
        {
            return Err(WireError::Invalid("range"));
        }
        ranges.push(Range {
            iova: e.iova,
            len: e.len,
        });
    }
    Ok(ranges)
}

/// One page of mirrored memory in a push or a pull.
///
/// Layout: `iova: u64, len: u32, reserved: u32 = 0`, then `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page<'a> {
    /// IOVA of the first byte.
    pub iova: u64,
    /// The bytes.
    pub data: &'a [u8],
}

/// Appends one [`Page`] to a push or pull payload.
pub fn encode_page(iova: u64, data: &[u8], out: &mut Vec<u8>) {
    RangeEntry::new(iova, data.len() as u32).push(out);
    out.extend_from_slice(data);
}

/// Bytes one page of `len` bytes takes in a payload.
pub const fn page_cost(len: usize) -> usize {
    RangeEntry::LEN + len
}

/// Splits a push or pull payload into its pages.
///
/// # Errors
/// [`WireError::Invalid`] for a truncated page, a reserved field that is not zero, an
/// empty page, or one that wraps the IOVA space.
pub fn decode_pages(p: &[u8]) -> Result<Vec<Page<'_>>, WireError> {
    let mut r = Reader::new(p);
    let mut pages = Vec::new();
    while !r.is_empty() {
        let h: RangeEntry = r
            .get()
            .map_err(|_| WireError::Invalid("mirror page header"))?;
        let bad = || WireError::Invalid("mirror page");
        if h.len == 0 || codec::reserved(&h.reserved, "mirror page").is_err() {
            return Err(bad());
        }
        let data = r.bytes(h.len as usize).map_err(|_| bad())?;
        if h.iova.checked_add(u64::from(h.len)).is_none() {
            return Err(WireError::Invalid("mirror page IOVA"));
        }
        pages.push(Page { iova: h.iova, data });
    }
    Ok(pages)
}

/// The payload of [`KIND_MEM_READ`].
///
/// Layout (16 bytes): `iova: u64, len: u32, reserved: u32 = 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemRead {
    /// IOVA of the first byte.
    pub iova: u64,
    /// Bytes to read (1..=[`MAX_ACCESS`]).
    pub len: u32,
}

impl MemRead {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        RangeEntry::new(self.iova, self.len).encode().to_vec()
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a wrong length, a reserved field that is not zero, a
    /// `len` of 0 or over [`MAX_ACCESS`], or a range that wraps the IOVA space.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let e: RangeEntry = exact(p, "guest memory read length")?;
        let r = MemRead {
            iova: e.iova,
            len: e.len,
        };
        if codec::reserved(&e.reserved, "guest memory read").is_err()
            || r.len == 0
            || r.len > MAX_ACCESS
            || r.iova.checked_add(u64::from(r.len)).is_none()
        {
            return Err(WireError::Invalid("guest memory read"));
        }
        Ok(r)
    }
}

/// The payload of [`KIND_IRQ`].
///
/// Layout (8 bytes): `index: u32, vector: u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Irq {
    /// VFIO interrupt index.
    pub index: u32,
    /// Vector within the index.
    pub vector: u32,
}

crate::layout! {
    /// An [`Irq`] payload.
    struct IrqRaw [8] {
        index: u32,
        vector: u32,
    }
}

impl Irq {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        IrqRaw {
            index: self.index,
            vector: self.vector,
        }
        .encode()
        .to_vec()
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a wrong length.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let raw: IrqRaw = exact(p, "interrupt message length")?;
        Ok(Irq {
            index: raw.index,
            vector: raw.vector,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let m = Message::new(KIND_WRITE, {
            let mut p = Access {
                region: 0,
                len: 4,
                offset: 8,
            }
            .encode();
            p.extend_from_slice(&5u32.to_le_bytes());
            p
        });
        let b = m.encode();
        let back = Message::read_from(&mut b.as_slice()).unwrap();
        assert_eq!(back, m);
        let (a, data) = Access::decode(&back.payload, true).unwrap();
        assert_eq!(
            (a.region, a.len, a.offset, data),
            (0, 4, 8, &[5, 0, 0, 0][..])
        );
        assert!(Access::decode(&back.payload, false).is_err());

        let mut bad = b.clone();
        bad[0] = 0x33;
        assert!(Message::read_from(&mut bad.as_slice()).is_err());
        let mut bad = b.clone();
        bad[1] = 1; // a status in a request
        assert!(Message::read_from(&mut bad.as_slice()).is_err());
        let mut bad = b.clone();
        bad[4..8].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(matches!(
            Message::read_from(&mut bad.as_slice()),
            Err(WireError::TooLong { .. })
        ));
        assert!(matches!(
            Message::read_from(&mut &b[..10]),
            Err(WireError::Truncated { .. })
        ));
        let r = Message::refusal(KIND_READ, PciStatus::Invalid, "no such region");
        let back = Message::read_from(&mut r.encode().as_slice()).unwrap();
        assert_eq!(back.kind, KIND_READ | REPLY);
        assert_eq!(back.status, PciStatus::Invalid);
    }

    #[test]
    fn info_pages_and_ranges_round_trip() {
        let info = PciInfo {
            regions: vec![
                RegionInfo {
                    size: 1 << 20,
                    flags: 3,
                },
                RegionInfo::default(),
            ],
            irqs: vec![IrqInfo { count: 1, flags: 7 }],
            flags: INFO_RESET,
        };
        assert_eq!(PciInfo::decode(&info.encode()).unwrap(), info);
        let mut p = info.encode();
        p.pop();
        assert!(PciInfo::decode(&p).is_err());

        let mut b = Vec::new();
        encode_page(0x1000, &[1; 4096], &mut b);
        encode_page(0x3000, &[2; 10], &mut b);
        let pages = decode_pages(&b).unwrap();
        assert_eq!(pages.len(), 2);
        assert_eq!(pages[1].iova, 0x3000);
        assert_eq!(pages[1].data, &[2; 10]);
        assert!(decode_pages(&b[..b.len() - 1]).is_err());

        let r = DmaRange {
            iova: 0x10_0000,
            size: 0x2000,
        };
        assert_eq!(DmaRange::decode(&r.encode()).unwrap(), r);
        for bad in [
            DmaRange {
                iova: 1,
                size: 4096,
            },
            DmaRange { iova: 0, size: 0 },
            DmaRange {
                iova: u64::MAX - 4095,
                size: 8192,
            },
        ] {
            assert!(DmaRange::decode(&bad.encode()).is_err());
        }
        let s = IrqSet {
            index: 1,
            action: IrqAction::Enable,
            count: 1,
        };
        assert_eq!(IrqSet::decode(&s.encode()).unwrap(), s);
        let s = IrqSet {
            index: 1,
            action: IrqAction::Enable,
            count: 0,
        };
        assert!(IrqSet::decode(&s.encode()).is_err());
        let i = Irq {
            index: 2,
            vector: 5,
        };
        assert_eq!(Irq::decode(&i.encode()).unwrap(), i);
        let r = MemRead {
            iova: 0x1000,
            len: 64,
        };
        assert_eq!(MemRead::decode(&r.encode()).unwrap(), r);
        for bad in [
            MemRead { iova: 0, len: 0 },
            MemRead {
                iova: u64::MAX,
                len: 2,
            },
            MemRead {
                iova: 0,
                len: MAX_ACCESS + 1,
            },
        ] {
            assert!(MemRead::decode(&bad.encode()).is_err());
        }
        let m = Message::new(KIND_MEM_WRITE, b.clone());
        assert_eq!(Message::read_from(&mut m.encode().as_slice()).unwrap(), m);
    }

    #[test]
    fn rdma_maps_and_range_lists_round_trip_and_garbage_is_refused() {
        let m = RemoteDmaRange {
            range: DmaRange {
                iova: 0x10_0000,
                size: 0x2000,
            },
            addr: 0x7f00_0000_0000,
            rkey: 0x1234,
        };
        let b = m.encode();
        assert_eq!(b.len(), 32);
        assert_eq!(RemoteDmaRange::decode(&b).unwrap(), m);
        assert!(
            RemoteDmaRange::decode(&b[..16]).is_err(),
            "a TCP map over RDMA"
        );
        let mut bad = b.clone();
        bad[28] = 1;
        assert!(RemoteDmaRange::decode(&bad).is_err(), "reserved");
        let mut bad = b.clone();
        bad[16..24].copy_from_slice(&(u64::MAX - 10).to_le_bytes());
        assert!(RemoteDmaRange::decode(&bad).is_err(), "wrapping address");

        let mut p = Vec::new();
        let rs = [
            Range {
                iova: 0x10_0000,
                len: 4096,
            },
            Range {
                iova: 0x10_3000,
                len: 8192,
            },
        ];
        for r in rs {
            encode_range(r, &mut p);
        }
        assert_eq!(decode_ranges(&p).unwrap(), rs);
        assert!(decode_ranges(&p[..20]).is_err(), "a cut entry");
        let mut bad = p.clone();
        bad[8..12].fill(0);
        assert!(decode_ranges(&bad).is_err(), "an empty range");
        let mut bad = p.clone();
        bad[15] = 1;
        assert!(decode_ranges(&bad).is_err(), "reserved");
        let long = vec![0u8; (RDMA_MAX_RANGES + 1) * 16];
        assert!(decode_ranges(&long).is_err(), "too many");
        assert!(decode_ranges(&[]).unwrap().is_empty());
    }
}

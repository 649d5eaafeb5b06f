//! The payloads of the borrower's requests: region access, interrupt setup, DMA map
//! and unmap.

use super::{exact, MAX_ACCESS, MIRROR_PAGE};
use crate::codec::{self, Reader};
use crate::WireError;

/// A region access ([`KIND_READ`](super::KIND_READ), [`KIND_WRITE`](super::KIND_WRITE)).
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
    pub(super) struct AccessHead [16] {
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

/// What [`KIND_SET_IRQS`](super::KIND_SET_IRQS) does to an interrupt index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum IrqAction {
    /// Stop signalling every vector of the index.
    Disable = 0,
    /// Signal `count` vectors from 0 with [`KIND_IRQ`](super::KIND_IRQ) messages.
    Enable = 1,
    /// Unmask the (level-triggered, automasked) INTx interrupt.
    Unmask = 2,
}

/// The payload of [`KIND_SET_IRQS`](super::KIND_SET_IRQS).
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

/// An IOVA range ([`KIND_DMA_MAP`](super::KIND_DMA_MAP), [`KIND_DMA_UNMAP`](super::KIND_DMA_UNMAP)).
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

/// Over RDMA, the payload of [`KIND_DMA_MAP`](super::KIND_DMA_MAP): the IOVA range and where the borrower
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

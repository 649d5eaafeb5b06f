//! The payloads of the lender's own messages: a guest memory read (coherence mode
//! `nvme`) and an interrupt.

use super::{exact, RangeEntry, MAX_ACCESS};
use crate::codec;
use crate::WireError;

/// The payload of [`KIND_MEM_READ`](super::KIND_MEM_READ).
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

/// The payload of [`KIND_IRQ`](super::KIND_IRQ).
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

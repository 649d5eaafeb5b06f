//! The function's regions and interrupts: the reply to [`super::KIND_INFO`].

use super::{MAX_IRQS, MAX_REGIONS};
use crate::codec::{self, Reader};
use crate::WireError;

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

/// The reply to [`KIND_INFO`](super::KIND_INFO).
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
/// keeps no mirror, reads and writes guest memory itself with [`KIND_MEM_READ`](super::KIND_MEM_READ) and
/// [`KIND_MEM_WRITE`](super::KIND_MEM_WRITE), and the borrower neither pushes nor pulls.
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

//! The borrower's DMA maps as the lender of a mediated function reads and writes them
//! ([`super::link::GuestMemory`]): every access is checked to lie inside one map, and
//! copied with volatile copies (the guest may write its memory at any time).

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use super::link::GuestMemory;
use super::GuestMap;

/// The DMA maps of one borrowed function, and whether its lender mediates it.
#[derive(Default)]
pub(super) struct Maps {
    maps: Mutex<Vec<GuestMap>>,
    mediated: AtomicBool,
}

impl Deref for Maps {
    type Target = Mutex<Vec<GuestMap>>;

    fn deref(&self) -> &Self::Target {
        &self.maps
    }
}

impl Maps {
    /// Marks the function mediated (from the lender's [`devlend_fabric::pci::PciInfo`]).
    pub(super) fn set_mediated(&self, on: bool) {
        self.mediated.store(on, Ordering::Release);
    }

    /// Calls `f` with the slice of guest memory `iova..iova + len`, when one map holds
    /// all of it.
    fn with_range<T>(
        &self,
        iova: u64,
        len: usize,
        f: impl FnOnce(vm_memory::VolatileSlice<'_>) -> T,
    ) -> Result<T, String> {
        let maps = self.maps.lock().unwrap_or_else(PoisonError::into_inner);
        let end = iova
            .checked_add(len as u64)
            .ok_or_else(|| format!("{len} bytes at IOVA {iova:#x} wrap around"))?;
        let m = maps
            .iter()
            .find(|m| iova >= m.iova && end <= m.iova + m.size as u64)
            .ok_or_else(|| format!("{len} bytes at IOVA {iova:#x} are outside every DMA map"))?;
        if !m.intact() {
            return Err(format!(
                "the VMM's memory file behind IOVA {iova:#x} shrank below its DMA map"
            ));
        }
        let s = m
            .slice()
            .subslice((iova - m.iova) as usize, len)
            .map_err(|e| format!("IOVA {iova:#x}: {e}"))?;
        Ok(f(s))
    }
}

impl GuestMemory for Maps {
    fn mediated(&self) -> bool {
        self.mediated.load(Ordering::Acquire)
    }

    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), String> {
        self.with_range(iova, buf.len(), |s| s.copy_to(buf))
            .map(|_| ())
    }

    fn write(&self, iova: u64, data: &[u8]) -> Result<(), String> {
        self.with_range(iova, data.len(), |s| s.copy_from(data))
    }
}

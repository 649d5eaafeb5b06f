//! The borrower's DMA maps as the lender of a mediated function reads and writes them
//! ([`super::link::GuestMemory`]): every access is checked to lie inside one map, and
//! copied with volatile copies (the guest may write its memory at any time).

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use super::dma::GuestMap;
use super::link::GuestMemory;

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

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    fn map(iova: u64, size: usize) -> (std::fs::File, GuestMap) {
        let f = tempfile::tempfile().expect("tempfile");
        f.set_len(size as u64).expect("set_len");
        let ptr = crate::shared_map::map_shared(f.as_raw_fd(), size, 0).expect("mmap");
        let file = f.try_clone().expect("dup");
        (
            f,
            GuestMap {
                reg: None,
                iova,
                size,
                ptr,
                sync: crate::pci::dma::MapSync::Mediated,
                file,
                file_end: size as u64,
                sealed: false,
            },
        )
    }

    #[test]
    fn the_lender_reaches_only_the_dma_maps() {
        let m = Maps::default();
        assert!(!m.mediated());
        m.set_mediated(true);
        let (_f1, a) = map(0x10_0000, 0x2000);
        let (_f2, b) = map(0x20_0000, 0x1000);
        m.lock().unwrap().extend([a, b]);
        m.write(0x10_1ff0, &[7; 16]).expect("inside the first map");
        let mut buf = [0u8; 16];
        m.read(0x10_1ff0, &mut buf).expect("read back");
        assert_eq!(buf, [7; 16]);
        // Across the end of a map, into the gap, across two maps, wrapping.
        assert!(m.write(0x10_1ff8, &[1; 16]).is_err());
        assert!(m.read(0x18_0000, &mut buf).is_err());
        let mut big = vec![0u8; 0x10_1000];
        assert!(m.read(0x10_0000, &mut big).is_err());
        assert!(m.write(u64::MAX - 4, &[1; 16]).is_err());
        m.write(0x20_0000, &[9; 4096])
            .expect("the whole second map");
        // A file shrunk under its map: refused, not touched (SIGBUS).
        _f2.set_len(0).expect("truncate");
        assert!(m.write(0x20_0000, &[9; 16]).is_err());
        assert!(
            m.read(0x10_0000, &mut buf).is_ok(),
            "the other map is whole"
        );
    }
}

//! The VMM's memory mapped for DMA: one [`GuestMap`] per DMA_MAP, with the shadow of
//! the lender's mirror, and the map and unmap requests that make and drop them here and
//! on the lender.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::PoisonError;

use devlend_fabric::pci::{
    DmaRange, Message, RemoteDmaRange, INFO_MEDIATED, KIND_DMA_MAP, KIND_DMA_UNMAP, MIRROR_PAGE,
};
use vm_memory::VolatileSlice;

use super::{einval, link, link_err, PciBorrower, MAX_DMA_MAPS};

/// How one DMA map is kept coherent with the lender ([`Coherence`], per map).
pub(super) enum MapSync {
    /// The lender keeps a mirror of the map: this is what the mirror holds, as far as
    /// the borrower knows (as long as the map).
    Mirror {
        /// The mirror's contents.
        shadow: Vec<u8>,
    },
    /// The lender mediates the function and moves guest memory itself: no shadow.
    Mediated,
}

/// One DMA mapping of the VMM's memory.
pub(super) struct GuestMap {
    /// Over RDMA, the mapping's registration (dropped before the mapping).
    pub(super) reg: Option<link::Registration>,
    pub(super) iova: u64,
    pub(super) size: usize,
    pub(super) ptr: NonNull<u8>,
    /// How this map is kept coherent with the lender.
    pub(super) sync: MapSync,
    /// The VMM's file, and the end of the mapped range in it (bytes).
    pub(super) file: File,
    pub(super) file_end: u64,
    /// Whether the file cannot shrink (F_SEAL_SHRINK).
    pub(super) sealed: bool,
}

// SAFETY: the mapping belongs to this GuestMap alone and is touched only through
// volatile copies (the guest may write it at any time).
unsafe impl Send for GuestMap {}

impl GuestMap {
    /// Whether the VMM's file still covers the whole mapping: a shared mapping touched
    /// past its file's end raises SIGBUS, and a VMM may shrink its file after DMA_MAP.
    /// Checked before every pass over guest memory; a sealed file cannot shrink.
    pub(super) fn intact(&self) -> bool {
        self.sealed || self.file.metadata().is_ok_and(|m| m.len() >= self.file_end)
    }

    pub(super) fn slice(&self) -> VolatileSlice<'_> {
        // SAFETY: `ptr..ptr + size` is our live mapping while `self` lives.
        unsafe { VolatileSlice::new(self.ptr.as_ptr(), self.size) }
    }

    pub(super) fn overlaps(&self, iova: u64, size: u64) -> bool {
        iova < self.iova + self.size as u64 && self.iova < iova.saturating_add(size)
    }
}

impl Drop for GuestMap {
    fn drop(&mut self) {
        drop(self.reg.take());
        // SAFETY: our own mapping, of this size; its registration is gone.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.size);
        }
    }
}
/// Makes sure the VMM's memory file cannot shrink under a DMA map: it is sealed against
/// shrinking already (QEMU's memfd backend seals its files), or the seal can be added
/// (a memfd created with MFD_ALLOW_SEALING). Otherwise (a plain file, hugetlbfs) the
/// map's [`GuestMap::intact`] checks the file's size before each pass.
fn seal_shrink(f: &File) -> bool {
    // SAFETY: fcntl on an open fd we own, with integer arguments only.
    let seals = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
    if seals >= 0 && seals & libc::F_SEAL_SHRINK != 0 {
        return true;
    }
    // SAFETY: as above.
    seals >= 0 && unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0
}

/// The refusal of a pass over a map whose file shrank under it.
pub(super) fn shrunk(m: &GuestMap) -> io::Error {
    einval(format!(
        "the VMM's memory file behind DMA map {:#x}+{:#x} shrank below the mapped range; \
         its memory is not touched",
        m.iova, m.size
    ))
}

impl PciBorrower {
    /// Maps `size` bytes of the VMM's file `fd` at `offset` for DMA at IOVA `address`,
    /// here and on the lender (vfio-user's DMA_MAP).
    pub(super) fn map_dma(
        &self,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> io::Result<()> {
        let Some(fd) = fd else {
            return Err(einval(
                "DMA_MAP without a file descriptor (DMA_READ/DMA_WRITE are not supported)",
            ));
        };
        let r = DmaRange {
            iova: address,
            size,
        };
        // The lender checks too; checking here first keeps a bad map from mmap.
        DmaRange::decode(&r.encode()).map_err(|_| {
            einval(format!(
                "DMA range {address:#x}+{size:#x} is not page-aligned"
            ))
        })?;
        if !offset.is_multiple_of(MIRROR_PAGE) {
            return Err(einval("DMA_MAP offset is not page-aligned"));
        }
        let len = usize::try_from(size).map_err(|_| einval("DMA range too large"))?;
        let file_off = libc::off_t::try_from(offset).map_err(|_| einval("DMA_MAP offset"))?;
        let mut maps = self
            .shared
            .maps
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = maps.iter().find(|m| m.overlaps(address, size)) {
            return Err(einval(format!(
                "DMA range {address:#x}+{size:#x} overlaps the mapped {:#x}+{:#x}",
                m.iova, m.size
            )));
        }
        if maps.len() >= MAX_DMA_MAPS as usize {
            // ENOSPC, as VFIO's type1 IOMMU answers past its dma_entry_limit.
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "DMA range {address:#x}+{size:#x}: the VMM holds {MAX_DMA_MAPS} DMA maps already, the most it may (max_dma_maps)"
                ),
            ));
        }
        // Before mapping or allocating anything: within the mirror limit, and within the
        // VMM's file (reading a shared mapping past the file's end raises SIGBUS).
        let mapped: u64 = maps.iter().map(|m| m.size as u64).sum();
        if mapped.saturating_add(size) > devlend_fabric::pci::MAX_MIRROR_BYTES {
            return Err(einval(format!(
                "DMA range {address:#x}+{size:#x} passes the mirror limit of {:#x} bytes",
                devlend_fabric::pci::MAX_MIRROR_BYTES
            )));
        }
        let file_len = fd.metadata()?.len();
        if offset.checked_add(size).is_none_or(|end| end > file_len) {
            return Err(einval(format!(
                "DMA_MAP of {size:#x} bytes at offset {offset:#x} passes the end of the VMM's file ({file_len:#x} bytes)"
            )));
        }
        let ptr = crate::shared_map::map_shared(fd.as_raw_fd(), len, file_off)?;
        let mediated = self.shared.info.flags & INFO_MEDIATED != 0;
        let sealed = seal_shrink(&fd);
        let mut map = GuestMap {
            reg: None,
            iova: address,
            size: len,
            ptr,
            sync: if mediated {
                MapSync::Mediated
            } else {
                MapSync::Mirror {
                    shadow: vec![0; len],
                }
            },
            file: fd,
            file_end: offset + size,
            sealed,
        };
        // SAFETY: the mapping lives in `map`, which drops the registration first.
        map.reg = unsafe { self.shared.link.register(ptr.as_ptr(), len) }.map_err(link_err)?;
        let payload = match &map.reg {
            Some(reg) => {
                let (addr, rkey) = reg.remote();
                RemoteDmaRange {
                    range: r,
                    addr,
                    rkey,
                }
                .encode()
            }
            None => r.encode(),
        };
        if !mediated {
            self.shared
                .link
                .call(Message::new(KIND_DMA_MAP, payload))
                .map_err(link_err)?;
            maps.push(map);
            return Ok(());
        }
        // Mapped here before the lender knows of it (its accesses come from the reader
        // thread, which takes `maps`): the map is in place for the first of them, and
        // `maps` is not held across the call.
        maps.push(map);
        drop(maps);
        if let Err(e) = self.shared.link.call(Message::new(KIND_DMA_MAP, payload)) {
            self.shared
                .maps
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .retain(|m| !(m.iova == address && m.size == len));
            return Err(link_err(e));
        }
        Ok(())
    }

    /// Drops the map `address`+`size`, or every map (vfio-user's DMA_UNMAP).
    pub(super) fn unmap_dma(&self, all: bool, address: u64, size: u64) -> io::Result<()> {
        if all {
            return self.unmap_all();
        }
        let known = self
            .shared
            .maps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|m| m.iova == address && m.size as u64 == size);
        if !known {
            return Err(einval(format!(
                "DMA range {address:#x}+{size:#x} is not mapped as such"
            )));
        }
        self.unmap_one(DmaRange {
            iova: address,
            size,
        })
    }

    pub(super) fn unmap_all(&self) -> io::Result<()> {
        let ranges: Vec<DmaRange> = self
            .shared
            .maps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|m| DmaRange {
                iova: m.iova,
                size: m.size as u64,
            })
            .collect();
        for r in ranges {
            self.unmap_one(r)?;
        }
        Ok(())
    }

    /// Has the lender unmap `r`, then drops the map here (not before: the lender's
    /// writes sent before its reply are applied to it, in stream order).
    fn unmap_one(&self, r: DmaRange) -> io::Result<()> {
        self.shared
            .link
            .call(Message::new(KIND_DMA_UNMAP, r.encode()))
            .map_err(link_err)?;
        self.shared
            .maps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|m| !(m.iova == r.iova && m.size as u64 == r.size));
        Ok(())
    }
}

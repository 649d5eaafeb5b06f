//! Lender memory that the function reaches by DMA: the shadow queues and the bounce
//! buffers. Each [`DmaBuf`] is anonymous shared memory mapped into the function's IOMMU
//! domain at an IOVA of the lender's choosing (the guest's IOVAs are not mapped in
//! coherence mode `nvme`), unmapped before it is freed. The function may write it at
//! any time: it is touched only through volatile copies.

use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use vfio_ioctls::VfioContainer;
use vm_memory::VolatileSlice;

use super::spec::PAGE;

/// One mapped buffer.
pub(crate) struct DmaBuf {
    /// IOVA of the first byte in the function's domain.
    pub(crate) iova: u64,
    /// Bytes (a multiple of [`PAGE`]).
    pub(crate) size: usize,
    ptr: NonNull<u8>,
    container: Arc<VfioContainer>,
}

// SAFETY: the mapping belongs to the DmaBuf alone and is accessed only through volatile
// copies; moving it to another thread moves that ownership.
unsafe impl Send for DmaBuf {}

impl DmaBuf {
    /// Allocates `size` zeroed bytes and maps them at `iova` for the function.
    ///
    /// # Errors
    /// The kernel's (mmap, VFIO_IOMMU_MAP_DMA).
    pub(crate) fn new(
        container: &Arc<VfioContainer>,
        iova: u64,
        size: usize,
    ) -> io::Result<DmaBuf> {
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?;
        // SAFETY: the mapping stays alive until Drop, which unmaps it from the IOMMU
        // first (and keeps it when that fails).
        let mapped = unsafe { container.vfio_dma_map(iova, size, ptr.as_ptr()) };
        if let Err(e) = mapped {
            // SAFETY: our own mapping, never given to the IOMMU.
            unsafe { libc::munmap(p, size) };
            return Err(io::Error::other(format!(
                "VFIO_IOMMU_MAP_DMA at {iova:#x}: {e}"
            )));
        }
        Ok(DmaBuf {
            iova,
            size,
            ptr,
            container: Arc::clone(container),
        })
    }

    fn slice(&self) -> VolatileSlice<'_> {
        // SAFETY: `ptr..ptr + size` is our live mapping for the lifetime of `self`.
        unsafe { VolatileSlice::new(self.ptr.as_ptr(), self.size) }
    }

    /// Copies `buf.len()` bytes at `off` out (a range past the end reads nothing).
    pub(crate) fn read(&self, off: usize, buf: &mut [u8]) {
        if let Ok(s) = self.slice().subslice(off, buf.len()) {
            s.copy_to(buf);
        }
    }

    /// Copies `data` in at `off` (a range past the end writes nothing).
    pub(crate) fn write(&self, off: usize, data: &[u8]) {
        if let Ok(s) = self.slice().subslice(off, data.len()) {
            s.copy_from(data);
        }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        if let Err(e) = self.container.vfio_dma_unmap(self.iova, self.size) {
            // The IOMMU may still point at the memory: keep it rather than free memory
            // the function may write.
            tracing::error!(iova = self.iova, error = %e, "cannot unmap a shadow buffer; its memory is kept");
            return;
        }
        // SAFETY: our own mapping, of this size, no longer reachable by the function.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.size);
        }
    }
}

/// Which pages of an arena are taken; runs of contiguous pages are given out first fit.
#[derive(Debug)]
pub(crate) struct Pages(Vec<bool>);

impl Pages {
    /// `n` free pages.
    pub(crate) fn new(n: usize) -> Pages {
        Pages(vec![false; n])
    }

    /// `n` contiguous free pages: the index of the first, or `None` when no run is free.
    pub(crate) fn alloc(&mut self, n: usize) -> Option<usize> {
        if n == 0 || n > self.0.len() {
            return None;
        }
        let mut run = 0;
        for i in 0..self.0.len() {
            run = if self.0[i] { 0 } else { run + 1 };
            if run == n {
                let first = i + 1 - n;
                self.0[first..=i].iter_mut().for_each(|u| *u = true);
                return Some(first);
            }
        }
        None
    }

    /// Gives back pages `first..first + n` (pages out of range are ignored).
    pub(crate) fn free(&mut self, first: usize, n: usize) {
        let end = first.saturating_add(n).min(self.0.len());
        if let Some(r) = self.0.get_mut(first.min(end)..end) {
            r.iter_mut().for_each(|u| *u = false);
        }
    }
}

/// The bounce buffers: one [`DmaBuf`] cut into pages, given out in contiguous runs.
pub(crate) struct Arena {
    /// The memory.
    pub(crate) buf: DmaBuf,
    pages: Pages,
}

impl Arena {
    /// An arena of `pages` pages at `iova`.
    ///
    /// # Errors
    /// As [`DmaBuf::new`].
    pub(crate) fn new(
        container: &Arc<VfioContainer>,
        iova: u64,
        pages: usize,
    ) -> io::Result<Arena> {
        Ok(Arena {
            buf: DmaBuf::new(container, iova, pages * PAGE)?,
            pages: Pages::new(pages),
        })
    }

    /// As [`Pages::alloc`].
    pub(crate) fn alloc(&mut self, n: usize) -> Option<usize> {
        self.pages.alloc(n)
    }

    /// As [`Pages::free`].
    pub(crate) fn free(&mut self, first: usize, n: usize) {
        self.pages.free(first, n);
    }

    /// IOVA of page `i`.
    pub(crate) fn iova(&self, i: usize) -> u64 {
        self.buf.iova + (i * PAGE) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::Pages;

    #[test]
    fn runs_are_given_first_fit_and_come_back() {
        let mut p = Pages::new(8);
        assert_eq!(p.alloc(3), Some(0));
        assert_eq!(p.alloc(3), Some(3));
        assert_eq!(p.alloc(3), None, "two pages left");
        p.free(0, 3);
        assert_eq!(p.alloc(2), Some(0));
        assert_eq!(p.alloc(2), Some(6));
        assert_eq!(p.alloc(1), Some(2));
        assert_eq!(p.alloc(1), None);
        assert_eq!(p.alloc(0), None);
        assert_eq!(p.alloc(9), None);
        p.free(5, 100);
        assert_eq!(p.alloc(3), Some(5));
    }
}

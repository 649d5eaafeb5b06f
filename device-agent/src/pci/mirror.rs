//! The DMA mirror of one mapped IOVA range: memory the function reads and writes by DMA
//! on the lender, standing in for the borrower's guest memory.
//!
//! The mirror is anonymous shared memory mapped into the function's IOMMU domain at the
//! borrower's IOVA. Beside it the lender keeps `synced`, a private copy of what the
//! borrower's memory holds as far as the lender knows (what was last pushed or pulled).
//! A pull compares the mirror with `synced` page by page ([`MIRROR_PAGE`]) and returns
//! the pages that differ: its cost is one `memcmp` of the whole mapped size per pull,
//! and twice the mapped size in memory.
//!
//! The function may write the mirror at any time, so the mirror is only ever touched
//! through [`VolatileSlice`] copies, never through a Rust reference.

use std::io;
use std::ptr::NonNull;

use devlend_fabric::pci::{changed_runs, MIRROR_PAGE};
use vm_memory::VolatileSlice;

/// A mirror's registration and the borrower's guest memory behind its range.
#[cfg(feature = "rdma")]
pub(crate) struct Remote {
    /// The mirror, registered for local access (RDMA READ lands in it, WRITE reads it).
    pub(crate) mr: devlend_fabric::rdma::verbs::Mr,
    /// Borrower virtual address of the range's first byte.
    pub(crate) addr: u64,
    /// The borrower's memory region key.
    pub(crate) rkey: u32,
}

/// One mapped range and its mirror.
pub(crate) struct Mirror {
    /// First IOVA.
    pub(crate) iova: u64,
    /// Length in bytes (a multiple of [`MIRROR_PAGE`]).
    pub(crate) size: usize,
    ptr: NonNull<u8>,
    synced: Vec<u8>,
    /// Over RDMA: the mirror's registration and where the borrower's guest memory
    /// behind this range is (set by the RDMA session right after the map).
    #[cfg(feature = "rdma")]
    pub(crate) remote: Option<Remote>,
}

// SAFETY: the mapping belongs to the Mirror alone and is accessed only through volatile
// copies; moving it to another thread moves that ownership.
unsafe impl Send for Mirror {}

impl Mirror {
    /// Allocates a zeroed mirror of `size` bytes for `iova` (reserved lazily: untouched
    /// pages cost no memory).
    ///
    /// # Errors
    /// The kernel's, e.g. `ENOMEM`.
    pub(crate) fn new(iova: u64, size: usize) -> io::Result<Mirror> {
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?;
        Ok(Mirror {
            iova,
            size,
            ptr,
            synced: vec![0; size],
            #[cfg(feature = "rdma")]
            remote: None,
        })
    }

    /// The mirror's address, for VFIO_IOMMU_MAP_DMA.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn slice(&self) -> VolatileSlice<'_> {
        // SAFETY: `ptr..ptr + size` is our live mapping for the lifetime of `self`.
        unsafe { VolatileSlice::new(self.ptr.as_ptr(), self.size) }
    }

    /// Whether `iova..iova + len` lies inside this range.
    pub(crate) fn contains(&self, iova: u64, len: u64) -> bool {
        iova >= self.iova
            && iova
                .checked_add(len)
                .is_some_and(|end| end <= self.iova + self.size as u64)
    }

    /// Whether `iova..iova + size` overlaps this range.
    pub(crate) fn overlaps(&self, iova: u64, size: u64) -> bool {
        iova < self.iova + self.size as u64 && self.iova < iova.saturating_add(size)
    }

    /// Stores pushed guest memory at `iova` (which [`Mirror::contains`] must accept for
    /// `data.len()`), in the mirror and in the synced copy.
    pub(crate) fn push(&mut self, iova: u64, data: &[u8]) {
        let off = (iova - self.iova) as usize;
        if let Ok(s) = self.slice().subslice(off, data.len()) {
            s.copy_from(data);
        }
        self.synced[off..off + data.len()].copy_from_slice(data);
    }

    /// Calls `out(iova, bytes)` for each run of bytes the function changed since they
    /// were last pushed or pulled (within a page, exactly those bytes:
    /// [`changed_runs`]), and takes them as synced.
    pub(crate) fn pull(&mut self, mut out: impl FnMut(u64, &[u8])) {
        let page = MIRROR_PAGE as usize;
        let mut buf = vec![0u8; page];
        // SAFETY: as in `slice`; built from the raw parts so that `synced` may be
        // borrowed beside it.
        let slice = unsafe { VolatileSlice::new(self.ptr.as_ptr(), self.size) };
        for off in (0..self.size).step_by(page) {
            let Ok(s) = slice.subslice(off, page) else {
                break;
            };
            s.copy_to(&mut buf[..]);
            let synced = &mut self.synced[off..off + page];
            if synced != buf.as_slice() {
                // Only the bytes the function changed: the guest may have written
                // others of the page since the last push, which a whole page would undo.
                changed_runs(synced, &buf, |o, n| {
                    out(self.iova + (off + o) as u64, &buf[o..o + n]);
                });
                synced.copy_from_slice(&buf);
            }
        }
    }

    /// Calls `out(offset, len)` for each run of consecutive bytes (at most `max_run`)
    /// that the function changed since they were last pushed or pulled, and takes them
    /// as synced. Same comparison, and cost, as
    /// [`Mirror::pull`]; the caller moves the bytes (RDMA WRITE from the mirror).
    #[cfg(feature = "rdma")]
    pub(crate) fn changed_runs(&mut self, max_run: usize, mut out: impl FnMut(usize, usize)) {
        let base = self.iova;
        let mut run: Option<(usize, usize)> = None;
        self.pull(|iova, bytes| {
            let (off, n) = ((iova - base) as usize, bytes.len());
            run = match run {
                Some((start, len)) if start + len == off && len + n <= max_run => {
                    Some((start, len + n))
                }
                Some((start, len)) => {
                    out(start, len);
                    Some((off, n))
                }
                None => Some((off, n)),
            };
        });
        if let Some((start, len)) = run {
            out(start, len);
        }
    }

    /// Takes `len` bytes at `off` of the mirror as synced (after an RDMA READ of guest
    /// memory into them).
    #[cfg(feature = "rdma")]
    pub(crate) fn synced_from_mirror(&mut self, off: usize, len: usize) {
        // SAFETY: as in `slice`; built from the raw parts so that `synced` may be
        // borrowed beside it.
        let slice = unsafe { VolatileSlice::new(self.ptr.as_ptr(), self.size) };
        if let (Ok(s), Some(dst)) = (
            slice.subslice(off, len),
            self.synced.get_mut(off..off + len),
        ) {
            s.copy_to(dst);
        }
    }

    /// Copies `len` bytes at `off` of the mirror out (for tests).
    #[cfg(test)]
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        if let Ok(s) = self.slice().subslice(off, len) {
            s.copy_to(&mut v[..]);
        }
        v
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        // The memory region goes before the memory.
        #[cfg(feature = "rdma")]
        drop(self.remote.take());
        // SAFETY: our own mapping, of this size; the IOMMU mapping was removed first by
        // the owner (or never made), so no device writes into it after this.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_returns_only_the_pages_that_changed() {
        let mut m = Mirror::new(0x10_0000, 4 * 4096).unwrap();
        m.push(0x10_1000, &[7; 4096]);
        assert_eq!(m.read(4096, 2), vec![7, 7]);
        let mut pulled = Vec::new();
        m.pull(|iova, d| pulled.push((iova, d.to_vec())));
        assert!(pulled.is_empty(), "a push is synced");
        // The "device" writes page 2.
        let s = m.slice().subslice(2 * 4096 + 5, 3).unwrap();
        s.copy_from(&[1u8, 2, 3][..]);
        m.pull(|iova, d| pulled.push((iova, d.to_vec())));
        assert_eq!(
            pulled,
            [(0x10_2005, vec![1, 2, 3])],
            "the bytes that changed"
        );
        pulled.clear();
        m.pull(|iova, d| pulled.push((iova, d.to_vec())));
        assert!(pulled.is_empty());
        // A push of other bytes of a page the function wrote, not yet pulled (a driver
        // filling descriptor 0 while the device writes descriptor 2 back): the
        // function's bytes stay, and the next pull has them.
        m.slice()
            .subslice(3 * 4096 + 32, 2)
            .unwrap()
            .copy_from(&[5u8, 5][..]);
        m.push(0x10_3000, &[6; 16]);
        m.pull(|iova, d| pulled.push((iova, d.to_vec())));
        assert_eq!(pulled, [(0x10_3020, vec![5, 5])]);
        assert_eq!(m.read(3 * 4096, 2), vec![6, 6]);
        pulled.clear();
        assert!(m.contains(0x10_3000, 4096) && !m.contains(0x10_3000, 4097));
        assert!(m.overlaps(0x0f_f000, 0x2000) && !m.overlaps(0x14_0000, 0x1000));
    }

    #[cfg(feature = "rdma")]
    #[test]
    fn changed_runs_coalesce_neighbours_up_to_the_limit() {
        let mut m = Mirror::new(0x10_0000, 8 * 4096).unwrap();
        for page in [1usize, 2, 3, 5] {
            m.slice()
                .subslice(page * 4096, 4096)
                .unwrap()
                .copy_from(&[9u8; 4096][..]);
        }
        let mut runs = Vec::new();
        m.changed_runs(2 * 4096, |off, len| runs.push((off, len)));
        assert_eq!(
            runs,
            vec![(4096, 8192), (3 * 4096, 4096), (5 * 4096, 4096)],
            "pages 1-2 in one run (the limit), then 3, then 5"
        );
        runs.clear();
        m.changed_runs(1 << 20, |off, len| runs.push((off, len)));
        assert!(runs.is_empty(), "taken as synced");
        // Two bytes apart in one page: two runs, the byte between them not moved.
        m.slice()
            .subslice(6 * 4096 + 10, 3)
            .unwrap()
            .copy_from(&[1u8, 0, 1][..]);
        m.changed_runs(1 << 20, |off, len| runs.push((off, len)));
        assert_eq!(runs, [(6 * 4096 + 10, 1), (6 * 4096 + 12, 1)]);
        runs.clear();
        // A READ landed in page 7: taken as synced, not reported by the next pull.
        m.slice()
            .subslice(7 * 4096, 2)
            .unwrap()
            .copy_from(&[4u8, 4][..]);
        m.synced_from_mirror(7 * 4096, 4096);
        m.changed_runs(1 << 20, |off, len| runs.push((off, len)));
        assert!(runs.is_empty());
    }
}

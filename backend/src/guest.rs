//! Guest memory as host I/O vectors.
//!
//! A guest buffer is a guest-physical range that may cross memory regions (each region
//! is its own mapping, e.g. its own memfd). [`gather`] turns a range into host iovecs,
//! one per region it touches, so a buffer contiguous in guest-physical space is never
//! treated as one host pointer.
//!
//! Dirty-page logging (vhost-user spec, "Migration", "Dirty pages logging"): each
//! region carries a [`BitmapMmapRegion`], which the library points at the frontend's log
//! on SET_LOG_BASE. Writes through vm-memory (the used ring, a status byte stored with
//! `write_obj`, a NIC's receive buffers written through virtio-queue's `Writer`) mark
//! it themselves; writes that bypass vm-memory (a socket read straight into a
//! [`HostIov`], a lender's RDMA WRITE) are marked with [`mark_dirty`] or
//! [`mark_iovs_dirty`] once the data is in.

use std::sync::Arc;

use vhost_user_backend::bitmap::BitmapMmapRegion;
use vm_memory::bitmap::Bitmap;
use vm_memory::{Address, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// The guest memory map a backend works on. Each region's bitmap logs the pages written
/// (4 KiB log pages, one bit each) while the frontend has given a dirty log
/// (SET_LOG_BASE); without one, marking a page costs a read lock and nothing else.
pub type GuestMemory = GuestMemoryMmap<BitmapMmapRegion>;

/// The library's vring over [`GuestMemory`] (its default is over `GuestMemoryMmap<()>`).
pub type Vring = vhost_user_backend::VringRwLock<vm_memory::GuestMemoryAtomic<GuestMemory>>;

/// A snapshot of the guest memory map, kept alive by every request that points into it.
pub type GuestMemoryRef = Arc<GuestMemory>;

/// A host virtual address range inside a mapped guest memory region.
///
/// Valid while the [`GuestMemoryRef`] it was gathered from is alive; the owner keeps that
/// `Arc` beside it.
#[derive(Debug, Clone, Copy)]
pub struct HostIov {
    /// Host address of the first byte.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

// SAFETY: a HostIov is a plain address range into a shared mapping of guest memory; it
// carries no thread affinity. Whoever dereferences it keeps the mapping alive (see the
// type's docs) and accesses it with volatile/syscall semantics only.
unsafe impl Send for HostIov {}

impl HostIov {
    /// As a `libc::iovec` for vectored syscalls.
    pub fn as_iovec(&self) -> libc::iovec {
        libc::iovec {
            iov_base: self.ptr.cast(),
            iov_len: self.len,
        }
    }
}

/// Appends to `out` the host iovecs that cover `len` bytes of guest memory at `addr`.
///
/// Returns `false`, leaving `out` with a partial list that the caller must discard, when
/// any byte of the range is outside guest memory (including an overflowing end address).
pub fn gather(mem: &GuestMemory, addr: GuestAddress, len: usize, out: &mut Vec<HostIov>) -> bool {
    if len == 0 {
        return true;
    }
    if addr.0.checked_add(len as u64 - 1).is_none() {
        return false;
    }
    let mut total = 0usize;
    for slice in GuestMemoryBackend::get_slices(mem, addr, len) {
        match slice {
            Ok(s) => {
                total += s.len();
                out.push(HostIov {
                    ptr: s.ptr_guard_mut().as_ptr(),
                    len: s.len(),
                });
            }
            Err(_) => return false,
        }
    }
    total == len
}

/// Marks `len` bytes of guest memory at guest-physical `addr` as written in the dirty
/// log (vhost-user spec, "Migration", "Dirty pages logging"), for a write that did not go
/// through vm-memory. Regions without a log, and bytes outside guest memory, are left
/// alone; a range crossing regions is marked in each.
///
/// Call it after the write: a page marked before it could be copied by the frontend
/// between the mark and the write.
pub fn mark_dirty(mem: &GuestMemory, addr: GuestAddress, len: usize) {
    let mut addr = addr;
    let mut left = len as u64;
    while left > 0 {
        let Some(region) = mem.find_region(addr) else {
            return;
        };
        let offset = addr.unchecked_offset_from(region.start_addr());
        let n = (region.len() - offset).min(left);
        region.bitmap().mark_dirty(offset as usize, n as usize);
        left -= n;
        match addr.checked_add(n) {
            Some(next) => addr = next,
            None => return,
        }
    }
}

/// Marks the guest pages under `iovs` as written in the dirty log (vhost-user spec,
/// "Migration"), for data a socket read or a lender's RDMA WRITE put there. Each iovec
/// must come from [`gather`] on `mem` (it lies in one region); one that lies in no
/// region of `mem` is skipped.
///
/// Cost without a log: per iovec, a scan of the regions and a read lock.
pub fn mark_iovs_dirty(mem: &GuestMemory, iovs: &[HostIov]) {
    for iov in iovs {
        let p = iov.ptr as usize;
        let found = mem.iter().find_map(|r| {
            let base = r.as_ptr() as usize;
            let offset = p.checked_sub(base)?;
            (offset < r.len() as usize).then_some((r, offset))
        });
        if let Some((region, offset)) = found {
            region.bitmap().mark_dirty(offset, iov.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    use vhost_user_backend::bitmap::{
        AtomicBitmapMmap, BitmapReplace, MemRegionBitmap, MmapLogReg,
    };

    const PAGE: u64 = 4096;
    const MIB: u64 = 1 << 20;

    /// Two 1 MiB regions at 0 and 1 MiB, logging into a file as SET_LOG_BASE sets it up.
    fn logged() -> (GuestMemory, std::fs::File) {
        let mem = GuestMemory::from_ranges(&[
            (GuestAddress(0), MIB as usize),
            (GuestAddress(MIB), MIB as usize),
        ])
        .expect("memory");
        let file = tempfile::tempfile().expect("log file");
        file.set_len(4096).expect("log size");
        let log = Arc::new(MmapLogReg::from_file(file.as_fd(), 0, 4096).expect("log map"));
        for r in mem.iter() {
            // The region's own bitmap (the trait's `bitmap()` is a slice of it).
            vm_memory::MmapRegion::<BitmapMmapRegion>::bitmap(r)
                .replace(AtomicBitmapMmap::new(r, Arc::clone(&log)).expect("bitmap"));
        }
        (mem, file)
    }

    fn dirty_pages(file: &std::fs::File) -> Vec<u64> {
        let mut bits = vec![0u8; 64];
        file.read_exact_at(&mut bits, 0).expect("read log");
        (0..512u64)
            .filter(|p| bits[(p / 8) as usize] & (1 << (p % 8)) != 0)
            .map(|p| p * PAGE)
            .collect()
    }

    #[test]
    fn mark_dirty_marks_every_page_of_a_range_across_regions() {
        let (mem, file) = logged();
        mark_dirty(&mem, GuestAddress(MIB - PAGE - 1), PAGE as usize + 2);
        assert_eq!(dirty_pages(&file), [MIB - 2 * PAGE, MIB - PAGE, MIB]);
        // Outside guest memory: nothing, and no panic.
        mark_dirty(&mem, GuestAddress(2 * MIB), 10);
        mark_dirty(&mem, GuestAddress(u64::MAX - 1), 10);
        assert_eq!(dirty_pages(&file).len(), 3);
    }

    #[test]
    fn mark_iovs_dirty_marks_the_guest_pages_under_host_iovecs() {
        let (mem, file) = logged();
        let mut iovs = Vec::new();
        assert!(gather(
            &mem,
            GuestAddress(MIB - 10),
            20 + PAGE as usize,
            &mut iovs
        ));
        assert_eq!(iovs.len(), 2, "one iovec per region");
        mark_iovs_dirty(&mem, &iovs);
        assert_eq!(dirty_pages(&file), [MIB - PAGE, MIB, MIB + PAGE]);
        // An iovec in no region of the map is skipped.
        let mut outside = [0u8; 8];
        mark_iovs_dirty(
            &mem,
            &[HostIov {
                ptr: outside.as_mut_ptr(),
                len: 8,
            }],
        );
        assert_eq!(dirty_pages(&file).len(), 3);
    }
}

//! Guest memory as host I/O vectors.
//!
//! A guest buffer is a guest-physical range that may cross memory regions (each region
//! is its own mapping, e.g. its own memfd). [`gather`] turns a range into host iovecs,
//! one per region it touches, so a buffer contiguous in guest-physical space is never
//! treated as one host pointer.

use std::sync::Arc;

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// The guest memory map a backend works on (no dirty-page bitmap).
pub type GuestMemory = GuestMemoryMmap<()>;

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

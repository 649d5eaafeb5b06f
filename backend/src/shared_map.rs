//! A shared, read-write mapping of part of a file the VMM passed (its memfd): the
//! vhost-user inflight buffer (GET/SET_INFLIGHT_FD) and a vfio-user DMA map.

use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;

/// Maps `len` bytes of `fd` from byte `offset` (page-aligned; the caller checked the
/// range lies within the file: reading a shared mapping past the file's end raises
/// SIGBUS), `PROT_READ | PROT_WRITE`, `MAP_SHARED`, at an address the kernel picks.
/// The caller owns the mapping and `munmap`s it.
///
/// # Errors
/// `mmap` failed (the OS error), or returned address 0.
pub(crate) fn map_shared(fd: RawFd, len: usize, offset: libc::off_t) -> io::Result<NonNull<u8>> {
    // SAFETY: a new shared mapping of an open fd; no existing memory is affected, and the
    // kernel picks the address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            offset,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))
}

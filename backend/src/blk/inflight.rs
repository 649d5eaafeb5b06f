//! Inflight I/O tracking: the shared buffer that lets a restarted backend resubmit the
//! descriptors its predecessor left in flight.
//!
//! The vhost-user protocol feature `INFLIGHT_SHMFD` (vhost-user spec, "Inflight I/O
//! tracking"; messages GET_INFLIGHT_FD and SET_INFLIGHT_FD): the backend allocates a
//! memfd, the frontend (QEMU) keeps it across backend restarts and hands it to the next
//! backend. For each virtqueue the buffer holds, in the split-virtqueue layout of the
//! spec (all little-endian):
//!
//! ```text
//! offset  size  field
//!      0     8  features         (unused, zero)
//!      8     2  version          (0: never used; 1: this layout)
//!     10     2  desc_num         (descriptor slots that follow)
//!     12     2  last_batch_head  (head of the last chain being returned)
//!     14     2  used_idx         (the used ring's index after that return)
//!     16  16*N  desc[N]: inflight u8, padding [u8; 5], next u16, counter u64
//! ```
//!
//! padded to a multiple of 64 bytes, queue after queue. A chain is marked in flight
//! (with an increasing counter) as soon as it is popped from the avail ring, and cleared
//! just after it is returned to the used ring. After a restart, the chains still marked
//! are exactly those popped and not returned: [`InflightQueue::recover`] lists them in
//! the order they were popped, and the avail index restarts at the used index plus their
//! number, which skips no chain and takes none twice.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use vhost::vhost_user::message::VhostUserInflight;

/// Bytes of one queue's header.
const HEADER_LEN: usize = 16;
/// Bytes of one descriptor's state.
const DESC_LEN: usize = 16;
/// Each queue's region is padded to this many bytes.
const ALIGN: usize = 64;
/// The layout version written into a fresh queue region.
const VERSION: u16 = 1;

/// Bytes of one queue's region for a queue of `queue_size` descriptors.
pub fn queue_region_len(queue_size: u16) -> usize {
    (HEADER_LEN + DESC_LEN * usize::from(queue_size)).div_ceil(ALIGN) * ALIGN
}

/// The mapped inflight buffer of one vhost-user device (all its queues).
#[derive(Debug)]
pub struct InflightRegion {
    ptr: NonNull<u8>,
    len: usize,
    num_queues: u16,
    queue_size: u16,
}

// SAFETY: the mapping is shared memory owned by this value until it is dropped; each
// queue's part is accessed only through its `InflightQueue`, which one worker uses at a
// time (behind the queue's engine mutex), with volatile accesses.
unsafe impl Send for InflightRegion {}
// SAFETY: as above; `&InflightRegion` only hands out queue handles.
unsafe impl Sync for InflightRegion {}

impl Drop for InflightRegion {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping made in `map`, unmapped only here.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Most queues and descriptors per queue a frontend may ask to track (the backend's own
/// limits).
pub const LIMITS: (u16, u16) = (crate::blk::spec::MAX_QUEUES, 1024);

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn check_shape(num_queues: u16, queue_size: u16) -> io::Result<usize> {
    if num_queues == 0 || num_queues > LIMITS.0 || queue_size == 0 || queue_size > LIMITS.1 {
        return Err(invalid(format!(
            "inflight buffer for {num_queues} queues of {queue_size} descriptors is outside 1..={} queues of 1..={} descriptors",
            LIMITS.0, LIMITS.1
        )));
    }
    Ok(usize::from(num_queues) * queue_region_len(queue_size))
}

/// Adds `seals` to `file` (fcntl F_ADD_SEALS).
fn add_seals(file: &File, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: fcntl on an fd `file` owns, with integer arguments only.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Makes sure `file` cannot shrink: it carries F_SEAL_SHRINK already, or takes it now.
fn seal_shrink(file: &File) -> io::Result<()> {
    // SAFETY: fcntl on an fd `file` owns, with integer arguments only.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals >= 0 && seals & libc::F_SEAL_SHRINK != 0 {
        return Ok(());
    }
    let why = if seals < 0 {
        io::Error::last_os_error()
    } else {
        match add_seals(file, libc::F_SEAL_SHRINK) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        }
    };
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "inflight buffer file cannot be sealed against shrinking ({why}): a frontend \
             could truncate it under the mapping; only a sealable memfd (such as the one \
             GET_INFLIGHT_FD returns) is taken"
        ),
    ))
}

impl InflightRegion {
    /// GET_INFLIGHT_FD: a new, zeroed buffer for `num_queues` queues of `queue_size`
    /// descriptors, in a memfd. Returns the reply's description (size in bytes, offset 0)
    /// and the memfd to send with it.
    ///
    /// # Errors
    /// A shape outside [`LIMITS`] (`InvalidInput`), or the memfd could not be made.
    pub fn create(
        num_queues: u16,
        queue_size: u16,
    ) -> io::Result<(Arc<Self>, VhostUserInflight, File)> {
        let len = check_shape(num_queues, queue_size)?;
        // SAFETY: the name is a NUL-terminated string; the flags are valid.
        let fd = unsafe {
            libc::memfd_create(
                c"devlend-inflight".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64)?;
        // The frontend keeps this fd: sealed, it can neither shrink it under the mapping
        // (the next access would be a SIGBUS, fatal to the whole agent) nor unseal it.
        add_seals(
            &file,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )?;
        let region = Self::map(&file, 0, len, num_queues, queue_size)?;
        let msg = VhostUserInflight::new(len as u64, 0, num_queues, queue_size);
        Ok((region, msg, file))
    }

    /// SET_INFLIGHT_FD: maps the buffer the frontend kept (one this backend, or an earlier
    /// one, returned from GET_INFLIGHT_FD).
    ///
    /// The file must be sealed against shrinking, or take the seal now (a memfd made with
    /// MFD_ALLOW_SEALING and not F_SEAL_SEAL-ed): a frontend that truncated it under the
    /// mapping would turn the next request into a SIGBUS that kills the agent. Buffers
    /// made by GET_INFLIGHT_FD are sealed; any other file is refused, and the frontend
    /// can ask for a new buffer.
    ///
    /// # Errors
    /// A shape outside [`LIMITS`], a size too small for it, an offset that is not
    /// page-aligned (`InvalidInput`), a file that cannot be sealed against shrinking
    /// (`PermissionDenied`), or the mapping failed.
    pub fn open(msg: &VhostUserInflight, file: &File) -> io::Result<Arc<Self>> {
        let need = check_shape(msg.num_queues, msg.queue_size)?;
        if msg.mmap_size < need as u64 {
            return Err(invalid(format!(
                "inflight buffer of {} bytes is smaller than the {need} bytes {} queues of {} descriptors need",
                msg.mmap_size, msg.num_queues, msg.queue_size
            )));
        }
        let offset = i64::try_from(msg.mmap_offset)
            .ok()
            .filter(|o| o % 4096 == 0)
            .ok_or_else(|| {
                invalid(format!(
                    "inflight buffer offset {} is not page-aligned",
                    msg.mmap_offset
                ))
            })?;
        seal_shrink(file)?;
        let size = file.metadata()?.len();
        if msg
            .mmap_offset
            .checked_add(need as u64)
            .is_none_or(|end| end > size)
        {
            return Err(invalid(format!(
                "inflight buffer ({need} bytes at offset {}) runs past the end of its {size}-byte file",
                msg.mmap_offset
            )));
        }
        Self::map(file, offset, need, msg.num_queues, msg.queue_size)
    }

    fn map(
        file: &File,
        offset: i64,
        len: usize,
        num_queues: u16,
        queue_size: u16,
    ) -> io::Result<Arc<Self>> {
        // The offset was checked to be page-aligned and the range to lie within the file.
        let ptr = crate::shared_map::map_shared(file.as_raw_fd(), len, offset)?;
        Ok(Arc::new(InflightRegion {
            ptr,
            len,
            num_queues,
            queue_size,
        }))
    }

    /// Queues in the buffer.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// The handle of queue `index`'s part, or `None` past the last queue.
    pub fn queue(self: &Arc<Self>, index: u16) -> Option<InflightQueue> {
        if index >= self.num_queues {
            return None;
        }
        Some(InflightQueue {
            region: Arc::clone(self),
            offset: usize::from(index) * queue_region_len(self.queue_size),
            counter: 0,
            checked: false,
        })
    }
}

/// One virtqueue's part of the inflight buffer.
#[derive(Debug)]
pub struct InflightQueue {
    region: Arc<InflightRegion>,
    offset: usize,
    counter: u64,
    checked: bool,
}

impl InflightQueue {
    fn at(&self, off: usize) -> *mut u8 {
        debug_assert!(off < queue_region_len(self.region.queue_size));
        // SAFETY: callers pass offsets inside this queue's region (header fields, or
        // descriptor slots below `queue_size`), which lies inside the mapping.
        unsafe { self.region.ptr.as_ptr().add(self.offset + off) }
    }

    fn read_u16(&self, off: usize) -> u16 {
        // SAFETY: an in-bounds, 2-aligned (offsets are even, the mapping page-aligned)
        // field of the shared mapping; volatile, since another process may have written it.
        u16::from_le(unsafe { self.at(off).cast::<u16>().read_volatile() })
    }

    fn write_u16(&self, off: usize, v: u16) {
        // SAFETY: as in `read_u16`.
        unsafe { self.at(off).cast::<u16>().write_volatile(v.to_le()) }
    }

    fn desc(&self, head: u16) -> Option<usize> {
        (head < self.region.queue_size).then(|| HEADER_LEN + DESC_LEN * usize::from(head))
    }

    fn set_inflight(&self, head: u16, on: bool) {
        if let Some(d) = self.desc(head) {
            // SAFETY: the descriptor's `inflight` byte, inside the region.
            unsafe { self.at(d).write_volatile(u8::from(on)) }
        }
    }

    fn is_inflight(&self, head: u16) -> bool {
        // SAFETY: the descriptor's `inflight` byte, inside the region.
        self.desc(head)
            .is_some_and(|d| unsafe { self.at(d).read_volatile() } == 1)
    }

    fn counter_of(&self, head: u16) -> u64 {
        self.desc(head).map_or(0, |d| {
            // SAFETY: the descriptor's 8-aligned `counter`, inside the region.
            u64::from_le(unsafe { self.at(d + 8).cast::<u64>().read_volatile() })
        })
    }

    /// Whether [`Self::recover`] has run on this handle.
    pub fn checked(&self) -> bool {
        self.checked
    }

    /// Marks `head` in flight: call as soon as its chain is popped from the avail ring.
    pub fn mark(&mut self, head: u16) {
        let Some(d) = self.desc(head) else { return };
        self.counter = self.counter.wrapping_add(1);
        // SAFETY: the descriptor's 8-aligned `counter`, inside the region.
        unsafe {
            self.at(d + 8)
                .cast::<u64>()
                .write_volatile(self.counter.to_le())
        };
        fence(Ordering::Release);
        self.set_inflight(head, true);
    }

    /// Call just before `head` is added to the used ring.
    pub fn before_used(&mut self, head: u16) {
        self.write_u16(12, head);
        fence(Ordering::Release);
    }

    /// Call just after `head` was added to the used ring, whose index is now `used_idx`.
    pub fn after_used(&mut self, head: u16, used_idx: u16) {
        fence(Ordering::Release);
        self.set_inflight(head, false);
        fence(Ordering::Release);
        self.write_u16(14, used_idx);
    }

    /// Reads what an earlier backend left: the heads of the chains still in flight, in
    /// the order they were popped, given the used ring's index in guest memory now and
    /// the queue's size. A never-used region is initialized instead (nothing to
    /// resubmit). Heads at or past `queue_size` are ignored (the buffer is the
    /// frontend's; it is checked like guest input).
    pub fn recover(&mut self, guest_used_idx: u16, queue_size: u16) -> Vec<u16> {
        self.checked = true;
        let slots = self.region.queue_size.min(queue_size);
        if self.read_u16(8) != VERSION || self.read_u16(10) != self.region.queue_size {
            // Fresh (or not ours): start clean.
            for h in 0..self.region.queue_size {
                self.set_inflight(h, false);
            }
            self.write_u16(10, self.region.queue_size);
            self.write_u16(14, guest_used_idx);
            fence(Ordering::Release);
            self.write_u16(8, VERSION);
            return Vec::new();
        }
        if self.read_u16(14) != guest_used_idx {
            // The last return reached the used ring but not this buffer.
            let last = self.read_u16(12);
            self.set_inflight(last, false);
            self.write_u16(14, guest_used_idx);
        }
        let mut heads: Vec<(u64, u16)> = (0..slots)
            .filter(|&h| self.is_inflight(h))
            .map(|h| (self.counter_of(h), h))
            .collect();
        // Slots past the live queue's size cannot be resubmitted: clear them.
        for h in slots..self.region.queue_size {
            self.set_inflight(h, false);
        }
        heads.sort_unstable();
        self.counter = heads.last().map_or(0, |&(c, _)| c);
        heads.into_iter().map(|(_, h)| h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(q: u16, n: u16) -> (Arc<InflightRegion>, VhostUserInflight, File) {
        InflightRegion::create(q, n).expect("memfd")
    }

    #[test]
    fn layout_matches_the_spec() {
        assert_eq!(queue_region_len(128), 16 + 16 * 128 + 48);
        assert_eq!(queue_region_len(256) % 64, 0);
        let (_, msg, file) = region(2, 256);
        assert_eq!(msg.mmap_size, 2 * queue_region_len(256) as u64);
        assert_eq!(file.metadata().map(|m| m.len()).ok(), Some(msg.mmap_size));
    }

    #[test]
    fn fresh_region_resubmits_nothing_and_is_initialized() {
        let (r, _, _) = region(1, 8);
        let mut q = r.queue(0).expect("queue 0");
        assert!(q.recover(5, 8).is_empty());
        assert_eq!(q.read_u16(8), VERSION);
        assert_eq!(q.read_u16(10), 8);
        assert_eq!(q.read_u16(14), 5);
        assert!(r.queue(1).is_none());
    }

    #[test]
    fn a_restart_sees_what_was_in_flight_in_pop_order() {
        let (r, msg, file) = region(2, 16);
        let mut q = r.queue(1).expect("queue 1");
        q.recover(0, 16);
        for h in [6, 1, 4, 9] {
            q.mark(h);
        }
        // 1 and 9 complete (used index 0 -> 2).
        q.before_used(1);
        q.after_used(1, 1);
        q.before_used(9);
        q.after_used(9, 2);
        drop(q);
        // A new backend maps the same memfd.
        let r2 = InflightRegion::open(&msg, &file).expect("reopen");
        let mut q2 = r2.queue(1).expect("queue 1");
        assert_eq!(q2.recover(2, 16), vec![6, 4]);
        // Resubmitted ones are marked again, after the others.
        q2.mark(6);
        assert!(q2.counter_of(6) > q2.counter_of(4));
        // Queue 0 was never used.
        assert!(r2.queue(0).expect("queue 0").recover(0, 16).is_empty());
    }

    #[test]
    fn a_return_cut_short_by_a_crash_is_not_resubmitted() {
        let (r, msg, file) = region(1, 8);
        let mut q = r.queue(0).expect("queue 0");
        q.recover(0, 8);
        q.mark(3);
        q.mark(5);
        // Crash after the used ring took head 3 (guest used index 1) but before the
        // buffer was updated.
        q.before_used(3);
        drop(q);
        let r2 = InflightRegion::open(&msg, &file).expect("reopen");
        assert_eq!(r2.queue(0).expect("queue 0").recover(1, 8), vec![5]);
    }

    #[test]
    fn bad_shapes_and_sizes_are_refused() {
        assert!(InflightRegion::create(0, 128).is_err());
        assert!(InflightRegion::create(1, 4096).is_err());
        let (_, msg, file) = region(1, 64);
        let mut big = msg;
        big.queue_size = 1024;
        assert!(InflightRegion::open(&big, &file).is_err());
        let mut off = msg;
        off.mmap_offset = 12;
        assert!(InflightRegion::open(&off, &file).is_err());
        let mut past = msg;
        past.mmap_offset = 4096;
        assert!(InflightRegion::open(&past, &file).is_err());
    }

    fn memfd(flags: libc::c_uint, len: u64) -> File {
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"test-inflight".as_ptr(), flags) };
        assert!(fd >= 0, "memfd_create");
        // SAFETY: a new descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).expect("set_len");
        file
    }

    #[test]
    fn the_buffer_returned_cannot_be_resized() {
        let (_, msg, file) = region(1, 64);
        let err = file.set_len(0).expect_err("shrink refused");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
        assert!(file.set_len(msg.mmap_size * 2).is_err());
        // SAFETY: fcntl with integer arguments on an fd the test owns.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        assert_ne!(seals & libc::F_SEAL_SEAL, 0);
    }

    #[test]
    fn a_frontend_file_must_be_sealed_against_shrinking() {
        let (_, msg, _) = region(1, 64);
        // A memfd that cannot be sealed is refused.
        let plain = memfd(libc::MFD_CLOEXEC, msg.mmap_size);
        let err = InflightRegion::open(&msg, &plain).expect_err("unsealable refused");
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        // A sealable one takes the seal, and can then no longer shrink.
        let sealable = memfd(libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING, msg.mmap_size);
        InflightRegion::open(&msg, &sealable).expect("sealable taken");
        let err = sealable.set_len(0).expect_err("sealed");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
    }

    #[test]
    fn any_buffer_contents_give_distinct_heads_inside_the_queue() {
        // The buffer is the frontend's: whatever it holds, recovery lists each head at
        // most once and only heads the live queue has.
        use std::io::{Seek, Write};
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..200 {
            let (_, msg, mut file) = region(1, 64);
            let mut junk = vec![0u8; msg.mmap_size as usize];
            for b in junk.iter_mut() {
                *b = (next() % 4) as u8; // mostly 0..3, so `inflight` is often 1
            }
            if round % 2 == 0 {
                junk[8..12].copy_from_slice(&[1, 0, 64, 0]); // a valid version and size
            }
            file.seek(std::io::SeekFrom::Start(0)).expect("seek");
            file.write_all(&junk).expect("write");
            let r = InflightRegion::open(&msg, &file).expect("open");
            let live = [8u16, 64, 256][round % 3];
            let heads = r.queue(0).expect("queue 0").recover(next() as u16, live);
            let mut seen = std::collections::HashSet::new();
            assert!(
                heads.iter().all(|&h| h < live.min(64) && seen.insert(h)),
                "{heads:?}"
            );
        }
    }

    #[test]
    fn heads_outside_the_live_queue_are_dropped() {
        let (r, msg, file) = region(1, 16);
        let mut q = r.queue(0).expect("queue 0");
        q.recover(0, 16);
        q.mark(2);
        q.mark(12);
        q.mark(200); // outside the buffer: ignored
        drop(q);
        let r2 = InflightRegion::open(&msg, &file).expect("reopen");
        // The ring came back with 8 descriptors: head 12 cannot be in it.
        assert_eq!(r2.queue(0).expect("queue 0").recover(0, 8), vec![2]);
    }
}

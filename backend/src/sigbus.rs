//! Survives a VMM that truncates the file behind guest memory.
//!
//! Guest RAM is the VMM's file (a memfd, a file in /dev/shm or hugetlbfs) mapped shared
//! into the compute agent. A VMM can shrink that file under the mapping; the agent's next
//! load or store in the lost range is then a SIGBUS, whose default action kills the agent
//! with every attachment it serves. A memfd sealed against shrinking cannot be truncated
//! (the vendored vhost-user-backend seals what it can), but a plain or hugetlbfs file, or
//! a memfd made without `MFD_ALLOW_SEALING`, cannot be sealed.
//!
//! So each backend registers the host addresses of its guest memory here
//! ([`GuestRanges::register`]), and a SIGBUS handler, installed once per process, looks
//! the faulting address up: inside a registered range, it maps a private zero page over
//! the faulting page (`MAP_FIXED`) and marks the range; the faulting access then runs
//! again on the zero page and the agent goes on. The backend sees the mark
//! ([`GuestRanges::faulted`]) and stops its queues with NEEDS_RESET: the guest's memory
//! is gone, the device is of no more use to that VM, and nothing else is touched. A
//! SIGBUS outside every registered range is not the guest's: the handler puts back the
//! action that was there before and returns, so the fault happens again and takes its
//! usual course.
//!
//! The handler only reads atomics and calls `mmap` (async-signal-safe). A range stays
//! registered until its [`GuestRanges`] is dropped, which the backend does only after it
//! has stopped using that memory; a range left registered a little longer only ever turns
//! what would have been a crash into a zero page.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, OnceLock};

use vm_memory::{GuestMemoryBackend as _, GuestMemoryRegion as _};

use crate::guest::GuestMemory;

/// Ranges registered at once, across every backend of the process. One is used per
/// guest memory region (a VM has a few; vhost-user allows up to 509 per device).
const SLOTS: usize = 4096;

struct Slot {
    start: AtomicUsize,
    /// 0: free.
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};

static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
/// Serializes registration and release (the handler reads without it).
static WRITER: Mutex<()> = Mutex::new(());
/// Faults the handler turned into zero pages, since the process started.
static FAULTS: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();
/// The SIGBUS action before ours, put back for a fault that is not the guest's.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// The guest memory ranges of one backend, registered with the SIGBUS handler while
/// this value lives.
#[derive(Debug, Default)]
pub struct GuestRanges {
    slots: Vec<usize>,
}

impl GuestRanges {
    /// Registers every region of `mem` (installing the handler on first use). Ranges
    /// past the table's room are left out, with a warning: a fault there still kills
    /// the agent, as before.
    pub fn register(mem: &GuestMemory) -> Self {
        install();
        let _w = WRITER.lock().unwrap_or_else(|p| p.into_inner());
        let mut slots = Vec::new();
        for region in mem.iter() {
            let start = region.as_ptr() as usize;
            let len = region.len() as usize;
            if len == 0 {
                continue;
            }
            match TABLE
                .iter()
                .position(|s| s.len.load(Ordering::Acquire) == 0)
            {
                Some(i) => {
                    TABLE[i].faulted.store(false, Ordering::Release);
                    TABLE[i].start.store(start, Ordering::Release);
                    TABLE[i].len.store(len, Ordering::Release);
                    slots.push(i);
                }
                None => {
                    devlend_fabric::limited!(
                        warn,
                        "no room to guard a guest memory region against truncation"
                    );
                }
            }
        }
        GuestRanges { slots }
    }

    /// Whether the VMM truncated one of these ranges under the agent (a fault there was
    /// turned into a zero page).
    pub fn faulted(&self) -> bool {
        self.slots
            .iter()
            .any(|&i| TABLE[i].faulted.load(Ordering::Acquire))
    }
}

impl Drop for GuestRanges {
    fn drop(&mut self) {
        let _w = WRITER.lock().unwrap_or_else(|p| p.into_inner());
        for &i in &self.slots {
            TABLE[i].len.store(0, Ordering::Release);
        }
    }
}

/// One backend's guard: the ranges of its current memory table, and whether a fault hit
/// them since that table came.
#[derive(Debug, Default)]
pub struct MemoryGuard {
    ranges: Mutex<GuestRanges>,
    /// [`faults`] when last looked at.
    faults_seen: AtomicU64,
    lost: AtomicBool,
}

impl MemoryGuard {
    /// Guards `mem`, the backend's new memory table (before the old one is let go).
    pub fn set_memory(&self, mem: &GuestMemory) {
        let ranges = GuestRanges::register(mem);
        *self.ranges.lock().unwrap_or_else(|p| p.into_inner()) = ranges;
        self.faults_seen.store(faults(), Ordering::Release);
        self.lost.store(false, Ordering::Release);
    }

    /// Whether the VMM truncated this memory table under the agent: one atomic load
    /// while nothing faulted in the process.
    pub fn lost(&self) -> bool {
        let now = faults();
        if now != self.faults_seen.load(Ordering::Acquire) {
            self.faults_seen.store(now, Ordering::Release);
            let ranges = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
            if ranges.faulted() {
                self.lost.store(true, Ordering::Release);
            }
        }
        self.lost.load(Ordering::Acquire)
    }
}

/// Why a backend stops a queue whose guest memory was lost.
pub const LOST: &str =
    "the VMM truncated the file behind guest memory (a SIGBUS, turned into a zero page)";

/// Faults turned into zero pages since the process started: a cheap check that lets a
/// backend skip [`GuestRanges::faulted`] while nothing happened.
pub fn faults() -> u64 {
    FAULTS.load(Ordering::Acquire)
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid value to fill in; sigaction reads `new`
        // and writes `old`, both live for the call. The handler is async-signal-safe
        // (atomics and mmap only).
        unsafe {
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_sigbus as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut new.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &new, &mut old) == 0 {
                let _ = PREVIOUS.set(old);
            }
        }
    });
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; si_addr is
    // the faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in TABLE.iter() {
        let len = slot.len.load(Ordering::Acquire);
        let start = slot.start.load(Ordering::Acquire);
        if len == 0 || addr < start || addr - start >= len {
            continue;
        }
        // SAFETY: sysconf is async-signal-safe in practice (a constant read).
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let at = addr & !(page - 1);
        // SAFETY: `at` is a page inside a guest memory mapping that is still
        // registered, hence still mapped by the backend that registered it; a private
        // anonymous page replaces the page whose file backing is gone.
        let mapped = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            slot.faulted.store(true, Ordering::Release);
            FAULTS.fetch_add(1, Ordering::AcqRel);
            return;
        }
        break;
    }
    // Not the guest's memory (or no page could be put there): the action from before,
    // and the access faults again on return.
    // SAFETY: sigaction with a value saved from the kernel (or the default action).
    unsafe {
        match PREVIOUS.get() {
            Some(old) => {
                libc::sigaction(libc::SIGBUS, old, std::ptr::null_mut());
            }
            None => {
                libc::signal(libc::SIGBUS, libc::SIG_DFL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

    /// A guest memory region on a file that is then truncated: a read of it is a zero
    /// page, not a SIGBUS that kills the test process; the range is marked. Without the
    /// handler this test dies of SIGBUS.
    #[test]
    fn a_truncated_region_reads_zeros_and_is_marked() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(4 << 20).unwrap();
        let region = MmapRegion::<vhost_user_backend::bitmap::BitmapMmapRegion>::from_file(
            vm_memory::FileOffset::new(file.try_clone().unwrap(), 0),
            4 << 20,
        )
        .unwrap();
        let mem: GuestMemory =
            GuestMemoryMmap::from_regions(vec![
                GuestRegionMmap::new(region, GuestAddress(0)).unwrap()
            ])
            .unwrap();
        mem.write_obj(0x5a5a_5a5a_u32, GuestAddress(0x30_0000))
            .unwrap();
        let ranges = GuestRanges::register(&mem);
        assert!(!ranges.faulted());
        let before = faults();
        // SAFETY: ftruncate on a file this test owns.
        assert_eq!(unsafe { libc::ftruncate(file.as_raw_fd(), 1 << 20) }, 0);
        let v: u32 = mem.read_obj(GuestAddress(0x30_0000)).unwrap();
        assert_eq!(v, 0, "a zero page where the file was cut");
        assert!(ranges.faulted());
        assert!(faults() > before);
        // Memory still in the file is untouched, and writes to the zero page work.
        mem.write_obj(7u32, GuestAddress(0x30_0000)).unwrap();
        assert_eq!(mem.read_obj::<u32>(GuestAddress(0x30_0000)).unwrap(), 7);
        drop(ranges);
    }
}

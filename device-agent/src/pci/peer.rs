//! Peer-to-peer DMA between the functions this lender lends to one VM (`docs/pci.md`,
//! "Peer-to-peer"): a function's DMA to an address where its guest placed a peer
//! function's BAR reaches that BAR on this host, as it would between two functions of
//! one machine, and nothing outside the VM's functions.
//!
//! Each lending that names its VM ([`devlend_fabric::pci::KIND_PEER_GROUP`]) is a
//! [`Membership`] of that VM's group. The group keeps each member's memory BARs as its
//! guest placed them ([`Window`]s: a BAR with memory decoding on, at a guest address
//! other than 0), and maps every member's windows into every other member's IOMMU
//! domain (VFIO_IOMMU_MAP_DMA of the lender's mmap of the BAR, which the type1 IOMMU
//! resolves to the BAR's bus address):
//!
//! - into a function in coherence `mirror`, at the guest address itself: that function
//!   DMAs to the addresses its guest driver gave it, unchanged;
//! - into a function under the NVMe mediator, at an IOVA the lender picks in
//!   [`MEDIATED_IOVA`] (clear of the mediator's own buffers): the mediator rewrites the
//!   PRPs of a command whose buffers lie in a peer's window to those IOVAs ([`Reach`]).
//!
//! Each function keeps its own VFIO container: its guest-memory maps (mirrors, or the
//! mediator's buffers at IOVAs of its own) are per lending, and two lendings' maps at
//! one IOVA cannot share a domain. The peers' BARs are what the members' domains share.
//!
//! A mediated function's BAR 0 (its registers and doorbells, which its mediator owns) is
//! never a window: a peer writing its doorbells would bypass the mediator.

use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use devlend_fabric::pci::VM_ID_LEN;
use vfio_ioctls::VfioContainer;

/// Where a mediated function's peer windows go in its IOMMU domain: 256 GiB up to
/// 320 GiB (the mediator's buffers sit at 4 GiB; 39 address bits suffice).
pub(crate) const MEDIATED_IOVA: std::ops::Range<u64> = (1 << 38)..(1 << 38) + (1 << 36);

/// A memory BAR of a function mapped into the lender (VFIO region mmap), once at open:
/// what peers' IOMMU domains map.
pub(crate) struct BarMap {
    ptr: NonNull<u8>,
    /// Bytes (the region's size).
    pub(crate) size: u64,
}

// SAFETY: the mapping is device memory owned by the BarMap alone; it is never read or
// written through this pointer, only handed to VFIO_IOMMU_MAP_DMA.
unsafe impl Send for BarMap {}
// SAFETY: as above: no access through the pointer, from any thread.
unsafe impl Sync for BarMap {}

impl BarMap {
    /// Maps `size` bytes of the VFIO device `fd` at region offset `offset`.
    ///
    /// # Errors
    /// The kernel's mmap (a region VFIO does not let be mapped).
    pub(crate) fn new(fd: RawFd, offset: u64, size: u64) -> io::Result<BarMap> {
        let len = usize::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a fresh shared mapping of the device fd; no existing memory is
        // affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?;
        Ok(BarMap { ptr, size })
    }
}

impl Drop for BarMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping of this size; every IOMMU map of it holds an Arc of
        // this BarMap, so none is left.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.size as usize);
        }
    }
}

/// One memory BAR of a member as its guest placed it.
#[derive(Clone)]
pub(crate) struct Window {
    /// BAR index.
    pub(crate) bar: u8,
    /// Guest address of its first byte.
    pub(crate) guest: u64,
    /// The lender's mapping of the BAR (its size is the window's).
    pub(crate) map: Arc<BarMap>,
}

impl Window {
    fn size(&self) -> u64 {
        self.map.size
    }
}

/// A peer's window mapped into a function's IOMMU domain.
struct Reached {
    /// The member whose BAR it is.
    peer: u64,
    bar: u8,
    /// Guest address and bytes.
    guest: u64,
    size: u64,
    /// Where the function reaches it.
    iova: u64,
    /// Kept mapped while the IOMMU maps it.
    _map: Arc<BarMap>,
}

/// What one lending reaches of its peers' BARs, read by its mediator.
#[derive(Default)]
pub(crate) struct Reach {
    entries: Mutex<Vec<Reached>>,
}

impl Reach {
    /// The IOVA in the function's domain of `guest..guest + len`, when that range lies
    /// inside one peer window.
    pub(crate) fn translate(&self, guest: u64, len: u64) -> Option<u64> {
        let end = guest.checked_add(len)?;
        let e = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        e.iter()
            .find(|r| guest >= r.guest && end <= r.guest + r.size)
            .map(|r| r.iova + (guest - r.guest))
    }
}

#[cfg(test)]
impl Reach {
    /// A reach of one peer window: `size` bytes at guest address `guest`, at `iova`.
    pub(crate) fn one(guest: u64, size: u64, iova: u64) -> Reach {
        let r = Reach::default();
        r.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Reached {
                peer: 0,
                bar: 2,
                guest,
                size,
                iova,
                _map: Arc::new(BarMap {
                    ptr: NonNull::dangling(),
                    size: 0,
                }),
            });
        r
    }
}

/// A member of a VM's group: one lending.
struct Member {
    id: u64,
    bdf: String,
    container: Arc<VfioContainer>,
    /// Peers' windows go at their guest addresses (coherence `mirror`), else at IOVAs
    /// picked in [`MEDIATED_IOVA`].
    identity: bool,
    windows: Vec<Window>,
    reach: Arc<Reach>,
}

type Groups = HashMap<[u8; VM_ID_LEN], Vec<Member>>;

/// Every VM's group on this lender.
static GROUPS: LazyLock<Mutex<Groups>> = LazyLock::new(|| Mutex::new(HashMap::new()));
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn groups() -> std::sync::MutexGuard<'static, Groups> {
    GROUPS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The first free IOVA of `size` bytes in [`MEDIATED_IOVA`] among `taken`, aligned to
/// the size (at most 1 GiB, at least 4 KiB).
fn free_iova(taken: &[Reached], size: u64) -> Option<u64> {
    let align = size.next_power_of_two().clamp(4096, 1 << 30);
    let mut used: Vec<(u64, u64)> = taken
        .iter()
        .filter(|r| MEDIATED_IOVA.contains(&r.iova))
        .map(|r| (r.iova, r.iova + r.size))
        .collect();
    used.sort_unstable();
    let mut at = MEDIATED_IOVA.start;
    for (s, e) in used {
        if at.checked_add(size)? <= s {
            break;
        }
        at = e.div_ceil(align) * align;
    }
    (at.checked_add(size)? <= MEDIATED_IOVA.end).then_some(at)
}

/// Maps window `w` of member `from` into `to`'s domain.
fn map_into(to: &Member, from: (u64, &str), w: &Window) {
    let mut reach = to
        .reach
        .entries
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let iova = if to.identity {
        Some(w.guest)
    } else {
        free_iova(&reach, w.size())
    };
    let Some(iova) = iova else {
        devlend_fabric::limited!(warn, bdf = %to.bdf, peer = %from.1, "no IOVA left for a peer's BAR; not reachable");
        return;
    };
    let Ok(size) = usize::try_from(w.size()) else {
        return;
    };
    // SAFETY: the BAR mapping stays alive while the IOMMU maps it: the Reached entry
    // holds an Arc of it until `unmap_from` unmapped it (or keeps it for good when that
    // fails).
    let mapped = unsafe { to.container.vfio_dma_map(iova, size, w.map.ptr.as_ptr()) };
    match mapped {
        Ok(()) => {
            devlend_fabric::limited!(info, bdf = %to.bdf, peer = %from.1, bar = w.bar, guest = format_args!("{:#x}", w.guest), iova = format_args!("{iova:#x}"), size = w.size(), "a peer's BAR mapped for DMA");
            reach.push(Reached {
                peer: from.0,
                bar: w.bar,
                guest: w.guest,
                size: w.size(),
                iova,
                _map: Arc::clone(&w.map),
            });
        }
        Err(e) => {
            devlend_fabric::limited!(warn, bdf = %to.bdf, peer = %from.1, bar = w.bar, guest = format_args!("{:#x}", w.guest), error = %e, "cannot map a peer's BAR for DMA (its guest address overlaps a DMA map?); not reachable");
        }
    }
}

/// Unmaps from `to`'s domain the windows of member `peer` that `which` selects.
fn unmap_from(to: &Member, peer: u64, which: impl Fn(u8) -> bool) {
    let mut reach = to
        .reach
        .entries
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let (gone, kept): (Vec<Reached>, Vec<Reached>) = reach
        .drain(..)
        .partition(|r| r.peer == peer && which(r.bar));
    *reach = kept;
    for r in gone {
        if let Err(e) = to.container.vfio_dma_unmap(r.iova, r.size as usize) {
            // The IOMMU may still point at the BAR: keep its mapping for good.
            tracing::error!(bdf = %to.bdf, iova = r.iova, error = %e, "cannot unmap a peer's BAR; its mapping is kept");
            std::mem::forget(r);
        }
    }
}

/// One lending's membership of its VM's group; leaves it on drop (its windows unmapped
/// from the peers' domains, theirs from its own).
pub(crate) struct Membership {
    vm: [u8; VM_ID_LEN],
    id: u64,
}

impl Membership {
    /// Joins the group of `vm` with the function at `bdf` (its `container`; peers at
    /// their guest addresses when `identity`), whose reach `reach` is filled from now
    /// on with the members' windows.
    pub(crate) fn join(
        vm: [u8; VM_ID_LEN],
        bdf: &str,
        container: &Arc<VfioContainer>,
        identity: bool,
        reach: &Arc<Reach>,
    ) -> Membership {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let me = Member {
            id,
            bdf: bdf.to_owned(),
            container: Arc::clone(container),
            identity,
            windows: Vec::new(),
            reach: Arc::clone(reach),
        };
        let mut g = groups();
        let members = g.entry(vm).or_default();
        for m in members.iter() {
            for w in &m.windows {
                map_into(&me, (m.id, &m.bdf), w);
            }
        }
        devlend_fabric::limited!(info, %bdf, peers = members.len(), "joined its VM's peer group");
        members.push(me);
        Membership { vm, id }
    }

    /// The member's windows are now `windows`: what changed is unmapped from, and
    /// mapped into, every peer's domain.
    pub(crate) fn update(&self, windows: Vec<Window>) {
        let mut g = groups();
        let Some(members) = g.get_mut(&self.vm) else {
            return;
        };
        let Some(at) = members.iter().position(|m| m.id == self.id) else {
            return;
        };
        let old = std::mem::replace(&mut members[at].windows, windows.clone());
        let same = |a: &Window, b: &Window| a.bar == b.bar && a.guest == b.guest;
        let gone: Vec<u8> = old
            .iter()
            .filter(|o| !windows.iter().any(|w| same(o, w)))
            .map(|o| o.bar)
            .collect();
        let new: Vec<&Window> = windows
            .iter()
            .filter(|w| !old.iter().any(|o| same(o, w)))
            .collect();
        if gone.is_empty() && new.is_empty() {
            return;
        }
        let bdf = members[at].bdf.clone();
        for m in members.iter().filter(|m| m.id != self.id) {
            unmap_from(m, self.id, |bar| {
                gone.contains(&bar) || new.iter().any(|w| w.bar == bar)
            });
            for w in &new {
                map_into(m, (self.id, &bdf), w);
            }
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        let mut g = groups();
        let Some(members) = g.get_mut(&self.vm) else {
            return;
        };
        if let Some(at) = members.iter().position(|m| m.id == self.id) {
            let me = members.swap_remove(at);
            for m in members.iter() {
                unmap_from(m, self.id, |_| true);
                unmap_from(&me, m.id, |_| true);
            }
            devlend_fabric::limited!(info, bdf = %me.bdf, "left its VM's peer group");
        }
        if members.is_empty() {
            g.remove(&self.vm);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reached(iova: u64, size: u64) -> Reached {
        Reached {
            peer: 0,
            bar: 2,
            guest: 0,
            size,
            iova,
            _map: Arc::new(BarMap {
                ptr: NonNull::dangling(),
                size: 0,
            }),
        }
    }

    #[test]
    fn mediated_iovas_are_first_fit_aligned_and_bounded() {
        let base = MEDIATED_IOVA.start;
        assert_eq!(free_iova(&[], 16 << 20), Some(base));
        let taken = [reached(base, 16 << 20)];
        assert_eq!(free_iova(&taken, 4096), Some(base + (16 << 20)));
        assert_eq!(
            free_iova(&taken, 64 << 20),
            Some(base + (64 << 20)),
            "aligned to its size"
        );
        let gap = [reached(base + (1 << 30), 4096)];
        assert_eq!(
            free_iova(&gap, 1 << 20),
            Some(base),
            "a gap before the first"
        );
        assert_eq!(free_iova(&[], 1 << 37), None, "larger than the range");
    }

    #[test]
    fn reach_translates_ranges_inside_one_window_only() {
        let r = Reach::default();
        let mut e = reached(0x40_0000_0000, 0x10_0000);
        e.guest = 0xfe00_0000;
        r.entries.lock().unwrap().push(e);
        assert_eq!(r.translate(0xfe00_0000, 4096), Some(0x40_0000_0000));
        assert_eq!(r.translate(0xfe0f_f000, 4096), Some(0x40_000f_f000));
        assert_eq!(r.translate(0xfe0f_f000, 8192), None, "past its end");
        assert_eq!(r.translate(0xfdff_f000, 4096), None, "before it");
        assert_eq!(r.translate(u64::MAX, 2), None, "wraps");
    }
}

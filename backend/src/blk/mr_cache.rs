//! Which guest memory regions are registered for RDMA, and for how long.
//!
//! **The lifetime rule.** A registration is per guest memory region (per host mapping),
//! not per memory-map snapshot: SET_MEM_TABLE / ADD_MEM_REG hand over a new map, and
//! [`RegionCache::ensure`] registers each of its regions that is not registered yet (a
//! region that ADD_MEM_REG kept from the previous map keeps its registration). An entry
//! holds a map that contains its region, so the region stays mapped (its host range
//! cannot be reused by another mapping) for as long as it is registered.
//! [`RegionCache::prune`] drops every registration whose region is in none of the maps
//! still in use: the current map and the maps of the requests in flight. So a region
//! that vhost-user removed stays registered until the last request in flight that was
//! parsed against a map containing it completes, and no longer. The cache is generic
//! over the registration (`M`, an RDMA MR in the transport) so that the rule is tested
//! without RDMA hardware.

use std::sync::Arc;

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::guest::GuestMemoryRef;

/// One region's registration.
struct Entry<M> {
    /// Host virtual address of the region's first byte.
    start: u64,
    /// Bytes.
    len: u64,
    /// The registration (dropped before `keep`: field order).
    reg: M,
    /// A map holding the region, so that it stays mapped while registered.
    keep: GuestMemoryRef,
}

/// The registered regions of one queue session. `M` is the registration (for RDMA, an
/// MR; its rkey is given by the `rkey` function of [`RegionCache::lookup`]).
pub(crate) struct RegionCache<M> {
    entries: Vec<Entry<M>>,
    /// The last map passed to [`Self::ensure`] (identity only).
    last: Option<GuestMemoryRef>,
}

/// The host ranges `(start, len)` of the regions of `mem` that are mapped.
fn ranges(mem: &GuestMemoryRef) -> impl Iterator<Item = (u64, u64, *mut u8)> + '_ {
    mem.iter().filter_map(|r| {
        let p = r.get_host_address(MemoryRegionAddress(0)).ok()?;
        Some((p as u64, r.len(), p))
    })
}

impl<M> RegionCache<M> {
    /// An empty cache.
    pub(crate) fn new() -> Self {
        RegionCache {
            entries: Vec::new(),
            last: None,
        }
    }

    /// Regions registered.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Registers, with `register(host_ptr, len)`, each region of `mem` not registered
    /// yet; a region already registered now holds `mem` rather than an older map. Does
    /// nothing when `mem` is the map of the last call.
    ///
    /// # Errors
    /// The first registration that fails; the regions registered before it stay.
    pub(crate) fn ensure<E>(
        &mut self,
        mem: &GuestMemoryRef,
        mut register: impl FnMut(*mut u8, usize) -> Result<M, E>,
    ) -> Result<(), E> {
        if self.last.as_ref().is_some_and(|l| Arc::ptr_eq(l, mem)) {
            return Ok(());
        }
        for (start, len, ptr) in ranges(mem) {
            match self
                .entries
                .iter_mut()
                .find(|e| e.start == start && e.len == len)
            {
                Some(e) => e.keep = Arc::clone(mem),
                None => {
                    let reg = register(ptr, len as usize)?;
                    self.entries.push(Entry {
                        start,
                        len,
                        reg,
                        keep: Arc::clone(mem),
                    });
                }
            }
        }
        self.last = Some(Arc::clone(mem));
        Ok(())
    }

    /// Whether some registered region is not in the last map passed to
    /// [`Self::ensure`] (then a [`Self::prune`] may free something).
    pub(crate) fn has_stale(&self) -> bool {
        let Some(last) = self.last.as_ref() else {
            return !self.entries.is_empty();
        };
        self.entries
            .iter()
            .any(|e| !ranges(last).any(|(s, l, _)| s == e.start && l == e.len))
    }

    /// Drops the registrations of the regions in none of `in_use` (the current map and
    /// the maps of the requests in flight). Returns how many were dropped.
    pub(crate) fn prune<'a>(&mut self, in_use: impl Iterator<Item = &'a GuestMemoryRef>) -> usize {
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut seen: Vec<&GuestMemoryRef> = Vec::new();
        for m in in_use {
            if seen.iter().any(|s| Arc::ptr_eq(s, m)) {
                continue;
            }
            seen.push(m);
            live.extend(ranges(m).map(|(s, l, _)| (s, l)));
        }
        let before = self.entries.len();
        self.entries
            .retain(|e| live.iter().any(|&(s, l)| s == e.start && l == e.len));
        if self
            .last
            .as_ref()
            .is_some_and(|l| !seen.iter().any(|s| Arc::ptr_eq(s, l)))
        {
            self.last = None;
        }
        before - self.entries.len()
    }

    /// The registration covering `len` bytes at host address `addr` (all inside one
    /// registered region), with `key` applied to it.
    pub(crate) fn lookup<K>(&self, addr: u64, len: u64, key: impl Fn(&M) -> K) -> Option<K> {
        let end = addr.checked_add(len)?;
        self.entries
            .iter()
            .find(|e| addr >= e.start && end <= e.start + e.len)
            .map(|e| key(&e.reg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::GuestMemory;
    use std::cell::Cell;
    use vm_memory::GuestAddress;

    fn two_regions() -> GuestMemoryRef {
        Arc::new(
            GuestMemory::from_ranges(&[
                (GuestAddress(0), 0x10000),
                (GuestAddress(0x10000), 0x10000),
            ])
            .expect("map"),
        )
    }

    fn host(mem: &GuestMemoryRef, gpa: u64) -> u64 {
        mem.get_host_address(GuestAddress(gpa)).expect("in memory") as u64
    }

    #[test]
    fn regions_follow_the_map_and_outlive_it_while_in_flight() {
        let registered = Cell::new(0u32);
        let reg = |_: *mut u8, _: usize| -> Result<u32, ()> {
            registered.set(registered.get() + 1);
            Ok(registered.get())
        };
        let mut c = RegionCache::new();
        let m1 = two_regions();
        c.ensure(&m1, reg).expect("register");
        assert_eq!((c.len(), registered.get()), (2, 2));
        // A buffer inside one region has its key; one across the two does not (it
        // must be two segments).
        let a = host(&m1, 0x1000);
        assert!(c.lookup(a, 0x1000, |k| *k).is_some());
        assert_eq!(c.lookup(host(&m1, 0xf000), 0x2000, |k| *k), None);
        assert_ne!(
            c.lookup(host(&m1, 0), 1, |k| *k),
            c.lookup(host(&m1, 0x10000), 1, |k| *k)
        );
        // The same map again registers nothing.
        c.ensure(&m1, reg).expect("same");
        assert_eq!(registered.get(), 2);

        // ADD_MEM_REG: a new map keeping both regions and adding a third; only the
        // new region is registered.
        let m2 =
            Arc::new(
                m1
                    .insert_region(
                        Arc::new(
                            vm_memory::GuestRegionMmap::<
                                vhost_user_backend::bitmap::BitmapMmapRegion,
                            >::from_range(
                                GuestAddress(0x40000), 0x10000, None
                            )
                            .expect("region"),
                        ),
                    )
                    .expect("insert"),
            );
        c.ensure(&m2, reg).expect("register");
        assert_eq!((c.len(), registered.get()), (3, 3));

        // SET_MEM_TABLE with other memory while a request parsed against m2 is in
        // flight: m2's regions stay registered until it completes.
        let m3 = two_regions();
        c.ensure(&m3, reg).expect("register");
        assert_eq!(c.len(), 5);
        assert!(c.has_stale());
        let inflight = [Arc::clone(&m2)];
        assert_eq!(c.prune([&m3].into_iter().chain(inflight.iter())), 0);
        assert!(c.lookup(a, 0x1000, |k| *k).is_some());
        // The request completed: m2's regions go.
        assert_eq!(c.prune([&m3].into_iter()), 3);
        assert_eq!(c.lookup(a, 0x1000, |k| *k), None);
        assert!(!c.has_stale());
        assert!(c.lookup(host(&m3, 0x10000), 0x10000, |k| *k).is_some());
        // Detach: nothing in use.
        assert_eq!(c.prune(std::iter::empty()), 2);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn a_failed_registration_is_reported() {
        let mut c: RegionCache<u32> = RegionCache::new();
        let m = two_regions();
        let mut n = 0;
        let r = c.ensure(&m, |_, _| {
            n += 1;
            if n == 2 {
                Err("no resources")
            } else {
                Ok(n)
            }
        });
        assert_eq!(r, Err("no resources"));
        assert_eq!(c.len(), 1);
        // A later call retries the missing region.
        c.ensure(&m, |_, _| Ok::<u32, ()>(9)).expect("retry");
        assert_eq!(c.len(), 2);
    }
}

//! Descriptor chains for given head indexes of a live virtqueue.
//!
//! Resubmitting what an earlier backend left in flight ([`crate::blk::inflight`]) needs
//! the chains of known heads, which `virtio-queue` only hands out by popping the avail
//! ring. This builds a private avail ring (in memory of the backend's own, mapped at a
//! guest-physical address above all guest memory) that lists just those heads, and a
//! queue that reads it with the live queue's descriptor table: popping it yields the
//! chains, walked and checked by `virtio-queue` as usual. The guest's rings are not
//! written.

use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestRegionMmap, MmapRegion};

use crate::guest::GuestMemory;

/// Bytes of the private region: an avail ring of up to 1024 entries (4 + 2·1024 + 2).
const RING_REGION_LEN: usize = 4096;

/// A private avail ring listing some heads of a live queue, and the queue that reads it.
pub struct ResubmitRing {
    /// The guest's memory regions plus the private ring's.
    pub mem: GuestMemory,
    /// Pops the listed heads, in order, as chains of the live queue's descriptor table.
    pub queue: Queue,
}

impl ResubmitRing {
    /// A ring listing `heads` (at most the queue's size) of `live`, whose memory is `mem`.
    /// `None` if there is no room above guest memory, or the queue cannot be set up.
    pub fn new(mem: &GuestMemory, live: &Queue, heads: &[u16]) -> Option<Self> {
        if heads.len() > usize::from(live.size()) || (4 + 2 * heads.len() + 2) > RING_REGION_LEN {
            return None;
        }
        let end = GuestMemoryBackend::last_addr(mem).0.checked_add(1)?;
        let base = GuestAddress(end.checked_add(0xfff)? & !0xfff);
        base.checked_add(RING_REGION_LEN as u64)?;
        let mapping =
            MmapRegion::<vhost_user_backend::bitmap::BitmapMmapRegion>::new(RING_REGION_LEN)
                .ok()?;
        let region = GuestRegionMmap::new(mapping, base)?;
        let mem = mem.insert_region(Arc::new(region)).ok()?;
        // struct virtq_avail { le16 flags; le16 idx; le16 ring[]; } (virtio 1.2 §2.7.6)
        mem.write_obj(0u16, base).ok()?;
        mem.write_obj((heads.len() as u16).to_le(), base.unchecked_add(2))
            .ok()?;
        for (i, &h) in heads.iter().enumerate() {
            mem.write_obj(h.to_le(), base.unchecked_add(4 + 2 * i as u64))
                .ok()?;
        }
        let mut queue = Queue::new(live.max_size()).ok()?;
        queue.try_set_size(live.size()).ok()?;
        queue
            .try_set_desc_table_address(GuestAddress(live.desc_table()))
            .ok()?;
        queue.try_set_avail_ring_address(base).ok()?;
        queue
            .try_set_used_ring_address(GuestAddress(live.used_ring()))
            .ok()?;
        queue.set_ready(true);
        Some(ResubmitRing { mem, queue })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;

    #[test]
    fn pops_exactly_the_listed_heads_in_order() {
        let m = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("memory");
        let vq = MockSplitQueue::new(&m, 16);
        // Five one-descriptor chains at heads 0..5.
        let descs: Vec<RawDescriptor> = (0..5u64)
            .map(|i| RawDescriptor::from(Descriptor::new(0x8000 + i * 0x100, 0x100, 0, 0)))
            .collect();
        vq.build_multiple_desc_chains(&descs).expect("chains");
        let live: Queue = vq.create_queue().expect("queue");
        let mut r = ResubmitRing::new(&m, &live, &[3, 1]).expect("ring");
        let got: Vec<(u16, u64)> = std::iter::from_fn(|| r.queue.pop_descriptor_chain(&r.mem))
            .map(|mut c| (c.head_index(), c.next().map_or(0, |d| d.addr().0)))
            .collect();
        assert_eq!(got, vec![(3, 0x8300), (1, 0x8100)]);
        // The private ring lies above guest memory.
        assert!(r.queue.avail_ring() >= 0x10_0000);
    }

    #[test]
    fn too_many_heads_is_refused() {
        let m = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("memory");
        let vq = MockSplitQueue::new(&m, 4);
        let live: Queue = vq.create_queue().expect("queue");
        assert!(ResubmitRing::new(&m, &live, &[0, 1, 2, 3, 0]).is_none());
    }
}

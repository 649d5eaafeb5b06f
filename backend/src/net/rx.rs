//! Writing one received frame into the guest's receive buffers (virtio 1.2 §5.1.6.3,
//! §5.1.6.4): a `virtio_net_hdr_v1` then the frame; with mergeable buffers the frame
//! spans as many chains as it needs and `num_buffers` says how many.

use std::io::Write;

use virtio_queue::{Queue, QueueT};

use devlend_fabric::net::{Offload, OFFLOAD_LEN};

use crate::guest::GuestMemory;
use crate::net::spec::NET_HDR_LEN;

/// What became of a frame offered to the receive queue.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Written; this many chains used.
    Done(u16),
    /// Not enough buffers posted now: nothing was taken from the ring; try again later.
    NoBuffers,
    /// Without mergeable buffers, the frame does not fit in one chain (or the guest's
    /// buffers are unusable): drop it.
    Unfit,
    /// The driver corrupted the ring (the reason): an avail index more than the queue
    /// size ahead, a head out of range, a malformed chain ([`crate::virtq`]). Nothing
    /// was taken; the queue is to stop until the frontend re-initializes it.
    Broken(String),
}

/// Writes `frame` into the chains at the head of `queue`'s avail ring, after a header
/// that carries `offload` (flags, GSO type and size, checksum offsets: what the guest
/// is left to do or need not do; none: all zero). Either the whole frame is written or
/// nothing is taken: the ring is rewound when buffers run short, and when the ring
/// turns out corrupt ([`Delivery::Broken`]).
///
/// # Errors
/// A guest memory error on the rings.
pub fn deliver(
    queue: &mut Queue,
    mem: &GuestMemory,
    frame: &[u8],
    offload: Option<&Offload>,
    mergeable: bool,
) -> Result<Delivery, virtio_queue::Error> {
    // A corrupt avail index: virtio-queue would take no chain and log it, for every
    // frame, and the receive loop would spin on it. It is the guest's error.
    if let Some(why) = crate::virtq::avail_violation(queue, mem)? {
        return Ok(Delivery::Broken(why));
    }
    let need = NET_HDR_LEN + frame.len();
    let start = queue.next_avail();
    let mut chains = Vec::new();
    let mut room = 0usize;
    while room < need {
        let Some(chain) = queue.pop_descriptor_chain(mem) else {
            queue.set_next_avail(start);
            return Ok(Delivery::NoBuffers);
        };
        let head = chain.head_index();
        // virtio-queue's chain iterator stops silently at a loop, a buffer outside
        // memory or a bad `next`: the frame would go into a truncated chain.
        if let Some(why) = crate::virtq::head_violation(queue, head)
            .or_else(|| crate::virtq::chain_violation(queue, mem, head))
        {
            queue.set_next_avail(start);
            return Ok(Delivery::Broken(why));
        }
        let Ok(w) = chain.writer(mem) else {
            queue.set_next_avail(start);
            return Ok(Delivery::Unfit);
        };
        room += w.available_bytes();
        chains.push((head, w));
        if !mergeable || chains.len() > u16::MAX as usize {
            break;
        }
    }
    if room < need {
        queue.set_next_avail(start);
        return Ok(Delivery::Unfit);
    }
    let count = chains.len() as u16;
    let mut hdr = [0u8; NET_HDR_LEN];
    // The first 10 bytes as `struct virtio_net_hdr` (zero: nothing to do); num_buffers
    // at offset 10.
    if let Some(o) = offload {
        hdr[..OFFLOAD_LEN].copy_from_slice(&o.to_bytes());
    }
    hdr[10..12].copy_from_slice(&count.to_le_bytes());
    let mut src: &[u8] = &hdr;
    let mut rest: &[u8] = frame;
    let mut lens = Vec::with_capacity(chains.len());
    for (head, w) in &mut chains {
        let mut written = 0usize;
        loop {
            if src.is_empty() {
                if rest.is_empty() {
                    break;
                }
                src = std::mem::take(&mut rest);
            }
            let n = w.write(src).unwrap_or(0);
            if n == 0 {
                break;
            }
            written += n;
            src = &src[n..];
        }
        lens.push((*head, written as u32));
    }
    if !src.is_empty() || !rest.is_empty() {
        // Guest memory refused a write the sizes promised: give nothing, drop the frame.
        queue.set_next_avail(start);
        return Ok(Delivery::Unfit);
    }
    for (head, len) in lens {
        queue.add_used(mem, head, len)?;
    }
    Ok(Delivery::Done(count))
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    const F_WRITE: u16 = 2;

    /// A queue whose avail ring holds `n` one-descriptor chains of `len` bytes each.
    fn queue_with(mem: &GuestMemory, n: u16, len: u32) -> (MockSplitQueue<'_, GuestMemory>, Queue) {
        let vq = MockSplitQueue::new(mem, 16);
        let descs: Vec<RawDescriptor> = (0..n)
            .map(|i| {
                RawDescriptor::from(SplitDescriptor::new(
                    0x10_0000 + u64::from(i) * 0x1_0000,
                    len,
                    F_WRITE,
                    0,
                ))
            })
            .collect();
        for (i, d) in descs.iter().enumerate() {
            vq.desc_table().store(i as u16, *d).unwrap();
            vq.avail()
                .ring()
                .ref_at(i)
                .unwrap()
                .store(u16::to_le(i as u16));
        }
        vq.avail().idx().store(u16::to_le(n));
        let q: Queue = vq.create_queue().unwrap();
        (vq, q)
    }

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
    }

    #[test]
    fn a_large_frame_spans_mergeable_buffers_with_num_buffers_set() {
        let m = mem();
        let (vq, mut q) = queue_with(&m, 8, 1536);
        let frame: Vec<u8> = (0..8014u32).map(|i| i as u8).collect();
        assert_eq!(
            deliver(&mut q, &m, &frame, None, true).unwrap(),
            Delivery::Done(6)
        );
        let hdr: [u8; 12] = m.read_obj(GuestAddress(0x10_0000)).unwrap();
        assert_eq!(u16::from_le_bytes([hdr[10], hdr[11]]), 6);
        // The frame continues across the buffers in order.
        let mut back = vec![0u8; 1536 - 12];
        m.read_slice(&mut back, GuestAddress(0x10_000c)).unwrap();
        assert_eq!(back, frame[..1524]);
        let mut next = vec![0u8; 1536];
        m.read_slice(&mut next, GuestAddress(0x11_0000)).unwrap();
        assert_eq!(next, frame[1524..3060]);
        assert_eq!(vq.used().idx().load(), 6);
        let last = vq.used().ring().ref_at(5).unwrap().load();
        assert_eq!(last.len(), (8014 + 12 - 5 * 1536) as u32);
    }

    #[test]
    fn a_corrupt_avail_index_breaks_the_queue_not_a_spin() {
        let m = mem();
        let (vq, mut q) = queue_with(&m, 2, 1536);
        vq.avail().idx().store(u16::to_le(40000));
        assert!(matches!(
            deliver(&mut q, &m, &[1u8; 100], None, true),
            Ok(Delivery::Broken(why)) if why.contains("avail.idx 40000")
        ));
        assert_eq!(q.next_avail(), 0);
        assert_eq!(vq.used().idx().load(), 0);
    }

    #[test]
    fn a_malformed_chain_breaks_the_queue_and_nothing_is_taken() {
        let m = mem();
        let (vq, mut q) = queue_with(&m, 3, 1536);
        // The second chain's buffer lies outside guest memory: a 4000-byte frame needs
        // three chains, and none is taken.
        let bad = RawDescriptor::from(SplitDescriptor::new(0x2000_0000, 1536, F_WRITE, 0));
        vq.desc_table().store(1, bad).unwrap();
        assert!(matches!(
            deliver(&mut q, &m, &[1u8; 4000], None, true),
            Ok(Delivery::Broken(why)) if why.contains("not in guest memory")
        ));
        assert_eq!(q.next_avail(), 0);
        assert_eq!(vq.used().idx().load(), 0);
        // A head out of range.
        vq.avail().ring().ref_at(0).unwrap().store(u16::to_le(16));
        assert!(matches!(
            deliver(&mut q, &m, &[1u8; 100], None, true),
            Ok(Delivery::Broken(why)) if why.contains("head index 16")
        ));
    }

    #[test]
    fn short_of_buffers_nothing_is_taken_and_unmergeable_frames_do_not_fit() {
        let m = mem();
        let (vq, mut q) = queue_with(&m, 2, 1536);
        assert_eq!(
            deliver(&mut q, &m, &[1u8; 4000], None, true).unwrap(),
            Delivery::NoBuffers
        );
        assert_eq!(q.next_avail(), 0);
        assert_eq!(vq.used().idx().load(), 0);
        assert_eq!(
            deliver(&mut q, &m, &[1u8; 4000], None, false).unwrap(),
            Delivery::Unfit
        );
        assert_eq!(q.next_avail(), 0);
        assert_eq!(
            deliver(&mut q, &m, &[1u8; 60], None, false).unwrap(),
            Delivery::Done(1)
        );
        let hdr: [u8; 12] = m.read_obj(GuestAddress(0x10_0000)).unwrap();
        assert_eq!(u16::from_le_bytes([hdr[10], hdr[11]]), 1);
    }

    #[test]
    fn an_offloaded_frame_carries_its_header_to_the_guest() {
        let m = mem();
        let (_vq, mut q) = queue_with(&m, 16, 4096);
        let gso = Offload {
            flags: devlend_fabric::net::OFFLOAD_DATA_VALID,
            gso_type: devlend_fabric::net::GSO_TCPV4,
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 0,
            csum_offset: 0,
        };
        let frame = vec![7u8; 30_000];
        assert_eq!(
            deliver(&mut q, &m, &frame, Some(&gso), true).unwrap(),
            Delivery::Done(8)
        );
        let hdr: [u8; 12] = m.read_obj(GuestAddress(0x10_0000)).unwrap();
        assert_eq!(hdr[..10], gso.to_bytes());
        assert_eq!(u16::from_le_bytes([hdr[10], hdr[11]]), 8);
    }
}

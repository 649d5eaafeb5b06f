//! A frame from the lender into the guest's receive buffers, or held for them, and the
//! counting of frames.

use super::*;

/// What [`receive`] works on: the pair's receive side, borrowed beside the frame.
pub(super) struct Rx<'a> {
    pub(super) held: &'a mut Held,
    pub(super) broken: &'a mut BrokenQueue,
    pub(super) stats: &'a PairStats,
    pub(super) mergeable: bool,
}

/// One frame from the lender: straight into the guest's buffers while nothing waits
/// before it; copied aside (into `held`) only when it has to wait; dropped while the
/// driver has the receiveq broken. Returns whether used entries were added.
pub(super) fn receive(
    rx: Rx<'_>,
    rxq: Option<&mut Queue>,
    mem: &GuestMemory,
    offload: Option<Offload>,
    f: &[u8],
) -> bool {
    let Rx {
        held,
        broken,
        stats,
        mergeable,
    } = rx;
    if broken.is_broken() {
        stats.rx_drops.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    let direct = match rxq {
        Some(q) if held.is_empty() => deliver(q, mem, f, offload.as_ref(), mergeable)
            .unwrap_or_else(|e| Delivery::Broken(format!("a ring is not in guest memory: {e}"))),
        _ => Delivery::NoBuffers,
    };
    match direct {
        Delivery::Broken(why) => {
            broken.break_queue(why);
            stats.errors.fetch_add(1, Ordering::Relaxed);
            stats
                .rx_drops
                .fetch_add(1 + held.len() as u64, Ordering::Relaxed);
            held.clear();
        }
        Delivery::Done(chains) => {
            count_delivered(stats, chains, f.len());
            if offload.is_some_and(|o| o.gso_type != net::GSO_NONE) {
                stats.rx_gso.fetch_add(1, Ordering::Relaxed);
            }
            return true;
        }
        Delivery::Unfit => {
            stats.rx_drops.fetch_add(1, Ordering::Relaxed);
        }
        Delivery::NoBuffers => {
            if held.len() >= HOLD_FRAMES {
                held.pop_front();
                stats.rx_drops.fetch_add(1, Ordering::Relaxed);
            }
            held.push_back((Instant::now(), offload, f.to_vec()));
        }
    }
    false
}

/// How many whole frame messages `buf` starts with (for counting drops).
pub(super) fn count_frames(buf: &[u8]) -> u64 {
    let mut n = 0;
    let mut at = 0;
    while let Ok(Some((m, len))) = net::decode(&buf[at..]) {
        if matches!(m, NetMessage::Frame(_) | NetMessage::OffloadFrame(..)) {
            n += 1;
        }
        at += len;
    }
    n
}

/// Counts a frame of `len` bytes delivered to the guest in `chains` receive chains.
pub(super) fn count_delivered(stats: &PairStats, chains: u16, len: usize) {
    if chains > 1 {
        stats.rx_merged.fetch_add(1, Ordering::Relaxed);
    }
    stats.rx_packets.fetch_add(1, Ordering::Relaxed);
    stats.rx_bytes.fetch_add(len as u64, Ordering::Relaxed);
}

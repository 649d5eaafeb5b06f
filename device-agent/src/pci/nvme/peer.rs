//! Commands whose buffers lie in peers' BARs (`crate::pci::peer`): handed to the
//! controller with the IOVAs at which the function's domain maps those BARs, nothing
//! bounced.

use super::cmd::{self, Segment};
use super::spec::{Status, DATA_TRANSFER_ERROR, INVALID_FIELD, PAGE};
use crate::pci::peer::Reach;

/// `None` when every segment lies in the guest's DMA `maps` (the command is bounced);
/// the segments' IOVAs in the function's domain when every one lies in a peer's window
/// of `reach`.
///
/// # Errors
/// [`INVALID_FIELD`] for a command with segments of both; [`DATA_TRANSFER_ERROR`] for a
/// segment in neither.
pub(super) fn in_peers(
    segs: &[Segment],
    maps: &[(u64, u64)],
    reach: &Reach,
) -> Result<Option<Vec<Segment>>, Status> {
    let in_guest = |&(iova, n): &Segment| cmd::inside_maps(maps, iova, n as u64);
    if segs.iter().all(in_guest) {
        return Ok(None);
    }
    // A command is bounced whole or not at all.
    let mut peer = Vec::with_capacity(segs.len());
    for s in segs {
        if in_guest(s) {
            return Err(INVALID_FIELD);
        }
        peer.push((
            reach
                .translate(s.0, s.1 as u64)
                .ok_or(DATA_TRANSFER_ERROR)?,
            s.1,
        ));
    }
    Ok(Some(peer))
}

/// The PRP entries of a transfer over `segs` (IOVAs in the controller's domain, in
/// order): the first segment's start, then each page boundary after it.
pub(super) fn prp_pages(segs: &[Segment]) -> Vec<u64> {
    let page = PAGE as u64;
    let mut out = Vec::new();
    for &(iova, n) in segs {
        let end = iova + n as u64;
        let mut at = iova;
        while at < end {
            out.push(at);
            at = (at / page + 1) * page;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_is_all_in_guest_memory_all_in_peers_or_refused() {
        let maps = [(0x10_0000, 0x10_0000)];
        let reach = Reach::one(0xfea0_0000, 0x10_0000, 1 << 38);
        let guest = [(0x10_0000, 4096), (0x10_2000, 4096)];
        assert_eq!(in_peers(&guest, &maps, &reach), Ok(None));
        let peer = [(0xfea0_0000, 4096), (0xfea0_3000, 4096)];
        assert_eq!(
            in_peers(&peer, &maps, &reach),
            Ok(Some(vec![(1 << 38, 4096), ((1 << 38) + 0x3000, 4096)]))
        );
        let mixed = [(0xfea0_0000, 4096), (0x10_2000, 4096)];
        assert_eq!(in_peers(&mixed, &maps, &reach), Err(INVALID_FIELD));
        let outside = [(0xd000_0000, 4096)];
        assert_eq!(in_peers(&outside, &maps, &reach), Err(DATA_TRANSFER_ERROR));
    }

    #[test]
    fn prp_entries_of_peer_segments_start_each_page() {
        assert_eq!(prp_pages(&[(0x10_0200, 0xe00)]), vec![0x10_0200]);
        assert_eq!(
            prp_pages(&[(0x10_0200, 0x1e00), (0x50_0000, 0x1000)]),
            vec![0x10_0200, 0x10_1000, 0x50_0000]
        );
        assert_eq!(prp_pages(&[]), Vec::<u64>::new());
    }
}

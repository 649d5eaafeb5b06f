//! Peer-to-peer between functions lent to one VM: the borrower's [`PeerGroup`] request,
//! and the lender's [`DmaCounters`] note.

use super::exact;
use crate::WireError;

/// Bytes of a VM's identity in a [`PeerGroup`].
pub const VM_ID_LEN: usize = 16;

/// The payload of [`KIND_PEER_GROUP`](super::KIND_PEER_GROUP): the VM this function is
/// lent to, as a random identity that the borrower keeps for that VM and sends for each
/// of its functions. The lender lets the functions of one identity reach each other's
/// BARs by DMA, and no other function.
///
/// Layout (16 bytes): `vm: [u8; 16]`, not all zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerGroup {
    /// The VM's identity.
    pub vm: [u8; VM_ID_LEN],
}

impl PeerGroup {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        self.vm.to_vec()
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a wrong length or an identity of zeros.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let vm: [u8; VM_ID_LEN] = exact(p, "peer group length")?;
        if vm == [0; VM_ID_LEN] {
            return Err(WireError::Invalid("peer group of zeros"));
        }
        Ok(PeerGroup { vm })
    }
}

crate::layout! {
    /// A [`DmaCounters`] payload.
    struct DmaCountersRaw [24] {
        guest_read: u64,
        guest_written: u64,
        peer: u64,
    }
}

/// The payload of [`KIND_COUNTERS`](super::KIND_COUNTERS): what the lender moved for
/// the function's DMA since the session opened, in bytes.
///
/// Layout (24 bytes): `guest_read: u64, guest_written: u64, peer: u64`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DmaCounters {
    /// Data read from guest memory for the function (the NVMe mediator's fetches).
    pub guest_read: u64,
    /// Data written to guest memory from the function (the mediator's pushes).
    pub guest_written: u64,
    /// Data the function moved straight to or from a peer's BAR, never through guest
    /// memory (commands whose buffers lie in a peer function's BAR).
    pub peer: u64,
}

impl DmaCounters {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        DmaCountersRaw {
            guest_read: self.guest_read,
            guest_written: self.guest_written,
            peer: self.peer,
        }
        .encode()
        .to_vec()
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a wrong length.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let r: DmaCountersRaw = exact(p, "DMA counters length")?;
        Ok(DmaCounters {
            guest_read: r.guest_read,
            guest_written: r.guest_written,
            peer: r.peer,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_group_and_counters_round_trip_and_refuse_bad_payloads() {
        let g = PeerGroup { vm: [7; 16] };
        assert_eq!(PeerGroup::decode(&g.encode()).unwrap(), g);
        assert!(PeerGroup::decode(&[0; 16]).is_err(), "zeros");
        assert!(PeerGroup::decode(&[1; 15]).is_err(), "short");
        assert!(PeerGroup::decode(&[1; 17]).is_err(), "long");
        let c = DmaCounters {
            guest_read: 1,
            guest_written: 2,
            peer: 1 << 40,
        };
        assert_eq!(DmaCounters::decode(&c.encode()).unwrap(), c);
        assert!(DmaCounters::decode(&[0; 23]).is_err());
    }
}

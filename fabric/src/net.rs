//! Frame messages of a lent NIC (feature [`FEATURE_NET`]): Ethernet frames each way and
//! the interface's link state, after the handshake of a queue-pair session.
//!
//! Every message is an 8-byte header `kind: u8, flags: u8 = 0, reserved: u16 = 0,
//! len: u32` followed by `len` bytes. Both ends write many messages per write. Layouts
//! are in `docs/protocol.md`.

use crate::codec::{self, Reader};
use crate::WireError;

/// [`crate::Hello::features`] bit: the borrower can be lent a NIC (frame messages). A
/// lender grants it only for a network interface, and refuses a NIC to a hello without it.
pub const FEATURE_NET: u64 = 1 << 0;

/// [`crate::Hello::features`] bit: the borrower may send [`KIND_FRAME_OFFLOAD`] messages
/// (frames with checksum or segmentation left to the lender). A lender grants it when
/// its interface path completes them (AF_PACKET with `PACKET_VNET_HDR` does, in software
/// where the hardware cannot); the borrower offers the guest the matching virtio-net
/// offloads (CSUM, HOST_TSO4, HOST_TSO6, HOST_ECN) only when granted.
pub const FEATURE_NET_OFFLOAD: u64 = 1 << 1;

/// Header length of every frame message.
pub const NET_HEADER_LEN: usize = 8;
/// Message kind: one Ethernet frame (destination MAC first, no FCS).
pub const KIND_FRAME: u8 = 0x20;
/// Message kind: the lent interface's link state, MTU and MAC ([`LinkState`]).
pub const KIND_LINK: u8 = 0x21;
/// Message kind: an [`Offload`] header (10 bytes) and then one Ethernet frame whose
/// checksum and/or segmentation the lender completes (borrower → lender only, after
/// [`FEATURE_NET_OFFLOAD`] was granted).
pub const KIND_FRAME_OFFLOAD: u8 = 0x22;
/// Length of the [`Offload`] header in a [`KIND_FRAME_OFFLOAD`] payload.
pub const OFFLOAD_LEN: usize = 10;
/// [`Offload::flags`]: the checksum from `csum_start` is to be completed
/// (`VIRTIO_NET_HDR_F_NEEDS_CSUM`).
pub const OFFLOAD_NEEDS_CSUM: u8 = 1;
/// [`Offload::flags`], lender → borrower only: the lender's kernel validated the
/// frame's checksums (`VIRTIO_NET_HDR_F_DATA_VALID`).
pub const OFFLOAD_DATA_VALID: u8 = 2;
/// Message kind, borrower → lender: which offloaded frames the guest takes
/// ([`RX_CSUM`], [`RX_TSO4`], [`RX_TSO6`], [`RX_ECN`] in a `u32`), after
/// [`FEATURE_NET_OFFLOAD`] was granted. Sent first on a session and again when the
/// guest's features change; until then the guest takes none.
pub const KIND_OFFLOADS: u8 = 0x23;
/// Message kind: a heartbeat, no payload (borrower → lender only, after
/// [`crate::FEATURE_HEARTBEAT`] was granted). The lender drops it; its TCP
/// acknowledgement is what a borrower with several paths checks the path with
/// (`docs/protocol.md`, "Paths and heartbeats").
pub const KIND_HEARTBEAT: u8 = 0x24;
/// Length of a [`KIND_OFFLOADS`] payload.
pub const OFFLOADS_LEN: usize = 4;
/// [`KIND_OFFLOADS`] bit: frames with NEEDS_CSUM or DATA_VALID (the guest acked
/// `VIRTIO_NET_F_GUEST_CSUM`).
pub const RX_CSUM: u32 = 1 << 0;
/// [`KIND_OFFLOADS`] bit: TCP/IPv4 frames larger than the MTU (`GUEST_TSO4`).
pub const RX_TSO4: u32 = 1 << 1;
/// [`KIND_OFFLOADS`] bit: TCP/IPv6 frames larger than the MTU (`GUEST_TSO6`).
pub const RX_TSO6: u32 = 1 << 2;
/// [`KIND_OFFLOADS`] bit: such frames with ECN (`GUEST_ECN`).
pub const RX_ECN: u32 = 1 << 3;
/// [`Offload::gso_type`]: no segmentation.
pub const GSO_NONE: u8 = 0;
/// [`Offload::gso_type`]: TCP over IPv4 segmentation (`VIRTIO_NET_HDR_GSO_TCPV4`).
pub const GSO_TCPV4: u8 = 1;
/// [`Offload::gso_type`]: TCP over IPv6 segmentation (`VIRTIO_NET_HDR_GSO_TCPV6`).
pub const GSO_TCPV6: u8 = 4;
/// [`Offload::gso_type`] bit: the TCP segments carry ECN/CWR (`VIRTIO_NET_HDR_GSO_ECN`).
pub const GSO_ECN: u8 = 0x80;
/// Shortest frame accepted: an Ethernet header.
pub const MIN_FRAME_LEN: usize = 14;
/// Longest frame accepted (MTU 65521 plus an Ethernet and a VLAN header).
pub const MAX_FRAME_LEN: usize = 65_539;
/// Longest frame of a [`KIND_FRAME_OFFLOAD`] message: a 64 KiB IP packet to segment
/// (65535 bytes) plus an Ethernet and a VLAN header.
pub const MAX_OFFLOAD_FRAME_LEN: usize = 65_553;
/// Length of a [`KIND_LINK`] payload.
pub const LINK_LEN: usize = 16;
/// [`LinkState`] flag: the link is up (carrier).
pub const LINK_UP: u32 = 1 << 0;

crate::layout! {
    /// The header of every frame message.
    struct NetHeader [NET_HEADER_LEN] {
        kind: u8,
        flags: u8,
        reserved: [u8; 2],
        len: u32,
    }
}

crate::layout! {
    /// The payload of a [`KIND_LINK`] message.
    struct LinkPayload [LINK_LEN] {
        flags: u32,
        mtu: u32,
        mac: [u8; 6],
        reserved: [u8; 2],
    }
}

/// The lent interface as the lender sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinkState {
    /// The link is up.
    pub up: bool,
    /// The interface's MTU (payload bytes of a frame).
    pub mtu: u32,
    /// The interface's MAC address.
    pub mac: [u8; 6],
}

impl LinkState {
    /// Appends the message (header and payload) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&header(KIND_LINK, LINK_LEN as u32));
        LinkPayload {
            flags: if self.up { LINK_UP } else { 0 },
            mtu: self.mtu,
            mac: self.mac,
            reserved: [0; 2],
        }
        .push(out);
    }

    fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(p);
        let l = LinkPayload::read(&mut r)?;
        r.finish()?;
        const WHAT: &str = "reserved bits of a link message";
        if l.flags & !LINK_UP != 0 {
            return Err(WireError::Invalid(WHAT));
        }
        codec::reserved(&l.reserved, WHAT)?;
        Ok(LinkState {
            up: l.flags & LINK_UP != 0,
            mtu: l.mtu,
            mac: l.mac,
        })
    }
}

crate::layout! {
    /// What is left to the lender for one frame: the first 10 bytes of virtio 1.2's
    /// `struct virtio_net_hdr` (§5.1.6), little-endian, which is also the header of an
    /// AF_PACKET socket with `PACKET_VNET_HDR` on a little-endian host.
    #[derive(Default)]
    pub struct Offload [OFFLOAD_LEN] {
        /// [`OFFLOAD_NEEDS_CSUM`] or 0.
        pub flags: u8,
        /// [`GSO_NONE`], [`GSO_TCPV4`] or [`GSO_TCPV6`], optionally with [`GSO_ECN`].
        pub gso_type: u8,
        /// Bytes of headers (Ethernet to TCP) a segment repeats; a hint.
        pub hdr_len: u16,
        /// Payload bytes per segment (the MSS) when segmenting.
        pub gso_size: u16,
        /// Byte offset in the frame where checksumming starts.
        pub csum_start: u16,
        /// Offset after `csum_start` where the 16-bit checksum is stored.
        pub csum_offset: u16,
    }
}

impl Offload {
    /// Parses the 10 bytes `b` (virtio_net_hdr layout).
    pub fn from_bytes(b: &[u8; OFFLOAD_LEN]) -> Self {
        Self::decode(b)
    }

    /// The 10 bytes of the header.
    pub fn to_bytes(&self) -> [u8; OFFLOAD_LEN] {
        self.encode()
    }

    /// Whether a guest that takes `accept` ([`KIND_OFFLOADS`] bits) takes this frame:
    /// its checksum flags need [`RX_CSUM`], and its segmentation the matching TSO (and
    /// ECN) bit.
    pub fn taken_by(&self, accept: u32) -> bool {
        if self.flags != 0 && accept & RX_CSUM == 0 {
            return false;
        }
        let ecn_ok = self.gso_type & GSO_ECN == 0 || accept & RX_ECN != 0;
        match self.gso_type & !GSO_ECN {
            GSO_NONE => true,
            GSO_TCPV4 => ecn_ok && accept & RX_TSO4 != 0,
            GSO_TCPV6 => ecn_ok && accept & RX_TSO6 != 0,
            _ => false,
        }
    }

    /// Whether nothing is left to the lender (a plain frame).
    pub fn is_none(&self) -> bool {
        self.flags == 0 && self.gso_type == GSO_NONE
    }

    /// Checks the header against a frame of `frame_len` bytes: only NEEDS_CSUM as a
    /// flag (and DATA_VALID, when `rx`: a frame towards the guest); segmentation only
    /// of TCP (v4/v6, ECN allowed) with a nonzero segment size and a checksum to
    /// complete (or, when `rx`, one validated); the checksum field inside the frame.
    ///
    /// # Errors
    /// [`WireError::Invalid`] naming the first rule broken.
    pub fn validate(&self, frame_len: usize, rx: bool) -> Result<(), WireError> {
        let allowed = if rx {
            OFFLOAD_NEEDS_CSUM | OFFLOAD_DATA_VALID
        } else {
            OFFLOAD_NEEDS_CSUM
        };
        if self.flags & !allowed != 0 {
            return Err(WireError::Invalid("offload flags not allowed this way"));
        }
        match self.gso_type & !GSO_ECN {
            GSO_NONE if self.gso_type & GSO_ECN != 0 => {
                return Err(WireError::Invalid("ECN without segmentation"))
            }
            GSO_NONE => {}
            GSO_TCPV4 | GSO_TCPV6 => {
                if self.flags == 0 {
                    return Err(WireError::Invalid("segmentation without a checksum"));
                }
                if self.gso_size == 0 {
                    return Err(WireError::Invalid("segmentation with gso_size 0"));
                }
            }
            _ => return Err(WireError::Invalid("segmentation type other than TCP")),
        }
        if self.flags & OFFLOAD_NEEDS_CSUM != 0
            && usize::from(self.csum_start) + usize::from(self.csum_offset) + 2 > frame_len
        {
            return Err(WireError::Invalid("checksum field past the frame"));
        }
        Ok(())
    }
}

/// Appends a [`KIND_FRAME_OFFLOAD`] message carrying `offload` and `frame` to `out`.
pub fn encode_offload_frame(offload: &Offload, frame: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&header(
        KIND_FRAME_OFFLOAD,
        (OFFLOAD_LEN + frame.len()) as u32,
    ));
    offload.push(out);
    out.extend_from_slice(frame);
}

/// The header of a message of `kind` with `len` payload bytes.
pub fn header(kind: u8, len: u32) -> [u8; NET_HEADER_LEN] {
    NetHeader {
        kind,
        flags: 0,
        reserved: [0; 2],
        len,
    }
    .encode()
}

/// Appends a [`KIND_FRAME`] message carrying `frame` to `out`.
pub fn encode_frame(frame: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&header(KIND_FRAME, frame.len() as u32));
    out.extend_from_slice(frame);
}

/// A decoded message, borrowing its payload from the input.
#[derive(Debug, PartialEq, Eq)]
pub enum NetMessage<'a> {
    /// An Ethernet frame.
    Frame(&'a [u8]),
    /// The link state.
    Link(LinkState),
    /// An Ethernet frame with checksum/segmentation left to the other end; the header
    /// is checked against the frame as a frame towards the guest
    /// ([`Offload::validate`] with `rx`: the lender checks again, without).
    OffloadFrame(Offload, &'a [u8]),
    /// The offloaded frames the guest takes ([`KIND_OFFLOADS`] bits).
    Offloads(u32),
    /// A heartbeat ([`KIND_HEARTBEAT`]): nothing to do.
    Heartbeat,
}

/// Appends a [`KIND_HEARTBEAT`] message to `out`.
pub fn encode_heartbeat(out: &mut Vec<u8>) {
    out.extend_from_slice(&header(KIND_HEARTBEAT, 0));
}

/// Appends a [`KIND_OFFLOADS`] message (`RX_*` bits) to `out`.
pub fn encode_offloads(bits: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(&header(KIND_OFFLOADS, OFFLOADS_LEN as u32));
    codec::push(out, bits);
}

/// Decodes the first message of `buf`: `Ok(None)` when `buf` holds only part of it
/// (read more), else the message and its total length in bytes.
///
/// # Errors
/// [`WireError::Invalid`] for an unknown kind or reserved bytes that are not zero,
/// [`WireError::TooLong`] / [`WireError::Invalid`] for a length out of range. Every
/// length is checked before anything is read past the header.
pub fn decode(buf: &[u8]) -> Result<Option<(NetMessage<'_>, usize)>, WireError> {
    let mut r = Reader::new(buf);
    let Ok(h) = NetHeader::read(&mut r) else {
        return Ok(None);
    };
    const WHAT: &str = "reserved bytes of a frame message";
    if h.flags != 0 {
        return Err(WireError::Invalid(WHAT));
    }
    codec::reserved(&h.reserved, WHAT)?;
    let len = h.len as usize;
    match h.kind {
        KIND_FRAME => {
            if len > MAX_FRAME_LEN {
                return Err(WireError::TooLong {
                    what: "frame",
                    len: len as u64,
                    limit: MAX_FRAME_LEN as u64,
                });
            }
            if len < MIN_FRAME_LEN {
                return Err(WireError::Invalid("frame shorter than an Ethernet header"));
            }
        }
        KIND_FRAME_OFFLOAD => {
            if len > OFFLOAD_LEN + MAX_OFFLOAD_FRAME_LEN {
                return Err(WireError::TooLong {
                    what: "frame",
                    len: len as u64,
                    limit: (OFFLOAD_LEN + MAX_OFFLOAD_FRAME_LEN) as u64,
                });
            }
            if len < OFFLOAD_LEN + MIN_FRAME_LEN {
                return Err(WireError::Invalid("frame shorter than an Ethernet header"));
            }
        }
        KIND_LINK => {
            if len != LINK_LEN {
                return Err(WireError::Invalid("link message length"));
            }
        }
        KIND_OFFLOADS => {
            if len != OFFLOADS_LEN {
                return Err(WireError::Invalid("offloads message length"));
            }
        }
        KIND_HEARTBEAT => {
            if len != 0 {
                return Err(WireError::Invalid("heartbeat message length"));
            }
        }
        _ => return Err(WireError::Invalid("frame message kind")),
    }
    let Ok(payload) = r.bytes(len) else {
        return Ok(None);
    };
    let total = r.position();
    let mut p = Reader::new(payload);
    let msg = match h.kind {
        KIND_FRAME => NetMessage::Frame(payload),
        KIND_FRAME_OFFLOAD => {
            let o = Offload::read(&mut p)?;
            let frame = p.rest();
            o.validate(frame.len(), true)?;
            NetMessage::OffloadFrame(o, frame)
        }
        KIND_OFFLOADS => {
            let bits = p.u32()?;
            if bits & !(RX_CSUM | RX_TSO4 | RX_TSO6 | RX_ECN) != 0 {
                return Err(WireError::Invalid("unknown offload bits"));
            }
            NetMessage::Offloads(bits)
        }
        KIND_HEARTBEAT => NetMessage::Heartbeat,
        _ => NetMessage::Link(LinkState::decode(payload)?),
    };
    Ok(Some((msg, total)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_is_an_empty_message_and_one_with_a_payload_is_refused() {
        let mut b = Vec::new();
        encode_heartbeat(&mut b);
        assert_eq!(b.len(), NET_HEADER_LEN);
        assert_eq!(
            decode(&b).unwrap(),
            Some((NetMessage::Heartbeat, NET_HEADER_LEN))
        );
        let mut bad = header(KIND_HEARTBEAT, 4).to_vec();
        bad.extend_from_slice(&[0; 4]);
        assert!(decode(&bad).is_err());
    }

    #[test]
    fn frames_and_link_round_trip_in_one_buffer() {
        let mut b = Vec::new();
        let link = LinkState {
            up: true,
            mtu: 9000,
            mac: [2, 0, 0, 0, 0, 7],
        };
        link.encode(&mut b);
        encode_frame(&[0xab; 60], &mut b);
        encode_frame(&[0xcd; 9014], &mut b);
        let (m, n) = decode(&b).unwrap().unwrap();
        assert_eq!(m, NetMessage::Link(link));
        let (m, n2) = decode(&b[n..]).unwrap().unwrap();
        assert_eq!(m, NetMessage::Frame(&[0xab; 60][..]));
        let (m, n3) = decode(&b[n + n2..]).unwrap().unwrap();
        assert_eq!(m, NetMessage::Frame(&[0xcd; 9014][..]));
        assert_eq!(n + n2 + n3, b.len());
        // Every cut short of a whole message asks for more.
        for cut in 0..n2 {
            assert_eq!(decode(&b[n..n + cut]).unwrap(), None);
        }
    }

    #[test]
    fn offload_frames_round_trip_and_bad_headers_are_refused() {
        let tso = Offload {
            flags: OFFLOAD_NEEDS_CSUM,
            gso_type: GSO_TCPV4 | GSO_ECN,
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
        };
        let frame = vec![0x5a; 30_000];
        let mut b = Vec::new();
        encode_offload_frame(&tso, &frame, &mut b);
        let (m, n) = decode(&b).unwrap().unwrap();
        assert_eq!(m, NetMessage::OffloadFrame(tso, &frame[..]));
        assert_eq!(n, b.len());
        assert_eq!(Offload::from_bytes(&tso.to_bytes()), tso);
        let bad = [
            Offload { flags: 4, ..tso },
            Offload { gso_type: 3, ..tso },
            Offload { gso_size: 0, ..tso },
            Offload { flags: 0, ..tso },
            Offload {
                gso_type: GSO_ECN,
                ..tso
            },
            Offload {
                csum_start: 29_990,
                ..tso
            },
        ];
        for o in bad {
            let mut b = Vec::new();
            encode_offload_frame(&o, &frame, &mut b);
            assert!(decode(&b).is_err(), "{o:?} accepted");
        }
        // A checksum-only frame, the field at the frame's very end.
        let csum = Offload {
            flags: OFFLOAD_NEEDS_CSUM,
            csum_start: 34,
            csum_offset: 6,
            ..Offload::default()
        };
        assert!(csum.validate(42, false).is_ok() && csum.validate(41, false).is_err());
        // DATA_VALID only towards the guest (a GRO'd frame carries it, with no
        // checksum to complete).
        let gro = Offload {
            flags: OFFLOAD_DATA_VALID,
            ..tso
        };
        assert!(gro.validate(30_000, true).is_ok() && gro.validate(30_000, false).is_err());
        assert!(gro.taken_by(RX_CSUM | RX_TSO4 | RX_ECN));
        assert!(!gro.taken_by(RX_CSUM | RX_TSO6 | RX_ECN));
        assert!(!gro.taken_by(RX_TSO4) && !tso.taken_by(RX_CSUM | RX_TSO4));
        assert!(tso.taken_by(RX_CSUM | RX_TSO4 | RX_ECN));
        let mut b = Vec::new();
        encode_offloads(RX_CSUM | RX_TSO6, &mut b);
        assert_eq!(
            decode(&b).unwrap(),
            Some((
                NetMessage::Offloads(RX_CSUM | RX_TSO6),
                NET_HEADER_LEN + OFFLOADS_LEN
            ))
        );
        b[NET_HEADER_LEN] = 0x10;
        assert!(decode(&b).is_err());
        assert!(decode(&header(KIND_FRAME_OFFLOAD, (OFFLOAD_LEN + 13) as u32)).is_err());
    }

    #[test]
    fn bad_lengths_kinds_and_reserved_bytes_are_refused() {
        let too_long = header(KIND_FRAME, (MAX_FRAME_LEN + 1) as u32);
        assert!(matches!(decode(&too_long), Err(WireError::TooLong { .. })));
        let huge = header(KIND_FRAME, u32::MAX);
        assert!(decode(&huge).is_err());
        let short = header(KIND_FRAME, 13);
        assert!(decode(&short).is_err());
        assert!(decode(&header(KIND_LINK, 11)).is_err());
        assert!(decode(&header(0x01, 24)).is_err());
        let mut reserved = header(KIND_FRAME, 60);
        reserved[2] = 1;
        assert!(decode(&reserved).is_err());
        let mut b = Vec::new();
        LinkState::default().encode(&mut b);
        b[NET_HEADER_LEN] = 0x80;
        assert!(decode(&b).is_err());
    }
}

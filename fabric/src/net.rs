//! Frame messages of a lent NIC (feature [`FEATURE_NET`]): Ethernet frames each way and
//! the interface's link state, after the handshake of a queue-pair session.
//!
//! Every message is an 8-byte header `kind: u8, flags: u8 = 0, reserved: u16 = 0,
//! len: u32` followed by `len` bytes. Both ends write many messages per write. Layouts
//! are in `docs/protocol.md`.

use crate::WireError;

/// [`crate::Hello::features`] bit: the borrower can be lent a NIC (frame messages). A
/// lender grants it only for a network interface, and refuses a NIC to a hello without it.
pub const FEATURE_NET: u64 = 1 << 0;

/// Header length of every frame message.
pub const NET_HEADER_LEN: usize = 8;
/// Message kind: one Ethernet frame (destination MAC first, no FCS).
pub const KIND_FRAME: u8 = 0x20;
/// Message kind: the lent interface's link state, MTU and MAC ([`LinkState`]).
pub const KIND_LINK: u8 = 0x21;
/// Shortest frame accepted: an Ethernet header.
pub const MIN_FRAME_LEN: usize = 14;
/// Longest frame accepted (MTU 65521 plus an Ethernet and a VLAN header).
pub const MAX_FRAME_LEN: usize = 65_539;
/// Length of a [`KIND_LINK`] payload.
pub const LINK_LEN: usize = 16;
/// [`LinkState`] flag: the link is up (carrier).
pub const LINK_UP: u32 = 1 << 0;

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
        out.extend_from_slice(&(if self.up { LINK_UP } else { 0 }).to_le_bytes());
        out.extend_from_slice(&self.mtu.to_le_bytes());
        out.extend_from_slice(&self.mac);
        out.extend_from_slice(&[0, 0]);
    }

    fn decode(p: &[u8]) -> Result<Self, WireError> {
        let flags = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
        if flags & !LINK_UP != 0 || p[14] != 0 || p[15] != 0 {
            return Err(WireError::Invalid("reserved bits of a link message"));
        }
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&p[8..14]);
        Ok(LinkState {
            up: flags & LINK_UP != 0,
            mtu: u32::from_le_bytes([p[4], p[5], p[6], p[7]]),
            mac,
        })
    }
}

/// The header of a message of `kind` with `len` payload bytes.
pub fn header(kind: u8, len: u32) -> [u8; NET_HEADER_LEN] {
    let l = len.to_le_bytes();
    [kind, 0, 0, 0, l[0], l[1], l[2], l[3]]
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
}

/// Decodes the first message of `buf`: `Ok(None)` when `buf` holds only part of it
/// (read more), else the message and its total length in bytes.
///
/// # Errors
/// [`WireError::Invalid`] for an unknown kind or reserved bytes that are not zero,
/// [`WireError::TooLong`] / [`WireError::Invalid`] for a length out of range. Every
/// length is checked before anything is read past the header.
pub fn decode(buf: &[u8]) -> Result<Option<(NetMessage<'_>, usize)>, WireError> {
    if buf.len() < NET_HEADER_LEN {
        return Ok(None);
    }
    if buf[1] != 0 || buf[2] != 0 || buf[3] != 0 {
        return Err(WireError::Invalid("reserved bytes of a frame message"));
    }
    let len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    match buf[0] {
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
        KIND_LINK => {
            if len != LINK_LEN {
                return Err(WireError::Invalid("link message length"));
            }
        }
        _ => return Err(WireError::Invalid("frame message kind")),
    }
    let total = NET_HEADER_LEN + len;
    if buf.len() < total {
        return Ok(None);
    }
    let payload = &buf[NET_HEADER_LEN..total];
    let msg = if buf[0] == KIND_FRAME {
        NetMessage::Frame(payload)
    } else {
        NetMessage::Link(LinkState::decode(payload)?)
    };
    Ok(Some((msg, total)))
}

#[cfg(test)]
mod tests {
    use super::*;

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

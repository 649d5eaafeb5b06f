//! Frames received from the lent interface, a batch per `recvmmsg`: each with the
//! packet socket's `virtio_net_hdr`, passed to a guest that takes what it says, else
//! its checksum completed here (or, for a GSO frame, dropped).

use std::os::fd::RawFd;

use devlend_fabric::net;

use super::{BATCH, VNET_HDR_LEN};

/// `VIRTIO_NET_HDR_F_NEEDS_CSUM`: the frame's checksum is left to whoever sends it on.
const VNET_F_NEEDS_CSUM: u8 = 1;

/// Receive buffers for one `recvmmsg` of up to [`BATCH`] frames.
pub(super) struct RxBatch {
    bufs: Vec<Vec<u8>>,
    addrs: Vec<libc::sockaddr_ll>,
    lens: Vec<(usize, bool, bool)>,
}

/// What became of one received frame.
pub(super) enum Rx<'a> {
    /// A frame for the borrower.
    Frame(&'a [u8]),
    /// A frame for the borrower, with what its guest is left to do or need not do
    /// (a checksum to complete or already validated, a GSO frame).
    Offload(net::Offload, &'a [u8]),
    /// Sent by the lender's own host: not the borrower's.
    Outgoing,
    /// Truncated (larger than the buffer, e.g. from GRO) or shorter than a header.
    Drop,
}

impl RxBatch {
    /// Buffers for frames of `mtu` bytes; when `offload`, for GSO frames too (a GRO'd
    /// or TSO frame of up to 64 KiB: 32 such buffers are 2 MiB).
    pub(super) fn new(mtu: u32, offload: bool) -> Self {
        // An Ethernet header, a VLAN tag, and some slack; at least a standard frame.
        let size = if offload {
            net::MAX_OFFLOAD_FRAME_LEN
        } else {
            (mtu as usize + 22).clamp(1536, net::MAX_FRAME_LEN)
        } + VNET_HDR_LEN;
        RxBatch {
            bufs: (0..BATCH).map(|_| vec![0u8; size]).collect(),
            // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
            addrs: (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect(),
            lens: vec![(0, false, false); BATCH],
        }
    }

    /// Receives up to [`BATCH`] frames; returns how many (0: none waiting, or an error).
    pub(super) fn receive(&mut self, fd: RawFd) -> usize {
        let mut iovs: Vec<libc::iovec> = self
            .bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: mmsghdr is plain old data; all-zero is a valid value.
        let mut msgs: Vec<libc::mmsghdr> =
            (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
        for ((m, iov), a) in msgs
            .iter_mut()
            .zip(iovs.iter_mut())
            .zip(self.addrs.iter_mut())
        {
            m.msg_hdr.msg_iov = iov;
            m.msg_hdr.msg_iovlen = 1;
            m.msg_hdr.msg_name = (a as *mut libc::sockaddr_ll).cast();
            m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        }
        // SAFETY: every message points to a live, writable buffer and address of the
        // lengths given, all alive for the call; the socket is non-blocking.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                msgs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_TRUNC,
                std::ptr::null_mut(),
            )
        };
        if n <= 0 {
            return 0;
        }
        for (i, m) in msgs.iter().take(n as usize).enumerate() {
            let outgoing = self.addrs[i].sll_pkttype == libc::PACKET_OUTGOING;
            let truncated = m.msg_hdr.msg_flags & libc::MSG_TRUNC != 0
                || m.msg_len as usize > self.bufs[i].len();
            self.lens[i] = (m.msg_len as usize, outgoing, truncated);
        }
        n as usize
    }

    /// The `i`th frame received: with its packet-socket header when the guest takes
    /// what it says (`accept`: `net::RX_*`), else its checksum completed where the
    /// header asks; a GSO frame the guest does not take is dropped.
    pub(super) fn frame(&mut self, i: usize, accept: u32) -> Rx<'_> {
        match self.lens[i] {
            (_, true, _) => Rx::Outgoing,
            (len, false, false) if len >= VNET_HDR_LEN + net::MIN_FRAME_LEN => {
                let (hdr, frame) = self.bufs[i][..len].split_at_mut(VNET_HDR_LEN);
                let mut h = [0u8; VNET_HDR_LEN];
                h.copy_from_slice(hdr);
                let o = net::Offload::from_bytes(&h);
                if o.flags != 0 && o.taken_by(accept) {
                    return match o.validate(frame.len(), true) {
                        Ok(()) => Rx::Offload(o, frame),
                        Err(e) => {
                            tracing::debug!(len, error = %e, "frame with a bad packet header dropped");
                            Rx::Drop
                        }
                    };
                }
                // A GSO frame (gso_type set) is larger than the MTU: not for a guest
                // that takes no segmentation offload.
                if hdr[1] != 0 {
                    tracing::debug!(len, gso_type = hdr[1], "GSO frame dropped");
                    return Rx::Drop;
                }
                if hdr[0] & VNET_F_NEEDS_CSUM != 0 {
                    let start = usize::from(u16::from_ne_bytes([hdr[6], hdr[7]]));
                    let offset = usize::from(u16::from_ne_bytes([hdr[8], hdr[9]]));
                    if !complete_checksum(frame, start, offset) {
                        return Rx::Drop;
                    }
                }
                Rx::Frame(frame)
            }
            (len, _, truncated) => {
                tracing::debug!(len, truncated, "frame dropped");
                Rx::Drop
            }
        }
    }
}

/// Completes a checksum left to the sender (`CHECKSUM_PARTIAL`): the Internet checksum
/// of `frame[start..]`, whose field at `start + offset` holds the pseudo-header sum,
/// stored in that field (0 written as 0xffff, as Linux does). False when the offsets
/// fall outside the frame.
fn complete_checksum(frame: &mut [u8], start: usize, offset: usize) -> bool {
    let at = start + offset;
    if start >= frame.len() || at + 2 > frame.len() {
        return false;
    }
    let mut sum: u32 = 0;
    let mut words = frame[start..].chunks_exact(2);
    for w in &mut words {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let c = match !(sum as u16) {
        0 => 0xffff,
        c => c,
    };
    frame[at..at + 2].copy_from_slice(&c.to_be_bytes());
    true
}

#[cfg(test)]
mod tests {
    use super::complete_checksum;

    fn fold(mut sum: u32) -> u16 {
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum as u16
    }

    fn sum16(b: &[u8]) -> u32 {
        b.chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
            .sum()
    }

    #[test]
    fn a_partial_checksum_is_completed_so_that_the_receiver_verifies_it() {
        // An Ethernet + IPv4 header (34 bytes) then a TCP segment of odd length; the
        // checksum field (offset 16 in TCP) holds the pseudo-header sum, as Linux
        // leaves it with CHECKSUM_PARTIAL.
        let pseudo: u16 = 0x1c46;
        let mut frame: Vec<u8> = (0..34 + 20 + 37).map(|i| (i * 31 + 7) as u8).collect();
        frame[34 + 16..34 + 18].copy_from_slice(&pseudo.to_be_bytes());
        assert!(complete_checksum(&mut frame, 34, 16));
        // The receiver's check: pseudo-header plus the segment sums to all ones.
        assert_eq!(fold(u32::from(pseudo) + sum16(&frame[34..])), 0xffff);
        // Offsets outside the frame: refused, nothing written.
        let before = frame.clone();
        assert!(!complete_checksum(&mut frame, 80, 16));
        assert!(!complete_checksum(&mut frame, 200, 0));
        assert_eq!(frame, before);
    }
}

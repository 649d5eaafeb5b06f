//! The RDMA transport: rdma_cm connection setup, one RC queue pair per virtqueue,
//! commands and completions as SEND/RECV messages, payloads moved one-sided by the
//! lender (RDMA READ out of guest memory for a write, RDMA WRITE into it for a read,
//! then the completion SEND).
//!
//! The message codec ([`encode_request`], [`decode_request`]) and the errors are always
//! compiled; the verbs themselves (`verbs`: device, PD, CQ, completion channel, QP,
//! MR, each freed on drop) only with the cargo feature `rdma`. Without it every entry
//! point returns [`RdmaError::NotCompiled`]. The layout is in `docs/protocol.md`.

use std::io;

use crate::codec::{self, Reader, Writer};
use crate::wire::{RequestHeader, REQUEST_HEADER_LEN};
use crate::WireError;

#[cfg(feature = "rdma")]
pub mod channel;
#[cfg(feature = "rdma")]
pub mod verbs;

/// Bytes of one remote segment in a request message: address u64, rkey u32, len u32.
pub const SEGMENT_LEN: usize = 16;
/// Bytes between the request header and the segments: count u16, reserved 6 bytes.
pub const SEGMENT_LIST_HEADER_LEN: usize = 8;
/// Most remote segments in one request (one per guest host mapping a buffer spans).
pub const MAX_SEGMENTS: usize = 256;
/// Largest request message: header, segment count, segments.
pub const MAX_REQUEST_MSG: usize =
    REQUEST_HEADER_LEN + SEGMENT_LIST_HEADER_LEN + MAX_SEGMENTS * SEGMENT_LEN;
/// Largest handshake message either way (a hello with a 255-byte name, a 1024-byte
/// token and a challenge; a version 2 reply with a credit, a proof, the longest device
/// description and a 1024-byte message), rounded up.
pub const MAX_HANDSHAKE_MSG: usize = 2048;

const _: () = {
    use crate::handshake::{
        CREDIT_LEN, HELLO_FIXED_LEN, MAX_DESCRIPTION_LEN, MAX_MESSAGE_LEN, MAX_NAME_LEN,
        REPLY_FIXED_LEN, V1_REPLY_FIXED_LEN,
    };
    use crate::lender_proof::{CHALLENGE_LEN, PROOF_LEN};
    let hello = HELLO_FIXED_LEN + MAX_NAME_LEN + crate::lease_token::MAX_TOKEN_LEN + CHALLENGE_LEN;
    let v2 = REPLY_FIXED_LEN + CREDIT_LEN + PROOF_LEN + MAX_DESCRIPTION_LEN + MAX_MESSAGE_LEN;
    let v1 = V1_REPLY_FIXED_LEN + CREDIT_LEN + PROOF_LEN + MAX_MESSAGE_LEN;
    assert!(hello <= MAX_HANDSHAKE_MSG && v2 <= MAX_HANDSHAKE_MSG && v1 <= MAX_HANDSHAKE_MSG);
};
/// Messages each end can receive at once: the largest virtqueue, so the borrower never
/// has more in flight than the lender has receive buffers posted.
pub const RECV_DEPTH: usize = 1024;

crate::layout! {
    /// One range of the borrower's registered memory that the lender reads or writes
    /// (16 bytes on the wire).
    pub struct Segment [SEGMENT_LEN] {
        /// Remote (borrower host virtual) address.
        pub addr: u64,
        /// The memory region's rkey.
        pub rkey: u32,
        /// Bytes.
        pub len: u32,
    }
}

crate::layout! {
    /// What comes between the request header and the segments.
    struct SegmentList [SEGMENT_LIST_HEADER_LEN] {
        count: u16,
        reserved: [u8; 6],
    }
}

const _: () = assert!(MAX_SEGMENTS <= u16::MAX as usize);

/// Why the RDMA transport cannot be used, or a session on it failed.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// This build has no RDMA support.
    #[error("RDMA is not compiled into this build (cargo feature `rdma`); use --transport tcp")]
    NotCompiled,
    /// No RDMA device (HCA, RoCE NIC or Soft-RoCE link) on this machine.
    #[error("no RDMA device on this machine (ibv_get_device_list found none; for Soft-RoCE: rdma link add rxe0 type rxe netdev IFACE)")]
    NoDevice,
    /// rdma_cm is not usable (no `/dev/infiniband/rdma_cm`).
    #[error("rdma_cm is not available (cannot open /dev/infiniband/rdma_cm: is the rdma_ucm module loaded?)")]
    NoCm(#[source] io::Error),
    /// The address is not a usable `IP:PORT`.
    #[error("cannot use {addr:?} as an RDMA address (IP:PORT expected)")]
    BadAddress {
        /// The address as given.
        addr: String,
    },
    /// rdma_cm could not resolve the address to a local RDMA device, or no route.
    #[error("no RDMA route to {addr} ({stage})")]
    Route {
        /// The address as given.
        addr: String,
        /// Which step failed.
        stage: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The lender's rdma_cm listener could not be set up.
    #[error("cannot listen with rdma_cm on {addr}")]
    Listen {
        /// The address as given.
        addr: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A verbs resource (PD, CQ, QP, MR, ...) could not be created.
    #[error("out of RDMA resources: cannot create {what}")]
    Resources {
        /// Which resource.
        what: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The connection was refused, unreachable, or dropped during setup.
    #[error("RDMA connection to {addr} failed: {reason}")]
    Connect {
        /// The peer.
        addr: String,
        /// The rdma_cm event or error.
        reason: String,
    },
    /// The lender did not prove the key the borrower expects, so the borrower did not
    /// send its token ([`crate::holder_proof`]).
    #[error("the lender is not the one expected")]
    WrongLender(#[source] crate::lender_proof::ProofError),
    /// A step of connection setup took too long.
    #[error("timed out {what}")]
    Timeout {
        /// Which step.
        what: &'static str,
    },
    /// A work request completed with an error, or posting one failed.
    #[error("RDMA work request failed: {0}")]
    WorkRequest(String),
    /// The peer disconnected.
    #[error("peer disconnected")]
    Disconnected,
}

/// Whether this build has the RDMA transport.
pub const fn compiled() -> bool {
    cfg!(feature = "rdma")
}

/// Encodes a request message into `out` (at least [`MAX_REQUEST_MSG`] bytes): the
/// 24-byte header (as [`RequestHeader::encode`] gives it), the segment count, the
/// segments (at most [`MAX_SEGMENTS`]; the caller checks). Returns its length, or 0
/// (and writes nothing) when `out` is too short for it.
pub fn encode_request(
    header: &[u8; REQUEST_HEADER_LEN],
    segs: &[Segment],
    out: &mut [u8],
) -> usize {
    let segs = &segs[..segs.len().min(MAX_SEGMENTS)];
    if out.len() < REQUEST_HEADER_LEN + SEGMENT_LIST_HEADER_LEN + segs.len() * SEGMENT_LEN {
        return 0;
    }
    let mut w = Writer::new(out);
    let put = |w: &mut Writer<'_>| -> Result<(), codec::CodecError> {
        w.put_bytes(header)?;
        SegmentList {
            count: segs.len() as u16,
            reserved: [0; 6],
        }
        .write(w)?;
        segs.iter().try_for_each(|s| s.write(w))
    };
    match put(&mut w) {
        Ok(()) => w.position(),
        Err(_) => 0,
    }
}

/// Decodes and checks a request message: the header as over TCP, then a segment list
/// that must be exact: as long as the message says, reserved bytes zero, and for a
/// READ or WRITE at least one segment, none empty, summing to the header's `len`; no
/// segment for other operations. `segs` receives the segments.
///
/// # Errors
/// A [`WireError`] naming what is wrong; the session is then closed.
pub fn decode_request(msg: &[u8], segs: &mut Vec<Segment>) -> Result<RequestHeader, WireError> {
    segs.clear();
    let fixed = REQUEST_HEADER_LEN + SEGMENT_LIST_HEADER_LEN;
    if msg.len() < fixed {
        return Err(WireError::Truncated {
            got: msg.len(),
            want: fixed,
        });
    }
    let mut r = Reader::new(msg);
    let h = RequestHeader::decode(&r.array()?)?;
    let list = SegmentList::read(&mut r)?;
    codec::reserved(&list.reserved, "segment list reserved bytes")?;
    let n = usize::from(list.count);
    if n > MAX_SEGMENTS {
        return Err(WireError::TooLong {
            what: "segment count",
            len: n as u64,
            limit: MAX_SEGMENTS as u64,
        });
    }
    if r.remaining() != n * SEGMENT_LEN {
        return Err(WireError::Invalid(
            "message length does not match its segment count",
        ));
    }
    let mut total = 0u64;
    for _ in 0..n {
        let s = Segment::read(&mut r)?;
        if s.len == 0 {
            return Err(WireError::Invalid("empty segment"));
        }
        if s.addr.checked_add(u64::from(s.len)).is_none() {
            return Err(WireError::Invalid("segment wraps the address space"));
        }
        total += u64::from(s.len);
        segs.push(s);
    }
    let want = h.request.data_len().u64();
    if want > 0 && n == 0 {
        return Err(WireError::Invalid("a read or write without segments"));
    }
    if total != want {
        return Err(WireError::Invalid(
            "segments do not add up to the request length",
        ));
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockRequest, Bytes, Op, Sector};

    fn hdr(op: Op, len: u32) -> RequestHeader {
        let sector = Sector(3);
        let request = match op {
            Op::Read => BlockRequest::Read {
                sector,
                len: Bytes(len),
            },
            Op::Write => BlockRequest::Write {
                sector,
                len: Bytes(len),
            },
            _ => BlockRequest::Flush,
        };
        RequestHeader { id: 7, request }
    }

    fn enc(h: RequestHeader) -> [u8; REQUEST_HEADER_LEN] {
        h.encode()
    }

    #[test]
    fn request_round_trips_and_bad_lists_are_refused() {
        let mut buf = vec![0u8; MAX_REQUEST_MSG];
        let segs = [
            Segment {
                addr: 0x1000,
                rkey: 5,
                len: 512,
            },
            Segment {
                addr: 0x9000,
                rkey: 6,
                len: 1024,
            },
        ];
        let n = encode_request(&enc(hdr(Op::Write, 1536)), &segs, &mut buf);
        let mut out = Vec::new();
        let h = decode_request(&buf[..n], &mut out).expect("valid");
        assert_eq!(h.request.data_len(), Bytes(1536));
        assert_eq!(out, segs);
        // Lengths that do not add up, a cut message, a flush with segments.
        let n2 = encode_request(&enc(hdr(Op::Write, 2048)), &segs, &mut buf);
        assert!(decode_request(&buf[..n2], &mut out).is_err());
        assert!(decode_request(&buf[..n - 1], &mut out).is_err());
        let n3 = encode_request(&enc(hdr(Op::Flush, 0)), &segs[..1], &mut buf);
        assert!(decode_request(&buf[..n3], &mut out).is_err());
        let n4 = encode_request(&enc(hdr(Op::Flush, 0)), &[], &mut buf);
        assert!(decode_request(&buf[..n4], &mut out).is_ok());
        // An empty segment, a count beyond the limit.
        let z = [Segment {
            addr: 1,
            rkey: 1,
            len: 0,
        }];
        let n5 = encode_request(&enc(hdr(Op::Read, 0)), &z, &mut buf);
        assert!(decode_request(&buf[..n5], &mut out).is_err());
        let n6 = encode_request(&enc(hdr(Op::Flush, 0)), &[], &mut buf);
        buf[REQUEST_HEADER_LEN..REQUEST_HEADER_LEN + 2].copy_from_slice(&300u16.to_le_bytes());
        assert!(decode_request(&buf[..n6], &mut out).is_err());
    }

    #[cfg(not(feature = "rdma"))]
    #[test]
    fn without_the_feature_it_says_so() {
        assert!(!compiled());
        assert!(RdmaError::NotCompiled.to_string().contains("not compiled"));
    }
}

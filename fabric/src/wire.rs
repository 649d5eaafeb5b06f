//! Block request and response headers (after the handshake).
//!
//! Every integer is little-endian. A request is a [`RequestHeader`] (24 bytes), followed
//! for [`BlockRequest::Write`] by exactly its `len` bytes of data. A response is a
//! [`ResponseHeader`] (16 bytes), followed for a successful [`BlockRequest::Read`] by
//! exactly the `len` bytes the request asked for. Responses carry the request's `id` and
//! may come in any order.
//!
//! The header's `len` field counts bytes for a read or a write and 512-byte sectors for
//! a discard or a write-zeroes: [`BlockRequest`] carries it as [`Bytes`] or [`Sectors`],
//! decided by the operation, so that no caller reads one as the other.

use crate::codec;
use crate::units::{Bytes, Sector, Sectors, UnitError};
use crate::WireError;

/// Size in bytes of an encoded [`RequestHeader`].
pub const REQUEST_HEADER_LEN: usize = 24;
/// Size in bytes of an encoded [`ResponseHeader`].
pub const RESPONSE_HEADER_LEN: usize = 16;
/// Opcode of a response frame (lender to borrower).
pub const OP_RESPONSE: u8 = 0x80;
/// Request flag for [`Op::WriteZeroes`]: the lender may deallocate the range
/// (virtio 1.2 §5.2.6, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP).
pub const FLAG_UNMAP: u8 = 0x01;

/// A block operation (borrower to lender).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Read `len` bytes at `sector` (virtio VIRTIO_BLK_T_IN).
    Read = 1,
    /// Write the `len` bytes that follow at `sector` (VIRTIO_BLK_T_OUT).
    Write = 2,
    /// Make every completed write durable (VIRTIO_BLK_T_FLUSH); `sector` and `len` are 0.
    Flush = 3,
    /// Deallocate `len` sectors at `sector` (VIRTIO_BLK_T_DISCARD); no data follows.
    Discard = 4,
    /// Zero `len` sectors at `sector` (VIRTIO_BLK_T_WRITE_ZEROES); no data follows.
    WriteZeroes = 5,
}

impl Op {
    /// Decodes an opcode byte.
    ///
    /// # Errors
    /// [`WireError::UnknownOp`] for any value not listed in [`Op`].
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            1 => Op::Read,
            2 => Op::Write,
            3 => Op::Flush,
            4 => Op::Discard,
            5 => Op::WriteZeroes,
            other => return Err(WireError::UnknownOp(other)),
        })
    }
}

/// Completion status, with the values of the virtio-blk status byte (virtio 1.2 §5.2.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// VIRTIO_BLK_S_OK.
    Ok = 0,
    /// VIRTIO_BLK_S_IOERR.
    IoErr = 1,
    /// VIRTIO_BLK_S_UNSUPP.
    Unsupp = 2,
}

impl Status {
    /// Decodes a status byte.
    ///
    /// # Errors
    /// [`WireError::UnknownStatus`] for a value other than 0, 1 or 2.
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0 => Status::Ok,
            1 => Status::IoErr,
            2 => Status::Unsupp,
            other => return Err(WireError::UnknownStatus(other)),
        })
    }
}

crate::layout! {
    /// A request header as it is on the wire, before its fields are checked and typed
    /// ([`RequestHeader::decode`]).
    pub struct RawRequest [REQUEST_HEADER_LEN] {
        /// [`Op`].
        pub op: u8,
        /// [`FLAG_UNMAP`] for write-zeroes, else 0.
        pub flags: u8,
        /// 0.
        pub reserved: [u8; 2],
        /// Bytes (read/write) or sectors (discard/write-zeroes); 0 for flush.
        pub len: u32,
        /// The request id.
        pub id: u64,
        /// First sector; 0 for flush.
        pub sector: u64,
    }
}

crate::layout! {
    /// A response header as it is on the wire, before its fields are checked.
    pub struct RawResponse [RESPONSE_HEADER_LEN] {
        /// [`OP_RESPONSE`].
        pub op: u8,
        /// [`Status`].
        pub status: u8,
        /// Bit 0: [`RESPONSE_THROTTLED`]; other bits 0.
        pub flags: u8,
        /// 0.
        pub reserved: u8,
        /// Bytes of data that follow.
        pub len: u32,
        /// The id of the request completed.
        pub id: u64,
    }
}

/// A block request: the operation and its range, each length in its unit.
///
/// A read or a write moves [`Bytes`] (a multiple of 512; the lender checks its
/// `max_transfer`); a discard or a write-zeroes covers [`Sectors`]; every range starts
/// at a [`Sector`]. A flush has neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockRequest {
    /// Read `len` bytes at `sector` (virtio VIRTIO_BLK_T_IN).
    Read {
        /// First sector.
        sector: Sector,
        /// Bytes to read.
        len: Bytes,
    },
    /// Write the `len` bytes that follow the header at `sector` (VIRTIO_BLK_T_OUT).
    Write {
        /// First sector.
        sector: Sector,
        /// Bytes to write.
        len: Bytes,
    },
    /// Make every completed write durable (VIRTIO_BLK_T_FLUSH).
    Flush,
    /// Deallocate `sectors` at `sector` (VIRTIO_BLK_T_DISCARD).
    Discard {
        /// First sector.
        sector: Sector,
        /// Sectors to deallocate.
        sectors: Sectors,
    },
    /// Zero `sectors` at `sector`, deallocating them if `unmap`
    /// (VIRTIO_BLK_T_WRITE_ZEROES).
    WriteZeroes {
        /// First sector.
        sector: Sector,
        /// Sectors to zero.
        sectors: Sectors,
        /// The lender may deallocate the range ([`FLAG_UNMAP`]).
        unmap: bool,
    },
}

impl BlockRequest {
    /// The operation.
    #[inline]
    pub const fn op(&self) -> Op {
        match self {
            BlockRequest::Read { .. } => Op::Read,
            BlockRequest::Write { .. } => Op::Write,
            BlockRequest::Flush => Op::Flush,
            BlockRequest::Discard { .. } => Op::Discard,
            BlockRequest::WriteZeroes { .. } => Op::WriteZeroes,
        }
    }

    /// The first sector of the range (sector 0 for a flush).
    #[inline]
    pub const fn sector(&self) -> Sector {
        match *self {
            BlockRequest::Read { sector, .. }
            | BlockRequest::Write { sector, .. }
            | BlockRequest::Discard { sector, .. }
            | BlockRequest::WriteZeroes { sector, .. } => sector,
            BlockRequest::Flush => Sector(0),
        }
    }

    /// The bytes of data the request moves on the wire: after the header of a write,
    /// after the response of a successful read; 0 for every other operation.
    #[inline]
    pub const fn data_len(&self) -> Bytes {
        match *self {
            BlockRequest::Read { len, .. } | BlockRequest::Write { len, .. } => len,
            _ => Bytes::ZERO,
        }
    }

    /// The length of the device range in bytes (0 for a flush).
    #[inline]
    pub const fn range_len(&self) -> u64 {
        match *self {
            BlockRequest::Read { len, .. } | BlockRequest::Write { len, .. } => len.u64(),
            BlockRequest::Discard { sectors, .. } | BlockRequest::WriteZeroes { sectors, .. } => {
                sectors.bytes_u64()
            }
            BlockRequest::Flush => 0,
        }
    }

    /// The device range in bytes, `sector × 512 .. sector × 512 + range_len` (empty at
    /// 0 for a flush).
    ///
    /// # Errors
    /// [`UnitError::Overflow`] when its start or end does not fit in a `u64`: such a
    /// range is beyond any device.
    #[inline]
    pub const fn byte_range(&self) -> Result<std::ops::Range<u64>, UnitError> {
        self.sector().byte_range(self.range_len())
    }
}

/// Header of a block request: its id and the [`BlockRequest`].
///
/// Layout (24 bytes, [`RawRequest`]): `op: u8, flags: u8, reserved: u16 = 0, len: u32,
/// id: u64, sector: u64`. `len` counts bytes for [`Op::Read`] and [`Op::Write`] and
/// 512-byte sectors for [`Op::Discard`] and [`Op::WriteZeroes`]; `len` and `sector` are
/// 0 for [`Op::Flush`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// The borrower's request id, echoed in the response; unique among requests in flight.
    pub id: u64,
    /// What to do.
    pub request: BlockRequest,
}

impl RequestHeader {
    /// The operation.
    #[inline]
    pub const fn op(&self) -> Op {
        self.request.op()
    }

    /// Encodes into the 24-byte wire layout.
    #[inline]
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let (len, flags) = match self.request {
            BlockRequest::Read { len, .. } | BlockRequest::Write { len, .. } => (len.0, 0),
            BlockRequest::Flush => (0, 0),
            BlockRequest::Discard { sectors, .. } => (sectors.0, 0),
            BlockRequest::WriteZeroes { sectors, unmap, .. } => {
                (sectors.0, if unmap { FLAG_UNMAP } else { 0 })
            }
        };
        RawRequest {
            op: self.op() as u8,
            flags,
            reserved: [0; 2],
            len,
            id: self.id,
            sector: self.request.sector().0,
        }
        .encode()
    }

    /// Decodes the 24-byte wire layout.
    ///
    /// # Errors
    /// [`WireError::UnknownOp`]; [`WireError::Invalid`] when reserved bits are set, a
    /// flag does not belong to the operation, or a flush has a sector or a length.
    #[inline]
    pub fn decode(b: &[u8; REQUEST_HEADER_LEN]) -> Result<Self, WireError> {
        let raw = RawRequest::decode(b);
        let op = Op::from_u8(raw.op)?;
        codec::reserved(&raw.reserved, "reserved bytes of a request header")?;
        let allowed = if op == Op::WriteZeroes { FLAG_UNMAP } else { 0 };
        if raw.flags & !allowed != 0 {
            return Err(WireError::Invalid("request flags"));
        }
        let sector = Sector(raw.sector);
        let request = match op {
            Op::Read => BlockRequest::Read {
                sector,
                len: Bytes(raw.len),
            },
            Op::Write => BlockRequest::Write {
                sector,
                len: Bytes(raw.len),
            },
            Op::Flush if raw.len != 0 || raw.sector != 0 => {
                return Err(WireError::Invalid("a flush with a sector or a length"))
            }
            Op::Flush => BlockRequest::Flush,
            Op::Discard => BlockRequest::Discard {
                sector,
                sectors: Sectors(raw.len),
            },
            Op::WriteZeroes => BlockRequest::WriteZeroes {
                sector,
                sectors: Sectors(raw.len),
                unmap: raw.flags & FLAG_UNMAP != 0,
            },
        };
        Ok(RequestHeader {
            id: raw.id,
            request,
        })
    }
}

/// Header of a response.
///
/// Layout (16 bytes, [`RawResponse`]): `op: u8 = 0x80, status: u8, flags: u8,
/// reserved: u8 = 0, len: u32, id: u64`. `len` is the number of data bytes that follow:
/// the request's `len` for a successful read, else 0. `flags` bit 0
/// ([`RESPONSE_THROTTLED`]) is set only for a borrower granted
/// [`FEATURE_THROTTLE_NOTE`]; other bits are 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    /// Outcome of the request.
    pub status: Status,
    /// Bytes of data that follow the header.
    pub len: Bytes,
    /// The id of the request this completes.
    pub id: u64,
    /// The request waited on the lender for its holder's limits (`docs/qos.md`).
    pub throttled: bool,
}

/// [`crate::Hello::features`] bit 9: the borrower may send heartbeat frames
/// ([`HEARTBEAT_FRAME`]) on a block session over a byte stream; a lender that reads them
/// grants the bit in its reply, and the borrower sends them only then.
pub const FEATURE_HEARTBEAT: u64 = 1 << 9;

/// Opcode of a heartbeat frame (borrower to lender, with [`FEATURE_HEARTBEAT`]).
pub const OP_HEARTBEAT: u8 = 0x40;

/// A heartbeat frame: a request header with opcode [`OP_HEARTBEAT`] and every other
/// byte 0. It asks for nothing: the lender reads it and drops it, takes no credit for
/// it and sends no response. What it is for is the lender's **TCP** acknowledgement: a
/// borrower sends one while it waits for responses, so a path that silently dropped
/// shows as data left unacknowledged past the socket's `TCP_USER_TIMEOUT`
/// (`docs/protocol.md`, "Paths and heartbeats").
pub const HEARTBEAT_FRAME: [u8; REQUEST_HEADER_LEN] = {
    let mut f = [0u8; REQUEST_HEADER_LEN];
    f[0] = OP_HEARTBEAT;
    f
};

/// Response flag: the request waited on the lender for its holder's limits.
pub const RESPONSE_THROTTLED: u8 = 1;

/// [`crate::Hello::features`] bit 5: the borrower reads [`RESPONSE_THROTTLED`]; a
/// lender that sets it grants the bit in its reply, and only then sets the flag.
pub const FEATURE_THROTTLE_NOTE: u64 = 1 << 5;

impl ResponseHeader {
    /// Encodes into the 16-byte wire layout.
    #[inline]
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_LEN] {
        RawResponse {
            op: OP_RESPONSE,
            status: self.status as u8,
            flags: if self.throttled {
                RESPONSE_THROTTLED
            } else {
                0
            },
            reserved: 0,
            len: self.len.0,
            id: self.id,
        }
        .encode()
    }

    /// Decodes the 16-byte wire layout.
    ///
    /// # Errors
    /// [`WireError::UnknownOp`] if the opcode is not a response, [`WireError::UnknownStatus`],
    /// [`WireError::Invalid`] for an unknown flag or a non-zero reserved byte.
    #[inline]
    pub fn decode(b: &[u8; RESPONSE_HEADER_LEN]) -> Result<Self, WireError> {
        let raw = RawResponse::decode(b);
        if raw.op != OP_RESPONSE {
            return Err(WireError::UnknownOp(raw.op));
        }
        let status = Status::from_u8(raw.status)?;
        codec::reserved(
            &[raw.flags & !RESPONSE_THROTTLED, raw.reserved],
            "reserved bits of a response header",
        )?;
        Ok(ResponseHeader {
            status,
            len: Bytes(raw.len),
            id: raw.id,
            throttled: raw.flags & RESPONSE_THROTTLED != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn request() -> impl Strategy<Value = BlockRequest> {
        let sector = any::<u64>().prop_map(Sector);
        prop_oneof![
            (sector.clone(), any::<u32>()).prop_map(|(sector, n)| BlockRequest::Read {
                sector,
                len: Bytes(n)
            }),
            (sector.clone(), any::<u32>()).prop_map(|(sector, n)| BlockRequest::Write {
                sector,
                len: Bytes(n)
            }),
            Just(BlockRequest::Flush),
            (sector.clone(), any::<u32>()).prop_map(|(sector, n)| BlockRequest::Discard {
                sector,
                sectors: Sectors(n)
            }),
            (sector, any::<u32>(), any::<bool>()).prop_map(|(sector, n, unmap)| {
                BlockRequest::WriteZeroes {
                    sector,
                    sectors: Sectors(n),
                    unmap,
                }
            }),
        ]
    }

    #[test]
    fn request_round_trips() {
        let h = RequestHeader {
            id: u64::MAX - 3,
            request: BlockRequest::WriteZeroes {
                sector: Sector(1 << 40),
                sectors: Sectors(77),
                unmap: true,
            },
        };
        assert_eq!(RequestHeader::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn the_op_decides_the_unit_of_len() {
        let mut b = RawRequest {
            op: Op::Read as u8,
            flags: 0,
            reserved: [0; 2],
            len: 1024,
            id: 1,
            sector: 2,
        };
        let read = RequestHeader::decode(&b.encode()).unwrap().request;
        assert_eq!(read.data_len(), Bytes(1024));
        assert_eq!(read.range_len(), 1024);
        assert_eq!(read.byte_range(), Ok(1024..2048));
        b.op = Op::Discard as u8;
        let discard = RequestHeader::decode(&b.encode()).unwrap().request;
        assert_eq!(
            discard,
            BlockRequest::Discard {
                sector: Sector(2),
                sectors: Sectors(1024)
            }
        );
        assert_eq!(discard.data_len(), Bytes::ZERO, "no data on the wire");
        assert_eq!(discard.range_len(), 1024 * 512);
        assert_eq!(discard.byte_range(), Ok(1024..1024 + 512 * 1024));
        b.sector = u64::MAX / 2;
        let far = RequestHeader::decode(&b.encode()).unwrap().request;
        assert!(
            far.byte_range().is_err(),
            "an overflow is an error, not a wrap"
        );
        assert_eq!(BlockRequest::Flush.byte_range(), Ok(0..0));
    }

    #[test]
    fn request_rejects_unknown_op_flags_reserved_and_a_flush_with_a_range() {
        let h = RequestHeader {
            id: 1,
            request: BlockRequest::Read {
                sector: Sector(0),
                len: Bytes(512),
            },
        };
        let mut b = h.encode();
        b[0] = 9;
        assert!(matches!(
            RequestHeader::decode(&b),
            Err(WireError::UnknownOp(9))
        ));
        let mut b = h.encode();
        b[1] = FLAG_UNMAP;
        assert!(matches!(
            RequestHeader::decode(&b),
            Err(WireError::Invalid(_))
        ));
        let mut b = h.encode();
        b[3] = 1;
        assert!(matches!(
            RequestHeader::decode(&b),
            Err(WireError::Invalid(_))
        ));
        for (len, sector) in [(512, 0), (0, 8)] {
            let raw = RawRequest {
                op: Op::Flush as u8,
                flags: 0,
                reserved: [0; 2],
                len,
                id: 1,
                sector,
            };
            assert!(matches!(
                RequestHeader::decode(&raw.encode()),
                Err(WireError::Invalid(_))
            ));
        }
    }

    #[test]
    fn response_round_trips_and_rejects_garbage() {
        let h = ResponseHeader {
            status: Status::Unsupp,
            len: Bytes(4096),
            id: 42,
            throttled: false,
        };
        assert_eq!(ResponseHeader::decode(&h.encode()).unwrap(), h);
        let t = ResponseHeader {
            throttled: true,
            ..h
        };
        assert_eq!(t.encode()[2], RESPONSE_THROTTLED);
        assert_eq!(ResponseHeader::decode(&t.encode()).unwrap(), t);
        for (byte, v) in [(2, 2u8), (2, 0x81), (3, 1)] {
            let mut b = h.encode();
            b[byte] = v;
            assert!(
                matches!(ResponseHeader::decode(&b), Err(WireError::Invalid(_))),
                "{byte} {v}"
            );
        }
        let mut b = h.encode();
        b[1] = 7;
        assert!(matches!(
            ResponseHeader::decode(&b),
            Err(WireError::UnknownStatus(7))
        ));
        let mut b = h.encode();
        b[0] = 1;
        assert!(matches!(
            ResponseHeader::decode(&b),
            Err(WireError::UnknownOp(1))
        ));
    }

    proptest! {
        #[test]
        fn every_request_round_trips(id: u64, request in request()) {
            let h = RequestHeader { id, request };
            prop_assert_eq!(RequestHeader::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn every_response_round_trips(status in 0u8..3, len: u32, id: u64, throttled: bool) {
            let h = ResponseHeader { status: Status::from_u8(status).unwrap(), len: Bytes(len), id, throttled };
            prop_assert_eq!(ResponseHeader::decode(&h.encode()).unwrap(), h);
        }

        /// Any 24 bytes: an error, or a header that encodes back to exactly them.
        #[test]
        fn arbitrary_request_bytes_decode_canonically(b: [u8; REQUEST_HEADER_LEN]) {
            if let Ok(h) = RequestHeader::decode(&b) {
                prop_assert_eq!(h.encode(), b);
            }
        }

        #[test]
        fn arbitrary_response_bytes_decode_canonically(b: [u8; RESPONSE_HEADER_LEN]) {
            if let Ok(h) = ResponseHeader::decode(&b) {
                prop_assert_eq!(h.encode(), b);
            }
        }
    }
}

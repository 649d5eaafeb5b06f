//! Block request and response headers (after the handshake).
//!
//! Every integer is little-endian. A request is a [`RequestHeader`] (24 bytes), followed
//! for [`Op::Write`] by exactly `len` bytes of data. A response is a [`ResponseHeader`]
//! (16 bytes), followed for a successful [`Op::Read`] by exactly the `len` bytes the
//! request asked for. Responses carry the request's `id` and may come in any order.

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

/// Header of a block request.
///
/// Layout (24 bytes): `op: u8, flags: u8, reserved: u16 = 0, len: u32, id: u64,
/// sector: u64`. `len` counts bytes for [`Op::Read`] and [`Op::Write`] and 512-byte
/// sectors for [`Op::Discard`] and [`Op::WriteZeroes`]; it is 0 for [`Op::Flush`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// The operation.
    pub op: Op,
    /// [`FLAG_UNMAP`] for write-zeroes; every other bit must be 0.
    pub flags: u8,
    /// Bytes (read/write) or sectors (discard/write-zeroes).
    pub len: u32,
    /// The borrower's request id, echoed in the response; unique among requests in flight.
    pub id: u64,
    /// First 512-byte sector addressed.
    pub sector: u64,
}

impl RequestHeader {
    /// Encodes into the 24-byte wire layout.
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0] = self.op as u8;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.sector.to_le_bytes());
        b
    }

    /// Decodes the 24-byte wire layout.
    ///
    /// # Errors
    /// [`WireError::UnknownOp`]; [`WireError::Invalid`] when reserved bits are set or a
    /// flag does not belong to the operation.
    pub fn decode(b: &[u8; REQUEST_HEADER_LEN]) -> Result<Self, WireError> {
        let op = Op::from_u8(b[0])?;
        let flags = b[1];
        if b[2] != 0 || b[3] != 0 {
            return Err(WireError::Invalid("reserved bytes of a request header"));
        }
        let allowed = if op == Op::WriteZeroes { FLAG_UNMAP } else { 0 };
        if flags & !allowed != 0 {
            return Err(WireError::Invalid("request flags"));
        }
        Ok(RequestHeader {
            op,
            flags,
            len: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            id: u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()),
            sector: u64::from_le_bytes(b[16..24].try_into().unwrap_or_default()),
        })
    }
}

/// Header of a response.
///
/// Layout (16 bytes): `op: u8 = 0x80, status: u8, reserved: u16 = 0, len: u32, id: u64`.
/// `len` is the number of data bytes that follow: the request's `len` for a successful
/// read, else 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    /// Outcome of the request.
    pub status: Status,
    /// Bytes of data that follow the header.
    pub len: u32,
    /// The id of the request this completes.
    pub id: u64,
}

impl ResponseHeader {
    /// Encodes into the 16-byte wire layout.
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_LEN] {
        let mut b = [0u8; RESPONSE_HEADER_LEN];
        b[0] = OP_RESPONSE;
        b[1] = self.status as u8;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    /// Decodes the 16-byte wire layout.
    ///
    /// # Errors
    /// [`WireError::UnknownOp`] if the opcode is not a response, [`WireError::UnknownStatus`],
    /// [`WireError::Invalid`] for non-zero reserved bytes.
    pub fn decode(b: &[u8; RESPONSE_HEADER_LEN]) -> Result<Self, WireError> {
        if b[0] != OP_RESPONSE {
            return Err(WireError::UnknownOp(b[0]));
        }
        let status = Status::from_u8(b[1])?;
        if b[2] != 0 || b[3] != 0 {
            return Err(WireError::Invalid("reserved bytes of a response header"));
        }
        Ok(ResponseHeader {
            status,
            len: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            id: u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips() {
        let h = RequestHeader {
            op: Op::WriteZeroes,
            flags: FLAG_UNMAP,
            len: 77,
            id: u64::MAX - 3,
            sector: 1 << 40,
        };
        assert_eq!(RequestHeader::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn request_rejects_unknown_op_flags_and_reserved() {
        let h = RequestHeader {
            op: Op::Read,
            flags: 0,
            len: 512,
            id: 1,
            sector: 0,
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
    }

    #[test]
    fn response_round_trips_and_rejects_garbage() {
        let h = ResponseHeader {
            status: Status::Unsupp,
            len: 4096,
            id: 42,
        };
        assert_eq!(ResponseHeader::decode(&h.encode()).unwrap(), h);
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
}

//! What the block kind's wire adds around a request's device I/O: whether a decoded
//! request header keeps its stream in frame ([`check_framing`]: the data that follows a
//! write, the buffer a read needs), and the response header and data that answer it
//! ([`Request::encode_response`], [`Request::response`]), the same over TCP and RDMA
//! (`docs/protocol.md`, "Requests (borrower → lender)" and "Responses"). The device I/O below ([`super::io`])
//! sees neither: it is handed a [`BlockRequest`] and gives back a status.

use devlend_fabric::wire::RESPONSE_HEADER_LEN;
use devlend_fabric::{BlockRequest, Bytes, Op, ResponseHeader, Status};

use super::io::Request;
use crate::MAX_TRANSFER_BYTES;

/// Why a request header cannot be served at all: the session must end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FramingError {
    /// A read or write length beyond [`MAX_TRANSFER_BYTES`].
    #[error("{op:?} of {len} bytes exceeds max_transfer ({MAX_TRANSFER_BYTES} bytes)")]
    TooLong {
        /// The operation.
        op: Op,
        /// Its length in bytes.
        len: u32,
    },
    /// A read or write length that is not a multiple of 512.
    #[error("{op:?} of {len} bytes is not a multiple of 512 bytes")]
    Unaligned {
        /// The operation.
        op: Op,
        /// Its length in bytes.
        len: u32,
    },
}

/// Checks what a header must satisfy for the stream to stay in frame: the length of the
/// data that follows a write, and the buffer a read needs.
///
/// Returns the bytes of buffer the request needs (its data length for a read or write,
/// else 0).
pub(crate) fn check_framing(r: &BlockRequest) -> Result<usize, FramingError> {
    match *r {
        BlockRequest::Read { len, .. } | BlockRequest::Write { len, .. } => {
            let (op, len) = (r.op(), len.0);
            if len > MAX_TRANSFER_BYTES {
                Err(FramingError::TooLong { op, len })
            } else if !Bytes(len).is_whole_sectors() {
                Err(FramingError::Unaligned { op, len })
            } else {
                Ok(len as usize)
            }
        }
        BlockRequest::Flush | BlockRequest::Discard { .. } | BlockRequest::WriteZeroes { .. } => {
            Ok(0)
        }
    }
}

/// Where a response's data comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResponseData<'a> {
    /// These bytes (empty when the response has no data).
    Buf(&'a [u8]),
    /// `len` bytes of the device at byte `offset`.
    File {
        /// Byte offset on the device.
        offset: u64,
        /// Bytes.
        len: usize,
    },
}

impl Request {
    /// Encodes the response header from the final status.
    pub(crate) fn encode_response(&mut self) {
        let len = self.response_data_len() as u32;
        self.resp = ResponseHeader {
            status: self.status,
            len: Bytes(len),
            id: self.id,
            throttled: self.throttled,
        }
        .encode();
    }

    /// The response header (as last encoded) and the data that follows it: a successful
    /// read's data, else nothing.
    pub(crate) fn response(&self) -> (&[u8; RESPONSE_HEADER_LEN], ResponseData<'_>) {
        let n = self.response_data_len();
        let data = if self.from_file && n > 0 {
            ResponseData::File {
                offset: self.offset,
                len: n,
            }
        } else {
            ResponseData::Buf(&self.buf[..n])
        };
        (&self.resp, data)
    }

    pub(in crate::block) fn response_data_len(&self) -> usize {
        if self.op == Op::Read && self.status == Status::Ok {
            self.len as usize
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(op: Op, len: u32) -> BlockRequest {
        let sector = devlend_fabric::Sector(0);
        match op {
            Op::Read => BlockRequest::Read {
                sector,
                len: Bytes(len),
            },
            Op::Write => BlockRequest::Write {
                sector,
                len: Bytes(len),
            },
            Op::Discard => BlockRequest::Discard {
                sector,
                sectors: devlend_fabric::Sectors(len),
            },
            _ => BlockRequest::Flush,
        }
    }

    #[test]
    fn framing_limits() {
        assert_eq!(check_framing(&hdr(Op::Read, 4096)), Ok(4096));
        assert_eq!(
            check_framing(&hdr(Op::Write, MAX_TRANSFER_BYTES)),
            Ok(4 << 20)
        );
        assert!(check_framing(&hdr(Op::Write, MAX_TRANSFER_BYTES + 512)).is_err());
        assert!(check_framing(&hdr(Op::Read, 100)).is_err());
        assert_eq!(check_framing(&hdr(Op::Discard, u32::MAX)), Ok(0));
    }
}

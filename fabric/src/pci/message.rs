//! The header of every message, the reply's status, and [`Message`] itself.

use std::io::{Read, Write};

use super::{
    FLAG_MORE, KIND_COUNTERS, KIND_INFO, KIND_IRQ, KIND_PEER_GROUP, MAX_PAYLOAD, PCI_HEADER_LEN,
    REPLY,
};
use crate::codec::{self, Writer};
use crate::io_util::read_exact_or_eof;
use crate::WireError;

crate::layout! {
    /// The header of every message.
    struct Header [PCI_HEADER_LEN] {
        kind: u8,
        status: u8,
        flags: u8,
        reserved: [u8; 1],
        len: u32,
    }
}

/// Why the lender refused a request (the reply's `status`); the payload says more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PciStatus {
    /// The request was answered.
    Ok = 0,
    /// The request asked for something out of range or not allowed (a region index, an
    /// offset past a BAR, a DMA range that overlaps a mapped one).
    Invalid = 1,
    /// The function or the lender's kernel failed the operation.
    Io = 2,
    /// The function does not support the operation.
    Unsupported = 3,
}

impl PciStatus {
    /// Decodes a status byte.
    ///
    /// # Errors
    /// [`WireError::UnknownStatus`].
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0 => PciStatus::Ok,
            1 => PciStatus::Invalid,
            2 => PciStatus::Io,
            3 => PciStatus::Unsupported,
            other => return Err(WireError::UnknownStatus(other)),
        })
    }
}

/// One message as read off the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The kind (`KIND_*`, ORed with [`REPLY`] for a reply).
    pub kind: u8,
    /// 0 in requests; the outcome in replies.
    pub status: PciStatus,
    /// [`FLAG_MORE`] or 0.
    pub flags: u8,
    /// The payload.
    pub payload: Vec<u8>,
}

impl Message {
    /// A message of `kind` with `payload`, status OK, no flags.
    pub fn new(kind: u8, payload: Vec<u8>) -> Self {
        Message {
            kind,
            status: PciStatus::Ok,
            flags: 0,
            payload,
        }
    }

    /// A refusal of a request of `kind`, with `reason` as payload (cut to 1024 bytes).
    pub fn refusal(kind: u8, status: PciStatus, reason: &str) -> Self {
        Message {
            kind: kind | REPLY,
            status,
            flags: 0,
            payload: crate::text::prefix(reason, 1024).as_bytes().to_vec(),
        }
    }

    /// Bytes of the encoded message (header and payload).
    pub fn encoded_len(&self) -> usize {
        PCI_HEADER_LEN + self.payload.len()
    }

    /// Encodes header and payload into the first [`Self::encoded_len`] bytes of `out`
    /// (e.g. a registered RDMA send buffer); `None` when `out` is shorter.
    pub fn encode_into(&self, out: &mut [u8]) -> Option<usize> {
        let n = self.encoded_len();
        let mut w = Writer::new(out.get_mut(..n)?);
        Header {
            kind: self.kind,
            status: self.status as u8,
            flags: self.flags,
            reserved: [0],
            len: self.payload.len() as u32,
        }
        .write(&mut w)
        .ok()?;
        w.put_bytes(&self.payload).ok()?;
        Some(n)
    }

    /// Encodes header and payload into one buffer (one `write_all`, so that two threads
    /// sharing a connection under a lock never interleave a message).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.encoded_len()];
        self.encode_into(&mut b);
        b
    }

    /// Writes the message.
    ///
    /// # Errors
    /// [`WireError::TooLong`] for a payload over [`MAX_PAYLOAD`]; [`WireError::Io`].
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), WireError> {
        if self.payload.len() > MAX_PAYLOAD {
            return Err(WireError::TooLong {
                what: "PCI message payload",
                len: self.payload.len() as u64,
                limit: MAX_PAYLOAD as u64,
            });
        }
        w.write_all(&self.encode())?;
        Ok(())
    }

    /// Reads one message, checking the header before reading the payload.
    ///
    /// # Errors
    /// [`WireError::Closed`] between messages, [`WireError::Truncated`] inside one,
    /// [`WireError::Invalid`] (unknown kind, flags, reserved byte),
    /// [`WireError::UnknownStatus`], [`WireError::TooLong`], [`WireError::Io`].
    pub fn read_from(r: &mut impl Read) -> Result<Self, WireError> {
        let mut b = [0u8; PCI_HEADER_LEN];
        read_exact_or_eof(r, &mut b)?;
        let h = Header::decode(&b);
        let kind = h.kind;
        if !matches!(kind & !REPLY, KIND_INFO..=KIND_PEER_GROUP)
            && !matches!(kind, KIND_IRQ | KIND_COUNTERS)
        {
            return Err(WireError::Invalid("PCI message kind"));
        }
        let status = PciStatus::from_u8(h.status)?;
        const WHAT: &str = "PCI message flags or reserved byte";
        if h.flags & !FLAG_MORE != 0 {
            return Err(WireError::Invalid(WHAT));
        }
        codec::reserved(&h.reserved, WHAT)?;
        if kind & REPLY == 0 && status != PciStatus::Ok {
            return Err(WireError::Invalid("status in a PCI request"));
        }
        let len = h.len as usize;
        if len > MAX_PAYLOAD {
            return Err(WireError::TooLong {
                what: "PCI message payload",
                len: len as u64,
                limit: MAX_PAYLOAD as u64,
            });
        }
        let mut payload = vec![0u8; len];
        read_exact_or_eof(r, &mut payload).map_err(|e| match e {
            WireError::Closed => WireError::Truncated {
                got: PCI_HEADER_LEN,
                want: PCI_HEADER_LEN + len,
            },
            e => e,
        })?;
        Ok(Message {
            kind,
            status,
            flags: h.flags,
            payload,
        })
    }
}

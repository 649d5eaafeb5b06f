//! The session handshake: the first message each way on a fabric connection.
//!
//! The borrower sends a [`Hello`] ([`hello`]): protocol version, device name, queue
//! index, features. The lender answers with a [`HelloReply`]: a [`HelloStatus`] and, when
//! the status is [`HelloStatus::Ok`], the [`DeviceDescription`] of the device, tagged by
//! kind ([`description`]). A hello may carry a challenge that the lender signs in its
//! reply ([`crate::lender_proof`]). Every integer is little-endian; layouts are in
//! `docs/protocol.md`.
//!
//! Versions: this build speaks 2 and still answers and reads 1 ([`v1`], the fixed
//! block-shaped reply of version 1); a lender answers a hello in the hello's version, and
//! refuses a version it does not speak with [`HelloStatus::UnsupportedVersion`] and a
//! message naming the versions it speaks ([`unsupported_version_message`]).

use std::io::{Read, Write};

use crate::holder_proof::{FEATURE_HOLDER_PROOF, NONCE_LEN};
use crate::lender_proof::{LenderProof, FEATURE_LENDER_PROOF, PROOF_LEN};
use crate::{codec, io_util::read_exact_or_eof, WireError, PROTOCOL_VERSION};

pub mod description;
pub mod hello;
pub mod v1;

pub use description::{
    BlockGeometry, CoherenceMode, DeviceDescription, NicLink, PciIdentity, PciRegion, DEV_DISCARD,
    DEV_READ_ONLY, DEV_WRITE_ZEROES, MAX_DESCRIPTION_LEN,
};
pub use hello::{Hello, HelloFixed};

/// The 4 bytes that start both handshake messages.
pub const MAGIC: [u8; 4] = *b"DVLD";
/// Longest device name in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Longest error message in a [`HelloReply`], in bytes.
pub const MAX_MESSAGE_LEN: usize = 1024;

/// Length of the fixed part of a [`Hello`], before the name and the token.
pub const HELLO_FIXED_LEN: usize = 36;
/// Length of the head every reply starts with, whatever its version: `magic, version,
/// status, features`.
pub const REPLY_HEAD_LEN: usize = 16;
/// Length of the fixed part of a version 2 [`HelloReply`], before the credit, the proof,
/// the description and the message.
pub const REPLY_FIXED_LEN: usize = REPLY_HEAD_LEN + 8;
/// Length of the fixed part of a version 1 [`HelloReply`].
pub const V1_REPLY_FIXED_LEN: usize = REPLY_HEAD_LEN + v1::V1_TAIL_LEN;
/// Length of the [`Credit`] that follows the fixed part of a reply granting
/// [`FEATURE_CREDIT`].
pub const CREDIT_LEN: usize = 8;

/// The oldest protocol version this build still speaks.
pub const MIN_PROTOCOL_VERSION: u16 = 1;

/// Whether this build speaks protocol `version`.
pub fn speaks(version: u16) -> bool {
    (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version)
}

/// What a lender tells a borrower whose hello has a `version` it does not speak.
pub fn unsupported_version_message(version: u16) -> String {
    format!(
        "protocol version {version} is not supported; this lender speaks versions \
         {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
    )
}

crate::layout! {
    /// The head of every [`HelloReply`], whatever its version.
    pub struct ReplyHead [REPLY_HEAD_LEN] {
        /// [`MAGIC`].
        pub magic: [u8; 4],
        /// [`HelloReply::version`].
        pub version: u16,
        /// [`HelloStatus`].
        pub status: u16,
        /// [`HelloReply::features`].
        pub features: u64,
    }
}

crate::layout! {
    /// What follows the head in a version 2 [`HelloReply`].
    pub struct V2Tail [8] {
        /// Bytes of message at the end of the reply.
        pub msg_len: u16,
        /// Bytes of device description before the message: 0 exactly when the status is
        /// not [`HelloStatus::Ok`]; at most [`MAX_DESCRIPTION_LEN`].
        pub desc_len: u16,
        /// 0.
        pub reserved: [u8; 4],
    }
}

/// [`Hello::features`] bit: the borrower keeps within the per-session [`Credit`] that
/// the lender states in its reply, and asks the lender to state it. A lender that grants
/// it sets the bit in [`HelloReply::features`] and sends [`HelloReply::credit`]; it may
/// then end a session that goes beyond it. Granted for block devices.
pub const FEATURE_CREDIT: u64 = 1 << 3;

crate::layout! {
    /// How much a borrower may have outstanding on one session: requests sent whose
    /// responses it has not received whole. The lender sizes its buffers for this and keeps
    /// reading the session while the borrower stays within it, so neither end ever waits
    /// for the other to read (`docs/protocol.md`, flow control).
    ///
    /// Layout (8 bytes): `requests: u32, bytes: u32`.
    pub struct Credit [CREDIT_LEN] {
        /// Most requests outstanding (≥ 1).
        pub requests: u32,
        /// Most bytes of read and write data outstanding (the `len` of READ and WRITE
        /// requests; other requests count 0). One request of any length is allowed when
        /// nothing else is outstanding.
        pub bytes: u32,
    }
}

impl Credit {
    /// What a lender of protocol version 1 without [`FEATURE_CREDIT`] took per session
    /// before it stopped reading: 1024 requests, 64 MiB. A borrower facing such a lender
    /// keeps within it.
    pub const V1_DEFAULT: Credit = Credit {
        requests: 1024,
        bytes: 64 << 20,
    };

    /// Whether a request of `charge` bytes may go out with `requests` requests and
    /// `bytes` bytes already outstanding.
    pub fn admits(&self, requests: usize, bytes: usize, charge: usize) -> bool {
        requests < self.requests as usize
            && (requests == 0 || bytes.saturating_add(charge) <= self.bytes as usize)
    }
}

/// Outcome of a handshake, as the lender states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum HelloStatus {
    /// The session is open; requests may follow.
    Ok = 0,
    /// The lender does not speak the borrower's protocol version.
    UnsupportedVersion = 1,
    /// No device of that name is lent here.
    NoSuchDevice = 2,
    /// The hello was malformed or asked for something not allowed (e.g. the queue index).
    BadRequest = 3,
    /// The lender cannot take the session now (resource limit).
    Busy = 4,
    /// The session was refused by policy (authentication, lease).
    Denied = 5,
    /// Not an outcome: the lender's interim reply to a hello with
    /// [`FEATURE_HOLDER_PROOF`], carrying its proof and a nonce; the borrower answers
    /// with a [`Possession`](crate::holder_proof::Possession), then reads the outcome.
    Prove = 6,
}

impl HelloStatus {
    fn from_u16(v: u16) -> Result<Self, WireError> {
        Ok(match v {
            0 => HelloStatus::Ok,
            1 => HelloStatus::UnsupportedVersion,
            2 => HelloStatus::NoSuchDevice,
            3 => HelloStatus::BadRequest,
            4 => HelloStatus::Busy,
            5 => HelloStatus::Denied,
            6 => HelloStatus::Prove,
            _ => return Err(WireError::Invalid("hello reply status")),
        })
    }
}

/// The lender's answer to a [`Hello`].
///
/// Version 2 layout: the 16-byte head `magic: [u8; 4], version: u16 = 2, status: u16,
/// features: u64`, then `msg_len: u16, desc_len: u16, reserved: [u8; 4] = 0`; then with
/// [`FEATURE_CREDIT`] in `features` the 8-byte credit `requests: u32, bytes: u32`; then
/// with [`FEATURE_LENDER_PROOF`] the 96-byte proof `key: [u8; 32], signature: [u8; 64]`;
/// then with [`FEATURE_HOLDER_PROOF`] the 32-byte nonce of an interim reply
/// ([`HelloStatus::Prove`]); then `desc_len` bytes of [`DeviceDescription`]; then `msg_len` bytes of UTF-8 message.
/// Version 1 (`version` 1): the same head, then the 52-byte block-shaped tail of [`v1`],
/// then the credit, the proof and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloReply {
    /// Protocol version of the reply: the version of the hello it answers (1 or 2).
    pub version: u16,
    /// Whether the session is open.
    pub status: HelloStatus,
    /// Features granted (a subset of those asked for).
    pub features: u64,
    /// The device: `Some` exactly when `status` is [`HelloStatus::Ok`].
    pub device: Option<DeviceDescription>,
    /// The session's credit, sent when [`FEATURE_CREDIT`] is granted (`features` has
    /// the bit exactly when this is `Some`).
    pub credit: Option<Credit>,
    /// The lender's answer to the hello's challenge ([`crate::lender_proof`]), after the
    /// credit, with [`FEATURE_LENDER_PROOF`] in `features` exactly when present.
    pub proof: Option<LenderProof>,
    /// The lender's nonce, in an interim reply ([`HelloStatus::Prove`]) to a hello
    /// proving possession ([`crate::holder_proof`]), with [`FEATURE_HOLDER_PROOF`] in
    /// `features` exactly when present.
    pub nonce: Option<[u8; NONCE_LEN]>,
    /// Why the session was refused (empty on success), at most [`MAX_MESSAGE_LEN`] bytes.
    pub message: String,
}

impl HelloReply {
    /// A successful reply in this build's version, describing `device`.
    pub fn ok(device: impl Into<DeviceDescription>) -> Self {
        HelloReply {
            version: PROTOCOL_VERSION,
            status: HelloStatus::Ok,
            features: 0,
            device: Some(device.into()),
            credit: None,
            proof: None,
            nonce: None,
            message: String::new(),
        }
    }

    /// The interim reply to a hello proving possession: the lender's `proof` of the
    /// hello's challenge (if it has a key) and its `nonce`.
    pub fn prove(proof: Option<LenderProof>, nonce: [u8; NONCE_LEN]) -> Self {
        HelloReply {
            version: PROTOCOL_VERSION,
            status: HelloStatus::Prove,
            features: FEATURE_HOLDER_PROOF,
            device: None,
            credit: None,
            proof,
            nonce: Some(nonce),
            message: String::new(),
        }
    }

    /// A refusal, with a message for the borrower's operator (truncated to
    /// [`MAX_MESSAGE_LEN`] bytes on a character boundary).
    pub fn refuse(status: HelloStatus, message: &str) -> Self {
        HelloReply {
            version: PROTOCOL_VERSION,
            status,
            features: 0,
            device: None,
            credit: None,
            proof: None,
            nonce: None,
            message: crate::text::prefix(message, MAX_MESSAGE_LEN).to_owned(),
        }
    }

    /// The same reply in the version a borrower that sent `hello_version` reads: 1 for
    /// a version 1 hello, else this build's version.
    #[must_use]
    pub fn for_version(mut self, hello_version: u16) -> Self {
        self.version = if hello_version == 1 {
            1
        } else {
            PROTOCOL_VERSION
        };
        self
    }

    /// The geometry, when the reply opened a block device.
    pub fn block(&self) -> Option<&BlockGeometry> {
        self.device.as_ref().and_then(DeviceDescription::as_block)
    }

    /// The link, when the reply opened a network interface.
    pub fn nic(&self) -> Option<&NicLink> {
        self.device.as_ref().and_then(DeviceDescription::as_nic)
    }

    /// The identity, when the reply opened a PCIe function.
    pub fn pci(&self) -> Option<&PciIdentity> {
        self.device.as_ref().and_then(DeviceDescription::as_pci)
    }

    /// Writes the reply in one `write_all`, in version 1's layout when `version` is 1,
    /// else in version 2's.
    ///
    /// # Errors
    /// [`WireError::TooLong`] for a description over its limits (version 2);
    /// [`WireError::Io`].
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), WireError> {
        let msg = &self.message.as_bytes()[..self.message.len().min(MAX_MESSAGE_LEN)];
        let mut features = match self.credit {
            Some(_) => self.features | FEATURE_CREDIT,
            None => self.features & !FEATURE_CREDIT,
        };
        features = match self.proof {
            Some(_) => features | FEATURE_LENDER_PROOF,
            None => features & !FEATURE_LENDER_PROOF,
        };
        features = match self.nonce {
            Some(_) => features | FEATURE_HOLDER_PROOF,
            None => features & !FEATURE_HOLDER_PROOF,
        };
        let mut desc = Vec::new();
        if self.version != 1 {
            if let Some(d) = &self.device {
                d.encode(&mut desc)?;
            }
        }
        let mut b = Vec::with_capacity(
            V1_REPLY_FIXED_LEN + CREDIT_LEN + PROOF_LEN + NONCE_LEN + desc.len() + msg.len(),
        );
        ReplyHead {
            magic: MAGIC,
            version: self.version,
            status: self.status as u16,
            features,
        }
        .push(&mut b);
        // Both bounded: the message by MAX_MESSAGE_LEN, the description by
        // MAX_DESCRIPTION_LEN (both < 65536).
        if self.version == 1 {
            v1::encode(self.device.as_ref(), msg.len() as u16).push(&mut b);
        } else {
            V2Tail {
                msg_len: msg.len() as u16,
                desc_len: desc.len() as u16,
                reserved: [0; 4],
            }
            .push(&mut b);
        }
        if let Some(c) = self.credit {
            c.push(&mut b);
        }
        if let Some(p) = &self.proof {
            b.extend_from_slice(&p.to_bytes());
        }
        if let Some(n) = &self.nonce {
            b.extend_from_slice(n);
        }
        b.extend_from_slice(&desc);
        b.extend_from_slice(msg);
        w.write_all(&b)?;
        Ok(())
    }

    /// Reads and validates a reply of version 1 or 2.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::UnsupportedVersion`] (a version other than
    /// 1 and 2), [`WireError::Invalid`] (status, reserved bytes, a credit of 0 requests,
    /// a description where the status is not `Ok` or none where it is, an invalid
    /// description: [`DeviceDescription::decode`]), [`WireError::TooLong`] (message,
    /// description), [`WireError::Closed`] / [`WireError::Truncated`] /
    /// [`WireError::Io`].
    pub fn read_from(r: &mut impl Read) -> Result<Self, WireError> {
        let mut b = [0u8; REPLY_HEAD_LEN];
        read_exact_or_eof(r, &mut b)?;
        let head = ReplyHead::decode(&b);
        if head.magic != MAGIC {
            return Err(WireError::BadMagic(head.magic));
        }
        let status = HelloStatus::from_u16(head.status)?;
        let (msg_len, desc_len, legacy) = match head.version {
            1 => {
                let mut t = [0u8; v1::V1_TAIL_LEN];
                read_exact_or_eof(r, &mut t)?;
                let t = v1::V1Tail::decode(&t);
                codec::reserved(&t.reserved, "reserved bytes of hello reply")?;
                (usize::from(t.msg_len), 0, Some(t))
            }
            2 => {
                let mut t = [0u8; 8];
                read_exact_or_eof(r, &mut t)?;
                let t = V2Tail::decode(&t);
                codec::reserved(&t.reserved, "reserved bytes of hello reply")?;
                (usize::from(t.msg_len), usize::from(t.desc_len), None)
            }
            v => return Err(WireError::UnsupportedVersion(v)),
        };
        if msg_len > MAX_MESSAGE_LEN {
            return Err(WireError::TooLong {
                what: "hello reply message",
                len: msg_len as u64,
                limit: MAX_MESSAGE_LEN as u64,
            });
        }
        if desc_len > MAX_DESCRIPTION_LEN {
            return Err(WireError::TooLong {
                what: "device description",
                len: desc_len as u64,
                limit: MAX_DESCRIPTION_LEN as u64,
            });
        }
        if legacy.is_none() && (desc_len == 0) == (status == HelloStatus::Ok) {
            return Err(WireError::Invalid(
                "a device description exactly when the session is open",
            ));
        }
        let features = head.features;
        let credit = if features & FEATURE_CREDIT != 0 {
            let mut c = [0u8; CREDIT_LEN];
            read_exact_or_eof(r, &mut c)?;
            let credit = Credit::decode(&c);
            if credit.requests == 0 {
                return Err(WireError::Invalid("credit of 0 requests"));
            }
            Some(credit)
        } else {
            None
        };
        let proof = if features & FEATURE_LENDER_PROOF != 0 {
            let mut p = [0u8; PROOF_LEN];
            read_exact_or_eof(r, &mut p)?;
            Some(LenderProof::from_bytes(&p)?)
        } else {
            None
        };
        let nonce = if features & FEATURE_HOLDER_PROOF != 0 {
            if status != HelloStatus::Prove {
                return Err(WireError::Invalid("a nonce in a reply that is not interim"));
            }
            let mut n = [0u8; NONCE_LEN];
            read_exact_or_eof(r, &mut n)?;
            Some(n)
        } else if status == HelloStatus::Prove {
            return Err(WireError::Invalid("an interim reply without a nonce"));
        } else {
            None
        };
        let mut desc = vec![0u8; desc_len];
        read_exact_or_eof(r, &mut desc)?;
        let mut msg = vec![0u8; msg_len];
        read_exact_or_eof(r, &mut msg)?;
        let device = match (status, legacy) {
            (HelloStatus::Ok, Some(t)) => Some(v1::decode(&t)?),
            (HelloStatus::Ok, None) => Some(DeviceDescription::decode(&desc)?),
            _ => None,
        };
        Ok(HelloReply {
            version: head.version,
            status,
            features,
            device,
            credit,
            proof,
            nonce,
            message: String::from_utf8_lossy(&msg).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests;

//! The session handshake: the first message each way on a fabric connection.
//!
//! The borrower sends a [`Hello`]: protocol version, device name, queue index, features.
//! The lender answers with a [`HelloReply`]: a [`HelloStatus`] and, when the status is
//! [`HelloStatus::Ok`], the [`DeviceInfo`] (capacity, limits, read-only, serial). A hello
//! may carry a challenge that the lender signs in its reply ([`crate::lender_proof`]).
//! Every integer is little-endian; layouts are in `docs/protocol.md`.
//!
//! Why this file is over 600 lines: the last 134 lines (from `#[cfg(test)]` on) are
//! round-trip and refusal tests of the two messages; the rest is the two messages with the
//! constants, device flags and credit they carry, a quarter of it doc comments.

use std::io::{Read, Write};

use crate::codec;
use crate::lease_token::MAX_TOKEN_LEN;
use crate::lender_proof::{LenderProof, CHALLENGE_LEN, FEATURE_LENDER_PROOF, PROOF_LEN};
use crate::{io_util::read_exact_or_eof, WireError, PROTOCOL_VERSION, SERIAL_LEN};

/// The 4 bytes that start both handshake messages.
pub const MAGIC: [u8; 4] = *b"DVLD";
/// Longest device name in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Longest error message in a [`HelloReply`], in bytes.
pub const MAX_MESSAGE_LEN: usize = 1024;

/// Length of the fixed part of a [`Hello`], before the name and the token.
pub const HELLO_FIXED_LEN: usize = 36;
/// Length of the fixed part of a [`HelloReply`], before the credit and the message.
pub const REPLY_FIXED_LEN: usize = 68;
/// Length of the [`Credit`] that follows the fixed part of a reply granting
/// [`FEATURE_CREDIT`].
pub const CREDIT_LEN: usize = 8;

crate::layout! {
    /// The fixed part of a [`Hello`] as it is on the wire.
    pub struct HelloFixed [HELLO_FIXED_LEN] {
        /// [`MAGIC`].
        pub magic: [u8; 4],
        /// [`Hello::version`].
        pub version: u16,
        /// [`Hello::queue_index`].
        pub queue_index: u16,
        /// [`Hello::features`].
        pub features: u64,
        /// [`Hello::borrower`].
        pub borrower: [u8; 16],
        /// Bytes of device name that follow.
        pub name_len: u16,
        /// Bytes of lease token after the name.
        pub token_len: u16,
    }
}

crate::layout! {
    /// The fixed part of a [`HelloReply`] as it is on the wire.
    pub struct ReplyFixed [REPLY_FIXED_LEN] {
        /// [`MAGIC`].
        pub magic: [u8; 4],
        /// [`HelloReply::version`].
        pub version: u16,
        /// [`HelloStatus`].
        pub status: u16,
        /// [`HelloReply::features`].
        pub features: u64,
        /// [`DeviceInfo::capacity_sectors`].
        pub capacity_sectors: u64,
        /// [`DeviceInfo::block_size`].
        pub block_size: u32,
        /// [`DeviceInfo::max_transfer`].
        pub max_transfer: u32,
        /// [`DeviceInfo::max_discard_sectors`].
        pub max_discard_sectors: u32,
        /// [`DeviceInfo::max_write_zeroes_sectors`].
        pub max_write_zeroes_sectors: u32,
        /// [`DeviceInfo::flags`].
        pub flags: u32,
        /// Bytes of message that follow (after the credit, if any).
        pub msg_len: u16,
        /// 0.
        pub reserved: [u8; 2],
        /// [`DeviceInfo::serial`].
        pub serial: [u8; SERIAL_LEN],
    }
}

/// [`DeviceInfo::flags`] bit: the device is read-only.
pub const DEV_READ_ONLY: u32 = 1 << 0;
/// [`DeviceInfo::flags`] bit: the lender executes discard.
pub const DEV_DISCARD: u32 = 1 << 1;
/// [`DeviceInfo::flags`] bit: the lender executes write-zeroes.
pub const DEV_WRITE_ZEROES: u32 = 1 << 2;

/// [`DeviceInfo::flags`] bit: the device is a network interface (granted with
/// [`crate::net::FEATURE_NET`]); `max_transfer` is then its MTU and the first 6 bytes of
/// `serial` its MAC address.
pub const DEV_NET: u32 = 1 << 3;
/// [`DeviceInfo::flags`] bit, with [`DEV_NET`]: the interface's link was up at the handshake.
pub const DEV_LINK_UP: u32 = 1 << 4;

/// [`DeviceInfo::flags`] bit: the device is a PCIe function (granted with
/// [`crate::pci::FEATURE_PCI`]); its regions and interrupts come in a
/// [`crate::pci::KIND_INFO`] reply after the handshake.
pub const DEV_PCI: u32 = 1 << 5;

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

/// The borrower's opening message.
///
/// Layout: `magic: [u8;4] = "DVLD", version: u16, queue_index: u16, features: u64,
/// borrower: [u8; 16], name_len: u16, token_len: u16`, then `name_len` bytes of UTF-8
/// device name, then `token_len` bytes of lease token (0 in direct mode; at most
/// [`MAX_TOKEN_LEN`](crate::lease_token::MAX_TOKEN_LEN)), then with
/// [`FEATURE_LENDER_PROOF`] the 32-byte challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version the borrower speaks.
    pub version: u16,
    /// Index of the virtqueue this connection serves (0-based).
    pub queue_index: u16,
    /// Optional protocol features requested; none are defined in version 1 (send 0).
    pub features: u64,
    /// Identity of the borrower's attachment (random, the same on all its connections).
    /// A lender gives a device to one borrower at a time; all zero means anonymous: such
    /// a session is refused while the device is held and does not hold it.
    pub borrower: [u8; 16],
    /// Name of the device to open, as configured on the lender (1..=255 bytes).
    pub device: String,
    /// The pool's lease token in binary form ([`crate::lease_token`]); empty in direct
    /// mode. A lender attached to a pool refuses a hello without a valid one.
    pub token: Vec<u8>,
    /// A challenge the lender must sign ([`crate::lender_proof`]); sent after the token,
    /// with [`FEATURE_LENDER_PROOF`] in `features`, exactly when present.
    pub challenge: Option<[u8; CHALLENGE_LEN]>,
}

impl Hello {
    /// An anonymous hello for this build's protocol version, with no features.
    pub fn new(device: &str, queue_index: u16) -> Self {
        Hello {
            version: PROTOCOL_VERSION,
            queue_index,
            features: 0,
            borrower: [0; 16],
            device: device.to_owned(),
            token: Vec::new(),
            challenge: None,
        }
    }

    /// Asks the lender to prove who it is: a fresh challenge (none if the system has no
    /// randomness: the lender's proof is then missing and [`Hello::check_proof`]
    /// refuses the session, never passes it unchecked).
    pub fn ask_proof(&mut self) {
        self.challenge = crate::lender_proof::challenge().ok();
    }

    /// The lender's proof of this hello's challenge, signed with `key`; `None` when the
    /// hello asks for none.
    pub fn prove(&self, key: &crate::lease_token::TokenSigner) -> Option<LenderProof> {
        let c = self.challenge.as_ref()?;
        let m = crate::lender_proof::message(c, &self.borrower, self.queue_index, &self.device);
        Some(LenderProof::sign(key, &m))
    }

    /// Checks the lender's `proof` of this hello's challenge against `expected`.
    ///
    /// # Errors
    /// [`crate::lender_proof::ProofError`]; `BadSignature` when this hello asked for no
    /// proof.
    pub fn check_proof(
        &self,
        proof: Option<&LenderProof>,
        expected: &crate::lease_token::PublicKey,
    ) -> Result<(), crate::lender_proof::ProofError> {
        let Some(c) = self.challenge.as_ref() else {
            return Err(crate::lender_proof::ProofError::BadSignature);
        };
        let m = crate::lender_proof::message(c, &self.borrower, self.queue_index, &self.device);
        LenderProof::check(proof, &m, expected)
    }

    /// Writes the message in one `write_all`.
    ///
    /// # Errors
    /// [`WireError::TooLong`] when the name exceeds [`MAX_NAME_LEN`] or the token
    /// [`MAX_TOKEN_LEN`](crate::lease_token::MAX_TOKEN_LEN); [`WireError::Io`].
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), WireError> {
        let name = self.device.as_bytes();
        if name.len() > MAX_NAME_LEN {
            return Err(WireError::TooLong {
                what: "device name",
                len: name.len() as u64,
                limit: MAX_NAME_LEN as u64,
            });
        }
        if self.token.len() > MAX_TOKEN_LEN {
            return Err(WireError::TooLong {
                what: "lease token",
                len: self.token.len() as u64,
                limit: MAX_TOKEN_LEN as u64,
            });
        }
        let mut b =
            Vec::with_capacity(HELLO_FIXED_LEN + name.len() + self.token.len() + CHALLENGE_LEN);
        let features = match self.challenge {
            Some(_) => self.features | FEATURE_LENDER_PROOF,
            None => self.features & !FEATURE_LENDER_PROOF,
        };
        let fixed = HelloFixed {
            magic: MAGIC,
            version: self.version,
            queue_index: self.queue_index,
            features,
            borrower: self.borrower,
            name_len: name.len() as u16,
            token_len: self.token.len() as u16,
        };
        fixed.push(&mut b);
        b.extend_from_slice(name);
        b.extend_from_slice(&self.token);
        if let Some(c) = &self.challenge {
            b.extend_from_slice(c);
        }
        w.write_all(&b)?;
        Ok(())
    }

    /// Reads and validates the message.
    ///
    /// The version is returned as sent, so that the lender can answer
    /// [`HelloStatus::UnsupportedVersion`] rather than drop the connection.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::TooLong`] (name, token),
    /// [`WireError::Invalid`] (empty or non-UTF-8 name), [`WireError::Closed`] /
    /// [`WireError::Truncated`] / [`WireError::Io`].
    pub fn read_from(r: &mut impl Read) -> Result<Self, WireError> {
        let mut b = [0u8; HELLO_FIXED_LEN];
        read_exact_or_eof(r, &mut b)?;
        let f = HelloFixed::decode(&b);
        if f.magic != MAGIC {
            return Err(WireError::BadMagic(f.magic));
        }
        let name_len = usize::from(f.name_len);
        let token_len = usize::from(f.token_len);
        if token_len > MAX_TOKEN_LEN {
            return Err(WireError::TooLong {
                what: "lease token",
                len: token_len as u64,
                limit: MAX_TOKEN_LEN as u64,
            });
        }
        if name_len > MAX_NAME_LEN {
            return Err(WireError::TooLong {
                what: "device name",
                len: name_len as u64,
                limit: MAX_NAME_LEN as u64,
            });
        }
        if name_len == 0 {
            return Err(WireError::Invalid("empty device name"));
        }
        let challenge_len = if f.features & FEATURE_LENDER_PROOF != 0 {
            CHALLENGE_LEN
        } else {
            0
        };
        let mut rest = vec![0u8; name_len + token_len + challenge_len];
        read_exact_or_eof(r, &mut rest).map_err(|e| match e {
            WireError::Closed => WireError::Truncated {
                got: HELLO_FIXED_LEN,
                want: HELLO_FIXED_LEN + name_len + token_len + challenge_len,
            },
            e => e,
        })?;
        let challenge = (challenge_len != 0).then(|| {
            let mut c = [0u8; CHALLENGE_LEN];
            c.copy_from_slice(&rest[name_len + token_len..]);
            c
        });
        rest.truncate(name_len + token_len);
        let token = rest.split_off(name_len);
        let name = rest;
        let device =
            String::from_utf8(name).map_err(|_| WireError::Invalid("device name is not UTF-8"))?;
        Ok(Hello {
            version: f.version,
            queue_index: f.queue_index,
            features: f.features,
            borrower: f.borrower,
            device,
            token,
            challenge,
        })
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
            _ => return Err(WireError::Invalid("hello reply status")),
        })
    }
}

/// What the borrower needs to know of a lent block device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceInfo {
    /// Capacity in 512-byte sectors (the backing size rounded down to a multiple of 512).
    pub capacity_sectors: u64,
    /// Logical block size in bytes that the guest should use (a power of two, ≥ 512).
    pub block_size: u32,
    /// Largest data length of one read or write request, in bytes.
    pub max_transfer: u32,
    /// Largest discard, in 512-byte sectors (0 when discard is not executed).
    pub max_discard_sectors: u32,
    /// Largest write-zeroes, in 512-byte sectors (0 when write-zeroes is not executed).
    pub max_write_zeroes_sectors: u32,
    /// [`DEV_READ_ONLY`], [`DEV_DISCARD`], [`DEV_WRITE_ZEROES`].
    pub flags: u32,
    /// Device serial, NUL-padded to 20 bytes (virtio 1.2 §5.2.6, GET_ID).
    pub serial: [u8; SERIAL_LEN],
}

impl DeviceInfo {
    /// What a lender advertises for a network interface: capacity 0, block size 512 (not
    /// used), `max_transfer` the MTU, the MAC in the first 6 bytes of `serial`.
    pub fn net(link: &crate::net::LinkState) -> Self {
        let mut serial = [0u8; SERIAL_LEN];
        serial[..6].copy_from_slice(&link.mac);
        DeviceInfo {
            capacity_sectors: 0,
            block_size: 512,
            max_transfer: link.mtu,
            max_discard_sectors: 0,
            max_write_zeroes_sectors: 0,
            flags: DEV_NET | if link.up { DEV_LINK_UP } else { 0 },
            serial,
        }
    }

    /// What a lender advertises for a PCIe function: capacity 0, block size 512 (not
    /// used), [`DEV_PCI`], the function's address (`pci:BDF`, cut to 20 bytes) as serial.
    pub fn pci(bdf: &str) -> Self {
        let mut serial = [0u8; SERIAL_LEN];
        let b = bdf.as_bytes();
        let n = b.len().min(SERIAL_LEN);
        serial[..n].copy_from_slice(&b[..n]);
        DeviceInfo {
            capacity_sectors: 0,
            block_size: 512,
            max_transfer: crate::pci::MAX_ACCESS,
            max_discard_sectors: 0,
            max_write_zeroes_sectors: 0,
            flags: DEV_PCI,
            serial,
        }
    }

    /// Whether the device is a PCIe function.
    pub fn is_pci(&self) -> bool {
        self.flags & DEV_PCI != 0
    }

    /// Whether the device is a network interface.
    pub fn is_net(&self) -> bool {
        self.flags & DEV_NET != 0
    }

    /// For a network interface: its link state, MTU and MAC as of the handshake.
    pub fn link(&self) -> crate::net::LinkState {
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&self.serial[..6]);
        crate::net::LinkState {
            up: self.flags & DEV_LINK_UP != 0,
            mtu: self.max_transfer,
            mac,
        }
    }

    /// Whether the device refuses writes.
    pub fn read_only(&self) -> bool {
        self.flags & DEV_READ_ONLY != 0
    }
}

/// The lender's answer to a [`Hello`].
///
/// Layout (68 bytes, then with [`FEATURE_CREDIT`] in `features` the 8-byte credit
/// `requests: u32, bytes: u32`, then with [`FEATURE_LENDER_PROOF`] the 96-byte proof
/// `key: [u8; 32], signature: [u8; 64]`, then `msg_len` bytes of UTF-8 message): `magic: [u8;4],
/// version: u16, status: u16, features: u64, capacity_sectors: u64, block_size: u32,
/// max_transfer: u32, max_discard_sectors: u32, max_write_zeroes_sectors: u32, flags: u32,
/// msg_len: u16, reserved: u16 = 0, serial: [u8; 20]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloReply {
    /// Protocol version the lender speaks.
    pub version: u16,
    /// Whether the session is open.
    pub status: HelloStatus,
    /// Features granted (a subset of those asked for; none in version 1).
    pub features: u64,
    /// The device; all zero when `status` is not [`HelloStatus::Ok`].
    pub device: DeviceInfo,
    /// The session's credit, sent when [`FEATURE_CREDIT`] is granted (`features` has
    /// the bit exactly when this is `Some`).
    pub credit: Option<Credit>,
    /// The lender's answer to the hello's challenge ([`crate::lender_proof`]), after the
    /// credit, with [`FEATURE_LENDER_PROOF`] in `features` exactly when present.
    pub proof: Option<LenderProof>,
    /// Why the session was refused (empty on success), at most [`MAX_MESSAGE_LEN`] bytes.
    pub message: String,
}

impl HelloReply {
    /// A successful reply.
    pub fn ok(device: DeviceInfo) -> Self {
        HelloReply {
            version: PROTOCOL_VERSION,
            status: HelloStatus::Ok,
            features: 0,
            device,
            credit: None,
            proof: None,
            message: String::new(),
        }
    }

    /// A refusal, with a message for the borrower's operator (truncated to
    /// [`MAX_MESSAGE_LEN`] bytes on a character boundary).
    pub fn refuse(status: HelloStatus, message: &str) -> Self {
        let mut end = message.len().min(MAX_MESSAGE_LEN);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        HelloReply {
            version: PROTOCOL_VERSION,
            status,
            features: 0,
            device: DeviceInfo::default(),
            credit: None,
            proof: None,
            message: message[..end].to_owned(),
        }
    }

    /// Writes the reply in one `write_all`.
    ///
    /// # Errors
    /// [`WireError::Io`].
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), WireError> {
        let msg = &self.message.as_bytes()[..self.message.len().min(MAX_MESSAGE_LEN)];
        let d = &self.device;
        let mut b = Vec::with_capacity(REPLY_FIXED_LEN + CREDIT_LEN + msg.len());
        let features = match self.credit {
            Some(_) => self.features | FEATURE_CREDIT,
            None => self.features & !FEATURE_CREDIT,
        };
        let features = match self.proof {
            Some(_) => features | FEATURE_LENDER_PROOF,
            None => features & !FEATURE_LENDER_PROOF,
        };
        let fixed = ReplyFixed {
            magic: MAGIC,
            version: self.version,
            status: self.status as u16,
            features,
            capacity_sectors: d.capacity_sectors,
            block_size: d.block_size,
            max_transfer: d.max_transfer,
            max_discard_sectors: d.max_discard_sectors,
            max_write_zeroes_sectors: d.max_write_zeroes_sectors,
            flags: d.flags,
            msg_len: msg.len() as u16,
            reserved: [0; 2],
            serial: d.serial,
        };
        fixed.push(&mut b);
        if let Some(c) = self.credit {
            c.push(&mut b);
        }
        if let Some(p) = &self.proof {
            b.extend_from_slice(&p.to_bytes());
        }
        b.extend_from_slice(msg);
        w.write_all(&b)?;
        Ok(())
    }

    /// Reads and validates a reply.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::Invalid`] (status, reserved bytes, a block
    /// size that is not a power of two ≥ 512), [`WireError::TooLong`] (message),
    /// [`WireError::Closed`] / [`WireError::Truncated`] / [`WireError::Io`].
    pub fn read_from(r: &mut impl Read) -> Result<Self, WireError> {
        let mut b = [0u8; REPLY_FIXED_LEN];
        read_exact_or_eof(r, &mut b)?;
        let f = ReplyFixed::decode(&b);
        if f.magic != MAGIC {
            return Err(WireError::BadMagic(f.magic));
        }
        let status = HelloStatus::from_u16(f.status)?;
        let msg_len = usize::from(f.msg_len);
        codec::reserved(&f.reserved, "reserved bytes of hello reply")?;
        if msg_len > MAX_MESSAGE_LEN {
            return Err(WireError::TooLong {
                what: "hello reply message",
                len: msg_len as u64,
                limit: MAX_MESSAGE_LEN as u64,
            });
        }
        let features = f.features;
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
        let device = DeviceInfo {
            capacity_sectors: f.capacity_sectors,
            block_size: f.block_size,
            max_transfer: f.max_transfer,
            max_discard_sectors: f.max_discard_sectors,
            max_write_zeroes_sectors: f.max_write_zeroes_sectors,
            flags: f.flags,
            serial: f.serial,
        };
        let mut msg = vec![0u8; msg_len];
        read_exact_or_eof(r, &mut msg)?;
        if status == HelloStatus::Ok
            && (device.block_size < 512 || !device.block_size.is_power_of_two())
        {
            return Err(WireError::Invalid("block size"));
        }
        Ok(HelloReply {
            version: f.version,
            status,
            features,
            device,
            credit,
            proof,
            message: String::from_utf8_lossy(&msg).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_admits_within_requests_and_bytes() {
        let c = Credit {
            requests: 2,
            bytes: 1 << 20,
        };
        assert!(c.admits(0, 0, 8 << 20), "alone, any length goes");
        assert!(c.admits(1, 512 << 10, 512 << 10));
        assert!(!c.admits(1, 512 << 10, (512 << 10) + 512));
        assert!(!c.admits(2, 0, 0), "no third request");
    }

    #[test]
    fn hello_round_trips() {
        let mut h = Hello::new("disk0", 3);
        h.borrower = [7; 16];
        let mut buf = Vec::new();
        h.write_to(&mut buf).unwrap();
        assert_eq!(Hello::read_from(&mut buf.as_slice()).unwrap(), h);
        h.token = vec![9; 300];
        let mut buf = Vec::new();
        h.write_to(&mut buf).unwrap();
        assert_eq!(buf.len(), 36 + 5 + 300);
        assert_eq!(Hello::read_from(&mut buf.as_slice()).unwrap(), h);
        let cut = &buf[..buf.len() - 1];
        assert!(matches!(
            Hello::read_from(&mut &cut[..]),
            Err(WireError::Truncated { .. })
        ));
        let mut long = buf.clone();
        long[34..36].copy_from_slice(&2000u16.to_le_bytes());
        assert!(matches!(
            Hello::read_from(&mut long.as_slice()),
            Err(WireError::TooLong {
                what: "lease token",
                ..
            })
        ));
    }

    #[test]
    fn hello_rejects_bad_magic_truncation_and_long_names() {
        let mut buf = Vec::new();
        Hello::new("disk0", 0).write_to(&mut buf).unwrap();
        let mut bad = buf.clone();
        bad[0] = b'X';
        assert!(matches!(
            Hello::read_from(&mut bad.as_slice()),
            Err(WireError::BadMagic(_))
        ));
        let cut = &buf[..10];
        assert!(matches!(
            Hello::read_from(&mut &cut[..]),
            Err(WireError::Truncated { got: 10, want: 36 })
        ));
        let cut = &buf[..38];
        assert!(matches!(
            Hello::read_from(&mut &cut[..]),
            Err(WireError::Truncated { .. })
        ));
        let mut long = buf.clone();
        long[32..34].copy_from_slice(&1000u16.to_le_bytes());
        assert!(matches!(
            Hello::read_from(&mut long.as_slice()),
            Err(WireError::TooLong { .. })
        ));
        assert!(Hello::new(&"x".repeat(300), 0)
            .write_to(&mut Vec::new())
            .is_err());
    }

    #[test]
    fn net_reply_round_trips() {
        let link = crate::net::LinkState {
            up: true,
            mtu: 9000,
            mac: [2, 1, 2, 3, 4, 5],
        };
        let mut r = HelloReply::ok(DeviceInfo::net(&link));
        r.features = crate::net::FEATURE_NET;
        let mut buf = Vec::new();
        r.write_to(&mut buf).unwrap();
        let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!(back, r);
        assert!(back.device.is_net());
        assert_eq!(back.device.link(), link);
    }

    #[test]
    fn a_challenge_and_its_proof_round_trip() {
        let key = crate::lease_token::TokenSigner::from_seed([5; 32]);
        let mut h = Hello::new("disk0", 3);
        h.borrower = [1; 16];
        h.token = vec![9; 40];
        h.challenge = Some([0xab; CHALLENGE_LEN]);
        let mut buf = Vec::new();
        h.write_to(&mut buf).unwrap();
        assert_eq!(buf.len(), HELLO_FIXED_LEN + 5 + 40 + CHALLENGE_LEN);
        let back = Hello::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!(back.challenge, h.challenge);
        assert_eq!(back.features & FEATURE_LENDER_PROOF, FEATURE_LENDER_PROOF);
        assert_eq!(back.token, h.token);
        // A hello cut inside its challenge is refused.
        assert!(Hello::read_from(&mut &buf[..buf.len() - 1]).is_err());

        let mut r = HelloReply::ok(DeviceInfo {
            block_size: 512,
            ..DeviceInfo::default()
        });
        r.credit = Some(Credit {
            requests: 8,
            bytes: 1 << 20,
        });
        r.proof = back.prove(&key);
        let mut buf = Vec::new();
        r.write_to(&mut buf).unwrap();
        assert_eq!(buf.len(), REPLY_FIXED_LEN + CREDIT_LEN + PROOF_LEN);
        let got = HelloReply::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!((&got.proof, got.credit), (&r.proof, r.credit));
        assert_eq!(got.features, FEATURE_CREDIT | FEATURE_LENDER_PROOF);
        h.check_proof(got.proof.as_ref(), &key.public_key())
            .unwrap();
        // No challenge: no proof.
        assert_eq!(Hello::new("disk0", 0).prove(&key), None);
        // A reply without a proof does not claim one.
        r.proof = None;
        let mut buf = Vec::new();
        r.write_to(&mut buf).unwrap();
        let got = HelloReply::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!(got.features & FEATURE_LENDER_PROOF, 0);
    }

    #[test]
    fn reply_round_trips() {
        let mut serial = [0u8; SERIAL_LEN];
        serial[..4].copy_from_slice(b"SN01");
        let r = HelloReply::ok(DeviceInfo {
            capacity_sectors: 2048,
            block_size: 4096,
            max_transfer: 1 << 20,
            max_discard_sectors: 1 << 16,
            max_write_zeroes_sectors: 1 << 16,
            flags: DEV_DISCARD | DEV_READ_ONLY,
            serial,
        });
        let mut buf = Vec::new();
        r.write_to(&mut buf).unwrap();
        let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!(back, r);
        assert!(back.device.read_only());

        let mut granted = HelloReply::ok(DeviceInfo {
            block_size: 512,
            ..DeviceInfo::default()
        });
        granted.credit = Some(Credit {
            requests: 256,
            bytes: 32 << 20,
        });
        let mut buf = Vec::new();
        granted.write_to(&mut buf).unwrap();
        assert_eq!(buf.len(), REPLY_FIXED_LEN + CREDIT_LEN);
        let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!(back.features & FEATURE_CREDIT, FEATURE_CREDIT);
        assert_eq!(back.credit, granted.credit);
        // A credit of no request would stall the borrower for good.
        buf[REPLY_FIXED_LEN..REPLY_FIXED_LEN + 4].fill(0);
        assert!(HelloReply::read_from(&mut buf.as_slice()).is_err());
        let refusal = HelloReply::refuse(HelloStatus::NoSuchDevice, "no device \"x\"");
        let mut buf = Vec::new();
        refusal.write_to(&mut buf).unwrap();
        assert_eq!(HelloReply::read_from(&mut buf.as_slice()).unwrap(), refusal);
    }
}

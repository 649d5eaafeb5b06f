//! The borrower's opening message, [`Hello`]: protocol version, device name, queue
//! index, features, lease token and challenge; its encoding and checks.

use std::io::{Read, Write};

use super::{HELLO_FIXED_LEN, MAGIC, MAX_NAME_LEN};
use crate::holder_proof::{Held, Holder, FEATURE_HOLDER_PROOF};
use crate::lease_token::MAX_TOKEN_LEN;
use crate::lender_proof::{
    LenderProof, CHALLENGE_LEN, FEATURE_LENDER_KEY_HINT, FEATURE_LENDER_PROOF,
};
use crate::{io_util::read_exact_or_eof, WireError, PROTOCOL_VERSION};

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

/// The borrower's opening message.
///
/// Layout: `magic: [u8;4] = "DVLD", version: u16, queue_index: u16, features: u64,
/// borrower: [u8; 16], name_len: u16, token_len: u16`, then `name_len` bytes of UTF-8
/// device name, then `token_len` bytes of lease token (0 in direct mode; at most
/// [`MAX_TOKEN_LEN`]), then with
/// [`FEATURE_LENDER_PROOF`] the 32-byte challenge, then with [`FEATURE_LENDER_KEY_HINT`]
/// the 32-byte lender key the borrower expects. With [`FEATURE_HOLDER_PROOF`] the
/// token is not in the hello (`token_len` 0): it follows the lender's interim reply in a
/// [`crate::holder_proof::Possession`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version the borrower speaks.
    pub version: u16,
    /// Index of the virtqueue this connection serves (0-based).
    pub queue_index: u16,
    /// Optional protocol features requested (NET, NET_OFFLOAD, PCI, CREDIT, LENDER_PROOF,
    /// THROTTLE_NOTE: `docs/protocol.md`); 0 for none.
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
    /// The lender key the borrower expects to be proven, sent after the challenge
    /// with [`FEATURE_LENDER_KEY_HINT`] (only with a challenge): a lender rotating its
    /// key proves the one asked for.
    pub expected_lender: Option<[u8; 32]>,
    /// The borrower's side only, never on the wire as such: the key that proves
    /// possession of the token ([`crate::holder_proof`]). When set, the hello asks for
    /// [`FEATURE_HOLDER_PROOF`] and carries no token; the token goes in the
    /// [`Possession`](crate::holder_proof::Possession) after the lender proved itself.
    pub holder: Option<Holder>,
    /// The lender's side only: the nonce it sent and the holder's signature, once the
    /// possession message was read (its token is then in `token`).
    pub held: Option<Held>,
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
            expected_lender: None,
            holder: None,
            held: None,
        }
    }

    /// Asks `lender` to prove its key: a fresh challenge, and `lender` as the key
    /// expected ([`FEATURE_LENDER_KEY_HINT`]).
    pub fn ask_proof_of(&mut self, lender: &crate::lease_token::PublicKey) {
        self.ask_proof();
        self.expected_lender = Some(lender.to_bytes());
    }

    /// Whether this hello asks to prove possession of its token's holder key (the token
    /// then follows the lender's interim reply).
    pub fn proves_possession(&self) -> bool {
        self.features & FEATURE_HOLDER_PROOF != 0
    }

    /// What the holder signs for this hello's token, under the lender's `nonce`.
    pub fn possession_message(&self, nonce: &[u8; crate::holder_proof::NONCE_LEN]) -> Vec<u8> {
        crate::holder_proof::message(
            nonce,
            self.challenge.as_ref(),
            &self.borrower,
            self.queue_index,
            &self.device,
            &self.token,
        )
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
    /// [`MAX_TOKEN_LEN`]; [`WireError::Io`].
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), WireError> {
        let name = self.device.as_bytes();
        if name.len() > MAX_NAME_LEN {
            return Err(WireError::TooLong {
                what: "device name",
                len: name.len() as u64,
                limit: MAX_NAME_LEN as u64,
            });
        }
        // With a holder key the token waits for the lender's proof.
        let token: &[u8] = if self.holder.is_some() {
            &[]
        } else {
            &self.token
        };
        if token.len() > MAX_TOKEN_LEN {
            return Err(WireError::TooLong {
                what: "lease token",
                len: token.len() as u64,
                limit: MAX_TOKEN_LEN as u64,
            });
        }
        let mut b = Vec::with_capacity(HELLO_FIXED_LEN + name.len() + token.len() + CHALLENGE_LEN);
        let mut features = match self.challenge {
            Some(_) => self.features | FEATURE_LENDER_PROOF,
            None => self.features & !FEATURE_LENDER_PROOF,
        };
        let hint = self.expected_lender.filter(|_| self.challenge.is_some());
        features = match hint {
            Some(_) => features | FEATURE_LENDER_KEY_HINT,
            None => features & !FEATURE_LENDER_KEY_HINT,
        };
        // With a holder key the bit is set; without one, a hello as read (the lender's
        // side) keeps the bit it came with, so that it encodes back to its bytes.
        if self.holder.is_some() {
            features |= FEATURE_HOLDER_PROOF;
        }
        let fixed = HelloFixed {
            magic: MAGIC,
            version: self.version,
            queue_index: self.queue_index,
            features,
            borrower: self.borrower,
            name_len: name.len() as u16,
            token_len: token.len() as u16,
        };
        fixed.push(&mut b);
        b.extend_from_slice(name);
        b.extend_from_slice(token);
        if let Some(c) = &self.challenge {
            b.extend_from_slice(c);
        }
        if let Some(k) = &hint {
            b.extend_from_slice(k);
        }
        w.write_all(&b)?;
        Ok(())
    }

    /// Reads and validates the message.
    ///
    /// The version is returned as sent, so that the lender can answer
    /// [`HelloStatus::UnsupportedVersion`](super::HelloStatus::UnsupportedVersion) rather
    /// than drop the connection.
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
        if f.features & FEATURE_HOLDER_PROOF != 0 && token_len != 0 {
            return Err(WireError::Invalid(
                "a hello proving possession carries its token after the lender's proof",
            ));
        }
        let challenge_len = if f.features & FEATURE_LENDER_PROOF != 0 {
            CHALLENGE_LEN
        } else {
            0
        };
        let hint_len = match (f.features & FEATURE_LENDER_KEY_HINT != 0, challenge_len) {
            (false, _) => 0,
            (true, 0) => return Err(WireError::Invalid("a lender key hint without a challenge")),
            (true, _) => 32,
        };
        let mut rest = vec![0u8; name_len + token_len + challenge_len + hint_len];
        read_exact_or_eof(r, &mut rest).map_err(|e| match e {
            WireError::Closed => WireError::Truncated {
                got: HELLO_FIXED_LEN,
                want: HELLO_FIXED_LEN + name_len + token_len + challenge_len + hint_len,
            },
            e => e,
        })?;
        let at = name_len + token_len;
        let challenge = (challenge_len != 0).then(|| {
            let mut c = [0u8; CHALLENGE_LEN];
            c.copy_from_slice(&rest[at..at + CHALLENGE_LEN]);
            c
        });
        let expected_lender = (hint_len != 0).then(|| {
            let mut k = [0u8; 32];
            k.copy_from_slice(&rest[at + CHALLENGE_LEN..]);
            k
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
            expected_lender,
            holder: None,
            held: None,
        })
    }
}

//! The borrower proves it holds the key its lease token names: proof of possession.
//!
//! A lease token names its holder's public key ([`LeaseClaims::holder_key`]: the
//! compute host's enrolled key for a pool lease, the borrower's own key in direct mode,
//! the destination's key for a migration's handover). A borrower with that key sets
//! [`FEATURE_HOLDER_PROOF`] in its [`Hello`] and sends **no token** in it. The lender
//! answers with an interim [`HelloReply`](crate::HelloReply) of status
//! [`HelloStatus::Prove`](crate::HelloStatus::Prove): its own proof
//! ([`crate::lender_proof`]) and a fresh [`NONCE_LEN`]-byte nonce. The borrower checks
//! the lender's proof first, and only then sends a [`Possession`]: the token, and its
//! Ed25519 signature of [`CONTEXT`] followed by [`message`] (the lender's nonce, the
//! hello's challenge, borrower identity, queue index, device name and the token). The
//! lender checks the token, then the signature with the token's holder key, and answers
//! with its final reply. A token seen on the wire is useless without the holder's
//! private key: the lender's nonce is new in every handshake (`docs/protocol.md`,
//! `docs/security.md`).
//!
//! [`LeaseClaims::holder_key`]: crate::lease_token::LeaseClaims::holder_key
//! [`Hello`]: crate::Hello

use std::io::{Read, Write};
use std::sync::Arc;

use crate::codec;
use crate::io_util::read_exact_or_eof;
use crate::lease_token::{PublicKey, TokenSigner, MAX_TOKEN_LEN};
use crate::lender_proof::{ProofError, CHALLENGE_LEN};
use crate::WireError;

/// [`Hello::features`](crate::Hello::features) bit: the borrower proves possession of
/// its token's holder key; the token follows the lender's interim reply, in a
/// [`Possession`]. A lender grants it by answering [`HelloStatus::Prove`](crate::HelloStatus::Prove)
/// with the bit set and a nonce.
pub const FEATURE_HOLDER_PROOF: u64 = 1 << 7;
/// Bytes of the lender's nonce in the interim reply.
pub const NONCE_LEN: usize = 32;
/// Domain separation prefix of the holder's signature.
pub const CONTEXT: &[u8] = b"devlend-holder-proof-v1\0";
/// The 4 bytes that start a [`Possession`].
pub const POSSESSION_MAGIC: [u8; 4] = *b"DVLP";
/// Bytes of a [`Possession`] before its token.
pub const POSSESSION_FIXED_LEN: usize = 8;
const SIGNATURE_LEN: usize = 64;

/// A borrower's private key that its tokens name as holder (compared and shown by its
/// public key).
#[derive(Clone)]
pub struct HolderKey(pub Arc<TokenSigner>);

impl HolderKey {
    /// Wraps `key`.
    pub fn new(key: TokenSigner) -> Self {
        HolderKey(Arc::new(key))
    }

    /// The public key, which tokens name.
    pub fn public_key(&self) -> PublicKey {
        self.0.public_key()
    }
}

impl std::fmt::Debug for HolderKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HolderKey({})", self.0.public_key().to_text())
    }
}

impl PartialEq for HolderKey {
    fn eq(&self, other: &Self) -> bool {
        self.0.public_key() == other.0.public_key()
    }
}

impl Eq for HolderKey {}

/// The key a borrower proves possession with, and the lender key it checks before it
/// sends its token (`None`: it was given none, and sends the token to whoever answers;
/// the token is bound to the key all the same).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The holder's private key.
    pub key: HolderKey,
    /// The lender's key the borrower expects.
    pub lender: Option<PublicKey>,
}

/// What the lender received for a hello with [`FEATURE_HOLDER_PROOF`]: the nonce it
/// sent and the holder's signature (the token itself goes to
/// [`Hello::token`](crate::Hello::token)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The lender's nonce of this handshake.
    pub nonce: [u8; NONCE_LEN],
    /// The holder's signature of [`message`].
    pub signature: [u8; SIGNATURE_LEN],
}

/// Why a holder's proof was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HolderError {
    /// The token names a holder key, and the borrower proved nothing (an older
    /// borrower, or one that sent the token in its hello).
    #[error("the token names a holder key and the borrower did not prove possession of it")]
    Missing,
    /// The signature does not verify with the token's holder key for this handshake.
    #[error("the borrower's proof of possession does not verify with the token's holder key")]
    BadSignature,
}

/// What the holder signs: the lender's nonce, the hello's challenge (32 zero bytes
/// without one), the borrower identity, the queue index (LE), then `name_len: u16 LE`
/// and the device name, then the token.
pub fn message(
    nonce: &[u8; NONCE_LEN],
    challenge: Option<&[u8; CHALLENGE_LEN]>,
    borrower: &[u8; 16],
    queue_index: u16,
    device: &str,
    token: &[u8],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(NONCE_LEN + CHALLENGE_LEN + 20 + device.len() + token.len());
    m.extend_from_slice(nonce);
    m.extend_from_slice(challenge.unwrap_or(&[0; CHALLENGE_LEN]));
    m.extend_from_slice(borrower);
    m.extend_from_slice(&queue_index.to_le_bytes());
    m.extend_from_slice(&(device.len() as u16).to_le_bytes());
    m.extend_from_slice(device.as_bytes());
    m.extend_from_slice(token);
    m
}

/// A fresh random nonce: 32 random bytes, as a challenge is.
///
/// # Errors
/// The system's random source failed.
pub fn nonce() -> Result<[u8; NONCE_LEN], getrandom::Error> {
    crate::lender_proof::challenge()
}

/// The borrower's answer to the lender's `interim` reply to `hello`: checks the
/// lender's proof against the key `holder` expects (before the token leaves), then signs
/// the handshake with the holder's key.
///
/// # Errors
/// [`ProofError`] when the lender did not prove the key expected; `Missing` too for an
/// interim reply without a nonce.
pub fn answer(
    hello: &crate::Hello,
    holder: &Holder,
    interim: &crate::HelloReply,
) -> Result<Possession, ProofError> {
    if let Some(expected) = holder.lender.as_ref() {
        hello.check_proof(interim.proof.as_ref(), expected)?;
    }
    let nonce = interim.nonce.ok_or_else(|| ProofError::Missing {
        expected: holder
            .lender
            .map_or_else(|| "a nonce".to_owned(), |k| k.to_text()),
    })?;
    Ok(Possession::sign(
        &holder.key.0,
        &hello.possession_message(&nonce),
        hello.token.clone(),
    ))
}

/// Checks a holder's signature `held` of `message` against the token's `holder_key`.
///
/// # Errors
/// [`HolderError`].
pub fn check(
    held: Option<&Held>,
    message: &[u8],
    holder_key: &PublicKey,
) -> Result<(), HolderError> {
    let held = held.ok_or(HolderError::Missing)?;
    holder_key
        .verify_message(CONTEXT, message, &held.signature)
        .map_err(|_| HolderError::BadSignature)
}

/// The borrower's second message: its token, and its signature of the handshake.
///
/// Layout: `magic: [u8; 4] = "DVLP", token_len: u16, reserved: u16 = 0`, then
/// `token_len` bytes of token (1..=[`MAX_TOKEN_LEN`]), then the 64-byte signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Possession {
    /// The lease token, binary form.
    pub token: Vec<u8>,
    /// The holder's signature of [`message`].
    pub signature: [u8; SIGNATURE_LEN],
}

impl Possession {
    /// Signs `message` with `key` for `token`.
    pub fn sign(key: &TokenSigner, message: &[u8], token: Vec<u8>) -> Possession {
        Possession {
            token,
            signature: key.sign_message(CONTEXT, message),
        }
    }

    /// Writes the message in one `write_all`.
    ///
    /// # Errors
    /// [`WireError::TooLong`] for a token over [`MAX_TOKEN_LEN`]; [`WireError::Io`].
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), WireError> {
        w.write_all(&self.to_bytes()?)?;
        Ok(())
    }

    /// The wire form.
    ///
    /// # Errors
    /// [`WireError::TooLong`] for a token over [`MAX_TOKEN_LEN`].
    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        if self.token.len() > MAX_TOKEN_LEN {
            return Err(WireError::TooLong {
                what: "lease token",
                len: self.token.len() as u64,
                limit: MAX_TOKEN_LEN as u64,
            });
        }
        let mut b = Vec::with_capacity(POSSESSION_FIXED_LEN + self.token.len() + SIGNATURE_LEN);
        b.extend_from_slice(&POSSESSION_MAGIC);
        codec::push(&mut b, self.token.len() as u16);
        codec::push(&mut b, 0u16);
        b.extend_from_slice(&self.token);
        b.extend_from_slice(&self.signature);
        Ok(b)
    }

    /// Reads and validates the message.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::Invalid`] (reserved bytes, no token),
    /// [`WireError::TooLong`], [`WireError::Closed`] / [`WireError::Truncated`] /
    /// [`WireError::Io`].
    pub fn read_from(r: &mut impl Read) -> Result<Self, WireError> {
        let mut f = [0u8; POSSESSION_FIXED_LEN];
        read_exact_or_eof(r, &mut f)?;
        let magic = [f[0], f[1], f[2], f[3]];
        if magic != POSSESSION_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let token_len = usize::from(u16::from_le_bytes([f[4], f[5]]));
        if f[6] != 0 || f[7] != 0 {
            return Err(WireError::Invalid(
                "reserved bytes of the possession message",
            ));
        }
        if token_len == 0 {
            return Err(WireError::Invalid("a possession message without a token"));
        }
        if token_len > MAX_TOKEN_LEN {
            return Err(WireError::TooLong {
                what: "lease token",
                len: token_len as u64,
                limit: MAX_TOKEN_LEN as u64,
            });
        }
        let mut rest = vec![0u8; token_len + SIGNATURE_LEN];
        read_exact_or_eof(r, &mut rest).map_err(|e| match e {
            WireError::Closed => WireError::Truncated {
                got: POSSESSION_FIXED_LEN,
                want: POSSESSION_FIXED_LEN + token_len + SIGNATURE_LEN,
            },
            e => e,
        })?;
        let mut signature = [0u8; SIGNATURE_LEN];
        signature.copy_from_slice(&rest[token_len..]);
        rest.truncate(token_len);
        Ok(Possession {
            token: rest,
            signature,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_named_key_signing_this_handshake_passes() {
        let holder = TokenSigner::from_seed([3; 32]);
        let thief = TokenSigner::from_seed([4; 32]);
        let n = nonce().unwrap();
        let m = message(&n, Some(&[9; 32]), &[7; 16], 1, "disk0", b"token");
        let p = Possession::sign(&holder, &m, b"token".to_vec());
        let held = Held {
            nonce: n,
            signature: p.signature,
        };
        assert_eq!(check(Some(&held), &m, &holder.public_key()), Ok(()));
        // The same signature for a new nonce (a replayed handshake): refused.
        let again = message(
            &nonce().unwrap(),
            Some(&[9; 32]),
            &[7; 16],
            1,
            "disk0",
            b"token",
        );
        assert_eq!(
            check(Some(&held), &again, &holder.public_key()),
            Err(HolderError::BadSignature)
        );
        // Another key's signature of this very handshake: refused.
        let t = Possession::sign(&thief, &m, b"token".to_vec());
        let forged = Held {
            nonce: n,
            signature: t.signature,
        };
        assert_eq!(
            check(Some(&forged), &m, &holder.public_key()),
            Err(HolderError::BadSignature)
        );
        // Another token, queue or device under the same signature: refused.
        for m2 in [
            message(&n, Some(&[9; 32]), &[7; 16], 1, "disk0", b"other"),
            message(&n, Some(&[9; 32]), &[7; 16], 2, "disk0", b"token"),
            message(&n, Some(&[9; 32]), &[7; 16], 1, "disk1", b"token"),
        ] {
            assert_eq!(
                check(Some(&held), &m2, &holder.public_key()),
                Err(HolderError::BadSignature)
            );
        }
        assert_eq!(
            check(None, &m, &holder.public_key()),
            Err(HolderError::Missing)
        );
    }

    #[test]
    fn the_message_round_trips_and_bad_ones_are_refused() {
        let p = Possession {
            token: vec![5; 100],
            signature: [6; 64],
        };
        let b = p.to_bytes().unwrap();
        assert_eq!(Possession::read_from(&mut b.as_slice()).unwrap(), p);
        let mut bad = b.clone();
        bad[0] = b'X';
        assert!(matches!(
            Possession::read_from(&mut bad.as_slice()),
            Err(WireError::BadMagic(_))
        ));
        let mut bad = b.clone();
        bad[6] = 1;
        assert!(Possession::read_from(&mut bad.as_slice()).is_err());
        let empty = [b'D', b'V', b'L', b'P', 0, 0, 0, 0];
        assert!(Possession::read_from(&mut empty.as_slice()).is_err());
        let long = [b'D', b'V', b'L', b'P', 0xff, 0xff, 0, 0];
        assert!(matches!(
            Possession::read_from(&mut long.as_slice()),
            Err(WireError::TooLong { .. })
        ));
        assert!(matches!(
            Possession::read_from(&mut &b[..b.len() - 1]),
            Err(WireError::Truncated { .. })
        ));
        let huge = Possession {
            token: vec![0; MAX_TOKEN_LEN + 1],
            signature: [0; 64],
        };
        assert!(huge.to_bytes().is_err());
    }
}

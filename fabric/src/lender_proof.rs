//! The lender proves who it is in the handshake: a signed challenge.
//!
//! A borrower that knows which lender it should reach (the lease names the lender's
//! public key; in direct mode the operator gives it) puts 32 random bytes in its
//! [`Hello`](crate::Hello) with [`FEATURE_LENDER_PROOF`]. A lender with a key answers
//! with a [`LenderProof`]: its public key and its Ed25519 signature of [`CONTEXT`]
//! followed by `challenge, borrower: [u8; 16], queue_index: u16 LE, device name`. The
//! borrower checks both the key (the one it expects) and the signature (fresh, for this
//! session) before it sends a request, so another machine that answers at the lender's
//! address cannot serve it, with or without TLS (`docs/protocol.md`, `docs/security.md`).

use crate::lease_token::{PublicKey, TokenSigner};

/// [`Hello::features`](crate::Hello::features) bit: the hello carries a challenge and the borrower wants the
/// lender's [`LenderProof`] in the reply. A lender that has a key grants it.
pub const FEATURE_LENDER_PROOF: u64 = 1 << 4;
/// [`Hello::features`](crate::Hello::features) bit, with [`FEATURE_LENDER_PROOF`]: the
/// 32-byte public key the borrower expects follows the challenge, so that a lender
/// that holds several keys (during a key rotation: its new one and its previous one)
/// proves the one asked for. A lender that holds none of them proves its current key.
pub const FEATURE_LENDER_KEY_HINT: u64 = 1 << 8;
/// Bytes of the challenge after the hello's token.
pub const CHALLENGE_LEN: usize = 32;
/// Bytes of a proof in the reply: the public key (32) and the signature (64).
pub const PROOF_LEN: usize = 96;
/// Domain separation prefix of the proof's signature.
pub const CONTEXT: &[u8] = b"devlend-lender-proof-v1\0";

/// Why a lender's proof was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    /// The lender did not answer the challenge (no key, or an older lender).
    #[error("the lender did not prove its key (expected {expected})")]
    Missing {
        /// The key expected, text form.
        expected: String,
    },
    /// Another key answered: another machine than the lender the borrower was sent to.
    #[error("another lender answered: its key is {got}, expected {expected}")]
    WrongKey {
        /// The key expected, text form.
        expected: String,
        /// The key that answered, text form.
        got: String,
    },
    /// The signature does not verify for this session's challenge.
    #[error("the lender's proof does not verify for this session")]
    BadSignature,
}

/// A lender's answer to a challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LenderProof {
    /// The lender's public key.
    pub key: PublicKey,
    /// Its signature of the session (see the module's documentation).
    pub signature: [u8; 64],
}

/// What the lender signs for a session: the challenge, the borrower identity, the queue
/// index (LE) and the device name, as the hello carries them.
pub fn message(
    challenge: &[u8; CHALLENGE_LEN],
    borrower: &[u8; 16],
    queue_index: u16,
    device: &str,
) -> Vec<u8> {
    let mut m = Vec::with_capacity(CHALLENGE_LEN + 18 + device.len());
    m.extend_from_slice(challenge);
    m.extend_from_slice(borrower);
    m.extend_from_slice(&queue_index.to_le_bytes());
    m.extend_from_slice(device.as_bytes());
    m
}

/// A fresh random challenge.
///
/// # Errors
/// The system's random source failed.
pub fn challenge() -> Result<[u8; CHALLENGE_LEN], getrandom::Error> {
    let mut c = [0u8; CHALLENGE_LEN];
    getrandom::fill(&mut c)?;
    Ok(c)
}

impl LenderProof {
    /// Signs a session's [`message`] with `key`.
    pub fn sign(key: &TokenSigner, message: &[u8]) -> LenderProof {
        LenderProof {
            key: key.public_key(),
            signature: key.sign_message(CONTEXT, message),
        }
    }

    /// Checks a reply's proof of a session's [`message`] against the key the borrower
    /// expects (`proof` is `None` when the lender gave none).
    ///
    /// # Errors
    /// [`ProofError`].
    pub fn check(
        proof: Option<&LenderProof>,
        message: &[u8],
        expected: &PublicKey,
    ) -> Result<(), ProofError> {
        let Some(p) = proof else {
            return Err(ProofError::Missing {
                expected: expected.to_text(),
            });
        };
        if p.key != *expected {
            return Err(ProofError::WrongKey {
                expected: expected.to_text(),
                got: p.key.to_text(),
            });
        }
        p.key
            .verify_message(CONTEXT, message, &p.signature)
            .map_err(|_| ProofError::BadSignature)
    }

    /// The wire form: key, then signature.
    pub fn to_bytes(&self) -> [u8; PROOF_LEN] {
        let mut b = [0u8; PROOF_LEN];
        b[..32].copy_from_slice(&self.key.to_bytes());
        b[32..].copy_from_slice(&self.signature);
        b
    }

    /// Parses the wire form.
    ///
    /// # Errors
    /// The key is not an Ed25519 public key.
    pub fn from_bytes(b: &[u8; PROOF_LEN]) -> Result<LenderProof, crate::WireError> {
        let mut key = [0u8; 32];
        key.copy_from_slice(&b[..32]);
        let mut signature = [0u8; 64];
        signature.copy_from_slice(&b[32..]);
        Ok(LenderProof {
            key: PublicKey::from_bytes(&key)
                .map_err(|_| crate::WireError::Invalid("lender proof key"))?,
            signature,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_expected_key_proving_this_session_passes() {
        let lender = TokenSigner::from_seed([1; 32]);
        let rogue = TokenSigner::from_seed([2; 32]);
        let c = challenge().unwrap();
        let m = message(&c, &[7; 16], 1, "disk0");
        let p = LenderProof::sign(&lender, &m);
        let key = lender.public_key();
        assert_eq!(LenderProof::check(Some(&p), &m, &key), Ok(()));
        // A rogue signs with its own key: the key is not the one expected.
        let r = LenderProof::sign(&rogue, &m);
        assert!(matches!(
            LenderProof::check(Some(&r), &m, &key),
            Err(ProofError::WrongKey { .. })
        ));
        // A rogue that replays the real lender's proof of another session.
        let other = message(&challenge().unwrap(), &[7; 16], 1, "disk0");
        assert_eq!(
            LenderProof::check(Some(&p), &other, &key),
            Err(ProofError::BadSignature)
        );
        // A proof for another queue or device.
        for m2 in [
            message(&c, &[7; 16], 2, "disk0"),
            message(&c, &[7; 16], 1, "disk1"),
        ] {
            assert_eq!(
                LenderProof::check(Some(&p), &m2, &key),
                Err(ProofError::BadSignature)
            );
        }
        assert!(matches!(
            LenderProof::check(None, &m, &key),
            Err(ProofError::Missing { .. })
        ));
        assert_eq!(LenderProof::from_bytes(&p.to_bytes()).unwrap(), p);
    }
}

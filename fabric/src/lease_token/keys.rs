//! The pool's Ed25519 keys: [`TokenSigner`] signs lease tokens (and other messages
//! under their own context), [`PublicKey`] verifies them.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

use super::claims::{decode_claims, encode_claims};
use super::{LeaseClaims, LeaseToken, TokenError, MAX_TOKEN_LEN, SIGNATURE_LEN, SIGNING_CONTEXT};

/// The pool's signing key (Ed25519, RFC 8032).
pub struct TokenSigner {
    key: SigningKey,
}

impl std::fmt::Debug for TokenSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSigner")
            .field("public_key", &self.public_key().to_text())
            .finish_non_exhaustive()
    }
}

impl TokenSigner {
    /// A key from its 32-byte seed (as stored by the pool).
    pub fn from_seed(seed: [u8; 32]) -> Self {
        TokenSigner {
            key: SigningKey::from_bytes(&seed),
        }
    }

    /// A new random key.
    ///
    /// # Errors
    /// [`TokenError::Random`] when the system's random source fails.
    pub fn generate() -> Result<Self, TokenError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|_| TokenError::Random)?;
        Ok(Self::from_seed(seed))
    }

    /// The 32-byte seed, to store the key.
    pub fn seed(&self) -> [u8; 32] {
        self.key.to_bytes()
    }

    /// A key from the text form of its seed (unpadded base64url of 32 bytes, as in a
    /// key file).
    ///
    /// # Errors
    /// [`TokenError::BadKey`] when it is not base64url of 32 bytes.
    pub fn from_seed_text(text: &str) -> Result<Self, TokenError> {
        let bytes = URL_SAFE_NO_PAD
            .decode(text.trim())
            .map_err(|_| TokenError::BadKey("not base64url"))?;
        let seed: [u8; 32] = bytes
            .try_into()
            .map_err(|_| TokenError::BadKey("not 32 bytes"))?;
        Ok(Self::from_seed(seed))
    }

    /// The text form of the seed (unpadded base64url), for a key file.
    pub fn seed_text(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.seed())
    }

    /// The key lenders verify tokens with.
    pub fn public_key(&self) -> PublicKey {
        PublicKey(self.key.verifying_key())
    }

    /// Signs `msg` under a domain-separation `context` (for example the pool's request
    /// signatures): the signature covers `context` followed by `msg`, so that it can
    /// never pass for a lease token's or another context's signature.
    pub fn sign_message(&self, context: &[u8], msg: &[u8]) -> [u8; 64] {
        let mut m = Vec::with_capacity(context.len() + msg.len());
        m.extend_from_slice(context);
        m.extend_from_slice(msg);
        self.key.sign(&m).to_bytes()
    }

    /// Signs `claims` into a token.
    ///
    /// # Errors
    /// [`TokenError::FieldTooLong`] when a text field exceeds [`MAX_FIELD_LEN`](super::MAX_FIELD_LEN) bytes.
    pub fn sign(&self, claims: &LeaseClaims) -> Result<LeaseToken, TokenError> {
        let mut body = encode_claims(claims)?;
        let mut msg = SIGNING_CONTEXT.to_vec();
        msg.extend_from_slice(&body);
        let sig = self.key.sign(&msg);
        body.extend_from_slice(&sig.to_bytes());
        Ok(LeaseToken(body))
    }
}

/// The pool's public key, which lenders verify tokens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublicKey(VerifyingKey);

impl PublicKey {
    /// Parses the text form: unpadded base64url of the 32 key bytes.
    ///
    /// # Errors
    /// [`TokenError::BadKey`] when it is not base64url of 32 bytes, not a valid point or
    /// a weak one ([`Self::from_bytes`]).
    pub fn from_text(text: &str) -> Result<Self, TokenError> {
        let bytes = URL_SAFE_NO_PAD
            .decode(text.trim())
            .map_err(|_| TokenError::BadKey("not base64url"))?;
        let bytes: [u8; 32] = bytes
            .try_into()
            .map_err(|_| TokenError::BadKey("not 32 bytes"))?;
        Self::from_bytes(&bytes)
    }

    /// The text form: unpadded base64url.
    pub fn to_text(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.0.as_bytes())
    }

    /// The 32 key bytes.
    pub fn to_bytes(&self) -> [u8; 32] {
        self.0.to_bytes()
    }

    /// A key from its 32 bytes.
    ///
    /// # Errors
    /// [`TokenError::BadKey`] when they are not a valid point, or a point of small order
    /// (such as the 32 zero bytes): no signature verifies under one of those
    /// (`verify_strict`), so a token bound to it could never be used.
    pub fn from_bytes(bytes: &[u8; 32]) -> Result<Self, TokenError> {
        let key = VerifyingKey::from_bytes(bytes)
            .map_err(|_| TokenError::BadKey("not an Ed25519 public key"))?;
        if key.is_weak() {
            return Err(TokenError::BadKey(
                "a weak Ed25519 key (a point of small order)",
            ));
        }
        Ok(PublicKey(key))
    }

    /// Checks a signature made by [`TokenSigner::sign_message`] with the same
    /// `context`.
    ///
    /// # Errors
    /// [`TokenError::BadSignature`] when it does not verify.
    pub fn verify_message(
        &self,
        context: &[u8],
        msg: &[u8],
        signature: &[u8; 64],
    ) -> Result<(), TokenError> {
        let mut m = Vec::with_capacity(context.len() + msg.len());
        m.extend_from_slice(context);
        m.extend_from_slice(msg);
        self.0
            .verify_strict(&m, &Signature::from_bytes(signature))
            .map_err(|_| TokenError::BadSignature)
    }

    /// Checks the signature of `token` and decodes its claims. The caller still checks
    /// the claims (device, provider, lease id, expiry) against the session.
    ///
    /// # Errors
    /// [`TokenError::Malformed`] for a bad layout, [`TokenError::BadSignature`] for a
    /// forged or altered token.
    pub fn verify(&self, token: &LeaseToken) -> Result<LeaseClaims, TokenError> {
        let bytes = token.as_bytes();
        if bytes.len() > MAX_TOKEN_LEN {
            return Err(TokenError::Malformed("too long"));
        }
        let split = bytes
            .len()
            .checked_sub(SIGNATURE_LEN)
            .ok_or(TokenError::Malformed("shorter than a signature"))?;
        let (body, sig) = bytes.split_at(split);
        let sig: [u8; SIGNATURE_LEN] = sig
            .try_into()
            .map_err(|_| TokenError::Malformed("signature length"))?;
        let mut msg = SIGNING_CONTEXT.to_vec();
        msg.extend_from_slice(body);
        self.0
            .verify(&msg, &Signature::from_bytes(&sig))
            .map_err(|_| TokenError::BadSignature)?;
        decode_claims(body)
    }
}

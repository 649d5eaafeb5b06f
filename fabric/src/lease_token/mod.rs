//! Lease tokens: the pool's signed statement that one borrower may open one device.
//!
//! The pool signs a [`LeaseClaims`] with its Ed25519 key when it grants a lease; the
//! borrower sends the token in its session [`Hello`](crate::Hello); the lender checks the
//! signature against the pool's public key and the claims against the hello (device,
//! provider, borrower identity = lease id) and the clock.
//!
//! Its parts: `claims` is what a token grants and its binary layout (also in
//! `docs/protocol.md`), `keys` the pool's signing key and the public key lenders verify
//! with. The signature covers [`SIGNING_CONTEXT`] followed by every byte before it.
//! Text form (JSON, command lines): unpadded base64url of the binary form.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

use crate::codec::CodecError;

mod claims;
mod keys;
#[cfg(test)]
mod tests;

use claims::decode_claims;
pub use claims::LeaseClaims;
pub use keys::{PublicKey, TokenSigner};

/// The clock tokens are read against: milliseconds since the Unix epoch (0 if the
/// clock is before it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Token layout version without a provider key.
pub const TOKEN_VERSION: u8 = 1;
/// Token layout version with the provider's key.
pub const TOKEN_VERSION_KEYED: u8 = 2;
/// Token layout version with flags: the provider's key and the lease's limits, each
/// optional.
pub const TOKEN_VERSION_FLAGGED: u8 = 3;
/// Domain separation prefix of every signed message.
pub const SIGNING_CONTEXT: &[u8] = b"devlend-lease-token-v1\0";
/// Longest token accepted, in bytes of binary form (fits the hello's `token_len: u16`).
pub const MAX_TOKEN_LEN: usize = 1024;
/// Longest text field (provider, device, consumer), in bytes.
pub const MAX_FIELD_LEN: usize = 255;
const SIGNATURE_LEN: usize = 64;

/// Why a token was not issued or not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not base64url, or not of the token layout.
    #[error("malformed lease token: {0}")]
    Malformed(&'static str),
    /// The signature does not verify with the pool's key: forged or altered.
    #[error("lease token signature does not verify")]
    BadSignature,
    /// A field is longer than [`MAX_FIELD_LEN`] bytes.
    #[error("lease token field {0} is longer than 255 bytes")]
    FieldTooLong(&'static str),
    /// A key is not 32 bytes of base64url.
    #[error("malformed public key: {0}")]
    BadKey(&'static str),
    /// The system's random source failed.
    #[error("no randomness for a new signing key")]
    Random,
}

impl From<CodecError> for TokenError {
    fn from(e: CodecError) -> Self {
        TokenError::Malformed(match e {
            CodecError::Short { .. } => "truncated",
            CodecError::NotZero(what) => what,
            CodecError::Trailing { .. } => "trailing bytes",
        })
    }
}

/// A signed token in binary form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseToken(Vec<u8>);

impl LeaseToken {
    /// Wraps bytes as received (e.g. from a hello); check them with [`PublicKey::verify`].
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        LeaseToken(bytes)
    }

    /// Parses the text form.
    ///
    /// # Errors
    /// [`TokenError::Malformed`] when it is not base64url or longer than
    /// [`MAX_TOKEN_LEN`] bytes.
    pub fn from_text(text: &str) -> Result<Self, TokenError> {
        if text.len() > MAX_TOKEN_LEN * 4 / 3 + 4 {
            return Err(TokenError::Malformed("too long"));
        }
        let bytes = URL_SAFE_NO_PAD
            .decode(text.trim())
            .map_err(|_| TokenError::Malformed("not base64url"))?;
        if bytes.len() > MAX_TOKEN_LEN {
            return Err(TokenError::Malformed("too long"));
        }
        Ok(LeaseToken(bytes))
    }

    /// The text form: unpadded base64url.
    pub fn to_text(&self) -> String {
        URL_SAFE_NO_PAD.encode(&self.0)
    }

    /// The binary form.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The claims, without checking the signature: what the borrower reads from the
    /// token it was given (the lender's key, [`LeaseClaims::provider_key`]). Whoever
    /// grants a session checks the signature with [`PublicKey::verify`].
    ///
    /// # Errors
    /// [`TokenError::Malformed`].
    pub fn claims_unverified(&self) -> Result<LeaseClaims, TokenError> {
        let split = self
            .0
            .len()
            .checked_sub(SIGNATURE_LEN)
            .ok_or(TokenError::Malformed("shorter than a signature"))?;
        decode_claims(&self.0[..split])
    }
}

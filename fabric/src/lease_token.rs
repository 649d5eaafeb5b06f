//! Lease tokens: the pool's signed statement that one borrower may open one device.
//!
//! The pool signs a [`LeaseClaims`] with its Ed25519 key when it grants a lease; the
//! borrower sends the token in its session [`Hello`](crate::Hello); the lender checks the
//! signature against the pool's public key and the claims against the hello (device,
//! provider, borrower identity = lease id) and the clock.
//!
//! Binary layout (all integers little-endian):
//! `version: u8 = 1, 2 or 3, lease_id: [u8; 16], expires_at_ms: u64, provider_len: u16,
//! provider, device_len: u16, device, consumer_len: u16, consumer`, in version 2 then
//! `provider_key: [u8; 32]` (the lender's public key, which the borrower makes the lender
//! prove in the handshake, [`crate::lender_proof`]); in version 3 instead `flags: u8`
//! (bit 0: a provider key follows, bit 1: limits follow, bit 2: the id of the lease this
//! one takes the device over from follows; bit 1 or bit 2 set; other bits 0), then the
//! provider key if bit 0, then `successor_of: [u8; 16]` if bit 2, then the lease's limits
//! ([`crate::qos`], wire form) if bit 1, then `epoch: u64` if bit 3 (the lease's fencing
//! epoch, see [`LeaseClaims::epoch`]); then `signature: [u8; 64]`. A token without
//! limits, predecessor or epoch is version 1 or 2, byte for byte as before; one without
//! a provider key either is version 1. The signature covers
//! [`SIGNING_CONTEXT`] followed by every byte before it. Text form
//! (JSON, command lines): unpadded base64url of the binary form.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

use crate::codec::{self, CodecError, Reader};
use crate::qos::Qos;

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
/// Version 3 flag: the provider's key follows.
const FLAG_PROVIDER_KEY: u8 = 1;
/// Version 3 flag: the lease's limits follow.
const FLAG_QOS: u8 = 2;
/// Version 3 flag: the id of the lease this one takes over from follows.
const FLAG_SUCCESSOR: u8 = 4;
/// Version 3 flag: the lease's fencing epoch follows.
const FLAG_EPOCH: u8 = 8;
/// Domain separation prefix of every signed message.
pub const SIGNING_CONTEXT: &[u8] = b"devlend-lease-token-v1\0";
/// Longest token accepted, in bytes of binary form (fits the hello's `token_len: u16`).
pub const MAX_TOKEN_LEN: usize = 1024;
/// Longest text field (provider, device, consumer), in bytes.
pub const MAX_FIELD_LEN: usize = 255;
const SIGNATURE_LEN: usize = 64;
/// Bytes of the claims before the text fields.
const CLAIMS_HEAD_LEN: usize = 25;

crate::layout! {
    /// The claims' fixed part, before the text fields.
    struct ClaimsHead [CLAIMS_HEAD_LEN] {
        version: u8,
        lease_id: [u8; 16],
        expires_at_ms: u64,
    }
}

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

/// What a lease token grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseClaims {
    /// The lease's id (a UUID's 16 bytes). The borrower sends it as its identity in the
    /// hello, so one lease is one holder of the device.
    pub lease_id: [u8; 16],
    /// Expiry at signing time, in milliseconds since the Unix epoch. Renewals move the
    /// lease's expiry; the lender learns them from the pool (heartbeat answers).
    pub expires_at_ms: u64,
    /// Name of the resource provider (the lender) that serves the device.
    pub provider: String,
    /// Device name on that lender.
    pub device: String,
    /// The consumer the lease was granted to (a VM id).
    pub consumer: String,
    /// The lender's public key as the pool enrolled it (version 2 tokens); the borrower
    /// makes the lender prove it holds it.
    pub provider_key: Option<[u8; 32]>,
    /// The lease's limits (version 3 tokens), which the lender enforces together with
    /// its own ([`Qos::tighter`]).
    pub qos: Option<Qos>,
    /// A handover (live migration): the lease that holds the device now, whose holder
    /// consented to hand it to this one (version 3 tokens). The lender lets this lease
    /// wait for the device while that one holds it, and take it when it lets go.
    pub successor_of: Option<[u8; 16]>,
    /// The lease's fencing epoch (version 3 tokens with flag bit 3): the pool numbers
    /// every lease it grants from one counter that only grows, so of two leases of one
    /// device the newer has the higher epoch. A lender that has seen a device's lease of
    /// epoch `E` never serves that device to a lease below `E` again, even while it
    /// cannot reach the pool (docs/pool.md, "When a lease ends"). `None`: a token from a
    /// pool before epochs, or a direct-mode token.
    pub epoch: Option<u64>,
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
    /// [`TokenError::FieldTooLong`] when a text field exceeds [`MAX_FIELD_LEN`] bytes.
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
    /// [`TokenError::BadKey`] when it is not base64url of 32 bytes or not a valid point.
    pub fn from_text(text: &str) -> Result<Self, TokenError> {
        let bytes = URL_SAFE_NO_PAD
            .decode(text.trim())
            .map_err(|_| TokenError::BadKey("not base64url"))?;
        let bytes: [u8; 32] = bytes
            .try_into()
            .map_err(|_| TokenError::BadKey("not 32 bytes"))?;
        VerifyingKey::from_bytes(&bytes)
            .map(PublicKey)
            .map_err(|_| TokenError::BadKey("not an Ed25519 public key"))
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
    /// [`TokenError::BadKey`] when they are not a valid point.
    pub fn from_bytes(bytes: &[u8; 32]) -> Result<Self, TokenError> {
        VerifyingKey::from_bytes(bytes)
            .map(PublicKey)
            .map_err(|_| TokenError::BadKey("not an Ed25519 public key"))
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

fn put_field(b: &mut Vec<u8>, name: &'static str, v: &str) -> Result<(), TokenError> {
    if v.len() > MAX_FIELD_LEN {
        return Err(TokenError::FieldTooLong(name));
    }
    codec::push(b, v.len() as u16);
    b.extend_from_slice(v.as_bytes());
    Ok(())
}

fn encode_claims(c: &LeaseClaims) -> Result<Vec<u8>, TokenError> {
    let mut b = Vec::with_capacity(64 + c.provider.len() + c.device.len() + c.consumer.len());
    let version = match (
        c.qos.is_some() || c.successor_of.is_some() || c.epoch.is_some(),
        c.provider_key.is_some(),
    ) {
        (true, _) => TOKEN_VERSION_FLAGGED,
        (false, true) => TOKEN_VERSION_KEYED,
        (false, false) => TOKEN_VERSION,
    };
    let head = ClaimsHead {
        version,
        lease_id: c.lease_id,
        expires_at_ms: c.expires_at_ms,
    };
    head.push(&mut b);
    put_field(&mut b, "provider", &c.provider)?;
    put_field(&mut b, "device", &c.device)?;
    put_field(&mut b, "consumer", &c.consumer)?;
    if version == TOKEN_VERSION_FLAGGED {
        let mut flags = 0;
        if c.qos.is_some() {
            flags |= FLAG_QOS;
        }
        if c.provider_key.is_some() {
            flags |= FLAG_PROVIDER_KEY;
        }
        if c.successor_of.is_some() {
            flags |= FLAG_SUCCESSOR;
        }
        if c.epoch.is_some() {
            flags |= FLAG_EPOCH;
        }
        codec::push(&mut b, flags);
    }
    if let Some(k) = &c.provider_key {
        b.extend_from_slice(k);
    }
    if let Some(s) = &c.successor_of {
        b.extend_from_slice(s);
    }
    if let Some(q) = &c.qos {
        q.encode(&mut b);
    }
    if let Some(e) = c.epoch {
        codec::push(&mut b, e);
    }
    Ok(b)
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

/// A text field: `len: u16`, then `len` bytes of UTF-8.
fn field(r: &mut Reader<'_>) -> Result<String, TokenError> {
    let len = usize::from(r.u16()?);
    if len > MAX_FIELD_LEN {
        return Err(TokenError::Malformed("field too long"));
    }
    String::from_utf8(r.bytes(len)?.to_vec())
        .map_err(|_| TokenError::Malformed("field is not UTF-8"))
}

fn decode_claims(body: &[u8]) -> Result<LeaseClaims, TokenError> {
    if body.first().is_some_and(|&v| {
        v != TOKEN_VERSION && v != TOKEN_VERSION_KEYED && v != TOKEN_VERSION_FLAGGED
    }) {
        return Err(TokenError::Malformed("unknown token version"));
    }
    let mut r = Reader::new(body);
    let head = ClaimsHead::read(&mut r)?;
    let provider = field(&mut r)?;
    let device = field(&mut r)?;
    let consumer = field(&mut r)?;
    let flags = match head.version {
        TOKEN_VERSION => 0,
        TOKEN_VERSION_KEYED => FLAG_PROVIDER_KEY,
        _ => {
            let f = r.u8()?;
            if f & !(FLAG_PROVIDER_KEY | FLAG_QOS | FLAG_SUCCESSOR | FLAG_EPOCH) != 0 {
                return Err(TokenError::Malformed("unknown token flags"));
            }
            // One encoding per token: claims without limits, predecessor or epoch are
            // version 1 or 2.
            if f & (FLAG_QOS | FLAG_SUCCESSOR | FLAG_EPOCH) == 0 {
                return Err(TokenError::Malformed(
                    "version 3 token without limits, predecessor or epoch",
                ));
            }
            f
        }
    };
    let provider_key = if flags & FLAG_PROVIDER_KEY != 0 {
        Some(r.array::<32>()?)
    } else {
        None
    };
    let successor_of = if flags & FLAG_SUCCESSOR != 0 {
        Some(r.array::<16>()?)
    } else {
        None
    };
    let qos = if flags & FLAG_QOS != 0 {
        Some(Qos::decode(&mut r).map_err(|e| TokenError::Malformed(e.0))?)
    } else {
        None
    };
    let epoch = if flags & FLAG_EPOCH != 0 {
        Some(r.u64()?)
    } else {
        None
    };
    let claims = LeaseClaims {
        lease_id: head.lease_id,
        expires_at_ms: head.expires_at_ms,
        provider,
        device,
        consumer,
        provider_key,
        qos,
        successor_of,
        epoch,
    };
    r.finish()?;
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> LeaseClaims {
        LeaseClaims {
            lease_id: [7; 16],
            expires_at_ms: 1_800_000_000_000,
            provider: "lender-a".into(),
            device: "disk0".into(),
            consumer: "vm-1".into(),
            provider_key: None,
            qos: None,
            successor_of: None,
            epoch: None,
        }
    }

    #[test]
    fn signed_token_verifies_and_round_trips_through_text() {
        let signer = TokenSigner::from_seed([1; 32]);
        let token = signer.sign(&claims()).unwrap();
        let text = token.to_text();
        let back = LeaseToken::from_text(&text).unwrap();
        let key = PublicKey::from_text(&signer.public_key().to_text()).unwrap();
        assert_eq!(key.verify(&back).unwrap(), claims());
    }

    #[test]
    fn message_signatures_are_bound_to_their_context_and_bytes() {
        let signer = TokenSigner::from_seed([3; 32]);
        let key = signer.public_key();
        let sig = signer.sign_message(b"ctx-a\0", b"PUT /v1/providers/x");
        assert!(key
            .verify_message(b"ctx-a\0", b"PUT /v1/providers/x", &sig)
            .is_ok());
        assert!(key
            .verify_message(b"ctx-b\0", b"PUT /v1/providers/x", &sig)
            .is_err());
        assert!(key
            .verify_message(b"ctx-a\0", b"PUT /v1/providers/y", &sig)
            .is_err());
        let other = TokenSigner::from_seed([4; 32]).public_key();
        assert!(other
            .verify_message(b"ctx-a\0", b"PUT /v1/providers/x", &sig)
            .is_err());
        // A lease token's signature is not a message signature under another context.
        let token = signer.sign(&claims()).unwrap();
        let (body, tsig) = token.as_bytes().split_at(token.as_bytes().len() - 64);
        let tsig: [u8; 64] = tsig.try_into().unwrap();
        assert!(key.verify_message(SIGNING_CONTEXT, body, &tsig).is_ok());
        assert!(key.verify_message(b"ctx-a\0", body, &tsig).is_err());
    }

    #[test]
    fn a_keyed_token_is_version_2_and_carries_the_key() {
        let signer = TokenSigner::from_seed([6; 32]);
        let mut c = claims();
        c.provider_key = Some([0x42; 32]);
        let token = signer.sign(&c).unwrap();
        assert_eq!(token.as_bytes()[0], TOKEN_VERSION_KEYED);
        assert_eq!(signer.public_key().verify(&token).unwrap(), c);
        assert_eq!(
            token.claims_unverified().unwrap().provider_key,
            Some([0x42; 32])
        );
        let plain = signer.sign(&claims()).unwrap();
        assert_eq!(plain.as_bytes()[0], TOKEN_VERSION);
        assert_eq!(plain.as_bytes().len() + 32, token.as_bytes().len());
    }

    #[test]
    fn a_token_with_limits_is_version_3_and_every_altered_byte_is_refused() {
        use crate::qos::Lane;
        let signer = TokenSigner::from_seed([8; 32]);
        for key in [None, Some([0x42; 32])] {
            let mut c = claims();
            c.provider_key = key;
            c.qos = Some(Qos::default().with(Lane::IopsRead, 2000, 0).with_weight(3));
            let token = signer.sign(&c).unwrap();
            assert_eq!(token.as_bytes()[0], TOKEN_VERSION_FLAGGED);
            assert_eq!(signer.public_key().verify(&token).unwrap(), c);
            assert_eq!(token.claims_unverified().unwrap(), c);
            // A borrower that lifts its limit (or drops it) breaks the signature.
            for i in 0..token.as_bytes().len() {
                let mut b = token.as_bytes().to_vec();
                b[i] ^= 0x01;
                let r = signer.public_key().verify(&LeaseToken::from_bytes(b));
                assert!(r.is_err(), "byte {i} altered yet accepted");
            }
        }
    }

    #[test]
    fn a_version_3_token_without_limits_is_refused() {
        // Found by the wire_decode fuzz target: version 3 with flags 0 (or only the key
        // bit) decoded, and re-encoded as version 1 or 2, so two byte strings meant one
        // token.
        for key in [None, Some([0x42; 32])] {
            let mut c = claims();
            c.provider_key = key;
            let mut body = encode_claims(&c).unwrap();
            body[0] = TOKEN_VERSION_FLAGGED;
            let at = body.len() - key.map_or(0, |k| k.len());
            body.insert(at, if key.is_some() { FLAG_PROVIDER_KEY } else { 0 });
            assert_eq!(
                decode_claims(&body),
                Err(TokenError::Malformed(
                    "version 3 token without limits, predecessor or epoch"
                ))
            );
            body[at] |= FLAG_QOS;
            Qos::default().with_weight(1).encode(&mut body);
            assert!(decode_claims(&body).is_ok());
        }
    }

    #[test]
    fn a_handover_token_names_its_predecessor_with_and_without_limits() {
        let signer = TokenSigner::from_seed([3; 32]);
        for qos in [None, Some(Qos::default().with_weight(2))] {
            for key in [None, Some([0x42; 32])] {
                let mut c = claims();
                c.successor_of = Some([9; 16]);
                c.qos = qos;
                c.provider_key = key;
                let token = signer.sign(&c).unwrap();
                assert_eq!(token.as_bytes()[0], TOKEN_VERSION_FLAGGED);
                let back = signer.public_key().verify(&token).unwrap();
                assert_eq!(back, c);
                // One encoding per token: re-encoding gives the same bytes.
                let body = encode_claims(&back).unwrap();
                assert_eq!(&token.as_bytes()[..body.len()], &body[..]);
            }
        }
    }

    #[test]
    fn an_epoch_travels_signed_alone_or_with_every_other_flag() {
        let signer = TokenSigner::from_seed([3; 32]);
        for successor in [None, Some([9; 16])] {
            for qos in [None, Some(Qos::default().with_weight(2))] {
                for key in [None, Some([0x42; 32])] {
                    let mut c = claims();
                    c.epoch = Some(0x0102_0304_0506_0708);
                    c.successor_of = successor;
                    c.qos = qos;
                    c.provider_key = key;
                    let token = signer.sign(&c).unwrap();
                    assert_eq!(token.as_bytes()[0], TOKEN_VERSION_FLAGGED);
                    let back = signer.public_key().verify(&token).unwrap();
                    assert_eq!(back, c);
                    let body = encode_claims(&back).unwrap();
                    assert_eq!(&token.as_bytes()[..body.len()], &body[..]);
                    // The epoch is the last field before the signature, little-endian.
                    assert_eq!(
                        &body[body.len() - 8..],
                        &0x0102_0304_0506_0708u64.to_le_bytes()
                    );
                }
            }
        }
    }

    #[test]
    fn every_altered_byte_is_refused() {
        let signer = TokenSigner::from_seed([2; 32]);
        let token = signer.sign(&claims()).unwrap();
        for i in 0..token.as_bytes().len() {
            let mut b = token.as_bytes().to_vec();
            b[i] ^= 0x01;
            let r = signer.public_key().verify(&LeaseToken::from_bytes(b));
            assert!(r.is_err(), "byte {i} altered yet accepted");
        }
    }

    #[test]
    fn another_pools_key_is_refused() {
        let token = TokenSigner::from_seed([3; 32]).sign(&claims()).unwrap();
        let other = TokenSigner::from_seed([4; 32]).public_key();
        assert_eq!(other.verify(&token), Err(TokenError::BadSignature));
    }

    #[test]
    fn malformed_inputs_are_errors_not_panics() {
        let key = TokenSigner::from_seed([5; 32]).public_key();
        for b in [vec![], vec![1u8; 10], vec![0u8; 64], vec![1u8; 2000]] {
            assert!(key.verify(&LeaseToken::from_bytes(b)).is_err());
        }
        assert!(LeaseToken::from_text("not base64!").is_err());
        assert!(PublicKey::from_text("AAAA").is_err());
        let mut long = claims();
        long.device = "x".repeat(256);
        assert_eq!(
            TokenSigner::from_seed([5; 32]).sign(&long),
            Err(TokenError::FieldTooLong("device"))
        );
    }
}

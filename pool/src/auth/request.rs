//! Signed pool requests: what a client puts in `Authorization`, and how the pool reads
//! it back. Used by both sides.
//!
//! Header: `Authorization: Devlend-Ed25519 key=K;ts=T;nonce=N;sig=S` where `K` is the
//! signer's public key (unpadded base64url), `T` the client's clock in ms since the Unix
//! epoch, `N` 16 random bytes in lower-case hex and `S` the Ed25519 signature
//! (unpadded base64url of 64 bytes) of [`CONTEXT`] followed by
//!
//! ```text
//! METHOD "\n" PATH_AND_QUERY "\n" T "\n" N "\n" hex(SHA-256(body))
//! ```
//!
//! `PATH_AND_QUERY` is the request target as sent (`/v1/leases?filter=all`). The pool
//! accepts `T` within [`MAX_SKEW_MS`] of its own clock and each nonce once, so a
//! captured request cannot be replayed; the body hash binds the body.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use devlend_fabric::lease_token::{PublicKey, TokenError, TokenSigner};
use sha2::{Digest, Sha256};

/// The authorization scheme's name.
pub const SCHEME: &str = "Devlend-Ed25519";
/// Domain separation prefix of every request signature.
pub const CONTEXT: &[u8] = b"devlend-pool-request-v1\0";
/// How far a request's time may be from the pool's clock, in ms (5 minutes).
pub const MAX_SKEW_MS: u64 = 300_000;
/// Longest `Authorization` value read, in bytes.
pub const MAX_HEADER_LEN: usize = 512;

/// Why an `Authorization` value was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// Not of the form above.
    #[error("malformed Authorization header: {0}")]
    Malformed(&'static str),
    /// The signature does not verify for this method, target, time, nonce and body.
    #[error("the request signature does not verify")]
    BadSignature,
    /// The time is too far from the pool's clock.
    #[error("the request time is {skew_ms} ms away from the pool's clock (at most {MAX_SKEW_MS})")]
    Stale {
        /// The distance, ms.
        skew_ms: u64,
    },
    /// No randomness for a nonce (client side).
    #[error("no randomness for a request nonce")]
    Random,
}

/// A parsed `Authorization` value, not yet verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedRequest {
    /// Who claims to have signed.
    pub key: PublicKey,
    /// The client's clock, ms since the epoch.
    pub ts_ms: u64,
    /// The request's nonce.
    pub nonce: [u8; 16],
    signature: [u8; 64],
}

fn message(method: &str, target: &str, ts_ms: u64, nonce: &[u8; 16], body: &[u8]) -> Vec<u8> {
    format!(
        "{method}\n{target}\n{ts_ms}\n{}\n{}",
        hex(nonce),
        hex(&Sha256::digest(body))
    )
    .into_bytes()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex16(s: &str) -> Option<[u8; 16]> {
    if s.len() != 32 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// The `Authorization` value for a request, signed with `signer` at `ts_ms`.
///
/// # Errors
/// [`SignatureError::Random`] when the system has no randomness.
pub fn sign(
    signer: &TokenSigner,
    method: &str,
    target: &str,
    ts_ms: u64,
    body: &[u8],
) -> Result<String, SignatureError> {
    let mut nonce = [0u8; 16];
    getrandom::fill(&mut nonce).map_err(|_| SignatureError::Random)?;
    let sig = signer.sign_message(CONTEXT, &message(method, target, ts_ms, &nonce, body));
    Ok(format!(
        "{SCHEME} key={};ts={ts_ms};nonce={};sig={}",
        signer.public_key().to_text(),
        hex(&nonce),
        URL_SAFE_NO_PAD.encode(sig)
    ))
}

impl SignedRequest {
    /// Parses an `Authorization` value.
    ///
    /// # Errors
    /// [`SignatureError::Malformed`].
    pub fn parse(value: &str) -> Result<SignedRequest, SignatureError> {
        if value.len() > MAX_HEADER_LEN {
            return Err(SignatureError::Malformed("too long"));
        }
        let rest = value
            .strip_prefix(SCHEME)
            .and_then(|r| r.strip_prefix(' '))
            .ok_or(SignatureError::Malformed("not the Devlend-Ed25519 scheme"))?;
        let (mut key, mut ts, mut nonce, mut sig) = (None, None, None, None);
        for part in rest.split(';') {
            let (k, v) = part
                .split_once('=')
                .ok_or(SignatureError::Malformed("a parameter without ="))?;
            let slot = match k.trim() {
                "key" => &mut key,
                "ts" => &mut ts,
                "nonce" => &mut nonce,
                "sig" => &mut sig,
                _ => return Err(SignatureError::Malformed("unknown parameter")),
            };
            if slot.replace(v.trim()).is_some() {
                return Err(SignatureError::Malformed("a parameter given twice"));
            }
        }
        let missing = SignatureError::Malformed("key, ts, nonce and sig are all required");
        let (key, ts, nonce, sig) = match (key, ts, nonce, sig) {
            (Some(a), Some(b), Some(c), Some(d)) => (a, b, c, d),
            _ => return Err(missing),
        };
        let key = PublicKey::from_text(key).map_err(|e| {
            SignatureError::Malformed(match e {
                TokenError::BadKey(why) => why,
                _ => "bad key",
            })
        })?;
        let ts_ms = ts
            .parse()
            .map_err(|_| SignatureError::Malformed("ts is not a number of ms"))?;
        let nonce =
            unhex16(nonce).ok_or(SignatureError::Malformed("nonce is not 32 hex digits"))?;
        let signature: [u8; 64] = URL_SAFE_NO_PAD
            .decode(sig)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or(SignatureError::Malformed(
                "sig is not 64 bytes of base64url",
            ))?;
        Ok(SignedRequest {
            key,
            ts_ms,
            nonce,
            signature,
        })
    }

    /// Checks the time against `now_ms` and the signature against the request.
    ///
    /// # Errors
    /// [`SignatureError::Stale`], [`SignatureError::BadSignature`].
    pub fn verify(
        &self,
        method: &str,
        target: &str,
        body: &[u8],
        now_ms: u64,
    ) -> Result<(), SignatureError> {
        let skew_ms = self.ts_ms.abs_diff(now_ms);
        if skew_ms > MAX_SKEW_MS {
            return Err(SignatureError::Stale { skew_ms });
        }
        self.key
            .verify_message(
                CONTEXT,
                &message(method, target, self.ts_ms, &self.nonce, body),
                &self.signature,
            )
            .map_err(|_| SignatureError::BadSignature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000_000;

    #[test]
    fn a_signed_request_verifies_only_as_sent() {
        let signer = TokenSigner::from_seed([9; 32]);
        let h = sign(&signer, "PUT", "/v1/providers/a", NOW, b"{}").unwrap();
        let r = SignedRequest::parse(&h).unwrap();
        assert_eq!(r.key, signer.public_key());
        r.verify("PUT", "/v1/providers/a", b"{}", NOW + 1000)
            .unwrap();
        for (m, t, b) in [
            ("POST", "/v1/providers/a", &b"{}"[..]),
            ("PUT", "/v1/providers/b", b"{}"),
            ("PUT", "/v1/providers/a", b"{ }"),
        ] {
            assert_eq!(
                r.verify(m, t, b, NOW),
                Err(SignatureError::BadSignature),
                "{m} {t} {b:?}"
            );
        }
        assert!(matches!(
            r.verify("PUT", "/v1/providers/a", b"{}", NOW + MAX_SKEW_MS + 1),
            Err(SignatureError::Stale { .. })
        ));
        // Another key in the header: the signature no longer verifies.
        let other = TokenSigner::from_seed([8; 32]).public_key().to_text();
        let swapped = h.replace(&signer.public_key().to_text(), &other);
        let r = SignedRequest::parse(&swapped).unwrap();
        assert_eq!(
            r.verify("PUT", "/v1/providers/a", b"{}", NOW),
            Err(SignatureError::BadSignature)
        );
    }

    #[test]
    fn malformed_headers_are_refused() {
        let signer = TokenSigner::from_seed([9; 32]);
        let good = sign(&signer, "GET", "/", NOW, b"").unwrap();
        for bad in [
            String::new(),
            "Bearer abc".into(),
            good.replace("key=", "kee="),
            good.replace(";nonce=", ";nonce=zz"),
            format!("{good};ts=1"),
            good.replace(";sig=", ";sig=AAAA"),
            "x".repeat(MAX_HEADER_LEN + 1),
        ] {
            assert!(SignedRequest::parse(&bad).is_err(), "{bad:?}");
        }
    }
}

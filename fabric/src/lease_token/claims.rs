//! What a lease token grants ([`LeaseClaims`]) and its binary layout.
//!
//! Binary layout (all integers little-endian):
//! `version: u8 = 1, 2 or 3, lease_id: [u8; 16], expires_at_ms: u64, provider_len: u16,
//! provider, device_len: u16, device, consumer_len: u16, consumer`, in version 2 then
//! `provider_key: [u8; 32]` (the lender's public key, which the borrower makes the lender
//! prove in the handshake, [`crate::lender_proof`]); in version 3 instead `flags: u8`
//! (bit 0: a provider key follows, bit 1: limits follow, bit 2: the id of the lease this
//! one takes the device over from follows; one of bits 1 to 4 set; other bits 0), then the
//! provider key if bit 0, then `successor_of: [u8; 16]` if bit 2, then the lease's limits
//! ([`crate::qos`], wire form) if bit 1, then `epoch: u64` if bit 3 (the lease's fencing
//! epoch, see [`LeaseClaims::epoch`]), then `holder_key: [u8; 32]` if bit 4 (the key the
//! borrower proves possession of, [`crate::holder_proof`]); then `signature: [u8; 64]`. A token without
//! limits, predecessor or epoch is version 1 or 2, byte for byte as before; one without
//! a provider key either is version 1.

use crate::codec::{self, Reader};
use crate::qos::Qos;

use super::{TokenError, MAX_FIELD_LEN, TOKEN_VERSION, TOKEN_VERSION_FLAGGED, TOKEN_VERSION_KEYED};

/// Version 3 flag: the provider's key follows.
pub(super) const FLAG_PROVIDER_KEY: u8 = 1;
/// Version 3 flag: the lease's limits follow.
pub(super) const FLAG_QOS: u8 = 2;
/// Version 3 flag: the id of the lease this one takes over from follows.
const FLAG_SUCCESSOR: u8 = 4;
/// Version 3 flag: the lease's fencing epoch follows.
const FLAG_EPOCH: u8 = 8;
/// Version 3 flag: the holder's key follows.
const FLAG_HOLDER_KEY: u8 = 16;
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
    /// The key of the lease's holder (version 3 tokens with flag bit 4): the compute
    /// host's enrolled key for a pool lease, the borrower's own key in direct mode, the
    /// destination's key for a handover. The borrower proves it holds it in the
    /// handshake ([`crate::holder_proof`]), so a token seen on the wire opens nothing.
    /// `None`: a bearer token, which lenders refuse unless told otherwise.
    pub holder_key: Option<[u8; 32]>,
}

fn put_field(b: &mut Vec<u8>, name: &'static str, v: &str) -> Result<(), TokenError> {
    if v.len() > MAX_FIELD_LEN {
        return Err(TokenError::FieldTooLong(name));
    }
    codec::push(b, v.len() as u16);
    b.extend_from_slice(v.as_bytes());
    Ok(())
}

pub(super) fn encode_claims(c: &LeaseClaims) -> Result<Vec<u8>, TokenError> {
    let mut b = Vec::with_capacity(64 + c.provider.len() + c.device.len() + c.consumer.len());
    let version = match (
        c.qos.is_some() || c.successor_of.is_some() || c.epoch.is_some() || c.holder_key.is_some(),
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
        if c.holder_key.is_some() {
            flags |= FLAG_HOLDER_KEY;
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
    if let Some(k) = &c.holder_key {
        b.extend_from_slice(k);
    }
    Ok(b)
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

pub(super) fn decode_claims(body: &[u8]) -> Result<LeaseClaims, TokenError> {
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
            if f & !(FLAG_PROVIDER_KEY | FLAG_QOS | FLAG_SUCCESSOR | FLAG_EPOCH | FLAG_HOLDER_KEY)
                != 0
            {
                return Err(TokenError::Malformed("unknown token flags"));
            }
            // One encoding per token: claims without limits, predecessor or epoch are
            // version 1 or 2.
            if f & (FLAG_QOS | FLAG_SUCCESSOR | FLAG_EPOCH | FLAG_HOLDER_KEY) == 0 {
                return Err(TokenError::Malformed(
                    "version 3 token without limits, predecessor, epoch or holder key",
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
    let holder_key = if flags & FLAG_HOLDER_KEY != 0 {
        Some(r.array::<32>()?)
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
        holder_key,
    };
    r.finish()?;
    Ok(claims)
}

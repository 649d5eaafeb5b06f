//! Tests of the lease token: signing, layouts, versions and text forms.

use super::claims::{encode_claims, FLAG_PROVIDER_KEY, FLAG_QOS};
use super::*;
use crate::qos::Qos;

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
        holder_key: None,
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
                "version 3 token without limits, predecessor, epoch or holder key"
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

#[test]
fn a_holder_key_round_trips_alone_and_with_every_other_claim() {
    let signer = TokenSigner::from_seed([5; 32]);
    let mut c = claims();
    c.holder_key = Some([0x17; 32]);
    let t = signer.sign(&c).unwrap();
    assert_eq!(t.as_bytes()[0], TOKEN_VERSION_FLAGGED);
    assert_eq!(signer.public_key().verify(&t).unwrap(), c);
    c.provider_key = Some([0x42; 32]);
    c.successor_of = Some([3; 16]);
    c.epoch = Some(9);
    let t = signer.sign(&c).unwrap();
    assert_eq!(signer.public_key().verify(&t).unwrap(), c);
    // The holder key is signed: another one in its place breaks the signature.
    let mut bytes = t.as_bytes().to_vec();
    let at = bytes.len() - 64 - 32;
    bytes[at] ^= 1;
    assert_eq!(
        signer.public_key().verify(&LeaseToken::from_bytes(bytes)),
        Err(TokenError::BadSignature)
    );
}

#[test]
fn weak_keys_are_refused() {
    // The 32 zero bytes decode to a point of order 4; so does the identity (1, 0..).
    let zero = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
    assert!(matches!(
        PublicKey::from_text(zero),
        Err(TokenError::BadKey(_))
    ));
    let mut identity = [0u8; 32];
    identity[0] = 1;
    assert!(matches!(
        PublicKey::from_bytes(&identity),
        Err(TokenError::BadKey(_))
    ));
    let good = TokenSigner::from_seed([5; 32]).public_key();
    assert_eq!(PublicKey::from_bytes(&good.to_bytes()), Ok(good));
}

//! The key a lender must prove in every session: the lease token's, or the attach
//! request's.

use super::*;

/// The key the lender must prove: the one the lease token names, or the one the attach
/// request gives (they must agree when both are there).
pub(super) fn expected_lender_key(
    given: Option<&str>,
    token: &[u8],
) -> Result<Option<devlend_fabric::lease_token::PublicKey>, RegistryError> {
    use devlend_fabric::lease_token::{LeaseToken, PublicKey};
    let given = given
        .map(PublicKey::from_text)
        .transpose()
        .map_err(|e| RegistryError::BadRequest(format!("lender_key: {e}")))?;
    let named = if token.is_empty() {
        None
    } else {
        LeaseToken::from_bytes(token.to_vec())
            .claims_unverified()
            .ok()
            .and_then(|c| c.provider_key)
            .and_then(|k| PublicKey::from_bytes(&k).ok())
    };
    match (given, named) {
        (Some(g), Some(n)) if g != n => Err(RegistryError::BadRequest(format!(
            "lender_key {} is not the key the lease names, {}",
            g.to_text(),
            n.to_text()
        ))),
        (g, n) => Ok(n.or(g)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lender_key_comes_from_the_token_or_the_request_and_they_must_agree() {
        use devlend_fabric::lease_token::{LeaseClaims, TokenSigner};
        let pool = TokenSigner::from_seed([1; 32]);
        let lender = TokenSigner::from_seed([2; 32]).public_key();
        let other = TokenSigner::from_seed([3; 32]).public_key();
        let token = |key: Option<[u8; 32]>| {
            pool.sign(&LeaseClaims {
                lease_id: [4; 16],
                expires_at_ms: 1,
                provider: "p".into(),
                device: "d".into(),
                consumer: "c".into(),
                provider_key: key,
                qos: None,
                successor_of: None,
                epoch: None,
                holder_key: None,
            })
            .unwrap()
            .as_bytes()
            .to_vec()
        };
        let keyed = token(Some(lender.to_bytes()));
        assert_eq!(expected_lender_key(None, &[]).unwrap(), None);
        assert_eq!(expected_lender_key(None, &keyed).unwrap(), Some(lender));
        assert_eq!(expected_lender_key(None, &token(None)).unwrap(), None);
        let given = lender.to_text();
        assert_eq!(
            expected_lender_key(Some(&given), &[]).unwrap(),
            Some(lender)
        );
        assert_eq!(
            expected_lender_key(Some(&given), &keyed).unwrap(),
            Some(lender)
        );
        assert!(expected_lender_key(Some(&other.to_text()), &keyed).is_err());
        assert!(expected_lender_key(Some("nope"), &[]).is_err());
    }
}

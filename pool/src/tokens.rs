//! The pool's signing key (kept in the database) and the lease tokens it signs.
//!
//! The key is an Ed25519 key generated at the first start and stored as its seed in
//! table `signing_keys`; every pool instance on the same database signs with it. The
//! token layout is `devlend_fabric::lease_token` (see `fabric/src/lease_token.rs`).

use devlend_fabric::lease_token::{LeaseClaims, LeaseToken, PublicKey, TokenSigner};

use crate::api::Lease;
use crate::error::Result;
use crate::store::Store;

/// Loads the pool's signing key from `store`, creating and storing it when there is
/// none yet.
///
/// # Errors
/// [`crate::error::Error::Token`] when the system has no randomness;
/// [`crate::error::Error::Database`].
pub async fn load_signer(store: &Store) -> Result<TokenSigner> {
    let fresh = TokenSigner::generate()?;
    let seed = store.signing_seed(fresh.seed()).await?;
    Ok(TokenSigner::from_seed(seed))
}

/// The claims of `lease`'s token: lease id bytes, expiry, provider, device, consumer.
pub fn claims(lease: &Lease) -> LeaseClaims {
    LeaseClaims {
        lease_id: *lease.id.as_bytes(),
        expires_at_ms: lease.expires_at_ms,
        provider: lease.provider.clone(),
        device: lease.device.clone(),
        consumer: lease.consumer.clone(),
    }
}

/// Signs `lease` into a token.
///
/// # Errors
/// [`crate::error::Error::Token`] when a field is too long for the token (names are
/// validated to fit, so this does not happen for leases the pool made).
pub fn sign(signer: &TokenSigner, lease: &Lease) -> Result<LeaseToken> {
    Ok(signer.sign(&claims(lease))?)
}

/// The text form of `key` as `GET /v1/signing-key` gives it.
pub fn key_text(key: &PublicKey) -> String {
    key.to_text()
}

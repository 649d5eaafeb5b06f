//! The pool's signing key (kept in the database) and the lease tokens it signs.
//!
//! The key is an Ed25519 key generated at the first start and stored as its seed in
//! table `signing_keys`; every pool instance on the same database signs with it. The
//! token layout is `devlend_fabric::lease_token` (see `fabric/src/lease_token/claims.rs`).

use devlend_fabric::lease_token::{LeaseClaims, LeaseToken, PublicKey, TokenSigner};

use crate::api::{Lease, Role};
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

/// The claims of `lease`'s token: lease id bytes, expiry, provider, device, consumer,
/// the key enrolled for the provider (a version 2 token), if any, and the key enrolled
/// for its compute host, if any: the holder, who proves it holds that key in every
/// handshake (`devlend_fabric::holder_proof`).
pub fn claims(
    lease: &Lease,
    provider_key: Option<&PublicKey>,
    holder_key: Option<&PublicKey>,
) -> LeaseClaims {
    LeaseClaims {
        lease_id: *lease.id.as_bytes(),
        expires_at_ms: lease.expires_at_ms,
        provider: lease.provider.clone(),
        device: lease.device.clone(),
        consumer: lease.consumer.clone(),
        provider_key: provider_key.map(PublicKey::to_bytes),
        qos: lease.qos,
        successor_of: lease.successor_of.map(|u| *u.as_bytes()),
        epoch: Some(lease.epoch),
        holder_key: holder_key.map(PublicKey::to_bytes),
    }
}

/// Signs `lease` into a token, binding the provider's enrolled key when it has one (the
/// borrower then makes the lender prove that key in the handshake) and the compute
/// host's enrolled key when it has one (the lender then makes the borrower prove it: a
/// token seen on the wire opens nothing). A pool with `--insecure-open-api` and no
/// enrolled compute host issues bearer tokens, which lenders refuse unless started with
/// `--allow-bearer-tokens`.
///
/// # Errors
/// [`crate::error::Error::Token`] when a field is too long for the token (names are
/// validated to fit, so this does not happen for leases the pool made);
/// [`crate::error::Error::Database`].
pub async fn sign(signer: &TokenSigner, store: &Store, lease: &Lease) -> Result<LeaseToken> {
    let key = store
        .principal_by_name(Role::Lender, &lease.provider)
        .await?
        .and_then(|p| PublicKey::from_text(&p.public_key).ok());
    let holder = store
        .principal_by_name(Role::Compute, &lease.compute_host)
        .await?
        .and_then(|p| PublicKey::from_text(&p.public_key).ok());
    Ok(signer.sign(&claims(lease, key.as_ref(), holder.as_ref()))?)
}

/// The text form of `key` as `GET /v1/signing-key` gives it.
pub fn key_text(key: &PublicKey) -> String {
    key.to_text()
}

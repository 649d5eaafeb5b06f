//! Enrollment: pinning keys to roles and names, join tokens, revocation, the admin key
//! made at the pool's first start, and trust on first use for lenders.

use std::path::Path;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use devlend_fabric::lease_token::PublicKey;
use sha2::{Digest, Sha256};

use crate::api::{codes, EnrollRequest, Enrollment, Principal, Role};
use crate::auth::{AuthMode, Caller};
use crate::error::{Error, Result};
use crate::service::PoolService;
use crate::store::now_ms;
use crate::validate;

/// Join token lifetime when the request gives none, ms (one hour).
pub const DEFAULT_JOIN_TTL_MS: u64 = 3_600_000;
/// Shortest join token lifetime, ms.
pub const MIN_JOIN_TTL_MS: u64 = 60_000;
/// Longest join token lifetime, ms (one week).
pub const MAX_JOIN_TTL_MS: u64 = 604_800_000;
/// Prefix of every join token, so that one is recognized in a config file or a log.
pub const JOIN_TOKEN_PREFIX: &str = "dlj_";

fn token_hash(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn key_text(text: &str) -> Result<String> {
    PublicKey::from_text(text)
        .map(|k| k.to_text())
        .map_err(|e| Error::invalid(format!("public_key: {e}")))
}

impl PoolService {
    /// `POST /v1/principals` (admin): pin a key, or issue a join token.
    ///
    /// # Errors
    /// 422 for a bad name, key or ttl; [`Error::Database`].
    pub async fn enroll(&self, req: &EnrollRequest) -> Result<Enrollment> {
        validate::name("name", &req.name)?;
        if let Some(k) = &req.public_key {
            if req.ttl_ms.is_some() {
                return Err(Error::invalid(
                    "ttl_ms is for join tokens; not with public_key",
                ));
            }
            let p = self.store().pin(&key_text(k)?, req.role, &req.name).await?;
            tracing::info!(role = %p.role, name = %p.name, key = %p.public_key, "key enrolled");
            return Ok(Enrollment {
                principal: Some(p),
                join_token: None,
                expires_at_ms: None,
            });
        }
        let ttl = req.ttl_ms.unwrap_or(DEFAULT_JOIN_TTL_MS);
        if !(MIN_JOIN_TTL_MS..=MAX_JOIN_TTL_MS).contains(&ttl) {
            return Err(Error::invalid(format!(
                "ttl_ms {ttl} is outside {MIN_JOIN_TTL_MS}..={MAX_JOIN_TTL_MS}"
            )));
        }
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret)
            .map_err(|_| Error::Token(devlend_fabric::lease_token::TokenError::Random))?;
        let token = format!("{JOIN_TOKEN_PREFIX}{}", URL_SAFE_NO_PAD.encode(secret));
        let expires = now_ms().saturating_add(validate_i64(ttl));
        self.store()
            .add_join_token(&token_hash(&token), req.role, &req.name, expires)
            .await?;
        tracing::info!(role = %req.role, name = %req.name, ttl_ms = ttl, "join token issued");
        Ok(Enrollment {
            principal: None,
            join_token: Some(token),
            expires_at_ms: Some(u64::try_from(expires).unwrap_or(0)),
        })
    }

    /// `POST /v1/join`: the signer redeems a join token and is pinned to its role and
    /// name. A key already enrolled may present a used token again (an agent restarting
    /// with the token still in its configuration): it gets its principal back.
    ///
    /// # Errors
    /// 401 unsigned; 403 `bad_join_token`; [`Error::Database`].
    pub async fn join(&self, caller: &Caller, token: &str) -> Result<Principal> {
        let key = match caller {
            Caller::Principal(p) => p.public_key.clone(),
            Caller::Unenrolled { key } => key.clone(),
            Caller::Open | Caller::Anonymous => {
                return Err(Error::Rejected {
                    status: 401,
                    code: codes::UNAUTHENTICATED,
                    message: "sign the join request with the key to enroll".into(),
                })
            }
        };
        if let Caller::Principal(p) = caller {
            if let Some(grant) = self.store().peek_join_token(&token_hash(token)).await? {
                if (grant.role, grant.name.as_str()) != (p.role, p.name.as_str()) {
                    return Err(Error::conflict(
                        codes::ALREADY_ENROLLED,
                        format!(
                            "this key is enrolled as {} {:?}; a join token for {} {:?} needs a \
                             new key (or revoke this one first)",
                            p.role, p.name, grant.role, grant.name
                        ),
                    ));
                }
            }
        }
        match self.store().redeem_join_token(&token_hash(token)).await? {
            Some(grant) => {
                let p = self.store().pin(&key, grant.role, &grant.name).await?;
                tracing::info!(role = %p.role, name = %p.name, key = %p.public_key, "key enrolled by join token");
                Ok(p)
            }
            None => match caller {
                Caller::Principal(p) => Ok(p.clone()),
                _ => Err(Error::Rejected {
                    status: 403,
                    code: codes::BAD_JOIN_TOKEN,
                    message: "the join token is unknown, used or expired: ask an admin \
                              for a new one (devlend pool enroll)"
                        .into(),
                }),
            },
        }
    }

    /// The caller for a provider route: under trust on first use, an unenrolled key
    /// registering a provider name that no key holds is pinned to it now.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn trust_on_first_use(&self, caller: Caller, provider: &str) -> Result<Caller> {
        let AuthMode::Signed {
            trust_first_use: true,
        } = self.gate().mode()
        else {
            return Ok(caller);
        };
        let Caller::Unenrolled { key } = &caller else {
            return Ok(caller);
        };
        if validate::name("provider name", provider).is_err() {
            return Ok(caller);
        }
        // A provider registered before enrollment (or by an admin) is not free: only an
        // admin can give its name a key.
        if self.store().provider(provider, now_ms()).await?.is_some() {
            return Ok(caller);
        }
        match self
            .store()
            .pin_if_free(key, Role::Lender, provider)
            .await?
        {
            Some(p) => {
                tracing::info!(name = %p.name, key = %p.public_key, "lender key pinned at first registration (trust on first use)");
                Ok(Caller::Principal(p))
            }
            None => Ok(caller),
        }
    }

    /// Makes the admin key file at `path` if there is none, and enrolls its key as an
    /// admin named `admin@HOST/KEY8` (the key's first 8 characters: several pool
    /// instances on one database each keep their own admin key). Answers the key.
    ///
    /// # Errors
    /// [`Error::Identity`] for an unusable key file; [`Error::Database`].
    pub async fn bootstrap_admin(&self, path: &Path) -> Result<PublicKey> {
        let (signer, made) = devlend_fabric::identity::load_or_create(path)?;
        let key = signer.public_key();
        let text = key.to_text();
        let name = format!(
            "admin@{}/{}",
            devlend_daemon::host_name(),
            text.get(..8).unwrap_or(&text)
        );
        // Enrolled when made, and on a database without any admin (a new database for
        // an old key file). A key an admin revoked stays revoked across restarts.
        let no_admin = !self
            .store()
            .principals()
            .await?
            .iter()
            .any(|p| p.role == Role::Admin);
        if made || no_admin {
            self.store().pin(&key.to_text(), Role::Admin, &name).await?;
            tracing::info!(path = %path.display(), key = %key.to_text(), "admin key enrolled");
        } else if self.store().principal(&key.to_text()).await?.is_none() {
            tracing::warn!(path = %path.display(), key = %key.to_text(), "the admin key file holds a key that is not enrolled (revoked?): it has no rights");
        }
        Ok(key)
    }
}

fn validate_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

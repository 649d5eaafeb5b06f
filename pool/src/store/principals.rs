//! Enrolled keys (principals) and one-time join tokens.
//!
//! Pinning is one row per key and one key per (role, name): [`Store::pin`] replaces
//! whatever key that role and name had, which is also how a key is rotated. A join token
//! is stored only as its SHA-256 and is deleted by the statement that redeems it, so
//! that of two racing redeemers exactly one wins.

use sqlx::any::AnyRow;
use sqlx::Row;

use super::{get_u64, now_ms, Store};
use crate::api::{Principal, Role};
use crate::error::{Error, Result};

fn principal(row: &AnyRow) -> Result<Principal> {
    let role: String = row.try_get("role")?;
    Ok(Principal {
        public_key: row.try_get("public_key")?,
        role: Role::parse(&role)
            .ok_or_else(|| Error::Config(format!("stored principal has unknown role {role:?}")))?,
        name: row.try_get("name")?,
        created_ms: get_u64(row, "created_ms")?,
    })
}

fn grant(row: &AnyRow) -> Result<JoinGrant> {
    let role: String = row.try_get("role")?;
    Ok(JoinGrant {
        role: Role::parse(&role)
            .ok_or_else(|| Error::Config(format!("stored join token has role {role:?}")))?,
        name: row.try_get("name")?,
    })
}

/// What a redeemed join token was for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinGrant {
    /// The role it enrolls.
    pub role: Role,
    /// The name it enrolls.
    pub name: String,
}

impl Store {
    /// The principal of `public_key`, if it is enrolled.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn principal(&self, public_key: &str) -> Result<Option<Principal>> {
        let row = sqlx::query(
            "SELECT public_key, role, name, created_ms FROM principals WHERE public_key = $1",
        )
        .bind(public_key)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(principal).transpose()
    }

    /// The key pinned to `role` and `name`, if any.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn principal_by_name(&self, role: Role, name: &str) -> Result<Option<Principal>> {
        let row = sqlx::query(
            "SELECT public_key, role, name, created_ms FROM principals \
             WHERE role = $1 AND name = $2",
        )
        .bind(role.as_str())
        .bind(name)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(principal).transpose()
    }

    /// Every enrolled key, by role then name.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn principals(&self) -> Result<Vec<Principal>> {
        sqlx::query("SELECT public_key, role, name, created_ms FROM principals ORDER BY role, name")
            .fetch_all(self.pool())
            .await?
            .iter()
            .map(principal)
            .collect()
    }

    /// Pins `public_key` to `role` and `name`, replacing the key they had and any role
    /// this key had.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn pin(&self, public_key: &str, role: Role, name: &str) -> Result<Principal> {
        let now = now_ms();
        let mut tx = self.pool().begin().await?;
        sqlx::query("DELETE FROM principals WHERE (role = $1 AND name = $2) OR public_key = $3")
            .bind(role.as_str())
            .bind(name)
            .bind(public_key)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO principals (public_key, role, name, created_ms) VALUES ($1, $2, $3, $4)",
        )
        .bind(public_key)
        .bind(role.as_str())
        .bind(name)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Principal {
            public_key: public_key.to_string(),
            role,
            name: name.to_string(),
            created_ms: u64::try_from(now).unwrap_or(0),
        })
    }

    /// Pins `public_key` to `role` and `name` only if nothing is pinned to them yet
    /// (trust on first use). `Ok(None)` when another key holds them.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn pin_if_free(
        &self,
        public_key: &str,
        role: Role,
        name: &str,
    ) -> Result<Option<Principal>> {
        let now = now_ms();
        let done = sqlx::query(
            "INSERT INTO principals (public_key, role, name, created_ms) VALUES ($1, $2, $3, $4) \
             ON CONFLICT DO NOTHING",
        )
        .bind(public_key)
        .bind(role.as_str())
        .bind(name)
        .bind(now)
        .execute(self.pool())
        .await?
        .rows_affected();
        if done == 1 {
            return self.principal(public_key).await;
        }
        Ok(None)
    }

    /// Records the nonce of a signed request that changes something, until
    /// `expires_ms`; false if this key used it before (a replay, perhaps to another
    /// pool instance or before a restart). Expired nonces are dropped now and then.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn record_nonce(
        &self,
        public_key: &str,
        nonce: &[u8; 16],
        expires_ms: u64,
    ) -> Result<bool> {
        if nonce[0] == 0 {
            sqlx::query("DELETE FROM request_nonces WHERE expires_ms <= $1")
                .bind(now_ms())
                .execute(self.pool())
                .await?;
        }
        let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        Ok(sqlx::query(
            "INSERT INTO request_nonces (public_key, nonce, expires_ms) VALUES ($1, $2, $3) \
             ON CONFLICT DO NOTHING",
        )
        .bind(public_key)
        .bind(hex)
        .bind(super::db_i64(expires_ms))
        .execute(self.pool())
        .await?
        .rows_affected()
            == 1)
    }

    /// Removes the key; true if it was enrolled.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn revoke(&self, public_key: &str) -> Result<bool> {
        Ok(sqlx::query("DELETE FROM principals WHERE public_key = $1")
            .bind(public_key)
            .execute(self.pool())
            .await?
            .rows_affected()
            == 1)
    }

    /// Stores a join token's hash for `role` and `name` until `expires_ms`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn add_join_token(
        &self,
        token_hash: &str,
        role: Role,
        name: &str,
        expires_ms: i64,
    ) -> Result<()> {
        // Expired tokens go when new ones come, so the table stays as small as the
        // enrollments in progress.
        sqlx::query("DELETE FROM join_tokens WHERE expires_ms <= $1")
            .bind(now_ms())
            .execute(self.pool())
            .await?;
        sqlx::query(
            "INSERT INTO join_tokens (token_hash, role, name, expires_ms) VALUES ($1, $2, $3, $4)",
        )
        .bind(token_hash)
        .bind(role.as_str())
        .bind(name)
        .bind(expires_ms)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// What the live join token with this hash is for, without redeeming it.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn peek_join_token(&self, token_hash: &str) -> Result<Option<JoinGrant>> {
        let row = sqlx::query(
            "SELECT role, name FROM join_tokens WHERE token_hash = $1 AND expires_ms > $2",
        )
        .bind(token_hash)
        .bind(now_ms())
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(grant).transpose()
    }

    /// Redeems the join token with this hash: deletes it and answers what it was for,
    /// or `None` when it is unknown, used or expired.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn redeem_join_token(&self, token_hash: &str) -> Result<Option<JoinGrant>> {
        let row = sqlx::query(
            "DELETE FROM join_tokens WHERE token_hash = $1 AND expires_ms > $2 \
             RETURNING role, name",
        )
        .bind(token_hash)
        .bind(now_ms())
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(grant).transpose()
    }
}

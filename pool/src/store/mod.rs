//! Storage: one schema on SQLite or PostgreSQL through sqlx's `Any` driver.
//!
//! SQL here is portable: `$N` parameters (both drivers accept them), TEXT ids, BIGINT
//! times (ms since the epoch) and counters, `ON CONFLICT`, no backend-specific types.
//! Every state change is a conditional `UPDATE ... WHERE generation = $read` (or an
//! equivalent guard) inside a transaction whose first statement writes, so that SQLite
//! takes its write lock up front and PostgreSQL's row locks serialize racing writers.
//!
//! - [`providers`]: registration, heartbeats, the inventory as read;
//! - [`leases`]: claims, bind, release, renewal, lease reads;
//! - `signing_seed` (here): the pool's Ed25519 key seed, created once.

pub mod leases;
pub mod principals;
pub mod providers;

use std::borrow::Cow;
use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AnyPool, Row};
use uuid::Uuid;

use crate::error::{Error, Result};

/// The schema migrations, embedded (files under `pool/migrations/`).
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "pool", include_str!("../../migrations/0001_pool.sql")),
    (
        2,
        "principals",
        include_str!("../../migrations/0002_principals.sql"),
    ),
    (
        3,
        "lease_qos",
        include_str!("../../migrations/0003_lease_qos.sql"),
    ),
    (
        4,
        "lease_successor",
        include_str!("../../migrations/0004_lease_successor.sql"),
    ),
    (
        5,
        "lease_epochs",
        include_str!("../../migrations/0005_lease_epochs.sql"),
    ),
    (
        6,
        "fabric_paths",
        include_str!("../../migrations/0006_fabric_paths.sql"),
    ),
];

/// Which database a [`Store`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// SQLite (a file, or `sqlite::memory:`).
    Sqlite,
    /// PostgreSQL.
    Postgres,
}

/// The pool's database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

impl Store {
    /// Connects to `url` (`sqlite://PATH?mode=rwc`, `sqlite::memory:`,
    /// `postgres://USER@HOST:PORT/DB`) and applies the migrations.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown scheme; [`Error::Database`] or
    /// [`Error::Migrate`] when the database refuses.
    pub async fn open(url: &str) -> Result<Store> {
        sqlx::any::install_default_drivers();
        let (backend, memory) = if url.starts_with("sqlite:") {
            (
                Backend::Sqlite,
                url.contains(":memory:") || url.contains("mode=memory"),
            )
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            (Backend::Postgres, false)
        } else {
            return Err(Error::Config(format!(
                "database URL {url:?} is neither sqlite: nor postgres://"
            )));
        };
        let mut opts = AnyPoolOptions::new().acquire_timeout(Duration::from_secs(10));
        if memory {
            // Each SQLite connection to :memory: is its own database: keep exactly one.
            opts = opts
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None);
        } else {
            opts = opts.max_connections(8);
        }
        let pool = opts.connect(url).await?;
        if backend == Backend::Sqlite && !memory {
            // Readers do not block the writer, nor it them; persistent in the file.
            sqlx::query("PRAGMA journal_mode=WAL")
                .execute(&pool)
                .await?;
        }
        let migrator = Migrator {
            migrations: Cow::Owned(
                MIGRATIONS
                    .iter()
                    .map(|(v, d, sql)| {
                        Migration::new(
                            *v,
                            Cow::Borrowed(*d),
                            MigrationType::Simple,
                            Cow::Borrowed(*sql),
                            false,
                        )
                    })
                    .collect(),
            ),
            ..Migrator::DEFAULT
        };
        // PostgreSQL serializes concurrent migrators with an advisory lock; SQLite has
        // none, so a pool starting beside another on the same file may find the schema
        // created under it: it then runs again and sees the migration applied.
        let mut tries = 0;
        loop {
            match migrator.run(&pool).await {
                Ok(()) => break,
                Err(_) if backend == Backend::Sqlite && tries < 3 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Store { pool, backend })
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The connection pool, for the submodules.
    pub(crate) fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// The signing key's seed: the stored one, or `fresh` stored now when there is none.
    /// Several pool instances on one database all get the first one stored.
    ///
    /// # Errors
    /// [`Error::Database`]; [`Error::Config`] when the stored seed is corrupt.
    pub async fn signing_seed(&self, fresh: [u8; 32]) -> Result<[u8; 32]> {
        sqlx::query(
            "INSERT INTO signing_keys (id, seed, created_ms) VALUES ('default', $1, $2) \
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(hex(&fresh))
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        let row = sqlx::query("SELECT seed FROM signing_keys WHERE id = 'default'")
            .fetch_one(&self.pool)
            .await?;
        let seed: String = row.try_get("seed")?;
        unhex(&seed).ok_or_else(|| Error::Config("the stored signing key is corrupt".into()))
    }
}

fn hex(b: &[u8; 32]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Reads a UUID stored as TEXT.
pub(crate) fn get_uuid(row: &AnyRow, col: &str) -> Result<Uuid> {
    let s: String = row.try_get(col)?;
    Uuid::from_str(&s).map_err(|e| Error::Database(sqlx::Error::Decode(Box::new(e))))
}

/// Reads an optional UUID stored as TEXT.
pub(crate) fn get_opt_uuid(row: &AnyRow, col: &str) -> Result<Option<Uuid>> {
    let s: Option<String> = row.try_get(col)?;
    s.map(|s| Uuid::from_str(&s).map_err(|e| Error::Database(sqlx::Error::Decode(Box::new(e)))))
        .transpose()
}

/// Reads a non-negative BIGINT.
pub(crate) fn get_u64(row: &AnyRow, col: &str) -> Result<u64> {
    let v: i64 = row.try_get(col)?;
    Ok(u64::try_from(v).unwrap_or(0))
}

/// Splits a stored comma-separated list.
pub(crate) fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect()
}

/// Non-negative u64 into the database's BIGINT (values are validated below 2^63).
pub(crate) fn db_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    #[test]
    fn seed_hex_round_trips() {
        let s = [0xa5u8; 32];
        assert_eq!(super::unhex(&super::hex(&s)), Some(s));
        assert_eq!(super::unhex("zz"), None);
    }
}

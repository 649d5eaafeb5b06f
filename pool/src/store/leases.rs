//! Leases: the atomic claim of a device, bind, release, renewal, reads.
//!
//! A lease is live while its stored state is `claimed` or `bound` and `expires_at_ms`
//! is in the future; past expiry it reads `expired`, and the device it claimed is free
//! (no sweeper: every read and claim compares with the clock). A claim that takes over a
//! device from an expired lease marks that lease `expired` in the same transaction,
//! conditionally on it still being past expiry, so a renewal racing the claim either
//! lands first (and the claim moves on) or finds the lease ended.
//!
//! A lease past its expiry whose device nobody claimed since still has its stored state
//! `claimed` or `bound`: it has lapsed, not ended. Its holder's renewal, or its lender's
//! report that the holder's sessions are open ([`Store::renew_served`]), takes it back;
//! a claim of its device, its lender's next heartbeat that does not report it (whose
//! answer fences it at the lender), or a release ends it for good (stored `expired` or
//! `released`).
//!
//! Every lease takes the next number of one counter, its fencing epoch
//! ([`Store::next_epoch`]), in the transaction that creates it.

use sqlx::any::AnyRow;
use sqlx::Row;
use uuid::Uuid;

use super::providers::DeviceRow;
use super::{get_u64, get_uuid, split_list, Store};
use crate::api::{codes, Lease, LeaseFilter, LeaseState};
use crate::error::{Error, Result};

const LEASE_SELECT: &str = "SELECT id, device_id, device_name, provider_name, \
    fabric_address, fabric_paths, consumer, compute_host, state, created_ms, expires_at_ms, \
    ttl_ms, generation, qos, successor_of, epoch FROM leases";

fn lease_from_row(r: &AnyRow, now: i64) -> Result<Lease> {
    let state: String = r.try_get("state")?;
    let exp: i64 = r.try_get("expires_at_ms")?;
    let state = match state.as_str() {
        "claimed" | "bound" if exp <= now => LeaseState::Expired,
        "claimed" => LeaseState::Claimed,
        "bound" => LeaseState::Bound,
        "released" => LeaseState::Released,
        _ => LeaseState::Expired,
    };
    Ok(Lease {
        id: get_uuid(r, "id")?,
        device_id: get_uuid(r, "device_id")?,
        device: r.try_get("device_name")?,
        provider: r.try_get("provider_name")?,
        fabric_address: r.try_get("fabric_address")?,
        fabric_paths: split_list(&r.try_get::<String, _>("fabric_paths")?),
        consumer: r.try_get("consumer")?,
        compute_host: r.try_get("compute_host")?,
        state,
        created_ms: get_u64(r, "created_ms")?,
        expires_at_ms: get_u64(r, "expires_at_ms")?,
        ttl_ms: get_u64(r, "ttl_ms")?,
        generation: get_u64(r, "generation")?,
        qos: match r.try_get::<Option<String>, _>("qos")? {
            Some(text) => Some(
                serde_json::from_str(&text)
                    .map_err(|e| Error::Database(sqlx::Error::Decode(Box::new(e))))?,
            ),
            None => None,
        },
        successor_of: match r.try_get::<Option<String>, _>("successor_of")? {
            Some(text) => Some(
                Uuid::parse_str(&text)
                    .map_err(|e| Error::Database(sqlx::Error::Decode(Box::new(e))))?,
            ),
            None => None,
        },
        epoch: get_u64(r, "epoch")?,
    })
}

/// What a new lease is for.
#[derive(Debug, Clone)]
pub struct NewLease<'a> {
    /// Holder (a VM id).
    pub consumer: &'a str,
    /// Compute host of the holder.
    pub compute_host: &'a str,
    /// Time to live, ms.
    pub ttl_ms: i64,
    /// The limits granted (none: unlimited).
    pub qos: Option<devlend_fabric::qos::Qos>,
}

impl Store {
    /// Claims `dev` as read (its generation) for a new lease at `now`. `Ok(None)` when
    /// the device moved on since it was read (another claim won, or its expired lease
    /// was renewed in between): placement then tries its next candidate.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn claim(
        &self,
        dev: &DeviceRow,
        new: &NewLease<'_>,
        now: i64,
    ) -> Result<Option<Lease>> {
        let id = Uuid::new_v4();
        let mut tx = self.pool().begin().await?;
        // The conditional update is the claim: of two claimants that read the same
        // generation, exactly one updates a row. It is the transaction's first
        // statement, so SQLite takes its write lock before anything is read.
        let won = sqlx::query(
            "UPDATE devices SET lease_id = $1, generation = generation + 1 \
             WHERE id = $2 AND generation = $3 AND listed = 1",
        )
        .bind(id.to_string())
        .bind(dev.id.to_string())
        .bind(super::db_i64(dev.generation))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if won != 1 {
            tx.rollback().await?;
            return Ok(None);
        }
        if let Some(old) = dev.lease_id {
            let expired = sqlx::query(
                "UPDATE leases SET state = 'expired', generation = generation + 1 \
                 WHERE id = $1 AND state IN ('claimed', 'bound') AND expires_at_ms <= $2",
            )
            .bind(old.to_string())
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if expired == 0 {
                let still = sqlx::query(
                    "SELECT state FROM leases WHERE id = $1 AND state IN ('claimed', 'bound')",
                )
                .bind(old.to_string())
                .fetch_optional(&mut *tx)
                .await?;
                if still.is_some() {
                    // Renewed since we read it: the device is held after all.
                    tx.rollback().await?;
                    return Ok(None);
                }
            }
        }
        let epoch = Self::next_epoch(&mut tx, &dev.id).await?;
        sqlx::query(
            "INSERT INTO leases (id, device_id, device_name, provider_id, provider_name, \
             fabric_address, consumer, compute_host, state, created_ms, expires_at_ms, ttl_ms, \
             generation, qos, epoch, fabric_paths) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'claimed', $9, $10, $11, 1, $12, $13, $14)",
        )
        .bind(id.to_string())
        .bind(dev.id.to_string())
        .bind(&dev.name)
        .bind(dev.provider_id.to_string())
        .bind(&dev.provider)
        .bind(&dev.fabric_address)
        .bind(new.consumer)
        .bind(new.compute_host)
        .bind(now)
        .bind(now.saturating_add(new.ttl_ms))
        .bind(new.ttl_ms)
        .bind(new.qos.as_ref().and_then(|q| serde_json::to_string(q).ok()))
        .bind(epoch)
        .bind(dev.fabric_paths.join(","))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.lease(id, now).await.map(Some)
    }

    /// Takes the next fencing epoch for a lease of device `device` inside `tx`, and
    /// records it as the device's last. Of two transactions the second waits on the
    /// counter's row (PostgreSQL) or the database's write lock (SQLite), so epochs are
    /// unique and grow in commit order.
    async fn next_epoch(tx: &mut sqlx::Transaction<'_, sqlx::Any>, device: &Uuid) -> Result<i64> {
        sqlx::query("UPDATE lease_epochs SET last = last + 1 WHERE id = 'default'")
            .execute(&mut **tx)
            .await?;
        let epoch: i64 = sqlx::query("SELECT last FROM lease_epochs WHERE id = 'default'")
            .fetch_one(&mut **tx)
            .await?
            .try_get("last")?;
        sqlx::query("UPDATE devices SET last_epoch = $1 WHERE id = $2")
            .bind(epoch)
            .bind(device.to_string())
            .execute(&mut **tx)
            .await?;
        Ok(epoch)
    }

    /// One lease, as of `now`.
    ///
    /// # Errors
    /// 404 `unknown_lease`; [`Error::Database`].
    pub async fn lease(&self, id: Uuid, now: i64) -> Result<Lease> {
        let q = format!("{LEASE_SELECT} WHERE id = $1");
        let row = sqlx::query(&q)
            .bind(id.to_string())
            .fetch_optional(self.pool())
            .await?;
        match row {
            Some(r) => lease_from_row(&r, now),
            None => Err(Error::not_found(
                codes::UNKNOWN_LEASE,
                format!("no lease {id}"),
            )),
        }
    }

    /// Leases, oldest first: the live ones, or all.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn leases(&self, filter: LeaseFilter, now: i64) -> Result<Vec<Lease>> {
        let rows = match filter {
            LeaseFilter::Active => {
                let q = format!(
                    "{LEASE_SELECT} WHERE state IN ('claimed', 'bound') AND expires_at_ms > $1 \
                     ORDER BY created_ms, id"
                );
                sqlx::query(&q).bind(now).fetch_all(self.pool()).await?
            }
            LeaseFilter::All => {
                let q = format!("{LEASE_SELECT} ORDER BY created_ms, id");
                sqlx::query(&q).fetch_all(self.pool()).await?
            }
        };
        rows.iter().map(|r| lease_from_row(r, now)).collect()
    }

    /// Why a conditional lease update matched no row: 404, `lease_ended`,
    /// `stale_generation`, or `other` (a state the caller names).
    async fn explain(
        &self,
        id: Uuid,
        generation: Option<i64>,
        now: i64,
        other: (&'static str, &str),
    ) -> Error {
        let lease = match self.lease(id, now).await {
            Ok(l) => l,
            Err(e) => return e,
        };
        if !lease.state.is_live() {
            return Error::conflict(
                codes::LEASE_ENDED,
                format!("lease {id} has ended (state {})", lease.state.as_str()),
            );
        }
        if let Some(g) = generation {
            if super::db_i64(lease.generation) != g {
                return Error::conflict(
                    codes::STALE_GENERATION,
                    format!(
                        "lease {id} is at generation {}, the request carried {g}: read it again",
                        lease.generation
                    ),
                );
            }
        }
        Error::conflict(other.0, format!("lease {id} {}", other.1))
    }

    /// claimed -> bound, if the lease is at `generation` and live.
    ///
    /// # Errors
    /// 404 `unknown_lease`; 409 `lease_ended`, `stale_generation`,
    /// `lease_already_bound`; [`Error::Database`].
    pub async fn bind(&self, id: Uuid, generation: i64, now: i64) -> Result<Lease> {
        let n = sqlx::query(
            "UPDATE leases SET state = 'bound', generation = generation + 1 \
             WHERE id = $1 AND generation = $2 AND state = 'claimed' AND expires_at_ms > $3",
        )
        .bind(id.to_string())
        .bind(generation)
        .bind(now)
        .execute(self.pool())
        .await?
        .rows_affected();
        if n == 0 {
            return Err(self
                .explain(
                    id,
                    Some(generation),
                    now,
                    (codes::LEASE_ALREADY_BOUND, "is already bound"),
                )
                .await);
        }
        self.lease(id, now).await
    }

    /// Ends the lease and frees its device, if the lease is at `generation` and live.
    ///
    /// # Errors
    /// 404 `unknown_lease`; 409 `lease_ended`, `stale_generation`; [`Error::Database`].
    pub async fn release(&self, id: Uuid, generation: i64, now: i64) -> Result<Lease> {
        let mut tx = self.pool().begin().await?;
        let n = sqlx::query(
            "UPDATE leases SET state = 'released', generation = generation + 1 \
             WHERE id = $1 AND generation = $2 AND state IN ('claimed', 'bound')",
        )
        .bind(id.to_string())
        .bind(generation)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n == 0 {
            tx.rollback().await?;
            return Err(self
                .explain(id, Some(generation), now, (codes::LEASE_ENDED, "has ended"))
                .await);
        }
        // A handover's successor released before the switch (the migration failed):
        // the device is its live predecessor's again; otherwise it is free.
        sqlx::query(
            "UPDATE devices SET generation = generation + 1, lease_id = \
             (SELECT p.id FROM leases s JOIN leases p ON p.id = s.successor_of \
              WHERE s.id = $1 AND p.state IN ('claimed', 'bound') AND p.expires_at_ms > $2) \
             WHERE lease_id = $1",
        )
        .bind(id.to_string())
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.lease(id, now).await
    }

    /// A live migration's handover: a new lease for the device of live lease `from`,
    /// held on `compute_host`, that names `from` as its predecessor; the device is the
    /// new lease's from now on (`from` stays live until its holder releases it).
    ///
    /// # Errors
    /// 404 `unknown_lease`; 409 `lease_ended`, `handover_in_progress` (the device is
    /// already another lease's); [`Error::Database`].
    pub async fn handover(&self, from: Uuid, compute_host: &str, now: i64) -> Result<Lease> {
        let old = self.lease(from, now).await?;
        if !old.state.is_live() {
            return Err(Error::conflict(
                codes::LEASE_ENDED,
                format!("lease {from} has ended (state {})", old.state.as_str()),
            ));
        }
        let id = Uuid::new_v4();
        let mut tx = self.pool().begin().await?;
        // The device moves to the new lease only if it is `from`'s now: a second
        // handover of the same lease, or of a lease whose device moved, finds no row.
        let moved = sqlx::query(
            "UPDATE devices SET lease_id = $1, generation = generation + 1 \
             WHERE id = $2 AND lease_id = $3",
        )
        .bind(id.to_string())
        .bind(old.device_id.to_string())
        .bind(from.to_string())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved != 1 {
            tx.rollback().await?;
            return Err(Error::conflict(
                codes::HANDOVER_IN_PROGRESS,
                format!(
                    "the device of lease {from} is not that lease's any more (a handover is in progress: release its successor first)"
                ),
            ));
        }
        let epoch = Self::next_epoch(&mut tx, &old.device_id).await?;
        sqlx::query(
            "INSERT INTO leases (id, device_id, device_name, provider_id, provider_name, \
             fabric_address, consumer, compute_host, state, created_ms, expires_at_ms, ttl_ms, \
             generation, qos, successor_of, epoch, fabric_paths) SELECT $1, device_id, \
             device_name, provider_id, provider_name, fabric_address, consumer, $2, 'claimed', \
             $3, $3 + ttl_ms, ttl_ms, 1, qos, id, $5, fabric_paths FROM leases WHERE id = $4",
        )
        .bind(id.to_string())
        .bind(compute_host)
        .bind(now)
        .bind(from.to_string())
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.lease(id, now).await
    }

    /// Renews a live or lapsed lease: expiry = `now` + its ttl_ms. A lease that lapsed
    /// (past its expiry, its device not claimed since) is taken back: its holder was cut
    /// from every pool server while nobody else wanted the device. Not
    /// generation-checked: it changes only the expiry, and repeating it is harmless.
    ///
    /// # Errors
    /// 404 `unknown_lease`; 409 `lease_ended` (released, or its device leased again);
    /// [`Error::Database`].
    pub async fn renew(&self, id: Uuid, now: i64) -> Result<Lease> {
        let n = sqlx::query(
            "UPDATE leases SET expires_at_ms = $1 + ttl_ms WHERE id = $2 \
             AND state IN ('claimed', 'bound') AND expires_at_ms < $1 + ttl_ms",
        )
        .bind(now)
        .bind(id.to_string())
        .execute(self.pool())
        .await?
        .rows_affected();
        if n == 0 {
            // Already renewed to the full TTL within this millisecond, or ended.
            let lease = self.lease(id, now).await?;
            if lease.state.is_live() {
                return Ok(lease);
            }
            return Err(self
                .explain(id, None, now, (codes::LEASE_ENDED, "has ended"))
                .await);
        }
        self.lease(id, now).await
    }

    /// A lender's report that the holders of `ids` have sessions open with it: each of
    /// those leases of provider `provider_id` that is live or lapsed is renewed as
    /// [`Store::renew`] does. Ids of other providers, and ended leases, are skipped.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn renew_served(&self, provider_id: &str, ids: &[Uuid], now: i64) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool().begin().await?;
        for id in ids {
            sqlx::query(
                "UPDATE leases SET expires_at_ms = $1 + ttl_ms WHERE id = $2 \
                 AND provider_id = $3 AND state IN ('claimed', 'bound') \
                 AND expires_at_ms < $1 + ttl_ms",
            )
            .bind(now)
            .bind(id.to_string())
            .bind(provider_id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records that a pool server looks at the database at `now`. When no server did
    /// for longer than `absent_ms` (all stopped or stalled, or the database down), the
    /// leases that were live when one last looked get a full TTL from `now` before any
    /// can expire: expiry counts only time the pool was there to renew. Returns the
    /// length of the absence that was made up for, if any.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn presence(&self, now: i64, absent_ms: i64) -> Result<Option<i64>> {
        let mut tx = self.pool().begin().await?;
        // First statement writes: SQLite takes its write lock here.
        let fresh = sqlx::query(
            "UPDATE pool_presence SET seen_ms = $1 WHERE id = 'default' AND seen_ms >= $2",
        )
        .bind(now)
        .bind(now.saturating_sub(absent_ms))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if fresh == 1 {
            tx.commit().await?;
            return Ok(None);
        }
        let seen: Option<i64> =
            sqlx::query("SELECT seen_ms FROM pool_presence WHERE id = 'default'")
                .fetch_optional(&mut *tx)
                .await?
                .map(|r| r.try_get("seen_ms"))
                .transpose()?;
        // Never seen (a database from before presence was kept): nothing is known of
        // the absence, and nothing is extended.
        if let Some(since) = seen {
            sqlx::query(
                "UPDATE leases SET expires_at_ms = $1 + ttl_ms \
                 WHERE state IN ('claimed', 'bound') AND expires_at_ms > $2 \
                 AND expires_at_ms < $1 + ttl_ms",
            )
            .bind(now)
            .bind(since)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(
            "INSERT INTO pool_presence (id, seen_ms) VALUES ('default', $1) \
             ON CONFLICT (id) DO UPDATE SET seen_ms = excluded.seen_ms",
        )
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(seen.map(|since| now.saturating_sub(since)))
    }
}

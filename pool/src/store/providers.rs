//! Providers and their devices: registration, heartbeats, and the inventory as read.

use std::collections::HashMap;

use sqlx::any::AnyRow;
use sqlx::Row;
use uuid::Uuid;

use super::{db_i64, get_opt_uuid, get_u64, get_uuid, split_list, Store};
use crate::api::{
    codes, Device, DeviceFence, DeviceSpec, DeviceState, LeaseState, Provider, ProviderHeartbeat,
    ProviderLease, RegisterProvider,
};
use crate::error::{Error, Result};
use crate::placement::Candidate;

/// A device row joined with its provider and the lease that claimed it last.
#[derive(Debug, Clone)]
pub struct DeviceRow {
    /// Device id.
    pub id: Uuid,
    /// Provider id.
    pub provider_id: Uuid,
    /// Provider name.
    pub provider: String,
    /// Provider's fabric address.
    pub fabric_address: String,
    /// Provider's further fabric addresses.
    pub fabric_paths: Vec<String>,
    /// Device name.
    pub name: String,
    /// Resource class.
    pub resource_class: String,
    /// Capacity in bytes.
    pub capacity_bytes: u64,
    /// Traits, sorted.
    pub traits: Vec<String>,
    /// The provider's last registration lists it.
    pub listed: bool,
    /// The lease that claimed it last, live or not.
    pub lease_id: Option<Uuid>,
    /// That lease still holds it.
    pub lease_live: bool,
    /// The provider heartbeats within its TTL.
    pub provider_available: bool,
    /// Device generation.
    pub generation: u64,
}

impl DeviceRow {
    fn from_row(row: &AnyRow, now: i64) -> Result<Self> {
        let lease_state: Option<String> = row.try_get("lease_state")?;
        let lease_exp: Option<i64> = row.try_get("lease_expires_at_ms")?;
        let lease_live = matches!(lease_state.as_deref(), Some("claimed" | "bound"))
            && lease_exp.is_some_and(|e| e > now);
        let ttl: i64 = row.try_get("heartbeat_ttl_ms")?;
        let last: i64 = row.try_get("last_heartbeat_ms")?;
        let listed: i64 = row.try_get("listed")?;
        let traits: String = row.try_get("traits")?;
        let paths: String = row.try_get("fabric_paths")?;
        Ok(DeviceRow {
            id: get_uuid(row, "id")?,
            provider_id: get_uuid(row, "provider_id")?,
            provider: row.try_get("provider")?,
            fabric_address: row.try_get("fabric_address")?,
            fabric_paths: split_list(&paths),
            name: row.try_get("name")?,
            resource_class: row.try_get("resource_class")?,
            capacity_bytes: get_u64(row, "capacity_bytes")?,
            traits: split_list(&traits),
            listed: listed != 0,
            lease_id: get_opt_uuid(row, "lease_id")?,
            lease_live,
            provider_available: now.saturating_sub(last) <= ttl,
            generation: get_u64(row, "generation")?,
        })
    }

    /// Whether it can be leased now.
    pub fn state(&self) -> DeviceState {
        if self.lease_live {
            DeviceState::Leased
        } else if self.provider_available && self.listed {
            DeviceState::Available
        } else {
            DeviceState::Unavailable
        }
    }

    /// The API view.
    pub fn to_device(&self) -> Device {
        Device {
            id: self.id,
            provider: self.provider.clone(),
            provider_id: self.provider_id,
            fabric_address: self.fabric_address.clone(),
            fabric_paths: self.fabric_paths.clone(),
            name: self.name.clone(),
            resource_class: self.resource_class.clone(),
            capacity_bytes: self.capacity_bytes,
            traits: self.traits.clone(),
            state: self.state(),
            lease_id: if self.lease_live { self.lease_id } else { None },
            generation: self.generation,
        }
    }

    /// The placement view, with the provider's number of live leases.
    pub fn to_candidate(&self, provider_load: u64) -> Candidate {
        Candidate {
            device_id: self.id,
            generation: self.generation,
            provider: self.provider.clone(),
            name: self.name.clone(),
            resource_class: self.resource_class.clone(),
            capacity_bytes: self.capacity_bytes,
            traits: self.traits.clone(),
            reachable: self.provider_available && self.listed,
            leased: self.lease_live,
            provider_load,
        }
    }
}

const DEVICE_SELECT: &str = "SELECT d.id AS id, d.name AS name, \
    d.resource_class AS resource_class, d.capacity_bytes AS capacity_bytes, \
    d.traits AS traits, d.listed AS listed, d.lease_id AS lease_id, \
    d.generation AS generation, p.id AS provider_id, p.name AS provider, \
    p.fabric_address AS fabric_address, p.fabric_paths AS fabric_paths, \
    p.heartbeat_ttl_ms AS heartbeat_ttl_ms, \
    p.last_heartbeat_ms AS last_heartbeat_ms, l.state AS lease_state, \
    l.expires_at_ms AS lease_expires_at_ms \
    FROM devices d JOIN providers p ON p.id = d.provider_id \
    LEFT JOIN leases l ON l.id = d.lease_id";

impl Store {
    /// Every device, ordered by provider name then device name, as of `now`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn devices(&self, now: i64) -> Result<Vec<DeviceRow>> {
        let q = format!("{DEVICE_SELECT} ORDER BY p.name, d.name");
        let rows = sqlx::query(&q).fetch_all(self.pool()).await?;
        rows.iter().map(|r| DeviceRow::from_row(r, now)).collect()
    }

    /// One device by id, as of `now`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn device(&self, id: Uuid, now: i64) -> Result<Option<DeviceRow>> {
        let q = format!("{DEVICE_SELECT} WHERE d.id = $1");
        let row = sqlx::query(&q)
            .bind(id.to_string())
            .fetch_optional(self.pool())
            .await?;
        row.map(|r| DeviceRow::from_row(&r, now)).transpose()
    }

    /// Live leases per provider id, as of `now`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn provider_loads(&self, now: i64) -> Result<HashMap<Uuid, u64>> {
        let rows = sqlx::query(
            "SELECT provider_id, COUNT(*) AS n FROM leases \
             WHERE state IN ('claimed', 'bound') AND expires_at_ms > $1 GROUP BY provider_id",
        )
        .bind(now)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| Ok((get_uuid(r, "provider_id")?, get_u64(r, "n")?)))
            .collect()
    }

    /// Every provider with its devices, ordered by name, as of `now`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn providers(&self, now: i64) -> Result<Vec<Provider>> {
        let rows = sqlx::query(
            "SELECT id, name, fabric_address, fabric_paths, transports, heartbeat_ttl_ms, \
             last_heartbeat_ms, generation FROM providers ORDER BY name",
        )
        .fetch_all(self.pool())
        .await?;
        let mut devices: HashMap<Uuid, Vec<Device>> = HashMap::new();
        for d in self.devices(now).await? {
            devices
                .entry(d.provider_id)
                .or_default()
                .push(d.to_device());
        }
        rows.iter()
            .map(|r| {
                let id = get_uuid(r, "id")?;
                let ttl: i64 = r.try_get("heartbeat_ttl_ms")?;
                let last: i64 = r.try_get("last_heartbeat_ms")?;
                let transports: String = r.try_get("transports")?;
                let paths: String = r.try_get("fabric_paths")?;
                Ok(Provider {
                    id,
                    name: r.try_get("name")?,
                    fabric_address: r.try_get("fabric_address")?,
                    fabric_paths: split_list(&paths),
                    transports: split_list(&transports),
                    heartbeat_ttl_ms: get_u64(r, "heartbeat_ttl_ms")?,
                    generation: get_u64(r, "generation")?,
                    available: now.saturating_sub(last) <= ttl,
                    last_heartbeat_ms: get_u64(r, "last_heartbeat_ms")?,
                    devices: devices.remove(&id).unwrap_or_default(),
                })
            })
            .collect()
    }

    /// One provider by name, as of `now`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn provider(&self, name: &str, now: i64) -> Result<Option<Provider>> {
        // Small inventories: reading all keeps one code path for the device states.
        Ok(self
            .providers(now)
            .await?
            .into_iter()
            .find(|p| p.name == name))
    }

    /// Registers provider `name` with `devices` (validated, traits sorted) at `now`.
    /// Creates it, or updates its addresses, transports, TTL and inventory; counts as a
    /// heartbeat. The provider's generation moves when anything but the heartbeat
    /// changed; a device's when its class, capacity, traits or listing changed.
    /// Devices no longer listed are deleted, unless a live lease holds them: those stay
    /// with `listed = 0` (state `unavailable`) until a registration after the lease ended.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn register(
        &self,
        name: &str,
        req: &RegisterProvider,
        devices: &[DeviceSpec],
        now: i64,
    ) -> Result<Provider> {
        let mut transports = req.transports.clone();
        transports.sort();
        transports.dedup();
        let transports = transports.join(",");
        // Validated: no address holds a comma.
        let paths = req.fabric_paths.join(",");
        let new_id = Uuid::new_v4().to_string();
        let mut tx = self.pool().begin().await?;
        // First statement writes: SQLite takes the write lock here.
        sqlx::query(
            "INSERT INTO providers (id, name, fabric_address, transports, heartbeat_ttl_ms, \
             last_heartbeat_ms, generation, created_ms, fabric_paths) \
             VALUES ($1, $2, $3, $4, $5, $6, 1, $6, $7) \
             ON CONFLICT (name) DO UPDATE SET last_heartbeat_ms = excluded.last_heartbeat_ms",
        )
        .bind(&new_id)
        .bind(name)
        .bind(&req.fabric_address)
        .bind(&transports)
        .bind(db_i64(req.heartbeat_ttl_ms))
        .bind(now)
        .bind(&paths)
        .execute(&mut *tx)
        .await?;
        let p = sqlx::query(
            "SELECT id, fabric_address, fabric_paths, transports, heartbeat_ttl_ms \
             FROM providers WHERE name = $1",
        )
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
        let pid: String = p.try_get("id")?;
        let created = pid == new_id;
        let mut changed = false;
        let old_addr: String = p.try_get("fabric_address")?;
        let old_paths: String = p.try_get("fabric_paths")?;
        let old_tr: String = p.try_get("transports")?;
        let old_ttl: i64 = p.try_get("heartbeat_ttl_ms")?;
        if old_addr != req.fabric_address
            || old_paths != paths
            || old_tr != transports
            || old_ttl != db_i64(req.heartbeat_ttl_ms)
        {
            sqlx::query(
                "UPDATE providers SET fabric_address = $1, transports = $2, \
                 heartbeat_ttl_ms = $3, fabric_paths = $4 WHERE id = $5",
            )
            .bind(&req.fabric_address)
            .bind(&transports)
            .bind(db_i64(req.heartbeat_ttl_ms))
            .bind(&paths)
            .bind(&pid)
            .execute(&mut *tx)
            .await?;
            changed = true;
        }
        let existing = sqlx::query(
            "SELECT d.id AS id, d.name AS name, d.resource_class AS resource_class, \
             d.capacity_bytes AS capacity_bytes, d.traits AS traits, d.listed AS listed, \
             l.state AS lease_state, l.expires_at_ms AS lease_expires_at_ms \
             FROM devices d LEFT JOIN leases l ON l.id = d.lease_id WHERE d.provider_id = $1",
        )
        .bind(&pid)
        .fetch_all(&mut *tx)
        .await?;
        let mut old: HashMap<String, &AnyRow> = HashMap::new();
        for r in &existing {
            old.insert(r.try_get("name")?, r);
        }
        for d in devices {
            let traits = d.traits.join(",");
            let cap = db_i64(d.capacity_bytes);
            match old.remove(&d.name) {
                Some(r) => {
                    let same = r.try_get::<String, _>("resource_class")? == d.resource_class
                        && r.try_get::<i64, _>("capacity_bytes")? == cap
                        && r.try_get::<String, _>("traits")? == traits
                        && r.try_get::<i64, _>("listed")? == 1;
                    if !same {
                        sqlx::query(
                            "UPDATE devices SET resource_class = $1, capacity_bytes = $2, \
                             traits = $3, listed = 1, generation = generation + 1 WHERE id = $4",
                        )
                        .bind(&d.resource_class)
                        .bind(cap)
                        .bind(&traits)
                        .bind(r.try_get::<String, _>("id")?)
                        .execute(&mut *tx)
                        .await?;
                        changed = true;
                    }
                }
                None => {
                    sqlx::query(
                        "INSERT INTO devices (id, provider_id, name, resource_class, \
                         capacity_bytes, traits, listed, lease_id, generation) \
                         VALUES ($1, $2, $3, $4, $5, $6, 1, NULL, 1)",
                    )
                    .bind(Uuid::new_v4().to_string())
                    .bind(&pid)
                    .bind(&d.name)
                    .bind(&d.resource_class)
                    .bind(cap)
                    .bind(&traits)
                    .execute(&mut *tx)
                    .await?;
                    changed = true;
                }
            }
        }
        for r in old.values() {
            let state: Option<String> = r.try_get("lease_state")?;
            let exp: Option<i64> = r.try_get("lease_expires_at_ms")?;
            let live = matches!(state.as_deref(), Some("claimed" | "bound"))
                && exp.is_some_and(|e| e > now);
            let id: String = r.try_get("id")?;
            if live {
                if r.try_get::<i64, _>("listed")? == 1 {
                    sqlx::query(
                        "UPDATE devices SET listed = 0, generation = generation + 1 \
                         WHERE id = $1",
                    )
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                    changed = true;
                }
            } else {
                sqlx::query("DELETE FROM devices WHERE id = $1")
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                changed = true;
            }
        }
        if changed && !created {
            sqlx::query("UPDATE providers SET generation = generation + 1 WHERE id = $1")
                .bind(&pid)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        self.provider(name, now)
            .await?
            .ok_or_else(|| Error::not_found(codes::UNKNOWN_PROVIDER, "provider vanished"))
    }

    /// Records a heartbeat of provider `name` at `now`, renews the leases it serves
    /// ([`Store::renew_served`]), ends its lapsed leases that it does not serve (its
    /// answer fences them at the lender), and returns its live leases and each device's
    /// fence.
    ///
    /// # Errors
    /// 404 `unknown_provider` when it is not registered; [`Error::Database`].
    pub async fn provider_heartbeat(
        &self,
        name: &str,
        serving: &[Uuid],
        now: i64,
    ) -> Result<ProviderHeartbeat> {
        let n = sqlx::query("UPDATE providers SET last_heartbeat_ms = $1 WHERE name = $2")
            .bind(now)
            .bind(name)
            .execute(self.pool())
            .await?
            .rows_affected();
        if n == 0 {
            return Err(Error::not_found(
                codes::UNKNOWN_PROVIDER,
                format!("provider {name:?} is not registered; register it with PUT /v1/providers/{name}"),
            ));
        }
        let p = sqlx::query("SELECT id, generation FROM providers WHERE name = $1")
            .bind(name)
            .fetch_one(self.pool())
            .await?;
        let pid: String = p.try_get("id")?;
        self.renew_served(&pid, serving, now).await?;
        // What lapsed and is not served ends for good now: the answer fences it at the
        // lender, so a later renewal must not take it back.
        sqlx::query(
            "UPDATE leases SET state = 'expired', generation = generation + 1 \
             WHERE provider_id = $1 AND state IN ('claimed', 'bound') AND expires_at_ms <= $2",
        )
        .bind(&pid)
        .bind(now)
        .execute(self.pool())
        .await?;
        let rows = sqlx::query(
            "SELECT id, device_name, expires_at_ms, state, epoch FROM leases \
             WHERE provider_id = $1 AND state IN ('claimed', 'bound') AND expires_at_ms > $2 \
             ORDER BY created_ms, id",
        )
        .bind(&pid)
        .bind(now)
        .fetch_all(self.pool())
        .await?;
        let leases: Vec<ProviderLease> = rows
            .iter()
            .map(|r| {
                let state: String = r.try_get("state")?;
                Ok(ProviderLease {
                    id: get_uuid(r, "id")?,
                    device: r.try_get("device_name")?,
                    expires_at_ms: get_u64(r, "expires_at_ms")?,
                    state: if state == "bound" {
                        LeaseState::Bound
                    } else {
                        LeaseState::Claimed
                    },
                    epoch: get_u64(r, "epoch")?,
                })
            })
            .collect::<Result<_>>()?;
        let devices = sqlx::query("SELECT name, last_epoch FROM devices WHERE provider_id = $1")
            .bind(&pid)
            .fetch_all(self.pool())
            .await?;
        let fences = devices
            .iter()
            .map(|r| {
                let device: String = r.try_get("name")?;
                let last = get_u64(r, "last_epoch")?;
                Ok(DeviceFence {
                    fence: fence(&device, last, &leases),
                    device,
                })
            })
            .collect::<Result<_>>()?;
        Ok(ProviderHeartbeat {
            generation: get_u64(&p, "generation")?,
            leases,
            fences,
        })
    }
}

/// A device's fence: the lowest epoch of its live leases (a handover's predecessor is
/// below its successor, and both are served until the predecessor lets go), or one past
/// its last lease's epoch when none is live.
fn fence(device: &str, last_epoch: u64, live: &[ProviderLease]) -> u64 {
    live.iter()
        .filter(|l| l.device == device)
        .map(|l| l.epoch)
        .min()
        .unwrap_or(last_epoch.saturating_add(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(device: &str, epoch: u64) -> ProviderLease {
        ProviderLease {
            id: Uuid::new_v4(),
            device: device.into(),
            expires_at_ms: 1,
            state: LeaseState::Bound,
            epoch,
        }
    }

    #[test]
    fn a_fence_is_the_lowest_live_epoch_or_one_past_the_last() {
        let l = [live("a", 7), live("a", 9), live("b", 3)];
        assert_eq!(fence("a", 9, &l), 7);
        assert_eq!(fence("b", 3, &l), 3);
        // Nothing live: the last lease of the device is fenced off too.
        assert_eq!(fence("c", 4, &l), 5);
        assert_eq!(fence("d", 0, &l), 1);
    }
}

//! The pool's operations, one per endpoint: validation, placement and storage put
//! together. The HTTP layer above (module `http`) only moves JSON in and out of these;
//! nothing here knows of it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use devlend_fabric::lease_token::{PublicKey, TokenSigner};
use uuid::Uuid;

use crate::api::{
    codes, Device, DeviceQuery, HandoverRequest, Lease, LeaseFilter, LeaseGrant, LeaseRequest,
    Provider, ProviderHeartbeat, ProviderHeartbeatBody, RegisterProvider, SigningKey,
    DEFAULT_LEASE_TTL_MS, MAX_SERVING,
};
use crate::auth::{AuthMode, Gate};
use crate::error::{Error, Result};
use crate::placement::{self, Want};
use crate::store::leases::NewLease;
use crate::store::providers::DeviceRow;
use crate::store::{now_ms, Store};
use crate::{tokens, validate};

/// How many times placement re-reads the inventory after losing every claim race.
const PLACEMENT_ROUNDS: usize = 3;

/// How long no pool server may look at the database before the pool counts as absent
/// (stopped, stalled, or its database down): the leases live then get a full TTL from
/// its return ([`Store::presence`]).
pub const ABSENCE_MS: i64 = 5_000;

/// How often a pool server records that it is there ([`PoolService::look`]): by a timer,
/// and before any request that reads or changes leases once this long has passed.
pub const PRESENCE_INTERVAL: Duration = Duration::from_secs(1);

/// The pool: its store and signing key. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PoolService {
    store: Store,
    signer: Arc<TokenSigner>,
    gate: Gate,
    /// When this server last recorded its presence in the database.
    looked: Arc<Mutex<Option<Instant>>>,
}

impl PoolService {
    /// Opens the database at `url` (migrating it) and loads or creates the signing key.
    ///
    /// # Errors
    /// As [`Store::open`] and [`tokens::load_signer`].
    pub async fn open(url: &str) -> Result<Self> {
        let store = Store::open(url).await?;
        let signer = Arc::new(tokens::load_signer(&store).await?);
        let service = PoolService {
            store,
            signer,
            gate: Gate::new(AuthMode::Signed {
                trust_first_use: false,
            }),
            looked: Arc::new(Mutex::new(None)),
        };
        service.look().await?;
        Ok(service)
    }

    /// Records in the database that this pool server is there. After an absence of
    /// every server (longer than [`ABSENCE_MS`]) the leases that were live get a full
    /// TTL from now, logged; the server's timer calls it every [`PRESENCE_INTERVAL`].
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn look(&self) -> Result<()> {
        let now = now_ms();
        if let Some(gap) = self.store.presence(now, ABSENCE_MS).await? {
            tracing::warn!(
                absent_ms = gap,
                "no pool server reached the database for {} s: every lease live then gets a full TTL from now for its holder to renew",
                gap / 1000
            );
        }
        *self.looked.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        Ok(())
    }

    /// The pool's clock for a request that reads or changes leases, after recording
    /// this server's presence when it is due (so that a server resumed from a stall
    /// makes up for its absence before it judges any expiry).
    async fn now(&self) -> Result<i64> {
        let due = self
            .looked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none_or(|t| t.elapsed() >= PRESENCE_INTERVAL);
        if due {
            self.look().await?;
        }
        Ok(now_ms())
    }

    /// The same service with requests authenticated as `mode` says.
    pub fn with_auth(mut self, mode: AuthMode) -> Self {
        self.gate = Gate::new(mode);
        self
    }

    /// The authentication gate.
    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The key tokens are signed with.
    pub fn public_key(&self) -> PublicKey {
        self.signer.public_key()
    }

    /// `GET /v1/signing-key`.
    pub fn signing_key(&self) -> SigningKey {
        SigningKey {
            algorithm: "ed25519".to_string(),
            public_key: tokens::key_text(&self.public_key()),
        }
    }

    /// `PUT /v1/providers/{name}`.
    ///
    /// # Errors
    /// 422 `invalid_value` for a bad name, address, class, trait or size.
    pub async fn register(&self, name: &str, req: &RegisterProvider) -> Result<Provider> {
        let devices = validate::registration(name, req)?;
        let now = self.now().await?;
        self.store.register(name, req, &devices, now).await
    }

    /// `POST /v1/providers/{name}/heartbeat`.
    ///
    /// # Errors
    /// 404 `unknown_provider`.
    /// The leases of `body.serving` are renewed first (their holders have sessions
    /// open with the lender), so the answer lists them live.
    ///
    /// # Errors
    /// 404 `unknown_provider`; 422 `invalid_value` for more than [`MAX_SERVING`] ids.
    pub async fn provider_heartbeat(
        &self,
        name: &str,
        body: &ProviderHeartbeatBody,
    ) -> Result<ProviderHeartbeat> {
        validate::name("provider name", name).map_err(|_| {
            Error::not_found(codes::UNKNOWN_PROVIDER, format!("no provider {name:?}"))
        })?;
        if body.serving.len() > MAX_SERVING {
            return Err(Error::invalid(format!(
                "serving lists {} leases, at most {MAX_SERVING}",
                body.serving.len()
            )));
        }
        let now = self.now().await?;
        self.store
            .provider_heartbeat(name, &body.serving, now)
            .await
    }

    /// `GET /v1/providers`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn providers(&self) -> Result<Vec<Provider>> {
        self.store.providers(self.now().await?).await
    }

    /// `GET /v1/devices`: devices of `q.class` with every trait of `q.traits` and at
    /// least `q.min_capacity` bytes, in every state.
    ///
    /// # Errors
    /// 422 `invalid_value` for a bad class or trait.
    pub async fn devices(&self, q: &DeviceQuery) -> Result<Vec<Device>> {
        if let Some(c) = &q.class {
            validate::class(c)?;
        }
        let traits = validate::traits(&q.traits)?;
        let min = q.min_capacity.unwrap_or(0);
        Ok(self
            .store
            .devices(self.now().await?)
            .await?
            .into_iter()
            .filter(|d| q.class.as_ref().is_none_or(|c| *c == d.resource_class))
            .filter(|d| d.capacity_bytes >= min)
            .filter(|d| traits.iter().all(|t| d.traits.contains(t)))
            .map(|d| d.to_device())
            .collect())
    }

    /// `POST /v1/leases`: by id (`device_id` + `generation`) or by placement.
    ///
    /// # Errors
    /// 422 for bad fields; 404 `unknown_device`; 409 `stale_generation`,
    /// `device_leased`, or a placement code.
    pub async fn create_lease(&self, req: &LeaseRequest) -> Result<LeaseGrant> {
        validate::text("consumer", &req.consumer)?;
        validate::text("compute_host", &req.compute_host)?;
        let ttl = req.ttl_ms.unwrap_or(DEFAULT_LEASE_TTL_MS);
        validate::lease_ttl(ttl)?;
        let new = NewLease {
            consumer: &req.consumer,
            compute_host: &req.compute_host,
            ttl_ms: i64::try_from(ttl).unwrap_or(i64::MAX),
            // Checked when the body was read (`Qos`'s own deserializer); no limit at all
            // is no QoS.
            qos: req.qos.filter(|q| !q.is_empty()),
        };
        let lease = match req.device_id {
            Some(id) => self.lease_by_id(req, id, &new).await?,
            None => self.lease_by_placement(req, &new).await?,
        };
        let token = tokens::sign(&self.signer, &self.store, &lease).await?;
        Ok(LeaseGrant {
            lease,
            token: token.to_text(),
        })
    }

    async fn lease_by_id(&self, req: &LeaseRequest, id: Uuid, new: &NewLease<'_>) -> Result<Lease> {
        if req.class.is_some()
            || req.min_capacity_bytes.is_some()
            || !req.traits.is_empty()
            || req.numa_node.is_some()
        {
            return Err(Error::invalid(
                "give either device_id with generation, or the placement fields \
                 (class, min_capacity_bytes, traits, numa_node), not both",
            ));
        }
        let generation = req
            .generation
            .ok_or_else(|| Error::invalid("generation is required with device_id"))?;
        validate::generation(generation)?;
        let now = self.now().await?;
        let dev = self.device_row(id, now).await?;
        let check = |dev: &DeviceRow| -> Result<()> {
            if dev.generation != generation {
                return Err(Error::conflict(
                    codes::STALE_GENERATION,
                    format!(
                        "device {id} is at generation {}, the request carried {generation}: \
                         read it again",
                        dev.generation
                    ),
                ));
            }
            if dev.lease_live {
                return Err(Error::conflict(
                    codes::DEVICE_LEASED,
                    format!(
                        "device {id} ({} on {}) is leased (lease {})",
                        dev.name,
                        dev.provider,
                        dev.lease_id.map(|l| l.to_string()).unwrap_or_default()
                    ),
                ));
            }
            if !(dev.provider_available && dev.listed) {
                return Err(Error::conflict(
                    codes::PROVIDERS_UNAVAILABLE,
                    format!(
                        "device {id} ({} on {}) is unavailable: its provider stopped \
                         heartbeating or no longer lists it",
                        dev.name, dev.provider
                    ),
                ));
            }
            Ok(())
        };
        check(&dev)?;
        match self.store.claim(&dev, new, now).await? {
            Some(l) => Ok(l),
            None => {
                // Lost a race: say why as of now.
                let dev = self.device_row(id, self.now().await?).await?;
                check(&dev)?;
                Err(Error::conflict(
                    codes::STALE_GENERATION,
                    format!("device {id} changed while it was being claimed: read it again"),
                ))
            }
        }
    }

    async fn device_row(&self, id: Uuid, now: i64) -> Result<DeviceRow> {
        self.store
            .device(id, now)
            .await?
            .ok_or_else(|| Error::not_found(codes::UNKNOWN_DEVICE, format!("no device {id}")))
    }

    async fn lease_by_placement(&self, req: &LeaseRequest, new: &NewLease<'_>) -> Result<Lease> {
        if req.generation.is_some() {
            return Err(Error::invalid("generation goes with device_id"));
        }
        let class = req.class.clone().ok_or_else(|| {
            Error::invalid("give class (and optionally min_capacity_bytes, traits), or device_id")
        })?;
        validate::class(&class)?;
        let min = req.min_capacity_bytes.unwrap_or(0);
        validate::capacity("min_capacity_bytes", min)?;
        let want = Want {
            class,
            min_capacity_bytes: min,
            traits: validate::traits(&req.traits)?,
            numa_node: req.numa_node,
        };
        for _ in 0..PLACEMENT_ROUNDS {
            let now = self.now().await?;
            let rows = self.store.devices(now).await?;
            let loads = self.store.provider_loads(now).await?;
            let cands: Vec<placement::Candidate> = rows
                .iter()
                .map(|r| r.to_candidate(loads.get(&r.provider_id).copied().unwrap_or(0)))
                .collect();
            let order = placement::place(&want, &cands)
                .map_err(|e| Error::conflict(e.code(), e.to_string()))?;
            for c in order {
                let Some(row) = rows.iter().find(|r| r.id == c.device_id) else {
                    continue;
                };
                if let Some(lease) = self.store.claim(row, new, now).await? {
                    return Ok(lease);
                }
            }
        }
        Err(Error::conflict(
            codes::ALL_LEASED,
            format!(
                "every matching device was claimed by someone else during {PLACEMENT_ROUNDS} \
                 placement rounds"
            ),
        ))
    }

    /// `GET /v1/leases/{id}`.
    ///
    /// # Errors
    /// 404 `unknown_lease`.
    pub async fn lease(&self, id: Uuid) -> Result<Lease> {
        self.store.lease(id, self.now().await?).await
    }

    /// `GET /v1/leases`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn leases(&self, filter: LeaseFilter) -> Result<Vec<Lease>> {
        self.store.leases(filter, self.now().await?).await
    }

    /// `POST /v1/leases/{id}/bind`.
    ///
    /// # Errors
    /// 404 `unknown_lease`; 409 `stale_generation`, `lease_ended`, `lease_already_bound`.
    pub async fn bind(&self, id: Uuid, generation: u64) -> Result<Lease> {
        let g = validate::generation(generation)?;
        self.store.bind(id, g, self.now().await?).await
    }

    /// `POST /v1/leases/{id}/release`.
    ///
    /// # Errors
    /// 404 `unknown_lease`; 409 `stale_generation`, `lease_ended`.
    pub async fn release(&self, id: Uuid, generation: u64) -> Result<Lease> {
        let g = validate::generation(generation)?;
        self.store.release(id, g, self.now().await?).await
    }

    /// `POST /v1/leases/{id}/heartbeat`: renews (not generation-checked).
    ///
    /// # Errors
    /// 404 `unknown_lease`; 409 `lease_ended`.
    pub async fn renew(&self, id: Uuid) -> Result<Lease> {
        self.store.renew(id, self.now().await?).await
    }

    /// `POST /v1/leases/{id}/handover`: a new lease on `req.compute_host` that takes the
    /// device of lease `id` over (a live migration), with its signed token.
    ///
    /// # Errors
    /// 422 for a bad compute host; 404 `unknown_lease`; 409 `lease_ended`,
    /// `handover_in_progress`.
    pub async fn handover(&self, id: Uuid, req: &HandoverRequest) -> Result<LeaseGrant> {
        validate::text("compute_host", &req.compute_host)?;
        // A destination that cannot bind or renew the new lease (a typo) would leave the
        // device stuck on it: it must be an enrolled compute host.
        if self.gate.mode() != AuthMode::Open
            && self
                .store
                .principal_by_name(crate::api::Role::Compute, &req.compute_host)
                .await?
                .is_none()
        {
            return Err(Error::invalid(format!(
                "compute_host {:?} is not an enrolled compute host",
                req.compute_host
            )));
        }
        let lease = self
            .store
            .handover(id, &req.compute_host, self.now().await?)
            .await?;
        let token = tokens::sign(&self.signer, &self.store, &lease).await?;
        Ok(LeaseGrant {
            lease,
            token: token.to_text(),
        })
    }
}

//! One method of [`PoolClient`] per endpoint of the pool's API.

use reqwest::Method;
use uuid::Uuid;

use crate::api::{
    Device, DeviceQuery, EmptyBody, EnrollRequest, Enrollment, GenerationBody, HandoverRequest,
    JoinRequest, Lease, LeaseFilter, LeaseGrant, LeaseRequest, Principal, Provider,
    ProviderHeartbeat, ProviderHeartbeatBody, RegisterProvider, SigningKey,
};

use super::{ClientError, PoolClient};

impl PoolClient {
    /// `GET /openapi.json`: the OpenAPI 3 document.
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn openapi(&self) -> Result<serde_json::Value, ClientError> {
        self.call(Method::GET, &["openapi.json"], &[], None::<&EmptyBody>)
    }

    /// `GET /v1/signing-key`: the key lease tokens are signed with.
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn signing_key(&self) -> Result<SigningKey, ClientError> {
        self.call(Method::GET, &["v1", "signing-key"], &[], None::<&EmptyBody>)
    }

    /// `PUT /v1/providers/{name}`: registers a lender and its devices (idempotent).
    ///
    /// # Errors
    /// [`ClientError::Api`] with 422 `invalid_value` for a bad name, class or trait.
    pub fn register_provider(
        &self,
        name: &str,
        body: &RegisterProvider,
    ) -> Result<Provider, ClientError> {
        self.call(Method::PUT, &["v1", "providers", name], &[], Some(body))
    }

    /// `POST /v1/providers/{name}/heartbeat`: keeps the provider available and returns
    /// its live leases.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 404 `unknown_provider` when it is not registered.
    pub fn provider_heartbeat(
        &self,
        name: &str,
        body: &ProviderHeartbeatBody,
    ) -> Result<ProviderHeartbeat, ClientError> {
        self.call(
            Method::POST,
            &["v1", "providers", name, "heartbeat"],
            &[],
            Some(body),
        )
    }

    /// `GET /v1/providers`: every provider with its devices.
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn providers(&self) -> Result<Vec<Provider>, ClientError> {
        self.call(Method::GET, &["v1", "providers"], &[], None::<&EmptyBody>)
    }

    /// `GET /v1/devices`: devices matching `query`.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 400 `bad_query` for a malformed filter.
    pub fn devices(&self, query: &DeviceQuery) -> Result<Vec<Device>, ClientError> {
        let mut q: Vec<(&str, String)> = Vec::new();
        if let Some(c) = &query.class {
            q.push(("class", c.clone()));
        }
        for t in &query.traits {
            q.push(("trait", t.clone()));
        }
        if let Some(m) = query.min_capacity {
            q.push(("min_capacity", m.to_string()));
        }
        self.call(Method::GET, &["v1", "devices"], &q, None::<&EmptyBody>)
    }

    /// `POST /v1/leases`: leases a device by placement or by id, and returns the lease
    /// with its token.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 and a placement code (`all_leased`, ...) when
    /// nothing can be placed, `stale_generation` / `device_leased` by id.
    pub fn create_lease(&self, body: &LeaseRequest) -> Result<LeaseGrant, ClientError> {
        self.call(Method::POST, &["v1", "leases"], &[], Some(body))
    }

    /// `GET /v1/leases`: live leases, or every lease with [`LeaseFilter::All`].
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn leases(&self, filter: LeaseFilter) -> Result<Vec<Lease>, ClientError> {
        let q = [("state", filter.as_str().to_string())];
        self.call(Method::GET, &["v1", "leases"], &q, None::<&EmptyBody>)
    }

    /// `GET /v1/leases/{id}`.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 404 `unknown_lease`.
    pub fn lease(&self, id: Uuid) -> Result<Lease, ClientError> {
        let id = id.to_string();
        self.call(Method::GET, &["v1", "leases", &id], &[], None::<&EmptyBody>)
    }

    /// `POST /v1/leases/{id}/bind`: claimed -> bound.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 `stale_generation`, `lease_ended` or
    /// `lease_already_bound`.
    pub fn bind_lease(&self, id: Uuid, generation: u64) -> Result<Lease, ClientError> {
        let id = id.to_string();
        self.call(
            Method::POST,
            &["v1", "leases", &id, "bind"],
            &[],
            Some(&GenerationBody { generation }),
        )
    }

    /// `POST /v1/leases/{id}/release`: ends the lease and frees its device.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 `stale_generation` or `lease_ended`.
    pub fn release_lease(&self, id: Uuid, generation: u64) -> Result<Lease, ClientError> {
        let id = id.to_string();
        self.call(
            Method::POST,
            &["v1", "leases", &id, "release"],
            &[],
            Some(&GenerationBody { generation }),
        )
    }

    /// Releases the lease at the generation it has now (read first): what a holder
    /// that gives its lease back means. A lease that has already ended is left as is.
    /// Returns the lease as it ends up.
    ///
    /// # Errors
    /// As [`PoolClient::lease`] and [`PoolClient::release_lease`] (a 409
    /// `stale_generation` when someone changed the lease in between).
    pub fn release_current(&self, id: Uuid) -> Result<Lease, ClientError> {
        let lease = self.lease(id)?;
        if !lease.state.is_live() {
            return Ok(lease);
        }
        self.release_lease(id, lease.generation)
    }

    /// `POST /v1/leases/{id}/handover`: a new lease on `compute_host` that takes the
    /// device of lease `id` over (a live migration), and its token.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 `lease_ended` or `handover_in_progress`.
    pub fn handover_lease(&self, id: Uuid, compute_host: &str) -> Result<LeaseGrant, ClientError> {
        let id = id.to_string();
        self.call(
            Method::POST,
            &["v1", "leases", &id, "handover"],
            &[],
            Some(&HandoverRequest {
                compute_host: compute_host.to_owned(),
            }),
        )
    }

    /// `POST /v1/leases/{id}/heartbeat`: renews the lease (expiry = now + ttl_ms).
    ///
    /// # Errors
    /// [`ClientError::Api`] with 409 `lease_ended` once released or expired: the
    /// borrower must stop using the device.
    pub fn lease_heartbeat(&self, id: Uuid) -> Result<Lease, ClientError> {
        let id = id.to_string();
        self.call(
            Method::POST,
            &["v1", "leases", &id, "heartbeat"],
            &[],
            Some(&EmptyBody {}),
        )
    }

    /// `POST /v1/join`: enrolls this client's key with a join token.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 403 `bad_join_token`, 401 without an identity.
    pub fn join(&self, token: &str) -> Result<Principal, ClientError> {
        self.call(
            Method::POST,
            &["v1", "join"],
            &[],
            Some(&JoinRequest {
                token: token.to_string(),
            }),
        )
    }

    /// `POST /v1/principals` (admin): pins a key, or issues a join token.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 403 for a caller that is not an admin.
    pub fn enroll(&self, body: &EnrollRequest) -> Result<Enrollment, ClientError> {
        self.call(Method::POST, &["v1", "principals"], &[], Some(body))
    }

    /// `GET /v1/principals` (admin): every enrolled key.
    ///
    /// # Errors
    /// [`ClientError`] as for every call.
    pub fn principals(&self) -> Result<Vec<Principal>, ClientError> {
        self.call(Method::GET, &["v1", "principals"], &[], None::<&EmptyBody>)
    }

    /// `DELETE /v1/principals/{key}` (admin): revokes a key.
    ///
    /// # Errors
    /// [`ClientError::Api`] with 404 `unknown_key`.
    pub fn revoke(&self, public_key: &str) -> Result<Principal, ClientError> {
        self.call(
            Method::DELETE,
            &["v1", "principals", public_key],
            &[],
            None::<&EmptyBody>,
        )
    }
}

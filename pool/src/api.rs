//! The pool's HTTP API types: request bodies, answers, and the error shape.
//!
//! Every request body refuses unknown fields. Times are milliseconds since the Unix
//! epoch (`*_ms`), durations are milliseconds (`ttl_ms`), sizes are bytes. Generations
//! are counters that every state change of a record increments; a write carries the
//! generation it read and gets 409 `stale_generation` when the record moved on.
//! The routes and their examples are in `docs/pool.md`.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[cfg(feature = "server")]
use utoipa::ToSchema;

/// Lease time to live when a request does not give one, in ms.
pub const DEFAULT_LEASE_TTL_MS: u64 = 30_000;
/// Shortest lease time to live accepted, in ms.
pub const MIN_LEASE_TTL_MS: u64 = 1_000;
/// Longest lease time to live accepted (one day), in ms.
pub const MAX_LEASE_TTL_MS: u64 = 86_400_000;
/// Provider heartbeat time to live when a registration does not give one, in ms.
pub const DEFAULT_HEARTBEAT_TTL_MS: u64 = 6_000;
/// Shortest provider heartbeat time to live accepted, in ms.
pub const MIN_HEARTBEAT_TTL_MS: u64 = 1_000;
/// Longest provider heartbeat time to live accepted (one hour), in ms.
pub const MAX_HEARTBEAT_TTL_MS: u64 = 3_600_000;
/// Largest device capacity accepted (1 EiB), in bytes.
pub const MAX_CAPACITY_BYTES: u64 = 1 << 60;
/// Most devices one provider may register.
pub const MAX_DEVICES_PER_PROVIDER: usize = 4096;
/// Most further fabric addresses (`fabric_paths`) one provider may register.
pub const MAX_FABRIC_PATHS: usize = 7;
/// Most traits one device (or one request) may carry.
pub const MAX_TRAITS: usize = 64;
/// Longest name, consumer, compute host, address, trait or class, in bytes (the lease
/// token's field limit).
pub const MAX_NAME_LEN: usize = 255;

/// The error body of every 4xx and 5xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ErrorBody {
    /// A stable snake_case code for programs (see [`codes`]).
    pub code: String,
    /// A sentence for people.
    pub message: String,
}

/// The `code`s the pool answers with.
pub mod codes {
    /// The body is not JSON.
    pub const BAD_JSON: &str = "bad_json";
    /// The body is JSON of the wrong shape (unknown field, wrong type, negative number).
    pub const INVALID_REQUEST: &str = "invalid_request";
    /// A field's value is out of bounds or of the wrong syntax.
    pub const INVALID_VALUE: &str = "invalid_value";
    /// A query string parameter is unknown or malformed.
    pub const BAD_QUERY: &str = "bad_query";
    /// A path segment is malformed (for example not a UUID).
    pub const BAD_PATH: &str = "bad_path";
    /// No such route.
    pub const NOT_FOUND: &str = "not_found";
    /// The route exists but not with this method.
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    /// The body is larger than the pool accepts.
    pub const TOO_LARGE: &str = "payload_too_large";
    /// The request's body and handling took longer than the pool allows (408; the
    /// connection is closed).
    pub const REQUEST_TIMEOUT: &str = "request_timeout";
    /// The provider is not registered (a lender then registers again).
    pub const UNKNOWN_PROVIDER: &str = "unknown_provider";
    /// No lease with that id.
    pub const UNKNOWN_LEASE: &str = "unknown_lease";
    /// No device with that id.
    pub const UNKNOWN_DEVICE: &str = "unknown_device";
    /// The write carried a generation older than the record's.
    pub const STALE_GENERATION: &str = "stale_generation";
    /// The device asked for by id is leased.
    pub const DEVICE_LEASED: &str = "device_leased";
    /// The lease was released or has expired.
    pub const LEASE_ENDED: &str = "lease_ended";
    /// The lease is already bound.
    pub const LEASE_ALREADY_BOUND: &str = "lease_already_bound";
    /// A handover of a lease whose device is already another lease's (409).
    pub const HANDOVER_IN_PROGRESS: &str = "handover_in_progress";
    /// Placement: no device of that resource class at all.
    pub const NO_DEVICE_OF_CLASS: &str = "no_device_of_class";
    /// Placement: devices of that class exist, none large enough.
    pub const TOO_SMALL: &str = "too_small";
    /// Placement: devices of that class and size exist, none with every wanted trait.
    pub const NO_DEVICE_WITH_TRAITS: &str = "no_device_with_traits";
    /// Placement: every matching device on a live provider is leased.
    pub const ALL_LEASED: &str = "all_leased";
    /// Placement: the matching devices are all on providers that stopped heartbeating.
    pub const PROVIDERS_UNAVAILABLE: &str = "providers_unavailable";
    /// The storage failed (not the client's fault).
    pub const INTERNAL: &str = "internal";
    /// 401: the request is not signed, or its signature, time or nonce does not hold.
    pub const UNAUTHENTICATED: &str = "unauthenticated";
    /// 403: the signing key is not enrolled with the pool.
    pub const UNKNOWN_KEY: &str = "unknown_key";
    /// 403: the key is enrolled, but its role or name does not allow this request.
    pub const FORBIDDEN: &str = "forbidden";
    /// 403: the join token is unknown, used or expired.
    pub const BAD_JOIN_TOKEN: &str = "bad_join_token";
    /// 429: this key sent too many requests within the signature window.
    pub const TOO_MANY_REQUESTS: &str = "too_many_requests";
    /// 409: the key is already enrolled with another role or name.
    pub const ALREADY_ENROLLED: &str = "already_enrolled";
}

/// `GET /v1/signing-key`: the key lenders verify lease tokens with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct SigningKey {
    /// Always `ed25519`.
    pub algorithm: String,
    /// Unpadded base64url of the 32 key bytes (`devlend_fabric::lease_token::PublicKey`).
    pub public_key: String,
}

/// `PUT /v1/providers/{name}`: a lender registers itself and its devices. Idempotent;
/// it counts as a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct RegisterProvider {
    /// Where borrowers reach the lender's fabric server, `HOST:PORT`.
    pub fabric_address: String,
    /// Further addresses of the same fabric server (another network or NIC), `HOST:PORT`
    /// each, no wildcard, distinct, at most 7: a leased block device or NIC is attached
    /// over all of them (docs/faults.md, "Paths").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fabric_paths: Vec<String>,
    /// Fabric transports the lender serves (`tcp`, `rdma`), lower case.
    #[serde(default)]
    pub transports: Vec<String>,
    /// The provider is unavailable when its last heartbeat is older than this, in ms
    /// (1000..=3600000, default 6000).
    #[serde(default = "default_heartbeat_ttl")]
    pub heartbeat_ttl_ms: u64,
    /// The lendable devices. A device no longer listed is removed, unless it is leased:
    /// then it stays, `unavailable`, until its lease ends and the next registration.
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
}

fn default_heartbeat_ttl() -> u64 {
    DEFAULT_HEARTBEAT_TTL_MS
}

/// One device in a registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct DeviceSpec {
    /// Device name on the lender (`[A-Za-z0-9._:-]`, 1..=255 bytes).
    pub name: String,
    /// `BLOCK`, `NIC` or `PCI_<vendor>_<device>` (four upper-case hex digits each).
    pub resource_class: String,
    /// Capacity in bytes (at most 2^60).
    pub capacity_bytes: u64,
    /// Upper-case `[A-Z0-9_]+` traits: `FABRIC_TCP`, `FABRIC_RDMA`, `DISCARD`,
    /// `READ_ONLY`, `NUMA_0`, ...
    #[serde(default)]
    pub traits: Vec<String>,
}

/// A resource provider: one lender (device server).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Provider {
    /// Stable id, given at first registration.
    pub id: Uuid,
    /// The lender's name (the provider in lease tokens).
    pub name: String,
    /// `HOST:PORT` of its fabric server.
    pub fabric_address: String,
    /// Its further fabric addresses, as registered.
    #[serde(default)]
    pub fabric_paths: Vec<String>,
    /// Transports it serves.
    pub transports: Vec<String>,
    /// Heartbeat time to live, in ms.
    pub heartbeat_ttl_ms: u64,
    /// Incremented by every registration that changes the provider or its devices.
    pub generation: u64,
    /// Whether its last heartbeat is younger than `heartbeat_ttl_ms`.
    pub available: bool,
    /// Its last heartbeat (or registration), ms since the epoch.
    pub last_heartbeat_ms: u64,
    /// Its devices.
    pub devices: Vec<Device>,
}

/// Whether a device can be leased now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub enum DeviceState {
    /// Free, on a live provider.
    Available,
    /// Held by a live lease (`lease_id`).
    Leased,
    /// Its provider stopped heartbeating, or no longer lists it.
    Unavailable,
}

/// A lendable device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Device {
    /// Stable id, given at its first registration.
    pub id: Uuid,
    /// Provider name.
    pub provider: String,
    /// Provider id.
    pub provider_id: Uuid,
    /// `HOST:PORT` of the provider's fabric server.
    pub fabric_address: String,
    /// The provider's further fabric addresses.
    #[serde(default)]
    pub fabric_paths: Vec<String>,
    /// Device name on the lender.
    pub name: String,
    /// `BLOCK`, `NIC` or `PCI_<vendor>_<device>`.
    pub resource_class: String,
    /// Capacity in bytes.
    pub capacity_bytes: u64,
    /// Traits, sorted.
    pub traits: Vec<String>,
    /// Whether it can be leased now.
    pub state: DeviceState,
    /// The live lease holding it, if any.
    pub lease_id: Option<Uuid>,
    /// Incremented by every claim, release and change of its registration.
    pub generation: u64,
}

/// `POST /v1/providers/{name}/heartbeat`: the provider's live leases.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ProviderHeartbeat {
    /// The provider's generation.
    pub generation: u64,
    /// Its leases in state claimed or bound that have not expired. A lease the lender
    /// serves that is missing here has ended.
    pub leases: Vec<ProviderLease>,
    /// Per device, the lowest lease epoch the lender may still serve: the lowest epoch
    /// of the device's live leases, or one past the last lease's epoch when none is
    /// live. A lender never serves a lease below its device's fence (docs/pool.md,
    /// "When a lease ends").
    #[serde(default)]
    pub fences: Vec<DeviceFence>,
}

/// One device's fence in a heartbeat answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct DeviceFence {
    /// Device name on the lender.
    pub device: String,
    /// The lowest lease epoch the lender may serve the device to.
    pub fence: u64,
}

/// Most lease ids a provider heartbeat may report as served.
pub const MAX_SERVING: usize = 4096;

/// Body of a provider heartbeat: the leases whose holders have a session open at the
/// lender right now. The pool renews each of them as if its holder had (a holder cut
/// from the pool, but not from its lender, keeps its device), and takes back one that
/// lapsed while nobody reached the pool, unless its device was leased again since.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ProviderHeartbeatBody {
    /// Ids of the leases served now (at most [`MAX_SERVING`]).
    #[serde(default)]
    pub serving: Vec<Uuid>,
}

/// A live lease as its provider sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ProviderLease {
    /// Lease id (the `lease_id` of its token).
    pub id: Uuid,
    /// Device name on the lender.
    pub device: String,
    /// Current expiry (renewals move it), ms since the epoch.
    pub expires_at_ms: u64,
    /// `claimed` or `bound`.
    pub state: LeaseState,
    /// The lease's fencing epoch (as in its token).
    #[serde(default)]
    pub epoch: u64,
}

/// A lease's state: claimed -> bound -> released; `expired` once past its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub enum LeaseState {
    /// Granted; the borrower has not bound it yet.
    Claimed,
    /// The borrower attached the device.
    Bound,
    /// Released; the device is free.
    Released,
    /// Not renewed in time; the device is free.
    Expired,
}

impl LeaseState {
    /// Whether the lease still holds its device (claimed or bound, and not expired).
    pub fn is_live(self) -> bool {
        matches!(self, LeaseState::Claimed | LeaseState::Bound)
    }

    /// The lower-case name, as in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Claimed => "claimed",
            LeaseState::Bound => "bound",
            LeaseState::Released => "released",
            LeaseState::Expired => "expired",
        }
    }
}

/// `POST /v1/leases`: lease a device, either by placement (`class`,
/// `min_capacity_bytes`, `traits`, `numa_node`) or by id (`device_id` + `generation`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct LeaseRequest {
    /// Who holds the lease (a VM's id), 1..=255 bytes without control characters.
    pub consumer: String,
    /// The compute host the consumer runs on.
    pub compute_host: String,
    /// Time to live, in ms (1000..=86400000, default 30000). Each lease heartbeat moves
    /// the expiry to now + ttl_ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Placement: the resource class wanted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// Placement: the smallest capacity accepted, in bytes (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_capacity_bytes: Option<u64>,
    /// Placement: traits the device must all have.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub traits: Vec<String>,
    /// Placement: prefer devices with trait `NUMA_<n>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// By id: the device to lease (then no placement fields).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<Uuid>,
    /// By id: the device generation read (required with `device_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Limits the lender enforces on the lease's sessions, signed into its token
    /// (`docs/qos.md`): flat keys `iops_total`, `iops_read`, `iops_write` (operations
    /// a second), `bps_total`, `bps_read`, `bps_write` (bytes a second), `tx_pps`,
    /// `rx_pps`, `tx_bps`, `rx_bps` (a lent NIC's frames and bytes a second, as the
    /// guest sees them), each with an optional `<key>_burst` (bucket size, default a
    /// tenth of a second's worth), and `weight` (1..=10000, share of a backing store).
    /// Rates are at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "server", schema(value_type = Option<Object>))]
    pub qos: Option<devlend_fabric::qos::Qos>,
}

/// A lease: one device held by one consumer on one compute host until `expires_at_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Lease {
    /// Lease id (the `lease_id` of its token, and the borrower's identity to the lender).
    pub id: Uuid,
    /// The device's id.
    pub device_id: Uuid,
    /// Device name on the lender.
    pub device: String,
    /// Provider (lender) name.
    pub provider: String,
    /// `HOST:PORT` of the lender's fabric server.
    pub fabric_address: String,
    /// The lender's further fabric addresses when the lease was granted: the
    /// attachment's further paths (a block device's; not a PCIe function's).
    #[serde(default)]
    pub fabric_paths: Vec<String>,
    /// Holder (a VM's id).
    pub consumer: String,
    /// The compute host the holder runs on.
    pub compute_host: String,
    /// State as of the answer (past its expiry a live lease reads `expired`).
    pub state: LeaseState,
    /// Creation time, ms since the epoch.
    pub created_ms: u64,
    /// Expiry, ms since the epoch.
    pub expires_at_ms: u64,
    /// Time to live each renewal grants, in ms.
    pub ttl_ms: u64,
    /// Incremented by every state change (bind, release, expiry); not by renewals.
    pub generation: u64,
    /// The limits granted, as in [`LeaseRequest::qos`]; absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "server", schema(value_type = Option<Object>))]
    pub qos: Option<devlend_fabric::qos::Qos>,
    /// A live migration's handover: the lease this one takes its device over from
    /// (`POST /v1/leases/{id}/handover`); absent: an ordinary lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub successor_of: Option<Uuid>,
    /// The lease's fencing epoch: a number of one counter of the pool that every new
    /// lease takes the next of, so a device's newer lease has the higher epoch (0: a
    /// lease granted before epochs).
    #[serde(default)]
    pub epoch: u64,
}

/// Body of `POST /v1/leases/{id}/handover`: where the lease's VM migrates to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct HandoverRequest {
    /// The destination compute host (its enrolled name): it holds the new lease.
    pub compute_host: String,
}

/// `POST /v1/leases` answer: the lease and its signed token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct LeaseGrant {
    /// The new lease, state `claimed`.
    pub lease: Lease,
    /// The lease token, text form (unpadded base64url, see
    /// `devlend_fabric::lease_token`); the borrower hands it to the lender.
    pub token: String,
}

/// Body of bind and release: the lease generation read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct GenerationBody {
    /// The lease's generation as last read.
    pub generation: u64,
}

/// Body of a lease heartbeat: empty, or `{}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct EmptyBody {}

/// Filter of `GET /v1/devices` (all optional).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceQuery {
    /// Only this resource class (`class=`).
    pub class: Option<String>,
    /// Only devices with all of these traits (`trait=`, repeated).
    pub traits: Vec<String>,
    /// Only devices of at least this many bytes (`min_capacity=`).
    pub min_capacity: Option<u64>,
}

/// Which leases `GET /v1/leases` lists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub enum LeaseFilter {
    /// Claimed or bound, not expired (the default).
    #[default]
    Active,
    /// Every lease the pool remembers.
    All,
}

impl LeaseFilter {
    /// The query string value.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseFilter::Active => "active",
            LeaseFilter::All => "all",
        }
    }
}

/// What an enrolled key may do at the pool (see `docs/security.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub enum Role {
    /// Everything, and enrollment.
    Admin,
    /// A lender: register and heartbeat the provider of its own name.
    Lender,
    /// A compute host: lease, bind, renew and release leases for its own host name.
    Compute,
}

impl Role {
    /// The name used in JSON, the database and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Lender => "lender",
            Role::Compute => "compute",
        }
    }

    /// Parses [`Role::as_str`]'s form.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "lender" => Some(Role::Lender),
            "compute" => Some(Role::Compute),
            _ => None,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An enrolled key: who it is and what it may do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Principal {
    /// The Ed25519 public key, unpadded base64url.
    pub public_key: String,
    /// Its role.
    pub role: Role,
    /// The provider name (lender), the compute host name (compute), or a label (admin).
    pub name: String,
    /// When it was enrolled, ms since the epoch.
    pub created_ms: u64,
}

/// `POST /v1/principals` (admin): pin `public_key` to a role and name at once, or,
/// without `public_key`, issue a one-time join token that pins the key which redeems it
/// (`POST /v1/join`). Either replaces the key that role and name had: that is how a key
/// is rotated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct EnrollRequest {
    /// The role.
    pub role: Role,
    /// Provider name (lender) or compute host name (compute), 1..=255 bytes.
    pub name: String,
    /// The key to pin now (unpadded base64url); absent: issue a join token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    /// How long the join token stays valid, in ms (60000..=604800000, default 3600000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
}

/// Answer of `POST /v1/principals`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Enrollment {
    /// The principal pinned now (when the request gave a key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<Principal>,
    /// The one-time join token (when the request gave no key); shown once, the pool
    /// keeps only its hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_token: Option<String>,
    /// The join token's expiry, ms since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
}

/// `POST /v1/join`, signed with the key to enroll: redeems a join token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct JoinRequest {
    /// The token `devlend pool enroll` printed.
    pub token: String,
}

//! Types of the compute agent's control API (JSON over HTTP on a unix socket).
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `GET /v1/attachments` | | `200` `[AttachmentInfo]` |
//! | `POST /v1/attachments` | [`AttachRequest`] | `201` [`AttachmentInfo`]; `400`, `409`, `502` [`ApiError`] |
//! | `GET /v1/attachments/{id}` | | `200` [`AttachmentInfo`]; `404` |
//! | `DELETE /v1/attachments/{id}[?release_timeout_s=N]` | | `200` [`AttachmentInfo`] (final counters); `404`; `504` when the guest keeps the device |
//! | `POST /v1/attachments/{id}/handover` | [`HandoverRequest`] or empty | `200` [`HandoverInfo`] |
//! | `DELETE /v1/attachments/{id}/handover` | | `200` [`AttachmentInfo`] |
//! | `POST /v1/attachments/{id}/finish` | | `200` [`AttachmentInfo`] |
//! | `GET /v1/openapi.yaml` | | `200` the OpenAPI 3.1 document (`compute-agent/openapi.yaml`) |

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[cfg(test)]
mod json_tests;
/// The transport of an attachment's queue sessions and its RDMA exposure, as the
/// engines and the CLI name them (`devlend_fabric::transport`).
pub use devlend_fabric::transport::{RdmaExposure, Transport};

mod kinds;

pub use kinds::{
    BlockInfo, CoherenceMode, DeviceKind, IoCounters, KindInfo, Latency, NetCounters, NicInfo,
    PathState, PciCounters, PciInfo, Rates,
};

/// Ask to attach a lent block device on a new vhost-user socket.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AttachRequest {
    /// Attachment id (letters, digits, `-`, `_`, `.`; at most 64); default: the device
    /// name, with a numeric suffix if taken.
    #[serde(default)]
    pub id: Option<String>,
    /// Lender address: `HOST:PORT` (direct), or `CLUSTER/LENDER`, a lender named in
    /// its cluster's gateway, reached through this compute agent's gateway (configured
    /// `cluster` and `gateway`); empty when `device` is a whole device address.
    pub lender: String,
    /// More addresses of the same lender, `HOST:PORT` each (another NIC, another
    /// network): with any, the attachment has several paths, `lender` first. Each
    /// virtqueue's session is opened on one of them (queues spread over the paths),
    /// carries heartbeats, and moves to the next path within about 400 ms when its own
    /// drops, the lender fencing the old one before the requests are resent
    /// (`docs/faults.md`, "Paths"). At most 7; direct `lender` only (not through a
    /// gateway); not with `kind` `pci`. Default: none; with `lease`, the further
    /// addresses its lender registered with the pool (`fabric_paths`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    /// Device name on the lender, or with an empty `lender` a device address
    /// `CLUSTER/LENDER/DEVICE`.
    pub device: String,
    /// Path of the vhost-user socket to create.
    pub socket: PathBuf,
    /// Number of virtqueues (1..=16); default 1.
    #[serde(default = "default_queues")]
    pub queues: u16,
    /// Virtqueue size to suggest to the VMM (a power of two, 64..=1024); default 256.
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    /// Busy-poll budget in microseconds (0..=1000): after handling events, each queue's
    /// worker polls the guest's ring and the fabric after its last work before it sleeps
    /// again, for an adaptive window of at most this long: grown while work follows
    /// within it, dropped to 0 after a longer wait (0, the default: interrupt-driven,
    /// no spinning). Costs CPU for lower latency.
    #[serde(default)]
    pub poll_us: u32,
    /// Seconds requests wait for a lost fabric session to come back (0..=3600; default
    /// 30): the borrower reconnects with backoff and resends them, so the guest sees a
    /// delay. Past it they complete with IOERR.
    #[serde(default = "default_reconnect_deadline")]
    pub reconnect_deadline_s: u32,
    /// Plug the device into this running VM once the socket is served; the VMM's device
    /// id is the attachment id.
    #[serde(default)]
    pub vmm: Option<VmmTarget>,
    /// Attach under this pool lease (its `lender` and `device` must match the request's):
    /// the agent binds it, renews it while attached and releases it at detach. Without
    /// one, the lender must be in direct mode.
    #[serde(default)]
    pub lease: Option<LeaseRef>,
    /// The lender's Ed25519 public key (unpadded base64url, as `devlend-device-agent`
    /// logs it at start): every session must prove it, or it is refused before any
    /// request (the guest's I/O waits, up to the reconnect deadline). With a lease whose
    /// token names the lender's key, that key is used and this must match it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lender_key: Option<String>,
    /// Open the fabric sessions inside TLS 1.3, verifying the lender's certificate
    /// against the compute agent's `tls_ca` (which must be configured); default false.
    /// Recommended when traffic leaves a rack.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls: bool,
    /// With `tls`: the name the lender's certificate must carry (DNS name or IP
    /// address); default: the host part of `lender`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_server_name: Option<String>,
    /// The virtqueues' fabric transport: `tcp` (default) or `rdma` (the lender must
    /// serve RDMA on the `lender` address; the holding session stays TCP).
    #[serde(default, skip_serializing_if = "Transport::is_tcp")]
    pub transport: Transport,
    /// With `transport: rdma`, what of the guest's memory the lender can reach:
    /// `request` (default: each request's buffers, registered for that request alone and
    /// deregistered at its response) or `guest-memory` (all of the guest's RAM, registered
    /// once, while a session is open: fewer verbs calls per request, for a lender trusted
    /// as much as the host). See docs/rdma.md, "Exposure". Refused with `tcp`.
    #[serde(default, skip_serializing_if = "RdmaExposure::is_request")]
    pub rdma_exposure: RdmaExposure,
    /// What to serve: `device` (default: a block device on vhost-user-blk, or a NIC on
    /// vhost-user-net, as the lender says) or `pci` (a PCIe function on vfio-user;
    /// `queues`, `queue_size`, `poll_us`, `reconnect_deadline_s`, `vmm` and `transport`
    /// do not apply).
    #[serde(default, skip_serializing_if = "AttachKind::is_device")]
    pub kind: AttachKind,
    /// With `kind` `pci`: the VM the function is lent to, a name the operator chooses
    /// (1..=64 of letters, digits, `.`, `_`, `-`; [`valid_vm_name`]). The PCIe
    /// functions attached with the same `vm` on this compute agent are one VM's: their
    /// lenders let their DMA reach each other's BARs (peer-to-peer, `docs/pci.md`).
    /// Refused for other kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// The destination of a live migration: the handover token that the source's
    /// compute agent issued (`POST /v1/attachments/{id}/handover` there). The
    /// attachment stands by for the device and takes it when the source lets it go at
    /// the end of the migration (`docs/migration.md`). Not with `lease`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_token: Option<String>,
}

/// A live migration's handover, as the source's compute agent issues it
/// (`POST /v1/attachments/{id}/handover`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HandoverInfo {
    /// The source attachment's id.
    pub attachment: String,
    /// Lender address.
    pub lender: String,
    /// More paths to the same lender (`HOST:PORT` each), as the source was attached with:
    /// the destination attaches with them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    /// Device name on the lender.
    pub device: String,
    /// The token the destination attaches with (`handover_token`; unpadded base64url).
    /// It names this attachment's lease as the predecessor of a new one.
    pub handover_token: String,
    /// The destination's lease id (hex, 32 digits).
    pub lease: String,
    /// This attachment's lease id (hex), which hands the device over.
    pub from_lease: String,
    /// Under a pool lease: the pool's URL. The destination attaches with the token as its
    /// lease (`lease: {pool, id: lease, token}`), which it binds and renews.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

/// Body of `POST /v1/attachments/{id}/handover` (may be empty).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HandoverRequest {
    /// Under a pool lease: the destination compute host's name (as enrolled with the
    /// pool); it holds the new lease.
    #[serde(default)]
    pub compute_host: Option<String>,
    /// In direct mode: the destination compute agent's public key (base64url, as
    /// `devlend keygen` prints it), which the token names as its holder: only the agent
    /// that holds it can present the token. `None`: this agent's own key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_key: Option<String>,
}

/// Where a source attachment is in a live migration's handover.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum HandoverState {
    /// Asked for: the device is let go when the VM stops at the end of the migration.
    Asked,
    /// The VM stopped: the device was let go for the destination.
    LetGo,
}

/// What an attachment serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttachKind {
    /// A block device or a NIC, as the lender lends it (vhost-user).
    #[default]
    Device,
    /// A PCIe function (vfio-user).
    Pci,
}

impl AttachKind {
    /// Whether this is the default, `device`.
    pub fn is_device(&self) -> bool {
        *self == AttachKind::Device
    }
}

/// Longest [`AttachRequest::vm`], in bytes.
pub const MAX_VM_NAME: usize = 64;

/// Whether `name` is a VM name [`AttachRequest::vm`] accepts: 1..=[`MAX_VM_NAME`]
/// ASCII letters, digits, `.`, `_` and `-`.
pub fn valid_vm_name(name: &str) -> bool {
    (1..=MAX_VM_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

impl AttachRequest {
    /// How its sessions travel, for people: `tcp`, `tcp+tls` or `rdma`.
    pub fn transport_label(&self) -> &'static str {
        match (&self.transport, self.tls) {
            (Transport::Rdma, _) => "rdma",
            (Transport::Tcp, true) => "tcp+tls",
            (Transport::Tcp, false) => "tcp",
        }
    }
}

/// A lease granted by a device pool (`POST /v1/leases`), handed to the compute agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LeaseRef {
    /// The pool's base URL, e.g. `http://pool:7400`.
    pub pool: String,
    /// The lease id.
    pub id: uuid::Uuid,
    /// The lease token, text form (unpadded base64url).
    pub token: String,
}

/// A running VM to plug an attachment into.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum VmmTarget {
    /// QEMU, through its QMP socket (`-qmp unix:PATH,server=on,wait=off`); needs a free
    /// `pcie-root-port`.
    Qemu {
        /// QMP socket path.
        qmp: PathBuf,
    },
    /// Cloud Hypervisor, through its API socket (`--api-socket PATH`).
    CloudHypervisor {
        /// API socket path.
        api: PathBuf,
    },
}

/// Where an attachment is plugged.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmmPlug {
    /// The VM.
    pub target: VmmTarget,
    /// The device id in the VMM.
    pub device_id: String,
    /// QEMU: the root port it sits on; Cloud Hypervisor: its PCI address (BDF).
    pub location: String,
}

fn default_queues() -> u16 {
    1
}

/// Default of [`AttachRequest::reconnect_deadline_s`].
pub fn default_reconnect_deadline() -> u32 {
    30
}

fn default_queue_size() -> u16 {
    256
}

/// An attachment as the API reports it: the fields every kind has, and its kind's own
/// (`kind`: `block`, `nic` or `pci`, flattened into the same object; [`KindInfo`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AttachmentInfo {
    /// Attachment id.
    pub id: String,
    /// Lender address.
    pub lender: String,
    /// Device name on the lender.
    pub device: String,
    /// Socket path (vhost-user for a block device or a NIC, vfio-user for a PCIe
    /// function).
    pub socket: PathBuf,
    /// Whether a VMM (frontend) is connected to the socket now.
    pub connected: bool,
    /// The VM it was plugged into live, if any.
    pub vmm: Option<VmmPlug>,
    /// The pool lease it holds the device under, if any.
    #[serde(default)]
    pub lease: Option<uuid::Uuid>,
    /// The limits its lease grants (the lender enforces them, with its own; flat form
    /// as in the pool's `qos`, `docs/qos.md`). Absent: none from the lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<devlend_fabric::qos::Qos>,
    /// The pool answered a renewal that the lease has ended: the device is no longer
    /// this attachment's (detach it).
    #[serde(default)]
    pub lease_ended: bool,
    /// Under a pool lease: since when the pool has not answered this agent (ms since
    /// the Unix epoch); absent while it answers. The device goes on meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_unreachable_since_ms: Option<u64>,
    /// A live migration's handover in progress from this attachment, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover: Option<HandoverState>,
    /// The lender is gone for good (a PCIe function, whose session is not re-opened:
    /// the VMM's device state was on it); detach and attach again.
    #[serde(default)]
    pub lender_lost: bool,
    /// How its sessions travel: `tcp`, `tcp+tls` or `rdma`.
    #[serde(default)]
    pub transport: String,
    /// Saved before a restart and not served again yet: why (e.g. its lender is
    /// unreachable); retried meanwhile. Its id and socket stay reserved; detach gives it
    /// up; its kind's fields are empty meanwhile. Absent for an attachment being served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restoring: Option<String>,
    /// What it serves, with that kind's own fields and counters.
    #[serde(flatten)]
    pub part: KindInfo,
}

impl AttachmentInfo {
    /// What it serves.
    pub fn kind(&self) -> DeviceKind {
        self.part.kind()
    }

    /// A block device's fields, if it is one.
    pub fn block(&self) -> Option<&BlockInfo> {
        match &self.part {
            KindInfo::Block(b) => Some(b),
            _ => None,
        }
    }

    /// A NIC's fields, if it is one.
    pub fn nic(&self) -> Option<&NicInfo> {
        match &self.part {
            KindInfo::Nic(n) => Some(n),
            _ => None,
        }
    }

    /// A PCIe function's fields, if it is one.
    pub fn pci(&self) -> Option<&PciInfo> {
        match &self.part {
            KindInfo::Pci(p) => Some(p),
            _ => None,
        }
    }
}

/// An error answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ApiError {
    /// What went wrong, for people.
    pub error: String,
}

/// A MAC address as `aa:bb:cc:dd:ee:ff` (lower-case hex).
pub fn format_mac(mac: &[u8]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

//! The attachments of a compute agent.
//!
//! Why this file is over 600 lines: one `Registry` attaches, detaches, lists and restores
//! saved attachments under its locks, and the file also builds the status views (`info`,
//! `restoring_info`) and plugs into the VMMs (`plug`, `unplug`). The VMM plugging could
//! move into `vmm/` and the status views to their own module; it is left whole for now, and
//! the planned reshaping of device kinds into types (issue 21) will split it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use devlend_backend::blk::engine::{new_borrower_id, LenderTarget};
use devlend_backend::blk::{AttachedKind, Attachment, AttachmentConfig, AttachmentError, Serve};

use crate::api::{
    AttachRequest, AttachmentInfo, BlockInfo, DeviceKind, KindInfo, NicInfo, PciInfo, VmmPlug,
    VmmTarget,
};
use crate::lease::{CheckedLease, LeaseError, LeaseKeeper};
use crate::state::{self, SavedAttachment, StateFile};
use crate::vmm::cloud_hypervisor::{self as ch, ChError};
use crate::vmm::link_watch::LinkWatch;
use crate::vmm::qemu::{self, HotplugError, PlugKind};

/// Why an attach or detach was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The request itself is invalid.
    #[error("{0}")]
    BadRequest(String),
    /// The id or socket is taken.
    #[error("{0}")]
    Conflict(String),
    /// No attachment with that id.
    #[error("no attachment {0:?}")]
    NotFound(String),
    /// The attachment could not start.
    #[error("cannot attach: {}", chain(.0))]
    Start(#[source] AttachmentError),
    /// Plugging into or unplugging from the VM failed.
    #[error("{}", chain(.0))]
    Vmm(#[source] VmmError),
    /// The pool lease cannot be used.
    #[error("{}", chain(.0))]
    Lease(#[source] LeaseError),
    /// The state file cannot be written: the attachment would not survive a restart.
    #[error("not attached: {}", chain(.0))]
    State(#[source] crate::state::StateError),
    /// A saved attachment's entry in the state file is damaged.
    #[error("{0}")]
    BadSaved(String),
    /// A saved attachment was given up (detached) while it waited to be restored.
    #[error("attachment {0} was given up while waiting to be served again")]
    Cancelled(String),
}

/// A failure of the VMM glue.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// QEMU hotplug.
    #[error("QEMU hotplug failed")]
    Qemu(#[source] HotplugError),
    /// Cloud Hypervisor API.
    #[error("Cloud Hypervisor API failed")]
    CloudHypervisor(#[source] ChError),
    /// Live attach of a lent NIC into Cloud Hypervisor is not done yet.
    #[error("live attach of a NIC into Cloud Hypervisor is not supported; start the VM with --net vhost_user=true,socket=...")]
    NicIntoCloudHypervisor,
}

use devlend_fabric::error::chain;

struct Entry {
    request: AttachRequest,
    id: String,
    attachment: Attachment,
    plug: Option<VmmPlug>,
    lease: Option<LeaseKeeper>,
    /// The borrower identity and token every hello carries (kept in the state file).
    borrower: [u8; 16],
    token: Vec<u8>,
    /// A lent NIC plugged into QEMU: its link followed into the guest.
    _link_watch: Option<LinkWatch>,
}

/// What a restored attachment keeps from before the restart.
struct Restore {
    borrower: [u8; 16],
    token: Vec<u8>,
    plug: Option<VmmPlug>,
}

/// What a started attachment is made of.
type Started = (
    Attachment,
    Option<VmmPlug>,
    Option<LeaseKeeper>,
    [u8; 16],
    Vec<u8>,
);

/// Lifetime of the token of a direct attachment (10 years): it lives as long as the
/// attachment; the key, not the expiry, is what protects it.
const DIRECT_TOKEN_LIFETIME_MS: u64 = 10 * 365 * 24 * 3600 * 1000;

use devlend_fabric::lease_token::now_ms;

mod handover;

/// Largest busy-poll budget an attachment may ask for, in microseconds.
pub const MAX_POLL_US: u32 = 1000;

/// Attachments by id.
#[derive(Default)]
pub struct Registry {
    entries: Mutex<BTreeMap<String, Entry>>,
    /// Ids and sockets of attachments being set up.
    pending: Mutex<Vec<(String, std::path::PathBuf)>>,
    rates: crate::rates::RateTracker,
    /// Signs the tokens of direct (lease-less) attachments, when configured.
    signer: Option<devlend_fabric::lease_token::TokenSigner>,
    /// Signs this compute host's pool requests (lease bind, renew, release), and the
    /// CA for `https://` pools.
    pool: crate::lease::PoolAccess,
    /// Where the attachments are saved after each change, to be restored at start.
    state: Option<PathBuf>,
    /// Saved attachments not served again yet (their lender unreachable so far): kept
    /// in the state file, listed, and their ids and sockets reserved meanwhile.
    restoring: Mutex<Vec<Restoring>>,
    /// Whether the last write of the state file succeeded.
    saved_ok: std::sync::atomic::AtomicBool,
    /// Trust anchors and client identity for attachments that ask for TLS.
    tls: Option<devlend_fabric::tls::ClientTls>,
    /// This compute agent's cluster and its cluster gateway (`HOST:PORT`), for lenders
    /// addressed `CLUSTER/LENDER`.
    gateway: Option<(String, String)>,
}

/// Where an attachment's sessions connect: the lender itself, or the local gateway with
/// a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// `HOST:PORT` to connect to: the lender, or the cluster gateway.
    pub addr: String,
    /// The route the gateway is asked for; `None`: direct.
    pub relay: Option<devlend_fabric::relay::Route>,
    /// The device name on the lender.
    pub device: String,
}

/// Resolves a request's `lender` and `device` into where its sessions go.
///
/// - `lender` `HOST:PORT`: direct, `device` as given;
/// - `lender` `CLUSTER/LENDER`, or an empty `lender` and `device`
///   `CLUSTER/LENDER/DEVICE`: through `gateway` (this agent's `(cluster, HOST:PORT)`),
///   which relays to the named lender of that cluster (its own cluster's included: the
///   gateway knows its lenders by name; the hop stays inside the cluster).
///
/// # Errors
/// A message for a malformed address, or a cluster address without a gateway.
pub fn resolve(
    lender: &str,
    device: &str,
    gateway: Option<&(String, String)>,
) -> Result<Resolved, String> {
    let (cluster, name, device) = if lender.contains('/') {
        let (c, l) = lender.split_once('/').unwrap_or((lender, ""));
        let (_, _, d) = devlend_fabric::relay::parse_device_address(&format!("{c}/{l}/{device}"))?;
        (c.to_owned(), l.to_owned(), d)
    } else if lender.is_empty() {
        devlend_fabric::relay::parse_device_address(device)?
    } else {
        return Ok(Resolved {
            addr: lender.to_owned(),
            relay: None,
            device: device.to_owned(),
        });
    };
    let Some((_, gw)) = gateway else {
        return Err(format!(
            "lender {cluster}/{name} is addressed by cluster, but this compute agent has no gateway (configure cluster and gateway)"
        ));
    };
    Ok(Resolved {
        addr: gw.clone(),
        relay: Some(devlend_fabric::relay::Route {
            cluster,
            lender: name,
        }),
        device,
    })
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn info(e: &Entry) -> AttachmentInfo {
    AttachmentInfo {
        id: e.id.clone(),
        lender: e.request.lender.clone(),
        device: e.request.device.clone(),
        socket: e.request.socket.clone(),
        connected: e.attachment.connected(),
        vmm: e.plug.clone(),
        lease: e.lease.as_ref().map(LeaseKeeper::id),
        limits: lease_limits(e.request.lease.as_ref()),
        lease_ended: e.lease.as_ref().is_some_and(LeaseKeeper::ended),
        handover: handover::state(&e.attachment),
        lender_lost: e.attachment.lender_lost(),
        transport: e.request.transport_label().to_owned(),
        restoring: None,
        part: part(&e.request, &e.attachment),
    }
}

/// The fields of an attachment's own kind, read from its backend.
fn part(req: &AttachRequest, a: &Attachment) -> KindInfo {
    let l = a.limits();
    match a.kind() {
        AttachedKind::Block => {
            let end = l
                .serial
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(l.serial.len());
            KindInfo::Block(BlockInfo {
                queues: req.queues,
                queue_size: req.queue_size,
                capacity_sectors: l.capacity_sectors,
                block_size: l.block_size,
                read_only: l.read_only,
                serial: String::from_utf8_lossy(&l.serial[..end]).into_owned(),
                counters: a.stats().into(),
                rates: None,
            })
        }
        AttachedKind::Nic => {
            let n = a.net_stats().unwrap_or_default();
            KindInfo::Nic(NicInfo {
                queue_pairs: req.queues,
                queue_size: req.queue_size,
                mac: a
                    .net_link()
                    .map(|l| crate::api::format_mac(&l.mac))
                    .unwrap_or_default(),
                mtu: n.mtu,
                link_up: n.link_up,
                reconnects: n.reconnects,
                counters: n.total.into(),
                pairs: n.pairs.into_iter().map(Into::into).collect(),
            })
        }
        AttachedKind::Pci => KindInfo::Pci(match a.pci() {
            Some(p) => {
                let id = p.identity();
                PciInfo {
                    bdf: id.bdf.clone(),
                    vendor_id: id.vendor_id,
                    device_id: id.device_id,
                    coherence: Some(p.coherence().into()),
                    dma_mapped_bytes: p.dma_mapped_bytes(),
                    counters: p.stats().into(),
                }
            }
            None => PciInfo::default(),
        }),
    }
}

/// The limits a lease's token carries (the lender enforces them, with its own).
fn lease_limits(lease: Option<&crate::api::LeaseRef>) -> Option<devlend_fabric::qos::Qos> {
    let token = devlend_fabric::lease_token::LeaseToken::from_text(&lease?.token).ok()?;
    token.claims_unverified().ok()?.qos
}

/// What `status` shows of a saved attachment not served again yet: its saved kind,
/// with that kind's fields empty.
fn restoring_info(r: &Restoring) -> AttachmentInfo {
    let q = &r.saved.request;
    let mut part = KindInfo::empty(r.saved.kind());
    match &mut part {
        KindInfo::Block(b) => {
            b.queues = q.queues;
            b.queue_size = q.queue_size;
        }
        KindInfo::Nic(n) => {
            n.queue_pairs = q.queues;
            n.queue_size = q.queue_size;
        }
        KindInfo::Pci(_) => {}
    }
    AttachmentInfo {
        id: r.saved.id.clone(),
        lender: q.lender.clone(),
        device: q.device.clone(),
        socket: q.socket.clone(),
        connected: false,
        vmm: r.saved.plug.clone(),
        lease: q.lease.as_ref().map(|l| l.id),
        limits: lease_limits(q.lease.as_ref()),
        lease_ended: false,
        handover: None,
        lender_lost: false,
        transport: q.transport_label().to_owned(),
        restoring: Some(r.reason.clone()),
        part,
    }
}

/// What a served attachment is, by its backend.
fn kind(e: &Entry) -> DeviceKind {
    match e.attachment.kind() {
        AttachedKind::Block => DeviceKind::Block,
        AttachedKind::Nic => DeviceKind::Nic,
        AttachedKind::Pci => DeviceKind::Pci,
    }
}

/// A saved attachment waiting to be served again, and why it is not yet.
#[derive(Debug, Clone)]
struct Restoring {
    saved: SavedAttachment,
    reason: String,
}

impl Registry {
    /// Signs this compute host's pool requests with `key` (its role at the pool:
    /// compute, named by its host name).
    pub fn set_pool_identity(
        &mut self,
        key: std::sync::Arc<devlend_fabric::lease_token::TokenSigner>,
    ) {
        self.pool.identity = Some(key);
    }

    /// Lease tokens must verify with the pool's `key` (`pool_public_key`).
    pub fn set_pool_key(&mut self, key: devlend_fabric::lease_token::PublicKey) {
        self.pool.pool_key = Some(key);
    }

    /// Verifies the certificate of `https://` pools against the CA certificates in
    /// `ca_file` (PEM) instead of the system's trust store.
    pub fn set_pool_ca(&mut self, ca_file: PathBuf) {
        self.pool.ca_file = Some(ca_file);
    }

    /// Authenticates direct attachments: each gets a token signed with `signer`
    /// (claims: its borrower identity, the device, an empty provider, a 10-year expiry),
    /// which a lender given the public key (`--auth-key`) checks.
    pub fn set_signer(&mut self, signer: devlend_fabric::lease_token::TokenSigner) {
        self.signer = Some(signer);
    }

    /// Saves the attachments to `path` after every attach and detach, for
    /// [`Self::restore`] after a restart ([`crate::state`]).
    pub fn set_state_file(&mut self, path: PathBuf) {
        self.state = Some(path);
    }

    /// The state file, if attachments are saved.
    pub fn state_file(&self) -> Option<&std::path::Path> {
        self.state.as_deref()
    }

    fn lock_restoring(&self) -> std::sync::MutexGuard<'_, Vec<Restoring>> {
        self.restoring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the attachments are in the state file as they are now (the last save
    /// succeeded, or there is no state file).
    pub fn state_saved(&self) -> bool {
        self.saved_ok.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Writes the state file from `entries` and the attachments still being restored.
    /// A failure is logged and returned: the attachments go on, but would not survive a
    /// restart.
    ///
    /// # Errors
    /// [`crate::state::StateError`] when the file cannot be written.
    fn save_state(
        &self,
        entries: &BTreeMap<String, Entry>,
    ) -> Result<(), crate::state::StateError> {
        let Some(path) = &self.state else {
            return Ok(());
        };
        let file = StateFile {
            version: state::VERSION,
            attachments: entries
                .values()
                .map(|e| SavedAttachment {
                    id: e.id.clone(),
                    request: e.request.clone(),
                    borrower: state::to_hex(&e.borrower),
                    token: state::to_hex(&e.token),
                    plug: e.plug.clone(),
                    kind: Some(kind(e)),
                })
                .chain(
                    self.lock_restoring()
                        .iter()
                        .filter(|r| !entries.contains_key(&r.saved.id))
                        .map(|r| SavedAttachment {
                            kind: Some(r.saved.kind()),
                            ..r.saved.clone()
                        }),
                )
                .collect(),
        };
        let result = file.save(path);
        self.saved_ok
            .store(result.is_ok(), std::sync::atomic::Ordering::Release);
        if let Err(e) = &result {
            tracing::error!(error = %chain(e), "cannot save the attachments; they would not survive a restart");
        }
        result
    }

    /// Writes the state file once at start (with the attachments about to be
    /// restored), so that an unwritable one is found before anything is attached.
    ///
    /// # Errors
    /// [`crate::state::StateError`].
    pub fn check_state_file(&self) -> Result<(), crate::state::StateError> {
        self.save_state(&self.lock())
    }

    /// Lets attachments ask for TLS (`tls: true`): their sessions verify the lender
    /// against `tls`'s trust anchors and present its client certificate, if any.
    pub fn set_tls(&mut self, tls: devlend_fabric::tls::ClientTls) {
        self.tls = Some(tls);
    }

    /// Lets attachments address lenders as `CLUSTER/LENDER`: their sessions go through
    /// the gateway at `gateway` (`HOST:PORT`) of this agent's `cluster`.
    pub fn set_gateway(&mut self, cluster: String, gateway: String) {
        self.gateway = Some((cluster, gateway));
    }

    /// The TLS target of a request asking for TLS; `None` for one that does not.
    fn tls_target(
        &self,
        req: &AttachRequest,
        resolved: &Resolved,
    ) -> Result<Option<devlend_fabric::tls::TlsTarget>, RegistryError> {
        if !req.tls {
            if req.tls_server_name.is_some() {
                return Err(RegistryError::BadRequest(
                    "tls_server_name needs tls: true".into(),
                ));
            }
            return Ok(None);
        }
        let Some(client) = &self.tls else {
            return Err(RegistryError::BadRequest(
                "TLS asked for, but this compute agent has no TLS trust anchors (start it with --tls-ca)".into(),
            ));
        };
        // Through a gateway TLS runs end to end with the lender, whose certificate
        // names it, not the gateway: the default name is the lender's.
        let name = req
            .tls_server_name
            .as_deref()
            .or(resolved.relay.as_ref().map(|r| r.lender.as_str()));
        devlend_fabric::tls::TlsTarget::new(client.clone(), &resolved.addr, name)
            .map(Some)
            .map_err(|e| RegistryError::BadRequest(e.to_string()))
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Vec<(String, std::path::PathBuf)>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn start_and_plug(
        &self,
        id: &str,
        req: &AttachRequest,
        restore: Option<Restore>,
    ) -> Result<Started, RegistryError> {
        let checked = match &req.lease {
            None => None,
            Some(r) => {
                let c = CheckedLease::check(r, &self.pool).map_err(RegistryError::Lease)?;
                if c.device() != req.device || c.lender() != req.lender {
                    return Err(RegistryError::BadRequest(format!(
                        "lease {} is for device {:?} at {}, not {:?} at {}",
                        r.id,
                        c.device(),
                        c.lender(),
                        req.device,
                        req.lender
                    )));
                }
                Some(c)
            }
        };
        let resolved = resolve(&req.lender, &req.device, self.gateway.as_ref())
            .map_err(RegistryError::BadRequest)?;
        if resolved.relay.is_some() && req.transport != crate::api::Transport::Tcp {
            return Err(RegistryError::BadRequest(
                "a lender in another cluster is reached through the gateways over TCP: transport rdma cannot be relayed".into(),
            ));
        }
        let tls = self.tls_target(req, &resolved)?;
        let incoming = match (&req.handover_token, &restore) {
            (Some(t), None) => Some(handover::incoming(t, &resolved.device, checked.is_some())?),
            _ => None,
        };
        let (borrower, token) = match (&checked, &self.signer, &restore, incoming) {
            (Some(c), _, _, _) => (c.borrower(), c.token.clone()),
            (None, _, Some(r), _) => (r.borrower, r.token.clone()),
            (None, _, None, Some(i)) => i,
            (None, Some(signer), None, None) => {
                let borrower = new_borrower_id();
                let claims = devlend_fabric::lease_token::LeaseClaims {
                    lease_id: borrower,
                    expires_at_ms: now_ms().saturating_add(DIRECT_TOKEN_LIFETIME_MS),
                    provider: String::new(),
                    device: resolved.device.clone(),
                    consumer: id.to_owned(),
                    provider_key: None,
                    qos: None,
                    successor_of: None,
                };
                let token = signer
                    .sign(&claims)
                    .map_err(|e| RegistryError::BadRequest(format!("cannot sign a token: {e}")))?;
                (borrower, token.as_bytes().to_vec())
            }
            (None, None, None, None) => (new_borrower_id(), Vec::new()),
        };
        let lender_key = expected_lender_key(req.lender_key.as_deref(), &token)?;
        let mut attachment = Attachment::start(AttachmentConfig {
            id: id.to_owned(),
            socket: req.socket.clone(),
            lender: LenderTarget {
                addr: resolved.addr.clone(),
                relay: resolved.relay.clone(),
                device: resolved.device.clone(),
                borrower,
                token: token.clone(),
                tls,
                lender_key,
                transport: req.transport,
                rdma_exposure: req.rdma_exposure,
            },
            num_queues: req.queues,
            poll: std::time::Duration::from_micros(u64::from(req.poll_us)),
            reconnect_deadline: Duration::from_secs(u64::from(req.reconnect_deadline_s)),
            serve: match req.kind {
                crate::api::AttachKind::Device => Serve::VhostUser,
                crate::api::AttachKind::Pci => Serve::VfioUser,
            },
        })
        .map_err(RegistryError::Start)?;
        let keeper = match checked.map(|c| c.bind_and_keep(id)).transpose() {
            Ok(k) => k,
            Err(e) => {
                attachment.stop();
                return Err(RegistryError::Lease(e));
            }
        };
        let plug = match (&req.vmm, restore) {
            // Restored: the VM has the device already.
            (_, Some(r)) => r.plug,
            (None, None) => None,
            (Some(target), None) => match plug(target, id, req, &attachment) {
                Ok(p) => Some(p),
                Err(e) => {
                    attachment.stop();
                    return Err(RegistryError::Vmm(e));
                }
            },
        };
        Ok((attachment, plug, keeper, borrower, token))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Validates the request, starts the attachment and records it. Blocking (it talks
    /// to the lender): call from a blocking context.
    ///
    /// # Errors
    /// [`RegistryError`] for each refusal; nothing is left behind on error.
    pub fn attach(&self, mut req: AttachRequest) -> Result<AttachmentInfo, RegistryError> {
        // A device address CLUSTER/LENDER/DEVICE is kept as lender CLUSTER/LENDER and
        // device DEVICE, as status shows it.
        if req.lender.is_empty() {
            let (c, l, d) = devlend_fabric::relay::parse_device_address(&req.device)
                .map_err(RegistryError::BadRequest)?;
            req.lender = format!("{c}/{l}");
            req.device = d;
        }
        if !(64..=1024).contains(&req.queue_size) || !req.queue_size.is_power_of_two() {
            return Err(RegistryError::BadRequest(format!(
                "queue size {} must be a power of two in 64..=1024",
                req.queue_size
            )));
        }
        if req.reconnect_deadline_s > 3600 {
            return Err(RegistryError::BadRequest(format!(
                "reconnect_deadline_s {} is above the maximum of 3600",
                req.reconnect_deadline_s
            )));
        }
        if req.poll_us > MAX_POLL_US {
            return Err(RegistryError::BadRequest(format!(
                "poll_us {} is above the maximum of {MAX_POLL_US} µs",
                req.poll_us
            )));
        }
        if req.kind == crate::api::AttachKind::Pci && req.vmm.is_some() {
            return Err(RegistryError::BadRequest(
                "a PCIe function is not hot-plugged yet: start the VMM with the printed \
                 --user-device / vfio-user-pci argument"
                    .into(),
            ));
        }
        if !req.rdma_exposure.is_request() && req.transport != crate::api::Transport::Rdma {
            return Err(RegistryError::BadRequest(
                "rdma_exposure applies to transport rdma only".into(),
            ));
        }
        if req.kind == crate::api::AttachKind::Pci
            && req.transport == crate::api::Transport::Rdma
            && req.tls
        {
            return Err(RegistryError::BadRequest(
                "a PCIe function over RDMA has no TLS: attach over TCP for TLS".into(),
            ));
        }
        if req.socket.as_os_str().is_empty() || !req.socket.is_absolute() {
            return Err(RegistryError::BadRequest(format!(
                "socket path {:?} must be absolute",
                req.socket
            )));
        }
        let id = {
            let entries = self.lock();
            let pending = self.lock_pending();
            if let Some((i, _)) = pending
                .iter()
                .find(|(i, sock)| *sock == req.socket || Some(i) == req.id.as_ref())
            {
                return Err(RegistryError::Conflict(format!(
                    "attachment {i} is being set up with that id or socket"
                )));
            }
            if let Some(e) = entries.values().find(|e| e.request.socket == req.socket) {
                return Err(RegistryError::Conflict(format!(
                    "socket {} is already used by attachment {}",
                    req.socket.display(),
                    e.id
                )));
            }
            // One borrower per device: a second attachment of it here would be refused
            // by the lender as "another borrower", which this agent is not.
            if let Some(e) = entries.values().find(|e| {
                !req.device.is_empty()
                    && e.request.lender == req.lender
                    && e.request.device == req.device
            }) {
                return Err(RegistryError::Conflict(format!(
                    "device {:?} of {} is already attached here as {} (one attachment per device); detach it first",
                    req.device, req.lender, e.id
                )));
            }
            if let Some(r) = self.lock_restoring().iter().find(|r| {
                r.saved.request.socket == req.socket || Some(&r.saved.id) == req.id.as_ref()
            }) {
                return Err(RegistryError::Conflict(format!(
                    "attachment {} (socket {}) is being served again after a restart ({}); detach it to give it up",
                    r.saved.id,
                    r.saved.request.socket.display(),
                    r.reason
                )));
            }
            match &req.id {
                Some(id) if !valid_id(id) => {
                    return Err(RegistryError::BadRequest(format!(
                        "invalid attachment id {id:?}"
                    )))
                }
                Some(id)
                    if entries.contains_key(id)
                        || self.lock_restoring().iter().any(|r| r.saved.id == *id) =>
                {
                    return Err(RegistryError::Conflict(format!(
                        "attachment id {id:?} is taken"
                    )))
                }
                Some(id) => id.clone(),
                None => {
                    let base: String = req
                        .device
                        .chars()
                        .map(|c| {
                            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                                c
                            } else {
                                '_'
                            }
                        })
                        .take(56)
                        .collect();
                    let base = if base.is_empty() {
                        "attachment".to_owned()
                    } else {
                        base
                    };
                    (0..)
                        .map(|n| {
                            if n == 0 {
                                base.clone()
                            } else {
                                format!("{base}-{n}")
                            }
                        })
                        .find(|c| {
                            !entries.contains_key(c)
                                && !self.lock_restoring().iter().any(|r| r.saved.id == *c)
                        })
                        .unwrap_or(base)
                }
            }
        };
        self.start_reserved(id, req, None)
    }

    /// With `id` and the request's socket free: reserves them, starts the attachment
    /// (plugging it into the VM unless restored), records it and saves the state.
    fn start_reserved(
        &self,
        id: String,
        req: AttachRequest,
        restore: Option<Restore>,
    ) -> Result<AttachmentInfo, RegistryError> {
        let restored = restore.is_some();
        self.lock_pending().push((id.clone(), req.socket.clone()));
        // Start the socket and plug into the VM without holding the registry; the id
        // and socket stay reserved meanwhile.
        let result = self.start_and_plug(&id, &req, restore);
        // Lock order everywhere: entries, then pending.
        let mut entries = self.lock();
        self.lock_pending().retain(|(i, _)| *i != id);
        let (attachment, plug, lease, borrower, token) = result?;
        let link_watch = match (&plug, attachment.net_counters()) {
            (
                Some(VmmPlug {
                    target: VmmTarget::Qemu { qmp },
                    device_id,
                    ..
                }),
                Some(net),
            ) => match LinkWatch::start(device_id.clone(), qmp.clone(), net) {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!(id, error = %e, "cannot follow the NIC's link into the guest");
                    None
                }
            },
            _ => None,
        };
        let entry = Entry {
            _link_watch: link_watch,
            request: req,
            id: id.clone(),
            attachment,
            plug,
            lease,
            borrower,
            token,
        };
        let out = info(&entry);
        self.rates.start(&id, std::time::Instant::now());
        entries.insert(id.clone(), entry);
        if let Err(e) = self.save_state(&entries) {
            if !restored {
                // Not attached unless it would survive a restart: undo.
                if let Some(mut entry) = entries.remove(&id) {
                    drop(entries);
                    entry.attachment.stop();
                    if let Some(k) = entry.lease.take() {
                        k.release();
                    }
                    if let Some(p) = &entry.plug {
                        let _ = unplug(p, qemu::RELEASE_TIMEOUT);
                    }
                }
                return Err(RegistryError::State(e));
            }
        }
        drop(entries);
        tracing::info!(id = %out.id, device = %out.device, lender = %out.lender, socket = %out.socket.display(), restored, "attached");
        Ok(out)
    }

    /// Records saved attachments that are about to be restored, so that the state file
    /// keeps them until they are served again or given up.
    pub fn set_restoring(&self, saved: Vec<SavedAttachment>) {
        *self.lock_restoring() = saved
            .into_iter()
            .map(|saved| Restoring {
                saved,
                reason: "starting".into(),
            })
            .collect();
    }

    /// Records why saved attachment `id` is not served yet (shown by `status`).
    pub fn restore_failed(&self, id: &str, reason: &str) {
        if let Some(r) = self.lock_restoring().iter_mut().find(|r| r.saved.id == id) {
            reason.clone_into(&mut r.reason);
        }
    }

    /// Whether saved attachment `id` still waits to be restored (not given up).
    pub fn is_restoring(&self, id: &str) -> bool {
        self.lock_restoring().iter().any(|r| r.saved.id == id)
    }

    /// Drops a saved attachment from those waiting to be restored (served again, or
    /// given up), and saves the state.
    pub fn restored(&self, id: &str) {
        let entries = self.lock();
        self.lock_restoring().retain(|r| r.saved.id != id);
        let _ = self.save_state(&entries);
    }

    /// Gives up a saved attachment that waits to be restored (`detach`): it leaves the
    /// state file; its lease, if any, is released. `None` if no such attachment waits.
    fn cancel_restore(&self, id: &str) -> Option<AttachmentInfo> {
        let entries = self.lock();
        let mut waiting = self.lock_restoring();
        let at = waiting.iter().position(|r| r.saved.id == id)?;
        let r = waiting.remove(at);
        drop(waiting);
        let _ = self.save_state(&entries);
        drop(entries);
        if let Some(l) = &r.saved.request.lease {
            match crate::lease::pool_client(&l.pool, &self.pool).map(|c| c.release_current(l.id)) {
                Ok(Ok(_)) => tracing::info!(id = %r.saved.id, lease = %l.id, "lease released"),
                Ok(Err(e)) => {
                    tracing::warn!(id = %r.saved.id, lease = %l.id, error = %e, "cannot release the lease; it lapses at its expiry")
                }
                Err(e) => {
                    tracing::warn!(id = %r.saved.id, lease = %l.id, error = %e, "cannot release the lease; it lapses at its expiry")
                }
            }
        }
        tracing::info!(id = %r.saved.id, "given up before it was served again");
        Some(restoring_info(&r))
    }

    /// Serves a saved attachment again after a restart: the same id, socket, borrower
    /// identity and token; the VMM plug is taken as it was (the VM kept the device), and
    /// a lease is renewed again.
    ///
    /// # Errors
    /// [`RegistryError`]: a bad saved entry, the id or socket taken, or the attachment
    /// cannot start (e.g. the lender is unreachable: call again later).
    pub fn restore(&self, saved: &SavedAttachment) -> Result<AttachmentInfo, RegistryError> {
        let borrower: [u8; 16] = state::from_hex(&saved.borrower)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| {
                RegistryError::BadRequest(format!("saved attachment {}: bad borrower id", saved.id))
            })?;
        let token = state::from_hex(&saved.token).ok_or_else(|| {
            RegistryError::BadRequest(format!("saved attachment {}: bad token", saved.id))
        })?;
        if !valid_id(&saved.id) {
            return Err(RegistryError::BadRequest(format!(
                "invalid attachment id {:?}",
                saved.id
            )));
        }
        if !self.is_restoring(&saved.id) {
            // Given up (detached) while it waited.
            return Err(RegistryError::Cancelled(saved.id.clone()));
        }
        {
            let entries = self.lock();
            let pending = self.lock_pending();
            if entries.contains_key(&saved.id)
                || entries
                    .values()
                    .any(|e| e.request.socket == saved.request.socket)
                || pending
                    .iter()
                    .any(|(i, s)| *i == saved.id || *s == saved.request.socket)
            {
                return Err(RegistryError::Conflict(format!(
                    "attachment {} or its socket is in use",
                    saved.id
                )));
            }
        }
        self.start_reserved(
            saved.id.clone(),
            saved.request.clone(),
            Some(Restore {
                borrower,
                token,
                plug: saved.plug.clone(),
            }),
        )
    }

    /// All attachments, by id, with their recent rates.
    pub fn list(&self) -> Vec<AttachmentInfo> {
        let entries = self.lock();
        let mut all: Vec<AttachmentInfo> = entries.values().map(info).collect();
        all.extend(
            self.lock_restoring()
                .iter()
                .filter(|r| !entries.contains_key(&r.saved.id))
                .map(restoring_info),
        );
        drop(entries);
        all.sort_by(|a, b| a.id.cmp(&b.id));
        for a in &mut all {
            if let KindInfo::Block(b) = &mut a.part {
                b.rates = self.rates.rates(&a.id);
            }
        }
        all
    }

    /// Samples every attachment's counters for [`AttachmentInfo::rates`]; call about
    /// once a second.
    pub fn sample_rates(&self) {
        // Under the registry lock, so that an attach (which starts its history under the
        // same lock) cannot fall between the listing and the sample.
        let entries = self.lock();
        let current: Vec<(String, crate::api::IoCounters)> = entries
            .values()
            .filter(|e| e.attachment.kind() == AttachedKind::Block)
            .map(|e| (e.id.clone(), e.attachment.stats().into()))
            .collect();
        self.rates.sample(std::time::Instant::now(), current);
    }

    /// One attachment.
    ///
    /// # Errors
    /// [`RegistryError::NotFound`].
    pub fn get(&self, id: &str) -> Result<AttachmentInfo, RegistryError> {
        let found = self.lock().get(id).map(info);
        let mut a = found
            .or_else(|| {
                self.lock_restoring()
                    .iter()
                    .find(|r| r.saved.id == id)
                    .map(restoring_info)
            })
            .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
        if let KindInfo::Block(b) = &mut a.part {
            b.rates = self.rates.rates(id);
        }
        Ok(a)
    }

    /// Stops an attachment: completes its requests in flight, disconnects the VMM and
    /// removes the socket. Blocking. Returns its final state.
    ///
    /// # Errors
    /// [`RegistryError::NotFound`].
    pub fn detach(
        &self,
        id: &str,
        release_timeout: Duration,
    ) -> Result<AttachmentInfo, RegistryError> {
        // Unplug from the VM first, without holding the registry: the guest may take
        // seconds. If it keeps the device, the attachment stays, still served.
        let served = self.lock().get(id).map(|e| e.plug.clone());
        let plug = match served {
            Some(p) => p,
            None => {
                // Not served: maybe a saved one waiting to be restored. Unplug it from
                // its VM as for a served one, then give it up.
                let waiting = self
                    .lock_restoring()
                    .iter()
                    .find(|r| r.saved.id == id)
                    .map(|r| r.saved.plug.clone())
                    .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
                if let Some(p) = &waiting {
                    unplug(p, release_timeout).map_err(RegistryError::Vmm)?;
                }
                return self
                    .cancel_restore(id)
                    .ok_or_else(|| RegistryError::NotFound(id.to_owned()));
            }
        };
        if let Some(p) = &plug {
            unplug(p, release_timeout).map_err(RegistryError::Vmm)?;
        }
        let mut entry = {
            let mut entries = self.lock();
            let e = entries
                .remove(id)
                .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
            let _ = self.save_state(&entries);
            e
        };
        // Stop first, so that the counters include the requests drained.
        entry.attachment.stop();
        let mut out = info(&entry);
        out.connected = false;
        if let Some(k) = entry.lease.take() {
            k.release();
        }
        tracing::info!(id, socket = %out.socket.display(), "detached");
        Ok(out)
    }

    /// Stops serving every attachment (requests in flight complete first) but keeps
    /// them in the state file, with their VM plugs and leases: the agent's shutdown when
    /// it will be restarted. The VMs keep their devices; a QEMU with `reconnect-ms`
    /// joins the restarted agent. Leases are no longer renewed meanwhile.
    pub fn suspend_all(&self) {
        let all: Vec<Entry> = std::mem::take(&mut *self.lock()).into_values().collect();
        for mut e in all {
            e.attachment.stop_for_restart();
            tracing::info!(id = %e.id, socket = %e.request.socket.display(), "stopped; kept for the next start");
        }
    }

    /// Detaches everything (shutdown).
    pub fn detach_all(&self) {
        let ids: Vec<String> = self.lock().keys().cloned().collect();
        for id in ids {
            let _ = self.detach(&id, qemu::RELEASE_TIMEOUT);
        }
    }
}

fn plug(
    target: &VmmTarget,
    id: &str,
    req: &AttachRequest,
    attachment: &Attachment,
) -> Result<VmmPlug, VmmError> {
    let read_only = attachment.limits().read_only;
    let link = attachment.net_link();
    match target {
        VmmTarget::Qemu { qmp } => {
            let kind = match link {
                Some(l) => PlugKind::Net {
                    pairs: req.queues,
                    mac: crate::api::format_mac(&l.mac),
                    mtu: l.mtu,
                },
                None => PlugKind::Blk {
                    num_queues: req.queues,
                    queue_size: req.queue_size,
                },
            };
            let p = qemu::plug(qmp, id, &req.socket, &kind).map_err(VmmError::Qemu)?;
            tracing::info!(id, qmp = %qmp.display(), port = %p.port, "plugged into QEMU");
            Ok(VmmPlug {
                target: target.clone(),
                device_id: p.device_id,
                location: p.port,
            })
        }
        VmmTarget::CloudHypervisor { .. } if link.is_some() => {
            Err(VmmError::NicIntoCloudHypervisor)
        }
        VmmTarget::CloudHypervisor { api } => {
            let body = ch::disk_config(&req.socket, id, req.queues, req.queue_size, read_only);
            let d = match ch::add_disk(api, &body) {
                Ok(d) => d,
                Err(e @ ChError::ColdAdded { .. }) => {
                    // The VM is not running: the disk went into its configuration only.
                    // Take it out again, so that it does not later boot on a gone socket.
                    let _ = ch::remove_device(api, id);
                    return Err(VmmError::CloudHypervisor(e));
                }
                Err(e) => return Err(VmmError::CloudHypervisor(e)),
            };
            tracing::info!(id, api = %api.display(), bdf = %d.bdf, "plugged into Cloud Hypervisor");
            Ok(VmmPlug {
                target: target.clone(),
                device_id: d.id,
                location: d.bdf,
            })
        }
    }
}

fn unplug(p: &VmmPlug, timeout: Duration) -> Result<(), VmmError> {
    match &p.target {
        VmmTarget::Qemu { qmp } => qemu::unplug(qmp, &p.device_id, timeout).map_err(VmmError::Qemu),
        VmmTarget::CloudHypervisor { api } => {
            ch::remove_device(api, &p.device_id).map_err(VmmError::CloudHypervisor)
        }
    }
}

/// The key the lender must prove: the one the lease token names, or the one the attach
/// request gives (they must agree when both are there).
fn expected_lender_key(
    given: Option<&str>,
    token: &[u8],
) -> Result<Option<devlend_fabric::lease_token::PublicKey>, RegistryError> {
    use devlend_fabric::lease_token::{LeaseToken, PublicKey};
    let given = given
        .map(PublicKey::from_text)
        .transpose()
        .map_err(|e| RegistryError::BadRequest(format!("lender_key: {e}")))?;
    let named = if token.is_empty() {
        None
    } else {
        LeaseToken::from_bytes(token.to_vec())
            .claims_unverified()
            .ok()
            .and_then(|c| c.provider_key)
            .and_then(|k| PublicKey::from_bytes(&k).ok())
    };
    match (given, named) {
        (Some(g), Some(n)) if g != n => Err(RegistryError::BadRequest(format!(
            "lender_key {} is not the key the lease names, {}",
            g.to_text(),
            n.to_text()
        ))),
        (g, n) => Ok(n.or(g)),
    }
}

#[cfg(test)]
mod resolve_tests {
    use super::*;

    #[test]
    fn the_lender_key_comes_from_the_token_or_the_request_and_they_must_agree() {
        use devlend_fabric::lease_token::{LeaseClaims, TokenSigner};
        let pool = TokenSigner::from_seed([1; 32]);
        let lender = TokenSigner::from_seed([2; 32]).public_key();
        let other = TokenSigner::from_seed([3; 32]).public_key();
        let token = |key: Option<[u8; 32]>| {
            pool.sign(&LeaseClaims {
                lease_id: [4; 16],
                expires_at_ms: 1,
                provider: "p".into(),
                device: "d".into(),
                consumer: "c".into(),
                provider_key: key,
                qos: None,
                successor_of: None,
            })
            .unwrap()
            .as_bytes()
            .to_vec()
        };
        let keyed = token(Some(lender.to_bytes()));
        assert_eq!(expected_lender_key(None, &[]).unwrap(), None);
        assert_eq!(expected_lender_key(None, &keyed).unwrap(), Some(lender));
        assert_eq!(expected_lender_key(None, &token(None)).unwrap(), None);
        let given = lender.to_text();
        assert_eq!(
            expected_lender_key(Some(&given), &[]).unwrap(),
            Some(lender)
        );
        assert_eq!(
            expected_lender_key(Some(&given), &keyed).unwrap(),
            Some(lender)
        );
        assert!(expected_lender_key(Some(&other.to_text()), &keyed).is_err());
        assert!(expected_lender_key(Some("nope"), &[]).is_err());
    }

    #[test]
    fn a_saved_attachment_given_up_is_not_restored_later() {
        // Found by a trial: the restore thread kept retrying an attachment detached while
        // it waited, and served it again once it could (it then took the device).
        let saved = crate::state::SavedAttachment {
            id: "d0".into(),
            request: serde_json::from_value(serde_json::json!({
                "lender": "127.0.0.1:1", "device": "d", "socket": "/nonexistent/devlend-r.sock",
            }))
            .unwrap(),
            borrower: crate::state::to_hex(&[7; 16]),
            token: String::new(),
            plug: None,
            kind: None,
        };
        let r = Registry::default();
        r.set_restoring(vec![saved.clone()]);
        assert!(r.cancel_restore("d0").is_some());
        assert!(matches!(
            r.restore(&saved),
            Err(RegistryError::Cancelled(_))
        ));
    }

    #[test]
    fn a_saved_attachment_of_each_kind_keeps_its_kind_while_it_waits() {
        let saved = |id: &str, kind: Option<DeviceKind>, request: serde_json::Value| {
            crate::state::SavedAttachment {
                id: id.into(),
                request: serde_json::from_value(request).unwrap(),
                borrower: crate::state::to_hex(&[7; 16]),
                token: String::new(),
                plug: None,
                kind,
            }
        };
        let req = |sock: &str, extra: serde_json::Value| {
            let mut v = serde_json::json!({
                "lender": "127.0.0.1:1", "device": sock, "socket": format!("/nonexistent/{sock}.sock"),
                "queues": 2, "queue_size": 512,
            });
            if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
                o.extend(e.clone());
            }
            v
        };
        let r = Registry::default();
        r.set_restoring(vec![
            saved(
                "b",
                Some(DeviceKind::Block),
                req("b", serde_json::json!({})),
            ),
            saved("n", Some(DeviceKind::Nic), req("n", serde_json::json!({}))),
            saved(
                "p",
                Some(DeviceKind::Pci),
                req("p", serde_json::json!({"kind": "pci"})),
            ),
            // Saved before kinds were: the request tells a PCIe function, else a disk.
            saved(
                "p-old",
                None,
                req("p-old", serde_json::json!({"kind": "pci"})),
            ),
            saved("b-old", None, req("b-old", serde_json::json!({}))),
        ]);
        let list = r.list();
        let kinds: Vec<(&str, DeviceKind)> =
            list.iter().map(|a| (a.id.as_str(), a.kind())).collect();
        assert_eq!(
            kinds,
            [
                ("b", DeviceKind::Block),
                ("b-old", DeviceKind::Block),
                ("n", DeviceKind::Nic),
                ("p", DeviceKind::Pci),
                ("p-old", DeviceKind::Pci),
            ]
        );
        for a in &list {
            assert!(a.restoring.is_some(), "{}", a.id);
        }
        let b = list[0].block().unwrap();
        assert_eq!((b.queues, b.queue_size, b.capacity_sectors), (2, 512, 0));
        let n = list[2].nic().unwrap();
        assert_eq!((n.queue_pairs, n.queue_size), (2, 512));
        assert_eq!(n.mac, "");
        assert_eq!(list[3].pci().unwrap(), &PciInfo::default());
        // In the JSON too.
        let v = serde_json::to_value(&list).unwrap();
        assert_eq!(v[2]["kind"], "nic");
        assert!(v[2].get("capacity_sectors").is_none(), "{v}");
        assert_eq!(v[3]["kind"], "pci");
        assert!(v[3]
            .get("counters")
            .is_some_and(|c| c.get("reads").is_none()));
        // And the state file keeps each kind.
        let dir = tempfile::tempdir().unwrap();
        let mut r = r;
        r.set_state_file(dir.path().join("state.json"));
        r.check_state_file().unwrap();
        let file = crate::state::StateFile::load(&dir.path().join("state.json")).unwrap();
        let kinds: Vec<Option<DeviceKind>> = file.attachments.iter().map(|s| s.kind).collect();
        assert_eq!(
            kinds,
            [
                Some(DeviceKind::Block),
                Some(DeviceKind::Nic),
                Some(DeviceKind::Pci),
                Some(DeviceKind::Pci),
                Some(DeviceKind::Block),
            ]
        );
    }

    #[test]
    fn rdma_exposure_is_refused_without_rdma() {
        let req = |v: serde_json::Value| -> AttachRequest { serde_json::from_value(v).unwrap() };
        let base = serde_json::json!({
            "lender": "127.0.0.1:1", "device": "d", "socket": "/nonexistent/devlend-test.sock",
        });
        // The default is request-bounded, and is not written out.
        let plain = req(base.clone());
        assert_eq!(plain.rdma_exposure, crate::api::RdmaExposure::Request);
        assert!(serde_json::to_value(&plain)
            .unwrap()
            .get("rdma_exposure")
            .is_none());
        let mut v = base;
        v["rdma_exposure"] = "guest-memory".into();
        match Registry::default().attach(req(v)) {
            Err(RegistryError::BadRequest(m)) => assert!(m.contains("rdma_exposure"), "{m}"),
            other => panic!("guest-memory exposure over TCP: {:?}", other.map(|i| i.id)),
        }
    }

    #[test]
    fn addresses_resolve_direct_or_through_the_gateway() {
        let gw = ("a".to_owned(), "10.0.0.1:7710".to_owned());
        let d = resolve("10.0.0.9:7700", "disk0", Some(&gw)).unwrap();
        assert_eq!(d.addr, "10.0.0.9:7700");
        assert!(d.relay.is_none());
        let r = resolve("b/store1", "disk0", Some(&gw)).unwrap();
        assert_eq!(r.addr, "10.0.0.1:7710");
        assert_eq!(
            r.relay,
            Some(devlend_fabric::relay::Route {
                cluster: "b".into(),
                lender: "store1".into()
            })
        );
        assert_eq!(r.device, "disk0");
        let r = resolve("", "b/store1/disk0", Some(&gw)).unwrap();
        assert_eq!(r.device, "disk0");
        assert_eq!(r.relay.unwrap().lender, "store1");
        let e = resolve("b/store1", "disk0", None).unwrap_err();
        assert!(e.contains("no gateway"), "{e}");
        assert!(resolve("b/", "disk0", Some(&gw)).is_err());
        assert!(resolve("b/x/y", "disk0", Some(&gw)).is_err());
        assert!(resolve("", "disk0", Some(&gw)).is_err());
    }
}

//! The attachments of a compute agent: one `Registry` attaches (validating the request,
//! reserving its id and socket), lists, detaches and saves them under its locks. Its
//! parts: [`start`] starts and plugs an attachment, [`restore`] serves saved ones again
//! after a restart, [`view`] builds what the API shows, [`plug`] is the VMM glue,
//! [`resolve`] where sessions go, [`lender_key`] the key a lender must prove,
//! [`handover`] a live migration's handover.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use devlend_backend::attachment::{Attachment, AttachmentConfig, AttachmentError, Serve};
use devlend_backend::lender::{new_borrower_id, LenderTarget};

use self::served::served;
use crate::api::{AttachRequest, AttachmentInfo, DeviceKind, KindInfo, VmmPlug, VmmTarget};
use crate::lease::{CheckedLease, LeaseError, LeaseKeeper};
use crate::state::{self, SavedAttachment, StateFile};
use crate::vmm::cloud_hypervisor::{self as ch, ChError};
use crate::vmm::link_watch::LinkWatch;
use crate::vmm::qemu::{self, PlugKind};

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
    /// The kind it served, if the state file says (files from before kinds were saved
    /// do not): the lender must still lend that kind.
    kind: Option<crate::api::DeviceKind>,
}

/// What a started attachment is made of.
type Started = (
    Attachment,
    Option<VmmPlug>,
    Option<LeaseKeeper>,
    [u8; 16],
    Vec<u8>,
    // The paths beside the lender's address: the request's, or its lease's.
    Vec<String>,
);

/// Lifetime of a direct-mode handover token (10 years): the destination presents it
/// for as long as its attachment lives, and cannot mint another (the source signed it);
/// the destination's key, which it names, is what protects it. An attachment's own
/// tokens are minted for each hello instead
/// (`devlend_backend::lender::target::MINTED_TOKEN_LIFETIME_MS`).
const DIRECT_TOKEN_LIFETIME_MS: u64 = 10 * 365 * 24 * 3600 * 1000;

use devlend_fabric::lease_token::now_ms;

mod handover;
mod lender_key;
mod plug;
mod resolve;
mod restore;
mod served;
mod start;
#[cfg(test)]
mod tests;
mod view;
mod vmm_error;
mod vms;

use lender_key::expected_lender_key;
use plug::{plug, unplug};
pub use resolve::{resolve, Resolved};
use restore::Restoring;
use view::{info, kind, restoring_info};
pub use vmm_error::VmmError;

/// Largest busy-poll budget an attachment may ask for, in microseconds.
pub const MAX_POLL_US: u32 = 1000;

/// Attachments by id.
#[derive(Default)]
pub struct Registry {
    entries: Mutex<BTreeMap<String, Entry>>,
    /// Ids and sockets of attachments being set up.
    pending: Mutex<Vec<(String, std::path::PathBuf)>>,
    rates: crate::rates::RateTracker,
    /// Signs the tokens of direct (lease-less) attachments, when configured; they name
    /// it as their holder.
    signer: Option<devlend_fabric::holder_proof::HolderKey>,
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
    /// The identity of each VM named by a PCIe function's `vm` ([`vms`]).
    vms: vms::VmIdentities,
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl Registry {
    /// Whether the pool answers this agent, for the metrics.
    pub fn pool_health(&self) -> devlend_daemon::pool_health::PoolHealth {
        self.pool.health.clone()
    }

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

    /// Authenticates direct attachments: each gets tokens signed with `signer` (claims:
    /// its borrower identity, the device, an empty provider, `signer`'s public key as
    /// the holder's, and an expiry 5 minutes on: a fresh token for every hello), which a lender given the public key
    /// (`--auth-key`) checks, with the proof of holding `signer` in every handshake.
    pub fn set_signer(&mut self, signer: devlend_fabric::lease_token::TokenSigner) {
        self.signer = Some(devlend_fabric::holder_proof::HolderKey::new(signer));
    }

    /// How to mint `token` afresh for every hello: when it is this agent's own
    /// direct-mode token (no provider, no predecessor, its holder key this agent's
    /// `--auth-key-file` key). Handover tokens, which another agent signed, are not.
    pub(crate) fn mint_for(&self, token: &[u8]) -> Option<devlend_backend::lender::target::Mint> {
        let key = self.signer.as_ref()?;
        let claims = devlend_fabric::lease_token::LeaseToken::from_bytes(token.to_vec())
            .claims_unverified()
            .ok()?;
        (claims.provider.is_empty()
            && claims.successor_of.is_none()
            && claims.holder_key == Some(key.public_key().to_bytes()))
        .then(|| devlend_backend::lender::target::Mint {
            key: key.clone(),
            claims,
        })
    }

    /// The key of this agent that `token` names as its holder (the pool key for a pool
    /// lease granted to this host, the direct-mode key for its own tokens and for
    /// handovers to it); `None` for a bearer token, or one that names a key this agent
    /// does not have (the lender refuses it either way).
    pub(crate) fn holder_for(
        &self,
        token: &[u8],
    ) -> Option<devlend_fabric::holder_proof::HolderKey> {
        if token.is_empty() {
            return None;
        }
        let named = devlend_fabric::lease_token::LeaseToken::from_bytes(token.to_vec())
            .claims_unverified()
            .ok()?
            .holder_key?;
        let pool = self
            .pool
            .identity
            .as_ref()
            .map(|k| devlend_fabric::holder_proof::HolderKey(std::sync::Arc::clone(k)));
        [self.signer.clone(), pool]
            .into_iter()
            .flatten()
            .find(|k| k.public_key().to_bytes() == named)
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

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Vec<(String, std::path::PathBuf)>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
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
        if let Some(vm) = &req.vm {
            if req.kind != crate::api::AttachKind::Pci {
                return Err(RegistryError::BadRequest(
                    "vm applies to kind pci only: it names the VM PCIe functions are lent to \
                     (peer-to-peer between them)"
                        .into(),
                ));
            }
            if !crate::api::valid_vm_name(vm) {
                return Err(RegistryError::BadRequest(format!(
                    "invalid vm {vm:?}: 1..={} letters, digits, '.', '_' or '-'",
                    crate::api::MAX_VM_NAME
                )));
            }
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
        let unreachable = self.pool.health.unreachable_since_ms();
        for a in &mut all {
            if let KindInfo::Block(b) = &mut a.part {
                b.rates = self.rates.rates(&a.id);
            }
            a.pool_unreachable_since_ms = a.lease.and(unreachable);
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
            .filter_map(|e| Some((e.id.clone(), served(e.attachment.part()).io_counters()?)))
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
        a.pool_unreachable_since_ms = a.lease.and(self.pool.health.unreachable_since_ms());
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
        tracing::info!(id, kind = %out.kind(), socket = %out.socket.display(), "detached");
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

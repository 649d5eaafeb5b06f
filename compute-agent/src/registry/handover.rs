//! A live migration's handover of a device between two compute agents
//! (`docs/migration.md`).
//!
//! The source issues a handover token for an attachment ([`Registry::handover`]): a
//! lease token for a new lease id whose `successor_of` is the attachment's own lease,
//! signed with the agent's key (`auth_key_file`), which the lender trusts. The
//! destination attaches with it ([`incoming`]); the lender admits its holding session
//! as a standby and hands it the device when the source lets go, which the source does
//! when QEMU stops the device at the end of the migration
//! (`devlend_backend::handover`). [`Registry::finish_handover`] then removes the source
//! attachment without unplugging it from a VM that is no longer there;
//! [`Registry::cancel_handover`] keeps it.

use devlend_backend::attachment::Attachment;
use devlend_backend::lender::new_borrower_id;
use devlend_fabric::lease_token::{LeaseClaims, LeaseToken, TokenSigner};

use super::served::served;
use super::{now_ms, Registry, RegistryError, DIRECT_TOKEN_LIFETIME_MS};
use crate::api::{AttachmentInfo, HandoverInfo, HandoverState};

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The refusal of a second handover token while one is pending.
fn pending(id: &str) -> RegistryError {
    RegistryError::Conflict(format!(
        "attachment {id} is being handed over already: its token stands (the destination that presents it first takes the device); to issue another, call this one off with `devlend migrate cancel {id}`"
    ))
}

/// Where `attachment` is in a handover, for its status.
pub(super) fn state(attachment: &Attachment) -> Option<HandoverState> {
    let h = attachment.handover();
    if h.is_let_go() {
        Some(HandoverState::LetGo)
    } else if h.is_active() {
        Some(HandoverState::Asked)
    } else {
        None
    }
}

/// The borrower identity and token of a destination attaching `device` with handover
/// token `text`: the token's lease id and the token itself. The lender checks the
/// signature; this checks what the agent can: that it is a handover token, for this
/// device, not expired.
///
/// # Errors
/// [`RegistryError::BadRequest`] saying which.
pub(super) fn incoming(
    text: &str,
    device: &str,
    with_lease: bool,
) -> Result<([u8; 16], Vec<u8>), RegistryError> {
    if with_lease {
        return Err(RegistryError::BadRequest(
            "handover_token and lease exclude each other: under a pool, the handover's lease (its token and id) is the lease".into(),
        ));
    }
    let token = LeaseToken::from_text(text.trim())
        .map_err(|e| RegistryError::BadRequest(format!("handover_token: {e}")))?;
    let claims = token
        .claims_unverified()
        .map_err(|e| RegistryError::BadRequest(format!("handover_token: {e}")))?;
    if !claims.provider.is_empty() {
        return Err(RegistryError::BadRequest(
            "handover_token was granted by a pool: attach with it as the lease (lease: {pool, id, token})".into(),
        ));
    }
    if claims.successor_of.is_none() {
        return Err(RegistryError::BadRequest(
            "handover_token is a lease token, not a handover token (it names no lease to take over from)".into(),
        ));
    }
    if claims.device != device {
        return Err(RegistryError::BadRequest(format!(
            "handover_token is for device {:?}, not {device:?}",
            claims.device
        )));
    }
    if claims.expires_at_ms <= now_ms() {
        return Err(RegistryError::BadRequest(
            "handover_token has expired".into(),
        ));
    }
    Ok((claims.lease_id, token.as_bytes().to_vec()))
}

impl Registry {
    /// Issues a handover token for attachment `id` and lets its device go when its VM
    /// stops (the end of the migration). In direct mode the agent signs it with its key;
    /// under a pool lease the pool grants the destination compute host `to` a new lease
    /// that names this one as predecessor. One token per handover: while one is pending
    /// another is refused, until [`Self::cancel_handover`] calls it off.
    ///
    /// # Errors
    /// [`RegistryError::NotFound`]; [`RegistryError::BadRequest`] for what cannot
    /// migrate (a PCIe function: QEMU's vfio-user client has no migration support) and a
    /// pool lease without `to`; [`RegistryError::Conflict`] while a handover is pending;
    /// [`RegistryError::Lease`] for the pool's refusal.
    pub fn handover(
        &self,
        id: &str,
        to: Option<&str>,
        to_key: Option<&str>,
    ) -> Result<HandoverInfo, RegistryError> {
        let to_key = to_key
            .map(|k| {
                devlend_fabric::lease_token::PublicKey::from_text(k)
                    .map_err(|e| RegistryError::BadRequest(format!("to_key (--to-key): {e}")))
            })
            .transpose()?;
        // What the token needs, read under the lock; the pool is asked without it.
        let (device, lender, from, own, pool, lender_key) = {
            let entries = self.lock();
            let e = entries
                .get(id)
                .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
            served(e.attachment.part()).check_handover()?;
            if e.attachment.handover().is_active() {
                return Err(pending(id));
            }
            let own = (!e.token.is_empty())
                .then(|| {
                    LeaseToken::from_bytes(e.token.clone())
                        .claims_unverified()
                        .ok()
                })
                .flatten();
            let pool = e.lease.as_ref().map(|k| (k.client().clone(), k.id()));
            if pool.is_none() && to.is_some() {
                return Err(RegistryError::BadRequest(
                    "compute_host (--to) is for an attachment under a pool lease; in direct mode the token is the handover (name the destination's key with --to-key)".into(),
                ));
            }
            if pool.is_some() && to_key.is_some() {
                return Err(RegistryError::BadRequest(
                    "to_key (--to-key) is for direct mode; under a pool lease the token names the key the pool enrolled for the destination (--to HOST)".into(),
                ));
            }
            // The lender's key the source checks (`--lender-key`), for the destination to
            // check too.
            let lender_key = e
                .request
                .lender_key
                .as_deref()
                .and_then(|k| devlend_fabric::lease_token::PublicKey::from_text(k).ok())
                .map(|k| k.to_bytes());
            (
                e.attachment.config().lender.device.clone(),
                (e.request.lender.clone(), e.request.paths.clone()),
                e.borrower,
                own,
                pool,
                lender_key,
            )
        };
        let (token, lease, pool_url) = match pool {
            Some((client, lease_id)) => {
                let to = to.filter(|t| !t.is_empty()).ok_or_else(|| {
                    RegistryError::BadRequest(
                        "the attachment holds its device under a pool lease: name the destination compute host (compute_host, devlend migrate handover --to HOST)".into(),
                    )
                })?;
                let grant = client
                    .handover_lease(lease_id, to)
                    .map_err(|e| RegistryError::Lease(crate::lease::LeaseError::Pool(e)))?;
                (
                    grant.token,
                    grant.lease.id.simple().to_string(),
                    // Every server of the pool, for the destination's renewals.
                    Some(client.pool_url()),
                )
            }
            None => {
                let claims = LeaseClaims {
                    lease_id: new_borrower_id(),
                    expires_at_ms: now_ms().saturating_add(DIRECT_TOKEN_LIFETIME_MS),
                    provider: String::new(),
                    device: device.clone(),
                    consumer: id.to_owned(),
                    // The source's own claims carry over: the lender's key the
                    // destination must make the lender prove, and the limits.
                    provider_key: own.as_ref().and_then(|c| c.provider_key).or(lender_key),
                    qos: own.as_ref().and_then(|c| c.qos),
                    successor_of: Some(from),
                    epoch: None,
                    // Only the destination may present it: its key, or this agent's
                    // own for hosts that share a key file.
                    holder_key: to_key
                        .or_else(|| self.signer.as_ref().map(|s| s.public_key()))
                        .map(|k| k.to_bytes()),
                };
                // Without a key (a lender without authentication, on loopback) nothing
                // checks the signature: any key will do.
                let ephemeral;
                let signer = match &self.signer {
                    Some(s) => &*s.0,
                    None => {
                        ephemeral = TokenSigner::generate().map_err(|e| {
                            RegistryError::BadRequest(format!("cannot make a handover key: {e}"))
                        })?;
                        &ephemeral
                    }
                };
                let token = signer.sign(&claims).map_err(|e| {
                    RegistryError::BadRequest(format!("cannot sign a handover token: {e}"))
                })?;
                (token.to_text(), hex(&claims.lease_id), None)
            }
        };
        {
            let entries = self.lock();
            let e = entries
                .get(id)
                .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
            // Two requests at once: the first one's token stands.
            if !e.attachment.handover().try_begin() {
                return Err(pending(id));
            }
        }
        tracing::info!(id, to = %lease, "handover asked: the device is let go when the VM stops");
        Ok(HandoverInfo {
            attachment: id.to_owned(),
            lender: lender.0,
            paths: lender.1,
            device,
            handover_token: token,
            lease,
            from_lease: hex(&from),
            pool: pool_url,
        })
    }

    /// Calls off the handover of attachment `id` (the migration failed or was
    /// cancelled): the attachment keeps its device, and takes it back if it let it go.
    ///
    /// # Errors
    /// [`RegistryError::NotFound`].
    pub fn cancel_handover(&self, id: &str) -> Result<AttachmentInfo, RegistryError> {
        let entries = self.lock();
        let e = entries
            .get(id)
            .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
        if !e.attachment.handover().is_active() {
            return Err(RegistryError::Conflict(format!(
                "attachment {id} has no handover to call off"
            )));
        }
        e.attachment.handover().cancel();
        tracing::info!(id, "handover called off: the attachment keeps its device");
        Ok(super::info(e))
    }

    /// Removes attachment `id` after its VM migrated away: as a detach, without
    /// unplugging it from the VM (which has stopped here and runs on the destination).
    ///
    /// # Errors
    /// [`RegistryError::NotFound`]; [`RegistryError::Conflict`] if no handover was asked
    /// for it.
    pub fn finish_handover(&self, id: &str) -> Result<AttachmentInfo, RegistryError> {
        let mut entry = {
            let mut entries = self.lock();
            let e = entries
                .get(id)
                .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
            let h = e.attachment.handover();
            if !h.is_active() {
                return Err(RegistryError::Conflict(format!(
                    "attachment {id} is not being handed over: ask for a handover first, or detach it"
                )));
            }
            // The VM must have stopped here (QEMU stopped the device at the end of the
            // migration), or gone: finishing under a running VM would pull its disk.
            if !h.is_let_go() && e.attachment.connected() {
                return Err(RegistryError::Conflict(format!(
                    "attachment {id}: its VM still runs here (QEMU has not stopped the device): finish after the migration completed, or cancel it"
                )));
            }
            let e = entries
                .remove(id)
                .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
            let _ = self.save_state(&entries);
            e
        };
        entry.attachment.stop();
        let mut out = super::info(&entry);
        out.connected = false;
        // The destination holds its own lease: this one ends.
        if let Some(k) = entry.lease.take() {
            k.release();
        }
        tracing::info!(id, "handed over: removed after the migration");
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(edit: impl FnOnce(&mut LeaseClaims)) -> String {
        let mut c = LeaseClaims {
            lease_id: [4; 16],
            expires_at_ms: u64::MAX,
            provider: String::new(),
            device: "disk0".into(),
            consumer: "a".into(),
            provider_key: None,
            qos: None,
            successor_of: Some([5; 16]),
            epoch: None,
            holder_key: None,
        };
        edit(&mut c);
        TokenSigner::from_seed([1; 32]).sign(&c).unwrap().to_text()
    }

    #[test]
    fn a_destination_takes_the_token_s_lease_id_as_its_identity() {
        let t = token(|_| {});
        let (borrower, bytes) = incoming(&t, "disk0", false).unwrap();
        assert_eq!(borrower, [4; 16]);
        assert_eq!(LeaseToken::from_bytes(bytes).to_text(), t);
    }

    #[test]
    fn what_is_not_a_handover_token_for_this_device_is_refused() {
        let msg = |r: Result<_, RegistryError>| match r {
            Err(RegistryError::BadRequest(m)) => m,
            other => panic!("{:?}", other.map(|_| ())),
        };
        assert!(msg(incoming(&token(|_| {}), "disk1", false)).contains("not \"disk1\""));
        assert!(
            msg(incoming(&token(|c| c.successor_of = None), "disk0", false))
                .contains("not a handover token")
        );
        assert!(msg(incoming(&token(|c| c.expires_at_ms = 1), "disk0", false)).contains("expired"));
        assert!(msg(incoming("garbage!", "disk0", false)).contains("handover_token"));
        assert!(msg(incoming(&token(|_| {}), "disk0", true)).contains("exclude"));
    }
}

//! Starting an attachment: its lease checked, where its sessions go, its credentials
//! (lease, saved or signed direct token), the backend started and plugged into the VM,
//! then recorded and saved.

use super::*;

impl Registry {
    /// The TLS target of a request asking for TLS; `None` for one that does not.
    pub(super) fn tls_target(
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

    pub(super) fn start_and_plug(
        &self,
        id: &str,
        req: &AttachRequest,
        restore: Option<Restore>,
    ) -> Result<Started, RegistryError> {
        let checked = match &req.lease {
            None => None,
            Some(r) => {
                let checked = if restore.is_some() {
                    CheckedLease::check_within(r, &self.pool, crate::lease::RESTORE_TIMEOUT)
                } else {
                    CheckedLease::check(r, &self.pool)
                };
                let c = match checked {
                    Ok(c) => c,
                    // Served again while the pool is away: from the saved token. The
                    // lender judges it; the renewals start when the pool answers.
                    Err(LeaseError::Pool(e)) if restore.is_some() && e.status().is_none() => {
                        tracing::warn!(id, lease = %r.id, error = %devlend_fabric::error::chain(&e), "device pool unreachable: serving the attachment again with its saved lease token");
                        CheckedLease::offline(r, &req.lender, &self.pool)
                            .map_err(RegistryError::Lease)?
                    }
                    Err(e) => return Err(RegistryError::Lease(e)),
                };
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
        // A leased attachment without paths of its own takes every further address its
        // lender registered with the pool: not a PCIe function's (its sessions have one
        // path yet), nor through a gateway. A NIC's queue pairs spread over them too.
        let paths = match &checked {
            Some(c)
                if req.paths.is_empty()
                    && req.kind != crate::api::AttachKind::Pci
                    && resolved.relay.is_none() =>
            {
                c.paths().to_vec()
            }
            _ => req.paths.clone(),
        };
        check_paths(&paths, req.kind, &resolved).map_err(RegistryError::BadRequest)?;
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
                    expires_at_ms: now_ms()
                        .saturating_add(devlend_backend::lender::target::MINTED_TOKEN_LIFETIME_MS),
                    provider: String::new(),
                    device: resolved.device.clone(),
                    consumer: id.to_owned(),
                    provider_key: None,
                    qos: None,
                    successor_of: None,
                    epoch: None,
                    holder_key: Some(signer.public_key().to_bytes()),
                };
                let token = signer
                    .0
                    .sign(&claims)
                    .map_err(|e| RegistryError::BadRequest(format!("cannot sign a token: {e}")))?;
                (borrower, token.as_bytes().to_vec())
            }
            (None, None, None, None) => (new_borrower_id(), Vec::new()),
        };
        // This agent's own direct-mode token (a new one, or a restored one): minted
        // afresh for every hello, and now.
        let mint = self.mint_for(&token);
        let token = match mint
            .as_ref()
            .map(devlend_backend::lender::target::Mint::token)
        {
            Some(Ok(t)) => t,
            _ => token,
        };
        let lender_key = expected_lender_key(req.lender_key.as_deref(), &token)?;
        // A PCIe function of a named VM joins that VM's peer group (a restored one
        // too: its saved request names the VM).
        let peer_group = match (req.kind, &req.vm) {
            (crate::api::AttachKind::Pci, Some(vm)) => Some(self.vms.identity(vm)),
            _ => None,
        };
        let mut attachment = Attachment::start(AttachmentConfig {
            id: id.to_owned(),
            socket: req.socket.clone(),
            lender: LenderTarget {
                addr: resolved.addr.clone(),
                alt_addrs: paths.clone(),
                device: resolved.device.clone(),
                borrower,
                token: token.clone(),
                tls,
                lender_key,
                holder: self.holder_for(&token),
                mint,
                transport: match req.transport {
                    crate::api::Transport::Tcp => devlend_backend::lender::Transport::Tcp {
                        relay: resolved.relay.clone(),
                    },
                    crate::api::Transport::Rdma => devlend_backend::lender::Transport::Rdma {
                        exposure: req.rdma_exposure,
                    },
                },
            },
            num_queues: req.queues,
            poll: std::time::Duration::from_micros(u64::from(req.poll_us)),
            reconnect_deadline: Duration::from_secs(u64::from(req.reconnect_deadline_s)),
            serve: match req.kind {
                crate::api::AttachKind::Device => Serve::VhostUser,
                crate::api::AttachKind::Pci => Serve::VfioUser,
            },
            expect: restore.as_ref().and_then(|r| r.kind),
            peer_group,
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
        Ok((attachment, plug, keeper, borrower, token, paths))
    }

    /// With `id` and the request's socket free: reserves them, starts the attachment
    /// (plugging it into the VM unless restored), records it and saves the state.
    pub(super) fn start_reserved(
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
        let (attachment, plug, lease, borrower, token, paths) = result?;
        // Saved with the paths it runs on: a restore while the pool is away has them.
        let req = AttachRequest { paths, ..req };
        let link_watch = match &plug {
            Some(VmmPlug {
                target: VmmTarget::Qemu { qmp },
                device_id,
                ..
            }) => served(attachment.part()).follow_link(device_id, qmp),
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
        tracing::info!(id = %out.id, kind = %out.kind(), device = %out.device, lender = %out.lender, socket = %out.socket.display(), restored, "attached");
        Ok(out)
    }
}

/// Checks an attachment's further paths, for a lender reached directly and not a PCIe
/// function: the pool's rule for a lender's further fabric addresses
/// ([`devlend_pool::rules::fabric_paths`]: at most
/// [`devlend_pool::api::MAX_FABRIC_PATHS`], `HOST:PORT`
/// each, no wildcard, distinct, none the lender address).
fn check_paths(
    paths: &[String],
    kind: crate::api::AttachKind,
    resolved: &Resolved,
) -> Result<(), String> {
    if paths.is_empty() {
        return Ok(());
    }
    if resolved.relay.is_some() {
        return Err("paths are addresses of a lender reached directly: not with a lender reached through a gateway".into());
    }
    if kind == crate::api::AttachKind::Pci {
        return Err("paths are not supported for a PCIe function (kind pci) yet".into());
    }
    devlend_pool::rules::fabric_paths(&resolved.addr, paths).map_err(|e| format!("paths: {e}"))
}

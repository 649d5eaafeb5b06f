//! Saved attachments served again after a restart: those waiting (listed, their ids and
//! sockets reserved, kept in the state file) and serving them again with their saved
//! identity.

use super::*;

/// A saved attachment waiting to be served again, and why it is not yet.
#[derive(Debug, Clone)]
pub(super) struct Restoring {
    /// As in the state file.
    pub(super) saved: SavedAttachment,
    /// Why it is not served yet, for `status`.
    pub(super) reason: String,
}

impl Registry {
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
    pub(super) fn cancel_restore(&self, id: &str) -> Option<AttachmentInfo> {
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
                kind: saved.kind,
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::PciInfo;

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
    fn a_restored_attachment_whose_device_changed_kind_is_refused() {
        // Found by a trial: a disk saved in the state file came back as a NIC on the
        // same socket (vhost-user-net where the VM expects vhost-user-blk) when the
        // lender's configuration lent that name as another kind after the restart.
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let spec = devlend_device_agent::DeviceSpec::new(
            "dev",
            devlend_device_agent::BlockSpec::new(img.clone()),
        );
        let lender = devlend_device_agent::Lender::bind("127.0.0.1:0", vec![spec])
            .unwrap()
            .spawn();
        let sock = dir.path().join("dev.sock");
        let saved = |kind| crate::state::SavedAttachment {
            id: "d0".into(),
            request: serde_json::from_value(serde_json::json!({
                "lender": lender.local_addr().to_string(), "device": "dev", "socket": sock,
            }))
            .unwrap(),
            borrower: crate::state::to_hex(&[7; 16]),
            token: String::new(),
            plug: None,
            kind,
        };
        let r = Registry::default();
        let was_nic = saved(Some(DeviceKind::Nic));
        r.set_restoring(vec![was_nic.clone()]);
        let err = r.restore(&was_nic).unwrap_err();
        assert!(
            matches!(
                &err,
                RegistryError::Start(AttachmentError::KindChanged {
                    expected: DeviceKind::Nic,
                    lent: DeviceKind::Block,
                    ..
                })
            ),
            "{err}"
        );
        assert!(
            !sock.exists(),
            "the socket was bound for a device of another kind"
        );
        assert!(r.is_restoring("d0"), "it still waits (detach gives it up)");
        assert!(r.list().is_empty() || r.list().iter().all(|i| i.restoring.is_some()));

        // Saved as the block device it is, it is served again.
        let was_block = saved(Some(DeviceKind::Block));
        r.set_restoring(vec![was_block.clone()]);
        let info = r.restore(&was_block).unwrap();
        assert_eq!(info.kind(), DeviceKind::Block);
        assert!(sock.exists());
        r.detach_all();
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
}

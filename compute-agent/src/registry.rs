//! The attachments of a compute agent.

use std::collections::BTreeMap;
use std::sync::Mutex;

use devlend_backend::blk::engine::{new_borrower_id, LenderTarget};
use devlend_backend::blk::{Attachment, AttachmentConfig, AttachmentError};

use crate::api::{AttachRequest, AttachmentInfo};

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
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

struct Entry {
    request: AttachRequest,
    id: String,
    attachment: Attachment,
}

/// Attachments by id.
#[derive(Default)]
pub struct Registry {
    entries: Mutex<BTreeMap<String, Entry>>,
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn info(e: &Entry) -> AttachmentInfo {
    let l = e.attachment.limits();
    let end = l
        .serial
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(l.serial.len());
    AttachmentInfo {
        id: e.id.clone(),
        lender: e.request.lender.clone(),
        device: e.request.device.clone(),
        socket: e.request.socket.clone(),
        queues: e.request.queues,
        queue_size: e.request.queue_size,
        capacity_sectors: l.capacity_sectors,
        block_size: l.block_size,
        read_only: l.read_only,
        serial: String::from_utf8_lossy(&l.serial[..end]).into_owned(),
        connected: e.attachment.connected(),
        counters: e.attachment.stats().into(),
    }
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Validates the request, starts the attachment and records it. Blocking (it talks
    /// to the lender): call from a blocking context.
    ///
    /// # Errors
    /// [`RegistryError`] for each refusal; nothing is left behind on error.
    pub fn attach(&self, req: AttachRequest) -> Result<AttachmentInfo, RegistryError> {
        if !(64..=1024).contains(&req.queue_size) || !req.queue_size.is_power_of_two() {
            return Err(RegistryError::BadRequest(format!(
                "queue size {} must be a power of two in 64..=1024",
                req.queue_size
            )));
        }
        if req.socket.as_os_str().is_empty() || !req.socket.is_absolute() {
            return Err(RegistryError::BadRequest(format!(
                "socket path {:?} must be absolute",
                req.socket
            )));
        }
        let id = {
            let entries = self.lock();
            if let Some(e) = entries.values().find(|e| e.request.socket == req.socket) {
                return Err(RegistryError::Conflict(format!(
                    "socket {} is already used by attachment {}",
                    req.socket.display(),
                    e.id
                )));
            }
            match &req.id {
                Some(id) if !valid_id(id) => {
                    return Err(RegistryError::BadRequest(format!(
                        "invalid attachment id {id:?}"
                    )))
                }
                Some(id) if entries.contains_key(id) => {
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
                        .find(|c| !entries.contains_key(c))
                        .unwrap_or(base)
                }
            }
        };
        let attachment = Attachment::start(AttachmentConfig {
            socket: req.socket.clone(),
            lender: LenderTarget {
                addr: req.lender.clone(),
                device: req.device.clone(),
                borrower: new_borrower_id(),
            },
            num_queues: req.queues,
        })
        .map_err(RegistryError::Start)?;
        let entry = Entry {
            request: req,
            id: id.clone(),
            attachment,
        };
        let out = info(&entry);
        let mut entries = self.lock();
        if entries.contains_key(&id) {
            // Lost a race for the same id: undo.
            drop(entries);
            let mut entry = entry;
            entry.attachment.stop();
            return Err(RegistryError::Conflict(format!(
                "attachment id {id:?} is taken"
            )));
        }
        entries.insert(id, entry);
        tracing::info!(id = %out.id, device = %out.device, lender = %out.lender, socket = %out.socket.display(), "attached");
        Ok(out)
    }

    /// All attachments, by id.
    pub fn list(&self) -> Vec<AttachmentInfo> {
        self.lock().values().map(info).collect()
    }

    /// One attachment.
    ///
    /// # Errors
    /// [`RegistryError::NotFound`].
    pub fn get(&self, id: &str) -> Result<AttachmentInfo, RegistryError> {
        self.lock()
            .get(id)
            .map(info)
            .ok_or_else(|| RegistryError::NotFound(id.to_owned()))
    }

    /// Stops an attachment: completes its requests in flight, disconnects the VMM and
    /// removes the socket. Blocking. Returns its final state.
    ///
    /// # Errors
    /// [`RegistryError::NotFound`].
    pub fn detach(&self, id: &str) -> Result<AttachmentInfo, RegistryError> {
        let mut entry = self
            .lock()
            .remove(id)
            .ok_or_else(|| RegistryError::NotFound(id.to_owned()))?;
        // Stop first, so that the counters include the requests drained.
        entry.attachment.stop();
        let mut out = info(&entry);
        out.connected = false;
        tracing::info!(id, socket = %out.socket.display(), "detached");
        Ok(out)
    }

    /// Detaches everything (shutdown).
    pub fn detach_all(&self) {
        let ids: Vec<String> = self.lock().keys().cloned().collect();
        for id in ids {
            let _ = self.detach(&id);
        }
    }
}

//! Starting a PCIe function attachment: one fabric session to the lender holds the
//! function and carries everything; the socket speaks vfio-user ([`crate::pci`]).

use super::*;

/// How long attaching a PCIe function retries while the lender answers busy (it may
/// still be quiescing the function for its previous borrower).
const PCI_BUSY_WAIT: Duration = Duration::from_secs(3);
/// Attaching a PCIe function: "busy" retried every 250 ms for [`PCI_BUSY_WAIT`].
const PCI_BUSY: Policy =
    Policy::backoff(Duration::from_millis(250), Duration::from_millis(250)).deadline(PCI_BUSY_WAIT);

impl Attachment {
    /// A PCIe function on a vfio-user socket: one fabric session to the lender holds the
    /// function and carries everything; the serving thread takes one VMM connection
    /// after the other.
    pub(super) fn start_pci(config: AttachmentConfig) -> Result<Self, AttachmentError> {
        let target = crate::pci::LinkTarget {
            lender: config.lender.addr.clone(),
            device: config.lender.device.clone(),
            borrower: config.lender.borrower,
            token: config.lender.token.clone(),
            tls: config.lender.tls.clone(),
            timeout: Duration::from_secs(10),
            transport: config.lender.transport.kind(),
            lender_key: config.lender.lender_key,
            holder: config.lender.holder.clone(),
        };
        // A function just given back by this compute agent (a detach, then an attach at
        // once) may still be quiescing on the lender, which answers busy meanwhile.
        let borrower = Reconnector::new(PCI_BUSY)
            .run(
                &SystemClock,
                |_| match crate::pci::PciBorrower::connect_in_group(&target, config.peer_group) {
                    Ok(b) => Attempt::Done(b),
                    Err(
                        e @ crate::pci::PciError::Connect(
                            devlend_fabric::tcp::ConnectError::Refused {
                                status: devlend_fabric::HelloStatus::Busy,
                                ..
                            },
                        ),
                    ) => Attempt::Failed(e),
                    Err(e) => Attempt::Refused(e),
                },
            )
            .map_err(|g| match g {
                GaveUp::Refused(e) | GaveUp::Deadline(e) => AttachmentError::Pci(e),
                GaveUp::Stopped => unreachable!("attaching is never stopped"),
            })?;
        let server = borrower
            .listen(&config.socket)
            .map_err(AttachmentError::Pci)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&config.socket, std::fs::Permissions::from_mode(0o660))
                .map_err(|source| AttachmentError::Listen {
                    path: config.socket.clone(),
                    source: vhost::vhost_user::Error::SocketError(source),
                })?;
        }
        let handle = borrower.handle();
        let shared = Arc::new(Serving::default());
        let thread = {
            let (shared, id) = (shared.clone(), config.id.clone());
            let mut borrower = borrower;
            std::thread::Builder::new()
                .name(format!("attach-{}", config.lender.device))
                .spawn(move || {
                    while !shared.stop.load(Ordering::Acquire) {
                        if let Err(e) = server.run(&mut borrower) {
                            tracing::info!(attachment = %id, error = %e, "vfio-user connection ended");
                        }
                        if shared.stop.load(Ordering::Acquire) {
                            break;
                        }
                        if let Err(e) = borrower.vmm_gone() {
                            tracing::warn!(attachment = %id, error = %e, "the PCI session is gone");
                            break;
                        }
                    }
                })
                .map_err(AttachmentError::Thread)?
        };
        Ok(Attachment {
            hold: None,
            part: Part::Pci(handle),
            shared,
            wake: EventFd::new(EFD_NONBLOCK).map_err(AttachmentError::Thread)?,
            thread: Some(thread),
            config,
        })
    }
}

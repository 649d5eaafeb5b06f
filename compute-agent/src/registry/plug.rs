//! Plugging an attachment into a running VM and out again (QEMU over QMP, Cloud
//! Hypervisor over its API).

use super::served::served;
use super::*;

pub(super) fn plug(
    target: &VmmTarget,
    id: &str,
    req: &AttachRequest,
    attachment: &Attachment,
) -> Result<VmmPlug, VmmError> {
    let device = served(attachment.part()).vmm_device(req)?;
    match (target, device) {
        (VmmTarget::Qemu { qmp }, kind) => {
            let p = qemu::plug(qmp, id, &req.socket, &kind).map_err(VmmError::Qemu)?;
            tracing::info!(id, qmp = %qmp.display(), port = %p.port, "plugged into QEMU");
            Ok(VmmPlug {
                target: target.clone(),
                device_id: p.device_id,
                location: p.port,
            })
        }
        (VmmTarget::CloudHypervisor { .. }, PlugKind::Net { .. }) => {
            Err(VmmError::NicIntoCloudHypervisor)
        }
        (
            VmmTarget::CloudHypervisor { api },
            PlugKind::Blk {
                num_queues,
                queue_size,
                read_only,
            },
        ) => {
            let body = ch::disk_config(&req.socket, id, num_queues, queue_size, read_only);
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

pub(super) fn unplug(p: &VmmPlug, timeout: Duration) -> Result<(), VmmError> {
    match &p.target {
        VmmTarget::Qemu { qmp } => qemu::unplug(qmp, &p.device_id, timeout).map_err(VmmError::Qemu),
        VmmTarget::CloudHypervisor { api } => {
            ch::remove_device(api, &p.device_id).map_err(VmmError::CloudHypervisor)
        }
    }
}

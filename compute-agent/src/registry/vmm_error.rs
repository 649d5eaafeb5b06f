//! What can fail when plugging an attachment into a VMM or out again: shared by the
//! VMM glue (`plug`) and the kinds it plugs (`served`), a leaf both import.

use crate::vmm::cloud_hypervisor::ChError;
use crate::vmm::qemu::HotplugError;

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
    /// A PCIe function is not hot-plugged: the VMM is started with its vfio-user
    /// device (`devlend status --qemu-args`).
    #[error("a PCIe function is not hot-plugged: start the VMM with its vfio-user device (devlend status --qemu-args)")]
    NotHotplugged,
}

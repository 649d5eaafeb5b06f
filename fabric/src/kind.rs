//! The kind of device a borrower serves, defined once: the handshake's description
//! says it ([`crate::DeviceDescription::kind`]), the borrower's attachment, the compute
//! agent's API and state file (`kind`) and the CLI show it.

use serde::{Deserialize, Serialize};

/// What kind of device a borrower serves, as the lender's handshake describes it
/// ([`crate::DeviceDescription::kind`]). JSON: `block`, `nic`, `pci`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// A block device, served on vhost-user-blk.
    Block,
    /// A network interface, served on vhost-user-net.
    Nic,
    /// A PCIe function, served on vfio-user.
    Pci,
}

impl DeviceKind {
    /// `block`, `nic` or `pci`, as in the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Block => "block",
            DeviceKind::Nic => "nic",
            DeviceKind::Pci => "pci",
        }
    }

    /// The kind in words: `block device`, `NIC`, `PCIe function`.
    pub fn noun(self) -> &'static str {
        match self {
            DeviceKind::Block => "block device",
            DeviceKind::Nic => "NIC",
            DeviceKind::Pci => "PCIe function",
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

//! The VMs that PCIe functions are attached for (the request's `vm`): each name gets a
//! random identity, the peer group its functions join on their lenders
//! ([`devlend_backend::pci::PciBorrower::connect_in_group`]).
//!
//! Every attachment of one name on this compute agent gets the same identity, and
//! different names different ones. The identities live as long as the agent (a name
//! keeps its identity after its last function is detached, so that an attach racing
//! that detach cannot split the VM); after a restart each name gets a new one, which
//! all the restored attachments of that name share.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use devlend_backend::lender::new_borrower_id;
use devlend_fabric::pci::VM_ID_LEN;

/// The identity of each VM name.
#[derive(Debug, Default)]
pub(super) struct VmIdentities(Mutex<HashMap<String, [u8; VM_ID_LEN]>>);

impl VmIdentities {
    /// The identity of VM `name`: the one it was given, or a new random one (not all
    /// zero, and no other name's).
    pub(super) fn identity(&self, name: &str) -> [u8; VM_ID_LEN] {
        let mut vms = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(id) = vms.get(name) {
            return *id;
        }
        let id = loop {
            let id = new_borrower_id();
            if id != [0; VM_ID_LEN] && !vms.values().any(|v| *v == id) {
                break id;
            }
        };
        vms.insert(name.to_owned(), id);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_identity_per_vm_name() {
        let vms = VmIdentities::default();
        let a = vms.identity("vm-a");
        assert_ne!(a, [0; VM_ID_LEN]);
        assert_eq!(vms.identity("vm-a"), a, "the same name, the same identity");
        let b = vms.identity("vm-b");
        assert_ne!(a, b, "another name, another identity");
        assert_eq!(vms.identity("vm-a"), a);
        // Another agent (or this one after a restart) makes its own.
        assert_ne!(VmIdentities::default().identity("vm-a"), a);
    }
}

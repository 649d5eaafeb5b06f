//! The admission checks of a hello that every transport shares: the protocol version,
//! the device, the lease or key, one borrower per device, the session limit.

use std::sync::Arc;

use devlend_fabric::net::FEATURE_NET;
use devlend_fabric::pci::FEATURE_PCI;
use devlend_fabric::{Hello, HelloStatus, PROTOCOL_VERSION};

use crate::device::{Claim, Device};
use crate::server::shared::{ActiveSession, Shared};

/// The admission checks of a hello, shared by every transport: version, device, lease
/// or key, one borrower per device, the session limit. Returns the device, the
/// borrower's claim on it and the session's slot, or the refusal to answer.
pub(crate) fn admit<'s>(
    shared: &'s Shared,
    hello: &Hello,
    peer: &dyn std::fmt::Display,
    id: u64,
) -> Result<(Arc<Device>, ActiveSession<'s>, Claim), (HelloStatus, String)> {
    if hello.version != PROTOCOL_VERSION {
        return Err((
            HelloStatus::UnsupportedVersion,
            format!(
                "protocol version {} is not supported; this lender speaks version {PROTOCOL_VERSION}",
                hello.version
            ),
        ));
    }
    let Some(dev) = shared.device(&hello.device) else {
        return Err((
            HelloStatus::NoSuchDevice,
            format!("no device {:?} is lent here", hello.device),
        ));
    };
    if dev.nic.is_some() && hello.features & FEATURE_NET == 0 {
        return Err((
            HelloStatus::BadRequest,
            format!(
                "device {:?} is a network interface, and this borrower does not speak frames",
                hello.device
            ),
        ));
    }
    if dev.pci.is_some() && (hello.features & FEATURE_PCI == 0 || hello.queue_index != 0) {
        return Err((
            HelloStatus::BadRequest,
            format!(
                "device {:?} is a PCIe function: a borrower must ask for feature PCI on queue 0 (devlend attach --kind pci)",
                hello.device
            ),
        ));
    }
    let mut lease_qos = None;
    if let Some(guard) = shared.leases.get() {
        match guard.admit(hello, crate::leases::now_ms()) {
            Ok(admitted) => {
                shared.set_session_lease(id, admitted.lease);
                lease_qos = admitted.qos;
            }
            Err((status, reason)) => {
                devlend_fabric::limited!(warn, %peer, device = %hello.device, %reason, "lease check failed");
                return Err((status, reason));
            }
        }
    }
    let claim = match dev.claim(hello.borrower, lease_qos.as_ref(), shared.store_of(&dev)) {
        Ok(c) => c,
        Err(holder) => {
            return Err((
                HelloStatus::Busy,
                format!(
                    "device {:?} is attached by another borrower ({})",
                    hello.device,
                    holder
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>()
                ),
            ))
        }
    };
    let Some(active) = shared.try_activate() else {
        return Err((
            HelloStatus::Busy,
            format!(
                "the lender serves its maximum of {} sessions",
                shared.options.max_sessions
            ),
        ));
    };
    Ok((dev, active, claim))
}

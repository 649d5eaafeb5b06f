//! The admission checks of a hello that every transport shares: the protocol version,
//! the device, the lease or key, one borrower per device, the session limit; and the
//! fence of a queue's earlier sessions.

use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::handshake::{speaks, unsupported_version_message};
use devlend_fabric::{Hello, HelloStatus};

use crate::device::Device;
use crate::holding::{Ask, Claim, CONTROL_QUEUE};
use crate::server::shared::{ActiveSession, LenderState, QueueKey};

/// The longest a new session waits for the earlier sessions of its queue it fenced to
/// end, before its hello is answered busy: below the borrower's 3 s handshake timeout.
pub(crate) const FENCE_WAIT: Duration = Duration::from_secs(2);

/// The admission checks of a hello, shared by every transport: version, device, lease
/// or key, one borrower per device, the session limit. Returns the device, the
/// borrower's claim on it and the session's slot, or the refusal to answer.
pub(crate) fn admit<'s>(
    shared: &'s LenderState,
    hello: &Hello,
    peer: &dyn std::fmt::Display,
    id: u64,
) -> Result<(Arc<Device>, ActiveSession<'s>, Claim), (HelloStatus, String)> {
    if !speaks(hello.version) {
        return Err((
            HelloStatus::UnsupportedVersion,
            unsupported_version_message(hello.version),
        ));
    }
    let Some(dev) = shared.device(&hello.device) else {
        let names: Vec<String> = shared
            .all_devices()
            .iter()
            .map(|d| d.counters.name.clone())
            .collect();
        let reason = match crate::pci::sriov::unknown_device_hint(&hello.device, &names) {
            Some(hint) => format!("no device {:?} is lent here: {hint}", hello.device),
            None => format!("no device {:?} is lent here", hello.device),
        };
        return Err((HelloStatus::NoSuchDevice, reason));
    };
    // What the kind serves: a NIC frames, a PCIe function queue 0 with feature PCI.
    dev.kind()
        .check_hello(&hello.device, hello)
        .map_err(|reason| (HelloStatus::BadRequest, reason))?;
    let mut lease_qos = None;
    let mut successor_of = None;
    if let Some(guard) = shared.leases.get() {
        match guard.admit(hello, crate::leases::now_ms()) {
            Ok(admitted) => {
                shared.set_session_lease(id, admitted.lease);
                lease_qos = admitted.qos;
                successor_of = admitted.successor_of;
            }
            Err((status, reason)) => {
                devlend_fabric::limited!(warn, %peer, device = %hello.device, %reason, "lease check failed");
                return Err((status, reason));
            }
        }
    } else if !hello.token.is_empty() {
        // Without authentication nothing is checked, the handover either: a token's
        // predecessor is taken as the borrower says.
        successor_of = devlend_fabric::lease_token::LeaseToken::from_bytes(hello.token.clone())
            .claims_unverified()
            .ok()
            .and_then(|c| c.successor_of);
    }
    let ask = Ask {
        borrower: hello.borrower,
        successor_of,
        queue: hello.queue_index,
        lease: lease_qos.as_ref(),
    };
    let claim = match dev.claim(&ask, shared.store_of(&dev)) {
        Ok(c) => c,
        Err(refusal) => {
            // Each may clear (the holder lets go): busy, retried.
            return Err((
                HelloStatus::Busy,
                format!("device {:?} is {refusal}", hello.device),
            ));
        }
    };
    // Before the session count: a session left alive by a silent cut counts among the
    // active ones, and a lender at its maximum would refuse the reconnect it fences.
    if dev.kind().fences_earlier_sessions()
        && hello.borrower != [0; 16]
        && hello.queue_index != CONTROL_QUEUE
        && !claim.is_standby()
    {
        let key = QueueKey {
            device: hello.device.clone(),
            borrower: hello.borrower,
            queue: hello.queue_index,
        };
        match shared.fence_earlier(id, key, FENCE_WAIT) {
            Ok(0) => {}
            Ok(n) => {
                devlend_fabric::limited!(info, %peer, device = %hello.device, queue = hello.queue_index, fenced = n, "earlier session of this queue fenced and ended: the new one is served");
            }
            Err(left) => {
                return Err((
                    HelloStatus::Busy,
                    format!(
                        "an earlier session of queue {} still has requests on the device ({left} session(s) not ended within {FENCE_WAIT:?}); retry",
                        hello.queue_index
                    ),
                ));
            }
        }
    }
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

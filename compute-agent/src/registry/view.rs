//! What the API shows of an attachment: the fields every kind has and its kind's own
//! part, read from a served attachment's backend, or from a saved one waiting to be
//! restored (its kind, with that kind's fields empty).

use super::*;

pub(super) fn info(e: &Entry) -> AttachmentInfo {
    AttachmentInfo {
        id: e.id.clone(),
        lender: e.request.lender.clone(),
        device: e.request.device.clone(),
        socket: e.request.socket.clone(),
        connected: e.attachment.connected(),
        vmm: e.plug.clone(),
        lease: e.lease.as_ref().map(LeaseKeeper::id),
        limits: lease_limits(e.request.lease.as_ref()),
        lease_ended: e.lease.as_ref().is_some_and(LeaseKeeper::ended),
        // Filled in by the listing (`Registry::list`, `Registry::get`).
        pool_unreachable_since_ms: None,
        handover: handover::state(&e.attachment),
        lender_lost: e.attachment.lender_lost(),
        transport: e.request.transport_label().to_owned(),
        restoring: None,
        part: part(&e.request, &e.attachment),
    }
}

/// The fields of an attachment's own kind, read from its backend.
pub(super) fn part(req: &AttachRequest, a: &Attachment) -> KindInfo {
    served::served(a.part()).info(req)
}

/// The limits a lease's token carries (the lender enforces them, with its own).
pub(super) fn lease_limits(
    lease: Option<&crate::api::LeaseRef>,
) -> Option<devlend_fabric::qos::Qos> {
    let token = devlend_fabric::lease_token::LeaseToken::from_text(&lease?.token).ok()?;
    token.claims_unverified().ok()?.qos
}

/// What `status` shows of a saved attachment not served again yet: its saved kind,
/// with that kind's fields empty.
pub(super) fn restoring_info(r: &Restoring) -> AttachmentInfo {
    let q = &r.saved.request;
    let mut part = KindInfo::empty(r.saved.kind());
    match &mut part {
        KindInfo::Block(b) => {
            b.queues = q.queues;
            b.queue_size = q.queue_size;
        }
        KindInfo::Nic(n) => {
            n.queue_pairs = q.queues;
            n.queue_size = q.queue_size;
        }
        KindInfo::Pci(p) => p.vm.clone_from(&q.vm),
    }
    AttachmentInfo {
        id: r.saved.id.clone(),
        lender: q.lender.clone(),
        device: q.device.clone(),
        socket: q.socket.clone(),
        connected: false,
        vmm: r.saved.plug.clone(),
        lease: q.lease.as_ref().map(|l| l.id),
        limits: lease_limits(q.lease.as_ref()),
        lease_ended: false,
        pool_unreachable_since_ms: None,
        handover: None,
        lender_lost: false,
        transport: q.transport_label().to_owned(),
        restoring: Some(r.reason.clone()),
        part,
    }
}

/// What a served attachment is, by its backend.
pub(super) fn kind(e: &Entry) -> DeviceKind {
    e.attachment.kind()
}

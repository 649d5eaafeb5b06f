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
        handover: handover::state(&e.attachment),
        lender_lost: e.attachment.lender_lost(),
        transport: e.request.transport_label().to_owned(),
        restoring: None,
        part: part(&e.request, &e.attachment),
    }
}

/// The fields of an attachment's own kind, read from its backend.
pub(super) fn part(req: &AttachRequest, a: &Attachment) -> KindInfo {
    let l = a.limits();
    match a.kind() {
        AttachedKind::Block => {
            let end = l
                .serial
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(l.serial.len());
            KindInfo::Block(BlockInfo {
                queues: req.queues,
                queue_size: req.queue_size,
                capacity_sectors: l.capacity_sectors,
                block_size: l.block_size,
                read_only: l.read_only,
                serial: String::from_utf8_lossy(&l.serial[..end]).into_owned(),
                counters: a.stats().into(),
                rates: None,
            })
        }
        AttachedKind::Nic => {
            let n = a.net_stats().unwrap_or_default();
            KindInfo::Nic(NicInfo {
                queue_pairs: req.queues,
                queue_size: req.queue_size,
                mac: a
                    .net_link()
                    .map(|l| crate::api::format_mac(&l.mac))
                    .unwrap_or_default(),
                mtu: n.mtu,
                link_up: n.link_up,
                reconnects: n.reconnects,
                counters: n.total.into(),
                pairs: n.pairs.into_iter().map(Into::into).collect(),
            })
        }
        AttachedKind::Pci => KindInfo::Pci(match a.pci() {
            Some(p) => {
                let id = p.identity();
                PciInfo {
                    bdf: id.bdf.clone(),
                    vendor_id: id.vendor_id,
                    device_id: id.device_id,
                    coherence: Some(p.coherence()),
                    dma_mapped_bytes: p.dma_mapped_bytes(),
                    counters: p.stats().into(),
                }
            }
            None => PciInfo::default(),
        }),
    }
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
        KindInfo::Pci(_) => {}
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
        handover: None,
        lender_lost: false,
        transport: q.transport_label().to_owned(),
        restoring: Some(r.reason.clone()),
        part,
    }
}

/// What a served attachment is, by its backend.
pub(super) fn kind(e: &Entry) -> DeviceKind {
    e.attachment.kind().into()
}

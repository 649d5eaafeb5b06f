//! The source side of a live migration's device handover.
//!
//! The lender lends a device to one borrower at a time. When a VM migrates, the
//! destination's compute agent stands by for the device with a lease token that names
//! this attachment's lease as its predecessor (see the device agent's `holding`
//! module). The source gives the device up when the frontend stops the device at the
//! end of the migration (vhost-user GET_VRING_BASE, after the requests in flight
//! completed, or failed after the disk backend's `DRAIN_TIMEOUT`): each queue closes
//! its fabric session and the holder pauses ([`Holding`]), so that the lender hands the
//! device to the
//! destination. The frontend stops only the rings it started, and a guest may start
//! fewer queues than the device has (one vCPU on a two-queue disk; a VM using one pair
//! of a two-pair NIC): at the first stop, the queues whose ring is not started close
//! their sessions too, having nothing in flight. So the device is let go as soon as
//! the frontend stops the VM, whatever number of queues the guest started, and the
//! destination's VM takes it at its first request (`devlend migrate finish` on the
//! source is bookkeeping, and may come late). If the migration fails and the VM resumes here, the frontend starts the
//! rings again: the holder resumes and the queues reconnect on their next request (the
//! lender lets the source take the device back while the destination has not).
//!
//! Nothing happens unless the operator asked for a handover ([`Handover::begin`]): a VM
//! paused or rebooted keeps its device.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What holds the device on the lender for the attachment (its holding session), as a
/// handover lets it go and takes it back. This module only asks; the holder (in
/// `blk::holder`) does.
pub trait Holding: Send + Sync + std::fmt::Debug {
    /// Lets the device go: closes the holding session and opens none until
    /// [`Self::resume`].
    fn pause(&self);
    /// Holds the device again (the session re-opens at once).
    fn resume(&self);
}

/// A handover of one attachment: whether one is asked for, and whether the device was
/// let go.
#[derive(Debug, Default)]
pub struct Handover {
    active: AtomicBool,
    let_go: AtomicBool,
    holder: Mutex<Option<Arc<dyn Holding>>>,
}

impl Handover {
    /// A handover for an attachment whose holder is `holder` (none for a PCIe function).
    pub fn new(holder: Option<Arc<dyn Holding>>) -> Self {
        Handover {
            active: AtomicBool::new(false),
            let_go: AtomicBool::new(false),
            holder: Mutex::new(holder),
        }
    }

    /// From now on the device is let go when the frontend stops it.
    pub fn begin(&self) {
        self.active.store(true, Ordering::Release);
    }

    /// As [`Self::begin`], unless a handover is asked for already: returns whether this
    /// call began it.
    pub fn try_begin(&self) -> bool {
        !self.active.swap(true, Ordering::AcqRel)
    }

    /// The handover is called off (the migration failed or was cancelled): the device is
    /// no longer let go at a stop. A device already let go is taken back when the
    /// frontend starts the device again (the VM resumes here), not before: after a
    /// migration that completed, the destination's VM has it.
    pub fn cancel(&self) {
        self.active.store(false, Ordering::Release);
    }

    /// Whether a handover was asked for.
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Whether the device was let go and not taken back.
    pub fn is_let_go(&self) -> bool {
        self.let_go.load(Ordering::Acquire)
    }

    /// The frontend stopped a ring: with a handover asked for, the holder lets the
    /// device go (the caller closes the queue's own session). Returns whether it did.
    pub fn ring_stopped(&self) -> bool {
        if !self.is_active() {
            return false;
        }
        if !self.let_go.swap(true, Ordering::AcqRel) {
            if let Some(h) = self.control() {
                h.pause();
            }
            devlend_fabric::limited!(
                info,
                "the frontend stopped the device during a handover: letting it go"
            );
        }
        true
    }

    /// The frontend uses the device again: a device let go is taken back.
    pub fn resume(&self) {
        if self.let_go.swap(false, Ordering::AcqRel) {
            if let Some(h) = self.control() {
                h.resume();
            }
            devlend_fabric::limited!(info, "the frontend uses the device again: taking it back");
        }
    }

    fn control(&self) -> Option<Arc<dyn Holding>> {
        self.holder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

//! What the compute agent does with each kind of attachment ([`ServedKind`], one impl
//! per kind of the backend's [`Part`]): what the API shows of it, what a VMM is given
//! to plug it in, whether a live migration may hand it over, whether its I/O rates are
//! sampled, and whether its link is followed into the guest. [`served`] is the one
//! place that turns a [`Part`] into its [`ServedKind`].

use std::path::Path;

use devlend_backend::attachment::{BlockPart, NicPart, Part};
use devlend_backend::pci::PciHandle;

use crate::api::{AttachRequest, BlockInfo, IoCounters, KindInfo, NicInfo, PciInfo};
use crate::vmm::link_watch::LinkWatch;
use crate::vmm::qemu::PlugKind;

use super::vmm_error::VmmError;
use super::RegistryError;

/// What the compute agent does with one kind of attachment.
pub(crate) trait ServedKind {
    /// Its own fields as the API shows them (`req`: what was asked).
    fn info(&self, req: &AttachRequest) -> KindInfo;

    /// What a VMM is given to plug it in.
    ///
    /// # Errors
    /// [`VmmError::NotHotplugged`] for a kind a VMM is started with instead.
    fn vmm_device(&self, req: &AttachRequest) -> Result<PlugKind, VmmError>;

    /// Refuses a live migration's handover of it.
    ///
    /// # Errors
    /// [`RegistryError::BadRequest`] saying why it cannot migrate.
    fn check_handover(&self) -> Result<(), RegistryError> {
        Ok(())
    }

    /// Its request counters, for the I/O rates; a kind without block requests has
    /// none.
    fn io_counters(&self) -> Option<IoCounters> {
        None
    }

    /// Follows its link into the guest of the QEMU behind `qmp`, where it is device
    /// `device_id` (a NIC); a kind without a link follows nothing.
    fn follow_link(&self, _device_id: &str, _qmp: &Path) -> Option<LinkWatch> {
        None
    }
}

/// The [`ServedKind`] of an attachment's part.
pub(crate) fn served(part: &Part) -> &dyn ServedKind {
    match part {
        Part::Block(b) => b,
        Part::Nic(n) => n,
        Part::Pci(p) => p,
    }
}

impl ServedKind for BlockPart {
    fn info(&self, req: &AttachRequest) -> KindInfo {
        let l = self.limits();
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
            counters: self.stats(),
            rates: None,
        })
    }

    fn vmm_device(&self, req: &AttachRequest) -> Result<PlugKind, VmmError> {
        Ok(PlugKind::Blk {
            num_queues: req.queues,
            queue_size: req.queue_size,
            read_only: self.limits().read_only,
        })
    }

    fn io_counters(&self) -> Option<IoCounters> {
        Some(self.stats())
    }
}

impl ServedKind for NicPart {
    fn info(&self, req: &AttachRequest) -> KindInfo {
        let n = self.stats();
        KindInfo::Nic(NicInfo {
            queue_pairs: req.queues,
            queue_size: req.queue_size,
            mac: crate::api::format_mac(&self.link().mac),
            mtu: n.mtu,
            link_up: n.link_up,
            lender_link_up: n.lender_link_up,
            reconnects: n.reconnects,
            counters: n.total,
            pairs: n.pairs,
            failovers: n.failovers,
            last_failover_us: n.last_failover_us,
            paths: n.paths,
        })
    }

    fn vmm_device(&self, req: &AttachRequest) -> Result<PlugKind, VmmError> {
        let link = self.link();
        Ok(PlugKind::Net {
            pairs: req.queues,
            mac: crate::api::format_mac(&link.mac),
            mtu: link.mtu,
        })
    }

    fn follow_link(&self, device_id: &str, qmp: &Path) -> Option<LinkWatch> {
        match LinkWatch::start(device_id.to_owned(), qmp.to_owned(), self.counters()) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(device_id, error = %e, "cannot follow the NIC's link into the guest");
                None
            }
        }
    }
}

impl ServedKind for PciHandle {
    fn info(&self, req: &AttachRequest) -> KindInfo {
        let id = self.identity();
        KindInfo::Pci(PciInfo {
            bdf: id.bdf.clone(),
            vendor_id: id.vendor_id,
            device_id: id.device_id,
            coherence: Some(self.coherence()),
            dma_mapped_bytes: self.dma_mapped_bytes(),
            vm: req.vm.clone(),
            counters: self.stats().into(),
        })
    }

    fn vmm_device(&self, _req: &AttachRequest) -> Result<PlugKind, VmmError> {
        Err(VmmError::NotHotplugged)
    }

    fn check_handover(&self) -> Result<(), RegistryError> {
        Err(RegistryError::BadRequest(
            "a PCIe function cannot migrate: QEMU's vfio-user client has no migration support"
                .into(),
        ))
    }
}

//! What one kind of attachment alone has ([`Part`]): a block device its geometry and
//! request counters, a NIC its link and frame counters, a PCIe function its handle
//! (identity, coherence mode, DMA maps, counters). Whoever shows an attachment matches
//! on [`Part`]; the compiler names every place a new kind must fill in.

use std::sync::Arc;

use devlend_fabric::net::LinkState;
use devlend_fabric::DeviceKind;

use crate::blk::engine::{QueueStats, StatsSnapshot};
use crate::blk::request::DeviceLimits;
use crate::lender::path_probe::PathProbe;
use crate::net::{NetStats, NetStatsSnapshot};
use crate::pci::PciHandle;

/// What one kind of attachment alone has.
pub enum Part {
    /// A block device on vhost-user-blk.
    Block(BlockPart),
    /// A NIC on vhost-user-net.
    Nic(NicPart),
    /// A PCIe function on vfio-user.
    Pci(PciHandle),
}

impl Part {
    /// Its kind.
    pub fn kind(&self) -> DeviceKind {
        match self {
            Part::Block(_) => DeviceKind::Block,
            Part::Nic(_) => DeviceKind::Nic,
            Part::Pci(_) => DeviceKind::Pci,
        }
    }
}

/// A block device's own part: what the lender described, and the request counters.
pub struct BlockPart {
    pub(super) limits: Arc<DeviceLimits>,
    pub(super) stats: Arc<QueueStats>,
    /// With several paths: probes the ones marked down (stops with the attachment).
    pub(super) _probe: Option<PathProbe>,
}

impl BlockPart {
    /// The device as the lender described it (capacity, block size, limits, serial).
    pub fn limits(&self) -> &DeviceLimits {
        &self.limits
    }

    /// Request counters since the attachment started.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }
}

/// A NIC's own part: its link and frame counters.
pub struct NicPart {
    pub(super) net: Arc<NetStats>,
    pub(super) link: LinkState,
    /// With several paths: probes the ones marked down (stops with the attachment).
    pub(super) _probe: Option<PathProbe>,
}

impl NicPart {
    /// Its frame counters and link state now.
    pub fn stats(&self) -> NetStatsSnapshot {
        self.net.snapshot()
    }

    /// Its counters, shared (e.g. with a thread that follows the link).
    pub fn counters(&self) -> Arc<NetStats> {
        Arc::clone(&self.net)
    }

    /// The link (MAC, MTU) the lender reported when it was attached.
    pub fn link(&self) -> LinkState {
        self.link
    }
}

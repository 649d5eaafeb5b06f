//! What a lent device's kinds and block I/O are handed of it: its name and its
//! counters ([`DeviceCounters`]), shared with the device itself. A leaf, so that the
//! kinds need not name the device that names them.

use crate::stats::DeviceStats;

/// A lent device's name and counters, shared by the device, its sessions and their I/O.
#[derive(Debug)]
pub(crate) struct DeviceCounters {
    /// The name borrowers ask for.
    pub(crate) name: String,
    /// The device's counters.
    pub(crate) stats: DeviceStats,
}

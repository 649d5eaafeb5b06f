//! Read-only handles on a running lender, for the pool link and the metrics endpoint:
//! the devices lent ([`InventoryView`]) and their counters ([`StatsView`]).

use std::sync::Arc;

use devlend_fabric::latency::LatencySnapshot;

use super::shared::LenderState;
pub use crate::kind_view::{KindView, NicCounters};
use crate::DeviceStatsSnapshot;

/// A lent device as the pool and the status views see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LentDevice {
    /// Device name.
    pub name: String,
    /// Lendable bytes as registered with the pool: a block device's capacity (a
    /// multiple of 512); 0 for a network interface or a PCIe function.
    pub capacity_bytes: u64,
    /// The pool's resource class: `BLOCK`, `NIC` for a network interface, or
    /// `PCI_<VENDOR>_<DEVICE>` for a PCIe function.
    pub resource_class: String,
    /// Traits to register: `FABRIC_TCP`, `DISCARD`, `WRITE_ZEROES`, `READ_ONLY` as they
    /// apply, then the configured ones; sorted, without repeats.
    pub traits: Vec<String>,
    /// The kind and its own fields.
    pub kind: KindView,
}

/// A handle on the list of lent devices, which a reload can change.
#[derive(Clone)]
pub struct InventoryView(pub(super) Arc<LenderState>);

impl InventoryView {
    /// The devices lent now, sorted by name.
    pub fn devices(&self) -> Vec<LentDevice> {
        self.0
            .all_devices()
            .iter()
            .map(|d| {
                let kind = d.kind();
                let mut traits = vec!["FABRIC_TCP".to_owned()];
                traits.extend(kind.derived_traits().into_iter().map(str::to_owned));
                traits.extend(d.traits().iter().cloned());
                traits.sort();
                traits.dedup();
                LentDevice {
                    name: d.counters.name.clone(),
                    capacity_bytes: kind.capacity_bytes(),
                    resource_class: kind.resource_class(),
                    traits,
                    kind: kind.view(),
                }
            })
            .collect()
    }

    /// The leases of the sessions open now, each once (see `LenderState::served_leases`).
    pub fn served_leases(&self) -> Vec<[u8; 16]> {
        self.0.served_leases()
    }
}

/// The counters of every device of a running lender.
#[derive(Clone)]
pub struct StatsView(pub(super) Arc<LenderState>);

impl StatsView {
    /// Each device's name and counters, by name.
    pub fn all(&self) -> Vec<(String, DeviceStatsSnapshot)> {
        self.0
            .all_devices()
            .iter()
            .map(|d| (d.counters.name.clone(), d.counters.stats.snapshot()))
            .collect()
    }

    /// Each device's name, counters and latency histogram (from receiving a request to
    /// queueing its response), by name.
    pub fn all_with_latency(&self) -> Vec<(String, DeviceStatsSnapshot, LatencySnapshot)> {
        self.0
            .all_devices()
            .iter()
            .map(|d| {
                (
                    d.counters.name.clone(),
                    d.counters.stats.snapshot(),
                    d.counters.stats.latency(),
                )
            })
            .collect()
    }

    /// Each device's counters with what its kind counts, by name.
    pub fn all_by_kind(&self) -> Vec<KindCounters> {
        self.0
            .all_devices()
            .iter()
            .map(|d| KindCounters {
                name: d.counters.name.clone(),
                kind: d.kind_name(),
                block_requests: d.kind().counts_block_requests(),
                limited: d.kind().is_limited(),
                stats: d.counters.stats.snapshot(),
                latency: d.counters.stats.latency(),
            })
            .collect()
    }
}

/// A device's counters, with what its kind counts.
#[derive(Debug, Clone)]
pub struct KindCounters {
    /// Device name.
    pub name: String,
    /// Its kind: `block`, `net` or `pci`.
    pub kind: &'static str,
    /// Whether it counts block requests (reads, writes, ..., their bytes, latency,
    /// backing operations, request errors): a block device does; for the other kinds
    /// those counters stay zero and are not to be shown.
    pub block_requests: bool,
    /// Whether limits apply to it (throttled requests or frames are counted): a block
    /// device and a NIC; not a PCIe function.
    pub limited: bool,
    /// The counters (sessions for every kind).
    pub stats: DeviceStatsSnapshot,
    /// Latency from receiving a block request to queueing its response.
    pub latency: LatencySnapshot,
}

impl StatsView {
    /// Each lent interface's device name and frame counters, by name.
    pub fn nics(&self) -> Vec<(String, NicCounters)> {
        self.0
            .all_devices()
            .iter()
            .filter_map(|d| match d.kind().view() {
                KindView::Net { frames, .. } => Some((d.counters.name.clone(), frames)),
                KindView::Block { .. } | KindView::Pci { .. } => None,
            })
            .collect()
    }
}

/// The limits a device is under now (`docs/qos.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceQos {
    /// While a borrower holds the device: its limits, the device's and its lease's, the
    /// tighter of each. Otherwise the device's own.
    pub limits: devlend_fabric::qos::Qos,
    /// Whether a borrower (or anonymous sessions) holds it.
    pub held: bool,
    /// The backing store it shares, if any.
    pub store: Option<String>,
    /// The holder's share of the store's capacity now (0..=1), while held.
    pub share: Option<f64>,
}

impl StatsView {
    /// Each device's name and limits, by name.
    pub fn qos(&self) -> Vec<(String, DeviceQos)> {
        self.0
            .all_devices()
            .iter()
            .map(|d| {
                let group = d.current_group();
                let q = DeviceQos {
                    limits: group.as_ref().map_or(d.qos(), |g| g.qos),
                    held: group.is_some(),
                    store: d.store_name().map(str::to_owned),
                    share: group
                        .as_ref()
                        .filter(|g| g.store().is_some())
                        .map(|g| g.share()),
                };
                (d.counters.name.clone(), q)
            })
            .collect()
    }
}

impl std::fmt::Debug for StatsView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatsView")
    }
}

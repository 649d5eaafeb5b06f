//! The counters of a NIC attachment's queue pairs, and its link as last reported.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use devlend_fabric::io_counters::PathState;

use crate::lender::path_cell::{Failovers, PathCell};

/// Counters of one queue pair.
#[derive(Debug, Default)]
pub struct PairStats {
    pub(super) rx_packets: AtomicU64,
    pub(super) rx_bytes: AtomicU64,
    pub(super) tx_packets: AtomicU64,
    pub(super) tx_bytes: AtomicU64,
    pub(super) rx_drops: AtomicU64,
    pub(super) tx_drops: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) rx_merged: AtomicU64,
    pub(super) rx_gso: AtomicU64,
    pub(super) tx_gso: AtomicU64,
}

/// Counters of an attachment's queue pairs, and the lender's link as last reported.
#[derive(Debug)]
pub struct NetStats {
    pub(super) pairs: Vec<PairStats>,
    pub(super) reconnects: AtomicU64,
    pub(super) link_up: AtomicBool,
    pub(super) connected: AtomicU32,
    /// Pairs paused ([`PairEngine::pause`]): the guest does not run them (yet), or a
    /// handover let the NIC go. They are not expected to be connected.
    pub(super) paused: AtomicU32,
    pub(super) mtu: AtomicU32,
    /// Pair sessions that reopened on another path after theirs was lost.
    pub(super) failovers: Failovers,
    /// One per path to the lender, when there are several.
    pub(super) paths: Vec<PathCell>,
}

/// A copy of the counters of one queue pair, or of all summed: the fabric's
/// [`NetCounters`](devlend_fabric::io_counters::NetCounters), the set the compute
/// agent's API reports.
pub type PairSnapshot = devlend_fabric::io_counters::NetCounters;

/// A copy of an attachment's NIC counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetStatsSnapshot {
    /// Summed over the queue pairs.
    pub total: PairSnapshot,
    /// Per queue pair.
    pub pairs: Vec<PairSnapshot>,
    /// Fabric connections re-established after a loss.
    pub reconnects: u64,
    /// The lender's link is up and every queue pair the guest runs is connected to it.
    pub link_up: bool,
    /// The lender's link is up, as last reported (whether or not the queue pairs are
    /// connected).
    pub lender_link_up: bool,
    /// The lender's MTU as last reported.
    pub mtu: u32,
    /// Queue pair sessions that reopened on another path after theirs was lost (a NIC
    /// with several paths to its lender).
    pub failovers: u64,
    /// How long the last failover took, µs: from the loss of the pair's session to its
    /// session on the next path. 0 before the first.
    pub last_failover_us: u64,
    /// The paths to the lender, in order (empty with one path).
    pub paths: Vec<PathState>,
}

impl NetStats {
    /// Counters for `pairs` queue pairs; `mtu` as the handshake gave it.
    pub fn new(pairs: u16, link_up: bool, mtu: u32) -> Self {
        NetStats {
            pairs: (0..pairs).map(|_| PairStats::default()).collect(),
            reconnects: AtomicU64::new(0),
            link_up: AtomicBool::new(link_up),
            connected: AtomicU32::new(0),
            paused: AtomicU32::new(0),
            mtu: AtomicU32::new(mtu),
            failovers: Failovers::default(),
            paths: Vec::new(),
        }
    }

    /// Counters for a NIC reached on several paths, `addrs` in path order (one
    /// address: no path states are kept).
    pub fn with_paths(mut self, addrs: impl IntoIterator<Item = String>) -> Self {
        self.paths = PathCell::for_addrs(addrs);
        self
    }

    /// The state of path `i`, if several paths are kept.
    pub(super) fn path(&self, i: usize) -> Option<&PathCell> {
        self.paths.get(i)
    }

    /// A copy of the counters.
    pub fn snapshot(&self) -> NetStatsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let pairs: Vec<PairSnapshot> = self
            .pairs
            .iter()
            .map(|p| PairSnapshot {
                rx_packets: get(&p.rx_packets),
                rx_bytes: get(&p.rx_bytes),
                tx_packets: get(&p.tx_packets),
                tx_bytes: get(&p.tx_bytes),
                rx_drops: get(&p.rx_drops),
                tx_drops: get(&p.tx_drops),
                errors: get(&p.errors),
                rx_merged: get(&p.rx_merged),
                rx_gso: get(&p.rx_gso),
                tx_gso: get(&p.tx_gso),
            })
            .collect();
        let mut total = PairSnapshot::default();
        for p in &pairs {
            total.rx_packets += p.rx_packets;
            total.rx_bytes += p.rx_bytes;
            total.tx_packets += p.tx_packets;
            total.tx_bytes += p.tx_bytes;
            total.rx_drops += p.rx_drops;
            total.tx_drops += p.tx_drops;
            total.errors += p.errors;
            total.rx_merged += p.rx_merged;
            total.rx_gso += p.rx_gso;
            total.tx_gso += p.tx_gso;
        }
        NetStatsSnapshot {
            total,
            reconnects: get(&self.reconnects),
            link_up: self.link_up(),
            lender_link_up: self.link_up.load(Ordering::Relaxed),
            mtu: self.mtu.load(Ordering::Relaxed),
            failovers: self.failovers.count(),
            last_failover_us: self.failovers.last_us(),
            paths: self.paths.iter().map(PathCell::snapshot).collect(),
            pairs,
        }
    }

    /// Whether the lender's link is up and the queue pairs are connected, but for those
    /// the guest does not run (at least one connected): what the guest's link should
    /// show.
    pub fn link_up(&self) -> bool {
        let connected = self.connected.load(Ordering::Relaxed) as usize;
        let paused = self.paused.load(Ordering::Relaxed) as usize;
        self.link_up.load(Ordering::Relaxed)
            && connected > 0
            && connected + paused >= self.pairs.len()
    }

    /// A new frontend connection's backend is about to make its engines: the sessions
    /// and pauses of the previous one's (gone with it) no longer count.
    pub fn new_backend(&self) {
        self.connected.store(0, Ordering::Relaxed);
        self.paused.store(0, Ordering::Relaxed);
    }

    pub(super) fn disconnected(&self) {
        let _ = self
            .connected
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    pub(super) fn unpause(&self) {
        let _ = self
            .paused
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}

impl crate::lender::path_probe::WithPaths for NetStats {
    fn paths(&self) -> &[PathCell] {
        &self.paths
    }
}

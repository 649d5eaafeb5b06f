//! The kind-specific part of an attachment as the API reports it: a block device's
//! geometry and I/O counters, a NIC's link and frame counters, a PCIe function's
//! identity, coherence mode and counters. [`KindInfo`] is flattened into
//! [`super::AttachmentInfo`] with its `kind` tag.

use serde::{Deserialize, Serialize};

/// What an attachment serves (the `kind` of its API object and of its entry in the
/// state file): `block`, `nic` or `pci`. One enum for the handshake's description, the
/// backend's attachment and the API.
pub use devlend_fabric::DeviceKind;

/// An attachment's own fields, by kind; in JSON, a `kind` member (`block`, `nic`,
/// `pci`) beside the variant's fields.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase")]
// An API value built per status call and serialized; a disk's counters make it large,
// and boxing them would change every constructor for nothing measurable.
#[allow(clippy::large_enum_variant)]
pub enum KindInfo {
    /// A block device.
    Block(BlockInfo),
    /// A NIC.
    Nic(NicInfo),
    /// A PCIe function.
    Pci(PciInfo),
}

impl KindInfo {
    /// Its kind.
    pub fn kind(&self) -> DeviceKind {
        match self {
            KindInfo::Block(_) => DeviceKind::Block,
            KindInfo::Nic(_) => DeviceKind::Nic,
            KindInfo::Pci(_) => DeviceKind::Pci,
        }
    }

    /// A part of `kind` with nothing known yet (zero counters, empty identity): what a
    /// saved attachment not served again yet shows.
    pub fn empty(kind: DeviceKind) -> Self {
        match kind {
            DeviceKind::Block => KindInfo::Block(BlockInfo::default()),
            DeviceKind::Nic => KindInfo::Nic(NicInfo::default()),
            DeviceKind::Pci => KindInfo::Pci(PciInfo::default()),
        }
    }
}

/// A lent block device.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct BlockInfo {
    /// Number of virtqueues.
    pub queues: u16,
    /// Suggested virtqueue size (descriptors).
    pub queue_size: u16,
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Whether the device is read-only.
    pub read_only: bool,
    /// Device serial (GET_ID), without NUL padding.
    pub serial: String,
    /// I/O counters (since this compute agent started serving it: a restart starts
    /// them again from zero).
    pub counters: IoCounters,
    /// I/O rates over the last seconds (absent until two samples, one second apart).
    #[serde(default)]
    pub rates: Option<Rates>,
}

/// A lent NIC.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NicInfo {
    /// Number of queue pairs (one receive and one transmit virtqueue each).
    pub queue_pairs: u16,
    /// Suggested virtqueue size (descriptors).
    pub queue_size: u16,
    /// The MAC address the guest should use (`aa:bb:cc:dd:ee:ff`).
    pub mac: String,
    /// The lender's MTU in bytes, as last reported.
    pub mtu: u32,
    /// The lender's link is up and every queue pair connected.
    pub link_up: bool,
    /// The lender's interface is up, as last reported, whether or not a VMM runs the
    /// queue pairs yet (absent in answers of older agents: read as false).
    #[serde(default)]
    pub lender_link_up: bool,
    /// Fabric sessions re-established after a loss.
    pub reconnects: u64,
    /// Frame counters summed over the queue pairs.
    pub counters: NetCounters,
    /// Frame counters per queue pair.
    pub pairs: Vec<NetCounters>,
    /// Queue pair sessions that reopened on another path after theirs was lost (a NIC
    /// with several paths to its lender).
    #[serde(default)]
    pub failovers: u64,
    /// How long the last failover took, in µs: from the loss of the pair's session to
    /// its session on the next path. 0 before the first.
    #[serde(default)]
    pub last_failover_us: u64,
    /// The paths to the lender, in order (empty with one path); `sessions` counts
    /// queue pair sessions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PathState>,
}

/// How the guest memory a PCIe function reaches by DMA is kept coherent with the
/// lender (`mirror` or `mediated`): the protocol's own enum.
pub use devlend_fabric::CoherenceMode;

/// A borrowed PCIe function.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PciInfo {
    /// Its address on the lender (`DDDD:BB:DD.F`); empty while restoring.
    pub bdf: String,
    /// PCI vendor ID; absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor_id: Option<u16>,
    /// PCI device ID; absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<u16>,
    /// How DMA-mapped memory is kept coherent; absent while restoring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coherence: Option<CoherenceMode>,
    /// Bytes of the VMM's memory mapped for the function's DMA now.
    pub dma_mapped_bytes: u64,
    /// The VM it was attached for (the request's `vm`: its peer group); absent when
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// Counters since this compute agent started serving it.
    pub counters: PciCounters,
}

/// Counters of a borrowed PCIe function.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PciCounters {
    /// Region (BAR, config space) reads forwarded to the lender.
    pub region_reads: u64,
    /// Region writes forwarded to the lender.
    pub region_writes: u64,
    /// Pages pushed to the lender's mirror.
    pub pages_pushed: u64,
    /// Pages pulled from the lender's mirror.
    pub pages_pulled: u64,
    /// Interrupts delivered to the VMM.
    pub irqs: u64,
    /// Bytes of guest memory the lender read for the function (a mediated function's
    /// fetches), as the lender reports them (absent in answers of older agents).
    #[serde(default)]
    pub guest_read_bytes: u64,
    /// Bytes the lender wrote to guest memory from the function, as it reports them.
    #[serde(default)]
    pub guest_written_bytes: u64,
    /// Bytes the function moved straight to or from another function of its VM
    /// (peer-to-peer, never through guest memory), as the lender reports them.
    #[serde(default)]
    pub peer_bytes: u64,
}

impl From<&devlend_backend::pci::PciStats> for PciCounters {
    fn from(s: &devlend_backend::pci::PciStats) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        PciCounters {
            region_reads: s.reads.load(Relaxed),
            region_writes: s.writes.load(Relaxed),
            pages_pushed: s.pages_pushed.load(Relaxed),
            pages_pulled: s.pages_pulled.load(Relaxed),
            irqs: s.irqs.load(Relaxed),
            guest_read_bytes: s.lender_guest_read_bytes.load(Relaxed),
            guest_written_bytes: s.lender_guest_written_bytes.load(Relaxed),
            peer_bytes: s.peer_bytes.load(Relaxed),
        }
    }
}

/// I/O counters of an attachment (since it was created), and their latency histogram:
/// the backend's counter snapshot, declared once in the fabric crate.
pub use devlend_fabric::io_counters::{IoCounters, Latency};

/// Counters of one queue pair of a lent NIC, or of all of them summed: the backend's
/// pair snapshot, declared once in the fabric crate.
pub use devlend_fabric::io_counters::{NetCounters, PathState};

/// Recent I/O rates of an attachment.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Rates {
    /// Seconds the rates are taken over.
    pub window_s: f64,
    /// Requests completed per second.
    pub iops: f64,
    /// Megabytes (10^6 bytes) read per second.
    pub read_mb_s: f64,
    /// Megabytes written per second.
    pub write_mb_s: f64,
    /// 99th percentile completion latency (upper bucket bound), microseconds.
    pub p99_us: Option<u64>,
    /// Requests per second that the lender held back for the lease's limits.
    #[serde(default)]
    pub throttled_per_s: f64,
}

//! A lent device's own fields as the status views show them ([`KindView`], one variant
//! per kind) and a NIC's frame counters ([`NicCounters`]): state types that the kinds
//! (`block/`, `nic/`, `pci/`), the kind trait and the server's views all share. A leaf:
//! it uses nothing of the lender but its config's types.

/// A lent device's own fields, by kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KindView {
    /// A block device or regular file.
    Block {
        /// The backing path.
        path: std::path::PathBuf,
        /// Lendable bytes, a multiple of 512.
        capacity_bytes: u64,
        /// The logical block size in bytes.
        block_size: u32,
        /// Writes, discards and write-zeroes are refused.
        read_only: bool,
    },
    /// A network interface.
    Net {
        /// The Linux interface name.
        interface: String,
        /// The MAC address the borrower's guest is told.
        mac: [u8; 6],
        /// The interface's MTU now, in bytes.
        mtu: u32,
        /// Whether its link is up now (up and running).
        link_up: bool,
        /// Its frame counters since the lender started.
        frames: NicCounters,
    },
    /// A PCIe function.
    Pci {
        /// Its address `DDDD:BB:DD.F`.
        bdf: String,
        /// The vendor ID from its config space.
        vendor_id: u16,
        /// The device ID from its config space.
        device_id: u16,
        /// How its DMA is kept coherent with the borrower's guest memory.
        coherence: crate::config::Coherence,
    },
}

impl KindView {
    /// The kind's name: `block`, `net` or `pci` (as `kind` in the config file).
    pub fn name(&self) -> &'static str {
        match self {
            KindView::Block { .. } => "block",
            KindView::Net { .. } => "net",
            KindView::Pci { .. } => "pci",
        }
    }
}

/// A lent network interface's frame counters (since the lender started).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NicCounters {
    /// Frames received on the interface and sent to the borrower.
    pub rx_packets: u64,
    /// Their bytes.
    pub rx_bytes: u64,
    /// Frames from the borrower sent on the interface.
    pub tx_packets: u64,
    /// Their bytes.
    pub tx_bytes: u64,
    /// Frames dropped either way (borrower too slow, too large, interface refused).
    pub drops: u64,
}

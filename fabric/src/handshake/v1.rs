//! The protocol version 1 hello reply, kept so that a lender and a borrower of different
//! versions still talk while operators upgrade one host at a time: its fixed 68-byte
//! block-shaped layout, and the translation between it and a [`DeviceDescription`].
//! Version 1 support goes away in a later version (`docs/protocol.md`).

use super::description::{
    BlockGeometry, CoherenceMode, DeviceDescription, NicLink, PciIdentity, DEV_BLOCK_FLAGS,
};
use crate::{WireError, SERIAL_LEN};

/// Length of the part of a version 1 reply after the common head (16 bytes): 68 in all.
pub const V1_TAIL_LEN: usize = 52;

/// Version 1 `flags` bit: the device is a network interface; `max_transfer` is then its
/// MTU and the first 6 bytes of `serial` its MAC address.
pub const DEV_NET: u32 = 1 << 3;
/// Version 1 `flags` bit, with [`DEV_NET`]: the interface's link was up.
pub const DEV_LINK_UP: u32 = 1 << 4;
/// Version 1 `flags` bit: the device is a PCIe function; `serial` holds its address, cut
/// to 20 bytes.
pub const DEV_PCI: u32 = 1 << 5;

crate::layout! {
    /// What follows the common head in a version 1 reply.
    pub struct V1Tail [V1_TAIL_LEN] {
        /// Capacity in 512-byte sectors (0 for a NIC or a PCIe function).
        pub capacity_sectors: u64,
        /// Block size in bytes (512 for a NIC or a PCIe function).
        pub block_size: u32,
        /// Largest transfer in bytes; a NIC's MTU.
        pub max_transfer: u32,
        /// Largest discard in 512-byte sectors.
        pub max_discard_sectors: u32,
        /// Largest write-zeroes in 512-byte sectors.
        pub max_write_zeroes_sectors: u32,
        /// Block flags, [`DEV_NET`], [`DEV_LINK_UP`], [`DEV_PCI`].
        pub flags: u32,
        /// Bytes of message that follow (after the credit and the proof, if any).
        pub msg_len: u16,
        /// 0.
        pub reserved: [u8; 2],
        /// Serial; a NIC's MAC; a PCIe function's address.
        pub serial: [u8; SERIAL_LEN],
    }
}

/// The version 1 tail for `device` (all zero for a refusal, `None`), with `msg_len`.
pub(super) fn encode(device: Option<&DeviceDescription>, msg_len: u16) -> V1Tail {
    let mut t = V1Tail {
        msg_len,
        ..V1Tail::ZERO
    };
    match device {
        None => {}
        Some(DeviceDescription::Block(g)) => {
            t.capacity_sectors = g.capacity_sectors;
            t.block_size = g.block_size;
            t.max_transfer = g.max_transfer;
            t.max_discard_sectors = g.max_discard_sectors;
            t.max_write_zeroes_sectors = g.max_write_zeroes_sectors;
            t.flags = g.flags & DEV_BLOCK_FLAGS;
            t.serial = g.serial;
        }
        Some(DeviceDescription::Nic(n)) => {
            t.block_size = 512;
            t.max_transfer = n.mtu;
            t.flags = DEV_NET | if n.up { DEV_LINK_UP } else { 0 };
            t.serial[..6].copy_from_slice(&n.mac);
        }
        Some(DeviceDescription::Pci(p)) => {
            t.block_size = 512;
            t.max_transfer = crate::pci::MAX_ACCESS;
            t.flags = DEV_PCI;
            let b = p.bdf.as_bytes();
            let n = b.len().min(SERIAL_LEN);
            t.serial[..n].copy_from_slice(&b[..n]);
        }
    }
    t
}

/// The description a version 1 reply of an open session carries. A NIC has no
/// offloads listed (version 1 grants them with the feature bit alone); a PCIe function
/// has its address (at most 20 bytes), no IDs and no regions (the borrower asks for the
/// regions after the handshake either way) and the mirror mode (a mediated function says
/// so in its info, [`crate::pci::INFO_MEDIATED`]).
///
/// # Errors
/// [`WireError::Invalid`]: a block size that is not a power of two ≥ 512, or a PCIe
/// address that is not UTF-8.
pub(super) fn decode(t: &V1Tail) -> Result<DeviceDescription, WireError> {
    if t.flags & DEV_NET != 0 {
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&t.serial[..6]);
        return Ok(DeviceDescription::Nic(NicLink {
            mac,
            mtu: t.max_transfer,
            up: t.flags & DEV_LINK_UP != 0,
            offloads: 0,
        }));
    }
    if t.flags & DEV_PCI != 0 {
        let end = t.serial.iter().position(|&c| c == 0).unwrap_or(SERIAL_LEN);
        let bdf = std::str::from_utf8(&t.serial[..end])
            .map_err(|_| WireError::Invalid("PCIe address is not UTF-8"))?;
        return Ok(DeviceDescription::Pci(PciIdentity {
            bdf: bdf.to_owned(),
            coherence: CoherenceMode::Mirror,
            ..PciIdentity::default()
        }));
    }
    if t.block_size < 512 || !t.block_size.is_power_of_two() {
        return Err(WireError::Invalid("block size"));
    }
    Ok(DeviceDescription::Block(BlockGeometry {
        capacity_sectors: t.capacity_sectors,
        block_size: t.block_size,
        max_transfer: t.max_transfer,
        max_discard_sectors: t.max_discard_sectors,
        max_write_zeroes_sectors: t.max_write_zeroes_sectors,
        flags: t.flags & DEV_BLOCK_FLAGS,
        serial: t.serial,
    }))
}

//! The device description of a protocol version 2 hello reply: what the borrower is told
//! of the device it opened, tagged by kind (block device, NIC, PCIe function), and its
//! bounded encoding. Layout in `docs/protocol.md` ("Device description").

use crate::codec::{self, Reader};
use crate::{WireError, SERIAL_LEN};

/// Kind tag of a [`BlockGeometry`] description.
pub const KIND_BLOCK: u8 = 1;
/// Kind tag of a [`NicLink`] description.
pub const KIND_NIC: u8 = 2;
/// Kind tag of a [`PciIdentity`] description.
pub const KIND_PCI: u8 = 3;

/// Bytes before every description's body: `kind: u8, reserved: [u8; 3]`.
pub const DESCRIPTION_HEAD_LEN: usize = 4;
/// Length of an encoded block description (head and body).
pub const BLOCK_DESCRIPTION_LEN: usize = DESCRIPTION_HEAD_LEN + BlockFixed::LEN;
/// Length of an encoded NIC description (head and body).
pub const NIC_DESCRIPTION_LEN: usize = DESCRIPTION_HEAD_LEN + NicFixed::LEN;
/// Length of an encoded PCIe description before its address and regions.
pub const PCI_DESCRIPTION_FIXED_LEN: usize = DESCRIPTION_HEAD_LEN + PciFixed::LEN;
/// Longest PCIe address in a [`PciIdentity`], in bytes (`DDDD:BB:DD.F` is 12).
pub const MAX_BDF_LEN: usize = 64;
/// Most regions in a [`PciIdentity`] (VFIO's 9 standard ones and device-specific ones).
pub const MAX_DESCRIPTION_REGIONS: usize = crate::pci::MAX_REGIONS as usize;
/// Longest encoded description in bytes: a PCIe function with the longest address and
/// the most regions (4 + 16 + 64 + 16 × 16 = 340).
pub const MAX_DESCRIPTION_LEN: usize =
    DESCRIPTION_HEAD_LEN + PciFixed::LEN + MAX_BDF_LEN + MAX_DESCRIPTION_REGIONS * RegionEntry::LEN;

/// [`BlockGeometry::flags`] bit: the device is read-only.
pub const DEV_READ_ONLY: u32 = 1 << 0;
/// [`BlockGeometry::flags`] bit: the lender executes discard.
pub const DEV_DISCARD: u32 = 1 << 1;
/// [`BlockGeometry::flags`] bit: the lender executes write-zeroes.
pub const DEV_WRITE_ZEROES: u32 = 1 << 2;
/// Every [`BlockGeometry::flags`] bit version 2 defines; others are refused.
pub const DEV_BLOCK_FLAGS: u32 = DEV_READ_ONLY | DEV_DISCARD | DEV_WRITE_ZEROES;

/// [`NicLink::offloads`] bit: the lender completes the checksum of a frame sent with
/// `NEEDS_CSUM` (virtio-net `CSUM`).
pub const NIC_OFFLOAD_CSUM: u32 = 1 << 0;
/// [`NicLink::offloads`] bit: the lender segments TCP over IPv4 (virtio-net `HOST_TSO4`).
pub const NIC_OFFLOAD_TSO4: u32 = 1 << 1;
/// [`NicLink::offloads`] bit: the lender segments TCP over IPv6 (virtio-net `HOST_TSO6`).
pub const NIC_OFFLOAD_TSO6: u32 = 1 << 2;
/// [`NicLink::offloads`] bit: the lender segments with ECN (virtio-net `HOST_ECN`).
pub const NIC_OFFLOAD_ECN: u32 = 1 << 3;
/// Every [`NicLink::offloads`] bit version 2 defines; others are refused.
pub const NIC_OFFLOADS: u32 =
    NIC_OFFLOAD_CSUM | NIC_OFFLOAD_TSO4 | NIC_OFFLOAD_TSO6 | NIC_OFFLOAD_ECN;
/// The NIC's `flags` bit on the wire: the link was up at the handshake.
const NIC_LINK_UP: u32 = 1 << 0;

/// Smallest MTU a [`NicLink`] may state (IPv4's minimum, RFC 791), in bytes.
pub const MIN_MTU: u32 = 68;
/// Largest MTU a [`NicLink`] may state, in bytes.
pub const MAX_MTU: u32 = 65535;

crate::layout! {
    /// The body of a block description on the wire (48 bytes).
    struct BlockFixed [48] {
        capacity_sectors: u64,
        block_size: u32,
        max_transfer: u32,
        max_discard_sectors: u32,
        max_write_zeroes_sectors: u32,
        flags: u32,
        serial: [u8; SERIAL_LEN],
    }
}

crate::layout! {
    /// The body of a NIC description on the wire (20 bytes).
    struct NicFixed [20] {
        mac: [u8; 6],
        reserved: [u8; 2],
        flags: u32,
        mtu: u32,
        offloads: u32,
    }
}

crate::layout! {
    /// The fixed part of a PCIe description's body (16 bytes), before the address and
    /// the regions.
    struct PciFixed [16] {
        vendor_id: u16,
        device_id: u16,
        subsystem_vendor_id: u16,
        subsystem_id: u16,
        class: u32,
        coherence: u8,
        bdf_len: u8,
        region_count: u8,
        reserved: u8,
    }
}

crate::layout! {
    /// One region of a PCIe description (16 bytes).
    struct RegionEntry [16] {
        index: u32,
        flags: u32,
        size: u64,
    }
}

/// What a borrower is told of the device it opened: one variant per kind of device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceDescription {
    /// A block device (kind tag [`KIND_BLOCK`]).
    Block(BlockGeometry),
    /// A network interface (kind tag [`KIND_NIC`]).
    Nic(NicLink),
    /// A PCIe function (kind tag [`KIND_PCI`]).
    Pci(PciIdentity),
}

/// A lent block device's geometry and limits.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockGeometry {
    /// Capacity in 512-byte sectors (the backing size rounded down to a multiple of 512).
    pub capacity_sectors: u64,
    /// Logical block size in bytes that the guest should use (a power of two, ≥ 512).
    pub block_size: u32,
    /// Largest data length of one read or write request, in bytes.
    pub max_transfer: u32,
    /// Largest discard, in 512-byte sectors (0 when discard is not executed).
    pub max_discard_sectors: u32,
    /// Largest write-zeroes, in 512-byte sectors (0 when write-zeroes is not executed).
    pub max_write_zeroes_sectors: u32,
    /// [`DEV_READ_ONLY`], [`DEV_DISCARD`], [`DEV_WRITE_ZEROES`].
    pub flags: u32,
    /// Device serial, NUL-padded to 20 bytes (virtio 1.2 §5.2.6, GET_ID).
    pub serial: [u8; SERIAL_LEN],
}

impl BlockGeometry {
    /// Whether the device refuses writes.
    pub fn read_only(&self) -> bool {
        self.flags & DEV_READ_ONLY != 0
    }
}

/// A lent network interface as of the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NicLink {
    /// The interface's MAC address.
    pub mac: [u8; 6],
    /// The interface's MTU: payload bytes of a frame. A guest can use
    /// [`MIN_MTU`]..=[`MAX_MTU`]; the borrower refuses another at attach.
    pub mtu: u32,
    /// The link was up.
    pub up: bool,
    /// What the lender completes for frames sent with an offload header
    /// ([`NIC_OFFLOAD_CSUM`], [`NIC_OFFLOAD_TSO4`], [`NIC_OFFLOAD_TSO6`],
    /// [`NIC_OFFLOAD_ECN`]); used once [`crate::net::FEATURE_NET_OFFLOAD`] is granted.
    pub offloads: u32,
}

impl NicLink {
    /// The link state the NIC's frame messages also carry ([`crate::net::LinkState`]).
    pub fn link(&self) -> crate::net::LinkState {
        crate::net::LinkState {
            up: self.up,
            mtu: self.mtu,
            mac: self.mac,
        }
    }

    /// A description of `link` offering `offloads`.
    pub fn new(link: &crate::net::LinkState, offloads: u32) -> Self {
        NicLink {
            mac: link.mac,
            mtu: link.mtu,
            up: link.up,
            offloads,
        }
    }
}

/// How a lent PCIe function's DMA is kept coherent with the guest's memory; in JSON
/// (the compute agent's API) `mirror` or `mediated`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum CoherenceMode {
    /// The lender mirrors guest memory; the borrower pushes before BAR writes and pulls
    /// after interrupts (`docs/pci.md`).
    #[default]
    Mirror = 0,
    /// The lender mediates the function (NVMe): it keeps no mirror and reads and writes
    /// guest memory itself ([`crate::pci::INFO_MEDIATED`], `docs/nvme.md`).
    Mediated = 1,
}

/// One region of a PCIe function (a BAR, the ROM, the config space), as VFIO reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PciRegion {
    /// VFIO region index (0..=5 the BARs, 6 the ROM, 7 the config space, 8 VGA).
    pub index: u32,
    /// Size in bytes.
    pub size: u64,
    /// VFIO_REGION_INFO_FLAG_READ (1) and _WRITE (2).
    pub flags: u32,
}

/// A lent PCIe function's identity, regions and coherence mode.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PciIdentity {
    /// The function's address on the lender, `DDDD:BB:DD.F` (at most [`MAX_BDF_LEN`]
    /// bytes).
    pub bdf: String,
    /// Vendor ID (config space offset 0x00).
    pub vendor_id: u16,
    /// Device ID (0x02).
    pub device_id: u16,
    /// Subsystem vendor ID (0x2c).
    pub subsystem_vendor_id: u16,
    /// Subsystem ID (0x2e).
    pub subsystem_id: u16,
    /// Class code, 24 bits: base class << 16 | subclass << 8 | programming interface
    /// (0x09..=0x0b); e.g. `0x010802` for an NVMe controller.
    pub class: u32,
    /// The regions that exist (size > 0), by ascending index (at most
    /// [`MAX_DESCRIPTION_REGIONS`]).
    pub regions: Vec<PciRegion>,
    /// How DMA is kept coherent.
    pub coherence: CoherenceMode,
}

impl From<BlockGeometry> for DeviceDescription {
    fn from(g: BlockGeometry) -> Self {
        DeviceDescription::Block(g)
    }
}

impl From<NicLink> for DeviceDescription {
    fn from(n: NicLink) -> Self {
        DeviceDescription::Nic(n)
    }
}

impl From<PciIdentity> for DeviceDescription {
    fn from(p: PciIdentity) -> Self {
        DeviceDescription::Pci(p)
    }
}

impl DeviceDescription {
    /// What kind of device it describes.
    pub fn kind(&self) -> crate::kind::DeviceKind {
        use crate::kind::DeviceKind;
        match self {
            DeviceDescription::Block(_) => DeviceKind::Block,
            DeviceDescription::Nic(_) => DeviceKind::Nic,
            DeviceDescription::Pci(_) => DeviceKind::Pci,
        }
    }

    /// The kind tag on the wire.
    pub fn tag(&self) -> u8 {
        match self {
            DeviceDescription::Block(_) => KIND_BLOCK,
            DeviceDescription::Nic(_) => KIND_NIC,
            DeviceDescription::Pci(_) => KIND_PCI,
        }
    }

    /// The block geometry, for a block device.
    pub fn as_block(&self) -> Option<&BlockGeometry> {
        match self {
            DeviceDescription::Block(g) => Some(g),
            _ => None,
        }
    }

    /// The link, for a network interface.
    pub fn as_nic(&self) -> Option<&NicLink> {
        match self {
            DeviceDescription::Nic(n) => Some(n),
            _ => None,
        }
    }

    /// The identity, for a PCIe function.
    pub fn as_pci(&self) -> Option<&PciIdentity> {
        match self {
            DeviceDescription::Pci(p) => Some(p),
            _ => None,
        }
    }

    /// Appends the encoded description (head and body) to `out`.
    ///
    /// # Errors
    /// [`WireError::TooLong`] for a PCIe address over [`MAX_BDF_LEN`] bytes or more than
    /// [`MAX_DESCRIPTION_REGIONS`] regions (nothing is appended).
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
        if let DeviceDescription::Pci(p) = self {
            check_len("PCIe address", p.bdf.len(), MAX_BDF_LEN)?;
            check_len("PCIe regions", p.regions.len(), MAX_DESCRIPTION_REGIONS)?;
        }
        codec::push(out, self.tag());
        codec::push(out, [0u8; 3]);
        match self {
            DeviceDescription::Block(g) => BlockFixed {
                capacity_sectors: g.capacity_sectors,
                block_size: g.block_size,
                max_transfer: g.max_transfer,
                max_discard_sectors: g.max_discard_sectors,
                max_write_zeroes_sectors: g.max_write_zeroes_sectors,
                flags: g.flags,
                serial: g.serial,
            }
            .push(out),
            DeviceDescription::Nic(n) => NicFixed {
                mac: n.mac,
                reserved: [0; 2],
                flags: if n.up { NIC_LINK_UP } else { 0 },
                mtu: n.mtu,
                offloads: n.offloads,
            }
            .push(out),
            DeviceDescription::Pci(p) => {
                PciFixed {
                    vendor_id: p.vendor_id,
                    device_id: p.device_id,
                    subsystem_vendor_id: p.subsystem_vendor_id,
                    subsystem_id: p.subsystem_id,
                    class: p.class,
                    coherence: p.coherence as u8,
                    // Both bounded above (≤ 64, ≤ 16).
                    bdf_len: p.bdf.len() as u8,
                    region_count: p.regions.len() as u8,
                    reserved: 0,
                }
                .push(out);
                out.extend_from_slice(p.bdf.as_bytes());
                for r in &p.regions {
                    RegionEntry {
                        index: r.index,
                        flags: r.flags,
                        size: r.size,
                    }
                    .push(out);
                }
            }
        }
        Ok(())
    }

    /// Decodes a whole description: `b` must hold exactly one.
    ///
    /// # Errors
    /// [`WireError::TooLong`] (more than [`MAX_DESCRIPTION_LEN`] bytes, an address or a
    /// region count over its limit), [`WireError::Invalid`] (an unknown kind tag, a
    /// reserved byte or flag bit that is set, a block size that is not a power of two
    /// ≥ 512, an MTU out of range, a non-UTF-8 or empty address, an unknown coherence
    /// mode, bytes after the end), [`WireError::Truncated`].
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        check_len("device description", b.len(), MAX_DESCRIPTION_LEN)?;
        let mut r = Reader::new(b);
        let kind = r.u8()?;
        r.zeros(3, "reserved bytes of a device description")?;
        let d = match kind {
            KIND_BLOCK => DeviceDescription::Block(decode_block(&mut r)?),
            KIND_NIC => DeviceDescription::Nic(decode_nic(&mut r)?),
            KIND_PCI => DeviceDescription::Pci(decode_pci(&mut r)?),
            _ => return Err(WireError::Invalid("unknown device description kind")),
        };
        r.finish()?;
        Ok(d)
    }
}

fn check_len(what: &'static str, len: usize, limit: usize) -> Result<(), WireError> {
    if len > limit {
        return Err(WireError::TooLong {
            what,
            len: len as u64,
            limit: limit as u64,
        });
    }
    Ok(())
}

fn decode_block(r: &mut Reader<'_>) -> Result<BlockGeometry, WireError> {
    let f = BlockFixed::read(r)?;
    if f.block_size < 512 || !f.block_size.is_power_of_two() {
        return Err(WireError::Invalid("block size"));
    }
    if f.flags & !DEV_BLOCK_FLAGS != 0 {
        return Err(WireError::Invalid("unknown block device flags"));
    }
    Ok(BlockGeometry {
        capacity_sectors: f.capacity_sectors,
        block_size: f.block_size,
        max_transfer: f.max_transfer,
        max_discard_sectors: f.max_discard_sectors,
        max_write_zeroes_sectors: f.max_write_zeroes_sectors,
        flags: f.flags,
        serial: f.serial,
    })
}

fn decode_nic(r: &mut Reader<'_>) -> Result<NicLink, WireError> {
    let f = NicFixed::read(r)?;
    codec::reserved(&f.reserved, "reserved bytes of a NIC description")?;
    if f.flags & !NIC_LINK_UP != 0 {
        return Err(WireError::Invalid("unknown NIC flags"));
    }
    if f.offloads & !NIC_OFFLOADS != 0 {
        return Err(WireError::Invalid("unknown NIC offloads"));
    }
    // The MTU is the lender's interface's, as it is: the borrower refuses at attach one
    // that no guest can use (outside MIN_MTU..=MAX_MTU, e.g. a loopback's 65536), with
    // a message that says so, rather than failing the handshake here.
    Ok(NicLink {
        mac: f.mac,
        mtu: f.mtu,
        up: f.flags & NIC_LINK_UP != 0,
        offloads: f.offloads,
    })
}

fn decode_pci(r: &mut Reader<'_>) -> Result<PciIdentity, WireError> {
    let f = PciFixed::read(r)?;
    codec::reserved(&[f.reserved], "reserved byte of a PCIe description")?;
    if f.class > 0x00ff_ffff {
        return Err(WireError::Invalid("PCIe class code over 24 bits"));
    }
    let coherence = match f.coherence {
        0 => CoherenceMode::Mirror,
        1 => CoherenceMode::Mediated,
        _ => return Err(WireError::Invalid("unknown PCIe coherence mode")),
    };
    let bdf_len = usize::from(f.bdf_len);
    let count = usize::from(f.region_count);
    check_len("PCIe address", bdf_len, MAX_BDF_LEN)?;
    check_len("PCIe regions", count, MAX_DESCRIPTION_REGIONS)?;
    if bdf_len == 0 {
        return Err(WireError::Invalid("empty PCIe address"));
    }
    let bdf = std::str::from_utf8(r.bytes(bdf_len)?)
        .map_err(|_| WireError::Invalid("PCIe address is not UTF-8"))?
        .to_owned();
    let mut regions = Vec::with_capacity(count);
    for _ in 0..count {
        let e = RegionEntry::read(r)?;
        if regions
            .last()
            .is_some_and(|p: &PciRegion| p.index >= e.index)
        {
            return Err(WireError::Invalid("PCIe regions not by ascending index"));
        }
        regions.push(PciRegion {
            index: e.index,
            size: e.size,
            flags: e.flags,
        });
    }
    Ok(PciIdentity {
        bdf,
        vendor_id: f.vendor_id,
        device_id: f.device_id,
        subsystem_vendor_id: f.subsystem_vendor_id,
        subsystem_id: f.subsystem_id,
        class: f.class,
        regions,
        coherence,
    })
}

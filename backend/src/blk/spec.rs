//! virtio-blk constants, feature bits and the config space (virtio 1.2 §5.2), and the
//! lent device's limits they are derived from ([`DeviceLimits`]).

use virtio_bindings::virtio_blk as vb;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// Size of the request header `virtio_blk_outhdr` in bytes (virtio 1.2 §5.2.6).
pub const OUTHDR_LEN: usize = 16;
/// Size of one discard/write-zeroes segment in bytes (virtio 1.2 §5.2.6).
pub const SEGMENT_LEN: usize = 16;
/// Segments accepted per discard or write-zeroes request (`max_discard_seg`,
/// `max_write_zeroes_seg` in config space).
pub const MAX_SEGMENTS: u32 = 1;
/// Descriptors of data per request the driver may use (`seg_max`).
pub const SEG_MAX: u32 = 254;
/// Largest virtqueue size accepted (SET_VRING_NUM above it fails).
pub const MAX_QUEUE_SIZE: usize = 1024;
/// Largest number of virtqueues of one device.
pub const MAX_QUEUES: u16 = 16;

/// Request type VIRTIO_BLK_T_IN.
pub const T_IN: u32 = vb::VIRTIO_BLK_T_IN;
/// Request type VIRTIO_BLK_T_OUT.
pub const T_OUT: u32 = vb::VIRTIO_BLK_T_OUT;
/// Request type VIRTIO_BLK_T_FLUSH.
pub const T_FLUSH: u32 = vb::VIRTIO_BLK_T_FLUSH;
/// Request type VIRTIO_BLK_T_GET_ID.
pub const T_GET_ID: u32 = vb::VIRTIO_BLK_T_GET_ID;
/// Request type VIRTIO_BLK_T_DISCARD.
pub const T_DISCARD: u32 = vb::VIRTIO_BLK_T_DISCARD;
/// Request type VIRTIO_BLK_T_WRITE_ZEROES.
pub const T_WRITE_ZEROES: u32 = vb::VIRTIO_BLK_T_WRITE_ZEROES;
/// Segment flag VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP.
pub const FLAG_UNMAP: u32 = vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;

/// Status VIRTIO_BLK_S_OK.
pub const S_OK: u8 = vb::VIRTIO_BLK_S_OK as u8;
/// Status VIRTIO_BLK_S_IOERR.
pub const S_IOERR: u8 = vb::VIRTIO_BLK_S_IOERR as u8;
/// Status VIRTIO_BLK_S_UNSUPP.
pub const S_UNSUPP: u8 = vb::VIRTIO_BLK_S_UNSUPP as u8;

/// What the backend knows of the lent device, from the lender's handshake reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Logical block size in bytes (config space `blk_size`).
    pub block_size: u32,
    /// Largest data length of one IN or OUT request, in bytes.
    pub max_transfer: u32,
    /// Largest discard in 512-byte sectors; 0 when discard is not offered.
    pub max_discard_sectors: u32,
    /// Largest write-zeroes in 512-byte sectors; 0 when write-zeroes is not offered.
    pub max_write_zeroes_sectors: u32,
    /// Whether writes are refused (VIRTIO_BLK_F_RO is offered; enforced whatever the
    /// driver acked).
    pub read_only: bool,
    /// Device ID string returned by GET_ID, NUL-padded.
    pub serial: [u8; devlend_fabric::SERIAL_LEN],
}

impl DeviceLimits {
    /// Derives the limits from a lender's [`devlend_fabric::BlockGeometry`]. A read-only
    /// device offers neither discard nor write-zeroes.
    pub fn from_device_info(info: &devlend_fabric::BlockGeometry) -> Self {
        use devlend_fabric::handshake::{DEV_DISCARD, DEV_WRITE_ZEROES};
        let ro = info.read_only();
        let pick = |flag: u32, v: u32| if !ro && info.flags & flag != 0 { v } else { 0 };
        DeviceLimits {
            capacity_sectors: info.capacity_sectors,
            block_size: info.block_size,
            max_transfer: info.max_transfer,
            max_discard_sectors: pick(DEV_DISCARD, info.max_discard_sectors),
            max_write_zeroes_sectors: pick(DEV_WRITE_ZEROES, info.max_write_zeroes_sectors),
            read_only: ro,
            serial: info.serial,
        }
    }

    /// Whether `sectors` 512-byte sectors at `sector` lie inside the device.
    pub(crate) fn in_range(&self, sector: u64, sectors: u64) -> bool {
        sector
            .checked_add(sectors)
            .is_some_and(|end| end <= self.capacity_sectors)
    }
}

/// Bit 30, VHOST_USER_F_PROTOCOL_FEATURES (vhost-user spec).
const VHOST_USER_F_PROTOCOL_FEATURES: u32 = 30;

/// Bit 26, VHOST_F_LOG_ALL (vhost-user spec, "Migration"): the backend logs every page
/// it writes in the frontend's dirty log (SET_LOG_BASE, with protocol feature
/// LOG_SHMFD). QEMU refuses to migrate a VM whose vhost device lacks it.
pub const VHOST_F_LOG_ALL: u32 = 26;

/// The virtio feature bits offered for a device: VERSION_1, RING_EVENT_IDX,
/// RING_INDIRECT_DESC, SEG_MAX, BLK_SIZE, FLUSH, DISCARD, WRITE_ZEROES, MQ, RO when
/// read-only, and the vhost-user PROTOCOL_FEATURES and LOG_ALL bits.
pub fn features(limits: &DeviceLimits) -> u64 {
    let mut bits = [
        VIRTIO_F_VERSION_1,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_RING_F_INDIRECT_DESC,
        vb::VIRTIO_BLK_F_SEG_MAX,
        vb::VIRTIO_BLK_F_BLK_SIZE,
        vb::VIRTIO_BLK_F_FLUSH,
        vb::VIRTIO_BLK_F_MQ,
        VHOST_USER_F_PROTOCOL_FEATURES,
        VHOST_F_LOG_ALL,
    ]
    .iter()
    .fold(0u64, |acc, b| acc | 1 << b);
    if limits.max_discard_sectors > 0 {
        bits |= 1 << vb::VIRTIO_BLK_F_DISCARD;
    }
    if limits.max_write_zeroes_sectors > 0 {
        bits |= 1 << vb::VIRTIO_BLK_F_WRITE_ZEROES;
    }
    if limits.read_only {
        bits |= 1 << vb::VIRTIO_BLK_F_RO;
    }
    bits
}

/// Size in bytes of the config space layout produced by [`config_space`].
pub const CONFIG_LEN: usize = 96;

/// Encodes `struct virtio_blk_config` (virtio 1.2 §5.2.4), little-endian.
///
/// Offsets: capacity 0, size_max 8, seg_max 12, geometry 16, blk_size 20, topology 24,
/// writeback 32, num_queues 34, max_discard_sectors 36, max_discard_seg 40,
/// discard_sector_alignment 44, max_write_zeroes_sectors 48, max_write_zeroes_seg 52,
/// write_zeroes_may_unmap 56; the rest (secure erase, zoned) is zero.
pub fn config_space(limits: &DeviceLimits, num_queues: u16) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    let mut put = |off: usize, bytes: &[u8]| c[off..off + bytes.len()].copy_from_slice(bytes);
    put(0, &limits.capacity_sectors.to_le_bytes());
    put(12, &SEG_MAX.to_le_bytes());
    put(20, &limits.block_size.to_le_bytes());
    put(34, &num_queues.to_le_bytes());
    let align = (limits.block_size / 512).max(1);
    if limits.max_discard_sectors > 0 {
        put(36, &limits.max_discard_sectors.to_le_bytes());
        put(40, &MAX_SEGMENTS.to_le_bytes());
        put(44, &align.to_le_bytes());
    }
    if limits.max_write_zeroes_sectors > 0 {
        put(48, &limits.max_write_zeroes_sectors.to_le_bytes());
        put(52, &MAX_SEGMENTS.to_le_bytes());
        put(56, &[1]);
    }
    c
}

/// The fields of `struct virtio_blk_config` (virtio 1.2 §5.2.4): offset, size, name.
const CONFIG_FIELDS: &[(u32, u32, &str)] = &[
    (0, 8, "capacity"),
    (8, 4, "size_max"),
    (12, 4, "seg_max"),
    (16, 4, "geometry"),
    (20, 4, "blk_size"),
    (24, 8, "topology"),
    (32, 1, "writeback"),
    (33, 1, "unused0"),
    (34, 2, "num_queues"),
    (36, 4, "max_discard_sectors"),
    (40, 4, "max_discard_seg"),
    (44, 4, "discard_sector_alignment"),
    (48, 4, "max_write_zeroes_sectors"),
    (52, 4, "max_write_zeroes_seg"),
    (56, 1, "write_zeroes_may_unmap"),
    (57, 3, "unused1"),
    (60, 4, "max_secure_erase_sectors"),
    (64, 4, "max_secure_erase_seg"),
    (68, 4, "secure_erase_sector_alignment"),
    (72, 24, "zoned"),
];

/// The name of the config-space field at byte `offset`, or `"beyond the config space"`.
pub fn config_field(offset: u32) -> &'static str {
    CONFIG_FIELDS
        .iter()
        .find(|&&(start, len, _)| offset >= start && offset - start < len)
        .map_or("beyond the config space", |&(_, _, name)| name)
}

/// The bytes of a GET_CONFIG reply: exactly `size` bytes from `offset` (relative to the
/// device config), zero-padded past the end of the layout (vhost-user spec,
/// VHOST_USER_GET_CONFIG; both QEMU and libblkio need the exact size).
pub fn config_slice(config: &[u8], offset: u32, size: u32) -> Vec<u8> {
    let mut out = vec![0u8; size as usize];
    let start = (offset as usize).min(config.len());
    let end = (offset as usize)
        .saturating_add(size as usize)
        .min(config.len());
    out[..end - start].copy_from_slice(&config[start..end]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> DeviceLimits {
        DeviceLimits {
            capacity_sectors: 2048,
            block_size: 4096,
            max_transfer: 1 << 20,
            max_discard_sectors: 1 << 16,
            max_write_zeroes_sectors: 1 << 15,
            read_only: false,
            serial: [0; 20],
        }
    }

    #[test]
    fn config_layout_matches_the_spec_offsets() {
        let c = config_space(&limits(), 2);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), SEG_MAX);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(c[36..40].try_into().unwrap()), 1 << 16);
        assert_eq!(u32::from_le_bytes(c[40..44].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8);
        assert_eq!(u32::from_le_bytes(c[48..52].try_into().unwrap()), 1 << 15);
        assert_eq!(u32::from_le_bytes(c[52..56].try_into().unwrap()), 1);
        assert_eq!(c[56], 1);
    }

    #[test]
    fn config_slice_has_exactly_the_size_asked() {
        let c = config_space(&limits(), 1);
        assert_eq!(config_slice(&c, 0, 57).len(), 57);
        assert_eq!(config_slice(&c, 0, 60), c[..60].to_vec());
        let tail = config_slice(&c, 90, 20);
        assert_eq!(tail.len(), 20);
        assert_eq!(&tail[6..], &[0u8; 14]);
        assert_eq!(config_slice(&c, u32::MAX, 4), vec![0; 4]);
    }

    #[test]
    fn config_fields_are_named_by_offset() {
        assert_eq!(config_field(0), "capacity");
        assert_eq!(config_field(7), "capacity");
        assert_eq!(config_field(32), "writeback");
        assert_eq!(config_field(35), "num_queues");
        assert_eq!(config_field(95), "zoned");
        assert_eq!(config_field(96), "beyond the config space");
        assert_eq!(config_field(u32::MAX), "beyond the config space");
        // The table covers the layout without gaps or overlaps.
        let mut next = 0;
        for &(start, len, _) in CONFIG_FIELDS {
            assert_eq!(start, next);
            next = start + len;
        }
        assert_eq!(next as usize, CONFIG_LEN);
    }

    #[test]
    fn features_follow_the_device() {
        let mut l = limits();
        let f = features(&l);
        assert_ne!(f & (1 << vb::VIRTIO_BLK_F_DISCARD), 0);
        assert_eq!(f & (1 << vb::VIRTIO_BLK_F_RO), 0);
        l.read_only = true;
        l.max_discard_sectors = 0;
        let f = features(&l);
        assert_ne!(f & (1 << vb::VIRTIO_BLK_F_RO), 0);
        assert_eq!(f & (1 << vb::VIRTIO_BLK_F_DISCARD), 0);
        assert_ne!(f & (1 << VIRTIO_F_VERSION_1), 0);
        assert_ne!(f & (1 << VHOST_F_LOG_ALL), 0);
    }
}

//! virtio-net feature bits and config space (virtio 1.2 §5.1.3, §5.1.4).

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_net as vn;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use devlend_fabric::net::LinkState;

/// vhost-user: the backend speaks protocol features (bit 30).
const VHOST_USER_F_PROTOCOL_FEATURES: u32 = 30;
/// Bit 26, VHOST_F_LOG_ALL (vhost-user spec, "Migration"): the backend logs every page
/// it writes in the frontend's dirty log (SET_LOG_BASE, with protocol feature
/// LOG_SHMFD). QEMU refuses to migrate a VM whose vhost device lacks it.
pub const VHOST_F_LOG_ALL: u32 = 26;

/// Most queue pairs an attachment offers.
pub const MAX_QUEUE_PAIRS: u16 = 8;
/// Largest virtqueue size accepted.
pub const MAX_QUEUE_SIZE: usize = 1024;
/// Size of `virtio_net_hdr_v1` (VERSION_1: `num_buffers` always present).
pub const NET_HDR_LEN: usize = 12;
/// Size of the config space produced by [`config_space`]: `mac`, `status`,
/// `max_virtqueue_pairs`, `mtu`.
pub const CONFIG_LEN: usize = 12;

/// The offloads offered when the lender grants offload frames (`FEATURE_NET_OFFLOAD`).
/// Transmit: the guest may leave TCP checksums and segmentation (v4, v6, with ECN) to
/// the lender, whose packet socket has the kernel complete them. Receive: the guest
/// takes frames whose checksum is left partial or was validated, and TCP frames larger
/// than the MTU (a GRO'd port, a TSO peer), as the lender's kernel hands them over.
pub const OFFLOADS: [u32; 8] = [
    vn::VIRTIO_NET_F_CSUM,
    vn::VIRTIO_NET_F_HOST_TSO4,
    vn::VIRTIO_NET_F_HOST_TSO6,
    vn::VIRTIO_NET_F_HOST_ECN,
    vn::VIRTIO_NET_F_GUEST_CSUM,
    vn::VIRTIO_NET_F_GUEST_TSO4,
    vn::VIRTIO_NET_F_GUEST_TSO6,
    vn::VIRTIO_NET_F_GUEST_ECN,
];

/// The receive offloads a guest that acked `features` takes, as the fabric's
/// `net::RX_*` bits (TSO only with GUEST_CSUM, as virtio 1.2 §5.1.3.1 requires).
pub fn guest_offloads(features: u64) -> u32 {
    use devlend_fabric::net::{RX_CSUM, RX_ECN, RX_TSO4, RX_TSO6};
    let has = |b: u32| features & (1u64 << b) != 0;
    if !has(vn::VIRTIO_NET_F_GUEST_CSUM) {
        return 0;
    }
    let mut bits = RX_CSUM;
    if has(vn::VIRTIO_NET_F_GUEST_TSO4) {
        bits |= RX_TSO4;
    }
    if has(vn::VIRTIO_NET_F_GUEST_TSO6) {
        bits |= RX_TSO6;
    }
    if has(vn::VIRTIO_NET_F_GUEST_ECN) && bits & (RX_TSO4 | RX_TSO6) != 0 {
        bits |= RX_ECN;
    }
    bits
}

/// The features offered (virtio 1.2 §5.1.3), with [`OFFLOADS`] when `offload`.
pub fn features(offload: bool) -> u64 {
    let base = [
        VIRTIO_F_VERSION_1,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_RING_F_INDIRECT_DESC,
        vn::VIRTIO_NET_F_MAC,
        vn::VIRTIO_NET_F_STATUS,
        vn::VIRTIO_NET_F_MRG_RXBUF,
        vn::VIRTIO_NET_F_MTU,
        vn::VIRTIO_NET_F_MQ,
        VHOST_USER_F_PROTOCOL_FEATURES,
        VHOST_F_LOG_ALL,
    ]
    .iter()
    .fold(0u64, |acc, b| acc | 1 << b);
    if offload {
        OFFLOADS.iter().fold(base, |acc, b| acc | 1 << b)
    } else {
        base
    }
}

/// The config space for `pairs` queue pairs and the lender's link.
pub fn config_space(link: &LinkState, pairs: u16) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    c[..6].copy_from_slice(&link.mac);
    let status = if link.up {
        vn::VIRTIO_NET_S_LINK_UP as u16
    } else {
        0
    };
    c[6..8].copy_from_slice(&status.to_le_bytes());
    c[8..10].copy_from_slice(&pairs.to_le_bytes());
    let mtu = u16::try_from(link.mtu).unwrap_or(u16::MAX);
    c[10..12].copy_from_slice(&mtu.to_le_bytes());
    c
}

/// Smallest and largest MTU a virtio-net device may report (virtio 1.2 §5.1.4.1:
/// 68..=65535 bytes).
pub const MTU_RANGE: std::ops::RangeInclusive<u32> = 68..=65535;

/// Checks a lender's link for a guest: an MTU in [`MTU_RANGE`] and a unicast,
/// non-zero MAC.
///
/// # Errors
/// What is wrong, for the attach's error message.
pub fn check_link(link: &LinkState) -> Result<(), String> {
    if !MTU_RANGE.contains(&link.mtu) {
        return Err(format!(
            "MTU {} is outside {}..={}",
            link.mtu,
            MTU_RANGE.start(),
            MTU_RANGE.end()
        ));
    }
    if link.mac[0] & 1 != 0 || link.mac == [0; 6] {
        return Err(format!(
            "MAC {} is not a unicast address",
            link.mac
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        ));
    }
    Ok(())
}

/// `size` bytes of `config` from `offset` (zero past its end), as GET_CONFIG answers.
pub fn config_slice(config: &[u8], offset: u32, size: u32) -> Vec<u8> {
    let mut out = vec![0u8; size as usize];
    let start = (offset as usize).min(config.len());
    let n = config.len().saturating_sub(start).min(out.len());
    out[..n].copy_from_slice(&config[start..start + n]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unusable_links_are_refused() {
        let ok = LinkState {
            up: true,
            mtu: 1500,
            mac: [2, 0, 0, 0, 0, 1],
        };
        assert!(check_link(&ok).is_ok());
        for bad in [
            LinkState { mtu: 0, ..ok },
            LinkState { mtu: 67, ..ok },
            LinkState { mtu: 100_000, ..ok },
            LinkState {
                mac: [0xff; 6],
                ..ok
            },
            LinkState { mac: [0; 6], ..ok },
        ] {
            assert!(check_link(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn config_holds_mac_status_pairs_and_mtu() {
        let link = LinkState {
            up: true,
            mtu: 9000,
            mac: [2, 0, 0, 0, 0, 9],
        };
        let c = config_space(&link, 2);
        assert_eq!(&c[..6], &[2, 0, 0, 0, 0, 9]);
        assert_eq!(u16::from_le_bytes([c[6], c[7]]), 1);
        assert_eq!(u16::from_le_bytes([c[8], c[9]]), 2);
        assert_eq!(u16::from_le_bytes([c[10], c[11]]), 9000);
        assert_eq!(config_slice(&c, 6, 4), vec![1, 0, 2, 0]);
        assert_eq!(config_slice(&c, 10, 8), vec![0x28, 0x23, 0, 0, 0, 0, 0, 0]);
        assert_eq!(config_slice(&c, 100, 2), vec![0, 0]);
        let f = features(false);
        assert!(f & (1 << vn::VIRTIO_NET_F_MRG_RXBUF) != 0 && f & (1 << 32) != 0);
        assert!(f & (1 << vn::VIRTIO_NET_F_CSUM) == 0);
        let f = features(true);
        assert!(
            f & (1 << vn::VIRTIO_NET_F_CSUM) != 0 && f & (1 << vn::VIRTIO_NET_F_HOST_TSO6) != 0
        );
        assert!(f & (1 << vn::VIRTIO_NET_F_GUEST_TSO4) != 0);
        use devlend_fabric::net::{RX_CSUM, RX_TSO4};
        assert_eq!(guest_offloads(f & !(1 << vn::VIRTIO_NET_F_GUEST_CSUM)), 0);
        let tso4 = (1 << vn::VIRTIO_NET_F_GUEST_CSUM) | (1 << vn::VIRTIO_NET_F_GUEST_TSO4);
        assert_eq!(guest_offloads(tso4), RX_CSUM | RX_TSO4);
    }
}

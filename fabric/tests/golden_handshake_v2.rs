//! Golden vectors of protocol version 2's handshake: the hello, and the hello reply of
//! each kind of device. Each golden is written from the layout in `docs/protocol.md`,
//! not captured from the encoder; the version 1 vectors are in `golden.rs`.

mod common;

use common::{hello_round_trip, reply_round_trip};
use devlend_fabric::handshake::{
    BlockGeometry, CoherenceMode, Credit, Hello, HelloReply, HelloStatus, NicLink, PciIdentity,
    PciRegion, DEV_DISCARD, DEV_WRITE_ZEROES,
};
use devlend_fabric::{net, pci, SERIAL_LEN};

/// Version 2: the hello, and the reply of each kind of device. Each golden is written
/// from the layout in `docs/protocol.md`, not captured from the encoder.
#[test]
fn handshake_v2() {
    let mut h = Hello::new("disk0", 0x0102);
    h.features = 0x0807_0605_0403_0201;
    h.borrower = std::array::from_fn(|i| 0xa0 + i as u8);
    h.token = vec![1, 2, 3];
    hello_round_trip(
        "hello v2",
        &h,
        "44564c44020002010102030405060708a0a1a2a3a4a5a6a7a8a9aaabacadaeaf050003006469736b30010203",
    );

    let mut serial = [0u8; SERIAL_LEN];
    serial[..4].copy_from_slice(b"SN01");
    let dev = BlockGeometry {
        capacity_sectors: 0x1112_1314_1516_1718,
        block_size: 4096,
        max_transfer: 0x0010_0000,
        max_discard_sectors: 0x0102_0304,
        max_write_zeroes_sectors: 0x0506_0708,
        flags: DEV_DISCARD | DEV_WRITE_ZEROES,
        serial,
    };
    let mut r = HelloReply::ok(dev.clone());
    r.features = 0x100;
    reply_round_trip(
        "v2 reply, block",
        &r,
        "44564c440200000000010000000000000000340000000000\
         01000000181716151413121100100000000010000403020108070605\
         06000000534e303100000000000000000000000000000000",
    );
    let mut r = HelloReply::ok(dev);
    r.credit = Some(Credit {
        requests: 0x0102_0304,
        bytes: 0x0506_0708,
    });
    r.features = devlend_fabric::FEATURE_CREDIT;
    reply_round_trip(
        "v2 reply, block, with a credit",
        &r,
        "44564c440200000008000000000000000000340000000000\
         0403020108070605\
         01000000181716151413121100100000000010000403020108070605\
         06000000534e303100000000000000000000000000000000",
    );

    let mut r = HelloReply::ok(NicLink {
        mac: [2, 1, 2, 3, 4, 5],
        mtu: 9000,
        up: true,
        offloads: devlend_fabric::handshake::description::NIC_OFFLOADS,
    });
    r.features = net::FEATURE_NET;
    reply_round_trip(
        "v2 reply, NIC",
        &r,
        "44564c440200000001000000000000000000180000000000\
         02000000020102030405000001000000282300000f000000",
    );

    let mut r = HelloReply::ok(PciIdentity {
        bdf: "0000:03:00.0".into(),
        vendor_id: 0x1234,
        device_id: 0x11e8,
        subsystem_vendor_id: 0x1af4,
        subsystem_id: 0x1100,
        class: 0x01_08_02,
        regions: vec![
            PciRegion {
                index: 0,
                size: 0x4000,
                flags: 3,
            },
            PciRegion {
                index: 7,
                size: 0x1000,
                flags: 3,
            },
        ],
        coherence: CoherenceMode::Mediated,
    });
    r.features = pci::FEATURE_PCI;
    reply_round_trip(
        "v2 reply, PCIe function",
        &r,
        "44564c440200000004000000000000000000400000000000\
         030000003412e811f41a001102080100010c0200\
         303030303a30333a30302e30\
         0000000003000000004000000000000007000000030000000010000000000000",
    );

    reply_round_trip(
        "v2 refusal",
        &HelloReply::refuse(HelloStatus::Denied, "no lease"),
        "44564c440200050000000000000000000800000000000000\
         6e6f206c65617365",
    );
}

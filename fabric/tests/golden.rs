//! Golden vectors: the bytes of every wire format, captured from the encoders before
//! they were ported to the `codec` module (commit d0c6a3b, hand-written offsets). Each
//! value must encode to exactly these bytes, and these bytes must decode to the value:
//! the wire does not change when the code does. Field values are distinct per byte
//! where they can be (0x0102…), so that a field at the wrong offset, of the wrong size
//! or in the wrong byte order shows.

use devlend_fabric::handshake::{
    BlockGeometry, Credit, Hello, HelloReply, HelloStatus, DEV_DISCARD, DEV_WRITE_ZEROES,
};
use devlend_fabric::lease_token::{LeaseClaims, LeaseToken, PublicKey, TokenSigner};
use devlend_fabric::net::{self, LinkState, NetMessage, Offload};
use devlend_fabric::pci::{self, Access, DmaRange, Irq, IrqAction, IrqInfo, IrqSet, MemRead};
use devlend_fabric::pci::{Message, PciInfo, PciStatus, Range, RegionInfo, RemoteDmaRange};
use devlend_fabric::rdma::{self, Segment};
use devlend_fabric::relay::{RelayReply, RelayRequest, RelayStatus};
use devlend_fabric::{
    BlockRequest, Bytes, RequestHeader, ResponseHeader, Sector, Sectors, Status, SERIAL_LEN,
};

mod common;

use common::{hello_round_trip, reply_round_trip, same};

#[test]
fn block_request_headers() {
    let cases = [
        (
            "read",
            RequestHeader {
                id: 0x0807_0605_0403_0201,
                request: BlockRequest::Read {
                    sector: Sector(0x1112_1314_1516_1718),
                    len: Bytes(0x0001_0200),
                },
            },
            "010000000002010001020304050607081817161514131211",
        ),
        (
            "write",
            RequestHeader {
                id: 42,
                request: BlockRequest::Write {
                    sector: Sector(8),
                    len: Bytes(4096),
                },
            },
            "02000000001000002a000000000000000800000000000000",
        ),
        (
            "flush",
            RequestHeader {
                id: u64::MAX,
                request: BlockRequest::Flush,
            },
            "0300000000000000ffffffffffffffff0000000000000000",
        ),
        (
            "discard",
            RequestHeader {
                id: 7,
                request: BlockRequest::Discard {
                    sector: Sector(0x0102_0304_0506_0708),
                    sectors: Sectors(0xa1b2_c3d4),
                },
            },
            "04000000d4c3b2a107000000000000000807060504030201",
        ),
        (
            "write-zeroes, unmap",
            RequestHeader {
                id: 0x1_0003,
                request: BlockRequest::WriteZeroes {
                    sector: Sector(1 << 40),
                    sectors: Sectors(16),
                    unmap: true,
                },
            },
            "050100001000000003000100000000000000000000010000",
        ),
        (
            "write-zeroes",
            RequestHeader {
                id: 0,
                request: BlockRequest::WriteZeroes {
                    sector: Sector(0),
                    sectors: Sectors(1),
                    unmap: false,
                },
            },
            "050000000100000000000000000000000000000000000000",
        ),
    ];
    for (name, h, golden) in cases {
        let b = h.encode();
        same(name, &b, golden);
        assert_eq!(RequestHeader::decode(&b).unwrap(), h, "{name}");
    }
}

#[test]
fn block_response_headers() {
    let cases = [
        (
            Status::Ok,
            0x0001_0200,
            0x0807_0605_0403_0201,
            "80000000000201000102030405060708",
        ),
        (Status::IoErr, 0, 9, "80010000000000000900000000000000"),
        (
            Status::Unsupp,
            0,
            u64::MAX,
            "8002000000000000ffffffffffffffff",
        ),
    ];
    for (status, len, id, golden) in cases {
        let h = ResponseHeader {
            status,
            len: Bytes(len),
            id,
            throttled: false,
        };
        let b = h.encode();
        same("response", &b, golden);
        assert_eq!(ResponseHeader::decode(&b).unwrap(), h);
    }
}

/// Version 1: the bytes of a version 1 peer, unchanged since they were captured.
#[test]
fn handshake() {
    let mut h = Hello::new("disk0", 0x0102);
    h.version = 1;
    h.features = 0x0807_0605_0403_0201;
    h.borrower = std::array::from_fn(|i| 0xa0 + i as u8);
    h.token = vec![1, 2, 3];
    hello_round_trip(
        "hello",
        &h,
        "44564c44010002010102030405060708a0a1a2a3a4a5a6a7a8a9aaabacadaeaf050003006469736b30010203",
    );
    hello_round_trip(
        "hello, anonymous",
        &Hello {
            version: 1,
            ..Hello::new("x", 0)
        },
        "44564c44010000000000000000000000000000000000000000000000000000000100000078",
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
    let mut r = HelloReply::ok(dev.clone()).for_version(1);
    r.features = 0x100;
    reply_round_trip(
        "reply",
        &r,
        "44564c440100000000010000000000001817161514131211001000000000100004030201\
         080706050600000000000000534e303100000000000000000000000000000000",
    );
    let mut r = HelloReply::ok(dev).for_version(1);
    r.features = devlend_fabric::FEATURE_CREDIT;
    r.credit = Some(Credit {
        requests: 0x0102_0304,
        bytes: 0x0506_0708,
    });
    reply_round_trip(
        "reply with a credit",
        &r,
        "44564c440100000008000000000000001817161514131211001000000000100004030201\
         080706050600000000000000534e3031000000000000000000000000000000000403020108070605",
    );
    reply_round_trip(
        "refusal",
        &HelloReply::refuse(HelloStatus::Denied, "no lease").for_version(1),
        "44564c44010005000000000000000000000000000000000000000000000000000000000000000000\
         000000000800000000000000000000000000000000000000000000006e6f206c65617365",
    );
}

#[test]
fn lease_token() {
    let claims = LeaseClaims {
        lease_id: [0xc0; 16],
        expires_at_ms: 0x0102_0304_0506_0708,
        provider: "lender-a".into(),
        device: "disk0".into(),
        consumer: "vm-1".into(),
        provider_key: None,
        qos: None,
        successor_of: None,
        epoch: None,
        holder_key: None,
    };
    let signer = TokenSigner::from_seed([0x5e; 32]);
    let t = signer.sign(&claims).unwrap();
    same(
        "lease token",
        t.as_bytes(),
        "01c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0080706050403020108006c656e6465722d6105006469736b\
         300400766d2d31a63fa5e47554f98914428475d1a2684f6669e7ca4a7e566ded4e4b3450eccfac71ed0a\
         4d8b07f2f8ba7012f9e2f5ea38056ec57634d0ffdb97a696d567260f09",
    );
    let text = "AcDAwMDAwMDAwMDAwMDAwMAIBwYFBAMCAQgAbGVuZGVyLWEFAGRpc2swBAB2bS0xpj-l5HVU-YkUQoR1\
                0aJoT2Zp58pKflZt7U5LNFDsz6xx7QpNiwfy-LpwEvni9eo4BW7FdjTQ_9uXppbVZyYPCQ";
    assert_eq!(t.to_text(), text);
    let key = PublicKey::from_text("gUZkDwJJOvT7xU_jM4jnXcLJN64LdyfMKyr7G3UZmj4").unwrap();
    assert_eq!(key, signer.public_key());
    assert_eq!(
        key.verify(&LeaseToken::from_text(text).unwrap()).unwrap(),
        claims
    );
}

#[test]
fn rdma_request_messages() {
    let mut out = vec![0u8; rdma::MAX_REQUEST_MSG];
    let segs = [
        Segment {
            addr: 0x0102_0304_0506_0708,
            rkey: 0x1112_1314,
            len: 512,
        },
        Segment {
            addr: 0x9000,
            rkey: 6,
            len: 1024,
        },
    ];
    let h = RequestHeader {
        id: 0x0807_0605_0403_0201,
        request: BlockRequest::Write {
            sector: Sector(3),
            len: Bytes(1536),
        },
    };
    let n = rdma::encode_request(&h.encode(), &segs, &mut out);
    same(
        "rdma write",
        &out[..n],
        "020000000006000001020304050607080300000000000000020000000000000008070605040302011413\
         12110002000000900000000000000600000000040000",
    );
    let mut back = Vec::new();
    assert_eq!(rdma::decode_request(&out[..n], &mut back).unwrap(), h);
    assert_eq!(back, segs);
    let flush = RequestHeader {
        id: 5,
        request: BlockRequest::Flush,
    };
    let n = rdma::encode_request(&flush.encode(), &[], &mut out);
    same(
        "rdma flush",
        &out[..n],
        "0300000000000000050000000000000000000000000000000000000000000000",
    );
    assert_eq!(rdma::decode_request(&out[..n], &mut back).unwrap(), flush);
}

#[test]
fn pci_messages() {
    let m = Message {
        kind: pci::KIND_PUSH,
        status: PciStatus::Ok,
        flags: pci::FLAG_MORE,
        payload: vec![9, 8, 7],
    };
    same("pci message", &m.encode(), "4700010003000000090807");
    assert_eq!(Message::read_from(&mut m.encode().as_slice()).unwrap(), m);
    let mut buf = [0u8; 11];
    assert_eq!(m.encode_into(&mut buf), Some(11));
    same("pci message, into", &buf, "4700010003000000090807");
    assert_eq!(m.encode_into(&mut buf[..10]), None);
    let r = Message::refusal(pci::KIND_READ, PciStatus::Unsupported, "nope");
    same("pci refusal", &r.encode(), "c1030000040000006e6f7065");
    assert_eq!(Message::read_from(&mut r.encode().as_slice()).unwrap(), r);

    let info = PciInfo {
        regions: vec![
            RegionInfo {
                size: 0x0102_0304_0506_0708,
                flags: 3,
            },
            RegionInfo::default(),
        ],
        irqs: vec![IrqInfo {
            count: 0x11,
            flags: 7,
        }],
        flags: pci::INFO_RESET | pci::INFO_MEDIATED,
    };
    same(
        "pci info",
        &info.encode(),
        "020000000100000003000000000000000807060504030201030000000000000000000000000000000000\
         0000000000001100000007000000",
    );
    assert_eq!(PciInfo::decode(&info.encode()).unwrap(), info);

    let a = Access {
        region: 0x0102_0304,
        len: 4,
        offset: 0x1112_1314_1516_1718,
    };
    same(
        "pci access",
        &a.encode(),
        "04030201040000001817161514131211",
    );
    assert_eq!(Access::decode(&a.encode(), false).unwrap(), (a, &[][..]));
    let mut w = a.encode();
    w.extend_from_slice(&[1, 2, 3, 4]);
    same("pci write", &w, "0403020104000000181716151413121101020304");
    assert_eq!(Access::decode(&w, true).unwrap(), (a, &[1, 2, 3, 4][..]));

    for (s, golden) in [
        (
            IrqSet {
                index: 2,
                action: IrqAction::Enable,
                count: 0x0102_0304,
            },
            "020000000100000004030201",
        ),
        (
            IrqSet {
                index: 0,
                action: IrqAction::Unmask,
                count: 0,
            },
            "000000000200000000000000",
        ),
    ] {
        same("pci irq set", &s.encode(), golden);
        assert_eq!(IrqSet::decode(&s.encode()).unwrap(), s);
    }

    let d = DmaRange {
        iova: 0x0102_0304_0506_0000,
        size: 0x2000,
    };
    same(
        "pci dma range",
        &d.encode(),
        "00000605040302010020000000000000",
    );
    assert_eq!(DmaRange::decode(&d.encode()).unwrap(), d);
    let rd = RemoteDmaRange {
        range: DmaRange {
            iova: 0x10_0000,
            size: 0x2000,
        },
        addr: 0x7f01_0203_0405,
        rkey: 0x1234_5678,
    };
    same(
        "pci remote dma range",
        &rd.encode(),
        "0000100000000000002000000000000005040302017f00007856341200000000",
    );
    assert_eq!(RemoteDmaRange::decode(&rd.encode()).unwrap(), rd);

    let ranges = [
        Range {
            iova: 0x0102_0304_0506_0708,
            len: 0x1000,
        },
        Range {
            iova: 0x3000,
            len: 1,
        },
    ];
    let mut b = Vec::new();
    for r in ranges {
        pci::encode_range(r, &mut b);
    }
    same(
        "pci ranges",
        &b,
        "0807060504030201001000000000000000300000000000000100000000000000",
    );
    assert_eq!(pci::decode_ranges(&b).unwrap(), ranges);

    let mut b = Vec::new();
    pci::encode_page(0x0102_0304_0506_0000, &[0xaa, 0xbb], &mut b);
    pci::encode_page(0x3000, &[1], &mut b);
    same(
        "pci pages",
        &b,
        "00000605040302010200000000000000aabb0030000000000000010000000000000001",
    );
    let pages = pci::decode_pages(&b).unwrap();
    assert_eq!(pages.len(), 2);
    assert_eq!(
        (pages[0].iova, pages[0].data),
        (0x0102_0304_0506_0000, &[0xaa, 0xbb][..])
    );
    assert_eq!((pages[1].iova, pages[1].data), (0x3000, &[1][..]));

    let mr = MemRead {
        iova: 0x0102_0304_0506_0708,
        len: 64,
    };
    same(
        "pci mem read",
        &mr.encode(),
        "08070605040302014000000000000000",
    );
    assert_eq!(MemRead::decode(&mr.encode()).unwrap(), mr);
    let irq = Irq {
        index: 0x0102_0304,
        vector: 0x0506_0708,
    };
    same("pci irq", &irq.encode(), "0403020108070605");
    assert_eq!(Irq::decode(&irq.encode()).unwrap(), irq);
}

/// Decodes one whole message of `b`.
fn net_one(b: &[u8]) -> NetMessage<'_> {
    let (m, n) = net::decode(b).unwrap().expect("a whole message");
    assert_eq!(n, b.len());
    m
}

#[test]
fn nic_frame_messages() {
    for (link, golden) in [
        (
            LinkState {
                up: true,
                mtu: 0x0102_0304,
                mac: [2, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5],
            },
            "2100000010000000010000000403020102a1a2a3a4a50000",
        ),
        (
            LinkState {
                up: false,
                mtu: 1500,
                mac: [0; 6],
            },
            "210000001000000000000000dc0500000000000000000000",
        ),
    ] {
        let mut b = Vec::new();
        link.encode(&mut b);
        same("net link", &b, golden);
        assert_eq!(net_one(&b), NetMessage::Link(link));
    }
    let frame: Vec<u8> = (0..14).collect();
    let mut b = Vec::new();
    net::encode_frame(&frame, &mut b);
    same(
        "net frame",
        &b,
        "200000000e000000000102030405060708090a0b0c0d",
    );
    assert_eq!(net_one(&b), NetMessage::Frame(&frame));

    let o = Offload {
        flags: net::OFFLOAD_NEEDS_CSUM,
        gso_type: net::GSO_TCPV4 | net::GSO_ECN,
        hdr_len: 0x0102,
        gso_size: 0x0304,
        csum_start: 0x0506,
        csum_offset: 0x0708,
    };
    same("net offload header", &o.to_bytes(), "01810201040306050807");
    assert_eq!(Offload::from_bytes(&o.to_bytes()), o);
    let o = Offload {
        flags: net::OFFLOAD_NEEDS_CSUM,
        gso_type: net::GSO_TCPV4,
        hdr_len: 54,
        gso_size: 1448,
        csum_start: 4,
        csum_offset: 6,
    };
    let mut b = Vec::new();
    net::encode_offload_frame(&o, &frame, &mut b);
    same(
        "net offload frame",
        &b,
        "220000001800000001013600a80504000600000102030405060708090a0b0c0d",
    );
    assert_eq!(net_one(&b), NetMessage::OffloadFrame(o, &frame));

    let mut b = Vec::new();
    net::encode_offloads(net::RX_CSUM | net::RX_TSO6, &mut b);
    same("net offloads", &b, "230000000400000005000000");
    assert_eq!(
        net_one(&b),
        NetMessage::Offloads(net::RX_CSUM | net::RX_TSO6)
    );
    same(
        "net header",
        &net::header(net::KIND_FRAME, 0x0102_0304),
        "2000000004030201",
    );
}

#[test]
fn relay_preamble() {
    let mut r = RelayRequest::new("site-b", "lender1");
    r.ttl = 3;
    let b = r.encode().unwrap();
    same(
        "relay request",
        &b,
        "444c47570103060700000000736974652d626c656e64657231",
    );
    assert_eq!(RelayRequest::decode(&b).unwrap(), r);
    assert_eq!(RelayRequest::read_from(&mut b.as_slice()).unwrap(), r);
    for (reply, golden) in [
        (RelayReply::ok(), "444c475701000000"),
        (
            RelayReply::refuse(RelayStatus::TtlExceeded, "loop"),
            "444c4757010404006c6f6f70",
        ),
    ] {
        let b = reply.encode();
        same("relay reply", &b, golden);
        assert_eq!(RelayReply::read_from(&mut b.as_slice()).unwrap(), reply);
    }
}

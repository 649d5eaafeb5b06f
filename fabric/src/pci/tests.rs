use super::*;

#[test]
fn messages_round_trip_and_garbage_is_refused() {
    let m = Message::new(KIND_WRITE, {
        let mut p = Access {
            region: 0,
            len: 4,
            offset: 8,
        }
        .encode();
        p.extend_from_slice(&5u32.to_le_bytes());
        p
    });
    let b = m.encode();
    let back = Message::read_from(&mut b.as_slice()).unwrap();
    assert_eq!(back, m);
    let (a, data) = Access::decode(&back.payload, true).unwrap();
    assert_eq!(
        (a.region, a.len, a.offset, data),
        (0, 4, 8, &[5, 0, 0, 0][..])
    );
    assert!(Access::decode(&back.payload, false).is_err());

    let mut bad = b.clone();
    bad[0] = 0x33;
    assert!(Message::read_from(&mut bad.as_slice()).is_err());
    let mut bad = b.clone();
    bad[1] = 1; // a status in a request
    assert!(Message::read_from(&mut bad.as_slice()).is_err());
    let mut bad = b.clone();
    bad[4..8].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
    assert!(matches!(
        Message::read_from(&mut bad.as_slice()),
        Err(WireError::TooLong { .. })
    ));
    assert!(matches!(
        Message::read_from(&mut &b[..10]),
        Err(WireError::Truncated { .. })
    ));
    let r = Message::refusal(KIND_READ, PciStatus::Invalid, "no such region");
    let back = Message::read_from(&mut r.encode().as_slice()).unwrap();
    assert_eq!(back.kind, KIND_READ | REPLY);
    assert_eq!(back.status, PciStatus::Invalid);
}

#[test]
fn peer_group_and_counters_messages_are_read_and_the_kinds_past_them_refused() {
    for m in [
        Message::new(KIND_PEER_GROUP, PeerGroup { vm: [1; 16] }.encode()),
        Message::new(KIND_PEER_GROUP | REPLY, Vec::new()),
        Message::new(KIND_COUNTERS, DmaCounters::default().encode()),
    ] {
        let back = Message::read_from(&mut m.encode().as_slice()).unwrap();
        assert_eq!(back, m);
    }
    for kind in [
        KIND_PEER_GROUP + 1,
        KIND_COUNTERS + 1,
        KIND_COUNTERS | REPLY,
    ] {
        let b = Message::new(kind, Vec::new()).encode();
        assert!(Message::read_from(&mut b.as_slice()).is_err(), "{kind:#x}");
    }
}

#[test]
fn info_pages_and_ranges_round_trip() {
    let info = PciInfo {
        regions: vec![
            RegionInfo {
                size: 1 << 20,
                flags: 3,
            },
            RegionInfo::default(),
        ],
        irqs: vec![IrqInfo { count: 1, flags: 7 }],
        flags: INFO_RESET,
    };
    assert_eq!(PciInfo::decode(&info.encode()).unwrap(), info);
    let mut p = info.encode();
    p.pop();
    assert!(PciInfo::decode(&p).is_err());

    let mut b = Vec::new();
    encode_page(0x1000, &[1; 4096], &mut b);
    encode_page(0x3000, &[2; 10], &mut b);
    let pages = decode_pages(&b).unwrap();
    assert_eq!(pages.len(), 2);
    assert_eq!(pages[1].iova, 0x3000);
    assert_eq!(pages[1].data, &[2; 10]);
    assert!(decode_pages(&b[..b.len() - 1]).is_err());

    let r = DmaRange {
        iova: 0x10_0000,
        size: 0x2000,
    };
    assert_eq!(DmaRange::decode(&r.encode()).unwrap(), r);
    for bad in [
        DmaRange {
            iova: 1,
            size: 4096,
        },
        DmaRange { iova: 0, size: 0 },
        DmaRange {
            iova: u64::MAX - 4095,
            size: 8192,
        },
    ] {
        assert!(DmaRange::decode(&bad.encode()).is_err());
    }
    let s = IrqSet {
        index: 1,
        action: IrqAction::Enable,
        count: 1,
    };
    assert_eq!(IrqSet::decode(&s.encode()).unwrap(), s);
    let s = IrqSet {
        index: 1,
        action: IrqAction::Enable,
        count: 0,
    };
    assert!(IrqSet::decode(&s.encode()).is_err());
    let i = Irq {
        index: 2,
        vector: 5,
    };
    assert_eq!(Irq::decode(&i.encode()).unwrap(), i);
    let r = MemRead {
        iova: 0x1000,
        len: 64,
    };
    assert_eq!(MemRead::decode(&r.encode()).unwrap(), r);
    for bad in [
        MemRead { iova: 0, len: 0 },
        MemRead {
            iova: u64::MAX,
            len: 2,
        },
        MemRead {
            iova: 0,
            len: MAX_ACCESS + 1,
        },
    ] {
        assert!(MemRead::decode(&bad.encode()).is_err());
    }
    let m = Message::new(KIND_MEM_WRITE, b.clone());
    assert_eq!(Message::read_from(&mut m.encode().as_slice()).unwrap(), m);
}

#[test]
fn rdma_maps_and_range_lists_round_trip_and_garbage_is_refused() {
    let m = RemoteDmaRange {
        range: DmaRange {
            iova: 0x10_0000,
            size: 0x2000,
        },
        addr: 0x7f00_0000_0000,
        rkey: 0x1234,
    };
    let b = m.encode();
    assert_eq!(b.len(), 32);
    assert_eq!(RemoteDmaRange::decode(&b).unwrap(), m);
    assert!(
        RemoteDmaRange::decode(&b[..16]).is_err(),
        "a TCP map over RDMA"
    );
    let mut bad = b.clone();
    bad[28] = 1;
    assert!(RemoteDmaRange::decode(&bad).is_err(), "reserved");
    let mut bad = b.clone();
    bad[16..24].copy_from_slice(&(u64::MAX - 10).to_le_bytes());
    assert!(RemoteDmaRange::decode(&bad).is_err(), "wrapping address");

    let mut p = Vec::new();
    let rs = [
        Range {
            iova: 0x10_0000,
            len: 4096,
        },
        Range {
            iova: 0x10_3000,
            len: 8192,
        },
    ];
    for r in rs {
        encode_range(r, &mut p);
    }
    assert_eq!(decode_ranges(&p).unwrap(), rs);
    assert!(decode_ranges(&p[..20]).is_err(), "a cut entry");
    let mut bad = p.clone();
    bad[8..12].fill(0);
    assert!(decode_ranges(&bad).is_err(), "an empty range");
    let mut bad = p.clone();
    bad[15] = 1;
    assert!(decode_ranges(&bad).is_err(), "reserved");
    let long = vec![0u8; (RDMA_MAX_RANGES + 1) * 16];
    assert!(decode_ranges(&long).is_err(), "too many");
    assert!(decode_ranges(&[]).unwrap().is_empty());
}

//! Round-trip and refusal tests of the two handshake messages, both versions.

use super::*;
use crate::lender_proof::CHALLENGE_LEN;
use crate::SERIAL_LEN;
use description::BLOCK_DESCRIPTION_LEN;

#[test]
fn credit_admits_within_requests_and_bytes() {
    let c = Credit {
        requests: 2,
        bytes: 1 << 20,
    };
    assert!(c.admits(0, 0, 8 << 20), "alone, any length goes");
    assert!(c.admits(1, 512 << 10, 512 << 10));
    assert!(!c.admits(1, 512 << 10, (512 << 10) + 512));
    assert!(!c.admits(2, 0, 0), "no third request");
}

#[test]
fn hello_round_trips() {
    let mut h = Hello::new("disk0", 3);
    h.borrower = [7; 16];
    let mut buf = Vec::new();
    h.write_to(&mut buf).unwrap();
    assert_eq!(Hello::read_from(&mut buf.as_slice()).unwrap(), h);
    h.token = vec![9; 300];
    let mut buf = Vec::new();
    h.write_to(&mut buf).unwrap();
    assert_eq!(buf.len(), 36 + 5 + 300);
    assert_eq!(Hello::read_from(&mut buf.as_slice()).unwrap(), h);
    let cut = &buf[..buf.len() - 1];
    assert!(matches!(
        Hello::read_from(&mut &cut[..]),
        Err(WireError::Truncated { .. })
    ));
    let mut long = buf.clone();
    long[34..36].copy_from_slice(&2000u16.to_le_bytes());
    assert!(matches!(
        Hello::read_from(&mut long.as_slice()),
        Err(WireError::TooLong {
            what: "lease token",
            ..
        })
    ));
}

#[test]
fn hello_rejects_bad_magic_truncation_and_long_names() {
    let mut buf = Vec::new();
    Hello::new("disk0", 0).write_to(&mut buf).unwrap();
    let mut bad = buf.clone();
    bad[0] = b'X';
    assert!(matches!(
        Hello::read_from(&mut bad.as_slice()),
        Err(WireError::BadMagic(_))
    ));
    let cut = &buf[..10];
    assert!(matches!(
        Hello::read_from(&mut &cut[..]),
        Err(WireError::Truncated { got: 10, want: 36 })
    ));
    let cut = &buf[..38];
    assert!(matches!(
        Hello::read_from(&mut &cut[..]),
        Err(WireError::Truncated { .. })
    ));
    let mut long = buf.clone();
    long[32..34].copy_from_slice(&1000u16.to_le_bytes());
    assert!(matches!(
        Hello::read_from(&mut long.as_slice()),
        Err(WireError::TooLong { .. })
    ));
    assert!(Hello::new(&"x".repeat(300), 0)
        .write_to(&mut Vec::new())
        .is_err());
}

#[test]
fn net_reply_round_trips() {
    let link = crate::net::LinkState {
        up: true,
        mtu: 9000,
        mac: [2, 1, 2, 3, 4, 5],
    };
    let mut r = HelloReply::ok(NicLink::new(&link, 0));
    r.features = crate::net::FEATURE_NET;
    let mut buf = Vec::new();
    r.write_to(&mut buf).unwrap();
    let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!(back, r);
    assert_eq!(back.nic().map(NicLink::link), Some(link));
}

#[test]
fn a_challenge_and_its_proof_round_trip() {
    let key = crate::lease_token::TokenSigner::from_seed([5; 32]);
    let mut h = Hello::new("disk0", 3);
    h.borrower = [1; 16];
    h.token = vec![9; 40];
    h.challenge = Some([0xab; CHALLENGE_LEN]);
    let mut buf = Vec::new();
    h.write_to(&mut buf).unwrap();
    assert_eq!(buf.len(), HELLO_FIXED_LEN + 5 + 40 + CHALLENGE_LEN);
    let back = Hello::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!(back.challenge, h.challenge);
    assert_eq!(back.features & FEATURE_LENDER_PROOF, FEATURE_LENDER_PROOF);
    assert_eq!(back.token, h.token);
    // A hello cut inside its challenge is refused.
    assert!(Hello::read_from(&mut &buf[..buf.len() - 1]).is_err());

    let mut r = HelloReply::ok(BlockGeometry {
        block_size: 512,
        ..BlockGeometry::default()
    });
    r.credit = Some(Credit {
        requests: 8,
        bytes: 1 << 20,
    });
    r.proof = back.prove(&key);
    let mut buf = Vec::new();
    r.write_to(&mut buf).unwrap();
    assert_eq!(
        buf.len(),
        REPLY_FIXED_LEN + CREDIT_LEN + PROOF_LEN + BLOCK_DESCRIPTION_LEN
    );
    let got = HelloReply::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!((&got.proof, got.credit), (&r.proof, r.credit));
    assert_eq!(got.features, FEATURE_CREDIT | FEATURE_LENDER_PROOF);
    h.check_proof(got.proof.as_ref(), &key.public_key())
        .unwrap();
    // No challenge: no proof.
    assert_eq!(Hello::new("disk0", 0).prove(&key), None);
    // A reply without a proof does not claim one.
    r.proof = None;
    let mut buf = Vec::new();
    r.write_to(&mut buf).unwrap();
    let got = HelloReply::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!(got.features & FEATURE_LENDER_PROOF, 0);
}

#[test]
fn reply_round_trips() {
    let mut serial = [0u8; SERIAL_LEN];
    serial[..4].copy_from_slice(b"SN01");
    let r = HelloReply::ok(BlockGeometry {
        capacity_sectors: 2048,
        block_size: 4096,
        max_transfer: 1 << 20,
        max_discard_sectors: 1 << 16,
        max_write_zeroes_sectors: 1 << 16,
        flags: DEV_DISCARD | DEV_READ_ONLY,
        serial,
    });
    let mut buf = Vec::new();
    r.write_to(&mut buf).unwrap();
    let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!(back, r);
    assert!(back.block().is_some_and(BlockGeometry::read_only));

    let mut granted = HelloReply::ok(BlockGeometry {
        block_size: 512,
        ..BlockGeometry::default()
    });
    granted.credit = Some(Credit {
        requests: 256,
        bytes: 32 << 20,
    });
    let mut buf = Vec::new();
    granted.write_to(&mut buf).unwrap();
    assert_eq!(
        buf.len(),
        REPLY_FIXED_LEN + CREDIT_LEN + BLOCK_DESCRIPTION_LEN
    );
    let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!(back.features & FEATURE_CREDIT, FEATURE_CREDIT);
    assert_eq!(back.credit, granted.credit);
    // A credit of no request would stall the borrower for good.
    buf[REPLY_FIXED_LEN..REPLY_FIXED_LEN + 4].fill(0);
    assert!(HelloReply::read_from(&mut buf.as_slice()).is_err());
    let refusal = HelloReply::refuse(HelloStatus::NoSuchDevice, "no device \"x\"");
    let mut buf = Vec::new();
    refusal.write_to(&mut buf).unwrap();
    assert_eq!(HelloReply::read_from(&mut buf.as_slice()).unwrap(), refusal);
}

fn sample_block() -> BlockGeometry {
    let mut serial = [0u8; SERIAL_LEN];
    serial[..4].copy_from_slice(b"SN01");
    BlockGeometry {
        capacity_sectors: 2048,
        block_size: 4096,
        max_transfer: 1 << 20,
        max_discard_sectors: 1 << 16,
        max_write_zeroes_sectors: 1 << 16,
        flags: DEV_DISCARD | DEV_READ_ONLY,
        serial,
    }
}

fn sample_nic() -> NicLink {
    NicLink {
        mac: [2, 1, 2, 3, 4, 5],
        mtu: 1500,
        up: true,
        offloads: description::NIC_OFFLOADS,
    }
}

fn sample_pci(bdf: &str) -> PciIdentity {
    PciIdentity {
        bdf: bdf.into(),
        vendor_id: 0x1b36,
        device_id: 0x0010,
        subsystem_vendor_id: 0x1af4,
        subsystem_id: 0x1100,
        class: 0x01_08_02,
        regions: (0..8)
            .map(|index| PciRegion {
                index,
                size: 0x1000 << index,
                flags: 3,
            })
            .collect(),
        coherence: CoherenceMode::Mediated,
    }
}

fn samples() -> Vec<DeviceDescription> {
    vec![
        sample_block().into(),
        sample_nic().into(),
        sample_pci("0000:03:00.0").into(),
    ]
}

fn encoded(d: &DeviceDescription) -> Vec<u8> {
    let mut b = Vec::new();
    d.encode(&mut b).unwrap();
    b
}

#[test]
fn every_kind_round_trips_in_a_v2_reply() {
    for d in samples() {
        let b = encoded(&d);
        assert_eq!(DeviceDescription::decode(&b).unwrap(), d);
        let r = HelloReply::ok(d.clone());
        let mut buf = Vec::new();
        r.write_to(&mut buf).unwrap();
        assert_eq!(buf.len(), REPLY_FIXED_LEN + b.len());
        let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.version, 2);
        assert_eq!(back.device, Some(d));
    }
}

#[test]
fn a_description_cut_anywhere_is_refused() {
    for d in samples() {
        let b = encoded(&d);
        for n in 0..b.len() {
            assert!(
                matches!(
                    DeviceDescription::decode(&b[..n]),
                    Err(WireError::Truncated { .. })
                ),
                "{d:?} cut at {n}"
            );
        }
        let mut long = b.clone();
        long.push(0);
        assert!(
            matches!(DeviceDescription::decode(&long), Err(WireError::Invalid(_))),
            "trailing byte after {d:?}"
        );
    }
}

#[test]
fn an_unknown_kind_or_an_oversized_description_is_refused() {
    for tag in [0u8, 4, 0xff] {
        let mut b = encoded(&sample_block().into());
        b[0] = tag;
        assert!(matches!(
            DeviceDescription::decode(&b),
            Err(WireError::Invalid("unknown device description kind"))
        ));
    }
    let big = vec![0u8; MAX_DESCRIPTION_LEN + 1];
    assert!(matches!(
        DeviceDescription::decode(&big),
        Err(WireError::TooLong { .. })
    ));
    // The longest PCIe description fits the limit exactly.
    let mut p = sample_pci(&"0".repeat(description::MAX_BDF_LEN));
    p.regions = (0..description::MAX_DESCRIPTION_REGIONS as u32)
        .map(|index| PciRegion {
            index,
            size: 1,
            flags: 1,
        })
        .collect();
    let b = encoded(&p.clone().into());
    assert_eq!(b.len(), MAX_DESCRIPTION_LEN);
    assert_eq!(DeviceDescription::decode(&b).unwrap(), p.into());
    // Over the limits: refused when encoding, and when decoding.
    let long = sample_pci(&"0".repeat(description::MAX_BDF_LEN + 1));
    assert!(DeviceDescription::from(long)
        .encode(&mut Vec::new())
        .is_err());
    let mut b = encoded(&sample_pci("0000:03:00.0").into());
    b[4 + 14] = description::MAX_DESCRIPTION_REGIONS as u8 + 1; // region_count
    assert!(matches!(
        DeviceDescription::decode(&b),
        Err(WireError::TooLong {
            what: "PCIe regions",
            ..
        })
    ));
    // A reply announcing a description over the limit is refused before it is read.
    let mut buf = Vec::new();
    HelloReply::ok(sample_nic()).write_to(&mut buf).unwrap();
    buf[18..20].copy_from_slice(&(MAX_DESCRIPTION_LEN as u16 + 1).to_le_bytes());
    assert!(matches!(
        HelloReply::read_from(&mut buf.as_slice()),
        Err(WireError::TooLong {
            what: "device description",
            ..
        })
    ));
}

#[test]
fn invalid_fields_of_a_description_are_refused() {
    let mut bad = encoded(&sample_block().into());
    bad[4 + 8..4 + 12].copy_from_slice(&1000u32.to_le_bytes()); // block size
    assert!(DeviceDescription::decode(&bad).is_err());
    // An MTU no guest can use (a loopback's 65536) is described as it is: the borrower
    // refuses it at attach with its own message.
    let mut lo = encoded(&sample_nic().into());
    lo[4 + 12..4 + 16].copy_from_slice(&65536u32.to_le_bytes()); // MTU
    let d = DeviceDescription::decode(&lo).expect("any MTU is described");
    assert_eq!(d.as_nic().map(|n| n.mtu), Some(65536));
    let mut bad = encoded(&sample_nic().into());
    bad[2] = 1; // reserved
    assert!(DeviceDescription::decode(&bad).is_err());
    let mut bad = encoded(&sample_pci("0000:03:00.0").into());
    bad[4 + 12] = 2; // coherence
    assert!(matches!(
        DeviceDescription::decode(&bad),
        Err(WireError::Invalid("unknown PCIe coherence mode"))
    ));
    let mut bad = encoded(&sample_pci("0000:03:00.0").into());
    bad[4 + 16] = 0xff; // address not UTF-8
    assert!(DeviceDescription::decode(&bad).is_err());
    // A v2 reply must describe exactly an open session.
    let mut buf = Vec::new();
    HelloReply::refuse(HelloStatus::Busy, "busy")
        .write_to(&mut buf)
        .unwrap();
    buf[6] = 0; // status Ok, no description
    assert!(HelloReply::read_from(&mut buf.as_slice()).is_err());
}

#[test]
fn a_v1_reply_of_each_kind_reads_into_its_description() {
    let block = sample_block();
    let nic = sample_nic();
    let pci = sample_pci("0000:03:00.0");
    for (d, want) in [
        (
            DeviceDescription::from(block.clone()),
            DeviceDescription::from(block),
        ),
        (nic.into(), NicLink { offloads: 0, ..nic }.into()),
        (
            pci.clone().into(),
            PciIdentity {
                bdf: pci.bdf.clone(),
                ..PciIdentity::default()
            }
            .into(),
        ),
    ] {
        let r = HelloReply::ok(d).for_version(1);
        let mut buf = Vec::new();
        r.write_to(&mut buf).unwrap();
        assert_eq!(buf.len(), V1_REPLY_FIXED_LEN);
        assert_eq!(&buf[4..6], &1u16.to_le_bytes());
        let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!(back.version, 1);
        assert_eq!(back.device, Some(want));
    }
    // Version 1's flags, as a version 1 lender sends them.
    let mut buf = Vec::new();
    HelloReply::ok(sample_nic())
        .for_version(1)
        .write_to(&mut buf)
        .unwrap();
    let flags = u32::from_le_bytes([buf[40], buf[41], buf[42], buf[43]]);
    assert_eq!(flags, v1::DEV_NET | v1::DEV_LINK_UP);
    // A version 1 refusal carries no description.
    let mut buf = Vec::new();
    HelloReply::refuse(HelloStatus::UnsupportedVersion, "v3")
        .for_version(1)
        .write_to(&mut buf)
        .unwrap();
    let back = HelloReply::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!((back.version, back.device), (1, None));
}

#[test]
fn a_reply_of_an_unknown_version_is_refused() {
    let mut buf = Vec::new();
    HelloReply::ok(sample_block()).write_to(&mut buf).unwrap();
    buf[4..6].copy_from_slice(&3u16.to_le_bytes());
    assert!(matches!(
        HelloReply::read_from(&mut buf.as_slice()),
        Err(WireError::UnsupportedVersion(3))
    ));
    assert!(speaks(1) && speaks(2) && !speaks(0) && !speaks(3));
    assert!(unsupported_version_message(3).contains("versions 1 to 2"));
}

#[test]
fn a_lender_key_hint_and_a_possession_handshake_round_trip() {
    let key = crate::lease_token::TokenSigner::from_seed([4; 32]);
    let mut h = Hello::new("disk0", 3);
    h.borrower = [9; 16];
    h.token = vec![1, 2, 3];
    h.ask_proof_of(&key.public_key());
    h.holder = Some(crate::holder_proof::Holder {
        key: crate::holder_proof::HolderKey::new(crate::lease_token::TokenSigner::from_seed(
            [5; 32],
        )),
        lender: Some(key.public_key()),
    });
    let mut buf = Vec::new();
    h.write_to(&mut buf).unwrap();
    // The token waits for the lender's proof; the hint follows the challenge.
    assert_eq!(buf.len(), HELLO_FIXED_LEN + 5 + 32 + 32);
    let back = Hello::read_from(&mut buf.as_slice()).unwrap();
    assert!(back.token.is_empty() && back.proves_possession());
    assert_eq!(back.expected_lender, Some(key.public_key().to_bytes()));
    assert_eq!(back.challenge, h.challenge);
    // As read (no holder key on the lender's side), it encodes back to its bytes (the
    // wire_decode fuzz target's property).
    let mut again = Vec::new();
    back.write_to(&mut again).unwrap();
    assert_eq!(again, buf);
    // A hint without a challenge, and a token in a hello that proves possession, are
    // protocol errors.
    let mut bad = buf.clone();
    bad[8..16].copy_from_slice(
        &(crate::lender_proof::FEATURE_LENDER_KEY_HINT | crate::holder_proof::FEATURE_HOLDER_PROOF)
            .to_le_bytes(),
    );
    assert!(Hello::read_from(&mut bad.as_slice()).is_err());
    let mut plain = h.clone();
    plain.holder = None;
    let mut bad = Vec::new();
    plain.write_to(&mut bad).unwrap();
    let f = u64::from_le_bytes(bad[8..16].try_into().unwrap())
        | crate::holder_proof::FEATURE_HOLDER_PROOF;
    bad[8..16].copy_from_slice(&f.to_le_bytes());
    assert!(Hello::read_from(&mut bad.as_slice()).is_err());
    // The interim reply carries the proof and the nonce, and only an interim reply may.
    let nonce = [7; 32];
    let interim = HelloReply::prove(back.prove(&key), nonce);
    let mut buf = Vec::new();
    interim.write_to(&mut buf).unwrap();
    let got = HelloReply::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!(got.status, HelloStatus::Prove);
    assert_eq!(got.nonce, Some(nonce));
    let p = crate::holder_proof::answer(&h, h.holder.as_ref().unwrap(), &got).unwrap();
    assert_eq!(p.token, h.token);
    // A lender that proves another key gets no token.
    let rogue = HelloReply::prove(
        back.prove(&crate::lease_token::TokenSigner::from_seed([6; 32])),
        nonce,
    );
    assert!(crate::holder_proof::answer(&h, h.holder.as_ref().unwrap(), &rogue).is_err());
    let mut ok = HelloReply::refuse(HelloStatus::Denied, "no");
    ok.nonce = Some(nonce);
    let mut buf = Vec::new();
    ok.write_to(&mut buf).unwrap();
    assert!(HelloReply::read_from(&mut buf.as_slice()).is_err());
}

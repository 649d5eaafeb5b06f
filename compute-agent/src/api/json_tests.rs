//! Tests of the API's attachment JSON: each kind shows its own fields, field by field,
//! and none of the other kinds'.

use std::collections::BTreeSet;

use serde_json::{json, Value};

use super::*;

fn shared(part: KindInfo) -> AttachmentInfo {
    AttachmentInfo {
        id: "a0".into(),
        lender: "10.0.0.9:7700".into(),
        device: "dev0".into(),
        socket: "/run/devlend/a0.sock".into(),
        connected: true,
        vmm: None,
        lease: None,
        limits: None,
        lease_ended: false,
        handover: None,
        lender_lost: false,
        transport: "tcp".into(),
        restoring: None,
        part,
    }
}

const SHARED: [&str; 10] = [
    "id",
    "lender",
    "device",
    "socket",
    "connected",
    "vmm",
    "lease",
    "lease_ended",
    "lender_lost",
    "transport",
];

/// The object's keys are exactly the shared ones, `kind`, and `own`.
fn assert_keys(v: &Value, own: &[&str]) {
    let keys: BTreeSet<&str> = v
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    let want: BTreeSet<&str> = SHARED.iter().chain(own).copied().chain(["kind"]).collect();
    assert_eq!(keys, want, "{v}");
}

/// Serializes, checks that it reads back the same, and returns the JSON.
fn round_trip(a: &AttachmentInfo) -> Value {
    let v = serde_json::to_value(a).expect("serialize");
    let back: AttachmentInfo = serde_json::from_value(v.clone()).expect("deserialize");
    assert_eq!(&back, a);
    v
}

#[test]
fn a_block_attachment_shows_its_geometry_and_io_counters_only() {
    let mut counters = IoCounters {
        reads: 3,
        writes: 4,
        bytes_read: 4096,
        ..IoCounters::default()
    };
    counters.per_queue = vec![7, 0];
    let a = shared(KindInfo::Block(BlockInfo {
        queues: 2,
        queue_size: 256,
        capacity_sectors: 262_144,
        block_size: 512,
        read_only: true,
        serial: "SN123".into(),
        counters,
        rates: None,
    }));
    let v = round_trip(&a);
    assert_keys(
        &v,
        &[
            "queues",
            "queue_size",
            "capacity_sectors",
            "block_size",
            "read_only",
            "serial",
            "counters",
            "rates",
        ],
    );
    assert_eq!(v["kind"], "block");
    assert_eq!(v["queues"], 2);
    assert_eq!(v["queue_size"], 256);
    assert_eq!(v["capacity_sectors"], 262_144);
    assert_eq!(v["block_size"], 512);
    assert_eq!(v["read_only"], true);
    assert_eq!(v["serial"], "SN123");
    assert_eq!(v["counters"]["reads"], 3);
    assert_eq!(v["counters"]["writes"], 4);
    assert_eq!(v["counters"]["bytes_read"], 4096);
    assert_eq!(v["counters"]["per_queue"], json!([7, 0]));
    assert_eq!(v["rates"], Value::Null);
    assert_eq!(a.kind(), DeviceKind::Block);
    assert!(a.nic().is_none() && a.pci().is_none());
}

#[test]
fn a_nic_attachment_shows_its_link_and_frame_counters_and_no_block_fields() {
    let pair = NetCounters {
        rx_packets: 10,
        rx_bytes: 1500,
        tx_packets: 20,
        tx_bytes: 3000,
        ..NetCounters::default()
    };
    let a = shared(KindInfo::Nic(NicInfo {
        queue_pairs: 2,
        queue_size: 512,
        mac: "52:54:00:12:34:56".into(),
        mtu: 9000,
        link_up: true,
        lender_link_up: true,
        reconnects: 1,
        counters: pair,
        pairs: vec![pair, NetCounters::default()],
    }));
    let v = round_trip(&a);
    assert_keys(
        &v,
        &[
            "queue_pairs",
            "queue_size",
            "mac",
            "mtu",
            "link_up",
            "lender_link_up",
            "reconnects",
            "counters",
            "pairs",
        ],
    );
    assert_eq!(v["kind"], "nic");
    assert_eq!(v["queue_pairs"], 2);
    assert_eq!(v["queue_size"], 512);
    assert_eq!(v["mac"], "52:54:00:12:34:56");
    assert_eq!(v["mtu"], 9000);
    assert_eq!(v["link_up"], true);
    assert_eq!(v["lender_link_up"], true);
    assert_eq!(v["reconnects"], 1);
    assert_eq!(v["counters"]["rx_packets"], 10);
    assert_eq!(v["counters"]["tx_bytes"], 3000);
    // Frame counters, not block ones.
    assert!(v["counters"].get("reads").is_none(), "{v}");
    assert_eq!(v["pairs"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["pairs"][0]["tx_packets"], 20);
    assert_eq!(a.kind(), DeviceKind::Nic);
    assert!(a.block().is_none() && a.pci().is_none());
}

#[test]
fn a_pci_attachment_shows_its_address_ids_coherence_and_dma_bytes() {
    let a = shared(KindInfo::Pci(PciInfo {
        bdf: "0000:03:00.0".into(),
        vendor_id: Some(0x1234),
        device_id: Some(0x11e8),
        coherence: Some(CoherenceMode::Mirror),
        dma_mapped_bytes: 1 << 20,
        counters: PciCounters {
            region_reads: 5,
            region_writes: 6,
            pages_pushed: 7,
            pages_pulled: 8,
            irqs: 9,
        },
    }));
    let v = round_trip(&a);
    assert_keys(
        &v,
        &[
            "bdf",
            "vendor_id",
            "device_id",
            "coherence",
            "dma_mapped_bytes",
            "counters",
        ],
    );
    assert_eq!(v["kind"], "pci");
    assert_eq!(v["bdf"], "0000:03:00.0");
    assert_eq!(v["vendor_id"], 0x1234);
    assert_eq!(v["device_id"], 0x11e8);
    assert_eq!(v["coherence"], "mirror");
    assert_eq!(v["dma_mapped_bytes"], 1 << 20);
    assert_eq!(
        v["counters"],
        json!({"region_reads": 5, "region_writes": 6, "pages_pushed": 7, "pages_pulled": 8, "irqs": 9})
    );
    let mediated = shared(KindInfo::Pci(PciInfo {
        coherence: Some(CoherenceMode::Mediated),
        ..PciInfo::default()
    }));
    assert_eq!(round_trip(&mediated)["coherence"], "mediated");
    assert_eq!(a.kind(), DeviceKind::Pci);
    assert!(a.block().is_none() && a.nic().is_none());
}

#[test]
fn a_restoring_attachment_keeps_its_kind_with_its_fields_empty() {
    for kind in [DeviceKind::Block, DeviceKind::Nic, DeviceKind::Pci] {
        let mut a = shared(KindInfo::empty(kind));
        a.restoring = Some("lender unreachable".into());
        let v = round_trip(&a);
        assert_eq!(v["kind"], kind.as_str(), "{v}");
        assert_eq!(v["restoring"], "lender unreachable");
        assert_eq!(a.kind(), kind);
    }
    // An unknown kind is refused, not read as a block device.
    let mut v = serde_json::to_value(shared(KindInfo::empty(DeviceKind::Block))).expect("json");
    v["kind"] = "gpu".into();
    assert!(serde_json::from_value::<AttachmentInfo>(v).is_err());
}

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
        pool_unreachable_since_ms: None,
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
        ops: devlend_fabric::io_counters::OpCounts {
            reads: 3,
            writes: 4,
            bytes_read: 4096,
            ..Default::default()
        },
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
        failovers: 2,
        last_failover_us: 350_000,
        paths: vec![
            PathState {
                addr: "10.0.0.2:7700".into(),
                sessions: 2,
                up: true,
                failures: 0,
            },
            PathState {
                addr: "10.0.1.2:7700".into(),
                sessions: 0,
                up: false,
                failures: 2,
            },
        ],
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
            "failovers",
            "last_failover_us",
            "paths",
        ],
    );
    assert_eq!(v["kind"], "nic");
    assert_eq!(v["failovers"], 2);
    assert_eq!(v["last_failover_us"], 350_000);
    assert_eq!(v["paths"][1]["addr"], "10.0.1.2:7700");
    assert_eq!(v["paths"][1]["up"], false);
    assert_eq!(v["paths"][0]["sessions"], 2);
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
        vm: Some("vm-1".into()),
        counters: PciCounters {
            region_reads: 5,
            region_writes: 6,
            pages_pushed: 7,
            pages_pulled: 8,
            irqs: 9,
            guest_read_bytes: 10,
            guest_written_bytes: 11,
            peer_bytes: 12,
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
            "vm",
            "counters",
        ],
    );
    assert_eq!(v["kind"], "pci");
    assert_eq!(v["bdf"], "0000:03:00.0");
    assert_eq!(v["vendor_id"], 0x1234);
    assert_eq!(v["device_id"], 0x11e8);
    assert_eq!(v["coherence"], "mirror");
    assert_eq!(v["dma_mapped_bytes"], 1 << 20);
    assert_eq!(v["vm"], "vm-1");
    assert_eq!(
        v["counters"],
        json!({
            "region_reads": 5, "region_writes": 6, "pages_pushed": 7, "pages_pulled": 8,
            "irqs": 9, "guest_read_bytes": 10, "guest_written_bytes": 11, "peer_bytes": 12,
        })
    );
    let mediated = shared(KindInfo::Pci(PciInfo {
        coherence: Some(CoherenceMode::Mediated),
        ..PciInfo::default()
    }));
    let v = round_trip(&mediated);
    assert_eq!(v["coherence"], "mediated");
    assert!(v.get("vm").is_none(), "no vm, no key: {v}");
    // An older agent's counters, without the lender's DMA bytes, read as zeros.
    let old: PciCounters = serde_json::from_value(
        json!({"region_reads": 1, "region_writes": 2, "pages_pushed": 3, "pages_pulled": 4, "irqs": 5}),
    )
    .expect("an older agent's counters");
    assert_eq!((old.irqs, old.peer_bytes, old.guest_read_bytes), (5, 0, 0));
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

/// The API's OpenAPI document (`compute-agent/openapi.yaml`) as JSON.
fn openapi() -> Value {
    serde_norway::from_str(crate::server::OPENAPI_YAML).expect("the OpenAPI document is YAML")
}

/// What `value` breaks of schema `name` in the OpenAPI document (JSON Schema 2020-12,
/// which OpenAPI 3.1 schemas are).
fn schema_errors(doc: &Value, name: &str, value: &Value) -> Vec<String> {
    let root = json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": format!("#/components/schemas/{name}"),
        "components": doc["components"],
    });
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .build(&root)
        .unwrap_or_else(|e| panic!("schema {name} does not compile: {e}"));
    validator
        .iter_errors(value)
        .map(|e| format!("{e} (at {})", e.instance_path()))
        .collect()
}

/// Every kind's attachment, served and restoring, as the API writes it, satisfies the
/// OpenAPI document, which allows nothing else: a key of another kind, an unknown key
/// or a missing one is refused, so the document cannot drift from the types.
#[test]
fn the_openapi_document_describes_every_kind_exactly() {
    let doc = openapi();
    assert_eq!(doc["openapi"], "3.1.0");
    let served = [
        KindInfo::Block(BlockInfo {
            queues: 2,
            queue_size: 256,
            capacity_sectors: 2048,
            block_size: 4096,
            read_only: false,
            serial: "SN1".into(),
            counters: IoCounters {
                per_queue: vec![1, 2],
                ..IoCounters::default()
            },
            rates: Some(Rates {
                p99_us: Some(120),
                ..Rates::default()
            }),
        }),
        KindInfo::Nic(NicInfo {
            queue_pairs: 1,
            queue_size: 256,
            mac: "52:54:00:12:34:56".into(),
            mtu: 1500,
            link_up: false,
            lender_link_up: true,
            reconnects: 0,
            counters: NetCounters::default(),
            pairs: vec![NetCounters::default()],
            ..NicInfo::default()
        }),
        KindInfo::Pci(PciInfo {
            bdf: "0000:03:00.0".into(),
            vendor_id: Some(0x1b36),
            device_id: Some(0x0010),
            coherence: Some(CoherenceMode::Mediated),
            dma_mapped_bytes: 4096,
            vm: Some("vm-1".into()),
            counters: PciCounters::default(),
        }),
    ];
    let mut all = Vec::new();
    for part in served {
        let mut a = shared(part);
        a.vmm = Some(VmmPlug {
            target: VmmTarget::Qemu {
                qmp: "/run/vm/qmp.sock".into(),
            },
            device_id: "a0".into(),
            location: "devlend-port-1".into(),
        });
        a.lease = Some(uuid::Uuid::nil());
        a.limits = Some(devlend_fabric::qos::Qos::default().with(
            devlend_fabric::qos::Lane::IopsRead,
            2000,
            400,
        ));
        a.handover = Some(HandoverState::LetGo);
        a.pool_unreachable_since_ms = Some(1_800_000_000_000);
        all.push(a);
    }
    for kind in [DeviceKind::Block, DeviceKind::Nic, DeviceKind::Pci] {
        // As the registry shows it: the kind's fields empty but the request's queues.
        let mut a = shared(KindInfo::empty(kind));
        match &mut a.part {
            KindInfo::Block(b) => (b.queues, b.queue_size) = (1, 256),
            KindInfo::Nic(n) => (n.queue_pairs, n.queue_size) = (1, 256),
            KindInfo::Pci(_) => {}
        }
        a.restoring = Some("lender unreachable".into());
        all.push(a);
    }
    for a in &all {
        let v = serde_json::to_value(a).expect("json");
        let errs = schema_errors(&doc, "AttachmentInfo", &v);
        assert!(errs.is_empty(), "{v}: {errs:#?}");
    }
    // What the document must refuse.
    let block = serde_json::to_value(&all[0]).expect("json");
    let mut cases = Vec::new();
    let mut v = block.clone();
    v["mac"] = json!("52:54:00:12:34:56");
    cases.push(("a NIC's key on a block device", v));
    let mut v = block.clone();
    v["bogus"] = json!(1);
    cases.push(("an unknown key", v));
    let mut v = block.clone();
    v.as_object_mut()
        .expect("object")
        .remove("capacity_sectors");
    cases.push(("a missing key of the kind", v));
    let mut v = block.clone();
    v.as_object_mut().expect("object").remove("connected");
    cases.push(("a missing shared key", v));
    let mut v = block.clone();
    v["kind"] = json!("gpu");
    cases.push(("an unknown kind", v));
    let mut v = block;
    v["counters"]["reads_total"] = json!(1);
    cases.push(("an unknown counter", v));
    for (what, v) in cases {
        assert!(
            !schema_errors(&doc, "AttachmentInfo", &v).is_empty(),
            "{what} passed: {v}"
        );
    }
}

/// Requests as the README shows them satisfy the document; unknown keys do not.
#[test]
fn the_openapi_document_describes_the_requests() {
    let doc = openapi();
    for body in [
        json!({"lender": "10.0.0.9:7700", "device": "disk0", "socket": "/run/devlend/d.sock"}),
        json!({"lender": "10.0.0.9:7700", "device": "fn0", "socket": "/run/devlend/f.sock", "kind": "pci"}),
        json!({"lender": "10.0.0.9:7700", "device": "fn1", "socket": "/run/devlend/g.sock", "kind": "pci", "vm": "vm-1.a_b"}),
        json!({
            "id": "vol1", "lender": "", "device": "west/lender1/disk0", "socket": "/s",
            "queues": 4, "queue_size": 512, "poll_us": 50, "reconnect_deadline_s": 60,
            "vmm": {"type": "cloud-hypervisor", "api": "/run/ch.sock"},
            "lease": {"pool": "https://pool:7400", "id": "00000000-0000-0000-0000-000000000000", "token": "t"},
            "lender_key": "k", "tls": true, "tls_server_name": "lender1",
            "transport": "rdma", "rdma_exposure": "guest-memory", "handover_token": "h",
        }),
    ] {
        let parsed: AttachRequest = serde_json::from_value(body.clone()).expect("a valid request");
        let again = serde_json::to_value(&parsed).expect("json");
        for v in [&body, &again] {
            let errs = schema_errors(&doc, "AttachRequest", v);
            assert!(errs.is_empty(), "{v}: {errs:#?}");
        }
    }
    for vm in ["", "vm 1", &"v".repeat(65)] {
        let bad = json!({"lender": "l", "device": "d", "socket": "/s", "kind": "pci", "vm": vm});
        assert!(
            !schema_errors(&doc, "AttachRequest", &bad).is_empty(),
            "{vm:?}"
        );
        assert!(!valid_vm_name(vm), "{vm:?}");
    }
    assert!(valid_vm_name(&"v".repeat(64)));
    let bad = json!({"lender": "l", "device": "d", "socket": "/s", "queue": 2});
    assert!(serde_json::from_value::<AttachRequest>(bad.clone()).is_err());
    assert!(!schema_errors(&doc, "AttachRequest", &bad).is_empty());
    let info = HandoverInfo {
        attachment: "a0".into(),
        lender: "l".into(),
        paths: vec!["m:1".into()],
        device: "d".into(),
        handover_token: "t".into(),
        lease: "00".repeat(16),
        from_lease: "11".repeat(16),
        pool: None,
    };
    let v = serde_json::to_value(&info).expect("json");
    assert!(schema_errors(&doc, "HandoverInfo", &v).is_empty(), "{v}");
    let e = serde_json::to_value(ApiError { error: "x".into() }).expect("json");
    assert!(schema_errors(&doc, "ApiError", &e).is_empty());
}

//! What the lender shows of each kind of device: the pool's and the status views'
//! fields, and the metrics (no block counters for a NIC). The NIC is `lo`, which
//! every machine has; opening it needs no privilege.

use devlend_device_agent::metrics::DeviceMetrics;
use devlend_device_agent::{BlockSpec, DeviceSpec, KindView, Lender, NetSpec};

/// A lender of a 1 MiB read-only file `disk0` and the interface `lo` as `nic0`.
fn lender(dir: &tempfile::TempDir) -> Lender {
    let img = dir.path().join("disk0.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(1 << 20))
        .expect("image");
    let mut disk = BlockSpec::new(&img);
    disk.read_only = true;
    let mut nic = NetSpec::new("lo");
    nic.mac = Some("02:00:00:00:00:07".into());
    Lender::bind(
        "127.0.0.1:0",
        vec![DeviceSpec::new("disk0", disk), DeviceSpec::new("nic0", nic)],
    )
    .expect("bind")
}

#[test]
fn inventory_shows_each_kinds_own_fields() {
    let dir = tempfile::tempdir().unwrap();
    let lender = lender(&dir);
    let devices = lender.inventory_view().devices();
    assert_eq!(devices.len(), 2);

    let disk = &devices[0];
    assert_eq!(disk.name, "disk0");
    assert_eq!(disk.resource_class, "BLOCK");
    assert_eq!(disk.capacity_bytes, 1 << 20);
    assert_eq!(disk.traits, ["FABRIC_TCP", "READ_ONLY"]);
    assert_eq!(
        disk.kind,
        KindView::Block {
            path: dir.path().join("disk0.img"),
            capacity_bytes: 1 << 20,
            block_size: 512,
            read_only: true,
        }
    );
    assert_eq!(disk.kind.name(), "block");

    let nic = &devices[1];
    assert_eq!(nic.name, "nic0");
    assert_eq!(nic.resource_class, "NIC");
    assert_eq!(nic.capacity_bytes, 0);
    assert_eq!(nic.traits, ["FABRIC_TCP"]);
    match &nic.kind {
        KindView::Net {
            interface,
            mac,
            mtu,
            ..
        } => {
            assert_eq!(interface, "lo");
            assert_eq!(*mac, [2, 0, 0, 0, 0, 7]);
            assert!(*mtu >= 1280, "{mtu}");
        }
        other => panic!("nic0 shows {other:?}"),
    }
    assert_eq!(nic.kind.name(), "net");
}

#[test]
fn counters_say_what_each_kind_counts() {
    let dir = tempfile::tempdir().unwrap();
    let lender = lender(&dir);
    let counters = lender.stats_view().all_by_kind();
    let kinds: Vec<_> = counters
        .iter()
        .map(|c| (c.name.as_str(), c.kind, c.block_requests, c.limited))
        .collect();
    assert_eq!(
        kinds,
        [("disk0", "block", true, true), ("nic0", "net", false, true)]
    );
}

#[test]
fn metrics_export_no_block_counters_for_a_nic() {
    let dir = tempfile::tempdir().unwrap();
    let lender = lender(&dir);
    let text = devlend_daemon::metrics::render(DeviceMetrics::new(
        lender.stats_view(),
        Default::default(),
    ))
    .unwrap();
    let lines = |device: &str| -> Vec<String> {
        text.lines()
            .filter(|l| !l.starts_with('#') && l.contains(&format!("device=\"{device}\"")))
            .map(str::to_owned)
            .collect()
    };
    let disk = lines("disk0");
    let nic = lines("nic0");
    for family in [
        "devlend_device_requests_total",
        "devlend_device_bytes_total",
        "devlend_device_operations_total",
        "devlend_device_requests_in_flight",
        "devlend_device_request_duration_seconds",
    ] {
        assert!(
            disk.iter().any(|l| l.starts_with(family)),
            "disk0 has no {family}:\n{text}"
        );
        assert!(
            !nic.iter().any(|l| l.starts_with(family)),
            "nic0 exports {family}:\n{text}"
        );
    }
    assert!(
        !nic.iter().any(|l| l.contains("cause=\"request\"")),
        "{text}"
    );
    // What every kind counts, and the NIC's frames.
    for family in [
        "devlend_device_sessions",
        "devlend_device_sessions_opened_total",
        "devlend_nic_packets_total",
    ] {
        assert!(
            nic.iter().any(|l| l.starts_with(family)),
            "nic0 has no {family}:\n{text}"
        );
    }
}

/// Each kind answers the hello its own way, with its own description: the disk its
/// geometry, the NIC its MAC and MTU to a borrower that speaks frames, and a refusal
/// naming the kind to one that does not.
#[test]
fn each_kind_answers_its_own_hello() {
    use devlend_fabric::net::FEATURE_NET;
    use devlend_fabric::tcp::ConnectError;
    use devlend_fabric::{Hello, HelloStatus};
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let handle = lender(&dir).spawn();
    let addr = handle.local_addr().to_string();
    let t = Duration::from_secs(5);

    let (_s, reply) = devlend_fabric::tcp::connect(&addr, "disk0", 0, t).unwrap();
    let g = reply
        .block()
        .expect("the disk is described as a block device");
    assert_eq!(g.capacity_sectors, 2048);
    assert!(g.read_only() && reply.nic().is_none());

    match devlend_fabric::tcp::connect(&addr, "nic0", 0, t) {
        Err(ConnectError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, HelloStatus::BadRequest);
            assert!(message.contains("network interface"), "{message}");
        }
        other => panic!("a hello without FEATURE_NET got {other:?}"),
    }
    let mut hello = Hello::new("nic0", 0);
    hello.features = FEATURE_NET;
    let (_s, reply) = devlend_fabric::tcp::connect_as(&addr, &hello, t).unwrap();
    let nic = reply.nic().expect("the NIC is described as a NIC");
    assert!(reply.block().is_none());
    assert_eq!(nic.mac, [2, 0, 0, 0, 0, 7]);
    assert!(nic.mtu >= 1280, "{:?}", reply.device);
}

/// A hello that asks a block device or a NIC for feature PCI (`devlend attach --kind
/// pci` on the wrong device) is refused with a message naming what the device is, not
/// answered OK without the PCI bit.
#[test]
fn a_pci_hello_to_a_block_device_or_nic_is_refused_naming_the_kind() {
    use devlend_fabric::net::FEATURE_NET;
    use devlend_fabric::pci::FEATURE_PCI;
    use devlend_fabric::tcp::ConnectError;
    use devlend_fabric::{Hello, HelloStatus};
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let handle = lender(&dir).spawn();
    let addr = handle.local_addr().to_string();
    let t = Duration::from_secs(5);
    for (device, features, what) in [
        (
            "disk0",
            FEATURE_PCI,
            "is a block device, not a PCIe function",
        ),
        (
            "nic0",
            FEATURE_PCI | FEATURE_NET,
            "is a network interface, not a PCIe function",
        ),
    ] {
        let mut hello = Hello::new(device, 0);
        hello.features = features;
        match devlend_fabric::tcp::connect_as(&addr, &hello, t) {
            Err(ConnectError::Refused {
                status, message, ..
            }) => {
                assert_eq!(status, HelloStatus::BadRequest, "{device}");
                assert!(message.contains(what), "{device}: {message}");
                assert!(message.contains("without --kind pci"), "{message}");
            }
            other => panic!("{device}: a PCI hello got {other:?}"),
        }
    }
}

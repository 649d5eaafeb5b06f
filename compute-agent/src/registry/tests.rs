//! Tests of attach requests refused before anything starts.

use super::*;

#[test]
fn rdma_exposure_is_refused_without_rdma() {
    let req = |v: serde_json::Value| -> AttachRequest { serde_json::from_value(v).unwrap() };
    let base = serde_json::json!({
        "lender": "127.0.0.1:1", "device": "d", "socket": "/nonexistent/devlend-test.sock",
    });
    // The default is request-bounded, and is not written out.
    let plain = req(base.clone());
    assert_eq!(plain.rdma_exposure, crate::api::RdmaExposure::Request);
    assert!(serde_json::to_value(&plain)
        .unwrap()
        .get("rdma_exposure")
        .is_none());
    let mut v = base;
    v["rdma_exposure"] = "guest-memory".into();
    match Registry::default().attach(req(v)) {
        Err(RegistryError::BadRequest(m)) => assert!(m.contains("rdma_exposure"), "{m}"),
        other => panic!("guest-memory exposure over TCP: {:?}", other.map(|i| i.id)),
    }
}

/// A NIC asked for over RDMA is refused with what to do, before any socket is bound;
/// before, the borrower's RDMA probe asked the NIC for block requests and reported the
/// lender's "does not speak frames".
#[test]
fn a_nic_over_rdma_is_refused_saying_it_goes_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let lender = devlend_device_agent::Lender::bind(
        "127.0.0.1:0",
        vec![devlend_device_agent::DeviceSpec::new(
            "nic0",
            devlend_device_agent::NetSpec::new("lo"),
        )],
    )
    .unwrap()
    .spawn();
    let sock = dir.path().join("nic0.sock");
    let req: AttachRequest = serde_json::from_value(serde_json::json!({
        "lender": lender.local_addr().to_string(), "device": "nic0", "socket": sock,
        "transport": "rdma",
    }))
    .unwrap();
    match Registry::default().attach(req) {
        Err(RegistryError::Start(e @ AttachmentError::TcpOnly { .. })) => {
            let m = e.to_string();
            assert!(
                m.contains("is a NIC") && m.contains("without --transport rdma"),
                "{m}"
            );
        }
        other => panic!("a NIC over RDMA: {:?}", other.map(|i| i.id)),
    }
    assert!(!sock.exists(), "the socket was bound");
}

/// A VM name is for PCIe functions only, and must be a name: both refused before
/// anything starts, saying why.
#[test]
fn a_vm_is_refused_for_other_kinds_and_when_malformed() {
    let req = |v: serde_json::Value| -> AttachRequest { serde_json::from_value(v).unwrap() };
    let base = serde_json::json!({
        "lender": "127.0.0.1:1", "device": "d", "socket": "/nonexistent/devlend-vm.sock",
        "vm": "vm-1",
    });
    match Registry::default().attach(req(base.clone())) {
        Err(RegistryError::BadRequest(m)) => assert!(m.contains("kind pci"), "{m}"),
        other => panic!("a disk with a vm: {:?}", other.map(|i| i.id)),
    }
    for bad in ["", "vm/1", "vm 1", &"v".repeat(65)] {
        let mut v = base.clone();
        v["kind"] = "pci".into();
        v["vm"] = bad.into();
        match Registry::default().attach(req(v)) {
            Err(RegistryError::BadRequest(m)) => {
                assert!(m.contains("invalid vm") && m.contains("1..=64"), "{m}")
            }
            other => panic!("vm {bad:?}: {:?}", other.map(|i| i.id)),
        }
    }
}

/// Further paths are `HOST:PORT` addresses of a lender reached directly, not wildcards,
/// distinct, at most seven (the pool's rule for a lender's further addresses): anything
/// else is refused before anything starts.
#[test]
fn paths_that_cannot_be_a_lenders_addresses_are_refused() {
    let attach = |paths: serde_json::Value, lender: &str, kind: &str| {
        let req: AttachRequest = serde_json::from_value(serde_json::json!({
            "lender": lender, "device": "d", "socket": "/nonexistent/devlend-test.sock",
            "paths": paths, "kind": kind,
        }))
        .unwrap();
        match Registry::default().attach(req) {
            Err(RegistryError::BadRequest(m)) => m,
            other => panic!("paths {paths}: {:?}", other.map(|i| i.id)),
        }
    };
    let direct = "10.0.0.1:7700";
    for (paths, want) in [
        (serde_json::json!(["10.0.1.1"]), "not HOST:PORT"),
        (serde_json::json!(["10.0.1.1:0"]), "not HOST:PORT"),
        (serde_json::json!(["c/l:1"]), "not HOST:PORT"),
        (serde_json::json!(["h x:1"]), "not HOST:PORT"),
        (serde_json::json!(["a,b:1"]), "not HOST:PORT"),
        (serde_json::json!(["0.0.0.0:7700"]), "wildcard"),
        (serde_json::json!(["[::]:7700"]), "wildcard"),
        (serde_json::json!([direct]), "twice"),
        (serde_json::json!(["a:1", "a:1"]), "twice"),
        (
            serde_json::json!(["a:1", "a:2", "a:3", "a:4", "a:5", "a:6", "a:7", "a:8"]),
            "at most 7",
        ),
    ] {
        let m = attach(paths.clone(), direct, "device");
        assert!(m.contains(want), "{paths}: {m}");
    }
    let m = attach(serde_json::json!(["a:1"]), direct, "pci");
    assert!(m.contains("PCIe"), "{m}");
    // A huge value costs its sender a short answer, not an echo.
    let m = attach(serde_json::json!(["x".repeat(1 << 20)]), direct, "device");
    assert!(
        m.len() < 300 && m.contains("not HOST:PORT"),
        "{} bytes",
        m.len()
    );
}

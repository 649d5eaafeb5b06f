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

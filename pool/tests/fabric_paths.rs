//! A provider's further fabric addresses (`fabric_paths`, issue 36): registered,
//! changed, refused when malformed, and carried by its leases, on SQLite and
//! PostgreSQL.

#[macro_use]
mod support;

use devlend_pool::api::{DeviceQuery, LeaseRequest, RegisterProvider, Role};
use devlend_pool::ClientError;
use support::{device, Backend, GIB};

on_both_backends!(
    a_lease_carries_its_providers_paths,
    malformed_paths_are_refused,
);

fn registration(paths: &[&str]) -> RegisterProvider {
    RegisterProvider {
        fabric_address: "10.0.0.1:7700".into(),
        fabric_paths: paths.iter().map(|p| p.to_string()).collect(),
        transports: vec!["tcp".into()],
        heartbeat_ttl_ms: 60_000,
        devices: vec![device("disk0", "BLOCK", GIB, &[])],
    }
}

fn request() -> LeaseRequest {
    LeaseRequest {
        consumer: "vm-1".into(),
        compute_host: "host-a".into(),
        ttl_ms: Some(30_000),
        class: Some("BLOCK".into()),
        ..Default::default()
    }
}

fn a_lease_carries_its_providers_paths(backend: Backend) {
    let pool = support::start(backend);
    support::enrolled(&pool, Role::Compute, "host-b");
    let c = &pool.client;
    let doc = c.openapi().unwrap();
    for schema in ["RegisterProvider", "Provider", "Device", "Lease"] {
        let field = &doc["components"]["schemas"][schema]["properties"]["fabric_paths"];
        assert_eq!(field["type"], "array", "{schema}: {field}");
    }
    let p = c
        .register_provider(
            "lender-a",
            &registration(&["10.0.1.1:7700", "10.0.2.1:7700"]),
        )
        .unwrap();
    assert_eq!(p.fabric_paths, ["10.0.1.1:7700", "10.0.2.1:7700"]);
    let again = c
        .register_provider(
            "lender-a",
            &registration(&["10.0.1.1:7700", "10.0.2.1:7700"]),
        )
        .unwrap();
    assert_eq!(again.generation, p.generation, "nothing changed");
    let d = c.devices(&DeviceQuery::default()).unwrap();
    assert_eq!(d[0].fabric_paths, ["10.0.1.1:7700", "10.0.2.1:7700"]);

    let grant = c.create_lease(&request()).unwrap();
    assert_eq!(grant.lease.fabric_address, "10.0.0.1:7700");
    assert_eq!(grant.lease.fabric_paths, ["10.0.1.1:7700", "10.0.2.1:7700"]);
    assert_eq!(
        c.lease(grant.lease.id).unwrap().fabric_paths,
        grant.lease.fabric_paths
    );
    // A handover's successor has them too.
    let next = c.handover_lease(grant.lease.id, "host-b").unwrap();
    assert_eq!(next.lease.fabric_paths, grant.lease.fabric_paths);

    // Changed paths: a new generation, and the leases granted from then on.
    let changed = c
        .register_provider("lender-a", &registration(&["10.0.3.1:7700"]))
        .unwrap();
    assert!(changed.generation > p.generation);
    assert_eq!(changed.fabric_paths, ["10.0.3.1:7700"]);
    assert_eq!(
        c.lease(grant.lease.id).unwrap().fabric_paths,
        ["10.0.1.1:7700", "10.0.2.1:7700"],
        "a lease keeps the paths it was granted with"
    );
    let next = c.lease(next.lease.id).unwrap();
    c.release_lease(next.id, next.generation).unwrap();
    let old = c.lease(grant.lease.id).unwrap();
    if old.state.is_live() {
        c.release_lease(old.id, old.generation).unwrap();
    }
    let grant = c.create_lease(&request()).unwrap();
    assert_eq!(grant.lease.fabric_paths, ["10.0.3.1:7700"]);

    // None any more: an empty list, as a provider that never had any.
    let none = c.register_provider("lender-a", &registration(&[])).unwrap();
    assert!(none.fabric_paths.is_empty());
    assert!(none.generation > changed.generation);
}

fn malformed_paths_are_refused(backend: Backend) {
    let pool = support::start(backend);
    let eight: Vec<String> = (1..=8).map(|i| format!("10.0.{i}.1:7700")).collect();
    let eight: Vec<&str> = eight.iter().map(String::as_str).collect();
    for bad in [
        &["0.0.0.0:7700"][..],
        &["[::]:7700"],
        &["10.0.1.1"],
        &["10.0.1.1:0"],
        &["10.0.1.1:7700,10.0.2.1:7700"],
        &["10.0.0.1:7700"],
        &["10.0.1.1:7700", "10.0.1.1:7700"],
        &eight,
    ] {
        match pool
            .client
            .register_provider("lender-a", &registration(bad))
        {
            Err(ClientError::Api { status, code, .. }) => {
                assert_eq!((status, code.as_str()), (422, "invalid_value"), "{bad:?}")
            }
            other => panic!("{bad:?}: expected a refusal, got {other:?}"),
        }
    }
    // The main address is one borrowers are given too: not a wildcard either.
    for wild in ["0.0.0.0:7700", "[::]:7700", "*:7700"] {
        let mut r = registration(&[]);
        r.fabric_address = wild.into();
        match pool.client.register_provider("lender-a", &r) {
            Err(ClientError::Api { status, code, .. }) => {
                assert_eq!((status, code.as_str()), (422, "invalid_value"), "{wild}")
            }
            other => panic!("{wild}: expected a refusal, got {other:?}"),
        }
    }
    assert!(pool.client.providers().unwrap().is_empty());
    // Seven are taken.
    let p = pool
        .client
        .register_provider("lender-a", &registration(&eight[..7]))
        .unwrap();
    assert_eq!(p.fabric_paths.len(), 7);
}

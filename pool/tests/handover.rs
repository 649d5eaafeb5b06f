//! A live migration's handover of a lease (`POST /v1/leases/{id}/handover`), on SQLite
//! and on PostgreSQL: the device moves to a successor lease on the destination compute
//! host, whose token names its predecessor; a successor released before the switch gives
//! the device back; the predecessor's release leaves it the successor's.

#[macro_use]
mod support;

use devlend_fabric::lease_token::{LeaseToken, PublicKey};
use devlend_fabric::qos::Qos;
use devlend_pool::api::{DeviceQuery, LeaseFilter, LeaseRequest, Role};
use devlend_pool::ClientError;
use support::{device, register, Backend, GIB};

on_both_backends!(
    a_handover_moves_the_device_to_a_successor_lease,
    a_failed_handover_gives_the_device_back,
);

fn code(r: Result<impl std::fmt::Debug, ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Api { status, code, .. }) => (status, code),
        other => panic!("expected a pool error, got {other:?}"),
    }
}

fn request() -> LeaseRequest {
    LeaseRequest {
        consumer: "vm-1".into(),
        compute_host: "host-a".into(),
        ttl_ms: Some(30_000),
        class: Some("BLOCK".into()),
        qos: Some(Qos::default().with_weight(4)),
        ..Default::default()
    }
}

fn device_lease(pool: &support::TestPool) -> Option<uuid::Uuid> {
    let d = pool.client.devices(&DeviceQuery::default()).unwrap();
    assert_eq!(d.len(), 1);
    d[0].lease_id
}

fn a_handover_moves_the_device_to_a_successor_lease(backend: Backend) {
    let pool = support::start(backend);
    for h in ["host-a", "host-b", "host-c"] {
        support::enrolled(&pool, Role::Compute, h);
    }
    // A destination that is not an enrolled compute host (a typo) could never bind or
    // renew the lease, which would keep the device: refused.
    let s0 = {
        register(
            &pool.client,
            "lender-a",
            60_000,
            vec![device("disk0", "BLOCK", GIB, &[])],
        );
        pool.client.create_lease(&request()).unwrap().lease
    };
    assert_eq!(
        code(pool.client.handover_lease(s0.id, "host-typo")),
        (422, "invalid_value".into())
    );
    pool.client.release_current(s0.id).unwrap();
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let s = pool.client.create_lease(&request()).unwrap().lease;
    let d = pool.client.handover_lease(s.id, "host-b").unwrap();
    assert_eq!(d.lease.successor_of, Some(s.id));
    assert_eq!(d.lease.compute_host, "host-b");
    assert_eq!(
        (
            &d.lease.device,
            &d.lease.provider,
            &d.lease.consumer,
            d.lease.qos
        ),
        (&s.device, &s.provider, &s.consumer, s.qos)
    );
    assert_ne!(d.lease.id, s.id);
    // The token names the predecessor, signed by the pool.
    let key = PublicKey::from_text(&pool.client.signing_key().unwrap().public_key).unwrap();
    let claims = key
        .verify(&LeaseToken::from_text(&d.token).unwrap())
        .unwrap();
    assert_eq!(claims.successor_of, Some(*s.id.as_bytes()));
    assert_eq!(claims.lease_id, *d.lease.id.as_bytes());
    // Both live until the source lets go; the device is the successor's.
    let live: Vec<_> = pool
        .client
        .leases(LeaseFilter::Active)
        .unwrap()
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(live, [s.id, d.lease.id]);
    assert_eq!(device_lease(&pool), Some(d.lease.id));
    // One handover at a time.
    assert_eq!(
        code(pool.client.handover_lease(s.id, "host-c")),
        (409, "handover_in_progress".into())
    );
    // The source releases its lease at the end: the device stays the successor's.
    pool.client.release_current(s.id).unwrap();
    assert_eq!(device_lease(&pool), Some(d.lease.id));
    assert_eq!(
        code(pool.client.create_lease(&request())),
        (409, "all_leased".into())
    );
    // An ended lease hands nothing over.
    assert_eq!(
        code(pool.client.handover_lease(s.id, "host-b")),
        (409, "lease_ended".into())
    );
    // And the successor can be handed over in turn (the way back).
    let back = pool.client.handover_lease(d.lease.id, "host-a").unwrap();
    assert_eq!(back.lease.successor_of, Some(d.lease.id));
}

fn a_failed_handover_gives_the_device_back(backend: Backend) {
    let pool = support::start(backend);
    support::enrolled(&pool, Role::Compute, "host-b");
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let s = pool.client.create_lease(&request()).unwrap().lease;
    let d = pool.client.handover_lease(s.id, "host-b").unwrap();
    // The migration failed: the destination releases its lease, the source keeps the
    // device, and may hand it over again.
    pool.client.release_current(d.lease.id).unwrap();
    assert_eq!(device_lease(&pool), Some(s.id));
    assert_eq!(
        code(pool.client.create_lease(&request())),
        (409, "all_leased".into())
    );
    let d2 = pool.client.handover_lease(s.id, "host-b").unwrap();
    assert_eq!(device_lease(&pool), Some(d2.lease.id));
}

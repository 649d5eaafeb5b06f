//! The pool over real HTTP, each behaviour on SQLite and on PostgreSQL.

#[macro_use]
mod support;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use devlend_fabric::lease_token::{LeaseToken, PublicKey};
use devlend_pool::api::{DeviceQuery, DeviceState, LeaseFilter, LeaseRequest, LeaseState};
use devlend_pool::ClientError;
use support::{device, register, Backend, GIB};

on_both_backends!(
    two_borrowers_race_for_the_last_device,
    stale_generations_are_refused,
    expiry_frees_the_device_and_ends_the_lease,
    renewal_keeps_a_lease_alive,
    silent_provider_drops_out_of_placement,
    token_verifies_and_carries_the_claims,
    a_leases_limits_are_kept_and_signed_into_its_token,
    two_servers_on_one_database_share_the_key,
    placement_explains_why_nothing_fits,
    registration_updates_the_inventory,
    devices_filter,
);

fn placement(consumer: &str, class: &str, min: u64, traits: &[&str]) -> LeaseRequest {
    LeaseRequest {
        consumer: consumer.into(),
        compute_host: "host-a".into(),
        ttl_ms: Some(30_000),
        class: Some(class.into()),
        min_capacity_bytes: Some(min),
        traits: traits.iter().map(|t| t.to_string()).collect(),
        ..Default::default()
    }
}

fn code(r: Result<impl std::fmt::Debug, ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Api { status, code, .. }) => (status, code),
        other => panic!("expected a pool error, got {other:?}"),
    }
}

fn two_borrowers_race_for_the_last_device(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![
            device("disk0", "BLOCK", 10 * GIB, &["FABRIC_TCP"]),
            device("small", "BLOCK", GIB, &["FABRIC_TCP"]),
            device("eth0", "NIC", 0, &["FABRIC_TCP"]),
        ],
    );
    for round in 0..50 {
        let barrier = Arc::new(Barrier::new(2));
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let barrier = barrier.clone();
                let client = pool.client.clone();
                std::thread::spawn(move || {
                    let req = placement(&format!("vm-{i}"), "BLOCK", 5 * GIB, &["FABRIC_TCP"]);
                    barrier.wait();
                    client.create_lease(&req)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let winners: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        let loser = results.iter().find_map(|r| r.as_ref().err()).unwrap();
        assert_eq!(loser.code(), Some("all_leased"), "round {round}: {loser}");
        assert_eq!(loser.status(), Some(409));
        let lease = &winners[0].lease;
        assert_eq!(lease.device, "disk0");
        assert_eq!(pool.client.leases(LeaseFilter::Active).unwrap().len(), 1);
        pool.client
            .release_lease(lease.id, lease.generation)
            .unwrap();
    }
    assert_eq!(pool.client.leases(LeaseFilter::All).unwrap().len(), 50);
    assert!(pool.client.leases(LeaseFilter::Active).unwrap().is_empty());
}

fn stale_generations_are_refused(backend: Backend) {
    let pool = support::start(backend);
    let p = register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let dev = &p.devices[0];
    let by_id = |generation: u64| LeaseRequest {
        consumer: "vm-1".into(),
        compute_host: "host-a".into(),
        device_id: Some(dev.id),
        generation: Some(generation),
        ..Default::default()
    };
    assert_eq!(
        code(pool.client.create_lease(&by_id(dev.generation + 1))),
        (409, "stale_generation".into())
    );
    let grant = pool.client.create_lease(&by_id(dev.generation)).unwrap();
    assert_eq!(grant.lease.state, LeaseState::Claimed);
    let now = pool.client.devices(&DeviceQuery::default()).unwrap();
    assert_eq!(now[0].state, DeviceState::Leased);
    assert_eq!(now[0].lease_id, Some(grant.lease.id));
    assert_eq!(
        code(pool.client.create_lease(&by_id(now[0].generation))),
        (409, "device_leased".into())
    );
    let l = grant.lease;
    assert_eq!(
        code(pool.client.bind_lease(l.id, l.generation + 1)),
        (409, "stale_generation".into())
    );
    let bound = pool.client.bind_lease(l.id, l.generation).unwrap();
    assert_eq!(bound.state, LeaseState::Bound);
    assert_eq!(bound.generation, l.generation + 1);
    assert_eq!(
        code(pool.client.bind_lease(l.id, bound.generation)),
        (409, "lease_already_bound".into())
    );
    assert_eq!(
        code(pool.client.release_lease(l.id, l.generation)),
        (409, "stale_generation".into())
    );
    let released = pool.client.release_lease(l.id, bound.generation).unwrap();
    assert_eq!(released.state, LeaseState::Released);
    assert_eq!(
        code(pool.client.release_lease(l.id, released.generation)),
        (409, "lease_ended".into())
    );
    assert_eq!(
        code(pool.client.lease_heartbeat(l.id)),
        (409, "lease_ended".into())
    );
    let d = &pool.client.devices(&DeviceQuery::default()).unwrap()[0];
    assert_eq!(d.state, DeviceState::Available);
    assert_eq!(d.lease_id, None);
}

fn expiry_frees_the_device_and_ends_the_lease(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let mut req = placement("vm-1", "BLOCK", 0, &[]);
    req.ttl_ms = Some(1_000);
    let first = pool.client.create_lease(&req).unwrap().lease;
    assert_eq!(
        code(
            pool.client
                .create_lease(&placement("vm-2", "BLOCK", 0, &[]))
        ),
        (409, "all_leased".into())
    );
    let hb = pool
        .client
        .provider_heartbeat("lender-a", &Default::default())
        .unwrap();
    assert_eq!(hb.leases.len(), 1);
    assert_eq!(hb.leases[0].id, first.id);
    std::thread::sleep(Duration::from_millis(1_300));
    assert_eq!(
        pool.client.lease(first.id).unwrap().state,
        LeaseState::Expired
    );
    let d = &pool.client.devices(&DeviceQuery::default()).unwrap()[0];
    assert_eq!(d.state, DeviceState::Available);
    assert!(pool.client.leases(LeaseFilter::Active).unwrap().is_empty());
    // Lapsed, not ended: nobody claimed the device since, so its holder's renewal takes
    // it back (a holder cut from the pool while nobody else wanted the device).
    let back = pool.client.lease_heartbeat(first.id).unwrap();
    assert_eq!(back.state, LeaseState::Claimed);
    let d = &pool.client.devices(&DeviceQuery::default()).unwrap()[0];
    assert_eq!(d.state, DeviceState::Leased);
    std::thread::sleep(Duration::from_millis(1_300));
    // Lapsed again; its lender's heartbeat does not report it: it ends for good, and the
    // answer fences its epoch at the lender.
    let hb = pool
        .client
        .provider_heartbeat("lender-a", &Default::default())
        .unwrap();
    assert!(hb.leases.is_empty());
    assert_eq!(hb.fences[0].device, "disk0");
    assert_eq!(hb.fences[0].fence, first.epoch + 1);
    assert_eq!(
        code(pool.client.lease_heartbeat(first.id)),
        (409, "lease_ended".into())
    );
    // The expired lease never blocks a new claim, which ends it for good.
    let second = pool
        .client
        .create_lease(&placement("vm-2", "BLOCK", 0, &[]))
        .unwrap();
    assert_eq!(second.lease.device, "disk0");
    assert!(second.lease.epoch > first.epoch);
    assert_eq!(
        pool.client.lease(first.id).unwrap().state,
        LeaseState::Expired
    );
    assert_eq!(
        code(pool.client.lease_heartbeat(first.id)),
        (409, "lease_ended".into())
    );
    assert_eq!(
        code(pool.client.release_lease(first.id, first.generation)),
        (409, "lease_ended".into())
    );
    let hb = pool
        .client
        .provider_heartbeat("lender-a", &Default::default())
        .unwrap();
    assert_eq!(hb.leases.len(), 1);
    assert_eq!(hb.leases[0].id, second.lease.id);
    assert_eq!(hb.leases[0].epoch, second.lease.epoch);
    assert_eq!(hb.fences[0].fence, second.lease.epoch);
}

fn renewal_keeps_a_lease_alive(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let mut req = placement("vm-1", "BLOCK", 0, &[]);
    req.ttl_ms = Some(1_000);
    let lease = pool.client.create_lease(&req).unwrap().lease;
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(400));
        let renewed = pool.client.lease_heartbeat(lease.id).unwrap();
        assert_eq!(renewed.state, LeaseState::Claimed);
        // Renewals are not state changes: the generation stays.
        assert_eq!(renewed.generation, lease.generation);
        assert!(renewed.expires_at_ms > lease.expires_at_ms);
    }
    let hb = pool
        .client
        .provider_heartbeat("lender-a", &Default::default())
        .unwrap();
    assert_eq!(hb.leases[0].id, lease.id);
    assert!(hb.leases[0].expires_at_ms > lease.expires_at_ms);
}

fn silent_provider_drops_out_of_placement(backend: Backend) {
    let pool = support::start(backend);
    assert_eq!(
        code(
            pool.client
                .provider_heartbeat("lender-a", &Default::default())
        ),
        (404, "unknown_provider".into())
    );
    register(
        &pool.client,
        "lender-a",
        1_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    std::thread::sleep(Duration::from_millis(1_300));
    let p = &pool.client.providers().unwrap()[0];
    assert!(!p.available);
    assert_eq!(p.devices[0].state, DeviceState::Unavailable);
    let (status, c) = code(
        pool.client
            .create_lease(&placement("vm-1", "BLOCK", 0, &[])),
    );
    assert_eq!((status, c.as_str()), (409, "providers_unavailable"));
    pool.client
        .provider_heartbeat("lender-a", &Default::default())
        .unwrap();
    let p = &pool.client.providers().unwrap()[0];
    assert!(p.available);
    assert_eq!(p.devices[0].state, DeviceState::Available);
    let grant = pool
        .client
        .create_lease(&placement("vm-1", "BLOCK", 0, &[]))
        .unwrap();
    assert_eq!(grant.lease.provider, "lender-a");
}

fn token_verifies_and_carries_the_claims(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let key = pool.client.signing_key().unwrap();
    assert_eq!(key.algorithm, "ed25519");
    let key = PublicKey::from_text(&key.public_key).unwrap();
    assert_eq!(key, pool.server.public_key());
    let grant = pool
        .client
        .create_lease(&placement("vm-7", "BLOCK", 0, &[]))
        .unwrap();
    let claims = key
        .verify(&LeaseToken::from_text(&grant.token).unwrap())
        .unwrap();
    assert_eq!(claims.lease_id, *grant.lease.id.as_bytes());
    assert_eq!(claims.provider, "lender-a");
    assert_eq!(claims.device, "disk0");
    assert_eq!(claims.consumer, "vm-7");
    assert_eq!(claims.expires_at_ms, grant.lease.expires_at_ms);
    assert_eq!(grant.lease.fabric_address, "lender-a.example:7700");
}

fn two_servers_on_one_database_share_the_key(backend: Backend) {
    let (database, _dir) = support::fresh_database(backend);
    // Both start at once on the empty database: migrations and key creation race.
    let a = {
        let database = database.clone();
        std::thread::spawn(move || support::start_on(&database))
    };
    let (b, cb) = support::start_on(&database);
    let (a, ca) = a.join().unwrap();
    assert_eq!(a.public_key(), b.public_key());
    register(
        &ca,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let grant = cb
        .create_lease(&placement("vm-1", "BLOCK", 0, &[]))
        .unwrap();
    let token = LeaseToken::from_text(&grant.token).unwrap();
    a.public_key().verify(&token).unwrap();
    assert_eq!(ca.lease(grant.lease.id).unwrap().id, grant.lease.id);
    assert_eq!(
        code(ca.create_lease(&placement("vm-2", "BLOCK", 0, &[]))),
        (409, "all_leased".into())
    );
    drop(a);
    // A restart keeps the key.
    let (c, _) = support::start_on(&database);
    assert_eq!(c.public_key(), b.public_key());
}

fn placement_explains_why_nothing_fits(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![
            device("disk0", "BLOCK", 10 * GIB, &["FABRIC_TCP", "DISCARD"]),
            device("disk1", "BLOCK", 20 * GIB, &["FABRIC_TCP"]),
        ],
    );
    let err = |r| match r {
        Err(ClientError::Api {
            status,
            code,
            message,
        }) => (status, code, message),
        other => panic!("expected an error, got {other:?}"),
    };
    let (s, c, m) = err(pool.client.create_lease(&placement("vm", "NIC", 0, &[])));
    assert_eq!((s, c.as_str()), (409, "no_device_of_class"), "{m}");
    assert!(m.contains("NIC"), "{m}");
    let (s, c, m) = err(pool
        .client
        .create_lease(&placement("vm", "BLOCK", 100 * GIB, &[])));
    assert_eq!((s, c.as_str()), (409, "too_small"), "{m}");
    assert!(
        m.contains(&(100 * GIB).to_string()) && m.contains(&(20 * GIB).to_string()),
        "{m}"
    );
    let (s, c, m) = err(pool
        .client
        .create_lease(&placement("vm", "BLOCK", 0, &["FABRIC_RDMA"])));
    assert_eq!((s, c.as_str()), (409, "no_device_with_traits"), "{m}");
    assert!(m.contains("FABRIC_RDMA"), "{m}");
    // Best fit: the smallest sufficient device first.
    let g = pool
        .client
        .create_lease(&placement("vm", "BLOCK", 0, &[]))
        .unwrap();
    assert_eq!(g.lease.device, "disk0");
    let g = pool
        .client
        .create_lease(&placement("vm", "BLOCK", 0, &[]))
        .unwrap();
    assert_eq!(g.lease.device, "disk1");
    let (s, c, m) = err(pool.client.create_lease(&placement("vm", "BLOCK", 0, &[])));
    assert_eq!((s, c.as_str()), (409, "all_leased"), "{m}");
    assert!(m.contains('2'), "{m}");
}

fn registration_updates_the_inventory(backend: Backend) {
    let pool = support::start(backend);
    let p1 = register(
        &pool.client,
        "lender-a",
        60_000,
        vec![
            device("disk0", "BLOCK", GIB, &[]),
            device("disk1", "BLOCK", GIB, &[]),
            device("disk2", "BLOCK", GIB, &[]),
        ],
    );
    // Idempotent: the same registration changes nothing.
    let again = register(
        &pool.client,
        "lender-a",
        60_000,
        vec![
            device("disk0", "BLOCK", GIB, &[]),
            device("disk1", "BLOCK", GIB, &[]),
            device("disk2", "BLOCK", GIB, &[]),
        ],
    );
    assert_eq!(again.id, p1.id);
    assert_eq!(again.generation, p1.generation);
    assert_eq!(again.devices, p1.devices);
    let disk1 = p1.devices.iter().find(|d| d.name == "disk1").unwrap();
    let lease = pool
        .client
        .create_lease(&LeaseRequest {
            consumer: "vm".into(),
            compute_host: "h".into(),
            device_id: Some(disk1.id),
            generation: Some(disk1.generation),
            ..Default::default()
        })
        .unwrap()
        .lease;
    // disk1 (leased) and disk2 (free) are no longer listed; disk0 grows.
    let p2 = register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", 2 * GIB, &[])],
    );
    assert!(p2.generation > p1.generation);
    let names: Vec<_> = p2
        .devices
        .iter()
        .map(|d| (d.name.as_str(), d.state))
        .collect();
    assert_eq!(
        names,
        [
            ("disk0", DeviceState::Available),
            ("disk1", DeviceState::Leased)
        ]
    );
    assert_eq!(p2.devices[0].capacity_bytes, 2 * GIB);
    assert_eq!(p2.devices[0].id, p1.devices[0].id);
    pool.client
        .release_lease(lease.id, lease.generation)
        .unwrap();
    let d1 = pool.client.devices(&DeviceQuery::default()).unwrap();
    assert_eq!(
        d1[1].state,
        DeviceState::Unavailable,
        "unlisted, waiting for removal"
    );
    let p3 = register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", 2 * GIB, &[])],
    );
    assert_eq!(p3.devices.len(), 1);
    // The lease history outlives the device.
    assert_eq!(pool.client.lease(lease.id).unwrap().device, "disk1");
}

fn devices_filter(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![
            device("a", "BLOCK", GIB, &["FABRIC_TCP"]),
            device("b", "BLOCK", 100 * GIB, &["FABRIC_TCP", "FABRIC_RDMA"]),
            device("n", "NIC", 0, &["FABRIC_RDMA"]),
            device("g", "PCI_10DE_2330", 80 * GIB, &["NUMA_1"]),
        ],
    );
    let names = |q: DeviceQuery| -> Vec<String> {
        pool.client
            .devices(&q)
            .unwrap()
            .into_iter()
            .map(|d| d.name)
            .collect()
    };
    assert_eq!(names(DeviceQuery::default()), ["a", "b", "g", "n"]);
    let q = DeviceQuery {
        class: Some("BLOCK".into()),
        ..Default::default()
    };
    assert_eq!(names(q), ["a", "b"]);
    let q = DeviceQuery {
        traits: vec!["FABRIC_RDMA".into()],
        ..Default::default()
    };
    assert_eq!(names(q), ["b", "n"]);
    let q = DeviceQuery {
        class: Some("BLOCK".into()),
        traits: vec!["FABRIC_TCP".into()],
        min_capacity: Some(10 * GIB),
    };
    assert_eq!(names(q), ["b"]);
}

fn a_leases_limits_are_kept_and_signed_into_its_token(backend: Backend) {
    use devlend_fabric::qos::{Lane, Qos};
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &["FABRIC_TCP"])],
    );
    let qos = Qos::default()
        .with(Lane::IopsRead, 2000, 100)
        .with(Lane::BpsTotal, 50 << 20, 0)
        .with_weight(3);
    let grant = pool
        .client
        .create_lease(&LeaseRequest {
            qos: Some(qos),
            ..placement("vm-q", "BLOCK", 0, &[])
        })
        .unwrap();
    assert_eq!(grant.lease.qos, Some(qos));
    // Read back from the database, and in the token the pool signed.
    let listed = pool.client.leases(LeaseFilter::Active).unwrap();
    assert_eq!(listed[0].qos, Some(qos));
    let key = PublicKey::from_text(&pool.client.signing_key().unwrap().public_key).unwrap();
    let claims = key
        .verify(&LeaseToken::from_text(&grant.token).unwrap())
        .unwrap();
    assert_eq!(claims.qos, Some(qos));
    pool.client.release_current(grant.lease.id).unwrap();
    let plain = pool
        .client
        .create_lease(&placement("vm-p", "BLOCK", 0, &[]))
        .unwrap();
    assert_eq!(plain.lease.qos, None);
    let claims = key
        .verify(&LeaseToken::from_text(&plain.token).unwrap())
        .unwrap();
    assert_eq!(claims.qos, None);
    // Every lease's token carries its epoch, which only grows.
    assert_eq!(claims.epoch, Some(plain.lease.epoch));
    assert!(plain.lease.epoch > grant.lease.epoch);
}

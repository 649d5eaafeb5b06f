//! The pool as a control plane that may go away: leases its lender reports served stay
//! live, a pool that was absent gives live leases a full TTL from its return, and a
//! client fails over between the servers of one pool. Each on SQLite and PostgreSQL.

#[macro_use]
mod support;

use std::sync::Arc;
use std::time::Duration;

use devlend_pool::api::{LeaseRequest, LeaseState, ProviderHeartbeatBody};
use devlend_pool::PoolClient;
use support::{device, register, Backend, GIB};

on_both_backends!(
    a_lease_its_lender_serves_outlives_a_silent_holder,
    a_pool_absent_longer_than_a_ttl_ends_no_lease,
    a_client_fails_over_to_the_second_server,
);

fn leased(client: &PoolClient, ttl_ms: u64) -> devlend_pool::api::Lease {
    client
        .create_lease(&LeaseRequest {
            consumer: "vm-1".into(),
            compute_host: "host-a".into(),
            class: Some("BLOCK".into()),
            ttl_ms: Some(ttl_ms),
            ..Default::default()
        })
        .expect("lease")
        .lease
}

fn a_lease_its_lender_serves_outlives_a_silent_holder(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let lease = leased(&pool.client, 1_000);
    // The holder never renews (cut from the pool); its lender reports its session.
    let serving = ProviderHeartbeatBody {
        serving: vec![lease.id],
    };
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(400));
        let hb = pool
            .client
            .provider_heartbeat("lender-a", &serving)
            .unwrap();
        assert_eq!(hb.leases.len(), 1, "the served lease is live");
        assert_eq!(hb.fences[0].fence, lease.epoch);
    }
    assert_eq!(
        pool.client.lease(lease.id).unwrap().state,
        LeaseState::Claimed
    );
    // Another provider cannot keep it: a report of a lease not its own is ignored.
    register(
        &pool.client,
        "lender-b",
        60_000,
        vec![device("disk9", "BLOCK", GIB, &[])],
    );
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(400));
        pool.client
            .provider_heartbeat("lender-b", &serving)
            .unwrap();
    }
    assert_eq!(
        pool.client.lease(lease.id).unwrap().state,
        LeaseState::Expired
    );
    // Too many ids is refused, not stored.
    let many = ProviderHeartbeatBody {
        serving: vec![lease.id; devlend_pool::api::MAX_SERVING + 1],
    };
    let e = pool
        .client
        .provider_heartbeat("lender-a", &many)
        .unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
}

fn a_pool_absent_longer_than_a_ttl_ends_no_lease(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![
            device("disk0", "BLOCK", GIB, &[]),
            device("disk1", "BLOCK", GIB, &[]),
        ],
    );
    let live = leased(&pool.client, 4_000);
    let lapsed = leased(&pool.client, 1_000);
    // Lapses while the pool is there (and looks at the database after that).
    std::thread::sleep(Duration::from_millis(2_600));
    assert_eq!(
        pool.client.lease(lapsed.id).unwrap().state,
        LeaseState::Expired
    );
    let database = pool.database.clone();
    let key = pool.admin_key.clone();
    drop(pool.server);
    // Gone for over two of the live lease's TTLs.
    std::thread::sleep(Duration::from_millis(9_000));
    let server = support::start_on_with(
        &database,
        devlend_pool::auth::AuthMode::Signed {
            trust_first_use: false,
        },
        &key,
    );
    let client = PoolClient::new(&server.url())
        .unwrap()
        .with_identity(Arc::new(devlend_fabric::identity::load(&key).unwrap()));
    let back = client.lease(live.id).unwrap();
    assert_eq!(
        back.state,
        LeaseState::Claimed,
        "a full TTL from the return"
    );
    let left = back.expires_at_ms as i64 - devlend_pool::store::now_ms();
    assert!((3_000..=4_000).contains(&left), "{left} ms left");
    // One that had lapsed before the pool went stays lapsed.
    assert_eq!(client.lease(lapsed.id).unwrap().state, LeaseState::Expired);
    // Its holder renews in time: live.
    client.lease_heartbeat(live.id).unwrap();
    std::thread::sleep(Duration::from_millis(1_000));
    assert_eq!(client.lease(live.id).unwrap().state, LeaseState::Claimed);
}

fn a_client_fails_over_to_the_second_server(backend: Backend) {
    let pool = support::start(backend);
    register(
        &pool.client,
        "lender-a",
        60_000,
        vec![device("disk0", "BLOCK", GIB, &[])],
    );
    let (b, _) = support::start_on(&pool.database);
    let key = Arc::new(devlend_fabric::identity::load(&pool.admin_key).unwrap());
    let both = PoolClient::new(&format!("{},{}", pool.url(), b.url()))
        .unwrap()
        .with_identity(key);
    let lease = leased(&both, 2_000);
    assert_eq!(both.base_url().as_str(), format!("{}/", pool.url()));
    drop(pool.server);
    // Renewals go to the other server from the first refused connection on.
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(600));
        let l = both.lease_heartbeat(lease.id).unwrap();
        assert_eq!(l.state, LeaseState::Claimed);
    }
    assert_eq!(both.base_url().as_str(), format!("{}/", b.url()));
    assert!(PoolClient::new("http://a:1,https://b:2").is_err());
}

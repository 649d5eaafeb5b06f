//! Who may call the pool: every route against every kind of caller, the rogue
//! re-registration, join tokens, key rotation and revocation, replays and stale times,
//! and trust on first use. On SQLite and on PostgreSQL.

#[macro_use]
mod support;

use std::sync::Arc;

use devlend_fabric::lease_token::TokenSigner;
use devlend_pool::api::{DeviceQuery, EnrollRequest, LeaseRequest, Role};
use devlend_pool::auth::request;
use devlend_pool::auth::AuthMode;
use devlend_pool::{ClientError, PoolClient};
use support::{device, enrolled, Backend, TestPool, GIB};

on_both_backends!(
    every_route_refuses_the_callers_it_must,
    a_rogue_cannot_re_register_a_lender,
    join_tokens_enroll_once,
    rotation_and_revocation_end_the_old_key,
    replays_and_stale_times_are_refused,
    trust_on_first_use_pins_the_first_key_only,
    restarts_keep_revocations_and_refuse_replays,
    an_enrolled_key_cannot_join_as_another,
);

fn status<T: std::fmt::Debug>(r: Result<T, ClientError>) -> u16 {
    match r {
        Ok(_) => 200,
        Err(e) => e.status().unwrap_or_else(|| panic!("no status: {e}")),
    }
}

fn stranger(pool: &TestPool) -> PoolClient {
    PoolClient::new(&pool.url())
        .unwrap()
        .with_identity(Arc::new(TokenSigner::generate().unwrap()))
}

fn registration(addr: &str) -> devlend_pool::api::RegisterProvider {
    devlend_pool::api::RegisterProvider {
        fabric_address: addr.into(),
        fabric_paths: vec![],
        transports: vec!["tcp".into()],
        heartbeat_ttl_ms: 60_000,
        devices: vec![device("disk0", "BLOCK", GIB, &["FABRIC_TCP"])],
    }
}

fn lease_for(host: &str) -> LeaseRequest {
    LeaseRequest {
        consumer: "vm-1".into(),
        compute_host: host.into(),
        class: Some("BLOCK".into()),
        ..Default::default()
    }
}

/// The table: each caller against each route, with the status it must get.
fn every_route_refuses_the_callers_it_must(backend: Backend) {
    let pool = support::start(backend);
    let store1 = enrolled(&pool, Role::Lender, "store1");
    let store2 = enrolled(&pool, Role::Lender, "store2");
    let host1 = enrolled(&pool, Role::Compute, "host1");
    let host2 = enrolled(&pool, Role::Compute, "host2");
    let anon = PoolClient::new(&pool.url()).unwrap();
    let strange = stranger(&pool);
    store1
        .register_provider("store1", &registration("10.0.0.1:7700"))
        .unwrap();
    let grant = host1.create_lease(&lease_for("host1")).unwrap();
    let id = grant.lease.id;

    type Call = Box<dyn Fn(&PoolClient) -> u16>;
    let enroll = |c: &PoolClient| {
        status(c.enroll(&EnrollRequest {
            role: Role::Compute,
            name: "host9".into(),
            public_key: None,
            ttl_ms: None,
        }))
    };
    let routes: Vec<(&str, Call)> = vec![
        ("signing-key", Box::new(|c| status(c.signing_key()))),
        ("openapi", Box::new(|c| status(c.openapi()))),
        (
            "register store1",
            Box::new(|c| status(c.register_provider("store1", &registration("10.0.0.1:7700")))),
        ),
        (
            "heartbeat store1",
            Box::new(|c| status(c.provider_heartbeat("store1", &Default::default()))),
        ),
        ("providers", Box::new(|c| status(c.providers()))),
        (
            "devices",
            Box::new(|c| status(c.devices(&DeviceQuery::default()))),
        ),
        (
            "lease for host2",
            Box::new(|c| status(c.create_lease(&lease_for("host2")))),
        ),
        ("lease of host1", Box::new(move |c| status(c.lease(id)))),
        (
            "heartbeat host1's lease",
            Box::new(move |c| status(c.lease_heartbeat(id))),
        ),
        ("principals", Box::new(|c| status(c.principals()))),
        ("enroll", Box::new(enroll)),
    ];
    // 200 = allowed (a 409 from the route itself would also show the check passed).
    #[rustfmt::skip]
    let expect: [(&str, &PoolClient, [u16; 11]); 7] = [
        //               sk   oapi reg  hb   prov dev  lease get  renew prin enroll
        ("anonymous",  &anon,     [200, 200, 401, 401, 401, 401, 401, 401, 401, 401, 401]),
        ("unenrolled", &strange,  [200, 200, 403, 403, 403, 403, 403, 403, 403, 403, 403]),
        ("store1",     &store1,   [200, 200, 200, 200, 200, 200, 403, 200, 403, 403, 403]),
        ("store2",     &store2,   [200, 200, 403, 403, 200, 200, 403, 403, 403, 403, 403]),
        ("host1",      &host1,    [200, 200, 403, 403, 200, 200, 403, 200, 200, 403, 403]),
        ("host2",      &host2,    [200, 200, 403, 403, 200, 200, 409, 403, 403, 403, 403]),
        ("admin",      &pool.client, [200, 200, 200, 200, 200, 200, 409, 200, 200, 200, 201]),
    ];
    let mut wrong = Vec::new();
    for (who, client, statuses) in &expect {
        for ((route, call), want) in routes.iter().zip(statuses) {
            let got = call(client);
            // 201 answers come back as Ok (200 here).
            let want = if *want == 201 { 200 } else { *want };
            if got != want {
                wrong.push(format!("{who} {route}: {got}, want {want}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Handovers (a live migration): only host1 may hand host1's lease over; others
    // cannot take its device that way.
    assert_eq!(status(host2.handover_lease(id, "host2")), 403);
    assert_eq!(status(store1.handover_lease(id, "host2")), 403);
    assert_eq!(status(anon.handover_lease(id, "host2")), 401);
    // Releases: only host1 (and the admin) may end host1's lease.
    assert_eq!(status(host2.release_current(id)), 403);
    assert_eq!(status(store1.release_current(id)), 403);
    assert_eq!(status(host1.release_current(id)), 200);
    // A compute host lists its own leases only; the admin sees them all.
    let other = host2.create_lease(&lease_for("host2")).unwrap();
    let all = devlend_pool::api::LeaseFilter::All;
    let ids = |c: &PoolClient| -> Vec<_> { c.leases(all).unwrap().iter().map(|l| l.id).collect() };
    assert_eq!(ids(&host1), vec![id]);
    assert_eq!(ids(&host2), vec![other.lease.id]);
    assert_eq!(ids(&pool.client).len(), 2);
}

/// The finding: anyone could `PUT /v1/providers/store1` with another address.
fn a_rogue_cannot_re_register_a_lender(backend: Backend) {
    let pool = support::start(backend);
    let store1 = enrolled(&pool, Role::Lender, "store1");
    store1
        .register_provider("store1", &registration("10.0.0.1:7700"))
        .unwrap();
    let rogue = stranger(&pool);
    let other_lender = enrolled(&pool, Role::Lender, "store2");
    for (who, c) in [("unenrolled key", &rogue), ("lender store2", &other_lender)] {
        let r = c.register_provider("store1", &registration("6.6.6.6:7700"));
        assert_eq!(status(r), 403, "{who}");
        let r = c.provider_heartbeat("store1", &Default::default());
        assert_eq!(status(r), 403, "{who}");
    }
    let providers = pool.client.providers().unwrap();
    assert_eq!(providers[0].fabric_address, "10.0.0.1:7700");
    // The real lender goes on, and its heartbeat is still its own.
    store1
        .provider_heartbeat("store1", &Default::default())
        .unwrap();
}

fn join_tokens_enroll_once(backend: Backend) {
    let pool = support::start(backend);
    let token = pool
        .client
        .enroll(&EnrollRequest {
            role: Role::Lender,
            name: "store1".into(),
            public_key: None,
            ttl_ms: None,
        })
        .unwrap()
        .join_token
        .unwrap();
    assert!(token.starts_with("dlj_"), "{token}");
    // Unsigned: refused, and the token is not spent.
    let anon = PoolClient::new(&pool.url()).unwrap();
    assert_eq!(status(anon.join(&token)), 401);
    let lender = stranger(&pool);
    let p = lender.join(&token).unwrap();
    assert_eq!((p.role, p.name.as_str()), (Role::Lender, "store1"));
    lender
        .register_provider("store1", &registration("10.0.0.1:7700"))
        .unwrap();
    // Spent: another key cannot use it; the enrolled key may present it again.
    let late = stranger(&pool);
    let e = late.join(&token).unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(403), Some("bad_join_token")));
    assert_eq!(lender.join(&token).unwrap().name, "store1");
    assert_eq!(status(late.join("dlj_made-up")), 403);
    // Only an admin issues tokens.
    let e = lender
        .enroll(&EnrollRequest {
            role: Role::Admin,
            name: "me".into(),
            public_key: None,
            ttl_ms: None,
        })
        .unwrap_err();
    assert_eq!(e.status(), Some(403));
}

fn rotation_and_revocation_end_the_old_key(backend: Backend) {
    let pool = support::start(backend);
    let old = enrolled(&pool, Role::Lender, "store1");
    old.register_provider("store1", &registration("10.0.0.1:7700"))
        .unwrap();
    // Rotation: the admin pins a new key to the same name; the old one is out.
    let new = enrolled(&pool, Role::Lender, "store1");
    let e = old
        .provider_heartbeat("store1", &Default::default())
        .unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(403), Some("unknown_key")));
    new.provider_heartbeat("store1", &Default::default())
        .unwrap();
    let pinned: Vec<_> = pool
        .client
        .principals()
        .unwrap()
        .into_iter()
        .filter(|p| p.name == "store1")
        .collect();
    assert_eq!(pinned.len(), 1);
    assert_eq!(
        Some(pinned[0].public_key.as_str()),
        new.identity().map(|k| k.public_key().to_text()).as_deref()
    );
    // Revocation.
    pool.client.revoke(&pinned[0].public_key).unwrap();
    assert_eq!(
        status(new.provider_heartbeat("store1", &Default::default())),
        403
    );
    assert_eq!(status(pool.client.revoke(&pinned[0].public_key)), 404);
}

fn replays_and_stale_times_are_refused(backend: Backend) {
    let pool = support::start(backend);
    let key = TokenSigner::from_seed_text(std::fs::read_to_string(&pool.admin_key).unwrap().trim())
        .unwrap();
    let http = devlend_pool::https::http_only_builder().build().unwrap();
    let send = |auth: &str| {
        http.get(format!("{}/v1/providers", pool.url()))
            .header("authorization", auth)
            .send()
            .unwrap()
            .status()
            .as_u16()
    };
    let now = devlend_fabric::lease_token::now_ms();
    let h = request::sign(&key, "GET", "/v1/providers", now, b"").unwrap();
    assert_eq!(send(&h), 200);
    assert_eq!(send(&h), 401, "a replayed request was accepted");
    let stale = request::sign(&key, "GET", "/v1/providers", now - 600_000, b"").unwrap();
    assert_eq!(send(&stale), 401);
    let other_path = request::sign(&key, "GET", "/v1/devices", now, b"").unwrap();
    assert_eq!(
        send(&other_path),
        401,
        "a signature for another path was accepted"
    );
    assert_eq!(send("Devlend-Ed25519 key=x"), 401);
}

fn trust_on_first_use_pins_the_first_key_only(backend: Backend) {
    let pool = support::start_with(
        backend,
        AuthMode::Signed {
            trust_first_use: true,
        },
    );
    let first = stranger(&pool);
    first
        .register_provider("store9", &registration("10.0.0.9:7700"))
        .unwrap();
    let second = stranger(&pool);
    let r = second.register_provider("store9", &registration("6.6.6.6:7700"));
    assert_eq!(status(r), 403);
    assert_eq!(
        pool.client.providers().unwrap()[0].fabric_address,
        "10.0.0.9:7700"
    );
    first
        .provider_heartbeat("store9", &Default::default())
        .unwrap();
    // A provider registered before enrollment is not taken by the first key that comes.
    pool.client
        .register_provider("legacy", &registration("10.0.0.8:7700"))
        .unwrap();
    let r = stranger(&pool).register_provider("legacy", &registration("6.6.6.6:7700"));
    assert_eq!(status(r), 403);
    // Trust on first use is for lenders' registrations only.
    assert_eq!(status(second.create_lease(&lease_for("h"))), 403);
    // Without it, an unenrolled key registers nothing.
    let strict = support::start(backend);
    let r = stranger(&strict).register_provider("store9", &registration("10.0.0.9:7700"));
    assert_eq!(status(r), 403);
}

/// Found by a trial: a revoked admin key came back at the next start (the pool enrolled
/// its key file again), and a captured request could be replayed after a restart (the
/// nonces were in memory only).
fn restarts_keep_revocations_and_refuse_replays(backend: Backend) {
    let TestPool {
        server,
        client: old_admin,
        database,
        admin_key,
        dir,
        keys,
    } = support::start(backend);
    let url = server.url();
    let ops2_key = Arc::new(TokenSigner::generate().unwrap());
    old_admin
        .enroll(&EnrollRequest {
            role: Role::Admin,
            name: "ops2".into(),
            public_key: Some(ops2_key.public_key().to_text()),
            ttl_ms: None,
        })
        .unwrap();
    let ops2 = PoolClient::new(&url)
        .unwrap()
        .with_identity(Arc::clone(&ops2_key));
    // A request that changes something, by a key that stays enrolled, captured as sent.
    let body = br#"{"role":"compute","name":"h9"}"#;
    let now = devlend_fabric::lease_token::now_ms();
    let h = request::sign(&ops2_key, "POST", "/v1/principals", now, body).unwrap();
    let key =
        TokenSigner::from_seed_text(std::fs::read_to_string(&admin_key).unwrap().trim()).unwrap();
    let send = |base: &str| {
        devlend_pool::https::http_only_builder()
            .build()
            .unwrap()
            .post(format!("{base}/v1/principals"))
            .header("authorization", &h)
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(send(&url), 201);
    let old_key = old_admin.identity().unwrap().public_key().to_text();
    ops2.revoke(&old_key).unwrap();
    server.stop();
    let again = support::start_on_with(
        &database,
        AuthMode::Signed {
            trust_first_use: false,
        },
        &admin_key,
    );
    let url = again.url();
    let old_admin = PoolClient::new(&url).unwrap().with_identity(Arc::new(key));
    assert_eq!(
        status(old_admin.principals()),
        403,
        "the revoked admin key is back"
    );
    assert_eq!(
        send(&url),
        401,
        "a request replayed after a restart was accepted"
    );
    drop((dir, keys));
}

/// Found by a trial: an admin key that redeemed a compute host's join token became that
/// compute host (and lost its admin rights).
fn an_enrolled_key_cannot_join_as_another(backend: Backend) {
    let pool = support::start(backend);
    let token = pool
        .client
        .enroll(&EnrollRequest {
            role: Role::Compute,
            name: "h12".into(),
            public_key: None,
            ttl_ms: None,
        })
        .unwrap()
        .join_token
        .unwrap();
    let e = pool.client.join(&token).unwrap_err();
    assert_eq!(
        (e.status(), e.code()),
        (Some(409), Some("already_enrolled"))
    );
    pool.client.principals().unwrap();
    // The token is not spent: a new key redeems it.
    let fresh = stranger(&pool);
    assert_eq!(fresh.join(&token).unwrap().name, "h12");
    // An unenrolled key learns nothing of the body's validation (no trust on first use).
    let r = stranger(&pool).register_provider(
        "x",
        &devlend_pool::api::RegisterProvider {
            fabric_address: "not an address".into(),
            fabric_paths: vec![],
            transports: vec![],
            heartbeat_ttl_ms: 1,
            devices: vec![],
        },
    );
    assert_eq!(status(r), 403);
}

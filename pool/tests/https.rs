//! The pool served over HTTPS (`--tls-cert`, `--tls-key`) and its clients with a CA
//! file (`--pool-ca`); the connection limits of the accept loop.

#[macro_use]
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::lease_token::TokenSigner;
use devlend_pool::api::{EnrollRequest, LeaseRequest, Role};
use devlend_pool::auth::AuthMode;
use devlend_pool::client::ClientError;
use devlend_pool::listen::{Limits, TlsFiles};
use devlend_pool::{PoolClient, PoolServer, ServerConfig};
use support::{device, fresh_database, register, Backend, GIB};

/// `ca.crt`, `pool.crt` + `pool.key` (for 127.0.0.1 and localhost, signed by the CA),
/// `other-ca.crt` (an unrelated CA), in a fresh directory.
fn certs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = |name: &str| {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = p.self_signed(&key).unwrap();
        (cert, key)
    };
    let (ca_cert, ca_key) = ca("devlend test CA");
    let (other, _) = ca("another CA");
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "devlend pool");
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
    let d = dir.path();
    std::fs::write(d.join("ca.crt"), ca_cert.pem()).unwrap();
    std::fs::write(d.join("other-ca.crt"), other.pem()).unwrap();
    std::fs::write(d.join("pool.crt"), cert.pem()).unwrap();
    std::fs::write(d.join("pool.key"), key.serialize_pem()).unwrap();
    dir
}

struct TlsPool {
    server: PoolServer,
    admin_key: PathBuf,
    ca: PathBuf,
    other_ca: PathBuf,
    _dirs: (
        tempfile::TempDir,
        Option<tempfile::TempDir>,
        tempfile::TempDir,
    ),
}

/// A pool on `backend` serving HTTPS with the test certificate, or plain HTTP.
fn start(backend: Backend, tls: bool, limits: Limits) -> TlsPool {
    let certs = certs();
    let (database, db_dir) = fresh_database(backend);
    let keys = tempfile::tempdir().expect("tempdir");
    let admin_key = keys.path().join("admin.key");
    let server = PoolServer::start(ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: tls.then(|| TlsFiles {
            cert: certs.path().join("pool.crt"),
            key: certs.path().join("pool.key"),
        }),
        limits,
        database: Some(database),
        data_dir: PathBuf::from("/nonexistent"),
        auth: AuthMode::Signed {
            trust_first_use: false,
        },
        admin_key_file: Some(admin_key.clone()),
    })
    .expect("pool server starts");
    TlsPool {
        server,
        admin_key,
        ca: certs.path().join("ca.crt"),
        other_ca: certs.path().join("other-ca.crt"),
        _dirs: (certs, db_dir, keys),
    }
}

fn admin(pool: &TlsPool, ca: Option<&Path>) -> PoolClient {
    let key = devlend_fabric::identity::load(&pool.admin_key).expect("admin key");
    PoolClient::with_ca(&pool.server.url(), ca)
        .expect("client")
        .with_identity(Arc::new(key))
}

/// A client of the pool, trusting `ca`, signing with a new key enrolled as `role`.
fn enrolled(pool: &TlsPool, role: Role, name: &str) -> PoolClient {
    let key = TokenSigner::generate().expect("key");
    admin(pool, Some(&pool.ca))
        .enroll(&EnrollRequest {
            role,
            name: name.into(),
            public_key: Some(key.public_key().to_text()),
            ttl_ms: None,
        })
        .expect("enroll over HTTPS");
    PoolClient::with_ca(&pool.server.url(), Some(&pool.ca))
        .expect("client")
        .with_identity(Arc::new(key))
}

/// A lender registers and a compute host leases its device, every request over HTTPS
/// verified against the CA file.
fn a_client_with_the_ca_registers_and_leases(backend: Backend) {
    let pool = start(backend, true, Limits::default());
    assert!(
        pool.server.url().starts_with("https://"),
        "{}",
        pool.server.url()
    );
    let lender = enrolled(&pool, Role::Lender, "lender-a");
    register(
        &lender,
        "lender-a",
        30_000,
        vec![device("disk0", "BLOCK", 10 * GIB, &["SSD"])],
    );
    let compute = enrolled(&pool, Role::Compute, "host-a");
    let grant = compute
        .create_lease(&LeaseRequest {
            consumer: "vm-1".into(),
            compute_host: "host-a".into(),
            ttl_ms: Some(30_000),
            class: Some("BLOCK".into()),
            ..Default::default()
        })
        .expect("lease over HTTPS");
    let lease = compute.lease(grant.lease.id).expect("read the lease back");
    assert_eq!(lease.id, grant.lease.id);
}

on_both_backends!(a_client_with_the_ca_registers_and_leases);

fn assert_certificate_error(r: Result<impl std::fmt::Debug, ClientError>, started: Instant) {
    let e = r.expect_err("the pool's certificate must not verify");
    assert!(
        matches!(&e, ClientError::Tls { reason, .. } if reason.contains("not signed by a trusted CA")),
        "want a certificate error, got {e:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the failure took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_client_without_the_ca_or_with_another_fails_on_the_certificate() {
    let pool = start(Backend::Sqlite, true, Limits::default());
    // No CA file: the system's trust store, which does not hold the test CA.
    let t = Instant::now();
    assert_certificate_error(admin(&pool, None).signing_key(), t);
    let t = Instant::now();
    assert_certificate_error(admin(&pool, Some(&pool.other_ca)).signing_key(), t);
    // The same pool with the right CA answers.
    admin(&pool, Some(&pool.ca))
        .signing_key()
        .expect("with the CA");
}

#[test]
fn plain_http_to_the_tls_port_gets_no_answer() {
    let pool = start(Backend::Sqlite, true, Limits::default());
    let addr = pool.server.addr();
    let t = Instant::now();
    let e = PoolClient::new(&format!("http://{addr}"))
        .unwrap()
        .signing_key()
        .expect_err("plain HTTP to the HTTPS port must fail");
    assert!(
        matches!(e, ClientError::Transport { .. }),
        "want a transport error, got {e:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    // On the wire: no HTTP answer comes back, at most a TLS alert, then the close.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /v1/signing-key HTTP/1.1\r\nHost: pool\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    assert!(
        !answer.starts_with(b"HTTP/"),
        "answered in plaintext: {:?}",
        String::from_utf8_lossy(&answer)
    );
    // A CA file with an http:// URL is refused before any request.
    let e = PoolClient::with_ca(&format!("http://{addr}"), Some(&pool.ca)).unwrap_err();
    assert!(matches!(e, ClientError::CaWithoutHttps { .. }), "{e:?}");
}

/// Reads from `s` until the peer closes it; how long that took, or None if it is still
/// open after `wait`.
fn closed_within(s: &mut TcpStream, wait: Duration) -> Option<Duration> {
    let t = Instant::now();
    s.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(t.elapsed()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(t.elapsed()),
            Err(_) => return None,
        }
    }
}

/// TLS done (by rustls, trusting the CA), then nothing sent.
fn tls_then_silent(
    addr: std::net::SocketAddr,
    ca: &Path,
) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let config = devlend_pool::https::client_config(Some(ca)).unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, TcpStream::connect(addr).unwrap());
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock).expect("handshake");
    }
    tls
}

#[test]
fn a_silent_client_is_dropped_after_the_timeout_while_others_are_served() {
    let limits = Limits {
        header_timeout: Duration::from_secs(1),
        ..Limits::default()
    };
    let pool = start(Backend::Sqlite, true, limits);
    let addr = pool.server.addr();
    // One connects and sends nothing (no TLS hello); another completes TLS and sends
    // no request.
    let mut silent = TcpStream::connect(addr).unwrap();
    let mut quiet_tls = tls_then_silent(addr, &pool.ca);
    // Meanwhile the pool serves others.
    let client = admin(&pool, Some(&pool.ca));
    for _ in 0..3 {
        client.signing_key().expect("served while a client stalls");
    }
    let took = closed_within(&mut silent, Duration::from_secs(5))
        .expect("a client that sends nothing is dropped");
    assert!(took < Duration::from_secs(3), "dropped after {took:?}");
    quiet_tls
        .sock
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 64];
    let r = quiet_tls.read(&mut buf);
    assert!(
        matches!(r, Ok(0))
            || r.as_ref()
                .is_err_and(|e| e.kind() != std::io::ErrorKind::WouldBlock),
        "a TLS client that sends no request is dropped, got {r:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "dropped after {:?}",
        t.elapsed()
    );
    // A new client: `client`'s kept-alive connection has now been idle past this
    // pool's 1 s header timeout, so the pool closed it too (the client reuses idle
    // connections up to 4 s, under the 10 s default; not under this test's 1 s).
    admin(&pool, Some(&pool.ca))
        .signing_key()
        .expect("still served");

    // Plain HTTP has the same header timeout.
    let plain = start(Backend::Sqlite, false, limits);
    let mut silent = TcpStream::connect(plain.server.addr()).unwrap();
    let took = closed_within(&mut silent, Duration::from_secs(5))
        .expect("a plain-HTTP client that sends nothing is dropped");
    assert!(took < Duration::from_secs(3), "dropped after {took:?}");
    // A kept-alive connection that sends no next request is dropped the same way.
    let mut kept = TcpStream::connect(plain.server.addr()).unwrap();
    kept.write_all(b"GET /v1/signing-key HTTP/1.1\r\nHost: pool\r\n\r\n")
        .unwrap();
    let mut head = [0u8; 12];
    kept.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let took = closed_within(&mut kept, Duration::from_secs(5))
        .expect("an idle kept-alive connection is dropped");
    assert!(took < Duration::from_secs(3), "dropped after {took:?}");
}

#[test]
fn connections_over_the_cap_are_closed_at_once() {
    let limits = Limits {
        header_timeout: Duration::from_secs(30),
        max_connections: 2,
        ..Limits::default()
    };
    let pool = start(Backend::Sqlite, true, limits);
    let addr = pool.server.addr();
    let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Let the pool accept both before the third arrives.
    std::thread::sleep(Duration::from_millis(200));
    let mut third = TcpStream::connect(addr).unwrap();
    let took = closed_within(&mut third, Duration::from_secs(3))
        .expect("a connection over the cap is closed");
    assert!(took < Duration::from_secs(1), "closed after {took:?}");
    drop(held);
    // Slots free again once the holders leave.
    std::thread::sleep(Duration::from_millis(200));
    admin(&pool, Some(&pool.ca))
        .signing_key()
        .expect("served after the holders left");
}

/// A plain-HTTP `GET /v1/signing-key` on `stream`: the status line's first 12 bytes.
fn get_signing_key(stream: &mut TcpStream) -> std::io::Result<[u8; 12]> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /v1/signing-key HTTP/1.1\r\nHost: pool\r\n\r\n")?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head)?;
    Ok(head)
}

#[test]
fn connections_over_the_per_address_cap_are_closed_while_other_addresses_are_served() {
    let limits = Limits {
        header_timeout: Duration::from_secs(30),
        max_per_address: 2,
        ..Limits::default()
    };
    let pool = start(Backend::Sqlite, false, limits);
    let addr = pool.server.addr();
    let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    // A third from the same address (127.0.0.1) is closed at once...
    let mut third = TcpStream::connect(addr).unwrap();
    let took = closed_within(&mut third, Duration::from_secs(3))
        .expect("a connection over the per-address cap is closed");
    assert!(took < Duration::from_secs(1), "closed after {took:?}");
    // ...while one from another address (127.0.0.2) is served.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let mut other = rt
        .block_on(async {
            let s = tokio::net::TcpSocket::new_v4()?;
            s.bind("127.0.0.2:0".parse().unwrap())?;
            s.connect(addr).await?.into_std()
        })
        .expect("a connection from 127.0.0.2");
    other.set_nonblocking(false).unwrap();
    assert_eq!(
        &get_signing_key(&mut other).expect("served"),
        b"HTTP/1.1 200"
    );
    drop(held);
    std::thread::sleep(Duration::from_millis(200));
    let mut again = TcpStream::connect(addr).unwrap();
    assert_eq!(
        &get_signing_key(&mut again).expect("served after the holders left"),
        b"HTTP/1.1 200"
    );
}

#[test]
fn a_request_whose_body_comes_too_slowly_is_answered_408_and_closed() {
    let limits = Limits {
        request_timeout: Duration::from_secs(1),
        ..Limits::default()
    };
    let pool = start(Backend::Sqlite, false, limits);
    // A request the pool would read the body of: signed by an enrolled key (the admin's),
    // its time and nonce fresh; then only the body's first byte comes.
    let key = devlend_fabric::identity::load(&pool.admin_key).expect("admin key");
    let body = br#"{"resource_class":"BLOCK","min_capacity_bytes":1,"consumer":"slow"}"#;
    let auth = devlend_pool::auth::request::sign(
        &key,
        "POST",
        "/v1/leases",
        devlend_fabric::lease_token::now_ms(),
        body,
    )
    .unwrap();
    let mut slow = TcpStream::connect(pool.server.addr()).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let t = Instant::now();
    write!(
        slow,
        "POST /v1/leases HTTP/1.1\r\nHost: pool\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nAuthorization: {auth}\r\n\r\n",
        body.len()
    )
    .unwrap();
    slow.write_all(&body[..1]).unwrap();
    let mut answer = Vec::new();
    let _ = slow.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "a slow body is answered 408: {answer:?}"
    );
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "answered and closed after {:?}",
        t.elapsed()
    );
    // A request sent whole is served as before.
    let mut quick = TcpStream::connect(pool.server.addr()).unwrap();
    assert_eq!(&get_signing_key(&mut quick).unwrap(), b"HTTP/1.1 200");
}

/// A connection to `to` from the loopback address `from` (127.0.0.0/8 is all local).
fn connect_from(from: &str, to: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(
        &format!("{from}:0")
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    )?;
    s.connect(&to.into())?;
    Ok(s.into())
}

/// Slowloris (issue 39): from four addresses, 240 connections dribble a request's
/// headers a byte at a time (each reconnects when the pool drops it) and 160 more sit
/// idle after connecting. Meanwhile a real client's signed request, on a fresh
/// connection each time, is answered within a second, every time.
#[test]
fn slow_and_idle_clients_do_not_delay_a_signed_request() {
    let limits = Limits {
        header_timeout: Duration::from_secs(2),
        ..Limits::default()
    };
    let pool = start(Backend::Sqlite, true, limits);
    let addr = pool.server.addr();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let dropped = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut attackers = Vec::new();
    let mut idle = Vec::new();
    for a in 2..6 {
        let from = format!("127.0.0.{a}");
        idle.extend((0..40).filter_map(|_| connect_from(&from, addr).ok()));
        for _ in 0..60 {
            let (from, stop, dropped) = (from.clone(), Arc::clone(&stop), Arc::clone(&dropped));
            attackers.push(std::thread::spawn(move || {
                let head = b"GET /v1/devices HTTP/1.1\r\nHost: pool\r\nX-Slow: ";
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Ok(mut s) = connect_from(&from, addr) else {
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    };
                    for b in head.iter().chain(std::iter::repeat(&b'a')) {
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            return;
                        }
                        if s.write_all(&[*b]).is_err() {
                            dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            }));
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    let key = Arc::new(TokenSigner::generate().expect("key"));
    admin(&pool, Some(&pool.ca))
        .enroll(&EnrollRequest {
            role: Role::Compute,
            name: "real-host".into(),
            public_key: Some(key.public_key().to_text()),
            ttl_ms: None,
        })
        .expect("enroll");
    let mut slowest = Duration::ZERO;
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        // A fresh connection each time: the client's own kept-alive one would hide a
        // full accept queue.
        let client = PoolClient::with_ca(&pool.server.url(), Some(&pool.ca))
            .expect("client")
            .with_identity(Arc::clone(&key));
        let t = Instant::now();
        client
            .devices(&Default::default())
            .expect("a signed request is answered under the attack");
        slowest = slowest.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(idle);
    for t in attackers {
        let _ = t.join();
    }
    eprintln!(
        "slowest signed request under attack: {slowest:?}; slow connections dropped by the pool: {}",
        dropped.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    assert!(
        dropped.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the pool dropped no slow client"
    );
}

//! The handshakes and the pump, over real TCP on loopback with certificates made here.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread;
use std::time::Duration;

use super::*;

/// A CA (certificate and key, PEM).
struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

fn ca(name: &str) -> Ca {
    let key = rcgen::KeyPair::generate().expect("CA key");
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let cert = p.self_signed(&key).expect("CA certificate");
    Ca { cert, key }
}

/// Writes `NAME.crt`/`NAME.key` signed by `ca` (for `names`, server or client use) and
/// `NAME-ca.crt`, into `dir`.
fn leaf(dir: &Path, name: &str, ca: &Ca, names: &[&str], server: bool) {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut p =
        rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("params");
    p.extended_key_usages = vec![if server {
        rcgen::ExtendedKeyUsagePurpose::ServerAuth
    } else {
        rcgen::ExtendedKeyUsagePurpose::ClientAuth
    }];
    let cert = p.signed_by(&key, &ca.cert, &ca.key).expect("sign");
    std::fs::write(dir.join(format!("{name}.crt")), cert.pem()).expect("write");
    std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).expect("write");
}

struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    fn new() -> Certs {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = ca("devlend test CA");
        let other = ca("unrelated CA");
        std::fs::write(dir.path().join("ca.crt"), good.cert.pem()).expect("write");
        std::fs::write(dir.path().join("other-ca.crt"), other.cert.pem()).expect("write");
        leaf(
            dir.path(),
            "lender",
            &good,
            &["localhost", "127.0.0.1"],
            true,
        );
        leaf(dir.path(), "borrower", &good, &["borrower"], false);
        leaf(dir.path(), "stranger", &other, &["stranger"], false);
        Certs { dir }
    }

    fn p(&self, f: &str) -> std::path::PathBuf {
        self.dir.path().join(f)
    }

    fn server(&self, mutual: bool) -> ServerTls {
        let ca = self.p("ca.crt");
        ServerTls::load(
            &self.p("lender.crt"),
            &self.p("lender.key"),
            mutual.then_some(ca.as_path()),
        )
        .expect("server config")
    }

    fn client(&self, ca: &str, identity: Option<&str>) -> ClientTls {
        let (c, k) = identity.map_or((None, None), |n| {
            (
                Some(self.p(&format!("{n}.crt"))),
                Some(self.p(&format!("{n}.key"))),
            )
        });
        ClientTls::load(&self.p(ca), c.as_deref().zip(k.as_deref())).expect("client config")
    }
}

const T: Duration = Duration::from_secs(5);

fn timeouts(s: &TcpStream) {
    s.set_read_timeout(Some(T)).expect("timeout");
    s.set_write_timeout(Some(T)).expect("timeout");
}

/// Runs both handshakes on a loopback connection; returns both results (the server's
/// pump end on success).
fn pair(
    server: ServerTls,
    target: TlsTarget,
) -> (Result<UnixStream, TlsError>, Result<UnixStream, TlsError>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let srv = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        timeouts(&s);
        let conn = server_handshake(&server, &mut s)?;
        Ok(spawn_pump(conn, s, "test-server").expect("pump"))
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    timeouts(&c);
    let client = client_handshake(&target, &mut c)
        .map(|conn| spawn_pump(conn, c, "test-client").expect("pump"));
    let server = srv.join().expect("server thread");
    (client, server)
}

fn target(client: ClientTls, name: &str) -> TlsTarget {
    TlsTarget::new(client, "127.0.0.1:1", Some(name)).expect("target")
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + u64::from(seed)) as u8 ^ (i >> 12) as u8)
        .collect()
}

/// Writes `data` in uneven pieces, then shuts the write side.
fn send(mut s: UnixStream, data: Vec<u8>) -> thread::JoinHandle<UnixStream> {
    thread::spawn(move || {
        let mut off = 0;
        let mut step = 1;
        while off < data.len() {
            let n = step.min(data.len() - off);
            s.write_all(&data[off..off + n]).expect("write");
            off += n;
            step = (step * 7 + 13) % 300_000 + 1;
        }
        s.shutdown(Shutdown::Write).expect("shutdown");
        s
    })
}

fn read_to_end(mut s: &UnixStream) -> Vec<u8> {
    let mut v = Vec::new();
    s.read_to_end(&mut v).expect("read");
    v
}

#[test]
fn a_large_transfer_both_ways_at_once_arrives_intact_and_ends_with_eof() {
    let certs = Certs::new();
    let (c, s) = pair(
        certs.server(false),
        target(certs.client("ca.crt", None), "localhost"),
    );
    let (c, s) = (c.expect("client"), s.expect("server"));
    let up = pattern(1, 24 << 20);
    let down = pattern(2, 17 << 20);
    let c2 = c.try_clone().expect("clone");
    let s2 = s.try_clone().expect("clone");
    let wc = send(c2, up.clone());
    let ws = send(s2, down.clone());
    let got_down = thread::spawn(move || read_to_end(&c));
    let got_up = read_to_end(&s);
    assert!(
        got_up == up,
        "borrower → lender: {} of {} bytes, or different",
        got_up.len(),
        up.len()
    );
    let got_down = got_down.join().expect("reader");
    assert!(
        got_down == down,
        "lender → borrower: {} of {} bytes, or different",
        got_down.len(),
        down.len()
    );
    wc.join().expect("writer");
    ws.join().expect("writer");
}

#[test]
fn a_half_close_passes_through_and_the_other_way_still_works() {
    let certs = Certs::new();
    let (c, s) = pair(
        certs.server(true),
        target(certs.client("ca.crt", Some("borrower")), "127.0.0.1"),
    );
    let (mut c, mut s) = (c.expect("client"), s.expect("server"));
    c.write_all(b"request").expect("write");
    c.shutdown(Shutdown::Write).expect("shutdown");
    assert_eq!(
        read_to_end(&s),
        b"request",
        "the lender reads the data, then EOF"
    );
    // The lender still answers after the borrower's close_notify.
    s.write_all(b"response").expect("write");
    drop(s);
    let mut buf = Vec::new();
    c.read_to_end(&mut buf).expect("read");
    assert_eq!(buf, b"response");
}

#[test]
fn closing_either_end_is_eof_at_the_other() {
    let certs = Certs::new();
    for close_client in [true, false] {
        let (c, s) = pair(
            certs.server(false),
            target(certs.client("ca.crt", None), "localhost"),
        );
        let (c, s) = (c.expect("client"), s.expect("server"));
        let (gone, stays) = if close_client { (c, s) } else { (s, c) };
        drop(gone);
        stays.set_read_timeout(Some(T)).expect("timeout");
        let mut b = [0u8; 8];
        assert_eq!((&stays).read(&mut b).expect("EOF, not a timeout"), 0);
    }
}

#[test]
fn a_lost_tcp_connection_is_eof_on_the_plaintext_end() {
    let certs = Certs::new();
    let server = certs.server(false);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let srv = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        timeouts(&s);
        let conn = server_handshake(&server, &mut s).expect("handshake");
        // Dies without close_notify: the TCP connection just ends.
        drop(conn);
        drop(s);
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    timeouts(&c);
    let conn = client_handshake(&target(certs.client("ca.crt", None), "localhost"), &mut c)
        .expect("handshake");
    let plain = spawn_pump(conn, c, "test").expect("pump");
    srv.join().expect("server");
    plain.set_read_timeout(Some(T)).expect("timeout");
    let mut b = [0u8; 8];
    assert_eq!((&plain).read(&mut b).expect("EOF, not a timeout"), 0);
}

#[test]
fn a_borrower_trusting_another_ca_refuses_the_lender_and_the_lender_hears_it() {
    let certs = Certs::new();
    let (c, s) = pair(
        certs.server(false),
        target(certs.client("other-ca.crt", None), "localhost"),
    );
    let c = c.expect_err("client must refuse");
    assert!(c.is_permanent());
    assert!(c.to_string().contains("not signed by a trusted CA"), "{c}");
    let s = s.expect_err("server must fail");
    assert!(
        s.to_string().contains("does not trust"),
        "{}",
        crate::error::chain(&s)
    );
}

#[test]
fn a_name_that_the_certificate_does_not_carry_is_refused() {
    let certs = Certs::new();
    let (c, _) = pair(
        certs.server(false),
        target(certs.client("ca.crt", None), "lender.example"),
    );
    let c = c.expect_err("client must refuse");
    assert!(
        c.to_string()
            .contains("not valid for the expected server name"),
        "{c}"
    );
}

#[test]
fn mutual_tls_refuses_a_borrower_without_a_certificate_or_with_a_stranger_one() {
    let certs = Certs::new();
    for identity in [None, Some("stranger")] {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = certs.server(true);
        let srv = thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            timeouts(&s);
            server_handshake(&server, &mut s).map(drop)
        });
        let mut c = TcpStream::connect(addr).expect("connect");
        timeouts(&c);
        let t = target(certs.client("ca.crt", identity), "localhost");
        // TLS 1.3: the client is done before the server judged its certificate; the
        // refusal arrives as an alert at the first read.
        let first: Result<(), TlsError> = client_handshake(&t, &mut c).and_then(|mut conn| {
            let mut s = rustls::Stream::new(&mut conn, &mut c);
            let _ = s.write_all(b"DVLD");
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Err(e) => Err(session_error(&e).expect("a TLS error, not a socket one")),
                Ok(n) => panic!("read {n} bytes from a lender that must refuse"),
            }
        });
        let e = first.expect_err("refused");
        assert!(e.is_permanent(), "{e}");
        let srv = srv.join().expect("server").expect_err("server refuses");
        let text = crate::error::chain(&srv);
        assert!(
            text.contains("no certificate") || text.contains("not signed by a trusted CA"),
            "{identity:?}: {text}"
        );
        if identity.is_none() {
            assert!(
                e.to_string().contains("requires a client certificate"),
                "{e}"
            );
        }
    }
}

#[test]
fn a_plaintext_devlend_hello_is_told_apart_and_left_unread() {
    let certs = Certs::new();
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = certs.server(false);
    let srv = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        timeouts(&s);
        let e = server_handshake(&server, &mut s).expect_err("plaintext");
        let mut magic = [0u8; 4];
        s.read_exact(&mut magic).expect("the hello is still there");
        (e, magic)
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    crate::Hello::new("disk0", 0)
        .write_to(&mut c)
        .expect("hello");
    let (e, magic) = srv.join().expect("server");
    assert!(matches!(e, TlsError::Plaintext), "{e}");
    assert_eq!(magic, crate::handshake::MAGIC);
}

#[test]
fn a_tls_borrower_against_a_plaintext_peer_gets_a_clear_error() {
    let certs = Certs::new();
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let srv = thread::spawn(move || {
        // What a plaintext lender does with a ClientHello: bad magic, close.
        let (mut s, _) = listener.accept().expect("accept");
        let mut b = [0u8; 36];
        let _ = s.read(&mut b);
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    timeouts(&c);
    let e = client_handshake(&target(certs.client("ca.crt", None), "localhost"), &mut c)
        .expect_err("no TLS there");
    srv.join().expect("server");
    assert!(
        e.to_string().contains("is TLS configured on it"),
        "{}",
        crate::error::chain(&e)
    );
}

#[test]
fn configuration_errors_name_the_file() {
    let certs = Certs::new();
    let missing = certs.p("nope.crt");
    let e = ClientTls::load(&missing, None).expect_err("missing");
    assert!(e.to_string().contains("nope.crt"), "{e}");
    // A key file given as the CA: no certificate in it.
    let e = ClientTls::load(&certs.p("lender.key"), None).expect_err("no certs");
    assert!(
        e.to_string()
            .contains("lender.key holds no CA certificates"),
        "{e}"
    );
    // A certificate with somebody else's key.
    let e = ServerTls::load(&certs.p("lender.crt"), &certs.p("borrower.key"), None)
        .expect_err("mismatch");
    assert!(e.to_string().contains("cannot be used"), "{e}");
}

#[test]
fn server_names_default_to_the_host_of_the_address() {
    assert_eq!(host_of("lender.example:7700"), "lender.example");
    assert_eq!(host_of("127.0.0.1:7700"), "127.0.0.1");
    assert_eq!(host_of("[::1]:7700"), "::1");
    assert_eq!(host_of("lender"), "lender");
    let certs = Certs::new();
    let t = TlsTarget::new(certs.client("ca.crt", None), "[::1]:7700", None).expect("target");
    assert_eq!(t.server_name, "::1");
    assert!(matches!(
        TlsTarget::new(certs.client("ca.crt", None), "x:1", Some("bad name!")),
        Err(TlsError::ServerName(_))
    ));
}

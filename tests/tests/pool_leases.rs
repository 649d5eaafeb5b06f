//! Leases enforced for real: a device pool (`devlend pool serve`, SQLite), a lender
//! registered with it, a borrower, the CLI and the `blkio` frontend, all real processes
//! on loopback. The pool's own API behaviour (races, generations, bad input, PostgreSQL)
//! is tested in `pool/tests`.
//!
//! Why this file is over 600 lines: a test file: its nine end-to-end tests share one rig
//! (`Rig`: a pool and a lender registered with it, with the helpers that attach by class
//! and check I/O, about 210 lines), each test its own so that they run in parallel.

use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_fabric::lease_token::{LeaseToken, TokenSigner};
use devlend_fabric::tcp::{connect_as, ConnectError};
use devlend_fabric::{Hello, HelloStatus};
use devlend_pool::api::{
    DeviceQuery, DeviceState, LeaseFilter, LeaseGrant, LeaseRequest, LeaseState, Role,
};
use devlend_pool::client::PoolClient;
use devlend_tests::agents::{free_port, sparse_file, Borrower, Lender, Pool};

const MIB: u64 = 1 << 20;
const HEARTBEAT_MS: u64 = 500;
const PROVIDER: &str = "lender-a";

struct Rig {
    dir: tempfile::TempDir,
    pool: Pool,
    client: PoolClient,
    lender: Lender,
    config: PathBuf,
}

/// A pool and a lender registered with it, lending disk0 (64 MiB, NUMA_0) and disk1
/// (16 MiB).
fn rig() -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::start(dir.path()).unwrap();
    let client = pool.admin().unwrap();
    let lender_key = dir.path().join("lender.key");
    pool.enroll(Role::Lender, PROVIDER, &lender_key).unwrap();
    pool.enroll(
        Role::Compute,
        &devlend_daemon::host_name(),
        &Borrower::pool_key(dir.path()),
    )
    .unwrap();
    for (name, size) in [("disk0", 64 * MIB), ("disk1", 16 * MIB)] {
        sparse_file(&dir.path().join(format!("{name}.img")), size).unwrap();
    }
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let config = dir.path().join("device-agent.toml");
    std::fs::write(
        &config,
        format!(
            r#"listen = "{addr}"
key_file = "{key}"
[pool]
url = "{url}"
provider = "{PROVIDER}"
heartbeat_interval_ms = {HEARTBEAT_MS}

[[device]]
name = "disk0"
path = "{d}/disk0.img"
traits = ["NUMA_0"]

[[device]]
name = "disk1"
path = "{d}/disk1.img"
"#,
            url = pool.url,
            d = dir.path().display(),
            key = lender_key.display()
        ),
    )
    .unwrap();
    let lender = Lender::start_with(
        dir.path(),
        &addr,
        &[],
        &["--config".into(), config.display().to_string()],
    )
    .unwrap();
    let r = Rig {
        dir,
        pool,
        client,
        lender,
        config,
    };
    r.wait_for("both devices registered and available", |c| {
        let d = c.devices(&DeviceQuery::default()).unwrap_or_default();
        d.len() == 2 && d.iter().all(|d| d.state == DeviceState::Available)
    });
    r
}

impl Rig {
    fn wait_for(&self, what: &str, mut f: impl FnMut(&PoolClient) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f(&self.client) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for: {what}\npool log:\n{}\nlender log:\n{}",
                self.pool.proc.log(),
                self.lender.proc.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn device_id(&self, name: &str) -> (uuid::Uuid, u64) {
        let d = self
            .client
            .devices(&DeviceQuery::default())
            .unwrap()
            .into_iter()
            .find(|d| d.name == name)
            .unwrap();
        (d.id, d.generation)
    }

    /// Leases `name` directly (not through a borrower), with `ttl_ms`.
    fn lease(&self, name: &str, ttl_ms: u64) -> LeaseGrant {
        let (id, generation) = self.device_id(name);
        self.client
            .create_lease(&LeaseRequest {
                consumer: "vm-test".into(),
                // The enrolled compute host: its key is the tokens' holder key.
                compute_host: devlend_daemon::host_name(),
                ttl_ms: Some(ttl_ms),
                device_id: Some(id),
                generation: Some(generation),
                ..LeaseRequest::default()
            })
            .unwrap()
    }

    /// Kills the lender with SIGKILL and starts it again with the same configuration.
    fn restart_lender(&mut self) {
        self.lender.proc.kill_hard();
        let addr = self.lender.addr.clone();
        self.lender = Lender::start_with(
            self.dir.path(),
            &addr,
            &[],
            &["--config".into(), self.config.display().to_string()],
        )
        .unwrap();
    }

    fn sock(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.sock"))
    }
}

/// Opens a session on `device` with `token` as `borrower`, proving possession with the
/// compute host's enrolled key (what the pool's tokens name); the lender's status.
fn hello(
    r: &Rig,
    device: &str,
    borrower: [u8; 16],
    token: Vec<u8>,
) -> Result<std::net::TcpStream, (HelloStatus, String)> {
    let mut h = Hello::new(device, 0);
    h.borrower = borrower;
    h.token = token;
    let (key, _) =
        devlend_fabric::identity::load_or_create(&Borrower::pool_key(r.dir.path())).unwrap();
    if !h.token.is_empty() {
        h.holder = Some(devlend_fabric::holder_proof::Holder {
            key: devlend_fabric::holder_proof::HolderKey::new(key),
            lender: None,
        });
    }
    match connect_as(&r.lender.addr, &h, Duration::from_secs(5)) {
        Ok((s, _)) => Ok(s),
        Err(ConnectError::Refused {
            status, message, ..
        }) => Err((status, message)),
        Err(e) => panic!("connect failed: {e}"),
    }
}

fn token_bytes(g: &LeaseGrant) -> Vec<u8> {
    LeaseToken::from_text(&g.token).unwrap().as_bytes().to_vec()
}

fn write_read(c: &mut BlkClient, seed: u8) -> Vec<i32> {
    for (i, b) in c.buffer()[..65536].iter_mut().enumerate() {
        *b = seed.wrapping_add((i % 251) as u8);
    }
    let mut r = c
        .run(
            0,
            &[BlkOp::Write {
                offset: 4096,
                buf: 0,
                len: 65536,
            }],
        )
        .unwrap();
    r.extend(
        c.run(
            0,
            &[BlkOp::Read {
                offset: 4096,
                buf: 65536,
                len: 65536,
            }],
        )
        .unwrap(),
    );
    if r.iter().all(|&x| x == 0) {
        let b = c.buffer();
        assert_eq!(b[..65536], b[65536..131072], "read back differs");
    }
    r
}

fn attach_by_class(b: &Borrower, r: &Rig, sock: &Path, extra: &[&str]) -> std::process::Output {
    let s = sock.display().to_string();
    let key = Borrower::pool_key(r.dir.path()).display().to_string();
    let mut args = vec![
        "attach",
        "--pool",
        &r.pool.url,
        "--pool-key",
        &key,
        "--class",
        "BLOCK",
        "--vm",
        "vm-1",
        "--socket",
        &s,
        "--json",
    ];
    args.extend_from_slice(extra);
    b.cli(&args).unwrap()
}

#[test]
fn placement_leases_attaches_serves_io_and_detach_releases() {
    let r = rig();
    let b = Borrower::start(r.dir.path()).unwrap();
    let sock = r.sock("a");
    // Only disk0 has 32 MiB: placement must pick it.
    let out = attach_by_class(&b, &r, &sock, &["--min-capacity", "32M"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(a["device"], "disk0");
    let lease_id = a["lease"]
        .as_str()
        .expect("attachment reports its lease")
        .to_owned();
    let leases = r.client.leases(LeaseFilter::Active).unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].id.to_string(), lease_id);
    assert_eq!(leases[0].state, LeaseState::Bound);
    assert_eq!(leases[0].consumer, "vm-1");

    let mut c = BlkClient::connect(&sock, 1, 4 * MIB as usize).unwrap();
    assert_eq!(c.capacity(), 64 * MIB);
    assert_eq!(write_read(&mut c, 7), vec![0, 0]);

    // disk0 is leased, disk1 is too small, nothing has RDMA: each says why.
    let out = attach_by_class(&b, &r, &r.sock("b"), &["--min-capacity", "32M"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("leased"), "{err}");
    let out = attach_by_class(&b, &r, &r.sock("b"), &["--trait", "FABRIC_RDMA"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("FABRIC_RDMA"), "{err}");
    assert!(!r.sock("b").exists());

    // The lease stays alive past its TTL while attached: the compute agent renews it.
    let out = attach_by_class(&b, &r, &r.sock("c"), &["--lease-ttl", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c2: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(c2["device"], "disk1");
    std::thread::sleep(Duration::from_secs(4));
    let mut cl = BlkClient::connect(&r.sock("c"), 1, 4 * MIB as usize).unwrap();
    assert_eq!(write_read(&mut cl, 9), vec![0, 0]);
    assert_eq!(r.client.leases(LeaseFilter::Active).unwrap().len(), 2);
    drop(cl);

    drop(c);
    let d = b
        .cli_json(&["detach", &sock.display().to_string()])
        .unwrap();
    assert_eq!(d["lease"].as_str(), Some(lease_id.as_str()));
    let l = r.client.lease(lease_id.parse().unwrap()).unwrap();
    assert_eq!(l.state, LeaseState::Released);
    let (id, _) = r.device_id("disk0");
    let dev = r
        .client
        .devices(&DeviceQuery::default())
        .unwrap()
        .into_iter()
        .find(|d| d.id == id)
        .unwrap();
    assert_eq!(dev.state, DeviceState::Available);
}

#[test]
fn the_lender_admits_only_the_right_token() {
    let r = rig();
    let g = r.lease("disk0", 60_000);
    let id = *g.lease.id.as_bytes();
    let token = token_bytes(&g);

    let denied = |res: Result<std::net::TcpStream, (HelloStatus, String)>, what: &str| match res {
        Err((HelloStatus::Denied, msg)) => msg,
        Err(other) => panic!("{what}: refused with {other:?}, expected Denied"),
        Ok(_) => panic!("{what}: session opened"),
    };
    // No token at all (direct-mode hello).
    let m = denied(hello(&r, "disk0", id, Vec::new()), "no token");
    assert!(m.contains("no lease token"), "{m}");
    // The token of disk0 does not open disk1.
    let m = denied(hello(&r, "disk1", id, token.clone()), "other device");
    assert!(m.contains("disk0"), "{m}");
    // Someone else presenting the token under another identity.
    denied(
        hello(&r, "disk0", [0x42; 16], token.clone()),
        "other borrower",
    );
    // An altered token: the lease id inside flipped, or the expiry pushed out.
    for i in [1, 17, 25] {
        let mut t = token.clone();
        t[i] ^= 0x80;
        let m = denied(hello(&r, "disk0", id, t), "altered token");
        assert!(m.contains("signature") || m.contains("malformed"), "{m}");
    }
    // A token signed by another key, with claims that would otherwise pass.
    let forged = TokenSigner::generate()
        .unwrap()
        .sign(&devlend_fabric::lease_token::LeaseClaims {
            lease_id: id,
            expires_at_ms: u64::MAX / 2,
            provider: PROVIDER.into(),
            device: "disk0".into(),
            consumer: "vm-test".into(),
            provider_key: None,
            qos: None,
            successor_of: None,
            epoch: None,
            holder_key: None,
        })
        .unwrap();
    let m = denied(
        hello(&r, "disk0", id, forged.as_bytes().to_vec()),
        "forged token",
    );
    assert!(m.contains("signature"), "{m}");
    // The right token opens the session.
    hello(&r, "disk0", id, token).expect("valid token refused");
    assert!(r.lender.proc.log().contains("lease check failed"));
}

#[test]
fn an_ended_lease_ends_its_sessions() {
    let r = rig();
    // 1. A lease whose holder never renews but keeps a session open is renewed by its
    //    lender's reports: three TTLs on, the session is still served. (Before the
    //    lender reported its sessions, it closed this one at the token's expiry.)
    let g = r.lease("disk1", 1500);
    let id = *g.lease.id.as_bytes();
    let mut s = hello(&r, "disk1", id, token_bytes(&g)).expect("session");
    s.set_read_timeout(Some(Duration::from_millis(4500)))
        .unwrap();
    let mut b = [0u8; 1];
    let e = s
        .read(&mut b)
        .expect_err("the lender keeps the session open");
    assert!(
        matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{e}"
    );
    assert!(r.client.lease(g.lease.id).unwrap().state.is_live());
    // 2. Expiry: once no session holds it and nobody renews it, it expires at the pool,
    //    and the lender refuses its token from its next heartbeat answer on.
    drop(s);
    let t0 = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(700));
        match hello(&r, "disk1", id, token_bytes(&g)) {
            Err((HelloStatus::Denied, m)) => {
                assert!(m.contains("ended"), "{m}");
                break;
            }
            Ok(s) => drop(s),
            Err(other) => panic!("expired lease: {other:?}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "an unserved lease was still admitted {:?} after its last session",
            t0.elapsed()
        );
    }

    // 3. Release by the pool while a borrower uses the device: its I/O stops.
    let bw = Borrower::start(r.dir.path()).unwrap();
    let sock = r.sock("a");
    // A 3 s lease, renewed every second: the agent learns soon that it ended.
    let out = attach_by_class(
        &bw,
        &r,
        &sock,
        &["--min-capacity", "32M", "--lease-ttl", "3"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lease: uuid::Uuid = a["lease"].as_str().unwrap().parse().unwrap();
    let mut c = BlkClient::connect(&sock, 1, 4 * MIB as usize).unwrap();
    assert_eq!(write_read(&mut c, 3), vec![0, 0]);
    let l = r.client.lease(lease).unwrap();
    r.client.release_lease(lease, l.generation).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let res = write_read(&mut c, 4);
        if res.iter().any(|&x| x != 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "I/O still served 10 s after the lease was released\n{}",
            r.lender.proc.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = r.lender.proc.log();
    assert!(log.contains("lease ended"), "{log}");
    // The compute agent shows it: its next renewal was told the lease has ended.
    let deadline = Instant::now() + Duration::from_secs(5);
    while bw.cli_json(&["status"]).unwrap()[0]["lease_ended"] != true {
        assert!(
            Instant::now() < deadline,
            "status never showed the ended lease"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let table = String::from_utf8(bw.cli(&["status"]).unwrap().stdout).unwrap();
    assert!(table.contains("lease-ended"), "{table}");
}

#[test]
fn a_lender_that_stops_heartbeating_drops_out_of_placement_and_returns() {
    let r = rig();
    let want = LeaseRequest {
        consumer: "vm-2".into(),
        compute_host: "test".into(),
        class: Some("BLOCK".into()),
        ..LeaseRequest::default()
    };
    r.lender.proc.signal(libc::SIGSTOP);
    r.wait_for("devices unavailable", |c| {
        c.devices(&DeviceQuery::default())
            .unwrap_or_default()
            .iter()
            .all(|d| d.state == DeviceState::Unavailable)
    });
    let e = r.client.create_lease(&want).unwrap_err();
    assert_eq!(e.code(), Some("providers_unavailable"), "{e}");
    r.lender.proc.signal(libc::SIGCONT);
    r.wait_for("devices back", |c| {
        c.devices(&DeviceQuery::default())
            .unwrap_or_default()
            .iter()
            .all(|d| d.state == DeviceState::Available)
    });
    let g = r.client.create_lease(&want).unwrap();
    assert_eq!(g.lease.provider, PROVIDER);
}

#[test]
fn a_lender_restart_in_pool_mode_is_a_delay_even_past_the_token_expiry() {
    let mut r = rig();
    let b = Borrower::start(r.dir.path()).unwrap();
    let sock = r.sock("a");
    // A 2 s lease: by the restart the token's own expiry has long passed, and only the
    // renewals the pool recorded keep it alive.
    let out = attach_by_class(&b, &r, &sock, &["--lease-ttl", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = BlkClient::connect(&sock, 1, 4 * MIB as usize).unwrap();
    assert_eq!(write_read(&mut c, 1), vec![0, 0]);
    std::thread::sleep(Duration::from_secs(4));
    for round in 0..3u8 {
        r.restart_lender();
        assert_eq!(write_read(&mut c, 10 + round), vec![0, 0], "round {round}");
    }
    let status = b.cli_json(&["status"]).unwrap();
    assert_eq!(status[0]["counters"]["errors"], 0, "{status}");
    assert_eq!(status[0]["lease_ended"], false);
}

#[test]
fn a_compute_agent_restart_keeps_the_attachment_and_its_lease() {
    let r = rig();
    let mut b = Borrower::start(r.dir.path()).unwrap();
    let sock = r.sock("a");
    let out = attach_by_class(
        &b,
        &r,
        &sock,
        &["--lease-ttl", "6", "--min-capacity", "32M"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lease_id: uuid::Uuid = a["lease"].as_str().unwrap().parse().unwrap();
    let mut c = BlkClient::connect(&sock, 1, 4 * MIB as usize).unwrap();
    assert_eq!(write_read(&mut c, 3), vec![0, 0]);
    drop(c);

    // SIGKILL just after a renewal, then a restart 4.5 s later, within the lease's 6 s
    // TTL (a lease left unrenewed for longer expires at the pool, as it should): the
    // attachment is served again from the state file, under the same lease, renewed at
    // once. (Its renewals come every 2 s: the first one 2 s after the restore would
    // come after the lease's expiry, as a trial saw with a 30 s TTL and a 13 s restart.)
    let renewed = r.client.lease(lease_id).unwrap().expires_at_ms;
    let deadline = Instant::now() + Duration::from_secs(10);
    while r.client.lease(lease_id).unwrap().expires_at_ms == renewed {
        assert!(Instant::now() < deadline, "the lease is not renewed");
        std::thread::sleep(Duration::from_millis(20));
    }
    b.proc.kill_hard();
    std::thread::sleep(Duration::from_millis(4500));
    let b = Borrower::start_named(r.dir.path(), "compute-agent-2", &[]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = b.cli_json(&["status"]).unwrap();
        if s[0]["id"] == a["id"] {
            assert_eq!(s[0]["lease"].as_str(), Some(lease_id.to_string().as_str()));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not restored: {s}\n{}",
            b.proc.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
    let l = r.client.lease(lease_id).unwrap();
    assert_eq!(l.state, LeaseState::Bound, "{l:?}");
    let mut c = BlkClient::connect(&sock, 1, 4 * MIB as usize).unwrap();
    // What was written before the kill is there, and I/O goes on.
    let got = c
        .run(
            0,
            &[BlkOp::Read {
                offset: 4096,
                buf: 0,
                len: 65536,
            }],
        )
        .unwrap();
    assert_eq!(got, vec![0]);
    assert!(c.buffer()[..65536]
        .iter()
        .enumerate()
        .all(|(i, &x)| x == 3u8.wrapping_add((i % 251) as u8)));
    assert_eq!(write_read(&mut c, 4), vec![0, 0]);
    drop(c);

    // SIGTERM keeps the lease too (a stop is not a detach) ...
    let mut b = b;
    assert!(b.proc.terminate(Duration::from_secs(30)).unwrap().success());
    assert!(!sock.exists(), "the socket outlived the agent");
    assert_eq!(r.client.lease(lease_id).unwrap().state, LeaseState::Bound);
    // ... and the detach after the next start releases it.
    let b = Borrower::start_named(r.dir.path(), "compute-agent-3", &[]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while b
        .cli_json(&["status"])
        .unwrap()
        .as_array()
        .is_none_or(|v| v.is_empty())
    {
        assert!(Instant::now() < deadline, "not restored:\n{}", b.proc.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    b.cli_json(&["detach", &sock.display().to_string()])
        .unwrap();
    assert_eq!(
        r.client.lease(lease_id).unwrap().state,
        LeaseState::Released
    );
    assert_eq!(
        b.cli_json(&["status"]).unwrap(),
        serde_json::json!([]),
        "detached attachments are not restored"
    );
}

/// Runs `program args`, killed after 60 s; its exit status and stderr.
fn run_to_exit(program: &Path, args: &[String]) -> (std::process::ExitStatus, String) {
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status, err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{} {args:?} still runs after 60 s", program.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The finding of issue 23: a second lender that claims the real lender's provider name
/// (with a key of its own) used to replace its address in the pool, so that new leases
/// sent borrowers to it. Its registration is refused now, it does not start, the real
/// lender's address stays, and the pool logs the refusal with the rogue's address.
#[test]
fn a_rogue_lender_under_the_real_ones_name_is_refused() {
    let r = rig();
    let rogue_disk = r.dir.path().join("rogue.img");
    sparse_file(&rogue_disk, 64 * MIB).unwrap();
    let rogue_addr = format!("127.0.0.1:{}", free_port().unwrap());
    let (status, err) = run_to_exit(
        &devlend_tests::agents::bin("devlend-device-agent").unwrap(),
        &[
            "--listen".into(),
            rogue_addr.clone(),
            "--device".into(),
            format!("disk0={}", rogue_disk.display()),
            "--pool".into(),
            r.pool.url.clone(),
            "--provider".into(),
            PROVIDER.into(),
            "--key-file".into(),
            r.dir.path().join("rogue.key").display().to_string(),
        ],
    );
    assert!(!status.success(), "the rogue lender started:\n{err}");
    assert!(
        err.contains("refuses this lender's registration") && err.contains("not enrolled"),
        "{err}"
    );
    let providers = r.client.providers().unwrap();
    assert_eq!(providers.len(), 1);
    assert_eq!(providers[0].fabric_address, r.lender.addr);
    let g = r.lease("disk0", 10_000);
    assert_eq!(g.lease.fabric_address, r.lender.addr);
    let log = r.pool.proc.log();
    assert!(
        log.contains("pool request refused") && log.contains("peer=127.0.0.1:"),
        "{log}"
    );
    // The pool API without a signature: refused.
    let anon = PoolClient::new(&r.pool.url).unwrap();
    let e = anon.providers().unwrap_err();
    assert_eq!(e.status(), Some(401), "{e}");
}

/// Enrollment as an operator does it: `devlend pool enroll` prints a join token, the
/// lender redeems it at its first start (`--pool-join-token`), and restarts with the
/// same flags (the token spent) keep working.
#[test]
fn a_lender_joins_with_a_token_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::start(dir.path()).unwrap();
    let devlend = devlend_tests::agents::bin("devlend").unwrap();
    let admin_key = pool.admin_key.display().to_string();
    let out = std::process::Command::new(&devlend)
        .args([
            "pool",
            "enroll",
            "--pool",
            &pool.url,
            "--pool-key",
            &admin_key,
        ])
        .args(["--role", "lender", "--name", "store7"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(token.starts_with("dlj_"), "{token}");
    let disk = dir.path().join("d.img");
    sparse_file(&disk, 16 * MIB).unwrap();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let args = [
        "--pool".to_owned(),
        pool.url.clone(),
        "--provider".into(),
        "store7".into(),
        "--key-file".into(),
        dir.path().join("store7.key").display().to_string(),
        "--pool-join-token".into(),
        token,
    ];
    let devices = [format!("disk0={}", disk.display())];
    for round in 0..2 {
        let mut lender = Lender::start_with(dir.path(), &addr, &devices, &args).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = std::process::Command::new(&devlend)
                .args([
                    "pool",
                    "providers",
                    "--pool",
                    &pool.url,
                    "--pool-key",
                    &admin_key,
                ])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            if text.contains("store7") && text.contains(&addr) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: not registered: {text}{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                lender.proc.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        lender.proc.kill_hard();
    }
    let out = std::process::Command::new(&devlend)
        .args([
            "pool",
            "principals",
            "--pool",
            &pool.url,
            "--pool-key",
            &admin_key,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("lender") && text.contains("store7"), "{text}");
}

/// Issue 23: a machine that takes the lender's address (its own key, a disk of zeros
/// under the same device name, no pool) never serves the borrower. The lease token names
/// the enrolled lender's key, the borrower asks every session to prove it, and the
/// rogue cannot: the guest's read waits, and completes with the data written before
/// once the real lender is back. Without the proof the rogue served the read (zeros).
#[test]
fn a_rogue_lender_at_the_lenders_address_never_serves_the_borrower() {
    let mut r = rig();
    let b = Borrower::start(r.dir.path()).unwrap();
    let sock = r.sock("a");
    let out = attach_by_class(&b, &r, &sock, &["--min-capacity", "32M"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = BlkClient::connect(&sock, 1, 4 * MIB as usize).unwrap();
    assert_eq!(write_read(&mut c, 77), vec![0, 0]);
    let want = c.buffer()[..65536].to_vec();

    r.lender.proc.kill_hard();
    let rogue_disk = r.dir.path().join("rogue.img");
    sparse_file(&rogue_disk, 64 * MIB).unwrap();
    let addr = r.lender.addr.clone();
    let mut rogue = Lender::start_with(
        r.dir.path(),
        &addr,
        &[format!("disk0={}", rogue_disk.display())],
        &[
            "--key-file".into(),
            r.dir.path().join("rogue.key").display().to_string(),
        ],
    )
    .unwrap();
    let mut ios = c.queue_ios();
    let q = &mut ios[0];
    q.submit(
        &BlkOp::Read {
            offset: 4096,
            buf: 131072,
            len: 65536,
        },
        7,
    )
    .unwrap();
    let mut done = Vec::new();
    let early = q.complete(1, Duration::from_secs(4), &mut done);
    assert!(
        early.is_err() && done.is_empty(),
        "the read completed while only the rogue answered: {done:?}"
    );
    let log = b.proc.log();
    assert!(log.contains("another lender answered"), "{log}");

    rogue.proc.kill_hard();
    r.restart_lender();
    q.complete(1, Duration::from_secs(30), &mut done).unwrap();
    assert_eq!(done, vec![(7, 0)]);
    assert!(
        q.buffer()[131072..131072 + 65536] == want[..],
        "the read did not return the data written before the rogue came"
    );
}

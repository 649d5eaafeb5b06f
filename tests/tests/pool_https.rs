//! The pool served over HTTPS (`devlend pool serve --tls-cert --tls-key`) with real
//! processes: a lender registers and heartbeats over it (`[pool] ca_file`), the CLI
//! lists and leases over it (`--pool-ca`), the compute agent checks, binds, renews and
//! releases its lease over it (`--pool-ca`). All on loopback, SQLite.

use std::path::Path;
use std::time::{Duration, Instant};

use devlend_pool::api::{DeviceQuery, DeviceState, LeaseFilter, LeaseState, Role};
use devlend_tests::agents::{bin, free_port, sparse_file, Borrower, Lender, Pool};
use devlend_tests::certs::Certs;

const MIB: u64 = 1 << 20;
const PROVIDER: &str = "lender-tls";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn lender_cli_and_compute_agent_use_an_https_pool_verified_by_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let certs = Certs::make(&d.join("certs")).unwrap();
    let ca = certs.path("ca.crt");
    let pool = Pool::start_https(d, &certs).unwrap();
    assert!(pool.url.starts_with("https://"), "{}", pool.url);
    let admin = pool.admin().unwrap();

    // The lender registers over HTTPS, trusting the CA given in its [pool] table.
    let lender_key = d.join("lender.key");
    pool.enroll(Role::Lender, PROVIDER, &lender_key).unwrap();
    pool.enroll(
        Role::Compute,
        &devlend_daemon::host_name(),
        &Borrower::pool_key(d),
    )
    .unwrap();
    sparse_file(&d.join("disk0.img"), 16 * MIB).unwrap();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let config = d.join("device-agent.toml");
    std::fs::write(
        &config,
        format!(
            r#"listen = "{addr}"
key_file = "{key}"
[pool]
url = "{url}"
provider = "{PROVIDER}"
heartbeat_interval_ms = 500
ca_file = "{ca}"

[[device]]
name = "disk0"
path = "{d}/disk0.img"
"#,
            url = pool.url,
            d = d.display(),
            key = lender_key.display(),
        ),
    )
    .unwrap();
    // With another CA than the pool's, the lender stops at start and says why.
    let mut wrong = std::process::Command::new(bin("devlend-device-agent").unwrap())
        .args(["--config", &config.display().to_string()])
        .args(["--pool-ca", &certs.path("other-ca.crt")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = wrong.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(10) {
            wrong.kill().unwrap();
            panic!("a lender that cannot verify the pool did not stop");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut wrong.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(stderr.contains("not signed by a trusted CA"), "{stderr}");

    let lender = Lender::start_with(
        d,
        &addr,
        &[],
        &["--config".into(), config.display().to_string()],
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let devices = admin.devices(&DeviceQuery::default()).unwrap_or_default();
        if devices.len() == 1 && devices[0].state == DeviceState::Available {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lender did not register over HTTPS\npool log:\n{}\nlender log:\n{}",
            pool.proc.log(),
            lender.proc.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // A compute agent given another pool key than the pool's (pool_public_key) refuses
    // the lease's token before using it, and says so; the CLI releases the lease.
    let compute_key = Borrower::pool_key(d).display().to_string();
    let sock = d.join("a.sock");
    let s = sock.display().to_string();
    let attach = |b: &Borrower| {
        b.cli(&[
            "attach",
            "--pool",
            &pool.url,
            "--pool-ca",
            &ca,
            "--pool-key",
            &compute_key,
            "--class",
            "BLOCK",
            "--vm",
            "vm-1",
            "--lease-ttl",
            "2",
            "--socket",
            &s,
            "--json",
        ])
        .unwrap()
    };
    let pool_key = admin.signing_key().unwrap().public_key;
    let wrong_key = devlend_fabric::lease_token::TokenSigner::from_seed([9; 32])
        .public_key()
        .to_text();
    let w = Borrower::start_named(
        d,
        "compute-agent-wrong-pool-key",
        &[
            "--pool-ca".into(),
            ca.clone(),
            "--pool-public-key".into(),
            wrong_key,
        ],
    )
    .unwrap();
    let out = attach(&w);
    assert!(
        !out.status.success(),
        "attached with a token the pool key does not verify"
    );
    assert!(
        text(&out.stderr).contains("does not verify with the pool's key"),
        "{}",
        text(&out.stderr)
    );
    drop(w);
    assert!(
        admin.leases(LeaseFilter::Active).unwrap().is_empty(),
        "the refused lease was released"
    );

    // The CLI: with --pool-ca it lists; without it, the system's trust store refuses
    // the test CA, and says so. This compute agent checks tokens with the pool's key.
    let b = Borrower::start_with(
        d,
        &[
            "--pool-ca".into(),
            ca.clone(),
            "--pool-public-key".into(),
            pool_key,
        ],
    )
    .unwrap();
    let admin_key = pool.admin_key.display().to_string();
    let out = b
        .cli(&[
            "pool",
            "providers",
            "--pool",
            &pool.url,
            "--pool-ca",
            &ca,
            "--pool-key",
            &admin_key,
            "--json",
        ])
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(PROVIDER),
        "{}",
        text(&out.stdout)
    );
    let out = b
        .cli(&[
            "pool",
            "providers",
            "--pool",
            &pool.url,
            "--pool-key",
            &admin_key,
        ])
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("not signed by a trusted CA"),
        "{}",
        text(&out.stderr)
    );

    // attach --class: the CLI leases over HTTPS, the compute agent checks and binds the
    // lease, renews it past its 2 s TTL, and releases it at detach, all over HTTPS.
    let out = attach(&b);
    assert!(
        out.status.success(),
        "{}\ncompute agent log:\n{}",
        text(&out.stderr),
        b.proc.log()
    );
    let a: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lease_id = a["lease"].as_str().expect("a lease").to_owned();
    std::thread::sleep(Duration::from_secs(4));
    let leases = admin.leases(LeaseFilter::Active).unwrap();
    assert_eq!(leases.len(), 1, "renewed past its TTL: {leases:?}");
    assert_eq!(leases[0].state, LeaseState::Bound);
    let detached = b.cli_json(&["detach", &s]).unwrap();
    assert_eq!(detached["lease"].as_str(), Some(lease_id.as_str()));
    let l = admin.lease(lease_id.parse().unwrap()).unwrap();
    assert_eq!(l.state, LeaseState::Released);
    assert!(!Path::new(&s).exists());
}

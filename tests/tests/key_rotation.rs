//! A lender's key rotated under verified I/O, following docs/security.md's steps
//! ("Rotating keys", issue 39): a pool, a lender enrolled with a join token, a compute
//! agent whose attachment's lease names the lender's first key (so its borrower makes
//! the lender prove that key in every handshake), and libblkio (`devlend verify`)
//! writing and reading back through the attachment for 20 s. Meanwhile the operator
//! enrolls a new key with a new join token and restarts the lender with it and
//! `--previous-key-file` (the old one). The verified run ends without an error and the
//! lender's file holds what it wrote: the reconnects after the restart asked for the
//! old key, and the lender proved it. A new attachment's lease names the new key, and it
//! works too.
//!
//! Without `--previous-key-file` the attachment's borrower refuses the restarted lender
//! (another key answered) until its reconnect deadline, and the run fails.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use devlend_pool::api::{DeviceQuery, DeviceState, Role};
use devlend_tests::agents::{bin, free_port, sparse_file, Borrower, Lender, Pool};

const MIB: u64 = 1 << 20;

/// `devlend pool enroll --role lender --name NAME`: the join token.
fn join_token(pool: &Pool, name: &str) -> String {
    let out = Command::new(bin("devlend").unwrap())
        .args(["pool", "enroll", "--pool", &pool.url, "--pool-key"])
        .arg(&pool.admin_key)
        .args(["--role", "lender", "--name", name])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

fn attach(b: &Borrower, pool: &Pool, dir: &Path, sock: &Path) -> serde_json::Value {
    let key = Borrower::pool_key(dir).display().to_string();
    b.cli_json(&[
        "attach",
        "--pool",
        &pool.url,
        "--pool-key",
        &key,
        "--class",
        "BLOCK",
        "--vm",
        "vm-1",
        "--queues",
        "1",
        "--socket",
        &sock.display().to_string(),
    ])
    .unwrap()
}

#[test]
fn a_lenders_key_rotates_under_verified_io_without_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pool = Pool::start(d).unwrap();
    let client = pool.admin().unwrap();
    pool.enroll(
        Role::Compute,
        &devlend_daemon::host_name(),
        &Borrower::pool_key(d),
    )
    .unwrap();
    for name in ["disk0", "disk1"] {
        sparse_file(&d.join(format!("{name}.img")), 16 * MIB).unwrap();
    }
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let devices = [
        format!("disk0={}", d.join("disk0.img").display()),
        format!("disk1={}", d.join("disk1.img").display()),
    ];
    let lender_args = |key: &str, token: String, previous: Option<&str>| {
        let mut a = vec![
            "--pool".to_owned(),
            pool.url.clone(),
            "--provider".into(),
            "rot".into(),
            "--key-file".into(),
            d.join(key).display().to_string(),
            "--pool-join-token".into(),
            token,
        ];
        if let Some(p) = previous {
            a.push("--previous-key-file".into());
            a.push(d.join(p).display().to_string());
        }
        a
    };
    let mut lender = Lender::start_with(
        d,
        &addr,
        &devices,
        &lender_args("old.key", join_token(&pool, "rot"), None),
    )
    .unwrap();
    let available = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while client
            .devices(&DeviceQuery::default())
            .unwrap_or_default()
            .iter()
            .filter(|x| x.state == DeviceState::Available)
            .count()
            < n
        {
            assert!(Instant::now() < deadline, "devices not available");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    available(2);
    let b = Borrower::start(d).unwrap();
    let sock = d.join("vm.sock");
    let first = attach(&b, &pool, d, &sock)["device"]
        .as_str()
        .unwrap()
        .to_owned();

    let expected = d.join("expected");
    let verify = Command::new(bin("devlend").unwrap())
        .args(["verify", "--queues", "1", "--span", "4M", "--rounds", "2"])
        .args(["--min-seconds", "20", "--seed", "5", "--socket"])
        .arg(&sock)
        .arg("--out")
        .arg(&expected)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));

    // The rotation, as docs/security.md says: a new join token, the lender restarted
    // with the new key file and the token, and its previous key.
    let token = join_token(&pool, "rot");
    lender.proc.terminate(Duration::from_secs(10)).unwrap();
    let lender = Lender::start_with(
        d,
        &addr,
        &devices,
        &lender_args("new.key", token, Some("old.key")),
    )
    .unwrap();

    let out = verify.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the verified run failed across the rotation:\n{}{}\nlender log:\n{}\ncompute agent log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        lender.proc.log(),
        b.proc.log()
    );
    let want = std::fs::read(&expected).unwrap();
    let got = std::fs::read(d.join(format!("{first}.img"))).unwrap();
    assert!(
        got[..want.len()] == want[..],
        "the lender's file lost writes"
    );
    assert!(lender.proc.log().contains("key rotation"));

    // A lease granted now names the new key: its borrower makes the lender prove it.
    available(1);
    let sock1 = d.join("vm1.sock");
    let a = attach(&b, &pool, d, &sock1);
    assert_ne!(a["device"], first.as_str(), "{a}");
    let mut c = devlend_cli::blk_client::BlkClient::connect(&sock1, 1, MIB as usize).unwrap();
    c.buffer()[..4096].fill(0x77);
    let r = c
        .run(
            0,
            &[devlend_cli::blk_client::BlkOp::Write {
                offset: 0,
                buf: 0,
                len: 4096,
            }],
        )
        .unwrap();
    assert_eq!(r, vec![0]);
}

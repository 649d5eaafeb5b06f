//! A lender's key rotated under verified I/O, following docs/security.md's steps
//! ("Rotating keys", issue 39): a pool, a lender enrolled with a join token, a compute
//! agent whose attachment's lease names the lender's first key (so its borrower makes
//! the lender prove that key in every handshake), and a QEMU guest (TCG) whose own
//! virtio-blk driver writes 256 KiB chunks with O_DIRECT and reads each back for 25 s.
//! Meanwhile the operator enrolls a new key with a new join token and restarts the
//! lender with it and `--previous-key-file` (the old one). The guest sees no error and
//! the lender's file holds what it wrote: the reconnects after the restart asked for
//! the old key, and the lender proved it. A new attachment's lease names the new key,
//! and it works too.
//!
//! Without `--previous-key-file` the attachment's borrower refuses the restarted lender
//! (another key answered) until its reconnect deadline, and the guest's I/O fails.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use devlend_pool::api::{DeviceQuery, DeviceState, Role};
use devlend_tests::agents::{bin, free_port, sparse_file, Borrower, Lender, Pool};
use devlend_tests::guest::Guest;
use devlend_tests::{console_result, sha256_hex};

const MIB: u64 = 1 << 20;
/// 256 KiB chunks the guest writes and reads back, over and over for `SECONDS`.
const CHUNKS: usize = 32;
const SECONDS: u64 = 25;

/// The guest's verified I/O: each chunk random, written with O_DIRECT, read back with
/// O_DIRECT and compared; then the region's sha256 for the lender's file.
const SCRIPT: &str = r#"
devlend-wait-for /dev/vda 30
echo "DEVLEND-RESULT workload=started"
t0=$(date +%s); j=0; bad=0
while [ $j -lt CHUNKS ] || [ $(( $(date +%s) - t0 )) -lt SECONDS ]; do
  i=$(( j % CHUNKS ))
  dd if=/dev/urandom of=/tmp/c bs=256k count=1 2>/dev/null
  if ! dd if=/tmp/c of=/dev/vda bs=256k seek=$i oflag=direct 2>/tmp/err; then
    echo "write $i failed: $(cat /tmp/err)"; bad=$((bad+1))
  fi
  a=$(sha256sum /tmp/c | cut -d' ' -f1)
  b=$(dd if=/dev/vda bs=256k skip=$i count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
  [ "$a" = "$b" ] || { echo "chunk $i differs"; bad=$((bad+1)); }
  j=$((j+1))
done
sync
echo "DEVLEND-RESULT bad=$bad"
echo "DEVLEND-RESULT chunks=$j"
echo "DEVLEND-RESULT region_sha256=$(dd if=/dev/vda bs=256k count=CHUNKS iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"
echo "DEVLEND-RESULT phase1=done"
"#;

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
    b.attach_class(&pool.url, dir, sock, 1).unwrap()
}

#[test]
fn a_lenders_key_rotates_under_a_guests_verified_io_without_an_error() {
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

    let guest = Guest::builder()
        .name("key_rotation")
        .script(
            SCRIPT
                .replace("CHUNKS", &CHUNKS.to_string())
                .replace("SECONDS", &SECONDS.to_string()),
        )
        .vhost_user_blk_with(&sock, Some(500))
        .boot()
        .unwrap();
    guest
        .wait_for_text("workload=started", Duration::from_secs(240))
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

    guest
        .wait_for_text("phase1=done", Duration::from_secs(300))
        .unwrap();
    let console = guest.console();
    let field = |key: &str| console_result(&console, key);
    assert_eq!(
        field("bad").as_deref(),
        Some("0"),
        "the guest's I/O failed across the rotation:\n{console}\nlender log:\n{}\ncompute agent log:\n{}",
        lender.proc.log(),
        b.proc.log()
    );
    eprintln!(
        "the guest wrote and verified {} chunks",
        field("chunks").unwrap_or_default()
    );
    let file = std::fs::read(d.join(format!("{first}.img"))).unwrap();
    assert_eq!(
        sha256_hex(&file[..CHUNKS * 256 * 1024]),
        field("region_sha256").expect("no region_sha256"),
        "the lender's file does not hold what the guest wrote"
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

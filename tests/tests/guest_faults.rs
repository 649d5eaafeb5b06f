//! Faults under a real QEMU guest (TCG), one guest for the file: its own virtio-blk
//! driver writes and verifies data while the lender is killed with SIGKILL and
//! restarted 5 times; then the guest is reset (a reboot with the disk attached) and
//! finds its data again.

use std::time::Duration;

use anyhow::{bail, Result};
use devlend_compute_agent::vmm::qmp::Qmp;
use devlend_tests::agents::{free_port, sparse_file, Borrower, Lender};
use devlend_tests::guest::Guest;
use devlend_tests::{console_result, sha256_hex};
use rand::{Rng, SeedableRng};

const MIB: usize = 1 << 20;
const DISK_BYTES: u64 = 64 << 20;
/// Chunks of 256 KiB the guest writes, each then read back and compared.
const CHUNKS: usize = 96;
/// The guest's workload goes on at least this long after it starts: longer than the
/// host's five kills take at most (5 × (2.5 s + 1 s)), whatever the machine's speed.
const MIN_SECONDS: u64 = 25;

/// Phase 1 (no marker at MiB 63): write CHUNKS random chunks with fsync, read each back
/// past the page cache and compare, print the sha256 of the whole region, leave a
/// marker, wait to be reset. Phase 2 (marker found): read the region again and print
/// its sha256.
const SCRIPT: &str = r#"
devlend-wait-for /dev/vda 30
marker=$(dd if=/dev/vda bs=1M skip=63 count=1 2>/dev/null | head -c 12)
if [ "$marker" = "DEVLEND-PH1" ]; then
  echo 3 > /proc/sys/vm/drop_caches
  echo "DEVLEND-RESULT after_reset_sha256=$(dd if=/dev/vda bs=256k count=CHUNKS 2>/dev/null | sha256sum | cut -d' ' -f1)"
  exit 0
fi
echo "DEVLEND-RESULT workload=started"
bad=0
n=0
t0=$(date +%s)
# Sized by time as well as by bytes: at least CHUNKS chunks, and on for MIN_SECONDS
# (chunks wrap around the region), so the host's kills land in the workload however
# fast the machine is.
while [ $n -lt CHUNKS ] || [ $(( $(date +%s) - t0 )) -lt MIN_SECONDS ]; do
  i=$((n % CHUNKS))
  dd if=/dev/urandom of=/tmp/c bs=256k count=1 2>/dev/null
  if ! dd if=/tmp/c of=/dev/vda bs=256k seek=$i conv=fsync 2>/tmp/err; then
    echo "write $i failed: $(cat /tmp/err)"; bad=$((bad+1))
  fi
  echo 3 > /proc/sys/vm/drop_caches
  a=$(sha256sum /tmp/c | cut -d' ' -f1)
  b=$(dd if=/dev/vda bs=256k skip=$i count=1 2>/dev/null | sha256sum | cut -d' ' -f1)
  [ "$a" = "$b" ] || { echo "chunk $i differs"; bad=$((bad+1)); }
  n=$((n+1))
done
echo "DEVLEND-RESULT bad=$bad"
echo 3 > /proc/sys/vm/drop_caches
echo "DEVLEND-RESULT region_sha256=$(dd if=/dev/vda bs=256k count=CHUNKS 2>/dev/null | sha256sum | cut -d' ' -f1)"
printf 'DEVLEND-PH1\n' | dd of=/dev/vda bs=1M seek=63 conv=fsync 2>/dev/null
echo "DEVLEND-RESULT phase1=done"
sleep 600
"#;

#[test]
fn a_guest_rides_out_lender_kills_and_finds_its_data_after_a_reset() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK_BYTES)?;
    let spec = format!("disk0={}", img.display());
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut lender = Lender::start_on(dir.path(), &addr, std::slice::from_ref(&spec))?;
    let borrower = Borrower::start(dir.path())?;
    let sock = dir.path().join("disk0.sock");
    borrower.attach(&addr, "disk0", &sock, 1)?;

    let script = SCRIPT
        .replace("CHUNKS", &CHUNKS.to_string())
        .replace("MIN_SECONDS", &MIN_SECONDS.to_string());
    let mut guest = Guest::builder()
        .name("guest_faults")
        .script(script)
        .vhost_user_blk(&sock)
        .allow_reset(true)
        .boot()?;
    guest.wait_for_text("workload=started", Duration::from_secs(240))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(devlend_tests::test_seed());
    for k in 0..5 {
        std::thread::sleep(Duration::from_millis(rng.random_range(500..2500)));
        if guest.console().contains("phase1=done") {
            bail!("the workload ended before kill {k}: make it longer");
        }
        lender.proc.kill_hard();
        std::thread::sleep(Duration::from_millis(rng.random_range(0..1000)));
        lender = Lender::start_on(dir.path(), &addr, std::slice::from_ref(&spec))?;
    }
    guest.wait_for_text("phase1=done", Duration::from_secs(300))?;
    let console = guest.console();
    let field = |key: &str| console_result(&console, key);
    assert_eq!(field("bad").as_deref(), Some("0"), "{console}");
    let region = field("region_sha256").expect("no region_sha256");
    let file = std::fs::read(&img)?;
    assert_eq!(
        sha256_hex(&file[..CHUNKS * 256 * 1024]),
        region,
        "the lender's file does not hold what the guest wrote"
    );
    let status = borrower.cli_json(&["status"])?;
    let c = &status[0]["counters"];
    assert_eq!(c["errors"], 0, "{status}");
    // One reconnect per kill only if the guest had I/O between each pair of kills; a
    // guest busy hashing in TCG across two kills reconnects once for both. At least one
    // reconnect, with requests resent or not, shows the path was taken.
    assert!(c["reconnects"].as_u64().unwrap_or(0) >= 1, "{status}");

    // Reboot with the disk attached: the guest's driver starts over on the same
    // vhost-user device and reads its data back.
    let mut qmp = Qmp::connect(guest.qmp_socket())?;
    qmp.execute("system_reset", serde_json::json!({}))?;
    let out = guest.wait_done(Duration::from_secs(300))?;
    out.check_success()?;
    assert_eq!(out.result("after_reset_sha256"), Some(region.as_str()));
    let file = std::fs::read(&img)?;
    assert!(file[63 * MIB..].starts_with(b"DEVLEND-PH1"));
    assert_eq!(borrower.cli_json(&["status"])?[0]["counters"]["errors"], 0);
    Ok(())
}

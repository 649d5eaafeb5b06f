//! A real QEMU guest (TCG) in cluster a with a disk lent in cluster b, through both
//! gateways and a 20 ms RTT link (`devlend_tests::gateways`): its own virtio-blk driver
//! writes and verifies data while gateway b is killed with SIGKILL and restarted twice;
//! no error reaches the guest and the lender's file holds every write.

use std::time::Duration;

use anyhow::{bail, Result};
use devlend_tests::gateways::{counters, Topo, DELAY};
use devlend_tests::guest::Guest;
use devlend_tests::{console_result, sha256_hex};

/// Chunks of 256 KiB the guest writes, each then read back and compared.
const CHUNKS: usize = 64;

const SCRIPT: &str = r#"
devlend-wait-for /dev/vda 30
echo "DEVLEND-RESULT workload=started"
bad=0
i=0
while [ $i -lt CHUNKS ]; do
  dd if=/dev/urandom of=/tmp/c bs=256k count=1 2>/dev/null
  if ! dd if=/tmp/c of=/dev/vda bs=256k seek=$i conv=fsync 2>/tmp/err; then
    echo "write $i failed: $(cat /tmp/err)"; bad=$((bad+1))
  fi
  echo 3 > /proc/sys/vm/drop_caches
  a=$(sha256sum /tmp/c | cut -d' ' -f1)
  b=$(dd if=/dev/vda bs=256k skip=$i count=1 2>/dev/null | sha256sum | cut -d' ' -f1)
  [ "$a" = "$b" ] || { echo "chunk $i differs"; bad=$((bad+1)); }
  i=$((i+1))
done
echo "DEVLEND-RESULT bad=$bad"
echo "DEVLEND-RESULT io_errors=$(dmesg | grep -c 'I/O error')"
echo 3 > /proc/sys/vm/drop_caches
echo "DEVLEND-RESULT region_sha256=$(dd if=/dev/vda bs=256k count=CHUNKS 2>/dev/null | sha256sum | cut -d' ' -f1)"
"#;

#[test]
fn a_guest_across_the_gateways_rides_out_gateway_b_restarts() -> Result<()> {
    let mut t = Topo::new(16);
    t.relay_ab.set_delay(DELAY);
    t.wait_peer_up(Duration::from_secs(5));
    let sock = t.socket("g.sock");
    let out = t.attach("b/store1/disk0", &sock, 1);
    if !out.status.success() {
        bail!("attach: {}", String::from_utf8_lossy(&out.stderr));
    }
    let script = SCRIPT.replace("CHUNKS", &CHUNKS.to_string());
    let mut guest = Guest::builder()
        .name("guest_gateway")
        .script(script)
        .vhost_user_blk(&sock)
        .boot()?;
    guest.wait_for_text("workload=started", Duration::from_secs(240))?;
    for k in 0..2 {
        std::thread::sleep(Duration::from_secs(3));
        if guest.console().contains("region_sha256=") {
            bail!("the workload ended before restart {k}: make it longer");
        }
        t.restart_gw_b(Duration::from_millis(500), &format!("gateway-b{}", k + 2));
    }
    let outcome = guest.wait_done(Duration::from_secs(300))?;
    outcome.check_success()?;
    let console = guest.console();
    let field = |key: &str| console_result(&console, key);
    assert_eq!(
        field("bad").as_deref(),
        Some("0"),
        "{console}\n{}",
        t.logs()
    );
    assert_eq!(field("io_errors").as_deref(), Some("0"), "{console}");
    let region = field("region_sha256").expect("no region_sha256");
    let file = std::fs::read(&t.img)?;
    assert_eq!(
        sha256_hex(&file[..CHUNKS * 256 * 1024]),
        region,
        "the lender's file does not hold what the guest wrote"
    );
    let c = counters(&t.borrower);
    assert_eq!(c["errors"], 0, "{c}");
    assert!(c["reconnects"].as_u64().unwrap_or(0) >= 1, "{c}");
    let p = t.peer_b();
    assert!(p["connects"].as_u64().unwrap() >= 3, "{p}");
    eprintln!(
        "guest wrote and verified {CHUNKS} chunks across 2 gateway restarts: {} reconnects, {} resent",
        c["reconnects"], c["resent"]
    );
    Ok(())
}

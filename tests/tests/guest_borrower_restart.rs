//! The borrower restarts under a real QEMU guest (TCG), one guest for the file: the
//! guest's own virtio-blk driver writes and verifies data on a disk whose QEMU chardev
//! has `reconnect-ms`, while the compute agent is killed with SIGKILL three times, each
//! time with requests in flight, and once stopped with SIGTERM while its lender is gone
//! (the requests waiting for it are left to the next agent), and started again. The
//! restarted agent serves the attachment again from its state file, QEMU joins it, and
//! the requests that were in flight are resubmitted from the vhost-user inflight buffer:
//! no write fails, every chunk reads back, and the lender's file holds the guest's data.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use devlend_tests::agents::{free_port, sparse_file, Borrower, Lender};
use devlend_tests::guest::Guest;
use devlend_tests::{console_result, sha256_hex};
use rand::{Rng, SeedableRng};

const DISK_BYTES: u64 = 64 << 20;
/// Chunks of 256 KiB the guest writes, each then read back and compared.
const CHUNKS: usize = 160;

/// The guest's workload goes on at least this long after it starts, whatever the
/// machine's speed: longer than the host's four restarts take (each a sleep of at most
/// 1.5 s, a kill, a restart and the resubmission, a few seconds in all).
const MIN_SECONDS: u64 = 45;

/// Four writers at once, each over its own quarter of the region, so that several
/// requests are in flight and complete out of order (a lost or doubled one then shows):
/// each writes random 256 KiB chunks with O_DIRECT and reads each back, also with
/// O_DIRECT, and compares. Sized by time as well as by bytes: each writer goes over its
/// quarter at least once and on for MIN_SECONDS (wrapping around its quarter), so that
/// the host's restarts land in the workload on a fast machine as on a slow one.
const SCRIPT: &str = r#"
devlend-wait-for /dev/vda 30
echo "DEVLEND-RESULT workload=started"
t0=$(date +%s)
worker() {
  j=0; bad=0
  while [ $j -lt PER ] || [ $(( $(date +%s) - t0 )) -lt MIN_SECONDS ]; do
    i=$(( $1 + j % PER ))
    dd if=/dev/urandom of=/tmp/c$1 bs=256k count=1 2>/dev/null
    if ! dd if=/tmp/c$1 of=/dev/vda bs=256k seek=$i oflag=direct 2>/tmp/err$1; then
      echo "write $i failed: $(cat /tmp/err$1)"; bad=$((bad+1))
    fi
    a=$(sha256sum /tmp/c$1 | cut -d' ' -f1)
    b=$(dd if=/dev/vda bs=256k skip=$i count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    [ "$a" = "$b" ] || { echo "chunk $i differs"; bad=$((bad+1)); }
    j=$((j+1))
  done
  echo $bad > /tmp/bad$1
}
worker 0 & worker PER & worker $((PER*2)) & worker $((PER*3)) &
wait
bad=$(( $(cat /tmp/bad0) + $(cat /tmp/badPER) + $(cat /tmp/bad$((PER*2))) + $(cat /tmp/bad$((PER*3))) ))
sync
echo "DEVLEND-RESULT bad=$bad"
echo "DEVLEND-RESULT region_sha256=$(dd if=/dev/vda bs=256k count=CHUNKS iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"
echo "DEVLEND-RESULT phase1=done"
"#;

/// Waits until the attachment has requests in flight (so that a kill lands on them), or
/// gives up after `limit` (the kill then lands wherever the guest is).
fn wait_for_inflight(b: &Borrower, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Ok(s) = b.cli_json(&["status"]) {
            if s[0]["counters"]["inflight"].as_u64().unwrap_or(0) > 0 {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// A counter of the attachment as the current agent reports it.
fn counter(b: &Borrower, key: &str) -> Result<u64> {
    let s = b.cli_json(&["status"])?;
    Ok(s[0]["counters"][key].as_u64().unwrap_or(0))
}

#[test]
fn a_guest_rides_out_borrower_kills_and_a_stop() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK_BYTES)?;
    let spec = format!("disk0={}", img.display());
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut lender = Lender::start_on(dir.path(), &addr, std::slice::from_ref(&spec))?;
    let mut borrower = Borrower::start(dir.path())?;
    let sock = dir.path().join("disk0.sock");
    let attached = borrower.attach(&addr, "disk0", &sock, 1)?;
    let id = attached["id"].as_str().unwrap_or_default().to_owned();
    assert!(dir.path().join("api.state.json").exists(), "no state file");

    let script = SCRIPT
        .replace("MIN_SECONDS", &MIN_SECONDS.to_string())
        .replace("CHUNKS", &CHUNKS.to_string())
        .replace("PER", &(CHUNKS / 4).to_string());
    let guest = Guest::builder()
        .name("guest_borrower_restart")
        .script(script)
        .vhost_user_blk_with(&sock, Some(500))
        .boot()?;
    guest.wait_for_text("workload=started", Duration::from_secs(240))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(devlend_tests::test_seed());
    for k in 0..4 {
        std::thread::sleep(Duration::from_millis(rng.random_range(300..1500)));
        if guest.console().contains("phase1=done") {
            bail!("the workload ended before restart {k}: raise MIN_SECONDS");
        }
        if k < 3 {
            // Hold the lender still so that requests are surely in flight when the
            // borrower dies; it finishes them after, answering a dead session.
            lender.proc.signal(libc::SIGSTOP);
            let caught = wait_for_inflight(&borrower, Duration::from_secs(10));
            borrower.proc.kill_hard();
            lender.proc.signal(libc::SIGCONT);
            assert!(caught, "the guest had no request in flight for 10 s");
        } else {
            // SIGTERM while the lender is gone: the requests waiting for it are not
            // failed (nor waited for until the reconnect deadline) but left in the
            // inflight buffer for the next agent; the attachment stays saved.
            lender.proc.kill_hard();
            let caught = wait_for_inflight(&borrower, Duration::from_secs(10));
            let t = Instant::now();
            let status = borrower.proc.terminate(Duration::from_secs(40))?;
            assert!(
                status.success(),
                "SIGTERM exit: {status}\n{}",
                borrower.proc.log()
            );
            assert!(caught, "the guest had no request in flight for 10 s");
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "SIGTERM waited {:?} for a lender that is gone",
                t.elapsed()
            );
            lender = Lender::start_on(dir.path(), &addr, std::slice::from_ref(&spec))?;
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..800)));
        borrower = Borrower::start_named(
            dir.path(),
            &format!("compute-agent-{}", k + 1),
            &["--log-level".into(), "info,devlend_backend=debug".into()],
        )?;
        // The attachment is back under its id and socket, and QEMU joins it again.
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let s = borrower.cli_json(&["status"])?;
            if s[0]["id"] == id.as_str() && s[0]["connected"] == true {
                break;
            }
            if Instant::now() > end {
                bail!(
                    "the attachment was not served again after restart {k}: {s}\n{}",
                    borrower.proc.log()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        {
            // What the previous agent had in flight comes back from the inflight buffer.
            let end = Instant::now() + Duration::from_secs(20);
            while counter(&borrower, "resubmitted")? == 0 {
                if Instant::now() > end {
                    bail!(
                        "nothing resubmitted after kill {k}:\n{}",
                        borrower.proc.log()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    guest.wait_for_text("phase1=done", Duration::from_secs(400))?;
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
    assert_eq!(counter(&borrower, "errors")?, 0);
    // Detach removes it from the state file: a restart then serves nothing.
    borrower.cli(&["detach", &id])?;
    drop(guest);
    borrower.proc.kill_hard();
    let borrower = Borrower::start_named(dir.path(), "compute-agent-last", &[])?;
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(borrower.cli_json(&["status"])?, serde_json::json!([]));
    Ok(())
}

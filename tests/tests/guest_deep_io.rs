//! A QEMU guest (TCG) whose own virtio-blk driver keeps a lent disk's single queue full
//! of large requests: four writers and four readers at once, each moving 16 MiB per
//! `dd` with O_DIRECT (the kernel splits each into requests of up to the device's
//! largest transfer, all in flight together), for 20 s. No request may fail or stall,
//! no fabric session may be lost, and every writer's last pattern must read back and be
//! in the lender's file.
//!
//! Before the credit flow control this stalled: more than the lender's 64 MiB budget in
//! flight on one queue, the lender stopped reading while the borrower's worker sat in a
//! socket write, and after ~15 s the session was lost and the same requests stalled
//! again on the next one.

use std::time::Duration;

use anyhow::Result;
use devlend_tests::agents::LentDisk;
use devlend_tests::guest::Guest;
use devlend_tests::sha256_hex;

const MIB: usize = 1 << 20;
const DISK_BYTES: u64 = 128 << 20;
/// How long the guest keeps the queue full.
const SECONDS: u32 = 20;

const SCRIPT: &str = r#"
devlend-wait-for /dev/vda 30
for w in 0 1 2 3; do dd if=/dev/urandom of=/tmp/pat$w bs=1M count=16 2>/dev/null; done
echo "DEVLEND-RESULT workload=started"
t0=$(date +%s)
writer() {
  n=0; bad=0
  while [ $(( $(date +%s) - t0 )) -lt SECONDS ]; do
    dd if=/tmp/pat$1 of=/dev/vda bs=16M count=1 seek=$1 oflag=direct 2>/tmp/werr$1 || { bad=$((bad+1)); cat /tmp/werr$1; }
    n=$((n+1))
  done
  echo "$n $bad" > /tmp/w$1
}
reader() {
  n=0; bad=0
  while [ $(( $(date +%s) - t0 )) -lt SECONDS ]; do
    dd if=/dev/vda of=/dev/null bs=16M count=1 skip=$(( 4 + $1 )) iflag=direct 2>/tmp/rerr$1 || { bad=$((bad+1)); cat /tmp/rerr$1; }
    n=$((n+1))
  done
  echo "$n $bad" > /tmp/r$1
}
for w in 0 1 2 3; do writer $w & reader $w & done
wait
bad=0; ios=0
for f in /tmp/w0 /tmp/w1 /tmp/w2 /tmp/w3 /tmp/r0 /tmp/r1 /tmp/r2 /tmp/r3; do
  set -- $(cat $f); ios=$((ios + $1)); bad=$((bad + $2))
done
echo "DEVLEND-RESULT dds=$ios"
echo "DEVLEND-RESULT bad=$bad"
for w in 0 1 2 3; do
  a=$(sha256sum /tmp/pat$w | cut -d' ' -f1)
  b=$(dd if=/dev/vda bs=16M count=1 skip=$w iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
  [ "$a" = "$b" ] && echo "DEVLEND-RESULT verify$w=ok" || echo "DEVLEND-RESULT verify$w=differs"
  echo "DEVLEND-RESULT pattern$w=$a"
done
"#;

#[test]
fn a_guest_keeping_one_queue_full_of_large_requests_never_stalls() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let disk = LentDisk::start(dir.path(), DISK_BYTES, 1)?;
    let (img, sock, borrower) = (&disk.image, &disk.socket, &disk.borrower);
    let script = SCRIPT.replace("SECONDS", &SECONDS.to_string());
    let mut guest = Guest::builder()
        .name("guest_deep_io")
        .memory_mib(1024)
        .script(script)
        .vhost_user_blk(sock)
        .boot()?;
    // 20 s of I/O, then the checks; a stalled queue shows as no end.
    let out = guest.wait_done(Duration::from_secs(400))?;
    let console = guest.console();
    out.check_success()?;
    assert_eq!(out.result("bad"), Some("0"), "{console}");
    let dds: u32 = out.result("dds").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(
        dds >= 8,
        "the workload hardly ran: {dds} dd runs\n{console}"
    );
    let file = std::fs::read(img)?;
    for w in 0..4 {
        assert_eq!(
            out.result(&format!("verify{w}")),
            Some("ok"),
            "writer {w}'s last pattern reads back\n{console}"
        );
        assert_eq!(
            Some(sha256_hex(&file[w * 16 * MIB..(w + 1) * 16 * MIB]).as_str()),
            out.result(&format!("pattern{w}")),
            "the lender's file holds writer {w}'s pattern"
        );
    }
    let status = borrower.cli_json(&["status"])?;
    let c = &status[0]["counters"];
    assert_eq!(c["errors"], 0, "{status}");
    assert_eq!(
        c["reconnects"],
        0,
        "a fabric session was lost: {status}\n{}",
        borrower.proc.log()
    );
    eprintln!(
        "{dds} dd runs of 16 MiB in {SECONDS} s; borrower counters {}",
        c
    );
    Ok(())
}
